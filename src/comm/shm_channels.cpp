// ShmChannels (see shm_channels.h).
#include "comm/shm_channels.h"

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/errors.h"

namespace caravan::comm {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

bool processExited(int64_t pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const size_t close = line.rfind(')');  // the state follows the command name's ")"
  return close != std::string::npos && close + 2 < line.size() &&
         (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

void ShmOutcomeWork::finish(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (done_) return;
  done_ = true;
  error_ = std::move(error);
  wake_.notify_all();
}

Clock::time_point ShmOutcomeWork::deadlineFor(milliseconds timeout) {
  return Clock::now() + std::min(atLeastOneMs(timeout), milliseconds(std::chrono::hours(24 * 365)));
}

bool ShmOutcomeWork::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void ShmOutcomeWork::awaitUntil(Clock::time_point deadline, milliseconds timeout,
                                const std::function<void(const std::string&)>& onTimeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!wake_.wait_until(lock, deadline, [&] { return done_; })) {
    const std::string message = fmt::format("{} through shared memory did not complete within {}",
                                            what_, formatDuration(atLeastOneMs(timeout)));
    failure_->fail(message);
    done_ = true;
    error_ = std::make_exception_ptr(PeerError(message));
    lock.unlock();
    if (onTimeout) onTimeout(message);
    std::rethrow_exception(error_);
  }
  if (error_) std::rethrow_exception(error_);
}

namespace {

// A ring's counters, each on its own cache line: only the writer moves `head`, only the
// reader `tail`; bytes [tail, head) of the stream are in the ring.
struct alignas(64) RingIndex {
  std::atomic<uint64_t> head;
  char padHead[56];
  std::atomic<uint64_t> tail;
  char padTail[56];
};
static_assert(sizeof(RingIndex) == 128, "a ring's counters take two cache lines");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word is 32 bits");

struct MessageHeader {
  int64_t tag;
  int64_t bytes;
};
constexpr int64_t kHeaderBytes = sizeof(MessageHeader);
static_assert(kHeaderBytes == 16, "headers are 16 bytes, the stream's alignment");

int64_t padded(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Writers publish the head, and readers the tail, at least every kPiece bytes, so a large
// message's reader starts while the rest is being written (a pipeline, not ring-sized turns).
constexpr int64_t kPiece = 64 << 10;

struct Ring {
  RingIndex* index;
  char* data;
  int64_t capacity;
  void put(uint64_t at, const char* from, int64_t n) const {
    const int64_t offset = static_cast<int64_t>(at % static_cast<uint64_t>(capacity));
    const int64_t first = std::min(n, capacity - offset);
    std::memcpy(data + offset, from, first);
    std::memcpy(data, from + first, n - first);
  }
  void get(uint64_t at, char* to, int64_t n) const {
    const int64_t offset = static_cast<int64_t>(at % static_cast<uint64_t>(capacity));
    const int64_t first = std::min(n, capacity - offset);
    std::memcpy(to, data + offset, first);
    std::memcpy(to + first, data, n - first);
  }
};

uint32_t* futexWord(std::atomic<uint32_t>* word) { return reinterpret_cast<uint32_t*>(word); }

// Shared (not FUTEX_PRIVATE): the word is in memory other processes map.
void futexWait(std::atomic<uint32_t>* word, uint32_t expected, milliseconds timeout) {
  timespec ts{};
  ts.tv_sec = timeout.count() / 1000;
  ts.tv_nsec = (timeout.count() % 1000) * 1000000;
  ::syscall(SYS_futex, futexWord(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, futexWord(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// What a waiting thread may do meanwhile: move bytes itself (the channels, while they exist).
class Pump {
 public:
  virtual ~Pump() = default;
  // One pass over the rings; false once the channels are closed.
  virtual bool pumpOnce(bool& moved) = 0;
  // A wait timed out: fail what is pending now (the ops leave the queues before the waiter
  // returns) and tell the other ranks.
  virtual void failNow(const std::string& message) = 0;
};

// A waiter helps while bytes move and for kHelpIdle after they last did, then sleeps (the
// progress thread goes on). Helping saves the hand-off from the progress thread to the waiter
// (a wake-up each way: about 20 us of a 4 KB message's 46 us here), and a waiter that streams
// a large message keeps the ring busy rather than waiting for the progress thread to wake.
constexpr std::chrono::microseconds kHelpIdle{200};

void relax(int spin) {
  if (spin < 64) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else {
    ::sched_yield();
  }
}

class ChannelWork final : public ShmOutcomeWork {
 public:
  ChannelWork(std::string what, std::shared_ptr<ShmFailure> failure, std::weak_ptr<Pump> pump)
      : ShmOutcomeWork(std::move(what), std::move(failure)), pump_(std::move(pump)) {}
  void wait(milliseconds timeout) override {
    const auto deadline = deadlineFor(timeout);
    help(deadline);
    // A timeout is final, as for every backend: what is pending fails now, and the other ranks
    // learn it.
    awaitUntil(deadline, timeout, [this](const std::string& message) {
      if (const std::shared_ptr<Pump> pump = pump_.lock()) pump->failNow(message);
    });
  }

 private:
  // Moves bytes on this thread until done, `deadline`, or kHelpIdle without progress.
  void help(Clock::time_point deadline) {
    auto idleSince = Clock::now();
    for (int spin = 0; !isCompleted(); ++spin) {
      const std::shared_ptr<Pump> pump = pump_.lock();
      bool moved = false;
      if (!pump || !pump->pumpOnce(moved)) return;
      const auto now = Clock::now();
      if (now >= deadline) return;
      if (moved) {
        idleSince = now;
        spin = 0;
      } else if (now - idleSince >= kHelpIdle) {
        return;
      }
      relax(spin);
    }
  }

  std::weak_ptr<Pump> pump_;
};

using WorkHandle = std::shared_ptr<ChannelWork>;

}  // namespace

struct ShmChannels::Impl final : Pump {
  Layout layout;
  milliseconds timeout{0};
  std::shared_ptr<ShmFailure> failure;
  std::function<void(const std::string&)> giveUp;

  struct SendOp {
    WorkHandle work;
    at::Tensor tensor;
    int64_t tag = 0;
    int64_t sent = 0;  // bytes of its stream (header, payload, padding) in the ring
  };
  struct RecvOp {
    WorkHandle work;
    at::Tensor tensor;
  };
  // The message being read from a source: into a posted recv's tensor (work set) or a buffer.
  struct Incoming {
    bool active = false;
    int64_t tag = 0, bytes = 0, got = 0;  // got: bytes of payload and padding read
    at::Tensor into;
    WorkHandle work;
  };
  using Key = std::pair<int, int64_t>;  // (source, tag)

  std::mutex mutex;  // everything below, and the writes into this rank's outgoing rings
  std::vector<std::deque<SendOp>> sends;  // per destination, in issue order
  std::vector<Incoming> incoming;         // per source
  std::map<Key, std::deque<RecvOp>> posted;
  std::map<Key, std::deque<at::Tensor>> early;  // whole messages no recv was posted for yet
  bool stop = false;
  bool closed = false;  // the destructor ran: the segment may be gone
  bool dead = false;    // failed for good: nothing moves any more
  Clock::time_point stopAt;
  std::thread thread;  // the progress thread, started at the first send or recv

  int rank() const { return layout.rank; }
  int global(int r) const { return layout.global ? layout.global(r) : r; }

  Ring ring(int src, int dst) const {
    const int64_t stride = static_cast<int64_t>(sizeof(RingIndex)) + layout.ringBytes;
    char* at = layout.rings + (static_cast<int64_t>(src) * layout.size + dst) * stride;
    return Ring{reinterpret_cast<RingIndex*>(at), at + sizeof(RingIndex), layout.ringBytes};
  }

  void ringBell(int r) {
    ShmDoorbell& bell = layout.bells[r];
    bell.seq.fetch_add(1, std::memory_order_seq_cst);
    if (bell.sleeping.load(std::memory_order_seq_cst) != 0) futexWake(&bell.seq);
  }

  void start() {
    if (!thread.joinable()) thread = std::thread([this] { serve(); });
  }

  // Fails every pending operation with `message`, final for the communicator (lock held).
  void failAll(const std::string& message) {
    giveUp(message);
    dead = true;
    layout.bells[rank()].gaveUp.store(1, std::memory_order_release);
    const auto error = std::make_exception_ptr(PeerError(failure->latch.get().value_or(message)));
    for (auto& queue : sends) {
      for (auto& op : queue) op.work->finish(error);
      queue.clear();
    }
    for (auto& [key, queue] : posted) {
      for (auto& op : queue) op.work->finish(error);
    }
    posted.clear();
    for (auto& in : incoming) {
      if (in.work) in.work->finish(error);
      in = Incoming{};
    }
    early.clear();
  }

  // Writes what fits of the sends to `dst`, oldest first (lock held); true when any byte moved.
  bool writeSends(int dst) {
    auto& queue = sends[dst];
    if (queue.empty()) return false;
    const Ring r = ring(rank(), dst);
    const uint64_t start = r.index->head.load(std::memory_order_relaxed);
    uint64_t head = start;
    int64_t room =
        r.capacity - static_cast<int64_t>(head - r.index->tail.load(std::memory_order_acquire));
    std::vector<WorkHandle> written;
    while (!queue.empty() && room > 0) {
      SendOp& op = queue.front();
      const int64_t bytes = static_cast<int64_t>(op.tensor.nbytes());
      if (op.sent == 0) {
        if (room < kHeaderBytes) break;
        const MessageHeader header{op.tag, bytes};
        r.put(head, reinterpret_cast<const char*>(&header), kHeaderBytes);
        head += kHeaderBytes;
        room -= kHeaderBytes;
        op.sent = kHeaderBytes;
      }
      const int64_t total = kHeaderBytes + padded(bytes);
      const int64_t n = std::min({room, total - op.sent, kPiece});
      const int64_t from = op.sent - kHeaderBytes;
      const int64_t payload = std::clamp<int64_t>(bytes - from, 0, n);
      if (payload > 0) r.put(head, static_cast<const char*>(op.tensor.data_ptr()) + from, payload);
      head += n;
      room -= n;
      op.sent += n;
      if (n == kPiece) {
        r.index->head.store(head, std::memory_order_release);
        ringBell(dst);
      }
      if (op.sent == total) {
        written.push_back(std::move(op.work));
        queue.pop_front();
      }
    }
    if (head == start) return false;
    r.index->head.store(head, std::memory_order_release);
    ringBell(dst);
    for (auto& work : written) work->finish(nullptr);
    return true;
  }

  // A message of `bytes` from `src` for `op`, whose tensor has another size: final; `op`, in no
  // queue any more, fails too.
  void refuseSizeMismatch(const RecvOp& op, int src, int64_t tag, int64_t bytes) {
    failAll(fmt::format(
        "rank {}: recv from rank {} (tag {}) through shared memory: the message has {} bytes, "
        "the tensor {} ({}); sender and receiver must agree on sizes",
        global(rank()), global(src), tag, bytes, op.tensor.nbytes(), describeTensor(op.tensor)));
    op.work->finish(std::make_exception_ptr(PeerError(*failure->latch.get())));
  }

  // Copies a whole early message into a recv's tensor; false (and final) on a size mismatch.
  bool deliver(const at::Tensor& buffer, const RecvOp& op, int src, int64_t tag) {
    if (buffer.nbytes() != op.tensor.nbytes()) {
      refuseSizeMismatch(op, src, tag, static_cast<int64_t>(buffer.nbytes()));
      return false;
    }
    std::memcpy(op.tensor.data_ptr(), buffer.data_ptr(), buffer.nbytes());
    op.work->finish(nullptr);
    return true;
  }

  // A message from `src` begins: into the oldest recv posted for it, or a buffer (lock held).
  // False when it cannot be received (final).
  bool begin(int src, const MessageHeader& header) {
    Incoming& in = incoming[src];
    in = Incoming{};
    in.active = true;
    in.tag = header.tag;
    in.bytes = header.bytes;
    auto it = posted.find({src, header.tag});
    if (it != posted.end()) {
      RecvOp op = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) posted.erase(it);
      if (static_cast<int64_t>(op.tensor.nbytes()) != header.bytes) {
        refuseSizeMismatch(op, src, header.tag, header.bytes);
        return false;
      }
      in.into = op.tensor;
      in.work = std::move(op.work);
    } else {
      in.into = at::empty({header.bytes}, at::kByte);
    }
    return true;
  }

  // The message from `src` is whole (lock held).
  void complete(int src) {
    Incoming in = std::move(incoming[src]);
    incoming[src] = Incoming{};
    if (in.work) {
      in.work->finish(nullptr);
      return;
    }
    // A recv posted while it streamed into a buffer takes it now.
    const Key key{src, in.tag};
    auto it = posted.find(key);
    if (it == posted.end()) {
      early[key].push_back(std::move(in.into));
      return;
    }
    RecvOp op = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) posted.erase(it);
    deliver(in.into, op, src, in.tag);
  }

  // Reads what has arrived from `src` (lock held); true when any byte moved.
  bool readRing(int src) {
    const Ring r = ring(src, rank());
    const uint64_t head = r.index->head.load(std::memory_order_acquire);
    const uint64_t start = r.index->tail.load(std::memory_order_relaxed);
    uint64_t tail = start;
    while (tail < head) {
      Incoming& in = incoming[src];
      if (!in.active) {
        MessageHeader header{};  // written whole before its head moved
        r.get(tail, reinterpret_cast<char*>(&header), kHeaderBytes);
        tail += kHeaderBytes;
        if (!begin(src, header)) return true;
      }
      const int64_t n =
          std::min({static_cast<int64_t>(head - tail), padded(in.bytes) - in.got, kPiece});
      const int64_t payload = std::clamp<int64_t>(in.bytes - in.got, 0, n);
      if (payload > 0) r.get(tail, static_cast<char*>(in.into.data_ptr()) + in.got, payload);
      tail += n;
      in.got += n;
      if (n == kPiece) {
        r.index->tail.store(tail, std::memory_order_release);
        ringBell(src);
      }
      if (in.got == padded(in.bytes)) complete(src);
    }
    if (tail == start) return false;
    r.index->tail.store(tail, std::memory_order_release);
    ringBell(src);
    return true;
  }

  bool pump() {
    if (dead) return false;
    bool moved = false;
    for (int r = 0; r < layout.size; ++r) moved |= readRing(r);
    for (int r = 0; r < layout.size; ++r) moved |= writeSends(r);
    return moved;
  }

  bool pumpOnce(bool& moved) override {
    std::lock_guard<std::mutex> lock(mutex);
    if (closed) return false;
    moved = pump();
    return true;
  }

  void failNow(const std::string& message) override {
    std::lock_guard<std::mutex> lock(mutex);
    if (!closed) failAll(message);
  }

  bool anySends() const {
    return std::any_of(sends.begin(), sends.end(), [](const auto& q) { return !q.empty(); });
  }
  bool receivingFrom(int src) const {
    auto it = posted.lower_bound({src, INT64_MIN});
    return incoming[src].active || (it != posted.end() && it->first.first == src);
  }
  bool anyPending() const {
    if (anySends() || !posted.empty()) return true;
    return std::any_of(incoming.begin(), incoming.end(), [](const auto& in) { return in.active; });
  }

  // Fails what is pending when the communicator failed or a peer it waits for is gone (lock
  // held).
  void checkPeers() {
    if (auto message = failure->latch.get()) {
      failAll(*message);
      return;
    }
    const int64_t gaveUp = layout.failedWord->load(std::memory_order_acquire);
    for (int peer = 0; peer < layout.size; ++peer) {
      if (peer == rank()) continue;
      const bool sending = !sends[peer].empty();
      if (!sending && !receivingFrom(peer)) continue;
      std::string why;
      if (gaveUp == peer + 1 || layout.bells[peer].gaveUp.load(std::memory_order_acquire) != 0) {
        why = "gave up (its log says why)";
      } else if (layout.bells[peer].closed.load(std::memory_order_acquire) != 0) {
        why = "closed its communicator";
      } else if (const int64_t pid = layout.pidOf(peer); pid > 0 && processExited(pid)) {
        why = fmt::format("(pid {}) exited", pid);
      }
      if (why.empty()) continue;
      // A receiver first reads what the peer wrote before it went (read after the check above).
      if (!sending && readRing(peer)) continue;
      failAll(fmt::format("rank {}: {} rank {} through shared memory: rank {} {}", global(rank()),
                          sending ? "send to" : "recv from", global(peer), global(peer), why));
      return;
    }
  }

  // The progress thread: moves bytes while there are any to move, checks peers every 20 ms while
  // something is pending, sleeps on this rank's doorbell otherwise; after stop, until the sends
  // are written (at most `timeout`).
  void serve() {
    constexpr milliseconds kCheckEvery{20};
    ShmDoorbell& bell = layout.bells[rank()];
    std::unique_lock<std::mutex> lock(mutex);
    auto nextCheck = Clock::now() + kCheckEvery;
    int idle = 0;
    while (true) {
      const bool moved = pump();
      if (stop && !anySends()) return;
      const auto now = Clock::now();
      if (anyPending() && now >= nextCheck) {
        checkPeers();
        nextCheck = now + kCheckEvery;
      }
      if (stop && now - stopAt >= timeout && anySends()) {
        failAll(fmt::format(
            "rank {}: sends through shared memory were not read within {} of closing the "
            "communicator",
            global(rank()), formatDuration(timeout)));
        return;
      }
      if (moved) {
        idle = 0;
        lock.unlock();  // a caller issuing, or a waiter helping, gets its turn
        relax(0);
        lock.lock();
        continue;
      }
      if (++idle < 80) {  // a reply often comes within microseconds: look again first
        lock.unlock();
        relax(idle);
        lock.lock();
        continue;
      }
      // Announce the sleep, then look once more: whoever has news after that wakes us.
      bell.sleeping.store(1, std::memory_order_seq_cst);
      const uint32_t seen = bell.seq.load(std::memory_order_seq_cst);
      if (pump()) {
        bell.sleeping.store(0, std::memory_order_relaxed);
        idle = 0;
        continue;
      }
      const milliseconds nap = anyPending() ? kCheckEvery : milliseconds(1000);
      lock.unlock();
      futexWait(&bell.seq, seen, nap);
      lock.lock();
      bell.sleeping.store(0, std::memory_order_relaxed);
      idle = 0;
    }
  }
};

ShmChannels::ShmChannels(Layout layout, milliseconds timeout, std::shared_ptr<ShmFailure> failure,
                         std::function<void(const std::string&)> giveUp)
    : impl_(std::make_shared<Impl>()) {
  CARAVAN_CHECK(layout.size >= 1 && layout.rank >= 0 && layout.rank < layout.size &&
                    layout.ringBytes >= 64 && layout.ringBytes % 64 == 0 && layout.rings &&
                    layout.bells && layout.pidOf && layout.failedWord,
                "shm channels: rank {} of {}, rings of {} bytes", layout.rank, layout.size,
                layout.ringBytes);
  Impl& m = *impl_;
  m.layout = std::move(layout);
  m.timeout = timeout;
  m.failure = std::move(failure);
  m.giveUp = std::move(giveUp);
  m.sends.resize(m.layout.size);
  m.incoming.resize(m.layout.size);
}

ShmChannels::~ShmChannels() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.stop = true;
    m.stopAt = Clock::now();
  }
  m.ringBell(m.rank());
  if (m.thread.joinable()) m.thread.join();
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    auto closed = [&](int src, int64_t tag) {
      return std::make_exception_ptr(PeerError(fmt::format(
          "rank {}: recv from rank {} (tag {}) through shared memory: the communicator was "
          "closed first",
          m.global(m.rank()), m.global(src), tag)));
    };
    for (auto& [key, queue] : m.posted) {
      for (auto& op : queue) op.work->finish(closed(key.first, key.second));
    }
    for (int src = 0; src < m.layout.size; ++src) {
      if (m.incoming[src].work) m.incoming[src].work->finish(closed(src, m.incoming[src].tag));
    }
    m.closed = true;  // a waiter still holding the Impl no longer touches the segment
  }
  m.layout.bells[m.rank()].closed.store(1, std::memory_order_release);
  for (int r = 0; r < m.layout.size; ++r) {
    if (r != m.rank()) m.ringBell(r);
  }
}

int64_t ShmChannels::bytesFor(int size, int64_t ringBytes) {
  return static_cast<int64_t>(size) * size * (static_cast<int64_t>(sizeof(RingIndex)) + ringBytes);
}

WorkPtr ShmChannels::send(const at::Tensor& tensor, int dst, int tag) {
  Impl& m = *impl_;
  if (auto refused = m.failure->latch.refuseIfFailed()) return refused;
  if (tensor.numel() == 0) return std::make_shared<ReadyWork>();
  auto work = std::make_shared<ChannelWork>(
      fmt::format("rank {}: send to rank {} (tag {})", m.global(m.rank()), m.global(dst), tag),
      m.failure, impl_);
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    if (dst != m.rank() && m.layout.bells[dst].closed.load(std::memory_order_acquire) != 0) {
      m.failAll(
          fmt::format("rank {}: send to rank {} through shared memory: rank {} closed its "
                      "communicator",
                      m.global(m.rank()), m.global(dst), m.global(dst)));
      return m.failure->latch.refuseIfFailed();
    }
    m.start();
    m.sends[dst].push_back(Impl::SendOp{work, tensor, tag, 0});
    m.writeSends(dst);  // what fits now, without a hand-off
  }
  if (!work->isCompleted()) m.ringBell(m.rank());
  return work;
}

WorkPtr ShmChannels::recv(const at::Tensor& tensor, int src, int tag) {
  Impl& m = *impl_;
  if (auto refused = m.failure->latch.refuseIfFailed()) return refused;
  if (tensor.numel() == 0) return std::make_shared<ReadyWork>();
  auto work = std::make_shared<ChannelWork>(
      fmt::format("rank {}: recv from rank {} (tag {})", m.global(m.rank()), m.global(src), tag),
      m.failure, impl_);
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.start();
    const Impl::Key key{src, tag};
    Impl::RecvOp op{work, tensor};
    if (auto it = m.early.find(key); it != m.early.end()) {
      at::Tensor buffer = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) m.early.erase(it);
      m.deliver(buffer, op, src, tag);
      return work;
    }
    m.posted[key].push_back(std::move(op));
    m.readRing(src);  // its message may be there already
  }
  if (!work->isCompleted()) m.ringBell(m.rank());
  return work;
}

}  // namespace caravan::comm
