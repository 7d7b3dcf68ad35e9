// The file container of checkpoints (checkpoint.h's format: header, CRC-32, then a LibTorch
// archive, or a zip of raw records) and the entries every checkpoint's archive has, for the
// writers and readers of each kind of checkpoint file: checkpoint.cpp's in-core files,
// sharded_checkpoint.cpp's manifests (archives) and slices (records). (A header of its own: it
// names LibTorch's archives, which checkpoint.h's many includers need not compile.)
//
// Threading: free functions; any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
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
// The same container around a zip of raw records (LibTorch's PyTorchStreamWriter; a sharded
// slice file): `write` adds the records, each going to the file as it is added (none is held
// whole in memory), then the zip's directory ends it. The CRC is computed as the bytes go and
// the header written last, as writeArchiveFile's.
ArchiveSum writeRecordsFile(
    const std::string& path,
    const std::function<void(caffe2::serialize::PyTorchStreamWriter&)>& write);
// Checks `path` as readArchiveFile does, then runs `read` on its records (read from the file
// as asked for); errors as readArchiveFile's.
ArchiveSum readRecordsFile(const std::string& path,
                           const std::function<void(caffe2::serialize::PyTorchStreamReader&)>& read,
                           const std::string& remedy = "");
// Whether `path` holds a zip of records with one named `name`: its header checked as
// readArchiveHeader does (a CheckpointError for a file that is no checkpoint), its CRC not;
// false where it has none (a LibTorch archive's records are its own) or its payload is no zip.
bool recordsFileHas(const std::string& path, const std::string& name);
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
