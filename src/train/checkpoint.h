// Checkpoints: everything needed to continue a run exactly (model parameters and buffers,
// optimizer state — the servers' too, in the in-core form —, step, sampler position with the
// workers and batch size it counts in, RNG state, the strategy's own state), in one file per
// checkpoint; under sync.shard a set of files, each rank's slices and a manifest
// (train/sharded_checkpoint.h), which loadCheckpoint reads too.
//
// File format: a 24-byte header (magic "CRVNCKP1", payload size u64 LE, CRC-32 of the
// payload u32 LE, 4 reserved bytes) followed by the payload, a LibTorch archive. A file whose
// size or CRC disagrees with the header is refused before anything is deserialized.
// Files are written atomically: temporary file in the same directory, fsync, rename, fsync of
// the directory; an existing checkpoint is never modified in place.
//
// Threading: called from the trainer thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/files.h"  // writeFileAtomic, with which checkpoints are written
#include "core/torch_fwd.h"
#include "data/loader.h"

namespace caravan {

struct ShardedSlices;  // train/sharded_checkpoint.h

struct TrainingState {
  int64_t step = 0;                   // steps completed
  SamplerPosition position;           // where the next batch comes from
  int64_t workers = 0;                // data-parallel workers that wrote it (servers not counted;
                                      // 0: a checkpoint from before it was stored)
  int64_t batchSize = 0;              // per worker (0: likewise)
  std::map<std::string, at::Tensor> strategy;  // Strategy::saveState (empty in one process)
  at::Tensor rngState;                // default CPU generator (dropout)
  double elapsedSeconds = 0.0;        // training time of the run so far (metrics time_s)
  std::string bf16Blocks;             // train.precision's choice (PrecisionChoice::blocksText)
  nlohmann::json meta;                // identity of the run: model/optimizer/data keys
  // A sharded checkpoint resumed on as many sharded workers (loadCheckpoint's `own`): this
  // rank's slices of the trainable parameters and of their optimizer state, which the sharded
  // engine installs; the model's trainable parameters and the optimizer were not loaded.
  std::shared_ptr<ShardedSlices> ownSlices;
};

// Rank `rank` of `workers` sharded workers (sync.shard), resuming: loadCheckpoint hands it
// only its own slices of a sharded checkpoint that as many workers wrote.
struct SliceOwner {
  int rank = 0;
  int64_t workers = 0;
};

void saveCheckpoint(const std::string& path, torch::nn::Module& model,
                    torch::optim::Optimizer& optimizer, const TrainingState& state);

// Verifies the header, then loads into `model` and `optimizer`. `expectedMeta` must equal the
// stored meta (otherwise the checkpoint belongs to another model/config). Throws
// CheckpointError with a one-line message naming the file. A sharded checkpoint's manifest is
// loaded with every rank's slice file, reassembled into the whole parameters and optimizer
// state (any number of workers, sharded or not); with `own` and a set of as many workers,
// only the common part and `own`'s slice file are read (TrainingState::ownSlices).
TrainingState loadCheckpoint(const std::string& path, torch::nn::Module& model,
                             torch::optim::Optimizer& optimizer, const nlohmann::json& expectedMeta,
                             const std::optional<SliceOwner>& own = std::nullopt);

// The checkpoints of one run directory: RUN_DIR/checkpoints/step-<8 digits>.ckpt (an in-core
// checkpoint, or a sharded set's manifest), and a sharded set's slice files beside it,
// step-<8 digits>.rank<r>-of-<W>.<8 hex digits>.slice (sharded_checkpoint.h).
class CheckpointDir {
 public:
  CheckpointDir(std::string runDir, int64_t keep);
  const std::string& dir() const { return dir_; }
  std::string pathFor(int64_t step) const;
  // Writes the checkpoint for state.step, then removes all but the newest `keep`.
  std::string save(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                   const TrainingState& state);
  // Retention after the checkpoint of `step` was written (its slice files `slices`, names in
  // dir(); none for an in-core one): all but the newest `keep` checkpoints are removed, each
  // file that makes it a checkpoint first, then the slice files no remaining checkpoint has
  // (those of removed sets, of writes killed before their manifest, and of `step` but not in
  // `slices`). Rank 0 calls it, while no other rank writes.
  void prune(int64_t step, const std::vector<std::string>& slices) const;
  // Checkpoint files (regular files named step-<digits>.ckpt), oldest first.
  std::vector<std::string> list() const;
  // The step a checkpoint's file name says, or nullopt for another name.
  static std::optional<int64_t> stepOf(const std::string& path);
  // The step a slice file's name says (step-<digits>.<...>.slice), or nullopt.
  static std::optional<int64_t> sliceStepOf(const std::string& path);
  // Removes temporary files a write killed midway left behind (.step-*.ckpt.tmp-*,
  // .step-*.slice.tmp-*) and the slice files of steps without a checkpoint file (a sharded
  // set whose manifest was never written); only the holder of the run directory's lock may
  // call it, while no worker writes (every writer holds it). Returns how many.
  int removeStaleTemporaries() const;
  std::optional<std::string> latest() const;

 private:
  std::string dir_;
  int64_t keep_;
};

// `value` in the file format of torch.save, as torch.load reads it by default (weights_only,
// since torch 2.6): torch::pickle_save's, minus the type tags it puts on dicts and lists
// (their global, torch.jit._pickle.restore_type_tag, is one weights_only refuses).
std::vector<char> pickleForTorchLoad(const c10::IValue& value);

// The names a tensor of the model is exported under (BlockModel::exportNames: a tied tensor
// under each).
using ExportNames = std::function<std::vector<std::string>(const std::string&)>;
// Brings the model's parameters whose bytes are not all in memory in, a group at a time: calls
// its argument with each of them while its bytes are there (a sharded unit's, gathered).
using ParameterStream = std::function<void(const std::function<void(const at::Tensor&)>&)>;

// Exports parameters and buffers as a dict {name: tensor} that Python loads with
// `torch.load(path)` (torch.save's zip, as pickleForTorchLoad writes it; written atomically);
// `rename` gives each the name the user knows it by, when set. The tensors' bytes are written
// one tensor at a time, data.pkl last (pickled from tensors that hold no bytes), so the file is
// never whole in memory: with `stream`, the parameters it brings in are written as they come,
// the others (and the buffers) from memory after it. The dict and its storages' names follow the
// model's order, the records the order they are written in: the same model gives the same bytes
// when `stream` brings its parameters in the model's order.
void exportStateDict(const std::string& path, torch::nn::Module& model,
                     const ExportNames& rename = {}, const ParameterStream& stream = {});

}  // namespace caravan
