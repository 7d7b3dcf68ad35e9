// caravan_bench_comm: all-reduce (sum, float32, in place) time and bus bandwidth of Caravan's
// communicators against the libraries they wrap, measured in the same process and interleaved.
// Driven by bench/comm_bandwidth.py; prints one JSON object per (size, implementation) on
// rank 0's stdout.
//
//   mpirun -np 2 --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader
//       build/caravan_bench_comm --min-bytes 1024 --max-bytes 67108864 --factor 4
//
// Implementations (each on its own buffer and its own connections):
//   caravan-gloo  GlooCommunicator::allreduce(kSum) + Work::wait (c10d::ProcessGroupGloo)
//   caravan-gloo-xN  the same with N TCP connections per pair (--connections N, striping)
//   caravan-shm   ShmCommunicator (shared memory; every rank on one host)
//   caravan-auto  dist.backend = auto: shm on one host, hierarchical on several (shared memory
//                 inside each host, Gloo between the hosts' leaders)
//   caravan-auto-xN  the same with N TCP connections per pair (--connections N)
//   raw-gloo      gloo::allreduce with gloo::AllreduceOptions on a gloo::rendezvous::Context over
//                 the TCP transport: the call ProcessGroupGloo makes, minus c10d
//   caravan-mpi   the MPI communicator's allreduce(kSum) + Work::wait (MPI_Iallreduce + MPI_Test)
//   raw-mpi       MPI_Allreduce(MPI_IN_PLACE, MPI_FLOAT, MPI_SUM) (Open MPI: coll/tuned)
//   raw-mpi-nb    MPI_Iallreduce + MPI_Wait: the call Caravan's MPI backend makes (Open MPI:
//                 coll/libnbc, which coll_tuned_* parameters do not affect)
//   memcpy        not an all-reduce: every rank copies its buffer into another at once, the
//                 memory bandwidth the shared-memory all-reduces share (busbw = algbw)
//
// Method: for each size, warm-up samples, then `repeats` rounds; each round takes one sample of
// every implementation in turn (A B C D E A B C D E ...). A sample is a barrier followed by
// `iters` back-to-back all-reduces (enough to fill ~--batch-bytes, at least 1); its time per
// all-reduce is the slowest rank's. The barriers and the maximum run on a separate raw Gloo
// context by default (--control gloo): it blocks rather than spins, so waiting ranks do not
// take CPU time from ranks still working when ranks outnumber cores. Reported: the median (and
// min/max) over rounds, algbw = bytes / time and busbw = algbw * 2 (n - 1) / n (nccl-tests'
// convention). Before timing, every implementation's result is checked (rank r contributes r + 1).
//
// --op pingpong measures send/recv instead: ranks pair up (0-1, 2-3, ...; an even number of
// ranks), the even rank sends its buffer and receives the odd rank's reply of the same size; a
// sample's time per round trip is halved: median_s is the one-way time, algbw = bytes / that
// (busbw = algbw). Implementations: the caravan-* communicators' send/recv, and raw-mpi
// (MPI_Send + MPI_Recv). Checked first: the odd rank holds the even rank's values.
//
// Rank and world size come from MPI under mpirun. Without mpirun (WORLD_SIZE set: ranks in
// network-namespace hosts, bench/comm_hosts.py) or in a build without MPI, they come from the
// environment (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as caravan's launcher and torchrun set
// them) and the MPI implementations are not available.
#if CARAVAN_BENCH_MPI
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/factory.h"
#include "comm/mpi_communicator.h"
#include "comm/store.h"
#include "comm/tcp_store.h"
#include "comm/world.h"
#include "core/errors.h"

using namespace caravan;
using Clock = std::chrono::steady_clock;

namespace {

// gloo's rendezvous Store over a c10d::Store (what ProcessGroupGloo's GlooStore does).
class GlooStoreAdapter : public ::gloo::rendezvous::Store {
 public:
  explicit GlooStoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_->get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// Synchronization and the cross-rank max of sample times, outside the measured operations.
class Control {
 public:
  virtual ~Control() = default;
  virtual void barrier() = 0;
  virtual double max(double v) = 0;
};

std::shared_ptr<::gloo::rendezvous::Context> glooContext(c10::intrusive_ptr<c10d::Store> store,
                                                         const std::string& prefix,
                                                         const std::string& hostname, int rank,
                                                         int size,
                                                         std::chrono::milliseconds timeout) {
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(store));
  auto adapter = std::make_shared<GlooStoreAdapter>(prefixed);
  ::gloo::transport::tcp::attr attr;
  attr.hostname = hostname;
  auto device = ::gloo::transport::tcp::CreateDevice(attr);
  auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  context->setTimeout(timeout);
  context->connectFullMesh(adapter, device);
  return context;
}

class GlooControl : public Control {
 public:
  explicit GlooControl(std::shared_ptr<::gloo::Context> c) : context_(std::move(c)) {}
  void barrier() override {
    ::gloo::BarrierOptions o(context_);
    o.setTag(tag_++);
    ::gloo::barrier(o);
  }
  double max(double v) override {
    ::gloo::AllreduceOptions o(context_);
    o.setOutput(&v, 1);
    o.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&::gloo::max<double>));
    o.setTag(tag_++);
    ::gloo::allreduce(o);
    return v;
  }

 private:
  std::shared_ptr<::gloo::Context> context_;
  uint32_t tag_ = 0;
};

#if CARAVAN_BENCH_MPI
class MpiControl : public Control {
 public:
  MpiControl() { MPI_Comm_dup(MPI_COMM_WORLD, &comm_); }
  ~MpiControl() override { MPI_Comm_free(&comm_); }
  void barrier() override { MPI_Barrier(comm_); }
  double max(double v) override {
    MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, comm_);
    return v;
  }

 private:
  MPI_Comm comm_;
};
#endif

// One implementation under test: runs one in-place float32 sum all-reduce of its buffer.
struct Impl {
  std::string name;
  std::function<void(at::Tensor&)> allreduce;
  at::Tensor buffer;    // sized per message size
  bool isCopy = false;  // memcpy: no result to check, busbw = algbw
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string envOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"caravan_bench_comm: all-reduce bus bandwidth, Caravan vs raw Gloo/MPI"};
  int64_t minBytes = 1024, maxBytes = 64ll << 20, factor = 4;
  int repeats = 10, warmup = 2;
  int64_t batchBytes = 8ll << 20;
  int maxIters = 100;
  int timeoutS = 300;
  std::vector<std::string> only;
  std::string controlKind = "gloo";
  std::string op = "allreduce";
  app.add_option("--op", op, "what to measure: allreduce, or pingpong (send/recv between pairs)")
      ->check(CLI::IsMember({"allreduce", "pingpong"}))
      ->default_val(op);
  app.add_option("--min-bytes", minBytes, "smallest message, bytes (float32)")->default_val(minBytes);
  app.add_option("--max-bytes", maxBytes, "largest message, bytes")->default_val(maxBytes);
  app.add_option("--factor", factor, "size step (multiplier)")->default_val(factor);
  app.add_option("--repeats", repeats, "measured rounds per size")->default_val(repeats);
  app.add_option("--warmup", warmup, "unmeasured rounds per size")->default_val(warmup);
  app.add_option("--batch-bytes", batchBytes,
                 "a sample runs ceil(batch-bytes / size) all-reduces back to back (1..max-iters)")
      ->default_val(batchBytes);
  app.add_option("--max-iters", maxIters, "most all-reduces per sample")->default_val(maxIters);
  app.add_option("--timeout", timeoutS, "seconds for rendezvous and each wait")->default_val(timeoutS);
  int connections = 2;
  app.add_option("--impls", only,
                 "measure these, in this order (default: caravan-gloo caravan-shm raw-gloo, and "
                 "caravan-mpi raw-mpi raw-mpi-nb under mpirun; also caravan-auto, "
                 "caravan-gloo-x<connections>, caravan-auto-x<connections>, memcpy)");
  app.add_option("--connections", connections,
                 "TCP connections per pair for caravan-gloo-x<N> and caravan-auto-x<N>")
      ->default_val(connections);
  app.add_option("--control", controlKind,
                 "what runs the barriers and time maxima between samples: gloo (a separate "
                 "raw Gloo context; blocks, so a rank waiting there leaves the CPU to the "
                 "others) or mpi (MPI_Barrier; busy-polls)")
      ->check(CLI::IsMember({"mpi", "gloo"}))
      ->default_val(controlKind);
  CLI11_PARSE(app, argc, argv);
  if (minBytes < 4 || maxBytes < minBytes || factor < 2 || repeats < 1 || warmup < 0 ||
      maxIters < 1) {
    std::cerr << "caravan_bench_comm: error: bad size range, factor, repeats or iters\n";
    return 2;
  }
  const auto timeout = std::chrono::milliseconds(int64_t{timeoutS} * 1000);

  try {
    at::set_num_threads(1);
    WorldInfo world;
    c10::intrusive_ptr<c10d::Store> store;
    // Ranks from mpirun (MPI builds, unless WORLD_SIZE is set without mpirun: ranks in network
    // namespace hosts), else from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.
    const bool useMpi = CARAVAN_BENCH_MPI && (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr ||
                                              std::getenv("WORLD_SIZE") == nullptr);
#if CARAVAN_BENCH_MPI
    if (useMpi) {
      int provided = 0;
      MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
      MPI_Comm_rank(MPI_COMM_WORLD, &world.rank);
      MPI_Comm_size(MPI_COMM_WORLD, &world.worldSize);
      world.launcher = "openmpi";
      world.masterAddr = "127.0.0.1";
      // Rank 0 serves the rendezvous store on a free loopback port and tells the others.
      int port = 0;
      if (world.rank == 0) {
        TcpStoreOptions o;
        o.host = world.masterAddr;
        o.port = 0;
        o.isServer = true;
        o.timeout = timeout;
        auto server = c10::make_intrusive<TcpStore>(o);
        port = server->port();
        store = server;
      }
      MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
      world.masterPort = port;
    }
#endif
    if (!useMpi) world = worldFromEnvironment(processEnvironment());
    if (!store) {
      StoreOptions so;
      so.timeout = timeout;
      store = makeStore(world, so);
    }
    const int rank = world.rank, n = world.worldSize;

    // What to measure: --impls, else every implementation this build and world have.
    std::vector<std::string> names = only;
    if (names.empty()) {
      names = {"caravan-gloo", "caravan-shm", "raw-gloo"};
      if (useMpi) names.insert(names.end(), {"caravan-mpi", "raw-mpi", "raw-mpi-nb"});
    }
    auto wanted = [&](const std::string& name) {
      return std::find(names.begin(), names.end(), name) != names.end();
    };
    const bool pingpong = op == "pingpong";
    if (pingpong && n % 2 != 0) {
      throw ConfigError(fmt::format("--op pingpong pairs ranks up: {} ranks is odd", n));
    }
    const std::string striped = fmt::format("caravan-gloo-x{}", connections);
    const std::string autoStriped = fmt::format("caravan-auto-x{}", connections);
    for (const auto& name : names) {
      const bool known =
          name == "caravan-gloo" || name == "caravan-shm" || name == "caravan-auto" ||
          name == striped || name == autoStriped || name == "raw-gloo" || name == "memcpy" ||
          (useMpi && (name == "caravan-mpi" || name == "raw-mpi" || name == "raw-mpi-nb"));
      if (pingpong && (name == "raw-gloo" || name == "memcpy" || name == "raw-mpi-nb")) {
        throw ConfigError(fmt::format("{} has no ping-pong here; use caravan-* or raw-mpi", name));
      }
      if (!known) {
        throw ConfigError(fmt::format(
            "unknown or unavailable implementation \"{}\" (this run "
            "has caravan-gloo, {}, caravan-shm, caravan-auto, {}, "
            "raw-gloo, memcpy{})",
            name, striped, autoStriped, useMpi ? ", caravan-mpi, raw-mpi, raw-mpi-nb" : ""));
      }
    }
    // The address other ranks reach this one at (a namespace host's own, or loopback).
    const std::string hostname = isLoopbackAddress(world.masterAddr)
                                     ? "127.0.0.1"
                                     : localAddressToward(world.masterAddr, world.masterPort);

    // Connections, in the same order on every rank (each under its own store prefix).
    auto prefixed = [&](const std::string& prefix) {
      return c10::make_intrusive<c10d::PrefixStore>(prefix, store);
    };
    std::unique_ptr<Communicator> glooComm, stripedComm, shmComm, autoComm, autoStripedComm;
    if (wanted("caravan-gloo")) glooComm = makeCommunicator("gloo", world, store, timeout);
    if (wanted(striped)) {
      stripedComm =
          makeCommunicator("gloo", world, prefixed("bench/striped"), timeout, {}, connections);
    }
    if (wanted("caravan-shm"))
      shmComm = makeCommunicator("shm", world, prefixed("bench/shm"), timeout);
    if (wanted("caravan-auto"))
      autoComm = makeCommunicator("auto", world, prefixed("bench/auto"), timeout);
    if (wanted(autoStriped)) {
      autoStripedComm =
          makeCommunicator("auto", world, prefixed("bench/auto-striped"), timeout, {}, connections);
    }
    std::shared_ptr<::gloo::Context> rawGloo;
    if (wanted("raw-gloo"))
      rawGloo = glooContext(store, "bench/raw-gloo", hostname, rank, n, timeout);
#if CARAVAN_BENCH_MPI
    std::unique_ptr<Communicator> mpiComm;
    MPI_Comm rawComm = MPI_COMM_NULL;
    if (useMpi) {
      if (wanted("caravan-mpi")) mpiComm = makeCommunicator("mpi", world, store, timeout);
      MPI_Comm_dup(MPI_COMM_WORLD, &rawComm);
    }
#endif
    std::unique_ptr<Control> control;
    if (controlKind == "gloo") {
      control = std::make_unique<GlooControl>(
          glooContext(store, "bench/control", hostname, rank, n, timeout));
    } else {
#if CARAVAN_BENCH_MPI
      if (!useMpi) throw ConfigError("--control mpi needs the ranks started by mpirun");
      control = std::make_unique<MpiControl>();
#else
      throw ConfigError("--control mpi needs a build with MPI");
#endif
    }

    const int partner = rank ^ 1;
    const bool sendsFirst = rank % 2 == 0;
    auto through = [&](std::unique_ptr<Communicator>& c) -> std::function<void(at::Tensor&)> {
      if (pingpong) {
        return [&c, timeout, partner, sendsFirst](at::Tensor& t) {
          if (sendsFirst) c->send(t, partner, 0)->wait(timeout);
          c->recv(t, partner, 0)->wait(timeout);
          if (!sendsFirst) c->send(t, partner, 0)->wait(timeout);
        };
      }
      return [&c, timeout](at::Tensor& t) { c->allreduce(t, ReduceOp::kSum)->wait(timeout); };
    };
    uint32_t rawGlooTag = 0;
    at::Tensor copyTarget;
    std::vector<Impl> impls;
    for (const auto& name : names) {
      if (name == "caravan-gloo") impls.push_back({name, through(glooComm)});
      if (name == striped) impls.push_back({name, through(stripedComm)});
      if (name == "caravan-shm") impls.push_back({name, through(shmComm)});
      if (name == "caravan-auto") impls.push_back({name, through(autoComm)});
      if (name == autoStriped) impls.push_back({name, through(autoStripedComm)});
      if (name == "raw-gloo") {
        impls.push_back({name, [&](at::Tensor& t) {
                           ::gloo::AllreduceOptions o(rawGloo);
                           o.setOutput(t.data_ptr<float>(), static_cast<size_t>(t.numel()));
                           o.setReduceFunction(
                               static_cast<void (*)(void*, const void*, const void*, size_t)>(
                                   &::gloo::sum<float>));
                           o.setTag(rawGlooTag++);
                           o.setTimeout(timeout);
                           ::gloo::allreduce(o);
                         }});
      }
      if (name == "memcpy") {
        // Not an all-reduce: every rank copies the buffer into another at once (the memory
        // bandwidth the all-reduces share); reported with busbw = algbw.
        impls.push_back({name,
                         [&](at::Tensor& t) {
                           if (copyTarget.numel() != t.numel()) copyTarget = at::empty_like(t);
                           std::memcpy(copyTarget.data_ptr(), t.data_ptr(), t.nbytes());
                         },
                         {},
                         /*isCopy=*/true});
      }
#if CARAVAN_BENCH_MPI
      if (name == "caravan-mpi") impls.push_back({name, through(mpiComm)});
      if (name == "raw-mpi" && pingpong) {
        impls.push_back({name, [&](at::Tensor& t) {
                           const int count = static_cast<int>(t.numel());
                           float* p = t.data_ptr<float>();
                           if (sendsFirst) MPI_Send(p, count, MPI_FLOAT, partner, 0, rawComm);
                           MPI_Recv(p, count, MPI_FLOAT, partner, 0, rawComm, MPI_STATUS_IGNORE);
                           if (!sendsFirst) MPI_Send(p, count, MPI_FLOAT, partner, 0, rawComm);
                         }});
      } else if (name == "raw-mpi") {
        impls.push_back({name, [&](at::Tensor& t) {
                           MPI_Allreduce(MPI_IN_PLACE, t.data_ptr<float>(),
                                         static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM, rawComm);
                         }});
      }
      if (name == "raw-mpi-nb") {
        impls.push_back({name, [&](at::Tensor& t) {
                           MPI_Request r;
                           MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr<float>(),
                                          static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM, rawComm,
                                          &r);
                           MPI_Wait(&r, MPI_STATUS_IGNORE);
                         }});
      }
#endif
    }

    if (rank == 0) {
      nlohmann::json info = {
          {"bench", pingpong ? "pingpong-info" : "allreduce-info"},
          {"ranks", n},
          {"mpi", bool(CARAVAN_BENCH_MPI)},
          {"impls",
           [&] {
             std::vector<std::string> v;
             for (auto& i : impls) v.push_back(i.name);
             return v;
           }()},
          {"coll_tuned_use_dynamic_rules", envOr("OMPI_MCA_coll_tuned_use_dynamic_rules", "")},
          {"coll_tuned_allreduce_algorithm", envOr("OMPI_MCA_coll_tuned_allreduce_algorithm", "")},
          {"coll_libnbc_iallreduce_algorithm",
           envOr("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "")},
          {"repeats", repeats},
          {"warmup", warmup},
          {"control", controlKind}};
      std::cout << info.dump() << std::endl;
    }

    const double busFactor = 2.0 * (n - 1) / n;
    for (int64_t bytes = minBytes; bytes <= maxBytes; bytes *= factor) {
      const int64_t elements = bytes / 4;
      const int iters = static_cast<int>(
          std::clamp<int64_t>((batchBytes + bytes - 1) / bytes, 1, maxIters));
      // Correctness first: rank r contributes r + 1 everywhere; the sum is n (n + 1) / 2. A
      // ping-pong leaves the even rank's values (rank + 1) on both ranks of a pair.
      const float expected =
          pingpong ? static_cast<float>((rank & ~1) + 1) : static_cast<float>(n * (n + 1) / 2);
      for (auto& impl : impls) {
        impl.buffer = at::full({elements}, static_cast<float>(rank + 1), at::kFloat);
        if (impl.isCopy) continue;
        impl.allreduce(impl.buffer);
        const double err = (impl.buffer - expected).abs().max().item<double>();
        if (err != 0.0) {
          throw Error(ExitCode::kInternal,
                      fmt::format("{}: {} bytes: result off by {} (rank {})", impl.name, bytes,
                                  err, rank));
        }
        impl.buffer.zero_();  // timed on zeros: sums stay finite and never denormal
      }
      std::vector<std::vector<double>> samples(impls.size());
      for (int round = 0; round < warmup + repeats; ++round) {
        for (size_t k = 0; k < impls.size(); ++k) {
          control->barrier();
          const auto start = Clock::now();
          for (int i = 0; i < iters; ++i) impls[k].allreduce(impls[k].buffer);
          const double perOp =
              std::chrono::duration<double>(Clock::now() - start).count() / iters;
          const double slowest = control->max(perOp);
          if (round >= warmup) samples[k].push_back(slowest);
        }
      }
      if (rank == 0) {
        for (size_t k = 0; k < impls.size(); ++k) {
          // A ping-pong's sample is a round trip: one way is half of it.
          const double scale = pingpong ? 0.5 : 1.0;
          const double med = scale * median(samples[k]);
          const double algbw = static_cast<double>(bytes) / med / 1e9;
          nlohmann::json row = {
              {"bench", op},
              {"impl", impls[k].name},
              {"ranks", n},
              {"bytes", bytes},
              {"iters_per_sample", iters},
              {"repeats", repeats},
              {"median_s", med},
              {"min_s", scale * *std::min_element(samples[k].begin(), samples[k].end())},
              {"max_s", scale * *std::max_element(samples[k].begin(), samples[k].end())},
              {"algbw_GBps", algbw},
              {"busbw_GBps", impls[k].isCopy || pingpong ? algbw : algbw * busFactor}};
          std::cout << row.dump() << std::endl;
        }
      }
      for (auto& impl : impls) impl.buffer = at::Tensor();
    }

    control->barrier();
    control.reset();
    rawGloo.reset();
    glooComm.reset();
    stripedComm.reset();
    shmComm.reset();
    autoComm.reset();
    autoStripedComm.reset();
#if CARAVAN_BENCH_MPI
    if (useMpi) {
      mpiComm.reset();
      MPI_Comm_free(&rawComm);
      store.reset();
      MPI_Finalize();
    }
#endif
    return 0;
  } catch (const Error& e) {
    std::cerr << "caravan_bench_comm: error: " << e.what() << std::endl;
#if CARAVAN_BENCH_MPI
    if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr)
      MPI_Abort(MPI_COMM_WORLD, static_cast<int>(e.code()));
#endif
    return static_cast<int>(e.code());
  } catch (const std::exception& e) {
    std::cerr << "caravan_bench_comm: error: " << e.what() << std::endl;
#if CARAVAN_BENCH_MPI
    if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
    return 1;
  }
}
