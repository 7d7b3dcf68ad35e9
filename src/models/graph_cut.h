// Cutting a TorchScript module's forward into Caravan's blocks (models/script_model.h), found
// in the graph rather than declared.
//
// The block calls are the calls of the items of the module's repeated containers: the top-most
// nn.ModuleList and nn.Sequential attributes whose items are, half of them at least and two or
// more, of one class that is not torch.nn's own (GPT's `h`, ResNet's `layerK`, ViT's
// `encoder.layer`; not a head Sequential(Linear, ReLU, Linear)), or the ones `containers`
// names. A module that is itself a Sequential, or whose only child is one, is cut at its items;
// a module without a repeated container at its children's calls. The forward is
// inlined down to those calls (every method call of a module that holds a container, never an
// item's own), and then cut before each block call and after the last one, where exactly one
// activation crosses: a value computed before the cut and used after it. Constants and the
// module's attributes (parameters, submodules, flags) do not cross: each segment reads them
// from the module itself. The code before the first block call and after the last becomes a
// segment of its own ("prologue", "epilogue") when it computes anything.
//
// Values that carry no gradient do not count: the forward's input, what holds no tensor (a
// sequence length), and tensors computed from such values and buffers alone, reading no
// parameter (an attention mask, rotary tables). They cross in the model's context
// (BlockModel::context: one slot each; the segment that computes one writes it, later ones read
// it), so a GPT-2's or a Llama's layers are cut with the hidden state as the activation. A cut
// where several values that carry a gradient cross (a skip connection around it) is left out,
// and the note names them; a block call inside a branch or loop, or a forward with more inputs
// than (x) or (x, targets), leaves the module uncut (`segments` is empty, the note says why).
//
// Each segment is a graph function run on the module's own object, so the segments share its
// parameters: the tensors a segment reads are found in its graph (an
// attribute read, or a call of a submodule: all of that submodule's), not from module
// membership, since a tie made by tracing reads the shared weight through its owner's path.
// Threading: the result is used by one training thread (as the module).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/api/module.h>

namespace caravan {

struct GraphSegment {
  std::string label;  // the first block call's module path, "prologue" or "epilogue"
  // (self, x, the context slots it reads...) -> (its output, the slots it writes...)
  std::shared_ptr<torch::jit::GraphFunction> function;
  // The paths of the parameters and buffers it reads; the slots of the model's context it
  // reads and writes.
  std::vector<std::string> tensors;
  std::vector<size_t> contextReads, contextWrites;
};

struct GraphCut {
  std::vector<GraphSegment> segments;  // empty: not cut (note says why)
  size_t contextSlots = 0;             // values crossing cuts besides the activations
  std::string note;                    // why not cut, or which cuts were left out
  // A forward(x, targets) that returns its own loss (nanoGPT's (logits, loss)): the blocks are
  // cut in the part before the loss, which ends at the one value the loss reads (the output,
  // the logits); `loss` is the rest, loss(self, output, targets) -> the loss; `model` the part
  // before it uncut (the one block where it cannot be cut); `outputIndex` where the output is
  // in the tuple the forward returns (-1: it returns the loss alone). All null without.
  // `lossIndex`: where the loss is (-1: returned alone); `lossTensors`: the parameters and
  // buffers the loss reads (by path). `takesTargets`: the forward takes them, split or not.
  std::shared_ptr<torch::jit::GraphFunction> loss;
  std::shared_ptr<GraphSegment> model;
  int outputIndex = -1;
  int lossIndex = -1;
  std::vector<std::string> lossTensors;
  bool takesTargets = false;
};

// `containers`: the module paths whose items are the blocks ("" = the module itself); empty
// finds them (above). `namesPrefix`: what paths in `root` have in front of the user's names
// (caravan export's wrapper, "m."), left out of labels and messages. Throws ConfigError when a
// named path is no submodule with children.
GraphCut cutForward(const torch::jit::Module& root, const std::vector<std::string>& containers,
                    const std::string& namesPrefix = "");

// `path` as the user's module names it: without `namesPrefix` (caravan export's wrapper
// attribute, "m."), where it starts with it.
std::string withoutPrefix(const std::string& path, const std::string& namesPrefix);

// Runs a GraphCut's loss on `root`'s object (graph optimizations off, as runSegment).
at::Tensor runLoss(torch::jit::GraphFunction& loss, const torch::jit::Module& root,
                   const at::Tensor& output, const at::Tensor& target);

// Runs a segment on `root`'s object, with TorchScript's graph optimizations off (ordinary
// autograd per op, as the module's own forward runs in script_model.cpp): `x` its input,
// `context` the values crossing besides (BlockModel::context), read and written in its slots.
at::Tensor runSegment(const GraphSegment& segment, const torch::jit::Module& root,
                      const at::Tensor& x, std::vector<c10::IValue>& context);

}  // namespace caravan
