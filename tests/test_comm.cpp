// Tests of the comm/ layer: rendezvous stores, the communicator factory, and one collective
// suite run against every backend with exact expected values.
//
// This file is compiled twice. In caravan_tests the Gloo backend runs W ranks as threads of
// this process over an in-memory c10d::HashStore ("multi-rank in one process"), W = 1..4, and
// the store and fault tests run. Compiled with CARAVAN_COMM_MPI_TESTS it is caravan_mpi_tests:
// each process is one MPI rank, CTest starts it under mpirun with 1..4 processes (CommMpi.npN)
// and the same collective checks run on the MPI world communicator.
//
// Inputs are small integers (-8..8), so sums over 4 ranks are exact in float32 and bfloat16,
// and every result is compared bit for bit.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "cli/launch.h"
#include "comm/auth.h"
#include "comm/comm_util.h"
#include "comm/communicator.h"
#include "comm/counting_communicator.h"
#include "comm/factory.h"
#include "comm/gloo_communicator.h"
#include "comm/hierarchical_communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/shm_communicator.h"
#include "comm/store.h"
#include "comm/tcp_store.h"
#include "comm/world.h"
#include "gloo_ranks.h"

namespace caravan {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Generous: two cores shared with other work. A hang still ends here, not at CTest's limit.
constexpr milliseconds kOpTimeout{20000};
const std::vector<int64_t> kCounts = {0, 1, 7, 1 << 20};

int64_t elapsedMs(Clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
}

// Rank `rank`'s input elements [offset, offset + n) for a check numbered `salt`: integers in
// -8..8, float32.
// (A plain loop: ATen's int64 remainder is ~10x slower, and W rank threads call this a lot.)
at::Tensor inputFor(int rank, int64_t n, int salt, int64_t offset = 0) {
  at::Tensor t = at::empty({n}, at::kFloat);
  float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    p[i] = static_cast<float>(((offset + i) * 7 + rank * 5 + salt * 3) % 17 - 8);
  }
  return t;
}

// Every rank's inputs stacked: (size, n).
at::Tensor allInputs(int size, int64_t n, int salt, int64_t offset = 0) {
  std::vector<at::Tensor> rows;
  for (int r = 0; r < size; ++r) rows.push_back(inputFor(r, n, salt, offset));
  return at::stack(rows);
}

at::Tensor reduceRows(const at::Tensor& rows, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return rows.sum(0);
    case ReduceOp::kAvg: return rows.sum(0) / static_cast<double>(rows.size(0));
    case ReduceOp::kMax: return std::get<0>(rows.max(0));
    case ReduceOp::kMin: return std::get<0>(rows.min(0));
  }
  return rows;
}

const char* opName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

// Bit-exact comparison; on a mismatch says where.
void expectExact(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  ASSERT_EQ(actual.numel(), expected.numel()) << what;
  const at::Tensor a = actual.reshape(-1).to(at::kFloat);
  const at::Tensor e = expected.reshape(-1).to(at::kFloat);
  if (at::equal(a, e)) return;
  const int64_t i = (a != e).nonzero()[0][0].item<int64_t>();
  ADD_FAILURE() << what << ": element " << i << " is " << a[i].item<float>() << ", expected "
                << e[i].item<float>();
}

// The collective checks every backend must pass, from one rank's point of view. Every rank
// calls this with the same arguments; it ends with a barrier, so no rank leaves early.
// `arrived`, when given, is shared by all ranks (threads) and checks the barrier itself.
void checkCollectives(Communicator& c, int64_t n, at::ScalarType dt,
                      std::atomic<int>* arrived = nullptr) {
  const int size = c.size();
  const int rank = c.rank();
  const std::string where = fmt::format("rank {} of {}, {} x {}", rank, size, n,
                                        comm::dtypeName(dt));
  int salt = 0;
  // Every op at every size, except that the large size skips the variants that add time but
  // no coverage (MIN, reduce-scatter AVG/MAX and int64 behave like their small-size runs).
  const bool large = n > 4096;
  const std::vector<ReduceOp> allreduceOps =
      large ? std::vector<ReduceOp>{ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}
            : std::vector<ReduceOp>{ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax,
                                    ReduceOp::kMin};
  const std::vector<ReduceOp> reduceScatterOps =
      large ? std::vector<ReduceOp>{ReduceOp::kSum}
            : std::vector<ReduceOp>{ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

  for (ReduceOp op : allreduceOps) {
    ++salt;
    at::Tensor t = inputFor(rank, n, salt).to(dt);
    c.allreduce(t, op)->wait(kOpTimeout);
    expectExact(t, reduceRows(allInputs(size, n, salt), op).to(dt),
                fmt::format("allreduce {} ({})", opName(op), where));
  }

  for (int root = 0; root < size; ++root) {
    ++salt;
    at::Tensor t = inputFor(rank, n, salt).to(dt);
    c.broadcast(t, root)->wait(kOpTimeout);
    expectExact(t, inputFor(root, n, salt).to(dt),
                fmt::format("broadcast from {} ({})", root, where));
  }

  {
    ++salt;
    at::Tensor in = inputFor(rank, n, salt).to(dt);
    at::Tensor out = at::full({size * n}, -99, dt);
    c.allgather(out, in)->wait(kOpTimeout);
    expectExact(out, allInputs(size, n, salt).reshape(-1).to(dt),
                fmt::format("allgather ({})", where));
  }

  for (ReduceOp op : reduceScatterOps) {
    ++salt;
    at::Tensor in = inputFor(rank, size * n, salt).to(dt);
    at::Tensor out = at::full({n}, -99, dt);
    c.reduceScatter(out, in, op)->wait(kOpTimeout);
    // Rank r's chunk: elements [r n, (r+1) n) of every rank's input, reduced.
    expectExact(out, reduceRows(allInputs(size, n, salt, rank * n), op).to(dt),
                fmt::format("reduceScatter {} ({})", opName(op), where));
    expectExact(in, inputFor(rank, size * n, salt).to(dt),
                fmt::format("reduceScatter {} leaves its input alone ({})", opName(op), where));
  }

  {
    // Ring: receive from the previous rank, send to the next (to itself when alone).
    ++salt;
    const int next = (rank + 1) % size;
    const int prev = (rank + size - 1) % size;
    at::Tensor out = inputFor(rank, n, salt).to(dt);
    at::Tensor in = at::full({n}, -99, dt);
    WorkPtr r = c.recv(in, prev, 7);
    WorkPtr s = c.send(out, next, 7);
    r->wait(kOpTimeout);
    s->wait(kOpTimeout);
    expectExact(in, inputFor(prev, n, salt).to(dt), fmt::format("ring recv ({})", where));
  }

  if (!large) {
    ++salt;
    at::Tensor t = at::arange(n, at::kLong) * (rank + 1);
    c.allreduce(t, ReduceOp::kSum)->wait(kOpTimeout);
    expectExact(t, at::arange(n, at::kLong) * (size * (size + 1) / 2),
                fmt::format("allreduce int64 ({})", where));
  }

  if (arrived != nullptr) ++*arrived;
  c.barrier()->wait(kOpTimeout);
  if (arrived != nullptr) {
    EXPECT_GE(arrived->load(), size) << "barrier returned before every rank arrived (" << where
                                     << ")";
  }
}

std::string paramName(int size, int64_t n, at::ScalarType dt) {
  std::string name = size > 0 ? fmt::format("w{}_", size) : "";
  if (n >= 0) name += fmt::format("n{}_", n);
  return name + comm::dtypeName(dt);
}

#ifndef CARAVAN_COMM_MPI_TESTS

// ---------------------------------------------------------------------------------------------
// Gloo: ranks as threads.

// Runs body(comm) on `size` threads, each one rank with its own GlooCommunicator over `store`.
// Returns each rank's exception message ("" when it returned normally).
std::vector<std::string> runGlooRanks(int size, const GlooOptions& options,
                                      const std::function<void(Communicator&)>& body,
                                      c10::intrusive_ptr<c10d::Store> store = {},
                                      const std::vector<int>& ranks = {}) {
  return test::runGlooRanks(
      size, options, [&](std::shared_ptr<Communicator> c) { body(*c); }, std::move(store),
      ranks);
}

GlooOptions loopbackOptions(milliseconds timeout = kOpTimeout) {
  return test::loopbackOptions(timeout);
}

class CommGlooCollectives : public ::testing::TestWithParam<std::tuple<int, at::ScalarType>> {};

TEST_P(CommGlooCollectives, MatchExpected) {
  const auto [size, dt] = GetParam();
  // One set of communicators per world size and dtype; every element count runs on it.
  std::vector<std::atomic<int>> arrived(kCounts.size());
  auto errors = runGlooRanks(size, loopbackOptions(), [&](Communicator& c) {
    for (size_t i = 0; i < kCounts.size(); ++i) checkCollectives(c, kCounts[i], dt, &arrived[i]);
  });
  for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(CommGloo, CommGlooCollectives,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(at::kFloat, at::kBFloat16)),
                         [](const auto& info) {
                           return paramName(std::get<0>(info.param), -1, std::get<1>(info.param));
                         });

// Job-token proofs over Gloo's connections (comm/auth.h): ranks with the same token pass and
// can communicate after; a rank with another token (a stranger in a peer's place) is refused by
// every other rank, naming it, and itself refuses them.
TEST(CommAuth, PeersProveTheJobTokenWithoutSendingIt) {
  auto same = runGlooRanks(3, loopbackOptions(), [&](Communicator& c) {
    authenticatePeers(c, "job-secret");
    at::Tensor t = at::ones({4});
    c.allreduce(t, ReduceOp::kSum)->wait(kOpTimeout);
    if (t[0].item<float>() != 3.0f) throw std::runtime_error("wrong sum after authentication");
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(same[r], "") << "rank " << r;
  auto mixed = runGlooRanks(3, loopbackOptions(), [&](Communicator& c) {
    authenticatePeers(c, c.rank() == 2 ? "a-guess" : "job-secret");
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(mixed[r].find("rank 2's connection to rank " + std::to_string(r) +
                            " did not prove the job token"),
              std::string::npos)
        << mixed[r];
  }
  EXPECT_NE(mixed[2].find("did not prove the job token"), std::string::npos) << mixed[2];
  EXPECT_EQ(mixed[2].find("job-secret"), std::string::npos) << "the token is never shown";
}

TEST(CommGlooFaults, RecvNobodySendsTimesOutNamingThePeer) {
  std::atomic<bool> rank0Done{false};
  int64_t waitedMs = -1;
  std::string message, later;
  auto errors = runGlooRanks(2, loopbackOptions(milliseconds(5000)), [&](Communicator& c) {
    if (c.rank() == 0) {
      at::Tensor t = at::zeros({4});
      const auto start = Clock::now();
      WorkPtr w = c.recv(t, 1, 5);
      try {
        w->wait(milliseconds(500));
      } catch (const PeerError& e) {
        message = e.what();
      }
      waitedMs = elapsedMs(start);
      // The first failure is final: later operations fail at once with it.
      try {
        c.allreduce(t, ReduceOp::kSum)->wait(milliseconds(500));
      } catch (const PeerError& e) {
        later = e.what();
      }
      rank0Done = true;
    } else {
      while (!rank0Done) std::this_thread::sleep_for(milliseconds(10));  // alive, never sends
    }
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
  EXPECT_NE(message.find("500 ms"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_GE(waitedMs, 450);
  EXPECT_LT(waitedMs, 2500);
  EXPECT_NE(later.find("earlier failure"), std::string::npos) << later;
}

TEST(CommGlooFaults, CollectiveTimeoutNamesThePeer) {
  std::atomic<bool> rank0Done{false};
  std::string message;
  int64_t waitedMs = -1;
  auto errors = runGlooRanks(2, loopbackOptions(milliseconds(2000)), [&](Communicator& c) {
    if (c.rank() == 0) {
      at::Tensor t = at::ones({3});
      const auto start = Clock::now();
      try {
        c.allreduce(t, ReduceOp::kSum)->wait(milliseconds(300));
      } catch (const PeerError& e) {
        message = e.what();
      }
      waitedMs = elapsedMs(start);
      rank0Done = true;
    } else {
      while (!rank0Done) std::this_thread::sleep_for(milliseconds(10));  // never joins
    }
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
  EXPECT_NE(message.find("allreduce #1"), std::string::npos) << message;
  EXPECT_GE(waitedMs, 250);
  EXPECT_LT(waitedMs, 2000);
}

// A reduce-scatter (a ring of point-to-point messages on a worker thread) that a rank never
// joins fails like any collective: a wait that runs out says so within its own timeout, and a
// longer one ends at Gloo's I/O timeout (the ring's own wait for a message); both name the
// ranks it depends on, and the communicator fails later operations at once.
TEST(CommGlooFaults, ReduceScatterARankNeverJoinsTimesOutNamingThePeers) {
  std::atomic<int> done{0};
  std::vector<std::string> messages(2), later(2);
  std::vector<int64_t> waitedMs(2, -1);
  auto errors = runGlooRanks(3, loopbackOptions(milliseconds(1500)), [&](Communicator& c) {
    if (c.rank() < 2) {
      at::Tensor in = at::ones({3 * 5}), out = at::empty({5});
      const auto start = Clock::now();
      try {
        c.reduceScatter(out, in, ReduceOp::kSum)->wait(milliseconds(c.rank() == 0 ? 300 : 10000));
      } catch (const PeerError& e) {
        messages[c.rank()] = e.what();
      }
      waitedMs[c.rank()] = elapsedMs(start);
      try {
        c.allreduce(at::ones({2}), ReduceOp::kSum)->wait(kOpTimeout);
      } catch (const PeerError& e) {
        later[c.rank()] = e.what();
      }
      ++done;
    } else {
      while (done < 2) std::this_thread::sleep_for(milliseconds(10));  // never joins
    }
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_NE(messages[0].find("reduceScatter #1"), std::string::npos) << messages[0];
  EXPECT_NE(messages[0].find("ranks 1, 2"), std::string::npos) << messages[0];
  EXPECT_NE(messages[0].find("300 ms"), std::string::npos) << messages[0];
  EXPECT_GE(waitedMs[0], 250);
  EXPECT_LT(waitedMs[0], 1400);
  EXPECT_NE(messages[1].find("reduceScatter #1"), std::string::npos) << messages[1];
  EXPECT_NE(messages[1].find("ranks 0, 2"), std::string::npos) << messages[1];
  EXPECT_GE(waitedMs[1], 1400);
  EXPECT_LT(waitedMs[1], 8000);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(later[r].find("earlier failure"), std::string::npos)
        << "rank " << r << ": " << later[r];
  }
}

TEST(CommGlooFaults, PeerClosingItsConnectionFailsFastNamingIt) {
  std::string message;
  int64_t waitedMs = -1;
  auto errors = runGlooRanks(2, loopbackOptions(milliseconds(10000)), [&](Communicator& c) {
    c.barrier()->wait(kOpTimeout);
    if (c.rank() == 0) {
      at::Tensor t = at::zeros({4});
      const auto start = Clock::now();
      try {
        c.recv(t, 1, 3)->wait(milliseconds(10000));
      } catch (const PeerError& e) {
        message = e.what();
      }
      waitedMs = elapsedMs(start);
    }
    // rank 1 returns at once: its communicator is destroyed and its connections close.
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
  EXPECT_LT(waitedMs, 5000) << message;
}

// The rendezvous has its own limit (fault.rendezvous_timeout), shorter than the one for peers
// in collectives, and says how many ranks arrived.
TEST(CommGlooFaults, MissingRankAtRendezvousIsNamedWithinTheJoinTimeout) {
  GlooOptions options = loopbackOptions(milliseconds(20000));
  options.joinTimeout = milliseconds(500);
  const auto start = Clock::now();
  auto errors = runGlooRanks(3, options, [](Communicator&) {}, {}, {0, 1});
  EXPECT_LT(elapsedMs(start), 3000);
  for (int r : {0, 1}) {
    EXPECT_NE(errors[r].find("2 of 3 ranks arrived at the rendezvous within 500 ms; rank 2 did "
                             "not"),
              std::string::npos)
        << errors[r];
  }
}

// The same checks with the stores a real job uses, through makeStore and makeCommunicator.
TEST(CommGloo, RunsOverTheTcpAndFileStores) {
  const int size = 3;
  for (const std::string kind : {"tcp", "file"}) {
    SCOPED_TRACE(kind);
    char dirTemplate[] = "/tmp/caravan-comm-XXXXXX";
    ASSERT_NE(::mkdtemp(dirTemplate), nullptr);
    StoreOptions so;
    so.kind = kind;
    so.filePath = std::string(dirTemplate) + "/store";
    so.timeout = milliseconds(10000);
    WorldInfo w0;
    w0.worldSize = size;
    w0.masterPort = 0;  // tcp: rank 0 picks a free port, the others learn it below
    c10::intrusive_ptr<c10d::Store> store0 = makeStore(w0, so);
    if (kind == "tcp") w0.masterPort = dynamic_cast<TcpStore&>(*store0).port();
    std::vector<std::string> errors(size);
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        try {
          WorldInfo w = w0;
          w.rank = r;
          auto store = r == 0 ? store0 : makeStore(w, so);
          auto comm = makeCommunicator("gloo", w, store, kOpTimeout);
          EXPECT_EQ(comm->backend(), "gloo");
          EXPECT_EQ(comm->rank(), r);
          checkCollectives(*comm, 7, at::kFloat);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
    store0.reset();
    std::filesystem::remove_all(dirTemplate);
  }
}

// ---------------------------------------------------------------------------------------------
// Stores.

TcpStoreOptions serverOptions(milliseconds timeout = milliseconds(5000)) {
  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.isServer = true;
  o.timeout = timeout;
  o.token = "job-1";
  return o;
}

TcpStoreOptions clientOptions(int port, milliseconds timeout = milliseconds(5000)) {
  TcpStoreOptions o = serverOptions(timeout);
  o.port = port;
  o.isServer = false;
  return o;
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

TEST(CommStore, TcpStoreServesItsClients) {
  TcpStore server(serverOptions());
  ASSERT_GT(server.port(), 0);
  TcpStore a(clientOptions(server.port()));
  TcpStore b(clientOptions(server.port()));

  a.set("x", bytes("hello"));
  EXPECT_EQ(text(b.get("x")), "hello");
  EXPECT_EQ(text(server.get("x")), "hello");
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(b.add("n", 5), 7);
  EXPECT_EQ(server.add("n", 1), 8);
  EXPECT_EQ(text(a.get("n")), "8");
  EXPECT_TRUE(b.check({"x", "n"}));
  EXPECT_FALSE(b.check({"x", "missing"}));
  EXPECT_EQ(a.getNumKeys(), 2);
  // compareSet: swaps only when the current value is the expected one.
  EXPECT_EQ(text(a.compareSet("x", bytes("nope"), bytes("y"))), "hello");
  EXPECT_EQ(text(b.compareSet("x", bytes("hello"), bytes("y"))), "y");
  EXPECT_EQ(text(a.compareSet("fresh", {}, bytes("z"))), "z");
  EXPECT_TRUE(a.deleteKey("fresh"));
  EXPECT_FALSE(a.deleteKey("fresh"));

  // get() and wait() block until another rank sets the key.
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(100));
    b.set("late", bytes("1"));
    server.set("late2", bytes("2"));
  });
  EXPECT_EQ(text(a.get("late")), "1");
  a.wait({"late", "late2"}, milliseconds(3000));
  setter.join();

  // A value of ~1 MB crosses intact.
  std::vector<uint8_t> big(1 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 31);
  a.set("big", big);
  EXPECT_EQ(b.get("big"), big);
}

TEST(CommStore, WaitForAMissingKeyTimesOutWithPeerError) {
  TcpStore server(serverOptions());
  TcpStore client(clientOptions(server.port()));
  for (c10d::Store* s : {static_cast<c10d::Store*>(&server), static_cast<c10d::Store*>(&client)}) {
    const auto start = Clock::now();
    try {
      s->wait({"never"}, milliseconds(200));
      ADD_FAILURE() << "wait returned";
    } catch (const PeerError& e) {
      EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
    }
    EXPECT_GE(elapsedMs(start), 190);
    EXPECT_LT(elapsedMs(start), 2000);
  }
}

// A port nothing listens on (bound once, then closed).
int closedPort() {
  TcpStore probe(serverOptions());
  return probe.port();
}

TEST(CommStore, UnreachableMasterFailsWithinTheTimeoutNamingIt) {
  const int port = closedPort();
  WorldInfo w;
  w.rank = 1;
  w.worldSize = 2;
  w.masterAddr = "127.0.0.1";
  w.masterPort = port;
  StoreOptions so;
  so.timeout = milliseconds(1000);
  const auto start = Clock::now();
  try {
    makeStore(w, so);
    ADD_FAILURE() << "connected to a closed port";
  } catch (const PeerError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(fmt::format("127.0.0.1:{}", port)), std::string::npos) << m;
    EXPECT_NE(m.find("MASTER_ADDR"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_GE(elapsedMs(start), 900);
  EXPECT_LT(elapsedMs(start), 2500);
}

TEST(CommStore, ClientsMayStartBeforeTheServer) {
  const int port = closedPort();
  std::unique_ptr<TcpStore> server;
  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(300));
    TcpStoreOptions o = serverOptions();
    o.port = port;
    server = std::make_unique<TcpStore>(o);
    server->set("up", bytes("1"));
  });
  TcpStore client(clientOptions(port));
  EXPECT_EQ(text(client.get("up")), "1");
  later.join();
}

TEST(CommStore, PortInUseIsAConfigErrorNamingIt) {
  TcpStore first(serverOptions());
  TcpStoreOptions o = serverOptions();
  o.port = first.port();
  try {
    TcpStore second(o);
    ADD_FAILURE() << "two servers on one port";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(first.port())), std::string::npos)
        << e.what();
  }
}

// Slurm gives the tasks per node as runs ("2(x3),1"); a task's local count is its node's
// entry, so that tasks sharing a node get passive OpenMP workers (core/openmp_env.h).
TEST(CommWorld, SlurmTasksShareANodeAsTheTasksPerNodeListSays) {
  EXPECT_EQ(slurmTasksOnNode("2(x3),1", 0), 2);
  EXPECT_EQ(slurmTasksOnNode("2(x3),1", 2), 2);
  EXPECT_EQ(slurmTasksOnNode("2(x3),1", 3), 1);
  EXPECT_EQ(slurmTasksOnNode("2(x3),1", 4), 0);
  EXPECT_EQ(slurmTasksOnNode("4", 0), 4);
  EXPECT_EQ(slurmTasksOnNode("1,3(x2)", 2), 3);
  for (const char* bad : {"", "x", "2(x", "2(x3", "2(x0)", "0", "2(x3)y", "-1"}) {
    EXPECT_EQ(slurmTasksOnNode(bad, 0), 0) << bad;
  }
  auto local = [](const Environment& extra) {
    Environment env = {{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "7"}, {"SLURM_NODEID", "1"}};
    env.insert(extra.begin(), extra.end());
    return worldFromEnvironment(env).localWorldSize;
  };
  EXPECT_EQ(local({{"SLURM_STEP_TASKS_PER_NODE", "3(x2),1"}}), 3);
  EXPECT_EQ(local({{"SLURM_TASKS_PER_NODE", "1,6"}}), 6);
  EXPECT_EQ(local({{"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"}, {"SLURM_TASKS_PER_NODE", "1,6"}}),
            2);             // the step's count first
  EXPECT_EQ(local({}), 1);  // not given: as if alone
}

// Rank 0 serves on the socket its launcher bound (CARAVAN_STORE_FD) and binds nothing itself;
// a descriptor that is not a socket listening at MASTER_PORT is refused in one line.
TEST(CommStore, RankZeroServesOnTheSocketItWasHanded) {
  const LoopbackListener l = listenOnLoopback();
  WorldInfo w = worldFromEnvironment({{"RANK", "0"},
                                      {"WORLD_SIZE", "2"},
                                      {"MASTER_PORT", std::to_string(l.port)},
                                      {kStoreFdVariable, std::to_string(l.fd)}});
  ASSERT_EQ(w.storeFd, l.fd);
  StoreOptions so;
  so.token = "job-1";
  auto server = makeStore(w, so);
  TcpStore client(clientOptions(l.port));
  client.set("x", bytes("1"));
  EXPECT_EQ(text(server->get("x")), "1");
  EXPECT_EQ(::fcntl(l.fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  // Rank 1 ignores the variable: only rank 0 serves.
  EXPECT_EQ(
      worldFromEnvironment({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {kStoreFdVariable, "3"}}).storeFd,
      -1);

  int pipeFds[2];
  ASSERT_EQ(::pipe(pipeFds), 0);
  const LoopbackListener other = listenOnLoopback();
  for (const int fd : {pipeFds[0], other.fd}) {
    TcpStoreOptions o = serverOptions();
    o.port = l.port;
    o.listenFd = fd;
    try {
      TcpStore wrong(o);
      ADD_FAILURE() << "served on descriptor " << fd;
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("CARAVAN_STORE_FD"), std::string::npos) << m;
      EXPECT_NE(m.find(fmt::format("127.0.0.1:{}", l.port)), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
  }
  ::close(pipeFds[0]);
  ::close(pipeFds[1]);
  ::close(other.fd);
}

TEST(CommStore, AnotherJobsTokenIsRefused) {
  TcpStore server(serverOptions());
  TcpStoreOptions o = clientOptions(server.port());
  o.token = "job-2";
  EXPECT_THROW(TcpStore client(o), ConfigError);
}

// The server listens on the master address only (here loopback), not on every interface.
TEST(CommStore, ServerListensOnTheMasterAddressOnly) {
  TcpStore server(serverOptions());
  std::ifstream in("/proc/net/tcp");
  ASSERT_TRUE(in) << "no /proc/net/tcp";
  const std::string wanted = fmt::format("0100007F:{:04X}", server.port());
  std::string line;
  bool found = false;
  while (std::getline(in, line)) {
    if (line.find(fmt::format(":{:04X} ", server.port())) == std::string::npos) continue;
    if (line.find(" 0A ") == std::string::npos) continue;  // LISTEN
    EXPECT_NE(line.find(wanted), std::string::npos) << line;
    found = true;
  }
  EXPECT_TRUE(found);
}

TEST(CommStore, FileStoreAndBadOptions) {
  char dirTemplate[] = "/tmp/caravan-store-XXXXXX";
  ASSERT_NE(::mkdtemp(dirTemplate), nullptr);
  StoreOptions so;
  so.kind = "file";
  so.filePath = std::string(dirTemplate) + "/store";
  so.timeout = milliseconds(2000);
  WorldInfo w;
  w.worldSize = 2;
  {
    auto s0 = makeStore(w, so);
    w.rank = 1;
    auto s1 = makeStore(w, so);
    s0->set("k", bytes("v"));
    EXPECT_EQ(text(s1->get("k")), "v");
  }
  so.filePath = std::string(dirTemplate) + "/no/such/dir/store";
  EXPECT_THROW(makeStore(w, so), ConfigError);
  // What is not a store file is refused at once, not read as one (a garbage length spins).
  so.filePath = dirTemplate;  // a directory
  EXPECT_THROW(makeStore(w, so), ConfigError);
  so.filePath = std::string(dirTemplate) + "/notes.txt";
  { std::ofstream(so.filePath) << "not a store, just someone's notes\n"; }
  const auto t0 = std::chrono::steady_clock::now();
  try {
    makeStore(w, so);
    ADD_FAILURE() << "a text file was taken for a store";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("not a rendezvous store file"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  so.kind = "redis";
  EXPECT_THROW(makeStore(w, so), ConfigError);
  std::filesystem::remove_all(dirTemplate);
}

// ---------------------------------------------------------------------------------------------
// Shared memory: ranks as threads, each a ShmCommunicator over one segment.

// Runs body(comm) for every rank of a world of `size`; returns each rank's exception message
// ("" when it returned normally).
std::vector<std::string> runShmRanks(int size, const ShmOptions& options,
                                     const std::function<void(Communicator&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        ShmCommunicator c(store, r, size, options);
        body(c);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Rendezvous within kOpTimeout; collectives wait `timeout`.
ShmOptions shmOptions(int64_t slotBytes = ShmOptions{}.slotBytes,
                      milliseconds timeout = kOpTimeout) {
  ShmOptions o;
  o.slotBytes = slotBytes;
  o.timeout = timeout;
  o.joinTimeout = kOpTimeout;
  o.token = "test-token";
  return o;
}

class CommShmCollectives : public ::testing::TestWithParam<std::tuple<int, at::ScalarType>> {};

// The suite every backend passes, at 0/1/7/2^20 elements with the default 1 MiB slots (one
// chunk, or several for reduce-scatter), and again with slots of 64 bytes per rank and 1000
// elements, so every collective crosses many chunk and buffer boundaries.
TEST_P(CommShmCollectives, MatchExpected) {
  const auto [size, dt] = GetParam();
  std::vector<std::atomic<int>> arrived(kCounts.size() + 1);
  auto errors = runShmRanks(size, shmOptions(), [&](Communicator& c) {
    EXPECT_EQ(c.backend(), "shm");
    for (size_t i = 0; i < kCounts.size(); ++i) checkCollectives(c, kCounts[i], dt, &arrived[i]);
  });
  for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  errors = runShmRanks(size, shmOptions(64 * size),
                       [&](Communicator& c) { checkCollectives(c, 1000, dt, &arrived.back()); });
  for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << "small slots, rank " << r;
}

INSTANTIATE_TEST_SUITE_P(CommShm, CommShmCollectives,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(at::kFloat, at::kBFloat16)),
                         [](const auto& info) {
                           return paramName(std::get<0>(info.param), -1, std::get<1>(info.param));
                         });

// The documented order: rank r's slice is summed over ranks 0, 1, ... in float32 (bfloat16
// rounded once at the end), so on random data the result is bitwise that sum; with two ranks it
// is a + b, which any order gives (Gloo's too).
// AVG divides that float32 sum by the number of ranks (true division, as ATen's div_).
TEST(CommShm, SumsInRankOrderBitwise) {
  for (int size : {2, 3, 4}) {
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        const int64_t n = 100003;
        at::manual_seed(11);
        std::vector<at::Tensor> inputs;
        for (int r = 0; r < size; ++r) inputs.push_back(at::randn({n}).mul_(r + 1).to(dt));
        at::Tensor expected = inputs[0].to(at::kFloat);
        for (int r = 1; r < size; ++r) expected = expected + inputs[r].to(at::kFloat);
        if (op == ReduceOp::kAvg) expected.div_(size);
        expected = expected.to(dt);
        std::vector<at::Tensor> results(size);
        auto errors = runShmRanks(size, shmOptions(64 * 1024), [&](Communicator& c) {
          at::Tensor t = inputs[c.rank()].clone();
          c.allreduce(t, op)->wait(kOpTimeout);
          results[c.rank()] = t;
        });
        for (int r = 0; r < size; ++r) {
          ASSERT_EQ(errors[r], "") << "rank " << r;
          EXPECT_TRUE(at::equal(results[r], expected))
              << size << " ranks, " << comm::dtypeName(dt) << ", " << opName(op) << ", rank " << r;
        }
      }
    }
  }
}

// Collectives issued back to back run in issue order whichever thread runs them (the op thread,
// or a waiter whose collective is next): waited in reverse order, each holds its own result.
TEST(CommShm, CollectivesWaitedInAnyOrderHoldTheirOwnResults) {
  const std::vector<int64_t> counts = {5, 70000, 3, 1 << 18, 1};
  auto errors = runShmRanks(3, shmOptions(64 * 1024), [&](Communicator& c) {
    for (int round = 0; round < 3; ++round) {
      std::vector<at::Tensor> tensors;
      std::vector<WorkPtr> works;
      for (size_t i = 0; i < counts.size(); ++i) {
        tensors.push_back(inputFor(c.rank(), counts[i], round * 10 + static_cast<int>(i)));
        works.push_back(c.allreduce(tensors.back(), ReduceOp::kSum));
      }
      if (round == 1) std::reverse(works.begin(), works.end());
      for (auto& w : works) w->wait(round == 2 ? milliseconds(kOpTimeout / 2) : kOpTimeout);
      for (size_t i = 0; i < counts.size(); ++i) {
        expectExact(
            tensors[i],
            reduceRows(allInputs(3, counts[i], round * 10 + static_cast<int>(i)), ReduceOp::kSum),
            fmt::format("round {}, allreduce {} (rank {})", round, i, c.rank()));
      }
    }
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// The segments of a job with this token, by the name shm_communicator.cpp gives them.
std::vector<std::string> segmentsOf(const std::string& token) {
  const std::string prefix = segmentPrefix(token);
  std::vector<std::string> found;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) found.push_back(name);
  }
  return found;
}

// The segment's name is gone once every rank mapped it (a SIGKILL later can leave nothing
// behind), and when a rank never comes, rank 0 names it and removes the name too.
TEST(CommShm, NoSegmentIsLeftBehind) {
  ShmOptions o = shmOptions();
  o.token = "no-segment-left-" + std::to_string(::getpid());
  auto errors = runShmRanks(2, o, [&](Communicator& c) {
    c.barrier()->wait(kOpTimeout);
    EXPECT_EQ(segmentsOf(o.token), std::vector<std::string>{}) << "while the job runs";
    at::Tensor t = at::ones({5});
    c.allreduce(t, ReduceOp::kSum)->wait(kOpTimeout);
    EXPECT_EQ(t[4].item<float>(), 2.0f);
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  // Rank 2 never maps the segment.
  o.joinTimeout = milliseconds(2000);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> failed(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        ShmCommunicator c(store, r, 3, o);
      } catch (const std::exception& e) {
        failed[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_NE(failed[0].find("2 of 3 ranks mapped the shared-memory segment within 2000 ms; rank 2 "
                           "did not"),
            std::string::npos)
      << failed[0];
  EXPECT_EQ(segmentsOf(o.token), std::vector<std::string>{}) << "after a failed rendezvous";
}

// A rank that never joins a collective is named by a rank that waits for it (within the
// timeout), and a rank that gave up tells the others: rank 1, starting 400 ms after rank 0,
// fails when rank 0 gives up at 700 ms, not at its own timeout (1100 ms).
TEST(CommShm, ALateRankIsNamedAndEveryWaiterLearnsIt) {
  const milliseconds timeout(700);
  std::atomic<bool> done{false};
  std::vector<int64_t> failedAfter(3, -1);
  auto errors = runShmRanks(3, shmOptions(ShmOptions{}.slotBytes, timeout), [&](Communicator& c) {
    if (c.rank() == 2) {
      while (!done) std::this_thread::sleep_for(milliseconds(10));
      return;
    }
    if (c.rank() == 1) std::this_thread::sleep_for(milliseconds(400));
    const auto start = Clock::now();
    at::Tensor t = at::ones({64});
    try {
      c.allreduce(t, ReduceOp::kSum)->wait(kOpTimeout);
    } catch (...) {
      failedAfter[c.rank()] = elapsedMs(start);
      if (c.rank() == 1) done = true;
      throw;
    }
  });
  EXPECT_NE(errors[0].find("allreduce through shared memory: rank 2 did not arrive within 700 ms"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("rank 0 gave up on it"), std::string::npos) << errors[1];
  EXPECT_GE(failedAfter[1], 0);
  EXPECT_LT(failedAfter[1], 650) << "rank 1 learnt it from rank 0, not from its own timeout";
  EXPECT_EQ(errors[2], "");
}

// Point-to-point through 64-byte rings (3 ranks, slots of 192 bytes): every rank sends every rank
// (itself too) three messages per tag on three tags, of 1 to 70000 elements (streamed through
// the ring many times over), all issued before any recv; receivers post their recvs tag by tag
// in reverse, so most messages arrive before their recv and wait in a buffer. Each (source, tag)
// must deliver its messages in the order sent, each bitwise the sender's.
TEST(CommShm, PointToPointKeepsEachTagsOrderThroughSmallRings) {
  constexpr int kSize = 3;
  const std::vector<int64_t> counts = {1, 70000, 7};
  auto salt = [](int src, int dst, int tag, int i) { return ((src * 3 + dst) * 3 + tag) * 3 + i; };
  auto errors = runShmRanks(kSize, shmOptions(64 * kSize), [&](Communicator& c) {
    std::vector<at::Tensor> outgoing;
    std::vector<WorkPtr> sends;
    for (int dst = 0; dst < kSize; ++dst) {
      for (int tag = 0; tag < 3; ++tag) {
        for (int i = 0; i < 3; ++i) {
          outgoing.push_back(inputFor(c.rank(), counts[i], salt(c.rank(), dst, tag, i)));
          sends.push_back(c.send(outgoing.back(), dst, tag));
        }
      }
    }
    for (int tag = 2; tag >= 0; --tag) {
      for (int src = kSize - 1; src >= 0; --src) {
        for (int i = 0; i < 3; ++i) {
          at::Tensor in = at::full({counts[i]}, -99.0f);
          c.recv(in, src, tag)->wait(kOpTimeout);
          expectExact(
              in, inputFor(src, counts[i], salt(src, c.rank(), tag, i)),
              fmt::format("rank {}: message {} of tag {} from rank {}", c.rank(), i, tag, src));
        }
      }
    }
    for (auto& w : sends) w->wait(kOpTimeout);
    c.barrier()->wait(kOpTimeout);
  });
  for (int r = 0; r < kSize; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// A message sent just before its sender closed its communicator still arrives; a recv from a
// rank that closed without sending fails at once naming it (not at the timeout); a recv whose
// tensor has another size than the message is named with both sizes; a recv nobody sends to
// fails at its wait's timeout, the failure is final, and the peer learns that this rank gave up.
TEST(CommShm, PointToPointFailuresAreNamed) {
  std::atomic<int> closed{0};
  std::string lost, wrongSize, timedOut, later, heard;
  int64_t lostAfter = -1, timedOutAfter = -1;
  auto errors =
      runShmRanks(3, shmOptions(ShmOptions{}.slotBytes, milliseconds(5000)), [&](Communicator& c) {
        if (c.rank() == 1) {
          c.send(at::arange(5, at::kFloat), 0, 4)->wait(kOpTimeout);
          ++closed;
          return;  // closes its communicator
        }
        if (c.rank() == 2) {
          c.send(at::ones({3}), 0, 9)->wait(kOpTimeout);
          while (closed < 2) std::this_thread::sleep_for(milliseconds(5));
          return;
        }
        while (closed < 1) std::this_thread::sleep_for(milliseconds(5));
        at::Tensor got = at::zeros({5});
        c.recv(got, 1, 4)->wait(kOpTimeout);
        expectExact(got, at::arange(5, at::kFloat), "the message sent before closing");
        auto start = Clock::now();
        try {
          c.recv(at::zeros({2}), 1, 4)->wait(kOpTimeout);
        } catch (const PeerError& e) {
          lost = e.what();
        }
        lostAfter = elapsedMs(start);
        ++closed;
        // A new communicator: the one above failed for good.
      });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_NE(lost.find("recv from rank 1 through shared memory: rank 1 closed its communicator"),
            std::string::npos)
      << lost;
  EXPECT_GE(lostAfter, 0);
  EXPECT_LT(lostAfter, 2000) << "named when rank 1 was found gone, not at the 5 s timeout";

  errors =
      runShmRanks(2, shmOptions(ShmOptions{}.slotBytes, milliseconds(5000)), [&](Communicator& c) {
        if (c.rank() == 1) {
          c.send(at::ones({3}), 0, 2)->wait(kOpTimeout);
          c.barrier()->wait(kOpTimeout);
          return;
        }
        c.barrier()->wait(kOpTimeout);
        try {
          c.recv(at::zeros({4}), 1, 2)->wait(kOpTimeout);
        } catch (const PeerError& e) {
          wrongSize = e.what();
        }
      });
  EXPECT_NE(wrongSize.find("recv from rank 1 (tag 2) through shared memory: the message has 12 "
                           "bytes, the tensor 16 (4 float32 elements)"),
            std::string::npos)
      << wrongSize;

  std::atomic<bool> done{false};
  errors =
      runShmRanks(2, shmOptions(ShmOptions{}.slotBytes, milliseconds(5000)), [&](Communicator& c) {
        if (c.rank() == 1) {  // alive, never sends; learns that rank 0 gave up on it
          try {
            c.recv(at::zeros({4}), 0, 8)->wait(kOpTimeout);
          } catch (const PeerError& e) {
            heard = e.what();
          }
          while (!done) std::this_thread::sleep_for(milliseconds(5));
          return;
        }
        const auto start = Clock::now();
        try {
          c.recv(at::zeros({4}), 1, 3)->wait(milliseconds(300));
        } catch (const PeerError& e) {
          timedOut = e.what();
        }
        timedOutAfter = elapsedMs(start);
        try {
          c.send(at::zeros({4}), 1, 3)->wait(milliseconds(300));
        } catch (const PeerError& e) {
          later = e.what();
        }
        done = true;
      });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_NE(timedOut.find("rank 0: recv from rank 1 (tag 3) through shared memory did not complete "
                          "within 300 ms"),
            std::string::npos)
      << timedOut;
  EXPECT_GE(timedOutAfter, 250);
  EXPECT_LT(timedOutAfter, 2000);
  EXPECT_NE(later.find("earlier failure"), std::string::npos) << later;
  EXPECT_NE(heard.find("rank 1: recv from rank 0 through shared memory: rank 0 gave up"),
            std::string::npos)
      << heard;
}

// ---------------------------------------------------------------------------------------------
// Striping: Gloo with several connections per pair.

// Sockets this process holds (its ranks' connections and listeners, when ranks are threads).
int openSockets() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(e.path(), ec);
    if (!ec && target.string().rfind("socket:", 0) == 0) ++n;
  }
  return n;
}

// Large all-reduces and broadcasts go as pieces over 3 meshes of connections at once (2 ranks
// hold at least twice the sockets one mesh takes); the suite's results hold (integers: exact in
// any order), and on 2 ranks a float sum is bitwise the one connection's.
TEST(CommGloo, StripedCollectivesMatchOneConnection) {
  GlooOptions striped = loopbackOptions();
  striped.connections = 3;
  striped.stripeBytes = 256;
  const int before = openSockets();
  std::vector<int> held(2);
  for (int k = 0; k < 2; ++k) {
    runGlooRanks(2, k == 0 ? loopbackOptions() : striped, [&](Communicator& c) {
      c.barrier()->wait(kOpTimeout);
      if (c.rank() == 0) held[k] = openSockets() - before;
      c.barrier()->wait(kOpTimeout);
    });
  }
  EXPECT_GE(held[1], 2 * held[0]) << "one connection: " << held[0]
                                  << " sockets, three: " << held[1];
  for (int size : {2, 3}) {
    std::vector<std::atomic<int>> arrived(3);
    auto errors = runGlooRanks(size, striped, [&](Communicator& c) {
      checkCollectives(c, 7, at::kFloat, &arrived[0]);
      checkCollectives(c, 1001, at::kFloat, &arrived[1]);
      checkCollectives(c, 1001, at::kBFloat16, &arrived[2]);
    });
    for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << size << " ranks, rank " << r;
  }
  at::manual_seed(5);
  const std::vector<at::Tensor> inputs = {at::randn({100003}), at::randn({100003})};
  std::vector<at::Tensor> one(2), three(2);
  for (auto [options, results] : {std::pair{loopbackOptions(), &one}, std::pair{striped, &three}}) {
    auto errors = runGlooRanks(2, options, [&, results = results](Communicator& c) {
      at::Tensor t = inputs[c.rank()].clone();
      c.allreduce(t, ReduceOp::kSum)->wait(kOpTimeout);
      (*results)[c.rank()] = t;
    });
    for (int r = 0; r < 2; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  }
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(at::equal(one[r], three[r])) << "rank " << r;
}

// Gloo's reduce-scatter is a ring of point-to-point messages (gloo_communicator.h). On 2..5
// ranks, with chunks whose size does and does not divide by the rank count, every op's result
// is the closed form (integers: exact in any order) in float32, bfloat16 (reduced in float32,
// rounded once) and int64, on one connection and striped over three, and the input is left
// alone.
TEST(CommGloo, RingReduceScatterEqualsTheClosedForm) {
  GlooOptions striped = loopbackOptions();
  striped.connections = 3;
  striped.stripeBytes = 256;
  for (int size : {2, 3, 4, 5}) {
    for (const GlooOptions& options : {loopbackOptions(), striped}) {
      const std::string how = options.connections > 1 ? "striped" : "one connection";
      auto errors = runGlooRanks(size, options, [&](Communicator& c) {
        const int rank = c.rank();
        int salt = 0;
        for (int64_t n : {1, 5, 12, 1001}) {
          for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
            for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
              ++salt;
              const std::string where = fmt::format("{} {} x {} on rank {} of {}, {}", opName(op),
                                                    n, comm::dtypeName(dt), rank, size, how);
              at::Tensor in = inputFor(rank, size * n, salt).to(dt);
              at::Tensor out = at::full({n}, -99, dt);
              c.reduceScatter(out, in, op)->wait(kOpTimeout);
              expectExact(out, reduceRows(allInputs(size, n, salt, rank * n), op).to(dt), where);
              expectExact(in, inputFor(rank, size * n, salt).to(dt), "input of " + where);
            }
          }
          at::Tensor in = at::arange(size * n, at::kLong) * (rank + 1);
          at::Tensor out = at::full({n}, -99, at::kLong);
          c.reduceScatter(out, in, ReduceOp::kSum)->wait(kOpTimeout);
          expectExact(out,
                      at::arange(rank * n, (rank + 1) * n, at::kLong) * (size * (size + 1) / 2),
                      fmt::format("int64 sum {} on rank {} of {}, {}", n, rank, size, how));
        }
      });
      for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << size << " ranks, rank " << r;
    }
  }
}

// The ring fixes each element's sum order: chunk c starts at rank c + 1 and takes in ranks
// c + 2, ..., c in turn, ((x[c+1] + x[c+2]) + ...) + x[c]. Random float32 inputs give that
// sum bit for bit, on one connection and striped, so runs repeat their results exactly.
TEST(CommGloo, RingReduceScatterSumsInRingOrderBitwise) {
  GlooOptions striped = loopbackOptions();
  striped.connections = 3;
  striped.stripeBytes = 256;
  const int64_t n = 1001;
  for (int size : {3, 5}) {
    at::manual_seed(size);
    std::vector<at::Tensor> inputs;
    for (int r = 0; r < size; ++r) inputs.push_back(at::randn({size * n}));
    auto chunkOf = [&](int r, int c) { return inputs[r % size].narrow(0, c * n, n); };
    for (const GlooOptions& options : {loopbackOptions(), striped}) {
      auto errors = runGlooRanks(size, options, [&](Communicator& c) {
        const int rank = c.rank();
        at::Tensor out = at::empty({n});
        c.reduceScatter(out, inputs[rank], ReduceOp::kSum)->wait(kOpTimeout);
        at::Tensor expected = chunkOf(rank + 1, rank).clone();
        for (int k = 2; k <= size; ++k) expected = expected + chunkOf(rank + k, rank);
        EXPECT_TRUE(at::equal(out, expected))
            << "rank " << rank << " of " << size << ", " << options.connections
            << " connection(s): " << (out - expected).abs().max().item<float>() << " off";
      });
      for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << size << " ranks, rank " << r;
    }
  }
}

// Reduce-scatters issued between all-reduces and all-gathers, all in flight at once on two
// worker threads and two connections, then waited in reverse order: each holds its own
// result (the ring's messages carry its collective number, as Gloo's own collectives do).
TEST(CommGloo, ReduceScattersInFlightWithOtherCollectivesKeepTheirOwnResults) {
  GlooOptions options = loopbackOptions();
  options.connections = 2;
  options.stripeBytes = 4096;
  for (int size : {3, 4}) {
    auto errors = runGlooRanks(size, options, [&](Communicator& c) {
      const int rank = c.rank();
      struct Op {
        std::string what;
        at::Tensor result, expected;
        WorkPtr work;
      };
      std::vector<Op> ops;
      int salt = 100;
      auto reduceScatter = [&](int64_t n, ReduceOp op) {
        ++salt;
        at::Tensor out = at::full({n}, -99.0f);
        ops.push_back({fmt::format("reduceScatter {} x {}", opName(op), n), out,
                       reduceRows(allInputs(size, n, salt, rank * n), op),
                       c.reduceScatter(out, inputFor(rank, size * n, salt), op)});
      };
      auto allreduce = [&](int64_t n) {
        ++salt;
        at::Tensor t = inputFor(rank, n, salt);
        ops.push_back({fmt::format("allreduce {}", n), t,
                       reduceRows(allInputs(size, n, salt), ReduceOp::kSum),
                       c.allreduce(t, ReduceOp::kSum)});
      };
      reduceScatter(3001, ReduceOp::kSum);
      allreduce(5000);
      reduceScatter(5, ReduceOp::kMax);
      {
        ++salt;
        at::Tensor out = at::full({size * 700}, -99.0f);
        ops.push_back({"allgather 700", out, allInputs(size, 700, salt).reshape(-1),
                       c.allgather(out, inputFor(rank, 700, salt))});
      }
      reduceScatter(4096, ReduceOp::kAvg);
      allreduce(7);
      reduceScatter(1200, ReduceOp::kSum);
      for (auto op = ops.rbegin(); op != ops.rend(); ++op) {
        op->work->wait(kOpTimeout);
        expectExact(op->result, op->expected,
                    fmt::format("{} on rank {} of {}", op->what, rank, size));
      }
    });
    for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << size << " ranks, rank " << r;
  }
}

// Bytes this process's TCP sockets have sent (its ranks' connections, when ranks are threads).
int64_t socketBytesSent() {
  int64_t sent = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(e.path(), ec);
    if (ec || target.string().rfind("socket:", 0) != 0) continue;
    tcp_info info{};
    socklen_t length = sizeof(info);
    const int fd = std::stoi(e.path().filename().string());
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &length) == 0 &&
        length >= offsetof(tcp_info, tcpi_bytes_sent) + sizeof(info.tcpi_bytes_sent)) {
      sent += static_cast<int64_t>(info.tcpi_bytes_sent);
    }
  }
  return sent;
}

// What CountingCommunicator counts is what goes on the wire: the bytes 4 ranks' sockets sent
// (TCP_INFO) against the counts, within Gloo's message headers and the barriers around. A
// reduce-scatter puts (P-1)/P of its input on the wire per rank, half an all-reduce's; an
// all-gather (P-1) inputs.
TEST(CommGloo, CollectivesPutOnTheWireWhatIsCounted) {
  const int size = 4;
  const int64_t n = 1 << 18;  // 1 MiB of float32 per chunk, 4 MiB of input
  const std::vector<std::string> ops = {"reduce-scatter", "allreduce", "allgather"};
  std::vector<std::vector<int64_t>> counted(ops.size(), std::vector<int64_t>(size));
  std::vector<int64_t> wire(ops.size());
  auto errors = runGlooRanks(size, loopbackOptions(), [&](Communicator& inner) {
    CountingCommunicator c(std::shared_ptr<Communicator>(&inner, [](Communicator*) {}));
    const int rank = c.rank();
    at::Tensor in = inputFor(rank, size * n, 1), out = at::empty({n});
    for (size_t k = 0; k < ops.size(); ++k) {
      inner.barrier()->wait(kOpTimeout);
      const int64_t before = rank == 0 ? socketBytesSent() : 0;
      inner.barrier()->wait(kOpTimeout);
      const int64_t countedBefore = c.bytes().sent;
      if (k == 0) c.reduceScatter(out, in, ReduceOp::kSum)->wait(kOpTimeout);
      if (k == 1) c.allreduce(in.clone(), ReduceOp::kSum)->wait(kOpTimeout);
      if (k == 2) c.allgather(at::empty({size * n}), out)->wait(kOpTimeout);
      counted[k][rank] = c.bytes().sent - countedBefore;
      inner.barrier()->wait(kOpTimeout);
      if (rank == 0) wire[k] = socketBytesSent() - before;
      inner.barrier()->wait(kOpTimeout);
    }
  });
  for (int r = 0; r < size; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  const int64_t inputBytes = size * n * 4;
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(counted[0][r], inputBytes * (size - 1) / size) << "rank " << r;
    EXPECT_EQ(counted[1][r], 2 * counted[0][r]) << "rank " << r;
  }
  for (size_t k = 0; k < ops.size(); ++k) {
    int64_t all = 0;
    for (int r = 0; r < size; ++r) all += counted[k][r];
    EXPECT_GE(wire[k], all) << ops[k];
    EXPECT_LE(wire[k], all * 1.02) << ops[k];
  }
}

// ---------------------------------------------------------------------------------------------
// Hierarchical: ranks as threads on made-up hosts (a host identity per rank), shared memory
// inside each host, Gloo among the leaders (3 connections, striped) and of every rank.

TEST(CommHierarchical, HostGroupsAreEachHostsRanksAndItsLowestRankLeads) {
  const std::vector<std::string> hosts = {"b", "a", "b", "a", "c"};
  EXPECT_EQ(hostGroups(hosts, 2).local, (std::vector<int>{0, 2}));
  EXPECT_EQ(hostGroups(hosts, 3).local, (std::vector<int>{1, 3}));
  EXPECT_EQ(hostGroups(hosts, 4).local, (std::vector<int>{4}));
  EXPECT_EQ(hostGroups(hosts, 0).leaders, (std::vector<int>{0, 1, 4}));
}

std::vector<std::string> runHierarchicalRanks(const std::vector<std::string>& hosts,
                                              const std::function<void(Communicator&)>& body,
                                              milliseconds timeout = kOpTimeout) {
  const int size = static_cast<int>(hosts.size());
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto prefixed = [](const std::string& p, c10::intrusive_ptr<c10d::Store> s) {
    return c10::make_intrusive<c10d::PrefixStore>(p, std::move(s));
  };
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        GlooOptions flatOptions = loopbackOptions(timeout);
        flatOptions.joinTimeout = kOpTimeout;  // a short `timeout` is for the operations
        auto flat =
            std::make_shared<GlooCommunicator>(prefixed("flat", store), r, size, flatOptions);
        auto c = makeHierarchical(
            hosts, r, flat, prefixed("hier", store), shmOptions(64 * 1024, timeout),
            [timeout](c10::intrusive_ptr<c10d::Store> s, int rank, int n) {
              GlooOptions o = loopbackOptions(timeout);
              o.joinTimeout = kOpTimeout;
              o.connections = 3;
              o.stripeBytes = 4096;
              return std::make_shared<GlooCommunicator>(std::move(s), rank, n, o);
            });
        EXPECT_EQ(c->backend(), "hierarchical");
        body(*c);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// The suite every backend passes (integer-valued inputs: exact in any order), on hosts of 2 + 2
// ranks, 3 + 1 (a rank alone on its host) and 1 + 1 + 1 (no shared memory at all).
TEST(CommHierarchical, CollectivesMatchExpected) {
  const std::vector<std::vector<std::string>> layouts = {
      {"a", "a", "b", "b"}, {"a", "b", "a", "a"}, {"a", "b", "c"}};
  for (const auto& hosts : layouts) {
    const int size = static_cast<int>(hosts.size());
    std::vector<std::atomic<int>> arrived(4);
    auto errors = runHierarchicalRanks(hosts, [&](Communicator& c) {
      checkCollectives(c, 0, at::kFloat, &arrived[0]);
      checkCollectives(c, 7, at::kFloat, &arrived[1]);
      checkCollectives(c, 100003, at::kFloat, &arrived[2]);
      checkCollectives(c, 1001, at::kBFloat16, &arrived[3]);
    });
    for (int r = 0; r < size; ++r) {
      EXPECT_EQ(errors[r], "") << "hosts " << hosts[0] << hosts[1] << hosts[2]
                               << (size > 3 ? hosts[3] : "") << ", rank " << r;
    }
  }
}

// The documented order: each host's ranks in rank order, then the hosts (two hosts: a + b in
// any order), in float32, bfloat16 rounded once; AVG divides that sum.
TEST(CommHierarchical, SumsPerHostThenOverHostsBitwise) {
  const std::vector<std::string> hosts = {"a", "a", "a", "b", "b"};
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      at::manual_seed(3);
      std::vector<at::Tensor> inputs;
      for (int r = 0; r < 5; ++r) inputs.push_back(at::randn({50001}).mul_(r + 1).to(dt));
      auto f = [&](int r) { return inputs[r].to(at::kFloat); };
      at::Tensor expected = ((f(0) + f(1)) + f(2)) + (f(3) + f(4));
      if (op == ReduceOp::kAvg) expected.div_(5);
      expected = expected.to(dt);
      std::vector<at::Tensor> results(5);
      auto errors = runHierarchicalRanks(hosts, [&](Communicator& c) {
        at::Tensor t = inputs[c.rank()].clone();
        c.allreduce(t, op)->wait(kOpTimeout);
        results[c.rank()] = t;
      });
      for (int r = 0; r < 5; ++r) {
        ASSERT_EQ(errors[r], "") << "rank " << r;
        EXPECT_TRUE(at::equal(results[r], expected))
            << comm::dtypeName(dt) << ", " << opName(op) << ", rank " << r;
      }
    }
  }
}

// Host b's ranks never join: leader 0's step between hosts times out (700 ms), and rank 1, which
// waits for rank 0 in shared memory, learns it from rank 0 at once (not at its own, doubled
// timeout), for both all-reduces it issued: neither reports a result.
TEST(CommHierarchical, ALeaderThatFailsBetweenHostsFailsItsHostsRanksToo) {
  const milliseconds timeout(700);
  std::atomic<bool> done{false};
  std::vector<int64_t> failedAfter(4, -1);
  std::vector<std::vector<std::string>> failures(4);
  auto errors = runHierarchicalRanks(
      {"a", "a", "b", "b"},
      [&](Communicator& c) {
        c.barrier()->wait(kOpTimeout);  // every rank is up: the clock starts here
        const auto start = Clock::now();
        if (c.rank() >= 2) {
          while (!done && elapsedMs(start) < kOpTimeout.count()) {
            std::this_thread::sleep_for(milliseconds(10));
          }
          return;
        }
        at::Tensor x = at::ones({1000}), y = at::ones({1000});
        std::vector<WorkPtr> works = {c.allreduce(x, ReduceOp::kSum),
                                      c.allreduce(y, ReduceOp::kSum)};
        for (auto& w : works) {
          try {
            w->wait(kOpTimeout);
            failures[c.rank()].push_back("");
          } catch (const PeerError& e) {
            failures[c.rank()].push_back(e.what());
          }
        }
        failedAfter[c.rank()] = elapsedMs(start);
        if (c.rank() == 1) done = true;
        // A second wait gives the first outcome at once.
        const auto again = Clock::now();
        try {
          works[0]->wait(kOpTimeout);
          failures[c.rank()].push_back("");
        } catch (const PeerError& e) {
          failures[c.rank()].push_back(e.what());
        }
        if (elapsedMs(again) > 100) failures[c.rank()].push_back("the second wait waited");
      },
      timeout);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(failures[r].size(), 3u) << "rank " << r;
    for (const std::string& f : failures[r]) EXPECT_NE(f, "") << "rank " << r << " got a result";
    EXPECT_EQ(failures[r][2], failures[r][0]) << "rank " << r;
  }
  EXPECT_NE(failures[0][0].find("failed between the hosts' leaders (ranks 0, 2, numbered 0-1 "
                                "there)"),
            std::string::npos)
      << failures[0][0];
  EXPECT_NE(failures[1][0].find("rank 0 gave up on it"), std::string::npos) << failures[1][0];
  EXPECT_GE(failedAfter[1], 0);
  EXPECT_LT(failedAfter[1], 1300) << "rank 1 learnt it from rank 0, not at its own timeout";
}

// ---------------------------------------------------------------------------------------------
// Factory and helpers.

TEST(CommFactory, UnknownBackendIsAConfigError) {
  WorldInfo w;
  EXPECT_THROW(makeCommunicator("nccl", w, c10::make_intrusive<c10d::HashStore>(), kOpTimeout),
               ConfigError);
}

// auto: the ranks publish their host identity; on one host the collectives go through shared
// memory, one rank alone keeps Gloo.
TEST(CommFactory, AutoIsShmOnOneHost) {
  for (int size : {1, 2}) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<std::string> backends(size);
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        WorldInfo w;
        w.rank = r;
        w.worldSize = size;
        try {
          backends[r] = makeCommunicator("auto", w, store, kOpTimeout)->backend();
        } catch (const std::exception& e) {
          backends[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < size; ++r) EXPECT_EQ(backends[r], size == 1 ? "gloo" : "shm");
  }
}

TEST(CommFactory, MpiInABuildWithoutMpiSaysHowToGetIt) {
  if (mpiBackendAvailable()) GTEST_SKIP() << "this build has MPI (CommMpi.* test it)";
  try {
    makeCommunicator("mpi", WorldInfo{}, {}, kOpTimeout);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("install libopenmpi-dev"), std::string::npos);
  }
}

TEST(CommUtil, FormatRanks) {
  EXPECT_EQ(comm::formatRanks({}), "no rank");
  EXPECT_EQ(comm::formatRanks({3}), "rank 3");
  EXPECT_EQ(comm::formatRanks({1, 2}), "ranks 1, 2");
  EXPECT_EQ(comm::formatRanks({1, 2, 3}), "ranks 1-3");
  EXPECT_EQ(comm::formatRanks({0, 2, 5, 6, 7}), "ranks 0, 2, 5-7");
  EXPECT_TRUE(isLoopbackAddress("127.0.0.1"));
  EXPECT_TRUE(isLoopbackAddress("localhost"));
  EXPECT_FALSE(isLoopbackAddress("10.0.0.1"));
}

#else  // CARAVAN_COMM_MPI_TESTS

// ---------------------------------------------------------------------------------------------
// MPI: this process is one rank of the mpirun job.

Communicator* gWorld = nullptr;  // set by main() for the life of the test run

class CommMpiCollectives
    : public ::testing::TestWithParam<std::tuple<int64_t, at::ScalarType>> {};

TEST_P(CommMpiCollectives, MatchExpected) {
  const auto [n, dt] = GetParam();
  checkCollectives(*gWorld, n, dt);
}

INSTANTIATE_TEST_SUITE_P(CommMpi, CommMpiCollectives,
                         ::testing::Combine(::testing::ValuesIn(kCounts),
                                            ::testing::Values(at::kFloat, at::kBFloat16)),
                         [](const auto& info) {
                           return paramName(0, std::get<0>(info.param), std::get<1>(info.param));
                         });

TEST(CommMpi, RankAndSizeComeFromMpi) {
  const WorldInfo world = worldFromEnvironment(processEnvironment());
  EXPECT_EQ(world.launcher, "openmpi");
  EXPECT_EQ(gWorld->rank(), world.rank);
  EXPECT_EQ(gWorld->size(), world.worldSize);
  auto comm = makeCommunicator("mpi", world, {}, kOpTimeout);
  EXPECT_EQ(comm->backend(), "mpi");
  EXPECT_EQ(comm->rank(), world.rank);
  WorldInfo wrong = world;
  wrong.worldSize = world.worldSize + 1;
  EXPECT_THROW(makeCommunicator("mpi", wrong, {}, kOpTimeout), ConfigError);
  comm->barrier()->wait(kOpTimeout);
}

TEST(CommMpiFaults, RecvNobodySendsTimesOutNamingThePeer) {
  // A communicator of its own: the timeout latches it failed.
  auto comm = makeMpiCommunicator(MpiOptions{kOpTimeout});
  if (comm->rank() == 0) {
    const int peer = comm->size() > 1 ? 1 : 0;
    at::Tensor t = at::zeros({4});
    const auto start = Clock::now();
    std::string message;
    try {
      comm->recv(t, peer, 999)->wait(milliseconds(500));
    } catch (const PeerError& e) {
      message = e.what();
    }
    EXPECT_NE(message.find(fmt::format("rank {}", peer)), std::string::npos) << message;
    EXPECT_GE(elapsedMs(start), 450);
    EXPECT_LT(elapsedMs(start), 2500);
    EXPECT_THROW(comm->barrier()->wait(kOpTimeout), PeerError);  // latched
    EXPECT_TRUE(at::equal(t, at::zeros({4})));  // the cancelled recv wrote nothing
  }
  gWorld->barrier()->wait(kOpTimeout);
}

// Only rank 0 prints the usual gtest output; the others report failures, prefixed.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      fmt::print(stderr, "[rank {}] {}:{}: {}\n", rank_, r.file_name() ? r.file_name() : "?",
                 r.line_number(), r.summary());
    }
  }

 private:
  int rank_;
};

#endif  // CARAVAN_COMM_MPI_TESTS

}  // namespace
}  // namespace caravan

#ifdef CARAVAN_COMM_MPI_TESTS
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto world = caravan::makeMpiCommunicator(caravan::MpiOptions{caravan::kOpTimeout});
  caravan::gWorld = world.get();
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new caravan::FailurePrinter(world->rank()));
  }
  const int rc = RUN_ALL_TESTS();
  world->barrier()->wait(caravan::kOpTimeout);
  caravan::gWorld = nullptr;
  world.reset();
  // CommMpiFaults recovered from a PeerError, after which exit would skip MPI_Finalize.
  caravan::finalizeMpi();
  return rc;
}
#endif
