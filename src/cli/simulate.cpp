#include "cli/simulate.h"

#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/output_path.h"
#include "memory/tier.h"
#include "memory/tracker.h"
#include "sim/cluster.h"
#include "sim/simulator.h"
#include "sim/workload.h"
#include "sync/compression.h"
#include "train/run_options.h"

namespace caravan {
namespace {

namespace fs = std::filesystem;
using sim::SimResult;
using sim::SyncSpec;

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

// The ways to run the job `recommend` compares: the config's own and the usual alternatives.
std::vector<SyncSpec> candidates(const SyncSpec& own, int workers) {
  std::vector<SyncSpec> out{own};
  auto add = [&](const std::string& mode, auto&& change) {
    SyncSpec s = own;
    s.mode = mode;
    s.compression = "none";
    s.pipelineStages = 1;
    s.microBatches = 1;
    s.servers = std::max(1, own.servers);
    s.postLocalSteps = 0;
    s.gossipTopology = "ring";
    change(s);
    if (s.label() != own.label()) out.push_back(s);
  };
  auto none = [](SyncSpec&) {};
  add("allreduce", none);
  add("allreduce", [](SyncSpec& s) { s.compression = "fp16"; });
  add("ps-bsp", none);
  add("ps-asp", none);
  add("ps-ssp", none);
  add("osp", [](SyncSpec& s) { s.ospAuto = true; });
  add("local-sgd", none);
  add("gossip", none);
  if (workers % 2 == 0) {
    add("allreduce", [](SyncSpec& s) {
      s.pipelineStages = 2;
      s.microBatches = 4;
    });
  }
  return out;
}

// What a mode gives up against single-process training, in words.
std::string consistency(const SyncSpec& s, const SimResult& r) {
  std::string c;
  if (s.mode == "allreduce" || s.mode == "ps-bsp") c = "exact (every step synchronous)";
  if (s.mode == "ps-asp")
    c = fmt::format("stale reads (mean gap {:.2f} steps)", sim::meanStaleness(r.staleness));
  if (s.mode == "ps-ssp") {
    c = fmt::format("reads at most {} steps stale (mean gap {:.2f})", s.staleness,
                    sim::meanStaleness(r.staleness));
  }
  if (s.mode == "osp") {
    c = fmt::format("{:.0f}% of each step synchronous, the rest a step late with LGP",
                    100.0 * r.ospFraction);
  }
  if (s.mode == "local-sgd") c = fmt::format("replicas averaged every {} steps", s.localPeriod);
  if (s.mode == "gossip") c = "replicas mixed with their ring neighbours only";
  if (s.compression == "fp16" || s.compression == "bf16") c += ", gradients rounded to 16 bits";
  if (s.compression == "topk")
    c += fmt::format(", top {:g}% of each gradient", 100.0 * s.topkRatio);
  return c;
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

// The run's options with a candidate's way of synchronising, for validate().
RunOptions withSync(RunOptions o, const SyncSpec& s) {
  o.sync.mode = parseSyncMode(s.mode);
  o.sync.servers = usesServers(o.sync.mode) ? s.servers : 0;
  o.sync.compressionName = s.compression;
  o.sync.allreduce.compression = parseCompression(s.compression);
  o.sync.ps.compression = o.sync.allreduce.compression;
  o.sync.osp.autoFraction = s.ospAuto;
  o.pipeline.stages = s.pipelineStages;
  o.pipeline.microBatches = s.microBatches;
  return o;
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

int runSimulate(const SimulateArgs& args) {
  const sim::ClusterSpec cluster = sim::ClusterSpec::fromFile(args.clusterPath);
  const Config config = args.configPath.empty()
                            ? Config::fromString("", "<defaults>", args.overrides)
                            : Config::fromFile(args.configPath, args.overrides);
  const RunOptions options = RunOptions::read(config);
  const SyncSpec own = sim::syncSpecFrom(options);
  if (const std::string why = own.unsupported(); !why.empty()) throw ConfigError(why);
  const std::vector<int> counts = workerCounts(args, cluster, own.pipelineStages);
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
    std::string why;
    const auto text = readRegularFile(args.workloadPath, &why, false, size_t{64} << 20);
    if (!text) {
      throw ConfigError(
          fmt::format("cannot read workload {}: it {}; pass a workload.json that "
                      "caravan simulate -o DIR wrote",
                      args.workloadPath, why));
    }
    w = sim::workloadFromJson(*text, args.workloadPath);
    sim::checkWorkloadIsTheConfigs(w, config, args.workloadPath);
    if (w.batchPerWorker != options.data.batchSize) {
      throw ConfigError(fmt::format(
          "{} was profiled at data.batch_size = {}, the config has {}; profile again (drop "
          "--workload) or set data.batch_size = {}",
          args.workloadPath, w.batchPerWorker, options.data.batchSize, w.batchPerWorker));
    }
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
    std::vector<SyncSpec> specs = args.recommend ? candidates(own, n) : std::vector<SyncSpec>{own};
    std::vector<std::pair<SimResult, SyncSpec>> results;
    for (const SyncSpec& s : specs) {
      if (s.label() != own.label()) {  // a candidate caravan train would refuse is no way to run
        const RunOptions candidate = withSync(options, s);
        try {
          validate(candidate, n + candidate.sync.servers);
        } catch (const ConfigError& e) {
          std::cout << fmt::format("{:>8}  {:<22} not a way to run this config: {}\n", n, s.label(),
                                   e.what());
          continue;
        }
      }
      SimResult r;
      try {
        r = sim::simulate(w, s, cluster, o);
      } catch (const ConfigError& e) {
        if (s.label() == own.label()) throw;
        std::cout << fmt::format("{:>8}  {:<22} not simulated: {}\n", n, s.label(), e.what());
        continue;
      }
      results.push_back({r, s});
      nlohmann::json j = toJson(r, w);
      lines += j.dump() + "\n";
      if (s.label() == own.label()) {
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
    const double perHost = cluster.memoryBytesPerHost;
    std::stable_sort(results.begin(), results.end(), [](const auto& a, const auto& b) {
      return a.first.samplesPerSecond > b.first.samplesPerSecond;
    });
    std::cout << fmt::format("\nrecommended for {} worker{} (fastest first):\n", n,
                             n == 1 ? "" : "s");
    int rank = 0;
    for (const auto& [r, s] : results) {
      const double perWorker =
          perHost > 0.0 ? perHost / std::max(1, (n + cluster.hosts - 1) / cluster.hosts) : 0.0;
      const bool fits = perWorker <= 0.0 || r.memoryPeakBytes <= perWorker;
      const std::string memory = r.memoryPeakBytes == 0 ? "; memory not predicted" : "";
      const std::string bound =
          r.computeUtilisation >= 0.8
              ? fmt::format("compute-bound ({:.0f}% computing)", 100.0 * r.computeUtilisation)
              : fmt::format("communication-bound ({:.0f}% computing, busiest link {:.0f}%)",
                            100.0 * r.computeUtilisation, 100.0 * r.linkUtilisation);
      const std::string epoch =
          w.epochExamples > 0
              ? fmt::format(", {:.1f} min/epoch", w.epochExamples / r.samplesPerSecond / 60.0)
              : "";
      std::cout << fmt::format("  {}. {}: {:.0f} samples/s{}; {}; {}{}{}\n", ++rank, r.mode,
                               r.samplesPerSecond, epoch, bound, consistency(s, r), memory,
                               fits ? ""
                                    : fmt::format("; does NOT fit memory ({} per worker)",
                                                  formatBytes(r.memoryPeakBytes)));
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
        {"title", fmt::format("Predicted scaling: {} ({})", w.model, own.label())},
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
           {"series", {{{"name", own.label()}, {"x", xs}, {"y", ys}}}}},
          {{"id", "efficiency"},
           {"title", "Predicted scaling efficiency"},
           {"type", "line"},
           {"x_label", "workers"},
           {"y_label", "samples/s over workers x one alone"},
           {"log_x", true},
           {"log_y", false},
           {"series", {{{"name", own.label()}, {"x", xs}, {"y", eff}}}}}}}};
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
