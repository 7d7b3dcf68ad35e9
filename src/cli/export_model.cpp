// caravan export (see export_model.h).
#include "cli/export_model.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <vector>

#include <fmt/format.h>

#include "core/errors.h"
#include "core/output_path.h"
#include "core/subprocess.h"
#include "models/script_model.h"

namespace caravan {

namespace fs = std::filesystem;

int runExport(const ExportArgs& args) {
  const std::string file = args.factory.substr(0, args.factory.rfind(':'));
  checkOutputPath({"-o", args.output}, {file});
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw IoError(fmt::format("cannot read /proc/self/exe: {}", ec.message()));
  const fs::path tree = exe.parent_path().parent_path();
  const fs::path tool = tree / "tools" / "caravan_export.py";
  const char* given = std::getenv("CARAVAN_PYTHON");
  const std::string python =
      given != nullptr && *given != '\0' ? given : (tree / ".venv" / "bin" / "python").string();
  if (!fs::is_regular_file(tool, ec)) {
    throw ConfigError(
        fmt::format("caravan export runs {}, which is not there: run caravan from "
                    "its source tree's build directory",
                    tool.string()));
  }
  // A name without a slash is looked up in PATH (execvp); a path must be executable.
  if (python.find('/') != std::string::npos && ::access(python.c_str(), X_OK) != 0) {
    throw ConfigError(
        fmt::format("caravan export needs the project's Python with torch, {}: "
                    "run scripts/setup.sh, or set CARAVAN_PYTHON",
                    python));
  }
  std::vector<std::string> argv = {python,      tool.string(), args.factory, "-o",
                                   args.output, "--blocks",    args.blocks};
  std::vector<char*> pointers = execArgv(argv);
  const std::string failed = "caravan: error: cannot run " + python + "\n";  // before fork
  std::cout.flush();
  const pid_t pid = ::fork();
  if (pid < 0) throw IoError(fmt::format("cannot start {}: {}", python, std::strerror(errno)));
  if (pid == 0) {
    ::execvp(python.c_str(), pointers.data());
    [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, failed.data(), failed.size());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status)) return static_cast<int>(ExitCode::kInternal);
  if (WEXITSTATUS(status) != 0) return WEXITSTATUS(status);
  std::string blocks;
  try {
    blocks = describeScriptBlocks(args.output);
  } catch (const ConfigError& e) {
    // Written by this command a moment ago and not trainable: not left behind.
    std::filesystem::remove(args.output, ec);
    throw ConfigError(fmt::format("{}: {} (the file it wrote is removed)", args.factory, e.what()));
  }
  std::cout << blocks << "\n";
  return 0;
}

}  // namespace caravan
