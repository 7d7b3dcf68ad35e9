// The activation executor (src/memory/executor.h) and tiers (tier.h): every policy gives the
// losses and gradients of `keep`, bitwise, on the GPT (with dropout, so recomputation must
// replay the RNG), the CNN and the ResNet (batch norm: running statistics must not be updated
// twice); what is accounted drops to zero after backward; recomputation really holds less.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <limits>
#include <thread>

#include <torch/torch.h>

#include "core/config.h"
#include "core/errors.h"
#include "memory/executor.h"
#include "memory/host_allocator.h"
#include "memory/planner.h"
#include "memory/saved_tensors.h"
#include "memory/tier.h"
#include "memory/tracker.h"
#include "models/model.h"
#include "run_util.h"
#include "test_util.h"
#include "train/memory_setup.h"
#include "train/run_options.h"
#include "train/step.h"

using namespace caravan;

namespace {

DataShape lmShape() {
  DataShape shape;
  shape.task = TaskKind::kLanguageModel;
  shape.vocabSize = 13;
  shape.seqLen = 16;
  return shape;
}

DataShape imageShape() {
  DataShape shape;
  shape.task = TaskKind::kImageClassification;
  return shape;
}

ModelSpec gptSpec() {
  ModelSpec s;
  s.name = "gpt";
  s.width = 32;
  s.depth = 3;
  s.heads = 4;
  s.dropout = 0.1;
  return s;
}

ModelSpec imageSpec(const std::string& name) {
  ModelSpec s;
  s.name = name;
  s.width = 8;
  return s;
}

struct Outcome {
  std::vector<double> losses;
  std::vector<at::Tensor> grads;    // after the last step's backward
  std::vector<at::Tensor> buffers;  // batch-norm running statistics
  int64_t activationPeak = 0;
  int64_t activationsAfter = -1;  // live after the last backward
  ExecutorStats stats;
};

// Two steps of SGD from the same initialization and batch; `policies` "" runs without an
// executor (stock forward, still accounted). `bf16`: every block under bf16 autocast.
Outcome train(bool bf16, const ModelSpec& spec, const DataShape& shape, const std::string& policies,
              Tier* tier, bool writesFirst = false, TierDtype tierDtype = TierDtype::kAsIs,
              int64_t activationLimit = 0, std::vector<int64_t> savedBytes = {}) {
  installSavedTensorEngine();
  torch::manual_seed(7);
  BlockModel model = buildModel(spec, shape);
  for (size_t i = 0; bf16 && i < model->numBlocks(); ++i) model->setBf16(i, true);
  model->train();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const Batch batch = test::randomBatch(shape, 4, 3);
  MemoryTracker tracker;
  Outcome out;
  {
    std::vector<at::Tensor> state = model->parameters();
    for (const auto& b : model->buffers()) state.push_back(b);
    SavedTensorScope scope(tracker, state);
    std::unique_ptr<ActivationExecutor> exec;
    if (!policies.empty()) {
      exec = std::make_unique<ActivationExecutor>(
          model, parsePolicies(policies, model->numBlocks(), "test"), tier, 1, tierDtype);
      // As memory_setup sets it under a budget (savedBytes: each block's, from a profile).
      if (activationLimit > 0) exec->setActivationLimit(activationLimit, std::move(savedBytes));
    }
    torch::manual_seed(11);  // dropout draws
    for (int step = 0; step < 2; ++step) {
      sgd.zero_grad();
      at::Tensor loss = taskLoss(model->task(), model->forward(batch.input), batch.target);
      // writesFirst: every write lands before backward, so every swapped tensor is read back
      // (otherwise, on a busy machine, prefetches may cancel writes that had not started).
      if (writesFirst && tier != nullptr) tier->drainWrites();
      loss.backward();
      out.losses.push_back(loss.item<double>());
      if (step == 1) {
        for (const auto& p : model->parameters()) out.grads.push_back(p.grad().clone());
      }
      sgd.step();
    }
    // An I/O thread may still hold an Offload it just finished with.
    if (tier != nullptr) tier->drain();
    out.activationsAfter = tracker.live(MemoryCategory::kActivations);
    out.activationPeak = tracker.peak(MemoryCategory::kActivations);
    if (exec) out.stats = exec->takeStats();
  }
  for (const auto& b : model->buffers()) out.buffers.push_back(b.clone());
  return out;
}

void expectSame(const Outcome& keep, const Outcome& other, const std::string& what) {
  ASSERT_EQ(keep.losses.size(), other.losses.size());
  for (size_t i = 0; i < keep.losses.size(); ++i) {
    EXPECT_EQ(keep.losses[i], other.losses[i]) << what << " step " << i;
  }
  ASSERT_EQ(keep.grads.size(), other.grads.size());
  for (size_t i = 0; i < keep.grads.size(); ++i) {
    EXPECT_TRUE(at::equal(keep.grads[i], other.grads[i]))
        << what << " gradient " << i << " differs by "
        << (keep.grads[i] - other.grads[i]).abs().max().item<double>();
  }
  ASSERT_EQ(keep.buffers.size(), other.buffers.size());
  for (size_t i = 0; i < keep.buffers.size(); ++i) {
    EXPECT_TRUE(at::equal(keep.buffers[i], other.buffers[i])) << what << " buffer " << i;
  }
  EXPECT_EQ(other.activationsAfter, 0) << what << ": saved tensors outlived backward";
}

std::unique_ptr<Tier> diskTier(const test::TempDir& dir) {
  try {
    return std::make_unique<FileTier>(dir.path());
  } catch (const ConfigError&) {
    return nullptr;  // the temp dir is on tmpfs: the file tier refuses it
  }
}

// Host memory whose writes each take `delay`: a tier slower than the forward that fills it.
class SlowTier final : public Tier {
 public:
  explicit SlowTier(std::chrono::milliseconds delay) : delay_(delay) {}
  ~SlowTier() override { stopThreads(); }
  std::string describe() const override { return "slow host memory (test)"; }
  int64_t allocate(int64_t bytes) override { return inner_.allocate(bytes); }
  void free(int64_t slot) override { inner_.free(slot); }
  void store(int64_t slot, const void* data, int64_t bytes) override {
    std::this_thread::sleep_for(delay_);
    inner_.store(slot, data, bytes);
  }
  void load(int64_t slot, void* data, int64_t bytes) override { inner_.load(slot, data, bytes); }

 private:
  HostTier inner_;
  std::chrono::milliseconds delay_;
};

// Runs `body` on the host tier and, unless the temp dir is tmpfs, the disk tier.
void onEveryTier(const std::function<void(Tier&)>& body) {
  test::TempDir dir;
  std::unique_ptr<Tier> disk = diskTier(dir);
  HostTier host;
  for (Tier* tier : {static_cast<Tier*>(&host), disk.get()}) {
    if (tier == nullptr) continue;
    SCOPED_TRACE(tier->describe());
    body(*tier);
  }
}

void checkEveryPolicy(const ModelSpec& spec, const DataShape& shape, const std::string& mixed,
                      bool bf16 = false) {
  test::TempDir dir;
  HostTier host;
  std::unique_ptr<Tier> disk = diskTier(dir);
  const Outcome plain = train(bf16, spec, shape, "", nullptr);
  const Outcome keep = train(bf16, spec, shape, "keep", nullptr);
  expectSame(plain, keep, "keep under the executor");
  EXPECT_EQ(plain.activationPeak, keep.activationPeak);

  const Outcome recompute = train(bf16, spec, shape, "recompute", nullptr);
  expectSame(keep, recompute, "recompute");
  EXPECT_LT(recompute.activationPeak, keep.activationPeak)
      << "recompute held as much as keep";
  EXPECT_GT(recompute.stats.recomputeSeconds, 0.0);

  for (Tier* tier : {static_cast<Tier*>(&host), disk.get()}) {
    if (tier == nullptr) continue;
    SCOPED_TRACE(tier->describe());
    const int64_t readBefore = tier->bytesRead();
    const Outcome swap = train(bf16, spec, shape, "swap", tier, /*writesFirst=*/true);
    expectSame(keep, swap, "swap");
    EXPECT_GT(swap.stats.bytesOffloaded, 0);
    // The swapped tensors really came back from the tier: all but the last block's, whose
    // prefetch at the end of forward cancels writes that had not started.
    EXPECT_GT(tier->bytesRead() - readBefore, swap.stats.bytesOffloaded / 2);
    EXPECT_LE(tier->bytesRead() - readBefore, swap.stats.bytesOffloaded);
    // And with writes racing backward (prefetches cancel writes not yet started).
    expectSame(keep, train(bf16, spec, shape, "swap", tier), "swap, writes racing backward");
    const Outcome swapInput = train(bf16, spec, shape, "swap-input", tier);
    expectSame(keep, swapInput, "swap-input");
    EXPECT_LT(swapInput.activationPeak, keep.activationPeak);
    expectSame(keep, train(bf16, spec, shape, mixed, tier), mixed);
  }
  if (!disk) std::cerr << "note: the temp dir is on tmpfs; the disk tier was not tested\n";
}

}  // namespace

TEST(Executor, EveryPolicyGivesKeepsGradientsOnGpt) {
  // Blocks: embedding, 3 transformer blocks, head.
  checkEveryPolicy(gptSpec(), lmShape(), "swap,recompute,swap-input,keep,swap");
}

// bf16 blocks save bf16 tensors; swapping moves them as they are and recompute reruns the
// block under the same autocast (models/precision.h): still the same gradients as keep.
TEST(Executor, EveryPolicyGivesKeepsGradientsOnGptInBf16) {
  checkEveryPolicy(gptSpec(), lmShape(), "swap,recompute,swap-input,keep,swap", /*bf16=*/true);
}

TEST(Executor, EveryPolicyGivesKeepsGradientsOnCnn) {
  checkEveryPolicy(imageSpec("cnn"), imageShape(), "recompute,swap,keep");
}

TEST(Executor, EveryPolicyGivesKeepsGradientsAndBuffersOnResnet) {
  // Blocks: stem, 3 stages, head.
  checkEveryPolicy(imageSpec("resnet-mini"), imageShape(), "swap-input,recompute,swap,keep,swap");
}

// memory.tier_dtype = bf16: what a swap block saves goes to the tier at half the bytes for its
// float32 storages (the GPT's are all float32 but the embedding's token ids), exactly as many
// as the profile counts; the first step's loss (forward only) is keep's, and the gradients are
// computed from rounded saves: not keep's bitwise, within bf16's rounding of them.
TEST(Executor, Bf16TierStorageHalvesTheFloat32BytesAndRoundsWhatBackwardGets) {
  installSavedTensorEngine();
  HostTier tier;
  const ModelSpec spec = gptSpec();
  const Outcome keep = train(false, spec, lmShape(), "keep", nullptr);
  const Outcome f32 = train(false, spec, lmShape(), "swap", &tier, /*writesFirst=*/true);
  const Outcome bf16 =
      train(false, spec, lmShape(), "swap", &tier, /*writesFirst=*/true, TierDtype::kBf16);
  expectSame(keep, f32, "swap, stored as float32");
  // Rounded whatever the I/O threads' timing: with writes racing backward (prefetches cancel
  // writes not yet started, or keep storages mid-write), the same gradients bitwise.
  expectSame(bf16, train(false, spec, lmShape(), "swap", &tier, false, TierDtype::kBf16),
             "bf16 storage, writes racing backward");

  torch::manual_seed(7);
  BlockModel model = buildModel(spec, lmShape());
  model->train();
  const ModelProfile profile = profileModel(model, test::randomBatch(lmShape(), 4, 3), 0);
  int64_t saved = 0, float32 = 0;
  for (const auto& b : profile.blocks) {
    saved += b.savedBytes;
    float32 += b.savedFloat32Bytes;
  }
  ASSERT_GT(float32, saved / 2) << "the GPT's saves should be mostly float32";
  EXPECT_EQ(f32.stats.bytesOffloaded, 2 * saved);  // two steps
  EXPECT_EQ(bf16.stats.bytesOffloaded, 2 * (saved - float32 / 2));

  EXPECT_EQ(bf16.losses[0], keep.losses[0]);
  ASSERT_EQ(bf16.grads.size(), keep.grads.size());
  double worst = 0.0;
  bool anyDiffers = false;
  for (size_t i = 0; i < keep.grads.size(); ++i) {
    anyDiffers = anyDiffers || !at::equal(keep.grads[i], bf16.grads[i]);
    const double scale = keep.grads[i].abs().max().item<double>();
    if (scale > 0) {
      worst = std::max(worst, (keep.grads[i] - bf16.grads[i]).abs().max().item<double>() / scale);
    }
  }
  EXPECT_TRUE(anyDiffers) << "no gradient changed: the saves were not rounded";
  EXPECT_LT(worst, 0.05) << "gradients from bf16-rounded saves strayed beyond rounding";
  EXPECT_EQ(bf16.activationsAfter, 0);
}

// Write backpressure on a tier slower than forward. In forward, with each block's saved sizes
// (as the run's setup gives a fixed swap policy under a budget) what is held stays within the
// limit, or one block's saves when they alone exceed it; with none, within one block's saves
// over it. Backward holds a block's saves and its prefetched successor's (memory.prefetch 1),
// whatever the limit. Without a limit the saves of every block pile up while their writes
// queue. The gradients are keep's.
TEST(Executor, AFixedSwapPolicyWaitsForSlowWritesToStayNearItsLimit) {
  installSavedTensorEngine();
  const ModelSpec spec = gptSpec();
  torch::manual_seed(7);
  BlockModel model = buildModel(spec, lmShape());
  model->train();
  const ModelProfile profile = profileModel(model, test::randomBatch(lmShape(), 4, 3), 0);
  int64_t largest = 0;
  std::vector<int64_t> saved;
  for (const auto& b : profile.blocks) {
    largest = std::max(largest, b.savedBytes);
    saved.push_back(b.savedBytes);
  }

  // Each write takes 40 ms, far longer than a block's forward even on a loaded machine (with
  // 10 ms, CI once saw the writes keep up and the precondition below fail).
  SlowTier tier(std::chrono::milliseconds(40));
  const Outcome keep = train(false, spec, lmShape(), "keep", nullptr);
  const Outcome unlimited = train(false, spec, lmShape(), "swap", &tier);
  const int64_t limit = unlimited.activationPeak / 3;
  ASSERT_GT(unlimited.activationPeak, std::max(limit + largest, 2 * largest))
      << "the writes kept up without a limit: the tier is not slow enough to test this";
  const Outcome limited =
      train(false, spec, lmShape(), "swap", &tier, false, TierDtype::kAsIs, limit);
  EXPECT_LE(limited.activationPeak, std::max(limit + largest, 2 * largest));
  EXPECT_GT(limited.stats.stallSeconds, 0.0) << "forward never waited for a write";
  expectSame(keep, limited, "swap under a limit");
  const Outcome ahead =
      train(false, spec, lmShape(), "swap", &tier, false, TierDtype::kAsIs, limit, saved);
  EXPECT_LE(ahead.activationPeak, std::max(limit, 2 * largest))
      << "the look-ahead at each block's saves";
  expectSame(keep, ahead, "swap under a limit, sizes known");
}

// The run's side of the test above: a fixed policy under memory.budget (no profile) gets the
// write backpressure too, at the budget less the weights, gradients and optimizer state (a
// planned run's is its plan's budget: the next test).
TEST(MemorySetup, AFixedSwapPolicyUnderABudgetGetsTheWriteBackpressure) {
  installSavedTensorEngine();
  torch::manual_seed(7);
  BlockModel model = buildModel(gptSpec(), lmShape());
  const Batch batch = test::randomBatch(lmShape(), 4, 3);
  const RunOptions options = RunOptions::read(Config::fromString(
      "", "<test>", {"memory.policy=swap", "memory.tier=host", "memory.budget=64MiB"}));
  const ActivationMemory m = makeActivationMemory(options, model, batch, /*alwaysPlan=*/false);
  ASSERT_NE(m.executor, nullptr);
  ASSERT_GT(m.persistent, 0);
  EXPECT_EQ(m.executor->activationLimit(), (int64_t{64} << 20) - m.persistent);
  // The sizes it looks ahead at, one per block, from an untimed profile.
  ASSERT_EQ(m.executor->limitSavedBytes().size(), model->numBlocks());
  EXPECT_GT(m.executor->limitSavedBytes()[1], 0);
}

// A planned run drains its writes at the budget its plan was fitted to and predicted with
// (95% of the room), so the prediction's backpressure is the run's.
TEST(MemorySetup, APlannedRunDrainsAtItsPlansBudget) {
  installSavedTensorEngine();
  torch::manual_seed(7);
  BlockModel model = buildModel(gptSpec(), lmShape());
  const Batch batch = test::randomBatch(lmShape(), 4, 3);
  // A budget with room for half of what keeping every block holds: the plan cannot keep all.
  const ActivationMemory unbounded = makeActivationMemory(
      RunOptions::read(Config::fromString("", "<test>", {"memory.profile_repeats=1"})), model,
      batch, /*alwaysPlan=*/true);
  const int64_t budget = unbounded.persistent + unbounded.plan->prediction.peakBytes / 2;
  const RunOptions options = RunOptions::read(
      Config::fromString("", "<test>",
                         {"memory.policy=auto", "memory.tier=host",
                          "memory.budget=" + std::to_string(budget), "memory.profile_repeats=1"}));
  const ActivationMemory m = makeActivationMemory(options, model, batch, /*alwaysPlan=*/false);
  ASSERT_TRUE(m.plan.has_value() && m.plan->fits);
  ASSERT_NE(m.executor, nullptr) << "a plan under half of keep's peak keeps every block";
  const int64_t room = budget - m.persistent;
  EXPECT_EQ(m.executor->activationLimit(), static_cast<int64_t>(0.95 * static_cast<double>(room)));
}

TEST(Executor, ParsesPolicies) {
  EXPECT_EQ(formatPolicies(parsePolicies("swap", 3, "k")), "swap,swap,swap");
  EXPECT_EQ(formatPolicies(parsePolicies("keep, swap-input,recompute", 3, "k")),
            "keep,swap-input,recompute");
  for (const char* bad : {"swop", "keep,swap", ""}) {
    try {
      parsePolicies(bad, 3, "memory.policy");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("memory.policy"), std::string::npos) << e.what();
    }
  }
}

TEST(Tier, OffloadRoundTripsBytesAndFreesSlots) {
  onEveryTier([](Tier& tier) {
    // Sizes around the 4 KiB direct-I/O alignment and the 8 MiB staging buffer.
    for (int64_t n : {int64_t{1}, int64_t{4095}, int64_t{4096}, int64_t{12345},
                      int64_t{(8 << 20) + 3}}) {
      at::Tensor data = at::randint(0, 255, {n}, at::TensorOptions().dtype(at::kByte));
      std::atomic<int> held{0};
      auto offload = Offload::start(tier, data.clone().storage(),
                                    [&](const at::Storage&, int d) { held += d; });
      // Once written the bytes leave memory (held 0); get() reads them back.
      tier.drainWrites();
      EXPECT_EQ(held, 0);
      const int64_t readBefore = tier.bytesRead();
      at::Storage back = offload->get();
      EXPECT_EQ(tier.bytesRead() - readBefore, n) << "get() did not read from the tier";
      ASSERT_EQ(static_cast<int64_t>(back.nbytes()), n);
      at::Tensor t = at::empty({0}, at::kByte).set_(back, 0, {n}, {1});
      EXPECT_TRUE(at::equal(t, data)) << n << " bytes";
      EXPECT_EQ(held, 1);
      offload.reset();  // the writer may still hold it for a moment after the write
      for (int i = 0; i < 1000 && held != 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_EQ(held, 0);
    }
    const TierBandwidth bw = tier.measure(8 << 20);
    EXPECT_GT(bw.writeBytesPerSecond, 0.0);
    EXPECT_GT(bw.readBytesPerSecond, 0.0);
    tier.check();
  });
}

// TierDtype::kBf16: a float32 storage goes to the tier as bf16 (half the bytes written and
// read) and comes back widened, each value as ATen's float32 -> bf16 -> float32 casts give it
// (round to nearest, ties to even; infinities kept, NaN still NaN).
TEST(Tier, Bf16StorageRoundsAsATenCastsAndMovesHalfTheBytes) {
  onEveryTier([](Tier& tier) {
    // Sizes around the 4 KiB alignment (in bf16 bytes too) and past the 8 MiB staging buffer.
    for (int64_t n : {int64_t{1}, int64_t{1023}, int64_t{3000}, int64_t{(3 << 20) + 5}}) {
      at::Tensor data = at::randn({n}) * 1e3;
      const float specials[] = {0.0f,
                                -0.0f,
                                1.00390625f /* a tie: 1 + 2^-8 */,
                                1.01171875f,
                                std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::infinity(),
                                1e-40f /* subnormal */,
                                3.4e38f,
                                std::numeric_limits<float>::quiet_NaN()};
      for (int64_t i = 0; i < std::min<int64_t>(n, 9); ++i) data[i] = specials[i];
      const int64_t writtenBefore = tier.bytesWritten();
      auto offload = Offload::start(tier, data.clone().storage(), nullptr, TierDtype::kBf16);
      tier.drainWrites();
      EXPECT_EQ(tier.bytesWritten() - writtenBefore, 2 * n);
      EXPECT_EQ(offload->storedBytes(), 2 * n);
      const int64_t readBefore = tier.bytesRead();
      at::Storage back = offload->get();
      EXPECT_EQ(tier.bytesRead() - readBefore, 2 * n);
      ASSERT_EQ(static_cast<int64_t>(back.nbytes()), 4 * n);
      const at::Tensor want = data.to(at::kBFloat16).to(at::kFloat);
      const at::Tensor nan = at::isnan(want);
      auto expectRounded = [&](const at::Storage& s, const char* how) {
        at::Tensor got = at::empty({0}, at::kFloat).set_(s, 0, {n}, {1});
        EXPECT_TRUE(at::equal(at::isnan(got), nan)) << n << " values, " << how;
        EXPECT_TRUE(at::equal(got.masked_fill(nan, 0).view(at::kInt),
                              want.masked_fill(nan, 0).view(at::kInt)))
            << n << " values, " << how;
      };
      expectRounded(back, "read back");
      // Asked for at once: the write is cancelled or still running, the storage never left;
      // what get() returns is rounded all the same.
      auto early = Offload::start(tier, data.clone().storage(), nullptr, TierDtype::kBf16);
      expectRounded(early->get(), "never left memory");
    }
    // The planner's probe through the same path: rates in bytes as stored, conversions timed.
    const TierBandwidth bw = tier.measure(8 << 20, TierDtype::kBf16);
    EXPECT_GT(bw.writeBytesPerSecond, 0.0);
    EXPECT_GT(bw.readBytesPerSecond, 0.0);
    tier.check();
  });
}

TEST(Tier, RefusesTmpfsAndMissingDirectories) {
  EXPECT_THROW(FileTier("/nonexistent/caravan"), IoError);
  if (std::system("mountpoint -q /dev/shm") == 0) {
    try {
      FileTier tier("/dev/shm");
      ADD_FAILURE() << "a tier on /dev/shm (tmpfs) was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("tmpfs"), std::string::npos) << e.what();
    }
  }
}

TEST(Executor, TierWriteErrorFailsTheRunWithAClearMessage) {
  // A real I/O error during training: the file size limit (ulimit -f, in KiB) is below one
  // step's swapped activations, so a tier write in the middle of forward fails with EFBIG
  // (fixed policies do not probe the tier's bandwidth at start-up), and the error reaches the
  // training thread at the next block or through backward.
  if (!test::expectTierWriteFailure(2048, "--set memory.policy=swap")) {
    GTEST_SKIP() << "the temp dir is on tmpfs";
  }
}

TEST(HostAllocator, ReusesMappingsBySizeWithinTheCacheLimit) {
  HostAllocator& a = HostAllocator::instance();
  const int64_t previousLimit = a.cacheLimit();
  a.emptyCache();
  a.setCacheLimit(int64_t{4} << 20);
  const HostAllocator::Stats before = a.stats();
  void* first = nullptr;
  {
    c10::DataPtr p = a.allocate(1 << 20);
    first = p.get();
    static_cast<char*>(p.get())[(1 << 20) - 1] = 7;  // writable to the last byte
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.get()) % 4096, 0u);
  }
  EXPECT_EQ(a.stats().cached - before.cached, 1 << 20);
  {
    c10::DataPtr p = a.allocate(1 << 20);  // the same size: the cached mapping again
    EXPECT_EQ(p.get(), first);
    EXPECT_EQ(a.stats().cached, before.cached);
  }
  {
    // Past the limit, freed mappings go back to the kernel.
    c10::DataPtr big = a.allocate(8 << 20);
    const int64_t mapped = a.stats().mapped;
    big.clear();
    EXPECT_EQ(a.stats().mapped, mapped - (8 << 20));
  }
  {
    // Small allocations come from the heap, and raw_deallocate (used by some kernels) works.
    void* small = a.raw_allocate(100);
    ASSERT_NE(small, nullptr);
    a.raw_deallocate(small);
    void* large = a.raw_allocate(1 << 20);
    EXPECT_EQ(large, first);
    a.raw_deallocate(large);
  }
  a.emptyCache();
  EXPECT_EQ(a.stats().cached, 0);
  a.setCacheLimit(previousLimit);
}

TEST(SavedTensors, AnInPlaceChangeAfterSavingFailsBackwardAsWithoutHooks) {
  installSavedTensorEngine();
  MemoryTracker tracker;
  at::Tensor w = torch::randn({4}, torch::requires_grad());
  SavedTensorScope scope(tracker, {});
  at::Tensor x = w * 2;   // not a leaf, so it may be changed in place
  at::Tensor y = x.sin();  // saves x
  {
    at::NoGradGuard noGrad;
    x.add_(1);
  }
  try {
    y.sum().backward();
    ADD_FAILURE() << "backward used a saved tensor changed in place";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("modified by an inplace operation"), std::string::npos)
        << e.what();
  }
}

TEST(PlanCommand, PrintsThePlanAndSaysWhenNothingFits) {
  test::TempDir dir;
  test::writeFile(dir / "g.toml",
                  "[data]\ndataset = \"synthetic\"\nsynthetic_task = \"tokens\"\nseq_len = 16\n"
                  "synthetic_size = 32\nbatch_size = 8\n[model]\nname = \"gpt\"\nwidth = 16\n"
                  "depth = 2\nheads = 2\n[train]\nthreads = 1\n[memory]\nprofile_repeats = 1\n");
  const test::CommandResult fits = test::runCaravan("plan --config " + (dir / "g.toml"));
  EXPECT_EQ(fits.exitCode, 0) << fits.err;
  for (const char* want : {"layer0", "layer1", "head", "predicted: forward+backward",
                           "activation peak"}) {
    EXPECT_NE(fits.out.find(want), std::string::npos) << want << " missing:\n" << fits.out;
  }
  const test::CommandResult tiny =
      test::runCaravan("plan --config " + (dir / "g.toml") + " --set memory.budget=16KiB");
  EXPECT_EQ(tiny.exitCode, static_cast<int>(ExitCode::kConfig)) << tiny.err;
  EXPECT_NE(tiny.out.find("does NOT fit"), std::string::npos) << tiny.out;
  EXPECT_NE(tiny.err.find("smallest budget the planner can fit"), std::string::npos) << tiny.err;
}

namespace {

// Two blocks, each computing 1 s forward and 2 s backward, reading a 10-byte input and saving
// 100 bytes; the tier moves 100 bytes/s each way. Worked by hand in the test below.
ModelProfile twoBlocks() {
  ModelProfile p;
  for (const char* label : {"b0", "b1"}) {
    BlockProfile b;
    b.label = label;
    b.forwardSeconds = 1.0;
    b.backwardSeconds = 2.0;
    b.inputBytes = 10;
    b.savedBytes = 100;
    p.blocks.push_back(b);
  }
  return p;
}

}  // namespace

TEST(Planner, PredictsHandWorkedSchedules) {
  const ModelProfile profile = twoBlocks();
  const TierBandwidth bw{100.0, 100.0};
  using P = BlockPolicy;
  // keep: 1 + 1 forward, 2 + 2 backward; both blocks' saves live at once.
  Prediction keep = predict(profile, {P::kKeep, P::kKeep}, bw, 1);
  EXPECT_DOUBLE_EQ(keep.stepSeconds, 6.0);
  EXPECT_EQ(keep.peakBytes, 200);
  // recompute: each backward reruns its forward (+1 s each); block 1's backward holds its
  // saves, its input and block 0's input.
  Prediction recompute = predict(profile, {P::kRecompute, P::kRecompute}, bw, 1);
  EXPECT_DOUBLE_EQ(recompute.stepSeconds, 8.0);
  EXPECT_EQ(recompute.peakBytes, 120);
  // swap block 0: written during block 1's forward (t 1..2, 100 B at 100 B/s), read back while
  // block 1 runs backward (t 2..3): no stall, but both blocks' saves are live again then.
  Prediction swap0 = predict(profile, {P::kSwap, P::kKeep}, bw, 1);
  EXPECT_DOUBLE_EQ(swap0.stepSeconds, 6.0);
  EXPECT_EQ(swap0.peakBytes, 200);
  // With the read slower than block 1's backward (10 B/s: t 2..12), block 0 waits for it.
  Prediction slow = predict(profile, {P::kSwap, P::kKeep}, TierBandwidth{100.0, 10.0}, 1);
  EXPECT_DOUBLE_EQ(slow.stepSeconds, 14.0);
}

// The executor's write backpressure (setActivationLimit) in the model: three swap blocks whose
// 100-byte saves take 2 s each to write at 50 B/s. Without a limit forward runs 3 s, the writes
// trail it and backward's prefetch cancels block 2's (not started at t 3): backward 3..9. With
// 150 bytes, blocks 1 and 2 each wait until the writes queued before them ended (t 3 and 6),
// so forward ends at 7, block 2's write at 9, and backward (2 s a block) at 15.
TEST(Planner, PredictsTheWriteBackpressureOfAnActivationLimit) {
  ModelProfile profile = twoBlocks();
  profile.blocks.push_back(profile.blocks.back());
  profile.blocks.back().label = "b2";
  using P = BlockPolicy;
  const std::vector<P> swap(3, P::kSwap);
  const TierBandwidth bw{50.0, 1e9};
  const Prediction free = predict(profile, swap, bw, 1);
  EXPECT_DOUBLE_EQ(free.forwardSeconds, 3.0);
  EXPECT_NEAR(free.stepSeconds, 9.0, 1e-6);
  const Prediction limited = predict(profile, swap, bw, 1, nullptr, 150);
  EXPECT_DOUBLE_EQ(limited.forwardSeconds, 7.0);
  EXPECT_NEAR(limited.stepSeconds, 15.0, 1e-6);
  // A limit the saves never reach changes nothing.
  const Prediction roomy = predict(profile, swap, bw, 1, nullptr, 1000);
  EXPECT_DOUBLE_EQ(roomy.stepSeconds, free.stepSeconds);
  EXPECT_EQ(roomy.peakBytes, free.peakBytes);
}

// memory.tier_dtype = bf16: the tier moves a swapped block's float32 bytes at half; what it
// holds in memory is unchanged.
TEST(Planner, PredictsBf16TierStorageHandWorked) {
  ModelProfile profile = twoBlocks();
  for (auto& b : profile.blocks) b.savedFloat32Bytes = 80;  // 20 bytes of other types
  using P = BlockPolicy;
  const TierBandwidth slowRead{100.0, 10.0};
  // As stored (float32): block 0's 100 bytes read at 10 B/s (t 2..12), as in
  // PredictsHandWorkedSchedules.
  EXPECT_DOUBLE_EQ(predict(profile, {P::kSwap, P::kKeep}, slowRead, 1).stepSeconds, 14.0);
  // As bf16: 20 + 80 / 2 = 60 bytes, written t 1..1.6, read t 2..8; block 0's backward waits
  // until 8 and ends at 10.
  profile.activationsOnTier = TierDtype::kBf16;
  const Prediction bf16 = predict(profile, {P::kSwap, P::kKeep}, slowRead, 1);
  EXPECT_DOUBLE_EQ(bf16.stepSeconds, 10.0);
  EXPECT_EQ(bf16.peakBytes, 200);  // memory holds the float32 saves until they are written
}

TEST(Planner, PredictsOutOfCoreWeightsHandWorked) {
  // Three blocks (forward 1 s, backward 2 s, all keep); out-of-core weights: blocks 1 and 2
  // hold 1 GB of weights and two 1 GB pieces of optimizer state each (block 0 stays in
  // memory), the tier reads and writes 1 GB/s, each block's update steps for 0.5 s.
  ModelProfile profile = twoBlocks();
  profile.blocks.push_back(profile.blocks.back());
  const std::vector<BlockPolicy> keep(3, BlockPolicy::kKeep);
  const TierBandwidth bw{1e9, 1e9};
  const int64_t gb = 1000000000;
  WeightTraffic w;
  w.weightBytes = {0, gb, gb};
  w.statePieces = {{}, {gb, gb}, {gb, gb}};
  w.updateSeconds = {0.5, 0.5, 0.5};
  w.prefetch = 1;
  w.updateBacklog = 0;
  w.writesInFlight = 2;
  // Forward: block 1's weights read at 0..1 (prefetched while block 0 runs), block 2's at
  // 1..2: forward ends at 3. Backward: block 1's weights read again at 3..4; block 2 (its
  // weights stayed) runs 3..5. Its update: pieces read 5..6 and 6..7, stepped 6..6.25 and
  // 7..7.25, written 6.25..7.25 and 7.25..8.25; done at 7.25 (the weights' write queued then,
  // 8.25..9.25). Block 1 waits for it (updateBacklog 0): 7.25..9.25; its pieces read 9.25..
  // 10.25 and 10.25..11.25, stepped to 10.5 and 11.5, written from 10.5 and 11.5: done at
  // 11.5. Block 0 waits for that: 11.5..13.5, its update (nothing to move) 13.5..14.
  const Prediction p = predict(profile, keep, bw, 1, &w);
  EXPECT_DOUBLE_EQ(p.forwardSeconds, 3.0);
  EXPECT_DOUBLE_EQ(p.stepSeconds, 13.5);
  EXPECT_DOUBLE_EQ(p.updatesEndSeconds, 14.0);
  // One piece in flight: block 2's second piece waits for the first's write (to 7.25), the
  // same; block 1's first write waits for block 2's weights (8.25..9.25 after the second
  // piece's 7.25..8.25): still before its step ends. Unchanged.
  w.writesInFlight = 1;
  EXPECT_DOUBLE_EQ(predict(profile, keep, bw, 1, &w).stepSeconds, 13.5);
  w.writesInFlight = 2;
  // One update may wait: block 1 runs 5..7 without waiting for block 2's update; block 0
  // waits for block 2's (done at 7.25): 7.25..9.25.
  w.updateBacklog = 1;
  EXPECT_DOUBLE_EQ(predict(profile, keep, bw, 1, &w).stepSeconds, 9.25);
  // An updater without a core of its own: block 2's steps (6..6.25, 7..7.25) overlap block
  // 1's backward (5..7) by 0.25 s; block 1's (its pieces read 7..8 and 8..9, stepped 8..8.25
  // and 9..9.25) overlap block 0's (7.25..9.25) by 0.5 s: 0.75 s more.
  w.updaterSharesCore = true;
  EXPECT_DOUBLE_EQ(predict(profile, keep, bw, 1, &w).stepSeconds, 10.0);
  w.updaterSharesCore = false;
  // With clipping the updates wait for backward (3..9, the weights read again for block 1 at
  // 3..4): forward+backward is the in-core 9 s.
  w.overlap = false;
  EXPECT_DOUBLE_EQ(predict(profile, keep, bw, 1, &w).stepSeconds, 9.0);
  // Weights in memory: the in-core prediction.
  EXPECT_DOUBLE_EQ(predict(profile, keep, bw, 1).stepSeconds, 9.0);
}

TEST(Planner, PicksTheFastestPlanThatFits) {
  const ModelProfile profile = twoBlocks();
  const TierBandwidth bw{100.0, 100.0};
  // No budget: keep everything.
  Plan free = planPolicies(profile, bw, 0, 1);
  EXPECT_EQ(formatPolicies(free.policies), "keep,keep");
  // 150 bytes: keep does not fit (200); all-recompute fits (8 s) but rebuilding only block 0
  // (recompute or swap-input, 7 s, peak 110) is faster.
  Plan tight = planPolicies(profile, bw, 150, 1);
  EXPECT_TRUE(tight.fits);
  EXPECT_DOUBLE_EQ(tight.prediction.stepSeconds, 7.0);
  EXPECT_LE(tight.prediction.peakBytes, 150);
  EXPECT_EQ(tight.policies[1], BlockPolicy::kKeep) << formatPolicies(tight.policies);
  // 50 bytes: nothing fits (one block's saves are 100); the smallest peak is returned.
  Plan none = planPolicies(profile, bw, 50, 1);
  EXPECT_FALSE(none.fits);
  EXPECT_GE(none.prediction.peakBytes, 100);
}

// StepPredictor's phases alone (predict runs them in order), each against a closed form.
namespace {

// Three blocks whose times and sizes are small powers of two, so every sum below is exact:
// forward 0.5, 1, 0.25 s; backward 1, 2, 0.5 s; inputs 8, 16, 32 bytes; saves 64, 128, 256
// bytes; the loss 0.125 s, saving 4 bytes.
ModelProfile phaseProfile() {
  ModelProfile p;
  const double forward[] = {0.5, 1.0, 0.25}, backward[] = {1.0, 2.0, 0.5};
  const int64_t input[] = {8, 16, 32}, saved[] = {64, 128, 256};
  for (size_t i = 0; i < 3; ++i) {
    BlockProfile b;
    b.label = "b" + std::to_string(i);
    b.forwardSeconds = forward[i];
    b.backwardSeconds = backward[i];
    b.inputBytes = input[i];
    b.savedBytes = saved[i];
    p.blocks.push_back(b);
  }
  p.lossSeconds = 0.125;
  p.lossSavedBytes = 4;
  return p;
}

constexpr double kForwardSeconds = 0.5 + 1.0 + 0.25;
constexpr double kBackwardSeconds = 1.0 + 2.0 + 0.5;
const TierBandwidth kNoTier{0.0, 0.0};

// Weights every block keeps in memory (nothing to move), updated for 0.25, 0.75 and 0.5 s.
WeightTraffic keptWeights(bool overlap, bool updaterSharesCore) {
  WeightTraffic w;
  w.weightBytes = {0, 0, 0};
  w.statePieces = {{}, {}, {}};
  w.updateSeconds = {0.25, 0.75, 0.5};
  w.overlap = overlap;
  w.updateBacklog = 2;  // backward never waits for an update
  w.updaterSharesCore = updaterSharesCore;
  return w;
}

// phaseProfile's model with every block keeping and `weights`, run through backward (which
// ends at kForwardSeconds + the loss + kBackwardSeconds: nothing waits).
StepPredictor afterBackward(const ModelProfile& profile, const WeightTraffic& weights) {
  StepPredictor model(profile, std::vector<BlockPolicy>(3, BlockPolicy::kKeep), kNoTier, 1,
                      &weights);
  model.runForward();
  model.runBackward();
  return model;
}

}  // namespace

TEST(PlannerPhases, ForwardNeverWaitsForTheTierWithoutAnActivationLimit) {
  const ModelProfile profile = phaseProfile();
  const std::vector<BlockPolicy> swap(3, BlockPolicy::kSwap);
  StepPredictor model(profile, swap, TierBandwidth{1.0, 1.0}, 1);  // 1 B/s: far behind
  EXPECT_EQ(model.runForward(), kForwardSeconds);
  EXPECT_EQ(model.forwardEnd(0), 0.5);
  EXPECT_EQ(model.forwardEnd(1), 0.5 + 1.0);
  EXPECT_EQ(model.forwardEnd(2), kForwardSeconds);
  EXPECT_GT(model.writeEnd(2), kForwardSeconds);  // the writes trail forward
}

TEST(PlannerPhases, EachWriteStartsWhenItsBytesExistAndTheWriterIsFree) {
  const ModelProfile profile = phaseProfile();
  using P = BlockPolicy;
  const std::vector<P> policies = {P::kSwapInput, P::kSwap, P::kSwap};
  StepPredictor model(profile, policies, TierBandwidth{64.0, 64.0}, 1);
  model.runForward();
  // Swap-input: block 0's input, from its start; swap: block 1's saves, from its end; block
  // 2's saves, from its end (1.75), queue behind block 1's write.
  EXPECT_EQ(model.writeStart(0), 0.0);
  EXPECT_EQ(model.writeEnd(0), 8.0 / 64);
  EXPECT_EQ(model.writeStart(1), 0.5 + 1.0);
  EXPECT_EQ(model.writeEnd(1), 0.5 + 1.0 + 128.0 / 64);
  EXPECT_EQ(model.writeStart(2), model.writeEnd(1));
  EXPECT_EQ(model.writeEnd(2), 0.5 + 1.0 + 128.0 / 64 + 256.0 / 64);
}

// 200 bytes: block 1 starts at 0.5 with block 0's 64 bytes unwritten (64 + 128 fit); block 2
// starts at 1.5 with block 1's 128 unwritten (128 + 256 do not): it waits for block 1's write.
TEST(PlannerPhases, AnActivationLimitHoldsForwardUntilTheQueuedWritesEnd) {
  const ModelProfile profile = phaseProfile();
  const std::vector<BlockPolicy> swap(3, BlockPolicy::kSwap);
  StepPredictor model(profile, swap, TierBandwidth{64.0, 64.0}, 1, nullptr, 200);
  const double blockOneWritten = 0.5 + 1.0 + 128.0 / 64;
  EXPECT_EQ(model.runForward(), blockOneWritten + 0.25);
  EXPECT_EQ(model.forwardEnd(1), 0.5 + 1.0);  // block 1 did not wait
  EXPECT_EQ(model.writeStart(2), blockOneWritten + 0.25);
}

TEST(PlannerPhases, KeepingEverythingPeaksAtTheSumOfSavedBytesPlusTheLoss) {
  const ModelProfile profile = phaseProfile();
  const std::vector<BlockPolicy> keep(3, BlockPolicy::kKeep);
  StepPredictor model(profile, keep, kNoTier, 1);
  model.runForward();
  EXPECT_EQ(model.forwardPeakBytes(), 64 + 128 + 256 + 4);
}

TEST(PlannerPhases, RecomputeAddsTheBlockForwardToBackward) {
  const ModelProfile profile = phaseProfile();
  using P = BlockPolicy;
  StepPredictor keep(profile, {P::kKeep, P::kKeep, P::kKeep}, kNoTier, 1);
  keep.runForward();
  EXPECT_EQ(keep.runBackward(), kForwardSeconds + 0.125 + kBackwardSeconds);
  StepPredictor recompute(profile, {P::kKeep, P::kRecompute, P::kKeep}, kNoTier, 1);
  recompute.runForward();
  EXPECT_EQ(recompute.runBackward(), kForwardSeconds + 0.125 + kBackwardSeconds + 1.0);
}

TEST(PlannerPhases, SwapWithInfiniteBandwidthCostsNothing) {
  const ModelProfile profile = phaseProfile();
  const double inf = std::numeric_limits<double>::infinity();
  StepPredictor model(profile, std::vector<BlockPolicy>(3, BlockPolicy::kSwap),
                      TierBandwidth{inf, inf}, 1);
  EXPECT_EQ(model.runForward(), kForwardSeconds);
  EXPECT_EQ(model.runBackward(), kForwardSeconds + 0.125 + kBackwardSeconds);
}

// Block 0 swapped (written at once), read at 16 B/s: its read is queued when block 1's backward
// starts (after the loss and block 2's) and takes 64 / 16 = 4 s, longer than block 1's 2 s.
TEST(PlannerPhases, ABlockWhoseReadOutlastsTheBlockAboveStartsWhenTheReadEnds) {
  const ModelProfile profile = phaseProfile();
  using P = BlockPolicy;
  const double inf = std::numeric_limits<double>::infinity();
  StepPredictor model(profile, {P::kSwap, P::kKeep, P::kKeep}, TierBandwidth{inf, 16.0}, 1);
  model.runForward();
  const double end = model.runBackward();
  const double readQueued = kForwardSeconds + 0.125 + 0.5;
  EXPECT_EQ(model.readEnd(0), readQueued + 64.0 / 16);
  EXPECT_EQ(end, readQueued + 64.0 / 16 + 1.0);
}

// Writes at 1 B/s: when backward queues the reads of blocks 2 (at the end of forward) and 1
// (when block 2 starts), their writes have not started: both are cancelled and cost nothing.
// Block 0's write (0.5..64.5) had started when block 1 queued its read: read 64.5..128.5.
TEST(PlannerPhases, AReadQueuedBeforeItsWriteStartedIsCancelledAndCostsNothing) {
  const ModelProfile profile = phaseProfile();
  StepPredictor model(profile, std::vector<BlockPolicy>(3, BlockPolicy::kSwap),
                      TierBandwidth{1.0, 1.0}, 1);
  model.runForward();
  const double end = model.runBackward();
  EXPECT_TRUE(model.readCancelled(2));
  EXPECT_TRUE(model.readCancelled(1));
  EXPECT_EQ(model.readEnd(2), kForwardSeconds);
  EXPECT_FALSE(model.readCancelled(0));
  EXPECT_EQ(model.readEnd(0), 0.5 + 64.0 + 64.0);
  EXPECT_EQ(end, 0.5 + 64.0 + 64.0 + 1.0);
}

TEST(PlannerPhases, BackwardHoldsItsRematerializedSavesAndWhatTheBlocksBelowHold) {
  const ModelProfile profile = phaseProfile();
  using P = BlockPolicy;
  StepPredictor model(profile, {P::kKeep, P::kRecompute, P::kRecompute}, kNoTier, 1);
  model.runForward();
  const double start = kForwardSeconds + 0.125;
  // Block 2 recomputes: its saves and input; below it block 0's saves and block 1's input.
  EXPECT_EQ(model.backwardLiveBytes(2, start), 256 + 32 + 64 + 16);
  EXPECT_EQ(model.backwardLiveBytes(1, start), 128 + 16 + 64);
  EXPECT_EQ(model.backwardLiveBytes(0, start), 64);
  // A swapped block below, written and not read back, holds nothing.
  const double inf = std::numeric_limits<double>::infinity();
  StepPredictor swapped(profile, {P::kSwap, P::kKeep, P::kKeep}, TierBandwidth{inf, inf}, 1);
  swapped.runForward();
  EXPECT_EQ(swapped.backwardLiveBytes(2, start), 256 + 128);
}

// One block, its optimizer state in pieces of 2 and 6 bytes (read at 1 B/s), stepped for 1 s
// shared out by bytes: piece 1's read starts when piece 0's step does, so the last step
// starts when both reads are done, back to back from `ready`.
TEST(PlannerPhases, AnUpdateEndsWhenItsPiecesAreReadBackToBackAndTheLastIsStepped) {
  ModelProfile profile = phaseProfile();
  profile.blocks.resize(1);
  WeightTraffic w;
  w.weightBytes = {4};
  w.statePieces = {{2, 6}};
  w.updateSeconds = {1.0};
  StepPredictor model(profile, {BlockPolicy::kKeep}, TierBandwidth{1.0, 1.0}, 1, &w);
  const double ready = 10.0;
  EXPECT_EQ(model.runUpdate(0, ready), ready + (2.0 + 6.0) / 1.0 + 1.0 * 6 / 8);
  EXPECT_EQ(model.updateEnd(0), ready + 8.0 + 0.75);
}

// Updates overlapped with backward (2.375..4.375 block 1, 4.375..5.375 block 0): block 2's
// (0.5 s) runs during block 1's backward, block 1's (0.75 s) during block 0's, block 0's after.
TEST(PlannerPhases, AnUpdaterWithoutACoreOfItsOwnAddsItsOverlapWithBackwardToTheStep) {
  const ModelProfile profile = phaseProfile();
  const WeightTraffic shares = keptWeights(/*overlap=*/true, /*updaterSharesCore=*/true);
  StepPredictor model = afterBackward(profile, shares);
  EXPECT_EQ(model.updaterSharedSeconds(), 0.5 + 0.75);
  EXPECT_EQ(model.finish().stepSeconds, kForwardSeconds + 0.125 + kBackwardSeconds + 0.5 + 0.75);
  // With a core of its own it takes nothing.
  const WeightTraffic own = keptWeights(/*overlap=*/true, /*updaterSharesCore=*/false);
  EXPECT_EQ(afterBackward(profile, own).updaterSharedSeconds(), 0.0);
}

TEST(PlannerPhases, WithClippingTheUpdatesRunAfterBackwardTopBlockFirst) {
  const ModelProfile profile = phaseProfile();
  const WeightTraffic clipping = keptWeights(/*overlap=*/false, /*updaterSharesCore=*/false);
  StepPredictor model = afterBackward(profile, clipping);
  EXPECT_EQ(model.updateEnd(2), -std::numeric_limits<double>::infinity());  // none yet
  model.runUpdatesAfterBackward();
  const double end = kForwardSeconds + 0.125 + kBackwardSeconds;
  EXPECT_EQ(model.updateEnd(2), end + 0.5);
  EXPECT_EQ(model.updateEnd(1), end + 0.5 + 0.75);
  EXPECT_EQ(model.updateEnd(0), end + 0.5 + 0.75 + 0.25);
}

// The planner's profile differentiates each block in turn and removes the gradients it made as
// soon as the block is done: while block i's gradients are computed no other block holds one
// (the whole model's gradients at once were 4 bytes a parameter on every worker, before a
// sharded run slices its model), and none is left afterwards.
TEST(Profile, HoldsOneBlocksGradientsAtATimeAndLeavesNone) {
  installSavedTensorEngine();
  torch::manual_seed(7);
  BlockModel model = buildModel(gptSpec(), lmShape());
  model->train();
  const size_t blocks = model->numBlocks();
  std::vector<std::vector<at::Tensor>> perBlock;
  for (size_t i = 0; i < blocks; ++i) perBlock.push_back(model->block(i).ptr()->parameters());
  int checks = 0;
  std::vector<std::pair<at::Tensor, unsigned>> hooks;
  for (size_t i = 0; i < blocks; ++i) {
    for (at::Tensor p : perBlock[i]) {
      hooks.emplace_back(p, p.register_hook([&, i](const at::Tensor& g) {
        for (size_t j = 0; j < blocks; ++j) {
          if (j == i) continue;
          for (const auto& q : perBlock[j]) {
            EXPECT_FALSE(q.grad().defined())
                << "block " << j << " held a gradient while block " << i << " was differentiated";
          }
        }
        ++checks;
        return g;
      }));
    }
  }
  profileModel(model, test::randomBatch(lmShape(), 4, 3), 1);
  for (auto& [p, handle] : hooks) p.remove_hook(handle);
  EXPECT_GT(checks, static_cast<int>(blocks)) << "the hooks did not run";
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
}
