// caravan_bench: measures single-worker training throughput of a config with the same data
// loader and step function as `caravan train`, and the machine's matrix-multiply peak.
// Prints one JSON object per measurement on stdout. Driven by bench/train_throughput.py.
//
//   caravan_bench train --config configs/fmnist-cnn.toml --steps 200 --warmup 20 --threads 1
//   caravan_bench matmul --size 1024 --threads 1
#include <chrono>
#include <iostream>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "core/config.h"
#include "core/errors.h"
#include "data/loader.h"
#include "train/setup.h"
#include "train/step.h"

using namespace caravan;
using Clock = std::chrono::steady_clock;

namespace {

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int benchTrain(const std::string& configPath, std::vector<std::string> overrides, int64_t steps,
               int64_t warmup, int64_t threads) {
  overrides.push_back("train.threads=" + std::to_string(threads));
  Config config = Config::fromFile(configPath, overrides);
  applyThreadConfig(config);
  DatasetSplits data = makeDatasets(config);
  torch::manual_seed(static_cast<uint64_t>(config.i64("seed.init")));
  BlockModel model = buildModel(makeModelSpec(config), data.train->shape());
  auto optimizer = makeOptimizer(config, model);
  SamplerOptions so;
  so.datasetSize = data.train->size();
  so.batchSize = config.i64("data.batch_size");
  so.seed = static_cast<uint64_t>(config.i64("seed.data"));
  Loader loader(data.train, so, config.i64("data.prefetch"));
  model->train();
  const double clip = config.f64("optim.grad_clip");
  double lossSum = 0.0;
  for (int64_t i = 0; i < warmup; ++i) trainStep(model, *optimizer, loader.next().batch, clip);
  const auto start = Clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    lossSum += trainStep(model, *optimizer, loader.next().batch, clip).loss;
  }
  const double s = seconds(start, Clock::now());
  const double samplesPerS = static_cast<double>(steps * so.batchSize) / s;
  const double flopsPerSample = 3.0 * model->forwardFlopsPerExample();
  nlohmann::json out = {{"bench", "train"},
                        {"config", configPath},
                        {"model", model->modelName()},
                        {"threads", threads},
                        {"batch_size", so.batchSize},
                        {"steps", steps},
                        {"seconds", s},
                        {"samples_per_s", samplesPerS},
                        {"train_flops_per_sample", flopsPerSample},
                        {"gflops", samplesPerS * flopsPerSample / 1e9},
                        {"mean_loss", lossSum / static_cast<double>(steps)}};
  std::cout << out.dump() << std::endl;
  return 0;
}

int benchMatmul(int64_t n, int64_t threads, int64_t repeats) {
  at::set_num_threads(static_cast<int>(threads));
  Config c = Config::fromString("", "<bench>", {"train.threads=" + std::to_string(threads)});
  applyThreadConfig(c);
  at::Tensor a = torch::randn({n, n}), b = torch::randn({n, n});
  at::Tensor out = at::mm(a, b);
  double best = 1e300;
  for (int64_t r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    at::mm_out(out, a, b);
    best = std::min(best, seconds(t0, Clock::now()));
  }
  const double gflops = 2.0 * static_cast<double>(n) * n * n / best / 1e9;
  nlohmann::json j = {{"bench", "matmul"}, {"size", n}, {"threads", threads},
                      {"best_seconds", best}, {"gflops", gflops}};
  std::cout << j.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"caravan_bench: training-step throughput and matmul peak (JSON on stdout)"};
  app.require_subcommand(1);
  std::string config;
  std::vector<std::string> overrides;
  int64_t steps = 100, warmup = 10, threads = 1, size = 1024, repeats = 10;
  auto* train = app.add_subcommand("train", "time training steps of a config");
  train->add_option("--config", config, "config file")->required();
  train->add_option("--set", overrides, "override a config key");
  train->add_option("--steps", steps, "timed steps");
  train->add_option("--warmup", warmup, "untimed steps first");
  train->add_option("--threads", threads, "compute threads");
  auto* mm = app.add_subcommand("matmul", "float32 matrix-multiply peak");
  mm->add_option("--size", size, "matrix size n (n x n times n x n)");
  mm->add_option("--threads", threads, "compute threads");
  mm->add_option("--repeats", repeats, "best of this many");
  CLI11_PARSE(app, argc, argv);
  try {
    if (*train) return benchTrain(config, overrides, steps, warmup, threads);
    return benchMatmul(size, threads, repeats);
  } catch (const Error& e) {
    std::cerr << "caravan_bench: error: " << e.what() << "\n";
    return e.exitCode();
  }
}
