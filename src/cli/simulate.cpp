#include "cli/simulate.h"

#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/output_path.h"
#include "memory/tier.h"
#include "memory/tracker.h"
#include "sim/choose_layout.h"
#include "sim/cluster.h"
#include "sim/recommend.h"
#include "sim/simulator.h"
#include "sim/workload.h"
#include "train/run_options.h"

namespace caravan {
namespace {

namespace fs = std::filesystem;
using sim::SimResult;

nlohmann::json toJson(const SimResult& r, const sim::Workload& w) {
  nlohmann::json j = {{"workers", r.workers},
                      {"mode", r.mode},
                      {"step_s", r.stepSeconds},
                      {"samples_per_s", r.samplesPerSecond},
                      {"scaling_efficiency", r.scalingEfficiency},
                      {"bytes_per_step", r.bytesSentPerStep},
                      {"compute_utilisation", r.computeUtilisation},
                      {"link_utilisation", r.linkUtilisation},
                      {"compute_scale", r.computeScale},
                      {"memory_peak_bytes", r.memoryPeakBytes},
                      {"placement", r.placement}};
  if (w.epochExamples > 0) j["epoch_s"] = w.epochExamples / r.samplesPerSecond;
  if (r.ospFraction >= 0.0) j["osp_fraction"] = r.ospFraction;
  if (!r.staleness.empty()) {
    j["staleness_histogram"] = r.staleness;
    j["staleness_mean"] = sim::meanStaleness(r.staleness);
  }
  return j;
}

// --workers, or 1, 2, 4, ... up to the cluster's hosts (pipelines: multiples of the stages).
std::vector<int> workerCounts(const SimulateArgs& args, const sim::ClusterSpec& cluster,
                              int stages) {
  if (!args.workers.empty()) return args.workers;
  std::vector<int> out;
  const int most = std::max(stages, cluster.hosts);
  for (int n = stages; n <= most; n *= 2) out.push_back(n);
  if (stages == 1 && out.back() != most) out.push_back(most);
  return out;
}

// -o DIR holds what simulate writes (core/output_path.h), and no other bench's results (their
// charts.json) are overwritten.
void checkOutputDirectory(const SimulateArgs& args, bool workloadIsThere) {
  const std::string& dir = args.outDir;
  std::vector<std::string> files = {"predictions.jsonl", "charts.json"};
  if (!workloadIsThere) files.push_back("workload.json");
  checkOutputPath({"-o", dir, /*directory=*/true, files},
                  {args.configPath, args.clusterPath, args.workloadPath});
  const fs::path charts = fs::path(dir) / "charts.json";
  if (!fs::exists(charts)) return;
  std::string why;
  const auto text = readRegularFile(charts.string(), &why, false, size_t{64} << 20);
  const nlohmann::json j = text ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
  if (!j.is_object() || j.value("name", "") != "simulate") {
    throw ConfigError(
        fmt::format("-o {} holds another bench's charts.json; pass a directory of "
                    "its own for the predictions",
                    dir));
  }
}

}  // namespace

sim::Workload readWorkload(const std::string& path, const Config& config) {
  std::string why;
  const auto text = readRegularFile(path, &why, false, size_t{64} << 20);
  if (!text) {
    throw ConfigError(
        fmt::format("cannot read workload {}: it {}; pass a workload.json that "
                    "caravan simulate -o DIR wrote",
                    path, why));
  }
  sim::Workload w = sim::workloadFromJson(*text, path);
  sim::checkWorkloadIsTheConfigs(w, config, path);
  const int64_t batch = config.i64("data.batch_size");
  if (w.batchPerWorker != batch) {
    throw ConfigError(fmt::format(
        "{} was profiled at data.batch_size = {}, the config has {}; profile again (drop "
        "--workload) or set data.batch_size = {}",
        path, w.batchPerWorker, batch, w.batchPerWorker));
  }
  return w;
}

int runPlanLayout(const PlanLayoutArgs& args) {
  const Config config = args.configPath.empty()
                            ? Config::fromString("", "<defaults>", args.overrides)
                            : Config::fromFile(args.configPath, args.overrides);
  const sim::ClusterSpec cluster = sim::layoutCluster(args.clusterPath);
  const int workers =
      args.workers > 0 ? args.workers : std::max(1, cluster.hosts - serverCount(config));
  if (!args.output.empty()) {
    checkOutputPath({"-o", args.output}, {args.configPath, args.clusterPath, args.workloadPath});
  }
  std::optional<sim::Workload> given;
  if (!args.workloadPath.empty()) {
    given = readWorkload(args.workloadPath, config);
  } else if (isatty(STDERR_FILENO) != 0) {  // a refusal stays one line where it is read later
    std::cerr << "caravan: profiling the model on one batch...\n";
  }
  const sim::LayoutDecision d = sim::chooseLayout(config, cluster, workers, /*checkCapacity=*/true,
                                                  given ? &*given : nullptr);
  std::cout << sim::formatLayouts(d, 5);
  std::cerr << fmt::format("caravan: searched {} layouts in {:.2f} s\n", d.search.ranked.size(),
                           d.searchSeconds);
  if (!args.output.empty()) {
    writeFileAtomic(args.output, sim::layoutJson(d));
    std::cerr << fmt::format("caravan: wrote {}\n", args.output);
  }
  return 0;
}

int runSimulate(const SimulateArgs& args) {
  const sim::ClusterSpec cluster = sim::ClusterSpec::fromFile(args.clusterPath);
  const Config config = args.configPath.empty()
                            ? Config::fromString("", "<defaults>", args.overrides)
                            : Config::fromFile(args.configPath, args.overrides);
  const RunOptions options = RunOptions::read(config);
  if (const std::string why = sim::unsupported(options); !why.empty()) throw ConfigError(why);
  const std::string own = sim::label(options);
  const std::vector<int> counts = workerCounts(args, cluster, options.pipeline.stages);
  for (int n : counts) {
    if (n < 1) throw ConfigError(fmt::format("--workers {}: a worker count is 1 or more", n));
    // What caravan train would refuse for this many workers, refused here too.
    validate(options, n + options.sync.servers);
  }
  // --workload DIR/workload.json -o DIR: simulated again into its own directory, where the
  // workload already is (it is not written over itself).
  std::error_code same;
  const bool workloadIsThere =
      !args.outDir.empty() && !args.workloadPath.empty() &&
      fs::equivalent(args.workloadPath, fs::path(args.outDir) / "workload.json", same);
  if (!args.outDir.empty()) {
    checkOutputDirectory(args, workloadIsThere);
    std::error_code ec;
    fs::create_directories(args.outDir, ec);
    if (ec) {
      throw IoError(
          fmt::format("cannot create {}: {}; pass another -o", args.outDir, ec.message()));
    }
  }
  sim::Workload w;
  if (!args.workloadPath.empty()) {
    w = readWorkload(args.workloadPath, config);
  } else {
    std::cerr << "caravan: profiling the model on one batch...\n";
    w = sim::measureWorkload(config);
  }
  std::cerr << fmt::format(
      "caravan: {} ({} blocks), batch {}: {:.1f} ms forward+backward, {:.1f} ms update, {} of "
      "parameters\n",
      w.model, w.forwardSeconds.size(), w.batchPerWorker, 1e3 * w.computeSeconds(),
      1e3 * w.updateSeconds, formatBytes(w.parameterTotal()));

  std::string lines;
  nlohmann::json xs = nlohmann::json::array(), ys = nlohmann::json::array(),
                 eff = nlohmann::json::array();
  std::cout << fmt::format("{:>8}  {:<22} {:>9} {:>10} {:>7} {:>12} {:>6} {:>6}\n", "workers",
                           "mode", "step ms", "samples/s", "scaling", "MB/step/wkr", "cpu%",
                           "link%");
  for (int n : counts) {
    sim::SimOptions o{n, args.steps, args.seed};
    const std::vector<RunOptions> jobs =
        args.recommend ? sim::candidates(options, n) : std::vector<RunOptions>{options};
    std::vector<std::pair<RunOptions, SimResult>> results;
    for (const RunOptions& job : jobs) {
      const std::string label = sim::label(job);
      if (label != own) {  // a candidate caravan train would refuse is no way to run
        try {
          validate(job, n + job.sync.servers);
        } catch (const ConfigError& e) {
          std::cout << fmt::format("{:>8}  {:<22} not a way to run this config: {}\n", n, label,
                                   e.what());
          continue;
        }
      }
      SimResult r;
      try {
        r = sim::simulate(w, job, cluster, o);
      } catch (const ConfigError& e) {
        if (label == own) throw;
        std::cout << fmt::format("{:>8}  {:<22} not simulated: {}\n", n, label, e.what());
        continue;
      }
      results.push_back({job, r});
      nlohmann::json j = toJson(r, w);
      lines += j.dump() + "\n";
      if (label == own) {
        xs.push_back(n);
        ys.push_back(r.samplesPerSecond);
        eff.push_back(r.scalingEfficiency);
      }
      std::cout << fmt::format(
          "{:>8}  {:<22} {:>9.1f} {:>10.1f} {:>7.2f} {:>12.2f} {:>6.0f} {:>6.0f}\n", n, r.mode,
          1e3 * r.stepSeconds, r.samplesPerSecond, r.scalingEfficiency, r.bytesSentPerStep / 1e6,
          100.0 * r.computeUtilisation, 100.0 * r.linkUtilisation);
    }
    if (!args.recommend) continue;
    std::cout << fmt::format("\nrecommended for {} worker{} (fastest first):\n", n,
                             n == 1 ? "" : "s");
    int rank = 0;
    for (const sim::Recommendation& c : sim::recommend(results, cluster, n, w.epochExamples)) {
      std::cout << fmt::format("  {}. {}\n", ++rank, c.text());
    }
  }
  if (!args.outDir.empty()) {
    writeFileAtomic((fs::path(args.outDir) / "predictions.jsonl").string(), lines);
    if (!workloadIsThere) {
      writeFileAtomic((fs::path(args.outDir) / "workload.json").string(), sim::workloadJson(w));
    }
    nlohmann::json charts = {
        {"format", "caravan-bench-1"},
        {"name", "simulate"},
        {"title", fmt::format("Predicted scaling: {} ({})", w.model, own)},
        {"note", fmt::format("caravan simulate, cluster {}, {} steps per point", args.clusterPath,
                             args.steps)},
        {"charts",
         {{{"id", "throughput"},
           {"title", "Predicted samples/s"},
           {"type", "line"},
           {"x_label", "workers"},
           {"y_label", "samples/s"},
           {"log_x", true},
           {"log_y", false},
           {"series", {{{"name", own}, {"x", xs}, {"y", ys}}}}},
          {{"id", "efficiency"},
           {"title", "Predicted scaling efficiency"},
           {"type", "line"},
           {"x_label", "workers"},
           {"y_label", "samples/s over workers x one alone"},
           {"log_x", true},
           {"log_y", false},
           {"series", {{{"name", own}, {"x", xs}, {"y", eff}}}}}}}};
    writeFileAtomic((fs::path(args.outDir) / "charts.json").string(), charts.dump(1));
    std::cerr << fmt::format("caravan: wrote {}/predictions.jsonl, charts.json and workload.json\n",
                             args.outDir);
  }
  return 0;
}

int runCalibrate(const CalibrateArgs& args) {
  for (const auto& [option, value] :
       {std::pair{"--link-mbit", args.linkMbit}, std::pair{"--latency-us", args.latencyUs}}) {
    if (!std::isfinite(value)) {
      throw ConfigError(fmt::format("{} {} is not a number; give a finite one", option, value));
    }
  }
  const bool toFile = !args.output.empty() && args.output != "-";
  // Before the disk is measured: the file it would write is checked first.
  if (toFile) checkOutputPath({"-o", args.output}, {});
  sim::ClusterSpec c;
  c.hosts = args.hosts;
  c.linkBitsPerSecond = args.linkMbit * 1e6;
  c.latencySeconds = args.latencyUs * 1e-6;
  c.coresPerHost = static_cast<double>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  struct sysinfo info {};
  if (sysinfo(&info) == 0) {
    c.memoryBytesPerHost = static_cast<double>(info.totalram) * info.mem_unit;
  }
  const std::unique_ptr<Tier> tier = makeTier("disk", args.swapDir);  // refusals before the line
  std::cerr << fmt::format("caravan: measuring the disk under {} (256 MiB each way)...\n",
                           args.swapDir);
  const TierBandwidth b = tier->measure(int64_t{256} << 20);
  c.diskBytesPerSecond = std::min(b.writeBytesPerSecond, b.readBytesPerSecond);
  const std::string text =
      "# caravan calibrate: cores, memory and disk measured on this host; the link's rate and\n"
      "# latency as given (--link-mbit, --latency-us)\n" +
      c.toToml();
  if (!toFile) {
    std::cout << text;
  } else {
    writeFileAtomic(args.output, text);
    std::cerr << fmt::format("caravan: wrote {}\n", args.output);
  }
  return 0;
}

}  // namespace caravan
