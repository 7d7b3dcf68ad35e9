// Reader for IDX files (the MNIST container format), gzipped or plain, with strict validation.
//
// Layout (all integers big-endian): two zero bytes, a type code (0x08 = unsigned byte, the
// only one supported), the number of dimensions, one uint32 per dimension, then exactly
// product(dims) bytes of data.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>

#include <unistd.h>
#include <zlib.h>

#include "core/errors.h"
#include "core/files.h"
#include "data/sources.h"

namespace caravan {
namespace {

constexpr int kIdxTypeUnsignedByte = 0x08;
constexpr int kMaxDims = 8;
constexpr int64_t kMaxElements = int64_t{1} << 31;  // exclusive
constexpr int64_t kMaxGzipRatio = 1032;               // deflate expands a byte at most 1032x
constexpr unsigned kReadChunk = 1u << 24;             // bytes per gzread call
constexpr unsigned kGzBufferSize = 1u << 17;

// Owns a gzFile; closing reports whether the stream ended cleanly.
class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path) {
    std::string why;
    const int fd = openRegularFile(path, &why);
    if (fd < 0 && why == "does not exist") {
      throw DataError(
          fmt::format("dataset file not found: {} (install the dataset: run "
                      "scripts/setup.sh, or set data.path)",
                      path));
    }
    if (fd < 0) throw DataError(fmt::format("cannot open dataset file {}: it {}", path, why));
    file_ = gzdopen(fd, "rb");  // owns fd from here
    if (file_ == nullptr) {
      ::close(fd);
      throw DataError(fmt::format("cannot open dataset file {} (out of memory)", path));
    }
    gzbuffer(file_, kGzBufferSize);
  }
  ~GzReader() {
    if (file_ != nullptr) gzclose(file_);
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to `n` bytes; returns how many were read. A damaged gzip stream throws.
  int64_t read(void* out, int64_t n) {
    auto* dst = static_cast<unsigned char*>(out);
    int64_t total = 0;
    while (total < n) {
      const unsigned want = static_cast<unsigned>(std::min<int64_t>(n - total, kReadChunk));
      const int got = gzread(file_, dst + total, want);
      if (got < 0) throwStreamError();
      total += got;
      if (static_cast<unsigned>(got) < want) break;
    }
    // A short read is either end of file or a damaged stream; tell them apart.
    checkStream();
    return total;
  }

  // Closes the file; a gzip stream cut off in the middle is reported here by zlib.
  void close() {
    gzFile f = file_;
    file_ = nullptr;
    const int rc = gzclose(f);
    if (rc == Z_BUF_ERROR) {
      throw DataError(fmt::format(
          "corrupt dataset file {}: the gzip stream is truncated (re-download or reinstall the "
          "dataset)",
          path_));
    }
    if (rc != Z_OK) {
      throw DataError(fmt::format("cannot read dataset file {} (zlib error {})", path_, rc));
    }
  }

 private:
  void checkStream() {
    int errnum = Z_OK;
    gzerror(file_, &errnum);
    if (errnum != Z_OK && errnum != Z_STREAM_END) throwStreamError();
  }

  [[noreturn]] void throwStreamError() {
    int errnum = Z_OK;
    std::string message = gzerror(file_, &errnum);  // "<path>: <what>"
    const std::string prefix = path_ + ": ";
    if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
    throw DataError(fmt::format(
        "corrupt dataset file {}: gzip error: {} (re-download or reinstall the dataset)", path_,
        message));
  }

  std::string path_;
  gzFile file_;
};

uint32_t readBigEndian32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace

IdxArray readIdx(const std::string& path) {
  GzReader reader(path);

  unsigned char header[4];
  const int64_t headerRead = reader.read(header, 4);
  if (headerRead < 4) {
    throw DataError(fmt::format(
        "not an IDX file: {} is only {} bytes long (re-download or reinstall the dataset)", path,
        headerRead));
  }
  if (header[0] != 0 || header[1] != 0) {
    throw DataError(fmt::format(
        "not an IDX file: {} has bad magic number {:02x} {:02x} {:02x} {:02x} (expected 00 00 08 "
        "<ndims>; re-download or reinstall the dataset)",
        path, header[0], header[1], header[2], header[3]));
  }
  if (header[2] != kIdxTypeUnsignedByte) {
    throw DataError(fmt::format(
        "unsupported IDX type code 0x{:02x} in {} (only unsigned bytes, 0x08, are supported)",
        header[2], path));
  }
  const int ndims = header[3];
  if (ndims < 1 || ndims > kMaxDims) {
    throw DataError(fmt::format("corrupt IDX file {}: {} dimensions (expected 1 to {})", path,
                                ndims, kMaxDims));
  }

  unsigned char dimBytes[4 * kMaxDims];
  const int64_t dimRead = reader.read(dimBytes, 4 * ndims);
  if (dimRead < 4 * ndims) {
    throw DataError(fmt::format(
        "truncated IDX file {}: header ends inside the dimension sizes (re-download or reinstall "
        "the dataset)",
        path));
  }
  IdxArray result;
  int64_t elements = 1;
  for (int d = 0; d < ndims; ++d) {
    const int64_t size = readBigEndian32(dimBytes + 4 * d);
    if (size <= 0) {
      throw DataError(fmt::format("corrupt IDX file {}: dimension {} has size 0", path, d));
    }
    elements *= size;  // < 2^31 * 2^32: no overflow before the check
    if (elements >= kMaxElements) {
      throw DataError(fmt::format(
          "corrupt IDX file {}: dimensions describe 2^31 or more elements", path));
    }
    result.dims.push_back(size);
  }

  // Before allocating: a few bytes must not claim gigabytes (a plain file holds its data as is).
  std::error_code ec;
  const auto fileBytes = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  if (!ec && elements > kMaxGzipRatio * fileBytes) {
    throw DataError(fmt::format(
        "truncated IDX file {}: its header describes {} bytes of data, more than a {}-byte file "
        "can hold (re-download or reinstall the dataset)",
        path, elements, fileBytes));
  }
  result.data = at::empty(result.dims, at::TensorOptions().dtype(at::kByte));
  const int64_t found = reader.read(result.data.data_ptr<uint8_t>(), elements);
  if (found < elements) {
    reader.close();  // a cut-off gzip stream is the more precise diagnosis
    throw DataError(fmt::format(
        "truncated IDX file {}: expected {} bytes of data, found {} (re-download or reinstall "
        "the dataset)",
        path, elements, found));
  }
  unsigned char extra[1];
  if (reader.read(extra, 1) != 0) {
    throw DataError(fmt::format(
        "corrupt IDX file {}: extra data after the {} bytes its header describes (re-download "
        "or reinstall the dataset)",
        path, elements));
  }
  reader.close();
  return result;
}

}  // namespace caravan
