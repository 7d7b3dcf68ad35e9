// Typed options -> components (see setup.h).
#include "train/setup.h"

#include <dlfcn.h>
#include <zlib.h>

#include <fmt/ranges.h>
#include <torch/torch.h>

#include "core/errors.h"
#include "data/sources.h"
#include "memory/accounting.h"
#include "memory/host_allocator.h"
#include "models/precision.h"
#include "models/script_model.h"
#include "optim/fused.h"

namespace caravan {

void applyRuntimeOptions(const RuntimeOptions& options) {
  if (options.keepFreedMemory) {
    // Tensor storages from mappings cached by size (memory/host_allocator.h): with the C heap,
    // every step page-faulted its activations back in (~19k faults per GPT step, measured:
    // bench/README.md) or, with raised malloc thresholds, fragmented. The cache holds at most
    // train.freed_memory_cache (1 GiB) of storages a step freed; it is not tied to
    // memory.budget: a cache of a quarter of the budget made swap-input steps 2x slower
    // (brown-gpt depth 12: 4.2 s against 2.1 s), every step unmapping and faulting back its
    // transient tensors.
    HostAllocator::install(options.freedMemoryCache);
  }
  // LibTorch does not forward its thread count to OpenBLAS: setBlasThreads sets it.
  const bool oneDnn = productsInBf16(options.precision);
  if (oneDnn) setBlasThreads(1);
  if (options.threads <= 0) return;
  if (!oneDnn) setBlasThreads(static_cast<int>(options.threads));
  // After OpenBLAS's: an OpenMP build's openblas_set_num_threads would set this pool too.
  at::set_num_threads(static_cast<int>(options.threads));
}

namespace {
template <typename Fn>
Fn blasFunction(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}
}  // namespace

void setBlasThreads(int threads) {
  // An OpenMP build of OpenBLAS (openblas_get_parallel() == 2, Debian's libopenblas0-openmp)
  // runs on OpenMP's own pool, whose size at::set_num_threads sets: leave it.
  if (auto parallel = blasFunction<int (*)()>("openblas_get_parallel"); parallel && parallel() == 2)
    return;
  if (auto fn = blasFunction<void (*)(int)>("openblas_set_num_threads")) fn(threads);
}

int blasThreads() {
  if (auto fn = blasFunction<int (*)()>("openblas_get_num_threads")) return fn();
  if (auto fn = blasFunction<int (*)()>("mkl_get_max_threads")) return fn();
  return 0;
}

bool productsInBf16(const std::string& precision) {
  return precision != "float32" && cpuRunsBf16();
}

bool blasRunsOnOpenMp() {
  if (auto parallel = blasFunction<int (*)()>("openblas_get_parallel")) return parallel() == 2;
  return blasFunction<int (*)()>("mkl_get_max_threads") != nullptr;
}

MatrixProducts matrixProductsFor(const std::string& precision) {
  return productsInBf16(precision) || blasRunsOnOpenMp() ? MatrixProducts::kOpenMpPool
                                                         : MatrixProducts::kBlasThreads;
}

DatasetSplits makeDatasets(const DataOptions& options, uint64_t dataSeed) {
  if (!options.sources.empty()) {
    std::vector<MixtureSource> sources;
    for (const DataSource& d : options.sources) {
      DataOptions one = options;
      one.sources.clear();
      one.dataset = d.format;
      one.path = d.path;
      sources.push_back(MixtureSource{d.path, makeDatasets(one, dataSeed), d.weight});
    }
    return mixSources(sources);
  }
  const std::string& name = options.dataset;
  const std::string& path = options.path;
  if (name == "fashion-mnist") {
    return loadIdxPairs(path.empty() ? kDefaultFashionMnistDir : path, name);
  }
  if (name == "brown") {
    BrownOptions o;
    o.dir = path.empty() ? kDefaultBrownDir : path;
    o.seqLen = options.seqLen;
    o.valFraction = options.valFraction;
    return loadBrown(o);
  }
  if (name == "tokens") {
    TokenFileOptions o;
    o.dir = path;
    o.dtype = options.tokenDtype;
    o.vocabSize = options.vocabSize;
    o.seqLen = options.seqLen;
    return loadTokenFiles(o);
  }
  if (name == "idx") {
    if (path.empty()) {
      throw ConfigError("data.dataset = 'idx' needs data.path: the directory of the IDX files");
    }
    return loadIdxPairs(path, name);
  }
  if (name == "npy") return loadNpyArrays(path);
  if (name == "text") return loadTextBytes(path, options.seqLen);
  if (name == "synthetic") {
    SyntheticOptions o;
    o.task = options.syntheticTask == "tokens" ? TaskKind::kLanguageModel
                                               : TaskKind::kImageClassification;
    o.trainSize = options.syntheticSize;
    o.testSize = std::max<int64_t>(1, o.trainSize / 4);
    o.seqLen = options.seqLen;
    if (options.vocabSize > 0) o.vocabSize = options.vocabSize;
    o.seed = dataSeed + 1234;
    return makeSynthetic(o);
  }
  CARAVAN_CHECK(false, "dataset {} not handled", name);
  return {};
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const OptimizerOptions& options,
                                                       std::vector<at::Tensor> params) {
  if (options.name == "adamw") {
    torch::optim::AdamWOptions o(options.lr);
    o.betas({options.beta1, options.beta2});
    o.eps(options.eps);
    o.weight_decay(options.weightDecay);
    return std::make_unique<FusedAdamW>(params, o);
  }
  validate(options);  // Nesterov without momentum (validate() refused it for a training run)
  torch::optim::SGDOptions o(options.lr);
  o.momentum(options.momentum);
  o.nesterov(options.nesterov);
  o.weight_decay(options.weightDecay);
  return std::make_unique<FusedSgd>(params, o);
}

SamplerOptions makeSamplerOptions(const RunOptions& options, int64_t datasetSize, int rank,
                                  int worldSize) {
  SamplerOptions o;
  o.datasetSize = datasetSize;
  o.batchSize = options.data.batchSize;
  o.seed = options.seed.data;
  o.rank = rank;
  o.worldSize = worldSize;
  return o;
}

void setLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

nlohmann::json runIdentity(const RunOptions& options, const DatasetSplits& data,
                           BlockModel& model) {
  // The config's key names: checkpoints of every version store and compare these.
  nlohmann::json j;
  j["model.name"] = options.model.name;
  j["data.dataset"] = options.data.dataset;
  j["optim.name"] = options.optim.name;
  j["model.width"] = options.model.width;
  j["model.depth"] = options.model.depth;
  j["model.heads"] = options.model.heads;
  j["data.seq_len"] = options.data.seqLen;
  // A corpus whose characters changed gives other token ids: the model would read nonsense or
  // index past its embedding. (Checkpoints from before this key are not checked for it.)
  if (options.data.dataset == "brown") {
    // Its CRC-32 (zlib's, as the checkpoint file's own check): a short, stable name.
    const std::string vocabulary = brownVocabulary(*data.train);
    j["data.vocabulary"] =
        fmt::format("{:08x}", crc32(0L, reinterpret_cast<const Bytef*>(vocabulary.data()),
                                    static_cast<uInt>(vocabulary.size())));
  }
  if (options.data.dataset == "tokens") {
    j["data.vocab_size"] = options.data.vocabSize;
    j["data.token_dtype"] = options.data.tokenDtype;
  }
  // A mixture: its sources and their weights (another mix is another order of samples).
  for (const DataSource& d : options.data.sources) {
    j["data.sources"].push_back({{"format", d.format}, {"weight", d.weight}});
  }
  // Arrays: what one example is (a model built for other arrays would not fit them).
  if (options.data.dataset == "npy") {
    const DataShape shape = data.train->shape();
    j["data.arrays"] =
        fmt::format("inputs [{}] {}, targets [{}] {}, {} classes", fmt::join(shape.inputShape, ","),
                    at::toString(shape.inputType), fmt::join(shape.targetShape, ","),
                    at::toString(shape.targetType), shape.numClasses);
  }
  // A scripted module is its file, not the config's keys: its parameters' names and shapes
  // (not their values, which the checkpoint holds) say whether a checkpoint fits it.
  if (options.model.name == kScriptModelName) {
    std::string layout;
    for (const auto& p : model->named_parameters()) {
      layout += model->exportName(p.key()) + ":";
      for (int64_t d : p.value().sizes()) layout += std::to_string(d) + ",";
      layout += ";";
    }
    j["model.parameters"] = fmt::format(
        "{} tensors, crc {:08x}", model->parameters().size(),
        crc32(0L, reinterpret_cast<const Bytef*>(layout.data()), static_cast<uInt>(layout.size())));
  }
  return j;
}

}  // namespace caravan
