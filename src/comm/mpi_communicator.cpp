// The MPI backend (see mpi_communicator.h). Built only when CMake finds MPI
// (CARAVAN_WITH_MPI); otherwise mpi_unavailable.cpp provides the entry points.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include "comm/mpi_communicator.h"

#include <atomic>
#include <climits>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "comm/comm_util.h"
#include "core/errors.h"

namespace caravan {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using namespace caravan::comm;

// MPI is initialized once per process and finalized at exit; this is the one place that knows.
struct MpiProcess {
  std::mutex callMutex;  // serializes MPI calls when the library lacks MPI_THREAD_MULTIPLE
  bool serialize = false;
  bool initializedHere = false;
  // Set by any PeerError: MPI_Finalize synchronizes with every process and would wait for a
  // hung peer, so exit skips it (the launcher then ends the job's other processes).
  std::atomic<bool> skipFinalize{false};
  // Buffers of operations abandoned in flight: MPI may still write them until the process ends.
  std::mutex orphansMutex;
  std::vector<std::vector<at::Tensor>> orphans;
};

MpiProcess& mpiProcess() {
  static MpiProcess process;
  return process;
}

// Holds the MPI call lock when the library needs serialized calls, nothing otherwise.
std::unique_lock<std::mutex> mpiLock() {
  auto& p = mpiProcess();
  return p.serialize ? std::unique_lock<std::mutex>(p.callMutex) : std::unique_lock<std::mutex>();
}

bool mpiFinalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

void finalizeAtExit() {
  if (mpiFinalized() || mpiProcess().skipFinalize) return;
  MPI_Finalize();
}

void initMpi() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& p = mpiProcess();  // constructed before the atexit hook, so destroyed after it
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      // Open MPI's waiting ranks spin unless told to yield, taking the cores compute needs
      // when a host runs as many ranks as cores (issue 19: 100 fmnist-cnn steps under
      // mpirun -np 2 on 2 cores took 38.9 s, 10.2 s yielding, 6.6 s on Gloo). A setting the
      // user made (mpirun --mca, the environment) wins.
      ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
        throw PeerError("MPI_Init_thread failed; start the job with mpirun or srun");
      }
      p.initializedHere = true;
      std::atexit(finalizeAtExit);
    } else {
      MPI_Query_thread(&provided);
    }
    p.serialize = provided < MPI_THREAD_MULTIPLE;
  });
}

std::string mpiErrorString(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(length));
}

MPI_Datatype reduceDatatype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    default: break;
  }
  CARAVAN_CHECK(false, "no MPI reduction type for {}", dtypeName(type));
  return MPI_DATATYPE_NULL;
}

// Data movement: any dtype as unsigned words of its width.
MPI_Datatype moveDatatype(const at::Tensor& t) {
  switch (t.element_size()) {
    case 1: return MPI_UINT8_T;
    case 2: return MPI_UINT16_T;
    case 4: return MPI_UINT32_T;
    case 8: return MPI_UINT64_T;
    default: break;
  }
  CARAVAN_CHECK(false, "no MPI type moves {} elements", dtypeName(t.scalar_type()));
  return MPI_DATATYPE_NULL;
}

MPI_Op toMpi(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_SUM;
}

int mpiCount(const at::Tensor& t) {
  CARAVAN_CHECK(t.numel() <= INT_MAX, "MPI counts are int; {} is too large", describeTensor(t));
  return static_cast<int>(t.numel());
}

at::ScalarType reduceType(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? at::kFloat : t.scalar_type();
}

// What one communicator's works share.
struct MpiShared {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  int tagUpperBound = 32767;
  milliseconds timeout{0};
  FailureLatch failure;
  uint64_t collectives = 0;  // issued so far; numbers them in messages
};

enum class Kind { kCollective, kSend, kRecv };

struct OpInfo {
  std::string what;
  std::vector<int> peers;
  Kind kind = Kind::kCollective;
};

class MpiWork : public Work {
 public:
  MpiWork(std::shared_ptr<MpiShared> shared, MPI_Request request, std::vector<at::Tensor> buffers,
          std::function<void()> finish, OpInfo info)
      : shared_(std::move(shared)),
        request_(request),
        buffers_(std::move(buffers)),
        finish_(std::move(finish)),
        info_(std::move(info)) {}

  ~MpiWork() override {
    if (transportDone_ || request_ == MPI_REQUEST_NULL) return;
    // Abandoned in flight: MPI may still touch the buffers, so they live until exit.
    {
      auto lock = mpiLock();
      if (mpiFinalized()) return;
      if (info_.kind == Kind::kRecv) {
        MPI_Cancel(&request_);
        MPI_Request_free(&request_);
      }
    }
    auto& p = mpiProcess();
    std::lock_guard<std::mutex> lock(p.orphansMutex);
    p.orphans.push_back(std::move(buffers_));
  }

  void wait(milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) complete(atLeastOneMs(timeout));
    if (error_) std::rethrow_exception(error_);
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_ || transportDone_) return true;
    MPI_Status status;
    return test(&status) != MPI_SUCCESS || transportDone_;
  }

 private:
  // One MPI_Test; sets transportDone_ when the request finished.
  int test(MPI_Status* status) {
    int flag = 0;
    int rc;
    {
      auto lock = mpiLock();
      rc = MPI_Test(&request_, &flag, status);
    }
    if (rc == MPI_SUCCESS && flag) transportDone_ = true;
    return rc;
  }

  static void backoff(int spin) {
    if (spin < 64) return;  // small messages finish within microseconds
    if (spin < 256) {
      std::this_thread::yield();
      return;
    }
    // Each MPI_Test also advances MPI's nonblocking collectives, so do not sleep long.
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(200, spin - 250)));
  }

  void complete(milliseconds timeout) {
    done_ = true;  // a failed wait is final
    const auto deadline = Clock::now() + timeout;
    MPI_Status status;
    for (int spin = 0; !transportDone_; ++spin) {
      const int rc = test(&status);
      if (rc != MPI_SUCCESS) return fail(fmt::format("rank {}: {} failed: {}", shared_->rank,
                                                     info_.what, mpiErrorString(rc)));
      if (transportDone_) break;
      if (Clock::now() >= deadline) {
        if (!cancelRecv()) return timedOut(timeout);
        break;  // the message arrived while cancelling
      }
      backoff(spin);
    }
    try {
      if (finish_) finish_();
    } catch (...) {
      error_ = std::current_exception();
    }
    finish_ = nullptr;
  }

  // After a timeout: a recv is cancelled (MPI cannot take back a collective or a send). True
  // when the recv had completed after all.
  bool cancelRecv() {
    if (info_.kind != Kind::kRecv) return false;
    {
      auto lock = mpiLock();
      MPI_Cancel(&request_);
    }
    MPI_Status status;
    const auto deadline = Clock::now() + std::chrono::seconds(1);
    for (int spin = 0; !transportDone_; ++spin) {
      if (test(&status) != MPI_SUCCESS) break;
      if (transportDone_) break;
      if (Clock::now() >= deadline) return false;
      backoff(spin);
    }
    if (!transportDone_) return false;
    int cancelled = 0;
    MPI_Test_cancelled(&status, &cancelled);
    return cancelled == 0;
  }

  void timedOut(milliseconds timeout) {
    const std::string peers = formatRanks(info_.peers);
    const bool one = info_.peers.size() == 1;
    std::string message;
    if (info_.kind != Kind::kCollective) {
      message = fmt::format("rank {}: {} did not complete within {}; {} is dead, hung or never "
                            "matched it; check its log",
                            shared_->rank, info_.what, formatDuration(timeout), peers);
    } else {
      message = fmt::format("rank {}: {} did not complete within {}; {} is dead, hung or issued "
                            "collectives in a different order; check {} logs",
                            shared_->rank, info_.what, formatDuration(timeout),
                            one ? peers : "one of " + peers, one ? "its" : "their");
    }
    fail(message);
  }

  void fail(const std::string& message) {
    mpiProcess().skipFinalize = true;
    shared_->failure.set(message);
    error_ = std::make_exception_ptr(PeerError(message));
  }

  std::mutex mutex_;
  std::shared_ptr<MpiShared> shared_;
  MPI_Request request_;
  std::vector<at::Tensor> buffers_;  // everything MPI reads or writes until done
  std::function<void()> finish_;
  OpInfo info_;
  bool transportDone_ = false;
  bool done_ = false;
  std::exception_ptr error_;
};

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(const MpiOptions& options) : shared_(std::make_shared<MpiShared>()) {
    CARAVAN_CHECK(options.timeout.count() > 0, "timeout must be positive");
    initMpi();
    shared_->timeout = options.timeout;
    auto lock = mpiLock();
    if (MPI_Comm_dup(MPI_COMM_WORLD, &shared_->comm) != MPI_SUCCESS) {
      throw PeerError("MPI_Comm_dup failed; is every process of the job running?");
    }
    MPI_Comm_set_errhandler(shared_->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(shared_->comm, &shared_->rank);
    MPI_Comm_size(shared_->comm, &shared_->size);
    void* value = nullptr;
    int found = 0;
    MPI_Comm_get_attr(shared_->comm, MPI_TAG_UB, &value, &found);
    if (found) shared_->tagUpperBound = *static_cast<int*>(value);
  }

  ~MpiCommunicator() override {
    auto lock = mpiLock();
    if (!mpiFinalized()) MPI_Comm_free(&shared_->comm);  // in-flight operations still complete
  }

  int rank() const override { return shared_->rank; }
  int size() const override { return shared_->size; }
  std::string backend() const override { return "mpi"; }
  milliseconds timeout() const override { return shared_->timeout; }

  WorkPtr allreduce(at::Tensor tensor, ReduceOp op) override {
    checkTensor(tensor, "allreduce", "tensor");
    checkReducible(tensor, op, "allreduce");
    if (auto refused = shared_->failure.refuseIfFailed()) return refused;
    OpInfo info = collective("allreduce", &tensor);
    if (tensor.numel() == 0) return std::make_shared<ReadyWork>();
    at::Tensor buf = tensor.to(reduceType(tensor));
    std::function<void()> finish;
    if (op == ReduceOp::kAvg || !buf.is_same(tensor)) {
      finish = [tensor, buf, avg = op == ReduceOp::kAvg, size = shared_->size]() mutable {
        if (avg) buf.div_(size);
        if (!buf.is_same(tensor)) tensor.copy_(buf);
      };
    }
    return start(std::move(info), {tensor, buf}, std::move(finish), [&](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, buf.data_ptr(), mpiCount(buf),
                            reduceDatatype(buf.scalar_type()), toMpi(op), shared_->comm, r);
    });
  }

  WorkPtr broadcast(at::Tensor tensor, int root) override {
    checkTensor(tensor, "broadcast", "tensor");
    checkRank(root, "broadcast");
    if (auto refused = shared_->failure.refuseIfFailed()) return refused;
    OpInfo info = collective("broadcast", &tensor);
    info.what += fmt::format(" from rank {}", root);
    if (shared_->rank != root) info.peers = {root};
    if (tensor.numel() == 0) return std::make_shared<ReadyWork>();
    return start(std::move(info), {tensor}, nullptr, [&](MPI_Request* r) {
      return MPI_Ibcast(tensor.data_ptr(), mpiCount(tensor), moveDatatype(tensor), root,
                        shared_->comm, r);
    });
  }

  WorkPtr allgather(at::Tensor output, at::Tensor input) override {
    checkTensor(output, "allgather", "output");
    checkTensor(input, "allgather", "input");
    CARAVAN_CHECK(output.numel() == input.numel() * shared_->size &&
                      output.scalar_type() == input.scalar_type(),
                  "allgather: output has {}, needs {} x {}", describeTensor(output),
                  shared_->size, describeTensor(input));
    if (auto refused = shared_->failure.refuseIfFailed()) return refused;
    OpInfo info = collective("allgather", &input);
    if (input.numel() == 0) return std::make_shared<ReadyWork>();
    return start(std::move(info), {output, input}, nullptr, [&](MPI_Request* r) {
      return MPI_Iallgather(input.data_ptr(), mpiCount(input), moveDatatype(input),
                            output.data_ptr(), mpiCount(input), moveDatatype(output),
                            shared_->comm, r);
    });
  }

  WorkPtr reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) override {
    checkTensor(output, "reduceScatter", "output");
    checkTensor(input, "reduceScatter", "input");
    checkReducible(input, op, "reduceScatter");
    CARAVAN_CHECK(input.numel() == output.numel() * shared_->size &&
                      output.scalar_type() == input.scalar_type(),
                  "reduceScatter: input has {}, needs {} x {}", describeTensor(input),
                  shared_->size, describeTensor(output));
    if (auto refused = shared_->failure.refuseIfFailed()) return refused;
    OpInfo info = collective("reduceScatter", &input);
    if (output.numel() == 0) return std::make_shared<ReadyWork>();
    at::Tensor in = input.to(reduceType(input));
    at::Tensor out = output.to(reduceType(output));
    std::function<void()> finish;
    if (op == ReduceOp::kAvg || !out.is_same(output)) {
      finish = [output, out, avg = op == ReduceOp::kAvg, size = shared_->size]() mutable {
        if (avg) out.div_(size);
        if (!out.is_same(output)) output.copy_(out);
      };
    }
    return start(std::move(info), {output, input, in, out}, std::move(finish),
                 [&](MPI_Request* r) {
                   return MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), mpiCount(out),
                                                    reduceDatatype(in.scalar_type()), toMpi(op),
                                                    shared_->comm, r);
                 });
  }

  WorkPtr send(at::Tensor tensor, int dstRank, int tag) override {
    checkTensor(tensor, "send", "tensor");
    checkRank(dstRank, "send");
    checkTag(tag, "send");
    if (auto refused = shared_->failure.refuseIfFailed()) return refused;
    if (tensor.numel() == 0) return std::make_shared<ReadyWork>();
    OpInfo info{fmt::format("send to rank {} (tag {}, {})", dstRank, tag, describeTensor(tensor)),
                {dstRank}, Kind::kSend};
    return start(std::move(info), {tensor}, nullptr, [&](MPI_Request* r) {
      return MPI_Isend(tensor.data_ptr(), mpiCount(tensor), moveDatatype(tensor), dstRank, tag,
                       shared_->comm, r);
    });
  }

  WorkPtr recv(at::Tensor tensor, int srcRank, int tag) override {
    checkTensor(tensor, "recv", "tensor");
    checkRank(srcRank, "recv");
    checkTag(tag, "recv");
    if (auto refused = shared_->failure.refuseIfFailed()) return refused;
    if (tensor.numel() == 0) return std::make_shared<ReadyWork>();
    OpInfo info{
        fmt::format("recv from rank {} (tag {}, {})", srcRank, tag, describeTensor(tensor)),
        {srcRank}, Kind::kRecv};
    return start(std::move(info), {tensor}, nullptr, [&](MPI_Request* r) {
      return MPI_Irecv(tensor.data_ptr(), mpiCount(tensor), moveDatatype(tensor), srcRank, tag,
                       shared_->comm, r);
    });
  }

  WorkPtr barrier() override {
    if (auto refused = shared_->failure.refuseIfFailed()) return refused;
    OpInfo info = collective("barrier", nullptr);
    return start(std::move(info), {}, nullptr,
                 [&](MPI_Request* r) { return MPI_Ibarrier(shared_->comm, r); });
  }

 private:
  OpInfo collective(const char* name, const at::Tensor* t) {
    ++shared_->collectives;
    return {t ? fmt::format("{} #{} ({})", name, shared_->collectives, describeTensor(*t))
              : fmt::format("{} #{}", name, shared_->collectives),
            otherRanks(shared_->rank, shared_->size), Kind::kCollective};
  }

  WorkPtr start(OpInfo info, std::vector<at::Tensor> buffers, std::function<void()> finish,
                const std::function<int(MPI_Request*)>& call) {
    MPI_Request request = MPI_REQUEST_NULL;
    int rc;
    {
      auto lock = mpiLock();
      rc = call(&request);
    }
    if (rc != MPI_SUCCESS) {
      const std::string message = fmt::format("rank {}: {} could not start: {}", shared_->rank,
                                              info.what, mpiErrorString(rc));
      mpiProcess().skipFinalize = true;
      shared_->failure.set(message);
      return std::make_shared<ReadyWork>(std::make_exception_ptr(PeerError(message)));
    }
    return std::make_shared<MpiWork>(shared_, request, std::move(buffers), std::move(finish),
                                     std::move(info));
  }

  void checkRank(int r, const char* op) const {
    CARAVAN_CHECK(r >= 0 && r < shared_->size, "{}: rank {} is outside a world of {}", op, r,
                  shared_->size);
  }

  void checkTag(int tag, const char* op) const {
    CARAVAN_CHECK(tag >= 0 && tag <= shared_->tagUpperBound, "{}: tag {} is outside 0..{}", op,
                  tag, shared_->tagUpperBound);
  }

  std::shared_ptr<MpiShared> shared_;
};

}  // namespace

bool mpiBackendAvailable() { return true; }

void finalizeMpi() {
  if (!mpiProcess().initializedHere || mpiFinalized()) return;
  auto lock = mpiLock();
  MPI_Finalize();
}

std::unique_ptr<Communicator> makeMpiCommunicator(const MpiOptions& options) {
  return std::make_unique<MpiCommunicator>(options);
}

}  // namespace caravan
