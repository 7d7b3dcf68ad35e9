// Sharded data parallelism: flat units, reduce-scatter, all-gather (see sharding.h).
#include "sync/sharding.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/native/Resize.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <deque>
#include <set>

#include "core/errors.h"
#include "memory/accounting.h"
#include "memory/tier_piece.h"
#include "memory/weights.h"
#include "sync/optimizer_state.h"
#include "sync/replicas.h"

namespace caravan {

// One gather of a unit (sharding.h, "bf16 gathers"): its parameters' elements in a flat buffer
// of their own, gathered in `dtype`.
struct ShardedParameters::Group {
  std::vector<size_t> params;    // indices into params_
  std::vector<int64_t> offsets;  // elements into `full`
  int64_t numel = 0, padded = 0, shardNumel = 0;
  int64_t sliceOffset = 0;  // where its part of a rank's slice starts (elements)
  int64_t unitOffset = 0;   // where its elements start among the unit's (unpadded)
  at::ScalarType dtype = at::kFloat;
  at::Tensor full;  // [padded] of dtype
  at::Tensor sent;  // bf16: this rank's slice cast, for the gather in flight
};

struct ShardedParameters::Unit {
  std::vector<Group> groups;                      // bf16-gathered (if any) first, then float32
  std::vector<size_t> blocks;                     // the blocks that own it (the shared unit: none)
  int64_t numel = 0, padded = 0, shardNumel = 0;  // sums over the groups
  bool resident = true;  // `full` always holds bytes (every level but parameters; shared)
  at::Tensor gradFull;   // [padded] the local gradients, rank-major (optimizer: kept; else in
                         // flight only)
  at::Tensor gradShard;  // [shardNumel] averaged gradient (optimizer: a view of gradFull)
  at::Tensor reduced;    // optimizer: the reduce-scatter's output, copied into gradShard
  WorkPtr reduceWork;
  std::vector<WorkPtr> gatherWork;  // one per group while in flight
  // Offloaded (ShardedParameters::offloadTo): the slice of the weights (shards_[i]) and its
  // optimizer state (from the first update on) on the tier while not in use.
  std::unique_ptr<TierPiece> weights, state;
  // gradShard too, from its reduce-scatter's end (scaled by 1/W there) to the update.
  std::unique_ptr<TierPiece> grads;
  double gradNormSquared = 0.0;  // of the scaled gradShard, taken while it was in memory
  bool sliceHeld = false;        // `weights` acquired for the gather in flight
  int64_t stateBytes = 0;        // offloaded, a resident unit's: its state's bytes counted
  bool gathered = true;          // `full` holds the current weights (no gather in flight)
  bool ready = false;            // this step: its gradients are final (launch when its turn comes)
  bool launched = false;         // this step: its reduce-scatter is issued
};

namespace {

int64_t bytesOf(int64_t elements) { return elements * static_cast<int64_t>(sizeof(float)); }

c10::StorageImpl* storageOf(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

// Calls fn(to, from, length) for the pieces of group `g`'s elements [begin, begin + n) in a
// unit's rank-major flat buffer (rank q's slice of `unitShard` elements holds elements
// [q s, (q+1) s) of the group at the group's sliceOffset): `to` into that buffer, `from` into
// the n elements.
template <typename Fn>
void forEachPiece(const ShardedParameters::Group& g, int64_t unitShard, int64_t begin, int64_t n,
                  Fn fn) {
  for (int64_t e = begin; e < begin + n;) {
    const int64_t q = e / g.shardNumel, within = e % g.shardNumel;
    const int64_t length = std::min(begin + n - e, g.shardNumel - within);
    fn(q * unitShard + g.sliceOffset + within, e - begin, length);
    e += length;
  }
}

}  // namespace

ShardedParameters::ShardedParameters(BlockModel model, std::shared_ptr<Communicator> comm,
                                     ShardLevel level, MemoryTracker* tracker,
                                     int64_t inFlightBytes,
                                     const std::set<const c10::TensorImpl*>& bf16Gathered,
                                     std::optional<StageScope> stage)
    : model_(std::move(model)),
      comm_(std::move(comm)),
      level_(level),
      tracker_(tracker),
      stage_(std::move(stage)),
      inFlightCap_(inFlightBytes) {
  CARAVAN_CHECK(comm_ != nullptr, "sharded data parallelism needs a communicator");
  CARAVAN_CHECK(level_ != ShardLevel::kNone, "ShardedParameters for sync.shard = none");
  // rank 0's initial parameters (and buffers) everywhere (a pipeline broadcasts nothing)
  if (!stage_) broadcastModel(*comm_, *model_);
  layUnits(level_ == ShardLevel::kParameters && !stage_ ? bf16Gathered
                                                        : std::set<const c10::TensorImpl*>{});
  if (stage_) return;  // the program's gathers and launches are the engine's calls
  inner_ = model_->runner();
  model_->setRunner(this);
}

ShardedParameters::~ShardedParameters() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hookKeys_[i]);
  if (!stage_) model_->setRunner(inner_);
}

std::set<const c10::TensorImpl*> sharedParameters(BlockModel& model) {
  std::set<const c10::TensorImpl*> shared;
  auto named = model->named_parameters();
  for (const auto& use : model->sharedUses()) {
    if (const at::Tensor* p = named.find(use.name)) shared.insert(p->unsafeGetTensorImpl());
  }
  // A parameter registered in several blocks is read by each: shared too.
  std::map<const c10::TensorImpl*, int> blocksOf;
  for (const auto& block : blockParameters(model)) {
    std::set<const c10::TensorImpl*> here;
    for (const auto& p : block) here.insert(p.unsafeGetTensorImpl());
    for (const auto* p : here) {
      if (++blocksOf[p] > 1) shared.insert(p);
    }
  }
  return shared;
}

std::set<const c10::TensorImpl*> bf16GatheredParameters(BlockModel& model, const Batch& sample) {
  std::set<const c10::TensorImpl*> gathered;
  // The candidates: the trainable, unshared parameters of the bf16 blocks.
  const std::set<const c10::TensorImpl*> shared = sharedParameters(model);
  const std::vector<std::vector<at::Tensor>> perBlock = blockParameters(model);
  std::vector<at::Tensor> candidates;
  for (size_t b = 0; b < perBlock.size(); ++b) {
    if (!model->bf16(b)) continue;
    for (const auto& p : perBlock[b]) {
      if (p.requires_grad() && shared.count(p.unsafeGetTensorImpl()) == 0) candidates.push_back(p);
    }
  }
  if (candidates.empty()) return gathered;
  // One forward and loss with autograd, as training runs it; what it changes is put back.
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  const at::Tensor rngState = generator.get_state();
  std::vector<at::Tensor> buffers, saved;
  for (const auto& b : model->buffers()) {
    buffers.push_back(b);
    saved.push_back(b.clone());
  }
  BlockRunner* runner = model->runner();
  model->setRunner(nullptr);
  std::exception_ptr failure;
  std::map<const torch::autograd::Node*, std::vector<const torch::autograd::Node*>> consumers;
  at::Tensor loss;
  try {
    torch::AutoGradMode grad(true);
    loss = model->loss(model->forward(sample.input), sample.target);
    // Every node's consumers (the nodes whose edges lead to it), from the loss down.
    std::vector<const torch::autograd::Node*> todo{loss.grad_fn().get()};
    std::set<const torch::autograd::Node*> seen(todo.begin(), todo.end());
    while (!todo.empty()) {
      const torch::autograd::Node* node = todo.back();
      todo.pop_back();
      if (node == nullptr) continue;
      for (const torch::autograd::Edge& e : node->next_edges()) {
        if (!e.is_valid()) continue;
        consumers[e.function.get()].push_back(node);
        if (seen.insert(e.function.get()).second) todo.push_back(e.function.get());
      }
    }
    for (const auto& p : candidates) {
      const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(p);
      if (!accumulator) continue;  // not used
      const auto it = consumers.find(accumulator.get());
      if (it == consumers.end() || it->second.size() != 1) continue;
      const torch::autograd::Node* use = it->second.front();
      if (use->name() == "ToCopyBackward0" && use->num_inputs() == 1 &&
          use->input_metadata(0).dtype() == caffe2::TypeMeta::Make<c10::BFloat16>()) {
        gathered.insert(p.unsafeGetTensorImpl());
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  consumers.clear();
  loss = at::Tensor();
  model->setRunner(runner);
  generator.set_state(rngState);
  {
    torch::NoGradGuard noGrad;
    for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(saved[i]);
  }
  if (failure) std::rethrow_exception(failure);
  return gathered;
}

int64_t gatherBytes(const std::vector<at::Tensor>& params,
                    const std::set<const c10::TensorImpl*>& bf16Gathered) {
  int64_t bytes = 0;
  for (const auto& p : params) {
    const int64_t n = p.numel();
    bytes += bf16Gathered.count(p.unsafeGetTensorImpl()) != 0 ? 2 * n : bytesOf(n);
  }
  return bytes;
}

void ShardedParameters::layUnits(const std::set<const c10::TensorImpl*>& bf16Gathered) {
  const int w = comm_->size(), r = comm_->rank();
  // Parameters that several blocks read: one unit of their own, always gathered.
  const std::set<const c10::TensorImpl*> shared = sharedParameters(model_);
  std::map<const c10::TensorImpl*, size_t> index;
  for (const auto& p : stage_ ? stage_->params : model_->parameters()) {
    if (!p.requires_grad() || index.count(p.unsafeGetTensorImpl()) != 0) continue;
    CARAVAN_CHECK(p.scalar_type() == at::kFloat && p.is_contiguous(),
                  "sharded data parallelism holds float32 parameters");
    index[p.unsafeGetTensorImpl()] = params_.size();
    params_.push_back(p);
  }
  const std::vector<std::vector<at::Tensor>> perBlock = blockParameters(model_);
  blockUnit_.assign(perBlock.size(), -1);
  auto addUnit = [&](const std::vector<at::Tensor>& ps, std::vector<size_t> blocks) {
    auto u = std::make_unique<Unit>();
    u->blocks = std::move(blocks);
    u->resident = level_ != ShardLevel::kParameters || u->blocks.empty();
    // The parameters gathered in bf16 first (a group of their own), then the others.
    for (const bool bf16 : {true, false}) {
      Group g;
      g.dtype = bf16 ? at::kBFloat16 : at::kFloat;
      for (const auto& p : ps) {
        if ((bf16Gathered.count(p.unsafeGetTensorImpl()) != 0) != bf16) continue;
        g.params.push_back(index.at(p.unsafeGetTensorImpl()));
        g.offsets.push_back(g.numel);
        g.numel += p.numel();
      }
      if (g.params.empty() && (bf16 || !u->groups.empty())) continue;
      CARAVAN_CHECK(!bf16 || !u->resident, "a resident unit is gathered in float32");
      g.padded = (std::max<int64_t>(g.numel, 1) + w - 1) / w * w;
      g.shardNumel = g.padded / w;
      g.sliceOffset = u->shardNumel;
      g.unitOffset = u->numel;
      u->numel += g.numel;
      u->padded += g.padded;
      u->shardNumel += g.shardNumel;
      u->groups.push_back(std::move(g));
    }
    for (size_t b : u->blocks) blockUnit_[b] = static_cast<int64_t>(units_.size());
    units_.push_back(std::move(u));
  };
  const size_t begin = stage_ ? stage_->begin : 0, end = stage_ ? stage_->end : perBlock.size();
  for (size_t b = end; b-- > begin;) {  // index order: backward's
    std::vector<at::Tensor> own;
    std::set<const c10::TensorImpl*> seen;  // a module registered twice in the block: once
    for (const auto& p : perBlock[b]) {
      const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
      if (shared.count(impl) == 0 && seen.insert(impl).second) own.push_back(p);
    }
    if (!own.empty()) addUnit(own, {b});
  }
  std::vector<at::Tensor> ps;
  for (const auto& p : params_) {
    if (shared.count(p.unsafeGetTensorImpl()) == 0) continue;
    if (stage_) {
      addUnit({p}, {});  // one each: a tied parameter's slices alike on each of its stages
    } else {
      ps.push_back(p);
    }
  }
  if (!ps.empty()) {
    sharedUnit_ = static_cast<int64_t>(units_.size());
    addUnit(ps, {});
  }
  for (size_t i = 0; i < units_.size(); ++i) {
    Unit& u = *units_[i];
    // The unit's float32 values, rank-major: [rank 0's slice | rank 1's | ...] (one group: its
    // flat buffer as it is gathered).
    at::Tensor flat = at::zeros({u.padded}, at::kFloat);
    for (const Group& g : u.groups) {
      for (size_t k = 0; k < g.params.size(); ++k) {
        const at::Tensor values = params_[g.params[k]].detach().reshape({-1});
        forEachPiece(g, u.shardNumel, g.offsets[k], values.numel(),
                     [&](int64_t to, int64_t from, int64_t length) {
                       flat.narrow(0, to, length).copy_(values.narrow(0, from, length));
                     });
      }
    }
    const at::Tensor mine = flat.narrow(0, r * u.shardNumel, u.shardNumel);
    if (u.resident) {
      u.groups.front().full = flat;
      shards_.push_back(mine);
      viewParameters(i);
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, bytesOf(u.padded));
    } else {
      shards_.push_back(mine.clone());
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, bytesOf(u.shardNumel));
      for (Group& g : u.groups) g.full = at::empty({g.padded}, g.dtype);
      viewParameters(i);
      u.gathered = true;
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, gatheredBytes(i));
      release(i);
    }
    if (level_ == ShardLevel::kOptimizer) {
      u.gradFull = at::zeros({u.padded}, at::kFloat);
      u.gradShard = u.gradFull.narrow(0, r * u.shardNumel, u.shardNumel);
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kGradients, bytesOf(u.padded));
    } else {
      u.gradShard = at::zeros({u.shardNumel}, at::kFloat);
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kGradients, bytesOf(u.shardNumel));
    }
  }
  int64_t largest = 0;
  for (const auto& u : units_) largest = std::max(largest, bytesOf(u->padded));
  inFlightCap_ = std::max(inFlightCap_, 2 * largest);
  // Units of blocks above each block (those final when the block's backward starts).
  unitsAbove_.assign(perBlock.size(), 0);
  for (size_t b = 0; b < perBlock.size(); ++b) {
    for (const auto& u : units_) {
      if (!u->blocks.empty() && u->blocks.front() > b) ++unitsAbove_[b];
    }
  }
  if (!stage_) hookAccumulators();  // a stage's gradients accumulate over the program
}

void ShardedParameters::viewParameters(size_t unit) {
  torch::NoGradGuard noGrad;
  for (const Group& g : units_[unit]->groups) {
    for (size_t k = 0; k < g.params.size(); ++k) {
      at::Tensor& p = params_[g.params[k]];
      p.set_data(g.full.narrow(0, g.offsets[k], p.numel()).view(p.sizes()));
    }
  }
}

void ShardedParameters::hookAccumulators() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hookKeys_[i]);
  accumulators_.clear();
  hookKeys_.clear();
  // A post hook on each parameter's gradient accumulator: its .grad is final for this step.
  for (size_t i = 0; i < units_.size(); ++i) {
    for (const Group& g : units_[i]->groups) {
      for (size_t p : g.params) {
        auto acc = torch::autograd::impl::grad_accumulator(params_[p]);
        auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [this, unit = i](const torch::autograd::variable_list& outputs,
                             const torch::autograd::variable_list&) {
              onGradReady(unit);
              return outputs;
            }));
        accumulators_.push_back(acc);
        hookKeys_.push_back(key);
      }
    }
  }
}

int64_t ShardedParameters::gatheredBytes(size_t unit) const {
  int64_t bytes = 0;
  for (const Group& g : units_[unit]->groups) {
    bytes += g.padded * static_cast<int64_t>(c10::elementSize(g.dtype));
  }
  return bytes;
}

int64_t ShardedParameters::nextGatheredUnit(size_t block, int direction) const {
  for (int64_t b = static_cast<int64_t>(block);
       b >= 0 && b < static_cast<int64_t>(blockUnit_.size()); b += direction) {
    const int64_t u = blockUnit_[b];
    if (u >= 0 && !units_[u]->resident) return u;
  }
  return -1;
}

void ShardedParameters::gather(size_t unit) {
  Unit& u = *units_[unit];
  if (u.gathered || !u.gatherWork.empty()) return;
  CARAVAN_CHECK(!u.resident, "a resident unit is gathered after the update only");
  if (u.weights) {
    u.weights->acquire();  // the slice is the gather's input until it completes
    u.sliceHeld = true;
  }
  if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, gatheredBytes(unit));
  for (Group& g : u.groups) {
    at::native::resize_bytes_cpu(storageOf(g.full),
                                 static_cast<size_t>(g.padded) * c10::elementSize(g.dtype));
    at::Tensor slice = shards_[unit].narrow(0, g.sliceOffset, g.shardNumel);
    if (g.dtype != at::kFloat) {
      // Rounded to nearest even, as autocast's cast of the whole weight rounds each element.
      g.sent = slice.to(g.dtype);
      slice = g.sent;
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, tensorBytes({g.sent}));
    }
    u.gatherWork.push_back(comm_->allgather(g.full, slice));
  }
}

void ShardedParameters::prefetchSlice(int64_t unit) {
  if (unit >= 0 && units_[unit]->weights) units_[unit]->weights->prefetch();
}

void ShardedParameters::waitGathered(size_t unit) {
  Unit& u = *units_[unit];
  if (u.gatherWork.empty()) return;
  for (const WorkPtr& work : u.gatherWork) work->wait(comm_->timeout());
  u.gatherWork.clear();
  for (Group& g : u.groups) {
    if (!g.sent.defined()) continue;
    if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, -tensorBytes({g.sent}));
    g.sent = at::Tensor();
  }
  u.gathered = true;
  if (u.sliceHeld) {
    u.sliceHeld = false;
    u.weights->release(TierPiece::Release::kUnchanged);
  }
}

void ShardedParameters::release(size_t unit) {
  Unit& u = *units_[unit];
  if (u.resident || !u.gathered) return;
  for (Group& g : u.groups) at::native::resize_bytes_cpu(storageOf(g.full), 0);
  u.gathered = false;
  if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, -gatheredBytes(unit));
}

void ShardedParameters::beginForward(size_t block) {
  if (block == 0) releaseGathered();  // what the last forward kept (its last block)
  if (sharedUnit_ >= 0) waitGathered(static_cast<size_t>(sharedUnit_));
  const int64_t u = blockUnit_[block];
  if (u >= 0) {
    gather(static_cast<size_t>(u));  // no-op when prefetched or resident
    const int64_t next = nextGatheredUnit(block + 1, +1);
    if (next >= 0) gather(static_cast<size_t>(next));
    if (offloaded_) {
      // The next gather's slice; at the last block, the first one backward gathers below it.
      prefetchSlice(block + 1 < blockUnit_.size() ? nextGatheredUnit(block + 2, +1)
                    : block > 0                   ? nextGatheredUnit(block - 1, -1)
                                                  : -1);
    }
    waitGathered(static_cast<size_t>(u));
  }
}

void ShardedParameters::endForward(size_t block) {
  // The last block's unit stays: backward needs it first, and a model's own loss may read it;
  // the next forward (or releaseGathered) lets it go.
  const int64_t u = blockUnit_[block];
  if (u >= 0 && block + 1 < blockUnit_.size()) release(static_cast<size_t>(u));
}

torch::Tensor ShardedParameters::run(size_t index, torch::nn::AnyModule& block, torch::Tensor x) {
  beginForward(index);
  torch::Tensor y = inner_ != nullptr ? inner_->run(index, block, x) : block.forward(x);
  if (at::GradMode::is_enabled() && y.requires_grad()) {
    // A view's node is replaced if the next block changes it in place, and its hook would
    // never run: the unit's backward gather rests on it, so the block hands on a copy.
    const int64_t u = blockUnit_[index];
    if (y.is_view() && u >= 0 && !units_[u]->resident) y = y.clone();
    y.register_hook([this, index](const at::Tensor&) { beforeBackward(index); });
  }
  endForward(index);
  return y;
}

void ShardedParameters::idleForward() {
  for (size_t b = 0; b < blockUnit_.size(); ++b) {
    beginForward(b);
    endForward(b);
  }
}

void ShardedParameters::releaseGathered() {
  for (size_t i = 0; i < units_.size(); ++i) {
    if (units_[i]->gatherWork.empty()) release(i);
  }
}

void ShardedParameters::beforeBackward(size_t block) {
  // Every block above has finished its backward (autograd runs a later block's nodes, and the
  // accumulation of their gradients, before an earlier block's): their units are final, with
  // zeros for a parameter that got no gradient. Launched here, at the same point of every
  // rank's backward whatever each rank's gradients are.
  const size_t final = unitsAbove_[block];
  for (size_t i = nextLaunch_; i < final; ++i) units_[i]->ready = true;
  launchReadyInOrder();
  const int64_t u = blockUnit_[block];
  if (u < 0 || units_[u]->resident) return;
  gather(static_cast<size_t>(u));
  if (block > 0) {
    const int64_t below = nextGatheredUnit(block - 1, -1);
    if (below >= 0) gather(static_cast<size_t>(below));
    if (offloaded_ && block > 1) prefetchSlice(nextGatheredUnit(block - 2, -1));
  }
  waitGathered(static_cast<size_t>(u));
}

void ShardedParameters::onGradReady(size_t unit) {
  // A gradient after its unit was exchanged would be lost: the launch points above rest on
  // blocks being a chain (block i's output is block i+1's only input that carries gradient).
  CARAVAN_CHECK(!units_[unit]->launched,
                "a gradient of sharded unit {} arrived after the unit's reduce-scatter: the "
                "model's blocks are not a chain for autograd",
                unit);
}

void ShardedParameters::launchReadyInOrder() {
  while (nextLaunch_ < units_.size() && units_[nextLaunch_]->ready) {
    const size_t i = nextLaunch_++;
    Unit& u = *units_[i];
    u.launched = true;
    if (level_ != ShardLevel::kOptimizer) {
      // The local gradients in flight stay within the cap (parameters: one unit's): the oldest
      // exchanges are waited for first.
      while (!inFlight_.empty() && (level_ == ShardLevel::kParameters ||
                                    inFlightBytes_ + bytesOf(u.padded) > inFlightCap_)) {
        finishReduce(inFlight_.front());
      }
      inFlight_.push_back(i);
      inFlightBytes_ += bytesOf(u.padded);
      u.gradFull = at::empty({u.padded}, at::kFloat);
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kGradients, bytesOf(u.padded));
    }
    // Rank-major (sharding.h): each group's part of rank q's slice in rank q's; a gradient in
    // bf16 (a bf16-gathered parameter's) converts exactly.
    for (const Group& g : u.groups) {
      for (size_t k = 0; k < g.params.size(); ++k) {
        at::Tensor& p = params_[g.params[k]];
        const at::Tensor grad = p.grad().defined() ? p.grad().reshape({-1}) : at::Tensor();
        forEachPiece(g, u.shardNumel, g.offsets[k], p.numel(),
                     [&](int64_t to, int64_t from, int64_t length) {
                       at::Tensor part = u.gradFull.narrow(0, to, length);
                       if (grad.defined()) {
                         part.copy_(grad.narrow(0, from, length));
                       } else {
                         part.zero_();
                       }
                     });
        p.mutable_grad() = at::Tensor();
      }
      forEachPiece(
          g, u.shardNumel, g.numel, g.padded - g.numel,
          [&](int64_t to, int64_t, int64_t length) { u.gradFull.narrow(0, to, length).zero_(); });
    }
    // A stage averages as its unsharded replicas' all-reduce does; else a sum scaled by 1/W.
    const ReduceOp op = stage_ ? ReduceOp::kAvg : ReduceOp::kSum;
    if (level_ == ShardLevel::kOptimizer) {
      u.reduced = at::empty({u.shardNumel}, at::kFloat);
      u.reduceWork = comm_->reduceScatter(u.reduced, u.gradFull, op);
    } else {
      if (u.grads) u.grads->acquireToOverwrite();  // the reduce-scatter's output
      u.reduceWork = comm_->reduceScatter(u.gradShard, u.gradFull, op);
    }
    release(i);  // its backward is done (parameters)
  }
}

void ShardedParameters::finishReduce(size_t unit) {
  Unit& u = *units_[unit];
  if (!u.reduceWork) return;
  u.reduceWork->wait(comm_->timeout());
  u.reduceWork.reset();
  if (level_ != ShardLevel::kOptimizer) {
    u.gradFull = at::Tensor();
    if (tracker_ != nullptr) tracker_->add(MemoryCategory::kGradients, -bytesOf(u.padded));
    CARAVAN_CHECK(!inFlight_.empty() && inFlight_.front() == unit,
                  "sharded unit {}'s exchange finished out of launch order", unit);
    inFlight_.pop_front();
    inFlightBytes_ -= bytesOf(u.padded);
  }
  if (u.grads) {
    // Offloaded: scaled now, as finishGradients scales the others, and its norm taken, while
    // it is in memory; then it goes to the tier until the update.
    u.gradShard.mul_(1.0 / static_cast<double>(comm_->size()));
    u.gradNormSquared = u.gradShard.to(at::kDouble).pow(2).sum().item<double>();
    // One gradient write in flight at a time: the previous unit's is done first.
    if (lastGradWrite_ >= 0) units_[lastGradWrite_]->grads->waitWritten();
    u.grads->release(TierPiece::Release::kChanged);
    lastGradWrite_ = static_cast<int64_t>(unit);
  }
}

void ShardedParameters::finishGradients() {
  for (auto& u : units_) u->ready = true;  // a missing gradient contributes zeros
  launchReadyInOrder();
  const double scale = stage_ ? 1.0 : 1.0 / static_cast<double>(comm_->size());
  gradCoefficient_ = 1.0;
  for (size_t i = 0; i < units_.size(); ++i) {
    Unit& u = *units_[i];
    finishReduce(i);
    if (u.grads) {  // scaled by finishReduce; attached for its update (stepOffloaded)
      u.ready = u.launched = false;
      continue;
    }
    if (level_ == ShardLevel::kOptimizer) {
      u.gradShard.copy_(u.reduced);
      u.reduced = at::Tensor();
    }
    if (scale != 1.0) u.gradShard.mul_(scale);
    shards_[i].mutable_grad() = u.gradShard;
    u.ready = u.launched = false;
  }
  nextLaunch_ = 0;
}

double ShardedParameters::globalGradientNormSquared() {
  at::Tensor sum = torch::tensor({localGradientNormSquared({})}, at::kDouble);
  comm_->allreduce(sum, ReduceOp::kSum)->wait(comm_->timeout());
  return sum.item<double>();
}

double ShardedParameters::localGradientNormSquared(const std::vector<at::Tensor>& skip) {
  std::set<size_t> skipped;
  for (const auto& p : skip) skipped.insert(unitAlone(p));
  double local = 0.0;
  for (size_t i = 0; i < units_.size(); ++i) {
    if (skipped.count(i) != 0) continue;
    const Unit& u = *units_[i];
    local += u.grads ? u.gradNormSquared : u.gradShard.to(at::kDouble).pow(2).sum().item<double>();
  }
  return local;
}

size_t ShardedParameters::unitAlone(const at::Tensor& param) const {
  for (size_t i = 0; i < units_.size(); ++i) {
    const Unit& u = *units_[i];
    if (u.groups.size() == 1 && u.groups.front().params.size() == 1 &&
        params_[u.groups.front().params.front()].is_same(param)) {
      return i;
    }
  }
  CARAVAN_CHECK(false, "a parameter of {} elements is not a sharded unit of its own",
                param.numel());
  return 0;
}

at::Tensor ShardedParameters::gradientSlice(const at::Tensor& param) const {
  return units_[unitAlone(param)]->gradShard;
}

void ShardedParameters::gatherAll() {
  for (size_t i = units_.size(); i-- > 0;) gather(i);  // resident ones: after-update gathers
  settle();
}

void ShardedParameters::afterUpdate() {
  // Forward order: the first block's unit is gathered first.
  for (size_t i = units_.size(); i-- > 0;) {
    Unit& u = *units_[i];
    if (!u.resident) continue;
    // The slice's gradient is spent: its buffer carries the updated slice to the others (one
    // float32 group).
    u.gradShard.copy_(shards_[i]);
    u.gatherWork.push_back(comm_->allgather(u.groups.front().full, u.gradShard));
    u.gathered = false;
  }
}

void ShardedParameters::settle() {
  for (size_t i = 0; i < units_.size(); ++i) waitGathered(i);
}

void ShardedParameters::forEachUnitGathered(const std::function<void(size_t unit)>& fn) {
  std::vector<size_t> unitOf(params_.size());
  for (size_t i = 0; i < units_.size(); ++i) {
    for (const Group& g : units_[i]->groups) {
      for (size_t p : g.params) unitOf[p] = i;
    }
  }
  std::vector<size_t> order;  // the units by their first parameter in the model's order
  std::vector<bool> listed(units_.size(), false);
  for (size_t p = 0; p < params_.size(); ++p) {
    if (!listed[unitOf[p]]) order.push_back(unitOf[p]);
    listed[unitOf[p]] = true;
  }
  // A unit with a bf16 group comes from its float32 masters (gatherMasters), not its bf16 copies.
  auto fromMasters = [&](size_t i) { return units_[i]->groups.front().dtype != at::kFloat; };
  auto issue = [&](size_t k) {  // the gather of the k-th unit (resident ones are whole)
    if (k < order.size() && !units_[order[k]]->resident && !fromMasters(order[k])) {
      gather(order[k]);
    }
  };
  std::exception_ptr failure;
  bool viewsChanged = false;
  issue(0);
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    issue(k + 1);
    if (offloaded_ && k + 2 < order.size()) prefetchSlice(static_cast<int64_t>(order[k + 2]));
    // The parameters that are float32 copies while fn runs, and their bf16 views to go back to.
    std::vector<std::pair<size_t, at::Tensor>> views;
    if (fromMasters(i)) {
      const at::Tensor masters = gatherMasters(i);
      torch::NoGradGuard noGrad;
      for (const Group& g : units_[i]->groups) {
        for (size_t j = 0; j < g.params.size(); ++j) {
          at::Tensor& p = params_[g.params[j]];
          views.emplace_back(g.params[j], p.tensor_data());
          p.set_data(masters.narrow(0, g.unitOffset + g.offsets[j], p.numel()).view(p.sizes()));
        }
      }
    } else {
      waitGathered(i);
    }
    if (fn && !failure) {
      try {
        fn(i);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (!views.empty()) {
      torch::NoGradGuard noGrad;
      for (auto& [p, view] : views) params_[p].set_data(view);
      viewsChanged = true;
    }
    release(i);
  }
  if (viewsChanged) hookAccumulators();  // set_data to another dtype gave new accumulators
  if (failure) std::rethrow_exception(failure);
}

at::Tensor ShardedParameters::gatherMasters(size_t unit) {
  const Unit& u = *units_[unit];
  const int w = comm_->size();
  if (u.weights) u.weights->acquire();
  at::Tensor all = at::empty({u.padded}, at::kFloat);
  comm_->allgather(all, shards_[unit])->wait(comm_->timeout());
  if (u.weights) u.weights->release(TierPiece::Release::kUnchanged);
  std::vector<ShardGroup> groups;
  for (const Group& g : u.groups) groups.push_back({g.numel, g.padded});
  return joinSlices(all.view({w, u.shardNumel}).unbind(0), groups);
}

std::vector<at::Tensor> ShardedParameters::unitParameters(size_t unit) const {
  std::vector<at::Tensor> ps;
  for (const Group& g : units_[unit]->groups) {
    for (size_t p : g.params) ps.push_back(params_[p]);
  }
  return ps;
}

std::vector<at::Tensor> ShardedParameters::unitParametersInModelOrder(size_t unit) const {
  std::vector<size_t> indices;  // into params_, which is in the model's order
  for (const Group& g : units_[unit]->groups)
    indices.insert(indices.end(), g.params.begin(), g.params.end());
  std::sort(indices.begin(), indices.end());
  std::vector<at::Tensor> ps;
  for (size_t p : indices) ps.push_back(params_[p]);
  return ps;
}

ShardedParameters::UnitLayout ShardedParameters::unitLayout(size_t unit) const {
  const Unit& u = *units_[unit];
  UnitLayout l{unitParameters(unit), {}, u.numel, u.padded, {}, {}};
  for (const Group& g : u.groups) {
    for (int64_t offset : g.offsets) l.offsets.push_back(g.unitOffset + offset);
    l.groups.push_back({g.numel, g.padded});
    l.dtypes.push_back(g.dtype);
  }
  return l;
}

void ShardedParameters::gatherOptimizerState(torch::optim::Optimizer& sliced,
                                             torch::optim::Optimizer& whole, int onRank) const {
  const int r = comm_->rank();
  for (size_t i = 0; i < units_.size(); ++i) {
    const Unit& u = *units_[i];
    const int tag = static_cast<int>(i);
    const FlatOptimizerState mine = caravan::gatherOptimizerState(sliced, {shards_[i]});
    if (r != onRank) {
      sendOptimizerState(*comm_, mine, onRank, tag);
      continue;
    }
    FlatOptimizerState all;
    all.step = mine.step;
    std::vector<at::Tensor> slices;
    for (int from = 0; from < comm_->size(); ++from) {
      const FlatOptimizerState part =
          from == r ? mine : recvOptimizerState(*comm_, u.shardNumel, from, tag, comm_->timeout());
      CARAVAN_CHECK(part.rows() == mine.rows() && part.step == mine.step,
                    "rank {}'s optimizer state of unit {}: {} rows at step {}, {} at {} here", from,
                    i, part.rows(), part.step, mine.rows(), mine.step);
      if (part.rows() != 0) slices.push_back(part.slots);
    }
    if (!slices.empty()) all.slots = joinSlices(slices, unitLayout(i).groups);
    scatterOptimizerState(whole, unitParameters(i), all);
  }
}

void ShardedParameters::sliceOptimizerState(torch::optim::Optimizer& whole,
                                            torch::optim::Optimizer& sliced) const {
  const int w = comm_->size(), r = comm_->rank();
  for (size_t i = 0; i < units_.size(); ++i) {
    const FlatOptimizerState all = caravan::gatherOptimizerState(whole, unitParameters(i));
    FlatOptimizerState mine;
    mine.step = all.step;
    if (all.rows() > 0) mine.slots = sliceOfGroups(all.slots, unitLayout(i).groups, w, r);
    scatterOptimizerState(sliced, {shards_[i]}, mine);
  }
}

void ShardedParameters::offloadTo(Tier& tier, torch::optim::Optimizer& sliced) {
  CARAVAN_CHECK(level_ == ShardLevel::kParameters, "offloaded slices need sync.shard = parameters");
  settle();
  tier_ = &tier;
  sliced_ = &sliced;
  offloaded_ = true;
  for (size_t i = 0; i < units_.size(); ++i) {
    Unit& u = *units_[i];
    const std::vector<at::Tensor> state = optimizerStateTensors(sliced, shards_[i]);
    if (u.resident) {
      u.stateBytes = tensorBytes(state);
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kOptimizerState, u.stateBytes);
      continue;
    }
    // The slice's bytes move into the piece (counted there from now on).
    if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, -bytesOf(u.shardNumel));
    u.weights = std::make_unique<TierPiece>(tier, std::vector<at::Tensor>{shards_[i]}, tracker_,
                                            MemoryCategory::kWeights);
    if (tracker_ != nullptr) tracker_->add(MemoryCategory::kGradients, -bytesOf(u.shardNumel));
    u.grads = std::make_unique<TierPiece>(tier, std::vector<at::Tensor>{u.gradShard}, tracker_,
                                          MemoryCategory::kGradients);
    if (!state.empty()) {  // a resumed run's
      u.state = std::make_unique<TierPiece>(tier, state, tracker_, MemoryCategory::kOptimizerState);
    }
  }
}

void ShardedParameters::scaleGradients(double coefficient) {
  for (size_t i = 0; i < units_.size(); ++i) {
    if (units_[i]->grads) continue;  // applied by stepOffloaded, in memory
    if (shards_[i].grad().defined()) shards_[i].grad().mul_(coefficient);
  }
  gradCoefficient_ *= coefficient;
}

void ShardedParameters::stepOffloaded(torch::optim::Optimizer& sliced) {
  CARAVAN_CHECK(offloaded_ && &sliced == sliced_, "stepOffloaded without offloadTo");
  // The optimizer steps the parameters that have a gradient: one slice at a time.
  std::vector<at::Tensor> grads(shards_.size());
  for (size_t i = 0; i < shards_.size(); ++i) {
    grads[i] = units_[i]->grads ? units_[i]->gradShard : shards_[i].grad();
    shards_[i].mutable_grad() = at::Tensor();
  }
  auto prefetch = [&](size_t i) {
    if (i >= units_.size()) return;
    for (TierPiece* p :
         {units_[i]->weights.get(), units_[i]->state.get(), units_[i]->grads.get()}) {
      if (p != nullptr) p->prefetch();
    }
  };
  prefetch(0);
  Unit* previous = nullptr;  // the last offloaded unit updated
  for (size_t i = 0; i < units_.size(); ++i) {
    Unit& u = *units_[i];
    prefetch(i + 1);
    if (u.grads) {
      u.grads->acquire();
      if (gradCoefficient_ != 1.0) u.gradShard.mul_(gradCoefficient_);  // clipping's
    } else if (!grads[i].defined()) {
      continue;
    }
    if (u.weights) u.weights->acquire();
    if (u.state) u.state->acquire();
    shards_[i].mutable_grad() = grads[i];
    sliced.step();
    shards_[i].mutable_grad() = at::Tensor();
    if (u.resident) {
      // Kept in memory: its state is counted when the first step makes it.
      const int64_t now = tensorBytes(optimizerStateTensors(sliced, shards_[i]));
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kOptimizerState, now - u.stateBytes);
      u.stateBytes = now;
      continue;
    }
    u.grads->release(TierPiece::Release::kSpent);
    u.weights->release(TierPiece::Release::kChanged);
    if (u.state) {
      u.state->release(TierPiece::Release::kChanged);
    } else if (auto state = optimizerStateTensors(sliced, shards_[i]); !state.empty()) {
      // The first step made it (SGD without momentum has none).
      u.state = std::make_unique<TierPiece>(*tier_, std::move(state), tracker_,
                                            MemoryCategory::kOptimizerState);
    }
    // The writes in flight stay within two units' slices: the previous unit's are done first.
    if (previous != nullptr) {
      previous->weights->waitWritten();
      if (previous->state) previous->state->waitWritten();
    }
    previous = &u;
  }
  gradCoefficient_ = 1.0;
  lastGradWrite_ = -1;
  // The next forward starts with block 0's and block 1's units (updated last): kept in memory.
  const int64_t first = nextGatheredUnit(0, +1);
  prefetchSlice(first);
  if (first >= 0 && !units_[first]->blocks.empty()) {
    prefetchSlice(nextGatheredUnit(units_[first]->blocks.front() + 1, +1));
  }
  tier_->check();
}

void ShardedParameters::forEachSlice(const std::function<void(size_t unit)>& fn) {
  auto pieces = [this](size_t i) {
    return std::array<TierPiece*, 2>{units_[i]->weights.get(), units_[i]->state.get()};
  };
  for (size_t i = 0; i < units_.size(); ++i) {
    if (i + 1 < units_.size()) {
      for (TierPiece* p : pieces(i + 1)) {
        if (p != nullptr) p->prefetch();
      }
    }
    std::vector<TierPiece*> held;
    std::exception_ptr failure;
    try {
      for (TierPiece* p : pieces(i)) {
        if (p == nullptr) continue;
        p->acquire();
        held.push_back(p);
      }
      fn(i);
    } catch (...) {
      failure = std::current_exception();
    }
    for (TierPiece* p : held) p->release(TierPiece::Release::kUnchanged);
    if (failure) std::rethrow_exception(failure);
  }
}

}  // namespace caravan
