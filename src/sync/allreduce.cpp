// BSP all-reduce with gradient buckets (see allreduce.h).
#include "sync/allreduce.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "core/errors.h"
#include "sync/buckets.h"
#include "sync/replicas.h"

namespace caravan {

using Clock = std::chrono::steady_clock;

AllReduceStrategy::AllReduceStrategy(std::shared_ptr<Communicator> comm, AllReduceOptions options)
    : comm_(std::move(comm)), options_(options) {
  CARAVAN_CHECK(comm_ != nullptr, "allreduce needs a communicator");
  CARAVAN_CHECK(!isQuantized(options_.compression),
                "int8/int4 are for pseudo-gradients (diloco, local-sgd); validate() refuses them "
                "for gradients");
}

AllReduceStrategy::~AllReduceStrategy() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hookKeys_[i]);
}

void AllReduceStrategy::forEachResidual(const std::function<void(at::Tensor, int64_t)>& f) {
  int64_t at = 0;
  for (size_t i = slots_.size(); i-- > 0;) {  // registration order
    const Slot& s = slots_[i];
    f(buckets_[slotBucket_[i]].topk->residual().narrow(0, s.offset, s.numel), at);
    at += s.numel;
  }
}

std::map<std::string, at::Tensor> AllReduceStrategy::saveState() {
  if (options_.compression != Compression::kTopK || buckets_.empty()) return {};
  int64_t n = 0;
  for (const auto& s : slots_) n += s.numel;
  at::Tensor mine = at::empty({n}, at::kFloat);
  forEachResidual([&](at::Tensor part, int64_t at) { mine.narrow(0, at, part.numel()).copy_(part); });
  return {{"allreduce_residuals", gatherRows(*comm_, mine)}};
}

void AllReduceStrategy::restoreState(const std::map<std::string, at::Tensor>& state,
                                     int64_t savedWorkers) {
  auto it = state.find("allreduce_residuals");
  if (it != state.end() && options_.compression == Compression::kTopK) {
    restoredResidual_ = it->second;  // every worker's rows: attach() picks this rank's
  }
}

void AllReduceStrategy::attachModel(torch::nn::Module& model) {
  std::vector<at::Tensor> params;
  for (auto& p : model.parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  broadcastModel(*comm_, model);  // rank 0's initial parameters (and buffers) everywhere
  layBuckets(params);
  // A post hook on each parameter's gradient accumulator fires once its .grad is final for
  // this backward pass.
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(slots_[i].param);
    auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          onGradReady(i);
          return outputs;
        }));
    accumulators_.push_back(acc);
    hookKeys_.push_back(key);
  }
}

void AllReduceStrategy::attachGradients(const std::vector<at::Tensor>& params) {
  CARAVAN_CHECK(slots_.empty(), "attachGradients on an attached all-reduce");
  accumulating_ = true;
  std::vector<at::Tensor> trained;
  for (const auto& p : params) {
    if (p.requires_grad()) trained.push_back(p);
  }
  layBuckets(trained);
}

void AllReduceStrategy::layBuckets(const std::vector<at::Tensor>& params) {
  // Buckets in reverse registration order: backward produces the last block's gradients first.
  cancelled_ = false;
  slots_.clear();
  buckets_.clear();
  slotBucket_.clear();
  auto addSlot = [&](const at::Tensor& p) {
    CARAVAN_CHECK(p.scalar_type() == at::kFloat, "allreduce supports float32 parameters");
    Bucket& b = buckets_.back();
    Slot s;
    s.param = p;
    s.sizes = p.sizes().vec();
    s.numel = p.numel();
    s.offset = b.numel;
    b.numel += s.numel;
    b.slots.push_back(slots_.size());
    slotBucket_.push_back(buckets_.size() - 1);
    slots_.push_back(s);
  };
  if (!groups_.empty()) {
    CARAVAN_CHECK(options_.compression == Compression::kNone,
                  "parameter groups need uncompressed buckets");
    groupBucket_.assign(groups_.size(), -1);
    size_t counted = 0;
    for (size_t g = groups_.size(); g-- > 0;) {
      if (groups_[g].empty()) continue;
      groupBucket_[g] = static_cast<int64_t>(buckets_.size());
      buckets_.emplace_back();
      for (const auto& p : groups_[g]) addSlot(p);
      counted += groups_[g].size();
    }
    CARAVAN_CHECK_EQ(counted, params.size(), "parameter groups must hold every parameter once");
  } else {
    std::vector<int64_t> bytes;  // in bucket order: the last parameter first
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      bytes.push_back(it->numel() * static_cast<int64_t>(it->element_size()));
    }
    const std::vector<size_t> starts =
        bucketStarts(bytes, options_.firstBucketBytes, options_.bucketBytes);
    size_t next = 0;  // the next bucket's first parameter
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (next < starts.size() && starts[next] == i) {
        buckets_.emplace_back();
        ++next;
      }
      addSlot(params[params.size() - 1 - i]);
    }
  }
  for (auto& b : buckets_) {
    // Grouped buckets allocate their buffer when the first gradient arrives.
    if (groups_.empty()) b.buffer = at::zeros({b.numel}, at::kFloat);
    b.pending = static_cast<int64_t>(b.slots.size());
    if (options_.compression == Compression::kTopK) {
      b.topk = std::make_unique<TopKCodec>(b.numel, options_.topkRatio);
      b.gathered = at::empty({comm_->size() * 2 * b.topk->k()}, at::kFloat);
    }
  }
  if (options_.compression == Compression::kFp16 || options_.compression == Compression::kBf16) {
    commThread_ = std::make_unique<CommThread>();
  }
  if (restoredResidual_.defined()) {
    int64_t n = 0;
    for (const auto& s : slots_) n += s.numel;
    const at::Tensor mine = rowForRank(restoredResidual_, comm_->rank(), comm_->size(), n);
    forEachResidual([&](at::Tensor part, int64_t at) {
      part.copy_(mine.narrow(0, at, part.numel()));
    });
    restoredResidual_ = at::Tensor();
  }
}

void AllReduceStrategy::beforeForward(int64_t) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& s : slots_) s.ready = false;
  for (auto& b : buckets_) {
    b.pending = static_cast<int64_t>(b.slots.size());
    b.work.reset();
    b.done = Bucket::Done::kPending;
    b.error = nullptr;
  }
  nextLaunch_ = 0;
}

void AllReduceStrategy::useParameterGroups(std::vector<std::vector<at::Tensor>> groups) {
  CARAVAN_CHECK(slots_.empty(), "useParameterGroups after attach");
  groups_ = std::move(groups);
}

void AllReduceStrategy::cancelGroupWaits() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cancelled_ = true;
  }
  cv_.notify_all();
}

void AllReduceStrategy::finishGroup(size_t group) {
  CARAVAN_CHECK(group < groupBucket_.size(), "finishGroup({}) without parameter groups", group);
  if (groupBucket_[group] >= 0) finishBucket(static_cast<size_t>(groupBucket_[group]));
}

void AllReduceStrategy::onGradReady(size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!enabled_) return;
  if (slots_[i].ready) return;  // a second backward in one step would double count: ignore
  fillSlot(i);
  launchReadyInOrder();
}

void AllReduceStrategy::fillSlot(size_t i) {
  Slot& s = slots_[i];
  Bucket& b = buckets_[slotBucket_[i]];
  if (!b.buffer.defined()) b.buffer = at::empty({b.numel}, at::kFloat);
  at::Tensor grad = s.param.grad();
  at::Tensor dst = b.buffer.narrow(0, s.offset, s.numel);
  s.hadGradient = grad.defined();
  if (grad.defined()) {
    dst.copy_(grad.reshape({-1}));
  } else {
    dst.zero_();  // no gradient this step: zeros
  }
  // Grouped: the bucket holds the gradient until finishBucket() hands the average back.
  if (!groups_.empty()) s.param.mutable_grad() = at::Tensor();
  s.ready = true;
  --b.pending;
}

void AllReduceStrategy::launchReadyInOrder() {
  while (nextLaunch_ < buckets_.size() && buckets_[nextLaunch_].pending == 0) {
    Bucket& b = buckets_[nextLaunch_];
    b.launchedAt = Clock::now();
    b.work = launch(nextLaunch_);
    ++nextLaunch_;
  }
  cv_.notify_all();
}

WorkPtr AllReduceStrategy::launch(size_t index) {
  Bucket& b = buckets_[index];
  switch (options_.compression) {
    case Compression::kNone:  // attachGradients: the communicator's own average
      return comm_->allreduce(b.buffer, accumulating_ ? ReduceOp::kAvg : ReduceOp::kSum);
    case Compression::kFp16:
    case Compression::kBf16: {
      const at::ScalarType wire =
          options_.compression == Compression::kFp16 ? at::kHalf : at::kBFloat16;
      return commThread_->submit(
          fmt::format("rank {}: 16-bit ring all-reduce of bucket {}", comm_->rank(), index),
          [this, buffer = b.buffer, wire] {
            ringAllreduce16(*comm_, buffer, wire, /*tag=*/0, comm_->timeout());
          });
    }
    case Compression::kTopK:
      return comm_->allgather(b.gathered, b.topk->encode(b.buffer));
    case Compression::kInt8:
    case Compression::kInt4: break;  // refused by the constructor
  }
  return nullptr;
}

void AllReduceStrategy::finishTransfer(size_t index) {
  Bucket& b = buckets_[index];
  if (options_.compression == Compression::kTopK) {
    b.topk->decode(b.gathered, comm_->size(), b.buffer);
  }
}

void AllReduceStrategy::finishBucket(size_t index) {
  Bucket& b = buckets_[index];
  WorkPtr work;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] {
      return b.work != nullptr || b.done != Bucket::Done::kPending || cancelled_;
    });
    if (b.done == Bucket::Done::kFinishing) {
      cv_.wait(lock, [&] { return b.done == Bucket::Done::kFinished || cancelled_; });
    }
    if (b.done == Bucket::Done::kFinished) {
      if (b.error) std::rethrow_exception(b.error);
      return;
    }
    CARAVAN_CHECK(!cancelled_, "the gradient exchange was cancelled");
    b.done = Bucket::Done::kFinishing;
    work = b.work;
  }
  std::exception_ptr error;
  try {
    work->wait(comm_->timeout());
    if (sink_) sink_("allreduce bucket " + std::to_string(index), b.launchedAt, Clock::now());
    finishTransfer(index);
    torch::NoGradGuard noGrad;
    if (!accumulating_) b.buffer.mul_(1.0 / static_cast<double>(comm_->size()));  // kAvg did
    for (size_t j : b.slots) {
      Slot& s = slots_[j];
      at::Tensor avg = b.buffer.narrow(0, s.offset, s.numel).view(s.sizes);
      if (accumulating_ && !s.hadGradient) {
        continue;  // none on any replica: it keeps none
      } else if (!groups_.empty()) {
        s.param.mutable_grad() = avg;  // a view: the bucket's buffer lives as long as the grads
      } else if (!s.param.grad().defined()) {
        s.param.mutable_grad() = avg.clone();
      } else {
        s.param.mutable_grad().copy_(avg);
      }
    }
    if (!groups_.empty()) b.buffer = at::Tensor();
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    b.done = Bucket::Done::kFinished;
    b.error = error;
  }
  cv_.notify_all();
  if (error) std::rethrow_exception(error);
}

void AllReduceStrategy::finishGradients() {
  if (!enabled_) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Parameters whose hook did not fire: what .grad holds (zeros without one); every
    // parameter without hooks (attachGradients).
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (!slots_[i].ready) fillSlot(i);
    }
    launchReadyInOrder();
  }
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    CARAVAN_CHECK(buckets_[bi].work != nullptr, "bucket {} was never launched", bi);
    finishBucket(bi);
  }
}

}  // namespace caravan
