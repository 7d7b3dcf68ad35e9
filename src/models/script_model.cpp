// TorchScript modules as BlockModels (see script_model.h).
#include "models/script_model.h"

#include <unistd.h>

#include <algorithm>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/script.h>

#include "core/errors.h"
#include "core/files.h"

namespace caravan {
namespace {

namespace jit = torch::jit;

std::string firstLine(const std::string& text) {
  const std::string line = text.substr(0, text.find('\n'));
  return line.size() > 200 ? line.substr(0, 200) + "..." : line;
}

// TorchScript's interpreter errors end with the error itself ("RuntimeError: ...").
std::string lastLine(const std::string& text) {
  size_t end = text.find_last_not_of(" \n");
  if (end == std::string::npos) return "";
  const size_t start = text.rfind('\n', end);
  return firstLine(text.substr(start == std::string::npos ? 0 : start + 1, end + 1));
}

std::string shapeText(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "] " + std::string(c10::toString(t.scalar_type()));
}

// Registers `from`'s parameters, buffers and (recursively) children on `into` under the same
// names: the same tensors, so an update through either is seen by both.
void mirror(torch::nn::Module& into, const jit::Module& from) {
  for (const auto& p : from.named_parameters(/*recurse=*/false)) {
    into.register_parameter(p.name, p.value, p.value.requires_grad());
  }
  for (const auto& b : from.named_buffers(/*recurse=*/false)) into.register_buffer(b.name, b.value);
  for (const auto& c : from.named_children()) {
    auto child = std::make_shared<torch::nn::Module>();
    mirror(*child, c.value);
    into.register_module(c.name, child);
  }
}

// One block: a scripted module run with graph optimizations off (script_model.h).
class ScriptBlockImpl : public torch::nn::Module {
 public:
  explicit ScriptBlockImpl(jit::Module module) : module_(std::move(module)) {
    mirror(*this, module_);
  }
  torch::Tensor forward(torch::Tensor x) {
    jit::GraphOptimizerEnabledGuard plain(false);
    return module_.forward({std::move(x)}).toTensor();
  }
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_.train(on);
  }

 private:
  jit::Module module_;
};
TORCH_MODULE(ScriptBlock);

// A block candidate: the scripted module, its label and its path in the user's module.
struct Part {
  std::string label;
  std::string path;  // "" for the whole module
  jit::Module module;
};

// A batch of two like the data's, from a generator of its own (the default one is seeded for
// the run and must not move).
at::Tensor sampleInput(const DataShape& shape) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(20231201);
  if (shape.task == TaskKind::kLanguageModel) {
    return at::randint(shape.vocabSize, {2, std::min<int64_t>(shape.seqLen, 16)}, generator,
                       at::TensorOptions(at::kLong));
  }
  return at::randn({2, shape.channels, shape.height, shape.width}, generator);
}

at::Tensor run(jit::Module& module, const at::Tensor& x) {
  jit::GraphOptimizerEnabledGuard plain(false);
  return module.forward({x}).toTensor();
}

// The parameters and buffers of `m`, by identity.
std::set<const void*> tensorsOf(const jit::Module& m) {
  std::set<const void*> out;
  for (const auto& p : m.named_parameters(true)) out.insert(p.value.unsafeGetTensorImpl());
  for (const auto& b : m.named_buffers(true)) out.insert(b.value.unsafeGetTensorImpl());
  return out;
}

// Why `parts` do not make up `root`'s forward on `x` ("" when they do, bitwise).
std::string whyNotSequential(jit::Module& root, std::vector<Part>& parts, const at::Tensor& x,
                             const at::Tensor& whole) {
  if (parts.size() < 2) return "it has fewer than two parts";
  std::set<const void*> covered;
  for (const Part& p : parts) {
    const auto t = tensorsOf(p.module);
    covered.insert(t.begin(), t.end());
  }
  if (covered != tensorsOf(root)) return "some of its parameters or buffers are outside them";
  at::Tensor y = x;
  try {
    for (Part& p : parts) y = run(p.module, y);
  } catch (const std::exception& e) {
    return fmt::format("applying them in order fails ({})", lastLine(e.what()));
  }
  if (!y.sizes().equals(whole.sizes()) || !at::equal(y, whole)) {
    return "its forward is not them applied in order";
  }
  return "";
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
  jit::Module root;
  try {
    root = jit::load(spec.path);
  } catch (const std::exception& e) {
    throw ConfigError(
        fmt::format("model.path {} is not a TorchScript module ({}); save one in "
                    "Python with torch.jit.script(model).save(path)",
                    spec.path, firstLine(e.what())));
  }
  if (!root.find_method("forward")) {
    throw ConfigError(
        fmt::format("model.path {} has no forward method: script an nn.Module "
                    "(torch.jit.script(model)), not a function",
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

  // The whole forward on a sample, in eval mode (no dropout) and without gradients.
  const at::Tensor x = sampleInput(shape);
  at::Tensor whole;
  {
    at::NoGradGuard noGrad;
    root.eval();
    try {
      whole = run(root, x);
    } catch (const std::exception& e) {
      throw ConfigError(
          fmt::format("model.path {}: its forward fails on a batch like the data's "
                      "({}): {}",
                      spec.path, shapeText(x), lastLine(e.what())));
    }
  }
  const bool crossEntropy = spec.loss.empty() || spec.loss == "cross_entropy";
  if (crossEntropy) {
    const bool lm = shape.task == TaskKind::kLanguageModel;
    const bool fits =
        lm ? (whole.dim() == 3 && whole.size(0) == x.size(0) && whole.size(1) == x.size(1) &&
              whole.size(2) == shape.vocabSize)
           : (whole.dim() == 2 && whole.size(0) == x.size(0) && whole.size(1) == shape.numClasses);
    if (!fits) {
      throw ConfigError(fmt::format(
          "model.path {}: on input {} it gives {}, but cross-entropy on this data needs {}",
          spec.path, shapeText(x), shapeText(whole),
          lm ? fmt::format("[batch, seq, {}] (the vocabulary)", shape.vocabSize)
             : fmt::format("[batch, {}] (the classes)", shape.numClasses)));
    }
  }

  // The blocks.
  std::vector<Part> parts;
  std::string note;
  {
    at::NoGradGuard noGrad;
    if (!spec.blocks.empty()) {
      if (!root.hasattr(spec.blocks) || !root.attr(spec.blocks).isModule()) {
        throw ConfigError(
            fmt::format("model.blocks = '{}' names no submodule of {}; name its "
                        "nn.Sequential or nn.ModuleList (or leave it empty)",
                        spec.blocks, spec.path));
      }
      for (const auto& c : root.attr(spec.blocks).toModule().named_children()) {
        parts.push_back({spec.blocks + "_" + c.name, spec.blocks + "." + c.name, c.value});
      }
      const std::string whyNot = whyNotSequential(root, parts, x, whole);
      if (!whyNot.empty()) {
        throw ConfigError(fmt::format(
            "model.blocks = '{}': {} cannot be Caravan's blocks: {}; put everything forward "
            "does in that nn.Sequential, or leave model.blocks empty to train the module as "
            "one block",
            spec.blocks, spec.blocks, whyNot));
      }
    } else {
      for (const auto& c : root.named_children()) parts.push_back({c.name, c.name, c.value});
      const std::string whyNot = whyNotSequential(root, parts, x, whole);
      if (!whyNot.empty()) {
        note = fmt::format(
            "the module's children are not its blocks ({}); it trains as one "
            "block. To plan per block, make forward an nn.Sequential's items "
            "in order and name it in model.blocks",
            whyNot);
        parts = {{"module", "", root}};
      }
    }
    root.train();
  }

  BlockModel model(std::string(kScriptModelName), shape.task);
  for (const Part& part : parts) {
    ScriptBlock block(part.module);
    const std::string prefix = "b" + std::to_string(model->numBlocks()) + "_" + part.label;
    for (const auto& p : block->named_parameters(true)) {
      model->setExportName(prefix + "." + p.key(),
                           part.path.empty() ? p.key() : part.path + "." + p.key());
    }
    for (const auto& b : block->named_buffers(true)) {
      model->setExportName(prefix + "." + b.key(),
                           part.path.empty() ? b.key() : part.path + "." + b.key());
    }
    model->addBlock(part.label, block);
  }
  model->setStructureNote(note);
  if (spec.loss == "mse") {
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
    model->setLoss([root](const at::Tensor& output, const at::Tensor& target) mutable {
      jit::GraphOptimizerEnabledGuard plain(false);
      return root.run_method("loss", output, target).toTensor();
    });
  }
  return model;
}

}  // namespace caravan
