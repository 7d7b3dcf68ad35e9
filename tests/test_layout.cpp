// The layout search (sim/layout.h): which ways it searches, that its prediction for a layout is
// the simulator's for that job, that its memory is the planner's and the simulator's accounting
// (closed forms for keep), and that what it chooses is the fastest that fits.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <string>

#include "core/errors.h"
#include "sim/cluster.h"
#include "sim/layout.h"
#include "sim/simulator.h"
#include "sync/parameter_server.h"

using namespace caravan;
using namespace caravan::sim;

namespace {

// Four blocks of 20 ms forward and 40 ms backward, 4 MB of parameters and 2 MB saved each (the
// planner's profile), AdamW's state (2 bytes per weight byte), batch 16.
Workload fourBlocks() {
  Workload w;
  w.model = "test";
  w.batchPerWorker = 16;
  w.forwardSeconds.assign(4, 0.020);
  w.backwardSeconds.assign(4, 0.040);
  w.parameterBytes.assign(4, 4000000);
  w.inputBytes.assign(4, 500000);
  w.lossSeconds = 0.004;
  w.updateSeconds = 0.008;
  w.optimizerStateBytes = 2 * 16000000;
  w.planner.measured = true;
  w.planner.savedBytes.assign(4, 2000000);
  w.planner.keepBackwardSeconds = w.backwardSeconds;
  w.planner.lossSavedBytes = 100000;
  w.activationPeakBytes = 4 * 2000000 + 100000;
  return w;
}

ClusterSpec hosts(int n, double mbit) {
  ClusterSpec c;
  c.hosts = n;
  c.coresPerHost = 1;
  c.linkBitsPerSecond = mbit * 1e6;
  return c;
}

std::set<std::string> labels(const std::vector<RunOptions>& jobs) {
  std::set<std::string> out;
  for (const RunOptions& j : jobs) out.insert(label(j));
  return out;
}

}  // namespace

TEST(Layout, SearchesEachStageCountDividingTheWorkersUpToTheBlocks) {
  LayoutSpace space;
  space.workers = 4;
  // Three blocks: K = 1 or 2 (4 stages would exceed them); batch 8: M in {2, 4, 8} for K = 2.
  const std::set<std::string> expected = {"allreduce",
                                          "allreduce+shard(optimizer)",
                                          "allreduce+shard(gradients)",
                                          "allreduce+shard(parameters)",
                                          "allreduce+offload",
                                          "allreduce+pipeline(2x2)",
                                          "allreduce+pipeline(2x4)",
                                          "allreduce+pipeline(2x8)"};
  EXPECT_EQ(labels(layoutCandidates(RunOptions{}, space, 3, 8)), expected);
  // Batch 6: only M = 2 divides it.
  std::set<std::string> six = expected;
  six.erase("allreduce+pipeline(2x4)");
  six.erase("allreduce+pipeline(2x8)");
  EXPECT_EQ(labels(layoutCandidates(RunOptions{}, space, 3, 6)), six);
  // One worker: neither sharding nor stages of a pipeline.
  space.workers = 1;
  EXPECT_EQ(labels(layoutCandidates(RunOptions{}, space, 3, 8)),
            (std::set<std::string>{"allreduce", "allreduce+offload"}));
}

TEST(Layout, AsynchronousModesOnlyWhenTheUserOptsIn) {
  LayoutSpace space;
  space.workers = 2;
  RunOptions servers;
  servers.sync.mode = SyncMode::kPsBsp;
  servers.sync.servers = 1;
  EXPECT_EQ(labels(layoutCandidates(servers, space, 4, 8)), (std::set<std::string>{"ps-bsp"}));
  RunOptions plain;
  const std::set<std::string> bsp = labels(layoutCandidates(plain, space, 4, 8));
  EXPECT_EQ(bsp.count("local-sgd(H=4)") + bsp.count("gossip"), 0u);
  space.sync = LayoutSync::kAny;
  const std::set<std::string> any = labels(layoutCandidates(plain, space, 4, 8));
  EXPECT_EQ(any.count("local-sgd(H=4)"), 1u);
  EXPECT_EQ(any.count("gossip"), 1u);
  const std::set<std::string> anyServers = labels(layoutCandidates(servers, space, 4, 8));
  EXPECT_EQ(anyServers, (std::set<std::string>{"ps-bsp", "ps-asp", "ps-ssp(3)", "osp(auto)"}));
  EXPECT_THROW(parseLayoutSync("async"), ConfigError);
}

TEST(Layout, WithoutALimitEachPredictionIsTheSimulatorsAndTheFastestIsChosen) {
  const Workload w = fourBlocks();
  LayoutSpace space;
  space.workers = 4;
  for (double mbit : {1000.0, 10.0}) {
    const ClusterSpec c = hosts(4, mbit);
    const LayoutSearch s = searchLayouts(w, RunOptions{}, c, space);
    ASSERT_FALSE(s.ranked.empty());
    EXPECT_EQ(s.memoryLimit, 0);
    for (const LayoutChoice& l : s.ranked) {
      EXPECT_TRUE(l.fits) << l.name;
      // Every block keeps: the workload as profiled, simulated as the job.
      const SimResult r = simulate(w, l.job, c, SimOptions{4, space.steps, 1});
      EXPECT_DOUBLE_EQ(l.predicted.samplesPerSecond, r.samplesPerSecond) << l.name;
      EXPECT_EQ(l.policy, "4 keep") << l.name;
    }
    for (size_t i = 1; i < s.ranked.size(); ++i) {
      const LayoutChoice &a = s.ranked[i - 1], &b = s.ranked[i];
      EXPECT_GE(a.predicted.samplesPerSecond, b.predicted.samplesPerSecond);
      // Equal predictions (ZeRO-1 and ZeRO-2 send the same bytes): less memory first.
      if (a.predicted.samplesPerSecond == b.predicted.samplesPerSecond) {
        EXPECT_LE(a.memoryBytes, b.memoryBytes) << a.name << " before " << b.name;
      }
    }
    ASSERT_NE(s.best(), nullptr);
    EXPECT_EQ(s.best(), &s.ranked.front());
  }
}

TEST(Layout, MemoryWithEveryBlockKeptIsTheModelStatePlusTheSavedActivations) {
  const Workload w = fourBlocks();
  LayoutSpace space;
  space.workers = 4;
  const LayoutSearch s = searchLayouts(w, RunOptions{}, hosts(4, 1000), space);
  const int64_t p = 16000000, saved = 4 * 2000000 + 100000;
  auto find = [&](const std::string& name) -> const LayoutChoice& {
    const auto it = std::find_if(s.ranked.begin(), s.ranked.end(),
                                 [&](const LayoutChoice& c) { return c.name == name; });
    EXPECT_NE(it, s.ranked.end()) << name;
    return *it;
  };
  // Plain data parallelism: weights, gradients, AdamW's two moments, every activation.
  EXPECT_EQ(find("allreduce").memoryBytes, 4 * p + saved);
  // ZeRO-2 over 4: weights whole, gradients and state a quarter each.
  EXPECT_EQ(find("allreduce+shard(gradients)").memoryBytes, p + p / 4 + 2 * p / 4 + saved);
  // Two stages of two blocks (the run's partition of equal blocks), 1F1B with 4 micro-batches:
  // stage 0 holds 2 micro-batches in flight of its blocks' saves, stage 1 one; each its half of
  // the state. The cut is the layout's parallel.partition.
  const int64_t stageState = 4 * p / 2;
  const int64_t stage0 = stageState + 2 * (2 * 2000000 / 4);
  const LayoutChoice& oneF = find("allreduce+pipeline(2x4)");
  EXPECT_EQ(oneF.memoryBytes, stage0);
  EXPECT_EQ(oneF.job.pipeline.partition, "2");
  EXPECT_NE(std::find(oneF.keys.begin(), oneF.keys.end(), "parallel.partition=\"2\""),
            oneF.keys.end());
  // GPipe holds all four.
  RunOptions gpipe;
  gpipe.pipeline.schedule = PipelineSchedule::kGPipe;
  const LayoutSearch g = searchLayouts(w, gpipe, hosts(4, 1000), space);
  const auto it = std::find_if(g.ranked.begin(), g.ranked.end(), [](const LayoutChoice& c) {
    return c.name == "allreduce+pipeline(2x4)";
  });
  ASSERT_NE(it, g.ranked.end());
  EXPECT_EQ(it->memoryBytes, stageState + 4 * (2 * 2000000 / 4));
}

TEST(Layout, UnderABudgetTheChosenFitsAndTheKeysLetThePlannerFitIt) {
  const Workload w = fourBlocks();
  LayoutSpace space;
  space.workers = 4;
  RunOptions own;
  // Plain all-reduce needs 64 MB of state and 8.1 MB of activations: 68 MB leaves the planner
  // 4 MB for them; ZeRO-2 (28 MB of state) keeps everything.
  own.memory.budget = 68000000;
  const LayoutSearch s = searchLayouts(w, own, hosts(4, 1000), space);
  EXPECT_EQ(s.memoryLimit, own.memory.budget);
  ASSERT_NE(s.best(), nullptr);
  for (const LayoutChoice& c : s.ranked) {
    if (c.fits) {
      EXPECT_LE(c.memoryBytes, own.memory.budget) << c.name;
      EXPECT_LE(c.leastMemoryBytes, own.memory.budget) << c.name;  // the smallest it fits
    }
  }
  const auto plain = std::find_if(s.ranked.begin(), s.ranked.end(),
                                  [](const LayoutChoice& c) { return c.name == "allreduce"; });
  ASSERT_NE(plain, s.ranked.end());
  ASSERT_TRUE(plain->fits);
  EXPECT_NE(plain->policy, "4 keep");  // the planner recomputes or swaps some blocks
  // Recomputing costs time the simulation sees.
  EXPECT_GT(plain->predicted.stepSeconds,
            simulate(w, plain->job, hosts(4, 1000), SimOptions{4, space.steps, 1}).stepSeconds);
  EXPECT_NE(std::find(plain->keys.begin(), plain->keys.end(), "memory.policy=\"auto\""),
            plain->keys.end());
  // A budget below every layout's state: nothing fits, and the least memory comes first.
  own.memory.budget = 1000000;
  const LayoutSearch none = searchLayouts(w, own, hosts(4, 1000), space);
  EXPECT_EQ(none.best(), nullptr);
  for (size_t i = 1; i < none.ranked.size(); ++i) {
    EXPECT_FALSE(none.ranked[i].fits);
    EXPECT_LE(none.ranked[i - 1].leastMemoryBytes, none.ranked[i].leastMemoryBytes);
  }
}

TEST(Layout, AClusterHoldsAsManyProcessesAsItsCoresRunAtTheThreads) {
  ClusterSpec c = hosts(4, 1000);
  c.coresPerHost = 2;
  EXPECT_EQ(clusterCapacity(c, 1), 8);
  EXPECT_EQ(clusterCapacity(c, 2), 4);
  EXPECT_EQ(clusterCapacity(c, 4), 4);  // one process per host at least
  c.coresPerHost = 0.5;                 // a CPU share
  EXPECT_EQ(clusterCapacity(c, 1), 4);
}

TEST(Layout, AWorkloadWithoutThePlannersProfileIsRefused) {
  Workload w = fourBlocks();
  w.planner = {};
  LayoutSpace space;
  EXPECT_THROW(searchLayouts(w, RunOptions{}, hosts(1, 1000), space), ConfigError);
}

// train.precision = bf16 (the run chooses per block): the search lays the job out in each
// profiled precision, each layout predicted as the simulator predicts its profile, and chooses
// bf16 where its profile is faster (a CPU with bf16 instructions) and float32 where it is slower
// (one that emulates it).
TEST(Layout, Bf16IsSearchedBesideFloat32AsItsOwnProfilePredicts) {
  const Workload f32 = fourBlocks();
  LayoutSpace space;
  space.workers = 4;
  const ClusterSpec c = hosts(4, 1000);
  const LayoutSearch alone = searchLayouts(f32, RunOptions{}, c, space);
  for (const double factor : {0.5, 2.0}) {
    Workload b16 = f32;
    for (double& t : b16.forwardSeconds) t *= factor;
    for (double& t : b16.backwardSeconds) t *= factor;
    b16.planner.keepBackwardSeconds = b16.backwardSeconds;
    for (int64_t& b : b16.planner.savedBytes) b /= 2;
    const LayoutSearch both =
        searchLayouts({{b16, "bf16"}, {f32, "float32"}}, RunOptions{}, c, space);
    ASSERT_EQ(both.ranked.size(), 2 * alone.ranked.size());
    for (const LayoutChoice& choice : both.ranked) {
      const bool isBf16 =
          choice.name.size() > 5 && choice.name.substr(choice.name.size() - 5) == "+bf16";
      const std::string precision = isBf16 ? "bf16" : "float32";
      ASSERT_EQ(choice.name.substr(choice.name.size() - precision.size() - 1), "+" + precision);
      EXPECT_EQ(std::count(choice.keys.begin(), choice.keys.end(), "train.precision=" + precision),
                1)
          << choice.name;
      EXPECT_EQ(choice.job.runtime.precision, precision);
      const LayoutSearch own = searchLayouts(isBf16 ? b16 : f32, RunOptions{}, c, space);
      const std::string base = choice.name.substr(0, choice.name.size() - precision.size() - 1);
      const auto same = std::find_if(own.ranked.begin(), own.ranked.end(),
                                     [&](const LayoutChoice& o) { return o.name == base; });
      ASSERT_NE(same, own.ranked.end()) << choice.name;
      EXPECT_EQ(choice.predicted.stepSeconds, same->predicted.stepSeconds) << choice.name;
      EXPECT_EQ(choice.memoryBytes, same->memoryBytes) << choice.name;
    }
    ASSERT_NE(both.best(), nullptr);
    const std::string want = factor < 1.0 ? "+bf16" : "+float32";
    EXPECT_EQ(both.best()->name.substr(both.best()->name.size() - want.size()), want);
  }
}
