// A sharded unit's groups (sync/sharding.h): how its elements are split over W ranks, and the
// slicing and joining of tensors by that split. Pure tensor functions (the checkpoint readers
// and the fuzz targets use them without the communicator). Threading: any thread.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace caravan {

// How a unit's elements are split over W ranks: groups of `numel` elements (back to back in the
// unit's parameter order), each padded to `padded`, a multiple of W; rank r's slice is its
// slice [r padded / W, (r+1) padded / W) of each group, group after group.
struct ShardGroup {
  int64_t numel = 0, padded = 0;
};
// Rank r's slice [..., sum padded / W] of `whole` [..., sum numel] (the last dimension split;
// zeros for the padding).
at::Tensor sliceOfGroups(const at::Tensor& whole, const std::vector<ShardGroup>& groups, int w,
                         int r);
// The inverse: every rank's slice (rank order, [..., sum padded / W] each) back into the whole
// [..., sum numel].
at::Tensor joinSlices(const std::vector<at::Tensor>& slices, const std::vector<ShardGroup>& groups);

}  // namespace caravan
