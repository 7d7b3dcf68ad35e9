// Builds the pieces of a run from a Config: datasets, model, optimizer, schedule, threads.
// The one place that maps config keys to component options.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "models/model.h"
#include "train/schedule.h"

namespace torch {
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace caravan {

// Process-wide settings from the config: LibTorch's intra-op threads and OpenBLAS's threads
// from train.threads (0 = leave the library defaults), and the allocator's thresholds
// (train.keep_freed_memory). Call before building the model.
void applyRuntimeConfig(const Config& config);

DatasetSplits makeDatasets(const Config& config);
ModelSpec makeModelSpec(const Config& config);
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const Config& config, BlockModel& model);
// The same optimizer over given tensors (a parameter server's shard).
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const Config& config,
                                                       std::vector<at::Tensor> params);
ScheduleOptions makeScheduleOptions(const Config& config, int64_t totalSteps);
// The training sampler for `datasetSize` examples (data.batch_size, seed.data), as shard `rank`
// of `worldSize` data-parallel workers.
SamplerOptions makeSamplerOptions(const Config& config, int64_t datasetSize, int rank = 0,
                                  int worldSize = 1);

// Sets the learning rate of every parameter group.
void setLearningRate(torch::optim::Optimizer& optimizer, double lr);

// The keys a checkpoint must agree with to be loadable into this run (model, optimizer and
// dataset identity): stored in each checkpoint and compared on resume.
nlohmann::json runIdentity(const Config& config);

}  // namespace caravan
