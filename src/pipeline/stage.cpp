#include "pipeline/stage.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include "comm/communicator.h"
#include "core/align.h"
#include "core/errors.h"
#include "sync/optimizer_state.h"
#include "sync/replicas.h"

namespace caravan {

namespace {

using Clock = std::chrono::steady_clock;

// Tags: three messages per micro-batch (parallel.micro_batches <= 10000 keeps every tag of a
// step below 32767, the least MPI_TAG_UB an MPI may have).
enum Message { kActivationHeader = 0, kActivation = 1, kGradient = 2 };
int tagOf(int microBatch, Message message) { return 3 * microBatch + message; }

// An activation's header: dtype, rank, up to 6 sizes; then one entry of kHeaderLength per
// context slot (BlockModel::context: values crossing besides the activation), so both sides
// know the length from the model: none, a tensor (dtype, rank, up to 5 sizes), or a scalar
// (its kind and its 64 bits).
constexpr int64_t kHeaderLength = 8;
constexpr int64_t kMaxRank = kHeaderLength - 2;
enum ContextKind : int64_t { kNone = 0, kTensor = 1, kInt = 2, kDouble = 3, kBool = 4 };
using Context = BlockModelImpl::Context;

void encodeMeta(const at::Tensor& t, int64_t* p, int64_t maxRank, const char* what) {
  CARAVAN_CHECK(t.dim() <= maxRank, "{} of rank {} (at most {})", what, t.dim(), maxRank);
  p[0] = static_cast<int64_t>(t.scalar_type());
  p[1] = t.dim();
  for (int64_t i = 0; i < t.dim(); ++i) p[2 + i] = t.size(i);
}

at::Tensor emptyFromMeta(const int64_t* p, int64_t maxRank, const char* what) {
  CARAVAN_CHECK(p[1] >= 0 && p[1] <= maxRank, "{} header of rank {}", what, p[1]);
  std::vector<int64_t> sizes(p + 2, p + 2 + p[1]);
  return at::empty(sizes, at::TensorOptions().dtype(static_cast<at::ScalarType>(p[0])));
}

at::Tensor encodeHeader(const at::Tensor& y, const Context& context) {
  at::Tensor h = at::zeros({kHeaderLength * (1 + static_cast<int64_t>(context.size()))}, at::kLong);
  auto* p = h.data_ptr<int64_t>();
  encodeMeta(y, p, kMaxRank, "activation");
  for (size_t i = 0; i < context.size(); ++i) {
    int64_t* e = p + kHeaderLength * static_cast<int64_t>(i + 1);
    const c10::IValue& v = context[i];
    if (v.isTensor()) {
      // The context carries no gradient (graph_cut.h): one that did would be cut off here.
      CARAVAN_CHECK(!v.toTensor().requires_grad(),
                    "context slot {} carries a gradient across the stages", i);
      e[0] = kTensor;
      encodeMeta(v.toTensor(), e + 1, kMaxRank - 1, "a value crossing the stages");
    } else if (v.isInt()) {
      e[0] = kInt;
      e[1] = v.toInt();
    } else if (v.isDouble()) {
      e[0] = kDouble;
      const double d = v.toDouble();
      std::memcpy(&e[1], &d, sizeof d);
    } else if (v.isBool()) {
      e[0] = kBool;
      e[1] = v.toBool();
    } else {
      CARAVAN_CHECK(v.isNone(), "a value crossing the stages of type {}", v.tagKind());
    }
  }
  return h;
}

// The payload: the activation, and the context's tensors after it when it has any (laid end to
// end as bytes, each at a multiple of 64 bytes).

std::vector<at::Tensor> contextTensors(const Context& context) {
  std::vector<at::Tensor> out;
  for (const auto& v : context) {
    if (v.isTensor()) out.push_back(v.toTensor());
  }
  return out;
}

// The payload's layout: `all` end to end in one byte buffer of `bytes`, each at offsets[i].
struct Packing {
  std::vector<int64_t> offsets;
  int64_t bytes = 0;
  explicit Packing(const std::vector<at::Tensor>& all) {
    for (const auto& t : all) {
      offsets.push_back(bytes);
      bytes += alignUp(static_cast<int64_t>(t.nbytes()), kTensorAlign);
    }
  }
  // Tensor i's place in `buffer`, as tensor `like` (its type and shape).
  static at::Tensor place(const at::Tensor& buffer, int64_t offset, const at::Tensor& like) {
    return buffer.narrow(0, offset, static_cast<int64_t>(like.nbytes()))
        .view(like.scalar_type())
        .view(like.sizes());
  }
};

at::Tensor packPayload(const at::Tensor& y, const Context& context) {
  const auto tensors = contextTensors(context);
  if (tensors.empty()) return y;
  std::vector<at::Tensor> all{y};
  all.insert(all.end(), tensors.begin(), tensors.end());
  const Packing packing(all);
  at::Tensor buffer = at::empty({packing.bytes}, at::kByte);
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].nbytes() > 0) Packing::place(buffer, packing.offsets[i], all[i]).copy_(all[i]);
  }
  return buffer;
}

// An activation and the context to `to` (the header, then the payload; `y` contiguous): both
// sends' works.
std::vector<WorkPtr> sendActivation(Communicator& comm, const at::Tensor& y, const Context& context,
                                    int to, int microBatch) {
  return {comm.send(encodeHeader(y, context), to, tagOf(microBatch, kActivationHeader)),
          comm.send(packPayload(y, context), to, tagOf(microBatch, kActivation))};
}

// The activation `from` sends for `microBatch` (its shape from the header), and the context
// sent with it (`slots` entries: the model's).
at::Tensor recvActivation(Communicator& comm, int from, int microBatch, size_t slots,
                          Context& context, std::chrono::milliseconds timeout) {
  at::Tensor header = at::empty({kHeaderLength * (1 + static_cast<int64_t>(slots))}, at::kLong);
  comm.recv(header, from, tagOf(microBatch, kActivationHeader))->wait(timeout);
  const auto* p = header.data_ptr<int64_t>();
  at::Tensor x = emptyFromMeta(p, kMaxRank, "activation");
  context.assign(slots, c10::IValue());
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < slots; ++i) {
    const int64_t* e = p + kHeaderLength * static_cast<int64_t>(i + 1);
    switch (e[0]) {
      case kNone: break;
      case kTensor:
        tensors.push_back(emptyFromMeta(e + 1, kMaxRank - 1, "context"));
        context[i] = tensors.back();
        break;
      case kInt: context[i] = e[1]; break;
      case kDouble: {
        double d = 0.0;
        std::memcpy(&d, &e[1], sizeof d);
        context[i] = d;
        break;
      }
      case kBool: context[i] = e[1] != 0; break;
      default: CARAVAN_CHECK(false, "context entry of kind {}", e[0]);
    }
  }
  if (tensors.empty()) {
    comm.recv(x, from, tagOf(microBatch, kActivation))->wait(timeout);
    return x;
  }
  std::vector<at::Tensor> all{x};
  all.insert(all.end(), tensors.begin(), tensors.end());
  const Packing packing(all);
  at::Tensor buffer = at::empty({packing.bytes}, at::kByte);
  comm.recv(buffer, from, tagOf(microBatch, kActivation))->wait(timeout);
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].nbytes() > 0) all[i].copy_(Packing::place(buffer, packing.offsets[i], all[i]));
  }
  return x;
}

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

// Keeps the gradients a node receives (its inputs in backward) when it runs.
class CaptureGradients : public torch::autograd::FunctionPreHook {
 public:
  explicit CaptureGradients(std::shared_ptr<variable_list> into) : into_(std::move(into)) {}
  variable_list operator()(const variable_list& grads) override {
    *into_ = grads;
    return grads;
  }

 private:
  std::shared_ptr<variable_list> into_;
};

}  // namespace

// zb-h1's W as a weight-only pass. B runs the nodes on the path from the stage's output to its
// input (P); a weight hangs off P through nodes B does not run. For each node of P with such
// an edge, B captures the gradients the node receives (a pre-hook), and W restarts autograd at
// that node with them, asking only for the weights below its off-path edges: the node computes
// just those outputs (a linear layer: the weight-gradient product, not the input-gradient one).
// One engine call per such node keeps a call from walking down P into earlier layers.
struct PipelineStage::WeightPass {
  struct Group {
    c10::intrusive_ptr<Node> node;
    std::shared_ptr<variable_list> captured;
    std::vector<Edge> weights;  // the weights' gradient edges (their accumulators)
  };
  std::vector<Group> groups;

  // Empty (W falls back to a backward to the weights) when the output does not depend on the
  // input or no weight hangs off its path.
  static WeightPass plan(const at::Tensor& output, const at::Tensor& input,
                         const std::vector<at::Tensor>& weights) {
    WeightPass pass;
    const c10::intrusive_ptr<Node> root = output.grad_fn();
    if (!root || !input.requires_grad()) return pass;
    const Node* inputNode = torch::autograd::impl::gradient_edge(input).function.get();
    std::unordered_map<const Node*, Edge> weightEdges;
    for (const auto& w : weights) {
      const Edge e = torch::autograd::impl::gradient_edge(w);
      if (e.function) weightEdges.emplace(e.function.get(), e);
    }
    // Every node below the root, in discovery order, and whether the input is below it.
    std::vector<c10::intrusive_ptr<Node>> order;
    std::unordered_map<const Node*, bool> reaches;
    std::vector<std::pair<Node*, size_t>> stack{{root.get(), 0}};
    reaches[root.get()] = false;
    order.push_back(root);
    while (!stack.empty()) {  // iterative post-order: a node's answer after its children's
      auto& [node, next] = stack.back();
      const auto& edges = node->next_edges();
      if (next < edges.size()) {
        const c10::intrusive_ptr<Node>& child = edges[next++].function;
        if (child && reaches.emplace(child.get(), false).second) {
          order.push_back(child);
          stack.push_back({child.get(), 0});
        }
        continue;
      }
      bool r = node == inputNode;
      for (const auto& e : edges) r = r || (e.function && reaches.at(e.function.get()));
      reaches[node] = r;
      stack.pop_back();
    }
    if (!reaches.at(root.get())) return pass;
    for (const c10::intrusive_ptr<Node>& node : order) {
      if (!reaches.at(node.get())) continue;
      Group g;
      std::unordered_set<const Node*> seen;
      for (const auto& e : node->next_edges()) {
        if (!e.function || reaches.at(e.function.get())) continue;
        // The weights below this off-path edge.
        std::vector<Node*> todo{e.function.get()};
        while (!todo.empty()) {
          Node* n = todo.back();
          todo.pop_back();
          if (!seen.insert(n).second) continue;
          if (auto it = weightEdges.find(n); it != weightEdges.end())
            g.weights.push_back(it->second);
          for (const auto& c : n->next_edges()) {
            if (c.function) todo.push_back(c.function.get());
          }
        }
      }
      if (g.weights.empty()) continue;
      g.node = node;
      pass.groups.push_back(std::move(g));
    }
    // A weight below two of these nodes (a layer applied twice in the stage, a shared w.t()):
    // the shallower node's call would also walk down the path to it and count the deeper
    // use twice. Such a micro-batch's W falls back to a backward to the weights.
    std::unordered_set<const Node*> claimed;
    for (const Group& g : pass.groups) {
      for (const Edge& w : g.weights) {
        if (!claimed.insert(w.function.get()).second) return WeightPass{};
      }
    }
    for (Group& g : pass.groups) {
      g.captured = std::make_shared<variable_list>();
      g.node->add_pre_hook(std::make_unique<CaptureGradients>(g.captured));
    }
    return pass;
  }

  // After B ran (every group's node captured what it received): the weights' gradients.
  void run() const {
    auto& engine = torch::autograd::Engine::get_default_engine();
    for (const Group& g : groups) {
      std::vector<Edge> roots;
      variable_list grads;
      for (size_t i = 0; i < g.captured->size(); ++i) {
        if ((*g.captured)[i].defined()) {
          roots.emplace_back(g.node, static_cast<uint32_t>(i));
          grads.push_back((*g.captured)[i]);
        }
      }
      if (roots.empty()) continue;  // B brought this node no gradient: nothing to add
      engine.execute(roots, grads, /*keep_graph=*/true, /*create_graph=*/false,
                     /*accumulate_grad=*/true, g.weights);
    }
  }
};

PipelineLayout PipelineLayout::of(int rank, int worldSize, int stages) {
  if (stages < 1 || worldSize % stages != 0) {
    throw ConfigError("parallel.pipeline_stages = " + std::to_string(stages) + " does not divide " +
                      std::to_string(worldSize) +
                      " workers: run K x D workers (D data-parallel pipelines of K stages)");
  }
  PipelineLayout l;
  l.stages = stages;
  l.replicas = worldSize / stages;
  l.stage = rank % stages;
  l.replica = rank / stages;
  return l;
}

struct PipelineStage::InFlight {
  at::Tensor input;       // first stage: the micro-batch's inputs; else the received activation
  at::Tensor output;      // last stage: loss / M; else the blocks' output
  at::Tensor outputGrad;  // the received gradient of `output` (not on the last stage)
  at::Tensor inputGrad;   // zb-h1's B: the gradient of `input`, until it is sent
  std::shared_ptr<WeightPass> weightPass;  // zb-h1: planned at B, run at W
  // What crosses the stages besides the activation (BlockModel::context): received with the
  // input, sent on with the output, with what this stage's blocks added.
  BlockModelImpl::Context context;
  // The send of `output`: it holds the output's storage until dropped, which happens when the
  // output's gradient came back (the receiver had it by then).
  std::vector<WorkPtr> activationSend;
};

PipelineStage::PipelineStage(BlockModel model, std::vector<size_t> boundaries, Communicator* comm,
                             PipelineLayout layout, PipelineSchedule schedule, int microBatches)
    : model_(std::move(model)),
      comm_(comm),
      layout_(layout),
      schedule_(schedule),
      microBatches_(microBatches) {
  CARAVAN_CHECK_EQ(boundaries.size(), static_cast<size_t>(layout.stages) + 1,
                   "boundaries of {} stages", layout.stages);
  CARAVAN_CHECK((comm == nullptr ? 1 : comm->size()) == layout.stages * layout.replicas,
                "a world of {} for {} x {}", comm == nullptr ? 1 : comm->size(), layout.stages,
                layout.replicas);
  begin_ = boundaries[layout.stage];
  end_ = boundaries[layout.stage + 1];
  boundaries_ = std::move(boundaries);
  CARAVAN_CHECK(begin_ < end_ && end_ <= model_->numBlocks(), "stage {} has blocks [{}, {})",
                layout.stage, begin_, end_);
  auto programs = buildSchedule(schedule, layout.stages, microBatches);
  const std::string problem = checkSchedule(programs, microBatches);
  CARAVAN_CHECK(problem.empty(), "{}", problem);
  program_ = std::move(programs[layout.stage]);
  // A parameter read by blocks of several stages (a tied embedding and head) is held by each
  // of them (Megatron's word embeddings): every one trains it, after sumTiedGradients gave them
  // the same gradient.
  auto stageOfBlock = [&](size_t block) {
    int s = 0;
    while (boundaries_[static_cast<size_t>(s) + 1] <= block) ++s;
    return s;
  };
  // Read through a shared use (its owner's block registers it), or a module that is the block
  // of two stages.
  tiedIn_.resize(static_cast<size_t>(layout_.stages));
  const auto named = model_->named_parameters();
  for (const auto& use : model_->sharedUses()) {
    const int owner = stageOfBlock(use.owner), user = stageOfBlock(use.user);
    if (owner == user) continue;
    if (!named.contains(use.name)) {  // a buffer: each stage would change its own copy
      throw ConfigError("buffer " + model_->exportName(use.name) + " is read by blocks on stages " +
                        std::to_string(owner) + " and " + std::to_string(user) +
                        ": a pipeline cannot split a shared buffer; put those blocks on one "
                        "stage (parallel.partition) or use fewer stages");
    }
    auto& in = tiedIn_[static_cast<size_t>(user)];
    const at::Tensor p = named[use.name];
    if (std::none_of(in.begin(), in.end(), [&](const at::Tensor& q) { return q.is_same(p); })) {
      in.push_back(p);
    }
  }
  std::map<const c10::TensorImpl*, size_t> tiedIndex;
  for (int s = 0; s < layout_.stages; ++s) {
    shapes_.emplace_back();
    for (const auto& p : stageParameters(s)) {
      shapes_.back().push_back(p.sizes().vec());
      const c10::TensorImpl* key = p.unsafeGetTensorImpl();
      auto it = tiedIndex.find(key);
      if (it == tiedIndex.end()) {
        tiedIndex.emplace(key, tied_.size());
        tied_.push_back({p, {s}});
      } else if (tied_[it->second].stages.back() != s) {
        tied_[it->second].stages.push_back(s);
      }
    }
  }
  tied_.erase(
      std::remove_if(tied_.begin(), tied_.end(), [](const Tied& t) { return t.stages.size() < 2; }),
      tied_.end());
}

void PipelineStage::sumTiedGradients(const GradientSlice& slice) {
  if (comm_ == nullptr) return;
  const int me = layout_.stage;
  const int base = layout_.replica * layout_.stages;  // rank of this replica's stage 0
  // Per other stage: the tied parameters both hold, their gradients end to end, one message
  // each way; then each parameter's gradient is the sum over its stages in stage order, the
  // same bits on every one of them.
  std::map<int, std::vector<const Tied*>> with;
  for (const Tied& t : tied_) {
    if (std::find(t.stages.begin(), t.stages.end(), me) == t.stages.end()) continue;
    for (int s : t.stages) {
      if (s != me) with[s].push_back(&t);
    }
  }
  if (with.empty()) return;
  auto gradOf = [&](const at::Tensor& p) {
    if (slice) return slice(p);
    return p.grad().defined() ? p.grad() : at::zeros_like(p);
  };
  std::vector<WorkPtr> works;
  std::map<int, at::Tensor> inbox;
  for (const auto& [s, tied] : with) {
    std::vector<at::Tensor> mine;
    for (const Tied* t : tied) mine.push_back(gradOf(t->param));
    at::Tensor out = flatten(mine);
    inbox[s] = at::empty_like(out);
    // Slot 1's tags: gatherParameters' and the timeline's, which run between steps.
    works.push_back(comm_->send(out, base + s, postStepTag(1, me)));
    works.push_back(comm_->recv(inbox[s], base + s, postStepTag(1, s)));
  }
  for (auto& w : works) w->wait(comm_->timeout());
  std::map<const Tied*, std::map<int, at::Tensor>> parts;  // by stage
  for (const auto& [s, tied] : with) {
    int64_t at = 0;
    for (const Tied* t : tied) {
      const at::Tensor mine = gradOf(t->param);
      parts[t][s] = inbox.at(s).narrow(0, at, mine.numel()).view(mine.sizes());
      at += mine.numel();
    }
  }
  torch::NoGradGuard noGrad;
  for (auto& [t, byStage] : parts) {
    byStage[me] = gradOf(t->param);
    at::Tensor sum;
    for (int s : t->stages) sum = sum.defined() ? sum + byStage.at(s) : byStage.at(s).clone();
    if (slice) {
      byStage[me].copy_(sum);
    } else {
      t->param.mutable_grad() = sum;
    }
  }
}

std::vector<at::Tensor> PipelineStage::normParameters() {
  std::vector<at::Tensor> out;
  for (const auto& p : parameters()) {
    const bool elsewhere = std::any_of(tied_.begin(), tied_.end(), [&](const Tied& t) {
      return t.param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl() &&
             t.stages.front() != layout_.stage;
    });
    if (!elsewhere) out.push_back(p);
  }
  return out;
}

std::vector<at::Tensor> PipelineStage::parameters() { return stageParameters(layout_.stage); }

std::vector<at::Tensor> PipelineStage::stageTensors(int stage) {
  std::vector<at::Tensor> out = stageParameters(stage);
  for (size_t i = boundaries_[stage]; i < boundaries_[stage + 1]; ++i) {
    for (const auto& b : model_->block(i).ptr()->buffers()) {  // as sync/replicas.h: float32
      if (b.scalar_type() == at::kFloat) out.push_back(b);
    }
  }
  return out;
}

PipelineStage::Totals PipelineStage::reduce(double localGradNormSquared, double localLoss,
                                            bool slicedNorm) {
  if (comm_ == nullptr) return Totals{localGradNormSquared, localLoss};
  at::Tensor t = at::tensor({localGradNormSquared, layout_.last() ? localLoss : 0.0}, at::kDouble);
  comm_->allreduce(t, ReduceOp::kSum)->wait(comm_->timeout());
  // Every replica of a stage holds the same averaged gradients (each counted D times), or its
  // slices of them.
  const double d = static_cast<double>(layout_.replicas);
  return Totals{slicedNorm ? t[0].item<double>() : t[0].item<double>() / d,
                t[1].item<double>() / d};
}

void PipelineStage::gatherParameters() {
  // From replica 0's stage s (rank s); the other replicas hold the same parameters.
  const int rank = comm_ != nullptr ? comm_->rank() : 0;
  for (int s = 1; s < layout_.stages; ++s) {
    if (rank != 0 && rank != s) continue;
    if (rank == 0) {
      torch::NoGradGuard noGrad;
      const std::vector<at::Tensor> params = stageParameters(s);
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].sizes() != at::IntArrayRef(shapes_[s][i]))
          params[i].set_data(at::empty(shapes_[s][i], params[i].options()));
      }
    }
    const std::vector<at::Tensor> tensors = stageTensors(s);
    if (tensors.empty()) continue;
    at::Tensor all = flatten(tensors);
    if (rank == s) {
      comm_->send(all, 0, postStepTag(1, s))->wait(comm_->timeout());
    } else {
      comm_->recv(all, s, postStepTag(1, s))->wait(comm_->timeout());
      unflattenInto(all, tensors);
    }
  }
}

std::vector<at::Tensor> PipelineStage::stageParameters(int stage) {
  std::vector<at::Tensor> out;
  for (size_t i = boundaries_[stage]; i < boundaries_[stage + 1]; ++i) {
    for (const auto& p : model_->block(i).ptr()->parameters()) out.push_back(p);
  }
  const auto& tied = tiedIn_.at(static_cast<size_t>(stage));
  out.insert(out.end(), tied.begin(), tied.end());
  return out;
}

void PipelineStage::holdOwnStageOnly(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard noGrad;
  std::unordered_set<const c10::TensorImpl*> own;
  for (const auto& p : parameters()) own.insert(p.unsafeGetTensorImpl());
  auto others = [&](std::vector<at::Tensor> params) {
    params.erase(
        std::remove_if(params.begin(), params.end(),
                       [&](const at::Tensor& p) { return own.count(p.unsafeGetTensorImpl()) > 0; }),
        params.end());
    return params;
  };
  for (int s = 0; s < layout_.stages; ++s) {
    if (s == layout_.stage) continue;
    scatterOptimizerState(optimizer, others(trainedParameters(s)), {});
    for (auto& p : others(stageParameters(s))) p.set_data(at::empty({0}, p.options()));
  }
}

std::vector<std::vector<PipelineStage::TimelineSpan>> PipelineStage::gatherTimeline(
    const std::vector<StageStepStats::Span>& spans, Clock::time_point stepStart) {
  // Per span: kind, micro-batch, start, end; the count first. After the step (every message of
  // it completed): collectOptimizerState's and gatherParameters' tags, unused then.
  const int rank = comm_ != nullptr ? comm_->rank() : 0;
  std::vector<std::vector<TimelineSpan>> out;
  if (rank >= layout_.stages) return out;  // pipeline 0 only
  auto encode = [&] {
    at::Tensor t = at::empty({static_cast<int64_t>(spans.size()), 4}, at::kDouble);
    auto a = t.accessor<double, 2>();
    for (size_t i = 0; i < spans.size(); ++i) {
      a[i][0] = static_cast<double>(spans[i].kind);
      a[i][1] = spans[i].microBatch;
      a[i][2] = seconds(stepStart, spans[i].start);
      a[i][3] = seconds(stepStart, spans[i].end);
    }
    return t;
  };
  if (rank != 0) {
    at::Tensor t = encode();
    at::Tensor count = at::full({1}, t.size(0), at::kLong);
    comm_->send(count, 0, postStepTag(0, rank))->wait(comm_->timeout());
    comm_->send(t, 0, postStepTag(1, rank))->wait(comm_->timeout());
    return out;
  }
  for (int s = 0; s < layout_.stages; ++s) {
    at::Tensor t;
    if (s == 0) {
      t = encode();
    } else {
      at::Tensor count = at::empty({1}, at::kLong);
      comm_->recv(count, s, postStepTag(0, s))->wait(comm_->timeout());
      CARAVAN_CHECK(count.item<int64_t>() >= 0 && count.item<int64_t>() <= 1 << 24,
                    "stage {} sent {} spans", s, count.item<int64_t>());
      t = at::empty({count.item<int64_t>(), 4}, at::kDouble);
      comm_->recv(t, s, postStepTag(1, s))->wait(comm_->timeout());
    }
    auto a = t.accessor<double, 2>();
    out.emplace_back();
    for (int64_t i = 0; i < t.size(0); ++i) {
      out.back().push_back({static_cast<ActionKind>(static_cast<int>(a[i][0])),
                            static_cast<int>(a[i][1]), a[i][2], a[i][3]});
    }
  }
  return out;
}

at::Tensor PipelineStage::forwardOnly(const at::Tensor& input) {
  torch::NoGradGuard noGrad;
  // One activation in flight per pair of stages (each send is waited for): tags may wrap.
  const int m = static_cast<int>(forwardOnlyCalls_++ % 10000);
  const auto timeout = comm_ != nullptr ? comm_->timeout() : std::chrono::milliseconds(0);
  Context context;
  const at::Tensor x = layout_.first() ? input
                                       : recvActivation(*comm_, comm_->rank() - 1, m,
                                                        model_->contextSlots(), context, timeout);
  const at::Tensor y = model_->forwardBlocks(x, begin_, end_, context);
  if (layout_.last()) return y;
  for (const WorkPtr& w : sendActivation(*comm_, y.contiguous(), context, comm_->rank() + 1, m))
    w->wait(timeout);
  return at::Tensor();
}

std::vector<at::Tensor> PipelineStage::trainedParameters(int stage) {
  std::vector<at::Tensor> out;
  for (const auto& p : stageParameters(stage)) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

int PipelineStage::postStepTag(int slot, int stage) const {
  // Above every micro-batch tag (3M + 2), and below 32767 (the least MPI_TAG_UB MPI allows)
  // for the micro-batch and stage counts the config accepts.
  return 3 * microBatches_ + slot * layout_.stages + stage;
}

void PipelineStage::collectOptimizerState(torch::optim::Optimizer& optimizer) {
  for (int s = 1; s < layout_.stages; ++s) {
    const std::vector<at::Tensor> params = trainedParameters(s);
    int64_t n = 0;
    for (const auto& p : params) n += p.numel();
    if (comm_->rank() == s) {
      sendOptimizerState(*comm_, gatherOptimizerState(optimizer, params), 0, postStepTag(0, s));
    } else if (comm_->rank() == 0) {
      scatterOptimizerState(optimizer, params,
                            recvOptimizerState(*comm_, n, s, postStepTag(0, s), comm_->timeout()));
    }
  }
}

StageStepStats PipelineStage::runStep(const Batch& batch) {
  const int64_t m = microBatches_;
  if (batch.size() % m != 0) {
    throw ConfigError("a batch of " + std::to_string(batch.size()) +
                      " examples does not split into parallel.micro_batches = " +
                      std::to_string(m) + ": make data.batch_size a multiple of it");
  }
  const std::vector<at::Tensor> inputs = batch.input.split(batch.size() / m);
  const std::vector<at::Tensor> targets = batch.target.split(batch.size() / m);
  const std::vector<at::Tensor> weights = trainedParameters(layout_.stage);  // W's outputs
  const int rank = comm_ != nullptr ? comm_->rank() : 0, prev = rank - 1, next = rank + 1;
  const auto timeout = comm_ != nullptr ? comm_->timeout() : std::chrono::milliseconds(0);
  std::vector<InFlight> mb(m);
  std::vector<WorkPtr> gradientSends;  // dropped once complete (checked at each receive)
  auto dropCompleted = [&] {
    for (auto it = gradientSends.begin(); it != gradientSends.end();) {
      if ((*it)->isCompleted()) {
        (*it)->wait(timeout);  // rethrows a failure
        it = gradientSends.erase(it);
      } else {
        ++it;
      }
    }
  };
  StageStepStats stats;
  for (const Action& a : program_) {
    InFlight& f = mb[a.microBatch];
    const auto start = Clock::now();
    switch (a.kind) {
      case ActionKind::kRecvActivation: {
        dropCompleted();
        at::Tensor x =
            recvActivation(*comm_, prev, a.microBatch, model_->contextSlots(), f.context, timeout);
        if (x.is_floating_point()) x.requires_grad_(true);
        f.input = x;
        break;
      }
      case ActionKind::kForward: {
        if (layout_.first()) f.input = inputs[a.microBatch];
        at::Tensor y = model_->forwardBlocks(f.input, begin_, end_, f.context);
        if (layout_.last()) {
          f.output = model_->loss(y, targets[a.microBatch]) / static_cast<double>(m);
          stats.loss += f.output.item<double>();
        } else {
          f.output = y;
        }
        break;
      }
      case ActionKind::kSendActivation: {
        f.activationSend =
            sendActivation(*comm_, f.output.detach().contiguous(), f.context, next, a.microBatch);
        break;
      }
      case ActionKind::kRecvGradient: {
        dropCompleted();
        f.outputGrad = at::empty_like(f.output, at::MemoryFormat::Contiguous);
        comm_->recv(f.outputGrad, next, tagOf(a.microBatch, kGradient))->wait(timeout);
        for (auto& w : f.activationSend) w->wait(timeout);  // done: the gradient came back
        f.activationSend.clear();
        break;
      }
      case ActionKind::kBackward: {
        // An output that needs no gradient (no parameter or float input before it): nothing.
        if (f.output.requires_grad()) torch::autograd::backward({f.output}, {f.outputGrad});
        f.output = f.outputGrad = at::Tensor();
        if (layout_.first()) f = InFlight{};  // nothing to send back
        break;
      }
      case ActionKind::kBackwardInput: {
        // The first stage's input takes no gradient: its W does the whole backward.
        if (!layout_.first() && f.input.requires_grad() && f.output.requires_grad()) {
          f.weightPass = std::make_shared<WeightPass>(WeightPass::plan(f.output, f.input, weights));
          f.inputGrad = torch::autograd::grad({f.output}, {f.input}, {f.outputGrad},
                                              /*retain_graph=*/true, /*create_graph=*/false,
                                              /*allow_unused=*/true)[0];
        }
        break;
      }
      case ActionKind::kBackwardWeight: {
        if (f.weightPass && !f.weightPass->groups.empty()) {
          f.weightPass->run();
          ++stats.weightOnlyPasses;
        } else if (!weights.empty() && f.output.requires_grad()) {  // stage 0: the whole backward
          torch::autograd::backward({f.output}, {f.outputGrad}, /*retain_graph=*/false,
                                    /*create_graph=*/false, weights);
        }
        f = InFlight{};  // its input gradient went out after its B
        break;
      }
      case ActionKind::kSendGradient: {
        at::Tensor g = f.inputGrad.defined() ? f.inputGrad : f.input.grad();
        if (!g.defined()) g = at::zeros_like(f.input);  // the stage ignored its input
        gradientSends.push_back(comm_->send(g.contiguous(), prev, tagOf(a.microBatch, kGradient)));
        f.inputGrad = at::Tensor();
        if (!f.output.defined()) f = InFlight{};  // a whole backward ran; zb-h1's W is to come
        break;
      }
    }
    const auto end = Clock::now();
    if (isReceive(a.kind)) stats.waitSeconds += seconds(start, end);
    if (isCompute(a.kind)) stats.computeSeconds += seconds(start, end);
    if (isReceive(a.kind) || isCompute(a.kind))
      stats.spans.push_back({a.kind, a.microBatch, start, end});
  }
  const auto start = Clock::now();
  for (auto& w : gradientSends) w->wait(timeout);
  for (auto& f : mb) {  // the last stage sends nothing; others had every gradient back
    for (auto& w : f.activationSend) w->wait(timeout);
  }
  stats.waitSeconds += seconds(start, Clock::now());
  return stats;
}

}  // namespace caravan
