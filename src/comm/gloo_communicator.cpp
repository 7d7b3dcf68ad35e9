// GlooCommunicator over c10d::ProcessGroupGloo (see gloo_communicator.h for the workarounds).
#include "comm/gloo_communicator.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>

#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <gloo/types.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/comm_util.h"
#include "comm/store.h"
#include "core/errors.h"

namespace caravan {
namespace {

using std::chrono::milliseconds;
using namespace caravan::comm;

// How a Work words its failure: the operation, and the ranks it waited for.
struct OpInfo {
  std::string what;        // "allreduce #3 (7 float32 elements)", "recv from rank 1 (tag 5, ...)"
  std::vector<int> peers;  // the ranks the operation depends on
  bool pointToPoint = false;
};

std::string peerFailureMessage(int rank, const OpInfo& info, bool timedOut, milliseconds timeout,
                               const std::string& cause) {
  const std::string peers = formatRanks(info.peers);
  if (timedOut) {
    if (info.pointToPoint) {
      return fmt::format("rank {}: {} did not complete within {}; {} is dead, hung or never "
                         "matched it; check its log",
                         rank, info.what, formatDuration(timeout), peers);
    }
    const bool one = info.peers.size() == 1;
    return fmt::format("rank {}: {} did not complete within {}; {} is dead, hung or issued "
                       "collectives in a different order; check {} logs",
                       rank, info.what, formatDuration(timeout), one ? peers : "one of " + peers,
                       one ? "its" : "their");
  }
  if (cause.find("closed") != std::string::npos || cause.find("reset") != std::string::npos) {
    return fmt::format("rank {}: {} failed: {} closed the connection ({}); that rank probably "
                       "exited; check its log",
                       rank, info.what, info.peers.size() == 1 ? peers : "one of " + peers,
                       cause);
  }
  return fmt::format("rank {}: {} failed ({}) while talking to {}", rank, info.what, cause, peers);
}

// The c10d works of one operation (one per stripe) plus the step that finishes the result in
// the caller's tensors.
class GlooWork : public Work {
 public:
  GlooWork(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::function<void()> finish,
           OpInfo info, int rank, milliseconds ioTimeout, std::shared_ptr<FailureLatch> failure)
      : works_(std::move(works)),
        finish_(std::move(finish)),
        info_(std::move(info)),
        rank_(rank),
        ioTimeout_(ioTimeout),
        failure_(std::move(failure)) {}

  void wait(milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) complete(atLeastOneMs(timeout));
    if (error_) std::rethrow_exception(error_);
  }

  // True once wait() would not block. Gloo's send/recv only learn completion inside wait(),
  // so for them this stays false until then.
  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_ || std::all_of(works_.begin(), works_.end(),
                                [](const auto& w) { return w->isCompleted(); });
  }

 private:
  void complete(milliseconds timeout) {
    done_ = true;  // a failed wait is final: Gloo closes the pair after a timeout
    std::string cause;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    size_t waiting = 0;  // the work a failure came from
    try {
      for (; waiting < works_.size(); ++waiting) {
        works_[waiting]->wait(atLeastOneMs(
            std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now())));
      }
      if (finish_) finish_();
      finish_ = nullptr;
      return;
    } catch (const Error&) {
      error_ = std::current_exception();
      return;
    } catch (const std::exception& e) {
      cause = errorLine(e);
    }
    // Our wait ran out: c10d's collective works say "Operation timed out!" and stay incomplete.
    // Gloo's own I/O timeout (ioTimeout_, and the wait's timeout for send/recv) completes the
    // work with "Timed out ...".
    const bool waitRanOut = waiting < works_.size() && !works_[waiting]->isCompleted();
    const bool timedOut = waitRanOut || cause.find("imed out") != std::string::npos;
    const milliseconds shown = waitRanOut ? timeout : std::min(timeout, ioTimeout_);
    const std::string message = peerFailureMessage(rank_, info_, timedOut, shown, cause);
    failure_->set(message);
    error_ = std::make_exception_ptr(PeerError(message));
  }

  std::mutex mutex_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::function<void()> finish_;
  OpInfo info_;
  int rank_;
  milliseconds ioTimeout_;
  std::shared_ptr<FailureLatch> failure_;
  bool done_ = false;
  std::exception_ptr error_;
};

// Messages a rank sends to itself, by tag, in send order.
struct Mailbox {
  std::mutex mutex;
  std::condition_variable arrived;
  std::map<int, std::deque<at::Tensor>> messages;
};

class SelfRecvWork : public Work {
 public:
  SelfRecvWork(std::shared_ptr<Mailbox> mailbox, at::Tensor tensor, int tag, int rank)
      : mailbox_(std::move(mailbox)), tensor_(std::move(tensor)), tag_(tag), rank_(rank) {}

  void wait(milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) {
      std::unique_lock<std::mutex> box(mailbox_->mutex);
      auto& queue = mailbox_->messages[tag_];
      if (!mailbox_->arrived.wait_for(box, atLeastOneMs(timeout), [&] { return !queue.empty(); })) {
        throw PeerError(fmt::format("rank {}: recv from itself (tag {}, {}) did not complete "
                                    "within {}; nothing was sent to it",
                                    rank_, tag_, describeTensor(tensor_), formatDuration(timeout)));
      }
      at::Tensor message = std::move(queue.front());
      queue.pop_front();
      box.unlock();
      CARAVAN_CHECK(message.numel() == tensor_.numel() &&
                        message.scalar_type() == tensor_.scalar_type(),
                    "recv from itself (tag {}): expected {}, got {}", tag_,
                    describeTensor(tensor_), describeTensor(message));
      tensor_.view(-1).copy_(message.view(-1));
      done_ = true;
    }
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return true;
    std::lock_guard<std::mutex> box(mailbox_->mutex);
    return !mailbox_->messages[tag_].empty();
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<Mailbox> mailbox_;
  at::Tensor tensor_;
  int tag_;
  int rank_;
  bool done_ = false;
};

c10d::ReduceOp toGloo(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return c10d::ReduceOp::SUM;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

// Data movement needs no arithmetic: types Gloo lacks travel as a supported type of the same
// width, bit for bit.
at::Tensor movable(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong: return t;
    default: break;
  }
  switch (t.element_size()) {
    case 1: return t.view(at::kByte);
    case 2: return t.view(at::kHalf);
    case 4: return t.view(at::kInt);
    case 8: return t.view(at::kLong);
    default: break;
  }
  CARAVAN_CHECK(false, "no Gloo type moves {} elements", dtypeName(t.scalar_type()));
  return t;
}

// The dtype Gloo reduces `t` in (bfloat16 -> float32).
at::ScalarType reduceType(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? at::kFloat : t.scalar_type();
}

// What one ring reduce-scatter works on: elements [begin, begin + length) of every one of the
// `size` chunks of `input` (n elements each), reduced into output's [begin, begin + length).
struct RingPiece {
  at::Tensor input;   // flat, size * n elements, the caller's dtype
  at::Tensor output;  // flat, n elements
  int64_t n = 0;
  int64_t begin = 0;
  int64_t length = 0;
  ReduceOp op = ReduceOp::kSum;
};

// Gloo slots are (prefix << 56) + tag; c10d's send/recv use bare tags (prefix 0) and Gloo's
// collectives their own prefixes. The tag is the process group's collective number, unique to
// this operation, so the ring's messages meet no others whatever the prefix; this one is
// unused by Gloo's collectives anyway.
constexpr uint8_t kRingSlotPrefix = 0xca;

// The reduce-scatter ring of gloo_communicator.h over one piece, on a ProcessGroupGloo worker
// thread like c10d's collectives. Its output is written before the work completes.
class RingReduceScatterWork final : public c10d::ProcessGroupGloo::AsyncWork {
 public:
  RingReduceScatterWork(std::shared_ptr<::gloo::Context> context, RingPiece piece, uint32_t tag,
                        uint64_t seq, milliseconds timeout)
      : AsyncWork(std::move(context), {{piece.output}}, c10d::OpType::REDUCE_SCATTER, seq, timeout,
                  "caravan:ring_reduce_scatter"),
        piece_(std::move(piece)),
        tag_(tag) {}

  void run() override {
    const c10::AutoGradMode noGrad(false);
    const int size = context_->size, rank = context_->rank;
    const RingPiece& p = piece_;
    const at::ScalarType type = reduceType(p.input);
    auto chunk = [&](int c) {
      c = ((c % size) + size) % size;
      return p.input.narrow(0, c * p.n + p.begin, p.length).to(type);  // a view unless bfloat16
    };
    at::Tensor out = p.output.narrow(0, p.begin, p.length);
    at::Tensor result = out.scalar_type() == type ? out : at::empty({p.length}, type);
    at::Tensor received = at::empty({p.length}, type), partial = at::empty({p.length}, type);
    at::Tensor sending = chunk(rank - 1);
    const uint64_t slot = ::gloo::Slot::build(kRingSlotPrefix, tag_);
    const size_t bytes = received.nbytes();
    if (size == 1) result.copy_(sending);
    for (int step = 0; step < size - 1; ++step) {
      // One slot for every step: Gloo matches a pair's messages on a slot in the order sent.
      auto in = context_->createUnboundBuffer(received.data_ptr(), bytes);
      auto sent = context_->createUnboundBuffer(sending.data_ptr(), bytes);
      in->recv((rank + size - 1) % size, slot);
      sent->send((rank + 1) % size, slot);
      if (!in->waitRecv(timeout_) || !sent->waitSend(timeout_)) {
        throw std::runtime_error("ring reduce-scatter aborted");
      }
      at::Tensor into = step == size - 2 ? result : partial;
      const at::Tensor own = chunk(rank - step - 2);
      switch (p.op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg: at::add_out(into, received, own); break;
        case ReduceOp::kMax: at::maximum_out(into, received, own); break;
        case ReduceOp::kMin: at::minimum_out(into, received, own); break;
      }
      sending = partial;
    }
    if (p.op == ReduceOp::kAvg) result.div_(size);
    if (!result.is_same(out)) out.copy_(result);
  }

  const std::vector<at::Tensor> getInputTensors() override { return {piece_.input}; }
  const std::vector<at::Tensor> getOutputTensors() override { return {piece_.output}; }

 private:
  RingPiece piece_;
  uint32_t tag_;
};

// ProcessGroupGloo with a ring reduce-scatter that runs as one of its own collectives: numbered
// by its collective counter (so ranks that issue in the same order match, alongside its other
// collectives in flight), on the context that number picks, queued to its worker threads.
class RingProcessGroup final : public c10d::ProcessGroupGloo {
 public:
  using ProcessGroupGloo::ProcessGroupGloo;

  c10::intrusive_ptr<c10d::Work> reduceScatterRing(RingPiece piece) {
    const uint32_t tag = nextTag();
    auto work = c10::make_intrusive<RingReduceScatterWork>(getContext(tag), std::move(piece), tag,
                                                           ++seq_, options_->timeout);
    enqueue(work);
    return work;
  }
};

std::shared_ptr<::gloo::transport::Device> makeDevice(const GlooOptions& o) {
  try {
    if (!o.interface.empty()) return c10d::ProcessGroupGloo::createDeviceForInterface(o.interface);
    if (!o.hostname.empty()) return c10d::ProcessGroupGloo::createDeviceForHostname(o.hostname);
    return c10d::ProcessGroupGloo::createDefaultDevice();
  } catch (const std::exception& e) {
    const std::string where = !o.interface.empty() ? "interface " + o.interface
                              : !o.hostname.empty() ? "address " + o.hostname
                                                    : "this host's name";
    throw ConfigError(fmt::format("cannot open a Gloo endpoint on {}: {}; set the network "
                                  "interface (GLOO_SOCKET_IFNAME) or address peers can reach",
                                  where, errorLine(e)));
  }
}

// Every rank claims its number, announces itself and waits for all others, so a missing rank
// is named here rather than surfacing as an anonymous timeout inside Gloo's address exchange,
// and a second process with a taken number is refused before it touches the job (Gloo's pairs
// would connect to whichever of the two published its address last).
void joinAll(c10d::Store& store, int rank, int size, milliseconds timeout) {
  claimRank(store, rank, size);
  auto key = [](int r) { return fmt::format("join/{}", r); };
  store.set(key(rank), std::vector<uint8_t>{1});
  waitForRanks(store, rank, size, key, timeout, "arrived at the rendezvous", "Gloo rendezvous");
}

}  // namespace

struct GlooCommunicator::Impl {
  int rank = 0;
  int size = 1;
  GlooOptions options;
  c10::intrusive_ptr<RingProcessGroup> pg;
  std::shared_ptr<FailureLatch> failure = std::make_shared<FailureLatch>();
  std::shared_ptr<Mailbox> mailbox = std::make_shared<Mailbox>();
  uint64_t collectives = 0;  // issued so far; numbers them in messages

  OpInfo collective(const char* name, const at::Tensor* t) {
    ++collectives;
    return {t ? fmt::format("{} #{} ({})", name, collectives, describeTensor(*t))
              : fmt::format("{} #{}", name, collectives),
            otherRanks(rank, size), false};
  }

  // Starts a c10d operation; a synchronous failure becomes a failed Work like any other.
  WorkPtr issue(OpInfo info, const std::function<c10::intrusive_ptr<c10d::Work>()>& start,
                std::function<void()> finish = nullptr) {
    return issueWorks(
        std::move(info), [&] { return std::vector<c10::intrusive_ptr<c10d::Work>>{start()}; },
        std::move(finish));
  }

  // The same for an operation on `flat` that runs as one c10d operation per stripe (stripes()):
  // start(piece) starts it on one piece.
  WorkPtr issueStriped(
      OpInfo info, const at::Tensor& flat,
      const std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>&)>& start,
      std::function<void()> finish) {
    return issueWorks(
        std::move(info),
        [&] {
          std::vector<c10::intrusive_ptr<c10d::Work>> works;
          for (const at::Tensor& piece : stripes(flat)) {
            std::vector<at::Tensor> tensors{piece};
            works.push_back(start(tensors));
          }
          return works;
        },
        std::move(finish));
  }

  WorkPtr issueWorks(OpInfo info,
                     const std::function<std::vector<c10::intrusive_ptr<c10d::Work>>()>& start,
                     std::function<void()> finish) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    try {
      works = start();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      const std::string message =
          fmt::format("rank {}: {} could not start: {}", rank, info.what, errorLine(e));
      failure->set(message);
      return std::make_shared<ReadyWork>(std::make_exception_ptr(PeerError(message)));
    }
    return std::make_shared<GlooWork>(std::move(works), std::move(finish), std::move(info), rank,
                                      options.timeout, failure);
  }

  // `flat` cut into options.connections contiguous pieces when it has at least
  // options.stripeBytes, else whole: consecutive c10d collectives run on consecutive meshes.
  std::vector<at::Tensor> stripes(const at::Tensor& flat) const {
    std::vector<at::Tensor> pieces;
    for (const auto& [begin, length] : stripeRanges(flat.numel(), flat.nbytes())) {
      pieces.push_back(flat.narrow(0, begin, length));
    }
    return pieces;
  }

  // The non-empty [begin, begin + length) ranges of `n` elements that stripes() cuts an
  // operation moving `bytes` into.
  std::vector<std::pair<int64_t, int64_t>> stripeRanges(int64_t n, size_t bytes) const {
    const int k = options.connections <= 1 || bytes < static_cast<size_t>(options.stripeBytes)
                      ? 1
                      : options.connections;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int i = 0; i < k; ++i) {
      const int64_t begin = n * i / k, end = n * (i + 1) / k;
      if (end > begin) ranges.emplace_back(begin, end - begin);
    }
    return ranges;
  }

  void checkRank(int r, const char* op) const {
    CARAVAN_CHECK(r >= 0 && r < size, "{}: rank {} is outside a world of {}", op, r, size);
  }
};

GlooCommunicator::GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                   const GlooOptions& options)
    : impl_(std::make_unique<Impl>()) {
  CARAVAN_CHECK(size >= 1 && rank >= 0 && rank < size, "rank {} of a world of {}", rank, size);
  CARAVAN_CHECK(store, "GlooCommunicator needs a store");
  CARAVAN_CHECK(options.timeout.count() > 0, "timeout must be positive");
  impl_->rank = rank;
  impl_->size = size;
  impl_->options = options;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(options.prefix, std::move(store));
  joinAll(*prefixed, rank, size,
          options.joinTimeout.count() > 0 ? options.joinTimeout : options.timeout);
  CARAVAN_CHECK(options.connections >= 1, "{} connections", options.connections);
  auto pgOptions = c10d::ProcessGroupGloo::Options::create(options.timeout);
  // One full mesh of connections per device (ProcessGroupGloo), and a worker thread for each.
  for (int k = 0; k < options.connections; ++k) pgOptions->devices.push_back(makeDevice(options));
  pgOptions->threads = std::max({1, options.threads, options.connections});
  try {
    impl_->pg = c10::make_intrusive<RingProcessGroup>(prefixed, rank, size, pgOptions);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw PeerError(fmt::format(
        "rank {}: could not connect to {} over Gloo within {}: {}; check that every rank can "
        "reach the others' address (set GLOO_SOCKET_IFNAME when a host has several networks)",
        rank, formatRanks(otherRanks(rank, size)), formatDuration(options.timeout),
        errorLine(e)));
  }
}

GlooCommunicator::~GlooCommunicator() = default;

int GlooCommunicator::rank() const { return impl_->rank; }
int GlooCommunicator::size() const { return impl_->size; }
std::chrono::milliseconds GlooCommunicator::timeout() const { return impl_->options.timeout; }

WorkPtr GlooCommunicator::allreduce(at::Tensor tensor, ReduceOp op) {
  checkTensor(tensor, "allreduce", "tensor");
  checkReducible(tensor, op, "allreduce");
  if (auto refused = impl_->failure->refuseIfFailed()) return refused;
  OpInfo info = impl_->collective("allreduce", &tensor);
  if (tensor.numel() == 0) return std::make_shared<ReadyWork>();
  at::Tensor buf = tensor.to(reduceType(tensor));  // the tensor itself unless bfloat16
  std::function<void()> finish;
  if (op == ReduceOp::kAvg || !buf.is_same(tensor)) {
    finish = [tensor, buf, avg = op == ReduceOp::kAvg, size = impl_->size]() mutable {
      if (avg) buf.div_(size);
      if (!buf.is_same(tensor)) tensor.copy_(buf);
    };
  }
  return impl_->issueStriped(
      std::move(info), buf.view(-1),
      [&](std::vector<at::Tensor>& tensors) {
        c10d::AllreduceOptions o;
        o.reduceOp = toGloo(op);
        return impl_->pg->allreduce(tensors, o);
      },
      std::move(finish));
}

WorkPtr GlooCommunicator::broadcast(at::Tensor tensor, int root) {
  checkTensor(tensor, "broadcast", "tensor");
  impl_->checkRank(root, "broadcast");
  if (auto refused = impl_->failure->refuseIfFailed()) return refused;
  OpInfo info = impl_->collective("broadcast", &tensor);
  info.what += fmt::format(" from rank {}", root);
  if (impl_->rank != root) info.peers = {root};
  if (tensor.numel() == 0) return std::make_shared<ReadyWork>();
  return impl_->issueStriped(
      std::move(info), movable(tensor).view(-1),
      [&](std::vector<at::Tensor>& tensors) {
        c10d::BroadcastOptions o;
        o.rootRank = root;
        o.rootTensor = 0;
        return impl_->pg->broadcast(tensors, o);
      },
      nullptr);
}

WorkPtr GlooCommunicator::allgather(at::Tensor output, at::Tensor input) {
  checkTensor(output, "allgather", "output");
  checkTensor(input, "allgather", "input");
  const int64_t n = input.numel();
  CARAVAN_CHECK(output.numel() == n * impl_->size && output.scalar_type() == input.scalar_type(),
                "allgather: output has {}, needs {} x {}", describeTensor(output), impl_->size,
                describeTensor(input));
  if (auto refused = impl_->failure->refuseIfFailed()) return refused;
  OpInfo info = impl_->collective("allgather", &input);
  if (n == 0) return std::make_shared<ReadyWork>();
  return impl_->issue(std::move(info), [&] {
    at::Tensor flat = movable(output).view(-1);
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < impl_->size; ++r) outputs[0].push_back(flat.narrow(0, r * n, n));
    std::vector<at::Tensor> inputs{movable(input).view(-1)};
    return impl_->pg->allgather(outputs, inputs);
  });
}

WorkPtr GlooCommunicator::reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) {
  checkTensor(output, "reduceScatter", "output");
  checkTensor(input, "reduceScatter", "input");
  checkReducible(input, op, "reduceScatter");
  const int64_t n = output.numel();
  CARAVAN_CHECK(input.numel() == n * impl_->size && output.scalar_type() == input.scalar_type(),
                "reduceScatter: input has {}, needs {} x {}", describeTensor(input), impl_->size,
                describeTensor(output));
  if (auto refused = impl_->failure->refuseIfFailed()) return refused;
  OpInfo info = impl_->collective("reduceScatter", &input);
  if (n == 0) return std::make_shared<ReadyWork>();
  // One ring per stripe, each over elements [begin, begin + length) of every chunk; every
  // element is summed in the ring's order whatever the striping.
  return impl_->issueWorks(
      std::move(info),
      [&] {
        std::vector<c10::intrusive_ptr<c10d::Work>> works;
        for (const auto& [begin, length] : impl_->stripeRanges(n, input.nbytes())) {
          works.push_back(impl_->pg->reduceScatterRing(
              {input.view(-1), output.view(-1), n, begin, length, op}));
        }
        return works;
      },
      nullptr);
}

WorkPtr GlooCommunicator::send(at::Tensor tensor, int dstRank, int tag) {
  checkTensor(tensor, "send", "tensor");
  impl_->checkRank(dstRank, "send");
  CARAVAN_CHECK(tag >= 0, "send: tag {} is negative", tag);
  if (auto refused = impl_->failure->refuseIfFailed()) return refused;
  if (tensor.numel() == 0) return std::make_shared<ReadyWork>();
  if (dstRank == impl_->rank) {
    auto& box = *impl_->mailbox;
    {
      std::lock_guard<std::mutex> lock(box.mutex);
      box.messages[tag].push_back(tensor.clone());
    }
    box.arrived.notify_all();
    return std::make_shared<ReadyWork>();
  }
  OpInfo info{fmt::format("send to rank {} (tag {}, {})", dstRank, tag, describeTensor(tensor)),
              {dstRank}, true};
  return impl_->issue(std::move(info), [&] {
    std::vector<at::Tensor> tensors{tensor};
    return impl_->pg->send(tensors, dstRank, tag);
  });
}

WorkPtr GlooCommunicator::recv(at::Tensor tensor, int srcRank, int tag) {
  checkTensor(tensor, "recv", "tensor");
  impl_->checkRank(srcRank, "recv");
  CARAVAN_CHECK(tag >= 0, "recv: tag {} is negative", tag);
  if (auto refused = impl_->failure->refuseIfFailed()) return refused;
  if (tensor.numel() == 0) return std::make_shared<ReadyWork>();
  if (srcRank == impl_->rank) {
    return std::make_shared<SelfRecvWork>(impl_->mailbox, tensor, tag, impl_->rank);
  }
  OpInfo info{fmt::format("recv from rank {} (tag {}, {})", srcRank, tag, describeTensor(tensor)),
              {srcRank}, true};
  return impl_->issue(std::move(info), [&] {
    std::vector<at::Tensor> tensors{tensor};
    return impl_->pg->recv(tensors, srcRank, tag);
  });
}

WorkPtr GlooCommunicator::barrier() {
  if (auto refused = impl_->failure->refuseIfFailed()) return refused;
  OpInfo info = impl_->collective("barrier", nullptr);
  return impl_->issue(std::move(info), [&] { return impl_->pg->barrier(); });
}

}  // namespace caravan
