// OSP's stage-1 fraction found by measuring step times (sync.osp_auto_fraction), osp.h.
//
// The step time T(f) of OSP with stage-1 fraction f is roughly max(compute + stage 1(f),
// stage 1(f) + stage 2(1 - f)): too small a stage 1 leaves a stage 2 that outlasts the next
// step's compute, too large a one waits for what could have been hidden. A model of the two
// needs the rate stage 2 really gets while compute runs, which on a busy host it does not know;
// this search measures T instead, with the model's guess as its starting point only.
//
// The servers run it, one instance each, and its decision sets the next split. Every server
// sees the same push headers and runs the same deterministic search, so every server and
// worker uses the same fraction.
//
// What a step of split s - 1 costs, as round s's pushes tell it (splitSeconds): stage 1 of step
// s - 1 for the worker that pushed last (its round trip is the service alone; the others' also
// waited for it: the least round trip over workers) plus the most time any worker took from that
// reply to its push at step s (its compute of step s, with split s - 1's stage 2 behind it, and
// the wait for that stage 2 to drain). Both parts belong to split s - 1 alone, whichever worker
// is slow; a period between one worker's pushes would not (a fast worker's holds the slow one's
// drain of split s - 2). A round with a worker that did not measure (step 0, or the first step
// after an evaluation or a checkpoint, which are not step time) gives no sample.
//
// Fractions are multiples of `grid` in [grid, 1]. A sample counts for the fraction in use only
// when split s - 1 used it too (one sample is lost per change); a measurement is the median of
// `window` such samples. Phases:
//   warm-up  `warmup` rounds at the workers' model-based guess (the compute they measure and
//            their exchange rate), then the guess becomes the centre;
//   centre   measure the centre;
//   probe    measure centre + stride, then centre - stride (a neighbour outside the grid is
//            skipped); one at least `margin` faster becomes the centre and the search goes on
//            in the direction that won (the other neighbour is the old centre); when neither
//            is, the stride halves and both are probed;
//   recall   when the probes ended away from where this search started, that fraction is
//            measured again: the centre won against it on a measurement taken earlier (a run's
//            first steps are slower than its later ones: measured 15% over the first ten of a
//            fmnist-cnn run; drift), so it may not be faster now; when it is the margin
//            faster than the centre, the search starts again around it;
//   confirm  back at the centre, it is measured again: a centre whose first measurement won
//            against noisy neighbours may have been lucky; when a neighbour measured around it
//            (or the recalled start) is the margin faster than what it takes now, the search
//            starts again around it (first stride, both directions); drift alone does not
//            restart it;
//   hold     below one grid step the centre is kept `recheckAfter` rounds, then measured again
//            and searched around from the first stride (a shallow slope that one grid step
//            cannot show above the margin, a larger one can), so a drifting optimum is
//            followed.
// Ties keep the centre, so a noisy flat region does not make the fraction wander.
//
// Threading: one server's loop; not shared.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace caravan {

struct FractionSearchOptions {
  double grid = 0.05;          // the fractions searched: multiples of this in [grid, 1] (1 / N)
  double firstStride = 0.2;    // the first probes' distance from the centre (grid steps)
  int window = 3;              // clean samples per measurement (their median)
  double margin = 0.015;       // a probe must be this much faster than the centre to win
  int warmup = 3;              // rounds at the model's guess before the search starts
  int64_t recheckAfter = 100;  // rounds a settled fraction is held before it is rechecked
};

// Why the fraction changed (FractionMove::reason).
enum class FractionReason : uint32_t {
  kGuess = 1,         // warm-up: the workers' model-based guess
  kProbe = 2,         // trying a neighbour of the centre
  kFaster = 3,        // the neighbour was faster: it is the new centre, the search goes on
  kBack = 4,          // no neighbour one grid step away was faster: back to the centre, held
  kSettled = 5,       // as kBack, the centre already in use (from == to)
  kRemeasured = 6,    // back at the centre, measured again, a neighbour measured around it
                      // is the margin faster: the search starts again around it
  kRecall = 7,        // the probes done away from where this search started: measuring that
                      // fraction again against the centre
  kOriginFaster = 8,  // measured again, where the search started is the margin faster than
                      // the centre: the search starts again around it
};
const char* reasonName(FractionReason reason);

struct FractionMove {
  int64_t step = 0;  // the first step whose split uses `to`
  double from = 0.0, to = 0.0;
  double centre = 0.0;  // the search's centre after the move
  FractionReason reason = FractionReason::kGuess;
  // The measurements behind the move (median seconds per step; 0 where none): the centre's
  // and the fraction's that was just measured (kFaster, kBack, kProbe after another probe,
  // kSettled after kFaster; kRemeasured: the centre's earlier measurement).
  double centreSeconds = 0.0, probeSeconds = 0.0;
};
// One line for people, e.g. "0.65 took 0.190 s/step against 0.212 at 0.45: the new centre".
std::string describe(const FractionMove& move, const FractionSearchOptions& options);

// Round s's sample from every worker's push (in any order): the least stage-1 round trip of
// step s - 1 plus the most time from that reply to the push of step s; 0 when a worker did not
// measure (a time <= 0 or not finite).
double splitSeconds(const std::vector<double>& stage1Seconds,
                    const std::vector<double>& sinceStage1Seconds);

class FractionSearch {
 public:
  // `first`: the fraction of step 0's split (sync.osp_fraction; off the grid, the first move
  // starts from it).
  explicit FractionSearch(double first, FractionSearchOptions options = {});

  // Round `step`'s stage-1 pushes: splitSeconds (<= 0 or not finite: not measured) and the
  // largest model-based guess. Returns the fraction for step + 1's split; `move` is set when it
  // differs from this step's (or step 0's was off the grid), and when the search settles
  // (kBack, kSettled). Rounds must come in order, one per step, counted from 0 in this process.
  double observe(int64_t step, double seconds, double guess, std::optional<FractionMove>* move);

  double fraction() const { return fractionOf(current_); }

 private:
  enum class Phase { kWarmup, kCentre, kProbe, kRecall, kConfirm, kHold };
  int snap(double fraction) const;  // grid units in [1, maxUnits_]
  int firstStride() const;          // grid units
  // units / (1 / grid): 3 of 20 is 0.15, the double nearest it (not 3 x 0.05).
  double fractionOf(int units) const { return static_cast<double>(units) / maxUnits_; }
  // A measurement of the fraction in use (`current_`) is complete: decide what to try next.
  void measured(double seconds, int64_t step);
  // `units`, measured at `seconds`, becomes the centre and where this search starts: its
  // neighbours are probed from the first stride.
  void searchAround(int units, double seconds, int64_t step, FractionReason reason,
                    double probeSeconds);
  // The next neighbour in pending_ inside the grid, or the next stride, or (below one grid
  // step) back to the centre to confirm it.
  void nextProbe(int64_t step, FractionReason reason, double probeSeconds);
  // current_ becomes `units`; a FractionMove for step + 1 is kept when that changes it (or
  // always, with `always`).
  void use(int units, int64_t step, FractionReason reason, double probeSeconds,
           bool always = false);

  FractionSearchOptions options_;
  int maxUnits_ = 1;
  Phase phase_ = Phase::kWarmup;
  int current_ = 0;              // grid units of the newest split's fraction (step s's)
  double offGrid_ = 0.0;         // step 0's fraction while it is in use and off the grid
  int previous_ = 0;             // and of step s - 1's, which round s's sample timed
  int centre_ = 0, stride_ = 0;  // grid units
  int origin_ = 0;               // the centre this search started from (grid units)
  double centreSeconds_ = 0.0;   // the centre's measurement
  double neighbourBest_ = 0.0;   // the fastest neighbour measured around this centre
  std::vector<int> pending_;     // directions (+1, -1) still to probe at this stride
  int direction_ = 0;            // the probe being measured: centre + direction * stride
  std::vector<double> samples_;  // clean samples of current_
  int64_t holdUntil_ = 0;
  std::optional<FractionMove> move_;  // this round's
};

}  // namespace caravan
