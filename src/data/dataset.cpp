// Helpers shared by the datasets (see dataset.h).
#include "data/dataset.h"

#include "core/errors.h"

namespace caravan {

Batch selectRows(const at::Tensor& input, const at::Tensor& target,
                 const std::vector<int64_t>& indices) {
  const int64_t n = input.size(0);
  for (int64_t i : indices) CARAVAN_CHECK(i >= 0 && i < n, "index {} of {}", i, n);
  // index_select reads the indices synchronously; no copy needed.
  const at::Tensor index =
      at::from_blob(const_cast<int64_t*>(indices.data()),
                    {static_cast<int64_t>(indices.size())}, at::TensorOptions(at::kLong));
  return Batch{input.index_select(0, index), target.index_select(0, index)};
}

}  // namespace caravan
