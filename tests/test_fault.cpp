// A rank lost mid-run under an external launcher (no Caravan supervisor to notice): three
// `caravan train` processes started with torchrun-style variables, one killed with SIGKILL or
// frozen with SIGSTOP while training. The survivors must exit with kPeer (7) within
// fault.timeout (plus the heartbeat window for a frozen rank, which only a timeout reveals),
// and their error line must name the lost rank first. Killing rank 0 also takes down the
// rendezvous store it hosts; that case is named through the store going silent.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>

#include "comm/launch.h"
#include "test_util.h"

extern char** environ;

using namespace caravan::test;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kWorld = 3;
constexpr double kTimeoutS = 10.0;  // fault.timeout of the run

std::string lastLine(std::string t) {
  while (!t.empty() && t.back() == '\n') t.pop_back();
  const auto nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

struct Case {
  int victim;
  int signal;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "rank " << c.victim << (c.signal == SIGKILL ? " killed" : " stopped");
}

std::string caseName(const ::testing::TestParamInfo<Case>& info) {
  return "Rank" + std::to_string(info.param.victim) +
         (info.param.signal == SIGKILL ? "Killed" : "Stopped");
}

class LostRank : public ::testing::TestWithParam<Case> {
 protected:
  void TearDown() override {
    for (pid_t pid : pids_) {
      if (pid > 0 && exit_.count(pid) == 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
  }

  // Starts rank `r` of the job: caravan train with torchrun-style variables, stderr to a file.
  void startRank(int r, int port) {
    const std::string err = tmp_ / ("err" + std::to_string(r));
    std::vector<std::string> argv = {
        CARAVAN_BINARY, "train", "-q", "--config", "/dev/null", "--run-dir", tmp_ / "run",
        "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=64",
        "--set", "data.batch_size=8", "--set", "model.name=mlp", "--set", "model.width=8",
        "--set", "train.threads=1", "--set", "train.max_steps=10000000",
        "--set", "train.log_every=1", "--set", "train.eval_every=0",
        "--set", "fault.timeout=" + std::to_string(kTimeoutS)};
    std::vector<std::string> envp;
    for (char** e = environ; *e != nullptr; ++e) envp.emplace_back(*e);
    for (const std::string& kv :
         {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
          "WORLD_SIZE=" + std::to_string(kWorld), std::string("MASTER_ADDR=127.0.0.1"),
          "MASTER_PORT=" + std::to_string(port), std::string("OMP_NUM_THREADS=1")}) {
      envp.push_back(kv);
    }
    std::vector<char*> av, ev;
    for (auto& s : argv) av.push_back(s.data());
    av.push_back(nullptr);
    for (auto& s : envp) ev.push_back(s.data());
    ev.push_back(nullptr);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
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

  TempDir tmp_;
  std::vector<pid_t> pids_;
  std::map<pid_t, std::pair<int, Clock::time_point>> exit_;
};

}  // namespace

TEST_P(LostRank, SurvivorsExitNamingIt) {
  const Case c = GetParam();
  const int port = caravan::pickFreeLoopbackPort();
  for (int r = 0; r < kWorld; ++r) startRank(r, port);
  // Training: rank 0 has logged a few steps.
  const auto started = Clock::now();
  while (countLines(readFile(tmp_ / "run/metrics.jsonl")) < 20) {
    ASSERT_LT(Clock::now() - started, std::chrono::seconds(60))
        << "the job did not train within 60 s: " << readFile(tmp_ / "err0");
    for (pid_t pid : pids_) ASSERT_EQ(::waitpid(pid, nullptr, WNOHANG), 0) << "a rank exited";
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));  // two heartbeats carry a step
  const pid_t victim = pids_.at(c.victim);
  const auto lostAt = Clock::now();
  ASSERT_EQ(::kill(victim, c.signal), 0);
  // A killed rank closes its connections, so the survivors notice at once; a stopped one is
  // only noticed when a collective times out (fault.timeout), then the heartbeat window.
  const double bound = c.signal == SIGKILL ? kTimeoutS : kTimeoutS + 5.0;
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
}

INSTANTIATE_TEST_SUITE_P(ExternalLauncher, LostRank,
                         ::testing::Values(Case{1, SIGKILL}, Case{0, SIGKILL},
                                           Case{2, SIGSTOP}),
                         caseName);
