// Sharded checkpoints (sync.shard != none; docs/sharding.md "Checkpoints"): each rank writes its
// own slices of the trainable parameters and of their optimizer state, with no gather; one
// manifest holds what is common. In RUN_DIR/checkpoints/, for step N (8 digits) of W ranks:
//
//   step-N.rank<r>-of-<W>.<token>.slice   rank r's slices (token: 8 hex digits of its own, so
//                                        a rewrite of step N never touches the set in place)
//   step-N.ckpt                          the manifest: the unit layout, each slice file's
//                                        name, size and CRC-32, the buffers and the parameters
//                                        no unit holds (frozen ones), and the training state
//                                        (step, sampler position, RNG, meta, workers...)
//
// Every file is checkpoint.h's container (header, CRC-32, payload), written atomically: the
// manifest's payload is a LibTorch archive; a slice file's (format 2) is a zip of raw records,
// written a unit at a time so that no rank holds more than a unit's slices for it (the
// offloaded ones read back from the tier one by one):
//
//   weights/<u>     unit u's slice of the flat weights, [padded / W] float32
//   optimizer/<u>   its optimizer state, [rows, padded / W] float32 (none while rows = 0)
//   slice           JSON, written last: step, rank, world_size, and per unit its rows and the
//                   optimizer's step count
//
// Order: every rank writes its slice file; an all-gather of what each wrote (a
// barrier); rank 0 checks that every slice file is there as it sees it, writes the manifest
// last, then prunes (checkpoint.keep: whole sets). The manifest's name is the in-core
// checkpoint's, so CheckpointDir::latest() and resume see a set only once all of it is there;
// slices without a manifest (a write killed midway) are removed like temporaries.
//
// The layout: per unit (sync/sharding.h: one flat buffer per block, padded to a multiple of
// W), its parameters' names, shapes and offsets, its elements and padded size, and its groups;
// rank r's slice of a unit is elements [r P / W, (r + 1) P / W) of the padded buffer, P its
// padded size. A unit whose block gathers some weights in bf16 (sync.shard = parameters) has
// two groups, each padded on its own: rank r's slice is its slice of the first, then of the
// second (still float32: the masters). A reader reassembles the whole tensors from it without
// the model's sharding.
//
// Reading (loadCheckpoint, checkpoint.h; whole slice files at once, not yet unit by unit): every
// slice file is checked against the manifest
// (there, same size and CRC) before anything loads: a missing or foreign slice is refused in
// one line naming the rank and the file. A sharded run on as many workers reads only its own
// slice file (ShardedSlices, installed by ShardedStep); any other run (another number of
// workers, sync.shard = none, caravan eval, caravan checkpoint consolidate) reads every slice
// file and gets the whole parameters and optimizer state, as from an in-core checkpoint.
//
// Threading: the trainer's thread (the writer issues one collective on `comm`).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "core/torch_fwd.h"
#include "sync/optimizer_state.h"
#include "train/checkpoint.h"

namespace caravan {

// How a sharded checkpoint's units are laid out (what sync/sharding.h's units were).
struct ShardedLayout {
  struct Parameter {
    std::string name;  // the model's (named_parameters)
    std::vector<int64_t> shape;
    int64_t offset = 0;  // elements into the unit's elements (its groups back to back, unpadded)
  };
  // A part of a unit's elements padded on its own (sync/sharding.h's groups); `dtype`: what
  // its gathers moved ("float32", "bfloat16"), for messages: the slices are float32.
  struct Group {
    int64_t numel = 0, padded = 0;
    std::string dtype = "float32";
  };
  struct Unit {
    std::vector<Parameter> params;
    int64_t numel = 0, padded = 0;  // padded: a multiple of worldSize
    // Rank r's slice: its slice of each group, group after group. One float32 group when the
    // manifest names none (the JSON has "groups" only when there is more to say).
    std::vector<Group> groups;
  };
  int64_t worldSize = 0;
  std::string level;  // the sync.shard that wrote it (for messages)
  std::vector<Unit> units;

  nlohmann::json toJson() const;
  // CheckpointError naming `path` for a layout that does not hold together.
  static ShardedLayout fromJson(const nlohmann::json& j, const std::string& path);
  // The same units (names, shapes, offsets, sizes, groups) over the same number of workers.
  bool sameUnits(const ShardedLayout& other) const;
};

// One rank's part of a sharded checkpoint as read: per unit its slice of the weights
// ([padded / W], float32) and of the optimizer state (rows x [padded / W]; no rows: not stepped
// yet).
struct ShardedSlices {
  ShardedLayout layout;
  int rank = 0;
  std::vector<at::Tensor> weights;
  std::vector<FlatOptimizerState> optimizer;
};

// One rank's part as written, a unit at a time: a SliceSource calls its SliceWriter once per
// unit, in index order, with the unit's slice of the weights and of its optimizer state (as in
// ShardedSlices), which need to be in memory only during that call.
using SliceWriter =
    std::function<void(size_t unit, const at::Tensor& weights, const FlatOptimizerState& state)>;
using SliceSource = std::function<void(const SliceWriter&)>;

// Writes the checkpoint of state.step as a sharded set (the order above); every rank calls it
// with its own `slices` of `layout` (the same on every rank). `model`'s buffers and its
// parameters that no unit holds go to the manifest (rank 0's). Returns the manifest's path. A
// rank that cannot write its slice fails every rank (IoError) and no manifest is written.
std::string saveShardedCheckpoint(const CheckpointDir& dir, Communicator& comm,
                                  const ShardedLayout& layout, const SliceSource& slices,
                                  torch::nn::Module& model, const TrainingState& state);

// Whether an opened checkpoint archive is a sharded set's manifest; whether the file at `path`
// is one rank's slice file (CheckpointError for a file that is no checkpoint at all).
bool isShardedManifest(torch::serialize::InputArchive& archive);
bool isSliceFile(const std::string& path);

// loadCheckpoint's part for a manifest (`path`, opened as `archive`; its meta already checked):
// the common part into `model`, then either `own`'s slices (a set of own->workers ranks:
// returned, the trainable parameters and `optimizer` untouched) or every rank's, reassembled
// into `model`'s parameters and `optimizer`'s state (returns null). CheckpointError naming the
// file at fault.
std::shared_ptr<ShardedSlices> loadShardedCheckpoint(const std::string& path,
                                                     torch::serialize::InputArchive& archive,
                                                     torch::nn::Module& model,
                                                     torch::optim::Optimizer& optimizer,
                                                     const std::optional<SliceOwner>& own);

}  // namespace caravan
