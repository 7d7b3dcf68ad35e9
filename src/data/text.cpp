// What a data file holds (see text.h).
#include "data/text.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/files.h"
#include "core/scope_guard.h"
#include "data/sources.h"

namespace caravan {
namespace fs = std::filesystem;
namespace {

constexpr size_t kMaxTextFile = size_t{4} << 30;  // bytes of one text file read at once

// One line about a token file read with ids of `dtype`.
std::string inspectTokens(const std::string& path, const std::string& dtype,
                          const std::string& how) {
  const int width = dtype == "uint32" ? 4 : dtype == "uint8" ? 1 : 2;
  std::string why;
  const int fd = openRegularFile(path, &why);
  if (fd < 0) throw DataError(fmt::format("{} {}", path, why));
  const auto closeFd = onScopeExit([fd] { ::close(fd); });
  struct stat st {};
  ::fstat(fd, &st);
  const auto bytes = static_cast<int64_t>(st.st_size);
  if (bytes % width != 0) {
    throw DataError(
        fmt::format("{}: {} bytes, not a whole number of {} ids ({}): not a {} token "
                    "file",
                    path, bytes, dtype, how, dtype));
  }
  uint32_t lo = std::numeric_limits<uint32_t>::max(), hi = 0;
  std::vector<unsigned char> piece(size_t{1} << 20);
  for (int64_t at = 0; at < bytes;) {
    const auto want = static_cast<size_t>(std::min<int64_t>(piece.size(), bytes - at));
    if (!preadFully(fd, piece.data(), want, at)) throw DataError("cannot read " + path);
    for (size_t k = 0; k < want; k += width) {
      uint32_t v = 0;
      std::memcpy(&v, piece.data() + k, width);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    at += static_cast<int64_t>(want);
  }
  if (bytes == 0) return fmt::format("{}: token file ({} ids, {}), empty", path, dtype, how);
  return fmt::format("{}: token file, {} ids ({}), {} tokens, ids {}..{} (data.vocab_size >= {})",
                     path, dtype, how, bytes / width, lo, hi, static_cast<int64_t>(hi) + 1);
}

std::string inspectNpy(const std::string& path) {
  const NpyHeader h = readNpyHeader(path);
  std::string range;
  if (h.dtype != "float32" && !h.shape.empty() && h.payloadBytes() > 0) {
    const auto [lo, hi] = npyIntegerRange(path);
    range = fmt::format(", values {}..{}", lo, hi);
  }
  std::vector<int64_t> row(h.shape.begin() + (h.shape.empty() ? 0 : 1), h.shape.end());
  return fmt::format("{}: .npy array, {}, shape [{}]: {} examples of [{}]{}", path, h.dtype,
                     fmt::join(h.shape, ", "), h.shape.empty() ? 0 : h.shape[0],
                     fmt::join(row, ", "), range);
}

std::string inspectIdx(const std::string& path) {
  const IdxArray a = readIdx(path);
  std::string range;
  if (a.data.numel() > 0) {
    range =
        fmt::format(", values {}..{}", a.data.min().item<int64_t>(), a.data.max().item<int64_t>());
  }
  return fmt::format("{}: IDX array, uint8, shape [{}]{}", path, fmt::join(a.dims, ", "), range);
}

std::string inspectText(const std::string& path) {
  std::string why;
  const auto text = readRegularFile(path, &why, false, kMaxTextFile);
  if (!text) throw DataError(fmt::format("{} {}", path, why));
  const auto lines = std::count(text->begin(), text->end(), '\n');
  return fmt::format(
      "{}: text, {} bytes, {} lines (data.dataset = \"text\" reads it as bytes, "
      "vocabulary 256)",
      path, text->size(), lines);
}

bool endsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The token dtype a directory's tokens.json names, or "".
std::string dtypeFromSummary(const fs::path& dir) {
  std::string why;
  const auto text = readRegularFile((dir / "tokens.json").string(), &why, false, 1 << 20);
  if (!text) return "";
  const auto j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.contains("token_dtype") || !j["token_dtype"].is_string()) return "";
  return j["token_dtype"].get<std::string>();
}

std::string inspectFile(const fs::path& p, const std::string& tokenDtype) {
  const std::string path = p.string();
  if (endsWith(path, ".npy")) return inspectNpy(path);
  if (endsWith(path, "-ubyte") || endsWith(path, "-ubyte.gz")) return inspectIdx(path);
  if (endsWith(path, ".bin")) {
    if (!tokenDtype.empty()) return inspectTokens(path, tokenDtype, "as --token-dtype says");
    const std::string named = dtypeFromSummary(p.parent_path());
    if (!named.empty()) return inspectTokens(path, named, "as tokens.json says");
    return inspectTokens(path, "uint16", "assumed; --token-dtype uint32 for others");
  }
  if (endsWith(path, ".txt")) return inspectText(path);
  return "";
}

}  // namespace

InspectResult inspectData(const std::string& path, const std::string& tokenDtype) {
  if (!tokenDtype.empty() && tokenDtype != "uint16" && tokenDtype != "uint32") {
    throw ConfigError(fmt::format("--token-dtype {}: use uint16 or uint32", tokenDtype));
  }
  std::error_code ec;
  const fs::path p(path);
  if (!fs::exists(p, ec)) throw DataError(fmt::format("{} does not exist", path));
  InspectResult out;
  if (!fs::is_directory(p, ec)) {
    std::string line = inspectFile(p, tokenDtype);
    if (line.empty()) {
      throw DataError(fmt::format(
          "{}: not a data file Caravan reads (.npy, .bin token ids, IDX *-ubyte[.gz], .txt)",
          path));
    }
    out.lines.push_back(line);
    return out;
  }
  std::vector<fs::directory_entry> entries;
  for (const auto& entry : fs::directory_iterator(p, ec)) entries.push_back(entry);
  if (ec) throw DataError(fmt::format("cannot list {}: {}", path, ec.message()));
  std::sort(entries.begin(), entries.end());
  bool anyData = false;
  for (const auto& entry : entries) {
    const std::string name = entry.path().string();
    std::error_code statError;
    if (entry.is_directory(statError)) {
      out.lines.push_back(
          fmt::format("{}: a directory (not looked into; inspect it by itself)", name));
      continue;
    }
    try {
      // A FIFO, socket or device is refused by the readers (core/files.h) with a DataError.
      std::string line = inspectFile(entry.path(), tokenDtype);
      if (!line.empty()) {
        out.lines.push_back(line);
        anyData = true;
      } else if (!entry.is_regular_file(statError)) {
        out.lines.push_back(
            fmt::format("{}: not a regular file (a FIFO, socket, device or "
                        "broken link), skipped",
                        name));
        ++out.unreadable;
      }
    } catch (const DataError& e) {
      out.lines.push_back(e.what());  // names the file; the others are still worth seeing
      ++out.unreadable;
    }
  }
  if (!anyData && out.unreadable == 0) {
    throw DataError(fmt::format(
        "{} holds no data file Caravan reads (.npy, .bin token ids, IDX *-ubyte[.gz], .txt)",
        path));
  }
  return out;
}

}  // namespace caravan
