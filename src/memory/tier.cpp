// Offload tiers and Offload (see tier.h).
#include "memory/tier.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include "core/align.h"
#include "core/errors.h"
#include "memory/host_allocator.h"
#include "memory/tracker.h"

namespace caravan {

namespace {

constexpr int64_t kDirectAlign = 4096;     // direct I/O alignment of offsets, sizes, buffers
constexpr int64_t kBounceBytes = 8 << 20;  // staging buffer for writes from unaligned memory

void* alignedAlloc(int64_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kDirectAlign,
                     static_cast<size_t>(std::max<int64_t>(bytes, kDirectAlign))) != 0) {
    throw std::bad_alloc();
  }
  return p;
}

void alignedFree(void* p) { std::free(p); }

}  // namespace

// ---- Tier ---------------------------------------------------------------------------------

Tier::Tier() {
  writer_.thread = std::thread([this] { run(writer_); });
  reader_.thread = std::thread([this] { run(reader_); });
}

Tier::~Tier() { stopThreads(); }

void Tier::stopThreads() {
  for (Queue* q : {&writer_, &reader_}) {
    {
      std::lock_guard<std::mutex> lock(q->mutex);
      q->stop = true;
    }
    q->cv.notify_all();
    if (q->thread.joinable()) q->thread.join();
  }
}

void Tier::run(Queue& q) {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(q.mutex);
      q.cv.wait(lock, [&] { return q.stop || !q.jobs.empty(); });
      if (q.jobs.empty()) return;  // stop, drained
      job = std::move(q.jobs.front());
      q.jobs.pop_front();
    }
    try {
      job();  // jobs record their own I/O errors; this is the last line of defence
    } catch (const std::exception& e) {
      fail(std::string("memory tier: ") + e.what());
    } catch (...) {
      fail("memory tier: unknown error in an I/O job");
    }
  }
}

void Tier::submit(Queue& q, std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(q.mutex);
    if (!q.stop) {
      q.jobs.push_back(std::move(job));
      q.cv.notify_one();
      return;
    }
  }
  job();  // no thread will run it any more
}

void Tier::submitWrite(std::function<void()> job) { submit(writer_, std::move(job)); }

void Tier::submitRead(std::function<void()> job) { submit(reader_, std::move(job)); }

namespace {

// Queues a marker with `submit` and waits for it: FIFO, one thread per queue.
template <typename Submit>
void waitForQueue(Submit submit) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  submit([&] {
    std::lock_guard<std::mutex> lock(m);
    done = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(m);
  cv.wait(lock, [&] { return done; });
}

}  // namespace

void Tier::drainWrites() {
  waitForQueue([this](std::function<void()> job) { submitWrite(std::move(job)); });
}

void Tier::drain() {
  drainWrites();  // writes may be followed by reads of what they wrote
  waitForQueue([this](std::function<void()> job) { submitRead(std::move(job)); });
}

void Tier::check() const {
  std::lock_guard<std::mutex> lock(errorMutex_);
  if (!error_.empty()) throw IoError(error_);
}

bool Tier::failed() const {
  std::lock_guard<std::mutex> lock(errorMutex_);
  return !error_.empty();
}

void Tier::fail(const std::string& message) {
  std::lock_guard<std::mutex> lock(errorMutex_);
  if (error_.empty()) error_ = message;
}

at::DataPtr Tier::allocateHost(int64_t bytes) {
  void* p = alignedAlloc(bytes);
  return at::DataPtr(p, p, &alignedFree, at::Device(at::kCPU));
}

TierBandwidth Tier::measure(int64_t bytes, TierDtype dtype) {
  using Clock = std::chrono::steady_clock;
  const int64_t blob = std::min<int64_t>(bytes, 4 << 20) / 4 * 4;
  const int64_t count = std::max<int64_t>(1, bytes / std::max<int64_t>(blob, 1));
  // Random bytes (no layer can compress or deduplicate them) from a private generator: the
  // default one drives dropout and is part of a run's exact state. As bf16: random floats.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(/*seed_in=*/20201109);
  at::Tensor data = dtype == TierDtype::kBf16
                        ? at::randn({blob / 4}, gen, at::TensorOptions().dtype(at::kFloat))
                        : at::randint(0, 255, {blob}, gen, at::TensorOptions().dtype(at::kByte));
  std::vector<std::shared_ptr<Offload>> offloads;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < count; ++i) {
    offloads.push_back(Offload::start(*this, data.storage(), nullptr, dtype));
  }
  drainWrites();
  const auto t1 = Clock::now();
  check();
  for (auto& o : offloads) o->prefetch();
  for (auto& o : offloads) o->get();
  const auto t2 = Clock::now();
  const double total = static_cast<double>(offloads.front()->storedBytes() * count);
  TierBandwidth bw;
  bw.writeBytesPerSecond = total / std::chrono::duration<double>(t1 - t0).count();
  bw.readBytesPerSecond = total / std::chrono::duration<double>(t2 - t1).count();
  return bw;
}

// ---- FileTier -----------------------------------------------------------------------------

FileTier::FileTier(const std::string& directory) : directory_(directory) {
  struct statfs fs {};
  if (statfs(directory.c_str(), &fs) != 0) {
    throw IoError(fmt::format("memory.swap_dir = '{}': {}; choose an existing directory on disk",
                              directory, std::strerror(errno)));
  }
  if (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC) {
    throw ConfigError(fmt::format(
        "memory.swap_dir = '{}' is on tmpfs (memory): offloading there frees nothing; choose a "
        "directory on disk, e.g. /var/tmp",
        directory));
  }
  bounce_ = alignedAlloc(kBounceBytes);
  auto openFile = [&](int extra) {
    return ::open(directory.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC | extra, 0600);
  };
  fd_ = openFile(O_DIRECT);
  direct_ = fd_ >= 0;
  if (direct_) {
    // Some file systems accept O_DIRECT at open and refuse the I/O (EINVAL): try one block.
    std::memset(bounce_, 0, kDirectAlign);
    if (::pwrite(fd_, bounce_, kDirectAlign, 0) != kDirectAlign ||
        ::pread(fd_, bounce_, kDirectAlign, 0) != kDirectAlign) {
      ::close(fd_);
      fd_ = -1;
      direct_ = false;
    }
  }
  if (fd_ < 0) fd_ = openFile(0);
  if (fd_ < 0) {
    // No O_TMPFILE on this file system: a named file, unlinked at once.
    std::string path = directory + "/caravan-tier-XXXXXX";
    std::vector<char> name(path.begin(), path.end());
    name.push_back('\0');
    fd_ = mkostemp(name.data(), O_CLOEXEC);
    if (fd_ >= 0) ::unlink(name.data());
  }
  if (fd_ < 0) {
    const int err = errno;
    alignedFree(bounce_);
    throw IoError(fmt::format("memory.swap_dir = '{}': cannot create the tier file: {}; choose "
                              "a writable directory on disk",
                              directory, std::strerror(err)));
  }
  // Past the file size limit (ulimit -f) a write should fail with EFBIG, which the tier
  // reports, rather than kill the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
}

FileTier::~FileTier() {
  stopThreads();
  if (fd_ >= 0) ::close(fd_);
  alignedFree(bounce_);
}

std::string FileTier::describe() const {
  return fmt::format("file in {} ({})", directory_,
                     direct_ ? "direct I/O" : "buffered, page cache dropped");
}

int64_t FileTier::allocate(int64_t bytes) {
  const int64_t length = alignUp(std::max<int64_t>(bytes, 1), kDirectAlign);
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < length) continue;
    const int64_t offset = it->first;
    const int64_t rest = it->second - length;
    free_.erase(it);
    if (rest > 0) free_[offset + length] = rest;
    used_[offset] = length;
    return offset;
  }
  const int64_t offset = end_;
  end_ += length;
  used_[offset] = length;
  return offset;
}

void FileTier::free(int64_t slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto used = used_.find(slot);
  CARAVAN_CHECK(used != used_.end(), "freeing a tier slot that is not allocated");
  int64_t offset = used->first, length = used->second;
  used_.erase(used);
  // Merge with the free neighbours.
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first == offset + length) {
    length += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      length += prev->second;
      free_.erase(prev);
    }
  }
  if (offset + length == end_) {
    end_ = offset;  // the tail is free: shrink what the file uses (not its length on disk)
  } else {
    free_[offset] = length;
  }
}

namespace {

void fullWrite(int fd, const char* p, int64_t n, int64_t offset, const std::string& where) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, static_cast<size_t>(n), offset);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      throw IoError(fmt::format(
          "memory tier: writing {} to {} failed: {}; free disk space, raise the file size "
          "limit (ulimit -f) or choose another memory.swap_dir",
          formatBytes(n), where, w < 0 ? std::strerror(errno) : "no progress"));
    }
    p += w, n -= w, offset += w;
  }
}

void fullRead(int fd, char* p, int64_t n, int64_t offset, const std::string& where) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, static_cast<size_t>(n), offset);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      throw IoError(fmt::format("memory tier: reading {} back from {} failed: {}; check the "
                                "disk behind memory.swap_dir",
                                formatBytes(n), where, r < 0 ? std::strerror(errno) : "EOF"));
    }
    p += r, n -= r, offset += r;
  }
}

}  // namespace

void FileTier::store(int64_t slot, const void* data, int64_t bytes) {
  const char* src = static_cast<const char*>(data);
  if (!direct_) {
    fullWrite(fd_, src, bytes, slot, directory_);
    countWrite(bytes);
    // Flush this range and drop it from the page cache, so the bytes leave memory.
    if (::sync_file_range(fd_, slot, bytes,
                          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                              SYNC_FILE_RANGE_WAIT_AFTER) != 0) {
      throw IoError(fmt::format("memory tier: flushing {} to {} failed: {}", formatBytes(bytes),
                                directory_, std::strerror(errno)));
    }
    ::posix_fadvise(fd_, slot, bytes, POSIX_FADV_DONTNEED);
    return;
  }
  // Direct I/O needs aligned memory, offsets and lengths: aligned sources go straight to the
  // file, others through the staging buffer. The tail is padded to the alignment (the slot
  // has room: allocate() rounds up).
  int64_t done = 0;
  const bool aligned = reinterpret_cast<uintptr_t>(src) % kDirectAlign == 0;
  while (done < bytes) {
    const int64_t n = std::min<int64_t>(bytes - done, kBounceBytes);
    const int64_t padded = alignUp(n, kDirectAlign);
    const char* from = src + done;
    if (!aligned || padded != n) {
      std::memcpy(bounce_, from, static_cast<size_t>(n));
      std::memset(static_cast<char*>(bounce_) + n, 0, static_cast<size_t>(padded - n));
      from = static_cast<const char*>(bounce_);
    }
    fullWrite(fd_, from, padded, slot + done, directory_);
    done += n;
  }
  countWrite(bytes);
}

void FileTier::load(int64_t slot, void* data, int64_t bytes) {
  // `data` comes from allocateHost(): aligned, with room for the padded length.
  char* dst = static_cast<char*>(data);
  const int64_t padded = direct_ ? alignUp(bytes, kDirectAlign) : bytes;
  fullRead(fd_, dst, padded, slot, directory_);
  countRead(bytes);
  if (!direct_) ::posix_fadvise(fd_, slot, bytes, POSIX_FADV_DONTNEED);
}

at::DataPtr FileTier::allocateHost(int64_t bytes) {
  // Mappings are page aligned; the caching allocator reuses them step after step.
  if (HostAllocator::installed()) {
    return HostAllocator::instance().allocatePages(
        static_cast<size_t>(alignUp(bytes, kDirectAlign)));
  }
  return Tier::allocateHost(alignUp(bytes, kDirectAlign));
}

// ---- HostTier -----------------------------------------------------------------------------

HostTier::~HostTier() { stopThreads(); }

int64_t HostTier::allocate(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t slot = next_++;
  blobs_[slot].reset(new char[static_cast<size_t>(std::max<int64_t>(bytes, 1))]);
  return slot;
}

void HostTier::free(int64_t slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  blobs_.erase(slot);
}

void HostTier::store(int64_t slot, const void* data, int64_t bytes) {
  char* dst;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dst = blobs_.at(slot).get();
  }
  std::memcpy(dst, data, static_cast<size_t>(bytes));
  countWrite(bytes);
}

void HostTier::load(int64_t slot, void* data, int64_t bytes) {
  const char* src;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    src = blobs_.at(slot).get();
  }
  std::memcpy(data, src, static_cast<size_t>(bytes));
  countRead(bytes);
}

std::unique_ptr<Tier> makeTier(const std::string& kind, const std::string& directory) {
  if (kind == "host") return std::make_unique<HostTier>();
  CARAVAN_CHECK(kind == "disk", "unknown tier kind " + kind);
  return std::make_unique<FileTier>(directory);
}

// ---- Offload ------------------------------------------------------------------------------

TierDtype parseTierDtype(const std::string& text, const std::string& key) {
  if (text == "float32") return TierDtype::kAsIs;
  if (text == "bf16") return TierDtype::kBf16;
  throw ConfigError(
      fmt::format("{} = '{}': use float32 (activations stored as they are) or "
                  "bf16 (float32 activations stored at half the bytes, rounded)",
                  key, text));
}

namespace {

// float32 -> bf16, rounding to nearest with ties to even (c10::BFloat16's conversion, the one
// ATen's casts use), and back (exact). Plain loops: they run on the tier's I/O threads, where
// ATen's parallel kernels would start a second OpenMP team beside the training thread's.
void narrowToBf16(const float* from, c10::BFloat16* to, int64_t n) {
  for (int64_t i = 0; i < n; ++i) to[i] = c10::BFloat16(from[i]);
}
void widenFromBf16(const c10::BFloat16* from, float* to, int64_t n) {
  for (int64_t i = 0; i < n; ++i) to[i] = static_cast<float>(from[i]);
}
void roundToBf16(const float* from, float* to, int64_t n) {
  for (int64_t i = 0; i < n; ++i) to[i] = static_cast<float>(c10::BFloat16(from[i]));
}

}  // namespace

std::shared_ptr<Offload> Offload::start(Tier& tier, at::Storage storage, ResidentFn onResident,
                                        TierDtype dtype) {
  std::shared_ptr<Offload> o(new Offload(tier, std::move(storage), std::move(onResident), dtype));
  std::weak_ptr<Offload> weak = o;
  tier.submitWrite([weak] {
    if (auto self = weak.lock()) self->write();
  });
  return o;
}

Offload::Offload(Tier& tier, at::Storage storage, ResidentFn onResident, TierDtype dtype)
    : tier_(tier),
      onResident_(std::move(onResident)),
      bytes_(static_cast<int64_t>(storage.nbytes())),
      dtype_(dtype),
      device_(storage.device()),
      storage_(std::move(storage)) {
  CARAVAN_CHECK(device_.is_cpu(), "only CPU storages can be offloaded in this build");
  CARAVAN_CHECK(dtype_ != TierDtype::kBf16 || bytes_ % 4 == 0,
                "a storage of {} bytes is not float32 values: it cannot be stored as bf16", bytes_);
  if (onResident_) onResident_(storage_, +1);
}

Offload::~Offload() {
  if (storage_ && onResident_) onResident_(storage_, -1);
  if (slot_ >= 0) tier_.free(slot_);
}

void Offload::write() {
  at::Storage s;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Needed again before the write started (prefetch cancelled it): nothing to write.
    if (state_ != State::kWriting) return;
    writeStarted_ = true;
    s = storage_;
  }
  std::string error;
  int64_t slot = -1;
  try {
    slot = tier_.allocate(storedBytes());
    if (dtype_ == TierDtype::kBf16) {
      at::DataPtr narrow = tier_.allocateHost(storedBytes());
      narrowToBf16(static_cast<const float*>(s.data()), static_cast<c10::BFloat16*>(narrow.get()),
                   bytes_ / 4);
      tier_.store(slot, narrow.get(), storedBytes());
    } else {
      tier_.store(slot, s.data(), bytes_);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  slot_ = slot;
  try {
    if (!error.empty()) {
      failLocked(error);
    } else if (wanted_) {
      state_ = State::kResident;  // asked for during the write: keep the storage
    } else {
      state_ = State::kOnTier;
      if (onResident_) onResident_(storage_, -1);
      storage_ = at::Storage();
    }
  } catch (const std::exception& e) {
    failLocked(e.what());
  }
  cv_.notify_all();
}

void Offload::read() {
  std::string error;
  at::Storage s;
  try {
    at::DataPtr data = tier_.allocateHost(bytes_);
    if (dtype_ == TierDtype::kBf16) {
      at::DataPtr narrow = tier_.allocateHost(storedBytes());
      tier_.load(slot_, narrow.get(), storedBytes());
      widenFromBf16(static_cast<const c10::BFloat16*>(narrow.get()),
                    static_cast<float*>(data.get()), bytes_ / 4);
    } else {
      tier_.load(slot_, data.get(), bytes_);
    }
    s = at::Storage(at::Storage::use_byte_size_t(), static_cast<size_t>(bytes_),
                    std::move(data), /*allocator=*/nullptr, /*resizable=*/false);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    if (!error.empty()) {
      failLocked(error);
    } else {
      storage_ = std::move(s);
      if (onResident_) onResident_(storage_, +1);
      state_ = State::kResident;
      rounded_ = true;
    }
  } catch (const std::exception& e) {
    failLocked(e.what());
  }
  cv_.notify_all();
}

void Offload::failLocked(const std::string& message) {
  error_ = message;
  state_ = State::kFailed;
  tier_.fail(message);
}

void Offload::prefetch() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == State::kWriting) {
    if (writeStarted_) {
      wanted_ = true;  // keep the storage when the write completes
    } else {
      state_ = State::kResident;  // cancel the queued write: the storage never left
      cv_.notify_all();
    }
    return;
  }
  if (state_ != State::kOnTier) return;
  state_ = State::kReading;
  std::weak_ptr<Offload> weak = shared_from_this();
  tier_.submitRead([weak] {
    if (auto self = weak.lock()) self->read();
  });
}

at::Storage Offload::get() {
  prefetch();
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return state_ == State::kResident || state_ == State::kFailed; });
  if (state_ == State::kFailed) throw IoError(error_);
  if (dtype_ == TierDtype::kBf16 && !rounded_) {
    // It never went through the tier: round a copy, as the trip would have.
    at::DataPtr data = tier_.allocateHost(bytes_);
    roundToBf16(static_cast<const float*>(storage_.data()), static_cast<float*>(data.get()),
                bytes_ / 4);
    at::Storage rounded(at::Storage::use_byte_size_t(), static_cast<size_t>(bytes_),
                        std::move(data), /*allocator=*/nullptr, /*resizable=*/false);
    if (onResident_) {
      onResident_(rounded, +1);
      onResident_(storage_, -1);
    }
    storage_ = std::move(rounded);
    rounded_ = true;
  }
  return storage_;
}

}  // namespace caravan
