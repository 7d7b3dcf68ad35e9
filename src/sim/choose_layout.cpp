#include "sim/choose_layout.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/log.h"
#include "core/machine.h"
#include "memory/tracker.h"
#include "sim/workload.h"
#include "train/run_options.h"

namespace caravan::sim {
namespace {

LayoutSpace spaceFor(int workers, const Config& config) {
  LayoutSpace space;
  space.workers = workers;
  space.sync = parseLayoutSync(config.str("parallel.layout_sync"));
  return space;
}

nlohmann::json choiceJson(const LayoutChoice& c) {
  return {{"name", c.name},
          {"keys", c.keys},
          {"predicted_step_s", c.predicted.stepSeconds},
          {"predicted_samples_per_s", c.predicted.samplesPerSecond},
          {"memory_bytes", c.memoryBytes},
          {"fits", c.fits},
          {"reasons", c.reasons}};
}

}  // namespace

ClusterSpec layoutCluster(const std::string& path) {
  if (!path.empty()) return ClusterSpec::fromFile(path);
  ClusterSpec c;
  c.hosts = 1;
  c.coresPerHost = static_cast<double>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  if (const auto m = availableMemory()) c.memoryBytesPerHost = static_cast<double>(m->bytes);
  return c;
}

LayoutDecision chooseLayout(const Config& config, const ClusterSpec& cluster, int workers,
                            bool checkCapacity, const Workload* given) {
  const RunOptions own = RunOptions::read(config);
  const int servers = own.sync.servers;  // 0 where the mode has none
  const int threads = static_cast<int>(std::max<int64_t>(1, own.runtime.threads));
  LayoutDecision d;
  d.cluster = cluster;
  d.workers = workers;
  d.workload = given != nullptr ? *given : measureWorkload(config);
  // Precision, where train.precision = bf16 lets the run choose it per block: when some block
  // chose bf16 here, float32 is profiled and searched beside it (bf16 halves what a block saves
  // and gathers, and is slower where a CPU only emulates it). No block in bf16 (no bf16
  // instructions, or none timed faster): the two are one profile, searched once.
  std::vector<PrecisionProfile> profiles = {{d.workload, ""}};
  if (given == nullptr && own.runtime.precision == "bf16" && d.workload.bf16Blocks > 0) {
    profiles.front().precision = "bf16";
    profiles.push_back(
        {measureWorkload(config.withOverrides({"train.precision=float32"})), "float32"});
  }
  const auto start = std::chrono::steady_clock::now();
  const int capacity = clusterCapacity(cluster, threads);
  if (checkCapacity && workers + servers > capacity) {
    const int most = capacity - servers;
    std::string nearest = "none: it cannot hold the servers alone";
    if (most >= 1) {
      const LayoutSearch fewer = searchLayouts(profiles, own, cluster, spaceFor(most, config));
      nearest = fewer.best() != nullptr
                    ? fmt::format("{} workers as {}", most, fewer.best()->name)
                    : fmt::format("{} workers, but no layout of them fits memory", most);
    }
    throw ConfigError(fmt::format(
        "the cluster holds {} processes ({} hosts x {} at train.threads = {}) and the job has "
        "{} workers{}; the nearest layout that works: {} (or a cluster of {} hosts)",
        capacity, cluster.hosts, capacity / cluster.hosts, threads, workers,
        servers > 0 ? fmt::format(" + {} servers", servers) : "", nearest,
        (workers + servers + capacity / cluster.hosts - 1) / (capacity / cluster.hosts)));
  }
  d.search = searchLayouts(profiles, own, cluster, spaceFor(workers, config));
  d.searchSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (d.search.ranked.empty()) {
    std::string why = d.search.refused.empty() ? "" : ": " + d.search.refused.front();
    throw ConfigError(fmt::format("no layout of {} workers can run this config{}", workers, why));
  }
  if (d.search.best() == nullptr) {
    const LayoutChoice& least = d.search.ranked.front();  // the non-fitting sort: least memory
    throw ConfigError(fmt::format(
        "no layout of {} workers fits {} per worker ({}); the nearest that would: {} with {} per "
        "worker (set memory.budget = \"{}\"{})",
        workers, formatBytes(d.search.memoryLimit), d.search.limitSource, least.name,
        formatBytesAtLeast(least.leastMemoryBytes), formatBytesAtLeast(least.leastMemoryBytes),
        d.search.limitSource == "memory.budget" ? ""
                                                : " on hosts with that much memory per process"));
  }
  return d;
}

std::string formatLayouts(const LayoutDecision& d, size_t count) {
  std::string out =
      fmt::format("{} ({} blocks), batch {} per worker, {} workers on {} host{}{}:\n",
                  d.workload.model, d.workload.forwardSeconds.size(), d.workload.batchPerWorker,
                  d.workers, d.cluster.hosts, d.cluster.hosts == 1 ? "" : "s",
                  d.search.memoryLimit > 0
                      ? fmt::format(", at most {} per worker", formatBytes(d.search.memoryLimit))
                      : "");
  size_t shown = 0;
  for (const LayoutChoice& c : d.search.ranked) {
    if (!c.fits || shown == count) break;
    out += fmt::format("  {}. {}\n", ++shown, c.text());
  }
  const size_t fitting =
      static_cast<size_t>(std::count_if(d.search.ranked.begin(), d.search.ranked.end(),
                                        [](const LayoutChoice& c) { return c.fits; }));
  out += fmt::format("{} layouts searched, {} fit, {} not a way to run this job\n",
                     d.search.ranked.size(), fitting, d.search.refused.size());
  std::string keys;
  for (const std::string& k : d.chosen().keys) keys += " --set '" + k + "'";
  out += fmt::format("chosen: {} (as keys:{})\n", d.chosen().name, keys);
  return out;
}

std::string layoutJson(const LayoutDecision& d) {
  nlohmann::json top = nlohmann::json::array(), all = nlohmann::json::array();
  for (const LayoutChoice& c : d.search.ranked) {
    if (c.fits && top.size() < 5) top.push_back(choiceJson(c));
    all.push_back(choiceJson(c));
  }
  nlohmann::json j = {{"format", "caravan-layout-1"},
                      {"workers", d.workers},
                      {"hosts", d.cluster.hosts},
                      {"memory_limit_bytes", d.search.memoryLimit},
                      {"searched", d.search.ranked.size()},
                      {"chosen", choiceJson(d.chosen())},
                      {"top", top},
                      {"layouts", all},
                      {"refused", d.search.refused},
                      {"cluster", d.cluster.toToml()}};
  return j.dump(1) + "\n";
}

std::vector<std::string> layoutKeysFromJson(const std::string& text, const std::string& source) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.value("format", "") != "caravan-layout-1") {
      throw ConfigError(fmt::format("{} is not a layout caravan train wrote", source));
    }
    return j.at("chosen").at("keys").get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(
        fmt::format("{}: not a readable layout ({}); start a new run", source, e.what()));
  }
}

std::vector<std::string> chooseLayoutKeys(const Config& config, int workers,
                                          const std::string& file, bool resume, bool log) {
  if (resume && std::filesystem::exists(file)) {
    std::string why;
    const auto text = readRegularFile(file, &why, false, size_t{1} << 20);
    if (!text) throw CheckpointError(fmt::format("cannot read {}: it {}", file, why));
    return layoutKeysFromJson(*text, file);
  }
  const std::string clusterPath = config.str("parallel.cluster");
  const LayoutDecision d = chooseLayout(config, layoutCluster(clusterPath), workers,
                                        /*checkCapacity=*/!clusterPath.empty());
  writeFileAtomic(file, layoutJson(d));
  if (log) {
    logLine(fmt::format("layout: {}, predicted {:.1f} samples/s ({} searched; {})", d.chosen().name,
                        d.chosen().predicted.samplesPerSecond, d.search.ranked.size(), file));
  }
  return d.chosen().keys;
}

}  // namespace caravan::sim
