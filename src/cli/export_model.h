// caravan export FILE.py:FACTORY -o OUT.pt [--blocks ...]: a model as the user wrote it, traced
// by the project's Python (tools/caravan_export.py says how) into a TorchScript file, and then
// the blocks Caravan's loader finds in it (models/graph_cut.h), printed with why it stopped
// where it did.
//
// The tool is found beside the binary's source tree (build/caravan -> tools/caravan_export.py)
// and run with CARAVAN_PYTHON, else the tree's .venv/bin/python (scripts/setup.sh makes it):
// Python is needed to export, never to train. Errors: an output the guard refuses
// (core/output_path.h), or no tool or Python -> ConfigError; the tool's own refusals keep its
// exit code and its one line.
#pragma once

#include <string>

namespace caravan {

struct ExportArgs {
  std::string factory;  // FILE.py:FACTORY
  std::string output;
  std::string blocks = "auto";
};

// Returns the exit code.
int runExport(const ExportArgs& args);

}  // namespace caravan
