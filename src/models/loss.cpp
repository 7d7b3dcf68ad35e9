// Task losses (see loss.h).
#include "models/loss.h"

#include <ATen/ATen.h>

namespace caravan {

at::Tensor taskLoss(TaskKind task, const at::Tensor& output, const at::Tensor& target) {
  if (task == TaskKind::kLanguageModel) {
    // output [B, T, V] -> [B*T, V]; target [B, T] -> [B*T]
    return at::cross_entropy_loss(output.reshape({-1, output.size(-1)}), target.reshape({-1}));
  }
  if (task == TaskKind::kRegression) return at::mse_loss(output, target.to(output.scalar_type()));
  return at::cross_entropy_loss(output, target);
}

}  // namespace caravan
