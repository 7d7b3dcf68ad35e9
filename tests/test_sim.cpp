// caravan simulate's model (sim/simulator.h) against closed forms: each mode's step time where
// the event model's answer can be written down by hand, and the cluster file's parsing; the
// all-reduce's buckets (sync/buckets.h) by hand and against AllReduceStrategy's own; the
// workload file's formats; --recommend's candidates and ranking (sim/recommend.h).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "comm/comm_util.h"
#include "core/config.h"
#include "core/errors.h"
#include "memory/accounting.h"
#include "models/model.h"
#include "pipeline/schedule.h"
#include "sim/cluster.h"
#include "sim/recommend.h"
#include "sim/simulator.h"
#include "sim/workload.h"
#include "sync/allreduce.h"
#include "sync/buckets.h"
#include "train/setup.h"

using namespace caravan;
using namespace caravan::sim;

namespace {

// One block: forward 30 ms, backward 60 ms, loss 10 ms, update 5 ms, 8 MB of parameters.
Workload oneBlock() {
  Workload w;
  w.model = "test";
  w.batchPerWorker = 32;
  w.forwardSeconds = {0.030};
  w.backwardSeconds = {0.060};
  w.lossSeconds = 0.010;
  w.updateSeconds = 0.005;
  w.parameterBytes = {8000000};
  w.inputBytes = {1000000};
  w.optimizerStateBytes = 8000000;
  w.activationPeakBytes = 4000000;
  return w;
}

// oneBlock's totals over blocks of these forward and backward times, parameter and input bytes.
Workload blocks(std::vector<double> forward, std::vector<double> backward,
                std::vector<int64_t> parameters, std::vector<int64_t> inputs) {
  Workload w = oneBlock();
  w.forwardSeconds = std::move(forward);
  w.backwardSeconds = std::move(backward);
  w.parameterBytes = std::move(parameters);
  w.inputBytes = std::move(inputs);
  return w;
}

// Hosts with a core each, 100 Mbit/s links (12.5 MB/s at efficiency 1), 100 us per message.
ClusterSpec hosts(int n) {
  ClusterSpec c;
  c.hosts = n;
  c.coresPerHost = 1;
  c.linkBitsPerSecond = 100e6;
  c.latencySeconds = 100e-6;
  return c;
}

constexpr double kRel = 1e-12;

// A job synchronising by `mode`, as RunOptions::read makes it: one server where the mode has
// servers, the mode's consistency for ps-bsp/asp/ssp; every other option the run's default.
RunOptions job(SyncMode mode) {
  RunOptions o;
  o.sync.mode = mode;
  o.sync.servers = usesServers(mode) ? 1 : 0;
  if (isConsistencyMode(mode)) o.sync.ps = psOptions(mode, o.sync.ps.staleness);
  return o;
}

// All-reduce between replicas of two pipeline stages, GPipe, one micro-batch.
RunOptions gpipeOfTwoStages() {
  RunOptions s = job(SyncMode::kAllReduce);
  s.pipeline.stages = 2;
  s.pipeline.microBatches = 1;
  s.pipeline.schedule = PipelineSchedule::kGPipe;
  return s;
}

// Two hosts on one shared core, the links free (nothing to transfer to speak of).
ClusterSpec twoHostsOnOneCore() {
  ClusterSpec c = hosts(2);
  c.sharedCores = 1;
  c.latencySeconds = 0;
  c.linkBitsPerSecond = 1e15;
  return c;
}

}  // namespace

TEST(Simulate, AllReduceOfOneBucketIsTheRingAfterBackward) {
  const Workload w = oneBlock();
  const ClusterSpec c = hosts(4);
  RunOptions s = job(SyncMode::kAllReduce);  // the one block's 8 MB are one bucket
  const SimResult r = simulate(w, s, c, {4, 10, 1});
  const double beta = 100e6 / 8;
  const double ring = 2.0 * 3 * (100e-6 + 8e6 / 4 / beta);
  const double step = 0.100 + ring + 0.005;
  EXPECT_NEAR(r.stepSeconds, step, step * kRel);
  EXPECT_NEAR(r.bytesSentPerStep, 2.0 * 3 / 4 * 8e6, 1e-3);
  EXPECT_NEAR(r.samplesPerSecond, 4 * 32 / step, 1e-9);
  // Efficiency: one worker alone steps in 105 ms.
  EXPECT_NEAR(r.scalingEfficiency, 0.105 / step, 1e-12);
  EXPECT_EQ(r.memoryPeakBytes, 2 * 8000000 + 8000000 + 4000000);
}

TEST(Simulate, AllReduceBucketsOverlapTheRestOfBackward) {
  // Two blocks of 4 MB: block 1's bucket leaves while block 0's backward runs.
  const Workload w = blocks({0.015, 0.015}, {0.030, 0.030}, {4000000, 4000000}, {1000000, 1000000});
  RunOptions s = job(SyncMode::kAllReduce);
  s.sync.allreduce.firstBucketBytes = 1;
  s.sync.allreduce.bucketBytes = 1;
  const ClusterSpec c = hosts(2);
  const double beta = 100e6 / 8;
  const double ring = 2.0 * (100e-6 + 4e6 / 2 / beta);  // 0.3202 s: longer than a block
  // Bucket 1 ready at 0.010 + 0.030 + 0.030 = 0.070; bucket 0 at 0.100 but waits for bucket 1.
  const double step = 0.070 + 2 * ring + 0.005;
  const SimResult r = simulate(w, s, c, {2, 3, 1});
  EXPECT_NEAR(r.stepSeconds, step, step * kRel);
}

TEST(Simulate, PsBspOnOneServerQueuesEveryPushAndPullOnItsLink) {
  const Workload w = oneBlock();
  RunOptions s = job(SyncMode::kPsBsp);
  s.sync.servers = 1;
  const ClusterSpec c = hosts(5);  // 4 workers and the server on hosts of their own
  const SimResult r = simulate(w, s, c, {4, 1, 1});
  const double one = 100e-6 + 8e6 / (100e6 / 8);
  // Pushes arrive one after the other, the server updates, the pulls leave one after the other.
  const double wall = 0.100 + 4 * one + 0.005 + 4 * one;
  EXPECT_NEAR(r.stepSeconds, wall, wall * kRel);
  EXPECT_EQ(r.memoryPeakBytes, 2 * 8000000 + 4000000);  // the server holds the optimizer state
  EXPECT_NE(r.placement.find("own"), std::string::npos) << r.placement;
}

TEST(Simulate, OspAtFractionOneIsPsBsp) {
  const Workload w = oneBlock();
  RunOptions bsp = job(SyncMode::kPsBsp);
  RunOptions osp = job(SyncMode::kOsp);
  osp.sync.osp.fraction = 1.0;
  ClusterSpec c = hosts(5);
  c.stragglerCv = 0.3;
  const SimResult a = simulate(w, bsp, c, {4, 20, 7});
  const SimResult b = simulate(w, osp, c, {4, 20, 7});
  EXPECT_DOUBLE_EQ(a.stepSeconds, b.stepSeconds);
  EXPECT_DOUBLE_EQ(a.bytesSentPerStep, b.bytesSentPerStep);
}

TEST(Simulate, OspHidesStageTwoBehindTheNextStepsCompute) {
  // One worker, one server: stage 2's round trip (two transfers of 0.3201 s at f = 0.5, and
  // the update) is under the compute of 1 s, so it is hidden, and each step costs compute, LGP
  // and stage 1; the last step's stage 2 comes after.
  Workload w = oneBlock();
  w.forwardSeconds = {0.330};
  w.backwardSeconds = {0.660};
  RunOptions s = job(SyncMode::kOsp);
  s.sync.osp.fraction = 0.5;
  const ClusterSpec c = hosts(2);
  const int64_t steps = 5;
  const SimResult r = simulate(w, s, c, {1, steps, 1});
  const double half = 100e-6 + 4e6 / (100e6 / 8);
  const double compute = 1.0 + 0.5 * 0.005;              // forward+loss+backward, LGP update
  const double step = compute + 2 * half + 0.5 * 0.005;  // stage 1: push, update, pull
  const double tail = 2 * half + 0.5 * 0.005;            // the last stage 2
  const double wall = steps * step + tail;
  EXPECT_NEAR(r.stepSeconds * steps, wall, wall * kRel);
  EXPECT_DOUBLE_EQ(r.ospFraction, 0.5);
}

TEST(Simulate, OspPushesStageOneOnlyAfterThePreviousStageTwoIsBack) {
  // Compute (100 ms, LGP 2.5 ms) shorter than a round trip (R: push, update, pull of half the
  // parameters: 2 x 0.3201 + 0.0025 s): step 0's stage 1 is back at C + R, its stage 2 at
  // C + 2R; step 1's compute ends at 2C + R but its stage 1 leaves only at C + 2R (osp.cpp
  // drains stage 2 first), back at C + 3R, and its stage 2 at C + 4R.
  const Workload w = oneBlock();
  RunOptions s = job(SyncMode::kOsp);
  s.sync.osp.fraction = 0.5;
  const SimResult r = simulate(w, s, hosts(2), {1, 2, 1});
  const double c = 0.100 + 0.0025;
  const double trip = 2 * (100e-6 + 4e6 / (100e6 / 8)) + 0.0025;
  const double wall = c + 4 * trip;
  EXPECT_NEAR(r.stepSeconds * 2, wall, wall * kRel);
}

TEST(Simulate, AllReduceBucketsCloseBeforeTheCapIsPassed) {
  // Three blocks of 10 MB, caps of 25 MB: AllReduceStrategy's buckets are {2, 1} and {0} (a
  // bucket of 30 MB if it closed only once past the cap).
  const Workload w = blocks({0.010, 0.010, 0.010}, {0.020, 0.020, 0.020},
                            {10000000, 10000000, 10000000}, {0, 0, 0});
  RunOptions s = job(SyncMode::kAllReduce);
  s.sync.allreduce.firstBucketBytes = 25000000;
  s.sync.allreduce.bucketBytes = 25000000;
  auto ring = [](double bytes) { return 2.0 * (100e-6 + bytes / 2 / (100e6 / 8)); };
  // Bucket {2, 1} ready at 0.040 + 0.040, bucket {0} at 0.100 but after the first one.
  const double step = 0.080 + ring(20e6) + ring(10e6) + 0.005;
  EXPECT_NEAR(simulate(w, s, hosts(2), {2, 1, 1}).stepSeconds, step, step * kRel);
}

TEST(Simulate, GossipOverlapsTheExchangeWithTheStepsCompute) {
  Workload w = oneBlock();
  RunOptions s = job(SyncMode::kGossip);
  // Small parameters: the step is its compute (105 ms); the exchange runs beside it.
  w.parameterBytes = {1000};
  EXPECT_NEAR(simulate(w, s, hosts(2), {2, 3, 1}).stepSeconds, 0.105, 1e-12);
  // Large ones: the step is the exchange (8 MB at 12.5 MB/s), the compute beside it.
  w.parameterBytes = {8000000};
  const double exchange = 100e-6 + 8e6 / (100e6 / 8);
  EXPECT_NEAR(simulate(w, s, hosts(2), {2, 3, 1}).stepSeconds, exchange, exchange * kRel);
  s.sync.gossip.topology = "complete";
  EXPECT_THROW(simulate(w, s, hosts(2), {2, 1, 1}), ConfigError);
}

TEST(Simulate, EachServerCountsStalenessByItsOwnClocks) {
  // One worker reads nothing stale, whatever the number of servers (each server's slowest
  // clock is that worker's own).
  const Workload w = oneBlock();
  RunOptions asp = job(SyncMode::kPsAsp);
  asp.sync.servers = 2;
  const SimResult r = simulate(w, asp, hosts(3), {1, 20, 1});
  ASSERT_EQ(r.staleness.size(), 1u);
  EXPECT_EQ(r.staleness[0], 20);
}

TEST(Simulate, OspAutoPicksAFractionNoSlowerThanBspOrHalf) {
  Workload w = oneBlock();
  RunOptions s = job(SyncMode::kOsp);
  s.sync.osp.autoFraction = true;
  const ClusterSpec c = hosts(5);
  const SimResult a = simulate(w, s, c, {4, 30, 1});
  for (double f : {1.0, 0.5}) {
    RunOptions fixed = s;
    fixed.sync.osp.autoFraction = false;
    fixed.sync.osp.fraction = f;
    // A smaller fraction is taken only when it is 0.1% faster (ties keep the larger).
    EXPECT_LE(a.stepSeconds, simulate(w, fixed, c, {4, 30, 1}).stepSeconds * 1.001) << f;
  }
  EXPECT_GT(a.ospFraction, 0.0);
  EXPECT_LE(a.ospFraction, 1.0);
}

TEST(Simulate, SspReadsStayWithinTheBoundAndAspDoesNot) {
  const Workload w = oneBlock();
  ClusterSpec c = hosts(9);
  c.linkBitsPerSecond = 10e9;  // compute-bound: the stragglers decide the gaps
  c.stragglerCv = 0.8;
  RunOptions ssp = job(SyncMode::kPsSsp);
  ssp.sync.ps.staleness = 1;
  RunOptions asp = job(SyncMode::kPsAsp);
  const SimResult a = simulate(w, ssp, c, {8, 200, 3});
  const SimResult b = simulate(w, asp, c, {8, 200, 3});
  ASSERT_FALSE(a.staleness.empty());
  EXPECT_LE(a.staleness.size(), 2u) << "a gap above the bound of 1";
  EXPECT_GT(b.staleness.size(), 2u) << "asp never ran 2 steps ahead";
  EXPECT_EQ(std::accumulate(a.staleness.begin(), a.staleness.end(), int64_t{0}), 8 * 200);
  EXPECT_GT(meanStaleness(b.staleness), meanStaleness(a.staleness));
  EXPECT_LT(b.stepSeconds, a.stepSeconds);  // nobody waits in asp
}

TEST(Simulate, LocalSgdPaysOneAllReduceOfTheParametersPerPeriod) {
  const Workload w = oneBlock();
  RunOptions s = job(SyncMode::kLocalSgd);
  s.sync.localSgd.period = 4;
  const ClusterSpec c = hosts(4);
  const SimResult r = simulate(w, s, c, {4, 8, 1});
  const double ring = 2.0 * 3 * (100e-6 + 8e6 / 4 / (100e6 / 8));
  const double wall = 8 * 0.105 + 2 * ring;
  EXPECT_NEAR(r.stepSeconds * 8, wall, wall * kRel);
  EXPECT_NEAR(r.bytesSentPerStep, 2 * (2.0 * 3 / 4 * 8e6) / 8, 1e-3);
}

TEST(Simulate, ProcessesSharingCoresComputeSlower) {
  const Workload w = oneBlock();
  ClusterSpec c = hosts(4);
  c.sharedCores = 2;           // 4 single-threaded workers on 2 cores: twice as long
  c.linkBitsPerSecond = 1e15;  // no communication to speak of
  c.latencySeconds = 0;
  RunOptions s = job(SyncMode::kAllReduce);
  const SimResult r = simulate(w, s, c, {4, 5, 1});
  EXPECT_NEAR(r.stepSeconds, 2 * 0.105, 1e-6);
  EXPECT_DOUBLE_EQ(r.computeScale, 2.0);
  // Two workers per host of one core each: the same.
  ClusterSpec two = hosts(2);
  two.linkBitsPerSecond = 1e15;
  two.latencySeconds = 0;
  two.shmBytesPerSecond = 1e15;
  EXPECT_NEAR(simulate(w, s, two, {4, 5, 1}).stepSeconds, 2 * 0.105, 1e-6);
}

TEST(Simulate, GpipeOfTwoStagesAndOneMicroBatchIsTheChainOfItsParts) {
  // Block 1's input: 0.1 s at 12.5 MB/s.
  const Workload w = blocks({0.010, 0.020}, {0.030, 0.040}, {1000, 1000}, {0, 1250000});
  RunOptions s = gpipeOfTwoStages();
  const ClusterSpec c = hosts(2);
  const SimResult r = simulate(w, s, c, {2, 1, 1});
  const double transfer = 100e-6 + 0.1;
  // F0, send, F1 + loss, B1, send back, B0, then the update (half the model on each stage).
  const double step = 0.010 + transfer + 0.030 + 0.040 + transfer + 0.030 + 0.005 / 2;
  EXPECT_NEAR(r.stepSeconds, step, step * 1e-9);
  EXPECT_NEAR(r.samplesPerSecond, 32 / step, 1e-6);
}

TEST(Simulate, PipelineStagesSlowOnlyBesideStagesComputingWithThem) {
  // GPipe of two stages and one micro-batch: no two actions overlap, so two workers on one
  // shared core each compute at its full speed (the chain of the parts, as on a core each).
  const Workload w = blocks({0.100, 0.100}, {0.200, 0.200}, {1000, 1000}, {0, 0});
  RunOptions s = gpipeOfTwoStages();
  ClusterSpec c = twoHostsOnOneCore();
  const double update = 0.005 / 2;
  const double chain = 0.100 + 0.100 + 0.010 + 0.200 + 0.200;  // F0, F1 + loss, B1, B0
  // Both stages' updates take the one core in turn: the step is the core's whole work.
  const SimResult r = simulate(w, s, c, {2, 1, 1});
  EXPECT_NEAR(r.stepSeconds, chain + 2.0 * update, 1e-9);
  EXPECT_DOUBLE_EQ(r.computeScale, 1.0);  // what the schedule applied, not two always computing
  // Each host held to half a core (a cgroup's quota per 100 ms period): a stage computes at
  // full speed for 50 ms of each period, across its actions, and waits for the next; stage 0's
  // periods start at 0, stage 1's at 50 ms. F0 runs [0, .05] and [.1, .15]; F1 + loss [.15, .2],
  // [.25, .3], [.35, .36]; B1 [.36, .4], then 50 ms from .45, .55 and .65 and 10 ms from .75:
  // .76; B0 [.76, .8], 50 ms from .8, .9 and 1.0 and 10 ms from 1.1: 1.11, then the update. The
  // step is then more than each host's work at half speed (0.62 s).
  c.coresPerHost = 0.5;
  EXPECT_NEAR(simulate(w, s, c, {2, 1, 1}).stepSeconds, 1.11 + update, 1e-9);
}

// With stragglers drawn, each drawn step's hosts' quota periods start anywhere: the step is the
// mean over uniform phases. Oracle: the same schedule (F0 .093, F1 + loss .097, B1 .187, B0
// .171: no action a multiple of the budget, which factors of 1 +- 1e-9 would push a period on;
// half a core's budget per 100 ms, nothing to transfer) simulated on a 40 x 40 grid of the two
// hosts' phases; the simulator's mean of 32 draws within 3 standard errors of its mean.
TEST(Simulate, PipelineStepIsTheMeanOverTheHostsQuotaPhases) {
  const Workload w = blocks({0.093, 0.087}, {0.171, 0.187}, {1000, 1000}, {0, 0});
  RunOptions s = gpipeOfTwoStages();
  ClusterSpec c = twoHostsOnOneCore();
  c.coresPerHost = 0.5;
  c.stragglerCv = 1e-9;
  const double update = 0.005 / 2;
  // At least each host's work over its half core, and both hosts' over the one core.
  const double host0 = 0.093 + 0.171 + update, host1 = 0.097 + 0.187 + update;
  const double least = std::max(std::max(host0, host1) / 0.5, host0 + host1);
  const auto program = buildSchedule(PipelineSchedule::kGPipe, 2, 1);
  std::vector<double> steps;
  for (int i = 0; i < 40; ++i) {
    for (int j = 0; j < 40; ++j) {
      std::vector<StageCosts> costs = {{0.093, 0.0855, 0.0855}, {0.097, 0.0935, 0.0935}};
      for (int h = 0; h < 2; ++h) {
        costs[h].quotaPeriod = 0.1;
        costs[h].quotaBudget = 0.05;
        costs[h].quotaPhase = 0.1 * ((h == 0 ? i : j) + 0.5) / 40;
      }
      steps.push_back(std::max(simulateSchedule(program, costs).makespan + update, least));
    }
  }
  const double mean = std::accumulate(steps.begin(), steps.end(), 0.0) / steps.size();
  double var = 0.0;
  for (double v : steps) var += (v - mean) * (v - mean) / steps.size();
  ASSERT_GT(var, 1e-6);  // the phases matter here
  const double got = simulate(w, s, c, {2, 32, 1}).stepSeconds;
  EXPECT_NEAR(got, mean, 3.0 * std::sqrt(var / 32.0)) << "sd " << std::sqrt(var);
  // Not the step with the periods half a period apart, as without stragglers.
  c.stragglerCv = 0.0;
  EXPECT_GT(std::abs(got - simulate(w, s, c, {2, 32, 1}).stepSeconds), 1e-6);
}

TEST(Simulate, PipelineReplicasComputeInStepOnTheCoresTheyShare) {
  // Two replicas of GPipe(2 stages, 1 micro-batch): each stage's actions overlap only its other
  // replica's. On two shared cores each computes at full speed; on one, at half.
  const Workload w = blocks({0.100, 0.100}, {0.200, 0.200}, {1000, 1000}, {0, 0});
  const RunOptions s = gpipeOfTwoStages();
  ClusterSpec c = hosts(4);
  c.latencySeconds = 0;
  c.linkBitsPerSecond = 1e15;
  c.sharedCores = 2;
  const double chain = 0.100 + 0.100 + 0.010 + 0.200 + 0.200;  // F0, F1 + loss, B1, B0
  const double update = 0.005 / 2;
  // (the four updates, 2.5 ms each, on the two cores: the cores' whole work, 0.615 s)
  EXPECT_NEAR(simulate(w, s, c, {4, 1, 1}).stepSeconds, chain + 2.0 * update, 1e-9);
  // On one shared core, at half speed: the schedule 2 * (chain + update) = 1.225 s, but the
  // four processes' work (2 x 0.3025 + 2 x 0.3125 s) takes the core 1.23 s.
  c.sharedCores = 1;
  const SimResult one = simulate(w, s, c, {4, 1, 1});
  EXPECT_NEAR(one.stepSeconds, 1.23, 1e-9);
  EXPECT_DOUBLE_EQ(one.computeScale, 2.0);
  // Hosts with a core each, 2 hosts and 4 workers (stage w % 2 on host w % 2): each host holds
  // one stage's two replicas, which compute in step: half speed.
  ClusterSpec own = hosts(2);
  own.latencySeconds = 0;
  own.linkBitsPerSecond = 1e15;
  own.shmBytesPerSecond = 1e15;
  EXPECT_NEAR(simulate(w, s, own, {4, 1, 1}).stepSeconds, 2.0 * (chain + update), 1e-9);
  // 3 hosts and 6 workers: each host holds one process of each stage, which never compute
  // together; each at full speed, the step the host's work (0.3025 + 0.3125 s) on its core.
  ClusterSpec three = hosts(3);
  three.latencySeconds = 0;
  three.linkBitsPerSecond = 1e15;
  EXPECT_NEAR(simulate(w, s, three, {6, 1, 1}).stepSeconds, 0.615, 1e-9);
}

TEST(Simulate, MicroBatchTimesFollowTheProfiledSmallerBatches) {
  Workload w = blocks({0.320}, {0.640}, {1000}, {3200});
  w.batchPerWorker = 32;
  w.lossSeconds = 0.032;
  // Profiled at 2 and 8 examples: shares 0.125 and 0.3 of the full batch's times.
  w.smallerBatches = {{2.0, {0.125}, {0.125}, 0.125}, {8.0, {0.3}, {0.3}, 0.3}};
  // 16 micro-batches of 2: the profile at 2 itself.
  Workload m = perMicroBatch(w, 16);
  EXPECT_NEAR(m.forwardSeconds[0], 0.320 * 0.125, 1e-12);
  EXPECT_NEAR(m.backwardSeconds[0], 0.640 * 0.125, 1e-12);
  EXPECT_NEAR(m.lossSeconds, 0.032 * 0.125, 1e-12);
  EXPECT_EQ(m.inputBytes[0], 200);
  // 8 of 4: between 2 and 8, a third of the way; 2 of 16: between 8 and the full batch.
  EXPECT_NEAR(perMicroBatch(w, 8).forwardSeconds[0], 0.320 * (0.125 + 0.175 / 3), 1e-12);
  EXPECT_NEAR(perMicroBatch(w, 2).forwardSeconds[0], 0.320 * (0.3 + 0.7 / 3), 1e-12);
  // 32 of 1: below the smallest profile, the line through the two smallest.
  EXPECT_NEAR(perMicroBatch(w, 32).forwardSeconds[0], 0.320 * (0.125 - 0.175 / 6), 1e-12);
  // Below the smallest profile a line steeper than proportional is held at proportional: at 1
  // example, the line through (2, 0.05) and (8, 0.3) says 0.0083, half of 0.05 is 0.025.
  Workload steep = w;
  steep.smallerBatches = {{2.0, {0.05}, {0.05}, 0.05}, {8.0, {0.3}, {0.3}, 0.3}};
  EXPECT_NEAR(perMicroBatch(steep, 32).forwardSeconds[0], 0.320 * 0.025, 1e-12);
  // None profiled: in proportion.
  w.smallerBatches.clear();
  EXPECT_NEAR(perMicroBatch(w, 4).forwardSeconds[0], 0.080, 1e-12);
}

TEST(WorkloadProfile, LeavesTheCallersThreadCountAsItWas) {
  // A run's rank 0 profiles its model to choose a layout, then trains at its own threads.
  const Config config = Config::fromString(
      "[data]\ndataset = \"synthetic\"\nsynthetic_size = 64\nbatch_size = 8\n"
      "[model]\nname = \"mlp\"\nwidth = 8\n[train]\nthreads = 1\n",
      "<string>");
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  const int blas = blasThreads();
  const Workload w = measureWorkload(config);
  EXPECT_EQ(w.threads, 1);  // profiled at the config's one thread
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_EQ(blasThreads(), blas);
  EXPECT_EQ(w.smallerBatches.size(), 1u);  // 8 examples: a quarter (2), no sixteenth
  at::set_num_threads(before);
}

TEST(WorkloadFile, KeepsTheSmallerBatchesAndReadsTheFixedTimesBefore) {
  Workload w = blocks({0.320}, {0.640}, {1000}, {3200});
  w.smallerBatches = {{2.0, {0.125}, {0.25}, 0.5}, {8.0, {0.3}, {0.35}, 0.4}};
  const Workload back = workloadFromJson(workloadJson(w), "w.json");
  ASSERT_EQ(back.smallerBatches.size(), 2u);
  EXPECT_EQ(back.smallerBatches[1].examples, 8.0);
  EXPECT_EQ(back.smallerBatches[0].backward, std::vector<double>{0.25});
  EXPECT_EQ(back.smallerBatches[1].loss, 0.4);
  // The form before: a fixed part of each time, the rest shrinking with the batch.
  nlohmann::json old = nlohmann::json::parse(workloadJson(w));
  old.erase("smaller_batches");
  old["fixed"] = {{"forward_s", {0.032}}, {"backward_s", {0.0}}, {"loss_s", 0.0}};
  const Workload fixed = workloadFromJson(old.dump(), "old.json");
  EXPECT_NEAR(perMicroBatch(fixed, 4).forwardSeconds[0], 0.032 + (0.320 - 0.032) / 4, 1e-12);
  EXPECT_NEAR(perMicroBatch(fixed, 4).backwardSeconds[0], 0.640 / 4, 1e-12);
  old["fixed"]["forward_s"] = {0.032, 0.0};  // not one per block
  EXPECT_THROW(workloadFromJson(old.dump(), "old.json"), ConfigError);
  // Out of order, or at the full batch: refused.
  nlohmann::json bad = nlohmann::json::parse(workloadJson(w));
  bad["smaller_batches"][1]["examples"] = 1.0;
  EXPECT_THROW(workloadFromJson(bad.dump(), "bad.json"), ConfigError);
  bad["smaller_batches"][1]["examples"] = 32.0;
  EXPECT_THROW(workloadFromJson(bad.dump(), "bad.json"), ConfigError);
}

TEST(Simulate, RefusesWhatItCannotSimulateInOneLine) {
  const Workload w = oneBlock();
  RunOptions s = job(SyncMode::kDiloco);
  EXPECT_THROW(simulate(w, s, hosts(2), {2, 1, 1}), ConfigError);
  s = job(SyncMode::kAllReduce);
  s.pipeline.stages = 2;
  EXPECT_THROW(simulate(w, s, hosts(2), {3, 1, 1}), ConfigError);  // 3 is no multiple of 2
}

TEST(ClusterFile, ReadsBackWhatItWrites) {
  ClusterSpec c;
  c.hosts = 16;
  c.coresPerHost = 0.4;
  c.sharedCores = 2;
  c.memoryBytesPerHost = 24.0 * 1073741824.0;
  c.linkBitsPerSecond = 300e6;
  c.latencySeconds = 37e-6;
  c.linkEfficiency = 0.93;
  c.diskBytesPerSecond = 1.2e9;
  c.shmBytesPerSecond = 4e9;
  c.stragglerCv = 0.05;
  c.stragglerStepSeconds = 0.11;
  const ClusterSpec d = ClusterSpec::fromString(c.toToml(), "t.toml");
  EXPECT_EQ(d.hosts, 16);
  EXPECT_DOUBLE_EQ(d.coresPerHost, 0.4);
  EXPECT_DOUBLE_EQ(d.sharedCores, 2);
  EXPECT_DOUBLE_EQ(d.memoryBytesPerHost, c.memoryBytesPerHost);
  EXPECT_DOUBLE_EQ(d.linkBitsPerSecond, 300e6);
  EXPECT_DOUBLE_EQ(d.latencySeconds, 37e-6);
  EXPECT_DOUBLE_EQ(d.linkEfficiency, 0.93);
  EXPECT_DOUBLE_EQ(d.diskBytesPerSecond, 1.2e9);
  EXPECT_DOUBLE_EQ(d.shmBytesPerSecond, 4e9);
  EXPECT_DOUBLE_EQ(d.stragglerCv, 0.05);
  EXPECT_DOUBLE_EQ(d.stragglerStepSeconds, 0.11);
}

TEST(ClusterFile, AStepFourTimesAsLongAsStragglerStepMsHasHalfTheCvAndAShorterOneItsOwn) {
  ClusterSpec c;
  c.stragglerCv = 0.15;
  EXPECT_DOUBLE_EQ(c.stragglerCvAt(10.0), 0.15);  // no straggler_step_ms: every step's
  c.stragglerStepSeconds = 0.11;
  EXPECT_NEAR(c.stragglerCvAt(0.44), 0.075, 1e-15);
  EXPECT_DOUBLE_EQ(c.stragglerCvAt(0.0275), 0.15);  // shorter: as given, not extrapolated
  EXPECT_DOUBLE_EQ(c.stragglerCvAt(0.0), 0.15);
}

TEST(ClusterFile, RefusesUnknownMissingAndOutOfRangeKeys) {
  auto message = [](const std::string& text) {
    try {
      ClusterSpec::fromString(text, "c.toml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message("[cluster]\nhosts = 2\nlink_mbit = 100\nlink_gbit = 1\n").find("link_gbit"),
            std::string::npos);
  EXPECT_NE(message("[cluster]\nhosts = 2\n").find("link_mbit"), std::string::npos);
  EXPECT_NE(message("[cluster]\nhosts = 0\nlink_mbit = 100\n").find("cluster.hosts"),
            std::string::npos);
  EXPECT_NE(message("[cluster]\nhosts = 2.5\nlink_mbit = 100\n").find("whole"), std::string::npos);
  EXPECT_NE(message("hosts = 2\n").find("[cluster]"), std::string::npos);
  EXPECT_NE(message("[cluster\n").find("invalid TOML"), std::string::npos);
  EXPECT_EQ(message("[cluster]\nhosts = 2\nlink_mbit = 100\n"), "accepted");
}

// What the simulator does not model is said, not simulated as something else: diloco, and the
// quantized parameter changes of local-sgd (whose bytes the float32 model would overstate 8x).
TEST(Simulate, SaysWhatItDoesNotModel) {
  const RunOptions diloco = job(SyncMode::kDiloco);
  EXPECT_NE(unsupported(diloco).find("sync.mode = diloco is not simulated"), std::string::npos)
      << unsupported(diloco);
  RunOptions quantized = job(SyncMode::kLocalSgd);
  quantized.sync.compressionName = "int4";
  quantized.sync.localSgd.compression = Compression::kInt4;
  EXPECT_NE(unsupported(quantized).find("sync.compression = int4"), std::string::npos)
      << unsupported(quantized);
  EXPECT_EQ(unsupported(job(SyncMode::kLocalSgd)), "");
}

TEST(Buckets, TheFirstCapClosesTheFirstBucketAndTheLaterCapTheRest) {
  // First cap 10, later cap 25: {6, 4} (10 fits the first cap exactly), {8, 8, 8} (24), {9}.
  EXPECT_EQ(bucketStarts({6, 4, 8, 8, 8, 9}, 10, 25), (std::vector<size_t>{0, 2, 5}));
  // The second bucket takes the later cap from its first tensor on: {6}, {6, 6, 6} (18 > 10).
  EXPECT_EQ(bucketStarts({6, 6, 6, 6}, 10, 100), (std::vector<size_t>{0, 1}));
}

TEST(Buckets, ATensorLargerThanTheCapGoesAlone) {
  EXPECT_EQ(bucketStarts({50, 3, 40, 2}, 10, 10), (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_EQ(bucketStarts({3, 50}, 10, 10), (std::vector<size_t>{0, 1}));
  // Empty tensors join the bucket they come to (it is never past its cap by them).
  EXPECT_EQ(bucketStarts({0, 10, 0, 1}, 10, 10), (std::vector<size_t>{0, 3}));
}

TEST(Buckets, NoTensorsNoBuckets) { EXPECT_TRUE(bucketStarts({}, 10, 10).empty()); }

namespace {

// One rank alone, every collective done when issued (over one rank the result is the input),
// recording the elements of each all-reduce: AllReduceStrategy launches one per bucket, in
// bucket order.
class OneRankRecorder final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "one-rank recorder"; }
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(1000); }
  WorkPtr allreduce(at::Tensor tensor, ReduceOp) override {
    numels.push_back(tensor.numel());
    return std::make_shared<comm::ReadyWork>();
  }
  WorkPtr broadcast(at::Tensor, int) override { return std::make_shared<comm::ReadyWork>(); }
  WorkPtr allgather(at::Tensor, at::Tensor) override { return unexpected("allgather"); }
  WorkPtr reduceScatter(at::Tensor, at::Tensor, ReduceOp) override {
    return unexpected("reduceScatter");
  }
  WorkPtr send(at::Tensor, int, int) override { return unexpected("send"); }
  WorkPtr recv(at::Tensor, int, int) override { return unexpected("recv"); }
  WorkPtr barrier() override { return std::make_shared<comm::ReadyWork>(); }

  std::vector<int64_t> numels;

 private:
  static WorkPtr unexpected(const char* op) {
    ADD_FAILURE() << "an uncompressed all-reduce called " << op;
    return std::make_shared<comm::ReadyWork>();
  }
};

// The float32 bytes of each bucket AllReduceStrategy launches over `model`, attached as a run
// attaches it, for one step.
std::vector<int64_t> enginesBuckets(BlockModel& model, const AllReduceOptions& options) {
  auto recorder = std::make_shared<OneRankRecorder>();
  AllReduceStrategy strategy(recorder, options);
  strategy.attach(*model);
  strategy.beforeForward(0);
  strategy.finishGradients();  // no backward: every bucket launched here, in order
  std::vector<int64_t> bytes;
  for (int64_t n : recorder->numels) bytes.push_back(4 * n);
  return bytes;
}

// The model's workload as measureWorkload records its parameters (no times).
Workload parametersOf(BlockModel& model) {
  Workload w;
  for (size_t i = 0; i < model->numBlocks(); ++i) {
    w.parameterBytes.push_back(tensorBytes(model->block(i).ptr()->parameters()));
  }
  w.gradientBytes = sim::blockGradientBytes(*model);
  return w;
}

}  // namespace

// The property sync/buckets.h exists for: the simulator predicts the all-reduce over the
// buckets the engine lays, for the repository's models and caps from one parameter per bucket
// to one bucket for everything.
TEST(Buckets, TheSimulatorFormsTheEnginesBuckets) {
  DataShape image;
  DataShape text;
  text.task = TaskKind::kLanguageModel;
  text.vocabSize = 20;
  text.seqLen = 16;
  ModelSpec mlp, cnn, gpt;
  mlp.name = "mlp";
  cnn.name = "cnn";
  cnn.width = 8;
  gpt.name = "gpt";
  gpt.width = 32;
  gpt.depth = 2;
  gpt.heads = 2;
  size_t multiParameterBuckets = 0;
  for (const auto& [spec, shape] :
       std::vector<std::pair<ModelSpec, DataShape>>{{mlp, image}, {cnn, image}, {gpt, text}}) {
    torch::manual_seed(1);
    BlockModel model = buildModel(spec, shape);
    const Workload w = parametersOf(model);
    for (const auto& [first, later] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 1}, {1 << 10, 1 << 12}, {3000, 20000}, {1 << 14, 1 << 16}, {1 << 20, 25 << 20}}) {
      AllReduceOptions options;
      options.firstBucketBytes = first;
      options.bucketBytes = later;
      std::vector<int64_t> simulated;
      size_t tensors = 0;
      for (const GradientBucket& b : gradientBuckets(w, options)) {
        simulated.push_back(b.bytes);
        tensors += b.tensors;
        multiParameterBuckets += b.tensors > 1;
      }
      EXPECT_EQ(simulated, enginesBuckets(model, options))
          << spec.name << " with caps " << first << ", " << later;
      EXPECT_EQ(tensors, model->parameters().size()) << spec.name;
    }
  }
  EXPECT_GT(multiParameterBuckets, 5u) << "the caps never grouped parameters";
}

TEST(Buckets, ABucketIsReadyWhenItsLastParametersBlockEndedBackward) {
  // Block 0 holds two parameters of 6 MB, block 1 one of 6 MB; caps of 10 MB: the buckets are
  // {block 1's}, {block 0's second}, {block 0's first}: the last two ready when block 0 ended
  // its backward. Per block (a caravan-workload-1 file) they would be {block 1}, {block 0}.
  Workload w = blocks({0.010, 0.010}, {0.020, 0.020}, {12000000, 6000000}, {0, 0});
  w.gradientBytes = {{6000000, 6000000}, {6000000}};
  AllReduceOptions caps;
  caps.firstBucketBytes = caps.bucketBytes = 10000000;
  const std::vector<GradientBucket> buckets = gradientBuckets(w, caps);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0].readyBlock, 1u);
  EXPECT_EQ(buckets[1].readyBlock, 0u);
  EXPECT_EQ(buckets[2].readyBlock, 0u);
  RunOptions s = job(SyncMode::kAllReduce);
  s.sync.allreduce = caps;
  auto ring = [](double bytes) { return 2.0 * (100e-6 + bytes / 2 / (100e6 / 8)); };
  // Bucket 0 ready at 0.030 + 0.020, then three rings of 6 MB one after the other.
  const double step = 0.050 + 3 * ring(6e6) + 0.005;
  EXPECT_NEAR(simulate(w, s, hosts(2), {2, 1, 1}).stepSeconds, step, step * kRel);
  w.gradientBytes.clear();
  EXPECT_EQ(gradientBuckets(w, caps).size(), 2u);
}

TEST(WorkloadFile, KeepsEachParametersBytesAndReadsTheFormatBefore) {
  Workload w = oneBlock();
  w.gradientBytes = {{4000000, 3999000}};
  w.gatherBytes = {6000000};
  const Workload back = workloadFromJson(workloadJson(w), "w.json");
  EXPECT_EQ(back.gradientBytes, w.gradientBytes);
  EXPECT_EQ(back.parameterBytes, w.parameterBytes);
  EXPECT_EQ(back.gatherBytes, w.gatherBytes);
  // caravan-workload-1: no gradient_bytes; each block one tensor.
  nlohmann::json old = nlohmann::json::parse(workloadJson(w));
  old["format"] = "caravan-workload-1";
  old.erase("gradient_bytes");
  old.erase("gather_bytes");  // before bf16 gathers: each block's parameters' bytes
  const Workload one = workloadFromJson(old.dump(), "old.json");
  EXPECT_TRUE(one.gradientBytes.empty());
  EXPECT_TRUE(one.gatherBytes.empty());
  EXPECT_EQ(gradientBuckets(one, AllReduceOptions{}).size(), 1u);
  // A block's gradients past its parameters are refused.
  nlohmann::json bad = nlohmann::json::parse(workloadJson(w));
  bad["gradient_bytes"] = {{9000000}};
  EXPECT_THROW(workloadFromJson(bad.dump(), "bad.json"), ConfigError);
}

TEST(Recommend, ComparesTheUsualWaysEachOnceWithTheOwnFirst) {
  RunOptions own = job(SyncMode::kPsSsp);
  own.sync.servers = 2;
  const std::vector<RunOptions> even = candidates(own, 4);
  std::vector<std::string> labels;
  for (const RunOptions& c : even) labels.push_back(label(c));
  EXPECT_EQ(labels, (std::vector<std::string>{
                        "ps-ssp(3)", "allreduce", "allreduce+fp16", "allreduce+shard(gradients)",
                        "allreduce+shard(parameters)", "allreduce+offload", "ps-bsp", "ps-asp",
                        "osp(auto)", "local-sgd(H=4)", "gossip", "allreduce+pipeline(2x4)"}));
  for (const RunOptions& c : even) {
    EXPECT_EQ(c.sync.servers, usesServers(c.sync.mode) ? 2 : 0) << label(c);
    EXPECT_EQ(unsupported(c), "") << label(c);
  }
  EXPECT_EQ(even[2].sync.allreduce.compression, Compression::kFp16);
  EXPECT_EQ(even[3].sync.shard, ShardLevel::kGradients);
  EXPECT_TRUE(even[5].memory.offloadWeights);
  EXPECT_EQ(even[7].sync.ps.consistency, PsConsistency::kAsp);
  // An odd number of workers has no two-stage pipeline.
  EXPECT_EQ(candidates(own, 3).size(), even.size() - 1);
}

TEST(Recommend, RanksFastestFirstAndSaysWhatBoundsAndWhatDoesNotFit) {
  auto result = [](const RunOptions& j, double samples, double computing, int64_t memory) {
    SimResult r;
    r.mode = label(j);
    r.samplesPerSecond = samples;
    r.computeUtilisation = computing;
    r.linkUtilisation = 0.5;
    r.memoryPeakBytes = memory;
    return std::pair{j, r};
  };
  ClusterSpec c = hosts(2);
  c.memoryBytesPerHost = 2e9;  // 4 workers on 2 hosts: 1 GB each
  RunOptions fp16 = job(SyncMode::kAllReduce);
  fp16.sync.compressionName = "fp16";
  fp16.sync.allreduce.compression = Compression::kFp16;
  const std::vector<Recommendation> ranked =
      recommend({result(job(SyncMode::kAllReduce), 100, 0.9, 500000000),
                 result(job(SyncMode::kPsBsp), 300, 0.5, 1500000000), result(fp16, 100, 0.85, 0),
                 result(job(SyncMode::kGossip), 200, 0.2, 10)},
                c, 4, 60000);
  std::vector<std::string> order;
  for (const auto& r : ranked) order.push_back(r.mode);
  EXPECT_EQ(order, (std::vector<std::string>{"ps-bsp", "gossip", "allreduce", "allreduce+fp16"}));
  EXPECT_FALSE(ranked[0].fits);
  EXPECT_NE(ranked[0].text().find("does NOT fit memory"), std::string::npos) << ranked[0].text();
  EXPECT_FALSE(ranked[0].computeBound);
  EXPECT_TRUE(ranked[2].computeBound);
  EXPECT_TRUE(ranked[2].fits);
  EXPECT_DOUBLE_EQ(ranked[2].epochMinutes, 60000 / 100.0 / 60.0);
  EXPECT_EQ(ranked[2].text(),
            "allreduce: 100 samples/s, 10.0 min/epoch; compute-bound (90% computing); exact "
            "(every step synchronous)");
  EXPECT_NE(ranked[3].text().find("gradients rounded to 16 bits; memory not predicted"),
            std::string::npos)
      << ranked[3].text();
  EXPECT_NE(ranked[1].consistency.find("ring neighbours"), std::string::npos);
}

// Sharded data parallelism (sync.shard): ZeRO's stages 1 and 2 send what the all-reduce sends
// (a reduce-scatter and an all-gather are half an all-reduce each); stage 3 gathers each of the
// n blocks twice but the last, which stays between its forward and backward: (3n - 1) / 2n of
// the all-reduce's bytes. Memory is ZeRO's accounting.
TEST(SimulateSharded, StagesOneAndTwoSendAnAllReducesBytesAndStageThreeOneAndAHalf) {
  const Workload w = blocks({0.015, 0.015}, {0.030, 0.030}, {4000000, 4000000}, {1000000, 1000000});
  const ClusterSpec c = hosts(4);
  const SimResult none = simulate(w, job(SyncMode::kAllReduce), c, {4, 5, 1});
  for (ShardLevel level : kShardLevels) {
    RunOptions s = job(SyncMode::kAllReduce);
    s.sync.shard = level;
    const SimResult r = simulate(w, s, c, {4, 5, 1});
    const double factor = level == ShardLevel::kParameters ? 5.0 / 4.0 : 1.0;  // n = 2
    EXPECT_NEAR(r.bytesSentPerStep, factor * none.bytesSentPerStep, 1e-6) << shardLevelName(level);
    // State factor 1 (8 MB of state for 8 MB of weights); parameters: two gathered blocks.
    const int64_t state = shardedModelState(level, 8000000, 1, 4).total() +
                          (level == ShardLevel::kParameters ? 8000000 : 0);
    EXPECT_EQ(r.memoryPeakBytes, state + 4000000) << shardLevelName(level);
  }
}

// bf16 gathers (Workload::gatherBytes: the weights stage 3 gathers in bf16, here half of each
// block's bytes): each of stage 3's three gathers sends half, its two reduce-scatters float32's,
// so 3.5 halves of an all-reduce's 4 against 5; the two gathered blocks hold half. The other
// levels gather the float32 weights after the update: what they sent before.
TEST(SimulateSharded, StageThreesBf16GathersSendAndHoldHalfTheirBytes) {
  Workload w = blocks({0.015, 0.015}, {0.030, 0.030}, {4000000, 4000000}, {1000000, 1000000});
  const ClusterSpec c = hosts(4);
  const SimResult none = simulate(w, job(SyncMode::kAllReduce), c, {4, 5, 1});
  RunOptions s = job(SyncMode::kAllReduce);
  s.sync.shard = ShardLevel::kParameters;
  const SimResult float32 = simulate(w, s, c, {4, 5, 1});
  w.gatherBytes = {2000000, 2000000};
  const SimResult bf16 = simulate(w, s, c, {4, 5, 1});
  EXPECT_NEAR(bf16.bytesSentPerStep, 3.5 / 4.0 * none.bytesSentPerStep,
              1e-9 * none.bytesSentPerStep);
  EXPECT_EQ(bf16.memoryPeakBytes, float32.memoryPeakBytes - 4000000);
  s.sync.shard = ShardLevel::kGradients;
  EXPECT_NEAR(simulate(w, s, c, {4, 5, 1}).bytesSentPerStep, none.bytesSentPerStep,
              1e-9 * none.bytesSentPerStep);
}

TEST(SimulateSharded, OneBlockIsForwardBackwardReduceScatterUpdateAndGather) {
  const Workload w = oneBlock();
  const ClusterSpec c = hosts(4);
  const double beta = 100e6 / 8;
  const double halfRing = 3 * (100e-6 + 8e6 / 4 / beta);  // a reduce-scatter or all-gather
  for (ShardLevel level : {ShardLevel::kGradients, ShardLevel::kParameters}) {
    RunOptions s = job(SyncMode::kAllReduce);
    s.sync.shard = level;
    const SimResult r = simulate(w, s, c, {4, 1, 1});
    // gradients: the first step's gather comes before its forward too (the previous update's);
    // parameters: gathered before the forward, kept for the backward. Then the reduce-scatter
    // and the update of a quarter.
    const double step = halfRing + 0.100 + halfRing + 0.005 / 4;
    EXPECT_NEAR(r.stepSeconds, step, step * kRel) << shardLevelName(level);
  }
}

TEST(SimulateSharded, RecommendWeighsShardingAgainstTheOtherModes) {
  const auto options = candidates(job(SyncMode::kAllReduce), 4);
  int sharded = 0;
  for (const auto& o : options) sharded += o.sync.shard != ShardLevel::kNone;
  EXPECT_EQ(sharded, 2);
  RunOptions local = job(SyncMode::kLocalSgd);
  local.sync.shard = ShardLevel::kGradients;
  EXPECT_THROW(simulate(oneBlock(), local, hosts(2), {2, 1, 1}), ConfigError);
}

// memory.weights = offload: the step is the in-core one with the planner's extra tier seconds on
// backward (before the gradients leave), and the memory is its window and activations.
TEST(SimulateOffload, AStepIsTheInCoreOneWithTheTiersSecondsOnBackward) {
  Workload w = oneBlock();
  w.offload = {true, 0.040, 3000000, 2500000};
  const ClusterSpec c = hosts(4);
  RunOptions offload = job(SyncMode::kAllReduce);
  offload.memory.offloadWeights = true;
  EXPECT_EQ(label(offload), "allreduce+offload");
  const SimResult core = simulate(w, job(SyncMode::kAllReduce), c, {4, 3, 1});
  const SimResult off = simulate(w, offload, c, {4, 3, 1});
  // One block: its bucket leaves when backward ends, so every step is 40 ms later.
  EXPECT_NEAR(off.stepSeconds - core.stepSeconds, 0.040, 1e-9);
  EXPECT_EQ(off.memoryPeakBytes, 3000000 + 2500000);
  EXPECT_EQ(core.memoryPeakBytes, 2 * 8000000 + 8000000 + 4000000);
  EXPECT_DOUBLE_EQ(off.bytesSentPerStep, core.bytesSentPerStep);
}

TEST(SimulateOffload, RefusesWhatItDoesNotModelInOneLine) {
  RunOptions offload = job(SyncMode::kAllReduce);
  offload.memory.offloadWeights = true;
  // A workload without the offload profile (a file from before it).
  try {
    simulate(oneBlock(), offload, hosts(2), {2, 1, 1});
    FAIL() << "simulated offload without its profile";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("profile again"), std::string::npos) << e.what();
  }
  offload.sync.shard = ShardLevel::kParameters;
  EXPECT_NE(unsupported(offload).find("sync.shard = none"), std::string::npos);
}

TEST(WorkloadFile, KeepsTheOffloadProfileAndReadsFilesWithoutIt) {
  Workload w = oneBlock();
  w.offload = {true, 0.25, 123456, 654321};
  const Workload back = workloadFromJson(workloadJson(w), "w.json");
  EXPECT_TRUE(back.offload.measured);
  EXPECT_EQ(back.offload.extraSeconds, 0.25);
  EXPECT_EQ(back.offload.windowBytes, 123456);
  EXPECT_EQ(back.offload.activationPeakBytes, 654321);
  const Workload none = workloadFromJson(workloadJson(oneBlock()), "old.json");
  EXPECT_FALSE(none.offload.measured);
  nlohmann::json bad = nlohmann::json::parse(workloadJson(w));
  bad["offload"]["extra_s"] = -1.0;
  EXPECT_THROW(workloadFromJson(bad.dump(), "bad.json"), ConfigError);
}
