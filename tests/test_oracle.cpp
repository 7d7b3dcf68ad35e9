// Oracle: Caravan's training step against Python PyTorch (Debian's python3-torch) from the same
// initial weights and batches. 20 SGD steps and 20 AdamW steps of the CNN must give losses that
// agree to 1e-4 relative (tests/python/oracle_train.py is the PyTorch side).
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/config.h"
#include "data/loader.h"
#include "data/sources.h"
#include "memory/saved_tensors.h"
#include "memory/tracker.h"
#include "train/schedule.h"
#include "train/setup.h"
#include "train/step.h"
#include "train/trainer.h"
#include "test_util.h"

using namespace caravan;
using caravan::test::TempDir;

namespace {

constexpr int kSteps = 20;
constexpr const char* kPython = "/usr/bin/python3";

c10::Dict<c10::IValue, c10::IValue> readDict(const std::string& path) {
  std::string bytes = test::readFile(path);
  return torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end())).toGenericDict();
}

// `tolerance`: the largest relative loss difference allowed at any step.
void compareWithPyTorch(const std::vector<std::string>& overrides, double tolerance = 1e-4) {
  std::vector<std::string> o = {"data.batch_size=32", "train.threads=1",
                                "schedule.kind=cosine", "schedule.warmup_steps=5"};
  if (!std::filesystem::exists(kDefaultFashionMnistDir)) {
    o.push_back("data.dataset=synthetic");  // the real data is preferred; CI installs it
  }
  o.insert(o.end(), overrides.begin(), overrides.end());
  Config config = Config::fromString("", "<oracle>", o);
  const RunOptions options = RunOptions::read(config);
  applyRuntimeOptions(options.runtime);
  DatasetSplits data = makeDatasets(options.data, options.seed.data);
  const DataShape shape = data.train->shape();
  torch::manual_seed(7);
  BlockModel model = buildModel(options.model, shape);
  auto optimizer = makeOptimizer(options.optim, model->parameters());
  ScheduleOptions schedule = options.schedule;
  schedule.totalSteps = kSteps;

  TempDir tmp;
  c10::Dict<std::string, at::Tensor> dump;
  // Under the names the user's module has (a scripted module's own; the built-in models').
  for (const auto& p : model->named_parameters()) {
    dump.insert("state." + model->exportName(p.key()), p.value().clone());
  }
  for (const auto& b : model->named_buffers()) {
    dump.insert("state." + model->exportName(b.key()), b.value().clone());
  }
  SamplerOptions so;
  so.datasetSize = data.train->size();
  so.batchSize = options.data.batchSize;
  Sampler sampler(so);
  std::vector<Batch> batches;
  std::vector<double> lrs;
  for (int i = 0; i < kSteps; ++i) {
    batches.push_back(data.train->get(sampler.next()));
    dump.insert("x" + std::to_string(i), batches.back().input);
    dump.insert("y" + std::to_string(i), batches.back().target);
    lrs.push_back(learningRate(schedule, i));
  }
  dump.insert("lr", torch::tensor(lrs, torch::kFloat64));
  nlohmann::json cfg = {{"model", config.str("model.name")},
                        {"width", config.i64("model.width")},
                        {"depth", config.i64("model.depth")},
                        {"heads", config.i64("model.heads")},
                        {"optim", config.str("optim.name")},
                        {"lr", config.f64("optim.lr")},
                        {"momentum", config.f64("optim.momentum")},
                        {"nesterov", config.flag("optim.nesterov")},
                        {"weight_decay", config.f64("optim.weight_decay")},
                        {"beta1", config.f64("optim.beta1")},
                        {"beta2", config.f64("optim.beta2")},
                        {"eps", config.f64("optim.eps")},
                        {"grad_clip", config.f64("optim.grad_clip")},
                        {"path", config.str("model.path")},
                        {"channels", shape.channels},
                        {"height", shape.height},
                        {"image_width", shape.width},
                        {"classes", shape.numClasses}};
  std::vector<char> bytes = torch::pickle_save(c10::IValue(dump));
  test::writeFile(tmp / "dump.pt", std::string(bytes.begin(), bytes.end()));
  test::writeFile(tmp / "config.json", cfg.dump());

  // Caravan, with the saved-tensor hooks accounting the first step's activations.
  installSavedTensorEngine();
  MemoryTracker memory;
  int64_t firstStepSaved = -1;
  std::vector<double> ours;
  model->train();
  {
    SavedTensorScope scope(memory, model->parameters());
    for (int i = 0; i < kSteps; ++i) {
      setLearningRate(*optimizer, lrs[i]);
      ours.push_back(trainStep(model, *optimizer, batches[i], config.f64("optim.grad_clip")).loss);
      if (i == 0) {
        firstStepSaved = memory.peak(MemoryCategory::kActivations);
        // Backward released every saved tensor.
        EXPECT_EQ(memory.live(MemoryCategory::kActivations), 0);
      }
    }
  }

  // PyTorch.
  std::string cmd = std::string(kPython) + " " + CARAVAN_SOURCE_DIR +
                    "/tests/python/oracle_train.py " + (tmp / "dump.pt") + " " + (tmp / "config.json") +
                    " " + (tmp / "out.pt");
  ASSERT_EQ(std::system(cmd.c_str()), 0)
      << "the PyTorch oracle failed; it needs Debian's python3-torch (bash scripts/setup.sh)";
  c10::Dict<c10::IValue, c10::IValue> theirs = readDict(tmp / "out.pt");
  // The bytes saved for backward: what our hooks saw equals what PyTorch's hooks saw.
  const int64_t theirSaved = theirs.at("saved_bytes").toTensor()[0].item<int64_t>();
  EXPECT_GT(theirSaved, 0);
  EXPECT_EQ(firstStepSaved, theirSaved);
  std::cout << "activations saved for backward in step 1: caravan " << firstStepSaved
            << " bytes, pytorch " << theirSaved << " bytes\n";
  at::Tensor theirLosses = theirs.at("losses").toTensor();
  ASSERT_EQ(theirLosses.numel(), kSteps);
  double worst = 0.0;
  for (int i = 0; i < kSteps; ++i) {
    const double t = theirLosses[i].item<double>();
    worst = std::max(worst, std::abs(ours[i] - t) / std::abs(t));
    EXPECT_LE(std::abs(ours[i] - t), tolerance * std::abs(t))
        << "step " << i + 1 << ": caravan " << ours[i] << " pytorch " << t;
  }
  std::cout << "max relative loss difference over " << kSteps << " steps: " << worst
            << " (first loss " << ours.front() << ", last " << ours.back() << ")\n";
  EXPECT_LT(ours.back(), ours.front()) << "the model did not learn";
  for (const auto& p : model->named_parameters()) {
    at::Tensor t = theirs.at("state." + model->exportName(p.key())).toTensor();
    EXPECT_TRUE(at::allclose(p.value(), t, /*rtol=*/1e-3, /*atol=*/1e-5))
        << p.key() << " max diff " << (p.value() - t).abs().max().item<double>();
  }
}

}  // namespace

// A user's module, scripted in Python (tests/python/script_models.py), trained by Caravan and by
// Python PyTorch from the same weights and batches: the same losses within 1e-5 relative.
TEST(Oracle, ScriptedCnnMatchesPyTorchTrainingTheSameModule) {
  const std::string dir = test::scriptedModelsDir();
  ASSERT_FALSE(dir.empty()) << "tests/python/script_models.py failed (python3-torch?)";
  compareWithPyTorch({"model.name=torchscript", "model.path=" + dir + "/cnn.pt", "optim.name=sgd",
                      "optim.lr=0.05", "optim.momentum=0.9", "optim.weight_decay=0.0005"},
                     1e-5);
}

TEST(Oracle, CnnSgdNesterovMatchesPyTorch) {
  compareWithPyTorch({"model.name=cnn", "model.width=16", "optim.name=sgd", "optim.lr=0.05",
                      "optim.momentum=0.9", "optim.nesterov=true", "optim.weight_decay=0.0005"});
}

TEST(Oracle, CnnAdamWWithClippingMatchesPyTorch) {
  compareWithPyTorch({"model.name=cnn", "model.width=16", "optim.name=adamw", "optim.lr=0.002",
                      "optim.weight_decay=0.01", "optim.grad_clip=0.5"});
}

TEST(Oracle, ExportedModelLoadsInPyTorch) {
  TempDir tmp;
  Config c = Config::fromString("", "<export>",
                                {"data.dataset=synthetic", "data.synthetic_size=64",
                                 "data.batch_size=8", "train.max_steps=3", "train.threads=1",
                                 "model.name=resnet-mini", "model.width=4"});
  TrainerOptions o;
  o.runDir = tmp / "run";
  o.quiet = true;
  train(c, o);
  // torch.load, then a strict load_state_dict into the PyTorch twin: names and shapes match.
  std::string cmd = std::string(kPython) + " -c \"import sys, torch; sys.path.insert(0, '" +
                    CARAVAN_SOURCE_DIR + "/tests/python'); import reference_models as r; "
                    "sd = torch.load('" + (tmp / "run/model.pt") + "'); "
                    "m = r.build('resnet-mini', width=4); m.load_state_dict(sd, strict=True)\"";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}
