// The file container of checkpoints (checkpoint.h's format: header, CRC-32, LibTorch
// archive) and the entries every checkpoint's archive has, for the writers and readers of each
// kind of checkpoint file: checkpoint.cpp's in-core files, sharded_checkpoint.cpp's manifests
// and slices. (A header of its own: it names LibTorch's archives, which checkpoint.h's many
// includers need not compile.)
//
// Threading: free functions; any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include "train/checkpoint.h"

namespace caravan {

// The checkpoint file container, for every file of a checkpoint (an in-core checkpoint, a
// sharded set's manifest and slices): `archive` written atomically behind the header; returns
// the payload's size and CRC-32 (what the header says).
struct ArchiveSum {
  uint64_t size = 0;
  uint32_t crc = 0;
};
ArchiveSum writeArchiveFile(const std::string& path, torch::serialize::OutputArchive& archive);
// Checks `path`'s header, size and CRC, then runs `read` on its archive (read from the file
// as needed, while `read` runs); any error is a CheckpointError naming the file, a damaged
// file's ending in `remedy` (default: move it out of checkpoints/). Returns what the header
// says.
ArchiveSum readArchiveFile(const std::string& path,
                           const std::function<void(torch::serialize::InputArchive&)>& read,
                           const std::string& remedy = "");
// The header alone (magic, and the size against the file's), without reading the payload;
// CheckpointError naming the file.
ArchiveSum readArchiveHeader(const std::string& path, const std::string& remedy = "");
// The entries every checkpoint's archive has beside the model: step, sampler position, RNG,
// meta, the strategy's tensors...; reading checks them (CheckpointError naming `path`).
void writeTrainingState(torch::serialize::OutputArchive& archive, const TrainingState& state);
void readTrainingState(const std::string& path, torch::serialize::InputArchive& archive,
                       TrainingState& state);
// A tensor whose storage holds only it (a view of a larger storage, such as a sharded unit's
// flat buffer, is copied): what a file stores of it is its own elements.
at::Tensor ownStorage(const at::Tensor& t);

}  // namespace caravan
