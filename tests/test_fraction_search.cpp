// OSP's stage-1 fraction search (sync/fraction_search.h) against closed-form step times: the
// oracle is the fastest fraction of the grid, known in closed form for each model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include <ATen/ATen.h>

#include "core/errors.h"
#include "sync/fraction_search.h"
#include "sync/ps_message.h"

using namespace caravan;

namespace {

using StepTime = std::function<double(double fraction, int64_t step)>;

// OSP's step time with compute c, a whole exchange s and stage 2 running at 1/slowdown of the
// rate while compute runs: c + s f + max(0, slowdown s (1 - f) - c).
StepTime ospModel(double c, double s, double slowdown) {
  return [=](double f, int64_t) { return c + s * f + std::max(0.0, slowdown * s * (1 - f) - c); };
}

struct SearchRun {
  std::vector<double> split;  // the fraction of each step's split
  std::vector<FractionMove> moves;
};

// The servers' view: round s brings the sample (splitSeconds) that timed split s - 1, times noise
// uniform in [1 - noise, 1 + noise] (a fixed seed); the guess is constant.
SearchRun simulate(const StepTime& time, double first, double guess, int64_t rounds, double noise,
                   FractionSearchOptions options = {}, unsigned seed = 7) {
  FractionSearch search(first, options);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> jitter(1.0 - noise, 1.0 + noise);
  SearchRun run;
  run.split.push_back(search.fraction());
  for (int64_t s = 0; s < rounds; ++s) {
    const double seconds = s == 0 ? 0.0 : time(run.split[s - 1], s) * jitter(rng);
    std::optional<FractionMove> move;
    run.split.push_back(search.observe(s, seconds, guess, &move));
    if (move) {
      EXPECT_EQ(move->step, s + 1);
      EXPECT_DOUBLE_EQ(move->to, run.split.back());
      EXPECT_FALSE(describe(*move, options).empty());
      run.moves.push_back(*move);
    } else {
      EXPECT_EQ(run.split[s + 1], run.split[s]) << "round " << s << " moved without a reason";
    }
  }
  return run;
}

double meanTime(const StepTime& time, const SearchRun& run, int64_t from) {
  double sum = 0.0;
  for (size_t s = from; s < run.split.size(); ++s) sum += time(run.split[s], s);
  return sum / static_cast<double>(run.split.size() - from);
}

double bestOf(const StepTime& time, const std::vector<double>& fractions, int64_t step) {
  double best = HUGE_VAL;
  for (double f : fractions) best = std::min(best, time(f, step));
  return best;
}

std::vector<double> grid() {
  std::vector<double> g;
  for (int u = 1; u <= 20; ++u) g.push_back(u * 0.05);
  return g;
}

}  // namespace

// Compute-bound, communication-bound with stage 2 slowed by compute, balanced, stage 1 slow:
// from guesses at both ends and the middle, under +-3% noise per step (10 seeds), the mean step
// time over rounds 150-400 (rechecks included) is within 5% of the grid's fastest fraction (so
// of every fixed fraction 0.25, 0.5, 0.75, and of 1, which is ps-bsp), and every fraction it
// held after round 100 (back at a centre, not left when measured again) is within 5% too.
TEST(FractionSearch, SettlesWithinFivePercentOfTheFastestFraction) {
  const std::vector<std::pair<const char*, StepTime>> models = {
      {"compute-bound", ospModel(0.15, 0.10, 1.0)},  // fastest at the smallest fraction
      {"comm-bound", ospModel(0.10, 0.30, 1.5)},     // fastest near 0.78
      {"balanced", ospModel(0.12, 0.12, 2.0)},       // fastest at 0.5
      {"stage 1 slow", ospModel(0.05, 0.40, 3.0)},   // fastest near 0.96
      {"shallow", ospModel(0.08, 0.20, 1.2)}};       // fastest near 0.67, 1.5% per grid step
  for (const auto& [name, time] : models) {
    const double best = bestOf(time, grid(), 0);
    for (const double guess : {0.05, 0.5, 1.0}) {
      double worst = 0.0;
      for (unsigned seed = 1; seed <= 10; ++seed) {
        const SearchRun run = simulate(time, 0.5, guess, 400, 0.03, {}, seed);
        const double mean = meanTime(time, run, 150);
        EXPECT_LE(mean, 1.05 * best) << name << " from " << guess << " seed " << seed;
        worst = std::max(worst, mean / best);
        for (size_t i = 0; i < run.moves.size(); ++i) {
          const FractionMove& m = run.moves[i];
          if (m.step < 100 ||
              (m.reason != FractionReason::kBack && m.reason != FractionReason::kSettled)) {
            continue;
          }
          // Back at the centre it is measured again (window + 1 rounds); a restart then means
          // it was not held.
          const bool left = i + 1 < run.moves.size() &&
                            run.moves[i + 1].reason == FractionReason::kRemeasured &&
                            run.moves[i + 1].step <= m.step + FractionSearchOptions{}.window + 1;
          if (left) continue;
          EXPECT_LE(time(m.centre, 0), 1.05 * best)
              << name << " from " << guess << " seed " << seed << ": " << describe(m, {});
        }
      }
      std::printf(
          "%-13s guess %.2f: mean step time from round 150 at most %.3fx the grid's "
          "best over 10 seeds\n",
          name, guess, worst);
    }
  }
}

// A sample times the split of the step before its push: counted for a new fraction, the first
// sample after each change would be the old fraction's. With one sample per measurement and no
// margin, a search that counted it would see every probe as fast as its centre and never move;
// on a step time falling with the fraction it climbs to 1.
TEST(FractionSearch, CountsEachSampleForTheSplitItTimed) {
  FractionSearchOptions o;
  o.window = 1;
  o.margin = 0.0;
  const StepTime falling = [](double f, int64_t) { return 1.0 - 0.5 * f; };
  const SearchRun run = simulate(falling, 0.5, 0.3, 80, 0.0, o);
  EXPECT_DOUBLE_EQ(run.split.back(), 1.0);
  ASSERT_FALSE(run.moves.empty());
  EXPECT_EQ(run.moves.front().reason, FractionReason::kGuess);
}

// Noise below the margin (+-0.5% against 1.5%) on a flat step time: probes come and go back, the
// centre never moves from the guess.
TEST(FractionSearch, NoiseBelowTheMarginNeverMovesTheCentre) {
  const StepTime flat = [](double, int64_t) { return 0.2; };
  const SearchRun run = simulate(flat, 0.5, 0.4, 500, 0.005);
  for (const FractionMove& m : run.moves) {
    EXPECT_NE(m.reason, FractionReason::kFaster) << describe(m, FractionSearchOptions{});
    EXPECT_DOUBLE_EQ(m.centre, 0.4);
  }
  EXPECT_DOUBLE_EQ(run.split.back(), 0.4);
  // Held between rechecks: each recheck probes both neighbours at three strides and returns.
  const auto settled = std::count_if(run.moves.begin(), run.moves.end(), [](const auto& m) {
    return m.reason == FractionReason::kBack;
  });
  EXPECT_GE(settled, 4);
  EXPECT_LE(run.moves.size(), 7u * 5u + 8u);
}

// The balance point moves at step 300 (compute falls to a quarter: stage 2 hides less; one grid
// step from the old optimum is only 1.7% faster, under the margin): the rechecks after holding
// find the new optimum, and the last 150 steps run within 5% of its step time.
TEST(FractionSearch, FollowsAnOptimumThatMoves) {
  const StepTime before = ospModel(0.20, 0.20, 1.0), after = ospModel(0.05, 0.20, 1.5);
  const StepTime drifting = [&](double f, int64_t s) {
    return s < 300 ? before(f, s) : after(f, s);
  };
  const SearchRun run = simulate(drifting, 0.5, 0.2, 900, 0.02);
  const double best = bestOf(after, grid(), 0);
  EXPECT_LE(meanTime(drifting, run, 750), 1.05 * best) << "ended at " << run.split.back();
  EXPECT_LE(after(run.split.back(), 0), 1.05 * best) << "ended at " << run.split.back();
  // Before the change it had settled near the old optimum (the smallest fractions).
  EXPECT_LE(before(run.split[299], 0), 1.05 * bestOf(before, grid(), 0)) << run.split[299];
}

// The stage-2 reply's header keeps the fraction and the move bit for bit; one that says
// something a worker cannot use is refused naming the server.
TEST(FractionSearch, TheSplitHeaderKeepsTheMoveAndRefusesNonsense) {
  SplitHeader h;
  h.fraction = 0.35000000000000003;
  FractionMove m;
  m.step = (int64_t{1} << 40) + 3;
  m.from = 0.55;
  m.to = h.fraction;
  m.centre = 0.35;
  m.reason = FractionReason::kBack;
  m.centreSeconds = 0.1 + 1e-17;
  m.probeSeconds = 1.0 / 3.0;
  h.move = m;
  const at::Tensor payload = at::randn({4});
  const at::Tensor message = encodeSplit(h, payload);
  const SplitHeader back = decodeSplit(message, 5);
  ASSERT_TRUE(back.move.has_value());
  EXPECT_EQ(back.fraction, h.fraction);
  EXPECT_EQ(back.move->step, m.step);
  EXPECT_EQ(back.move->from, m.from);
  EXPECT_EQ(back.move->to, m.to);
  EXPECT_EQ(back.move->centre, m.centre);
  EXPECT_EQ(back.move->reason, m.reason);
  EXPECT_EQ(back.move->centreSeconds, m.centreSeconds);
  EXPECT_EQ(back.move->probeSeconds, m.probeSeconds);
  EXPECT_TRUE(at::equal(splitPayload(message), payload));
  EXPECT_FALSE(decodeSplit(encodeSplit(SplitHeader{0.5, std::nullopt}, payload), 5).move);

  PushHeader push;
  push.stage1Seconds = 0.1 + 1e-17;
  push.sinceStage1Seconds = 1.0 / 3.0;
  const PushHeader pushBack = decodePush(encodePush(push, payload), 0, 1);
  EXPECT_EQ(pushBack.stage1Seconds, push.stage1Seconds);
  EXPECT_EQ(pushBack.sinceStage1Seconds, push.sinceStage1Seconds);

  auto refusal = [&](double fraction, uint32_t reason) {
    at::Tensor bad = encodeSplit(SplitHeader{fraction, m}, payload);
    static_cast<uint32_t*>(bad.data_ptr())[1] = reason;
    try {
      decodeSplit(bad, 5);
    } catch (const PeerError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  for (const auto& [fraction, reason] :
       std::vector<std::pair<double, uint32_t>>{{0.0, 3}, {1.5, 3}, {std::nan(""), 3}, {0.5, 9}}) {
    EXPECT_NE(refusal(fraction, reason).find("rank 5 (a server) sent an OSP split"),
              std::string::npos)
        << fraction << " " << reason;
  }
  EXPECT_EQ(refusal(0.5, 3), "accepted");
}

// What a step of split s - 1 costs, from round s's pushes, on a timeline of three workers with
// different, jittered compute and a fraction that changes: worker k pushes step s at
// p_k(s) = r(s - 1) + max(c_k(s), S2(f(s - 1))) (its compute, or split s - 1's stage 2 still
// draining), the servers reply at r(s) = max_k p_k(s) + S1(f(s)). splitSeconds of the round
// trips of step s - 1 and the times since their reply equals, to rounding, the closed form
// S1(f(s - 1)) + max_k max(c_k(s), S2(f(s - 1))), split s - 1's alone. One fast worker's own
// period between pushes does not: after a change it also holds the slow worker's drain of the
// split before.
TEST(FractionSearch, ARoundsSampleIsThePreviousSplitsCostWhicheverWorkerIsSlow) {
  auto s1 = [](double f) { return 0.02 + 0.1 * f; };
  auto s2 = [](double f) { return 0.3 * (1.0 - f); };
  const std::vector<double> base = {0.10, 0.15, 0.12};
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> jitter(0.9, 1.1);
  const int steps = 40;
  std::vector<double> f(steps);
  for (int s = 0; s < steps; ++s) f[s] = s < 10 ? 0.5 : s < 20 ? 0.1 : s < 30 ? 0.9 : 0.3;
  std::vector<std::vector<double>> c(steps, std::vector<double>(3)), p = c, stage1 = c;
  std::vector<double> r(steps);
  for (int s = 0; s < steps; ++s) {
    for (int k = 0; k < 3; ++k) c[s][k] = base[k] * jitter(rng);
    const double start = s == 0 ? 0.0 : r[s - 1];
    for (int k = 0; k < 3; ++k) p[s][k] = start + std::max(c[s][k], s == 0 ? 0.0 : s2(f[s - 1]));
    r[s] = *std::max_element(p[s].begin(), p[s].end()) + s1(f[s]);
    for (int k = 0; k < 3; ++k) stage1[s][k] = r[s] - p[s][k];
  }
  int fastDiffers = 0;
  for (int s = 2; s < steps; ++s) {
    std::vector<double> trips = stage1[s - 1], since(3);
    for (int k = 0; k < 3; ++k) since[k] = p[s][k] - r[s - 1];
    double expected = 0.0;
    for (int k = 0; k < 3; ++k) expected = std::max(expected, std::max(c[s][k], s2(f[s - 1])));
    expected += s1(f[s - 1]);
    EXPECT_NEAR(splitSeconds(trips, since), expected, 1e-12) << "round " << s;
    const double fastPeriod = p[s][0] - p[s - 1][0];
    fastDiffers += std::abs(fastPeriod - expected) > 1e-3;
  }
  EXPECT_GT(fastDiffers, 0) << "the timeline never separates the two measures";
  EXPECT_EQ(splitSeconds({0.1, 0.0, 0.1}, {0.2, 0.2, 0.2}), 0.0) << "a worker not measuring";
  EXPECT_EQ(splitSeconds({0.1, 0.1}, {0.2, std::nan("")}), 0.0);
}

// Step 0's fraction off the grid (sync.osp_fraction = 0.33): the first move starts from it,
// even when the guess snaps to the grid point nearest it, so the records chain from what ran.
TEST(FractionSearch, AnOffGridFirstFractionIsWhereTheFirstMoveStarts) {
  const StepTime flat = [](double, int64_t) { return 0.2; };
  const SearchRun run = simulate(flat, 0.33, 0.33, 10, 0.0);
  ASSERT_FALSE(run.moves.empty());
  EXPECT_EQ(run.moves.front().from, 0.33);
  EXPECT_DOUBLE_EQ(run.moves.front().to, 0.35);
  EXPECT_EQ(run.moves.front().step, 1);
}

// A centre whose first measurement was lucky: the first three samples at 0.8 come 40% low, so
// 0.8 beats 0.6 and every later neighbour is compared with a time 0.8 never runs at. Back at the
// centre it is measured again, its neighbour 0.7 is found the margin faster, and the search
// starts again around it: it ends at the true optimum 0.4 (T = 0.2 + 0.3 |f - 0.4|), not held
// at 0.8.
TEST(FractionSearch, ALuckyCentreIsMeasuredAgainAndLeft) {
  auto time = [](double f) { return 0.2 + 0.3 * std::abs(f - 0.4); };
  FractionSearch search(0.6);
  std::vector<double> split = {search.fraction()};
  std::vector<FractionMove> moves;
  int lucky = 3;
  for (int64_t s = 0; s < 160; ++s) {
    double seconds = s == 0 ? 0.0 : time(split[s - 1]);
    if (s > 0 && std::abs(split[s - 1] - 0.8) < 1e-9 && lucky > 0) {
      seconds *= 0.6;
      --lucky;
    }
    std::optional<FractionMove> move;
    split.push_back(search.observe(s, seconds, 0.6, &move));
    if (move) moves.push_back(*move);
  }
  ASSERT_EQ(lucky, 0) << "the search never tried 0.8";
  const bool remeasured = std::any_of(moves.begin(), moves.end(), [](const FractionMove& m) {
    return m.reason == FractionReason::kRemeasured && std::abs(m.centre - 0.8) < 1e-9;
  });
  EXPECT_TRUE(remeasured);
  EXPECT_DOUBLE_EQ(split.back(), 0.4);
  for (const FractionMove& m : moves)
    std::printf("  step %3ld %s\n", static_cast<long>(m.step), describe(m, {}).c_str());
}

// A run's first steps are slower than its later ones (measured at 1 Gbit/s, 0.4 cores per host:
// 0.15 took 0.146 s/step at step 5 and 0.129 at step 70). A centre timed then loses to a
// neighbour timed later that is really slower, and the search holds that neighbour. Modelled
// as 1 + 0.25 exp(-s / 6) on a step time with its optimum at 0.2 rising 6% per 0.1 on either
// side, the guess at the optimum: over rounds 30-120 of every seed the mean step time is within
// 5% of the optimum's. Where the search started is measured again before the centre is held
// (recall); without that, 3 seeds of 10 held a neighbour (at most 1.09x).
TEST(FractionSearch, ARunsSlowFirstStepsDoNotTimeTheCentre) {
  const StepTime steady = [](double f, int64_t) { return 0.125 * (1.0 + 0.6 * std::abs(f - 0.2)); };
  const StepTime warming = [&](double f, int64_t s) {
    return steady(f, s) * (1.0 + 0.25 * std::exp(-static_cast<double>(s) / 6.0));
  };
  const double best = bestOf(steady, grid(), 0);
  double worst = 0.0;
  for (unsigned seed = 1; seed <= 10; ++seed) {
    const SearchRun run = simulate(warming, 0.5, 0.2, 120, 0.03, {}, seed);
    const double mean = meanTime(steady, run, 30);
    EXPECT_LE(mean, 1.05 * best) << "seed " << seed;
    worst = std::max(worst, mean / best);
  }
  std::printf("mean step time over rounds 30-120 at most %.3fx the grid's best over 10 seeds\n",
              worst);
}
