// Starting and supervising the local workers of `caravan train --workers N` (launcher.h).
#include "cli/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>

#include <fmt/format.h>

#include "cli/launch.h"
#include "comm/shm_communicator.h"
#include "comm/world.h"
#include "core/errors.h"
#include "core/subprocess.h"

namespace caravan {
namespace {

using Clock = std::chrono::steady_clock;

// Blocks the signals the supervisor waits for, for the object's lifetime. Blocked signals are
// queued even when their disposition is SIG_IGN (as for SIGINT in a background job), so
// sigtimedwait sees them; SIGCHLD is set to SIG_DFL because SIG_IGN would make the kernel reap
// the workers before we learn how they ended.
class SignalBlock {
 public:
  SignalBlock() {
    sigemptyset(&set_);
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&set_, s);
    ::pthread_sigmask(SIG_BLOCK, &set_, &old_);
  }
  ~SignalBlock() {
    // Discard what is still pending (a late SIGCHLD, a Ctrl-C after the workers ended): once
    // unblocked, a pending SIGINT would end the supervisor before it reports.
    const timespec zero{0, 0};
    while (::sigtimedwait(&set_, nullptr, &zero) > 0) {
    }
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SignalBlock(const SignalBlock&) = delete;
  SignalBlock& operator=(const SignalBlock&) = delete;

  const sigset_t& set() const { return set_; }
  const sigset_t& previousMask() const { return old_; }

 private:
  // Set before the signals are blocked, restored after they are unblocked.
  ScopedSignalHandler childDefault_{{SIGCHLD}, SIG_DFL};
  sigset_t set_;
  sigset_t old_;
};

// An fd closed when the object dies.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&&) = delete;
  Fd(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// What a worker process needs, prepared before fork(): between fork and exec the child may only
// make async-signal-safe calls, so no allocation happens there.
struct WorkerSpec {
  std::vector<std::string> argv;
  std::vector<std::string> envp;
  int logFd = -1;  // -1: keep the supervisor's stdout/stderr (rank 0)
  int storeFd = -1;  // rank 0: the rendezvous socket it inherits (CARAVAN_STORE_FD)
};

// In the child: makes `from` the descriptor `to`, without close-on-exec.
void redirect(int from, int to) {
  if (from == to) {
    ::fcntl(to, F_SETFD, 0);
  } else {
    ::dup2(from, to);
  }
}

// Forks and execs one worker; returns its pid, or -1 with errno set when fork fails.
pid_t spawnWorker(WorkerSpec& spec, int nullFd, pid_t supervisor, const sigset_t& childMask) {
  std::vector<char*> argv = execArgv(spec.argv);
  std::vector<char*> envp = execArgv(spec.envp);
  const pid_t pid = ::fork();
  if (pid != 0) return pid;

  // Child. A worker must not outlive the supervisor: the kernel sends SIGTERM (the worker then
  // checkpoints and exits) when the supervisor dies. If it died before prctl took effect, we
  // have already been reparented and must not start at all.
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != supervisor) ::_exit(1);
  redirect(nullFd, STDIN_FILENO);
  if (spec.logFd >= 0) {
    redirect(spec.logFd, STDOUT_FILENO);
    redirect(spec.logFd, STDERR_FILENO);
  }
  if (spec.storeFd >= 0) ::fcntl(spec.storeFd, F_SETFD, 0);  // kept across exec
  ::sigprocmask(SIG_SETMASK, &childMask, nullptr);
  // /proc/self/exe is this very binary even if the file on disk was replaced meanwhile.
  ::execve("/proc/self/exe", argv.data(), envp.data());
  static const char kMsg[] = "caravan: error: cannot start a worker: exec of /proc/self/exe failed\n";
  ssize_t ignored = ::write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
  (void)ignored;
  ::_exit(127);
}

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
};

// Among failures seen in the same reaping pass, the one most likely to be the cause: a signal
// or an ordinary error before a lost peer (kPeer), which is usually the consequence of another
// rank dying, before an interrupted worker.
int causeRank(int status) {
  if (WIFSIGNALED(status)) return 0;
  const int code = WEXITSTATUS(status);
  if (code == static_cast<int>(ExitCode::kInterrupted)) return 3;
  if (code == static_cast<int>(ExitCode::kPeer)) return 2;
  return 1;
}

bool succeeded(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

class Supervisor {
 public:
  explicit Supervisor(const LaunchOptions& o) : o_(o) {}

  int run() {
    std::error_code ec;
    std::filesystem::create_directories(o_.runDir, ec);
    if (ec) {
      throw IoError(fmt::format("cannot create run directory {}: {}", o_.runDir, ec.message()));
    }
    const LoopbackListener listener = listenOnLoopback();
    const Fd storeSocket(listener.fd);  // held until this start ends
    const Environment base = processEnvironment();
    // The job's token: the user's (CARAVAN_JOB_TOKEN) or a new one for this start.
    auto given = base.find(kJobTokenVariable);
    const std::string token =
        given != base.end() && !given->second.empty() ? given->second : newJobToken();
    // This start's own keys in a file store that an earlier start or job left (store.h).
    const std::string start = newJobToken();
    std::vector<WorkerSpec> specs(static_cast<size_t>(o_.workers));
    std::vector<Fd> logs;
    for (int r = 0; r < o_.workers; ++r) {
      WorkerSpec& s = specs[static_cast<size_t>(r)];
      s.argv = workerArguments(o_.args, r, o_.addRunDir ? o_.runDir : "");
      s.argv.insert(s.argv.begin(), o_.program);
      Environment env =
          workerEnvironment(base, r, o_.workers, listener.port, o_.threadsConfigured, token);
      env[kJobStartVariable] = start;
      if (r == 0) {
        env[kStoreFdVariable] = std::to_string(listener.fd);
        s.storeFd = listener.fd;
      }
      s.envp = environmentStrings(env);
      if (r > 0) {
        const std::string path = rankLogPath(o_.runDir, r);
        logs.emplace_back(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
        if (logs.back().get() < 0) {
          throw IoError(fmt::format("cannot open {}: {}", path, std::strerror(errno)));
        }
        s.logFd = logs.back().get();
      }
    }
    Fd devNull(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (devNull.get() < 0) throw IoError(fmt::format("cannot open /dev/null: {}", std::strerror(errno)));

    SignalBlock signals;
    const pid_t self = ::getpid();
    for (int r = 0; r < o_.workers; ++r) {
      const pid_t pid = spawnWorker(specs[static_cast<size_t>(r)], devNull.get(), self,
                                    signals.previousMask());
      if (pid < 0) {
        startError_ = fmt::format("cannot start worker process {} of {}: fork failed: {}", r,
                                  o_.workers, std::strerror(errno));
        stop(o_.stopGrace);
        break;
      }
      workers_.push_back({r, pid, true, 0});
      ++running_;
    }
    logs.clear();  // the workers hold their own copies

    const timespec zero{0, 0};
    while (running_ > 0) {
      for (int sig; (sig = ::sigtimedwait(&signals.set(), nullptr, &zero)) > 0;) onSignal(sig);
      reap();
      if (running_ == 0) break;
      const auto now = Clock::now();
      if (killAt_ && now >= *killAt_) kill();
      if (giveUpAt_ && now >= *giveUpAt_) break;  // unreapable after SIGKILL; nothing else to do
      // Sleep until a signal (SIGCHLD included) or the next deadline.
      auto wait = std::chrono::milliseconds(1000);
      for (const auto& d : {killAt_, giveUpAt_}) {
        if (d) {
          wait = std::min(wait, std::chrono::ceil<std::chrono::milliseconds>(*d - now));
        }
      }
      wait = std::max(wait, std::chrono::milliseconds(1));
      const timespec ts{static_cast<time_t>(wait.count() / 1000),
                        static_cast<long>((wait.count() % 1000) * 1'000'000)};
      const int sig = ::sigtimedwait(&signals.set(), nullptr, &ts);
      if (sig > 0) onSignal(sig);
    }

    // A shared-memory segment's name outlives its ranks only when rank 0 died mid-rendezvous.
    removeSegments(token);
    if (!startError_.empty()) throw IoError(startError_);
    if (failure_) {
      const LauncherExit e = launcherExit(causeRank_, causeStatus_, workers_.front().status);
      throw WorkerError(*failure_, e.code, e.saidAbove);
    }
    return interrupted_ ? static_cast<int>(ExitCode::kInterrupted) : 0;
  }

 private:
  void signalRunning(int sig) {
    for (const Worker& w : workers_) {
      if (w.running) ::kill(w.pid, sig);
    }
  }

  // SIGTERM now (workers checkpoint and exit), SIGKILL after `grace`.
  void stop(std::chrono::milliseconds grace) {
    signalRunning(SIGTERM);
    const auto at = Clock::now() + grace;
    if (!killAt_ || at < *killAt_) killAt_ = at;
  }

  void kill() {
    signalRunning(SIGKILL);
    killAt_.reset();
    if (!giveUpAt_) giveUpAt_ = Clock::now() + kReapGrace;
  }

  bool stopping() const { return interrupted_ || failure_ || !startError_.empty(); }

  void onSignal(int sig) {
    if (sig == SIGCHLD) return;  // reaped on the next pass
    if (!stopping()) {
      interrupted_ = true;
      stop(o_.interruptGrace);
    } else {
      kill();  // a second interrupt: stop now
    }
  }

  void reap() {
    const Worker* cause = nullptr;
    for (Worker& w : workers_) {
      if (!w.running) continue;
      int status = 0;
      if (::waitpid(w.pid, &status, WNOHANG) != w.pid) continue;
      w.running = false;
      w.status = status;
      --running_;
      if (!succeeded(status) && (cause == nullptr || causeRank(status) < causeRank(cause->status))) {
        cause = &w;
      }
    }
    if (cause == nullptr || stopping()) return;
    failure_ = workerFailureMessage(cause->rank, cause->pid, cause->status, running_, o_.workers,
                                    o_.runDir);
    causeStatus_ = cause->status;
    causeRank_ = cause->rank;
    stop(o_.stopGrace);
  }

  const LaunchOptions& o_;
  std::vector<Worker> workers_;
  int running_ = 0;
  bool interrupted_ = false;
  std::optional<std::string> failure_;
  int causeStatus_ = 0;  // the failed worker's wait status and rank, with failure_
  int causeRank_ = 0;
  std::string startError_;
  std::optional<Clock::time_point> killAt_;   // SIGKILL whoever still runs at this time
  std::optional<Clock::time_point> giveUpAt_; // stop waiting for SIGKILLed workers
};

}  // namespace

int superviseWorkers(const LaunchOptions& options) {
  CARAVAN_CHECK(options.workers >= 1, "workers = {}", options.workers);
  return Supervisor(options).run();
}

}  // namespace caravan
