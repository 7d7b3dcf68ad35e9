// TorchScript modules as BlockModels (see script_model.h).
#include "models/script_model.h"

#include <unistd.h>

#include <algorithm>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/script.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/rng.h"
#include "core/scope_guard.h"
#include "models/graph_cut.h"

namespace caravan {
namespace {

namespace jit = torch::jit;

std::string firstLine(const std::string& text) {
  const std::string line = text.substr(0, text.find('\n'));
  return line.size() > 200 ? line.substr(0, 200) + "..." : line;
}

// TorchScript's interpreter errors end with the error itself ("RuntimeError: ..."); a
// c10::Error's what() ends with a C++ backtrace instead.
std::string lastLine(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  const std::string text = c10 != nullptr ? c10->what_without_backtrace() : e.what();
  const size_t end = text.find_last_not_of(" \n");
  if (end == std::string::npos) return "";
  const size_t newline = text.rfind('\n', end);
  const size_t begin = newline == std::string::npos ? 0 : newline + 1;
  return firstLine(text.substr(begin, end + 1 - begin));
}

std::string shapeText(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "] " + std::string(c10::toString(t.scalar_type()));
}

// Why jit::load refused `path`, in one line: an operator this LibTorch does not have (a model
// saved by a newer torch: F.scaled_dot_product_attention, nn.RMSNorm on 1.13), or what the
// error says first (its what() starts with a line break: the reason used to print as "()").
std::string whyNotLoadable(const std::string& path, const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  const std::string text = c10 != nullptr ? c10->what_without_backtrace() : e.what();
  static const std::regex unknownOp(
      R"(Unknown builtin op: ([A-Za-z_][A-Za-z0-9_:.]*[A-Za-z0-9_]))");
  std::smatch op;
  if (std::regex_search(text, op, unknownOp)) {
    const std::string name = op[1].str();
    const std::string space = name.substr(0, name.find("::"));
    if (space != "aten" && space != "prim" && space != "quantized") {  // torchvision::nms, ...
      return fmt::format(
          "model.path {} calls the operator {} of a library Caravan does not load ({}); export "
          "the model without it",
          path, name, space);
    }
    return fmt::format(
        "model.path {} calls the operator {}, which this LibTorch ({}.{}.{}) does not have: it "
        "was saved by a newer torch; save it with torch {}.{} or older, or without that operator",
        path, name, TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH,
        TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);
  }
  const size_t start = text.find_first_not_of(" \n");
  return fmt::format(
      "model.path {} is not a TorchScript module ({}); save one in Python with "
      "torch.jit.script(model).save(path)",
      path, start == std::string::npos ? std::string() : firstLine(text.substr(start)));
}

// A block candidate: a segment of the module's forward (graph_cut.h), or the whole forward.
struct Part {
  std::string label;
  std::shared_ptr<GraphSegment> segment;  // nullptr: the module's forward
};

at::Tensor run(jit::Module& module, const at::Tensor& x);

// `context`: what crosses the parts besides `x` (BlockModel::context), read and written.
at::Tensor run(jit::Module& root, const Part& part, const at::Tensor& x,
               BlockModelImpl::Context& context) {
  return part.segment ? runSegment(*part.segment, root, x, context) : run(root, x);
}

// A parameter or buffer of the module, by its path there.
struct Slot {
  std::string path;
  at::Tensor tensor;
  bool parameter = true;
};

// Registers `slot` on `into` under its path ("h.0.attn.c_attn.weight": submodules h, 0, attn,
// c_attn), the very tensor, so an update through either is seen by both.
void registerAt(torch::nn::Module& into, const Slot& slot) {
  torch::nn::Module* m = &into;
  size_t at = 0;
  for (size_t dot; (dot = slot.path.find('.', at)) != std::string::npos; at = dot + 1) {
    const std::string part = slot.path.substr(at, dot - at);
    auto children = m->named_children();
    if (!children.contains(part)) m->register_module(part, std::make_shared<torch::nn::Module>());
    m = m->named_children()[part].get();
  }
  const std::string name = slot.path.substr(at);
  if (slot.parameter) {
    m->register_parameter(name, slot.tensor, slot.tensor.requires_grad());
  } else {
    m->register_buffer(name, slot.tensor);
  }
}

// One block: a part of the module run with graph optimizations off (script_model.h). It
// registers the tensors it owns (its own, and a tied or shared one where it is first used).
// `context`: the model's (BlockModel::contextHolder).
class ScriptBlockImpl : public torch::nn::Module {
 public:
  ScriptBlockImpl(jit::Module root, Part part, const std::vector<Slot>& owned,
                  std::shared_ptr<BlockModelImpl::Context> context)
      : root_(std::move(root)), part_(std::move(part)), context_(std::move(context)) {
    for (const Slot& s : owned) registerAt(*this, s);
  }
  torch::Tensor forward(torch::Tensor x) { return run(root_, part_, x, *context_); }
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    if (root_.is_training() != on) root_.train(on);
  }

 private:
  jit::Module root_;
  Part part_;
  std::shared_ptr<BlockModelImpl::Context> context_;
};
TORCH_MODULE(ScriptBlock);

// A batch of two like the data's, from a generator of its own (the default one is seeded for
// the run and must not move).
at::Tensor sampleInput(const DataShape& shape, int64_t tokens) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(20231201);
  if (!shape.inputShape.empty()) {  // the data says its examples' shape (arrays)
    std::vector<int64_t> dims{2};
    dims.insert(dims.end(), shape.inputShape.begin(), shape.inputShape.end());
    if (shape.inputType == at::kLong) {
      return at::randint(std::max<int64_t>(shape.vocabSize, 1), dims, generator,
                         at::TensorOptions(at::kLong));
    }
    return at::randn(dims, generator);
  }
  if (shape.task == TaskKind::kLanguageModel) {
    return at::randint(shape.vocabSize, {2, std::min<int64_t>(shape.seqLen, tokens)}, generator,
                       at::TensorOptions(at::kLong));
  }
  return at::randn({2, shape.channels, shape.height, shape.width}, generator);
}

// The default generator's state (seeded for the run) and `root`'s buffers (batch norm's running
// statistics), to put back after a probe of the module.
class ModuleSnapshot {
 public:
  explicit ModuleSnapshot(const jit::Module& root) : rng_(defaultRngState()) {
    for (const auto& b : root.named_buffers(true)) {
      buffers_.push_back(b.value);
      saved_.push_back(b.value.clone());
    }
  }
  void restore() {
    at::NoGradGuard noGrad;
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(saved_[i]);
    setDefaultRngState(rng_);
  }

 private:
  at::Tensor rng_;
  std::vector<at::Tensor> buffers_, saved_;
};

// Targets for the batch `x` like the data's: class ids, next tokens or regression values.
at::Tensor sampleTarget(const DataShape& shape, const at::Tensor& x) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(20231202);
  std::vector<int64_t> dims{x.size(0)};
  if (!shape.targetShape.empty()) {
    dims.insert(dims.end(), shape.targetShape.begin(), shape.targetShape.end());
  } else if (shape.task == TaskKind::kLanguageModel) {
    dims.push_back(x.size(1));
  }
  if (shape.task == TaskKind::kRegression || isFloatingType(shape.targetType)) {
    return at::randn(dims, generator, at::TensorOptions(shape.targetType));
  }
  const int64_t classes =
      shape.task == TaskKind::kLanguageModel ? shape.vocabSize : shape.numClasses;
  return at::randint(std::max<int64_t>(classes, 1), dims, generator, at::TensorOptions(at::kLong));
}

// Why `call(output)` (a loss of the output and `target`, `what` in messages) cannot be the
// training loss ("" when it can): on the sample it must return one floating-point number that
// depends on the output. The RNG and the module's buffers are as before afterwards.
std::string whyNotLossOn(jit::Module& root,
                         const std::function<c10::IValue(const at::Tensor&)>& call,
                         const at::Tensor& output, const at::Tensor& target,
                         const std::string& what) {
  // As the run left them afterwards: the RNG (seeded for the run) and buffers a loss updates.
  ModuleSnapshot snapshot(root);
  const auto restore = onScopeExit([&] { snapshot.restore(); });
  c10::IValue value;
  // As training calls it: an output that is not a leaf (a loss may change it in place).
  const at::Tensor in = output.detach().requires_grad_(true).clone();
  try {
    jit::GraphOptimizerEnabledGuard plain(false);
    at::AutoGradMode enable(true);
    value = call(in);
  } catch (const std::exception& e) {
    return fmt::format("{} fails on output {} and target {} ({})", what, shapeText(output),
                       shapeText(target), lastLine(e));
  }
  if (!value.isTensor()) {
    return fmt::format("it returns {}; Caravan expects one number (a 0-dimensional Tensor)",
                       value.tagKind());
  }
  const at::Tensor t = value.toTensor();
  if (t.numel() != 1 || !t.is_floating_point()) {  // a [1] loss backpropagates as a scalar
    return fmt::format(
        "it returns a Tensor {}; Caravan expects one floating-point number (a "
        "0-dimensional Tensor: reduce it, e.g. .mean())",
        shapeText(t));
  }
  if (!t.requires_grad()) {  // backward would fail: "element 0 of tensors does not require grad"
    return "its value does not depend on the output (no gradient reaches the model through it)";
  }
  return "";
}

// Why the module's `loss` method cannot be the training loss ("" when it can): it must take
// (output, target), more arguments only with defaults, and return one floating-point number.
std::string whyNotALoss(jit::Module& root, const at::Tensor& output, const at::Tensor& target) {
  const auto method = root.find_method("loss");
  const auto& arguments = method->function().getSchema().arguments();  // self included
  size_t required = 0;
  for (const auto& a : arguments) required += !a.default_value().has_value();
  if (required > 3 || arguments.size() < 3) {
    const size_t n = (arguments.size() < 3 ? arguments.size() : required) - 1;
    return fmt::format("it {} {} argument{}; Caravan calls loss(output, target)",
                       arguments.size() < 3 ? "takes" : "needs", n, n == 1 ? "" : "s");
  }
  return whyNotLossOn(
      root, [&](const at::Tensor& in) { return root.run_method("loss", in, target); }, output,
      target, "loss(output, target)");
}

// Why the loss a forward(x, targets) returns cannot be the training loss ("" when it can).
std::string whyNotOwnLoss(jit::GraphFunction& loss, jit::Module& root, const at::Tensor& output,
                          const at::Tensor& target) {
  return whyNotLossOn(
      root, [&](const at::Tensor& in) { return c10::IValue(runLoss(loss, root, in, target)); },
      output, target, "the forward's loss");
}

// The output shape the loss needs on input `x`, or "" when any fits (the module's own loss).
std::string neededOutput(const ModelSpec& spec, const DataShape& shape, const at::Tensor& x,
                         const at::Tensor& out) {
  const bool regression = shape.task == TaskKind::kRegression;
  const std::string& loss = spec.loss;
  if (loss == "module") return "";
  if (loss == "mse" && !regression) {
    // Integer targets as numbers: the output must have their shape ([batch] for class ids).
    const at::Tensor target = sampleTarget(shape, x);
    if (out.sizes().equals(target.sizes())) return "";
    throw ConfigError(fmt::format(
        "model.path {}: model.loss = 'mse' compares the output with this data's {} targets, {} "
        "on input {}, but the module gives {}; use model.loss = 'cross_entropy' for class ids, "
        "or give outputs of the targets' shape",
        spec.path, c10::toString(shape.targetType), shapeText(target), shapeText(x),
        shapeText(out)));
  }
  if (loss == "cross_entropy" && regression) {
    throw ConfigError(fmt::format(
        "model.loss = 'cross_entropy' needs integer class targets, but this data's targets are "
        "{} (regression); use model.loss = 'mse' or leave it empty",
        at::toString(shape.targetType)));
  }
  std::vector<int64_t> want{x.size(0)};
  std::string what;
  if (regression) {
    want.insert(want.end(), shape.targetShape.begin(), shape.targetShape.end());
    what = "[batch, ...] as the targets (mean squared error)";
  } else if (shape.task == TaskKind::kLanguageModel) {
    if (shape.targetShape.empty()) {
      want.push_back(x.size(1));
    } else {
      want.insert(want.end(), shape.targetShape.begin(), shape.targetShape.end());
    }
    want.push_back(shape.vocabSize);
    what = fmt::format("[batch, seq, {}] (the vocabulary)", shape.vocabSize);
  } else {
    want.push_back(shape.numClasses);
    what = fmt::format("[batch, {}] (the classes)", shape.numClasses);
  }
  return out.sizes().vec() == want ? "" : what;
}

at::Tensor run(jit::Module& module, const at::Tensor& x) {
  jit::GraphOptimizerEnabledGuard plain(false);
  const c10::IValue out = module.forward({x});
  if (!out.isTensor()) {
    throw ConfigError(
        fmt::format("the module's forward returns {}; Caravan trains a forward "
                    "that returns one Tensor",
                    out.tagKind()));
  }
  return out.toTensor();
}

// Every parameter and buffer of `m` under each of its paths (a tied tensor under all its
// names), parameters first, in the module's order.
void slotsOf(const jit::Module& m, const std::string& prefix, std::vector<Slot>& out) {
  for (const auto& p : m.named_parameters(false)) {
    out.push_back({prefix.empty() ? p.name : prefix + "." + p.name, p.value, true});
  }
  for (const auto& b : m.named_buffers(false)) {
    out.push_back({prefix.empty() ? b.name : prefix + "." + b.name, b.value, false});
  }
  for (const auto& c : m.named_children()) {
    slotsOf(c.value, prefix.empty() ? c.name : prefix + "." + c.name, out);
  }
}

// model.blocks as container paths in the file, each behind `namesPrefix` (caravan export's
// wrapper): "" or "auto" finds them ("none": not cut at all); else a path or a comma-separated
// list of paths.
std::vector<std::string> blockHolders(const std::string& blocks, const std::string& namesPrefix) {
  std::vector<std::string> out;
  if (blocks.empty() || blocks == "auto" || blocks == "none") return out;
  for (const std::string& path : listItems(blocks)) {
    if (!path.empty()) out.push_back(namesPrefix + path);
  }
  return out;
}

// `root`'s forward (`forwardWhole`: up to the output) and `parts` applied in order on `x`, in
// training mode with gradients: from
// the same RNG state (dropout) and the same buffers (batch norm's running statistics, restored
// afterwards, as are the RNG and every gradient), outputs and, for a floating-point input, the
// input's gradient compared bitwise ("" when equal). Catches what eval mode hides: dropout or
// `self.training` branches between the parts, a detach() between them.
using Forward = std::function<at::Tensor(const at::Tensor&)>;

std::string whyNotSequentialInTraining(jit::Module& root, std::vector<Part>& parts,
                                       const at::Tensor& x, const Forward& forwardWhole) {
  ModuleSnapshot snapshot(root);
  std::vector<at::Tensor> params;
  for (const auto& p : root.named_parameters(true)) params.push_back(p.value);
  auto restore = [&] {
    snapshot.restore();
    for (auto& p : params) p.mutable_grad() = at::Tensor();
  };
  auto pass = [&](const std::function<at::Tensor(const at::Tensor&)>& forward) {
    restore();
    at::Tensor in = x.is_floating_point() ? x.clone().requires_grad_(true) : x;
    at::Tensor out = forward(in);
    at::Tensor grad;
    if (in.requires_grad() && out.requires_grad()) {
      out.sum().backward();
      grad = in.grad();
    }
    return std::make_pair(out.detach(), grad);
  };
  root.train();
  std::string why;
  try {
    const auto whole = pass(forwardWhole);
    const auto split = pass([&](const at::Tensor& in) {
      at::Tensor y = in;
      BlockModelImpl::Context context;
      for (const Part& p : parts) y = run(root, p, y, context);
      return y;
    });
    auto same = [](const at::Tensor& a, const at::Tensor& b) {
      return a.defined() == b.defined() &&
             (!a.defined() || (a.sizes().equals(b.sizes()) && a.scalar_type() == b.scalar_type() &&
                               at::equal(a, b)));
    };
    if (!same(whole.first, split.first)) {
      why =
          "in training its forward is not them applied in order (dropout or a self.training "
          "branch between them?)";
    } else if (!same(whole.second, split.second)) {
      why = "in training its gradients are not theirs in order (a detach() between them?)";
    }
  } catch (const std::exception& e) {
    why = fmt::format("training them in order fails ({})", lastLine(e));
  }
  restore();
  return why;
}

// Why `parts` do not make up `root`'s forward on `x` ("" when they do, bitwise): in eval mode
// without gradients their output must be the forward's; then as whyNotSequentialInTraining.
std::string whyNotSequential(jit::Module& root, std::vector<Part>& parts, const at::Tensor& x,
                             const Forward& forwardWhole) {
  if (parts.size() < 2) return "it has fewer than two parts";
  {
    // Both from the same RNG state and buffers: a traced forward keeps its dropout (the
    // training flag is fixed at trace) and its batch norm updates statistics.
    ModuleSnapshot snapshot(root);
    const auto restore = onScopeExit([&] { snapshot.restore(); });
    at::NoGradGuard noGrad;
    root.eval();
    at::Tensor whole, y = x;
    BlockModelImpl::Context context;
    try {
      whole = forwardWhole(x);
      snapshot.restore();
      for (const Part& p : parts) y = run(root, p, y, context);
    } catch (const std::exception& e) {
      return fmt::format("applying them in order fails ({})", lastLine(e));
    }
    if (!y.sizes().equals(whole.sizes()) || y.scalar_type() != whole.scalar_type() ||
        !at::equal(y, whole)) {
      return "its forward is not them applied in order";
    }
  }
  return whyNotSequentialInTraining(root, parts, x, forwardWhole);
}

// The forward up to the output (the whole forward, or up to the output its own loss reads),
// as the module runs it; `targetFor(x)`: targets for a forward(x, targets).
Forward forwardUpToOutput(jit::Module root, const GraphCut& cut,
                          std::function<at::Tensor(const at::Tensor&)> targetFor) {
  return [root, &cut, targetFor](const at::Tensor& in) mutable -> at::Tensor {
    if (!cut.loss) return run(root, in);
    BlockModelImpl::Context none;
    if (cut.outputIndex < 0) return runSegment(*cut.model, root, in, none);
    jit::GraphOptimizerEnabledGuard plain(false);
    const c10::IValue out = root.forward({in, targetFor(in)});
    return out.toTupleRef().elements().at(static_cast<size_t>(cut.outputIndex)).toTensor();
  };
}

// Why the loss split from a forward(x, targets) is not the loss that forward returns on the
// sample ("" when it is, bitwise): in eval mode without gradients, from the same RNG state,
// the forward's own loss against the split loss of the output `output` the forward gave.
std::string whyNotTheForwardsLoss(jit::GraphFunction& loss, int lossIndex, jit::Module& root,
                                  const at::Tensor& x, const at::Tensor& target,
                                  const at::Tensor& output) {
  ModuleSnapshot snapshot(root);
  const auto restore = onScopeExit([&] { snapshot.restore(); });
  at::NoGradGuard noGrad;
  root.eval();
  at::Tensor theirs, ours;
  try {
    jit::GraphOptimizerEnabledGuard plain(false);
    const c10::IValue out = root.forward({x, target});
    theirs = lossIndex < 0
                 ? out.toTensor()
                 : out.toTupleRef().elements().at(static_cast<size_t>(lossIndex)).toTensor();
    snapshot.restore();
    ours = runLoss(loss, root, output, target);
  } catch (const std::exception& e) {
    return fmt::format("the forward or its loss fails on the sample ({})", lastLine(e));
  }
  root.train();
  if (!theirs.sizes().equals(ours.sizes()) || !at::equal(theirs, ours)) {
    return "the loss split from its forward is not the loss it returns";
  }
  return "";
}

// A loss computed by the scripted module, run in the model's mode: the module's own mode is not
// set by the blocks' train(), and a loss may branch on self.training. The model owns the
// function, so `self` outlives it.
BlockModelImpl::LossFunction inModelMode(
    jit::Module root, BlockModelImpl* self,
    std::function<at::Tensor(jit::Module&, const at::Tensor&, const at::Tensor&)> loss) {
  return [root, self, loss](const at::Tensor& output, const at::Tensor& target) mutable {
    if (root.is_training() != self->is_training()) root.train(self->is_training());
    return loss(root, output, target);
  };
}

// A TorchScript file and what `caravan export` (tools/caravan_export.py) says of it in
// caravan/export.json: the wrapper's attribute in front of the module's own names, and the
// blocks asked for at export.
struct Loaded {
  jit::Module root;
  std::string namesPrefix;
  std::string blocks;
  std::set<std::string> nonPersistent;  // buffers the module's state_dict leaves out (its names)
  std::vector<int64_t> exampleShape;    // the input it was traced on ([] when not said)
  std::string exampleDtype;             // "torch.int64", "torch.float32"
};

Loaded load(const std::string& path) {
  Loaded out;
  try {
    jit::ExtraFilesMap extra{{"caravan/export.json", ""}};
    out.root = jit::load(path, std::nullopt, extra);
    if (!extra["caravan/export.json"].empty()) {
      const auto meta = nlohmann::json::parse(extra["caravan/export.json"]);
      out.namesPrefix = meta.value("names_prefix", "");
      out.blocks = meta.value("blocks", "");
      out.nonPersistent = meta.value("non_persistent", std::set<std::string>());
      if (meta.contains("example")) {
        out.exampleShape = meta["example"].value("shape", std::vector<int64_t>());
        out.exampleDtype = meta["example"].value("dtype", "");
      }
    }
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(
        fmt::format("model.path {}: its caravan/export.json is not JSON ({}); "
                    "export the model again with caravan export",
                    path, e.what()));
  } catch (const std::exception& e) {
    throw ConfigError(whyNotLoadable(path, e));
  }
  return out;
}

}  // namespace

BlockModel loadScriptModel(const ModelSpec& spec, const DataShape& shape) {
  if (spec.path.empty()) {
    throw ConfigError(
        "model.name = 'torchscript' needs model.path: the file "
        "torch.jit.script(model).save(path) wrote");
  }
  std::string why;
  const int fd = openRegularFile(spec.path, &why);
  if (fd < 0) throw ConfigError(fmt::format("model.path {} {}", spec.path, why));
  ::close(fd);
  Loaded loaded = load(spec.path);
  jit::Module& root = loaded.root;
  const std::string& namesPrefix = loaded.namesPrefix;
  const std::set<std::string>& nonPersistent = loaded.nonPersistent;
  if (!root.find_method("forward")) {
    throw ConfigError(
        fmt::format("model.path {} has no forward method: script an nn.Module "
                    "(torch.jit.script(model)), not a function",
                    spec.path));
  }
  bool trainable = false;
  for (const auto& p : root.named_parameters(true))
    trainable = trainable || p.value.requires_grad();
  if (!trainable) {
    throw ConfigError(
        fmt::format("model.path {} has no parameters to train (a scripted function, a module "
                    "without parameters, or one whose parameters are all frozen); script an "
                    "nn.Module with trainable parameters",
                    spec.path));
  }
  for (const auto& p : root.named_parameters(true)) {
    if (p.value.scalar_type() != at::kFloat) {
      throw ConfigError(
          fmt::format("model.path {}: parameter {} is {}; Caravan trains float32 "
                      "parameters (model.float() before scripting)",
                      spec.path, p.name, c10::toString(p.value.scalar_type())));
    }
  }

  // The cut into blocks (graph_cut.h) first: a forward with a loss of its own needs the targets
  // to run. The containers: model.blocks, else what caravan export was given (--blocks), in the
  // user's names (under the export's wrapper attribute in the file); "auto" finds them.
  const std::string& blocksAsked = spec.blocks.empty() ? loaded.blocks : spec.blocks;
  const std::string blocksSource =
      spec.blocks.empty() && !loaded.blocks.empty() ? "caravan export --blocks" : "model.blocks";
  const std::vector<std::string> holders = blockHolders(blocksAsked, namesPrefix);
  const bool asOne = blocksAsked == "none";  // asked to train it as one block
  GraphCut cut;
  try {
    cut = cutForward(root, holders, namesPrefix);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("model.path {}: {} = '{}': {}", spec.path, blocksSource,
                                  blocksAsked, e.what()));
  }
  if (asOne) cut.segments.clear();
  if (cut.takesTargets && !cut.loss) {
    throw ConfigError(fmt::format(
        "model.path {}: its forward takes (x, targets), but Caravan cannot tell its loss from "
        "its output: {}; export it with an example input alone (caravan export), or return "
        "(logits, loss)",
        spec.path, cut.note));
  }
  // With a loss of its own (forward(x, targets) returning it) and no other asked for.
  const bool ownLoss = cut.loss != nullptr && spec.loss.empty();

  const Forward forwardWhole =
      forwardUpToOutput(root, cut, [&](const at::Tensor& in) { return sampleTarget(shape, in); });

  // The whole forward on a sample, in eval mode (no dropout) and without gradients: sequences
  // of 16 tokens, or of data.seq_len for a module that needs exactly that many.
  at::Tensor x = sampleInput(shape, 16);
  at::Tensor whole;
  {
    at::NoGradGuard noGrad;
    root.eval();
    auto forward = [&]() -> std::string {
      try {
        whole = forwardWhole(x);
        return "";
      } catch (const ConfigError& e) {  // it returned something else than a Tensor
        throw ConfigError(fmt::format("model.path {}: {}", spec.path, e.what()));
      } catch (const Error&) {
        throw;
      } catch (const std::exception& e) {
        return lastLine(e);
      }
    };
    std::string failed = forward();
    if (!failed.empty() && shape.task == TaskKind::kLanguageModel && shape.seqLen > 16) {
      x = sampleInput(shape, shape.seqLen);
      failed = forward();
    }
    if (!failed.empty()) {
      throw ConfigError(
          fmt::format("model.path {}: its forward fails on a batch like the data's "
                      "({}): {}",
                      spec.path, shapeText(x), failed));
    }
  }
  if (!whole.is_floating_point()) {
    throw ConfigError(
        fmt::format("model.path {}: on input {} its forward returns a Tensor {}; Caravan "
                    "trains a forward that returns floating-point outputs (logits or "
                    "predictions)",
                    spec.path, shapeText(x), shapeText(whole)));
  }
  const std::string needed = ownLoss ? "" : neededOutput(spec, shape, x, whole);
  if (!needed.empty()) {
    throw ConfigError(
        fmt::format("model.path {}: on input {} it gives {}, but the loss on this "
                    "data needs {}",
                    spec.path, shapeText(x), shapeText(whole), needed));
  }

  // The blocks: the cut, checked to be the forward bitwise; else the module is one block and
  // the note says why.
  std::vector<Part> parts;
  std::string note;
  for (auto& segment : cut.segments) {
    parts.push_back({segment.label, std::make_shared<GraphSegment>(std::move(segment))});
  }
  note = cut.note;
  if (parts.size() >= 2) {
    const std::string whyNot = whyNotSequential(root, parts, x, forwardWhole);
    if (!whyNot.empty()) {
      note = fmt::format("its forward cut at the block calls is not the forward: {}", whyNot);
      parts.clear();
    }
  }
  if (parts.size() < 2) {
    if (!holders.empty() && !asOne) {
      throw ConfigError(fmt::format(
          "{} = '{}': the forward of {} cannot be cut at those blocks: {}; name other "
          "containers in model.blocks, or set it to 'auto' (found in the graph, one block "
          "where none is) or 'none'",
          blocksSource, blocksAsked, spec.path, note));
    }
    if (asOne) {
      note = blocksSource + " = 'none': the module trains as one block";
    } else {
      if (note.empty()) note = "its forward has no block calls to cut at";
      note = fmt::format("the module is not cut into blocks ({}); it trains as one block", note);
    }
    parts = {{"module", cut.model}};  // with its own loss: the forward up to the output
  }
  root.train();

  // Each tensor is registered once, by the first part that reads it (a tied or shared tensor
  // is one parameter: one gradient, one optimizer state); one that no part reads, by part 0.
  // Under every name it has in the module (a tied pair's both) in model.pt.
  std::vector<Slot> slots;
  slotsOf(root, "", slots);
  std::map<const void*, size_t> owner;
  std::vector<std::set<const void*>> reads(parts.size());
  std::map<std::string, const void*> byPath;
  for (const Slot& s : slots) byPath[s.path] = s.tensor.unsafeGetTensorImpl();
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!parts[i].segment) {
      for (const Slot& s : slots) reads[i].insert(s.tensor.unsafeGetTensorImpl());
    } else {
      for (const std::string& path : parts[i].segment->tensors) reads[i].insert(byPath.at(path));
    }
    // The loss of a forward(x, targets) runs after the last block: what it reads is read there.
    if (ownLoss && i + 1 == parts.size()) {
      for (const std::string& path : cut.lossTensors) reads[i].insert(byPath.at(path));
    }
    for (const void* t : reads[i]) owner.emplace(t, i);
  }
  BlockModel model(std::string(kScriptModelName), shape.task);
  if (parts.size() >= 2) model->setContextSlots(cut.contextSlots);
  std::set<const void*> registered;
  std::map<const void*, std::string> registeredName;
  for (size_t i = 0; i < parts.size(); ++i) {
    std::vector<Slot> owned;
    for (const Slot& s : slots) {
      const void* t = s.tensor.unsafeGetTensorImpl();
      const auto o = owner.find(t);
      if ((o == owner.end() ? 0 : o->second) != i || !registered.insert(t).second) continue;
      owned.push_back(s);
    }
    std::string label = parts[i].label;
    std::replace(label.begin(), label.end(), '.', '_');
    const std::string prefix = "b" + std::to_string(i) + "_" + label;
    for (const Slot& s : owned) {
      registeredName[s.tensor.unsafeGetTensorImpl()] = prefix + "." + s.path;
    }
    model->addBlock(label, ScriptBlock(root, parts[i], owned, model->contextHolder()));
    const auto& segment = parts[i].segment;
    if (segment && !(segment->contextReads.empty() && segment->contextWrites.empty())) {
      model->setUsesContext(i);
    }
  }
  for (const Slot& s : slots) {
    const std::string name = withoutPrefix(s.path, namesPrefix);
    if (nonPersistent.count(name) > 0) {
      model->keepOutOfExport(registeredName.at(s.tensor.unsafeGetTensorImpl()));
    } else {
      model->addExportName(registeredName.at(s.tensor.unsafeGetTensorImpl()), name);
    }
  }
  // In the module's order of its tensors (each once), so messages name the first.
  for (size_t i = 0; i < parts.size(); ++i) {
    std::set<const void*> seen;
    for (const Slot& s : slots) {
      const void* t = s.tensor.unsafeGetTensorImpl();
      if (reads[i].count(t) == 0 || !seen.insert(t).second || owner.at(t) == i) continue;
      model->addSharedUse({registeredName.at(t), owner.at(t), i});
    }
  }
  model->setStructureNote(note);
  if (ownLoss) {
    // Its own: what its forward computes from the output and the targets, checked on the
    // sample as a module's loss method is; run in the model's mode (a loss may branch on it).
    std::string whyNot = whyNotOwnLoss(*cut.loss, root, whole, sampleTarget(shape, x));
    if (whyNot.empty())
      whyNot =
          whyNotTheForwardsLoss(*cut.loss, cut.lossIndex, root, x, sampleTarget(shape, x), whole);
    if (!whyNot.empty()) {
      throw ConfigError(
          fmt::format("model.path {}: the loss its forward returns cannot be the "
                      "training loss: {}; set model.loss (cross_entropy, mse)",
                      spec.path, whyNot));
    }
    std::shared_ptr<jit::GraphFunction> loss = cut.loss;
    model->setLoss(inModelMode(root, model.get(),
                               [loss](jit::Module& m, const at::Tensor& out, const at::Tensor& y) {
                                 return runLoss(*loss, m, out, y);
                               }));
  } else if (spec.loss == "mse") {
    model->setLoss([](const at::Tensor& output, const at::Tensor& target) {
      return at::mse_loss(output, target.to(output.scalar_type()));
    });
  } else if (spec.loss == "module") {
    if (!root.find_method("loss")) {
      throw ConfigError(
          fmt::format("model.loss = 'module' but {} has no loss method; add "
                      "`def loss(self, output, target) -> Tensor` (scripted)",
                      spec.path));
    }
    const std::string whyNot = whyNotALoss(root, whole, sampleTarget(shape, x));
    if (!whyNot.empty()) {
      throw ConfigError(
          fmt::format("model.loss = 'module': the loss method of {} cannot be "
                      "the training loss: {}",
                      spec.path, whyNot));
    }
    model->setLoss(inModelMode(root, model.get(),
                               [](jit::Module& m, const at::Tensor& out, const at::Tensor& y) {
                                 jit::GraphOptimizerEnabledGuard plain(false);
                                 return m.run_method("loss", out, y).toTensor();
                               }));
  }
  return model;
}

std::string describeScriptBlocks(const std::string& path) {
  Loaded loaded = load(path);
  const GraphCut cut =
      cutForward(loaded.root, blockHolders(loaded.blocks, loaded.namesPrefix), loaded.namesPrefix);
  if (cut.takesTargets && !cut.loss) {
    throw ConfigError(
        fmt::format("its forward takes (x, targets), but its loss cannot be told "
                    "from its output: {}; export it with an example input alone",
                    cut.note));
  }
  const std::string loss = cut.loss ? "; trained on the loss its forward returns" : "";
  // The loader checks the cut against the forward on a batch like the data's: here on one like
  // the example it was traced on (token ids 0 and 1, valid in any vocabulary; or normal floats).
  std::string whyNot;
  if (cut.segments.size() >= 2 && loaded.blocks != "none" && !loaded.exampleShape.empty()) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(20231201);
    const at::Tensor x =
        loaded.exampleDtype == "torch.int64"
            ? at::randint(2, loaded.exampleShape, generator, at::TensorOptions(at::kLong))
            : at::randn(loaded.exampleShape, generator);
    std::vector<Part> parts;
    for (const GraphSegment& segment : cut.segments) {
      parts.push_back({segment.label, std::make_shared<GraphSegment>(segment)});
    }
    const Forward forwardWhole = forwardUpToOutput(loaded.root, cut, [](const at::Tensor& in) {
      return in.is_floating_point() ? at::zeros({in.size(0)}, at::kLong) : in;
    });
    try {
      whyNot = whyNotSequential(loaded.root, parts, x, forwardWhole);
    } catch (const std::exception& e) {
      whyNot = fmt::format("its forward fails on an input like the example ({})", lastLine(e));
    }
    if (!whyNot.empty()) {
      whyNot = "its forward cut at the block calls is not the forward: " + whyNot;
    }
  }
  if (cut.segments.size() < 2 || loaded.blocks == "none" || !whyNot.empty()) {
    return fmt::format("blocks: 1 (the module is not cut: {}){}",
                       loaded.blocks == "none" ? "--blocks none"
                       : !whyNot.empty()       ? whyNot
                       : cut.note.empty()      ? "its forward has no block calls to cut at"
                                               : cut.note,
                       loss);
  }
  std::string labels;
  for (const GraphSegment& s : cut.segments) labels += (labels.empty() ? "" : ", ") + s.label;
  return fmt::format("blocks: {} ({}){}{}", cut.segments.size(), labels,
                     cut.note.empty() ? "" : "; " + cut.note, loss);
}

}  // namespace caravan
