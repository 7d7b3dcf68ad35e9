// The local launcher (`caravan train --workers N`): the pure pieces (worker environment,
// arguments, failure line) as units, and the supervisor as real processes: all workers finish,
// a worker killed with SIGKILL stops the others, SIGINT stops everything with exit 130, a
// killed supervisor leaves no workers, and --workers under another launcher is refused.
//
// Every process test runs the supervisor in its own process group with a deadline, and the
// fixture kills that group in TearDown, so a failing test leaves no processes behind.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>

#include "cli/launch.h"
#include "comm/world.h"
#include "core/config.h"
#include "core/errors.h"
#include "run_util.h"
#include "test_util.h"
#include "train/trainer.h"

extern char** environ;

using namespace caravan;
using namespace caravan::test;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

namespace {

const std::string kSynthetic =
    "--set data.dataset=synthetic --set data.synthetic_size=64 --set data.batch_size=8 "
    "--set model.name=mlp --set model.width=8 --set train.threads=1";

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// Fields of /proc/PID/stat after the command name: state, ppid, ...
std::vector<std::string> statFields(pid_t pid) {
  const std::string stat = readFile("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return {};
  return split(stat.substr(close + 1));
}

// Running (a zombie has finished running: it only waits to be reaped).
bool alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  const auto f = statFields(pid);
  return !f.empty() && f[0] != "Z";
}

std::vector<pid_t> childrenOf(pid_t parent) {
  std::vector<pid_t> out;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
    if (pid <= 0) continue;
    const auto f = statFields(pid);
    if (f.size() > 1 && std::stoi(f[1]) == parent) out.push_back(pid);
  }
  ::closedir(d);
  return out;
}

// The environment of a process, from /proc/PID/environ.
Environment environmentOf(pid_t pid) {
  Environment env;
  const std::string raw = readFile("/proc/" + std::to_string(pid) + "/environ");
  size_t start = 0;
  while (start < raw.size()) {
    size_t end = raw.find('\0', start);
    if (end == std::string::npos) end = raw.size();
    const std::string kv = raw.substr(start, end - start);
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    start = end + 1;
  }
  return env;
}

template <typename Pred>
bool waitUntil(Pred pred, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(50));
  }
  return true;
}

// Runs `caravan ARGS` as a supervisor in its own process group, in a temporary directory.
class LauncherProcess : public ::testing::Test {
 protected:
  void TearDown() override {
    if (supervisor_ > 0) {
      ::killpg(supervisor_, SIGKILL);  // the supervisor and every worker it started
      if (!reaped_) ::waitpid(supervisor_, nullptr, 0);
    }
    for (const auto& [rank, pid] : workers_) {
      if (alive(pid)) ::kill(pid, SIGKILL);
    }
  }

  void start(const std::string& args, const std::vector<std::string>& extraEnv = {}) {
    configPath_ = tmp_ / "c.toml";
    writeFile(configPath_, "[train]\nmax_steps = 4\n");
    std::vector<std::string> argv = split(args);
    argv.insert(argv.begin(), CARAVAN_BINARY);
    std::vector<std::string> envp;
    for (char** e = environ; *e != nullptr; ++e) envp.emplace_back(*e);
    for (const auto& kv : extraEnv) envp.push_back(kv);
    std::vector<char*> av, ev;
    for (auto& s : argv) av.push_back(s.data());
    av.push_back(nullptr);
    for (auto& s : envp) ev.push_back(s.data());
    ev.push_back(nullptr);
    const std::string out = tmp_ / "out", err = tmp_ / "err", dir = tmp_.path();
    supervisor_ = ::fork();
    ASSERT_GE(supervisor_, 0);
    if (supervisor_ == 0) {
      ::setpgid(0, 0);
      const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int n = ::open("/dev/null", O_RDONLY);
      if (o < 0 || e < 0 || n < 0 || ::chdir(dir.c_str()) != 0) ::_exit(99);
      ::dup2(n, 0);
      ::dup2(o, 1);
      ::dup2(e, 2);
      ::execve(av[0], av.data(), ev.data());
      ::_exit(98);
    }
    ::setpgid(supervisor_, supervisor_);  // also from here, so killpg works at once
  }

  // The supervisor's wait status, or nullopt after `timeout`.
  std::optional<int> waitExit(milliseconds timeout) {
    std::optional<int> result;
    waitUntil(
        [&] {
          int status = 0;
          if (::waitpid(supervisor_, &status, WNOHANG) == supervisor_) {
            reaped_ = true;
            result = status;
          }
          return result.has_value();
        },
        timeout);
    return result;
  }

  // Waits until the supervisor has `n` workers that exec'd (RANK in their environment).
  // Starts `args` (a two-worker job with --max-restarts), waits for its workers and its first
  // checkpoint, and SIGKILLs rank 1 (`victim`). A fatal failure when one of them does not happen.
  void killRankOneAfterTheFirstCheckpoint(const std::string& args, pid_t* victim) {
    run_ = tmp_ / "run";
    start(args + " --run-dir " + run_);
    ASSERT_TRUE(waitForWorkers(2, seconds(30))) << readFile(tmp_ / "err");
    ASSERT_TRUE(waitUntil(
        [&] { return fs::exists(run_ + "/checkpoints") && !fs::is_empty(run_ + "/checkpoints"); },
        seconds(60)))
        << readFile(tmp_ / "err");
    *victim = workers_.at(1);
    ASSERT_EQ(::kill(*victim, SIGKILL), 0);
  }

  bool waitForWorkers(int n, milliseconds timeout) {
    return waitUntil(
        [&] {
          for (pid_t pid : childrenOf(supervisor_)) {
            const Environment env = environmentOf(pid);
            if (env.count("RANK") != 0) {
              workers_[std::stoi(env.at("RANK"))] = pid;
              workerEnv_[pid] = env;
            }
          }
          return static_cast<int>(workers_.size()) == n;
        },
        timeout);
  }

  // A long run of 3 workers, started and training (rank 0 wrote metrics.jsonl).
  void startLongRun() {
    run_ = tmp_ / "run";
    start("train --config " + (tmp_ / "c.toml") + " " + kSynthetic +
          " --set train.max_steps=10000000 --set train.log_every=1 --run-dir " + run_ +
          " --workers 3");
    ASSERT_TRUE(waitForWorkers(3, seconds(30))) << readFile(tmp_ / "err");
    ASSERT_TRUE(waitUntil([&] { return fs::exists(run_ + "/metrics.jsonl"); }, seconds(60)))
        << readFile(tmp_ / "err");
    std::this_thread::sleep_for(milliseconds(500));
  }

  void expectNoWorkersLeft() {
    for (const auto& [rank, pid] : workers_) {
      EXPECT_TRUE(waitUntil([&] { return !alive(pid); }, seconds(5)))
          << "rank " << rank << " (pid " << pid << ") is still running";
    }
  }

  TempDir tmp_;
  std::string configPath_;
  std::string run_;
  pid_t supervisor_ = -1;
  bool reaped_ = false;
  std::map<int, pid_t> workers_;  // rank -> pid
  std::map<pid_t, Environment> workerEnv_;
};

}  // namespace

TEST(LauncherUnits, WorkerEnvironmentIsTheWorkersWorld) {
  const Environment base = {{"PATH", "/usr/bin"}, {"OMP_NUM_THREADS", "4"}};
  for (int r = 0; r < 3; ++r) {
    const Environment env = workerEnvironment(base, r, 3, 29511, false, "s3cret");
    const WorldInfo w = worldFromEnvironment(env);
    EXPECT_EQ(w.token, "s3cret");
    EXPECT_EQ(w.rank, r);
    EXPECT_EQ(w.worldSize, 3);
    EXPECT_EQ(w.localRank, r);
    EXPECT_EQ(w.launcher, "caravan");
    EXPECT_EQ(w.masterAddr, "127.0.0.1");
    EXPECT_EQ(w.masterPort, 29511);
    EXPECT_EQ(env.at("PATH"), "/usr/bin");
    EXPECT_EQ(env.at("OMP_NUM_THREADS"), "4");  // the user's value wins
    EXPECT_EQ(env.at("OPENBLAS_NUM_THREADS"), "1");
  }
  // train.threads set: the thread variables are left alone.
  const Environment env = workerEnvironment({}, 0, 1, 1, true, "t");
  EXPECT_EQ(env.count("OMP_NUM_THREADS"), 0u);
  EXPECT_EQ(env.count("OPENBLAS_NUM_THREADS"), 0u);
  EXPECT_EQ(worldFromEnvironment(env).worldSize, 1);
  EXPECT_EQ(worldFromEnvironment(env).launcher, "caravan");
}

// Job tokens are 128 random bits: 32 hex digits, a new one each time.
TEST(LauncherUnits, JobTokensAreFreshRandomHex) {
  const std::string a = newJobToken(), b = newJobToken();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
}

TEST(LauncherUnits, WorkerArguments) {
  const std::vector<std::string> args = {"train", "--config", "c.toml", "--workers", "3",
                                         "--set", "a.b=1", "--workers=2"};
  EXPECT_EQ(workerArguments(args, 0, "runs/c-1"),
            (std::vector<std::string>{"train", "--config", "c.toml", "--set", "a.b=1",
                                      "--run-dir", "runs/c-1"}));
  EXPECT_EQ(workerArguments(args, 2, ""),
            (std::vector<std::string>{"train", "--config", "c.toml", "--set", "a.b=1",
                                      "--quiet"}));
  EXPECT_EQ(rankLogPath("runs/x", 2), "runs/x/rank-2.log");
  // Workers do not supervise: --max-restarts goes too.
  EXPECT_EQ(workerArguments({"train", "-c", "c.toml", "--max-restarts", "2", "--workers", "2",
                             "--max-restarts=3"},
                            1, ""),
            (std::vector<std::string>{"train", "-c", "c.toml", "--quiet"}));
}

TEST(LauncherUnits, RestartArgumentsResumeTheRunDirectory) {
  const std::vector<std::string> args = {
      "train", "--config", "c.toml", "--set", "a.b=1", "--run-dir", "r", "--workers", "2",
      "--max-restarts", "3", "-q", "--stop-at-step=7", "--set=c.d=2", "--trace"};
  // --stop-at-step stays: the failure came before it (a restart without it ran on to
  // train.max_steps).
  EXPECT_EQ(restartArguments(args, "r"),
            (std::vector<std::string>{"train", "--workers", "2", "--max-restarts", "3", "-q",
                                      "--stop-at-step=7", "--trace", "--resume", "r"}));
  EXPECT_EQ(restartArguments({"train", "--resume", "r", "--workers", "2"}, "r"),
            (std::vector<std::string>{"train", "--workers", "2", "--resume", "r"}));
}

// How the supervisor ends: rank 0's own code and no second line when rank 0 ended with the
// failed worker's error code (it said why on the shared terminal); otherwise 2 for a worker's
// config refusal and 8 for any other failure, with the supervisor's line.
TEST(LauncherUnits, ExitCodeAndLineFollowWhatRankZeroSaid) {
  const auto exited = [](int code) { return W_EXITCODE(code, 0); };
  const auto e = [](int causeRank, int cause, int rank0) {
    const LauncherExit x = launcherExit(causeRank, cause, rank0);
    return std::make_pair(static_cast<int>(x.code), x.saidAbove);
  };
  EXPECT_EQ(e(1, exited(2), exited(2)), std::make_pair(2, true));     // one config everywhere
  EXPECT_EQ(e(0, exited(5), exited(5)), std::make_pair(5, true));     // /dev/shm, a swap dir
  EXPECT_EQ(e(1, exited(5), exited(5)), std::make_pair(5, false));    // rank 1's log may differ
  EXPECT_EQ(e(0, exited(6), exited(6)), std::make_pair(6, true));     // non-finite on rank 0
  EXPECT_EQ(e(1, exited(2), exited(130)), std::make_pair(2, false));  // rank 0 was stopped
  EXPECT_EQ(e(1, exited(5), exited(7)), std::make_pair(8, false));    // rank 0 lost its peer
  EXPECT_EQ(e(1, exited(7), exited(7)), std::make_pair(8, false));    // lost peers say little
  EXPECT_EQ(e(1, W_EXITCODE(0, SIGKILL), exited(7)), std::make_pair(8, false));  // killed
}

TEST(LauncherUnits, FailureLine) {
  EXPECT_EQ(describeExit(W_EXITCODE(4, 0)), "exited with code 4");
  EXPECT_EQ(describeExit(SIGKILL), "was killed by signal 9 (SIGKILL)");
  EXPECT_EQ(workerFailureMessage(2, 1234, SIGKILL, 3, 4, "runs/x"),
            "rank 2 (pid 1234) was killed by signal 9 (SIGKILL); stopped the other 3 ranks; see "
            "runs/x/rank-2.log");
  EXPECT_EQ(workerFailureMessage(1, 7, W_EXITCODE(4, 0), 1, 2, "r"),
            "rank 1 (pid 7) exited with code 4; stopped the other rank; see r/rank-1.log");
  EXPECT_EQ(workerFailureMessage(0, 7, W_EXITCODE(3, 0), 1, 4, "r"),
            "rank 0 (pid 7) exited with code 3; stopped the 1 rank still running; see its "
            "output above");
  EXPECT_EQ(workerFailureMessage(0, 7, W_EXITCODE(3, 0), 0, 1, "r"),
            "rank 0 (pid 7) exited with code 3; see its output above");
}

// The rendezvous port stays taken from the pick until the supervisor closes it: no other
// socket can bind it (SO_REUSEADDR included, as the store's own bind), a client's connection
// waits in its queue for rank 0's accept, and once closed the port is free again.
TEST(LauncherUnits, RendezvousPortIsHeldUntilClosed) {
  const LoopbackListener l = listenOnLoopback();
  ASSERT_GE(l.fd, 0);
  ASSERT_GT(l.port, 0);
  EXPECT_EQ(::fcntl(l.fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(l.port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  auto bindsAgain = [&] {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    return bound;
  };
  EXPECT_FALSE(bindsAgain());
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(client);
  ::close(l.fd);
  EXPECT_TRUE(bindsAgain());
}

TEST_F(LauncherProcess, ThreeWorkersFinish) {
  // No --run-dir: the supervisor chooses runs/c-<time> once and tells every rank.
  start("train --config c.toml " + kSynthetic + " --workers 3");
  const auto status = waitExit(seconds(120));
  ASSERT_TRUE(status.has_value()) << "the supervisor did not finish in 120 s";
  const std::string err = readFile(tmp_ / "err");
  ASSERT_TRUE(WIFEXITED(*status)) << err;
  EXPECT_EQ(WEXITSTATUS(*status), 0) << err;
  std::vector<fs::path> runs;
  for (const auto& e : fs::directory_iterator(tmp_ / "runs")) runs.push_back(e.path());
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].filename().string().rfind("c-", 0), 0u) << runs[0];
  EXPECT_TRUE(fs::exists(runs[0] / "rank-1.log"));
  EXPECT_TRUE(fs::exists(runs[0] / "rank-2.log"));
  EXPECT_FALSE(fs::exists(runs[0] / "rank-0.log"));  // rank 0 writes to the terminal
  EXPECT_TRUE(fs::exists(runs[0] / "config.toml"));
  // Only rank 0 printed its summary.
  size_t summaries = 0;
  for (size_t at = 0; (at = err.find("run directory: ", at)) != std::string::npos; ++at) {
    ++summaries;
  }
  EXPECT_EQ(summaries, 1u) << err;
  EXPECT_NE(err.find("run directory: runs/c-"), std::string::npos) << err;
}

TEST_F(LauncherProcess, KilledWorkerStopsTheOthers) {
  startLongRun();
  // Each worker saw its own rank and the same world.
  for (int r = 0; r < 3; ++r) {
    const Environment& env = workerEnv_.at(workers_.at(r));
    EXPECT_EQ(env.at("RANK"), std::to_string(r));
    EXPECT_EQ(env.at("LOCAL_RANK"), std::to_string(r));
    EXPECT_EQ(env.at("WORLD_SIZE"), "3");
    EXPECT_EQ(env.at("MASTER_ADDR"), "127.0.0.1");
    EXPECT_EQ(env.at("MASTER_PORT"), workerEnv_.at(workers_.at(0)).at("MASTER_PORT"));
    EXPECT_EQ(env.at("CARAVAN_LAUNCHER"), "caravan");
  }
  const pid_t victim = workers_.at(1);
  const auto killedAt = Clock::now();
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  const auto status = waitExit(seconds(20));
  ASSERT_TRUE(status.has_value()) << "the supervisor did not exit within 20 s of the kill";
  const double took = std::chrono::duration<double>(Clock::now() - killedAt).count();
  const std::string err = readFile(tmp_ / "err");
  ASSERT_TRUE(WIFEXITED(*status)) << err;
  EXPECT_EQ(WEXITSTATUS(*status), 8) << err;
  const std::string line = lastLine(err);
  const std::string expected = "caravan: error: rank 1 (pid " + std::to_string(victim) +
                               ") was killed by signal 9 (SIGKILL); ";
  EXPECT_EQ(line.rfind(expected, 0), 0u) << line;
  EXPECT_NE(line.find("see " + run_ + "/rank-1.log"), std::string::npos) << line;
  expectNoWorkersLeft();
  std::printf("supervisor exited %.1f s after the kill: %s\n", took, line.c_str());
}

TEST_F(LauncherProcess, MaxRestartsContinuesFromTheLastCheckpointAfterAKilledWorker) {
  // A worker killed mid-run: with --max-restarts 1 the supervisor says so and starts the job
  // again from the newest checkpoint; deterministic BSP then ends exactly as a run that never
  // failed (every step's loss and the final weights, bitwise).
  const std::string job = kSynthetic +
                          " --set train.max_steps=3000 --set checkpoint.every=50 "
                          "--set train.log_every=1";
  writeFile(tmp_ / "c.toml", "[train]\nmax_steps = 4\n");
  const test::CommandResult ref =
      test::runCaravan("train --config c.toml " + job + " --run-dir ref --workers 2", tmp_.path());
  ASSERT_EQ(ref.exitCode, 0) << ref.err;

  pid_t victim = 0;
  killRankOneAfterTheFirstCheckpoint(
      "train --config c.toml " + job + " --workers 2 --max-restarts 1", &victim);
  ASSERT_FALSE(HasFatalFailure());
  const auto status = waitExit(seconds(120));
  ASSERT_TRUE(status.has_value()) << "the restarted job did not finish within 120 s";
  const std::string err = readFile(tmp_ / "err");
  ASSERT_TRUE(WIFEXITED(*status)) << err;
  EXPECT_EQ(WEXITSTATUS(*status), 0) << err;
  EXPECT_NE(err.find("rank 1 (pid " + std::to_string(victim) + ") was killed by signal 9"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("caravan: restart 1 of 1, from " + run_ + "/checkpoints/"),
            std::string::npos)
      << err;
  const std::vector<double> expected = test::trainLosses(tmp_ / "ref");
  ASSERT_EQ(expected.size(), 3000u);
  EXPECT_EQ(test::trainLosses(run_), expected);
  const Config config = Config::fromFile(tmp_ / "ref/config.toml", {});
  const auto a = test::finalWeights(config, tmp_ / "ref"), b = test::finalWeights(config, run_);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name;
}

// An explicit dist.store_path outlives its job: a restart after a killed worker, and a new job
// on the file a killed job left, each keep their keys apart in it (issue 51: both stopped with
// "rank 0 of 2 is taken", exit 8).
TEST_F(LauncherProcess, RestartsAndNewJobsReuseAnExplicitStoreFile) {
  const std::string store = tmp_ / "store";
  const std::string job = kSynthetic +
                          " --set train.max_steps=2000 --set checkpoint.every=50 "
                          "--set train.log_every=1 --set dist.store=file --set dist.store_path=" +
                          store;
  pid_t victim = 0;
  killRankOneAfterTheFirstCheckpoint(
      "train --config /dev/null " + job + " --workers 2 --max-restarts 1", &victim);
  ASSERT_FALSE(HasFatalFailure());
  const auto status = waitExit(seconds(120));
  ASSERT_TRUE(status.has_value()) << "the restarted job did not finish within 120 s";
  const std::string err = readFile(tmp_ / "err");
  EXPECT_NE(err.find("caravan: restart 1 of 1, from"), std::string::npos) << err;
  ASSERT_TRUE(WIFEXITED(*status)) << err;
  EXPECT_EQ(WEXITSTATUS(*status), 0) << err;
  EXPECT_EQ(err.find("is taken"), std::string::npos) << err;
  // A job killed outright (every process, SIGKILL) leaves its keys in the file; a new job on it
  // trains.
  const test::CommandResult killed = test::runShell(
      "setsid " + std::string(CARAVAN_BINARY) + " train -q --config /dev/null " + job +
          " --set train.max_steps=1000000 --run-dir killed --workers 2 & p=$!; "
          "for i in $(seq 600); do [ -s killed/metrics.jsonl ] && break; sleep 0.1; done; "
          "pkill -KILL -g $p; wait $p; test -s " +
          store,
      tmp_.path());
  ASSERT_EQ(killed.exitCode, 0) << "the killed job left no store file: " << killed.err;
  const test::CommandResult again =
      test::runCaravan("train -q --config /dev/null " + job +
                       " --set train.max_steps=3 --run-dir " + (tmp_ / "again") + " --workers 2");
  EXPECT_EQ(again.exitCode, 0) << again.err;
}

// A config error only a worker can find (here memory.budget, checked after the first step)
// reaches the launcher as exit 2, not 8 (a worker failed), in rank 0's one line, and is not
// restarted.
TEST_F(LauncherProcess, AConfigErrorFoundInAWorkerExitsTwoAndIsNotRestarted) {
  const test::CommandResult r = test::runCaravan(
      "train -q --config /dev/null " + kSynthetic +
          " --set train.max_steps=3 --set memory.budget=1KiB --workers 2 --max-restarts 2 "
          "--set checkpoint.every=1 --run-dir " +
          (tmp_ / "run"),
      tmp_.path());
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_NE(r.err.find("memory.budget = 1.0 KiB is below"), std::string::npos) << r.err;
  // Rank 0's own line says it; the supervisor adds no second one about the exit code.
  EXPECT_EQ(countLines(r.err), 1) << r.err;
  EXPECT_EQ(r.err.find("restart"), std::string::npos) << r.err;
}

// A /dev/shm that cannot hold the segment (here read-only, in a mount namespace of the test's
// own): dist.backend = auto says so in one line and trains on Gloo; dist.backend = shm stops,
// naming /dev/shm and the way out (it said "cannot create /caravan-...: Read-only file system").
TEST_F(LauncherProcess, AutoFallsBackToGlooWhenDevShmCannotHoldTheSegment) {
  if (std::system("unshare -m true 2>/dev/null") != 0) GTEST_SKIP() << "no mount namespaces here";
  const std::string bin = CARAVAN_BINARY;
  auto runReadOnlyShm = [&](const std::string& backend, const std::string& dir) {
    const std::string script = "mount -t tmpfs -o ro,size=64k tmpfs /dev/shm && exec " + bin +
                               " train --config /dev/null " + kSynthetic +
                               " --set train.max_steps=3 --set dist.backend=" + backend +
                               " --workers 2 --run-dir " + dir;
    return test::runShell("unshare -m sh -c '" + script + "'", tmp_.path());
  };
  const test::CommandResult autoRun = runReadOnlyShm("auto", tmp_ / "auto");
  EXPECT_EQ(autoRun.exitCode, 0) << autoRun.err;
  EXPECT_NE(autoRun.err.find("dist.backend = auto: /dev/shm cannot hold the job's segment"),
            std::string::npos)
      << autoRun.err;
  EXPECT_NE(autoRun.err.find("using gloo instead"), std::string::npos) << autoRun.err;
  const test::CommandResult shm = runReadOnlyShm("shm", tmp_ / "shm");
  EXPECT_NE(shm.exitCode, 0) << shm.err;
  EXPECT_NE(shm.err.find("dist.backend = shm: rank 0: cannot create the shared-memory segment "
                         "/dev/shm/caravan-"),
            std::string::npos)
      << shm.err;
  EXPECT_NE(shm.err.find("use dist.backend = auto or gloo"), std::string::npos) << shm.err;
}

TEST_F(LauncherProcess, MaxRestartsNeedsWorkers) {
  const test::CommandResult r = test::runCaravan("train --config /dev/null --max-restarts 1");
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_NE(r.err.find("--max-restarts restarts the workers of --workers N"), std::string::npos)
      << r.err;
}

TEST_F(LauncherProcess, InterruptStopsEveryWorker) {
  startLongRun();
  ASSERT_EQ(::kill(supervisor_, SIGINT), 0);
  const auto status = waitExit(seconds(60));
  ASSERT_TRUE(status.has_value()) << "the supervisor did not exit within 60 s of SIGINT";
  const std::string err = readFile(tmp_ / "err");
  ASSERT_TRUE(WIFEXITED(*status)) << err;
  EXPECT_EQ(WEXITSTATUS(*status), 130) << err;
  expectNoWorkersLeft();
  // Rank 0 tells how to continue, with the same number of workers.
  EXPECT_NE(err.find("continue with: caravan train --resume " + run_ + " --workers 3"),
            std::string::npos)
      << err;
}

TEST_F(LauncherProcess, KilledSupervisorLeavesNoWorkers) {
  // Orphaned workers are re-parented to this process, so it can reap and check them.
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  startLongRun();
  ASSERT_EQ(::kill(supervisor_, SIGKILL), 0);
  ASSERT_TRUE(waitExit(seconds(5)).has_value());
  for (const auto& [rank, pid] : workers_) {
    EXPECT_TRUE(waitUntil(
        [pid = pid] {
          ::waitpid(pid, nullptr, WNOHANG);
          return !alive(pid);
        },
        seconds(30)))
        << "rank " << rank << " outlived the supervisor";
  }
  for (const auto& [rank, pid] : workers_) {
    if (alive(pid)) ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
}

TEST_F(LauncherProcess, RefusedUnderAnotherLauncherOrWithABadConfig) {
  start("train --config c.toml " + kSynthetic + " --run-dir run --workers 2",
        {"RANK=1", "WORLD_SIZE=2"});
  auto status = waitExit(seconds(30));
  ASSERT_TRUE(status.has_value());
  std::string err = readFile(tmp_ / "err");
  ASSERT_TRUE(WIFEXITED(*status)) << err;
  EXPECT_EQ(WEXITSTATUS(*status), 2) << err;
  EXPECT_EQ(countLines(err), 1) << err;
  EXPECT_EQ(err.rfind("caravan: error: --workers", 0), 0u) << err;
  EXPECT_NE(err.find("RANK/WORLD_SIZE"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(tmp_ / "run"));

  // Refused before any worker starts: exit 2 with one line containing `needle`.
  auto expectRefused = [&](const std::string& args, const std::string& needle) {
    reaped_ = false;
    start(args);
    const auto s = waitExit(seconds(30));
    ASSERT_TRUE(s.has_value());
    const std::string e = readFile(tmp_ / "err");
    ASSERT_TRUE(WIFEXITED(*s)) << e;
    EXPECT_EQ(WEXITSTATUS(*s), 2) << e;
    EXPECT_EQ(countLines(e), 1) << e;
    EXPECT_NE(e.find(needle), std::string::npos) << e;
  };
  // A bad config is reported once, before any worker starts.
  expectRefused("train --config c.toml --set optim.lrr=1 --run-dir run --workers 2", "optim.lrr");
  EXPECT_FALSE(fs::exists(tmp_ / "run"));

  // A run directory that holds a run is refused before any worker starts (and writes its log
  // into it): one line, the directory as it was.
  fs::create_directories(tmp_ / "run");
  writeFile(tmp_ / "run/metrics.jsonl", "{}\n");
  expectRefused("train --config c.toml " + kSynthetic + " --run-dir run --workers 2",
                "already holds a run");
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp_ / "run"), fs::directory_iterator()), 1);
}

// Every combination of keys that cannot run is refused before any worker starts: `--workers 4`
// exits 2 with one line in under 2 s, never forks a worker, and creates no run directory. Each
// rank under an external launcher refuses with the same line before it connects (rank 1 of 4
// here, whose master never comes: without the check it would wait fault.timeout).
TEST_F(LauncherProcess, RefusedCombinationsExitBeforeAnyWorkerStartsWithOneLine) {
  const std::vector<std::pair<std::string, std::string>> combinations = {
      {"--set sync.mode=gossip --set sync.compression=fp16",
       "sync.compression = fp16 works with sync.mode = allreduce"},
      {"--set sync.mode=ps-bsp --set optim.grad_clip=1",
       "optim.grad_clip is not supported with sync.mode = ps-bsp"},
      {"--set sync.mode=local-sgd --set memory.weights=offload",
       "memory.weights = offload works with sync.mode = allreduce"},
      {"--set sync.compression=bf16 --set memory.weights=offload",
       "memory.weights = offload exchanges uncompressed"},
      {"--set sync.mode=osp --set train.nonfinite_skips=2",
       "train.nonfinite_skips needs the update after backward; sync.mode = osp"},
      {"--set memory.weights=offload --set train.nonfinite_skips=2",
       "train.nonfinite_skips needs the update after backward; memory.weights = offload"},
      {"--set sync.mode=ps-asp --set dist.backend=mpi", "does not run on dist.backend = mpi yet"},
      {"--set optim.nesterov=true --set optim.momentum=0", "optim.nesterov = true needs"},
      {"--set fault.timeout=1e-9", "fault.timeout is below a millisecond"},
      {"--set sync.compression=int4", "sync.compression = int4 is for parameter changes"},
      {"--set sync.mode=diloco --set sync.compression=topk",
       "sync.compression = topk works with sync.mode = allreduce, ps-bsp, ps-asp and ps-ssp; "
       "for diloco use none, int8 or int4"},
      {"--set sync.mode=diloco --set sync.local_period=2 --set sync.fragments=3",
       "sync.fragments = 3 is more than sync.local_period = 2"},
      {"--set sync.mode=local-sgd --set sync.fragments=2",
       "sync.fragments = 2 streams diloco's fragments"},
      {"--set sync.mode=diloco --set sync.post_local_steps=3",
       "sync.post_local_steps is local-sgd's BSP phase"},
      {"--set sync.mode=ps-diloco --set sync.compression=bf16",
       "for ps-diloco use none, int8 or int4"},
      {"--set sync.mode=ps-diloco --set sync.local_period=2 --set sync.fragments=3",
       "sync.fragments = 3 is more than sync.local_period = 2"},
  };
  const int port = caravan::test::reservePort();
  for (const auto& [settings, needle] : combinations) {
    SCOPED_TRACE(settings);
    reaped_ = false;
    const auto t0 = Clock::now();
    start("train --config c.toml " + kSynthetic + " " + settings + " --run-dir run --workers 4");
    bool forked = false;
    std::optional<int> status;
    while (!status && Clock::now() - t0 < seconds(30)) {
      forked = forked || !childrenOf(supervisor_).empty();
      status = waitExit(milliseconds(1));
    }
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    ASSERT_TRUE(status.has_value());
    const std::string line = readFile(tmp_ / "err");
    ASSERT_TRUE(WIFEXITED(*status)) << line;
    EXPECT_EQ(WEXITSTATUS(*status), 2) << line;
    EXPECT_EQ(countLines(line), 1) << line;
    EXPECT_NE(line.find(needle), std::string::npos) << line;
    // Refused at once, not after a rendezvous wait: well under its timeout even on a loaded
    // machine (2 s was exceeded while other jobs shared the 2 cores).
    EXPECT_LT(took, 10.0) << line;
    EXPECT_FALSE(forked);
    EXPECT_FALSE(fs::exists(tmp_ / "run"));

    reaped_ = false;
    const auto r0 = Clock::now();
    start(
        "train --config c.toml " + kSynthetic + " " + settings + " --run-dir rank-run",
        {"RANK=1", "WORLD_SIZE=4", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port)});
    status = waitExit(seconds(30));
    ASSERT_TRUE(status.has_value());
    const std::string rankLine = readFile(tmp_ / "err");
    ASSERT_TRUE(WIFEXITED(*status)) << rankLine;
    EXPECT_EQ(WEXITSTATUS(*status), 2) << rankLine;
    EXPECT_EQ(rankLine, line);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - r0).count(), 2.0) << rankLine;
  }
}

// The lock itself: one holder at a time, the refused process learns the holder's pid, and a
// holder killed with SIGKILL leaves the directory free.
TEST(RunDirectoryLock, OneHolderAtATimeAndAKilledHolderReleasesIt) {
  TempDir dir;
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t holder = ::fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {
    const auto lock = lockRunDirectory(dir.path());
    const char byte = 1;
    if (::write(ready[1], &byte, 1) != 1) ::_exit(1);
    ::pause();
    ::_exit(0);
  }
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);
  try {
    lockRunDirectory(dir.path());
    ADD_FAILURE() << "a second holder took the lock";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("in use by process " + std::to_string(holder)),
              std::string::npos)
        << e.what();
  }
  ::kill(holder, SIGKILL);
  ::waitpid(holder, nullptr, 0);
  EXPECT_TRUE(lockRunDirectory(dir.path())->held());
}

// Two jobs on one run directory: the second (a single process or a --workers launcher) is
// refused with one line naming the first, before it writes anything; once the first is
// killed, the directory can be resumed again.
TEST_F(LauncherProcess, SecondJobOnARunDirectoryInUseIsRefusedNamingItsHolder) {
  run_ = tmp_ / "run";
  start("train --config c.toml " + kSynthetic +
        " --set train.max_steps=10000000 --set train.log_every=1 --set checkpoint.every=5"
        " --run-dir run");
  ASSERT_TRUE(waitUntil([&] { return fs::exists(run_ + "/checkpoints"); }, seconds(60)))
      << readFile(tmp_ / "err");
  const std::string config = tmp_ / "c.toml";
  const std::string holder = "in use by process " + std::to_string(supervisor_);
  const std::string before = readFile(run_ + "/metrics.jsonl");
  for (const std::string& how :
       {"train --resume " + run_, "train --resume " + run_ + " --workers 2",
        "train --config " + config + " " + kSynthetic + " --run-dir " + run_}) {
    SCOPED_TRACE(how);
    const auto t0 = Clock::now();
    const CommandResult r = runCaravan(how);
    EXPECT_EQ(r.exitCode, 2) << r.err;
    EXPECT_EQ(countLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(holder), std::string::npos) << r.err;
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 5.0);
  }
  // The refused jobs wrote nothing: the first run's records are all still there.
  const std::string after = readFile(run_ + "/metrics.jsonl");
  EXPECT_EQ(after.substr(0, before.size()), before);
  ::killpg(supervisor_, SIGKILL);
  ::waitpid(supervisor_, nullptr, 0);
  reaped_ = true;
  // Free again: a resume runs, two steps past the newest checkpoint the killed run left.
  int64_t newest = 0;
  for (const auto& f : fs::directory_iterator(run_ + "/checkpoints")) {
    const std::string name = f.path().filename();
    if (name.rfind("step-", 0) == 0) newest = std::max<int64_t>(newest, std::stoll(name.substr(5)));
  }
  const CommandResult again = runCaravan("train -q --resume " + run_ +
                                         " --set train.max_steps=" + std::to_string(newest + 2));
  EXPECT_EQ(again.err.find("in use"), std::string::npos) << again.err;
  EXPECT_EQ(again.exitCode, 0) << again.err;
}

// A rank under an external launcher whose peers never start says so within
// fault.rendezvous_timeout (not fault.timeout), with how many ranks arrived; a rank whose
// master never starts names the address it could not reach.
// A second process given a rank that another process of the job already has (a launcher
// script's mistake) is refused at once, naming the rank, and the job runs on undisturbed. It
// used to wait about 5x fault.timeout and then blame the network.
TEST_F(LauncherProcess, ADuplicateRankIsRefusedAtOnceAndTheJobRunsOn) {
  const int port = caravan::test::reservePort();
  writeFile(tmp_ / "c.toml", "[train]\nmax_steps = 10000000\n");
  const std::string train = std::string(CARAVAN_BINARY) + " train -q --config c.toml " +
                            kSynthetic + " --set fault.timeout=2 --run-dir ";
  // Ranks 0 and 1 each in their own directory (as on two hosts), training until stopped; once
  // rank 0 has written its first records (both have joined), a third process comes as rank 1
  // too. Then: are both still training, a second later? (Then they are killed: `timeout`
  // forwards one SIGTERM to its child and another to its group, and caravan's second signal
  // ends it at once, so the job's own exit codes are not this test's.)
  const std::string script =
      "cd " + tmp_.path() +
      " && export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
      "; (RANK=0 timeout 120 " + train + "a 2>a.err & echo $! >a.pid; " +
      "wait $!; echo $? >a.rc) & (RANK=1 timeout 120 " + train + "b 2>b.err & echo $! >b.pid; " +
      "wait $!; echo $? >b.rc) & " +
      "for i in $(seq 600); do [ -s a/metrics.jsonl ] && break; sleep 0.1; done; " +
      "s=$(date +%s%N); RANK=1 timeout 60 " + train + "c 2>c.err; echo $? >c.rc; " +
      "echo $(( ($(date +%s%N) - s) / 1000000 )) >c.ms; " + "RANK=1 timeout 60 " + train +
      "a 2>d.err; echo $? >d.rc; " +
      "sleep 1; kill -0 $(cat a.pid) && kill -0 $(cat b.pid) && echo yes >alive; " +
      "for p in $(cat a.pid) $(cat b.pid); do pkill -KILL -P $p; kill -KILL $p; done; wait";
  ASSERT_EQ(std::system(("bash -c '" + script + "'").c_str()), 0);
  const std::string err = readFile(tmp_ / "c.err");
  EXPECT_EQ(readFile(tmp_ / "c.rc"), "2\n") << err;
  EXPECT_EQ(countLines(err), 1) << err;
  EXPECT_NE(err.find("rank 1 of 2 is taken: another process joined this job as rank 1 first"),
            std::string::npos)
      << err;
  EXPECT_LT(std::stoi(readFile(tmp_ / "c.ms")), 10000) << "fault.timeout is 2 s";
  // A duplicate given the running job's own directory is told a job runs there, and never to
  // remove it (it was told the run "stopped before its first checkpoint ... or remove" it).
  const std::string dup = readFile(tmp_ / "d.err");
  EXPECT_EQ(readFile(tmp_ / "d.rc"), "2\n") << dup;
  EXPECT_EQ(countLines(dup), 1) << dup;
  EXPECT_NE(dup.find("is in use by process"), std::string::npos) << dup;
  EXPECT_NE(dup.find("a job is running in it"), std::string::npos) << dup;
  EXPECT_EQ(dup.find("remove"), std::string::npos) << dup;
  EXPECT_EQ(readFile(tmp_ / "alive"), "yes\n")
      << "the job stopped when the duplicate came: " << readFile(tmp_ / "a.err")
      << readFile(tmp_ / "b.err");
}

TEST_F(LauncherProcess, MissingPeersAreReportedWithinTheRendezvousTimeout) {
  const int port = caravan::test::reservePort();
  const std::vector<std::string> world = {"WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                                          "MASTER_PORT=" + std::to_string(port)};
  const std::string args = "train --config c.toml " + kSynthetic +
                           " --set fault.timeout=60 --set fault.rendezvous_timeout=2"
                           " --run-dir run";
  for (const auto& [rank, needle] : std::vector<std::pair<std::string, std::string>>{
           {"RANK=0", "1 of 2 ranks arrived at the rendezvous within 2000 ms; rank 1 did not"},
           {"RANK=1", "could not reach the rendezvous store at 127.0.0.1:" + std::to_string(port) +
                          " within 2000 ms"}}) {
    SCOPED_TRACE(rank);
    std::vector<std::string> env = world;
    env.push_back(rank);
    reaped_ = false;
    const auto t0 = Clock::now();
    start(args, env);
    const std::optional<int> status = waitExit(seconds(30));
    ASSERT_TRUE(status.has_value());
    const std::string err = readFile(tmp_ / "err");
    ASSERT_TRUE(WIFEXITED(*status)) << err;
    EXPECT_EQ(WEXITSTATUS(*status), 7) << err;
    EXPECT_NE(err.find(needle), std::string::npos) << err;
    EXPECT_EQ(countLines(err), 1) << err;
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0) << err;
  }
}
