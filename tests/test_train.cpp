// Schedules, checkpoints (format, atomicity, corruption) and exact resume of the trainer.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/config.h"
#include "core/errors.h"
#include "models/precision.h"
#include "run_util.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/data_parallel_step.h"
#include "train/metrics.h"
#include "train/precision.h"
#include "train/run_options.h"
#include "train/run_setup.h"
#include "train/schedule.h"
#include "train/setup.h"
#include "train/step.h"
#include "train/trainer.h"

using namespace caravan;
using caravan::test::finalWeights;
using caravan::test::TempDir;
using caravan::test::trainLosses;
namespace fs = std::filesystem;

TEST(Schedule, WarmupThenConstantStepCosine) {
  ScheduleOptions o;
  o.peakLr = 0.1;
  o.warmupSteps = 4;
  o.totalSteps = 104;
  EXPECT_DOUBLE_EQ(learningRate(o, 0), 0.025);
  EXPECT_DOUBLE_EQ(learningRate(o, 3), 0.1);
  EXPECT_DOUBLE_EQ(learningRate(o, 50), 0.1);
  o.kind = "step";
  o.stepSize = 10;
  o.gamma = 0.5;
  EXPECT_DOUBLE_EQ(learningRate(o, 4), 0.1);
  EXPECT_DOUBLE_EQ(learningRate(o, 13), 0.1);
  EXPECT_DOUBLE_EQ(learningRate(o, 14), 0.05);
  EXPECT_DOUBLE_EQ(learningRate(o, 34), 0.0125);
  o.kind = "cosine";
  o.minLr = 0.01;
  EXPECT_DOUBLE_EQ(learningRate(o, 4), 0.1);
  EXPECT_NEAR(learningRate(o, 54), 0.01 + 0.09 * 0.5, 1e-12);
  EXPECT_NEAR(learningRate(o, 104), 0.01, 1e-12);
}

TEST(Schedule, ATimeHorizonCountsTrainingSecondsAgainstTheBudget) {
  ScheduleOptions o;
  o.kind = "cosine";
  o.peakLr = 0.1;
  o.minLr = 0.01;
  o.warmupSteps = 4;
  o.totalSteps = 104;  // not read by a time horizon
  o.horizon = "time";
  o.budgetSeconds = 600;
  EXPECT_DOUBLE_EQ(learningRate(o, 0, 500.0), 0.025);  // warm-up counts steps
  EXPECT_DOUBLE_EQ(learningRate(o, 4, 0.0), 0.1);
  EXPECT_NEAR(learningRate(o, 5, 300.0), 0.01 + 0.09 * 0.5, 1e-12);
  EXPECT_NEAR(learningRate(o, 6, 150.0), 0.01 + 0.09 * 0.5 * (1 + std::cos(M_PI / 4)), 1e-12);
  EXPECT_NEAR(learningRate(o, 1000, 600.0), 0.01, 1e-12);
  EXPECT_NEAR(learningRate(o, 7, 900.0), 0.01, 1e-12);  // past the budget: the final rate
}

TEST(Schedule, ATimeHorizonNeedsABudgetAndACosine) {
  auto refused = [](const std::vector<std::string>& sets, const std::string& needle) {
    try {
      validate(RunOptions::read(Config::fromString("", "<test>", sets)), 1);
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused({"schedule.kind=cosine", "schedule.horizon=time"},
          "set it (e.g. --set train.max_minutes");
  refused({"schedule.kind=step", "schedule.horizon=time", "train.max_minutes=5"},
          "use schedule.kind = cosine with schedule.horizon = time");
}

// Under ps-diloco the run's optimizer steps on the workers (the servers take only the outer
// step), so clipping and skipping non-finite steps work as among workers; the modes whose
// servers run the optimizer still refuse both.
TEST(RunOptionsCheck, PsDilocoClipsAndSkipsOnTheWorkers) {
  auto read = [](const std::string& mode) {
    return RunOptions::read(Config::fromString(
        "", "<test>",
        {"sync.mode=" + mode, "optim.grad_clip=1", "train.nonfinite_skips=2", "sync.servers=1"}));
  };
  EXPECT_NO_THROW(validate(read("ps-diloco"), 3));
  for (const char* mode : {"ps-bsp", "osp"}) {
    EXPECT_THROW(validate(read(mode), 3), ConfigError) << mode;
  }
}

// A pipeline under a parameter-server mode is refused for the mode, before any count of
// workers (the world counts the server: the message said "does not divide 3 workers" for 2
// workers and a server).
TEST(RunOptionsCheck, APipelineUnderServersIsRefusedForTheModeNotTheCount) {
  const RunOptions o = RunOptions::read(Config::fromString(
      "", "<test>", {"sync.mode=ps-bsp", "sync.servers=1", "parallel.pipeline_stages=2"}));
  try {
    validate(o, 3);
    FAIL() << "a pipeline under ps-bsp was accepted";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("parallel.pipeline_stages = 2 runs without sync.mode = ps-bsp"),
              std::string::npos)
        << m;
    EXPECT_EQ(m.find("3 workers"), std::string::npos) << m;
  }
}

namespace {

Config syntheticConfig(const std::vector<std::string>& extra) {
  std::vector<std::string> o = {"data.dataset=synthetic", "data.synthetic_size=96",
                                "data.batch_size=8", "train.max_steps=30", "train.log_every=1",
                                "train.eval_every=10", "train.threads=1", "checkpoint.every=7"};
  o.insert(o.end(), extra.begin(), extra.end());
  return Config::fromString("", "<test>", o);
}

void expectExactResume(const Config& config) {
  TempDir tmp;
  TrainerOptions full;
  full.runDir = tmp / "full";
  full.quiet = true;
  train(config, full);

  TrainerOptions first = full;
  first.runDir = tmp / "split";
  first.stopAtStep = 13;  // between two periodic checkpoints; stopping writes its own
  TrainSummary s1 = train(config, first);
  EXPECT_TRUE(s1.stoppedEarly);
  EXPECT_EQ(s1.steps, 13);
  TrainerOptions second = first;
  second.stopAtStep = 0;
  second.resume = true;
  TrainSummary s2 = train(config, second);
  EXPECT_EQ(s2.steps, 30);

  std::vector<double> a = trainLosses(full.runDir), b = trainLosses(first.runDir);
  ASSERT_EQ(a.size(), 30u);
  ASSERT_EQ(b.size(), 30u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  auto wa = finalWeights(config, full.runDir), wb = finalWeights(config, first.runDir);
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) EXPECT_TRUE(at::equal(t, wb.at(name))) << name;
}

}  // namespace

// A run stopped at step 4 by Caravan built on LibTorch 1.13 (tests/fixtures/run-1.13-*, see
// its README) resumes on this build: its optimizer state (momentum; AdamW's moments and step)
// is paired with the parameters although 1.13 wrote the keys as "0x..." text, which LibTorch
// 2.x's own reader turned into one key (the process aborted). The oracle is the 1.13 build's
// own uninterrupted run: steps 5..8 within 1e-5 relative (the two LibTorch builds' kernels may
// differ in the last bits). A lost state would not pass: step 5's update already uses it, and
// step 6's loss moves by far more than 1e-5 without it.
TEST(Resume, ACheckpointOfTheLibTorch113BuildResumes) {
  for (const std::string opt : {"sgd", "adamw"}) {
    SCOPED_TRACE(opt);
    TempDir tmp;
    const std::string run = tmp / "run";
    std::filesystem::copy(std::string(CARAVAN_SOURCE_DIR) + "/tests/fixtures/run-1.13-" + opt, run,
                          std::filesystem::copy_options::recursive);
    const test::CommandResult r = test::runCaravan("train --resume '" + run + "' --quiet");
    ASSERT_EQ(r.exitCode, 0) << r.err;
    const auto expected = nlohmann::json::parse(test::readFile(run + "/losses-uninterrupted.json"));
    const std::vector<double> theirs = expected.at("losses").get<std::vector<double>>();
    const std::vector<double> ours = test::trainLosses(run);
    ASSERT_EQ(ours.size(), 8u);
    ASSERT_EQ(theirs.size(), 8u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(ours[i], theirs[i]) << "step " << i + 1;  // the file's
    for (size_t i = 4; i < 8; ++i) {
      EXPECT_NEAR(ours[i], theirs[i], 1e-5 * std::abs(theirs[i])) << "step " << i + 1;
    }
  }
}

TEST(Resume, CnnSgdMomentumIsExact) {
  expectExactResume(syntheticConfig({"model.name=cnn", "model.width=4", "optim.name=sgd",
                                     "schedule.kind=cosine", "schedule.warmup_steps=3"}));
}

TEST(Resume, GptAdamWWithDropoutIsExact) {
  // Dropout draws from the default generator: the resumed run must restore its state.
  expectExactResume(syntheticConfig({"data.synthetic_task=tokens", "data.seq_len=16",
                                     "model.name=gpt", "model.width=16", "model.depth=2",
                                     "model.heads=2", "model.dropout=0.2", "optim.name=adamw",
                                     "optim.lr=0.003", "optim.grad_clip=1.0"}));
}

// schedule.horizon = time: each step's rate is the cosine at the training seconds before it,
// and a resumed run goes on from the checkpoint's seconds (TrainingState::elapsedSeconds), not
// from the peak. The oracle brackets the seconds a record's rate was computed from: no earlier
// than the record two back was written (before the step ran), no later than this record.
TEST(Resume, ATimeHorizonGoesOnFromTheCheckpointsSeconds) {
  TempDir tmp;
  const double budget = 1.5;  // seconds: train.max_minutes = 0.025
  const Config config = syntheticConfig(
      {"model.name=mlp", "model.width=8", "train.max_steps=1000000", "train.epochs=1000000",
       "train.eval_every=0", "checkpoint.every=0", "train.max_minutes=0.025",
       "schedule.kind=cosine", "schedule.horizon=time", "optim.lr=0.1", "schedule.min_lr=0.01"});
  TrainerOptions o;
  o.runDir = tmp / "run";
  o.quiet = true;
  o.stopAtStep = 20;
  ASSERT_TRUE(train(config, o).stoppedEarly);
  o.stopAtStep = 0;
  o.resume = true;
  const TrainSummary s = train(config, o);
  EXPECT_FALSE(s.stoppedEarly);
  EXPECT_GT(s.steps, 20);
  auto cosine = [&](double t) {
    return 0.01 + 0.09 * 0.5 * (1 + std::cos(M_PI * std::min(1.0, t / budget)));
  };
  std::vector<double> lr, time;
  std::istringstream lines(test::readFile(o.runDir + "/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] != "train") continue;
    lr.push_back(j.at("lr").get<double>());
    time.push_back(j.at("time_s").get<double>());
  }
  ASSERT_EQ(static_cast<int64_t>(lr.size()), s.steps);
  for (size_t k = 2; k < lr.size(); ++k) {
    EXPECT_GE(lr[k], cosine(time[k]) - 1e-12) << "record " << k;
    EXPECT_LE(lr[k], cosine(time[k - 2]) + 1e-12) << "record " << k;
  }
  EXPECT_GE(time.back(), budget);  // the run used its budget, and the rate came down with it
  EXPECT_LT(lr.back(), cosine(time[time.size() - 3]) + 1e-12);
  EXPECT_LT(lr.back(), 0.02);
}

TEST(Resume, Bf16BlocksAreExact) {
  test::EmulateBf16 emulated;  // where the CPU has no bf16 instructions
  expectExactResume(
      syntheticConfig({"data.synthetic_task=tokens", "data.seq_len=16", "model.name=gpt",
                       "model.width=16", "model.depth=2", "model.heads=2", "optim.name=adamw",
                       "optim.lr=0.003", "train.precision=bf16-all"}));
}

// A timed choice is recorded in each checkpoint and a resumed run takes it as it is.
TEST(Precision, AResumedRunTakesTheCheckpointsChoice) {
  test::EmulateBf16 emulated;  // where the CPU has no bf16 instructions
  RunSetup setup(syntheticConfig({"model.name=cnn", "model.width=4"}));
  const PrecisionChoice c =
      choosePrecision("bf16", setup.model, setup.sampleBatch(), 2, /*resumed=*/"010");
  EXPECT_EQ(c.blocksText(), "010");
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(setup.model->bf16(i), i == 1) << i;
  EXPECT_TRUE(c.float32Seconds.empty());  // not timed
  // A timed choice of no block is a choice too: recorded, and taken again.
  const PrecisionChoice none = choosePrecision("bf16", setup.model, setup.sampleBatch(), 2, "000");
  EXPECT_EQ(none.blocksText(), "000");
  for (size_t i = 0; i < 3; ++i) EXPECT_FALSE(setup.model->bf16(i)) << i;
  const PrecisionChoice f = choosePrecision("float32", setup.model, setup.sampleBatch(), 2, "");
  EXPECT_EQ(f.blocksText(), "");
  for (size_t i = 0; i < 3; ++i) EXPECT_FALSE(setup.model->bf16(i)) << i;
}

TEST(Resume, ResnetBatchNormNesterovIsExact) {
  Config c = syntheticConfig({"model.name=resnet-mini", "model.width=4", "optim.nesterov=true",
                              "checkpoint.keep=2"});
  expectExactResume(c);
}

namespace {

// The synthetic image set of syntheticConfig({}) written as .npy arrays in `dir`.
void exportSyntheticArrays(const std::string& dir) {
  const RunOptions o = RunOptions::read(syntheticConfig({}));
  const DatasetSplits d = makeDatasets(o.data, o.seed.data);
  for (const auto& [split, set] :
       {std::pair<std::string, const Dataset*>{"train", d.train.get()}, {"test", d.test.get()}}) {
    std::vector<int64_t> all(set->size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    const Batch b = set->get(all);
    test::writeNpy(dir + "/" + split + "_inputs.npy", b.input);
    test::writeNpy(dir + "/" + split + "_targets.npy", b.target);
  }
}

// syntheticConfig's run on arrays in `dir` instead.
Config arraysConfig(const std::string& dir, const std::vector<std::string>& extra) {
  std::vector<std::string> o = {"data.dataset=npy",   "data.path=" + dir,  "data.batch_size=8",
                                "train.max_steps=30", "train.log_every=1", "train.eval_every=10",
                                "train.threads=1",    "checkpoint.every=7"};
  o.insert(o.end(), extra.begin(), extra.end());
  return Config::fromString("", "<test>", o);
}

}  // namespace

// The same examples from .npy files as from memory: the run is the same, step for step (the
// sampler sees the same sizes; the model the same shapes).
TEST(OwnData, ArraysTrainAsTheSameExamplesInMemory) {
  TempDir tmp;
  std::filesystem::create_directories(tmp / "arrays");
  exportSyntheticArrays(tmp / "arrays");
  const std::vector<std::string> model = {"model.name=cnn", "model.width=4", "train.max_steps=12"};
  const Config arrays = arraysConfig(tmp / "arrays", model);
  ASSERT_EQ(RunSetup(arrays).data.train->shape().numClasses, 10);
  TrainerOptions o;
  o.quiet = true;
  o.runDir = tmp / "memory";
  train(syntheticConfig(model), o);
  o.runDir = tmp / "files";
  train(arrays, o);
  const std::vector<double> memory = trainLosses(tmp / "memory");
  ASSERT_EQ(memory.size(), 12u);
  EXPECT_EQ(trainLosses(tmp / "files"), memory);
}

TEST(Resume, ArraysAreExact) {
  TempDir tmp;
  std::filesystem::create_directories(tmp / "arrays");
  exportSyntheticArrays(tmp / "arrays");
  expectExactResume(arraysConfig(tmp / "arrays", {"model.name=mlp", "model.width=8"}));
}

TEST(Resume, TokenFilesAreExact) {
  TempDir tmp;
  std::filesystem::create_directories(tmp / "tokens");
  torch::manual_seed(3);
  for (const auto& [file, n] :
       {std::pair<std::string, int64_t>{"train.bin", 96 * 16 + 1}, {"val.bin", 24 * 16 + 1}}) {
    const at::Tensor ids = torch::randint(0, 16, {n}, torch::kLong).to(at::kShort);
    test::writeFile(tmp / ("tokens/" + file),
                    std::string(static_cast<const char*>(ids.data_ptr()), 2 * n));
  }
  expectExactResume(Config::fromString(
      "", "<test>",
      {"data.dataset=tokens", "data.path=" + tmp / "tokens", "data.vocab_size=16",
       "data.seq_len=16", "data.batch_size=8", "train.max_steps=30", "train.log_every=1",
       "train.eval_every=10", "train.threads=1", "checkpoint.every=7", "model.name=gpt",
       "model.width=16", "model.depth=2", "model.heads=2", "model.dropout=0.1", "optim.name=adamw",
       "optim.lr=0.003"}));
}

TEST(Trainer, RefusesToOverwriteAnExistingRun) {
  TempDir tmp;
  Config c = syntheticConfig({"model.name=mlp", "model.width=8", "train.max_steps=3"});
  TrainerOptions o;
  o.runDir = tmp / "run";
  o.quiet = true;
  train(c, o);
  std::string before = test::readFile(CheckpointDir(o.runDir, 3).latest().value());
  EXPECT_THROW(train(c, o), ConfigError);
  EXPECT_EQ(test::readFile(CheckpointDir(o.runDir, 3).latest().value()), before);
}

TEST(Trainer, KeepsOnlyLastKCheckpoints) {
  TempDir tmp;
  Config c = syntheticConfig({"model.name=mlp", "model.width=8", "checkpoint.every=2",
                              "checkpoint.keep=2"});
  TrainerOptions o;
  o.runDir = tmp / "run";
  o.quiet = true;
  train(c, o);
  auto files = CheckpointDir(o.runDir, 2).list();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_NE(files.back().find("step-00000030.ckpt"), std::string::npos);
  EXPECT_NE(files.front().find("step-00000028.ckpt"), std::string::npos);
  for (const auto& e : fs::directory_iterator(o.runDir + "/checkpoints")) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  EXPECT_TRUE(fs::exists(o.runDir + "/model.pt"));
  EXPECT_TRUE(fs::exists(o.runDir + "/config.toml"));
}

class CheckpointFile : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = syntheticConfig({"model.name=mlp", "model.width=8", "optim.name=adamw"});
    setup_ = std::make_unique<RunSetup>(config_);
    model_ = setup_->model;
    optimizer_ = setup_->optimizer.get();
    // One step so the optimizer has state to save.
    auto out = model_->forward(torch::randn({4, 1, 28, 28}));
    out.sum().backward();
    optimizer_->step();
    state_.step = 5;
    state_.position = {1, 3};
    state_.rngState = at::detail::getDefaultCPUGenerator().get_state();
    state_.meta = setup_->identity;
    path_ = tmp_ / "a.ckpt";
    saveCheckpoint(path_, *model_, *optimizer_, state_);
  }

  Config config_;
  std::unique_ptr<RunSetup> setup_;
  BlockModel model_{nullptr};
  torch::optim::Optimizer* optimizer_ = nullptr;
  TrainingState state_;
  TempDir tmp_;
  std::string path_;
};

// A checkpoint whose optimizer states belong to other parameters (a damaged or crafted file:
// here the optimizer that wrote it listed the parameters in reverse) is refused in one line at
// load; it loaded before and the first fused step wrote past a buffer (SIGSEGV).
TEST_F(CheckpointFile, OptimizerStateOfAnotherShapeIsRefusedAtLoad) {
  std::vector<at::Tensor> params = model_->parameters();
  std::vector<at::Tensor> reversed(params.rbegin(), params.rend());
  torch::optim::AdamW writer(reversed, torch::optim::AdamWOptions(0.01));
  for (auto& p : params) p.mutable_grad() = torch::ones_like(p);
  writer.step();
  saveCheckpoint(path_, *model_, writer, state_);
  RunSetup fresh(config_);
  try {
    loadCheckpoint(path_, *fresh.model, *fresh.optimizer, fresh.identity);
    FAIL() << "a checkpoint pairing optimizer states with other parameters loaded";
  } catch (const CheckpointError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("its optimizer state for a parameter of shape"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

TEST_F(CheckpointFile, RoundTrip) {
  RunSetup fresh(config_);
  BlockModel& other = fresh.model;
  torch::optim::Optimizer* otherOpt = fresh.optimizer.get();
  TrainingState s = loadCheckpoint(path_, *other, *fresh.optimizer, fresh.identity);
  EXPECT_EQ(s.step, 5);
  EXPECT_EQ(s.position, (SamplerPosition{1, 3}));
  EXPECT_TRUE(at::equal(s.rngState, state_.rngState));
  auto a = model_->named_parameters(), b = other->named_parameters();
  for (const auto& p : a) EXPECT_TRUE(at::equal(p.value(), b[p.key()])) << p.key();
  // Optimizer state restored: one more identical step gives identical parameters.
  optimizer_->zero_grad();
  otherOpt->zero_grad();
  for (auto* m : {&model_, &other}) {
    auto out = (*m)->forward(torch::ones({2, 1, 28, 28}));
    out.sum().backward();
  }
  optimizer_->step();
  otherOpt->step();
  b = other->named_parameters();
  for (const auto& p : model_->named_parameters()) {
    EXPECT_TRUE(at::equal(p.value(), b[p.key()])) << p.key();
  }
}

TEST_F(CheckpointFile, TruncatedIsRefusedAndLeftAlone) {
  std::string bytes = test::readFile(path_);
  test::writeFile(path_, bytes.substr(0, bytes.size() / 2));
  try {
    loadCheckpoint(path_, *model_, *optimizer_, setup_->identity);
    FAIL() << "no error";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path_), std::string::npos) << e.what();
  }
  EXPECT_EQ(test::readFile(path_), bytes.substr(0, bytes.size() / 2));
  test::writeFile(path_, bytes.substr(0, 10));
  EXPECT_THROW(loadCheckpoint(path_, *model_, *optimizer_, setup_->identity), CheckpointError);
}

TEST_F(CheckpointFile, AHeaderClaimingMoreThanTheFileIsRefusedBeforeReading) {
  // A crafted header claiming 1 TiB of payload: refused from the file's size, nothing that
  // size allocated (the loader would fail with bad_alloc or be killed if it trusted it).
  std::string bytes = test::readFile(path_);
  const uint64_t claimed = uint64_t{1} << 40;
  for (int i = 0; i < 8; ++i) bytes[8 + i] = static_cast<char>((claimed >> (8 * i)) & 0xff);
  test::writeFile(path_, bytes);
  try {
    loadCheckpoint(path_, *model_, *optimizer_, setup_->identity);
    FAIL() << "no error";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("header says 1099511627776 bytes"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(test::readFile(path_), bytes);
}

TEST_F(CheckpointFile, CorruptedByteIsRefused) {
  std::string bytes = test::readFile(path_);
  bytes[bytes.size() / 2] ^= 0x5a;
  test::writeFile(path_, bytes);
  try {
    loadCheckpoint(path_, *model_, *optimizer_, setup_->identity);
    FAIL() << "no error";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt"), std::string::npos) << e.what();
  }
}

TEST_F(CheckpointFile, OtherModelIsRefused) {
  Config other = syntheticConfig({"model.name=mlp", "model.width=16", "optim.name=adamw"});
  RunSetup setup(other);
  try {
    loadCheckpoint(path_, *setup.model, *setup.optimizer, setup.identity);
    FAIL() << "no error";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("model.width"), std::string::npos) << e.what();
  }
}

TEST(ExportStateDict, WritesLoadableDict) {
  TempDir tmp;
  Config c = syntheticConfig({"model.name=mlp", "model.width=8"});
  RunSetup setup(c);
  BlockModel& m = setup.model;
  exportStateDict(tmp / "model.pt", *m);
  std::string bytes = test::readFile(tmp / "model.pt");
  auto dict = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end())).toGenericDict();
  EXPECT_EQ(dict.size(), m->named_parameters().size() + m->named_buffers().size());
  for (const auto& p : m->named_parameters()) {
    EXPECT_TRUE(at::equal(dict.at(p.key()).toTensor(), p.value())) << p.key();
  }
}

TEST(NonFinite, ASkippedStepLeavesTheModelAsIfTheBatchNeverCame) {
  // Three batches, the middle one poisoned with a NaN: with skipNonFinite the poisoned step
  // changes nothing (weights, momentum), so the run equals one that saw only the good batches.
  DataShape shape;
  shape.task = TaskKind::kImageClassification;
  ModelSpec spec;
  spec.name = "cnn";
  spec.width = 4;
  auto batch = [&](uint64_t seed) { return test::randomBatch(shape, 4, seed); };
  Batch poisoned = batch(2);
  poisoned.input[1][0][3][3] = std::nan("");
  auto train = [&](const std::vector<Batch>& batches, std::vector<bool>* skipped) {
    torch::manual_seed(7);
    BlockModel model = buildModel(spec, shape);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    DataParallelStep engine(model, sgd, {/*gradClip=*/0.0, /*skipNonFinite=*/true});
    for (const Batch& b : batches) {
      StepResult r = engine.step(b, 0);
      skipped->push_back(r.skipped);
    }
    std::vector<at::Tensor> out;
    for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
    return out;
  };
  std::vector<bool> withPoison, without;
  const auto a = train({batch(1), poisoned, batch(3)}, &withPoison);
  const auto b = train({batch(1), batch(3)}, &without);
  EXPECT_EQ(withPoison, (std::vector<bool>{false, true, false}));
  EXPECT_EQ(without, (std::vector<bool>{false, false}));
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::isfinite(a[i]).all().item<bool>()) << i;
    EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
  }
}

TEST(NonFinite, StopsNamingTheStepAfterTheAllowedSkips) {
  // A learning rate of 1e6 blows the weights up within a few updates: from some step F on,
  // every loss is not finite. Without skips the run stops at F naming it; with 2 skips the
  // weights stay as they were at F, so it stops at F + 2, saying so, and metrics.jsonl counts
  // the skipped steps.
  int64_t first = -1;
  for (const int64_t skips : {int64_t{0}, int64_t{2}}) {
    SCOPED_TRACE(skips);
    const Config c = syntheticConfig({"model.name=mlp", "model.width=8", "optim.lr=1e6",
                                      "optim.momentum=0", "checkpoint.every=0",
                                      "train.nonfinite_skips=" + std::to_string(skips)});
    TempDir tmp;
    TrainerOptions o;
    o.runDir = tmp / "run";
    o.quiet = true;
    std::string m;
    try {
      train(c, o);
      ADD_FAILURE() << "a run whose loss is not finite finished";
    } catch (const NonFiniteError& e) {
      m = e.what();
    }
    const size_t at = m.find(" at step ");
    ASSERT_NE(at, std::string::npos) << m;
    const int64_t step = std::stoll(m.substr(at + 9));
    if (skips == 0) {
      first = step;
      EXPECT_GE(first, 2) << m;
    } else {
      EXPECT_EQ(step, first + 2) << m;
      EXPECT_NE(m.find("after 2 skipped steps"), std::string::npos) << m;
    }
    EXPECT_NE(m.find("the last good checkpoint is (none: set checkpoint.every)"),
              std::string::npos)
        << m;
    int64_t lastSkipped = -1;
    std::istringstream lines(test::readFile(tmp / "run/metrics.jsonl"));
    for (std::string line; std::getline(lines, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["kind"] == "train" && j.contains("skipped_steps")) lastSkipped = j["skipped_steps"];
    }
    EXPECT_EQ(lastSkipped, skips > 0 ? 2 : -1);
  }
}

TEST(NonFinite, SkippingIsRefusedWhereUpdatesComeBeforeTheCheck) {
  const Config c = syntheticConfig({"model.name=mlp", "model.width=8", "memory.weights=offload",
                                    "memory.tier=host", "train.nonfinite_skips=1"});
  TempDir tmp;
  TrainerOptions o;
  o.runDir = tmp / "run";
  o.quiet = true;
  try {
    train(c, o);
    ADD_FAILURE() << "train.nonfinite_skips with out-of-core weights was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("memory.weights = offload"), std::string::npos)
        << e.what();
  }
}

// A resume drops the records after its checkpoint (they are redone) and a last line cut short
// by a kill; a line in the middle that does not parse is someone's data and stays.
TEST(MetricsFile, ResumeKeepsEverythingButLaterRecordsAndACutLastLine) {
  TempDir tmp;
  const std::string path = tmp / "metrics.jsonl";
  test::writeFile(path,
                  "{\"kind\":\"train\",\"step\":1}\n"
                  "a note someone added\n"
                  "{\"kind\":\"eval\",\"step\":5}\n"
                  "{\"kind\":\"train\",\"step\":9}\n"
                  "{\"kind\":\"tra");
  { MetricsSink sink(path, 5); }
  EXPECT_EQ(test::readFile(path),
            "{\"kind\":\"train\",\"step\":1}\n"
            "a note someone added\n"
            "{\"kind\":\"eval\",\"step\":5}\n");
}

// A mixture of two array sources weighted 3:1: the run resumes exactly (the mix is a dataset
// like any other to the sampler), and each train record counts the samples from each source.
TEST(Resume, MixtureIsExactAndCountsSamplesPerSource) {
  TempDir tmp;
  for (const char* d : {"a", "b"}) {
    std::filesystem::create_directories(tmp / d);
    exportSyntheticArrays(tmp / d);
  }
  const std::string text = "[[data.sources]]\npath = \"" + tmp / "a" +
                           "\"\nformat = \"npy\"\nweight = 3\n[[data.sources]]\npath = \"" +
                           tmp / "b" + "\"\nformat = \"npy\"\nweight = 1\n";
  std::vector<std::string> sets = {"data.batch_size=8", "train.log_every=1",  "train.eval_every=10",
                                   "train.threads=1",   "checkpoint.every=7", "model.name=mlp",
                                   "model.width=8"};
  sets.push_back("train.max_steps=30");
  expectExactResume(Config::fromString(text, "<test>", sets));

  // One epoch: 2 x 96 mixture slots, 24 steps of 8.
  sets.back() = "train.max_steps=24";
  TrainerOptions o;
  o.quiet = true;
  o.runDir = tmp / "counted";
  train(Config::fromString(text, "<test>", sets), o);
  int64_t a = 0, b = 0, records = 0;
  std::istringstream lines(test::readFile(tmp / "counted/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] != "train") continue;
    ++records;
    const auto& counts = j.at("source_samples");
    a += counts.at(tmp / "a").get<int64_t>();
    b += counts.at(tmp / "b").get<int64_t>();
    EXPECT_EQ(counts.at(tmp / "a").get<int64_t>() + counts.at(tmp / "b").get<int64_t>(), 8);
  }
  EXPECT_EQ(records, 24);
  // The whole epoch: its 192 slots split 3:1 exactly (the interleave repeats a, a, a, b).
  EXPECT_EQ(a, 144);
  EXPECT_EQ(b, 48);
}

// The terminal's ETA of a run bounded by train.max_minutes is the time left, not the steps
// left at the current rate (an 18-minute run promised 8 hours).
TEST(Progress, TheEtaIsTheSoonerOfTheStepsAndTheTimeLeft) {
  auto etaLine = [](double secondsLeft) {
    char* text = nullptr;
    size_t size = 0;
    std::FILE* out = open_memstream(&text, &size);
    {
      Progress p(out, /*tty=*/false, /*quiet=*/false, /*totalSteps=*/1000000, /*logEvery=*/1);
      p.update(1, 1, 1.0, 0.1, 10.0, secondsLeft);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      p.update(2, 1, 1.0, 0.1, 10.0, secondsLeft);
    }
    std::fclose(out);
    std::string s(text, size);
    std::free(text);
    return s.substr(s.rfind("eta ") + 4);
  };
  EXPECT_EQ(etaLine(90.0), "01:30\n");
  EXPECT_NE(etaLine(std::numeric_limits<double>::infinity()), "01:30\n");  // ~5.5 h of steps
}
