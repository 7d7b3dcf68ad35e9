// A rank lost mid-run under an external launcher (no Caravan supervisor to notice): three
// `caravan train` processes started with torchrun-style variables, one killed with SIGKILL or
// frozen with SIGSTOP while training. The survivors must exit with kPeer (7) within
// fault.timeout plus the heartbeat window, and their error line must name the lost rank first.
// Killing rank 0 also takes down the rendezvous store it hosts; that case is named through the
// store going silent.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <sstream>
#include <thread>
#include <cstdlib>
#include <random>

#include <fmt/format.h>

#include "cli/launch.h"
#include "comm/shm_communicator.h"
#include "run_util.h"
#include "test_util.h"

extern char** environ;

using namespace caravan::test;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kWorld = 3;
constexpr double kTimeoutS = 10.0;  // fault.timeout of the run
// How long a survivor may take to exit after a rank is lost: a collective's timeout (a stopped
// rank is only seen so; on LibTorch 2.13's Gloo a killed one sometimes too, see LostRank),
// the heartbeat window that names the lost rank (2.5 s) and the exit.
constexpr double kSurvivorBoundS = kTimeoutS + 5.0;

struct Case {
  int victim;
  int signal;
  std::string backend = "gloo";
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "rank " << c.victim << (c.signal == SIGKILL ? " killed" : " stopped") << " on "
      << c.backend;
}

std::string caseName(const ::testing::TestParamInfo<Case>& info) {
  return "Rank" + std::to_string(info.param.victim) +
         (info.param.signal == SIGKILL ? "Killed" : "Stopped") +
         (info.param.backend == "gloo" ? "" : "On" + info.param.backend);
}

// A job of caravan processes started by the test (torchrun-style variables), reaped by it.
class Job : public ::testing::Test {
 protected:
  void TearDown() override {
    for (pid_t pid : pids_) {
      if (pid > 0 && exit_.count(pid) == 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
  }

  // Starts rank `r` of a job of `world` ranks: caravan train with torchrun-style variables
  // (plus `env`, "KEY=VALUE"), its config the base below plus `sets`, its run directory
  // tmp/RUN, stderr to tmp/err<r> (tmp/err<r>-RUN for another run than "run"); returns the
  // pid.
  pid_t startRank(int r, int port, const std::vector<std::string>& sets = {},
                  int world = kWorld, const std::vector<std::string>& env = {},
                  const std::string& run = "run") {
    const std::string err =
        tmp_ / ("err" + std::to_string(r) + (run == "run" ? "" : "-" + run));
    std::vector<std::string> argv = {
        CARAVAN_BINARY, "train", "-q", "--config", "/dev/null", "--run-dir", tmp_ / run,
        "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=64",
        "--set", "data.batch_size=8", "--set", "model.name=mlp", "--set", "model.width=8",
        "--set", "train.threads=1", "--set", "train.log_every=1", "--set", "train.eval_every=0",
        "--set", "fault.timeout=" + std::to_string(kTimeoutS)};
    bool steps = false;
    for (const auto& s : sets) {
      argv.push_back("--set");
      argv.push_back(s);
      steps = steps || s.rfind("train.max_steps=", 0) == 0;
    }
    if (!steps) {
      argv.push_back("--set");
      argv.push_back("train.max_steps=10000000");
    }
    std::vector<std::string> envp;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string(*e).rfind("CARAVAN_JOB_TOKEN=", 0) != 0) envp.emplace_back(*e);
    }
    for (const std::string& kv :
         {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
          "WORLD_SIZE=" + std::to_string(world), std::string("MASTER_ADDR=127.0.0.1"),
          "MASTER_PORT=" + std::to_string(port), std::string("OMP_NUM_THREADS=1")}) {
      envp.push_back(kv);
    }
    for (const auto& kv : env) envp.push_back(kv);
    std::vector<char*> av, ev;
    for (auto& s : argv) av.push_back(s.data());
    av.push_back(nullptr);
    for (auto& s : envp) ev.push_back(s.data());
    ev.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork failed";
      std::abort();  // never hand -1 to kill()
    }
    if (pid == 0) {
      const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int n = ::open("/dev/null", O_RDWR);
      if (e < 0 || n < 0) ::_exit(99);
      ::dup2(n, 0);
      ::dup2(n, 1);
      ::dup2(e, 2);
      ::execve(av[0], av.data(), ev.data());
      ::_exit(98);
    }
    pids_.push_back(pid);
    return pid;
  }

  // Reaps every rank other than `except` that exits before `deadline`.
  void reapUntil(Clock::time_point deadline, pid_t except) {
    while (Clock::now() < deadline) {
      bool pending = false;
      for (pid_t pid : pids_) {
        if (pid == except || exit_.count(pid) != 0) continue;
        int status = 0;
        if (::waitpid(pid, &status, WNOHANG) == pid) {
          exit_[pid] = {status, Clock::now()};
        } else {
          pending = true;
        }
      }
      if (!pending) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // Waits until RUN_DIR/metrics.jsonl has `lines` lines, every rank still running.
  void waitForMetrics(const std::string& run, int lines) {
    const auto started = Clock::now();
    while (countLines(readFile(tmp_ / (run + "/metrics.jsonl"))) < lines) {
      ASSERT_LT(Clock::now() - started, std::chrono::seconds(60))
          << "the job did not train within 60 s: " << readFile(tmp_ / "err0");
      for (pid_t pid : pids_) {
        if (exit_.count(pid) == 0) {
          ASSERT_EQ(::waitpid(pid, nullptr, WNOHANG), 0) << "a rank exited";
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  TempDir tmp_;
  std::vector<pid_t> pids_;
  std::map<pid_t, std::pair<int, Clock::time_point>> exit_;
};

class LostRank : public Job, public ::testing::WithParamInterface<Case> {};

}  // namespace

TEST_P(LostRank, SurvivorsExitNamingIt) {
  const Case c = GetParam();
  const int port = caravan::test::reservePort();
  // A token of its own, so the shared-memory segments checked below are this job's.
  const std::string token = fmt::format("lost-rank-{}-{}", ::getpid(), port);
  for (int r = 0; r < kWorld; ++r) {
    startRank(r, port, {"dist.backend=" + c.backend}, kWorld, {"CARAVAN_JOB_TOKEN=" + token});
  }
  // Training: rank 0 has logged a few steps.
  waitForMetrics("run", 20);
  std::this_thread::sleep_for(std::chrono::seconds(1));  // two heartbeats carry a step
  const pid_t victim = pids_.at(c.victim);
  const auto lostAt = Clock::now();
  ASSERT_EQ(::kill(victim, c.signal), 0);
  // A killed rank closes its connections, and the survivors usually notice at once; a stopped
  // one is only noticed when a collective times out (fault.timeout), then the heartbeat window.
  // Gloo 2.13 does not always report the closed connection to a rank blocked on another peer
  // (1 run in 6 here; CI saw rank 2 wait the full timeout), so a killed rank gets the same bound.
  const double bound = kSurvivorBoundS;
  reapUntil(lostAt + std::chrono::milliseconds(static_cast<int>(bound * 1000)), victim);
  for (int r = 0; r < kWorld; ++r) {
    if (r == c.victim) continue;
    const pid_t pid = pids_.at(r);
    const std::string err = readFile(tmp_ / ("err" + std::to_string(r)));
    ASSERT_EQ(exit_.count(pid), 1u) << "rank " << r << " still runs " << bound
                                    << " s after rank " << c.victim << " was lost: " << err;
    const auto [status, when] = exit_.at(pid);
    ASSERT_TRUE(WIFEXITED(status)) << "rank " << r << ": " << err;
    EXPECT_EQ(WEXITSTATUS(status), 7) << "rank " << r << ": " << err;
    const std::string line = lastLine(err);
    const std::string named = "caravan: error: rank " + std::to_string(c.victim) + " (worker";
    EXPECT_EQ(line.rfind(named, 0), 0u) << "rank " << r << ": " << line;
    EXPECT_NE(line.find("is lost"), std::string::npos) << line;
    if (c.victim != 0) {  // rank 0's own beats die with the store it hosts
      EXPECT_NE(line.find("it last reported step "), std::string::npos) << line;
    }
    EXPECT_NE(line.find("rank " + std::to_string(r) + " saw: "), std::string::npos) << line;
    EXPECT_EQ(countLines(err), 1) << err;
    std::printf("rank %d exited %.1f s after rank %d was lost: %s\n", r,
                std::chrono::duration<double>(when - lostAt).count(), c.victim, line.c_str());
  }
  if (c.signal == SIGKILL) {
    ::waitpid(victim, nullptr, 0);
    exit_[victim] = {0, Clock::now()};
  }
  // Shared memory: the segment's name went at the rendezvous; nothing of the job is left.
  const std::string prefix = caravan::segmentPrefix(token);
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_NE(e.path().filename().string().rfind(prefix, 0), 0u) << e.path();
  }
}

INSTANTIATE_TEST_SUITE_P(ExternalLauncher, LostRank,
                         ::testing::Values(Case{1, SIGKILL}, Case{0, SIGKILL}, Case{2, SIGSTOP},
                                           Case{1, SIGKILL, "shm"}, Case{0, SIGKILL, "shm"},
                                           Case{2, SIGSTOP, "shm"}),
                         caseName);

// The kill harness: once per strategy, a rank (worker or server; random, the four modes with a
// server taking the ranks in turn) of a 3-rank job is SIGKILLed at a random step (3 to 40 steps
// logged); a new seed each run. Zero hangs: every survivor exits 7 within kSurvivorBoundS
// (fault.timeout and the heartbeat window), its one error line naming the killed rank and its role
// first. The seed is printed; CARAVAN_KILL_SEED repeats a sequence.
TEST_F(Job, KillHarnessRandomRankAtARandomStep) {
  const char* given = std::getenv("CARAVAN_KILL_SEED");
  const uint64_t seed = given != nullptr ? std::stoull(given)
                                         : static_cast<uint64_t>(::time(nullptr));
  std::printf("kill harness seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::vector<std::string>> modes = {
      {"sync.mode=allreduce"},
      {"sync.mode=ps-bsp", "sync.servers=1"},
      {"sync.mode=osp", "sync.servers=1", "sync.osp_chunk=64"},
      {"sync.mode=local-sgd", "sync.local_period=4"},
      {"sync.mode=ps-asp", "sync.servers=1"},
      {"sync.mode=gossip"},
      {"sync.mode=ps-ssp", "sync.servers=1", "sync.staleness=2"},
      {"sync.mode=allreduce", "sync.compression=topk", "sync.topk_ratio=0.1"}};
  // The modes with a server take the victims in turn from a random start: every run kills a
  // server (rank 2) at least once, and each worker rank too.
  const uint64_t firstServerModeVictim = rng() % kWorld;
  int serverModes = 0;
  for (size_t i = 0; i < modes.size(); ++i) {
    const auto& sets = modes[i];
    const bool servers = sets.size() > 1 && sets[1] == "sync.servers=1";
    const int victim = servers ? static_cast<int>((firstServerModeVictim + serverModes++) % kWorld)
                               : static_cast<int>(rng() % kWorld);
    const int after = 3 + static_cast<int>(rng() % 38);
    const std::string run = "kill" + std::to_string(i);
    std::string mode;
    for (const auto& kv : sets) mode += (mode.empty() ? "" : " ") + kv.substr(kv.find('.') + 1);
    const std::string what = fmt::format("{}: rank {} ({}) killed after {} steps", mode,
                                         victim, servers && victim == 2 ? "server" : "worker",
                                         after);
    SCOPED_TRACE(what);
    const int port = caravan::test::reservePort();
    std::vector<pid_t> job;
    for (int r = 0; r < kWorld; ++r) job.push_back(startRank(r, port, sets, kWorld, {}, run));
    waitForMetrics(run, after);
    const auto lostAt = Clock::now();
    ASSERT_EQ(::kill(job[victim], SIGKILL), 0);
    ::waitpid(job[victim], nullptr, 0);
    exit_[job[victim]] = {0, Clock::now()};
    reapUntil(lostAt + std::chrono::milliseconds(static_cast<int>(kSurvivorBoundS * 1000)),
              job[victim]);
    const std::string role = servers && victim == 2 ? "server" : "worker";
    double slowest = 0.0;
    for (int r = 0; r < kWorld; ++r) {
      if (r == victim) continue;
      const std::string err = readFile(tmp_ / ("err" + std::to_string(r) + "-" + run));
      ASSERT_EQ(exit_.count(job[r]), 1u) << "rank " << r << " hangs: " << err;
      const auto [status, when] = exit_.at(job[r]);
      ASSERT_TRUE(WIFEXITED(status)) << "rank " << r << ": " << err;
      EXPECT_EQ(WEXITSTATUS(status), 7) << "rank " << r << ": " << err;
      const std::string line = lastLine(err);
      // Rank 0 is also named as the store's host: "rank 0 (worker, host of ...) is lost".
      EXPECT_EQ(line.rfind(fmt::format("caravan: error: rank {} ({}", victim, role), 0), 0u)
          << "rank " << r << ": " << line;
      EXPECT_NE(line.find(") is lost"), std::string::npos) << "rank " << r << ": " << line;
      EXPECT_EQ(countLines(err), 1) << err;
      slowest = std::max(slowest, std::chrono::duration<double>(when - lostAt).count());
    }
    std::printf("%zu %-75s survivors out in %.1f s\n", i, what.c_str(), slowest);
  }
}

namespace {

// A stranger's TCP connection to 127.0.0.1:port: sends `bytes`, then returns what comes back
// before the peer closes (at most 5 s; "timeout" if it neither answers nor closes).
std::string strangerExchange(int port, const std::string& bytes) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return "connect failed";
  }
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)!::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  std::string got;
  char buf[256];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n > 0) {
      got.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) got += "timeout";
    break;
  }
  ::close(fd);
  return got;
}

std::string le32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// The store's first hello frame (tcp_store.cpp): [u8 op 1][u32 magic "CRV2"][u32 length]
// [client nonce]. A stranger's guess in place of the 16-byte nonce is refused at once.
std::string helloFrame(const std::string& token) {
  const std::string payload = std::string(1, '\x01') + le32(0x32565243) +
                              le32(static_cast<uint32_t>(token.size())) + token;
  return le32(static_cast<uint32_t>(payload.size())) + payload;
}

}  // namespace

// A job with a token (CARAVAN_JOB_TOKEN) while strangers try to get in: a process started as
// rank 1 with a guessed token, and raw connections to the rendezvous store with a wrong token,
// an empty one, a frame header claiming 300 MB, and garbage. The impostor exits 2 with the
// refusal; every stranger connection is closed without being served (a wrong token gets the
// one-byte refusal); the job runs to its end with every loss bitwise the same as the same job
// without strangers.
TEST_F(Job, StrangersAreRefusedAndTheJobCarriesOn) {
  const std::vector<std::string> sets = {"train.max_steps=2500", "checkpoint.every=0"};
  const std::vector<std::string> token = {"CARAVAN_JOB_TOKEN=7f3a9c0e5b1d4a6f8e2c0b9d7a5f3e1c"};
  // The same job undisturbed.
  {
    const int port = caravan::test::reservePort();
    std::vector<pid_t> job;
    for (int r = 0; r < 2; ++r) job.push_back(startRank(r, port, sets, 2, token, "quiet"));
    reapUntil(Clock::now() + std::chrono::seconds(120), -1);
    for (pid_t pid : job) {
      ASSERT_TRUE(exit_.count(pid) && WIFEXITED(exit_[pid].first) &&
                  WEXITSTATUS(exit_[pid].first) == 0)
          << readFile(tmp_ / "err0-quiet");
    }
  }
  const int port = caravan::test::reservePort();
  std::vector<pid_t> job;
  for (int r = 0; r < 2; ++r) job.push_back(startRank(r, port, sets, 2, token, "run"));
  waitForMetrics("run", 5);
  // An impostor rank.
  const pid_t impostor =
      startRank(1, port, sets, 2, {"CARAVAN_JOB_TOKEN=guessed"}, "impostor");
  int status = 0;
  ASSERT_EQ(::waitpid(impostor, &status, 0), impostor);
  exit_[impostor] = {status, Clock::now()};
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << status;
  const std::string impostorErr = readFile(tmp_ / "err1-impostor");
  EXPECT_NE(impostorErr.find("job token"), std::string::npos)
      << impostorErr;
  // Raw connections.
  const std::string refused = le32(1) + std::string(1, '\x02');  // one frame: status kRefused
  EXPECT_EQ(strangerExchange(port, helloFrame("guessed")), refused);
  EXPECT_EQ(strangerExchange(port, helloFrame("")), refused);
  EXPECT_EQ(strangerExchange(port, le32(300u << 20) + std::string(64, 'x')), "");
  EXPECT_EQ(strangerExchange(port, std::string(4096, '\xff')), "");
  reapUntil(Clock::now() + std::chrono::seconds(120), -1);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(exit_.count(job[r]), 1u) << "rank " << r << " still runs";
    EXPECT_TRUE(WIFEXITED(exit_[job[r]].first) && WEXITSTATUS(exit_[job[r]].first) == 0)
        << readFile(tmp_ / ("err" + std::to_string(r)));
  }
  const auto quiet = caravan::test::trainLosses(tmp_ / "quiet");
  const auto disturbed = caravan::test::trainLosses(tmp_ / "run");
  EXPECT_EQ(quiet.size(), 2500u);
  EXPECT_EQ(disturbed, quiet);
}

// The stall inspector (comm/liveness.h): rank 2 of 3 frozen with SIGSTOP while the others wait
// for it in an all-reduce. With fault.stall_report = 2 s (fault.timeout 10 s), ranks 0 and 1
// each print one line, while the job is still alive, naming rank 2 (not at their collective, or
// silent inside it); after SIGCONT the job runs to its end, every rank exiting 0.
TEST_F(Job, StallInspectorNamesTheRankOthersWaitFor) {
  const std::vector<std::string> sets = {"fault.stall_report=2", "train.max_steps=2000"};
  const int port = caravan::test::reservePort();
  std::vector<pid_t> job;
  for (int r = 0; r < kWorld; ++r) job.push_back(startRank(r, port, sets));
  waitForMetrics("run", 20);
  ASSERT_EQ(::kill(job[2], SIGSTOP), 0);
  std::string reports[2];
  const auto stoppedAt = Clock::now();
  while (Clock::now() - stoppedAt < std::chrono::seconds(6)) {
    reports[0] = readFile(tmp_ / "err0");
    reports[1] = readFile(tmp_ / "err1");
    if (!reports[0].empty() && !reports[1].empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const double after = std::chrono::duration<double>(Clock::now() - stoppedAt).count();
  ASSERT_EQ(::kill(job[2], SIGCONT), 0);
  for (int r = 0; r < 2; ++r) {
    const std::string& line = reports[r];
    EXPECT_EQ(countLines(line), 1) << line;
    EXPECT_EQ(line.rfind(fmt::format("caravan: stall: rank {} has waited ", r), 0), 0u) << line;
    EXPECT_NE(line.find("in collective #"), std::string::npos) << line;
    EXPECT_TRUE(line.find("not reached by rank 2") != std::string::npos ||
                line.find("no heartbeat from rank 2") != std::string::npos)
        << line;
  }
  std::printf("reported %.1f s after rank 2 stopped:\n%s%s", after, reports[0].c_str(),
              reports[1].c_str());
  reapUntil(Clock::now() + std::chrono::seconds(120), -1);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(exit_.count(job[r]), 1u) << "rank " << r << " still runs";
    EXPECT_TRUE(WIFEXITED(exit_[job[r]].first) && WEXITSTATUS(exit_[job[r]].first) == 0)
        << "rank " << r << ": " << readFile(tmp_ / ("err" + std::to_string(r)));
  }
}

// A lost pipeline stage is named like any lost rank: the middle stage of three is killed; the
// first and last stages (each blocked on it in a send, a receive or a reduction) exit 7 naming
// it within kSurvivorBoundS, in one line.
TEST_F(Job, LostPipelineStageIsNamed) {
  const int port = caravan::test::reservePort();
  const std::vector<std::string> sets = {"parallel.pipeline_stages=3", "parallel.micro_batches=4",
                                         "model.depth=3", "parallel.partition=even"};
  for (int r = 0; r < kWorld; ++r) startRank(r, port, sets);
  waitForMetrics("run", 20);
  std::this_thread::sleep_for(std::chrono::seconds(1));  // two heartbeats carry a step
  const pid_t victim = pids_.at(1);
  const auto lostAt = Clock::now();
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  reapUntil(lostAt + std::chrono::milliseconds(static_cast<int>(kSurvivorBoundS * 1000)), victim);
  for (int r : {0, 2}) {
    const pid_t pid = pids_.at(r);
    const std::string err = readFile(tmp_ / ("err" + std::to_string(r)));
    ASSERT_EQ(exit_.count(pid), 1u) << "stage " << r << " still runs: " << err;
    const auto [status, when] = exit_.at(pid);
    ASSERT_TRUE(WIFEXITED(status)) << err;
    EXPECT_EQ(WEXITSTATUS(status), 7) << err;
    const std::string line = lastLine(err);
    EXPECT_EQ(line.rfind("caravan: error: rank 1 (worker", 0), 0u) << line;
    EXPECT_NE(line.find("is lost"), std::string::npos) << line;
    EXPECT_EQ(countLines(err), 1) << err;
    std::printf("stage %d exited %.1f s after stage 1 was lost: %s\n", r,
                std::chrono::duration<double>(when - lostAt).count(), line.c_str());
  }
}
