// Memory accounting (src/memory/): the tracker's arithmetic, size parsing, the metrics a run
// writes, and memory.budget: the smallest budget the error names is exactly the smallest that
// works. (Saved-activation bytes against PyTorch's own saved-tensor hooks: test_oracle.cpp.)
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/errors.h"
#include "core/machine.h"
#include "memory/accounting.h"
#include "memory/planner.h"
#include "memory/saved_tensors.h"
#include "memory/tracker.h"
#include "run_util.h"
#include "test_util.h"
#include "train/memory_setup.h"
#include "train/run_setup.h"
#include "train/trainer.h"

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

// What the machine leaves a process: the smaller of MemAvailable and its cgroup's limit less
// its usage (v2 or v1, the group found where the hierarchy is mounted at the group or an
// ancestor of it, as in containers); v1's "no limit" and v2's "max" are no limit.
TEST(AvailableMemory, TheSmallerOfMemAvailableAndTheCgroupRoom) {
  TempDir tmp;
  const std::string proc = tmp / "proc", cg = tmp / "cg";
  std::filesystem::create_directories(proc + "/self");
  caravan::test::writeFile(proc + "/meminfo",
                           "MemTotal:       24000000 kB\nMemFree:  1000 kB\n"
                           "MemAvailable:    8388608 kB\n");
  auto groupFiles = [](const std::string& dir, const std::string& limitFile,
                       const std::string& limit, const std::string& usageFile, int64_t usage) {
    std::filesystem::create_directories(dir);
    caravan::test::writeFile(dir + "/" + limitFile, limit + "\n");
    caravan::test::writeFile(dir + "/" + usageFile, std::to_string(usage) + "\n");
  };
  // cgroup v2: 1 GiB limit, 256 MiB used.
  caravan::test::writeFile(proc + "/self/cgroup", "0::/jobs/a\n");
  groupFiles(cg + "/jobs/a", "memory.max", std::to_string(1 << 30), "memory.current", 256 << 20);
  auto m = availableMemory(proc, cg);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->bytes, (1 << 30) - (256 << 20));
  EXPECT_EQ(m->cgroupLimit, 1 << 30);
  // "max": MemAvailable (8 GiB).
  groupFiles(cg + "/jobs/a", "memory.max", "max", "memory.current", 256 << 20);
  m = availableMemory(proc, cg);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->bytes, int64_t{8} << 30);
  EXPECT_EQ(m->cgroupLimit, 0);
  // A limit above MemAvailable: MemAvailable.
  groupFiles(cg + "/jobs/a", "memory.max", std::to_string(int64_t{16} << 30), "memory.current", 0);
  EXPECT_EQ(availableMemory(proc, cg)->bytes, int64_t{8} << 30);
  // cgroup v1, mounted at the container's own group: /host/c1/t is found as /t.
  caravan::test::writeFile(proc + "/self/cgroup", "5:cpu:/x\n4:memory:/host/c1/t\n");
  groupFiles(cg + "/memory/t", "memory.limit_in_bytes", std::to_string(512 << 20),
             "memory.usage_in_bytes", 500 << 20);
  m = availableMemory(proc, cg);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->bytes, 12 << 20);
  EXPECT_EQ(m->cgroupLimit, 512 << 20);
  // v1's "no limit" (2^63 rounded to a page) and usage above the limit.
  groupFiles(cg + "/memory/t", "memory.limit_in_bytes", "9223372036854771712",
             "memory.usage_in_bytes", 1);
  EXPECT_EQ(availableMemory(proc, cg)->cgroupLimit, 0);
  groupFiles(cg + "/memory/t", "memory.limit_in_bytes", std::to_string(1 << 20),
             "memory.usage_in_bytes", 2 << 20);
  EXPECT_EQ(availableMemory(proc, cg)->bytes, 0);
  // Nothing readable: no claim.
  EXPECT_FALSE(availableMemory(tmp / "none", tmp / "none").has_value());
}

// ulimit -v (RLIMIT_AS) limits a process's address space: what it leaves is the limit less the
// process's size now (VmSize), and without a limit there is no claim. Checked in a child, whose
// limit is set there (a parent's stays as it was).
TEST(AvailableMemory, AnAddressSpaceLimitLeavesTheLimitLessTheProcessSize) {
  TempDir tmp;
  std::filesystem::create_directories(tmp / "proc/self");
  caravan::test::writeFile(tmp / "proc/self/status",
                           "Name:\tcaravan\nVmPeak:\t 2097152 kB\nVmSize:\t 1048576 kB\n");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    struct rlimit unlimited {
      RLIM_INFINITY, RLIM_INFINITY
    };
    struct rlimit eight {
      rlim_t{8} << 30, RLIM_INFINITY
    };
    int bad = 0;
    if (::setrlimit(RLIMIT_AS, &unlimited) == 0 && addressSpaceLeft(tmp / "proc")) bad |= 1;
    if (::setrlimit(RLIMIT_AS, &eight) != 0) bad |= 2;
    const auto left = addressSpaceLeft(tmp / "proc");
    if (!left || left->limit != int64_t{8} << 30 || left->bytes != int64_t{7} << 30) bad |= 4;
    if (addressSpaceLeft(tmp / "none")) bad |= 8;  // no status file: no claim
    ::_exit(bad);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "bits: 1 unlimited claimed, 2 setrlimit, 4 wrong value, "
                                       "8 claimed without status";
}

// The estimate a run is checked against before it allocates anything large is scaled from a
// few short examples; for every built-in model it is exactly the profile of the whole batch
// at the full length (the oracle: profileModel on the run's own sample batch, timed; the
// estimate's own profile is not, and swapping policies must not depend on it).
TEST(TrainingMemoryEstimate, EqualsTheProfileOfTheWholeBatch) {
  installSavedTensorEngine();  // as train() and caravan plan do before profiling
  const std::vector<std::vector<std::string>> runs = {
      {"model.name=gpt", "data.synthetic_task=tokens", "data.seq_len=200", "data.batch_size=7",
       "model.width=16", "model.depth=2", "model.heads=2"},
      {"model.name=gpt", "data.synthetic_task=tokens", "data.seq_len=40", "data.batch_size=3",
       "model.width=16", "model.depth=2", "model.heads=2", "memory.policy=recompute"},
      {"model.name=cnn", "data.batch_size=9"},
      {"model.name=resnet-mini", "data.batch_size=6", "memory.policy=recompute"},
      {"model.name=mlp", "data.batch_size=5", "model.width=32"},
      {"model.name=gpt", "data.synthetic_task=tokens", "data.seq_len=40", "data.batch_size=3",
       "model.width=16", "model.depth=3", "model.heads=2", "memory.policy=swap"},
      {"model.name=cnn", "data.batch_size=9", "memory.policy=swap-input"},
  };
  for (std::vector<std::string> overrides : runs) {
    std::string trace;
    for (const auto& o : overrides) trace += o + " ";
    SCOPED_TRACE(trace);
    for (const char* common :
         {"data.dataset=synthetic", "data.synthetic_size=64", "train.threads=1"}) {
      overrides.emplace_back(common);
    }
    const Config config = Config::fromString("", "<test>", overrides);
    RunSetup setup(config);
    setup.model->train();
    const Batch sample = setup.sampleBatch();
    const int64_t seqLen = setup.data.train->shape().seqLen;
    const auto estimate = estimateTrainingMemory(setup.options, setup.model, sample, seqLen);
    ASSERT_TRUE(estimate.has_value());
    const ModelProfile whole = profileModel(setup.model, sample, 1);
    const auto policies =
        parsePolicies(setup.options.memory.policy, setup.model->numBlocks(), "memory.policy");
    const double inf = std::numeric_limits<double>::infinity();
    const int64_t oracle = predict(whole, policies, TierBandwidth{inf, inf},
                                   static_cast<int>(setup.options.memory.prefetch))
                               .peakBytes;
    EXPECT_GT(oracle, 0);
    if (setup.options.memory.policy != "keep") {  // swapping or recomputing holds less
      const std::vector<BlockPolicy> keep(policies.size(), BlockPolicy::kKeep);
      EXPECT_LT(oracle, predict(whole, keep, TierBandwidth{inf, inf}, 1).peakBytes);
    }
    EXPECT_EQ(estimate->activations, oracle);
    EXPECT_EQ(estimate->persistent,
              persistentBytes(setup.options, setup.model, weightOptions(setup.options)));
  }
}

// A run the machine cannot hold is refused before it allocates it, with the estimate and what
// to lower (the GPT at a 65536-token context used to grow to 23 GB and be killed).
TEST(TrainingMemoryEstimate, ARunTooLargeForTheMachineIsRefusedBeforeItAllocates) {
  if (!availableMemory()) GTEST_SKIP() << "no /proc/meminfo";
  installSavedTensorEngine();
  const Config config = Config::fromString(
      "", "<test>",
      {"data.dataset=synthetic", "data.synthetic_task=tokens", "data.seq_len=65536",
       "data.synthetic_size=2", "data.batch_size=2", "model.name=gpt", "model.width=32",
       "model.depth=2", "model.heads=4", "train.threads=1"});
  RunSetup setup(config);
  try {
    setup.prepareTraining(std::nullopt);
    ADD_FAILURE() << "accepted";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    for (const char* part : {"this run needs at least", "data.seq_len = 65536", "more than the",
                             "lower data.batch_size or data.seq_len"}) {
      EXPECT_NE(what.find(part), std::string::npos) << part << " in: " << what;
    }
  }
}

// The smallest budget a refusal suggests, read back as a size, is at least the bytes it stands
// for (3284143 bytes was shown as "3.1 MiB", and 3.1MiB was refused again).
TEST(MemoryAccounting, ASuggestedSizeReadsBackAsAtLeastItsBytes) {
  EXPECT_EQ(formatBytesAtLeast(3284143), "3.2 MiB");
  EXPECT_EQ(formatBytes(3284143), "3.1 MiB");
  EXPECT_EQ(formatBytesAtLeast(1048570), "1.0 MiB");  // not "1024.0 KiB"
  for (int64_t b : {int64_t{1}, int64_t{1023}, int64_t{1025}, int64_t{3284143}, int64_t{1} << 20,
                    (int64_t{5} << 30) + 1, int64_t{123456789012}}) {
    std::string text = formatBytesAtLeast(b);
    text.erase(std::remove(text.begin(), text.end(), ' '), text.end());
    EXPECT_GE(parseBytes(text, "memory.budget"), b) << text;
  }
}

TEST(MemoryAccounting, ParsesSizes) {
  EXPECT_EQ(parseBytes("", "k"), 0);
  EXPECT_EQ(parseBytes("2GiB", "k"), int64_t{2} << 30);
  EXPECT_EQ(parseBytes("512 MiB", "k"), int64_t{512} << 20);
  EXPECT_EQ(parseBytes("1.5k", "k"), 1536);
  EXPECT_EQ(parseBytes("1000", "k"), 1000);
  // Also what the hostile-input probe found accepted: past 2^60 bytes (it overflowed to 0, no
  // limit), hexadecimal, under one byte.
  for (const char* bad : {"lots", "2 parsecs", "-1GiB", "GiB", "99999999999999999999GiB",
                          "18446744073709551616", "0x10GiB", "0.4"}) {
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
  std::string smallest;
  try {
    train(gptBudgetConfig({"memory.budget=64KiB", "memory.policy=auto"}), o);
    ADD_FAILURE() << "a 64 KiB budget was accepted";
  } catch (const ConfigError& e) {
    const int64_t named = test::smallestBudgetNamed(e.what());
    ASSERT_GT(named, 0);
    smallest = std::to_string(named);
  }
  EXPECT_FALSE(std::filesystem::exists(tmp / "tiny/metrics.jsonl"))
      << "a run that cannot fit started training";
  // The budget the refusal names is one the planner accepts (it plans to a margin below it).
  o.runDir = tmp / "smallest";
  EXPECT_NO_THROW(train(gptBudgetConfig({"memory.budget=" + smallest, "memory.policy=auto"}), o));
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
