// Builds the pieces of a run from its typed options (run_options.h): datasets, model,
// optimizer, sampler, schedule, and the process-wide runtime settings. RunSetup
// (run_setup.h) puts them together in the order every run uses.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/openmp_env.h"
#include "core/torch_fwd.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "models/model.h"
#include "train/run_options.h"
#include "train/schedule.h"

namespace caravan {

// Whether the run's matrix products go through oneDNN in bf16: train.precision bf16 or
// bf16-all on a CPU with bf16 instructions (models/precision.h cpuRunsBf16).
bool productsInBf16(const std::string& precision);
// Whether the float32 BLAS multiplies on OpenMP's pool: MKL (the torch wheel's) or an OpenMP
// build of OpenBLAS; false for OpenBLAS's own pthreads pool.
bool blasRunsOnOpenMp();
// Which threads run the products (core/openmp_env.h): OpenMP's pool for bf16 products
// (oneDNN) and for a BLAS on OpenMP's pool; the BLAS's own threads otherwise.
MatrixProducts matrixProductsFor(const std::string& precision);

// Process-wide settings: LibTorch's intra-op threads and OpenBLAS's threads from
// train.threads (0 = leave the library defaults), OpenBLAS held to one thread whatever
// train.threads says when the products go through oneDNN (productsInBf16: its threads would
// only compete with OpenMP's workers), and the allocator's thresholds
// (train.keep_freed_memory). Call before building the model.
void applyRuntimeOptions(const RuntimeOptions& options);
// OpenBLAS's threads, when it is loaded and runs its own (pthreads) pool.
void setBlasThreads(int threads);
// The BLAS's thread count now, for summary.json: OpenBLAS's pool when it is loaded, else
// MKL's (the torch wheel's BLAS; it runs on OpenMP's pool, whose size at::set_num_threads
// sets), else 0.
int blasThreads();

// The dataset's train and test splits (`dataSeed`: the synthetic data's seed).
DatasetSplits makeDatasets(const DataOptions& options, uint64_t dataSeed);
// The configured optimizer over `params` (the model's, or a parameter server's shard).
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const OptimizerOptions& options,
                                                       std::vector<at::Tensor> params);
// The training sampler for `datasetSize` examples, as shard `rank` of `worldSize` workers.
SamplerOptions makeSamplerOptions(const RunOptions& options, int64_t datasetSize, int rank = 0,
                                  int worldSize = 1);

// Sets the learning rate of every parameter group.
void setLearningRate(torch::optim::Optimizer& optimizer, double lr);

// The keys a checkpoint must agree with to be loadable into this run (model, optimizer and
// dataset identity): stored in each checkpoint and compared on resume. `data`: the run's
// datasets, whose content matters too (the Brown corpus's vocabulary: the token ids).
// A scripted `model` (model.name = torchscript) adds its parameters' names and shapes.
nlohmann::json runIdentity(const RunOptions& options, const DatasetSplits& data, BlockModel& model);

}  // namespace caravan
