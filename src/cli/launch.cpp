// Worker environments, command lines and failure reports for the local launcher (launch.h).
#include "cli/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string_view>

#include <fmt/format.h>

#include "comm/auth.h"

namespace caravan {

Environment workerEnvironment(const Environment& base, int rank, int worldSize, int masterPort,
                              bool threadsConfigured, const std::string& token) {
  Environment env = base;
  env[kJobTokenVariable] = token;
  env["RANK"] = std::to_string(rank);
  env["WORLD_SIZE"] = std::to_string(worldSize);
  env["LOCAL_RANK"] = std::to_string(rank);
  env["LOCAL_WORLD_SIZE"] = std::to_string(worldSize);
  env["MASTER_ADDR"] = kLocalMasterAddr;
  env["MASTER_PORT"] = std::to_string(masterPort);
  env["CARAVAN_LAUNCHER"] = kCaravanLauncher;
  env.erase(kStoreFdVariable);  // the supervisor sets it for rank 0 alone
  if (!threadsConfigured) {
    // emplace keeps a value the user set.
    env.emplace("OMP_NUM_THREADS", "1");
    env.emplace("OPENBLAS_NUM_THREADS", "1");
  }
  return env;
}

std::string newJobToken() {
  unsigned char bytes[16];
  randomBytes(bytes, sizeof(bytes));
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

std::vector<std::string> environmentStrings(const Environment& env) {
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

namespace {

// `args` without the options named in `drop` (each with its value: "--x v" or "--x=v").
std::vector<std::string> withoutOptions(const std::vector<std::string>& args,
                                        const std::vector<std::string>& drop) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    bool dropped = false;
    for (const std::string& d : drop) {
      if (a == d) {
        ++i;  // and its value
        dropped = true;
      } else if (a.rfind(d + "=", 0) == 0) {
        dropped = true;
      }
    }
    if (!dropped) out.push_back(a);
  }
  return out;
}

}  // namespace

std::vector<std::string> restartArguments(const std::vector<std::string>& supervisorArgs,
                                          const std::string& runDir) {
  std::vector<std::string> out =
      withoutOptions(supervisorArgs, {"--config", "-c", "--run-dir", "--resume", "--set"});
  out.push_back("--resume");
  out.push_back(runDir);
  return out;
}

std::vector<std::string> workerArguments(const std::vector<std::string>& supervisorArgs, int rank,
                                         const std::string& addRunDir) {
  // The workers are not supervisors: no --workers, no --max-restarts.
  std::vector<std::string> out = withoutOptions(supervisorArgs, {"--workers", "--max-restarts"});
  if (!addRunDir.empty()) {
    out.push_back("--run-dir");
    out.push_back(addRunDir);
  }
  if (rank > 0) out.push_back("--quiet");
  return out;
}

std::string rankLogPath(const std::string& runDir, int rank) {
  return (std::filesystem::path(runDir) / fmt::format("rank-{}.log", rank)).string();
}

LoopbackListener listenOnLoopback() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    throw IoError(fmt::format("cannot create a socket for the workers' rendezvous: {}",
                              std::strerror(errno)));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;  // the kernel picks a free port
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd, SOMAXCONN) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(
        fmt::format("cannot listen on a loopback TCP port for the workers' "
                    "rendezvous: {}",
                    std::strerror(err)));
  }
  return {fd, ntohs(addr.sin_port)};
}

std::string describeExit(int waitStatus) {
  if (WIFEXITED(waitStatus)) return fmt::format("exited with code {}", WEXITSTATUS(waitStatus));
  if (WIFSIGNALED(waitStatus)) {
    const int sig = WTERMSIG(waitStatus);
    const char* abbrev = ::sigabbrev_np(sig);
    return fmt::format("was killed by signal {}{}{}", sig,
                       abbrev != nullptr ? fmt::format(" (SIG{})", abbrev) : "",
                       WCOREDUMP(waitStatus) ? " and dumped core" : "");
  }
  return fmt::format("ended with wait status {:#x}", waitStatus);
}

LauncherExit launcherExit(int causeRank, int cause, int rank0) {
  if (!WIFEXITED(cause)) return {};
  const int code = WEXITSTATUS(cause);
  if (WIFEXITED(rank0) && WEXITSTATUS(rank0) == code && code != 0 &&
      code != static_cast<int>(ExitCode::kPeer) &&
      code != static_cast<int>(ExitCode::kInterrupted)) {
    return {static_cast<ExitCode>(code),
            causeRank == 0 || code == static_cast<int>(ExitCode::kConfig)};
  }
  return {code == static_cast<int>(ExitCode::kConfig) ? ExitCode::kConfig : ExitCode::kWorkerFailed,
          false};
}

std::string workerFailureMessage(int rank, pid_t pid, int waitStatus, int stopped, int worldSize,
                                 const std::string& runDir) {
  std::string others;
  if (stopped == 0) {
    others = worldSize == 1 ? "" : "; no other rank was still running";
  } else if (stopped == worldSize - 1) {
    others = stopped == 1 ? "; stopped the other rank"
                          : fmt::format("; stopped the other {} ranks", stopped);
  } else {
    others =
        fmt::format("; stopped the {} {} still running", stopped, stopped == 1 ? "rank" : "ranks");
  }
  const std::string hint =
      rank == 0 ? "see its output above" : fmt::format("see {}", rankLogPath(runDir, rank));
  return fmt::format("rank {} (pid {}) {}{}; {}", rank, static_cast<long>(pid),
                     describeExit(waitStatus), others, hint);
}

}  // namespace caravan
