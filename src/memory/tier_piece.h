// TierPiece: a few float32 tensors kept as views of one blob that lives on a tier (tier.h) while
// no one uses it: a shard's slice of the weights, or its optimizer state (sync/sharding.h under
// memory.weights = offload). The tensors keep their identity (set_data), so the optimizer's
// state keys and the collectives' arguments stay; out of memory each is an empty tensor.
//
// Use: acquire() pins the piece in memory (reading it back and waiting if it is on the tier),
// release(how) unpins it. An unpinned piece leaves memory as soon as the tier holds its
// current bytes: at once when the tier copy is current (a piece read back and only read), after
// its write when it changed (the write is queued on the tier's writer thread at release; the
// tensors stay views of the blob until it is done). prefetch() queues the read of a piece on the
// tier so a later acquire() does not wait, or keeps a piece still in memory there (either way
// it stays in memory until acquired and released). A piece is created in memory, as changed, and
// its write is queued at once.
//
// Reads and writes of one piece never overlap: a read is queued only when no write is pending
// (an acquire during the write takes the bytes still in memory back).
//
// Memory accounting: the blob's bytes are added to `category` of the tracker (may be null) while
// it is in memory, pinned or not.
//
// Errors: an I/O error fails the tier (Tier::check) and acquire() throws IoError.
// Threading: acquire/release/prefetch from any one thread at a time per piece; the tier's I/O
// threads finish reads and writes. The tier must outlive the piece (the destructor waits for its
// I/O and frees its slot) and keep its I/O threads running while the piece exists: jobs are
// submitted under the piece's lock, and a stopped tier would run them inline, on that lock.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>

#include "memory/tier.h"
#include "memory/tracker.h"

namespace caravan {

class TierPiece {
 public:
  // `members`: defined, contiguous float32 CPU tensors; their bytes are copied into the blob
  // (in memory, changed).
  TierPiece(Tier& tier, std::vector<at::Tensor> members, MemoryTracker* tracker,
            MemoryCategory category);
  ~TierPiece();
  TierPiece(const TierPiece&) = delete;
  TierPiece& operator=(const TierPiece&) = delete;

  void acquire();
  // Pinned in memory for a caller that overwrites every member: no read (fresh bytes when the
  // piece is on the tier; a read in flight is waited for).
  void acquireToOverwrite();
  enum class Release {
    kUnchanged,  // only read: the tier copy stays current
    kChanged,    // written: its write is queued when the last pin goes
    kSpent,      // its bytes are no longer needed (a gradient after its update): no write
  };
  void release(Release how);
  void prefetch();
  // Waits until no write of this piece is queued or running (bounds the writes in flight of a
  // caller that changes pieces one after the other). Throws the tier's IoError.
  void waitWritten();
  int64_t bytes() const { return bytes_; }
  const std::vector<at::Tensor>& members() const { return members_; }

 private:
  struct State;
  void attach(const at::Storage& blob);  // members become views of `blob`
  void detachIfIdleLocked();             // drops the blob when unpinned and the tier is current
  void startReadLocked();
  void startWriteLocked();

  Tier& tier_;
  std::vector<at::Tensor> members_;
  std::vector<int64_t> offsets_;  // bytes into the blob
  std::vector<std::vector<int64_t>> shapes_;
  MemoryTracker* tracker_;
  MemoryCategory category_;
  int64_t bytes_ = 0;
  int64_t slot_ = -1;

  std::mutex mutex_;
  std::condition_variable cv_;
  at::Storage blob_;  // defined while in memory
  int pins_ = 0;
  bool tierCurrent_ = false;  // the tier's copy holds the current bytes
  bool reading_ = false;
  bool prefetched_ = false;     // read ahead for an acquire to come: kept in memory until then
  int writes_ = 0;              // writes queued or running
  int64_t version_ = 0;         // bumped at each change; a write makes the tier current only if
                                // no change came after the bytes it wrote
  int64_t queuedVersion_ = -1;  // the version the last queued write carries
};

}  // namespace caravan
