// Caravan's CPU allocator for tensor storage (installed by applyRuntimeConfig when
// train.keep_freed_memory is on). Storages of at least 256 KiB are separate anonymous mappings
// (page aligned), cached by size when freed and handed out again for the same size: a training
// step allocates the same shapes every step, so after the first step it page-faults nothing.
// Smaller storages come from c10's default allocation (the C heap).
//
// Why not the C heap for everything: glibc interleaves big transient tensors with the small,
// long-lived objects autograd allocates (graph nodes, saved-variable hooks), so freed tensors
// leave holes the next block cannot always reuse. Measured on brown-gpt depth 12 with every
// block recomputed: ~30 MiB of free-but-mapped heap per block, 436 MiB in all, against 99 MiB
// of tracked tensors (docs/architecture.md, "Memory accounting").
//
// The cache holds only storages that were live and is bounded (cacheLimit bytes); past it,
// freed mappings go back to the kernel. Threading: any thread.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>

namespace caravan {

class HostAllocator final : public c10::Allocator {
 public:
  static constexpr size_t kMappedBytes = 256 << 10;  // smaller: the C heap

  static HostAllocator& instance();
  // Makes it LibTorch's CPU allocator (idempotent). Tensors allocated before keep theirs.
  static void install(int64_t cacheLimit);
  static bool installed();

  c10::DataPtr allocate(size_t bytes) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &HostAllocator::release; }
  // Page-aligned and mapped whatever the size (direct I/O buffers); cached like the others.
  c10::DataPtr allocatePages(size_t bytes) const;

  void setCacheLimit(int64_t bytes);
  int64_t cacheLimit() const;
  struct Stats {
    int64_t mapped = 0;  // bytes in mappings, live or cached
    int64_t cached = 0;  // of which free, kept for reuse
  };
  Stats stats() const;
  // Unmaps every cached mapping.
  void emptyCache();

 private:
  HostAllocator() = default;
  // Frees what allocate() returned (a mapping, or else c10's heap allocation): the raw
  // deleter, which must tell them apart by a lookup. DataPtrs carry the right one directly.
  static void release(void* ptr);
  static void releaseMapping(void* ptr);


  mutable std::mutex mutex_;
  mutable std::multimap<size_t, void*> cache_;  // page-rounded size -> free mapping
  mutable std::unordered_map<void*, size_t> live_;  // mappings handed out -> size
  mutable int64_t mapped_ = 0, cached_ = 0;
  int64_t limit_ = 0;
};

}  // namespace caravan
