// The one guard every command's output goes through before anything is computed or written
// (caravan report -o / --png, simulate -o, calibrate -o, data tokenize --out): what a command
// writes never replaces what it must not.
//
// Refused, each with one line in the same words whichever command asks (ConfigError, exit 2):
// - what is not a regular file where a file is written: a device (as root, /dev/null became a
//   regular file), a FIFO, a socket, a symbolic link (the file renamed over it would replace the
//   link, not what it points to), a directory; where files are written into a directory, what
//   is not one (a link to a directory is that directory: files go inside it);
// - a run directory or anything in one (a directory with metrics.jsonl, or config.toml and
//   checkpoints/), but for report pages (.html files): a run's files (config.toml,
//   checkpoints, model.pt, ...) are the run's alone;
// - an input of the command (the same file, through any path or link), or a file in a
//   directory the command reads (a bench's results), again but for .html pages.
//
// Threading: free functions; any thread. They only look at the file system.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace caravan {

struct OutputPath {
  OutputPath(std::string option, std::string path, bool directory = false,
             std::vector<std::string> files = {})
      : option(std::move(option)),
        path(std::move(path)),
        directory(directory),
        files(std::move(files)) {}

  std::string option;  // how the command names it in messages: "-o", "--png", "--out"
  std::string path;
  // A directory the command writes `files` into (they are checked as files too), rather than
  // one file.
  bool directory;
  std::vector<std::string> files;
};

// ConfigError when the command may not write `out` (see above); `inputs` are the files and
// directories it reads.
void checkOutputPath(const OutputPath& out, const std::vector<std::string>& inputs);

// The directory that holds a run (its metrics.jsonl, or its config.toml and checkpoints/).
bool isRunDirectory(const std::string& dir);

}  // namespace caravan
