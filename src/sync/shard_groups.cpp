// Slicing and joining by a unit's groups (see shard_groups.h).
#include "sync/shard_groups.h"

#include <algorithm>

namespace caravan {

at::Tensor sliceOfGroups(const at::Tensor& whole, const std::vector<ShardGroup>& groups, int w,
                         int r) {
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  for (const ShardGroup& g : groups) {
    const int64_t s = g.padded / w;
    const int64_t begin = std::min(r * s, g.numel), end = std::min((r + 1) * s, g.numel);
    std::vector<int64_t> shape = whole.sizes().vec();
    shape.back() = s;
    at::Tensor part = at::zeros(shape, whole.options());
    part.narrow(-1, 0, end - begin).copy_(whole.narrow(-1, offset + begin, end - begin));
    parts.push_back(part);
    offset += g.numel;
  }
  return at::cat(parts, -1);
}

at::Tensor joinSlices(const std::vector<at::Tensor>& slices,
                      const std::vector<ShardGroup>& groups) {
  const auto w = static_cast<int64_t>(slices.size());
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  for (const ShardGroup& g : groups) {
    const int64_t s = g.padded / w;
    std::vector<at::Tensor> chunks;
    for (const at::Tensor& slice : slices) chunks.push_back(slice.narrow(-1, offset, s));
    parts.push_back(at::cat(chunks, -1).narrow(-1, 0, g.numel));
    offset += s;
  }
  return at::cat(parts, -1);
}

}  // namespace caravan
