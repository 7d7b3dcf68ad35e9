// caravan simulate's model (sim/simulator.h) against closed forms: each mode's step time where
// the event model's answer can be written down by hand, and the cluster file's parsing.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>

#include "core/errors.h"
#include "sim/cluster.h"
#include "sim/simulator.h"

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

}  // namespace

TEST(Simulate, AllReduceOfOneBucketIsTheRingAfterBackward) {
  const Workload w = oneBlock();
  const ClusterSpec c = hosts(4);
  SyncSpec s;  // allreduce; the one block's 8 MB are one bucket
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
  Workload w = oneBlock();
  w.forwardSeconds = {0.015, 0.015};
  w.backwardSeconds = {0.030, 0.030};
  w.parameterBytes = {4000000, 4000000};
  w.inputBytes = {1000000, 1000000};
  SyncSpec s;
  s.firstBucketBytes = 1;
  s.bucketBytes = 1;
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
  SyncSpec s;
  s.mode = "ps-bsp";
  s.servers = 1;
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
  SyncSpec bsp;
  bsp.mode = "ps-bsp";
  SyncSpec osp = bsp;
  osp.mode = "osp";
  osp.ospFraction = 1.0;
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
  SyncSpec s;
  s.mode = "osp";
  s.ospFraction = 0.5;
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
  SyncSpec s;
  s.mode = "osp";
  s.ospFraction = 0.5;
  const SimResult r = simulate(w, s, hosts(2), {1, 2, 1});
  const double c = 0.100 + 0.0025;
  const double trip = 2 * (100e-6 + 4e6 / (100e6 / 8)) + 0.0025;
  const double wall = c + 4 * trip;
  EXPECT_NEAR(r.stepSeconds * 2, wall, wall * kRel);
}

TEST(Simulate, AllReduceBucketsCloseBeforeTheCapIsPassed) {
  // Three blocks of 10 MB, caps of 25 MB: AllReduceStrategy's buckets are {2, 1} and {0} (a
  // bucket of 30 MB if it closed only once past the cap).
  Workload w = oneBlock();
  w.forwardSeconds = {0.010, 0.010, 0.010};
  w.backwardSeconds = {0.020, 0.020, 0.020};
  w.parameterBytes = {10000000, 10000000, 10000000};
  w.inputBytes = {0, 0, 0};
  SyncSpec s;
  s.firstBucketBytes = 25000000;
  s.bucketBytes = 25000000;
  auto ring = [](double bytes) { return 2.0 * (100e-6 + bytes / 2 / (100e6 / 8)); };
  // Bucket {2, 1} ready at 0.040 + 0.040, bucket {0} at 0.100 but after the first one.
  const double step = 0.080 + ring(20e6) + ring(10e6) + 0.005;
  EXPECT_NEAR(simulate(w, s, hosts(2), {2, 1, 1}).stepSeconds, step, step * kRel);
}

TEST(Simulate, GossipOverlapsTheExchangeWithTheStepsCompute) {
  Workload w = oneBlock();
  SyncSpec s;
  s.mode = "gossip";
  // Small parameters: the step is its compute (105 ms); the exchange runs beside it.
  w.parameterBytes = {1000};
  EXPECT_NEAR(simulate(w, s, hosts(2), {2, 3, 1}).stepSeconds, 0.105, 1e-12);
  // Large ones: the step is the exchange (8 MB at 12.5 MB/s), the compute beside it.
  w.parameterBytes = {8000000};
  const double exchange = 100e-6 + 8e6 / (100e6 / 8);
  EXPECT_NEAR(simulate(w, s, hosts(2), {2, 3, 1}).stepSeconds, exchange, exchange * kRel);
  s.gossipTopology = "complete";
  EXPECT_THROW(simulate(w, s, hosts(2), {2, 1, 1}), ConfigError);
}

TEST(Simulate, EachServerCountsStalenessByItsOwnClocks) {
  // One worker reads nothing stale, whatever the number of servers (each server's slowest
  // clock is that worker's own).
  const Workload w = oneBlock();
  SyncSpec asp;
  asp.mode = "ps-asp";
  asp.servers = 2;
  const SimResult r = simulate(w, asp, hosts(3), {1, 20, 1});
  ASSERT_EQ(r.staleness.size(), 1u);
  EXPECT_EQ(r.staleness[0], 20);
}

TEST(Simulate, OspAutoPicksAFractionNoSlowerThanBspOrHalf) {
  Workload w = oneBlock();
  SyncSpec s;
  s.mode = "osp";
  s.ospAuto = true;
  const ClusterSpec c = hosts(5);
  const SimResult a = simulate(w, s, c, {4, 30, 1});
  for (double f : {1.0, 0.5}) {
    SyncSpec fixed = s;
    fixed.ospAuto = false;
    fixed.ospFraction = f;
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
  SyncSpec ssp;
  ssp.mode = "ps-ssp";
  ssp.staleness = 1;
  SyncSpec asp = ssp;
  asp.mode = "ps-asp";
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
  SyncSpec s;
  s.mode = "local-sgd";
  s.localPeriod = 4;
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
  SyncSpec s;
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
  Workload w = oneBlock();
  w.forwardSeconds = {0.010, 0.020};
  w.backwardSeconds = {0.030, 0.040};
  w.parameterBytes = {1000, 1000};
  w.inputBytes = {0, 1250000};  // 0.1 s at 12.5 MB/s
  SyncSpec s;
  s.pipelineStages = 2;
  s.microBatches = 1;
  s.schedule = "gpipe";
  const ClusterSpec c = hosts(2);
  const SimResult r = simulate(w, s, c, {2, 1, 1});
  const double transfer = 100e-6 + 0.1;
  // F0, send, F1 + loss, B1, send back, B0, then the update (half the model on each stage).
  const double step = 0.010 + transfer + 0.030 + 0.040 + transfer + 0.030 + 0.005 / 2;
  EXPECT_NEAR(r.stepSeconds, step, step * 1e-9);
  EXPECT_NEAR(r.samplesPerSecond, 32 / step, 1e-6);
}

TEST(Simulate, RefusesWhatItCannotSimulateInOneLine) {
  const Workload w = oneBlock();
  SyncSpec s;
  s.mode = "diloco";
  EXPECT_THROW(simulate(w, s, hosts(2), {2, 1, 1}), ConfigError);
  s.mode = "allreduce";
  s.pipelineStages = 2;
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
  SyncSpec diloco;
  diloco.mode = "diloco";
  EXPECT_NE(diloco.unsupported().find("sync.mode = diloco is not simulated"), std::string::npos)
      << diloco.unsupported();
  SyncSpec quantized;
  quantized.mode = "local-sgd";
  quantized.compression = "int4";
  EXPECT_NE(quantized.unsupported().find("sync.compression = int4"), std::string::npos)
      << quantized.unsupported();
  SyncSpec plain;
  plain.mode = "local-sgd";
  EXPECT_EQ(plain.unsupported(), "");
}
