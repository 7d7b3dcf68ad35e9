// checkOutputPath (see output_path.h).
#include "core/output_path.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/errors.h"

namespace caravan {
namespace {

namespace fs = std::filesystem;

std::string kindOf(const fs::file_status& s) {
  if (fs::is_symlink(s)) return "symbolic link";
  if (fs::is_directory(s)) return "directory";
  if (fs::is_fifo(s)) return "FIFO";
  if (fs::is_socket(s)) return "socket";
  if (fs::is_character_file(s) || fs::is_block_file(s)) return "device";
  if (fs::is_regular_file(s)) return "regular file";
  return "file of another kind";
}

// The run directory that `p` (canonical) is or lies in, or "".
std::string enclosingRun(const fs::path& p) {
  for (fs::path d = p; !d.empty(); d = d.parent_path()) {
    if (isRunDirectory(d.string())) return d.string();
    if (d == d.root_path()) break;
  }
  return "";
}

// `p` (canonical) lies in the directory `dir`.
bool isInside(const fs::path& p, const std::string& dir) {
  std::error_code ec;
  const fs::path d = fs::weakly_canonical(dir, ec);
  if (ec) return false;
  const fs::path rel = p.lexically_relative(d);
  return !rel.empty() && *rel.begin() != ".." && rel != ".";
}

void checkFile(const std::string& option, const fs::path& path,
               const std::vector<std::string>& inputs) {
  std::error_code ec;
  const fs::file_status s = fs::symlink_status(path, ec);
  if (fs::exists(s) && !fs::is_regular_file(s)) {
    throw ConfigError(
        fmt::format("{} {} is not a regular file (a {}); write to a new or regular "
                    "file",
                    option, path.string(), kindOf(s)));
  }
  const fs::path canonical = fs::weakly_canonical(path, ec);
  const bool page = path.extension() == ".html";
  const std::string run = enclosingRun(canonical.parent_path());
  if (!run.empty() && !page) {
    throw ConfigError(
        fmt::format("{} {} is a file of the run {}: a run directory holds its run's "
                    "files and report pages (.html) only; write it elsewhere",
                    option, path.string(), run));
  }
  for (const std::string& input : inputs) {
    if (input.empty()) continue;
    if (fs::exists(s) && fs::exists(input, ec) && fs::equivalent(path, input, ec)) {
      throw ConfigError(fmt::format("{} {} is {}, an input of this command; write to another file",
                                    option, path.string(), input));
    }
    // What a directory the command reads holds is its input too (a bench's results.json).
    if (!page && fs::is_directory(input, ec) && isInside(canonical, input)) {
      throw ConfigError(
          fmt::format("{} {} is in {}, which this command reads: write it elsewhere "
                      "(or as an .html page)",
                      option, path.string(), input));
    }
  }
  // Where it goes must exist and take files: said now, not after the command's work.
  const fs::path parent = path.has_parent_path() ? path.parent_path() : fs::path(".");
  if (!fs::is_directory(parent, ec)) {
    throw IoError(
        fmt::format("{} {}: the directory {} does not exist; create it or write "
                    "elsewhere",
                    option, path.string(), parent.string()));
  }
  if (::access(parent.c_str(), W_OK | X_OK) != 0) {
    throw IoError(fmt::format("{} {}: cannot write in {} ({}); write elsewhere", option,
                              path.string(), parent.string(), std::strerror(errno)));
  }
}

}  // namespace

bool isRunDirectory(const std::string& dir) {
  std::error_code ec;
  const fs::path d(dir);
  return fs::is_regular_file(d / "metrics.jsonl", ec) ||
         (fs::is_regular_file(d / "config.toml", ec) && fs::is_directory(d / "checkpoints", ec));
}

void checkOutputPath(const OutputPath& out, const std::vector<std::string>& inputs) {
  if (!out.directory) {
    checkFile(out.option, out.path, inputs);
    return;
  }
  // Files are written inside it, never over it: a link to a directory is that directory.
  std::error_code ec;
  const fs::file_status s = fs::status(out.path, ec);
  if (fs::exists(s) && !fs::is_directory(s)) {
    throw ConfigError(
        fmt::format("{} {} is not a directory (a {}); name a new or existing "
                    "directory",
                    out.option, out.path, kindOf(s)));
  }
  const std::string run = enclosingRun(fs::weakly_canonical(out.path, ec));
  if (!run.empty()) {
    throw ConfigError(fmt::format(
        "{} {} is {} the run {}: a run directory holds its run's files "
        "and report pages (.html) only; name a directory outside it",
        out.option, out.path, fs::equivalent(out.path, run, ec) ? "the directory of" : "in", run));
  }
  if (!fs::is_directory(s)) return;  // made new: nothing in it yet
  for (const std::string& name : out.files) {
    checkFile(out.option, fs::path(out.path) / name, inputs);
  }
}

}  // namespace caravan
