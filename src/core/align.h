// Rounding sizes and offsets up to an alignment, the one rule the files that lay tensors end to
// end in one buffer (tier pieces, offloaded weights, a pipeline stage's payload) and the tier's
// direct I/O share.
#pragma once

#include <cstdint>

namespace caravan {

// Where one buffer holds several tensors, each starts at a multiple of this (a cache line).
inline constexpr int64_t kTensorAlign = 64;

// The smallest multiple of `to` (> 0) that is >= n (n >= 0).
constexpr int64_t alignUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

}  // namespace caravan
