// Block-structured models and the model registry.
//
// A model is an ordered list of blocks; block i's output is block i+1's input. The block list
// is the unit the memory planner (keep/swap/recompute per block) and pipeline stages (runs of
// consecutive blocks) operate on, so every model is written as blocks, never as one forward.
// Threading: a model is used by one training thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include "data/dataset.h"
#include "models/attention.h"

namespace caravan {

// What a config says about the model; DataShape supplies input/output sizes.
struct ModelSpec {
  std::string name = "cnn";  // mlp | cnn | resnet-mini | gpt
  int64_t width = 0;         // 0 = the model's default. mlp: hidden units; cnn/resnet: base
                             // channels; gpt: embedding size (d_model)
  int64_t depth = 0;         // 0 = default. mlp: hidden layers; resnet: residual blocks per
                             // stage; gpt: transformer blocks
  int64_t heads = 0;         // gpt: attention heads (0 = default)
  double dropout = 0.0;      // gpt and mlp: dropout probability
  std::string path;          // torchscript: the saved module
  std::string blocks;        // torchscript: the attribute holding the blocks ("" = children)
  std::string loss;          // torchscript: "" (the task's) | cross_entropy | mse | module
  // gpt: model.attention (models/attention.h).
  AttentionKernel attention = AttentionKernel::kExplicit;
};

// Runs one block's forward on behalf of BlockModel::forward: the memory executor
// (memory/executor.h) places what each block saves for backward this way.
class BlockRunner {
 public:
  virtual ~BlockRunner() = default;
  virtual torch::Tensor run(size_t index, torch::nn::AnyModule& block, torch::Tensor x) = 0;
};

class BlockModelImpl : public torch::nn::Module {
 public:
  using Context = std::vector<c10::IValue>;
  BlockModelImpl(std::string name, TaskKind task);

  // Appends a block; registers it as submodule "b<i>_<label>" (e.g. "b0_conv1"), so parameter
  // names are stable and readable: "b0_conv1.conv.weight".
  template <typename ModuleHolder>
  void addBlock(const std::string& label, ModuleHolder block) {
    register_module("b" + std::to_string(blocks_.size()) + "_" + label, block.ptr());
    blocks_.emplace_back(std::move(block));
    plain_.push_back(blocks_.back());
    labels_.push_back(label);
    usesContext_.push_back(false);
  }

  // Runs all blocks in order, through the runner if one is set. input/output shapes depend on
  // the task (see DataShape).
  torch::Tensor forward(torch::Tensor x);
  // Runs blocks [begin, end) only (a pipeline stage's), through the runner if one is set, on
  // `x` (block begin's input) and `context` (below: what earlier blocks of this forward put
  // there; the blocks' own are added to it).
  torch::Tensor forwardBlocks(torch::Tensor x, size_t begin, size_t end, Context& context);

  // Values that cross a block boundary besides the activation, for the forward that runs now: a
  // cut model's attention mask, rotary tables, sequence length (models/graph_cut.h), one slot
  // each (contextSlots()). The block that computes one puts it in its slot and later blocks
  // read it; they carry no gradient. forward() runs its blocks on a fresh context,
  // forwardBlocks on the one it is given (a pipeline stage's, received with the activation and
  // sent on with it); who runs one block alone (the memory executor's recomputation, the
  // planner's profile) sets the context that block's forward saw with a ContextScope.
  Context& context() { return *context_; }
  // What a block that uses the context holds to reach it (the model's, shared; a ContextScope
  // swaps its contents).
  std::shared_ptr<Context> contextHolder() const { return context_; }
  // While it lives, the model's context is `context` (swapped in; swapped back out, with what
  // the blocks added, when the scope ends).
  class ContextScope {
   public:
    ContextScope(BlockModelImpl& model, Context& context)
        : holder_(model.context_), context_(context) {
      std::swap(*holder_, context_);
    }
    ~ContextScope() { std::swap(*holder_, context_); }
    ContextScope(const ContextScope&) = delete;
    ContextScope& operator=(const ContextScope&) = delete;

   private:
    std::shared_ptr<Context> holder_;
    Context& context_;
  };
  size_t contextSlots() const { return contextSlots_; }
  void setContextSlots(size_t n) { contextSlots_ = n; }
  void setUsesContext(size_t i) { usesContext_.at(i) = true; }
  bool usesContext(size_t i) const { return usesContext_.at(i); }
  // nullptr = run blocks directly. The runner must outlive its use here.
  void setRunner(BlockRunner* runner) { runner_ = runner; }
  BlockRunner* runner() const { return runner_; }

  size_t numBlocks() const { return blocks_.size(); }
  // Mixed precision (train.precision, models/precision.h): block i runs under bf16 autocast
  // (its matrix products and convolutions in bfloat16, its floating outputs back to float32)
  // or in float32. Its parameters stay float32 either way: they are the master weights the
  // optimizer updates. block(i) is then a wrapper whose parameters() are the block's.
  void setBf16(size_t i, bool bf16);
  // Every block at once: bf16[i] for block i (one entry per block).
  void setBf16(const std::vector<bool>& bf16);
  bool bf16(size_t i) const { return blocks_.at(i).ptr() != plain_.at(i).ptr(); }
  torch::nn::AnyModule& block(size_t i) { return blocks_.at(i); }
  const std::string& blockLabel(size_t i) const { return labels_.at(i); }
  const std::string& modelName() const { return name_; }
  TaskKind task() const { return task_; }

  // The training objective on this model's output: taskLoss for the task unless another was
  // set (a scripted module's mse or its own loss method).
  using LossFunction =
      std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
  at::Tensor loss(const at::Tensor& output, const at::Tensor& target) const;
  void setLoss(LossFunction loss) { loss_ = std::move(loss); }

  // The name a parameter or buffer has for the user (model.pt): its own unless set (a scripted
  // module's tensors are registered here as "b<i>_<label>.<path>" and exported by the names
  // they have in the user's Python module). exportNames: every name, the first being
  // exportName (a tied tensor is one parameter here and both of its names in model.pt).
  std::string exportName(const std::string& name) const;
  std::vector<std::string> exportNames(const std::string& name) const;
  void addExportName(const std::string& name, const std::string& exported) {
    exportNames_[name].push_back(exported);
  }
  // A buffer the user's module keeps out of its state_dict (persistent=False): no name in
  // model.pt (exportNames is empty), its own in messages.
  void keepOutOfExport(const std::string& name) { exportNames_[name].clear(); }

  // A parameter or buffer that block `user` reads and block `owner` registers (a tied weight,
  // or a tensor two blocks share): one tensor, one gradient that autograd sums over its uses.
  // Out-of-core weights and a pipeline that puts the two blocks on two stages do not hold it
  // on both, and refuse it.
  struct SharedUse {
    std::string name;  // the registered name (named_parameters / named_buffers)
    size_t owner = 0;
    size_t user = 0;
  };
  const std::vector<SharedUse>& sharedUses() const { return sharedUses_; }
  // Block i's buffers: its own and those it reads of other blocks (SharedUse), which a
  // recomputation of block i must put back as it must its own.
  std::vector<at::Tensor> blockBuffers(size_t i);
  void addSharedUse(SharedUse use) { sharedUses_.push_back(std::move(use)); }

  // Why the model is one block where the planner would want several, or where a found cut
  // into blocks was left out (models/graph_cut.h); "" when neither.
  const std::string& structureNote() const { return structureNote_; }
  void setStructureNote(std::string note) { structureNote_ = std::move(note); }

  // Forward-pass floating-point operations per example (multiply-add = 2 FLOPs), counted
  // analytically over matrix multiplies and convolutions; a training step is ~3x this.
  double forwardFlopsPerExample() const { return forwardFlops_; }
  void setForwardFlopsPerExample(double f) { forwardFlops_ = f; }

 private:
  std::string name_;
  TaskKind task_;
  std::vector<torch::nn::AnyModule> blocks_;  // what runs: a block or its bf16 wrapper
  std::vector<torch::nn::AnyModule> plain_;   // the blocks as added
  std::vector<std::string> labels_;
  std::vector<bool> usesContext_;  // by block
  size_t contextSlots_ = 0;
  std::shared_ptr<Context> context_ = std::make_shared<Context>();
  double forwardFlops_ = 0.0;
  BlockRunner* runner_ = nullptr;
  LossFunction loss_;
  std::map<std::string, std::vector<std::string>> exportNames_;
  std::vector<SharedUse> sharedUses_;
  std::string structureNote_;
};
TORCH_MODULE(BlockModel);

// Builds a model by name. Parameters are initialized from the current default generator, so
// the caller seeds it (seed.init) first. Throws ConfigError for an unknown name or sizes that
// do not fit the data (e.g. heads not dividing width).
BlockModel buildModel(const ModelSpec& spec, const DataShape& shape);

// Names the registry knows, for --help and error messages.
std::vector<std::string> modelNames();

}  // namespace caravan
