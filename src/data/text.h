// A look at what a data file holds before a long run (`caravan data inspect`). Tokenizing text
// is data/tokenize.h.
//
// Errors: DataError (what cannot be read), ConfigError (options); each one line. Threading:
// free functions, any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace caravan {

// What the data file or directory at `path` holds, one line per file: format, dtype, shape or
// count, and the range of ids or labels (.npy, token .bin with `tokenDtype` or the dtype its
// directory's tokens.json names, IDX, text). In a directory, a file it cannot read (corrupt, or
// a FIFO, socket or device) gets a line saying why and counts in `unreadable`; a subdirectory
// gets a line too (not looked into). Throws DataError when `path` is a file it cannot read or a
// directory with no data file.
struct InspectResult {
  std::vector<std::string> lines;
  int unreadable = 0;
};
InspectResult inspectData(const std::string& path, const std::string& tokenDtype);

}  // namespace caravan
