// ShmCommunicator (see shm_communicator.h).
#include "comm/shm_communicator.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "comm/comm_util.h"
#include "comm/shm_channels.h"
#include "comm/store.h"
#include "core/errors.h"

namespace caravan {

using comm::atLeastOneMs;
using comm::formatDuration;
using comm::formatRanks;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kShmMagic = 0x3263617261766e73;  // the layout's version

struct alignas(64) SegmentHeader {
  uint64_t magic;
  int64_t size;
  int64_t slotBytes;
  std::atomic<int64_t> failed;  // 0, or 1 + the rank that gave up on a collective
};

struct alignas(64) RankWord {
  std::atomic<uint64_t> phase;  // the last phase this rank arrived at
  std::atomic<int64_t> pid;     // 0 until the rank mapped the segment
};

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<int64_t>::is_always_lock_free,
              "shared-memory counters must be lock-free atomics");

// The segment: the header, every rank's word, every rank's doorbell (shm_channels.h), then the
// two buffers of slots, then the point-to-point rings (ShmChannels).
int64_t headerBytes(int size) {
  const int64_t raw = static_cast<int64_t>(sizeof(SegmentHeader) + size * sizeof(RankWord) +
                                           size * sizeof(comm::ShmDoorbell));
  return (raw + 4095) / 4096 * 4096;
}

// Each ordered pair's ring: slot / (2 size), at least 64 bytes (a quarter slot for 2 ranks), so
// the size * size rings take size / 2 slots in all, not size * size / 4.
int64_t ringBytesFor(int size, int64_t slotBytes) {
  return std::max<int64_t>(64, slotBytes / (2 * static_cast<int64_t>(size)) / 64 * 64);
}

int64_t segmentBytes(int size, int64_t slotBytes) {
  return headerBytes(size) + 2 * static_cast<int64_t>(size) * slotBytes +
         comm::ShmChannels::bytesFor(size, ringBytesFor(size, slotBytes));
}

std::string firstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string inodeOf(const char* path, bool device) {
  struct stat st {};
  if (::stat(path, &st) != 0) return "?";
  return std::to_string(device ? st.st_dev : st.st_ino);
}

std::string systemError(const std::string& what) {
  return fmt::format("{}: {}", what, std::strerror(errno));
}

// The slot size rank 0 lays out: `wanted`, or less when the segment would take more than half of
// what /dev/shm has free (a container's is often 64 MiB); IoError when not even 64 bytes per
// rank fit.
int64_t fittingSlot(int size, int64_t wanted, int who) {
  struct statvfs fs {};
  if (::statvfs("/dev/shm", &fs) != 0) return wanted;
  const int64_t budget = static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize) / 2;
  // Per slot byte: two buffers of `size` slots and size * size rings of slot / (2 size): 2.5 size.
  const int64_t rings = comm::ShmChannels::bytesFor(size, 64);  // their counters, and 64 spare
  const int64_t fits =
      (budget - headerBytes(size) - rings) * 2 / (5 * static_cast<int64_t>(size)) / 64 * 64;
  if (fits < 64 * size) {
    throw IoError(fmt::format(
        "rank {}: /dev/shm has {} KiB free, too little for the shared-memory collectives of {} "
        "ranks",
        who, 2 * budget >> 10, size));
  }
  return std::min(wanted, fits);
}

at::Tensor view(char* at, int64_t n, at::ScalarType type) {
  return at::from_blob(at, {n}, at::TensorOptions().dtype(type));
}

// The reduction of `count` elements of `parts` (one pointer per rank) in rank order into `out`,
// and into `copy` too when it is not null; `out` may be one of the parts (it is read before it is
// written, element by element). float32 and bfloat16 sums (and AVG) run in one pass over blocks
// that stay in registers: bfloat16 widened to float32 and rounded once, AVG dividing the float
// sum by `size`, each element's sum taken in rank order, so the result is bitwise what ATen's
// copy_, add_ and div_ give (but for a NaN's payload bits: a bfloat16 NaN here is 0x7fc0). Other
// types and MAX/MIN go through ATen on a temporary.
template <typename T, typename Load, typename Store>
void sumInBlocks(const std::vector<const char*>& parts, char* out, char* copy, int64_t count,
                 bool average, int size, Load load, Store store) {
  constexpr int64_t kBlock = 256;
  float acc[kBlock];
  const float divisor = static_cast<float>(size);
  for (int64_t i = 0; i < count; i += kBlock) {
    const int64_t m = std::min(kBlock, count - i);
    const T* first = reinterpret_cast<const T*>(parts[0]) + i;
    for (int64_t j = 0; j < m; ++j) acc[j] = load(first[j]);
    for (size_t k = 1; k < parts.size(); ++k) {
      const T* p = reinterpret_cast<const T*>(parts[k]) + i;
      for (int64_t j = 0; j < m; ++j) acc[j] += load(p[j]);
    }
    if (average) {
      for (int64_t j = 0; j < m; ++j) acc[j] /= divisor;
    }
    T* o = reinterpret_cast<T*>(out) + i;
    for (int64_t j = 0; j < m; ++j) o[j] = store(acc[j]);
    if (copy != nullptr) std::memcpy(copy + i * sizeof(T), o, m * sizeof(T));
  }
}

void reduceInto(const std::vector<const char*>& parts, char* out, char* copy, int64_t count,
                at::ScalarType type, ReduceOp op, int size) {
  const bool sum = op == ReduceOp::kSum || op == ReduceOp::kAvg;
  const bool average = op == ReduceOp::kAvg;
  if (sum && type == at::kFloat) {
    sumInBlocks<float>(
        parts, out, copy, count, average, size, [](float v) { return v; },
        [](float v) { return v; });
    return;
  }
  if (sum && type == at::kBFloat16) {
    sumInBlocks<c10::BFloat16>(
        parts, out, copy, count, average, size, [](c10::BFloat16 v) { return float(v); },
        [](float v) { return c10::BFloat16(v); });  // round to nearest even, as ATen's copy_
    return;
  }
  const at::ScalarType accType = type == at::kBFloat16 ? at::kFloat : type;
  auto operand = [&](size_t k) {
    return at::from_blob(const_cast<char*>(parts[k]), {count}, at::TensorOptions().dtype(type));
  };
  at::Tensor acc = operand(0).to(accType, /*non_blocking=*/false, /*copy=*/true);
  for (size_t k = 1; k < parts.size(); ++k) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc.add_(operand(k)); break;
      case ReduceOp::kMax: at::maximum_out(acc, acc, operand(k)); break;
      case ReduceOp::kMin: at::minimum_out(acc, acc, operand(k)); break;
    }
  }
  if (average) acc.div_(size);
  view(out, count, type).copy_(acc);
  if (copy != nullptr) std::memcpy(copy, out, count * c10::elementSize(type));
}

// Element range [begin, begin + count) of part r when n elements are split in `size` parts.
std::pair<int64_t, int64_t> part(int64_t n, int size, int r) {
  const int64_t base = n / size, extra = n % size;
  return {r * base + std::min<int64_t>(r, extra), base + (r < extra ? 1 : 0)};
}

// When this thread runs a collective for a Work it waits for (OpQueue::runIfNext): the end of
// that wait. arrive() gives up there, as the wait would have.
thread_local Clock::time_point tWaitDeadline = Clock::time_point::max();
thread_local milliseconds tWaitTimeout{0};

// The collectives waiting to run, in issue order, and who runs them: the op thread, or a thread
// that waits for the Work of the task at the front (the caller would only sleep meanwhile, and
// two thread hand-offs cost more than a small collective). One task runs at a time. A task
// pushed without waking the op thread (a small one: its waiter will likely run it) is still
// taken by the op thread within kPoll, so a collective nobody waits for yet completes.
struct OpQueue {
  static constexpr std::chrono::milliseconds kPoll{2};
  std::mutex mutex;
  std::condition_variable wake;  // the op thread: a task is queued, the runner left, or stop
  std::deque<std::pair<uint64_t, std::function<void()>>> tasks;
  uint64_t issued = 0;
  bool busy = false;  // a task runs
  bool stop = false;

  uint64_t push(std::function<void()> task, bool wakeOpThread) {
    uint64_t id = 0;
    {
      std::lock_guard<std::mutex> lock(mutex);
      id = ++issued;
      tasks.emplace_back(id, std::move(task));
    }
    if (wakeOpThread) wake.notify_one();
    return id;
  }

  // Runs the front task here when it is `id` and nothing runs, giving up at the end of a wait of
  // `timeout` (tWaitDeadline); false when it was not next.
  bool runIfNext(uint64_t id, milliseconds timeout) {
    std::function<void()> task;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (busy || tasks.empty() || tasks.front().first != id) return false;
      task = std::move(tasks.front().second);
      tasks.pop_front();
      busy = true;
    }
    struct Done {
      OpQueue& q;
      Clock::time_point deadline = tWaitDeadline;  // restored: a task may run inside a wait
      milliseconds timeout = tWaitTimeout;
      ~Done() {
        tWaitDeadline = deadline;
        tWaitTimeout = timeout;
        {
          std::lock_guard<std::mutex> lock(q.mutex);
          q.busy = false;
        }
        q.wake.notify_one();
      }
    } done{*this};
    tWaitTimeout = timeout;
    tWaitDeadline = comm::ShmOutcomeWork::deadlineFor(timeout);
    task();
    return true;
  }

  // The op thread: runs tasks until stop and none is left (nor running).
  void serve() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      if (!wake.wait_for(lock, kPoll, [&] { return !busy && (stop || !tasks.empty()); })) {
        continue;
      }
      if (tasks.empty()) return;
      std::function<void()> task = std::move(tasks.front().second);
      tasks.pop_front();
      busy = true;
      lock.unlock();
      task();
      lock.lock();
      busy = false;
    }
  }
};

class ShmWork final : public comm::ShmOutcomeWork {
 public:
  ShmWork(std::string what, std::shared_ptr<comm::ShmFailure> failure,
          std::shared_ptr<OpQueue> queue)
      : ShmOutcomeWork(std::move(what), std::move(failure)), queue_(std::move(queue)) {}
  void setId(uint64_t id) { id_ = id; }
  void wait(milliseconds timeout) override {
    // Run the collective here when it is next (it gives up where this wait would).
    if (!isCompleted()) queue_->runIfNext(id_, atLeastOneMs(timeout));
    // A timeout is final, as for every backend: the op thread gives up on the collective and
    // tells the other ranks.
    awaitUntil(deadlineFor(timeout), timeout);
  }

 private:
  std::shared_ptr<OpQueue> queue_;
  uint64_t id_ = 0;
};

}  // namespace

std::string hostIdentity() {
  // The pid namespace too: a rank tells a peer that exited from a late one by its pid.
  return fmt::format("boot {} net {} pid {} shm {}", firstLine("/proc/sys/kernel/random/boot_id"),
                     inodeOf("/proc/self/ns/net", false), inodeOf("/proc/self/ns/pid", false),
                     inodeOf("/dev/shm", true));
}

std::string segmentPrefix(const std::string& token) {
  return fmt::format("caravan-{:016x}-", std::hash<std::string>{}(token));
}

int removeSegments(const std::string& token) {
  const std::string prefix = segmentPrefix(token);
  int removed = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0 && ::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

std::vector<std::string> exchangeHostIdentities(c10d::Store& store, int rank, int size,
                                                milliseconds timeout) {
  claimRank(store, rank, size);  // a job's first rendezvous under auto/shm
  auto key = [](int r) { return fmt::format("caravan/host/{}", r); };
  const std::string mine = hostIdentity();
  store.set(key(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  // The job's first rendezvous under auto/shm: worded as Gloo's own (gloo_communicator.cpp).
  waitForRanks(store, rank, size, key, timeout, "arrived at the rendezvous");
  std::vector<std::string> hosts;
  for (int r = 0; r < size; ++r) {
    const std::vector<uint8_t> v = store.get(key(r));
    hosts.emplace_back(v.begin(), v.end());
  }
  return hosts;
}

struct ShmCommunicator::Impl {
  int rank = 0, size = 1;
  ShmOptions options;
  void* base = MAP_FAILED;
  int64_t bytes = 0;
  SegmentHeader* header = nullptr;
  RankWord* words = nullptr;
  char* data = nullptr;
  // The running task's alone (one at a time: OpQueue).
  uint64_t phase = 0;
  int buffer = 0;
  std::shared_ptr<comm::ShmFailure> failure = std::make_shared<comm::ShmFailure>();
  // The collectives to run, and the op thread that runs them.
  std::shared_ptr<OpQueue> queue = std::make_shared<OpQueue>();
  std::thread thread;
  std::unique_ptr<comm::ShmChannels> channels;  // send/recv

  ~Impl() {
    channels.reset();  // it writes into the segment until it is gone
    if (base != MAP_FAILED) ::munmap(base, bytes);
  }

  // Final here with `message`, and the other ranks learn that this one gave up.
  void giveUp(const std::string& message) {
    failure->fail(message);
    int64_t none = 0;
    header->failed.compare_exchange_strong(none, rank + 1, std::memory_order_acq_rel);
  }

  // Rank r's number in messages (options.globalRanks).
  int global(int r) const { return options.globalRanks.empty() ? r : options.globalRanks[r]; }

  char* slot(int b, int r) const {
    return data + (static_cast<int64_t>(b) * size + r) * options.slotBytes;
  }
  int nextBuffer() { return buffer ^= 1; }

  // Every rank arrives at the next phase; PeerError when one does not (see the header).
  void arrive(const char* op) {
    ++phase;
    words[rank].phase.store(phase, std::memory_order_release);
    const auto start = Clock::now();
    auto nextCheck = start + milliseconds(20);
    for (uint64_t spin = 0;; ++spin) {
      bool all = true;
      for (int r = 0; r < size && all; ++r) {
        all = words[r].phase.load(std::memory_order_acquire) >= phase;
      }
      if (all) return;
      if (spin < 64) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else if (spin < 4096) {
        ::sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      if ((spin & 63) != 0) continue;
      if (failure->abandon) {
        throw PeerError(failure->latch.get().value_or(
            fmt::format("rank {}: {} through shared memory was abandoned", global(rank), op)));
      }
      if (const int64_t gaveUp = header->failed.load(std::memory_order_acquire); gaveUp != 0) {
        throw PeerError(fmt::format(
            "rank {}: {} through shared memory: rank {} gave up on it (its log says why)",
            global(rank), op, global(static_cast<int>(gaveUp - 1))));
      }
      const auto now = Clock::now();
      if (now < nextCheck) continue;
      nextCheck = now + milliseconds(20);
      std::vector<int> late;
      for (int r = 0; r < size; ++r) {
        if (words[r].phase.load(std::memory_order_acquire) < phase) late.push_back(r);
      }
      for (int r : late) {
        const int64_t pid = words[r].pid.load(std::memory_order_acquire);
        if (pid > 0 && comm::processExited(pid)) {
          throw PeerError(fmt::format("rank {}: {} through shared memory: rank {} (pid {}) exited",
                                      global(rank), op, global(r), pid));
        }
      }
      for (int& r : late) r = global(r);
      if (now - start >= options.timeout) {
        throw PeerError(
            fmt::format("rank {}: {} through shared memory: {} did not arrive within {}",
                        global(rank), op, formatRanks(late), formatDuration(options.timeout)));
      }
      if (now >= tWaitDeadline) {  // run by a waiter whose wait ends here
        throw PeerError(fmt::format(
            "rank {}: {} through shared memory did not complete within {}; {} had not arrived",
            global(rank), op, formatDuration(tWaitTimeout), formatRanks(late)));
      }
    }
  }

  // Queues `task`, moving `bytes`, behind every collective issued before it (OpQueue).
  WorkPtr submit(const char* op, int64_t bytes, std::function<void()> task) {
    if (auto refused = failure->latch.refuseIfFailed()) return refused;
    auto work =
        std::make_shared<ShmWork>(fmt::format("rank {}: {}", global(rank), op), failure, queue);
    work->setId(queue->push(
        [this, work, task = std::move(task)] {
          if (auto message = failure->latch.get()) {
            giveUp(*message);  // the others may wait for this one in it
            work->finish(std::make_exception_ptr(PeerError(*message)));
            return;
          }
          try {
            task();
            work->finish(nullptr);
          } catch (const std::exception& e) {
            // Whatever stopped this rank mid-collective (a peer, an allocation), its phases no
            // longer line up with the others': final here, and the first to give up tells them.
            giveUp(e.what());
            work->finish(std::current_exception());
          }
        },
        bytes > options.deferBytes));
    return work;
  }

  // The collectives, on the op thread. Each chunk: copy in, a phase, read (shm_communicator.h).
  void allreduce(const at::Tensor& t, ReduceOp op) {
    const int64_t e = t.element_size(), n = t.numel(), cap = options.slotBytes / e;
    char* mine = static_cast<char*>(t.data_ptr());
    for (int64_t off = 0; off < n; off += cap) {
      const int64_t len = std::min(cap, n - off);
      const int b = nextBuffer();
      const auto [begin, count] = part(len, size, rank);
      // The others reduce the other slices: only those go through the slot.
      char* chunk = mine + off * e;
      std::memcpy(slot(b, rank), chunk, begin * e);
      std::memcpy(slot(b, rank) + (begin + count) * e, chunk + (begin + count) * e,
                  (len - begin - count) * e);
      arrive("allreduce");
      if (count > 0) {
        std::vector<const char*> parts;
        for (int r = 0; r < size; ++r) {
          parts.push_back(r == rank ? chunk + begin * e : slot(b, r) + begin * e);
        }
        reduceInto(parts, chunk + begin * e, slot(b, rank) + begin * e, count, t.scalar_type(), op,
                   size);
      }
      arrive("allreduce");
      for (int r = 0; r < size; ++r) {
        if (r == rank) continue;
        const auto [from, many] = part(len, size, r);
        std::memcpy(chunk + from * e, slot(b, r) + from * e, many * e);
      }
    }
  }

  void broadcast(const at::Tensor& t, int root) {
    const int64_t e = t.element_size(), n = t.numel(), cap = options.slotBytes / e;
    char* mine = static_cast<char*>(t.data_ptr());
    for (int64_t off = 0; off < n; off += cap) {
      const int64_t len = std::min(cap, n - off);
      const int b = nextBuffer();
      if (rank == root) std::memcpy(slot(b, root), mine + off * e, len * e);
      arrive("broadcast");
      if (rank != root) std::memcpy(mine + off * e, slot(b, root), len * e);
    }
  }

  void allgather(const at::Tensor& out, const at::Tensor& in) {
    const int64_t e = in.element_size(), n = in.numel(), cap = options.slotBytes / e;
    const char* mine = static_cast<const char*>(in.data_ptr());
    char* all = static_cast<char*>(out.data_ptr());
    for (int64_t off = 0; off < n; off += cap) {
      const int64_t len = std::min(cap, n - off);
      const int b = nextBuffer();
      std::memcpy(slot(b, rank), mine + off * e, len * e);
      arrive("allgather");
      for (int r = 0; r < size; ++r) std::memcpy(all + (r * n + off) * e, slot(b, r), len * e);
    }
  }

  void reduceScatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) {
    const int64_t e = in.element_size(), n = out.numel();
    const int64_t cap = options.slotBytes / e / size;
    const char* input = static_cast<const char*>(in.data_ptr());
    char* mine = static_cast<char*>(out.data_ptr());
    for (int64_t off = 0; off < n; off += cap) {
      const int64_t len = std::min(cap, n - off);
      const int b = nextBuffer();
      for (int r = 0; r < size; ++r) {
        if (r == rank) continue;  // reduced from the input itself
        std::memcpy(slot(b, rank) + r * len * e, input + (r * n + off) * e, len * e);
      }
      arrive("reduceScatter");
      std::vector<const char*> parts;
      for (int r = 0; r < size; ++r) {
        parts.push_back(r == rank ? input + (rank * n + off) * e : slot(b, r) + rank * len * e);
      }
      reduceInto(parts, mine + off * e, nullptr, len, in.scalar_type(), op, size);
    }
  }
};

ShmCommunicator::ShmCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                 ShmOptions options)
    : impl_(std::make_unique<Impl>()) {
  CARAVAN_CHECK(store && size >= 1 && rank >= 0 && rank < size, "shm: rank {} of {}", rank, size);
  CARAVAN_CHECK(options.slotBytes >= 64 * size && options.slotBytes % 64 == 0,
                "shm: slots of {} bytes for {} ranks", options.slotBytes, size);
  CARAVAN_CHECK(options.globalRanks.empty() || static_cast<int>(options.globalRanks.size()) == size,
                "shm: {} global rank numbers for {} ranks", options.globalRanks.size(), size);
  Impl& m = *impl_;
  m.rank = rank;
  m.size = size;
  const milliseconds join = options.joinTimeout.count() > 0 ? options.joinTimeout : options.timeout;
  m.options = std::move(options);
  const std::string nameKey = "caravan/shm/name";
  std::string name;
  if (rank == 0) {
    std::random_device random;
    const uint64_t nonce = (static_cast<uint64_t>(random()) << 32) ^ random();
    name = fmt::format("/{}{:016x}", segmentPrefix(m.options.token), nonce);
  }
  // The name goes as soon as every rank mapped it (or rank 0 gives up waiting).
  struct Unlink {
    std::string name;
    ~Unlink() {
      if (!name.empty()) ::shm_unlink(name.c_str());
    }
  } unlink;
  int fd = -1;
  if (rank == 0) {
    try {
      m.options.slotBytes = fittingSlot(size, m.options.slotBytes, m.global(0));
      m.bytes = segmentBytes(size, m.options.slotBytes);
      fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        throw IoError(systemError(fmt::format(
            "rank {}: cannot create the shared-memory segment /dev/shm{}", m.global(0), name)));
      }
      unlink.name = name;
      // Reserve the pages now: a full /dev/shm is one line here, not a SIGBUS mid-collective.
      if (const int err = ::posix_fallocate(fd, 0, m.bytes); err != 0) {
        ::close(fd);
        throw IoError(
            fmt::format("rank {}: cannot reserve {} MiB of shared memory in /dev/shm ({})",
                        m.global(0), m.bytes >> 20, std::strerror(err)));
      }
    } catch (const std::exception& e) {
      // The others learn why now rather than at their join timeout ("!" + the reason).
      const std::string why = std::string("!") + e.what();
      store->set(nameKey, std::vector<uint8_t>(why.begin(), why.end()));
      throw ShmUnavailable(e.what());
    }
  } else {
    try {
      store->wait({nameKey}, join);
    } catch (const std::exception& e) {
      throw PeerError(
          fmt::format("rank {}: rank {} did not make the shared-memory segment within {} "
                      "({})",
                      m.global(rank), m.global(0), formatDuration(join), comm::errorLine(e)));
    }
    const std::vector<uint8_t> v = store->get(nameKey);
    name.assign(v.begin(), v.end());
    if (!name.empty() && name[0] == '!') {
      throw ShmUnavailable(
          fmt::format("rank {}: no shared-memory segment: {}", m.global(rank), name.substr(1)));
    }
    fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0)
      throw IoError(systemError(fmt::format("rank {}: cannot open {}", m.global(rank), name)));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size < headerBytes(size)) {
      ::close(fd);
      throw ConfigError(fmt::format(
          "rank {}: the shared-memory segment {} has {} bytes, too few for {} ranks; every "
          "rank must run the same caravan with the same world size",
          m.global(rank), name, static_cast<int64_t>(st.st_size), size));
    }
    m.bytes = st.st_size;  // rank 0 chose the slots (fittingSlot)
  }
  m.base = ::mmap(nullptr, m.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m.base == MAP_FAILED) {
    throw IoError(systemError(fmt::format("rank {}: cannot map {}", m.global(rank), name)));
  }
  m.header = static_cast<SegmentHeader*>(m.base);
  m.words = reinterpret_cast<RankWord*>(static_cast<char*>(m.base) + sizeof(SegmentHeader));
  m.data = static_cast<char*>(m.base) + headerBytes(size);
  if (rank == 0) {
    // Laid out before anyone learns the name (the store orders it before their reads).
    m.header->magic = kShmMagic;
    m.header->size = size;
    m.header->slotBytes = m.options.slotBytes;
    m.header->failed.store(0);
    store->set(nameKey, std::vector<uint8_t>(name.begin(), name.end()));
  } else if (m.header->magic != kShmMagic || m.header->size != size ||
             segmentBytes(size, m.header->slotBytes) != m.bytes) {
    throw ConfigError(fmt::format(
        "rank {}: the shared-memory segment {} was laid out for another version of caravan or "
        "another world size",
        m.global(rank), name));
  } else {
    m.options.slotBytes = m.header->slotBytes;
  }
  comm::ShmChannels::Layout channels;
  channels.rank = rank;
  channels.size = size;
  channels.rings = m.data + 2 * static_cast<int64_t>(size) * m.options.slotBytes;
  channels.ringBytes = ringBytesFor(size, m.options.slotBytes);
  channels.bells = reinterpret_cast<comm::ShmDoorbell*>(reinterpret_cast<char*>(m.words) +
                                                        size * sizeof(RankWord));
  channels.pidOf = [words = m.words](int r) {
    return words[r].pid.load(std::memory_order_acquire);
  };
  channels.failedWord = &m.header->failed;
  channels.global = [&m](int r) { return m.global(r); };
  m.channels =
      std::make_unique<comm::ShmChannels>(std::move(channels), m.options.timeout, m.failure,
                                          [&m](const std::string& message) { m.giveUp(message); });
  auto mapped = [](int r) { return fmt::format("caravan/shm/mapped/{}", r); };
  m.words[rank].pid.store(::getpid(), std::memory_order_release);
  store->set(mapped(rank), std::vector<uint8_t>{1});
  if (rank == 0) waitForRanks(*store, rank, size, mapped, join, "mapped the shared-memory segment");
  m.thread = std::thread([queue = m.queue] { queue->serve(); });
}

ShmCommunicator::~ShmCommunicator() {
  {
    std::lock_guard<std::mutex> lock(impl_->queue->mutex);
    impl_->queue->stop = true;
  }
  impl_->queue->wake.notify_one();
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->channels.reset();  // writes the sends issued, then marks this rank closed
}

int ShmCommunicator::rank() const { return impl_->rank; }
int ShmCommunicator::size() const { return impl_->size; }
milliseconds ShmCommunicator::timeout() const { return impl_->options.timeout; }

WorkPtr ShmCommunicator::allreduce(at::Tensor tensor, ReduceOp op) {
  comm::checkTensor(tensor, "allreduce", "tensor");
  comm::checkReducible(tensor, op, "allreduce");
  if (auto refused = impl_->failure->latch.refuseIfFailed()) return refused;
  if (tensor.numel() == 0) return std::make_shared<comm::ReadyWork>();
  return impl_->submit("allreduce", tensor.nbytes(),
                       [this, tensor, op] { impl_->allreduce(tensor, op); });
}

WorkPtr ShmCommunicator::broadcast(at::Tensor tensor, int root) {
  comm::checkTensor(tensor, "broadcast", "tensor");
  CARAVAN_CHECK(root >= 0 && root < impl_->size, "broadcast from rank {} of {}", root, impl_->size);
  if (auto refused = impl_->failure->latch.refuseIfFailed()) return refused;
  if (tensor.numel() == 0) return std::make_shared<comm::ReadyWork>();
  return impl_->submit("broadcast", tensor.nbytes(),
                       [this, tensor, root] { impl_->broadcast(tensor, root); });
}

WorkPtr ShmCommunicator::allgather(at::Tensor output, at::Tensor input) {
  comm::checkTensor(output, "allgather", "output");
  comm::checkTensor(input, "allgather", "input");
  CARAVAN_CHECK(
      output.numel() == input.numel() * impl_->size && output.scalar_type() == input.scalar_type(),
      "allgather: output {} for input {} on {} ranks", comm::describeTensor(output),
      comm::describeTensor(input), impl_->size);
  if (auto refused = impl_->failure->latch.refuseIfFailed()) return refused;
  if (input.numel() == 0) return std::make_shared<comm::ReadyWork>();
  return impl_->submit("allgather", output.nbytes(),
                       [this, output, input] { impl_->allgather(output, input); });
}

WorkPtr ShmCommunicator::reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) {
  comm::checkTensor(output, "reduceScatter", "output");
  comm::checkTensor(input, "reduceScatter", "input");
  comm::checkReducible(input, op, "reduceScatter");
  CARAVAN_CHECK(
      input.numel() == output.numel() * impl_->size && output.scalar_type() == input.scalar_type(),
      "reduceScatter: output {} for input {} on {} ranks", comm::describeTensor(output),
      comm::describeTensor(input), impl_->size);
  if (auto refused = impl_->failure->latch.refuseIfFailed()) return refused;
  if (output.numel() == 0) return std::make_shared<comm::ReadyWork>();
  return impl_->submit("reduceScatter", input.nbytes(),
                       [this, output, input, op] { impl_->reduceScatter(output, input, op); });
}

WorkPtr ShmCommunicator::send(at::Tensor tensor, int dstRank, int tag) {
  comm::checkTensor(tensor, "send", "tensor");
  CARAVAN_CHECK(dstRank >= 0 && dstRank < impl_->size && tag >= 0, "send to rank {} of {}, tag {}",
                dstRank, impl_->size, tag);
  return impl_->channels->send(tensor, dstRank, tag);
}

WorkPtr ShmCommunicator::recv(at::Tensor tensor, int srcRank, int tag) {
  comm::checkTensor(tensor, "recv", "tensor");
  CARAVAN_CHECK(srcRank >= 0 && srcRank < impl_->size && tag >= 0,
                "recv from rank {} of {}, tag {}", srcRank, impl_->size, tag);
  return impl_->channels->recv(tensor, srcRank, tag);
}

void ShmCommunicator::fail(const std::string& message) { impl_->giveUp(message); }

WorkPtr ShmCommunicator::barrier() {
  return impl_->submit("barrier", 0, [this] { impl_->arrive("barrier"); });
}

}  // namespace caravan
