// The activation executor: runs each block of a BlockModel under a policy for what its
// backward needs (ALGORITHMS.md §2.1).
//   keep        what autograd saves stays in memory.
//   recompute   only the block's input is kept; the first time backward needs one of the
//               block's saved tensors, the block's forward reruns (same RNG state, buffers
//               restored) and its saves are captured in order; backward uses those.
//   swap        every saved tensor (by storage) is written to the tier as it is saved, while
//               later blocks compute; it leaves memory once written and is read back ahead of
//               the block's backward.
//   swap-input  only the block's input, written to the tier; read back and recomputed.
// Parameters and buffers saved by ops (a linear layer saves its weight, batch norm its running
// statistics) are held as they are; with out-of-core weights (memory/weights.h) a saved view of
// a weight is kept as its place in the block's blob and rebuilt on the blob fetched back, and
// the first unpack of block i in backward fetches block i's weights.
//
// Everything goes through the saved-tensor hooks (saved_tensors.h): the graph autograd builds
// is the one `keep` builds and the tensors backward gets are bitwise the ones forward saved (or
// recomputed by the same ops from the same input), so every policy gives `keep`'s gradients.
// The exception is asked for: memory.tier_dtype = bf16 stores swapped float32 storages (swap's
// saves, swap-input's input) as bf16, and backward gets them rounded to bf16's 8 bits.
//
// Prefetch: when backward first unpacks a tensor of block i, the reads of the next
// `prefetchDepth` blocks below i are queued; at the end of forward those of the last blocks.
//
// Saved tensors are checked on unpack for in-place changes since they were saved (autograd
// skips that check for tensors saved through hooks), and a recomputed block's input too.
//
// Lifetime: the executor and the tier must outlive every graph built under the executor (the
// trainer drops each step's graph in backward; a graph kept past them is a use-after-free).
// Threading: run() on the training thread; hooks release and unpack on autograd's threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/rng.h"  // recompute replays a block's draws; the trainer and planner include it here
#include "memory/tier.h"
#include "models/model.h"

namespace caravan {

class OutOfCoreWeights;

enum class BlockPolicy { kKeep, kRecompute, kSwap, kSwapInput };
inline constexpr int kBlockPolicies = 4;
const char* policyName(BlockPolicy p);  // "keep", "recompute", "swap", "swap-input"
// One policy for every block ("swap"), or a comma-separated list with one per block
// ("keep,swap,recompute"). ConfigError naming `key` otherwise.
std::vector<BlockPolicy> parsePolicies(const std::string& text, size_t blocks,
                                       const std::string& key);
std::string formatPolicies(const std::vector<BlockPolicy>& policies);
bool needsTier(const std::vector<BlockPolicy>& policies);

struct ExecutorStats {
  int64_t bytesOffloaded = 0;     // handed to the tier (writes queued), as it stores them
  double recomputeSeconds = 0.0;  // rerunning forwards inside backward
  double stallSeconds = 0.0;      // backward waiting for reads
};

class ActivationExecutor final : public BlockRunner {
 public:
  // Installs itself as the model's runner until destroyed. `tier` may be nullptr when no
  // policy swaps; it must outlive the executor and every graph built under it. `tierDtype`
  // (memory.tier_dtype): kBf16 stores swapped float32 storages as bf16, so backward gets them
  // rounded (tensors of other types go as they are).
  ActivationExecutor(BlockModel model, std::vector<BlockPolicy> policies, Tier* tier,
                     int prefetchDepth, TierDtype tierDtype = TierDtype::kAsIs);
  ~ActivationExecutor() override;
  ActivationExecutor(const ActivationExecutor&) = delete;
  ActivationExecutor& operator=(const ActivationExecutor&) = delete;

  torch::Tensor run(size_t index, torch::nn::AnyModule& block, torch::Tensor x) override;
  // Write backpressure: before block i's forward, if the activations held plus what block i
  // will save (savedBytes[i], from the profile) exceed `limit`, wait for the tier's queued
  // writes (their storages leave memory). The planner assumes writes keep up; when they do not
  // (small writes, a busy disk), this keeps the tracked peak under the budget at the cost of a
  // stall (counted in stallSeconds). Without savedBytes the check is on the activations held
  // alone, so the peak can end one block's saves over `limit` (the run's setup gives fixed
  // policies the sizes from an untimed profile).
  void setActivationLimit(int64_t limit, std::vector<int64_t> savedBytes);
  int64_t activationLimit() const { return activationLimit_; }  // 0: none
  const std::vector<int64_t>& limitSavedBytes() const { return savedBytes_; }
  const std::vector<BlockPolicy>& policies() const { return policies_; }
  ExecutorStats takeStats();

  struct Frame;
  // Called by the hooks (internal).
  void reached(size_t block);
  void addStall(double seconds);
  void addRecompute(double seconds);
  void addOffloaded(int64_t bytes);
  Tier* tier() const { return tier_; }
  // How `t`'s storage goes to the tier: kBf16 when memory.tier_dtype asks for it and `t` is
  // float32.
  TierDtype tierDtypeFor(const at::Tensor& t) const;
  // `t` lives on the storage of one of the model's parameters or buffers (a weight or batch
  // norm's running statistics saved by an op): held as it is, whatever the policy.
  bool isParameter(const at::Tensor& t) const;
  BlockModel& model() { return model_; }
  // Out-of-core weights: saved views of weights become descriptions (see the file comment).
  // Set before the first forward under it; the store must outlive its use here.
  void setWeights(OutOfCoreWeights* weights);
  OutOfCoreWeights* weights() const { return weights_; }
  // The model's parameters changed storages (a pipeline stage released the others' blocks,
  // sharded parameters became views of their units): isParameter looks at the current ones,
  // and at the storages of `gatheredLater` even while they are empty (sharded units, gathered
  // into again; sync/sharding.h). Not while a forward or backward runs.
  void refreshParameters(const std::vector<at::Tensor>& gatheredLater = {});

 private:
  BlockModel model_;
  std::vector<BlockPolicy> policies_;
  Tier* tier_;
  int prefetchDepth_;
  TierDtype tierDtype_;
  int64_t activationLimit_ = 0;
  std::vector<int64_t> savedBytes_;
  std::mutex mutex_;
  std::vector<std::weak_ptr<Frame>> frames_;  // this forward's, by block
  std::unordered_set<const c10::StorageImpl*> parameterStorages_;
  OutOfCoreWeights* weights_ = nullptr;
  ExecutorStats stats_;
};

}  // namespace caravan
