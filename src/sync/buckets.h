// Where the all-reduce's gradient buckets begin: the one rule AllReduceStrategy forms its
// buckets by and the simulator (sim/simulator.cpp) predicts them by, so the two cannot drift
// apart (tests: Buckets.*).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace caravan {

// `bytes`: the tensors' sizes in the order their gradients become ready (backward's order: the
// last registered parameter first). A new bucket begins before a tensor that would take the
// current bucket past its cap, unless the bucket is still empty (a tensor larger than the cap
// goes alone); the first bucket's cap is `firstBucketBytes` (small, so communication starts
// early), every later one's `bucketBytes`. Returns the index of each bucket's first tensor, in
// order (0 first; empty when `bytes` is).
std::vector<size_t> bucketStarts(const std::vector<int64_t>& bytes, int64_t firstBucketBytes,
                                 int64_t bucketBytes);

}  // namespace caravan
