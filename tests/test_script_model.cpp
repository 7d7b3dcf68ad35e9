// A user's PyTorch module, scripted in Python and trained by Caravan (model.name = torchscript,
// models/script_model.h): blocks, loss, export, memory policies, and bad models. The modules are
// tests/python/script_models.py's; the PyTorch oracle is in test_oracle.cpp, data-parallel and
// out-of-core equivalence in test_dist.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include <torch/torch.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/errors.h"
#include "data/loader.h"
#include "memory/saved_tensors.h"
#include "run_util.h"
#include "test_util.h"
#include "train/data_parallel_step.h"
#include "train/run_setup.h"
#include "train/schedule.h"
#include "train/setup.h"
#include "train/step.h"
#include "train/trainer.h"

using namespace caravan;
using caravan::test::TempDir;

namespace {

std::string models() {
  const std::string dir = test::scriptedModelsDir();
  EXPECT_FALSE(dir.empty())
      << "tests/python/script_models.py failed (.venv: bash scripts/setup.sh)";
  return dir;
}

std::vector<std::string> scriptedCnn(const std::vector<std::string>& more = {}) {
  std::vector<std::string> o = {
      "data.dataset=synthetic", "data.synthetic_size=96", "data.batch_size=16",
      "train.threads=1",        "train.max_steps=6",      "train.log_every=1",
      "train.eval_every=0",     "optim.name=sgd",         "optim.lr=0.05",
      "optim.momentum=0.9",     "model.name=torchscript", "model.path=" + models() + "/cnn.pt"};
  o.insert(o.end(), more.begin(), more.end());
  return o;
}

// Trains `overrides` in this process; returns model.pt's tensors.
std::map<std::string, at::Tensor> trainAndExport(const std::vector<std::string>& overrides,
                                                 const std::string& runDir) {
  TrainerOptions o;
  o.quiet = true;
  o.runDir = runDir;
  train(Config::fromString("", "<test>", overrides), o);
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : test::readDict(runDir + "/model.pt")) {
    out[kv.key().toStringRef()] = kv.value().toTensor();
  }
  return out;
}

}  // namespace

// The module's children are its blocks when its forward is them in order; their tensors are the
// module's (an update through Caravan is the module's), exported under the module's names.
TEST(ScriptModel, ChildrenInOrderAreTheBlocksAndNamesAreTheModules) {
  const Config config = Config::fromString("", "<test>", scriptedCnn());
  RunSetup setup(config);
  BlockModel& model = setup.model;
  ASSERT_EQ(model->numBlocks(), 3u);
  EXPECT_EQ(model->blockLabel(0), "features");
  EXPECT_EQ(model->blockLabel(2), "head");
  EXPECT_TRUE(model->structureNote().empty());
  EXPECT_EQ(model->exportName("b0_features.features.0.weight"), "features.0.weight");
  EXPECT_EQ(model->exportName("b0_features.features.4.running_mean"), "features.4.running_mean");
  EXPECT_EQ(model->exportName("b2_head.head.2.bias"), "head.2.bias");
  EXPECT_EQ(setup.identity.at("model.parameters").get<std::string>().rfind("10 tensors", 0), 0u)
      << setup.identity;

  // model.blocks = "none": the same module as one block.
  RunSetup asOne(Config::fromString("", "<test>", scriptedCnn({"model.blocks=none"})));
  EXPECT_EQ(asOne.model->numBlocks(), 1u);
  EXPECT_EQ(asOne.model->structureNote(), "model.blocks = 'none': the module trains as one block");
  EXPECT_EQ(asOne.model->exportName("b0_module.features.0.weight"), "features.0.weight");

  // What the forward does besides calling its children is cut with them: a scale after the
  // last child is a block of its own, a dropout or a detach() between two children stays in
  // the block before (the cut is checked bitwise against the whole forward, in eval and in
  // training, at load; Oracle.CutForwardsTrainAsPyTorchTrainsTheModule trains them).
  for (const auto& [file, labels] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"not-sequential.pt", {"features", "flat", "head", "epilogue"}},
           {"dropout-between.pt", {"features", "flat", "head"}},
           {"detach-between.pt", {"features", "flat", "head"}}}) {
    SCOPED_TRACE(file);
    RunSetup s(
        Config::fromString("", "<test>", scriptedCnn({"model.path=" + models() + "/" + file})));
    ASSERT_EQ(s.model->numBlocks(), labels.size());
    for (size_t i = 0; i < labels.size(); ++i) EXPECT_EQ(s.model->blockLabel(i), labels[i]);
    EXPECT_TRUE(s.model->structureNote().empty()) << s.model->structureNote();
    EXPECT_EQ(s.model->exportName("b0_features.features.0.weight"), "features.0.weight");
  }
}

// caravan export of a module that scripts as well (script_models.py's Cnn, through its factory):
// the blocks are those of the scripted file, below the export's wrapper (features, flat, head).
// Refused in one line, exit 2, nothing written: --blocks naming no container, a factory that
// raises, a forward(x, targets) whose loss reads more than the output, an output the guard
// refuses.
TEST(ScriptModel, ExportCutsAModuleAsItsScriptedTwinAndRefusesBadInput) {
  TempDir tmp;
  const std::string file = std::string(CARAVAN_SOURCE_DIR) + "/tests/python/script_models.py";
  const auto r = test::runCaravan("export " + file + ":cnn_factory -o " + (tmp / "cnn.pt"));
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("blocks: 3 (features, flat, head)"), std::string::npos) << r.out;
  RunSetup setup(Config::fromString("", "<test>", scriptedCnn({"model.path=" + (tmp / "cnn.pt")})));
  ASSERT_EQ(setup.model->numBlocks(), 3u);
  EXPECT_EQ(setup.model->blockLabel(0), "features");
  EXPECT_EQ(setup.model->exportName("b0_features.m.features.0.weight"), "features.0.weight");

  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {file + ":cnn_factory --blocks nothere",
            "--blocks names 'nothere', which is no submodule with children of Cnn"},
           {file + ":failing_factory", "failing_factory() fails: RuntimeError: no weights here"},
           {file + ":nothere", "has no callable nothere"},
           // A loss of (output, targets) alone: this one reads the input's batch size too.
           {file + ":loss_of_input_factory",
            "its loss reads a value of the forward besides the output"}}) {
    SCOPED_TRACE(args);
    const auto bad = test::runCaravan("export " + args + " -o " + (tmp / "bad.pt"));
    EXPECT_EQ(bad.exitCode, 2) << bad.err;
    EXPECT_EQ(test::countLines(bad.err), 1) << bad.err;
    EXPECT_NE(bad.err.find(says), std::string::npos) << bad.err;
    EXPECT_FALSE(std::filesystem::exists(tmp / "bad.pt"));
  }
  // A tensor of no parameter written through a view with one that has a gradient is no
  // context value: it crosses every cut as a second activation, and the module is one block.
  const auto skip =
      test::runCaravan("export " + file + ":written_skip_factory -o " + (tmp / "skip.pt"));
  ASSERT_EQ(skip.exitCode, 0) << skip.err;
  EXPECT_NE(skip.out.find("blocks: 1 (the module is not cut: not cut before layers.0: 2 values "
                          "that carry a gradient cross"),
            std::string::npos)
      << skip.out;

  const auto guard = test::runCaravan("export " + file + ":cnn_factory -o " + tmp.path());
  EXPECT_EQ(guard.exitCode, 2) << guard.err;
  EXPECT_NE(guard.err.find("is not a regular file (a directory)"), std::string::npos) << guard.err;
}

// Tied weights are one parameter: todays_models.py's TiedLayers uses its first layer's Linear
// again in its third (one module under two names, as ALBERT ties layers), so blocks 1 and 3 read
// it. Registered once (by block 1; one gradient that autograd sums over both uses, one optimizer
// state), model.pt holds it under both names and loads strictly into the class; every memory
// policy gives keep's weights bitwise; out-of-core weights, which hold a block's weights only
// while it runs, hold its owner's too. TodaysPyTorch.TiedLayersTrainAsInEagerPyTorch is the
// oracle. A module under two names in one block (script_models.py's Tied) trains too.
TEST(ScriptModel, TiedWeightsAreOneParameterUnderBothNames) {
  const std::string dir = test::pythonWrittenDir("todays_models.py");
  ASSERT_FALSE(dir.empty()) << "tests/python/todays_models.py failed (.venv: scripts/setup.sh)";
  const std::string path = "model.path=" + dir + "/tied-layers.pt";
  RunSetup setup(Config::fromString("", "<test>", scriptedCnn({path})));
  BlockModel& model = setup.model;
  ASSERT_EQ(model->numBlocks(), 5u);
  const std::vector<std::string> labels = {"prologue", "layers_0", "layers_1", "layers_2",
                                           "epilogue"};
  for (size_t i = 0; i < labels.size(); ++i) EXPECT_EQ(model->blockLabel(i), labels[i]);
  // embed 2, three norms 6, two distinct Linears 4, head 2.
  EXPECT_EQ(model->parameters().size(), 14u);
  ASSERT_EQ(model->sharedUses().size(), 2u);
  for (const auto& use : model->sharedUses()) {
    EXPECT_EQ(use.owner, 1u);
    EXPECT_EQ(use.user, 3u);
    EXPECT_EQ(use.name.rfind("b1_layers_0.layers.0.fc.", 0), 0u) << use.name;
  }
  EXPECT_EQ(model->exportNames("b1_layers_0.layers.0.fc.weight"),
            (std::vector<std::string>{"layers.0.fc.weight", "layers.2.fc.weight"}));

  TempDir tmp;
  const auto keep = trainAndExport(scriptedCnn({path, "memory.tier=host"}), tmp / "keep");
  EXPECT_EQ(keep.size(), 16u);  // 14 parameters, the tied two under their second names too
  ASSERT_EQ(keep.count("layers.2.fc.weight"), 1u);
  EXPECT_TRUE(at::equal(keep.at("layers.0.fc.weight"), keep.at("layers.2.fc.weight")));
  for (const std::string policy : {"recompute", "swap", "keep,recompute,swap,recompute,keep"}) {
    SCOPED_TRACE(policy);
    const auto other = trainAndExport(
        scriptedCnn({path, "memory.tier=host", "memory.policy=" + policy}), tmp / policy);
    ASSERT_EQ(other.size(), keep.size());
    for (const auto& [name, t] : keep) EXPECT_TRUE(at::equal(t, other.at(name))) << name;
  }
  const std::string load = std::string(test::kPython) +
                           " -c \"import sys, torch; sys.path.insert(0, '" + CARAVAN_SOURCE_DIR +
                           "/tests/python'); import todays_models as t; m = t.TiedLayers(); "
                           "m.load_state_dict(torch.load('" +
                           (tmp / "keep/model.pt") + "'), strict=True)\"";
  EXPECT_EQ(std::system(load.c_str()), 0) << load;

  // Out-of-core weights: block 1's weights are fetched and held while block 3 runs and in its
  // backward (block 2 between them lets them go), also where block 3 is recomputed there:
  // keep's weights, bitwise.
  for (const std::string policy : {"keep", "keep,keep,keep,recompute,keep", "swap-input"}) {
    SCOPED_TRACE(policy);
    const auto offload =
        trainAndExport(scriptedCnn({path, "memory.tier=host", "memory.weights=offload",
                                    "memory.policy=" + policy}),
                       tmp / ("offload-" + std::to_string(policy.size())));
    ASSERT_EQ(offload.size(), keep.size());
    for (const auto& [name, t] : keep) EXPECT_TRUE(at::equal(t, offload.at(name))) << name;
  }

  const auto tied =
      trainAndExport(scriptedCnn({"model.path=" + models() + "/tied.pt"}), tmp / "tied");
  for (const char* name : {"b.weight", "b.bias", "c.weight", "c.bias"}) {
    ASSERT_EQ(tied.count(name), 1u) << name;
  }
  EXPECT_TRUE(at::equal(tied.at("b.weight"), tied.at("c.weight")));
}

// Models cut from their graph, through the machinery per block: a scripted CNN, and through
// caravan export (when transformers is there) Hugging Face's ViT, ResNet, GPT-2 (tied) and Llama
// (its context: rotary tables, mask), and nanoGPT's form (tied; its own loss). Recomputing or
// swapping every block, and out-of-core weights, give keep's weights bitwise; for the stock
// models, memory.policy = auto with a budget a third of keep's activations above what persists
// trains within it (the CNN's convolutions are one block, `features`: no plan fits that; for
// ResNet, whose stem is one block, the smallest budget the planner names).
TEST(ScriptModel, CutModelsTrainUnderEveryPolicyOutOfCoreAndABudget) {
  TempDir tmp;
  // (model, file). Exported in the reverse order of PipelineExactness.ModelsCutFromTheirGraph-
  // EqualOneWorker's, which CTest starts at the same time (tests/test_costs.cmake): each test
  // exports half and finds the other half made (test::exportStockModel), instead of one waiting
  // for each export the other makes.
  auto files = test::exportStockModels({"nanogpt", "llama", "gpt2", "mobilenet", "resnet", "vit"});
  files.insert(files.begin(), {"cnn", models() + "/cnn.pt"});
  for (const auto& entry : files) {
    const std::string& model = entry.first;
    const std::string& file = entry.second;
    SCOPED_TRACE(model);
    const std::string dir = tmp / model;
    // stock_models.py's language models read tokens of a vocabulary of 64.
    const bool tokens = model == "gpt2" || model == "llama" || model == "nanogpt";
    const auto run = [&](const std::string& name, std::vector<std::string> more) {
      more.push_back("model.path=" + file);
      more.push_back("memory.tier=host");
      if (tokens) {
        more.insert(more.end(),
                    {"data.synthetic_task=tokens", "data.seq_len=16", "data.vocab_size=64"});
      }
      return trainAndExport(scriptedCnn(more), dir + "-" + name);
    };
    const auto keep = run("keep", {});
    for (const auto& [name, more] : std::vector<std::pair<std::string, std::vector<std::string>>>{
             {"recompute", {"memory.policy=recompute"}},
             {"swap", {"memory.policy=swap"}},
             {"offload", {"memory.weights=offload"}}}) {
      SCOPED_TRACE(name);
      const auto other = run(name, more);
      ASSERT_EQ(other.size(), keep.size());
      for (const auto& [key, t] : keep) EXPECT_TRUE(at::equal(t, other.at(key))) << key;
    }
    const auto summary = [&](const std::string& name) {
      return nlohmann::json::parse(test::readFile(dir + "-" + name + "/summary.json"));
    };
    const int64_t keepPeak = summary("keep").at("tracked_peak_bytes").get<int64_t>();
    const int64_t activations = summary("keep").at("activation_peak_bytes").get<int64_t>();
    ASSERT_GT(activations, 0);
    if (model == "cnn") continue;  // the scripted CNN
    // A third of keep's activations; where the blocks are too coarse for that (ResNet's stem is
    // one block and holds most of them), the smallest budget the planner names, which must fit.
    int64_t budget = keepPeak - 2 * activations / 3;
    try {
      run("auto", {"memory.policy=auto", "memory.budget=" + std::to_string(budget)});
    } catch (const ConfigError& e) {
      std::printf("%s: a third does not fit: %s\n", model.c_str(), e.what());
      budget = test::smallestBudgetNamed(e.what());
      ASSERT_GT(budget, 0);
      EXPECT_EQ(model, "resnet") << "only ResNet's stem is too coarse for a third";
      run("auto", {"memory.policy=auto", "memory.budget=" + std::to_string(budget)});
    }
    const auto s = summary("auto");
    EXPECT_LE(s.at("tracked_peak_bytes").get<int64_t>(), budget) << s;
    std::printf("%s: keep's peak %lld bytes (activations %lld); auto at %lld: %lld, policy %s\n",
                model.c_str(), static_cast<long long>(keepPeak),
                static_cast<long long>(activations), static_cast<long long>(budget),
                static_cast<long long>(s.at("tracked_peak_bytes").get<int64_t>()),
                s.at("memory_policy").get<std::string>().c_str());
  }
}

// The scripted twin of the built-in GPT (the same blocks and parameter names, written in Python)
// trains to the same losses as the built-in GPT from the same weights and batches.
TEST(ScriptModel, GptTwinTrainsLikeTheBuiltInGpt) {
  installSavedTensorEngine();
  const std::vector<std::string> common = {"data.dataset=synthetic", "data.synthetic_task=tokens",
                                           "data.seq_len=24",        "data.batch_size=8",
                                           "train.threads=1",        "optim.name=adamw",
                                           "optim.lr=0.003"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), common.begin(), common.end());
    return Config::fromString("", "<test>", more);
  };
  RunSetup builtIn(with({"model.name=gpt", "model.width=16", "model.depth=2", "model.heads=2"}));
  RunSetup twin(with({"model.name=torchscript", "model.path=" + models() + "/gpt.pt"}));
  ASSERT_EQ(twin.model->numBlocks(), builtIn.model->numBlocks());
  {
    torch::NoGradGuard noGrad;
    auto theirs = builtIn.model->named_parameters();
    for (auto& p : twin.model->named_parameters()) {
      const std::string name = twin.model->exportName(p.key());
      ASSERT_NE(theirs.find(name), nullptr) << name;
      p.value().copy_(theirs[name]);
    }
  }
  Sampler sampler(builtIn.sampler);
  double worst = 0.0;
  DataParallelStep builtInStep(builtIn.model, *builtIn.optimizer, {});
  DataParallelStep twinStep(twin.model, *twin.optimizer, {});
  for (int step = 0; step < 20; ++step) {
    const Batch batch = builtIn.data.train->get(sampler.next());
    const double a = builtInStep.step(batch, step).loss;
    const double b = twinStep.step(batch, step).loss;
    worst = std::max(worst, std::abs(a - b) / std::abs(a));
    EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(a)) << "step " << step + 1;
  }
  std::cout << "scripted twin vs built-in GPT, 20 AdamW steps: max relative loss difference "
            << worst << "\n";
}

// Every memory policy gives the scripted model keep's weights, bitwise; so does its own loss.
TEST(ScriptModel, EveryMemoryPolicyIsBitwiseKeep) {
  TempDir tmp;
  const auto keep = trainAndExport(scriptedCnn({"memory.tier=host"}), tmp / "keep");
  for (const std::string policy : {"recompute", "swap", "swap-input", "keep,recompute,swap"}) {
    SCOPED_TRACE(policy);
    const auto other =
        trainAndExport(scriptedCnn({"memory.tier=host", "memory.policy=" + policy}), tmp / policy);
    ASSERT_EQ(other.size(), keep.size());
    for (const auto& [name, t] : keep) EXPECT_TRUE(at::equal(t, other.at(name))) << name;
  }
}

// Blocks without parameters train (issue 51: "element 0 of tensors does not require grad" from
// the planner's profile, which assumed every block's output carries a gradient): a leading
// Flatten and a ReLU between Linears as their own blocks, the same MLP as a module's `layers`
// (model.blocks = "layers"), and a torch.jit.trace'd MLP. Every memory policy gives keep's
// weights bitwise (recomputing or swapping a block with nothing to differentiate included), and
// caravan plan profiles them (simulate profiles as plan does; the probe runs it too).
TEST(ScriptModel, BlocksWithoutParametersTrainUnderEveryPolicy) {
  TempDir tmp;
  const std::string m = models();
  for (const std::string model :
       {"flatten-first.pt", "flatten-layers.pt --set model.blocks=layers", "traced-mlp.pt"}) {
    SCOPED_TRACE(model);
    const std::string set =
        "--config /dev/null --set data.dataset=synthetic "
        "--set data.synthetic_size=64 --set data.batch_size=8 "
        "--set train.threads=1 --set model.name=torchscript --set model.path=" +
        m + "/" + model;
    const std::string dir = tmp / std::to_string(std::hash<std::string>{}(model));
    const auto r = test::runCaravan("train " + set + " --set train.max_steps=3 --run-dir " + dir);
    ASSERT_EQ(r.exitCode, 0) << r.err;
    EXPECT_TRUE(std::filesystem::exists(dir + "/model.pt"));
    const auto plan = test::runCaravan("plan " + set + " --set memory.budget=64MiB");
    EXPECT_EQ(plan.exitCode, 0) << plan.err;
    EXPECT_NE((plan.out + plan.err).find("predicted: forward+backward"), std::string::npos)
        << plan.out << plan.err;
  }
  const auto mlp = [&](const std::vector<std::string>& more) {
    std::vector<std::string> o = scriptedCnn(more);
    for (std::string& kv : o) {
      if (kv.rfind("model.path=", 0) == 0) kv = "model.path=" + m + "/flatten-first.pt";
    }
    return o;
  };
  const auto keep = trainAndExport(mlp({"memory.tier=host"}), tmp / "keep");
  ASSERT_EQ(keep.size(), 4u);  // two Linears' weights and biases
  for (const std::string policy :
       {"recompute", "swap", "swap-input", "swap-input,recompute,swap,keep"}) {
    SCOPED_TRACE(policy);
    const auto other =
        trainAndExport(mlp({"memory.tier=host", "memory.policy=" + policy}), tmp / policy);
    ASSERT_EQ(other.size(), keep.size());
    for (const auto& [name, t] : keep) EXPECT_TRUE(at::equal(t, other.at(name))) << name;
  }
}

// model.pt loads into the user's own Python class with load_state_dict(strict=True) and holds
// what Caravan trained; a scripted loss(output, target) method is used when asked for.
TEST(ScriptModel, ModelPtLoadsIntoTheUsersClassAndAModuleLossIsUsed) {
  TempDir tmp;
  trainAndExport(scriptedCnn(), tmp / "run");
  const std::string check = "import sys, torch; sys.path.insert(0, '" +
                            std::string(CARAVAN_SOURCE_DIR) +
                            "/tests/python'); import script_models; m = script_models.Cnn(); "
                            "m.load_state_dict(torch.load('" +
                            (tmp / "run/model.pt") +
                            "'), strict=True); "
                            "s = torch.jit.load('" +
                            models() +
                            "/cnn.pt').state_dict(); "
                            "assert any(not torch.equal(v, m.state_dict()[k]) for k, v in "
                            "s.items() if v.is_floating_point())";
  EXPECT_EQ(std::system((std::string(test::kPython) + " -c \"" + check + "\"").c_str()), 0);

  const auto ce =
      trainAndExport(scriptedCnn({"model.path=" + models() + "/cnn-loss.pt"}), tmp / "ce");
  const auto smoothed =
      trainAndExport(scriptedCnn({"model.path=" + models() + "/cnn-loss.pt", "model.loss=module"}),
                     tmp / "smoothed");
  EXPECT_FALSE(at::equal(ce.at("head.2.weight"), smoothed.at("head.2.weight")));
}

// Bad models: one line that says what to do, exit 2, nothing written.
TEST(ScriptModel, BadModelsAreOneLineAndWriteNothing) {
  TempDir tmp;
  test::writeFile(tmp / "text.pt", "not a model\n");
  const std::string m = models();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--set model.path=" + (tmp / "text.pt"), "is not a TorchScript module"},
      {"--set model.path=" + tmp.path(), "is a directory"},
      {"--set model.path=" + (tmp / "none.pt"), "does not exist"},
      // A scripted function loads as a module whose forward is the function.
      {"--set model.path=" + m + "/function.pt", "has no parameters to train (a scripted function"},
      // Mistakes that ended as "internal error (LibTorch)", exit 1 (issue 51): each one line
      // naming the module, what it gave and what Caravan expected.
      {"--set model.path=" + m + "/no-params.pt", "no-params.pt has no parameters to train"},
      {"--set model.path=" + m + "/int-output.pt",
       "int-output.pt: on input [2, 1, 28, 28] Float its forward returns a Tensor [2] Long; "
       "Caravan trains a forward that returns floating-point outputs"},
      {"--set model.path=" + m + "/cnn.pt --set model.loss=mse",
       "cnn.pt: model.loss = 'mse' compares the output with this data's Long targets, [2] Long "
       "on input [2, 1, 28, 28] Float, but the module gives [2, 10] Float"},
      {"--set model.path=" + m + "/loss-vector.pt --set model.loss=module",
       "the loss method of " + m +
           "/loss-vector.pt cannot be the training loss: it returns a "
           "Tensor [2] Float; Caravan expects one floating-point number"},
      {"--set model.path=" + m + "/loss-constant.pt --set model.loss=module",
       "loss-constant.pt cannot be the training loss: its value does not depend on the output"},
      {"--set model.path=" + m + "/loss-one-arg.pt --set model.loss=module",
       "loss-one-arg.pt cannot be the training loss: it takes 1 argument; Caravan calls "
       "loss(output, target)"},
      {"--set model.path=" + m + "/loss-string.pt --set model.loss=module",
       "loss-string.pt cannot be the training loss: it returns String; Caravan expects one "
       "number"},
      {"--set model.path=" + m + "/double.pt", "is Double; Caravan trains float32"},
      // A model from a newer torch (nn.RMSNorm, F.scaled_dot_product_attention on 1.13): the
      // operator and this LibTorch's version (the reason used to print as "()").
      {"--set model.path=" + m + "/newer-op.pt",
       "newer-op.pt calls the operator aten::an_op_of_a_newer_torch, which this LibTorch (" +
           std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR)},
      {"--set model.path=" + m + "/cnn.pt --set model.blocks=nothere",
       "model.blocks = 'nothere': 'nothere' is no submodule with children"},
      {"--set model.path=" + m + "/cnn.pt --set model.blocks=flat",
       "model.blocks = 'flat': 'flat' is no submodule with children"},
      // The items of `head` are called inside head's forward, after the flatten: cut before
      // each, one tensor crosses; a cut at them is fine. Blocks that a forward calls in a loop
      // it cannot unroll, or never, are refused when named.
      {"--set model.path=" + m + "/flatten-layers.pt --set model.blocks=layers,nothere",
       "model.blocks = 'layers,nothere': 'nothere' is no submodule"},
      {"--set model.path=" + m + "/cnn.pt --set data.synthetic_task=tokens",
       "its forward fails on a batch like the data's ([2, 128] Long)"},
      {"--set model.path=" + m +
           "/gpt.pt --set data.synthetic_task=tokens --set data.seq_len=24 "
           "--set data.dataset=synthetic --set model.loss=module",
       "has no loss method"},
      {"--set model.path=" + m + "/cnn.pt --set model.width=8", "has no meaning"},
      {"--set model.path=" + m + "/pair.pt",
       "pair.pt: the module's forward returns Tuple; Caravan trains a forward"},
      {"", "needs model.path"},
  };
  for (const auto& [args, says] : cases) {
    SCOPED_TRACE(args);
    const auto r = test::runCaravan(
        "train --config /dev/null --set data.dataset=synthetic --set model.name=torchscript " +
        args + " --set train.max_steps=1 --run-dir " + (tmp / "run"));
    EXPECT_EQ(r.exitCode, 2) << r.err;
    EXPECT_EQ(test::countLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(says), std::string::npos) << r.err;
    EXPECT_TRUE(!std::filesystem::exists(tmp / "run") || std::filesystem::is_empty(tmp / "run"));
  }
  // What the load-time checks accept: a loss of shape [1] whose third argument has a default.
  const auto lossDefault = test::runCaravan(
      "train -q --config /dev/null --set data.dataset=synthetic --set model.name=torchscript "
      "--set model.path=" +
      m +
      "/loss-default.pt --set model.loss=module --set train.max_steps=2 "
      "--set train.threads=1 --run-dir " +
      (tmp / "default"));
  EXPECT_EQ(lossDefault.exitCode, 0) << lossDefault.err;
  // The model options of a scripted module are refused for the built-in ones.
  const auto r = test::runCaravan(
      "train --config /dev/null --set data.dataset=synthetic "
      "--set model.path=x.pt --run-dir " +
      (tmp / "run"));
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_NE(r.err.find("model.path is for model.name = 'torchscript' only"), std::string::npos)
      << r.err;
}

// Regression on arrays: a scripted linear map trained with mean squared error on targets that a
// linear map makes exactly recovers that map (the closed-form solution), and evaluation reports
// no accuracy (null). Classification-only choices are refused in one line.
TEST(ScriptModel, LearnsTheLinearMapOfRegressionArrays) {
  TempDir tmp;
  std::filesystem::create_directories(tmp / "arrays");
  torch::manual_seed(5);
  const at::Tensor w = torch::tensor({{1.0f, -2.0f, 0.5f, 3.0f}, {0.0f, 1.0f, -1.0f, 2.0f}});
  for (const auto& [split, n] : {std::pair<std::string, int64_t>{"train", 256}, {"test", 64}}) {
    const at::Tensor x = torch::randn({n, 4});
    test::writeNpy(tmp / ("arrays/" + split + "_inputs.npy"), x);
    test::writeNpy(tmp / ("arrays/" + split + "_targets.npy"), x.matmul(w.t()).contiguous());
  }
  const std::vector<std::string> run = {"data.dataset=npy",
                                        "data.path=" + tmp / "arrays",
                                        "data.batch_size=16",
                                        "train.threads=1",
                                        "train.max_steps=300",
                                        "train.eval_every=0",
                                        "optim.name=sgd",
                                        "optim.lr=0.05",
                                        "optim.momentum=0.9",
                                        "model.name=torchscript",
                                        "model.path=" + models() + "/linear.pt"};
  const auto weights = trainAndExport(run, tmp / "run");
  EXPECT_LT((weights.at("0.weight") - w).abs().max().item<double>(), 1e-4);
  std::string evalLine;
  std::istringstream lines(test::readFile(tmp / "run/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    if (line.find("\"kind\":\"eval\"") != std::string::npos) evalLine = line;
  }
  ASSERT_FALSE(evalLine.empty());
  EXPECT_NE(evalLine.find("\"accuracy\":null"), std::string::npos) << evalLine;

  std::string args = "train --config /dev/null --run-dir " + (tmp / "bad");
  for (const auto& set : run) args += " --set " + set;
  for (const auto& [more, says] : std::vector<std::pair<std::string, std::string>>{
           {" --set model.loss=cross_entropy", "needs integer class targets"},
           {" --set model.name=mlp --set model.path=", "no built-in model trains regression"}}) {
    const auto r = test::runCaravan(args + more);
    EXPECT_EQ(r.exitCode, 2) << r.err;
    EXPECT_EQ(test::countLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(says), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(tmp / "bad/metrics.jsonl"));
  }
}
