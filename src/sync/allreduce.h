// BSP all-reduce (DDP-style): gradients are grouped into buckets in reverse registration order
// (the order backward produces them); a bucket's all-reduce starts as soon as its last
// gradient is ready during backward, so communication overlaps the rest of backward.
// finishGradients() waits for all buckets and writes the averaged gradients back to .grad.
//
// With compression (sync.compression), buckets travel as 16-bit values or as top-k entries
// with error feedback (compression.h); the launch order and the averaging stay the same.
//
// Parameters that received no gradient in a step contribute zeros (attachModel; see
// attachGradients for the accumulating mode a pipeline stage uses); their buckets are launched
// in finishGradients(). Buckets are always launched in index order on every rank (a bucket
// whose predecessor is not launched yet waits for it), so collectives match across ranks
// without any flag or extra round trip. The reduction order is fixed by the bucket layout and
// the backend's algorithm, so reruns with the same world size are bitwise identical.
//
// Parameter groups (out-of-core weights): one bucket per group, launched as the group's last
// gradient is ready; the bucket's buffer exists only from its first gradient (copied in, the
// .grad dropped) until the optimizer drops the averaged .grad, which is a view of it, so
// gradients are held once. finishGroup() finishes one bucket from the updater thread.
//
// Threading: the gradient hooks run on autograd's thread and only enqueue launches under a
// mutex; attach/finishGradients run on the trainer thread, finishGroup on the out-of-core
// weights' updater thread (finishBucket makes each bucket's finish happen once).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>

#include "comm/comm_thread.h"
#include "comm/communicator.h"
#include "core/torch_fwd.h"
#include "sync/compression.h"
#include "sync/strategy.h"
#include "sync/sync_mode.h"

namespace caravan {

struct AllReduceOptions {
  int64_t firstBucketBytes = 1 << 20;  // small first bucket: starts communication early
  int64_t bucketBytes = 25 << 20;      // later buckets, capped by bytes
  Compression compression = Compression::kNone;  // how buckets travel (compression.h)
  double topkRatio = 0.01;                       // topk: fraction of each bucket sent
};

class AllReduceStrategy : public Strategy {
 public:
  AllReduceStrategy(std::shared_ptr<Communicator> comm, AllReduceOptions options);
  ~AllReduceStrategy() override;
  std::string name() const override { return syncModeName(SyncMode::kAllReduce); }
  void attachModel(torch::nn::Module& model) override;
  void beforeForward(int64_t step) override;
  void finishGradients() override;
  bool supportsParameterGroups() const override { return true; }
  void useParameterGroups(std::vector<std::vector<at::Tensor>> groups) override;
  void finishGroup(size_t group) override;
  void cancelGroupWaits() override;
  // topk: every rank's residual (registration order), kept per rank or averaged on resume.
  std::map<std::string, at::Tensor> saveState() override;
  void restoreState(const std::map<std::string, at::Tensor>& state,
                    int64_t savedWorkers) override;

  // Buckets over `params` (those that require a gradient) without a strategy's attach: no
  // broadcast and no gradient hooks, so finishGradients() launches every bucket (gradients
  // accumulated over several backward passes, as a pipeline stage's micro-batches;
  // pipeline_step.h). The buckets travel uncompressed as ReduceOp::kAvg all-reduces (the
  // communicator's own average), and a parameter without a
  // gradient keeps none (every replica must agree on which have one).
  // Call once, in place of attach(); every replica passes the same shapes in the same order.
  void attachGradients(const std::vector<at::Tensor>& params);

  // Disabled, the gradient hooks do nothing and finishGradients() leaves the local gradients
  // (local SGD's local phase). Set before a step's forward, on every rank alike.
  void setEnabled(bool enabled) { enabled_ = enabled; }

 private:
  struct Slot {
    at::Tensor param;
    std::vector<int64_t> sizes;  // the parameter's shape (out-of-core weights empty it)
    int64_t offset = 0;          // elements into the bucket buffer
    int64_t numel = 0;
    bool ready = false;
    bool hadGradient = false;  // this step: .grad was defined when the slot was filled
  };
  struct Bucket {
    std::vector<size_t> slots;  // indices into slots_
    at::Tensor buffer;          // flat float32, sum of the bucket's numel
    int64_t pending = 0;        // slots not ready yet this step
    WorkPtr work;
    std::chrono::steady_clock::time_point launchedAt;
    std::unique_ptr<TopKCodec> topk;  // topk: this bucket's residual
    at::Tensor gathered;              // topk: every rank's message
    int64_t numel = 0;
    enum class Done { kPending, kFinishing, kFinished } done = Done::kPending;
    std::exception_ptr error;  // what finishing it threw
  };

  // Slots and buckets over `params` (bucketStarts, or one per parameter group).
  void layBuckets(const std::vector<at::Tensor>& params);
  void onGradReady(size_t slot);
  // Copies slot `slot`'s gradient (zeros without one) into its bucket and counts it ready
  // (requires mutex_).
  void fillSlot(size_t slot);
  void launchReadyInOrder();  // requires mutex_
  WorkPtr launch(size_t index);
  void finishTransfer(size_t index);  // after the bucket's work: buffer = sum over ranks
  // Waits for bucket `index`'s work and writes the averaged gradients to .grad, once per step
  // whoever calls first (the other caller waits for it).
  void finishBucket(size_t index);
  // f(part of a bucket's top-k residual, its offset in the flat registration order) per slot.
  void forEachResidual(const std::function<void(at::Tensor, int64_t)>& f);

  std::shared_ptr<Communicator> comm_;
  AllReduceOptions options_;
  std::vector<Slot> slots_;
  std::vector<size_t> slotBucket_;
  std::vector<Bucket> buckets_;
  size_t nextLaunch_ = 0;
  std::mutex mutex_;
  std::condition_variable cv_;  // a bucket launched or finished
  bool cancelled_ = false;
  std::vector<std::vector<at::Tensor>> groups_;  // empty: buckets by size
  std::vector<int64_t> groupBucket_;             // -1: a group without parameters
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hookKeys_;
  std::atomic<bool> enabled_{true};
  // attachGradients: gradients accumulated over several backward passes and averaged after the
  // last (no hooks; ReduceOp::kAvg; a missing gradient stays missing). attachModel: per backward
  // pass, through the hooks (a sum scaled by 1/W; a missing gradient contributes zeros).
  bool accumulating_ = false;
  std::unique_ptr<CommThread> commThread_;  // fp16/bf16: runs the 16-bit rings
  at::Tensor restoredResidual_;             // topk: every worker's rows from a checkpoint
};

}  // namespace caravan
