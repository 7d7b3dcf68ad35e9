// The caching CPU allocator (see host_allocator.h).
#include "memory/host_allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <new>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace caravan {

namespace {

constexpr size_t kPage = 4096;

size_t roundToPages(size_t n) { return (n + kPage - 1) / kPage * kPage; }

std::atomic<bool> gAllocatorInstalled{false};

}  // namespace

HostAllocator& HostAllocator::instance() {
  static HostAllocator* a = new HostAllocator();  // never destroyed: storages may outlive main
  return *a;
}

void HostAllocator::install(int64_t cacheLimit) {
  instance().setCacheLimit(cacheLimit);
  if (gAllocatorInstalled.exchange(true)) return;
  // Priority above c10's default CPU allocator (0).
  c10::SetCPUAllocator(&instance(), /*priority=*/1);
}

bool HostAllocator::installed() { return gAllocatorInstalled.load(); }

c10::DataPtr HostAllocator::allocate(size_t bytes) {
  if (bytes < kMappedBytes) {
    void* p = c10::alloc_cpu(bytes);
    return {p, p, &c10::free_cpu, c10::Device(c10::DeviceType::CPU)};
  }
  return allocatePages(bytes);
}

c10::DataPtr HostAllocator::allocatePages(size_t bytes) const {
  const size_t size = roundToPages(bytes == 0 ? 1 : bytes);
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = cache_.find(size);
    if (it != cache_.end()) {
      p = it->second;
      cache_.erase(it);
      cached_ -= static_cast<int64_t>(size);
    }
  }
  if (p == nullptr) {
    p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    std::lock_guard<std::mutex> lock(mutex_);
    mapped_ += static_cast<int64_t>(size);
    live_.emplace(p, size);
  } else {
    std::lock_guard<std::mutex> lock(mutex_);
    live_.emplace(p, size);
  }
  // ctx == ptr: LibTorch's raw_allocate/raw_deallocate (used by some kernels) require it.
  return {p, p, &HostAllocator::releaseMapping, c10::Device(c10::DeviceType::CPU)};
}

void HostAllocator::releaseMapping(void* ptr) { release(ptr); }

void HostAllocator::release(void* ptr) {
  HostAllocator& a = instance();
  size_t size = 0;
  {
    std::lock_guard<std::mutex> lock(a.mutex_);
    auto it = a.live_.find(ptr);
    if (it == a.live_.end()) {
      // Not a mapping: c10's heap allocation (allocate() below kMappedBytes).
    } else {
      size = it->second;
      a.live_.erase(it);
      if (a.cached_ + static_cast<int64_t>(size) <= a.limit_) {
        a.cache_.emplace(size, ptr);
        a.cached_ += static_cast<int64_t>(size);
        return;
      }
      a.mapped_ -= static_cast<int64_t>(size);
    }
  }
  if (size == 0) {
    c10::free_cpu(ptr);
  } else {
    ::munmap(ptr, size);
  }
}

void HostAllocator::setCacheLimit(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = bytes;
}

int64_t HostAllocator::cacheLimit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return limit_;
}

HostAllocator::Stats HostAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {mapped_, cached_};
}

void HostAllocator::emptyCache() {
  std::multimap<size_t, void*> drop;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    drop.swap(cache_);
    mapped_ -= cached_;
    cached_ = 0;
  }
  for (auto& [size, ptr] : drop) ::munmap(ptr, size);
}

}  // namespace caravan
