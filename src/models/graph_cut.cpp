// Cutting a TorchScript forward at its block calls (see graph_cut.h).
#include "models/graph_cut.h"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include <fmt/format.h>
#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/lower_tuples.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#include "core/errors.h"

namespace caravan {
namespace {

namespace jit = torch::jit;
using jit::Node;
using jit::Value;

std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

bool isModuleValue(const Value* v) {
  const auto cls = v->type()->cast<c10::ClassType>();
  return cls && cls->is_module();
}

// The module path a module-typed value holds: a chain of attribute reads from the graph's
// `self` ("" for self itself), or nothing for a module that came another way.
std::optional<std::string> modulePath(const Value* v, const Value* self) {
  if (v == self) return std::string();
  const Node* n = v->node();
  if (n->kind() != c10::prim::GetAttr) return std::nullopt;
  auto parent = modulePath(n->input(0), self);
  if (!parent) return std::nullopt;
  return join(*parent, n->s(c10::attr::name));
}

bool isContainer(const jit::Module& m) {
  const auto name = m.type()->name();
  if (!name) return false;
  const std::string q = name->qualifiedName();
  const std::string last = name->name();
  return (last == "ModuleList" || last == "Sequential") &&
         q.find("torch.nn.modules.container") != std::string::npos;
}

bool hasChildren(const jit::Module& m) { return m.named_children().size() > 0; }

// A container of repeated layers: two items or more of one class of the user's or a library's
// (not torch.nn's own: a head Sequential(Linear, ReLU, Linear) is not one), making at least
// half of its items. Traced copies of a class have mangled type names; the class name is the
// last atom.
bool repeats(const jit::Module& m) {
  std::map<std::string, size_t> count;
  size_t items = 0, most = 0;
  for (const auto& c : m.named_children()) {
    ++items;
    const auto name = c.value.type()->name();
    if (!name || name->qualifiedName().rfind("__torch__.torch.nn.", 0) == 0) continue;
    most = std::max(most, ++count[name->name()]);
  }
  return most >= 2 && 2 * most >= items;
}

std::optional<jit::Module> submodule(const jit::Module& root, const std::string& path) {
  jit::Module m = root;
  size_t at = 0;
  while (at < path.size()) {
    const size_t dot = path.find('.', at);
    const std::string part =
        path.substr(at, dot == std::string::npos ? std::string::npos : dot - at);
    if (!m.hasattr(part) || !m.attr(part).isModule()) return std::nullopt;
    m = m.attr(part).toModule();
    at = dot == std::string::npos ? path.size() : dot + 1;
  }
  return m;
}

// Top-most repeated containers, in attribute order.
void findContainers(const jit::Module& m, const std::string& prefix,
                    std::vector<std::string>& out) {
  for (const auto& c : m.named_children()) {
    const std::string path = join(prefix, c.name);
    if (isContainer(c.value) && repeats(c.value)) {
      out.push_back(path);
    } else {
      findContainers(c.value, path, out);
    }
  }
}

// Every path of a parameter or buffer under `m` (a tied tensor under each of its names).
void tensorPaths(const jit::Module& m, const std::string& prefix, std::vector<std::string>& out) {
  for (const auto& p : m.named_parameters(false)) out.push_back(join(prefix, p.name));
  for (const auto& b : m.named_buffers(false)) out.push_back(join(prefix, b.name));
  for (const auto& c : m.named_children()) tensorPaths(c.value, join(prefix, c.name), out);
}

// Values every segment can compute again from the module: constants and attribute reads.
bool recomputable(const Value* v, const Value* self) {
  if (v == self) return true;
  const Node* n = v->node();
  if (n->kind() == c10::prim::Constant) return true;
  return n->kind() == c10::prim::GetAttr && recomputable(n->input(0), self);
}

bool trivial(const Node* n) {
  return n->kind() == c10::prim::Constant || n->kind() == c10::prim::GetAttr;
}

std::string describe(const Value* v) {
  return fmt::format("%{} ({})", v->debugName(), v->type()->annotation_str());
}

// Whether values of type `t` can hold a tensor (a gradient).
bool holdsTensors(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::TensorType || t->cast<c10::ClassType>()) return true;
  for (const auto& inner : t->containedTypes()) {
    if (holdsTensors(inner)) return true;
  }
  return false;
}

// The kinds of value a context slot carries (BlockModel::context), across pipeline stages too.
bool contextKind(const c10::TypePtr& t) {
  const auto k = t->kind();
  return k == c10::TypeKind::TensorType || k == c10::TypeKind::IntType ||
         k == c10::TypeKind::FloatType || k == c10::TypeKind::BoolType;
}

// Every value a node reads, its nested blocks' included.
void readsOf(Node* n, std::vector<Value*>& out) {
  for (Value* v : n->inputs()) out.push_back(v);
  for (jit::Block* b : n->blocks()) {
    for (Node* inner : b->nodes()) readsOf(inner, out);
    for (Value* v : b->outputs()) out.push_back(v);
  }
}

// A forward(x, targets) that returns its loss, split in two: the model, forward(self, x) ->
// the one value the loss reads from it (the logits), and the loss, loss(self, output,
// targets). The loss part is every top-level node that reads the targets, directly or not.
struct LossSplit {
  std::shared_ptr<jit::Graph> model, loss;
  int outputIndex = -1;  // where the output is in the tuple the forward returns (-1: not there)
  int lossIndex = -1;    // where the loss is in it (-1: the forward returns the loss alone)
  std::string note;      // why not split
};

// Appends clones of `nodes` to `g`, inputs through `env` (what is not there must be
// `clonable`: computed again in `g`, from what its node reads, on first use), and makes the
// clones of `outputs` g's outputs.
void cloneInto(jit::Graph& g, const std::vector<Node*>& nodes,
               const std::function<bool(const Value*)>& clonable,
               std::unordered_map<Value*, Value*>& env, const std::vector<Value*>& outputs) {
  std::function<Value*(Value*)> lookup = [&](Value* v) -> Value* {
    const auto it = env.find(v);
    if (it != env.end()) return it->second;
    CARAVAN_CHECK(clonable(v), "graph cut: {} crosses a cut unaccounted", describe(v));
    Node* copy = g.insertNode(g.createClone(v->node(), lookup));
    for (size_t i = 0; i < copy->outputs().size(); ++i) env[v->node()->output(i)] = copy->output(i);
    return env.at(v);
  };
  for (Node* n : nodes) {
    Node* copy = g.insertNode(g.createClone(n, lookup));
    for (size_t o = 0; o < copy->outputs().size(); ++o) env[n->output(o)] = copy->output(o);
  }
  if (outputs.size() == 1) {
    g.registerOutput(lookup(outputs[0]));
    return;
  }
  // A method returns one value: several go as a tuple.
  std::vector<Value*> values;
  for (Value* v : outputs) values.push_back(lookup(v));
  g.registerOutput(g.insertNode(g.createTuple(values))->output());
}

// The node of the graph's top level that holds `n` (itself, or the branch or loop it is in).
Node* topLevel(Node* n, const jit::Block* top) {
  while (n->owningBlock() != top) n = n->owningBlock()->owningNode();
  return n;
}

LossSplit splitLoss(const std::shared_ptr<jit::Graph>& graph) {
  LossSplit split;
  Value* self = graph->inputs()[0];
  Value* input = graph->inputs()[1];
  Value* targets = graph->inputs()[2];
  Node* tuple = graph->outputs()[0]->node()->kind() == c10::prim::TupleConstruct
                    ? graph->outputs()[0]->node()
                    : nullptr;
  const auto returned =
      tuple != nullptr ? tuple->inputs().vec() : std::vector<Value*>{graph->outputs()[0]};
  // What reads the targets, directly or not.
  std::set<const Value*> dependent{targets};
  for (Node* n : graph->nodes()) {
    std::vector<Value*> reads;
    readsOf(n, reads);
    if (n != tuple && std::any_of(reads.begin(), reads.end(),
                                  [&](const Value* v) { return dependent.count(v) > 0; })) {
      for (Value* v : n->outputs()) dependent.insert(v);
    }
  }
  // The loss: the one returned value that reads them; the output: the one returned value that
  // does not (nanoGPT's logits), else the one value the nodes reading the targets read of the
  // rest.
  Value* loss = nullptr;
  std::vector<Value*> outputs;
  for (Value* v : returned) {
    if (dependent.count(v) == 0) {
      outputs.push_back(v);
    } else if (loss != nullptr) {
      split.note = "its forward returns two values that read the targets";
      return split;
    } else {
      loss = v;
    }
  }
  if (loss == nullptr) {
    split.note = "its forward takes a second input but returns nothing that reads it";
    return split;
  }
  std::vector<Value*> crossing;
  if (outputs.size() == 1 && outputs[0]->type()->cast<c10::TensorType>() && outputs[0] != input) {
    crossing = outputs;
  } else {
    std::set<Value*> read;
    for (Node* n : graph->nodes()) {
      if (n == tuple || dependent.count(n->outputs().empty() ? nullptr : n->output(0)) == 0) {
        continue;
      }
      std::vector<Value*> reads;
      readsOf(n, reads);
      for (Value* v : reads) {
        if (dependent.count(v) == 0 && !recomputable(v, self) &&
            (v == input || topLevel(v->node(), graph->block()) != n)) {
          read.insert(v);
        }
      }
    }
    crossing.assign(read.begin(), read.end());
  }
  if (crossing.size() != 1 || !crossing[0]->type()->cast<c10::TensorType>() ||
      crossing[0] == input) {
    std::string what;
    for (const Value* v : crossing) what += (what.empty() ? "" : ", ") + describe(v);
    split.note = fmt::format(
        "its loss reads {} value{} of the forward ({}); Caravan trains on "
        "a loss of one output (the logits) and the targets",
        crossing.size(), crossing.size() == 1 ? "" : "s", what);
    return split;
  }
  Value* output = crossing[0];
  for (size_t i = 0; i < returned.size(); ++i) {
    if (returned[i] == output) split.outputIndex = static_cast<int>(i);
  }
  // The model: what the output needs. The loss: what the loss needs besides (what reads the
  // targets, and what only it uses, such as the output's sizes for a view); it may read of the
  // model's part the output alone. What neither needs is left out, unless it has effects.
  auto slice = [&](Value* from) {
    std::set<Node*> out;
    std::vector<Node*> stack{from->node()};
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      if (n->kind() == c10::prim::Param || n->owningBlock() != graph->block() ||
          !out.insert(n).second) {
        continue;
      }
      std::vector<Value*> reads;
      readsOf(n, reads);
      for (Value* v : reads) stack.push_back(topLevel(v->node(), graph->block()));
    }
    return out;
  };
  const std::set<Node*> needed = slice(output);
  const std::set<Node*> forLoss = slice(loss);
  std::vector<Node*> modelNodes, lossNodes;
  std::set<Value*> lossReads;
  for (Node* n : graph->nodes()) {
    if (n == tuple) continue;
    if (needed.count(n) > 0) {
      modelNodes.push_back(n);
    } else if (forLoss.count(n) > 0) {
      lossNodes.push_back(n);
      std::vector<Value*> reads;
      readsOf(n, reads);
      for (Value* v : reads) {
        if (v == input ||
            (needed.count(topLevel(v->node(), graph->block())) > 0 && !recomputable(v, self))) {
          lossReads.insert(v);
        }
      }
    } else {
      const std::string kind = n->kind().toQualString();
      if (n->hasSideEffects() || n->isNondeterministic() || kind.back() == '_') {
        split.note = fmt::format("its forward runs {} for neither its output nor its loss", kind);
        return split;
      }
    }
  }
  lossReads.erase(output);
  if (!lossReads.empty()) {
    std::string what;
    for (const Value* v : lossReads) what += (what.empty() ? "" : ", ") + describe(v);
    split.note = fmt::format(
        "its loss reads {} of the forward besides the output ({}); Caravan trains on a loss of "
        "one output (the logits) and the targets",
        lossReads.size() == 1 ? "a value" : "values", what);
    return split;
  }
  for (size_t i = 0; i < returned.size(); ++i) {
    if (returned[i] == loss) split.lossIndex = static_cast<int>(i);
  }

  const auto onModule = [self](const Value* v) { return recomputable(v, self); };
  split.model = std::make_shared<jit::Graph>();
  {
    std::unordered_map<Value*, Value*> env;
    env[self] = split.model->addInput("self")->setType(self->type());
    env[input] = split.model->addInput("x")->setType(input->type());
    cloneInto(*split.model, modelNodes, onModule, env, {output});
    jit::EliminateDeadCode(split.model);
  }
  split.loss = std::make_shared<jit::Graph>();
  {
    std::unordered_map<Value*, Value*> env;
    env[self] = split.loss->addInput("self")->setType(self->type());
    env[output] = split.loss->addInput("output")->setType(c10::TensorType::get());
    env[targets] = split.loss->addInput("targets")->setType(targets->type());
    cloneInto(*split.loss, lossNodes, onModule, env, {loss});
    jit::EliminateDeadCode(split.loss);
  }
  return split;
}

// The parameters and buffers (by path; `everyPath` lists them all) a graph on the module's
// object reads: attribute reads of them, and every one of a module it uses otherwise (a call).
// A plain tensor attribute (self.mask = ...) is no state and is not counted.
std::set<std::string> tensorsRead(jit::Graph& g, const std::vector<std::string>& everyPath) {
  const Value* self = g.inputs()[0];
  const std::set<std::string> stateful(everyPath.begin(), everyPath.end());
  std::set<std::string> reads;
  std::vector<Node*> all;
  std::function<void(jit::Block*)> walk = [&](jit::Block* block) {
    for (Node* n : block->nodes()) {
      all.push_back(n);
      for (jit::Block* inner : n->blocks()) walk(inner);
    }
  };
  walk(g.block());
  for (Node* n : all) {
    if (n->kind() == c10::prim::GetAttr) {
      const auto p = modulePath(n->input(0), self);
      if (p && stateful.count(join(*p, n->s(c10::attr::name))) > 0) {
        reads.insert(join(*p, n->s(c10::attr::name)));
      }
      continue;
    }
    for (Value* v : n->inputs()) {
      if (!isModuleValue(v)) continue;
      const auto p = modulePath(v, self);
      if (!p) continue;
      for (const std::string& t : everyPath) {
        if (p->empty() || t.compare(0, p->size() + 1, *p + ".") == 0) reads.insert(t);
      }
    }
  }
  return reads;
}

}  // namespace

GraphCut cutForward(const jit::Module& root, const std::vector<std::string>& containers,
                    const std::string& namesPrefix) {
  GraphCut cut;
  auto shown = [&](const std::string& path) { return withoutPrefix(path, namesPrefix); };
  // The block items: the named containers' children, the top-most containers', or the
  // module's own children.
  std::vector<std::string> holders = containers;
  if (holders.empty()) {
    const auto children = root.named_children();
    if (isContainer(root)) {
      holders = {""};
    } else if (children.size() == 1 && isContainer((*children.begin()).value)) {
      holders = {(*children.begin()).name};  // a module around one Sequential: its items
    } else {
      findContainers(root, "", holders);
      if (holders.empty()) {
        // None repeats: the module's children, below any wrapper of one child (caravan
        // export's, or the user's own).
        std::string path;
        jit::Module m = root;
        for (auto c = m.named_children(); c.size() == 1; c = m.named_children()) {
          const auto only = *c.begin();
          if (!hasChildren(only.value)) break;
          path = join(path, only.name);
          m = only.value;
        }
        holders = {path};
      }
    }
  }
  std::set<std::string> items;
  for (const std::string& h : holders) {
    const auto m = submodule(root, h);
    if (!m || !hasChildren(*m)) {
      throw ConfigError(
          fmt::format("'{}' is no submodule with children of the module; name an "
                      "nn.Sequential or nn.ModuleList, or use 'auto'",
                      shown(h)));
    }
    for (const auto& c : m->named_children()) items.insert(join(h, c.name));
  }
  auto holdsAnItem = [&](const std::string& p) {
    if (p.empty()) return true;
    return std::any_of(items.begin(), items.end(), [&](const std::string& item) {
      return item.size() > p.size() && item.compare(0, p.size() + 1, p + ".") == 0;
    });
  };

  std::vector<std::string> everyPath;  // every parameter's and buffer's path
  tensorPaths(root, "", everyPath);

  // Compiled (a loaded file's methods are, at first use) with the graph optimizer off, as they
  // run here: with it on, the compiler inlines every call, and no block call would be left.
  jit::GraphOptimizerEnabledGuard plain(false);
  const auto& forward = jit::toGraphFunction(root.get_method("forward").function());
  auto graph = forward.graph()->copy();
  if (graph->inputs().size() != 2 && graph->inputs().size() != 3) {
    cut.note = fmt::format(
        "its forward takes {} inputs; Caravan calls forward(x) or, with a "
        "loss of its own, forward(x, targets)",
        graph->inputs().size() - 1);
    return cut;
  }
  Value* self = graph->inputs()[0];

  // Inline down to the block calls.
  for (bool changed = true; changed;) {
    changed = false;
    for (Node* n : graph->nodes()) {
      if (n->kind() != c10::prim::CallMethod) continue;
      const auto p = modulePath(n->input(0), self);
      if (!p || items.count(*p) > 0 || !holdsAnItem(*p)) continue;
      const auto cls = n->input(0)->type()->expect<c10::ClassType>();
      auto& callee = jit::toGraphFunction(cls->getMethod(n->s(c10::attr::name)));
      jit::inlineCallTo(n, &callee);
      changed = true;
      break;
    }
  }

  // forward(x, targets) returning its loss: the blocks are cut in what comes before the loss.
  cut.takesTargets = graph->inputs().size() == 3;
  // A tuple built and taken apart again (a forward returning (logits, loss) to a caller that
  // unpacks it) is each element itself: otherwise every element would seem to read the targets.
  if (graph->inputs().size() == 3) {
    jit::LowerSimpleTuples(graph);
    jit::EliminateDeadCode(graph);
    LossSplit split = splitLoss(graph);
    if (!split.model) {
      cut.note = split.note;
      return cut;
    }
    cut.loss = std::make_shared<jit::GraphFunction>(c10::QualifiedName("__caravan__.loss"),
                                                    split.loss, nullptr);
    cut.outputIndex = split.outputIndex;
    cut.lossIndex = split.lossIndex;
    cut.model = std::make_shared<GraphSegment>();
    cut.model->label = "module";
    cut.model->function = std::make_shared<jit::GraphFunction>(
        c10::QualifiedName("__caravan__.model"), split.model->copy(), nullptr);
    const auto modelReads = tensorsRead(*split.model, everyPath);
    cut.model->tensors.assign(modelReads.begin(), modelReads.end());
    const auto lossReads = tensorsRead(*split.loss, everyPath);
    cut.lossTensors.assign(lossReads.begin(), lossReads.end());
    graph = split.model;
    self = graph->inputs()[0];
  }

  // The block calls, at the top level only.
  const std::vector<Node*> nodes(graph->nodes().begin(), graph->nodes().end());
  std::unordered_map<const Node*, size_t> index;
  for (size_t i = 0; i < nodes.size(); ++i) index[nodes[i]] = i;
  std::vector<size_t> calls;
  std::vector<std::string> callLabels;
  for (Node* n : jit::findAllNodes(*graph, c10::prim::CallMethod, /*recurse=*/true)) {
    const auto p = modulePath(n->input(0), self);
    if (!p || items.count(*p) == 0) continue;
    if (n->owningBlock() != graph->block()) {
      cut.note = fmt::format("{} is called inside a branch or a loop", shown(*p));
      return cut;
    }
    calls.push_back(index.at(n));
    callLabels.push_back(shown(*p));
  }
  if (calls.empty()) {
    cut.note = "its forward calls none of the blocks' modules";
    return cut;
  }
  // Values that carry no gradient: the input, what holds no tensor (a length, a flag), and
  // tensors computed from such values and buffers alone (an attention mask, rotary tables from
  // a buffer), reading no parameter: through its path, or by a call of a module that has it,
  // and written by nothing after (an in-place write through a view, skip[:] = h, could give it
  // a gradient). They cross a cut in the model's context (BlockModel::context), beside the one
  // activation.
  std::set<std::string> parameterPaths;
  for (const auto& p : root.named_parameters(true)) parameterPaths.insert(p.name);
  auto readsParameter = [&](const Value* v) {
    if (v->node()->kind() == c10::prim::Constant) return false;
    const auto p = modulePath(v, self);
    if (!p) return true;
    if (!isModuleValue(v)) return parameterPaths.count(*p) > 0;
    return std::any_of(parameterPaths.begin(), parameterPaths.end(), [&](const std::string& t) {
      return p->empty() || t.compare(0, p->size() + 1, *p + ".") == 0;
    });
  };
  std::set<const Value*> gradientFree{graph->inputs()[1]};
  // What the forward's own operators write in place (not the block calls': the alias analysis
  // takes any tensor handed to a call as possibly written, the hidden state and a mask alike).
  const jit::AliasDb aliases(graph);
  std::vector<const Value*> written;
  for (const Node* n : nodes) {
    const c10::FunctionSchema* schema = n->maybeSchema();
    if (schema == nullptr) continue;
    for (size_t i = 0; i < schema->arguments().size() && i < n->inputs().size(); ++i) {
      const auto* alias = schema->arguments()[i].alias_info();
      if (alias != nullptr && alias->isWrite()) written.push_back(n->input(i));
    }
  }
  auto hasWriters = [&](const Value* v) {
    return std::any_of(written.begin(), written.end(),
                       [&](const Value* w) { return aliases.mayAlias(v, w); });
  };
  auto isFree = [&](const Value* v) {
    return !holdsTensors(v->type()) || gradientFree.count(v) > 0 ||
           (recomputable(v, self) && !readsParameter(v));
  };
  for (Node* n : nodes) {
    if (trivial(n)) continue;
    std::vector<Value*> reads;
    readsOf(n, reads);
    if (std::all_of(reads.begin(), reads.end(), [&](Value* v) {
          return isFree(v) || topLevel(v->node(), graph->block()) == n;
        })) {
      for (const Value* v : n->outputs()) {
        if (!holdsTensors(v->type()) || !hasWriters(v)) gradientFree.insert(v);
      }
    }
  }

  auto topIndex = [&](Node* user) {
    user = topLevel(user, graph->block());
    return user == graph->return_node() ? nodes.size() : index.at(user);
  };
  // What crosses a cut before position p.
  auto crossing = [&](size_t p) {
    std::vector<Value*> out;
    auto consider = [&](Value* v) {
      if (recomputable(v, self)) return;
      for (const auto& use : v->uses()) {
        if (topIndex(use.user) >= p) {
          out.push_back(v);
          return;
        }
      }
    };
    consider(graph->inputs()[1]);
    for (size_t i = 0; i < p; ++i) {
      for (Value* v : nodes[i]->outputs()) consider(v);
    }
    return out;
  };
  auto computes = [&](size_t a, size_t b) {
    for (size_t i = a; i < b; ++i) {
      if (!trivial(nodes[i])) return true;
    }
    return false;
  };

  // The cuts: before each block call (in graph order), after the last; those where one Tensor
  // crosses.
  std::vector<std::pair<size_t, std::string>> candidates;
  for (size_t k = 0; k < calls.size(); ++k)
    candidates.push_back({calls[k], "before " + callLabels[k]});
  candidates.push_back({calls.back() + 1, "after the last block"});
  std::vector<size_t> cuts;          // positions
  std::vector<Value*> carried;       // what crosses each
  std::vector<std::string> skipped;  // the cuts left out, and why
  size_t last = 0;
  for (const auto& [p, at] : candidates) {
    if (!computes(last, p) || !computes(p, nodes.size())) continue;  // nothing on one side
    // One activation (what carries a gradient; the one value crossing, when it is all) and
    // what goes in the context (of a kind it carries).
    const auto values = crossing(p);
    std::vector<Value*> activations, context;
    for (Value* v : values) (isFree(v) ? context : activations).push_back(v);
    if (activations.empty() && values.size() == 1) activations.swap(context);
    const auto badKind = std::find_if(context.begin(), context.end(),
                                      [](const Value* v) { return !contextKind(v->type()); });
    if (activations.size() == 1 && activations[0]->type()->cast<c10::TensorType>() &&
        badKind == context.end()) {
      cuts.push_back(p);
      carried.push_back(activations[0]);
      last = p;
      continue;
    }
    std::string what;
    for (const Value* v : badKind == context.end() ? activations : context) {
      what += (what.empty() ? "" : ", ") + describe(v);
    }
    skipped.push_back(
        badKind != context.end()
            ? fmt::format("{}: a value that is no tensor, number or flag crosses ({})", at,
                          describe(*badKind))
            : fmt::format("{}: {} values that carry a gradient cross ({})", at, activations.size(),
                          what));
  }
  if (!skipped.empty()) {
    cut.note = fmt::format("not cut {}{}", skipped.front(),
                           skipped.size() > 1
                               ? fmt::format(", nor at {} other place{}", skipped.size() - 1,
                                             skipped.size() > 2 ? "s" : "")
                               : "");
  }
  if (cuts.empty()) return cut;

  // The context: what crosses each cut besides its activation, a slot each, in the order
  // they cross.
  std::vector<std::vector<Value*>> across;  // by cut
  std::map<const Value*, size_t> slot;
  for (size_t k = 0; k < cuts.size(); ++k) {
    across.emplace_back();
    for (Value* v : crossing(cuts[k])) {
      if (v == carried[k]) continue;
      across.back().push_back(v);
      slot.emplace(v, slot.size());
    }
  }
  cut.contextSlots = slot.size();

  // The segments.
  Value* input = graph->inputs()[1];
  Value* output = graph->return_node()->input(0);
  const auto onModule = [self](const Value* v) { return recomputable(v, self); };
  for (size_t s = 0; s <= cuts.size(); ++s) {
    const size_t a = s == 0 ? 0 : cuts[s - 1];
    const size_t b = s == cuts.size() ? nodes.size() : cuts[s];
    Value* in = s == 0 ? input : carried[s - 1];
    Value* out = s == cuts.size() ? output : carried[s];

    auto g = std::make_shared<jit::Graph>();
    std::unordered_map<Value*, Value*> env;
    env[self] = g->addInput("self")->setType(self->type());
    env[in] = g->addInput("x")->setType(c10::TensorType::get());
    // Reads: what crosses the cut before it and is used in it. Writes: what crosses the cut
    // after it and not the one before (computed here; the input, in the first).
    GraphSegment segment;
    if (s > 0) {
      for (Value* v : across[s - 1]) {
        const bool used = std::any_of(v->uses().begin(), v->uses().end(), [&](const jit::Use& u) {
          const size_t at = topIndex(u.user);
          return at >= a && (at < b || b == nodes.size());
        });
        if (!used) continue;
        env[v] = g->addInput(fmt::format("context{}", slot.at(v)))->setType(v->type());
        segment.contextReads.push_back(slot.at(v));
      }
    }
    std::vector<Value*> outputs{out};
    if (s < cuts.size()) {
      for (Value* v : across[s]) {
        if (s > 0 &&
            std::find(across[s - 1].begin(), across[s - 1].end(), v) != across[s - 1].end()) {
          continue;
        }
        outputs.push_back(v);
        segment.contextWrites.push_back(slot.at(v));
      }
    }
    cloneInto(*g,
              std::vector<Node*>(nodes.begin() + static_cast<std::ptrdiff_t>(a),
                                 nodes.begin() + static_cast<std::ptrdiff_t>(b)),
              onModule, env, outputs);
    jit::EliminateDeadCode(g);

    const std::set<std::string> reads = tensorsRead(*g, everyPath);
    segment.label = "prologue";
    for (size_t k = 0; k < calls.size(); ++k) {
      if (calls[k] < a) segment.label = "epilogue";
      if (calls[k] >= a && calls[k] < b) {
        segment.label = callLabels[k];
        break;
      }
    }
    segment.tensors.assign(reads.begin(), reads.end());
    segment.function = std::make_shared<jit::GraphFunction>(
        c10::QualifiedName(fmt::format("__caravan__.segment{}", s)), g, nullptr);
    cut.segments.push_back(std::move(segment));
  }
  return cut;
}

std::string withoutPrefix(const std::string& path, const std::string& namesPrefix) {
  return !namesPrefix.empty() && path.rfind(namesPrefix, 0) == 0 ? path.substr(namesPrefix.size())
                                                                 : path;
}

at::Tensor runLoss(jit::GraphFunction& loss, const jit::Module& root, const at::Tensor& output,
                   const at::Tensor& target) {
  jit::GraphOptimizerEnabledGuard plain(false);
  jit::Stack stack{root._ivalue(), output, target};
  loss.run(stack);
  return stack.back().toTensor();
}

at::Tensor runSegment(const GraphSegment& segment, const jit::Module& root, const at::Tensor& x,
                      std::vector<c10::IValue>& context) {
  jit::GraphOptimizerEnabledGuard plain(false);
  jit::Stack stack{root._ivalue(), x};
  for (size_t slot : segment.contextReads) {
    CARAVAN_CHECK(slot < context.size() && !context[slot].isNone(),
                  "segment {} reads context slot {}, which no block before it wrote", segment.label,
                  slot);
    stack.push_back(context[slot]);
  }
  segment.function->run(stack);
  if (segment.contextWrites.empty()) return stack.back().toTensor();
  const auto tuple = stack.back().toTuple();  // (its output, the slots it writes...)
  const auto& out = tuple->elements();
  CARAVAN_CHECK_EQ(out.size(), 1 + segment.contextWrites.size(), "segment {}'s outputs",
                   segment.label);
  for (size_t i = 0; i < segment.contextWrites.size(); ++i) {
    const size_t slot = segment.contextWrites[i];
    if (context.size() <= slot) context.resize(slot + 1);
    context[slot] = out[1 + i];
  }
  return out[0].toTensor();
}

}  // namespace caravan
