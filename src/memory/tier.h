// Offload tiers: where bytes go when they leave the memory budget, and come back from.
//
// A Tier stores blobs of bytes in slots: FileTier in an unnamed file on disk (direct I/O, so
// the bytes really leave memory instead of sitting in the page cache), HostTier in separate
// host memory (the device -> host tier of a CUDA build; on a CPU build it only moves bytes
// out of the tracked budget, which tests use). Tier calls are blocking; Offload (below) runs
// them on the tier's I/O threads, one writer and one reader, so writes overlap compute and
// reads can be prefetched without queueing behind writes.
//
// Offload is one storage's trip through a tier: created with the storage (write queued at
// once), the storage is dropped from memory when the write completes, prefetch() queues the
// read back into a new storage, get() waits for it. A prefetch before the write has started
// cancels the write; one during the write keeps the storage. Errors (disk full, file size
// limit, I/O error) are kept: get() and Tier::check() throw IoError with the first of them,
// naming the tier and what to do. Stored as bf16 (TierDtype below), the writer narrows into a
// half-size buffer of its own before storing and the reader widens after loading: one such
// transient buffer per I/O thread at a time, outside the memory accounting.
//
// Threading: Tier's blocking calls run on its I/O threads only; Offload methods and check()
// may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <ATen/ATen.h>

namespace caravan {

// How an offloaded storage is kept on the tier (memory.tier_dtype): as it is, or, for a
// storage of float32 values, as bf16 (half the bytes each way; each value rounded to the
// nearest bf16, ties to even, as float32 -> bf16 casts round). Only activations are given
// kBf16: weights and optimizer state stay exact.
enum class TierDtype { kAsIs, kBf16 };
// "float32" -> kAsIs, "bf16" -> kBf16; ConfigError naming `key` otherwise.
TierDtype parseTierDtype(const std::string& text, const std::string& key);

struct TierBandwidth {
  double writeBytesPerSecond = 0.0;
  double readBytesPerSecond = 0.0;
};

class Tier {
 public:
  Tier();
  virtual ~Tier();
  Tier(const Tier&) = delete;
  Tier& operator=(const Tier&) = delete;

  // "file /var/tmp (direct I/O)", "host memory".
  virtual std::string describe() const = 0;

  // store/load block (I/O threads); allocate/free are quick and thread-safe. A slot is an opaque
  // id with room for `bytes` bytes.
  virtual int64_t allocate(int64_t bytes) = 0;
  virtual void free(int64_t slot) = 0;
  // Throw IoError on failure.
  virtual void store(int64_t slot, const void* data, int64_t bytes) = 0;
  virtual void load(int64_t slot, void* data, int64_t bytes) = 0;
  // Host memory that load() can fill without a copy (FileTier: aligned for direct I/O).
  virtual at::DataPtr allocateHost(int64_t bytes);

  // Queues `job` on the writer or the reader thread (after stopThreads(): runs it inline, so
  // nothing waits for a job no thread will run).
  void submitWrite(std::function<void()> job);
  void submitRead(std::function<void()> job);
  // Waits until every write (drainWrites) or every job (drain) queued so far has run, objects
  // the jobs held included.
  void drainWrites();
  void drain();
  // Bytes stored and loaded so far (cancelled writes never count).
  int64_t bytesWritten() const { return bytesWritten_.load(); }
  int64_t bytesRead() const { return bytesRead_.load(); }
  void countWrite(int64_t n) { bytesWritten_ += n; }
  void countRead(int64_t n) { bytesRead_ += n; }
  // Throws the first I/O error any job hit (IoError), so the training thread fails promptly.
  void check() const;
  void fail(const std::string& message);
  bool failed() const;

  // Writes and reads `bytes` through the I/O threads (in 4 MiB blobs) and times it. `dtype`
  // kBf16: float32 blobs stored as bf16, the conversions timed with the I/O, and the rates in
  // bytes as stored (what the planner divides by them).
  TierBandwidth measure(int64_t bytes, TierDtype dtype = TierDtype::kAsIs);

  // Call from the most-derived destructor: drains the queues before the slots go away.
  void stopThreads();

 private:
  struct Queue {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> jobs;
    bool stop = false;
    std::thread thread;
  };
  void run(Queue& q);
  void submit(Queue& q, std::function<void()> job);
  Queue writer_, reader_;
  std::atomic<int64_t> bytesWritten_{0}, bytesRead_{0};
  mutable std::mutex errorMutex_;
  std::string error_;
};

// An unnamed file (O_TMPFILE) in `directory`, opened with O_DIRECT where the file system
// allows it (else buffered, with each range flushed and dropped from the page cache after use).
// Refuses tmpfs (offloading there would stay in memory). Slots are first-fit extents of the
// file, 4 KiB aligned; the file is gone when the tier is (or the process) is.
class FileTier final : public Tier {
 public:
  explicit FileTier(const std::string& directory);
  ~FileTier() override;
  std::string describe() const override;
  int64_t allocate(int64_t bytes) override;
  void free(int64_t slot) override;
  void store(int64_t slot, const void* data, int64_t bytes) override;
  void load(int64_t slot, void* data, int64_t bytes) override;
  at::DataPtr allocateHost(int64_t bytes) override;
  bool direct() const { return direct_; }

 private:
  std::string directory_;
  int fd_ = -1;
  bool direct_ = false;
  std::mutex mutex_;
  std::map<int64_t, int64_t> free_;   // offset -> length of free extents
  std::map<int64_t, int64_t> used_;   // offset -> length of allocated extents
  int64_t end_ = 0;                   // file length in use
  void* bounce_ = nullptr;            // aligned staging buffer for writes of unaligned data
};

// Separate host memory (malloc). See the file comment.
class HostTier final : public Tier {
 public:
  HostTier() = default;
  ~HostTier() override;
  std::string describe() const override { return "host memory"; }
  int64_t allocate(int64_t bytes) override;
  void free(int64_t slot) override;
  void store(int64_t slot, const void* data, int64_t bytes) override;
  void load(int64_t slot, void* data, int64_t bytes) override;

 private:
  std::mutex mutex_;
  std::map<int64_t, std::unique_ptr<char[]>> blobs_;
  int64_t next_ = 0;
};

// Creates the tier named by memory.tier: "disk" (FileTier in `directory`) or "host".
std::unique_ptr<Tier> makeTier(const std::string& kind, const std::string& directory);

// One storage's trip through a tier (see the file comment).
class Offload : public std::enable_shared_from_this<Offload> {
 public:
  // `onResident(storage, +1/-1)` is told when a storage of these bytes starts and stops being
  // held in memory by this Offload (the memory accounting).
  using ResidentFn = std::function<void(const at::Storage&, int)>;
  // `dtype` kBf16: the storage holds float32 values (a whole number of them); they are written
  // as bf16 and read back widened, so get() returns a float32 storage of the same size whose
  // values are rounded to bf16. Also when the storage never left (a prefetch cancelled the
  // write, or came during it): get() then rounds a copy, so what the caller gets does not
  // depend on how the I/O threads were timed.
  static std::shared_ptr<Offload> start(Tier& tier, at::Storage storage, ResidentFn onResident,
                                        TierDtype dtype = TierDtype::kAsIs);
  ~Offload();

  // Queues the read (no-op if resident, reading, or the write has not finished: then the
  // storage stays).
  void prefetch();
  // The storage, waiting for a read in flight (starting one if needed). Throws IoError.
  at::Storage get();
  int64_t bytes() const { return bytes_; }
  // The bytes the tier holds for it (half of bytes() as bf16).
  int64_t storedBytes() const { return dtype_ == TierDtype::kBf16 ? bytes_ / 2 : bytes_; }

 private:
  enum class State { kWriting, kOnTier, kReading, kResident, kFailed };
  Offload(Tier& tier, at::Storage storage, ResidentFn onResident, TierDtype dtype);
  void write();
  void read();
  void failLocked(const std::string& message);  // under mutex_

  Tier& tier_;
  ResidentFn onResident_;
  const int64_t bytes_;
  const TierDtype dtype_;
  const at::Device device_;
  std::mutex mutex_;
  std::condition_variable cv_;
  State state_ = State::kWriting;
  bool wanted_ = false;  // a prefetch/get came while writing: keep the storage
  bool writeStarted_ = false;
  bool rounded_ = false;  // kBf16: storage_ holds the bf16-rounded values (read back, or copied)
  int64_t slot_ = -1;
  at::Storage storage_;  // defined while resident (or writing)
  std::string error_;
};

}  // namespace caravan
