// The synchronization strategies' parameter operations, with ranks as threads (Gloo over
// loopback): gossip mixes exactly (complete graph = the average; ring = the mean with both
// neighbours) and keeps the local update; local SGD averages exactly every H steps and not in
// between, also with int4 averaging; DiLoCo's outer step (blocking and streamed fragments, and
// the fragments' schedule); the consensus distance is the spread of the replicas. The
// compression codecs: block-scaled integers and top-k (error feedback, hostile indices), the
// 16-bit ring all-reduce. The parameter servers and OSP: every gradient applied exactly once,
// ps-ssp's staleness bound as the workers read it, crafted messages refused, headers bit-exact.
// The bytes counted by the counting communicator. sync.shard = parameters' bf16 gathers against
// the unsharded model. Whole training runs of these modes are in test_dist.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/counting_communicator.h"
#include "core/config.h"
#include "core/errors.h"
#include "gloo_ranks.h"
#include "memory/tier.h"
#include "models/model.h"
#include "sync/allreduce.h"
#include "sync/compression.h"
#include "sync/diloco.h"
#include "sync/gossip.h"
#include "sync/local_sgd.h"
#include "sync/osp.h"
#include "sync/parameter_server.h"
#include "sync/replicas.h"
#include "sync/sharding.h"
#include "sync/sync_mode.h"
#include "test_util.h"

using namespace caravan;
using caravan::test::loopbackOptions;
using caravan::test::runGlooRanks;

namespace {

constexpr std::chrono::milliseconds kTimeout{20000};

// Rank r's parameter values: small integers, so means over 3 or 4 ranks are exact in float.
at::Tensor valuesOf(int rank, int64_t n) {
  return at::arange(n, at::kFloat).mul(3).add(rank * 12).remainder(17).sub(8);
}

struct Net : torch::nn::Module {
  Net() {
    a = register_parameter("a", torch::zeros({2, 3}));
    b = register_parameter("b", torch::zeros({5}));
  }
  at::Tensor a, b;
};

void setReplica(Net& net, int rank) {
  torch::NoGradGuard g;
  at::Tensor v = valuesOf(rank, 11);
  net.a.copy_(v.narrow(0, 0, 6).view({2, 3}));
  net.b.copy_(v.narrow(0, 6, 5));
}

at::Tensor replica(Net& net) { return flatten({net.a, net.b}); }

void expectNoErrors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace

class GossipMix : public ::testing::TestWithParam<int> {};

TEST_P(GossipMix, CompleteGraphIsTheExactAverage) {
  const int w = GetParam();
  at::Tensor mean = at::zeros({11});
  for (int r = 0; r < w; ++r) mean += valuesOf(r, 11);
  mean /= w;
  expectNoErrors(runGlooRanks(w, loopbackOptions(kTimeout), [&](auto comm) {
    Net net;
    GossipStrategy g(comm, {"complete"});
    g.attach(net);
    setReplica(net, comm->rank());  // after attach's broadcast: the replicas differ
    g.beforeForward(0);
    g.afterStep(0);
    // x + (mean - x): exact for W = 2, 4; one rounding of a third for W = 3.
    EXPECT_TRUE(at::allclose(replica(net), mean, 0, 1e-6)) << "rank " << comm->rank();
  }));
}

TEST_P(GossipMix, RingMixesWithBothNeighboursAndKeepsTheLocalUpdate) {
  const int w = GetParam();
  expectNoErrors(runGlooRanks(w, loopbackOptions(kTimeout), [&](auto comm) {
    const int r = comm->rank();
    Net net;
    GossipStrategy g(comm, {"ring"});
    g.attach(net);
    for (int step = 0; step < 3; ++step) {
      setReplica(net, r + step);
      g.beforeForward(step);
      // The local optimizer's update, made between the exchange and the mix.
      at::Tensor delta = at::full({11}, 0.5f * static_cast<float>(r + 1));
      {
        torch::NoGradGuard ng;
        unflattenInto(replica(net) + delta, {net.a, net.b});
      }
      g.afterStep(step);
      std::vector<int> group = {r};
      for (int n : {(r + w - 1) % w, (r + 1) % w}) {
        if (std::find(group.begin(), group.end(), n) == group.end()) group.push_back(n);
      }
      at::Tensor expected = at::zeros({11});
      for (int j : group) expected += valuesOf(j + step, 11);
      expected = expected / static_cast<double>(group.size()) + delta;
      EXPECT_TRUE(at::allclose(replica(net), expected, 0, 1e-6))
          << "rank " << r << " step " << step << ": " << replica(net) << " vs " << expected;
    }
  }));
}

INSTANTIATE_TEST_SUITE_P(World, GossipMix, ::testing::Values(2, 3, 4));

TEST(LocalSgd, AveragesExactlyEveryPeriodAndNotInBetween) {
  const int w = 3;
  at::Tensor mean = at::zeros({11});
  for (int r = 0; r < w; ++r) mean += valuesOf(r, 11);
  mean /= w;
  expectNoErrors(runGlooRanks(w, loopbackOptions(kTimeout), [&](auto comm) {
    Net net;
    LocalSgdOptions o;
    o.period = 3;
    o.postLocalAfter = 2;  // steps 0, 1 are BSP; averaging after steps 4, 7, ...
    LocalSgdStrategy s(comm, o);
    s.attach(net);
    for (int step = 2; step < 8; ++step) {
      setReplica(net, comm->rank());
      s.afterStep(step);
      const bool averaged = step == 4 || step == 7;
      EXPECT_TRUE(at::equal(replica(net), averaged ? mean : valuesOf(comm->rank(), 11)))
          << "step " << step;
    }
  }));
}

// int8/int4 with error feedback: values that are whole multiples of their block's scale (each
// block's largest magnitude is 127 or 7, so the scale is 1) travel exactly and leave no
// residual; other values travel within half a scale step with the rounding kept in the
// residual (value = decoded + residual), and a second message of zeros carries that residual
// within half of its own, smaller, step. A message is the closed-form size.
TEST(Quantization, BlockScaledIntegersAreExactAndRoundingIsFedBack) {
  for (const auto& [compression, qmax] :
       {std::pair{Compression::kInt8, 127}, std::pair{Compression::kInt4, 7}}) {
    SCOPED_TRACE(qmax);
    const QuantCodec codec(compression);
    const int64_t n = 2 * kQuantBlock + 37;  // a partial last block
    const int64_t blocks = 3, bytes = (n * codec.bits() + 7) / 8;
    EXPECT_EQ(codec.words(n), blocks + (bytes + 3) / 4);

    at::Tensor exact = at::arange(n, at::kFloat).remainder(2 * qmax + 1).sub(qmax);
    for (int64_t b = 0; b < blocks; ++b) exact[b * kQuantBlock] = static_cast<float>(qmax);
    at::Tensor residual = at::zeros({n});
    const at::Tensor message = codec.encode(exact, residual);
    EXPECT_EQ(message.numel(), codec.words(n));
    at::Tensor decoded = at::zeros({n});
    codec.addDecoded(message, decoded);
    EXPECT_TRUE(at::equal(decoded, exact));
    EXPECT_TRUE(at::equal(residual, at::zeros({n})));

    at::manual_seed(5);
    const at::Tensor values = at::randn({n}).mul(3);
    residual.zero_();
    decoded.zero_();
    codec.addDecoded(codec.encode(values, residual), decoded);
    EXPECT_TRUE(at::allclose(decoded + residual, values, 0, 1e-6));
    at::Tensor stepBound = at::zeros({n}), secondBound = at::zeros({n});
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * kQuantBlock, len = std::min(kQuantBlock, n - begin);
      const float scale = values.narrow(0, begin, len).abs().max().item<float>() / qmax;
      stepBound.narrow(0, begin, len).fill_(scale / 2 * (1 + 1e-5));
      const float second = residual.narrow(0, begin, len).abs().max().item<float>() / qmax;
      secondBound.narrow(0, begin, len).fill_(second / 2 * (1 + 1e-5) + 1e-7);
    }
    EXPECT_TRUE(residual.abs().le(stepBound).all().item<bool>());
    codec.addDecoded(codec.encode(at::zeros({n}), residual), decoded);
    EXPECT_TRUE((values - decoded).abs().le(secondBound).all().item<bool>());
  }
}

// The streaming schedule: over four periods every fragment syncs once per period, exactly H
// steps after its previous sync, in the order 0, 1, ..., F-1, 0, ...; nothing syncs before the
// first step. (The schedule is a function of the step alone, so every rank follows it.)
TEST(Diloco, EveryFragmentSyncsOncePerPeriodInOrder) {
  for (const auto& [h, f] : {std::pair<int64_t, int64_t>{8, 4}, {7, 3}, {5, 5}, {6, 1}, {1, 1}}) {
    SCOPED_TRACE(std::to_string(h) + " steps, " + std::to_string(f) + " fragments");
    EXPECT_EQ(fragmentDue(0, h, f), -1);
    std::vector<int64_t> order, last(f, -1);
    for (int64_t t = 1; t <= 4 * h; ++t) {
      const int64_t due = fragmentDue(t, h, f);
      if (due < 0) continue;
      ASSERT_LT(due, f);
      if (last[due] >= 0) EXPECT_EQ(t - last[due], h) << "fragment " << due;
      last[due] = t;
      order.push_back(due);
    }
    ASSERT_EQ(static_cast<int64_t>(order.size()), 4 * f);
    for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i], static_cast<int64_t>(i) % f);
    // nextSync (ps-diloco's rounds) is the first due step after any step count, as a scan of
    // fragmentDue finds it.
    for (int64_t done = 0; done <= 3 * h; ++done) {
      int64_t t = done + 1;
      while (fragmentDue(t, h, f) < 0) ++t;
      EXPECT_EQ(nextSync(done, h, f), std::make_pair(t, fragmentDue(t, h, f))) << done;
    }
  }
}

namespace {

// The mean over `w` ranks of valuesOf(rank + shift), in double.
at::Tensor meanValues(int w, int shift) {
  at::Tensor m = at::zeros({11}, at::kDouble);
  for (int r = 0; r < w; ++r) m += valuesOf(r + shift, 11).to(at::kDouble);
  return m / w;
}

}  // namespace

// Blocking DiLoCo on 3 ranks, H = 2, outer lr 0.7, Nesterov momentum 0.5: between syncs each
// replica keeps its own values; after steps 1 and 3 every replica is θ_sync after the outer
// step on the mean pseudo-gradient (closed form in double: m = μ m + Δ̄, θ -= lr (Δ̄ + μ m)).
TEST(Diloco, BlockingOuterStepIsNesterovOnTheMeanChange) {
  const int w = 3;
  expectNoErrors(runGlooRanks(w, loopbackOptions(kTimeout), [&](auto comm) {
    const int r = comm->rank();
    Net net;  // zeros: θ_sync starts at 0
    DilocoOptions o;
    o.period = 2;
    o.outerLr = 0.7;
    o.outerMomentum = 0.5;
    DilocoStrategy s(comm, o);
    s.attach(net);
    at::Tensor anchor = at::zeros({11}, at::kDouble), m = at::zeros({11}, at::kDouble);
    for (int step = 0; step < 4; ++step) {
      setReplica(net, r + step);  // the inner optimizer's result
      s.afterStep(step);
      if (step % 2 == 0) {
        EXPECT_TRUE(at::equal(replica(net), valuesOf(r + step, 11))) << "step " << step;
        continue;
      }
      const at::Tensor delta = anchor - meanValues(w, step);
      m = m * 0.5 + delta;
      anchor = anchor - 0.7 * (delta + 0.5 * m);
      EXPECT_TRUE(at::allclose(replica(net).to(at::kDouble), anchor, 0, 1e-5))
          << "rank " << r << " step " << step << ": " << replica(net) << " vs " << anchor;
    }
  }));
}

// Streaming DiLoCo on 3 ranks, H = 2, F = 2 (elements [0, 5) and [5, 11)), outer lr 1, no
// momentum: fragment 0 is sent after step 0 and applied after step 1, keeping each rank's step-1
// progress (θ = mean of what was sent + (now - sent)); fragment 1 is sent after step 1 and
// applied after step 2 likewise; the other fragment is untouched meanwhile.
TEST(Diloco, StreamedFragmentArrivesAStepLaterWithTheLocalProgressKept) {
  const int w = 3;
  expectNoErrors(runGlooRanks(w, loopbackOptions(kTimeout), [&](auto comm) {
    const int r = comm->rank();
    Net net;
    DilocoOptions o;
    o.period = 2;
    o.fragments = 2;
    o.outerLr = 1.0;
    o.outerMomentum = 0.0;
    DilocoStrategy s(comm, o);
    s.attach(net);
    auto own = [&](int step) { return valuesOf(r + step, 11).to(at::kDouble); };
    setReplica(net, r);
    s.afterStep(0);  // sends fragment 0
    EXPECT_TRUE(at::equal(replica(net), valuesOf(r, 11)));
    setReplica(net, r + 1);
    s.afterStep(1);  // applies fragment 0, sends fragment 1
    at::Tensor expected = own(1);
    expected.narrow(0, 0, 5) += meanValues(w, 0).narrow(0, 0, 5) - own(0).narrow(0, 0, 5);
    EXPECT_TRUE(at::allclose(replica(net).to(at::kDouble), expected, 0, 1e-5))
        << "rank " << r << ": " << replica(net) << " vs " << expected;
    at::Tensor afterOne = replica(net).to(at::kDouble);
    setReplica(net, r + 2);
    s.afterStep(2);  // applies fragment 1
    expected = own(2);
    expected.narrow(0, 5, 6) += meanValues(w, 1).narrow(0, 5, 6) - afterOne.narrow(0, 5, 6);
    EXPECT_TRUE(at::allclose(replica(net).to(at::kDouble), expected, 0, 1e-5))
        << "rank " << r << ": " << replica(net) << " vs " << expected;
  }));
}

// Local SGD with int4 averaging on 4 ranks, H = 1: values that are whole numbers in [-7, 7]
// with a 7 in the block travel exactly, so the replicas become their exact mean (as the
// uncompressed averaging makes them); and the next averaging starts from that mean.
TEST(LocalSgd, Int4AveragingOfExactValuesIsTheMean) {
  const int w = 4;
  auto exactValues = [](int rank) {
    at::Tensor v = valuesOf(rank, 11).clamp(-7, 7);
    v[0] = 7;
    return v;
  };
  at::Tensor mean = at::zeros({11});
  for (int r = 0; r < w; ++r) mean += exactValues(r);
  mean /= w;
  expectNoErrors(runGlooRanks(w, loopbackOptions(kTimeout), [&](auto comm) {
    Net net;
    LocalSgdOptions o;
    o.period = 1;
    o.compression = Compression::kInt4;
    LocalSgdStrategy s(comm, o);
    s.attach(net);
    for (int step = 0; step < 2; ++step) {
      {
        torch::NoGradGuard g;
        at::Tensor v = exactValues(comm->rank());
        if (step == 1) v = v.mul(0.0).add(mean);  // equal replicas: their mean is themselves
        unflattenInto(v, {net.a, net.b});
      }
      s.beforeForward(step);
      s.afterStep(step);
      EXPECT_TRUE(at::equal(replica(net), mean)) << "step " << step << ": " << replica(net);
    }
  }));
}

TEST(Replicas, ConsensusDistanceIsTheSpreadAndConsolidateAverages) {
  const int w = 4;
  at::Tensor all = at::stack({valuesOf(0, 11), valuesOf(1, 11), valuesOf(2, 11), valuesOf(3, 11)})
                       .to(at::kDouble);
  const double expected =
      std::sqrt((all - all.mean(0)).pow(2).sum().item<double>() / static_cast<double>(w));
  ASSERT_GT(expected, 1.0);
  expectNoErrors(runGlooRanks(w, loopbackOptions(kTimeout), [&](auto comm) {
    Net net;
    GossipStrategy g(comm, {"ring"});
    g.attach(net);
    setReplica(net, comm->rank());
    EXPECT_NEAR(g.consolidate(), expected, 1e-9);
    EXPECT_TRUE(at::equal(replica(net), all.mean(0).to(at::kFloat)));
    EXPECT_EQ(consensusDistance(*comm, net), 0.0);
  }));
}

// 16-bit ring all-reduce: inputs that are exact in 16 bits and sums that stay exact give the
// exact sum on every rank (also with fewer elements than ranks, and none); general inputs give
// identical results on every rank, within 16-bit rounding of the float32 sum.
class Ring16 : public ::testing::TestWithParam<std::tuple<int, at::ScalarType>> {};

TEST_P(Ring16, SumsExactlyAndEveryRankAgrees) {
  const auto [w, wire] = GetParam();
  std::vector<at::Tensor> results(w);
  expectNoErrors(runGlooRanks(w, loopbackOptions(kTimeout), [&, w = w, wire = wire](auto comm) {
    const int r = comm->rank();
    for (int64_t n : {0, 2, 1001}) {
      at::Tensor x = valuesOf(r, n);
      ringAllreduce16(*comm, x, wire, 0, kTimeout);
      at::Tensor expected = at::zeros({n});
      for (int j = 0; j < w; ++j) expected += valuesOf(j, n);
      EXPECT_TRUE(at::equal(x, expected)) << "n " << n << " rank " << r;
    }
    at::Tensor g = at::sin(at::arange(5000, at::kFloat) * 0.37 + r);  // not exact in 16 bits
    at::Tensor exact = g.clone();
    comm->allreduce(exact, ReduceOp::kSum)->wait(kTimeout);
    ringAllreduce16(*comm, g, wire, 0, kTimeout);
    const double tol = (wire == at::kHalf ? 1e-3 : 8e-3) * w;
    EXPECT_LE((g - exact).abs().max().item<double>(), tol);
    results[r] = g;
  }));
  for (int r = 1; r < w; ++r) EXPECT_TRUE(at::equal(results[r], results[0])) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(WorldAndWire, Ring16,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(at::kHalf, at::kBFloat16)));

// Error feedback loses nothing: over any number of steps, what was sent plus the residual is
// exactly the sum of the gradients fed in (exact here: small integers). Ratio 1 sends all.
TEST(TopK, ErrorFeedbackDelaysButNeverDrops) {
  TopKCodec codec(100, 0.1);
  EXPECT_EQ(codec.k(), 10);
  at::Tensor fed = at::zeros({100}), sent = at::zeros({100}), out = at::empty({100});
  for (int step = 0; step < 7; ++step) {
    at::Tensor g = valuesOf(step, 100);
    fed += g;
    codec.decode(codec.encode(g), 1, out);
    EXPECT_EQ(out.ne(0).sum().item<int64_t>(), 10) << "step " << step;
    sent += out;
  }
  EXPECT_TRUE(at::equal(sent + codec.residual(), fed));
  // The entries sent are the largest of residual + gradient.
  TopKCodec one(6, 0.33);  // k = ceil(1.98) = 2
  one.decode(one.encode(torch::tensor({0.1f, -5.f, 2.f, 0.f, 3.f, -0.5f})), 1, out);
  EXPECT_TRUE(at::equal(out.narrow(0, 0, 6), torch::tensor({0.f, -5.f, 0.f, 0.f, 3.f, 0.f})));
  TopKCodec all(50, 1.0);
  at::Tensor g = valuesOf(3, 50), o = at::empty({50});
  all.decode(all.encode(g), 1, o);
  EXPECT_TRUE(at::equal(o, g));
  EXPECT_EQ(all.residual().abs().sum().item<double>(), 0.0);
}

// A top-k index outside the bucket (a peer of another version, a damaged message) is a
// PeerError, not an out-of-range access (found by fuzz/fuzz_codec.cpp).
TEST(TopK, IndexOutsideTheBucketIsAPeerError) {
  const ShardCodec codec(Compression::kTopK, 8, 0.25);  // k = 2: [value, value, index, index]
  auto words = [](int32_t index) {
    return at::cat({torch::tensor({1.f, 2.f}),
                    torch::tensor({int32_t{3}, index}, at::kInt).view(at::kFloat)});
  };
  EXPECT_EQ(codec.decode(words(7))[7].item<float>(), 2.f);
  for (int32_t bad : {8, -1, 1 << 30}) {
    try {
      codec.decode(words(bad));
      ADD_FAILURE() << "no PeerError for index " << bad;
    } catch (const PeerError& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("index {}, outside the 8 entries", bad)),
                std::string::npos)
          << e.what();
    }
  }
}

// Parameter servers apply every gradient exactly once: workers (threads) push fixed gradients
// for T steps through ps-bsp, ps-asp, ps-ssp (s = 1) — with pushes as float32, fp16, bf16 or
// top-k with ratio 1 (the gradients are small integers, exact in 16 bits) — or OSP (half the
// chunks in stage 2, both split policies, 1 or 2 servers); with plain SGD and lr 1/8 the
// result must be exactly w0 - lr * sum_t mean_k g_t^k (every value is a small binary fraction,
// so no rounding), on every worker.
class ServersApplyOnce
    : public ::testing::TestWithParam<std::tuple<std::string, std::string, int>> {};

TEST_P(ServersApplyOnce, EveryGradientExactlyOnce) {
  // `variant`: OSP's split policy, or a parameter server's compression.
  const auto [mode, variant, servers] = GetParam();
  const std::string policy = mode == "osp" ? variant : "magnitude";
  PsOptions ps = psOptions(parseSyncMode(mode == "osp" ? "ps-bsp" : mode), 1);
  if (mode != "osp" && !variant.empty()) {
    ps.compression = parseCompression(variant);
    ps.topkRatio = 1.0;
  }
  constexpr int kWorkers = 2, kSteps = 6;
  constexpr double kLr = 0.125;
  auto gradient = [](int rank, int step) { return valuesOf(rank * 7 + step, 11); };
  at::Tensor expected = at::zeros({11});
  for (int t = 0; t < kSteps; ++t) {
    expected -= kLr * (gradient(0, t) + gradient(1, t)) / 2.0;
  }
  OspOptions o;
  o.fraction = 0.5;
  o.policy = policy;
  o.chunkElements = 2;  // 11 elements: several chunks per server
  auto sgd = [](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(kLr));
  };
  auto store = c10::make_intrusive<c10d::HashStore>();
  expectNoErrors(runGlooRanks(
      kWorkers + servers, loopbackOptions(kTimeout),
      [&, mode = mode, servers = servers](std::shared_ptr<Communicator> world) {
        if (world->rank() >= kWorkers) {
          if (mode == "osp") {
            runOspServer(*world, kWorkers, o, sgd);
          } else {
            runParameterServer(*world, kWorkers, ps, sgd);
          }
          return;
        }
        auto workers = std::make_shared<GlooCommunicator>(
            c10::make_intrusive<c10d::PrefixStore>("workers", store), world->rank(), kWorkers,
            loopbackOptions(kTimeout));
        std::unique_ptr<Strategy> s;
        if (mode == "osp") {
          s = std::make_unique<OspWorkerStrategy>(world, workers, servers, o);
        } else {
          s = std::make_unique<PsWorkerStrategy>(world, workers, servers, ps);
        }
        Net net;
        s->attach(net);
        for (int t = 0; t < kSteps; ++t) {
          s->setLearningRate(kLr);
          const at::Tensor g = gradient(world->rank(), t);
          net.a.mutable_grad() = g.narrow(0, 0, 6).view({2, 3}).clone();
          net.b.mutable_grad() = g.narrow(0, 6, 5).clone();
          s->finishGradients();
        }
        s->consolidate();
        s->finish();
        EXPECT_TRUE(at::equal(replica(net), expected))
            << "rank " << world->rank() << ": " << replica(net) << " vs " << expected;
      },
      store));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, ServersApplyOnce,
    ::testing::Values(std::make_tuple("ps-bsp", "", 1), std::make_tuple("ps-bsp", "", 2),
                      std::make_tuple("ps-asp", "", 1), std::make_tuple("ps-asp", "", 2),
                      std::make_tuple("ps-ssp", "", 2), std::make_tuple("ps-bsp", "fp16", 2),
                      std::make_tuple("ps-bsp", "bf16", 1), std::make_tuple("ps-asp", "topk", 2),
                      std::make_tuple("osp", "magnitude", 1),
                      std::make_tuple("osp", "magnitude", 2),
                      std::make_tuple("osp", "layer-order", 2)));

// Bounded staleness, checked from what the workers read rather than from the server's own
// bookkeeping: worker k's gradient is -W at element k and zero elsewhere, so with SGD, lr 1
// and ASP/SSP's lr/W per push, element k of the parameters is exactly the number of worker k's
// pushes applied: its clock. Worker 0 is slow (sleeps each step). After its c-th push a
// worker must read its own element = c (read-my-writes) and, under ps-ssp, every other
// element >= c - s. Under ps-asp the fast workers must run further ahead than s (so the
// check can fail), and the staleness the strategy reports equals the largest gap read.
class PsStaleness : public ::testing::TestWithParam<std::string> {};

TEST_P(PsStaleness, WorkersReadWithinTheBound) {
  const std::string mode = GetParam();
  constexpr int kWorkers = 3, kSteps = 10;
  constexpr int64_t kBound = 2;
  const PsOptions options = psOptions(parseSyncMode(mode), kBound);
  auto sgd = [](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(1.0));
  };
  std::vector<int64_t> largestGap(kWorkers, 0);
  auto store = c10::make_intrusive<c10d::HashStore>();
  expectNoErrors(runGlooRanks(
      kWorkers + 1, loopbackOptions(kTimeout),
      [&](std::shared_ptr<Communicator> world) {
        if (world->rank() == kWorkers) {
          runParameterServer(*world, kWorkers, options, sgd);
          return;
        }
        const int k = world->rank();
        auto workers = std::make_shared<GlooCommunicator>(
            c10::make_intrusive<c10d::PrefixStore>("workers", store), k, kWorkers,
            loopbackOptions(kTimeout));
        PsWorkerStrategy s(world, workers, 1, options);
        Net net;
        s.attach(net);
        for (int64_t c = 1; c <= kSteps; ++c) {
          if (k == 0) std::this_thread::sleep_for(std::chrono::milliseconds(40));
          s.setLearningRate(1.0);
          net.a.mutable_grad() = at::zeros({2, 3});
          net.b.mutable_grad() = at::zeros({5});
          net.a.mutable_grad().view(-1)[k] = -static_cast<float>(kWorkers);
          s.finishGradients();
          const at::Tensor read = replica(net);
          EXPECT_EQ(read[k].item<float>(), static_cast<float>(c)) << "worker " << k;
          for (int j = 0; j < kWorkers; ++j) {
            const auto gap = c - static_cast<int64_t>(read[j].item<float>());
            largestGap[k] = std::max(largestGap[k], gap);
            if (mode == "ps-ssp") {
              EXPECT_LE(gap, kBound) << "worker " << k << " at clock " << c << " read worker "
                                     << j << "'s clock " << read[j].item<float>();
            }
          }
        }
        const auto reported = s.takeMetrics();
        EXPECT_EQ(reported.at("staleness_max"), static_cast<double>(largestGap[k]));
        s.consolidate();
        s.finish();
        // Everything applied once: every worker's element is kSteps on every replica.
        at::Tensor expected = at::zeros({11});
        expected.narrow(0, 0, kWorkers).fill_(static_cast<float>(kSteps));
        EXPECT_TRUE(at::equal(replica(net), expected)) << replica(net);
      },
      store));
  const int64_t fastest = *std::max_element(largestGap.begin(), largestGap.end());
  if (mode == "ps-ssp") {
    EXPECT_EQ(fastest, kBound) << "the fast workers should run exactly s clocks ahead";
  } else {
    EXPECT_GT(fastest, kBound) << "ps-asp should let fast workers run further ahead";
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, PsStaleness, ::testing::Values("ps-ssp", "ps-asp"));

// A crafted push (hostile input from a process inside the job: the job token keeps strangers
// out): a learning rate that is not a finite number >= 0 stops the server with a PeerError
// naming the worker, before anything is applied; an unknown kind likewise.
TEST(PsMessages, ACraftedPushIsRefusedNamingTheWorker) {
  for (const double lr : {std::nan(""), -1.0, HUGE_VAL}) {
    auto sgd = [](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
    };
    auto store = c10::make_intrusive<c10d::HashStore>();
    const auto errors = runGlooRanks(
        2, loopbackOptions(std::chrono::milliseconds(5000)),
        [&](std::shared_ptr<Communicator> world) {
          if (world->rank() == 1) {
            runParameterServer(*world, 1, PsOptions{}, sgd);
            return;
          }
          auto workers = std::make_shared<GlooCommunicator>(
              c10::make_intrusive<c10d::PrefixStore>("workers", store), 0, 1,
              loopbackOptions(std::chrono::milliseconds(5000)));
          PsWorkerStrategy s(world, workers, 1, PsOptions{});
          Net net;
          s.attach(net);
          s.setLearningRate(lr);
          net.a.mutable_grad() = at::ones({2, 3});
          net.b.mutable_grad() = at::ones({5});
          s.finishGradients();
        },
        store);
    EXPECT_NE(errors[1].find("rank 1 (server): worker 0 sent learning rate"), std::string::npos)
        << "lr " << lr << ": " << errors[1];
    EXPECT_NE(errors[0], "") << "the worker cannot go on without its server";
  }
  PushHeader header;
  header.learningRate = 0.1;
  at::Tensor push = encodePush(header, at::ones({3}));
  static_cast<uint32_t*>(push.data_ptr())[1] = 7;  // the kind's word
  auto refusal = [](const at::Tensor& message) {
    try {
      decodePush(message, 3, 9);
    } catch (const PeerError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refusal(push).find("rank 9 (server): worker 3 sent a message of unknown kind 7"),
            std::string::npos)
      << refusal(push);
  push[0] = 0.5f;  // an old-style push: values where the header should be
  EXPECT_NE(refusal(push).find("worker 3 sent a message that is no push"), std::string::npos)
      << refusal(push);
}

// The header is bytes, not float values: a learning rate and a fraction come back with every
// bit (the float32 elements the header replaced rounded them), the payload unchanged.
TEST(PsMessages, HeadersKeepEveryBitAndThePayload) {
  PushHeader push;
  push.kind = PushKind::kState;
  push.learningRate = std::nextafter(0.05, 1.0);
  push.requestedFraction = 1.0 / 3.0;
  push.round = (int64_t{1} << 40) + 1;  // ps-diloco's round step: not a float32 value
  const at::Tensor payload = at::randn({5});
  const at::Tensor message = encodePush(push, payload);
  ASSERT_EQ(message.numel(), PushHeader::kWords + 5);
  const PushHeader back = decodePush(message, 0, 1);
  EXPECT_EQ(back.kind, PushKind::kState);
  EXPECT_EQ(back.learningRate, push.learningRate);
  EXPECT_EQ(back.requestedFraction, push.requestedFraction);
  EXPECT_EQ(back.round, push.round);
  EXPECT_TRUE(at::equal(pushPayload(message), payload));

  PullHeader pull;
  pull.staleness = (int64_t{1} << 40) + 1;  // not a float32 value
  const at::Tensor reply = encodePull(pull, payload);
  EXPECT_EQ(decodePull(reply, 2).staleness, pull.staleness);
  EXPECT_TRUE(at::equal(pullPayload(reply), payload));

  // A round must agree on the kind; the message names both workers' kinds.
  PushHeader gradient;
  gradient.learningRate = 0.1;
  try {
    decodeRound({encodePush(gradient, payload), message}, 4, 17);
    ADD_FAILURE() << "a round of a gradient and a checkpoint request was accepted";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("at step 17 worker 0 sent a gradient push and worker 1 "
                                         "a checkpoint push"),
              std::string::npos)
        << e.what();
  }
}

// The bytes metric: point to point counts exactly what was sent and received; collectives
// count the ring estimate 2(P-1)/P of the tensor each way (counting_communicator.h).
TEST(CountingCommunicator, CountsPointToPointExactlyAndRingEstimates) {
  expectNoErrors(runGlooRanks(2, loopbackOptions(kTimeout), [](std::shared_ptr<Communicator> c) {
    CountingCommunicator counted(c);
    const int peer = 1 - counted.rank();
    at::Tensor out = at::ones({10}), in = at::empty({10});
    auto r = counted.recv(in, peer, 3);
    counted.send(out, peer, 3)->wait(kTimeout);
    r->wait(kTimeout);
    EXPECT_EQ(counted.bytes().sent, 40);
    EXPECT_EQ(counted.bytes().received, 40);
    counted.allreduce(at::ones({100}), ReduceOp::kSum)->wait(kTimeout);  // 2(2-1)/2 * 400
    EXPECT_EQ(counted.bytes().sent, 440);
    EXPECT_EQ(counted.bytes().received, 440);
    counted.send(out, counted.rank(), 4)->wait(kTimeout);  // to oneself: not on the wire
    counted.recv(in, counted.rank(), 4)->wait(kTimeout);
    EXPECT_EQ(counted.bytes().sent, 440);
  }));
}

// sync.mode's names live in two places: the config schema (what `caravan config --schema` and
// docs/config.md offer) and SyncMode (what the engine parses). They offer the same modes, and
// each name parses to the mode that prints it.
TEST(SyncModes, TheSchemaOffersExactlyTheModesTheEngineParses) {
  std::vector<std::string> schema;
  for (const ConfigOption& o : Config::schema()) {
    if (o.key == "sync.mode") schema = o.choices;
  }
  std::vector<std::string> engine;
  for (SyncMode m : kSyncModes) {
    engine.push_back(syncModeName(m));
    EXPECT_EQ(parseSyncMode(syncModeName(m)), m) << syncModeName(m);
  }
  EXPECT_EQ(schema, engine);
  EXPECT_THROW(parseSyncMode("all-reduce"), ConfigError);
}

// A pipeline stage's replica average (AllReduceStrategy::attachGradients): the bucketed
// all-reduce without hooks gives each gradient what the communicator's ReduceOp::kAvg gives
// (the stage's one all-reduce before; shm divides, which multiplying by a third would not
// match), bitwise; a parameter without a gradient keeps none, and one that takes no gradient
// is left alone.
TEST(AllReduceGradients, TheReplicaAverageIsTheCommunicatorsAverageAndLeavesMissingOnesMissing) {
  // Rank r's gradient at `step`: integers, so their sum is exact in any order.
  auto gradientOf = [](int rank, int step) {
    return at::arange(7, at::kFloat).mul(2 * rank + step + 1).add(5);
  };
  expectNoErrors(runGlooRanks(3, loopbackOptions(kTimeout), [&](auto comm) {
    const int r = comm->rank();
    at::Tensor trained = torch::zeros({7}, torch::requires_grad());
    at::Tensor unused = torch::zeros({3}, torch::requires_grad());
    at::Tensor frozen = torch::zeros({2});
    AllReduceOptions tiny;
    tiny.firstBucketBytes = tiny.bucketBytes = 8;  // several buckets
    AllReduceStrategy average(comm, tiny);
    average.attachGradients({trained, unused, frozen});
    for (int step = 0; step < 2; ++step) {
      trained.mutable_grad() = gradientOf(r, step);
      unused.mutable_grad() = at::Tensor();
      average.beforeForward(step);
      average.finishGradients();
      at::Tensor expected = gradientOf(r, step);
      comm->allreduce(expected, ReduceOp::kAvg)->wait(kTimeout);
      const at::Tensor sum = gradientOf(0, step) + gradientOf(1, step) + gradientOf(2, step);
      EXPECT_TRUE(at::allclose(expected, sum / 3, 0, 1e-5));  // the oracle is the mean
      EXPECT_TRUE(at::equal(trained.grad(), expected)) << "rank " << r << " step " << step;
      EXPECT_FALSE(unused.grad().defined());
      EXPECT_FALSE(frozen.grad().defined());
    }
  }));
}

// ZeRO's accounting (Rajbhandari et al., SC20) with AdamW in float32 (state factor 2), Psi
// parameters, N workers: 16 Psi; 8 Psi + 8 Psi / N; 4 Psi + 12 Psi / N; 16 Psi / N. And the
// bytes per step: stages 1 and 2 an all-reduce's 2 (N-1)/N of the gradients, stage 3 3 (N-1)/N.
TEST(SyncModes, ShardLevelsHoldZerosAccountingAndSendItsBytes) {
  const int64_t psi = 1 << 20, p = 4 * psi;
  for (int n : {1, 2, 4, 8}) {
    EXPECT_EQ(shardedModelState(ShardLevel::kNone, p, 2, n).total(), 16 * psi);
    EXPECT_EQ(shardedModelState(ShardLevel::kOptimizer, p, 2, n).total(), 8 * psi + 8 * psi / n);
    EXPECT_EQ(shardedModelState(ShardLevel::kGradients, p, 2, n).total(), 4 * psi + 12 * psi / n);
    EXPECT_EQ(shardedModelState(ShardLevel::kParameters, p, 2, n).total(), 16 * psi / n);
    EXPECT_EQ(shardedBytesPerStep(ShardLevel::kGradients, p, n), 2 * p * (n - 1) / n);
    EXPECT_EQ(shardedBytesPerStep(ShardLevel::kParameters, p, n), 3 * (p * (n - 1) / n));
  }
  for (ShardLevel level : kShardLevels) EXPECT_EQ(parseShardLevel(shardLevelName(level)), level);
  EXPECT_THROW(parseShardLevel("zero3"), ConfigError);
}

// sync.shard = parameters with bf16 blocks (sync/sharding.h, "bf16 gathers"), ranks as threads
// (bf16 blocks run under autocast on any CPU; caravan train keeps float32 where the CPU has no
// bf16 instructions, so the whole runs of test_dist.cpp need one).
namespace {

// A GPT without dropout (the threads share the default generator), every block in bf16: the
// built-in one (vocabulary 13), or a user's scripted twin saved by PyTorch (script_models.py's
// gpt.pt: vocabulary 16, context 24).
BlockModel bf16Gpt(bool scripted) {
  ModelSpec spec;
  spec.name = "gpt";
  spec.width = 32;
  spec.depth = 2;
  spec.heads = 4;
  DataShape shape;
  shape.task = TaskKind::kLanguageModel;
  shape.vocabSize = 13;
  shape.seqLen = 8;
  if (scripted) {
    spec = ModelSpec{};
    spec.name = "torchscript";
    spec.path = test::scriptedModelsDir() + "/gpt.pt";
    shape.vocabSize = 16;
    shape.seqLen = 24;
  }
  torch::manual_seed(3);
  BlockModel model = buildModel(spec, shape);
  model->setBf16(std::vector<bool>(model->numBlocks(), true));
  return model;
}

Batch tokenBatch(bool scripted, uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  const at::Tensor tokens = at::randint(scripted ? 16 : 13, {3, 9}, g, at::kLong);
  return {tokens.narrow(1, 0, 8).contiguous(), tokens.narrow(1, 1, 8).contiguous()};
}

// The parameters autocast casts to bf16 and nothing else reads: the linear layers' weights and
// biases (not the layer norms, not the embeddings).
bool castByAutocast(const std::string& name) {
  for (const char* linear : {".c_attn.", ".c_proj.", ".c_fc.", ".lm_head."}) {
    if (name.find(linear) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

// Against the unsharded model on the same batches (each rank's loss, the gradients summed in
// rank order and scaled by 1/W as the reduce-scatter does, AdamW on the whole tensors): W = 2
// trains the same bits for 3 steps (a sum of two is the same in any order); W = 3 computes the
// same first losses (uneven groups: padding in both) and the same masters within rounding after
// (Gloo's ring sums three in its own order). The linear layers' weights and biases are gathered
// in bf16 (their model parameters are bf16 while a block runs); a forward's gathers move
// (W - 1) (2 ceil(nbf16 / W) + 4 ceil(nf32 / W)) bytes per block, counted by the communicator;
// model.pt's view (forEachUnitGathered) is the float32 masters, with offload too. The same for a
// user's scripted GPT (TorchScript's linear under the same autocast).
class ShardedBf16Gathers : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(ShardedBf16Gathers, LinearWeightsTravelInBf16AndTrainTheBitsOfTheUnshardedModel) {
  const int w = std::get<0>(GetParam());
  const bool offload = std::get<1>(GetParam());
  const bool scripted = std::get<2>(GetParam());
  if (scripted) {
    ASSERT_FALSE(test::scriptedModelsDir().empty())
        << "tests/python/script_models.py failed (.venv: bash scripts/setup.sh)";
  }
  constexpr int kSteps = 3;
  std::vector<std::vector<Batch>> batches(kSteps);
  for (int s = 0; s < kSteps; ++s) {
    for (int r = 0; r < w; ++r) batches[s].push_back(tokenBatch(scripted, 100 * s + r));
  }
  // The unsharded run.
  BlockModel reference = bf16Gpt(scripted);
  torch::optim::AdamW referenceOptimizer(reference->parameters(), torch::optim::AdamWOptions(0.01));
  std::vector<std::vector<double>> referenceLoss(kSteps);
  for (int s = 0; s < kSteps; ++s) {
    std::vector<at::Tensor> sum;
    for (int r = 0; r < w; ++r) {
      reference->zero_grad();
      const at::Tensor loss =
          reference->loss(reference->forward(batches[s][r].input), batches[s][r].target);
      loss.backward();
      referenceLoss[s].push_back(loss.item<double>());
      const auto ps = reference->parameters();
      for (size_t k = 0; k < ps.size(); ++k) {
        if (r == 0) {
          sum.push_back(ps[k].grad().clone());
        } else {
          sum[k] = sum[k] + ps[k].grad();
        }
      }
    }
    const auto ps = reference->parameters();
    for (size_t k = 0; k < ps.size(); ++k) ps[k].mutable_grad() = sum[k].mul_(1.0 / w);
    referenceOptimizer.step();
  }
  // The bytes a forward's gathers send, from the parameters' names and sizes.
  BlockModel probe = bf16Gpt(scripted);
  std::set<std::string> bf16Names;
  int64_t expectedBytes = 0;
  for (size_t b = 0; b < probe->numBlocks(); ++b) {
    int64_t bf16 = 0, f32 = 0;
    for (const auto& p : probe->named_parameters()) {
      if (p.key().rfind("b" + std::to_string(b) + "_", 0) != 0) continue;
      if (castByAutocast(p.key())) {
        bf16Names.insert(p.key());
        bf16 += p.value().numel();
      } else {
        f32 += p.value().numel();
      }
    }
    auto slice = [&](int64_t n) { return n == 0 ? 0 : (n + w - 1) / w; };
    expectedBytes += (w - 1) * (2 * slice(bf16) + 4 * slice(f32));
  }
  // The rule finds them from the autograd graph.
  std::set<std::string> found;
  const auto gathered = bf16GatheredParameters(probe, batches[0][0]);
  for (const auto& p : probe->named_parameters()) {
    if (gathered.count(p.value().unsafeGetTensorImpl()) != 0) found.insert(p.key());
  }
  EXPECT_EQ(found, bf16Names);
  ASSERT_FALSE(bf16Names.empty());

  std::vector<BlockModel> models;
  std::vector<std::set<const c10::TensorImpl*>> sets;
  for (int r = 0; r < w; ++r) {
    models.push_back(bf16Gpt(scripted));
    sets.push_back(bf16GatheredParameters(models.back(), batches[0][r]));
  }
  std::vector<std::vector<double>> losses(w);
  std::vector<int64_t> forwardBytes(w, 0);
  std::vector<std::map<std::string, std::string>> dtypes(w);
  std::map<std::string, at::Tensor> masters;
  expectNoErrors(runGlooRanks(w, loopbackOptions(kTimeout), [&](auto comm) {
    const int r = comm->rank();
    BlockModel& m = models[r];
    auto counted = std::make_shared<CountingCommunicator>(comm);
    HostTier tier;  // outlives the slices on it
    ShardedParameters shards(m, counted, ShardLevel::kParameters, nullptr, 0, sets[r]);
    torch::optim::AdamW sliced(shards.shards(), torch::optim::AdamWOptions(0.01));
    if (offload) shards.offloadTo(tier, sliced);
    for (int s = 0; s < kSteps; ++s) {
      const int64_t before = counted->bytes().sent;
      at::Tensor out = m->forward(batches[s][r].input);
      if (s == 0) {
        forwardBytes[r] = counted->bytes().sent - before;
        for (const auto& p : m->named_parameters()) {
          dtypes[r][p.key()] = p.value().scalar_type() == at::kBFloat16 ? "bf16" : "float32";
        }
      }
      const at::Tensor loss = m->loss(out, batches[s][r].target);
      loss.backward();
      shards.finishGradients();
      if (offload) {
        shards.stepOffloaded(sliced);
      } else {
        sliced.step();
      }
      shards.afterUpdate();
      losses[r].push_back(loss.item<double>());
    }
    shards.settle();
    shards.forEachUnitGathered([&](size_t unit) {
      if (r != 0) return;
      std::set<const c10::TensorImpl*> here;
      for (const auto& p : shards.unitLayout(unit).params) here.insert(p.unsafeGetTensorImpl());
      for (const auto& p : m->named_parameters()) {
        if (here.count(p.value().unsafeGetTensorImpl()) != 0) {
          masters[p.key()] = p.value().detach().clone();
        }
      }
    });
    // After model.pt's float32 view the blocks gather in bf16 again, and train.
    const at::Tensor loss = m->loss(m->forward(batches[0][r].input), batches[0][r].target);
    loss.backward();
    shards.finishGradients();
  }));
  for (int r = 0; r < w; ++r) {
    for (const auto& [name, dtype] : dtypes[r]) {
      EXPECT_EQ(dtype, bf16Names.count(name) != 0 ? "bf16" : "float32") << name;
    }
    EXPECT_EQ(forwardBytes[r], expectedBytes) << "rank " << r;
    for (int s = 0; s < kSteps; ++s) {
      if (w == 2 || s == 0) {
        EXPECT_EQ(losses[r][s], referenceLoss[s][r]) << "rank " << r << " step " << s;
      } else {
        // Gloo's ring sums W = 3 in its own order: the bound, 1e-6 relative.
        EXPECT_NEAR(losses[r][s], referenceLoss[s][r], 1e-6 * std::abs(referenceLoss[s][r]));
      }
    }
  }
  for (const auto& p : reference->named_parameters()) {
    ASSERT_EQ(masters.count(p.key()), 1U) << p.key();
    EXPECT_EQ(masters[p.key()].scalar_type(), at::kFloat) << p.key();
    const double diff = (masters[p.key()] - p.value()).abs().max().item<double>();
    if (w == 2) {
      EXPECT_EQ(diff, 0.0) << p.key();
    } else {
      EXPECT_LE(diff, 1e-4) << p.key();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Workers, ShardedBf16Gathers,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool(),
                                            ::testing::Bool()));

// A unit's groups: every rank's slice (sliceOfGroups) joined again (joinSlices) is the whole,
// padding apart; a rank's slice is its part of each group, group after group.
TEST(ShardedBf16Gathers, SlicesOfGroupsJoinIntoTheWhole) {
  const at::Tensor whole = at::arange(2 * 12, at::kFloat).view({2, 12});
  for (int w : {1, 2, 3, 5}) {
    const std::vector<ShardGroup> groups = {{7, (7 + w - 1) / w * w}, {5, (5 + w - 1) / w * w}};
    std::vector<at::Tensor> slices;
    for (int r = 0; r < w; ++r) slices.push_back(sliceOfGroups(whole, groups, w, r));
    EXPECT_TRUE(at::equal(joinSlices(slices, groups), whole)) << w;
    if (w == 3) {  // groups of 7 -> 9 and 5 -> 6: rank 1 holds elements 3..5 and 7 + 2..3
      EXPECT_TRUE(at::equal(slices[1][0], at::tensor({3.F, 4.F, 5.F, 9.F, 10.F}))) << slices[1];
      EXPECT_TRUE(at::equal(slices[2][0], at::tensor({6.F, 0.F, 0.F, 11.F, 0.F}))) << slices[2];
    }
  }
}
