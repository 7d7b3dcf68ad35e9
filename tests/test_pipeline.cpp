// Pipeline parallelism: schedules as data (pipeline/schedule.h), checked without a network.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "core/errors.h"
#include "gloo_ranks.h"
#include "models/model.h"
#include "models/script_model.h"
#include "pipeline/partition.h"
#include "pipeline/schedule.h"
#include "pipeline/stage.h"
#include "test_util.h"

namespace caravan {
namespace {

const PipelineSchedule kAll[] = {PipelineSchedule::kGPipe, PipelineSchedule::kOneFOneB,
                                 PipelineSchedule::kZeroBubbleH1};

std::string label(PipelineSchedule s, int k, int m) {
  return pipelineScheduleName(s) + " K=" + std::to_string(k) + " M=" + std::to_string(m);
}

TEST(PipelineSchedule, EveryScheduleIsValidForEveryStageAndMicroBatchCount) {
  for (PipelineSchedule s : kAll) {
    for (int k = 1; k <= 8; ++k) {
      for (int m = 1; m <= 32; ++m) {
        const auto programs = buildSchedule(s, k, m);
        ASSERT_EQ(programs.size(), static_cast<size_t>(k));
        EXPECT_EQ(checkSchedule(programs, m), "") << label(s, k, m);
      }
    }
  }
}

TEST(PipelineSchedule, MicroBatchesInFlightAreWhatTheMemoryModelAssumes) {
  for (PipelineSchedule s : kAll) {
    for (int k = 1; k <= 8; ++k) {
      for (int m = 1; m <= 32; ++m) {
        const auto programs = buildSchedule(s, k, m);
        for (int stage = 0; stage < k; ++stage) {
          const int expected = s == PipelineSchedule::kGPipe          ? m
                               : s == PipelineSchedule::kZeroBubbleH1 ? std::min(k, m)
                                                                      : std::min(k - stage, m);
          EXPECT_EQ(peakInFlight(programs[stage]), expected)
              << label(s, k, m) << " stage " << stage;
        }
      }
    }
  }
}

// Closed form: with a backward costing two forwards and free transfers, gpipe and 1f1b idle
// (K-1)/(M+K-1) of the step; zb-h1 with F = B = W idles (K-1)/(3M+K-1) (Qi et al.: each stage's
// bubble shrinks from (K-1)(F+B+W) to (K-1)(F+B-W)).
TEST(PipelineSchedule, BubbleFractionIsTheClosedForm) {
  for (int k = 1; k <= 8; ++k) {
    for (int m : {1, 2, 4, 8, 16, 32}) {
      const double oneF = static_cast<double>(k - 1) / (m + k - 1);
      for (PipelineSchedule s : {PipelineSchedule::kGPipe, PipelineSchedule::kOneFOneB}) {
        const auto sim = simulateSchedule(buildSchedule(s, k, m), {StageCosts{1.0, 1.0, 1.0}});
        EXPECT_NEAR(sim.bubbleFraction(), oneF, 1e-12) << label(s, k, m);
        EXPECT_DOUBLE_EQ(sim.makespan, 3.0 * (m + k - 1)) << label(s, k, m);
      }
      const auto zb = simulateSchedule(buildSchedule(PipelineSchedule::kZeroBubbleH1, k, m),
                                       {StageCosts{1.0, 1.0, 1.0}});
      const double third = static_cast<double>(k - 1) / (3 * m + k - 1);
      if (m >= k) {
        EXPECT_NEAR(zb.bubbleFraction(), third, 1e-12)
            << label(PipelineSchedule::kZeroBubbleH1, k, m);
      } else {
        EXPECT_LE(zb.bubbleFraction(), oneF + 1e-12)
            << label(PipelineSchedule::kZeroBubbleH1, k, m);
      }
    }
  }
}

TEST(PipelineSchedule, SimulatedTransfersDelayTheReceiver) {
  // Two stages, one micro-batch: F0 | transfer | F1 B1 | transfer | B0.
  StageCosts c{1.0, 1.0, 1.0, 0.5};
  const auto sim = simulateSchedule(buildSchedule(PipelineSchedule::kOneFOneB, 2, 1), {c});
  EXPECT_DOUBLE_EQ(sim.makespan, 1.0 + 0.5 + 1.0 + 2.0 + 0.5 + 2.0);
  ASSERT_EQ(sim.spans[1].size(), 2u);
  EXPECT_DOUBLE_EQ(sim.spans[1][0].start, 1.5);
}

// A budget per period (a cgroup's CPU quota): the stage computes at most half of each period,
// across its actions, and what is left of an action waits for the next period. One stage,
// 1f1b over two micro-batches (F0 B0 F1 B1), F = 3/8, B = 1/2 of a period (binary-exact):
// F0 [0, 3/8]; B0 1/8 then (out of budget) 3/8 from 1; F1 1/8 then 1/4 from 2; B1 1/4 then 1/4
// from 3: the step ends at 3 1/4 where it would end at 1 3/4 without the budget. With the
// periods starting half a period later, B0's second part starts at once (a new period begins as
// the budget runs out): 2 3/4.
TEST(PipelineSchedule, AStageOutOfItsBudgetWaitsForTheNextPeriod) {
  StageCosts c{0.375, 0.25, 0.25};
  const auto program = buildSchedule(PipelineSchedule::kOneFOneB, 1, 2);
  EXPECT_DOUBLE_EQ(simulateSchedule(program, {c}).makespan, 1.75);
  c.quotaPeriod = 1.0;
  c.quotaBudget = 0.5;
  const auto sim = simulateSchedule(program, {c});
  EXPECT_DOUBLE_EQ(sim.makespan, 3.25);
  EXPECT_DOUBLE_EQ(sim.busy[0], 1.75);  // what it computed, not the waits
  // Each stretch it computed: F0, B0 in two, F1 in two, B1 in two.
  const std::vector<std::pair<double, double>> stretches = {
      {0, 0.375}, {0.375, 0.5}, {1, 1.375}, {1.375, 1.5}, {2, 2.25}, {2.25, 2.5}, {3, 3.25}};
  ASSERT_EQ(sim.spans[0].size(), stretches.size());
  for (size_t i = 0; i < stretches.size(); ++i) {
    EXPECT_DOUBLE_EQ(sim.spans[0][i].start, stretches[i].first) << i;
    EXPECT_DOUBLE_EQ(sim.spans[0][i].end, stretches[i].second) << i;
  }
  c.quotaPhase = 0.5;
  EXPECT_DOUBLE_EQ(simulateSchedule(program, {c}).makespan, 2.75);
}

// Waiting for a receive spends none of the budget: stage 1 of two waits 0.75 of its first
// period for F0 and its transfer, then computes to the period's end and on from the next (were
// the wait charged, F1 would start at 1 and the step end at 3.25).
TEST(PipelineSchedule, WaitingForAReceiveSpendsNoBudget) {
  StageCosts c{0.5, 0.25, 0.25, 0.25};  // F0 [0, .5], transfer .25: F1 from .75
  c.quotaPeriod = 1.0;
  c.quotaBudget = 0.5;
  const auto sim = simulateSchedule(buildSchedule(PipelineSchedule::kOneFOneB, 2, 1), {c});
  // Stage 1: F1 .25 in [.75, 1] and .25 from 1; B1 from 1.25 to 1.5 (the budget's end), then
  // .25 from 2: 2.25; stage 0 gets the gradient at 2.5, B0 (.5, a new period's whole budget) 3.
  ASSERT_GE(sim.spans[1].size(), 2u);
  EXPECT_DOUBLE_EQ(sim.spans[1][0].start, 0.75);
  EXPECT_DOUBLE_EQ(sim.spans[1][0].end, 1.0);
  EXPECT_DOUBLE_EQ(sim.spans[1][1].start, 1.0);
  EXPECT_DOUBLE_EQ(sim.makespan, 3.0);
}

// The check is only worth something if it fails on broken schedules: each of these breaks one
// rule of a valid 1f1b or zb-h1 schedule.
TEST(PipelineSchedule, CheckNamesEachBrokenRule) {
  auto valid = [] { return buildSchedule(PipelineSchedule::kOneFOneB, 3, 4); };
  auto find = [](StageProgram& p, ActionKind k, int m) {
    return std::find(p.begin(), p.end(), Action{k, m});
  };
  {  // receives in another order than the sends
    auto p = valid();
    auto a = find(p[1], ActionKind::kRecvActivation, 0),
         b = find(p[1], ActionKind::kRecvActivation, 1);
    std::swap(a->microBatch, b->microBatch);
    std::swap(find(p[1], ActionKind::kForward, 0)->microBatch,
              find(p[1], ActionKind::kForward, 1)->microBatch);
    EXPECT_NE(checkSchedule(p, 4), "");
  }
  {  // a send dropped: the receiver waits forever
    auto p = valid();
    p[0].erase(find(p[0], ActionKind::kSendActivation, 3));
    EXPECT_NE(checkSchedule(p, 4), "");
  }
  {  // backward before forward
    auto p = valid();
    auto f = find(p[2], ActionKind::kForward, 0), b = find(p[2], ActionKind::kBackward, 0);
    std::iter_swap(f, b);
    EXPECT_NE(checkSchedule(p, 4), "");
  }
  {  // a micro-batch forwarded twice
    auto p = valid();
    p[0].push_back({ActionKind::kForward, 0});
    EXPECT_NE(checkSchedule(p, 4), "");
  }
  {  // receives ordered so that two stages wait on each other: stage 1 wants micro-batch 1's
     // gradient before it forwards micro-batch 1 to stage 2
    auto p = valid();
    auto rg = find(p[1], ActionKind::kRecvGradient, 0);
    const Action moved = *rg;
    p[1].erase(rg);
    p[1].insert(p[1].begin(), moved);
    EXPECT_NE(checkSchedule(p, 4), "");
  }
  {  // a whole backward and a W for the same micro-batch
    auto p = valid();
    p[0].push_back({ActionKind::kBackwardWeight, 0});
    EXPECT_NE(checkSchedule(p, 4), "");
  }
  {  // the sends of stage 0 reordered with its forwards: every local rule holds, but stage 1
     // receives micro-batch 0 first and the other end sent 1 first
    auto p = buildSchedule(PipelineSchedule::kGPipe, 2, 2);
    // stage 0: F0 send0 F1 send1 ...  ->  F0 F1 send1 send0
    auto s0 = find(p[0], ActionKind::kSendActivation, 0);
    const Action send0 = *s0;
    p[0].erase(s0);
    p[0].insert(find(p[0], ActionKind::kSendActivation, 1) + 1, send0);
    const std::string why = checkSchedule(p, 2);
    EXPECT_NE(why.find("the other end sent micro-batch 1 first"), std::string::npos) << why;
  }
  {  // zb-h1: W before its B
    auto p = buildSchedule(PipelineSchedule::kZeroBubbleH1, 2, 4);
    auto bi = find(p[0], ActionKind::kBackwardInput, 2),
         w = find(p[0], ActionKind::kBackwardWeight, 2);
    std::iter_swap(bi, w);
    EXPECT_NE(checkSchedule(p, 4), "");
  }
  {  // weight gradients out of micro-batch order (accumulation order differs from one worker)
    auto p = buildSchedule(PipelineSchedule::kGPipe, 2, 4);
    std::swap(find(p[0], ActionKind::kBackward, 1)->microBatch,
              find(p[0], ActionKind::kBackward, 2)->microBatch);
    std::swap(find(p[0], ActionKind::kRecvGradient, 1)->microBatch,
              find(p[0], ActionKind::kRecvGradient, 2)->microBatch);
    EXPECT_NE(checkSchedule(p, 4), "");
  }
}

TEST(PipelineSchedule, NamesParseAndBadOnesAreRefused) {
  for (PipelineSchedule s : kAll) EXPECT_EQ(parsePipelineSchedule(pipelineScheduleName(s)), s);
  EXPECT_THROW(parsePipelineSchedule("interleaved"), ConfigError);
  EXPECT_THROW(buildSchedule(PipelineSchedule::kGPipe, 0, 4), ConfigError);
  EXPECT_THROW(buildSchedule(PipelineSchedule::kGPipe, 2, 0), ConfigError);
}

// ---- one step of a pipeline against one worker accumulating gradients ---------------------------

struct ModelCase {
  ModelSpec spec;
  DataShape shape;
  std::function<BlockModel()> build;       // instead of buildModel(spec, shape) when set
  std::vector<size_t> reusedWeightBlocks;  // blocks applying a weight twice (zb-h1's W falls
                                           // back to a backward on their stage)
};

// A linear layer applied twice in one block: its weight hangs off the input's path at two
// depths, where zb-h1's weight-only W would count the deeper use twice (it falls back).
struct TwiceImpl : torch::nn::Module {
  torch::nn::Linear l{nullptr};
  explicit TwiceImpl(int64_t n) : l(register_module("l", torch::nn::Linear(n, n))) {}
  torch::Tensor forward(torch::Tensor x) { return l(torch::tanh(l(x))); }
};
TORCH_MODULE(Twice);

struct FlattenLinearImpl : torch::nn::Module {
  torch::nn::Linear l{nullptr};
  FlattenLinearImpl(int64_t in, int64_t out)
      : l(register_module("l", torch::nn::Linear(in, out))) {}
  torch::Tensor forward(torch::Tensor x) { return l(x.flatten(1)); }
};
TORCH_MODULE(FlattenLinear);

ModelCase sharedWeightSetup() {  // 4 blocks: flatten+linear, twice, twice, head
  ModelCase s;
  s.spec.name = "twice";
  s.shape.height = s.shape.width = 4;
  s.reusedWeightBlocks = {1, 2};
  s.build = [] {
    BlockModel m("twice", TaskKind::kImageClassification);
    m->addBlock("in", FlattenLinear(16, 8));
    m->addBlock("twice1", Twice(8));
    m->addBlock("twice2", Twice(8));
    m->addBlock("head", torch::nn::Linear(8, 10));
    return m;
  };
  return s;
}

ModelCase gptSetup() {  // embedding, 4 transformer blocks, head: 6 blocks; integer inputs
  ModelCase s;
  s.spec.name = "gpt";
  s.spec.width = 16;
  s.spec.depth = 4;
  s.spec.heads = 2;
  s.shape.task = TaskKind::kLanguageModel;
  s.shape.vocabSize = 23;
  s.shape.seqLen = 8;
  return s;
}

ModelCase cnnSetup() {  // 3 blocks; float image inputs
  ModelCase s;
  s.spec.name = "cnn";
  s.spec.width = 4;
  s.shape.height = s.shape.width = 12;
  return s;
}

std::vector<Batch> batches(const ModelCase& s, int count, int64_t size) {
  torch::manual_seed(77);
  std::vector<Batch> out;
  for (int i = 0; i < count; ++i) {
    if (s.shape.task == TaskKind::kLanguageModel) {
      at::Tensor t = torch::randint(s.shape.vocabSize, {size, s.shape.seqLen + 1}, at::kLong);
      out.push_back({t.slice(1, 0, -1).contiguous(), t.slice(1, 1).contiguous()});
    } else {
      out.push_back({torch::randn({size, 1, s.shape.height, s.shape.width}),
                     torch::randint(10, {size}, at::kLong)});
    }
  }
  return out;
}

BlockModel freshModel(const ModelCase& s) {
  torch::manual_seed(5);
  return s.build ? s.build() : buildModel(s.spec, s.shape);
}

// AdamW is nearly blind to a uniform scale of the gradients (a lost 1/M shows only through
// eps); plain SGD is not. The first test runs both.
bool useSgd = false;
std::unique_ptr<torch::optim::Optimizer> testOptimizer(const std::vector<at::Tensor>& params) {
  if (useSgd) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05));
  return std::make_unique<torch::optim::AdamW>(params,
                                               torch::optim::AdamWOptions(0.01).weight_decay(0.01));
}

// One worker: per step, M micro-batches each adding the gradient of loss / M, then AdamW.
// Returns the final parameters in block order and the per-step losses.
std::pair<std::vector<at::Tensor>, std::vector<double>> accumulateOnOneWorker(
    const ModelCase& s, const std::vector<Batch>& data, int m) {
  BlockModel model = freshModel(s);
  auto opt = testOptimizer(model->parameters());
  std::vector<double> losses;
  for (const Batch& b : data) {
    opt->zero_grad();
    const auto xs = b.input.split(b.size() / m), ys = b.target.split(b.size() / m);
    double loss = 0.0;
    for (int i = 0; i < m; ++i) {
      at::Tensor l = model->loss(model->forward(xs[i]), ys[i]) / static_cast<double>(m);
      loss += l.item<double>();
      l.backward();
    }
    opt->step();
    losses.push_back(loss);
  }
  std::vector<at::Tensor> params;
  for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
  return {params, losses};
}

// K stages as threads over Gloo: each rank updates its own blocks' parameters with AdamW.
std::pair<std::vector<at::Tensor>, std::vector<double>> trainPipeline(
    const ModelCase& s, const std::vector<Batch>& data, PipelineSchedule schedule, int k, int m) {
  std::vector<BlockModel> models;
  for (int r = 0; r < k; ++r) models.push_back(freshModel(s));
  const auto bounds = evenPartition(models[0]->numBlocks(), k);
  std::vector<std::vector<at::Tensor>> stageParams(k);
  std::vector<std::map<std::string, at::Tensor>> held(k);  // by registered name
  std::vector<double> losses(data.size(), 0.0);
  const auto errors = test::runGlooRanks(
      k, test::loopbackOptions(std::chrono::seconds(60)), [&](std::shared_ptr<Communicator> comm) {
        const int r = comm->rank();
        PipelineStage stage(models[r], bounds, comm.get(), PipelineLayout::of(r, k, k), schedule,
                            m);
        auto opt = testOptimizer(stage.parameters());
        for (size_t i = 0; i < data.size(); ++i) {
          opt->zero_grad();
          const StageStepStats st = stage.runStep(data[i]);
          stage.sumTiedGradients();
          // zb-h1's W computes only weight gradients on every stage that has an input to
          // differentiate (stage 0 runs a backward to its weights).
          if (schedule == PipelineSchedule::kZeroBubbleH1) {
            bool reused = false;
            for (size_t b : s.reusedWeightBlocks) {
              reused = reused || (b >= stage.firstBlock() && b < stage.endBlock());
            }
            EXPECT_EQ(st.weightOnlyPasses, r == 0 || reused ? 0 : m) << "stage " << r;
          }
          if (stage.layout().last()) losses[i] = st.loss;
          opt->step();
        }
        // A tied parameter once, from the first of its stages; the others' copies must be it.
        for (const auto& p : stage.normParameters()) stageParams[r].push_back(p.detach().clone());
        for (const auto& p : stage.parameters()) {
          for (const auto& named : models[r]->named_parameters()) {
            if (named.value().is_same(p)) held[r][named.key()] = p.detach().clone();
          }
        }
      });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  // Every stage that holds a tied parameter holds the same bits (updated from the same sum).
  for (int r = 1; r < k; ++r) {
    for (const auto& [name, t] : held[r]) {
      for (int q = 0; q < r; ++q) {
        if (held[q].count(name) > 0) EXPECT_TRUE(at::equal(held[q].at(name), t)) << name;
      }
    }
  }
  std::vector<at::Tensor> params;
  for (const auto& sp : stageParams) params.insert(params.end(), sp.begin(), sp.end());
  return {params, losses};
}

double relativeDifference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    num += (a[i] - b[i]).pow(2).sum().item<double>();
    den += b[i].pow(2).sum().item<double>();
  }
  return std::sqrt(num / den);
}

TEST(PipelineExactness, EveryScheduleEqualsOneWorkerAccumulatingTheMicroBatches) {
  torch::set_num_threads(1);
  double worst = 0.0;
  for (bool sgd : {false, true}) {
    useSgd = sgd;
    for (const ModelCase& s : {gptSetup(), cnnSetup(), sharedWeightSetup()}) {
      const auto data = batches(s, 5, 8);
      for (int m : {1, 4}) {
        const auto [expected, expectedLoss] = accumulateOnOneWorker(s, data, m);
        for (int k : {2, 3}) {
          for (PipelineSchedule schedule : kAll) {
            const std::string what = s.spec.name + " " + label(schedule, k, m);
            const auto [got, loss] = trainPipeline(s, data, schedule, k, m);
            const double diff = relativeDifference(got, expected);
            worst = std::max(worst, diff);
            EXPECT_LE(diff, 1e-6) << what << (sgd ? " sgd" : " adamw");
            for (size_t i = 0; i < loss.size(); ++i) {
              EXPECT_NEAR(loss[i], expectedLoss[i], 1e-6 * std::abs(expectedLoss[i]))
                  << what << " step " << i;
            }
          }
        }
      }
    }
  }
  useSgd = false;
  std::printf(
      "every schedule, K = 2, 3, M = 1, 4, GPT and CNN, AdamW and SGD, 5 steps: largest "
      "relative difference to one worker %.3g\n",
      worst);
}

// A user's module cut into blocks from its graph (models/graph_cut.h), each stage loading its
// own copy of the file: a scripted CNN (features, flat, head; BatchNorm in its features) and
// Hugging Face's ViT through caravan export (prologue, its 6 layers, epilogue; without
// transformers only the CNN). Every schedule, 2 stages, 4 micro-batches, 3 AdamW steps (the
// later ones update from the optimizer state): one worker's result.
TEST(PipelineExactness, ModelsCutFromTheirGraphEqualOneWorker) {
  torch::set_num_threads(1);
  const std::string scripted = test::scriptedModelsDir();
  ASSERT_FALSE(scripted.empty()) << "tests/python/script_models.py failed (scripts/setup.sh)";
  // (name, file). Hugging Face's ViT, Llama (its rotary tables, mask and lengths go from stage
  // to stage in the context, beside the hidden state), GPT-2, and nanoGPT's form (its own loss).
  auto files = test::exportStockModels({"vit", "resnet", "mobilenet", "llama", "gpt2", "nanogpt"});
  files.insert(files.begin(), {"cnn", scripted + "/cnn.pt"});
  for (const auto& entry : files) {
    const std::string& name = entry.first;
    const std::string& file = entry.second;
    ModelCase s;
    s.spec.name = kScriptModelName;
    s.spec.path = file;
    // stock_models.py's language models: tokens of a vocabulary of 64. GPT-2's and nanoGPT's
    // heads are tied to their embeddings: the tie spans the first and the last stage.
    if (name == "llama" || name == "gpt2" || name == "nanogpt") {
      s.shape.task = TaskKind::kLanguageModel;
      s.shape.vocabSize = 64;
      s.shape.seqLen = 16;
    }
    s.build = [s] { return loadScriptModel(s.spec, s.shape); };
    ASSERT_GE(s.build()->numBlocks(), 3u) << name;
    const auto data = batches(s, 3, 8);
    const auto [expected, expectedLoss] = accumulateOnOneWorker(s, data, 4);
    for (PipelineSchedule schedule : kAll) {
      const auto [got, loss] = trainPipeline(s, data, schedule, 2, 4);
      const double diff = relativeDifference(got, expected);
      double lossDiff = 0.0;
      for (size_t i = 0; i < loss.size(); ++i) {
        lossDiff =
            std::max(lossDiff, std::abs(loss[i] - expectedLoss[i]) / std::abs(expectedLoss[i]));
      }
      // A head tied to the embedding across the stages: each stage adds its use's gradients
      // over the micro-batches and the stages then add the two sums, where one worker adds
      // both uses per micro-batch; rounded apart, and AdamW's steps make the parameters' 1e-7
      // larger (measured over 3 steps: GPT-2's parameters 1.4e-6 apart, its losses equal;
      // nanoGPT's 7.6e-8 and 2.9e-8). Untied models: the same bits.
      const bool tiedAcross = name == "gpt2" || name == "nanogpt";
      EXPECT_LE(diff, tiedAcross ? 1e-5 : 1e-6) << name << " " << label(schedule, 2, 4);
      EXPECT_LE(lossDiff, 1e-6) << name << " " << label(schedule, 2, 4);
      std::printf("%s %s: relative difference to one worker %.3g, losses %.3g\n", name.c_str(),
                  label(schedule, 2, 4).c_str(), diff, lossDiff);
    }
  }
}

TEST(PipelineExactness, FourStagesOfTheGpt) {
  torch::set_num_threads(1);
  const ModelCase s = gptSetup();
  const auto data = batches(s, 20, 8);
  const auto [expected, expectedLoss] = accumulateOnOneWorker(s, data, 8);
  for (PipelineSchedule schedule : kAll) {
    const auto [got, loss] = trainPipeline(s, data, schedule, 4, 8);
    EXPECT_LE(relativeDifference(got, expected), 1e-6) << label(schedule, 4, 8);
    EXPECT_NEAR(loss.back(), expectedLoss.back(), 1e-6 * std::abs(expectedLoss.back()));
  }
}

// ---- what a stage holds ----------------------------------------------------------------------

int64_t heldElements(BlockModel& model) {
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  return n;
}

// After holdOwnStageOnly a rank's model holds its stage's parameters only; gatherParameters
// brings rank 0 every stage's trained values (equal to what the stages hold) and holdOwnStageOnly
// drops them again; forwardOnly's last-stage output is one worker's forward of the same model.
TEST(PipelineMemory, AStageHoldsItsOwnParametersAndRankZeroGathersTheWholeModel) {
  torch::set_num_threads(1);
  const ModelCase s = gptSetup();
  const int k = 3;
  const auto data = batches(s, 3, 6);
  std::vector<BlockModel> models;
  for (int r = 0; r < k; ++r) models.push_back(freshModel(s));
  const int64_t whole = heldElements(models[0]);
  const auto bounds = evenPartition(models[0]->numBlocks(), k);
  std::vector<std::vector<at::Tensor>> trained(k);
  std::vector<int64_t> own(k), held(k);
  std::vector<at::Tensor> gathered;
  at::Tensor pipelineOutput;
  const auto errors = test::runGlooRanks(
      k, test::loopbackOptions(std::chrono::seconds(60)), [&](std::shared_ptr<Communicator> comm) {
        const int r = comm->rank();
        PipelineStage stage(models[r], bounds, comm.get(), PipelineLayout::of(r, k, k),
                            PipelineSchedule::kOneFOneB, 3);
        auto opt = testOptimizer(models[r]->parameters());
        stage.holdOwnStageOnly(*opt);
        for (const auto& p : stage.parameters()) own[r] += p.numel();
        held[r] = heldElements(models[r]);
        for (const Batch& b : data) {
          opt->zero_grad();
          stage.runStep(b);
          opt->step();
        }
        for (const auto& p : stage.parameters()) trained[r].push_back(p.detach().clone());
        stage.gatherParameters();
        if (r == 0) {
          for (const auto& p : models[r]->parameters()) gathered.push_back(p.detach().clone());
        }
        stage.holdOwnStageOnly(*opt);
        EXPECT_EQ(heldElements(models[r]), own[r]) << "rank " << r << " after a gather";
        models[r]->eval();
        at::Tensor y = stage.forwardOnly(data[0].input);
        if (r == k - 1) pipelineOutput = y;
        EXPECT_EQ(y.defined(), r == k - 1);
      });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  int64_t sum = 0;
  for (int r = 0; r < k; ++r) {
    EXPECT_EQ(held[r], own[r]) << "rank " << r;
    EXPECT_LT(own[r], whole);
    sum += own[r];
  }
  EXPECT_EQ(sum, whole);
  std::vector<at::Tensor> expected;
  for (const auto& t : trained) expected.insert(expected.end(), t.begin(), t.end());
  ASSERT_EQ(gathered.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_TRUE(gathered[i].equal(expected[i])) << i;
  // The gathered model on one worker: its forward is the pipeline's, bitwise.
  BlockModel one = freshModel(s);
  {
    torch::NoGradGuard noGrad;
    const auto ps = one->parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(gathered[i]);
  }
  one->eval();
  torch::NoGradGuard noGrad;
  ASSERT_TRUE(pipelineOutput.defined());
  EXPECT_TRUE(one->forward(data[0].input).equal(pipelineOutput));
}

// A weight that blocks of two stages read is held by both, which train it on the sum of their
// gradients (PipelineStage::sumTiedGradients): one worker's training, and the same bits on both
// stages. A scripted module whose third layer uses its first's Linear (todays_models.py's
// TiedLayers: prologue, 3 layers, epilogue; blocks 1 and 3 on stages 0 and 1). The stock language
// models whose head is tied to the embedding are in ModelsCutFromTheirGraphEqualOneWorker.
TEST(PipelineExactness, AWeightTiedAcrossStagesEqualsOneWorker) {
  torch::set_num_threads(1);
  const std::string dir = test::pythonWrittenDir("todays_models.py");
  ASSERT_FALSE(dir.empty()) << "tests/python/todays_models.py failed (scripts/setup.sh)";
  ModelCase layers;
  layers.spec.name = kScriptModelName;
  layers.spec.path = dir + "/tied-layers.pt";
  layers.build = [layers] { return loadScriptModel(layers.spec, layers.shape); };
  ASSERT_EQ(layers.build()->sharedUses().size(), 2u);
  const auto data = batches(layers, 10, 8);
  const auto [expected, expectedLoss] = accumulateOnOneWorker(layers, data, 4);
  for (PipelineSchedule schedule : kAll) {
    const auto [got, loss] = trainPipeline(layers, data, schedule, 2, 4);
    const double diff = relativeDifference(got, expected);
    EXPECT_LE(diff, 1e-6) << label(schedule, 2, 4);
    EXPECT_NEAR(loss.back(), expectedLoss.back(), 1e-6 * std::abs(expectedLoss.back()));
    std::printf("TiedLayers %s: relative difference to one worker %.3g\n",
                label(schedule, 2, 4).c_str(), diff);
  }
}

// ---- the partition into stages (pipeline/partition.h), on hand-made block costs ------------

std::vector<BlockCost> costs(const std::vector<double>& seconds,
                             const std::vector<int64_t>& activations,
                             const std::vector<int64_t>& state) {
  std::vector<BlockCost> out;
  for (size_t i = 0; i < seconds.size(); ++i) {
    out.push_back({"b" + std::to_string(i), seconds[i] / 3, 2 * seconds[i] / 3, activations[i],
                   state[i], state[i] / 4});
  }
  return out;
}

// Brute force over every contiguous cut: the oracle for the dynamic program.
double bestPeriod(const std::vector<BlockCost>& b, int k,
                  const std::function<bool(std::vector<size_t>)>& ok) {
  double best = 1e300;
  const size_t n = b.size();
  std::vector<size_t> cut(k + 1, 0);
  cut[k] = n;
  std::function<void(int, size_t)> go = [&](int s, size_t from) {
    if (s == k) {
      if (!ok(cut)) return;
      double worst = 0;
      for (int i = 0; i < k; ++i) {
        double t = 0;
        for (size_t j = cut[i]; j < cut[i + 1]; ++j)
          t += b[j].forwardSeconds + b[j].backwardSeconds;
        worst = std::max(worst, t);
      }
      best = std::min(best, worst);
      return;
    }
    for (size_t c = from + 1; c + (k - s) <= n; ++c) {
      cut[s] = c;
      go(s + 1, c);
    }
  };
  go(1, 0);
  return best;
}

TEST(PipelinePartition, TimeOnlyIsTheBruteForceOptimum) {
  const auto b =
      costs({3, 1, 4, 1, 5, 9, 2, 6}, std::vector<int64_t>(8, 1), std::vector<int64_t>(8, 1));
  for (int k = 1; k <= 8; ++k) {
    const Partition p =
        partitionBlocks(b, k, 8, PipelineSchedule::kOneFOneB, 0, PartitionObjective::kTimeOnly);
    EXPECT_NEAR(p.periodSeconds, bestPeriod(b, k, [](auto) { return true; }), 1e-12) << k;
    EXPECT_TRUE(p.fits);
  }
}

// A GPT-like model whose first block (embedding) and last (head) are heavy in memory but light
// in time: 1f1b keeps K - s micro-batches on stage s, so the time-only partition puts the most
// memory where the most is in flight; the joint partition fits a budget it cannot.
TEST(PipelinePartition, TimeAndMemoryFitsABudgetTheOthersDoNot) {
  const auto b = costs({1, 4, 4, 4, 4, 4, 4, 2}, {40, 10, 10, 10, 10, 10, 10, 30},
                       {100, 20, 20, 20, 20, 20, 20, 100});
  const int k = 4, m = 8;
  const Partition time =
      partitionBlocks(b, k, m, PipelineSchedule::kOneFOneB, 0, PartitionObjective::kTimeOnly);
  const Partition params =
      partitionBlocks(b, k, m, PipelineSchedule::kOneFOneB, 0, PartitionObjective::kParameters);
  int64_t worstOther = 0;
  for (const auto* p : {&time, &params}) {
    for (const auto& s : p->stages) worstOther = std::max(worstOther, s.memoryBytes);
  }
  const int64_t budget = worstOther - 1;  // neither fits it
  const Partition joint = partitionBlocks(b, k, m, PipelineSchedule::kOneFOneB, budget,
                                          PartitionObjective::kTimeAndMemory);
  ASSERT_TRUE(joint.fits) << formatPartition(b, joint, budget);
  // Stage memory: state + (K - s) micro-batches of activations (closed form).
  for (int s = 0; s < k; ++s) {
    int64_t mem = 0, act = 0;
    for (size_t i = joint.stages[s].begin; i < joint.stages[s].end; ++i) {
      mem += b[i].stateBytes;
      act += b[i].activationBytes;
    }
    EXPECT_EQ(joint.stages[s].memoryBytes, mem + (k - s) * act);
    EXPECT_LE(joint.stages[s].memoryBytes, budget);
  }
  EXPECT_NEAR(joint.periodSeconds,
              bestPeriod(b, k,
                         [&](std::vector<size_t> cut) {
                           for (int s = 0; s < k; ++s) {
                             int64_t mem = 0;
                             for (size_t i = cut[s]; i < cut[s + 1]; ++i) {
                               mem += b[i].stateBytes + (k - s) * b[i].activationBytes;
                             }
                             if (mem > budget) return false;
                           }
                           return true;
                         }),
              1e-12);
  // Too small for anything: not fitting, and the smallest budget named is one that does fit.
  const Partition none =
      partitionBlocks(b, k, m, PipelineSchedule::kOneFOneB, 10, PartitionObjective::kTimeAndMemory);
  EXPECT_FALSE(none.fits);
  EXPECT_TRUE(partitionBlocks(b, k, m, PipelineSchedule::kOneFOneB, none.smallestBudget,
                              PartitionObjective::kTimeAndMemory)
                  .fits);
  EXPECT_FALSE(partitionBlocks(b, k, m, PipelineSchedule::kOneFOneB, none.smallestBudget - 1,
                               PartitionObjective::kTimeAndMemory)
                   .fits);
}

// memory.policy = auto with stages: a stage that does not fit recomputes blocks; worked by
// hand. Four blocks (forward 1 s, backward 2 s, 100 bytes kept, 10 bytes of input, 10 bytes of
// state), K = 2, 1f1b over 4 micro-batches (2 in flight on stage 0, 1 on stage 1), budget 300.
// A stage needs its state + (in flight - 1) x what a micro-batch keeps + the most the micro-batch
// in backward holds (all it keeps, or, while recomputed block i is rebuilt, what the blocks
// before i keep + i's input + its 100). Keeping, the leanest cut (1|3) needs 330. Cut 2|2 with
// stage 0 recomputing block 0: 20 + 110 + max(110, 0 + 10 + 100) = 240, in 6 + 1 = 7 s per
// micro-batch; stage 1 keeps 20 + 200 = 220 in 6 s. Cut 1|3 would recompute block 1 (10 s),
// cut 3|1 blocks 0 and 1 (11 s).
std::vector<BlockCost> b4() {
  std::vector<BlockCost> b;
  for (int i = 0; i < 4; ++i) b.push_back({"b" + std::to_string(i), 1.0, 2.0, 100, 10, 10, 10});
  return b;
}

TEST(PipelinePartition, RecomputingFitsABudgetKeepingCannotAtTheLeastTime) {
  const std::vector<BlockCost> b = b4();
  const auto keep = partitionBlocks(b, 2, 4, PipelineSchedule::kOneFOneB, 300,
                                    PartitionObjective::kTimeAndMemory);
  EXPECT_FALSE(keep.fits);
  EXPECT_EQ(keep.smallestBudget, 330);
  const auto p = partitionBlocks(b, 2, 4, PipelineSchedule::kOneFOneB, 300,
                                 PartitionObjective::kTimeAndMemory, /*recompute=*/true);
  ASSERT_TRUE(p.fits);
  EXPECT_EQ(p.boundaries, (std::vector<size_t>{0, 2, 4}));
  EXPECT_EQ(p.stages[0].recomputed, (std::vector<size_t>{0}));
  EXPECT_EQ(p.stages[0].memoryBytes, 240);
  EXPECT_DOUBLE_EQ(p.stages[0].recomputeSeconds, 1.0);
  EXPECT_TRUE(p.stages[1].recomputed.empty());
  EXPECT_EQ(p.stages[1].memoryBytes, 220);
  EXPECT_DOUBLE_EQ(p.periodSeconds, 7.0);
  // The least any cut needs: 1|3 with stage 0 recomputing block 0 (10 + 10 + 110 = 130) and
  // stage 1 blocks 1 and 2 (30 + max(120, 10 + 10 + 100) = 150; recomputing block 3 as well
  // would need 160). That budget fits, one byte less does not.
  EXPECT_EQ(p.smallestBudget, 150);
  EXPECT_TRUE(partitionBlocks(b, 2, 4, PipelineSchedule::kOneFOneB, 150,
                              PartitionObjective::kTimeAndMemory, true)
                  .fits);
  EXPECT_FALSE(partitionBlocks(b, 2, 4, PipelineSchedule::kOneFOneB, 149,
                               PartitionObjective::kTimeAndMemory, true)
                   .fits);
  // Under a budget every stage keeps in, nothing recomputes.
  const auto roomy = partitionBlocks(b, 2, 4, PipelineSchedule::kOneFOneB, 1000,
                                     PartitionObjective::kTimeAndMemory, true);
  for (const auto& st : roomy.stages) EXPECT_TRUE(st.recomputed.empty());
}

// parallel.partition as split points: the blocks at which stages 1..K-1 start.
TEST(PipelinePartition, GivenSplitPointsAreTheCutAndBadOnesAreRefusedInOneLine) {
  const PartitionChoice c = parsePartition("3,6");
  EXPECT_EQ(c.objective, PartitionObjective::kGiven);
  EXPECT_EQ(c.splits, (std::vector<size_t>{3, 6}));
  EXPECT_EQ(parsePartition("time").objective, PartitionObjective::kTimeOnly);
  EXPECT_EQ(givenPartition({3, 6}, 8, 3), (std::vector<size_t>{0, 3, 6, 8}));
  for (const char* bad : {"3,,6", "a", "-1", "3,", ",3", "1e3", "3 6", "", "1234567890"}) {
    EXPECT_THROW(parsePartition(bad), ConfigError) << bad;
  }
  for (const std::vector<size_t>& bad :
       std::vector<std::vector<size_t>>{{6, 3}, {3}, {3, 8}, {0, 3}, {3, 3}, {2, 4, 6}}) {
    try {
      givenPartition(bad, 8, 3);
      ADD_FAILURE() << "accepted " << bad.size() << " split points";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("give 2 increasing block indices between 1 and 7"),
                std::string::npos)
          << e.what();
    }
  }
  // The given cut is evaluated like the others (memory and time per stage).
  std::vector<BlockCost> b;
  for (int i = 0; i < 8; ++i) b.push_back({"b" + std::to_string(i), 1.0, 2.0, 100, 10, 10, 10});
  const auto p = partitionBlocks(b, 3, 4, PipelineSchedule::kOneFOneB, 0,
                                 PartitionObjective::kGiven, false, givenPartition({1, 2}, 8, 3));
  EXPECT_EQ(p.boundaries, (std::vector<size_t>{0, 1, 2, 8}));
  EXPECT_DOUBLE_EQ(p.periodSeconds, 18.0);           // the last stage's six blocks
  EXPECT_EQ(p.stages[0].memoryBytes, 10 + 3 * 100);  // 3 micro-batches in flight on stage 0
  EXPECT_EQ(parsePartition("1, 2").splits, (std::vector<size_t>{1, 2}));
  EXPECT_EQ(parsePartition(" 1 ,  2 ").splits, (std::vector<size_t>{1, 2}));
  EXPECT_THROW(givenPartition({3}, 8, 1), ConfigError);

  // A given cut that does not fit names the least it needs itself, each stage at its least.
  // RecomputingFitsABudget...'s blocks, cut 1|3 under 140: stage 1's search needs 330, 240, 150
  // (blocks 1 and 2 recomputed), then 160 (all three): it stops at 150.
  const auto tight = partitionBlocks(b4(), 2, 4, PipelineSchedule::kOneFOneB, 140,
                                     PartitionObjective::kGiven, true, givenPartition({1}, 4, 2));
  EXPECT_FALSE(tight.fits);
  EXPECT_EQ(tight.smallestBudget, 150);
  EXPECT_EQ(tight.stages[1].memoryBytes, 150);
  EXPECT_EQ(tight.stages[1].recomputed, (std::vector<size_t>{1, 2}));
  EXPECT_DOUBLE_EQ(tight.stages[1].recomputeSeconds, 2.0);
}

TEST(PipelineLayout, RanksAreStagesOfReplicasAndPartitionsCoverEveryBlock) {
  const auto l = PipelineLayout::of(5, 6, 3);
  EXPECT_EQ(l.stage, 2);
  EXPECT_EQ(l.replica, 1);
  EXPECT_EQ(l.replicas, 2);
  EXPECT_TRUE(l.last());
  EXPECT_THROW(PipelineLayout::of(0, 5, 2), ConfigError);
  EXPECT_EQ(evenPartition(6, 4), (std::vector<size_t>{0, 2, 4, 5, 6}));
  EXPECT_EQ(evenPartition(3, 3), (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_THROW(evenPartition(3, 4), ConfigError);
}

}  // namespace
}  // namespace caravan
