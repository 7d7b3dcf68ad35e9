// The training objective of each task kind, shared by the training step (train/step.h) and the
// memory planner's profiling step (memory/planner.h).
#pragma once

#include <ATen/core/Tensor.h>

#include "data/dataset.h"

namespace caravan {

// Mean cross-entropy of `output` against `target`:
// image: output [B, classes], target [B]; language model: output [B, T, V], target [B, T].
// Regression: mean squared error, output and target of one shape.
at::Tensor taskLoss(TaskKind task, const at::Tensor& output, const at::Tensor& target);

}  // namespace caravan
