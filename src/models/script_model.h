// A model written in Python PyTorch, scripted (torch.jit.script(module).save(path)) and loaded
// with LibTorch's TorchScript runtime, as a BlockModel: model.name = "torchscript".
//
// Blocks: the items of the attribute `model.blocks` names (an nn.Sequential or nn.ModuleList),
// or by default the module's children; either only when the module's forward is exactly those
// blocks applied in order (checked bitwise on a sample input, in eval mode). Otherwise the
// module is one block, and BlockModel::structureNote says why. Each block's parameters and
// buffers are registered on the BlockModel as "b<i>_<label>.<path>" (the very tensors the
// scripted module uses, so an optimizer's in-place update is the module's), exported under the
// module's own names (BlockModel::exportName), so model.pt loads with load_state_dict(strict).
//
// Scripted blocks run with TorchScript's graph optimizations off: every op records ordinary
// autograd (no fused or symbolically differentiated graphs), so Caravan's saved-tensor engine
// sees what each block saves, and results match eager PyTorch.
//
// Loss (model.loss): "" or cross_entropy (the task's), mse, or module (the module's
// loss(output, target) method). Parameters must be float32. The file is code: trusted as a
// checkpoint is (docs/reliability.md). Threading: as BlockModel.
#pragma once

#include "models/model.h"

namespace caravan {

inline constexpr const char* kScriptModelName = "torchscript";

// Throws ConfigError with one line for a file that is not a TorchScript module, blocks that do
// not make up the forward, parameters that are not float32, an output that does not fit the
// data, or a loss the module lacks.
BlockModel loadScriptModel(const ModelSpec& spec, const DataShape& shape);

}  // namespace caravan
