// Memory accounting (src/memory/): the tracker's arithmetic, size parsing, the metrics a run
// writes, and memory.budget: the smallest budget the error names is exactly the smallest that
// works. (Saved-activation bytes against PyTorch's own saved-tensor hooks: test_oracle.cpp.)
#include <gtest/gtest.h>

#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/errors.h"
#include "memory/accounting.h"
#include "memory/tracker.h"
#include "train/trainer.h"
#include "run_util.h"
#include "test_util.h"

using namespace caravan;
using caravan::test::TempDir;

TEST(MemoryTracker, LiveAndPeakByCategoryAndInTotal) {
  MemoryTracker m;
  m.set(MemoryCategory::kWeights, 100);
  m.add(MemoryCategory::kActivations, 40);
  m.add(MemoryCategory::kActivations, 60);
  m.add(MemoryCategory::kActivations, -70);
  EXPECT_EQ(m.live(MemoryCategory::kActivations), 30);
  EXPECT_EQ(m.peak(MemoryCategory::kActivations), 100);
  EXPECT_EQ(m.totalLive(), 130);
  EXPECT_EQ(m.totalPeak(), 200);
  m.set(MemoryCategory::kWeights, 50);  // a measured total replaces the live value
  EXPECT_EQ(m.totalLive(), 80);
  EXPECT_EQ(m.peak(MemoryCategory::kWeights), 100);
  m.resetPeaks();
  EXPECT_EQ(m.peak(MemoryCategory::kActivations), 30);
  EXPECT_EQ(m.totalPeak(), 80);
}

TEST(MemoryAccounting, ParsesSizes) {
  EXPECT_EQ(parseBytes("", "k"), 0);
  EXPECT_EQ(parseBytes("2GiB", "k"), int64_t{2} << 30);
  EXPECT_EQ(parseBytes("512 MiB", "k"), int64_t{512} << 20);
  EXPECT_EQ(parseBytes("1.5k", "k"), 1536);
  EXPECT_EQ(parseBytes("1000", "k"), 1000);
  for (const char* bad : {"lots", "2 parsecs", "-1GiB", "GiB"}) {
    try {
      parseBytes(bad, "memory.budget");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("memory.budget"), std::string::npos) << e.what();
    }
  }
}

namespace {

Config budgetConfig(const std::string& budget) {
  return Config::fromString("", "<test>",
                            {"data.dataset=synthetic", "data.synthetic_size=64",
                             "data.batch_size=16", "train.max_steps=4", "train.log_every=1",
                             "train.threads=1", "model.name=mlp", "model.width=32",
                             "optim.name=sgd", "optim.momentum=0.9", "memory.budget=" + budget});
}

}  // namespace

// A run reports its tracked memory; a budget below it stops the run with the smallest budget
// that works, in bytes; that budget works and one byte less does not.
TEST(MemoryBudget, NamesTheSmallestBudgetThatWorks) {
  TempDir tmp;
  TrainerOptions o;
  o.quiet = true;
  o.runDir = tmp / "free";
  train(budgetConfig(""), o);
  std::istringstream lines(test::readFile(tmp / "free/metrics.jsonl"));
  int64_t steadyPeak = 0;
  for (std::string line; std::getline(lines, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] != "train") continue;
    EXPECT_GT(j.at("mem_activations_peak").get<int64_t>(), 0) << j;
    EXPECT_GT(j.at("mem_weights").get<int64_t>(), 0) << j;
    EXPECT_GT(j.at("rss_bytes").get<int64_t>(), 0) << j;
    EXPECT_EQ(j.at("mem_gradients").get<int64_t>(), j.at("mem_weights").get<int64_t>()) << j;
    // SGD with momentum: one buffer per parameter after the first step.
    EXPECT_EQ(j.at("mem_optimizer_state").get<int64_t>(), j.at("mem_weights").get<int64_t>());
    steadyPeak = std::max(steadyPeak, j.at("mem_tracked_peak").get<int64_t>());
  }
  ASSERT_GT(steadyPeak, 0);

  o.runDir = tmp / "tiny";
  std::string message;
  try {
    train(budgetConfig("1KiB"), o);
  } catch (const ConfigError& e) {
    message = e.what();
  }
  std::smatch m;
  ASSERT_TRUE(std::regex_search(message, m, std::regex("smallest budget .* \\((\\d+) bytes")))
      << message;
  const int64_t smallest = std::stoll(m[1]);
  EXPECT_EQ(smallest, steadyPeak) << message;

  o.runDir = tmp / "exact";
  EXPECT_NO_THROW(train(budgetConfig(std::to_string(smallest)), o));
  o.runDir = tmp / "short";
  EXPECT_THROW(train(budgetConfig(std::to_string(smallest - 1)), o), ConfigError);
}

namespace {

Config gptBudgetConfig(const std::vector<std::string>& extra) {
  std::vector<std::string> o = {"data.dataset=synthetic", "data.synthetic_task=tokens",
                                "data.seq_len=32", "data.synthetic_size=64", "data.batch_size=16",
                                "train.max_steps=3", "train.log_every=1", "train.threads=1",
                                "model.name=gpt", "model.width=32", "model.depth=4",
                                "model.heads=2", "optim.name=sgd", "memory.profile_repeats=1"};
  o.insert(o.end(), extra.begin(), extra.end());
  return Config::fromString("", "<test>", o);
}

nlohmann::json summaryOf(const std::string& runDir) {
  return nlohmann::json::parse(test::readFile(runDir + "/summary.json"));
}

}  // namespace

// memory.policy = auto fits a budget that `keep` cannot: the tracked peak of the whole run
// stays under it. Below what any plan needs, the run refuses to start and says what would fit.
TEST(MemoryBudget, AutoPlanKeepsTheTrackedPeakUnderABudgetKeepExceeds) {
  TempDir tmp;
  TrainerOptions o;
  o.quiet = true;
  o.runDir = tmp / "keep";
  train(gptBudgetConfig({}), o);
  const int64_t keepPeak = summaryOf(o.runDir).at("tracked_peak_bytes").get<int64_t>();
  const int64_t activations = summaryOf(o.runDir).at("activation_peak_bytes").get<int64_t>();
  ASSERT_GT(activations, 0);
  // Half of keep's activations on top of what persists.
  const int64_t budget = keepPeak - activations / 2;

  o.runDir = tmp / "keep-budget";
  try {
    train(gptBudgetConfig({"memory.budget=" + std::to_string(budget)}), o);
    ADD_FAILURE() << "keep fitted a budget below its own peak";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("memory.policy = auto"), std::string::npos) << e.what();
  }

  o.runDir = tmp / "auto";
  train(gptBudgetConfig({"memory.budget=" + std::to_string(budget), "memory.policy=auto"}), o);
  const nlohmann::json s = summaryOf(o.runDir);
  EXPECT_LE(s.at("tracked_peak_bytes").get<int64_t>(), budget) << s;
  EXPECT_NE(s.at("memory_policy").get<std::string>().find_first_of("rs"), std::string::npos)
      << "the plan under a budget keep exceeds kept every block: " << s;
  EXPECT_GT(s.at("predicted_fwd_bwd_s").get<double>(), 0.0) << s;
  EXPECT_TRUE(std::filesystem::exists(o.runDir + "/memory_plan.txt"));

  o.runDir = tmp / "tiny";
  try {
    train(gptBudgetConfig({"memory.budget=64KiB", "memory.policy=auto"}), o);
    ADD_FAILURE() << "a 64 KiB budget was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("smallest budget the planner can fit"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(tmp / "tiny/metrics.jsonl"))
      << "a run that cannot fit started training";
}


// Through the whole trainer, with dropout: swap, recompute and an auto plan (whose start-up
// probes the tier and profiles the blocks) give keep's losses exactly, step by step. Nothing
// at start-up may draw from the generator dropout uses.
TEST(MemoryBudget, EveryPolicyTrainsLikeKeepWithDropout) {
  TempDir tmp;
  TrainerOptions o;
  o.quiet = true;
  o.runDir = tmp / "keep";
  train(gptBudgetConfig({"model.dropout=0.1", "train.max_steps=4"}), o);
  const std::vector<double> keep = test::trainLosses(o.runDir);
  ASSERT_EQ(keep.size(), 4u);
  const int64_t activations = summaryOf(o.runDir).at("activation_peak_bytes").get<int64_t>();
  const int64_t tracked = summaryOf(o.runDir).at("tracked_peak_bytes").get<int64_t>();
  const std::vector<std::vector<std::string>> variants = {
      {"memory.policy=swap"},
      {"memory.policy=recompute"},
      {"memory.policy=auto", "memory.budget=" + std::to_string(tracked - activations / 2)}};
  for (size_t v = 0; v < variants.size(); ++v) {
    std::vector<std::string> sets = {"model.dropout=0.1", "train.max_steps=4"};
    sets.insert(sets.end(), variants[v].begin(), variants[v].end());
    o.runDir = tmp / ("v" + std::to_string(v));
    train(gptBudgetConfig(sets), o);
    EXPECT_EQ(test::trainLosses(o.runDir), keep) << variants[v][0];
  }
}
