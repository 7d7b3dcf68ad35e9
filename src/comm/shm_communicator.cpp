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
#include "comm/store.h"
#include "core/errors.h"

namespace caravan {

using comm::atLeastOneMs;
using comm::formatDuration;
using comm::formatRanks;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kMagic = 0x3163617261766e73;  // the layout's version

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

int64_t headerBytes(int size) {
  const int64_t raw = static_cast<int64_t>(sizeof(SegmentHeader) + size * sizeof(RankWord));
  return (raw + 4095) / 4096 * 4096;
}

int64_t segmentBytes(int size, int64_t slotBytes) {
  return headerBytes(size) + 2 * static_cast<int64_t>(size) * slotBytes;
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

// The process is gone, or a zombie its parent has not reaped yet (it will never arrive).
bool exited(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const size_t close = line.rfind(')');  // the state follows the command name's ")"
  return close != std::string::npos && close + 2 < line.size() &&
         (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

std::string systemError(const std::string& what) {
  return fmt::format("{}: {}", what, std::strerror(errno));
}

// The slot size rank 0 lays out: `wanted`, or less when the segment would take more than half of
// what /dev/shm has free (a container's is often 64 MiB); IoError when not even 64 bytes per
// rank fit.
int64_t fittingSlot(int size, int64_t wanted) {
  struct statvfs fs {};
  if (::statvfs("/dev/shm", &fs) != 0) return wanted;
  const int64_t budget = static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize) / 2;
  const int64_t fits = (budget - headerBytes(size)) / (2 * static_cast<int64_t>(size)) / 64 * 64;
  if (fits < 64 * size) {
    throw IoError(fmt::format(
        "rank 0: /dev/shm has {} KiB free, too little for the shared-memory collectives of {} "
        "ranks; free space there or use dist.backend = gloo",
        2 * budget >> 10, size));
  }
  return std::min(wanted, fits);
}

at::Tensor view(char* at, int64_t n, at::ScalarType type) {
  return at::from_blob(at, {n}, at::TensorOptions().dtype(type));
}

// out = the reduction of `parts` in their order; bfloat16 in float32, rounded once; AVG divides
// the sum by `size`.
void reduceInto(at::Tensor out, const std::vector<at::Tensor>& parts, ReduceOp op, int size) {
  const bool widen = out.scalar_type() == at::kBFloat16;
  at::Tensor acc = widen ? parts[0].to(at::kFloat) : out.copy_(parts[0]);
  for (size_t k = 1; k < parts.size(); ++k) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc.add_(parts[k]); break;
      case ReduceOp::kMax: at::maximum_out(acc, acc, parts[k]); break;
      case ReduceOp::kMin: at::minimum_out(acc, acc, parts[k]); break;
    }
  }
  if (op == ReduceOp::kAvg) acc.div_(size);
  if (widen) out.copy_(acc);
}

// Element range [begin, begin + count) of part r when n elements are split in `size` parts.
std::pair<int64_t, int64_t> part(int64_t n, int size, int r) {
  const int64_t base = n / size, extra = n % size;
  return {r * base + std::min<int64_t>(r, extra), base + (r < extra ? 1 : 0)};
}

// What the communicator's Works share with it (a Work may outlive it): the first failure, and
// the word that tells the op thread to give up on the collective it waits in.
struct FailureState {
  comm::FailureLatch latch;
  std::atomic<bool> abandon{false};
  void fail(const std::string& message) {
    latch.set(message);
    abandon = true;
  }
};

class ShmWork final : public Work {
 public:
  ShmWork(std::string what, int rank, std::shared_ptr<FailureState> failure)
      : what_(std::move(what)), rank_(rank), failure_(std::move(failure)) {}
  // The first outcome stays (a wait that timed out already decided it).
  void finish(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    done_ = true;
    error_ = std::move(error);
    wake_.notify_all();
  }
  void wait(milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!wake_.wait_for(lock, atLeastOneMs(timeout), [&] { return done_; })) {
      // Final, as for every backend: the op thread gives up on it and tells the other ranks.
      const std::string message =
          fmt::format("rank {}: {} through shared memory did not complete within {}", rank_, what_,
                      formatDuration(atLeastOneMs(timeout)));
      failure_->fail(message);
      done_ = true;
      error_ = std::make_exception_ptr(PeerError(message));
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

 private:
  std::string what_;
  int rank_;
  std::shared_ptr<FailureState> failure_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false;
  std::exception_ptr error_;
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
  std::shared_ptr<Communicator> pointToPoint;
  void* base = MAP_FAILED;
  int64_t bytes = 0;
  SegmentHeader* header = nullptr;
  RankWord* words = nullptr;
  char* data = nullptr;
  // The op thread's alone.
  uint64_t phase = 0;
  int buffer = 0;
  std::shared_ptr<FailureState> failure = std::make_shared<FailureState>();
  // The op thread and its queue.
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<std::function<void()>> queue;
  bool stop = false;
  std::thread thread;

  ~Impl() {
    if (base != MAP_FAILED) ::munmap(base, bytes);
  }

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
            fmt::format("rank {}: {} through shared memory was abandoned", rank, op)));
      }
      if (const int64_t gaveUp = header->failed.load(std::memory_order_acquire); gaveUp != 0) {
        throw PeerError(fmt::format(
            "rank {}: {} through shared memory: rank {} gave up on it (its log says why)", rank, op,
            gaveUp - 1));
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
        if (pid > 0 && exited(static_cast<pid_t>(pid))) {
          throw PeerError(fmt::format("rank {}: {} through shared memory: rank {} (pid {}) exited",
                                      rank, op, r, pid));
        }
      }
      if (now - start >= options.timeout) {
        throw PeerError(
            fmt::format("rank {}: {} through shared memory: {} did not arrive within {}", rank, op,
                        formatRanks(late), formatDuration(options.timeout)));
      }
    }
  }

  WorkPtr submit(const char* op, std::function<void()> task) {
    if (auto refused = failure->latch.refuseIfFailed()) return refused;
    auto work = std::make_shared<ShmWork>(op, rank, failure);
    {
      std::lock_guard<std::mutex> lock(mutex);
      queue.push_back([this, work, task = std::move(task)] {
        if (auto message = failure->latch.get()) {
          work->finish(std::make_exception_ptr(PeerError(*message)));
          return;
        }
        try {
          task();
          work->finish(nullptr);
        } catch (const std::exception& e) {
          // Whatever stopped this rank mid-collective (a peer, an allocation), its phases no
          // longer line up with the others': final here, and the first to give up tells them.
          failure->fail(e.what());
          int64_t none = 0;
          header->failed.compare_exchange_strong(none, rank + 1, std::memory_order_acq_rel);
          work->finish(std::current_exception());
        }
      });
    }
    wake.notify_one();
    return work;
  }

  void run() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
      }
      task();
    }
  }

  // The collectives, on the op thread. Each chunk: copy in, a phase, read (shm_communicator.h).
  void allreduce(const at::Tensor& t, ReduceOp op) {
    const int64_t e = t.element_size(), n = t.numel(), cap = options.slotBytes / e;
    char* mine = static_cast<char*>(t.data_ptr());
    for (int64_t off = 0; off < n; off += cap) {
      const int64_t len = std::min(cap, n - off);
      const int b = nextBuffer();
      std::memcpy(slot(b, rank), mine + off * e, len * e);
      arrive("allreduce");
      const auto [begin, count] = part(len, size, rank);
      if (count > 0) {
        std::vector<at::Tensor> parts;
        for (int r = 0; r < size; ++r) {
          parts.push_back(view(slot(b, r) + begin * e, count, t.scalar_type()));
        }
        at::Tensor out = view(mine + (off + begin) * e, count, t.scalar_type());
        reduceInto(out, parts, op, size);
        std::memcpy(slot(b, rank) + begin * e, out.data_ptr(), count * e);
      }
      arrive("allreduce");
      for (int r = 0; r < size; ++r) {
        if (r == rank) continue;
        const auto [from, many] = part(len, size, r);
        std::memcpy(mine + (off + from) * e, slot(b, r) + from * e, many * e);
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
        std::memcpy(slot(b, rank) + r * len * e, input + (r * n + off) * e, len * e);
      }
      arrive("reduceScatter");
      std::vector<at::Tensor> parts;
      for (int r = 0; r < size; ++r) {
        parts.push_back(view(slot(b, r) + rank * len * e, len, in.scalar_type()));
      }
      reduceInto(view(mine + off * e, len, out.scalar_type()), parts, op, size);
    }
  }
};

ShmCommunicator::ShmCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                 ShmOptions options, std::shared_ptr<Communicator> pointToPoint)
    : impl_(std::make_unique<Impl>()) {
  CARAVAN_CHECK(store && size >= 1 && rank >= 0 && rank < size, "shm: rank {} of {}", rank, size);
  CARAVAN_CHECK(pointToPoint && pointToPoint->rank() == rank && pointToPoint->size() == size,
                "shm: the point-to-point communicator is not rank {} of {}", rank, size);
  CARAVAN_CHECK(options.slotBytes >= 64 * size && options.slotBytes % 64 == 0,
                "shm: slots of {} bytes for {} ranks", options.slotBytes, size);
  Impl& m = *impl_;
  m.rank = rank;
  m.size = size;
  const milliseconds join = options.joinTimeout.count() > 0 ? options.joinTimeout : options.timeout;
  m.options = std::move(options);
  m.pointToPoint = std::move(pointToPoint);
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
      m.options.slotBytes = fittingSlot(size, m.options.slotBytes);
      m.bytes = segmentBytes(size, m.options.slotBytes);
      fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) throw IoError(systemError(fmt::format("rank 0: cannot create {}", name)));
      unlink.name = name;
      // Reserve the pages now: a full /dev/shm is one line here, not a SIGBUS mid-collective.
      if (const int err = ::posix_fallocate(fd, 0, m.bytes); err != 0) {
        ::close(fd);
        throw IoError(fmt::format(
            "rank 0: cannot reserve {} MiB of shared memory in /dev/shm ({}); free space "
            "there or use dist.backend = gloo",
            m.bytes >> 20, std::strerror(err)));
      }
    } catch (const std::exception& e) {
      // The others learn why now rather than at their join timeout ("!" + the reason).
      const std::string why = std::string("!") + e.what();
      store->set(nameKey, std::vector<uint8_t>(why.begin(), why.end()));
      throw;
    }
  } else {
    try {
      store->wait({nameKey}, join);
    } catch (const std::exception& e) {
      throw PeerError(
          fmt::format("rank {}: rank 0 did not make the shared-memory segment within {} "
                      "({})",
                      rank, formatDuration(join), comm::errorLine(e)));
    }
    const std::vector<uint8_t> v = store->get(nameKey);
    name.assign(v.begin(), v.end());
    if (!name.empty() && name[0] == '!') {
      throw IoError(fmt::format("rank {}: no shared-memory segment: {}", rank, name.substr(1)));
    }
    fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) throw IoError(systemError(fmt::format("rank {}: cannot open {}", rank, name)));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size < headerBytes(size)) {
      ::close(fd);
      throw ConfigError(fmt::format(
          "rank {}: the shared-memory segment {} has {} bytes, too few for {} ranks; every "
          "rank must run the same caravan with the same world size",
          rank, name, static_cast<int64_t>(st.st_size), size));
    }
    m.bytes = st.st_size;  // rank 0 chose the slots (fittingSlot)
  }
  m.base = ::mmap(nullptr, m.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m.base == MAP_FAILED) {
    throw IoError(systemError(fmt::format("rank {}: cannot map {}", rank, name)));
  }
  m.header = static_cast<SegmentHeader*>(m.base);
  m.words = reinterpret_cast<RankWord*>(static_cast<char*>(m.base) + sizeof(SegmentHeader));
  m.data = static_cast<char*>(m.base) + headerBytes(size);
  if (rank == 0) {
    // Laid out before anyone learns the name (the store orders it before their reads).
    m.header->magic = kMagic;
    m.header->size = size;
    m.header->slotBytes = m.options.slotBytes;
    m.header->failed.store(0);
    store->set(nameKey, std::vector<uint8_t>(name.begin(), name.end()));
  } else if (m.header->magic != kMagic || m.header->size != size ||
             segmentBytes(size, m.header->slotBytes) != m.bytes) {
    throw ConfigError(fmt::format(
        "rank {}: the shared-memory segment {} was laid out for another version of caravan or "
        "another world size",
        rank, name));
  } else {
    m.options.slotBytes = m.header->slotBytes;
  }
  auto mapped = [](int r) { return fmt::format("caravan/shm/mapped/{}", r); };
  m.words[rank].pid.store(::getpid(), std::memory_order_release);
  store->set(mapped(rank), std::vector<uint8_t>{1});
  if (rank == 0) waitForRanks(*store, rank, size, mapped, join, "mapped the shared-memory segment");
  m.thread = std::thread([this] { impl_->run(); });
}

ShmCommunicator::~ShmCommunicator() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stop = true;
  }
  impl_->wake.notify_one();
  if (impl_->thread.joinable()) impl_->thread.join();
}

int ShmCommunicator::rank() const { return impl_->rank; }
int ShmCommunicator::size() const { return impl_->size; }
milliseconds ShmCommunicator::timeout() const { return impl_->options.timeout; }

WorkPtr ShmCommunicator::allreduce(at::Tensor tensor, ReduceOp op) {
  comm::checkTensor(tensor, "allreduce", "tensor");
  comm::checkReducible(tensor, op, "allreduce");
  if (auto refused = impl_->failure->latch.refuseIfFailed()) return refused;
  if (tensor.numel() == 0) return std::make_shared<comm::ReadyWork>();
  return impl_->submit("allreduce", [this, tensor, op] { impl_->allreduce(tensor, op); });
}

WorkPtr ShmCommunicator::broadcast(at::Tensor tensor, int root) {
  comm::checkTensor(tensor, "broadcast", "tensor");
  CARAVAN_CHECK(root >= 0 && root < impl_->size, "broadcast from rank {} of {}", root, impl_->size);
  if (auto refused = impl_->failure->latch.refuseIfFailed()) return refused;
  if (tensor.numel() == 0) return std::make_shared<comm::ReadyWork>();
  return impl_->submit("broadcast", [this, tensor, root] { impl_->broadcast(tensor, root); });
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
  return impl_->submit("allgather", [this, output, input] { impl_->allgather(output, input); });
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
  return impl_->submit("reduceScatter",
                       [this, output, input, op] { impl_->reduceScatter(output, input, op); });
}

WorkPtr ShmCommunicator::send(at::Tensor tensor, int dstRank, int tag) {
  return impl_->pointToPoint->send(std::move(tensor), dstRank, tag);
}

WorkPtr ShmCommunicator::recv(at::Tensor tensor, int srcRank, int tag) {
  return impl_->pointToPoint->recv(std::move(tensor), srcRank, tag);
}

WorkPtr ShmCommunicator::barrier() {
  return impl_->submit("barrier", [this] { impl_->arrive("barrier"); });
}

}  // namespace caravan
