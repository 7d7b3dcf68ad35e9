// The all-reduce's bucket boundaries (see buckets.h).
#include "sync/buckets.h"

namespace caravan {

std::vector<size_t> bucketStarts(const std::vector<int64_t>& bytes, int64_t firstBucketBytes,
                                 int64_t bucketBytes) {
  std::vector<size_t> starts;
  int64_t filled = 0;  // bytes in the current bucket
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int64_t cap = starts.size() <= 1 ? firstBucketBytes : bucketBytes;
    if (starts.empty() || (filled > 0 && filled + bytes[i] > cap)) {
      starts.push_back(i);
      filled = 0;
    }
    filled += bytes[i];
  }
  return starts;
}

}  // namespace caravan
