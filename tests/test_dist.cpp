// Data-parallel training equivalence: W workers with per-worker batch b end with the same
// parameters as one worker with batch W*b over the same samples (BSP all-reduce), and
// deterministic reruns are bitwise identical. Workers are real `caravan` processes started
// with torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or under mpirun
// for the MPI backend.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <mutex>

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "cli/launch.h"
#include "core/config.h"
#include "core/errors.h"
#include "core/rng.h"
#include "gloo_ranks.h"
#include "memory/saved_tensors.h"
#include "memory/tier.h"
#include "memory/tracker.h"
#include "models/precision.h"
#include "run_util.h"
#include "sync/sharding.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/memory_setup.h"
#include "train/run_setup.h"
#include "train/setup.h"
#include "train/sharded_checkpoint.h"
#include "train/sharded_step.h"

using namespace caravan;
using caravan::test::TempDir;
namespace fs = std::filesystem;

namespace {

const std::vector<std::string> kBase = {
    "data.dataset=synthetic", "data.synthetic_size=480", "train.max_steps=20",
    "train.threads=1",        "optim.name=sgd",          "optim.lr=0.01",
    "optim.momentum=0.9",     "train.log_every=1",       "train.eval_every=0",
    "seed.init=3",            "fault.timeout=60"};

std::string setArgs(const std::vector<std::string>& overrides) {
  std::string s;
  for (const auto& o : overrides) s += " --set " + o;
  return s;
}

// A shell command starting rank r of `world` in the background (torchrun-style variables,
// killed after `limitS` seconds) as `caravan train -q ARGS`, its pid in ${pids[r]} (the pid
// of `timeout`; caravan is its child).
std::string rankCommand(int r, int world, int port, int limitS, const std::string& args) {
  return "RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(world) +
         " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
         " OMP_NUM_THREADS=1 timeout " + std::to_string(limitS) + " " + CARAVAN_BINARY +
         " train -q " + args + " & pids[" + std::to_string(r) + "]=$!; ";
}

// Runs W ranks of `caravan train ARGS` with torchrun-style variables, rank r's output in
// LOG.rank<r>.log; returns the exit codes.
std::vector<int> runRanksWith(int world, const std::string& log, const std::string& args) {
  const int port = caravan::test::reservePort();
  std::string script;
  for (int r = 0; r < world; ++r) {
    script += rankCommand(r, world, port, 300,
                          args + " >" + log + ".rank" + std::to_string(r) + ".log 2>&1");
  }
  script += "for p in ${pids[@]}; do wait $p; echo $?; done";
  FILE* pipe = ::popen(("bash -c '" + script + "'").c_str(), "r");
  std::vector<int> codes;
  int code;
  while (std::fscanf(pipe, "%d", &code) == 1) codes.push_back(code);
  ::pclose(pipe);
  return codes;
}

// Runs W ranks of `caravan train --config /dev/null --set OVERRIDES --run-dir RUN_DIR`.
std::vector<int> runRanks(int world, const std::string& runDir,
                          const std::vector<std::string>& overrides) {
  return runRanksWith(world, runDir, "--config /dev/null" + setArgs(overrides) + " --run-dir " +
                                         runDir);
}

// The last checkpoint's parameters, loaded by one process (parallel.* in `overrides`, which
// describe the job rather than the model, are left out).
std::map<std::string, at::Tensor> finalParams(const std::string& runDir,
                                              const std::vector<std::string>& overrides) {
  std::vector<std::string> alone;
  for (const auto& o : overrides) {
    if (o.rfind("parallel.", 0) != 0) alone.push_back(o);
  }
  Config config = Config::fromString("", "<test>", alone);
  RunSetup setup(config);
  BlockModel& model = setup.model;
  auto latest = CheckpointDir(runDir, 3).latest();
  EXPECT_TRUE(latest.has_value()) << runDir;
  loadCheckpoint(*latest, *model, *setup.optimizer, setup.identity);
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

double maxAbsDiff(const std::map<std::string, at::Tensor>& a,
                  const std::map<std::string, at::Tensor>& b) {
  double worst = 0.0;
  for (const auto& [name, t] : a) {
    worst = std::max(worst, (t - b.at(name)).abs().max().item<double>());
  }
  return worst;
}

std::vector<std::string> with(std::vector<std::string> base, const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

class DistEquivalence : public ::testing::TestWithParam<int> {};

}  // namespace

// Data-parallel training on `world` ranks (with `backend`) against one worker with W times the
// batch: the largest difference of the final parameters after 20 steps.
double dataParallelDifference(int world, const std::string& backend) {
  const int perWorker = 8;
  TempDir tmp;
  // Small buckets so several all-reduces overlap backward.
  auto model = std::vector<std::string>{"model.name=cnn", "model.width=4",
                                        "sync.first_bucket_mb=0.001", "sync.bucket_mb=0.01"};
  auto single = with(with(kBase, model), {"data.batch_size=" + std::to_string(world * perWorker)});
  auto multi = with(with(kBase, model),
                    {"data.batch_size=" + std::to_string(perWorker), "dist.backend=" + backend});
  EXPECT_EQ(runRanks(1, tmp / "one", single), std::vector<int>{0});
  std::vector<int> codes = runRanks(world, tmp / "many", multi);
  EXPECT_EQ(codes, std::vector<int>(world, 0))
      << test::readFile(tmp / "many.rank0.log") << test::readFile(tmp / "many.rank1.log");
  if (codes != std::vector<int>(world, 0)) return HUGE_VAL;
  const double diff = maxAbsDiff(finalParams(tmp / "one", single), finalParams(tmp / "many", multi));
  std::cout << backend << " W=" << world << " max |single - data-parallel| after 20 steps: " << diff
            << "\n";
  return diff;
}

TEST_P(DistEquivalence, GlooMatchesSingleWorkerWithWTimesBatch) {
  EXPECT_LE(dataParallelDifference(GetParam(), "gloo"), 1e-5);
}

// The same through shared memory (every rank is on this host).
TEST_P(DistEquivalence, ShmMatchesSingleWorkerWithWTimesBatch) {
  EXPECT_LE(dataParallelDifference(GetParam(), "shm"), 1e-5);
}

TEST_P(DistEquivalence, MpiMatchesSingleWorkerWithWTimesBatch) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "mpirun not installed (bash scripts/setup.sh installs openmpi-bin)";
  }
  const int world = GetParam();
  const int perWorker = 8;
  TempDir tmp;
  auto model = std::vector<std::string>{"model.name=cnn", "model.width=4",
                                        "sync.first_bucket_mb=0.001", "sync.bucket_mb=0.01"};
  auto single = with(with(kBase, model), {"data.batch_size=" + std::to_string(world * perWorker)});
  auto multi = with(with(kBase, model), {"data.batch_size=" + std::to_string(perWorker),
                                         "dist.backend=mpi"});
  ASSERT_EQ(runRanks(1, tmp / "one", single), std::vector<int>{0});
  std::string cmd = "cd " + tmp.path() +
                    " && timeout 300 mpirun --allow-run-as-root --oversubscribe --bind-to none "
                    "--mca btl self,vader -np " + std::to_string(world) +
                    " -x OMP_NUM_THREADS=1 " + CARAVAN_BINARY +
                    " train -q --config /dev/null" + setArgs(multi) + " --run-dir " +
                    (tmp / "many") + " >" + (tmp / "mpi.log") + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << test::readFile(tmp / "mpi.log");
  const double diff = maxAbsDiff(finalParams(tmp / "one", single), finalParams(tmp / "many", multi));
  std::cout << "MPI W=" << world << " max |single - data-parallel| after 20 steps: " << diff << "\n";
  EXPECT_LE(diff, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Workers, DistEquivalence, ::testing::Values(2, 3, 4));

TEST(DistDeterminism, RerunsAreBitwiseIdentical) {
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "sync.first_bucket_mb=0.001", "sync.bucket_mb=0.01"});
  ASSERT_EQ(runRanks(3, tmp / "a", o), std::vector<int>(3, 0));
  ASSERT_EQ(runRanks(3, tmp / "b", o), std::vector<int>(3, 0));
  auto a = finalParams(tmp / "a", o), b = finalParams(tmp / "b", o);
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name;
}

TEST(DistFileStore, RendezvousThroughASharedFileGivesTheSameRun) {
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8"});
  ASSERT_EQ(runRanks(2, tmp / "tcp", o), std::vector<int>(2, 0));
  auto f = with(o, {"dist.store=file", "dist.store_path=" + (tmp / "store")});
  ASSERT_EQ(runRanks(2, tmp / "file", f), std::vector<int>(2, 0))
      << test::readFile(tmp / "file.rank0.log") << test::readFile(tmp / "file.rank1.log");
  auto a = finalParams(tmp / "tcp", o), b = finalParams(tmp / "file", o);
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name;
}

TEST(DistTrace, EachRankWritesAChromeTrace) {
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "train.max_steps=3", "sync.first_bucket_mb=0.001",
                        "sync.bucket_mb=0.01"});
  const int port = caravan::test::reservePort();
  std::string script;
  for (int r = 0; r < 2; ++r) {
    script += rankCommand(r, 2, port, 120,
                          "--trace --config /dev/null" + setArgs(o) + " --run-dir " + (tmp / "run"));
  }
  script += "wait";
  ASSERT_EQ(std::system(("bash -c '" + script + "'").c_str()), 0);
  for (int r = 0; r < 2; ++r) {
    auto j = nlohmann::json::parse(test::readFile(tmp / ("run/trace-rank" + std::to_string(r) + ".json")));
    std::map<std::string, int> names;
    for (const auto& e : j["traceEvents"]) {
      if (e["ph"] == "X") {
        ++names[e["name"].get<std::string>().substr(0, 16)];
        EXPECT_GE(e["dur"].get<double>(), 0.0);
        EXPECT_EQ(e["pid"].get<int>(), r);
      }
    }
    EXPECT_EQ(names["forward"], 3);
    EXPECT_EQ(names["backward"], 3);
    EXPECT_GE(names["allreduce bucket"], 3 * 2) << "expected at least 2 buckets per step";
  }
}

// Multi-host: each rank is a separate host in its own network namespace (scripts/
// netns_hosts.sh: veth pairs to a bridge, addresses 198.18.0.i), the master address is rank
// 0's host address, so the store and every Gloo connection cross the virtual network. The
// result must equal the same job on one host (loopback) bit for bit.
class DistMultiHost : public ::testing::TestWithParam<int> {};

TEST_P(DistMultiHost, NamespaceHostsMatchOneHost) {
  const int world = GetParam();
  TempDir tmp;
  // Gloo on both sides (auto would pick shared memory on one host, whose sums of 3 or more
  // terms run in another order): this checks the hosts' wiring, not the transport.
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "sync.first_bucket_mb=0.001", "sync.bucket_mb=0.01", "dist.backend=gloo"});
  const std::string ranks = std::string("RANK=$HOST_INDEX WORLD_SIZE=$HOSTS ") +
                            "MASTER_ADDR=198.18.0.1 MASTER_PORT=29500 OMP_NUM_THREADS=1 " +
                            CARAVAN_BINARY + " train -q --config /dev/null" + setArgs(o) +
                            " --run-dir " + (tmp / "hosts") + " >" + (tmp / "hosts.log") +
                            ".$HOST_INDEX 2>&1";
  const std::string cmd = std::string(CARAVAN_SOURCE_DIR) + "/scripts/netns_hosts.sh --hosts " +
                          std::to_string(world) + " --timeout 120 -- bash -c '" + ranks + "'";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "needs root and ip netns";
  std::string logs;
  for (int r = 0; r < world; ++r) {
    logs += test::readFile(tmp / ("hosts.log." + std::to_string(r)));
  }
  ASSERT_EQ(WEXITSTATUS(status), 0) << logs;
  ASSERT_EQ(runRanks(world, tmp / "one", o), std::vector<int>(world, 0));
  auto hosts = finalParams(tmp / "hosts", o), one = finalParams(tmp / "one", o);
  ASSERT_FALSE(hosts.empty());
  for (const auto& [name, t] : hosts) EXPECT_TRUE(at::equal(t, one.at(name))) << name;
  std::printf("%d namespace hosts: max |difference| to one host %.3g\n", world,
              maxAbsDiff(hosts, one));
}

INSTANTIATE_TEST_SUITE_P(Hosts, DistMultiHost, ::testing::Values(2, 3, 4));

// dist.backend = auto on 2 namespace hosts of 2 ranks each: hierarchical (shared memory inside
// each host, Gloo between the two leaders; dist.connections = 2 opens 2 meshes, though these
// buckets are too small to be cut). Its sums run per host, then over hosts, so the result
// equals the same job on one host with Gloo up to float32 rounding
// (hierarchical_communicator.h).
TEST(DistMultiHostRanks, HierarchicalOnTwoHostsOfTwoRanksMatchesOneHost) {
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "sync.first_bucket_mb=0.001", "sync.bucket_mb=0.01"});
  const std::string rank =
      std::string("RANK=$((2*HOST_INDEX+k)) WORLD_SIZE=4 ") +
      "MASTER_ADDR=198.18.0.1 MASTER_PORT=29500 OMP_NUM_THREADS=1 " + CARAVAN_BINARY +
      " train --config /dev/null" + setArgs(with(o, {"dist.backend=auto", "dist.connections=2"})) +
      " --run-dir " + (tmp / "hosts") + " >" + (tmp / "hosts.log") + ".$((2*HOST_INDEX+k)) 2>&1";
  const std::string host = "s=0; for k in 0 1; do " + rank +
                           " & pids=\"$pids $!\"; done; for p in $pids; do wait $p || s=$?; "
                           "done; exit $s";
  const std::string cmd = std::string(CARAVAN_SOURCE_DIR) +
                          "/scripts/netns_hosts.sh --hosts 2 --timeout 120 -- bash -c '" + host +
                          "'";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "needs root and ip netns";
  std::string logs;
  for (int r = 0; r < 4; ++r) logs += test::readFile(tmp / ("hosts.log." + std::to_string(r)));
  ASSERT_EQ(WEXITSTATUS(status), 0) << logs;
  EXPECT_NE(test::readFile(tmp / "hosts.log.0").find("hierarchical"), std::string::npos) << logs;
  auto gloo = with(o, {"dist.backend=gloo"});
  ASSERT_EQ(runRanks(4, tmp / "one", gloo), std::vector<int>(4, 0));
  auto hosts = finalParams(tmp / "hosts", o), one = finalParams(tmp / "one", gloo);
  ASSERT_FALSE(hosts.empty());
  const double diff = maxAbsDiff(hosts, one);
  EXPECT_LE(diff, 1e-5);
  std::printf(
      "2 namespace hosts x 2 ranks (hierarchical): max |difference| to one host (gloo) "
      "%.3g\n",
      diff);
}

// netns_hosts.sh --cpus C: each host's command gets C cores at most (a cgroup quota): a busy
// loop of 2 s uses about 2 x C seconds of CPU (closed form; /proc's cumulative child times, in
// 1/100 s), not the whole core it would take alone.
TEST(NetnsHosts, CpusCapEachHostsShare) {
  TempDir tmp;
  const std::string host =
      "timeout 2 sh -c \"while :; do :; done\"; awk \"{print \\$16+\\$17}\" "
      "/proc/$$/stat >" +
      (tmp / "ticks") + ".$HOST_INDEX";
  const std::string cmd =
      std::string(CARAVAN_SOURCE_DIR) +
      "/scripts/netns_hosts.sh --hosts 2 --cpus 0.25 --timeout 30 -- bash -c '" + host + "'";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "needs root, ip netns and a cpu cgroup";
  ASSERT_EQ(WEXITSTATUS(status), 0);
  for (int h = 0; h < 2; ++h) {
    const int ticks = std::stoi(test::readFile(tmp / ("ticks." + std::to_string(h))));
    std::printf("host %d: %.2f s of CPU in a 2 s busy loop at --cpus 0.25\n", h, ticks / 100.0);
    EXPECT_LE(ticks, 0.25 * 2 * 100 * 1.2 + 2);  // 0.5 s, with the last period's rounding
    EXPECT_GE(ticks, 5);                         // it ran
  }
  // A share that is not a positive number is refused in one line, exit 2.
  const int badStatus =
      std::system((std::string(CARAVAN_SOURCE_DIR) + "/scripts/netns_hosts.sh --cpus 0 -- true 2>" +
                   (tmp / "bad.err"))
                      .c_str());
  const std::string err = test::readFile(tmp / "bad.err");
  EXPECT_EQ(WIFEXITED(badStatus) ? WEXITSTATUS(badStatus) : -1, 2) << err;
  EXPECT_NE(err.find("--cpus must be a number of cores of at least 0.01"), std::string::npos)
      << err;
  EXPECT_EQ(test::countLines(err), 1) << err;
}

// Local SGD with H = 1 and plain SGD averages x - lr*g_k, which is x - lr*mean(g_k): the BSP
// all-reduce step, up to float rounding. With the post-local phase covering every step it is
// BSP exactly (momentum included).
TEST(DistLocalSgd, PeriodOneWithPlainSgdMatchesAllReduce) {
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "optim.momentum=0"});
  ASSERT_EQ(runRanks(3, tmp / "bsp", o), std::vector<int>(3, 0));
  auto l = with(o, {"sync.mode=local-sgd", "sync.local_period=1"});
  ASSERT_EQ(runRanks(3, tmp / "local", l), std::vector<int>(3, 0))
      << test::readFile(tmp / "local.rank0.log");
  const double diff = maxAbsDiff(finalParams(tmp / "bsp", o), finalParams(tmp / "local", o));
  EXPECT_LE(diff, 1e-5);
  std::printf("local SGD H=1 vs all-reduce after 20 steps: max |difference| %.3g\n", diff);
}

// DiLoCo with H = 1, outer lr 1 and no outer momentum replaces the replicas by their mean after
// every inner step. The inner SGD with momentum 0.9 (each worker's own buffer) is linear, so the
// mean of the replicas is the BSP all-reduce step, up to float rounding.
TEST(DistDiloco, PeriodOneWithOuterLrOneIsAllReduce) {
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8"});
  ASSERT_EQ(runRanks(3, tmp / "bsp", o), std::vector<int>(3, 0));
  auto d = with(
      o, {"sync.mode=diloco", "sync.local_period=1", "sync.outer_lr=1", "sync.outer_momentum=0"});
  ASSERT_EQ(runRanks(3, tmp / "diloco", d), std::vector<int>(3, 0))
      << test::readFile(tmp / "diloco.rank0.log");
  const double diff = maxAbsDiff(finalParams(tmp / "bsp", o), finalParams(tmp / "diloco", o));
  EXPECT_LE(diff, 1e-5);
  std::printf(
      "diloco H=1, outer lr 1, no outer momentum vs all-reduce after 20 steps: max "
      "|difference| %.3g\n",
      diff);
}

// ps-diloco takes the outer step on the servers: with float32 exchanges it is diloco among the
// workers, up to the order of the float sums (the servers sum in rank order, the all-reduce in
// ring order; with two workers both are a + b, so bitwise). Streamed in 3 fragments over 2 servers
// with 2 workers, so fragments straddle the shards and some rounds leave a server an empty piece;
// outer momentum 0.9 is on the servers. With int4 pushes and replies, the run ends near the float
// one (the replies' error feedback keeps θ̂ within a few rounding steps of θ_sync).
TEST(DistDiloco, ThroughServersEqualsAmongWorkers) {
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "sync.local_period=4", "sync.fragments=3", "train.log_every=4"});
  ASSERT_EQ(runRanks(2, tmp / "workers", with(o, {"sync.mode=diloco"})), std::vector<int>(2, 0))
      << test::readFile(tmp / "workers.rank0.log");
  auto ps = with(o, {"sync.mode=ps-diloco", "sync.servers=2"});
  ASSERT_EQ(runRanks(4, tmp / "servers", ps), std::vector<int>(4, 0))
      << test::readFile(tmp / "servers.rank0.log") << test::readFile(tmp / "servers.rank3.log");
  const auto among = finalParams(tmp / "workers", o);
  const double diff = maxAbsDiff(among, finalParams(tmp / "servers", o));
  EXPECT_EQ(diff, 0.0);  // two workers: a + b in either order
  std::printf(
      "ps-diloco (2 servers) vs diloco, H=4, 3 fragments, 20 steps: max |difference| %.3g\n", diff);
  // The checkpoint holds the servers' outer momentum: diloco's, up to rounding, and not zeros.
  auto momentum = [&](const std::string& run) {
    Config config = Config::fromString("", "<test>", o);
    RunSetup setup(config);
    const auto latest = CheckpointDir(run, 3).latest();
    EXPECT_TRUE(latest.has_value()) << run;
    return loadCheckpoint(*latest, *setup.model, *setup.optimizer, setup.identity)
        .strategy.at("diloco_momentum");
  };
  const at::Tensor m = momentum(tmp / "workers"), mps = momentum(tmp / "servers");
  EXPECT_GT(m.abs().max().item<double>(), 1e-3);
  EXPECT_LE((m - mps).abs().max().item<double>(), 1e-5);
  auto q = with(ps, {"sync.compression=int4"});
  ASSERT_EQ(runRanks(4, tmp / "int4", q), std::vector<int>(4, 0))
      << test::readFile(tmp / "int4.rank0.log");
  const double quantized = maxAbsDiff(among, finalParams(tmp / "int4", o));
  double largest = 0.0;
  for (const auto& [name, t] : among) largest = std::max(largest, t.abs().max().item<double>());
  EXPECT_GT(quantized, 0.0);  // int4 did change what travelled
  EXPECT_LE(quantized, 0.05 * largest);
  std::printf("ps-diloco int4 vs diloco float: max |difference| %.3g (largest parameter %.3g)\n",
              quantized, largest);
}

TEST(DistLocalSgd, PostLocalPhaseIsBspExactly) {
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8"});
  ASSERT_EQ(runRanks(2, tmp / "bsp", o), std::vector<int>(2, 0));
  auto l = with(o, {"sync.mode=local-sgd", "sync.local_period=5", "sync.post_local_steps=20"});
  ASSERT_EQ(runRanks(2, tmp / "local", l), std::vector<int>(2, 0));
  auto a = finalParams(tmp / "bsp", o), b = finalParams(tmp / "local", o);
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name;
}

// Local SGD (H = 4) and ring gossip train: the loss falls, and the evaluation records carry the
// replicas' spread before consolidation (zero right after a local-SGD averaging, positive for
// gossip).
TEST(DistDecentralized, LocalSgdAndGossipTrainAndReportTheSpread) {
  TempDir tmp;
  auto base = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                           "train.max_steps=60", "train.eval_every=10", "optim.lr=0.05"});
  for (const std::string mode : {"local-sgd", "gossip"}) {
    const std::string dir = tmp / mode;
    ASSERT_EQ(runRanks(3, dir, with(base, {"sync.mode=" + mode})), std::vector<int>(3, 0))
        << test::readFile(dir + ".rank0.log");
    std::vector<double> losses, spreads;
    std::istringstream lines(test::readFile(dir + "/metrics.jsonl"));
    for (std::string line; std::getline(lines, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["kind"] == "train") {
        losses.push_back(j["loss"].get<double>());
        // The per-step split: positive compute, non-negative waiting, together no more than
        // the step's share of wall time (batch * 3 workers / samples_per_s).
        const double compute = j["compute_s"].get<double>(), wait = j["sync_wait_s"].get<double>();
        EXPECT_GT(compute, 0.0);
        EXPECT_GE(wait, 0.0);
        EXPECT_LE(compute + wait, 1.01 * 24.0 / j["samples_per_s"].get<double>()) << line;
      }
      if (j["kind"] == "eval") spreads.push_back(j["consensus_distance"].get<double>());
    }
    ASSERT_EQ(losses.size(), 60u) << mode;
    ASSERT_EQ(spreads.size(), 6u) << mode;
    double first = 0, last = 0;
    for (int i = 0; i < 10; ++i) first += losses[i], last += losses[losses.size() - 1 - i];
    EXPECT_LT(last, 0.9 * first) << mode << ": the loss did not fall";
    for (double d : spreads) {
      EXPECT_TRUE(std::isfinite(d)) << mode;
      if (mode == "gossip") EXPECT_GT(d, 0.0) << mode;
    }
    std::printf("%s: loss %.3f -> %.3f (mean of 10 steps), spread at evaluations %.3g .. %.3g\n",
                mode.c_str(), first / 10, last / 10,
                *std::min_element(spreads.begin(), spreads.end()),
                *std::max_element(spreads.begin(), spreads.end()));
  }
}

// Compression: top-k with ratio 1 sends every entry (= no compression, up to the order of the
// float sums); fp16/bf16 stay within 16-bit rounding of float32 after 20 steps.
TEST(DistCompression, TopKRatioOneMatchesNoneAnd16BitStaysClose) {
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "sync.first_bucket_mb=0.001", "sync.bucket_mb=0.01"});
  ASSERT_EQ(runRanks(3, tmp / "none", o), std::vector<int>(3, 0));
  const auto none = finalParams(tmp / "none", o);
  for (const auto& [c, bound] : std::vector<std::pair<std::string, double>>{
           {"topk", 1e-5}, {"fp16", 2e-3}, {"bf16", 1e-2}}) {
    auto oc = with(o, {"sync.compression=" + c, "sync.topk_ratio=1"});
    ASSERT_EQ(runRanks(3, tmp / c, oc), std::vector<int>(3, 0))
        << test::readFile(tmp / (c + ".rank0.log"));
    const double diff = maxAbsDiff(finalParams(tmp / c, o), none);
    EXPECT_LE(diff, bound) << c;
    std::printf("compression %s: max |difference| to none after 20 steps %.3g\n", c.c_str(),
                diff);
  }
}

// Parameter server (BSP): W workers + S servers give the BSP all-reduce's parameters after 20
// steps up to the order of the float sums, with SGD momentum and with AdamW; one worker works.
class DistParameterServer : public ::testing::TestWithParam<std::tuple<int, int, std::string>> {};

TEST_P(DistParameterServer, MatchesAllReduce) {
  const auto [workers, servers, optim] = GetParam();
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "optim.name=" + optim, "optim.weight_decay=0.01"});
  ASSERT_EQ(runRanks(workers, tmp / "bsp", o), std::vector<int>(workers, 0));
  auto p = with(o, {"sync.mode=ps-bsp", "sync.servers=" + std::to_string(servers)});
  ASSERT_EQ(runRanks(workers + servers, tmp / "ps", p), std::vector<int>(workers + servers, 0))
      << test::readFile(tmp / "ps.rank0.log") << test::readFile(tmp / "ps.rank1.log");
  const double diff = maxAbsDiff(finalParams(tmp / "bsp", o), finalParams(tmp / "ps", o));
  EXPECT_LE(diff, 1e-5);
  std::printf("ps-bsp %d workers + %d servers (%s) vs all-reduce: max |difference| %.3g\n",
              workers, servers, optim.c_str(), diff);
}

INSTANTIATE_TEST_SUITE_P(
    WorkersServers, DistParameterServer,
    ::testing::Values(std::make_tuple(1, 1, "sgd"), std::make_tuple(3, 1, "sgd"),
                      std::make_tuple(3, 2, "adamw"), std::make_tuple(2, 2, "sgd")));

// Every sync.mode runs to the end with 1 and 3 workers (and 1 and 2 servers where it has
// servers), the loss falls, and the per-step metrics it promises are in metrics.jsonl: bytes
// on the wire (with more than one worker), staleness (ps-asp, ps-ssp: within sync.staleness),
// the stage-1 fraction (osp). Asynchronous modes agree only every train.log_every = 5 steps.
// With one worker ps-asp and ps-ssp apply each gradient as it comes: exactly ps-bsp.
// "MODE+COMPRESSION" also sets sync.compression (top-k with ratio 0.1).
class DistModesSurvive : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(DistModesSurvive, RunsToTheEndAndReports) {
  const auto [modeAndCompression, workers, servers] = GetParam();
  const auto plus = modeAndCompression.find('+');
  const std::string mode = modeAndCompression.substr(0, plus);
  const std::string compression =
      plus == std::string::npos ? "none" : modeAndCompression.substr(plus + 1);
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "train.log_every=5", "sync.mode=" + mode, "sync.staleness=1",
                        "sync.osp_chunk=1000", "sync.compression=" + compression,
                        "sync.topk_ratio=0.1"});
  if (servers > 0) o = with(o, {"sync.servers=" + std::to_string(servers)});
  const int world = workers + servers;
  ASSERT_EQ(runRanks(world, tmp / "run", o), std::vector<int>(world, 0))
      << test::readFile(tmp / "run.rank0.log") << test::readFile(tmp / "run.rank1.log");
  std::vector<nlohmann::json> train;
  std::istringstream lines(test::readFile(tmp / "run/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") train.push_back(j);
  }
  ASSERT_EQ(train.size(), 4u);
  EXPECT_LT(train.back()["loss"].get<double>(), train.front()["loss"].get<double>());
  for (const auto& j : train) {
    if (workers > 1 || servers > 0) EXPECT_GT(j.at("sent_bytes").get<double>(), 0.0) << j;
    if (mode == "ps-asp" || mode == "ps-ssp") {
      EXPECT_GE(j.at("staleness").get<double>(), 0.0) << j;
      if (mode == "ps-ssp") EXPECT_LE(j.at("staleness_max").get<double>(), 1.0) << j;
    }
    if (mode == "osp") EXPECT_NEAR(j.at("stage1_fraction").get<double>(), 0.5, 0.1) << j;
  }
  if (workers == 1 && (mode == "ps-asp" || mode == "ps-ssp")) {
    auto b = with(o, {"sync.mode=ps-bsp"});
    ASSERT_EQ(runRanks(world, tmp / "bsp", b), std::vector<int>(world, 0));
    EXPECT_EQ(maxAbsDiff(finalParams(tmp / "bsp", b), finalParams(tmp / "run", o)), 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, DistModesSurvive,
    ::testing::Values(std::make_tuple("allreduce", 1, 0), std::make_tuple("allreduce", 3, 0),
                      std::make_tuple("local-sgd", 1, 0), std::make_tuple("local-sgd", 3, 0),
                      std::make_tuple("gossip", 1, 0), std::make_tuple("gossip", 3, 0),
                      std::make_tuple("ps-bsp", 1, 2), std::make_tuple("ps-bsp", 3, 1),
                      std::make_tuple("ps-asp", 1, 1), std::make_tuple("ps-asp", 3, 2),
                      std::make_tuple("ps-ssp", 1, 2), std::make_tuple("ps-ssp", 3, 1),
                      std::make_tuple("osp", 1, 1), std::make_tuple("osp", 3, 2),
                      std::make_tuple("ps-diloco", 1, 1), std::make_tuple("ps-diloco+int4", 3, 2),
                      std::make_tuple("ps-ssp+fp16", 3, 1), std::make_tuple("ps-bsp+topk", 3, 2),
                      std::make_tuple("allreduce+bf16", 3, 0)));

// A server killed mid-run: the workers exit 7 naming it as a server.
TEST(DistParameterServerFault, KilledServerIsNamed) {
  TempDir tmp;
  auto p = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "train.max_steps=10000000", "sync.mode=ps-bsp", "fault.timeout=10"});
  const int port = caravan::test::reservePort();
  std::string script;
  for (int r = 0; r < 3; ++r) {
    script += rankCommand(r, 3, port, 60,
                          "--config /dev/null" + setArgs(p) + " --run-dir " + (tmp / "run") +
                              " 2>" + (tmp / ("err" + std::to_string(r))));
  }
  // pids[2] is `timeout`; the server is its child.
  script += "sleep 4; pkill -9 -P ${pids[2]}; wait ${pids[0]}; echo $?; wait ${pids[1]}; echo $?";
  FILE* pipe = ::popen(("bash -c '" + script + "'").c_str(), "r");
  std::vector<int> codes;
  int code;
  while (std::fscanf(pipe, "%d", &code) == 1) codes.push_back(code);
  ::pclose(pipe);
  ASSERT_EQ(codes, std::vector<int>({7, 7}));
  for (int r = 0; r < 2; ++r) {
    const std::string err = test::readFile(tmp / ("err" + std::to_string(r)));
    EXPECT_EQ(err.rfind("caravan: error: rank 2 (server) is lost", 0), 0u) << err;
  }
}

// OSP with every chunk in stage 1 is ps-bsp (bitwise here: same sums, the optimizer stepping
// chunks instead of the shard is elementwise the same); with half the chunks in stage 2 it
// trains, with LGP on and off, across 2 servers and several chunks per server.
TEST(DistOsp, FractionOneIsPsBspAndHalfTrains) {
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "sync.servers=2", "sync.osp_chunk=1000", "train.max_steps=40",
                        "optim.lr=0.05"});
  ASSERT_EQ(runRanks(5, tmp / "ps", with(o, {"sync.mode=ps-bsp"})), std::vector<int>(5, 0));
  ASSERT_EQ(runRanks(5, tmp / "osp1", with(o, {"sync.mode=osp", "sync.osp_fraction=1"})),
            std::vector<int>(5, 0))
      << test::readFile(tmp / "osp1.rank0.log") << test::readFile(tmp / "osp1.rank3.log");
  const double diff = maxAbsDiff(finalParams(tmp / "ps", o), finalParams(tmp / "osp1", o));
  EXPECT_EQ(diff, 0.0);
  std::printf("osp fraction 1 vs ps-bsp: max |difference| %.3g\n", diff);
  for (const std::string lgp : {"true", "false"}) {
    const std::string dir = tmp / ("half-" + lgp);
    ASSERT_EQ(runRanks(5, dir, with(o, {"sync.mode=osp", "sync.osp_fraction=0.5",
                                        "sync.osp_lgp=" + lgp})),
              std::vector<int>(5, 0))
        << test::readFile(dir + ".rank0.log") << test::readFile(dir + ".rank3.log");
    std::vector<double> losses;
    std::istringstream lines(test::readFile(dir + "/metrics.jsonl"));
    for (std::string line; std::getline(lines, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["kind"] == "train") losses.push_back(j["loss"].get<double>());
    }
    ASSERT_EQ(losses.size(), 40u);
    double first = 0, last = 0;
    for (int i = 0; i < 5; ++i) first += losses[i], last += losses[losses.size() - 1 - i];
    EXPECT_LT(last, 0.8 * first) << "lgp " << lgp;
    const double gap = maxAbsDiff(finalParams(dir, o), finalParams(tmp / "ps", o));
    EXPECT_GT(gap, 0.0) << "half the chunks one step late cannot equal BSP";
    std::printf("osp fraction 0.5 lgp %s: loss %.3f -> %.3f, max |difference| to ps-bsp %.3g\n",
                lgp.c_str(), first / 5, last / 5, gap);
  }
}

// sync.osp_auto_fraction (fraction_search.h): the servers' moves reach metrics.jsonl as one
// chain of osp_fraction records from sync.osp_fraction, on the 0.05 grid, each with its reason,
// and the search gets past its warm-up to probing; the stage-1 share every train record
// reports is exactly the one those moves set (layer-order splits of 100-element chunks: each
// server's first ceil(f x chunks) chunks, its shard being half of the model). Every worker checks
// each server's split against the fraction the reply names, so a run that ends also had the two
// servers agree every step.
TEST(DistOsp, AutoFractionMovesAreRecordedAndEveryServerSplitsAlike) {
  TempDir tmp;
  const auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                              "sync.servers=2", "sync.osp_chunk=100", "train.max_steps=60",
                              "train.log_every=5", "sync.mode=osp", "sync.osp_fraction=0.5",
                              "sync.osp_auto_fraction=true", "sync.osp_policy=layer-order"});
  ASSERT_EQ(runRanks(5, tmp / "auto", o), std::vector<int>(5, 0))
      << test::readFile(tmp / "auto.rank0.log") << test::readFile(tmp / "auto.rank3.log");
  std::vector<nlohmann::json> moves, train;
  std::istringstream lines(test::readFile(tmp / "auto/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "osp_fraction") moves.push_back(j);
    if (j["kind"] == "train") train.push_back(j);
  }
  ASSERT_FALSE(moves.empty());
  double last = 0.5;
  int64_t lastStep = 0;
  int probes = 0;
  std::vector<double> fractionOf(60, 0.5);  // of each step's split
  for (const auto& m : moves) {
    const double to = m.at("to").get<double>();
    const int64_t step = m.at("step").get<int64_t>();
    EXPECT_DOUBLE_EQ(m.at("from").get<double>(), last) << m;
    EXPECT_GT(step, lastStep) << m;
    EXPECT_NEAR(to / 0.05, std::round(to / 0.05), 1e-9) << m;
    EXPECT_TRUE(to >= 0.05 - 1e-12 && to <= 1.0 + 1e-12) << m;
    const std::string reason = m.at("reason").get<std::string>();
    const std::vector<std::string> reasons = {"guess",   "probe",      "faster", "back",
                                              "settled", "remeasured", "recall", "origin-faster"};
    EXPECT_NE(std::find(reasons.begin(), reasons.end(), reason), reasons.end()) << m;
    probes += reason == "probe";
    EXPECT_FALSE(m.at("why").get<std::string>().empty()) << m;
    for (int64_t s = step; s < 60; ++s) fractionOf[s] = to;
    last = to;
    lastStep = step;
  }
  EXPECT_GE(probes, 1) << "the search never got past its warm-up";
  ASSERT_EQ(train.size(), 12u);
  const int64_t total = train[0].at("mem_weights").get<int64_t>() / 4;  // float32 parameters
  auto share = [&](double f) {
    int64_t stage1 = 0;
    for (int s = 0; s < 2; ++s) {
      const int64_t n = total * (s + 1) / 2 - total * s / 2, chunks = (n + 99) / 100;
      const int64_t k = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(f * chunks)), 1, chunks);
      stage1 += std::min(k * 100, n);
    }
    return static_cast<double>(stage1) / static_cast<double>(total);
  };
  for (const auto& j : train) {
    const int64_t end = j.at("step").get<int64_t>();
    double mean = 0.0;
    for (int64_t s = end - 5; s < end; ++s) mean += share(fractionOf[s]) / 5.0;
    EXPECT_NEAR(j.at("stage1_fraction").get<double>(), mean, 1e-12) << j;
  }
}

// Out-of-core weights under BSP all-reduce (memory.weights = offload): one bucket per block,
// each block's optimizer update runs as soon as its exchange finishes, during the rest of
// backward. With 2 workers the sums are the in-core run's (a + b is exact either way round),
// so the final parameters are bitwise equal, with activations kept or recomputed.
TEST(DistOutOfCore, AllreduceWithOffloadedWeightsEqualsInCore) {
  TempDir tmp;
  const auto o = with(kBase, {"model.name=gpt", "model.width=32", "model.depth=3",
                              "model.heads=2", "model.dropout=0.1", "data.synthetic_task=tokens",
                              "data.seq_len=16", "data.batch_size=8", "train.max_steps=8",
                              "optim.name=adamw", "optim.lr=0.003", "sync.mode=allreduce",
                              "memory.tier=host"});
  ASSERT_EQ(runRanks(2, tmp / "core", o), std::vector<int>({0, 0}))
      << test::readFile(tmp / "core.rank0.log");
  for (const std::string policy : {"keep", "recompute"}) {
    const auto off = with(o, {"memory.weights=offload", "memory.policy=" + policy});
    const std::string dir = tmp / ("offload-" + policy);
    ASSERT_EQ(runRanks(2, dir, off), std::vector<int>({0, 0}))
        << test::readFile(dir + ".rank0.log") << test::readFile(dir + ".rank1.log");
    EXPECT_EQ(maxAbsDiff(finalParams(tmp / "core", o), finalParams(dir, o)), 0.0) << policy;
    // The weights really moved: every step read and wrote them.
    std::istringstream lines(test::readFile(dir + "/metrics.jsonl"));
    int records = 0;
    for (std::string line; std::getline(lines, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["kind"] != "train") continue;
      ++records;
      EXPECT_GT(j.at("weights_read_bytes").get<double>(), 0.0) << j;
      EXPECT_GT(j.at("weights_written_bytes").get<double>(), 0.0) << j;
    }
    EXPECT_EQ(records, 8);
  }
}

// A user's scripted module (tests/python/script_models.py): data-parallel on W = 2 and 3 equals
// one worker with W times the batch, as for the built-in models; out-of-core weights on the
// scripted GPT twin are bitwise in-core.
TEST(DistScripted, DataParallelAndOutOfCoreAsForBuiltInModels) {
  TempDir tmp;
  const std::string models = test::scriptedModelsDir();
  ASSERT_FALSE(models.empty());
  // The GPT twin: layer norm, no batch statistics (batch norm is not data-parallel-invariant).
  const auto gptDp =
      with(kBase, {"model.name=torchscript", "model.path=" + models + "/gpt.pt",
                   "data.synthetic_task=tokens", "data.seq_len=24", "sync.first_bucket_mb=0.001",
                   "sync.bucket_mb=0.01", "train.max_steps=10"});
  for (int world : {2, 3}) {
    const auto single = with(gptDp, {"data.batch_size=" + std::to_string(4 * world)});
    const auto multi = with(gptDp, {"data.batch_size=4"});
    const std::string one = tmp / ("one" + std::to_string(world));
    const std::string many = tmp / ("many" + std::to_string(world));
    ASSERT_EQ(runRanks(1, one, single), std::vector<int>{0}) << test::readFile(one + ".rank0.log");
    ASSERT_EQ(runRanks(world, many, multi), std::vector<int>(world, 0))
        << test::readFile(many + ".rank0.log");
    const double diff = maxAbsDiff(finalParams(one, single), finalParams(many, multi));
    std::cout << "scripted gpt W=" << world << " max |single - data-parallel|: " << diff << "\n";
    EXPECT_LE(diff, 1e-5);
  }
  const auto gpt =
      with(kBase, {"model.name=torchscript", "model.path=" + models + "/gpt.pt",
                   "data.synthetic_task=tokens", "data.seq_len=24", "data.batch_size=8",
                   "train.max_steps=6", "optim.name=adamw", "optim.lr=0.003", "memory.tier=host"});
  ASSERT_EQ(runRanks(2, tmp / "core", gpt), std::vector<int>({0, 0}))
      << test::readFile(tmp / "core.rank0.log");
  const auto off = with(gpt, {"memory.weights=offload"});
  ASSERT_EQ(runRanks(2, tmp / "off", off), std::vector<int>({0, 0}))
      << test::readFile(tmp / "off.rank0.log");
  EXPECT_EQ(maxAbsDiff(finalParams(tmp / "core", gpt), finalParams(tmp / "off", gpt)), 0.0);
}

// Ranks started with different configs are refused on every rank before any tensor of the run
// moves (one used to abort inside Gloo on tensors of another size, exit 134, the other to report
// a lost peer); keys that may differ between hosts (threads, paths) do not count.
TEST(DistJob, RanksWithAnotherConfigAreRefusedOnEveryRank) {
  TempDir tmp;
  const auto base = with(kBase, {"model.name=mlp", "model.width=8", "data.batch_size=8"});
  const std::string log = tmp / "log";
  // Rank 0 with `base`, rank 1 with `base` and `more`, each in its own directory (as two hosts).
  auto runPair = [&](const std::vector<std::string>& more) {
    const int port = caravan::test::reservePort();
    std::string script;
    for (int r = 0; r < 2; ++r) {
      const auto o = r == 0 ? base : with(base, more);
      const std::string dir = tmp / ("rank" + std::to_string(r) + "-" + std::to_string(port));
      script += rankCommand(r, 2, port, 60,
                            "--config /dev/null" + setArgs(o) + " --run-dir " + dir + " >" + log +
                                std::to_string(r) + " 2>&1");
    }
    script += "for p in ${pids[@]}; do wait $p; echo $?; done";
    FILE* pipe = ::popen(("bash -c '" + script + "'").c_str(), "r");
    std::vector<int> codes;
    for (int code; std::fscanf(pipe, "%d", &code) == 1;) codes.push_back(code);
    ::pclose(pipe);
    return codes;
  };
  for (const std::string other : {"model.width=16", "sync.mode=gossip", "train.max_steps=30"}) {
    SCOPED_TRACE(other);
    EXPECT_EQ(runPair({other}), std::vector<int>({2, 2}))
        << test::readFile(log + "0") << test::readFile(log + "1");
    for (const std::string r : {"0", "1"}) {
      EXPECT_NE(test::readFile(log + r).find("rank 1 of 2 was started with another config than "
                                             "rank 0"),
                std::string::npos)
          << test::readFile(log + r);
    }
  }
  // Only what may differ between hosts differs: the job runs.
  EXPECT_EQ(runPair({"train.threads=2", "data.prefetch=3"}), std::vector<int>({0, 0}))
      << test::readFile(log + "0") << test::readFile(log + "1");
}

TEST(DistOutOfCore, StrategiesWithoutPerBlockExchangeAreRefused) {
  TempDir tmp;
  const auto o = with(kBase, {"model.name=mlp", "model.width=16", "sync.mode=gossip",
                              "memory.weights=offload", "memory.tier=host"});
  ASSERT_EQ(runRanks(2, tmp / "run", o), std::vector<int>({2, 2}));
  const std::string err = test::readFile(tmp / "run.rank0.log");
  EXPECT_NE(err.find("memory.weights = offload works with sync.mode = allreduce"),
            std::string::npos)
      << err;
}

// Kill and resume with the strategy's state in the checkpoint: a run stopped at step 9 (as a
// signal or a failed rank would stop it, with a checkpoint) and resumed ends with bitwise the
// parameters of the run that was not interrupted (and checkpointed at step 9 too: a checkpoint
// consolidates, e.g. OSP installs its pending stage 2 for it), for the deterministic strategies: all-reduce with top-k
// (every worker's residual), ps-bsp with momentum SGD and AdamW (the servers' optimizer state),
// ps-bsp with top-k pushes, and OSP with its layer-order split (servers' state and heavy-ball
// LGP's previous weights). A resumed run that restarted the servers' momentum or Adam moments
// could not be bitwise equal.
class DistResume : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(DistResume, StopAndResumeEqualsUninterrupted) {
  const auto [modeAndMore, workers, servers] = GetParam();
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "data.batch_size=8",
                        "checkpoint.every=9", "sync.osp_chunk=1000",
                        "sync.osp_policy=layer-order", "sync.osp_fraction=0.5",
                        "sync.topk_ratio=0.1"});
  std::istringstream parts(modeAndMore);
  for (std::string part; std::getline(parts, part, ',');) o.push_back(part);
  if (servers > 0) o.push_back("sync.servers=" + std::to_string(servers));
  const int world = workers + servers;
  ASSERT_EQ(runRanks(world, tmp / "whole", o), std::vector<int>(world, 0))
      << test::readFile(tmp / "whole.rank0.log");
  const std::string cut = tmp / "cut";
  ASSERT_EQ(runRanksWith(world, cut, "--config /dev/null" + setArgs(o) + " --run-dir " + cut +
                                         " --stop-at-step 9"),
            std::vector<int>(world, 0))
      << test::readFile(cut + ".rank0.log");
  ASSERT_EQ(runRanksWith(world, cut + "-resumed", "--resume " + cut),
            std::vector<int>(world, 0))
      << test::readFile(cut + "-resumed.rank0.log")
      << test::readFile(cut + "-resumed.rank" + std::to_string(world - 1) + ".log");
  const double diff = maxAbsDiff(finalParams(tmp / "whole", o), finalParams(cut, o));
  EXPECT_EQ(diff, 0.0) << modeAndMore;
  std::printf("%s, %d workers + %d servers, stopped at step 9 and resumed: max |difference| "
              "%.3g\n",
              modeAndMore.c_str(), workers, servers, diff);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, DistResume,
    ::testing::Values(
        std::make_tuple("sync.mode=allreduce,sync.compression=topk", 2, 0),
        std::make_tuple("sync.mode=ps-bsp", 2, 1),
        std::make_tuple("sync.mode=ps-bsp,optim.name=adamw", 2, 2),
        std::make_tuple("sync.mode=ps-bsp,sync.compression=topk", 2, 1),
        std::make_tuple("sync.mode=osp", 2, 1),
        // Streaming DiLoCo with int4: θ_sync, the outer momentum, every worker's residual and
        // every worker's own inner momentum; with AdamW inside, every worker's moments. (Streamed
        // fragments are not lockstep: the workers agree every train.log_every = 3 steps.)
        std::make_tuple("sync.mode=diloco,sync.local_period=3,sync.fragments=3,"
                        "sync.compression=int4,sync.outer_momentum=0.5,train.log_every=3",
                        2, 0),
        std::make_tuple("sync.mode=diloco,sync.local_period=2,optim.name=adamw", 3, 0),
        // The same through servers: their shards of the outer momentum and (int4 replies) of
        // θ_sync, which differs from the workers' θ̂ by the replies' rounding.
        // Stopped at step 9 with H = F = 4, the next round is fragment 1's, not fragment 0's: a
        // resumed schedule that restarted at step 0 would send the wrong fragment.
        std::make_tuple("sync.mode=ps-diloco,sync.local_period=4,sync.fragments=4,"
                        "sync.compression=int4,sync.outer_momentum=0.5,train.log_every=3",
                        2, 2),
        std::make_tuple("sync.mode=ps-diloco,sync.local_period=2,optim.name=adamw", 3, 1),
        // Local SGD's int8 averaging after a BSP phase of 5 steps (its residuals; plain SGD:
        // no per-worker state besides).
        std::make_tuple("sync.mode=local-sgd,sync.local_period=4,sync.compression=int8,"
                        "optim.momentum=0,sync.post_local_steps=5",
                        2, 0)));

// Resharding: a checkpoint of W workers resumes on W' workers. With the global batch kept
// (W x b = W' x b') the resumed run takes the same samples in the same steps, so it ends with
// the uninterrupted run's parameters up to the order of the float sums: 4 -> 2 and 2 -> 4
// workers under all-reduce, and ps-bsp with AdamW from 2 workers + 1 server to 4 workers + 2
// servers (the servers' Adam moments cut anew: restarted moments would make the first steps
// after the resume move each parameter by about lr = 3e-3, far beyond the bound).
TEST(DistReshard, ResumesOnAnotherNumberOfWorkers) {
  TempDir tmp;
  const auto o = with(kBase, {"model.name=mlp", "model.width=16", "checkpoint.every=0",
                              "optim.name=adamw", "optim.lr=0.003"});
  struct Case {
    std::string name;
    int from, to, servers;  // workers before and after; servers: before (after: 2x)
    std::string mode;
  };
  for (const Case& c : {Case{"allreduce 4 -> 2", 4, 2, 0, "allreduce"},
                        Case{"allreduce 2 -> 4", 2, 4, 0, "allreduce"},
                        Case{"ps-bsp 2+1 -> 4+2", 2, 4, 1, "ps-bsp"}}) {
    SCOPED_TRACE(c.name);
    const int global = 16;
    auto before = with(o, {"sync.mode=" + c.mode, "data.batch_size=" + std::to_string(global / c.from)});
    const int serversAfter = 2 * c.servers;
    if (c.servers > 0) before.push_back("sync.servers=" + std::to_string(c.servers));
    const std::string whole = tmp / (c.mode + std::to_string(c.from) + "whole");
    const std::string cut = tmp / (c.mode + std::to_string(c.from) + "cut");
    ASSERT_EQ(runRanks(c.from + c.servers, whole, before),
              std::vector<int>(c.from + c.servers, 0));
    ASSERT_EQ(runRanksWith(c.from + c.servers, cut,
                           "--config /dev/null" + setArgs(before) + " --run-dir " + cut +
                               " --stop-at-step 7"),
              std::vector<int>(c.from + c.servers, 0));
    std::string after = " --set data.batch_size=" + std::to_string(global / c.to);
    if (c.servers > 0) after += " --set sync.servers=" + std::to_string(serversAfter);
    ASSERT_EQ(runRanksWith(c.to + serversAfter, cut + "-resumed", "--resume " + cut + after),
              std::vector<int>(c.to + serversAfter, 0))
        << test::readFile(cut + "-resumed.rank0.log");
    const double diff = maxAbsDiff(finalParams(whole, before), finalParams(cut, before));
    EXPECT_LE(diff, 2e-6);
    std::printf("%s workers, global batch %d: max |difference| to the uninterrupted run %.3g\n",
                c.name.c_str(), global, diff);
  }
}

// The strategies whose future a resume does not replay (asynchronous servers, gossip, local
// SGD with its per-rank momentum, OSP's magnitude split), also resharded: stopped at step 20 of
// 40 and resumed (on the same or another number of workers and servers, the global batch of 24
// kept), the run ends within 5 accuracy points of the uninterrupted run. At this learning rate
// the model is mid-way (43-50% after 40 steps here, 10% is chance; one process after 20 steps
// is at 37%), so a resume that lost the model or its position would show.
class DistResumeAccuracy
    : public ::testing::TestWithParam<std::tuple<std::string, int, int, int, int>> {};

TEST_P(DistResumeAccuracy, ReachesTheUninterruptedAccuracyBand) {
  const auto [modeAndMore, workers, servers, workersAfter, serversAfter] = GetParam();
  TempDir tmp;
  auto o = with(kBase, {"model.name=mlp", "model.width=16", "optim.lr=0.005",
                        "train.max_steps=40", "checkpoint.every=0", "sync.osp_chunk=1000",
                        "sync.staleness=1", "data.batch_size=" + std::to_string(24 / workers)});
  std::istringstream parts(modeAndMore);
  for (std::string part; std::getline(parts, part, ',');) o.push_back(part);
  if (servers > 0) o.push_back("sync.servers=" + std::to_string(servers));
  const int world = workers + servers;
  ASSERT_EQ(runRanks(world, tmp / "whole", o), std::vector<int>(world, 0));
  const std::string cut = tmp / "cut";
  ASSERT_EQ(runRanksWith(world, cut, "--config /dev/null" + setArgs(o) + " --run-dir " + cut +
                                         " --stop-at-step 20"),
            std::vector<int>(world, 0));
  std::string after = " --set data.batch_size=" + std::to_string(24 / workersAfter);
  if (serversAfter > 0) after += " --set sync.servers=" + std::to_string(serversAfter);
  ASSERT_EQ(runRanksWith(workersAfter + serversAfter, cut + "-resumed", "--resume " + cut + after),
            std::vector<int>(workersAfter + serversAfter, 0))
      << test::readFile(cut + "-resumed.rank0.log");
  auto accuracy = [](const std::string& run) {
    return nlohmann::json::parse(test::readFile(run + "/summary.json"))["eval_accuracy"]
        .get<double>();
  };
  const double whole = accuracy(tmp / "whole"), resumed = accuracy(cut);
  EXPECT_GT(whole, 0.3) << "the uninterrupted run must have learned";
  EXPECT_NEAR(resumed, whole, 0.05);
  std::printf("%s, %d+%d resumed on %d+%d: accuracy %.3f uninterrupted, %.3f resumed at 20\n",
              modeAndMore.c_str(), workers, servers, workersAfter, serversAfter, whole, resumed);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, DistResumeAccuracy,
    ::testing::Values(std::make_tuple("sync.mode=ps-asp", 3, 1, 3, 1),
                      std::make_tuple("sync.mode=ps-ssp", 3, 1, 2, 2),
                      std::make_tuple("sync.mode=gossip", 3, 0, 2, 0),
                      std::make_tuple("sync.mode=local-sgd,sync.local_period=4", 2, 0, 3, 0),
                      std::make_tuple("sync.mode=diloco,sync.local_period=4,sync.fragments=2,"
                                      "sync.compression=int8",
                                      2, 0, 3, 0),
                      std::make_tuple("sync.mode=osp,sync.osp_policy=magnitude", 2, 1, 3, 2),
                      // ps-diloco from 2 workers + 1 server to 3 + 2: the servers' momentum and
                      // θ_sync cut again for 2 shards, residuals and inner state averaged.
                      std::make_tuple("sync.mode=ps-diloco,sync.local_period=4,sync.fragments=2,"
                                      "sync.compression=int4",
                                      2, 1, 3, 2)));

// ---- pipeline stages: `caravan train` with parallel.pipeline_stages = K on K workers ----------

namespace {

// A GPT of 5 blocks (embedding, 3 transformer blocks, head) on synthetic tokens, with AdamW and
// clipping (the global norm spans the stages).
std::vector<std::string> pipelineBase(const std::vector<std::string>& more) {
  return with(with(kBase, {"data.synthetic_task=tokens", "data.seq_len=16", "model.name=gpt",
                           "model.width=16", "model.depth=3", "model.heads=2", "optim.name=adamw",
                           "optim.lr=0.003", "optim.grad_clip=0.5", "data.batch_size=8"}),
              more);
}

// sqrt(sum |a - b|^2 / sum |b|^2) over every parameter.
double relativeDifference(const std::map<std::string, at::Tensor>& a,
                          const std::map<std::string, at::Tensor>& b) {
  double num = 0.0, den = 0.0;
  for (const auto& [name, t] : b) {
    num += (a.at(name) - t).pow(2).sum().item<double>();
    den += t.pow(2).sum().item<double>();
  }
  return std::sqrt(num / den);
}

// Trains `oracle` on one worker and `pipeline` on `workers` ranks (runs TMP/one, TMP/many) and
// expects the same parameters after 20 steps (relative difference <= 1e-6, printed after
// `what`) and the same train losses (relative 1e-6).
void expectPipelineEqualsOneWorker(const TempDir& tmp, const std::vector<std::string>& oracle,
                                   int workers, const std::vector<std::string>& pipeline,
                                   const std::string& what) {
  ASSERT_EQ(runRanks(1, tmp / "one", oracle), std::vector<int>{0})
      << test::readFile(tmp / "one.rank0.log");
  ASSERT_EQ(runRanks(workers, tmp / "many", pipeline), std::vector<int>(workers, 0))
      << test::readFile(tmp / "many.rank0.log")
      << test::readFile(tmp / ("many.rank" + std::to_string(workers - 1) + ".log"));
  const double diff =
      relativeDifference(finalParams(tmp / "many", oracle), finalParams(tmp / "one", oracle));
  std::printf("%s, 20 steps: relative difference %.3g\n", what.c_str(), diff);
  EXPECT_LE(diff, 1e-6);
  const auto a = test::trainLosses(tmp / "one"), b = test::trainLosses(tmp / "many");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-6 * std::abs(a[i])) << i;
  // The final evaluation ran through the stages (no rank holds the whole model): it scores
  // what one worker's evaluation of nearly the same parameters does.
  const auto one = nlohmann::json::parse(test::readFile(tmp / "one/summary.json"));
  const auto many = nlohmann::json::parse(test::readFile(tmp / "many/summary.json"));
  const double loss = one["eval_loss"].get<double>();
  EXPECT_NEAR(many["eval_loss"].get<double>(), loss, 1e-5 * loss);
  EXPECT_NEAR(many["eval_accuracy"].get<double>(), one["eval_accuracy"].get<double>(), 1e-3);
}

}  // namespace

// With one micro-batch a pipeline computes exactly one worker's step (no pipeline code on the
// single worker's side): the oracle is plain training.
TEST(DistPipeline, TwoStagesOfOneMicroBatchEqualOneWorker) {
  expectPipelineEqualsOneWorker(
      TempDir(), pipelineBase({}), 2,
      pipelineBase({"parallel.pipeline_stages=2", "parallel.micro_batches=1"}),
      "K=2 M=1 against one worker");
}

// M micro-batches on K stages equal one worker accumulating the same M micro-batches
// (parallel.micro_batches = M alone; PipelineExactness checks that against a hand-written loop).
class DistPipelineSchedules : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(DistPipelineSchedules, EqualGradientAccumulationOnOneWorker) {
  const auto [schedule, stages] = GetParam();
  expectPipelineEqualsOneWorker(
      TempDir(), pipelineBase({"parallel.micro_batches=4"}), stages,
      pipelineBase({"parallel.micro_batches=4", "parallel.schedule=" + schedule,
                    "parallel.pipeline_stages=" + std::to_string(stages)}),
      schedule + " K=" + std::to_string(stages) +
          " M=4 against one worker accumulating 4 micro-batches");
}

INSTANTIATE_TEST_SUITE_P(Schedules, DistPipelineSchedules,
                         ::testing::Combine(::testing::Values("gpipe", "1f1b", "zb-h1"),
                                            ::testing::Values(2, 3, 4)));

// A user's scripted module (tests/python/script_models.py's GPT, saved by PyTorch) cut into
// stages trains as one worker accumulating the same micro-batches.
TEST(DistPipeline, ScriptedModelStagesEqualOneWorker) {
  const std::string dir = test::scriptedModelsDir();
  ASSERT_FALSE(dir.empty())
      << "tests/python/script_models.py failed (.venv: bash scripts/setup.sh)";
  const auto scripted = with(
      kBase, {"data.synthetic_task=tokens", "data.seq_len=24", "data.batch_size=8",
              "optim.name=adamw", "optim.lr=0.003", "optim.grad_clip=0.5", "model.name=torchscript",
              "model.path=" + dir + "/gpt.pt", "parallel.micro_batches=4"});
  expectPipelineEqualsOneWorker(TempDir(), scripted, 2,
                                with(scripted, {"parallel.pipeline_stages=2"}),
                                "scripted GPT, K=2 M=4 against one worker accumulating 4");
}

// 2-D: D = 2 pipelines of K = 2 stages, each stage averaging its gradients with its replica,
// equal one worker accumulating the two pipelines' micro-batches (a batch of D x b in D x M
// micro-batches: the same samples, as the data-parallel equivalence above).
TEST(DistPipeline, TwoPipelinesOfTwoStagesEqualOneWorkerWithTheirBatches) {
  expectPipelineEqualsOneWorker(
      TempDir(), pipelineBase({"data.batch_size=16", "parallel.micro_batches=8"}), 4,
      pipelineBase({"parallel.pipeline_stages=2", "parallel.micro_batches=4"}),
      "K=2 x D=2, M=4 against one worker with batch 16 in 8 micro-batches");
}

// Gradient accumulation on D workers (one stage each, D replicas averaging): one worker
// accumulating the D workers' micro-batches.
TEST(DistPipeline, GradientAccumulationOnTwoWorkersEqualsOneWorkerWithTheirBatches) {
  expectPipelineEqualsOneWorker(
      TempDir(), pipelineBase({"data.batch_size=16", "parallel.micro_batches=8"}), 2,
      pipelineBase({"parallel.micro_batches=4"}),
      "K=1 x D=2, M=4 against one worker with batch 16 in 8 micro-batches");
}

// Activation policies run per micro-batch on each stage: every fixed policy (and a mix per
// block) gives keep's parameters bitwise, for gpipe and 1f1b.
TEST(DistPipeline, EveryFixedPolicyEqualsKeep) {
  TempDir tmp;
  for (const std::string schedule : {"1f1b", "gpipe"}) {
    const auto base = pipelineBase({"parallel.pipeline_stages=2", "parallel.micro_batches=4",
                                    "parallel.partition=even", "parallel.schedule=" + schedule});
    ASSERT_EQ(runRanks(2, tmp / ("keep-" + schedule), base), std::vector<int>(2, 0));
    const auto keep = finalParams(tmp / ("keep-" + schedule), pipelineBase({}));
    for (const std::string policy :
         {"recompute", "swap", "swap-input", "keep,recompute,swap,keep,swap-input"}) {
      const std::string run = tmp / (schedule + "-" + std::to_string(policy.size()));
      ASSERT_EQ(runRanks(2, run, with(base, {"memory.policy=" + policy})), std::vector<int>(2, 0))
          << test::readFile(run + ".rank0.log") << test::readFile(run + ".rank1.log");
      EXPECT_EQ(relativeDifference(finalParams(run, pipelineBase({})), keep), 0.0)
          << schedule << " " << policy;
    }
  }
}

// memory.policy = auto: under a budget no cut fits keeping (one byte below the leanest cut's
// need), the partition recomputes blocks on the stages that need it. Training equals one worker
// accumulating the micro-batches; every stage's tracked peak stays within the budget.
TEST(DistPipeline, AutoPolicyRecomputesUnderABudgetKeepingCannotFit) {
  TempDir tmp;
  const auto stages = pipelineBase({"parallel.pipeline_stages=2", "parallel.micro_batches=4"});
  int64_t budget = 0;
  {
    installSavedTensorEngine();  // as caravan plan does before profiling
    const Config c = Config::fromString("", "<test>", stages);
    RunSetup setup = RunSetup::forInspection(c);
    setup.model->train();
    budget =
        planPipeline(setup.options, setup.model, setup.sampleBatch()).partition.smallestBudget - 1;
  }
  expectPipelineEqualsOneWorker(
      tmp, pipelineBase({"parallel.micro_batches=4"}), 2,
      with(stages, {"memory.policy=auto", "memory.budget=" + std::to_string(budget)}),
      "K=2 M=4 recomputing under " + std::to_string(budget) + " bytes against one worker");
  const std::string plan = test::readFile(tmp / "many/pipeline_plan.txt");
  EXPECT_NE(plan.find(" ms) |"), std::string::npos) << "no stage recomputes:\n" << plan;
  std::istringstream lines(test::readFile(tmp / "many/metrics.jsonl"));
  int records = 0;
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("kind", "") != "train") continue;
    ++records;
    for (const auto& peak : j.at("rank_mem_tracked_peak")) EXPECT_LE(peak.get<int64_t>(), budget);
  }
  EXPECT_GT(records, 0);
}

// Checkpoints do not depend on the layout: rank 0 writes every stage's parameters and optimizer
// state, so a run of 4 stages stopped at step 9 resumes on 2 stages and on one worker and ends
// where the uninterrupted 4-stage run does.
TEST(DistPipeline, CheckpointOfFourStagesResumesOnTwoAndOnOne) {
  TempDir tmp;
  const auto four = pipelineBase(
      {"parallel.micro_batches=4", "parallel.pipeline_stages=4", "checkpoint.every=9"});
  ASSERT_EQ(runRanks(4, tmp / "whole", four), std::vector<int>(4, 0))
      << test::readFile(tmp / "whole.rank0.log");
  const auto expected = finalParams(tmp / "whole", pipelineBase({}));
  for (int stages : {2, 1}) {
    const std::string cut = tmp / ("cut" + std::to_string(stages));
    ASSERT_EQ(runRanksWith(
                  4, cut,
                  "--config /dev/null" + setArgs(four) + " --run-dir " + cut + " --stop-at-step 9"),
              std::vector<int>(4, 0))
        << test::readFile(cut + ".rank0.log");
    ASSERT_EQ(runRanksWith(
                  stages, cut + "-resumed",
                  "--resume " + cut + " --set parallel.pipeline_stages=" + std::to_string(stages)),
              std::vector<int>(stages, 0))
        << test::readFile(cut + "-resumed.rank0.log");
    // The resumed run continued at step 10 (a run that started over would log steps 1..20
    // twice and still end where the whole run did).
    std::vector<int64_t> steps;
    std::istringstream lines(test::readFile(cut + "/metrics.jsonl"));
    for (std::string line; std::getline(lines, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.value("kind", "") == "train") steps.push_back(j.at("step").get<int64_t>());
    }
    ASSERT_EQ(steps.size(), 20u);
    for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i], static_cast<int64_t>(i + 1));
    const double diff = relativeDifference(finalParams(cut, pipelineBase({})), expected);
    std::printf("4 stages stopped at step 9, resumed on %d: relative difference %.3g\n", stages,
                diff);
    EXPECT_LE(diff, 1e-6);
  }
}

// The same pipeline over MPI (Open MPI's point to point) ends where it does over Gloo.
TEST(DistPipeline, MpiStagesEqualGlooStages) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "mpirun not installed (bash scripts/setup.sh installs openmpi-bin)";
  }
  TempDir tmp;
  const auto gloo = pipelineBase(
      {"parallel.pipeline_stages=3", "parallel.micro_batches=4", "parallel.schedule=zb-h1"});
  const auto mpi = with(gloo, {"dist.backend=mpi"});
  ASSERT_EQ(runRanks(3, tmp / "gloo", gloo), std::vector<int>(3, 0));
  const std::string cmd =
      "cd " + tmp.path() +
      " && timeout 300 mpirun --allow-run-as-root --oversubscribe --bind-to none "
      "--mca btl self,vader -np 3 -x OMP_NUM_THREADS=1 " +
      CARAVAN_BINARY + " train -q --config /dev/null" + setArgs(mpi) + " --run-dir " +
      (tmp / "mpi") + " >" + (tmp / "mpi.log") + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << test::readFile(tmp / "mpi.log");
  const auto base = pipelineBase({});
  const double diff =
      relativeDifference(finalParams(tmp / "mpi", base), finalParams(tmp / "gloo", base));
  std::printf("zb-h1 K=3 M=4 over MPI against Gloo, 20 steps: relative difference %.3g\n", diff);
  EXPECT_LE(diff, 1e-6);
}

TEST(DistPipeline, LayoutsThatCannotRunAreRefusedInOneLine) {
  TempDir tmp;
  struct Case {
    std::vector<std::string> set;
    int workers;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"parallel.pipeline_stages=2"}, 3, "does not divide 3 workers"},
      {{"parallel.pipeline_stages=2", "dist.backend=mpi"},
       4,
       "does not run on dist.backend = mpi yet"},
      {{"parallel.pipeline_stages=2", "parallel.micro_batches=3"}, 2, "does not split into"},
      {{"parallel.pipeline_stages=2", "sync.mode=gossip"}, 2, "leave sync.mode at allreduce"},
      {{"parallel.pipeline_stages=2", "memory.policy=auto", "memory.budget=1KB"},
       2,
       "fits no partition of the model into 2 stages; the smallest budget one fits is"},
      {{"parallel.pipeline_stages=2", "parallel.schedule=zb-h1", "memory.policy=recompute"},
       2,
       "parallel.schedule = 1f1b"},
      {{"parallel.pipeline_stages=6"}, 6, "every stage needs at least one"},
      {{"parallel.pipeline_stages=2", "parallel.partition=7"}, 2, "does not cut 5 blocks"},
      {{"parallel.pipeline_stages=2", "sync.compression=topk"}, 2, "sync.compression = none"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string run = tmp / ("bad" + std::to_string(i));
    const auto codes = runRanks(cases[i].workers, run, pipelineBase(cases[i].set));
    EXPECT_EQ(codes, std::vector<int>(cases[i].workers, 2)) << cases[i].says;
    const std::string err = test::readFile(run + ".rank0.log");
    EXPECT_NE(err.find(cases[i].says), std::string::npos) << err;
    EXPECT_EQ(test::countLines(err), 1) << err;
  }
}

// Sharded data parallelism (sync.shard, sync/sharding.h) against sync.shard = none.
namespace {

const std::vector<std::string> kShardGpt = {"data.dataset=synthetic",  "data.synthetic_task=tokens",
                                            "data.synthetic_size=480", "model.name=gpt",
                                            "model.width=32",          "model.depth=3",
                                            "data.seq_len=16",         "data.batch_size=4",
                                            "train.max_steps=30",      "train.log_every=1",
                                            "train.eval_every=10",     "optim.name=adamw",
                                            "optim.lr=0.01",           "seed.init=3",
                                            "train.threads=1",         "fault.timeout=60"};

const char* const kShardLevelNames[] = {"optimizer", "gradients", "parameters"};

// Each level's run against none's on `world` ranks with `overrides`: the largest relative loss
// difference over the steps and evaluations and the largest final parameter difference; every
// run must end.
struct ShardDifference {
  double loss = 0.0, params = 0.0;
};
std::map<std::string, ShardDifference> shardDifferences(int world,
                                                        const std::vector<std::string>& o,
                                                        const std::vector<std::string>& levels = {
                                                            std::begin(kShardLevelNames),
                                                            std::end(kShardLevelNames)}) {
  TempDir tmp;
  std::map<std::string, ShardDifference> out;
  const std::string none = tmp / "none";
  EXPECT_EQ(runRanks(world, none, o), std::vector<int>(world, 0))
      << test::readFile(none + ".rank0.log");
  const auto noneLoss = test::trainLosses(none);
  const auto noneEval = test::losses(none, "eval");
  const auto noneParams = finalParams(none, o);
  for (const std::string& level : levels) {
    const auto sharded = with(o, {"sync.shard=" + level});
    const std::string dir = tmp / level;
    const auto codes = runRanks(world, dir, sharded);
    EXPECT_EQ(codes, std::vector<int>(world, 0)) << level << test::readFile(dir + ".rank0.log");
    if (codes != std::vector<int>(world, 0)) continue;
    const auto loss = test::trainLosses(dir);
    EXPECT_EQ(loss.size(), noneLoss.size()) << level;
    ShardDifference d;
    for (size_t i = 0; i < std::min(loss.size(), noneLoss.size()); ++i) {
      d.loss = std::max(d.loss, std::abs(loss[i] - noneLoss[i]) / std::abs(noneLoss[i]));
    }
    const auto eval = test::losses(dir, "eval");  // the evaluations count as losses too
    EXPECT_EQ(eval.size(), noneEval.size()) << level;
    for (size_t i = 0; i < std::min(eval.size(), noneEval.size()); ++i) {
      d.loss = std::max(d.loss, std::abs(eval[i] - noneEval[i]) / std::abs(noneEval[i]));
    }
    d.params = maxAbsDiff(noneParams, finalParams(dir, o));
    std::printf("W=%d sync.shard = %s: relative loss difference %.3g, parameters %.3g\n", world,
                level.c_str(), d.loss, d.params);
    out[level] = d;
  }
  return out;
}

class DistSharded : public ::testing::TestWithParam<int> {};

}  // namespace

// Through shared memory every element's gradient is summed over the ranks in rank order
// whatever the layout (an all-reduce's bucket or a reduce-scatter's unit), and the optimizers
// are elementwise, so every level trains the same bits as none for 30 steps: losses, evaluations
// (every 10 steps, the ranks with no batch of a round making its gathers) and parameters.
TEST_P(DistSharded, EveryLevelTrainsTheBitsOfNoneThroughSharedMemory) {
  const int world = GetParam();
  for (const auto& [level, d] : shardDifferences(world, with(kShardGpt, {"dist.backend=shm"}))) {
    EXPECT_EQ(d.loss, 0.0) << level;
    EXPECT_EQ(d.params, 0.0) << level;
  }
}

INSTANTIATE_TEST_SUITE_P(Workers, DistSharded, ::testing::Values(2, 3, 4));

// Gloo's ring sums each chunk in the ring's order, which follows the layout: rounding apart,
// also with clipping (the global norm from the slices' squares): losses within 1e-6 (measured
// 1.5e-7). AdamW at lr = 0.01 turns the rounding of near-zero gradients into whole steps of some
// elements (m / sqrt(v) changes sign), so the parameters are bounded by half a step (measured
// 8.5e-4, the same for the three levels). And bf16 blocks through shm: the same bits.
TEST(DistShardedRounding, GlooWithClippingAndBf16StayWithinRounding) {
  for (const auto& [level, d] :
       shardDifferences(3, with(kShardGpt, {"dist.backend=gloo", "optim.grad_clip=0.5"}))) {
    EXPECT_LE(d.loss, 1e-6) << level;
    EXPECT_LE(d.params, 5e-3) << level;
  }
  test::EmulateBf16 emulated;  // where the CPU has no bf16 instructions
  for (const auto& [level, d] :
       shardDifferences(2, with(kShardGpt, {"dist.backend=shm", "train.precision=bf16-all"}))) {
    EXPECT_EQ(d.loss, 0.0) << level;
    EXPECT_EQ(d.params, 0.0) << level;
  }
}

// Activation policies: saved weights stay weights (the executor knows the units' storages,
// empty ones too), so recomputing (every level) and swapping (optimizer, gradients; through
// the host tier, in bf16 too: weights never travel) train the bits none trains.
TEST(DistShardedRounding, RecomputeAndSwapPoliciesTrainTheBitsOfNone) {
  const auto o = with(kShardGpt, {"dist.backend=shm", "memory.tier=host", "train.max_steps=10"});
  for (const auto& [level, d] : shardDifferences(2, with(o, {"memory.policy=recompute"}))) {
    EXPECT_EQ(d.loss, 0.0) << level;
    EXPECT_EQ(d.params, 0.0) << level;
  }
  for (const auto& [level, d] :
       shardDifferences(2, with(o, {"memory.policy=swap", "memory.tier_dtype=bf16"}),
                        {"optimizer", "gradients"})) {
    EXPECT_EQ(d.loss, 0.0) << level;
    EXPECT_EQ(d.params, 0.0) << level;
  }
}

// A tied embedding and head (nanoGPT's form, exported from Python) is one unit of its own,
// gathered throughout: equal to none.
TEST(DistShardedRounding, TiedWeightsOfAStockModelAreOneSlice) {
  if (!test::transformersInstalled()) GTEST_SKIP() << "transformers is not in the project's Python";
  const test::StockExport nanogpt = test::exportStockModel("nanogpt");
  ASSERT_EQ(nanogpt.run.exitCode, 0) << nanogpt.run.err;
  std::vector<std::string> o;
  for (const auto& kv : kShardGpt) {
    if (kv.rfind("model.", 0) != 0) o.push_back(kv);  // the scripted module is what it is
  }
  o = with(o, {"model.name=torchscript", "model.path=" + nanogpt.path, "data.vocab_size=64",
               "train.max_steps=10", "dist.backend=shm"});
  for (const auto& [level, d] : shardDifferences(2, o)) {
    EXPECT_EQ(d.loss, 0.0) << level;
    EXPECT_EQ(d.params, 0.0) << level;
  }
}

// memory.weights = offload with sync.shard = parameters (ZeRO-Infinity): each rank's slices and
// their AdamW state live on the tier between uses (read back for the gathers and the update,
// written after it), and it trains the bits of offload alone (itself bitwise the in-core run),
// through the host tier and the disk tier, W = 2 and 3, evaluations included, with clipping,
// and across a stop and resume.
TEST(DistShardedOffload, SlicesOnTheTierTrainTheBitsOfNone) {
  for (const char* tier : {"host", "disk"}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE(std::string(tier) + " W=" + std::to_string(world));
      const auto o =
          with(kShardGpt, {"dist.backend=shm", "memory.weights=offload",
                           std::string("memory.tier=") + tier, "memory.swap_dir=/var/tmp"});
      for (const auto& [level, d] : shardDifferences(world, o, {"parameters"})) {
        EXPECT_EQ(d.loss, 0.0) << level;
        EXPECT_EQ(d.params, 0.0) << level;
      }
    }
  }
  // Clipping: the global norm from the gradients' squares taken before they went to the tier,
  // the coefficient applied when each is read back for its update: the bits of the in-memory
  // slices (whose norm sums in another order than none's: DistShardedRounding).
  TempDir tmp;
  const auto clipped = with(kShardGpt, {"dist.backend=shm", "sync.shard=parameters",
                                        "memory.tier=host", "optim.grad_clip=0.05"});
  std::map<std::string, std::vector<double>> losses;
  std::map<std::string, std::map<std::string, at::Tensor>> params;
  for (const char* weights : {"core", "offload"}) {
    const auto o = with(clipped, {std::string("memory.weights=") + weights});
    const std::string dir = tmp / weights;
    ASSERT_EQ(runRanks(2, dir, o), std::vector<int>(2, 0)) << test::readFile(dir + ".rank0.log");
    losses[weights] = test::trainLosses(dir);
    params[weights] = finalParams(dir, o);
  }
  EXPECT_EQ(losses["core"], losses["offload"]);
  EXPECT_EQ(maxAbsDiff(params["core"], params["offload"]), 0.0);
  // Stopped at step 12 and resumed: the checkpoint reads each rank's slices and state back for
  // its slice file, the resumed run installs them and moves them to the tier again: the bits of
  // the uninterrupted run.
  const auto o =
      with(kShardGpt,
           {"dist.backend=shm", "sync.shard=parameters", "memory.weights=offload",
            "memory.tier=host", "train.max_steps=24", "train.eval_every=0", "checkpoint.every=0"});
  const std::string whole = tmp / "whole", cut = tmp / "cut";
  ASSERT_EQ(runRanks(2, whole, o), std::vector<int>(2, 0)) << test::readFile(whole + ".rank0.log");
  ASSERT_EQ(
      runRanksWith(2, cut,
                   "--config /dev/null" + setArgs(o) + " --run-dir " + cut + " --stop-at-step 12"),
      std::vector<int>(2, 0));
  ASSERT_EQ(runRanksWith(2, cut + "-resumed", "--resume " + cut), std::vector<int>(2, 0))
      << test::readFile(cut + "-resumed.rank0.log");
  EXPECT_EQ(maxAbsDiff(finalParams(whole, o), finalParams(cut, o)), 0.0);
}

// LibTorch's CPU allocator, counted: the bytes it hands out from reset() on, live and peak
// (those freed that it handed out before reset() are not seen: a peak over-counts). Installed
// for the process's life once made (what it handed out may outlive any test).
class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& installed() {
    static auto* counting = new CountingCpuAllocator();  // never freed, see above
    return *counting;
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_.clear();  // freed later, not counted
    live_ = peak_ = 0;
  }
  int64_t peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  c10::DataPtr allocate(size_t n) override {
    void* data = inner_->raw_allocate(n);  // its context is its data (raw_allocate's rule)
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_[data] = static_cast<int64_t>(n);
    live_ += static_cast<int64_t>(n);
    peak_ = std::max(peak_, live_);
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  CountingCpuAllocator() : inner_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this); }
  static void release(void* data) {
    CountingCpuAllocator& self = installed();
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      const auto it = self.bytes_.find(data);
      if (it != self.bytes_.end()) {
        self.live_ -= it->second;
        self.bytes_.erase(it);
      }
    }
    self.inner_->raw_deallocate(data);
  }
  c10::Allocator* inner_;
  std::mutex mutex_;
  std::map<void*, int64_t> bytes_;
  int64_t live_ = 0, peak_ = 0;
};

// Under memory.weights = offload, the end of a run writes each rank's slice file and model.pt
// a unit at a time, whatever the depth: while the slice file is written the memory held grows
// by less than three and a half units' slices with their AdamW state (12 bytes an element: the
// tracked tier pieces, this unit's and the next one's read ahead, plus what LibTorch's allocator
// hands out, the state's copy for the file; measured: 3.0 units), where the whole slices are
// over 24 units'; while model.pt is
// written, by less than ten units' weights (two units gathered, their slices read back and read
// ahead, the collective's buffers), where the whole model is over 24 units' (and the whole gathered
// and copied for the file, over 48, was the old way's). model.pt is the bytes exportStateDict
// writes of the model read back whole from that checkpoint. W = 1: one rank, each slice its whole
// unit (the slices read back weigh as much as the gathered units).
TEST(DistShardedOffload, EndOfRunWritesHoldAFewUnitsAtATime) {
  TempDir tmp;
  DataShape shape;
  shape.task = TaskKind::kLanguageModel;
  shape.vocabSize = 64;
  shape.seqLen = 16;
  ModelSpec spec;
  spec.name = "gpt";
  spec.width = 64;
  spec.depth = 24;
  spec.heads = 4;
  torch::manual_seed(3);
  BlockModel model = buildModel(spec, shape);
  const ExportNames names = [&](const std::string& n) { return model->exportNames(n); };
  CountingCpuAllocator& allocated = CountingCpuAllocator::installed();
  std::optional<std::string> written;
  const auto errors = test::runGlooRanks(
      1, test::loopbackOptions(std::chrono::seconds(60)), [&](std::shared_ptr<Communicator> comm) {
        MemoryTracker tracker;
        HostTier tier;
        auto shards =
            std::make_unique<ShardedParameters>(model, comm, ShardLevel::kParameters, &tracker, 0);
        int64_t largest = 0, total = 0;  // elements of the units' slices
        for (const at::Tensor& s : shards->shards()) {
          largest = std::max(largest, s.numel());
          total += s.numel();
        }
        torch::optim::AdamW whole(model->parameters());
        auto sliced = std::make_unique<torch::optim::AdamW>(shards->shards());
        ShardedStep engine(model, whole, StepOptions{}, std::move(shards), std::move(sliced),
                           nullptr, "", &tier);
        const at::Tensor tokens = at::randint(64, {2, 17}, at::kLong);
        engine.step({tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16)}, 0);  // AdamW's state
        ASSERT_GE(total, 24 * largest);  // the bounds below are well under the whole

        TrainingState state;
        state.step = 1;
        state.rngState = defaultRngState();
        const int64_t before = tracker.totalLive();
        tracker.resetPeaks();
        allocated.reset();
        written = engine.writeShardedCheckpoint(CheckpointDir(tmp / "run", 1), state);
        const int64_t unitBytes = 12 * largest;
        EXPECT_LT(tracker.totalPeak() - before + allocated.peak(), 7 * unitBytes / 2)
            << "tracked " << tracker.totalPeak() - before << ", allocated " << allocated.peak();

        const int64_t settled = tracker.totalLive();
        tracker.resetPeaks();
        allocated.reset();
        engine.exportModel(tmp / "streamed.pt", *model, names);
        EXPECT_LT(tracker.totalPeak() - settled + allocated.peak(), 10 * 4 * largest)
            << "tracked " << tracker.totalPeak() - settled << ", allocated " << allocated.peak();
      });
  ASSERT_EQ(errors, std::vector<std::string>{""});
  ASSERT_TRUE(written.has_value());
  torch::manual_seed(4);  // other initial weights: the checkpoint's replace them
  BlockModel read = buildModel(spec, shape);
  torch::optim::AdamW readOptimizer(read->parameters());
  loadCheckpoint(*written, *read, readOptimizer, nlohmann::json(), std::nullopt);
  exportStateDict(tmp / "whole.pt", *read,
                  [&](const std::string& n) { return read->exportNames(n); });
  EXPECT_TRUE(test::readFile(tmp / "streamed.pt") == test::readFile(tmp / "whole.pt"))
      << (tmp / "streamed.pt") << " and " << (tmp / "whole.pt") << " differ";
}

// The files in RUN_DIR/checkpoints/, by name.
std::vector<std::string> checkpointFiles(const std::string& runDir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(fs::path(runDir) / "checkpoints")) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// How many of `names` start with `prefix` and end with `suffix`.
int countNamed(const std::vector<std::string>& names, const std::string& prefix,
               const std::string& suffix) {
  return static_cast<int>(std::count_if(names.begin(), names.end(), [&](const std::string& n) {
    return n.rfind(prefix, 0) == 0 && n.size() >= suffix.size() &&
           n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0;
  }));
}

// bf16 gathers (sync/sharding.h): with every block in bf16, sync.shard = parameters gathers the
// linear layers' weights in bf16 and trains the bits none trains in bf16: W = 2, 3 and 4, and
// with its slices offloaded. Its checkpoint (units in two groups) resumes bitwise on as many
// workers, resumes on 2 after 4 as none's does, and consolidates to the run's model.pt, which
// is none's (the float32 masters, not their bf16 copies). On a CPU without bf16 instructions
// the runs emulate bf16 (CARAVAN_EMULATE_BF16); ranks as threads check the gathers step by step
// (test_sync.cpp, ShardedBf16Gathers).
TEST(DistShardedBf16, GathersInBf16TrainTheBitsOfNoneAndItsCheckpointsResume) {
  test::EmulateBf16 emulated;  // where the CPU has no bf16 instructions
  const auto o = with(kShardGpt, {"dist.backend=shm", "train.precision=bf16-all"});
  for (int world : {2, 3, 4}) {
    for (const auto& [level, d] : shardDifferences(world, o, {"parameters"})) {
      EXPECT_EQ(d.loss, 0.0) << world;
      EXPECT_EQ(d.params, 0.0) << world;
    }
  }
  for (const auto& [level, d] : shardDifferences(
           2, with(o, {"memory.weights=offload", "memory.tier=host"}), {"parameters"})) {
    EXPECT_EQ(d.loss, 0.0) << "offload";
    EXPECT_EQ(d.params, 0.0) << "offload";
  }
  TempDir tmp;
  const auto r = with(o, {"train.max_steps=24", "train.eval_every=0", "checkpoint.every=0"});
  auto stopAt12 = [&](int world, const std::vector<std::string>& s, const std::string& cut) {
    return runRanksWith(
        world, cut, "--config /dev/null" + setArgs(s) + " --run-dir " + cut + " --stop-at-step 12");
  };
  const auto p = with(r, {"sync.shard=parameters"});
  const std::string whole = tmp / "whole", cut = tmp / "cut";
  ASSERT_EQ(runRanks(2, whole, p), std::vector<int>(2, 0)) << test::readFile(whole + ".rank0.log");
  ASSERT_EQ(stopAt12(2, p, cut), std::vector<int>(2, 0)) << test::readFile(cut + ".rank0.log");
  ASSERT_EQ(runRanksWith(2, cut + "-resumed", "--resume " + cut), std::vector<int>(2, 0))
      << test::readFile(cut + "-resumed.rank0.log");
  EXPECT_EQ(maxAbsDiff(finalParams(whole, p), finalParams(cut, p)), 0.0);
  const auto consolidated =
      test::runCaravan("checkpoint consolidate " + whole + " --out " + (tmp / "model.pt"));
  ASSERT_EQ(consolidated.exitCode, 0) << consolidated.err;
  EXPECT_TRUE(test::readFile(tmp / "model.pt") == test::readFile(whole + "/model.pt"))
      << (tmp / "model.pt") << " and " << (whole + "/model.pt") << " differ";
  const std::string none = tmp / "none";
  ASSERT_EQ(runRanks(2, none, r), std::vector<int>(2, 0));
  EXPECT_TRUE(test::readFile(whole + "/model.pt") == test::readFile(none + "/model.pt"))
      << (whole + "/model.pt") << " and " << (none + "/model.pt") << " differ";
  // 4 -> 2 workers (global batch 16): parameters' resumed run is none's.
  std::map<std::string, std::map<std::string, at::Tensor>> resumed;
  for (const char* level : {"none", "parameters"}) {
    SCOPED_TRACE(level);
    const auto before = with(r, {std::string("sync.shard=") + level, "data.batch_size=4"});
    const std::string from4 = tmp / (std::string(level) + "-4-to-2");
    ASSERT_EQ(stopAt12(4, before, from4), std::vector<int>(4, 0));
    ASSERT_EQ(runRanksWith(2, from4 + "-resumed", "--resume " + from4 + " --set data.batch_size=8"),
              std::vector<int>(2, 0))
        << test::readFile(from4 + "-resumed.rank0.log");
    resumed[level] = finalParams(from4, before);
  }
  EXPECT_EQ(maxAbsDiff(resumed["none"], resumed["parameters"]), 0.0);
}

// A manifest's layout: a unit in two groups (bf16 gathers) comes back from its JSON as it was;
// a unit of one float32 group writes no groups (the manifests before bf16 gathers) and reads
// back as that one group; groups that do not add up to their unit are refused as damage.
TEST(DistShardedCheckpoint, ALayoutsGroupsRoundTripAndALayoutWithoutGroupsIsOneGroup) {
  ShardedLayout two;
  two.worldSize = 2;
  two.level = "parameters";
  ShardedLayout::Unit unit;
  unit.numel = 7;
  unit.padded = 8;
  unit.params = {{"w", {3}, 0}, {"ln", {4}, 3}};
  unit.groups = {{3, 4, "bfloat16"}, {4, 4, "float32"}};
  two.units.push_back(unit);
  const ShardedLayout back = ShardedLayout::fromJson(two.toJson(), "ckpt");
  EXPECT_TRUE(back.sameUnits(two));
  ASSERT_EQ(back.units.front().groups.size(), 2U);
  EXPECT_EQ(back.units.front().groups.front().dtype, "bfloat16");
  ShardedLayout one = two;
  one.units.front().groups = {{7, 8, "float32"}};
  const nlohmann::json oneJson = one.toJson();
  EXPECT_FALSE(oneJson["units"][0].contains("groups")) << oneJson;
  EXPECT_TRUE(ShardedLayout::fromJson(oneJson, "ckpt").sameUnits(one));
  EXPECT_FALSE(ShardedLayout::fromJson(oneJson, "ckpt").sameUnits(two));
  nlohmann::json bad = two.toJson();
  bad["units"][0]["groups"][0]["padded"] = 6;
  try {
    ShardedLayout::fromJson(bad, "ckpt");
    ADD_FAILURE() << "groups of 10 padded elements in a unit of 8 were read";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint ckpt is damaged"), std::string::npos)
        << e.what();
  }
}

// Stopped at step 12 and resumed, each level ends with the uninterrupted run's bits: its
// checkpoint is a sharded set (a manifest and each rank's slice file), and each rank resumes
// from its own slices. A level resumed under another level on as many workers (its own slices
// again: the units are the same), under sync.shard = none (the slices reassembled), and a
// sharded run resumed from none's in-core checkpoint: the bits of the uninterrupted run too.
// A checkpoint of 4 sharded workers resumes on 2 and one of 2 on 3 (the global batch kept;
// every slice file read and the whole tensors sliced anew): their losses stay within 1e-6 of
// the uninterrupted run's (a batch of 8 sums in another order than two of 4; AdamW then moves
// some elements by whole steps, as in DistShardedRounding), and they are bitwise what
// sync.shard = none does on the same stop and resume.
TEST(DistShardedResume, StopAndResumeIsBitwiseAndResumesOnOtherWorkersAndLevels) {
  TempDir tmp;
  const auto o = with(kShardGpt, {"dist.backend=shm", "train.max_steps=24", "train.eval_every=0",
                                  "checkpoint.every=0", "data.batch_size=4"});
  auto stopAt12 = [&](int world, const std::vector<std::string>& s, const std::string& cut) {
    return runRanksWith(
        world, cut, "--config /dev/null" + setArgs(s) + " --run-dir " + cut + " --stop-at-step 12");
  };
  const std::string noneWhole = tmp / "none-whole";
  ASSERT_EQ(runRanks(2, noneWhole, with(o, {"sync.shard=none"})), std::vector<int>(2, 0));
  const auto noneParams = finalParams(noneWhole, o);
  for (const char* level : kShardLevelNames) {
    SCOPED_TRACE(level);
    const auto s = with(o, {std::string("sync.shard=") + level});
    const std::string whole = tmp / (std::string(level) + "-whole");
    const std::string cut = tmp / (std::string(level) + "-cut");
    ASSERT_EQ(runRanks(2, whole, s), std::vector<int>(2, 0))
        << test::readFile(whole + ".rank0.log");
    EXPECT_EQ(maxAbsDiff(finalParams(whole, s), noneParams), 0.0);
    ASSERT_EQ(stopAt12(2, s, cut), std::vector<int>(2, 0));
    const auto files = checkpointFiles(cut);
    EXPECT_EQ(countNamed(files, "step-00000012.rank0-of-2.", ".slice"), 1) << files.size();
    EXPECT_EQ(countNamed(files, "step-00000012.rank1-of-2.", ".slice"), 1) << files.size();
    EXPECT_EQ(countNamed(files, "step-00000012", ".ckpt"), 1) << files.size();
    fs::copy(cut, cut + "-asnone", fs::copy_options::recursive);
    ASSERT_EQ(runRanksWith(2, cut + "-resumed", "--resume " + cut), std::vector<int>(2, 0))
        << test::readFile(cut + "-resumed.rank0.log");
    EXPECT_EQ(maxAbsDiff(finalParams(whole, s), finalParams(cut, s)), 0.0);
    ASSERT_EQ(runRanksWith(2, cut + "-asnone-resumed",
                           "--resume " + cut + "-asnone --set sync.shard=none"),
              std::vector<int>(2, 0))
        << test::readFile(cut + "-asnone-resumed.rank0.log");
    EXPECT_EQ(maxAbsDiff(noneParams, finalParams(cut + "-asnone", s)), 0.0);
  }
  {  // optimizer's set resumed under parameters; none's in-core checkpoint resumed sharded
    const std::string fromOptimizer = tmp / "optimizer-then-parameters";
    ASSERT_EQ(stopAt12(2, with(o, {"sync.shard=optimizer"}), fromOptimizer),
              std::vector<int>(2, 0));
    ASSERT_EQ(runRanksWith(2, fromOptimizer + "-resumed",
                           "--resume " + fromOptimizer + " --set sync.shard=parameters"),
              std::vector<int>(2, 0))
        << test::readFile(fromOptimizer + "-resumed.rank0.log");
    EXPECT_EQ(maxAbsDiff(noneParams, finalParams(fromOptimizer, o)), 0.0);
    const std::string fromNone = tmp / "none-then-gradients";
    ASSERT_EQ(stopAt12(2, with(o, {"sync.shard=none"}), fromNone), std::vector<int>(2, 0));
    ASSERT_EQ(runRanksWith(2, fromNone + "-resumed",
                           "--resume " + fromNone + " --set sync.shard=gradients"),
              std::vector<int>(2, 0))
        << test::readFile(fromNone + "-resumed.rank0.log");
    EXPECT_EQ(maxAbsDiff(noneParams, finalParams(fromNone, o)), 0.0);
  }
  // 4 -> 2 workers (global batch 16) and 2 -> 3 (global batch 12): parameters against none.
  struct Reshard {
    int from, to, globalBatch;
  };
  for (const Reshard& r : {Reshard{4, 2, 16}, Reshard{2, 3, 12}}) {
    std::map<std::string, std::map<std::string, at::Tensor>> resumed;
    for (const char* level : {"none", "parameters"}) {
      const std::string name = fmt::format("{}-{}-to-{}", level, r.from, r.to);
      SCOPED_TRACE(name);
      const auto before = with(o, {std::string("sync.shard=") + level,
                                   "data.batch_size=" + std::to_string(r.globalBatch / r.from)});
      const std::string whole = tmp / (name + "-whole");
      const std::string cut = tmp / (name + "-cut");
      ASSERT_EQ(runRanks(r.from, whole, before), std::vector<int>(r.from, 0));
      ASSERT_EQ(stopAt12(r.from, before, cut), std::vector<int>(r.from, 0));
      ASSERT_EQ(runRanksWith(r.to, cut + "-resumed",
                             "--resume " + cut +
                                 " --set data.batch_size=" + std::to_string(r.globalBatch / r.to)),
                std::vector<int>(r.to, 0))
          << test::readFile(cut + "-resumed.rank0.log");
      const auto a = test::trainLosses(whole), b = test::trainLosses(cut);
      ASSERT_EQ(a.size(), b.size());
      double lossDiff = 0.0;
      for (size_t i = 0; i < a.size(); ++i) {
        lossDiff = std::max(lossDiff, std::abs(a[i] - b[i]) / std::abs(a[i]));
      }
      std::printf("sync.shard = %s, %d workers resumed on %d: relative loss difference %.3g\n",
                  level, r.from, r.to, lossDiff);
      EXPECT_LE(lossDiff, 1e-6);
      resumed[level] = finalParams(cut, before);
    }
    EXPECT_EQ(maxAbsDiff(resumed["none"], resumed["parameters"]), 0.0) << r.from << " -> " << r.to;
  }
}

// A sharded checkpoint counts once its manifest is written, last: a write killed before it
// (its slices there, the manifest not; a temporary left) is never resumed from: the resume
// takes the previous checkpoint, ends with the uninterrupted run's bits, and the killed write's
// files are gone. checkpoint.keep removes whole sets: two manifests and their slices remain.
TEST(DistShardedCheckpoint, AKilledWriteIsNeverResumedAndRetentionRemovesWholeSets) {
  TempDir tmp;
  const auto o =
      with(kShardGpt, {"dist.backend=shm", "train.max_steps=24", "train.eval_every=0",
                       "checkpoint.every=6", "checkpoint.keep=2", "sync.shard=parameters"});
  const std::string whole = tmp / "whole";
  ASSERT_EQ(runRanks(2, whole, o), std::vector<int>(2, 0)) << test::readFile(whole + ".rank0.log");
  const std::string cut = tmp / "cut";
  ASSERT_EQ(
      runRanksWith(2, cut,
                   "--config /dev/null" + setArgs(o) + " --run-dir " + cut + " --stop-at-step 18"),
      std::vector<int>(2, 0));
  auto files = checkpointFiles(cut);
  EXPECT_EQ(files.size(), 6u) << fmt::format("{}", fmt::join(files, " "));
  for (const char* step : {"step-00000012", "step-00000018"}) {
    EXPECT_EQ(countNamed(files, step, ".ckpt"), 1) << step;
    EXPECT_EQ(countNamed(files, step, ".slice"), 2) << step;
  }
  // Killed after the slices of step 18, before its manifest.
  fs::remove(fs::path(cut) / "checkpoints" / "step-00000018.ckpt");
  test::writeFile(fs::path(cut) / "checkpoints" / ".step-00000018.rank1-of-2.0badf00d.slice.tmp-x1",
                  "half a slice");
  EXPECT_EQ(*CheckpointDir(cut, 2).latest(),
            (fs::path(cut) / "checkpoints" / "step-00000012.ckpt").string());
  ASSERT_EQ(runRanksWith(2, cut + "-resumed", "--resume " + cut), std::vector<int>(2, 0))
      << test::readFile(cut + "-resumed.rank0.log");
  EXPECT_EQ(test::trainLosses(cut), test::trainLosses(whole));
  EXPECT_EQ(maxAbsDiff(finalParams(whole, o), finalParams(cut, o)), 0.0);
  files = checkpointFiles(cut);
  EXPECT_EQ(files.size(), 6u) << fmt::format("{}", fmt::join(files, " "));
  for (const char* step : {"step-00000018", "step-00000024"}) {
    EXPECT_EQ(countNamed(files, step, ".ckpt"), 1) << step;
    EXPECT_EQ(countNamed(files, step, ".slice"), 2) << step;
  }
}

// A sharded checkpoint with a slice file missing is refused before training, on every rank, in
// one line that names the rank and the file (a CheckpointError), resumed on as many workers
// (each rank reads its own slice only) or on another number (every slice); a slice damaged
// inside is refused by the rank that reads it, naming it. caravan checkpoint consolidate writes
// the run's own model.pt, bit for bit, from the sharded set, refuses a missing slice alike, and
// caravan eval evaluates the set (as sync.shard = none's in-core checkpoint: the same loss).
TEST(DistShardedCheckpoint, MissingSlicesAreRefusedInOneLineAndConsolidateWritesModelPt) {
  TempDir tmp;
  const auto o = with(kShardGpt, {"dist.backend=shm", "train.max_steps=12", "train.eval_every=0"});
  const std::string run = tmp / "run";
  ASSERT_EQ(runRanks(2, run, with(o, {"sync.shard=parameters"})), std::vector<int>(2, 0))
      << test::readFile(run + ".rank0.log");
  const std::string none = tmp / "none";
  ASSERT_EQ(runRanks(2, none, o), std::vector<int>(2, 0));

  const auto consolidated =
      test::runCaravan("checkpoint consolidate " + run + " --out " + (tmp / "model.pt"));
  ASSERT_EQ(consolidated.exitCode, 0) << consolidated.err;
  EXPECT_EQ(test::countLines(consolidated.err), 1) << consolidated.err;
  EXPECT_TRUE(test::readFile(tmp / "model.pt") == test::readFile(run + "/model.pt"))
      << (tmp / "model.pt") << " and " << (run + "/model.pt") << " differ";
  // Trained to the same bits (shm), written alike: none's model.pt too.
  EXPECT_TRUE(test::readFile(tmp / "model.pt") == test::readFile(none + "/model.pt"))
      << (tmp / "model.pt") << " and " << (none + "/model.pt") << " differ";
  const auto evalSharded = test::runCaravan("eval --run-dir " + run);
  const auto evalNone = test::runCaravan("eval --run-dir " + none);
  ASSERT_EQ(evalSharded.exitCode, 0) << evalSharded.err;
  ASSERT_EQ(evalNone.exitCode, 0) << evalNone.err;
  EXPECT_EQ(nlohmann::json::parse(evalSharded.out)["loss"],
            nlohmann::json::parse(evalNone.out)["loss"]);
  const auto noStep = test::runCaravan("checkpoint consolidate " + run + " --step 5");
  EXPECT_EQ(noStep.exitCode, 4) << noStep.err;
  EXPECT_NE(noStep.err.find("--step 12"), std::string::npos) << noStep.err;
  EXPECT_EQ(test::countLines(noStep.err), 1) << noStep.err;

  std::string slice1;
  for (const auto& name : checkpointFiles(run)) {
    if (name.rfind("step-00000012.rank1-of-2.", 0) == 0) slice1 = name;
  }
  ASSERT_FALSE(slice1.empty());
  const fs::path slicePath = fs::path(run) / "checkpoints" / slice1;
  {  // half the weights and half the AdamW moments: no rank wrote the whole model
    const double modelBytes = static_cast<double>(fs::file_size(run + "/model.pt"));
    const double sliceBytes = static_cast<double>(fs::file_size(slicePath));
    EXPECT_NEAR(sliceBytes, 1.5 * modelBytes, 0.1 * modelBytes);
  }
  fs::rename(slicePath, tmp / "aside");
  auto expectRefused = [&](const std::string& err, int code) {
    EXPECT_EQ(code, 4) << err;
    EXPECT_NE(err.find("rank 1's slice file " + slicePath.string()), std::string::npos) << err;
    EXPECT_EQ(test::countLines(err), 1) << err;
  };
  const auto refused = test::runCaravan("checkpoint consolidate " + run);
  expectRefused(refused.err, refused.exitCode);
  EXPECT_FALSE(fs::exists(fs::path(run) / "model-step-00000012.pt"));
  for (int world : {2, 3}) {  // its own slices; every slice
    SCOPED_TRACE(world);
    const std::string log = tmp / ("resumed-on-" + std::to_string(world));
    const auto codes = runRanksWith(world, log,
                                    "--resume " + run + " --set train.max_steps=14" +
                                        (world == 3 ? " --set data.batch_size=3" : ""));
    ASSERT_EQ(codes.size(), static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      expectRefused(test::readFile(log + ".rank" + std::to_string(r) + ".log"), codes[r]);
    }
  }
  fs::rename(tmp / "aside", slicePath);
  {  // damaged inside (the header's CRC no longer matches the payload)
    std::string bytes = test::readFile(slicePath.string());
    bytes[bytes.size() - 30] ^= 0x5a;
    test::writeFile(slicePath.string(), bytes);
    const auto damaged = test::runCaravan("checkpoint consolidate " + run);
    EXPECT_EQ(damaged.exitCode, 4) << damaged.err;
    EXPECT_NE(damaged.err.find(slicePath.string() + " is corrupt"), std::string::npos)
        << damaged.err;
    EXPECT_NE(damaged.err.find("rank 1's slice"), std::string::npos) << damaged.err;
    EXPECT_EQ(test::countLines(damaged.err), 1) << damaged.err;
    const std::string log = tmp / "resumed-damaged";
    const auto codes = runRanksWith(2, log, "--resume " + run + " --set train.max_steps=14");
    ASSERT_EQ(codes.size(), 2u);
    const std::string err = test::readFile(log + ".rank1.log");
    EXPECT_EQ(codes[1], 4) << err;
    EXPECT_NE(err.find(slicePath.string() + " is corrupt"), std::string::npos) << err;
    EXPECT_EQ(test::countLines(err), 1) << err;
    // Rank 0 read its own slice only: it went on, and lost rank 1, whose error it names.
    const std::string err0 = test::readFile(log + ".rank0.log");
    EXPECT_EQ(codes[0], 7) << err0;
    EXPECT_NE(err0.find("rank 1 (worker) failed"), std::string::npos) << err0;
  }
}

// What each worker holds after a step (metrics.jsonl's mem_weights, mem_gradients,
// mem_optimizer_state) is ZeRO's accounting of the model state (shardedModelState) within 5%
// (the units' padding): W = 2 and 4, AdamW.
TEST(DistShardedMemory, EachWorkerHoldsZerosAccountingOfTheModelState) {
  TempDir tmp;
  const auto o = with(kShardGpt, {"dist.backend=shm", "train.max_steps=2", "train.eval_every=0",
                                  "model.width=64", "model.depth=4"});
  RunSetup setup(Config::fromString("", "<test>", o));
  int64_t paramBytes = 0;
  for (const auto& p : setup.model->parameters()) paramBytes += p.numel() * 4;
  for (int world : {2, 4}) {
    for (ShardLevel level : kShardLevels) {
      const auto s = with(o, {std::string("sync.shard=") + shardLevelName(level)});
      const std::string dir = tmp / (std::string(shardLevelName(level)) + std::to_string(world));
      ASSERT_EQ(runRanks(world, dir, s), std::vector<int>(world, 0))
          << test::readFile(dir + ".rank0.log");
      nlohmann::json last;
      std::istringstream lines(test::readFile(dir + "/metrics.jsonl"));
      for (std::string line; std::getline(lines, line);) {
        auto j = nlohmann::json::parse(line);
        if (j["kind"] == "train") last = j;
      }
      const ModelStateBytes expected = shardedModelState(level, paramBytes, 2, world);
      for (const auto& [key, want] : {std::pair{"mem_weights", expected.weights},
                                      std::pair{"mem_gradients", expected.gradients},
                                      std::pair{"mem_optimizer_state", expected.optimizerState}}) {
        const double got = last.at(key).get<double>();
        std::printf("W=%d %s %s: %.0f bytes, ZeRO's accounting %lld\n", world,
                    shardLevelName(level), key, got, static_cast<long long>(want));
        EXPECT_NEAR(got, static_cast<double>(want), 0.05 * static_cast<double>(want))
            << world << " " << shardLevelName(level) << " " << key;
      }
    }
  }
}

// Sharded data parallelism inside pipeline stages (train/pipeline_step.h, ShardedParameters'
// StageScope) against the same pipeline with sync.shard = none.
namespace {

const std::vector<std::string> kShardPipeline =
    with(kShardGpt, {"dist.backend=shm", "data.batch_size=8", "parallel.micro_batches=4",
                     "train.max_steps=10", "train.eval_every=5"});

}  // namespace

// Through shared memory each element of a stage's averaged gradient is its replicas' sum in
// rank order divided by D, whatever the layout (the unsharded all-reduce's buckets and the
// reduce-scatter's units both average with ReduceOp::kAvg), and AdamW is elementwise: every
// level trains the bits of sync.shard = none, losses, evaluations (at steps 5 and 10, through
// the stages) and parameters, for 2 stages x 2 replicas (1f1b; zb-h1, whose W accumulates into the
// same .grad) and 1 stage x 2 replicas accumulating 4 micro-batches.
TEST(DistPipelineShard, EveryLevelTrainsTheBitsOfTheUnshardedPipeline) {
  for (const char* schedule : {"1f1b", "zb-h1"}) {
    const auto o = with(kShardPipeline, {"parallel.pipeline_stages=2",
                                         std::string("parallel.schedule=") + schedule});
    for (const auto& [level, d] : shardDifferences(4, o)) {
      EXPECT_EQ(d.loss, 0.0) << level << " " << schedule;
      EXPECT_EQ(d.params, 0.0) << level << " " << schedule;
    }
  }
  for (const auto& [level, d] : shardDifferences(2, kShardPipeline)) {
    EXPECT_EQ(d.loss, 0.0) << level << " K=1";
    EXPECT_EQ(d.params, 0.0) << level << " K=1";
  }
}

// Over Gloo (each stage's replicas reduce-scatter and all-gather through its ring, the stages'
// activations through its point-to-point sends): 2 stages x 2 replicas, 1f1b. With two
// replicas each element is a + b, the same bits in either order, whatever ring chunk carries
// it: every level trains the bits of the same pipeline under none.
TEST(DistPipelineShard, OverGlooEveryLevelTrainsTheBitsOfNone) {
  const auto o = with(kShardPipeline, {"dist.backend=gloo", "parallel.pipeline_stages=2"});
  for (const auto& [level, d] : shardDifferences(4, o)) {
    EXPECT_EQ(d.loss, 0.0) << level;
    EXPECT_EQ(d.params, 0.0) << level;
  }
}

// A Linear tied across the stages (todays_models.py's TiedLayers: blocks 1 and 3 read it; the
// split at block 2 puts them on stages 0 and 1): each stage holds it as a unit of its own, whose
// slices line up on both stages, and sums its slices' averaged gradients in stage order as the
// unsharded stages sum the whole ones: every level trains none's bits, the tie kept.
TEST(DistPipelineShard, AWeightTiedAcrossStagesTrainsTheBitsOfNone) {
  const std::string dir = test::pythonWrittenDir("todays_models.py");
  ASSERT_FALSE(dir.empty()) << "tests/python/todays_models.py failed (.venv: scripts/setup.sh)";
  const std::vector<std::string> o = {"data.dataset=synthetic",
                                      "data.synthetic_size=96",
                                      "data.batch_size=8",
                                      "train.threads=1",
                                      "train.max_steps=10",
                                      "train.log_every=1",
                                      "train.eval_every=5",
                                      "optim.name=adamw",
                                      "optim.lr=0.003",
                                      "seed.init=3",
                                      "fault.timeout=60",
                                      "dist.backend=shm",
                                      "model.name=torchscript",
                                      "model.path=" + dir + "/tied-layers.pt",
                                      "parallel.pipeline_stages=2",
                                      "parallel.partition=2",
                                      "parallel.micro_batches=4"};
  for (const auto& [level, d] : shardDifferences(4, o)) {
    EXPECT_EQ(d.loss, 0.0) << level;
    EXPECT_EQ(d.params, 0.0) << level;
  }
}

// Clipping (max norm 0.05: every step clips) with the global norm: the slices' squares summed
// over the whole world (every replica's slices, every stage's) where none sums each stage's
// whole gradients' norms and divides by the replicas. A norm off by a factor (the replicas' sum
// missed, or counted D times) would clip differently by as much; the two agree up to rounding:
// losses within 1e-6 relative (SGD, whose updates do not amplify the coefficient's rounding).
TEST(DistPipelineShard, ClippingUsesTheGlobalNormOfTheSlices) {
  const auto o = with(kShardPipeline, {"parallel.pipeline_stages=2", "optim.grad_clip=0.05",
                                       "optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.1"});
  for (const auto& [level, d] : shardDifferences(4, o)) {
    EXPECT_LE(d.loss, 1e-6) << level;
    EXPECT_LE(d.params, 1e-5) << level;
  }
  // The clipping is real: without it none trains other losses.
  TempDir tmp;
  ASSERT_EQ(runRanks(4, tmp / "clip", o), std::vector<int>(4, 0));
  ASSERT_EQ(runRanks(4, tmp / "noclip", with(o, {"optim.grad_clip=0"})), std::vector<int>(4, 0));
  EXPECT_NE(test::trainLosses(tmp / "clip"), test::trainLosses(tmp / "noclip"));
}

// A pipeline's checkpoint is the whole model on rank 0: each sharded stage's slices of the
// optimizer state come to its first replica, then to rank 0 with the stage's weights; a resume
// slices them again. Stopped at step 12 and resumed, every level ends with the uninterrupted
// run's bits (which are none's); a sharded run's checkpoint resumes under none bitwise too.
TEST(DistPipelineShard, StopAndResumeIsBitwise) {
  TempDir tmp;
  const auto o = with(kShardPipeline, {"parallel.pipeline_stages=2", "train.max_steps=24",
                                       "train.eval_every=0", "checkpoint.every=0"});
  const std::string none = tmp / "none";
  ASSERT_EQ(runRanks(4, none, o), std::vector<int>(4, 0)) << test::readFile(none + ".rank0.log");
  const auto noneParams = finalParams(none, o);
  for (const char* level : kShardLevelNames) {
    SCOPED_TRACE(level);
    const auto s = with(o, {std::string("sync.shard=") + level});
    const std::string cut = tmp / level;
    ASSERT_EQ(
        runRanksWith(
            4, cut, "--config /dev/null" + setArgs(s) + " --run-dir " + cut + " --stop-at-step 12"),
        std::vector<int>(4, 0))
        << test::readFile(cut + ".rank0.log");
    fs::copy(cut, cut + "-asnone", fs::copy_options::recursive);
    ASSERT_EQ(runRanksWith(4, cut + "-resumed", "--resume " + cut), std::vector<int>(4, 0))
        << test::readFile(cut + "-resumed.rank0.log");
    EXPECT_EQ(maxAbsDiff(noneParams, finalParams(cut, s)), 0.0);
    ASSERT_EQ(runRanksWith(4, cut + "-asnone-resumed",
                           "--resume " + cut + "-asnone --set sync.shard=none"),
              std::vector<int>(4, 0))
        << test::readFile(cut + "-asnone-resumed.rank0.log");
    EXPECT_EQ(maxAbsDiff(noneParams, finalParams(cut + "-asnone", s)), 0.0);
  }
}

// What stage 0 holds after a step (rank 0's metrics.jsonl) is ZeRO's accounting of the stage's
// model state over its D = 2 replicas (shardedModelState of the unsharded stage 0's weights)
// within 5% (the units' padding), none's included. An even cut: the same stage 0 in every run
// (a cut by time follows each run's timings).
TEST(DistPipelineShard, EachStageHoldsZerosAccountingOfItsModelState) {
  TempDir tmp;
  const auto o = with(kShardPipeline,
                      {"parallel.pipeline_stages=2", "parallel.partition=even", "train.max_steps=2",
                       "train.eval_every=0", "model.width=64", "model.depth=4"});
  auto lastTrain = [](const std::string& dir) {
    nlohmann::json last;
    std::istringstream lines(test::readFile(dir + "/metrics.jsonl"));
    for (std::string line; std::getline(lines, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["kind"] == "train") last = j;
    }
    return last;
  };
  ASSERT_EQ(runRanks(4, tmp / "base", o), std::vector<int>(4, 0));
  const auto stageWeights = lastTrain(tmp / "base").at("mem_weights").get<int64_t>();
  for (ShardLevel level : kShardLevels) {
    const std::string dir = tmp / shardLevelName(level);
    ASSERT_EQ(runRanks(4, dir, with(o, {std::string("sync.shard=") + shardLevelName(level)})),
              std::vector<int>(4, 0))
        << test::readFile(dir + ".rank0.log");
    const nlohmann::json last = lastTrain(dir);
    const ModelStateBytes expected = shardedModelState(level, stageWeights, 2, 2);
    for (const auto& [key, want] : {std::pair{"mem_weights", expected.weights},
                                    std::pair{"mem_gradients", expected.gradients},
                                    std::pair{"mem_optimizer_state", expected.optimizerState}}) {
      const double got = last.at(key).get<double>();
      std::printf("stage 0 of 2 x 2 %s %s: %.0f bytes, ZeRO's accounting %lld\n",
                  shardLevelName(level), key, got, static_cast<long long>(want));
      EXPECT_NEAR(got, static_cast<double>(want), 0.05 * static_cast<double>(want))
          << shardLevelName(level) << " " << key;
    }
  }
}

// A shard level with another sync.mode, compression, pipelines or out-of-core weights: one line
// that says what to do, exit 2, before any rank connects.
TEST(DistShardedRefusals, CombinationsThatCannotRunAreOneLine) {
  TempDir tmp;
  for (const auto& [more, says] : std::vector<std::pair<std::string, std::string>>{
           {"sync.mode=local-sgd", "set sync.mode = allreduce"},
           {"sync.compression=bf16", "set sync.compression = none"},
           {"parallel.pipeline_stages=2", "run 4 workers or more"},
           {"memory.weights=offload", "set sync.shard = parameters"},
           {"memory.policy=swap", "memory.policy = keep, recompute or auto"}}) {
    // Out-of-core slices are parameters' (ZeRO-Infinity): gradients is refused with them.
    const bool offload = more == "memory.weights=offload";
    const auto s =
        with(kShardGpt, {offload ? "sync.shard=gradients" : "sync.shard=parameters", more});
    const auto r = test::runCaravan("train -q --config /dev/null" + setArgs(s) +
                                    " --workers 2 --run-dir " + (tmp / "refused"));
    EXPECT_EQ(r.exitCode, 2) << more << r.err;
    EXPECT_NE(r.err.find(says), std::string::npos) << more << ": " << r.err;
    EXPECT_EQ(test::countLines(r.err), 1) << r.err;
    EXPECT_FALSE(fs::exists(tmp / "refused/metrics.jsonl")) << more;
  }
  // A budget below the first step's model state and gathered blocks: refused after it, with
  // advice that runs under sync.shard = parameters (not memory.policy = auto, which it refuses).
  const auto s =
      with(kShardGpt, {"sync.shard=parameters", "memory.budget=100KiB", "dist.backend=shm"});
  const auto r = test::runCaravan("train -q --config /dev/null" + setArgs(s) +
                                  " --workers 2 --run-dir " + (tmp / "budget"));
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_NE(r.err.find("is below what step 1 needs"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("train on more workers"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("memory.policy = auto"), std::string::npos) << r.err;
  EXPECT_EQ(test::countLines(r.err), 1) << r.err;
  // Below one gathered block (a block's weights and gradients: 2 x 50816 bytes here), with the
  // slices out of core or not: refused before the first step.
  for (const char* weights : {"core", "offload"}) {
    const auto b =
        with(kShardGpt, {"sync.shard=parameters", "memory.budget=64KiB", "dist.backend=shm",
                         "memory.tier=host", std::string("memory.weights=") + weights});
    const auto refused = test::runCaravan("train -q --config /dev/null" + setArgs(b) +
                                          " --workers 2 --run-dir " + (tmp / "block"));
    EXPECT_EQ(refused.exitCode, 2) << refused.err;
    EXPECT_NE(refused.err.find("is below one gathered block"), std::string::npos) << refused.err;
    EXPECT_NE(refused.err.find("raise memory.budget"), std::string::npos) << refused.err;
    EXPECT_EQ(test::countLines(refused.err), 1) << refused.err;
    EXPECT_FALSE(fs::exists(tmp / "block/metrics.jsonl")) << weights;
  }
}
