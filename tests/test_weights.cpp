// Out-of-core weights, gradients and optimizer state (src/memory/weights.h): training with
// every block's weights and optimizer state on a tier is bitwise the in-core run (losses, final
// weights) on the GPT with dropout and AdamW, the CNN with Nesterov momentum and weight decay,
// and the ResNet (batch norm), under every activation policy, on the host and disk tiers, with
// and without gradient clipping; between steps only block 0 is in memory; checkpoints are in
// the in-core format and a run resumed out of core continues an in-core run exactly; under a
// budget below what in-core training needs, the tracked peak stays under it.
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/config.h"
#include "core/errors.h"
#include "memory/executor.h"
#include "memory/saved_tensors.h"
#include "memory/tier.h"
#include "memory/tracker.h"
#include "memory/weights.h"
#include "models/model.h"
#include "run_util.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/data_parallel_step.h"
#include "train/setup.h"
#include "train/step.h"
#include "train/trainer.h"

using namespace caravan;
using caravan::test::TempDir;

namespace {

struct Case {
  std::string name;
  ModelSpec spec;
  DataShape shape;
  std::string optimizer;  // "adamw" or "sgd" (momentum, nesterov, weight decay)
};

Case gptCase() {
  Case c;
  c.name = "gpt";
  c.spec.name = "gpt";
  c.spec.width = 32;
  c.spec.depth = 3;
  c.spec.heads = 4;
  c.spec.dropout = 0.1;
  c.shape.task = TaskKind::kLanguageModel;
  c.shape.vocabSize = 13;
  c.shape.seqLen = 16;
  c.optimizer = "adamw";
  return c;
}

Case imageCase(const std::string& name) {
  Case c;
  c.name = name;
  c.spec.name = name;
  c.spec.width = 8;
  c.shape.task = TaskKind::kImageClassification;
  c.optimizer = "sgd";
  return c;
}

std::unique_ptr<torch::optim::Optimizer> makeOpt(const std::string& kind,
                                                 std::vector<at::Tensor> params) {
  if (kind == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(0.01).weight_decay(0.05));
  }
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3));
}

struct Outcome {
  std::vector<double> losses;
  std::vector<at::Tensor> params;   // after the last step
  std::vector<at::Tensor> buffers;  // batch-norm running statistics
  int64_t weightsPeak = 0, gradientsPeak = 0, statePeak = 0;
  int64_t inCoreBytes = 0;       // weights + gradients + state of the whole model
  WeightWindow window;           // OutOfCoreWeights::window
  int64_t residentBetween = -1;  // blocks >= 1 holding weights between steps (elements)
  WeightStats stats;
};

// The window of the default options, or the smallest: no prefetch, each update before the next
// block's backward, one write in flight, every parameter's state a piece of its own.
WeightOptions windowOptions(const Case& c, double clip, bool smallest) {
  WeightOptions o;
  o.overlapUpdates = clip <= 0.0;
  o.stateFactor = c.optimizer == "adamw" ? 2 : 1;
  if (smallest) {
    o.prefetch = 0;
    o.updateBacklog = 0;
    o.maxWritesInFlight = 1;
    o.stateChunkBytes = 1;
  }
  return o;
}

// Four steps (learning rate changing every step) from the same initialization and batches.
// `tier` nullptr: in core. `policies` "": no activation executor.
Outcome run(const Case& c, Tier* tier, const std::string& policies, double clip,
            bool smallestWindow = false) {
  installSavedTensorEngine();
  torch::manual_seed(7);
  BlockModel model = buildModel(c.spec, c.shape);
  model->train();
  auto optimizer = makeOpt(c.optimizer, model->parameters());
  Outcome out;
  for (const auto& p : model->parameters()) {
    out.inCoreBytes += p.numel() * 4 * (c.optimizer == "adamw" ? 4 : 3);
  }
  MemoryTracker tracker;
  {
    std::vector<at::Tensor> state;
    if (tier == nullptr) state = model->parameters();
    for (const auto& b : model->buffers()) state.push_back(b);
    SavedTensorScope scope(tracker, state);
    std::unique_ptr<ActivationExecutor> exec;
    if (!policies.empty() || tier != nullptr) {
      exec = std::make_unique<ActivationExecutor>(
          model, parsePolicies(policies.empty() ? "keep" : policies, model->numBlocks(), "test"),
          tier, 1);
    }
    std::unique_ptr<OutOfCoreWeights> weights;
    if (tier != nullptr) {
      const WeightOptions o = windowOptions(c, clip, smallestWindow);
      out.window = OutOfCoreWeights::window(model, o);
      weights = std::make_unique<OutOfCoreWeights>(
          model, *optimizer,
          [&c](std::vector<at::Tensor> ps) { return makeOpt(c.optimizer, std::move(ps)); },
          *tier, &tracker, nullptr, o);
      exec->setWeights(weights.get());
      tracker.resetPeaks();
    }
    torch::manual_seed(11);  // dropout draws
    DataParallelStep engine(model, *optimizer, {clip}, {nullptr, nullptr, weights.get()});
    for (int step = 0; step < 4; ++step) {
      const Batch batch = test::randomBatch(c.shape, 4, 100 + step);
      for (auto& g : optimizer->param_groups()) g.options().set_lr(0.05 / (1 + step));
      StepResult r = engine.step(batch, step);
      out.losses.push_back(r.loss);
      if (weights && step == 1) {
        tier->drainWrites();  // the last writes land; then only block 0 stays
        int64_t resident = 0;
        for (size_t i = 1; i < model->numBlocks(); ++i) {
          for (const auto& p : model->block(i).ptr()->parameters()) resident += p.numel();
        }
        out.residentBetween = resident;
      }
    }
    out.weightsPeak = tracker.peak(MemoryCategory::kWeights);
    out.gradientsPeak = tracker.peak(MemoryCategory::kGradients);
    out.statePeak = tracker.peak(MemoryCategory::kOptimizerState);
    auto collect = [&] {
      for (const auto& p : model->parameters()) out.params.push_back(p.detach().clone());
    };
    if (weights) {
      weights->withAllResident(collect);
      out.stats = weights->takeStats();
    } else {
      collect();
    }
  }
  for (const auto& b : model->buffers()) out.buffers.push_back(b.clone());
  return out;
}

void expectSame(const Outcome& a, const Outcome& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << what << " step " << i;
  }
  ASSERT_EQ(a.params.size(), b.params.size()) << what;
  for (size_t i = 0; i < a.params.size(); ++i) {
    ASSERT_EQ(a.params[i].sizes(), b.params[i].sizes()) << what << " parameter " << i;
    EXPECT_TRUE(at::equal(a.params[i], b.params[i]))
        << what << " parameter " << i << " differs by "
        << (a.params[i] - b.params[i]).abs().max().item<double>();
  }
  ASSERT_EQ(a.buffers.size(), b.buffers.size());
  for (size_t i = 0; i < a.buffers.size(); ++i) {
    EXPECT_TRUE(at::equal(a.buffers[i], b.buffers[i])) << what << " buffer " << i;
  }
}

// Each category's peak within its bound, and the sum of the peaks (which bounds the peak of the
// sum) within the total.
void expectWithin(const Outcome& o) {
  EXPECT_LE(o.weightsPeak, o.window.weights);
  EXPECT_LE(o.statePeak, o.window.state);
  EXPECT_LE(o.gradientsPeak, o.window.gradients);
  EXPECT_LE(o.weightsPeak + o.gradientsPeak + o.statePeak, o.window.total)
      << "weights " << o.weightsPeak << " gradients " << o.gradientsPeak << " state "
      << o.statePeak;
}

std::unique_ptr<Tier> diskTier(const TempDir& dir) {
  try {
    return std::make_unique<FileTier>(dir.path());
  } catch (const ConfigError&) {
    return nullptr;  // the temp dir is on tmpfs: the file tier refuses it
  }
}

void checkCase(const Case& c, const std::string& mixed) {
  TempDir dir;
  HostTier host;
  std::unique_ptr<Tier> disk = diskTier(dir);
  const Outcome inCore = run(c, nullptr, "", 0.0);
  for (Tier* tier : {static_cast<Tier*>(&host), disk.get()}) {
    if (tier == nullptr) continue;
    SCOPED_TRACE(tier->describe());
    const Outcome out = run(c, tier, "", 0.0);
    expectSame(inCore, out, "offload, keep");
    // Between steps only block 0's weights are in memory; everything went through the tier.
    EXPECT_EQ(out.residentBetween, 0);
    EXPECT_GT(out.stats.bytesWritten, 0);
    EXPECT_GT(out.stats.bytesRead, 0);
    // Never more than the window the budget is planned with (the sum of the category peaks
    // bounds the peak of the sum), and on the GPT (5 blocks) at most 3/4 of the whole model
    // (the worst interleaving of the updater and backward reaches exactly 3/4: measured in 2
    // of 8 runs, before and after issue 16).
    expectWithin(out);
    if (c.name == "gpt") {
      EXPECT_LE(out.weightsPeak + out.statePeak, out.inCoreBytes * 3 / 4);
    }
    expectSame(inCore, run(c, tier, "recompute", 0.0), "offload, recompute");
    expectSame(inCore, run(c, tier, mixed, 0.0), "offload, " + mixed);
    // The smallest window: the optimizer state streamed through memory one parameter at a
    // time, updates in turn with backward. Still bitwise, and within its (smaller) window.
    const Outcome small = run(c, tier, mixed, 0.0, true);
    expectSame(inCore, small, "offload, smallest window, " + mixed);
    expectWithin(small);
    EXPECT_LT(small.window.total, out.window.total);
    EXPECT_LT(small.statePeak, out.statePeak);
  }
  // Clipping: the updates wait for every gradient (global norm), still bitwise, and within the
  // window for that case (every gradient, but the blobs leave as their gradients are in).
  const Outcome clipped = run(c, &host, "", 0.5);
  expectSame(run(c, nullptr, "", 0.5), clipped, "offload with clipping");
  expectWithin(clipped);
  if (c.name == "gpt") {
    EXPECT_LT(clipped.weightsPeak + clipped.statePeak, clipped.inCoreBytes * 3 / 4);
  }
  if (!disk) std::cerr << "note: the temp dir is on tmpfs; the disk tier was not tested\n";
}

}  // namespace

TEST(OutOfCoreWeights, TrainsBitwiseLikeInCoreOnGptWithAdamW) {
  // Blocks: embedding, 3 transformer blocks, head.
  checkCase(gptCase(), "swap,recompute,swap-input,keep,swap");
}

TEST(OutOfCoreWeights, TrainsBitwiseLikeInCoreOnCnnWithNesterov) {
  checkCase(imageCase("cnn"), "recompute,swap,keep");
}

TEST(OutOfCoreWeights, TrainsBitwiseLikeInCoreOnResnet) {
  checkCase(imageCase("resnet-mini"), "keep,recompute,swap,keep,recompute");
}

namespace {

Config offloadGptConfig(const std::vector<std::string>& extra) {
  std::vector<std::string> o = {"data.dataset=synthetic", "data.synthetic_size=96",
                                "data.synthetic_task=tokens", "data.seq_len=16",
                                "data.batch_size=8", "train.max_steps=20", "train.log_every=1",
                                "train.eval_every=10", "train.threads=1", "checkpoint.every=7",
                                "model.name=gpt", "model.width=32", "model.depth=3",
                                "model.heads=2", "model.dropout=0.1", "optim.name=adamw",
                                "optim.lr=0.003", "memory.tier=host"};
  o.insert(o.end(), extra.begin(), extra.end());
  return Config::fromString("", "<test>", o);
}

}  // namespace

TEST(OutOfCoreWeights, ResumesAnInCoreRunExactlyFromItsCheckpoint) {
  // The checkpoint format is the in-core one: an in-core run stopped at step 9 and resumed out
  // of core (and the other way round) ends as the uninterrupted in-core run, bitwise.
  const Config inCore = offloadGptConfig({});
  const Config offload = offloadGptConfig({"memory.weights=offload"});
  TempDir tmp;
  TrainerOptions full;
  full.runDir = tmp / "full";
  full.quiet = true;
  train(inCore, full);
  for (const auto& [first, second, name] :
       {std::tuple<const Config*, const Config*, std::string>{&inCore, &offload, "core-offload"},
        {&offload, &inCore, "offload-core"}}) {
    SCOPED_TRACE(name);
    TrainerOptions a = full;
    a.runDir = tmp / name;
    a.stopAtStep = 9;
    EXPECT_TRUE(train(*first, a).stoppedEarly);
    TrainerOptions b = a;
    b.stopAtStep = 0;
    b.resume = true;
    EXPECT_EQ(train(*second, b).steps, 20);
    const std::vector<double> la = test::trainLosses(full.runDir), lb = test::trainLosses(a.runDir);
    ASSERT_EQ(la.size(), 20u);
    ASSERT_EQ(lb.size(), 20u);
    for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;
    auto wa = test::finalWeights(inCore, full.runDir), wb = test::finalWeights(inCore, a.runDir);
    for (const auto& [key, t] : wa) EXPECT_TRUE(at::equal(t, wb.at(key))) << key;
  }
}

TEST(OutOfCoreWeights, KeepsTheTrackedPeakUnderABudgetInCoreExceeds) {
  // A GPT whose weights dominate (wide, short context): in core it needs more than the budget;
  // out of core (with recompute for the activations) its tracked peak stays under it.
  // Checkpoints every 2 steps: the blocks read back for them are not training's memory.
  const std::vector<std::string> base = {"model.width=128", "model.depth=12", "model.heads=4",
                                         "data.batch_size=2", "train.max_steps=5",
                                         "checkpoint.every=2", "train.eval_every=0"};
  TempDir tmp;
  auto runWith = [&](const std::vector<std::string>& extra, const std::string& name) {
    std::vector<std::string> o = base;
    o.insert(o.end(), extra.begin(), extra.end());
    TrainerOptions t;
    t.runDir = tmp / name;
    t.quiet = true;
    train(offloadGptConfig(o), t);
    return nlohmann::json::parse(test::readFile(tmp / (name + "/summary.json")));
  };
  const nlohmann::json core = runWith({"memory.policy=recompute"}, "core");
  const int64_t needed = core["tracked_peak_bytes"].get<int64_t>();
  const int64_t budget = needed / 2;
  const std::string b = "memory.budget=" + std::to_string(budget);
  EXPECT_THROW(runWith({"memory.policy=recompute", b}, "core-budget"), ConfigError);
  const nlohmann::json off =
      runWith({"memory.policy=recompute", "memory.weights=offload", b}, "offload");
  EXPECT_LE(off["tracked_peak_bytes"].get<int64_t>(), budget);
  EXPECT_GT(off["tracked_peak_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(off["final_train_loss"].get<double>(), core["final_train_loss"].get<double>());
}

TEST(OutOfCoreWeights, TierWriteErrorFailsTheRunWithAClearMessage) {
  // The CNN's blocks 1.. hold 1.8 MB of weights: written at start-up under the 3 MiB file size
  // limit; the first updates create the momentum buffers, whose pieces take the file to 3.6 MB,
  // and their writes fail with EFBIG on the updater's I/O, which reaches the training thread.
  if (!test::expectTierWriteFailure(3072, "--set memory.weights=offload")) {
    GTEST_SKIP() << "the temp dir is on tmpfs";
  }
  // Under 1 MiB the writes at start-up fail, while the store is being made: the same.
  EXPECT_TRUE(test::expectTierWriteFailure(1024, "--set memory.weights=offload"));
}
