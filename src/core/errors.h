// User-facing errors with distinct exit codes, and CARAVAN_CHECK for broken invariants.
//
// A user-facing error (bad config, missing data, unreadable checkpoint) is a typed exception
// whose message is one line that says what went wrong and what to do. The CLI catches
// `Error`, prints "caravan: error: <message>" and exits with `exitCode()`.
// A broken invariant is a bug: CARAVAN_CHECK throws `InternalError` with file:line;
// CARAVAN_CHECK_EQ/LE/LT(a, b, msg...) also print both values (each evaluated once).
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace caravan {

// Process exit codes. 0 success, 1 internal error, 2 usage/config, 3.. by domain.
enum class ExitCode : int {
  kOk = 0,
  kInternal = 1,
  kConfig = 2,
  kData = 3,
  kCheckpoint = 4,
  kIo = 5,
  kNonFinite = 6,
  kPeer = 7,
  kWorkerFailed = 8,  // a local worker process (caravan train --workers N) failed
  kOutOfMemory = 9,   // the process could not get memory (the machine's, or a limit on it)
  kInterrupted = 130,
};

class Error : public std::runtime_error {
 public:
  Error(ExitCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ExitCode code() const { return code_; }
  int exitCode() const { return static_cast<int>(code_); }

 private:
  ExitCode code_;
};

// Invalid command line or config (unknown key, wrong type, out of range).
class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& m) : Error(ExitCode::kConfig, m) {}
};

// Missing, truncated or corrupt dataset.
class DataError : public Error {
 public:
  explicit DataError(const std::string& m) : Error(ExitCode::kData, m) {}
};

// Missing, truncated, corrupt or incompatible checkpoint.
class CheckpointError : public Error {
 public:
  explicit CheckpointError(const std::string& m) : Error(ExitCode::kCheckpoint, m) {}
};

// File-system failure (cannot create run directory, disk full, ...).
class IoError : public Error {
 public:
  explicit IoError(const std::string& m) : Error(ExitCode::kIo, m) {}
};

// The loss became NaN or infinite.
class NonFiniteError : public Error {
 public:
  explicit NonFiniteError(const std::string& m) : Error(ExitCode::kNonFinite, m) {}
};

// A bug in Caravan: an invariant did not hold.
class InternalError : public Error {
 public:
  explicit InternalError(const std::string& m) : Error(ExitCode::kInternal, m) {}
};

}  // namespace caravan

#define CARAVAN_CHECK(cond, ...)                                                          \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      throw ::caravan::InternalError(fmt::format("internal check failed at {}:{}: {} ({})", \
                                                 __FILE__, __LINE__, #cond,                \
                                                 fmt::format(__VA_ARGS__)));               \
    }                                                                                     \
  } while (0)

namespace caravan::detail {
template <typename A, typename B>
[[noreturn]] void throwCheckFailed(const char* file, int line, const char* expr, const A& a,
                                   const B& b, const std::string& message) {
  throw InternalError(fmt::format("internal check failed at {}:{}: {} ({} vs {}) ({})", file, line,
                                  expr, a, b, message));
}
}  // namespace caravan::detail

#define CARAVAN_CHECK_OP_(op, a, b, ...)                                                         \
  do {                                                                                           \
    const auto& caravanCheckA_ = (a);                                                            \
    const auto& caravanCheckB_ = (b);                                                            \
    if (!(caravanCheckA_ op caravanCheckB_)) {                                                   \
      ::caravan::detail::throwCheckFailed(__FILE__, __LINE__, #a " " #op " " #b, caravanCheckA_, \
                                          caravanCheckB_, fmt::format(__VA_ARGS__));             \
    }                                                                                            \
  } while (0)
#define CARAVAN_CHECK_EQ(a, b, ...) CARAVAN_CHECK_OP_(==, a, b, __VA_ARGS__)
#define CARAVAN_CHECK_LE(a, b, ...) CARAVAN_CHECK_OP_(<=, a, b, __VA_ARGS__)
#define CARAVAN_CHECK_LT(a, b, ...) CARAVAN_CHECK_OP_(<, a, b, __VA_ARGS__)
