// Sharded data parallelism: flat units, reduce-scatter, all-gather (see sharding.h).
#include "sync/sharding.h"

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

struct ShardedParameters::Unit {
  std::vector<size_t> params;    // indices into params_
  std::vector<int64_t> offsets;  // elements into `full`
  std::vector<size_t> blocks;    // the blocks that own it (the shared unit: none)
  int64_t numel = 0, padded = 0, shardNumel = 0;
  bool resident = true;  // `full` always holds bytes (every level but parameters; shared)
  at::Tensor full;       // [padded]
  at::Tensor gradFull;   // [padded] the local gradients (optimizer: kept; else in flight only)
  at::Tensor gradShard;  // [shardNumel] averaged gradient (optimizer: a view of gradFull)
  at::Tensor reduced;    // optimizer: the reduce-scatter's output, copied into gradShard
  WorkPtr reduceWork, gatherWork;
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

}  // namespace

ShardedParameters::ShardedParameters(BlockModel model, std::shared_ptr<Communicator> comm,
                                     ShardLevel level, MemoryTracker* tracker,
                                     int64_t inFlightBytes)
    : model_(std::move(model)),
      comm_(std::move(comm)),
      level_(level),
      tracker_(tracker),
      inFlightCap_(inFlightBytes) {
  CARAVAN_CHECK(comm_ != nullptr, "sharded data parallelism needs a communicator");
  CARAVAN_CHECK(level_ != ShardLevel::kNone, "ShardedParameters for sync.shard = none");
  broadcastModel(*comm_, *model_);  // rank 0's initial parameters (and buffers) everywhere
  layUnits();
  inner_ = model_->runner();
  model_->setRunner(this);
}

ShardedParameters::~ShardedParameters() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hookKeys_[i]);
  model_->setRunner(inner_);
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

void ShardedParameters::layUnits() {
  const int w = comm_->size(), r = comm_->rank();
  // Parameters that several blocks read: one unit of their own, always gathered.
  const std::set<const c10::TensorImpl*> shared = sharedParameters(model_);
  std::map<const c10::TensorImpl*, size_t> index;
  for (const auto& p : model_->parameters()) {
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
    for (const auto& p : ps) {
      u->params.push_back(index.at(p.unsafeGetTensorImpl()));
      u->offsets.push_back(u->numel);
      u->numel += p.numel();
    }
    u->blocks = std::move(blocks);
    u->padded = (std::max<int64_t>(u->numel, 1) + w - 1) / w * w;
    u->shardNumel = u->padded / w;
    u->resident = level_ != ShardLevel::kParameters || u->blocks.empty();
    for (size_t b : u->blocks) blockUnit_[b] = static_cast<int64_t>(units_.size());
    units_.push_back(std::move(u));
  };
  for (size_t b = perBlock.size(); b-- > 0;) {  // index order: backward's
    std::vector<at::Tensor> own;
    std::set<const c10::TensorImpl*> seen;  // a module registered twice in the block: once
    for (const auto& p : perBlock[b]) {
      const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
      if (shared.count(impl) == 0 && seen.insert(impl).second) own.push_back(p);
    }
    if (!own.empty()) addUnit(own, {b});
  }
  if (!shared.empty()) {
    std::vector<at::Tensor> ps;
    for (const auto& p : params_) {
      if (shared.count(p.unsafeGetTensorImpl()) != 0) ps.push_back(p);
    }
    sharedUnit_ = static_cast<int64_t>(units_.size());
    addUnit(ps, {});
  }
  for (size_t i = 0; i < units_.size(); ++i) {
    Unit& u = *units_[i];
    u.full = at::zeros({u.padded}, at::kFloat);
    for (size_t k = 0; k < u.params.size(); ++k) {
      at::Tensor& p = params_[u.params[k]];
      at::Tensor view = u.full.narrow(0, u.offsets[k], p.numel());
      view.copy_(p.detach().reshape({-1}));
      torch::NoGradGuard noGrad;
      p.set_data(view.view(p.sizes()));
    }
    const at::Tensor mine = u.full.narrow(0, r * u.shardNumel, u.shardNumel);
    if (u.resident) {
      shards_.push_back(mine);
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, bytesOf(u.padded));
    } else {
      shards_.push_back(mine.clone());
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, bytesOf(u.shardNumel));
      u.gathered = true;
      if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, bytesOf(u.padded));
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
  // A post hook on each parameter's gradient accumulator: its .grad is final for this step.
  std::vector<size_t> unitOf(params_.size());
  for (size_t i = 0; i < units_.size(); ++i) {
    for (size_t p : units_[i]->params) unitOf[p] = i;
  }
  for (size_t p = 0; p < params_.size(); ++p) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[p]);
    const size_t unit = unitOf[p];
    auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, unit](const torch::autograd::variable_list& outputs,
                     const torch::autograd::variable_list&) {
          onGradReady(unit);
          return outputs;
        }));
    accumulators_.push_back(acc);
    hookKeys_.push_back(key);
  }
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
  if (u.gathered || u.gatherWork) return;
  CARAVAN_CHECK(!u.resident, "a resident unit is gathered after the update only");
  if (u.weights) {
    u.weights->acquire();  // the slice is the gather's input until it completes
    u.sliceHeld = true;
  }
  at::native::resize_bytes_cpu(storageOf(u.full), static_cast<size_t>(bytesOf(u.padded)));
  if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, bytesOf(u.padded));
  u.gatherWork = comm_->allgather(u.full, shards_[unit]);
}

void ShardedParameters::prefetchSlice(int64_t unit) {
  if (unit >= 0 && units_[unit]->weights) units_[unit]->weights->prefetch();
}

void ShardedParameters::waitGathered(size_t unit) {
  Unit& u = *units_[unit];
  if (!u.gatherWork) return;
  u.gatherWork->wait(comm_->timeout());
  u.gatherWork.reset();
  u.gathered = true;
  if (u.sliceHeld) {
    u.sliceHeld = false;
    u.weights->release(TierPiece::Release::kUnchanged);
  }
}

void ShardedParameters::release(size_t unit) {
  Unit& u = *units_[unit];
  if (u.resident || !u.gathered) return;
  at::native::resize_bytes_cpu(storageOf(u.full), 0);
  u.gathered = false;
  if (tracker_ != nullptr) tracker_->add(MemoryCategory::kWeights, -bytesOf(u.padded));
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
    if (!units_[i]->gatherWork) release(i);
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
    for (size_t k = 0; k < u.params.size(); ++k) {
      at::Tensor& p = params_[u.params[k]];
      at::Tensor part = u.gradFull.narrow(0, u.offsets[k], p.numel());
      if (p.grad().defined()) {
        part.copy_(p.grad().reshape({-1}));
        p.mutable_grad() = at::Tensor();
      } else {
        part.zero_();
      }
    }
    u.gradFull.narrow(0, u.numel, u.padded - u.numel).zero_();
    if (level_ == ShardLevel::kOptimizer) {
      u.reduced = at::empty({u.shardNumel}, at::kFloat);
      u.reduceWork = comm_->reduceScatter(u.reduced, u.gradFull, ReduceOp::kSum);
    } else {
      if (u.grads) u.grads->acquireToOverwrite();  // the reduce-scatter's output
      u.reduceWork = comm_->reduceScatter(u.gradShard, u.gradFull, ReduceOp::kSum);
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
  const double scale = 1.0 / static_cast<double>(comm_->size());
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
    u.gradShard.mul_(scale);
    shards_[i].mutable_grad() = u.gradShard;
    u.ready = u.launched = false;
  }
  nextLaunch_ = 0;
}

double ShardedParameters::globalGradientNormSquared() {
  double local = 0.0;
  for (const auto& u : units_) {
    local +=
        u->grads ? u->gradNormSquared : u->gradShard.to(at::kDouble).pow(2).sum().item<double>();
  }
  at::Tensor sum = torch::tensor({local}, at::kDouble);
  comm_->allreduce(sum, ReduceOp::kSum)->wait(comm_->timeout());
  return sum.item<double>();
}

void ShardedParameters::afterUpdate() {
  // Forward order: the first block's unit is gathered first.
  for (size_t i = units_.size(); i-- > 0;) {
    Unit& u = *units_[i];
    if (!u.resident) continue;
    // The slice's gradient is spent: its buffer carries the updated slice to the others.
    u.gradShard.copy_(shards_[i]);
    u.gatherWork = comm_->allgather(u.full, u.gradShard);
    u.gathered = false;
  }
}

void ShardedParameters::settle() {
  for (size_t i = 0; i < units_.size(); ++i) waitGathered(i);
}

void ShardedParameters::forEachUnitGathered(const std::function<void(size_t unit)>& fn) {
  std::vector<size_t> unitOf(params_.size());
  for (size_t i = 0; i < units_.size(); ++i) {
    for (size_t p : units_[i]->params) unitOf[p] = i;
  }
  std::vector<size_t> order;  // the units by their first parameter in the model's order
  std::vector<bool> listed(units_.size(), false);
  for (size_t p = 0; p < params_.size(); ++p) {
    if (!listed[unitOf[p]]) order.push_back(unitOf[p]);
    listed[unitOf[p]] = true;
  }
  auto issue = [&](size_t k) {  // the gather of the k-th unit (resident ones are whole)
    if (k < order.size() && !units_[order[k]]->resident) gather(order[k]);
  };
  std::exception_ptr failure;
  issue(0);
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    issue(k + 1);
    if (offloaded_ && k + 2 < order.size()) prefetchSlice(static_cast<int64_t>(order[k + 2]));
    waitGathered(i);
    if (fn && !failure) {
      try {
        fn(i);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    release(i);
  }
  if (failure) std::rethrow_exception(failure);
}

std::vector<at::Tensor> ShardedParameters::unitParameters(size_t unit) const {
  std::vector<at::Tensor> ps;
  for (size_t p : units_[unit]->params) ps.push_back(params_[p]);
  return ps;
}

ShardedParameters::UnitLayout ShardedParameters::unitLayout(size_t unit) const {
  const Unit& u = *units_[unit];
  return {unitParameters(unit), u.offsets, u.numel, u.padded};
}

void ShardedParameters::sliceOptimizerState(torch::optim::Optimizer& whole,
                                            torch::optim::Optimizer& sliced) const {
  const int r = comm_->rank();
  for (size_t i = 0; i < units_.size(); ++i) {
    const Unit& u = *units_[i];
    const FlatOptimizerState all = caravan::gatherOptimizerState(whole, unitParameters(i));
    FlatOptimizerState mine;
    mine.step = all.step;
    if (all.rows() > 0) {
      at::Tensor padded = at::zeros({all.rows(), u.padded}, at::kFloat);
      padded.narrow(1, 0, u.numel).copy_(all.slots);
      mine.slots = padded.narrow(1, r * u.shardNumel, u.shardNumel).contiguous();
    }
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
