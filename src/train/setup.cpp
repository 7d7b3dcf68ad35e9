// Config -> components (see setup.h).
#include "train/setup.h"

#include <dlfcn.h>

#include <torch/torch.h>

#include "core/errors.h"
#include "memory/host_allocator.h"
#include "data/sources.h"
#include "memory/accounting.h"

namespace caravan {

void applyRuntimeConfig(const Config& config) {
  if (config.flag("train.keep_freed_memory")) {
    // Tensor storages from mappings cached by size (memory/host_allocator.h): with the C heap,
    // every step page-faulted its activations back in (~19k faults per GPT step, measured:
    // bench/README.md) or, with raised malloc thresholds, fragmented. The cache holds at most
    // train.freed_memory_cache (1 GiB) of storages a step freed; it is not tied to
    // memory.budget: a cache of a quarter of the budget made swap-input steps 2x slower
    // (brown-gpt depth 12: 4.2 s against 2.1 s), every step unmapping and faulting back its
    // transient tensors.
    HostAllocator::install(
        parseBytes(config.str("train.freed_memory_cache"), "train.freed_memory_cache"));
  }
  const int64_t threads = config.i64("train.threads");
  if (threads <= 0) return;
  at::set_num_threads(static_cast<int>(threads));
  // LibTorch does not forward its thread count to OpenBLAS; set it directly when present.
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(static_cast<int>(threads));
  }
}

DatasetSplits makeDatasets(const Config& config) {
  const std::string& name = config.str("data.dataset");
  const std::string& path = config.str("data.path");
  if (name == "fashion-mnist") {
    return loadFashionMnist(path.empty() ? kDefaultFashionMnistDir : path);
  }
  if (name == "brown") {
    BrownOptions o;
    o.dir = path.empty() ? kDefaultBrownDir : path;
    o.seqLen = config.i64("data.seq_len");
    o.valFraction = config.f64("data.val_fraction");
    return loadBrown(o);
  }
  if (name == "synthetic") {
    SyntheticOptions o;
    o.task = config.str("data.synthetic_task") == "tokens" ? TaskKind::kLanguageModel
                                                           : TaskKind::kImageClassification;
    o.trainSize = config.i64("data.synthetic_size");
    o.testSize = std::max<int64_t>(1, o.trainSize / 4);
    o.seqLen = config.i64("data.seq_len");
    o.seed = static_cast<uint64_t>(config.i64("seed.data")) + 1234;
    return makeSynthetic(o);
  }
  CARAVAN_CHECK(false, "dataset {} not handled", name);
  return {};
}

ModelSpec makeModelSpec(const Config& config) {
  ModelSpec spec;
  spec.name = config.str("model.name");
  spec.width = config.i64("model.width");
  spec.depth = config.i64("model.depth");
  spec.heads = config.i64("model.heads");
  spec.dropout = config.f64("model.dropout");
  return spec;
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const Config& config, BlockModel& model) {
  return makeOptimizer(config, model->parameters());
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const Config& config,
                                                       std::vector<at::Tensor> params) {
  const double lr = config.f64("optim.lr");
  if (config.str("optim.name") == "adamw") {
    torch::optim::AdamWOptions o(lr);
    o.betas({config.f64("optim.beta1"), config.f64("optim.beta2")});
    o.eps(config.f64("optim.eps"));
    o.weight_decay(config.f64("optim.weight_decay"));
    return std::make_unique<torch::optim::AdamW>(params, o);
  }
  torch::optim::SGDOptions o(lr);
  o.momentum(config.f64("optim.momentum"));
  o.nesterov(config.flag("optim.nesterov"));
  o.weight_decay(config.f64("optim.weight_decay"));
  if (o.nesterov() && o.momentum() <= 0.0) {
    throw ConfigError("optim.nesterov = true needs optim.momentum > 0");
  }
  return std::make_unique<torch::optim::SGD>(params, o);
}

SamplerOptions makeSamplerOptions(const Config& config, int64_t datasetSize, int rank,
                                  int worldSize) {
  SamplerOptions o;
  o.datasetSize = datasetSize;
  o.batchSize = config.i64("data.batch_size");
  o.seed = static_cast<uint64_t>(config.i64("seed.data"));
  o.rank = rank;
  o.worldSize = worldSize;
  return o;
}

ScheduleOptions makeScheduleOptions(const Config& config, int64_t totalSteps) {
  ScheduleOptions o;
  o.kind = config.str("schedule.kind");
  o.peakLr = config.f64("optim.lr");
  o.warmupSteps = config.i64("schedule.warmup_steps");
  o.stepSize = config.i64("schedule.step_size");
  o.gamma = config.f64("schedule.gamma");
  o.minLr = config.f64("schedule.min_lr");
  o.totalSteps = totalSteps;
  return o;
}

void setLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

nlohmann::json runIdentity(const Config& config) {
  nlohmann::json j;
  for (const char* key : {"model.name", "data.dataset", "optim.name"}) j[key] = config.str(key);
  for (const char* key : {"model.width", "model.depth", "model.heads", "data.seq_len"}) {
    j[key] = config.i64(key);
  }
  return j;
}

}  // namespace caravan
