// A model written in Python PyTorch, scripted (torch.jit.script(module).save(path)) or traced
// (`caravan export`, tools/caravan_export.py) and loaded with LibTorch's TorchScript runtime, as
// a BlockModel: model.name = "torchscript".
//
// Blocks: the module's forward cut at the calls of its repeated layers (models/graph_cut.h:
// the containers model.blocks names, or by default those found in the graph), checked bitwise
// against the whole forward on a sample input, in eval mode and in training with gradients.
// Where it cannot be cut the module is one block, and BlockModel::structureNote says why (or,
// when cut, which cuts were left out). Each parameter and buffer is registered once, by the
// first block whose graph reads it, as "b<i>_<label>.<path>" (the very tensor the module uses,
// so an optimizer's in-place update is the module's): a tied weight is one parameter, and a
// block that reads another block's tensor is a BlockModel::SharedUse. Exported under every name
// the module has for it (BlockModel::exportNames; a file from caravan export without its
// wrapper's "m."), so model.pt loads with load_state_dict(strict=True).
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

// The blocks the loader's cut finds in the file at `path` (models/graph_cut.h), for caravan
// export: "blocks: 4 (prologue, vit.encoder.layer.0, ...)", or why it is one block. Without
// data, so without the bitwise check against the whole forward that training's load makes.
std::string describeScriptBlocks(const std::string& path);

}  // namespace caravan
