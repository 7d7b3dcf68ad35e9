// Helpers shared by the libFuzzer targets (fuzz/*.cpp; built by fuzz/CMakeLists.txt, run by
// scripts/fuzz.sh).
//
// Policy of every target: a documented user error (a caravan::Error subclass other than
// InternalError) is the parser doing its job and is swallowed; anything else that escapes (an
// InternalError from CARAVAN_CHECK, a c10::Error, std::bad_alloc, ...) is a finding and aborts,
// as do the sanitizers' reports.
//
// Seeds: run a target with CARAVAN_FUZZ_SEEDS=<dir> in the environment and its
// LLVMFuzzerInitialize writes a small valid seed corpus into <dir> and exits.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <typeinfo>

#include "core/errors.h"

namespace caravan::fuzz {

// A file the target rewrites on every input, one per process and name, removed at exit (a
// crash leaves it): in $CARAVAN_FUZZ_SCRATCH (scripts/fuzz.sh sets it), else /dev/shm, else the
// temp dir.
inline std::string scratchPath(const std::string& name) {
  namespace fs = std::filesystem;
  static const fs::path dir = [] {
    std::error_code ec;
    fs::path d = fs::temp_directory_path();
    if (const char* env = std::getenv("CARAVAN_FUZZ_SCRATCH"); env != nullptr && *env != '\0') {
      d = env;
      fs::create_directories(d, ec);
    } else if (fs::is_directory("/dev/shm", ec)) {
      d = "/dev/shm";
    }
    return d;
  }();
  static std::set<std::string> paths;
  const std::string path =
      (dir / ("caravan-fuzz-" + name + "-" + std::to_string(::getpid()))).string();
  if (paths.insert(path).second && paths.size() == 1) {
    std::atexit([] {
      for (const auto& p : paths) std::remove(p.c_str());
    });
  }
  return path;
}

inline void writeFile(const std::string& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  out.close();
  if (!out) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
}

// The seed directory when CARAVAN_FUZZ_SEEDS is set, else "".
inline std::string seedDir() {
  const char* dir = std::getenv("CARAVAN_FUZZ_SEEDS");
  if (dir == nullptr || *dir == '\0') return "";
  std::filesystem::create_directories(dir);
  return dir;
}

inline void writeSeed(const std::string& dir, const std::string& name, const std::string& bytes) {
  writeFile((std::filesystem::path(dir) / name).string(), bytes.data(), bytes.size());
}

// Runs `body`; swallows expected user errors, aborts (a finding) on anything else.
template <typename Body>
void runGuarded(const char* target, Body&& body) {
  try {
    body();
  } catch (const InternalError& e) {
    std::fprintf(stderr, "\nfuzz %s: InternalError (a CARAVAN_CHECK tripped on input): %s\n",
                 target, e.what());
    std::abort();
  } catch (const Error&) {
    // Documented, one-line user error: handled.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nfuzz %s: unexpected %s: %s\n", target, typeid(e).name(), e.what());
    std::abort();
  }
}

// LLVMFuzzerInitialize's body: with CARAVAN_FUZZ_SEEDS set, writes the target's seeds there
// and exits; otherwise fuzzing starts.
template <typename WriteSeeds>
int initialize(WriteSeeds writeSeeds) {
  const std::string dir = seedDir();
  if (!dir.empty()) {
    writeSeeds(dir);
    std::exit(0);
  }
  return 0;
}

}  // namespace caravan::fuzz
