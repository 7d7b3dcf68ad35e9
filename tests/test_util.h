// Helpers shared by the tests: temporary directories, running the caravan binary, files.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "models/precision.h"

namespace caravan::test {

// CARAVAN_EMULATE_BF16=1 while alive, the previous value back after: bf16 blocks run on a CPU
// without bf16 instructions too, emulated (models/precision.h), in this process and in the
// caravan processes a test starts meanwhile.
class EmulateBf16 {
 public:
  EmulateBf16() {
    if (const char* v = std::getenv(kName)) previous_ = v;
    ::setenv(kName, "1", 1);
  }
  ~EmulateBf16() {
    if (previous_.empty()) {
      ::unsetenv(kName);
    } else {
      ::setenv(kName, previous_.c_str(), 1);
    }
  }
  EmulateBf16(const EmulateBf16&) = delete;
  EmulateBf16& operator=(const EmulateBf16&) = delete;

 private:
  static constexpr const char* kName = kEmulateBf16Env;
  std::string previous_;
};

// A fresh directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "caravan-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The last line of a program's output, without the newlines after it.
inline std::string lastLine(std::string text) {
  while (!text.empty() && text.back() == '\n') text.pop_back();
  const auto nl = text.rfind('\n');
  return nl == std::string::npos ? text : text.substr(nl + 1);
}

inline std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void writeFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

struct CommandResult {
  int exitCode = -1;
  std::string out;
  std::string err;
};

// Runs `caravan ARGS` (a shell-quoted string) with stdout/stderr captured, in `cwd`.
// `env`: "NAME=value ..." set for the command.
inline CommandResult runCaravan(const std::string& args, const std::string& cwd = ".",
                                const std::string& env = "") {
  TempDir io;
  std::string cmd = "cd '" + cwd + "' && " + env + " OMP_NUM_THREADS=1 " +
                    std::string(CARAVAN_BINARY) + " " + args + " >" + (io / "out") + " 2>" +
                    (io / "err") + " </dev/null";
  int status = std::system(cmd.c_str());
  CommandResult r;
  r.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = readFile(io / "out");
  r.err = readFile(io / "err");
  return r;
}

// Runs the shell command `command` (quoted as the shell reads it) in `cwd`, with stdout and
// stderr captured; the exit code is -1 if it did not exit.
inline CommandResult runShell(const std::string& command, const std::string& cwd = ".") {
  TempDir io;
  const std::string cmd = "cd '" + cwd + "' && { " + command + "; } >" + (io / "out") + " 2>" +
                          (io / "err") + " </dev/null";
  const int status = std::system(cmd.c_str());
  CommandResult r;
  r.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = readFile(io / "out");
  r.err = readFile(io / "err");
  return r;
}

// A TCP port on 127.0.0.1 for a test that starts ranks itself with MASTER_PORT, this test
// process's alone: drawn below the kernel's ephemeral range (which every bind to port 0, Gloo's
// listeners and outgoing connections draw from), claimed by a lock on
// /tmp/caravan-test-ports/PORT that the process holds until it exits, so tests run at the same
// time never share one (two did, with a port that was only free a moment ago, and both
// failed), and checked free by a bind. Throws when none of the range is free.
inline int reservePort() {
  int low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> low;
  const int first = 20000, last = std::max(first + 100, low) - 1;
  const std::string dir = "/tmp/caravan-test-ports";
  ::mkdir(dir.c_str(), 01777);
  const int span = last - first + 1;
  const int offset = static_cast<int>((::getpid() * 7919L + ::time(nullptr)) % span);
  for (int i = 0; i < span; ++i) {
    const int port = first + (offset + i) % span;
    const int lock =
        ::open((dir + "/" + std::to_string(port)).c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0666);
    if (lock < 0) continue;
    if (::flock(lock, LOCK_EX | LOCK_NB) != 0) {
      ::close(lock);
      continue;
    }
    const int probe = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(probe, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool free = ::bind(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(probe);
    if (free) return port;  // `lock` stays open: the claim lasts as long as this process
    ::close(lock);
  }
  throw std::runtime_error("no free TCP port in " + std::to_string(first) + ".." +
                           std::to_string(last) + " for a test's rendezvous");
}

inline int countLines(const std::string& text) {
  int n = 0;
  for (char c : text) n += c == '\n';
  return n;
}

// The project's Python (.venv, scripts/setup.sh): the torch whose LibTorch Caravan runs on,
// and NumPy. Oracles, fixtures and TorchScript files come from it.
inline constexpr const char* kPython = CARAVAN_PYTHON;

// 64-bit FNV-1a of `bytes`, continuing from `h`: the name of a cached directory (sharedDir).
inline uint64_t fnv1a(const std::string& bytes, uint64_t h = 14695981039346656037ull) {
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}

// A directory that `fill` wrote, made once for every test process of this build: CTest runs
// each test in a process of its own, and what Python writes (a TorchScript file, an export)
// takes seconds that each test that used it spent again. It is CARAVAN_TEST_CACHE/NAME-HASH,
// HASH of `key`, which holds every byte that decides what `fill` writes (scripts, the Python
// that runs them, the caravan binary): changed inputs name another directory, so nothing stale
// is read, and the one of the old key is removed. The first process that needs it holds a lock
// on NAME.lock while `fill` writes into a temporary directory, which is then renamed into place:
// a concurrent test waits for it instead of making its own, and none reads half of one. ""
// when `fill` returns false (nothing is kept; each test that needs it tries again and fails).
// Tests only read what is in it.
inline std::string sharedDir(const std::string& name, const std::string& key,
                             const std::function<bool(const std::string&)>& fill) {
  namespace fs = std::filesystem;
  const fs::path root = CARAVAN_TEST_CACHE;
  std::error_code ec;
  fs::create_directories(root, ec);
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(fnv1a(key)));
  const fs::path dir = root / (name + "-" + hash);
  const int lock = ::open((root / (name + ".lock")).c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0666);
  if (lock < 0) throw std::runtime_error("cannot open the lock of " + dir.string());
  while (::flock(lock, LOCK_EX) != 0 && errno == EINTR) {
  }
  std::string made = dir.string();
  if (!fs::is_directory(dir, ec)) {
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      const std::string old = entry.path().filename().string();
      if (old.rfind(name + "-", 0) == 0 && old.size() == name.size() + 17) {
        fs::remove_all(entry.path(), ec);  // NAME-HASH of another key: stale
      }
    }
    std::string tmpl = (root / (".tmp-" + name + "-XXXXXX")).string();
    const fs::path tmp = ::mkdtemp(tmpl.data()) != nullptr ? tmpl : "";
    if (!tmp.empty() && fill(tmp.string())) {
      fs::rename(tmp, dir, ec);
      if (ec) made = "";
    } else {
      made = "";
    }
    if (!tmp.empty()) fs::remove_all(tmp, ec);
  }
  ::close(lock);
  return made;
}

// The project's Python as a key for sharedDir: its path, the times its site-packages last
// changed (a package installed, upgraded or removed) and tests/python/*.py, the scripts and
// the modules they import.
inline std::string pythonKey() {
  namespace fs = std::filesystem;
  std::string key = kPython;
  std::error_code ec;
  const fs::path prefix = fs::path(kPython).parent_path().parent_path();
  for (const auto& lib : fs::directory_iterator(prefix / "lib", ec)) {
    const fs::path packages = lib.path() / "site-packages";
    const auto changed = fs::last_write_time(packages, ec);
    if (!ec) key += packages.string() + std::to_string(changed.time_since_epoch().count());
  }
  std::vector<fs::path> scripts;
  const fs::path dir = fs::path(CARAVAN_SOURCE_DIR) / "tests" / "python";
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".py") scripts.push_back(entry.path());
  }
  std::sort(scripts.begin(), scripts.end());
  for (const fs::path& script : scripts) key += script.string() + '\0' + readFile(script);
  return key;
}

// A directory that tests/python/SCRIPT (run with kPython) filled, made once for every test
// process (sharedDir); "" when the script failed (Python, torch or NumPy missing: the caller
// fails the test).
inline std::string pythonWrittenDir(const std::string& script) {
  return sharedDir(script, pythonKey(), [&](const std::string& dir) {
    const std::string command = std::string(kPython) + " " + std::string(CARAVAN_SOURCE_DIR) +
                                "/tests/python/" + script + " " + dir + " >/dev/null";
    return std::system(command.c_str()) == 0;
  });
}

// Whether the project's Python has Hugging Face's transformers (requirements.txt installs it;
// the tests of stock models skip, or drop those models, in one line without it). Asked once
// for every test process (sharedDir).
inline bool transformersInstalled() {
  const std::string dir = sharedDir("transformers", pythonKey(), [](const std::string& d) {
    const std::string import = std::string(kPython) + " -c 'import transformers' 2>/dev/null";
    writeFile(d + "/installed", std::system(import.c_str()) == 0 ? "1" : "0");
    return true;
  });
  return readFile(dir + "/installed") == "1";
}

// `caravan export tests/python/stock_models.py:FACTORY -o PATH`, made once for every test
// process (sharedDir, keyed by the Python, tools/caravan_export.py and the caravan binary, which
// prints the blocks it cuts): `run` is what the command printed and its exit code, `path` the
// file it wrote, "" when it failed.
struct StockExport {
  std::string path;
  CommandResult run;
};

inline StockExport exportStockModel(const std::string& factory) {
  const std::string key = pythonKey() +
                          readFile(std::string(CARAVAN_SOURCE_DIR) + "/tools/caravan_export.py") +
                          readFile(CARAVAN_BINARY);
  CommandResult failed;
  const std::string dir = sharedDir("export-" + factory, key, [&](const std::string& d) {
    failed = runCaravan("export " + std::string(CARAVAN_SOURCE_DIR) +
                        "/tests/python/stock_models.py:" + factory + " -o " + d + "/model.pt");
    writeFile(d + "/out", failed.out);
    writeFile(d + "/err", failed.err);
    return failed.exitCode == 0;
  });
  if (dir.empty()) return {"", failed};
  return {dir + "/model.pt", {0, readFile(dir + "/out"), readFile(dir + "/err")}};
}

// The stock models FACTORIES of tests/python/stock_models.py, exported (exportStockModel) in
// the order given: (factory, file) each. None without transformers, said in one line. Throws
// with what `caravan export` printed when one fails.
inline std::vector<std::pair<std::string, std::string>> exportStockModels(
    const std::vector<std::string>& factories) {
  std::vector<std::pair<std::string, std::string>> files;
  if (!transformersInstalled()) {
    std::printf("without the stock models: transformers is not in the project's Python\n");
    return files;
  }
  for (const std::string& factory : factories) {
    const StockExport exported = exportStockModel(factory);
    if (exported.path.empty()) {
      throw std::runtime_error("caravan export of " + factory + " failed: " + exported.run.err);
    }
    files.emplace_back(factory, exported.path);
  }
  return files;
}

// A file torch.save wrote (model.pt, the oracle's out.pt) as its dict of names to values.
inline c10::Dict<c10::IValue, c10::IValue> readDict(const std::string& path) {
  const std::string bytes = readFile(path);
  return torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end())).toGenericDict();
}

// The .npy fixtures NumPy itself wrote (tests/python/npy_fixtures.py says what each holds).
inline std::string npyFixturesDir() { return pythonWrittenDir("npy_fixtures.py"); }

// The scripted modules of tests/python/script_models.py.
inline std::string scriptedModelsDir() { return pythonWrittenDir("script_models.py"); }

}  // namespace caravan::test
