// The online search of OSP's stage-1 fraction (see fraction_search.h).
#include "sync/fraction_search.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/errors.h"

namespace caravan {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

double splitSeconds(const std::vector<double>& stage1Seconds,
                    const std::vector<double>& sinceStage1Seconds) {
  auto measured = [](double t) { return std::isfinite(t) && t > 0.0; };
  if (stage1Seconds.empty() || sinceStage1Seconds.empty() ||
      !std::all_of(stage1Seconds.begin(), stage1Seconds.end(), measured) ||
      !std::all_of(sinceStage1Seconds.begin(), sinceStage1Seconds.end(), measured)) {
    return 0.0;
  }
  return *std::min_element(stage1Seconds.begin(), stage1Seconds.end()) +
         *std::max_element(sinceStage1Seconds.begin(), sinceStage1Seconds.end());
}

const char* reasonName(FractionReason reason) {
  switch (reason) {
    case FractionReason::kGuess: return "guess";
    case FractionReason::kProbe: return "probe";
    case FractionReason::kFaster: return "faster";
    case FractionReason::kBack: return "back";
    case FractionReason::kSettled: return "settled";
    case FractionReason::kRemeasured: return "remeasured";
    case FractionReason::kRecall: return "recall";
    case FractionReason::kOriginFaster: return "origin-faster";
  }
  return "?";
}

std::string describe(const FractionMove& m, const FractionSearchOptions& o) {
  const double margin = 100.0 * o.margin;
  switch (m.reason) {
    case FractionReason::kGuess:
      return fmt::format("{:.2f}: the workers' guess from their compute time and exchange rate",
                         m.to);
    case FractionReason::kProbe:
      if (m.probeSeconds > 0.0) {
        return fmt::format(
            "{:.2f} took {:.3f} s/step, not {:g}% under {:.3f} at {:.2f}: "
            "probing {:.2f}",
            m.from, m.probeSeconds, margin, m.centreSeconds, m.centre, m.to);
      }
      return fmt::format("probing {:.2f} ({:.2f} took {:.3f} s/step)", m.to, m.centre,
                         m.centreSeconds);
    case FractionReason::kFaster:
      return fmt::format(
          "{:.2f} took {:.3f} s/step, at least {:g}% under the old centre: the "
          "new centre; probing {:.2f}",
          m.centre, m.centreSeconds, margin, m.to);
    case FractionReason::kBack:
      return fmt::format(
          "{:.2f} took {:.3f} s/step, not {:g}% under {:.3f} at {:.2f}: back "
          "to {:.2f}, measured again, held {} steps, then rechecked",
          m.from, m.probeSeconds, margin, m.centreSeconds, m.centre, m.to, o.recheckAfter);
    case FractionReason::kRemeasured:
      return fmt::format(
          "{:.2f} measured again took {:.3f} s/step (first {:.3f}), a neighbour {:g}% "
          "faster: searching around it again, probing {:.2f}",
          m.centre, m.centreSeconds, m.probeSeconds, margin, m.to);
    case FractionReason::kRecall:
      return fmt::format(
          "{:.2f} took {:.3f} s/step, not {:g}% under {:.3f} at {:.2f}: measuring {:.2f}, "
          "where the search started, again",
          m.from, m.probeSeconds, margin, m.centreSeconds, m.centre, m.to);
    case FractionReason::kOriginFaster:
      return fmt::format(
          "{:.2f}, where the search started, measured again took {:.3f} s/step, at least {:g}% "
          "under {:.3f} at the centre: searching around it again, probing {:.2f}",
          m.centre, m.centreSeconds, margin, m.probeSeconds, m.to);
    case FractionReason::kSettled:
      return fmt::format(
          "settled at {:.2f} ({:.3f} s/step; no neighbour {:.2f} away {:g}% "
          "faster), measured again, held {} steps, then rechecked",
          m.centre, m.centreSeconds, o.grid, margin, o.recheckAfter);
  }
  return "?";
}

FractionSearch::FractionSearch(double first, FractionSearchOptions options) : options_(options) {
  CARAVAN_CHECK(options_.grid > 0.0 && options_.grid <= 1.0 && options_.window >= 1 &&
                    options_.margin >= 0.0 && options_.warmup >= 1 && options_.recheckAfter >= 1,
                "OSP fraction search options");
  maxUnits_ = std::max(1, static_cast<int>(std::lround(1.0 / options_.grid)));
  CARAVAN_CHECK(std::abs(maxUnits_ * options_.grid - 1.0) < 1e-9,
                "OSP fraction search: grid {} does not divide 1", options_.grid);
  current_ = previous_ = snap(first);
  if (fractionOf(current_) != first) offGrid_ = first;
}

int FractionSearch::firstStride() const {
  return std::max(1, static_cast<int>(std::lround(options_.firstStride / options_.grid)));
}

int FractionSearch::snap(double fraction) const {
  if (!std::isfinite(fraction)) fraction = 1.0;
  return std::clamp(static_cast<int>(std::lround(fraction / options_.grid)), 1, maxUnits_);
}

double FractionSearch::observe(int64_t step, double seconds, double guess,
                               std::optional<FractionMove>* move) {
  move_.reset();
  // The sample timed step - 1's split: it measures current_ only when that split used it.
  const bool clean = step >= 1 && std::isfinite(seconds) && seconds > 0.0 && previous_ == current_;
  const int thisStep = offGrid_ != 0.0 ? -1 : current_;  // -1: off the grid, never clean
  switch (phase_) {
    case Phase::kWarmup:
      centre_ = snap(guess);
      if (step + 1 >= options_.warmup) phase_ = Phase::kCentre;
      samples_.clear();
      use(snap(guess), step, FractionReason::kGuess, 0.0);
      break;
    case Phase::kHold:  // then measure the centre again and search around it afresh
      if (step >= holdUntil_) {
        samples_.clear();
        phase_ = Phase::kCentre;
      }
      break;
    case Phase::kCentre:
    case Phase::kProbe:
    case Phase::kRecall:
    case Phase::kConfirm:
      if (clean) samples_.push_back(seconds);
      if (static_cast<int>(samples_.size()) >= options_.window) {
        const double measuredSeconds = median(samples_);
        samples_.clear();
        measured(measuredSeconds, step);
      }
      break;
  }
  previous_ = thisStep;
  if (move != nullptr) *move = move_;
  return fraction();
}

void FractionSearch::measured(double seconds, int64_t step) {
  if (phase_ == Phase::kConfirm) {
    // The centre measured again, back from its last probe. Its first measurement won against
    // noisy neighbours, so it may have been lucky: when a neighbour measured around it is now
    // the margin faster than it, the search starts again around it with what it takes now
    // (both directions, first stride). A centre merely slower than its first measurement, with
    // no neighbour faster, is held: drift alone does not restart the search.
    if (!(neighbourBest_ < seconds * (1.0 - options_.margin))) {
      centreSeconds_ = seconds;
      phase_ = Phase::kHold;
      holdUntil_ = step + options_.recheckAfter;
      return;
    }
    searchAround(centre_, seconds, step, FractionReason::kRemeasured, centreSeconds_);
    return;
  }
  if (phase_ == Phase::kRecall) {
    // Where this search started, measured again: it lost to the centre on a measurement taken
    // earlier. The margin faster than the centre, the search starts again around it; otherwise
    // it is one more neighbour the centre's confirmation compares with.
    if (seconds < centreSeconds_ * (1.0 - options_.margin)) {
      searchAround(origin_, seconds, step, FractionReason::kOriginFaster, centreSeconds_);
      return;
    }
    neighbourBest_ = std::min(neighbourBest_, seconds);
    phase_ = Phase::kConfirm;
    use(centre_, step, FractionReason::kBack, seconds, /*always=*/true);
    return;
  }
  if (phase_ == Phase::kCentre) {
    searchAround(centre_, seconds, step, FractionReason::kProbe, 0.0);
    return;
  }
  // A probe: the winner becomes the centre and the search goes on in its direction (the other
  // neighbour is the old centre, known slower).
  if (seconds < centreSeconds_ * (1.0 - options_.margin)) {
    centre_ = current_;
    neighbourBest_ = centreSeconds_;  // the old centre is a neighbour of the new one
    centreSeconds_ = seconds;
    pending_ = {direction_};
    nextProbe(step, FractionReason::kFaster, seconds);
    return;
  }
  neighbourBest_ = std::min(neighbourBest_, seconds);
  nextProbe(step, FractionReason::kProbe, seconds);
}

void FractionSearch::searchAround(int units, double seconds, int64_t step, FractionReason reason,
                                  double probeSeconds) {
  centre_ = origin_ = units;
  centreSeconds_ = seconds;
  neighbourBest_ = HUGE_VAL;
  stride_ = firstStride();
  pending_ = {+1, -1};
  nextProbe(step, reason, probeSeconds);
}

void FractionSearch::nextProbe(int64_t step, FractionReason reason, double probeSeconds) {
  while (true) {
    while (!pending_.empty()) {
      const int direction = pending_.front();
      pending_.erase(pending_.begin());
      const int units = centre_ + direction * stride_;
      if (units < 1 || units > maxUnits_) continue;
      direction_ = direction;
      phase_ = Phase::kProbe;
      use(units, step, reason, probeSeconds);
      return;
    }
    if (stride_ <= 1) break;
    stride_ /= 2;
    pending_ = {+1, -1};
  }
  // No neighbour one grid step away is faster. Away from where the search started: measure that
  // again first. Then back to the centre, confirm its time, hold.
  samples_.clear();
  if (origin_ != centre_) {
    phase_ = Phase::kRecall;
    use(origin_, step, FractionReason::kRecall, probeSeconds, /*always=*/true);
    return;
  }
  phase_ = Phase::kConfirm;
  const bool back = current_ != centre_;
  use(centre_, step, back ? FractionReason::kBack : FractionReason::kSettled, probeSeconds,
      /*always=*/true);
}

void FractionSearch::use(int units, int64_t step, FractionReason reason, double probeSeconds,
                         bool always) {
  if (units == current_ && !always && offGrid_ == 0.0) return;
  FractionMove m;
  m.step = step + 1;
  m.from = offGrid_ != 0.0 ? offGrid_ : fractionOf(current_);
  offGrid_ = 0.0;
  m.to = fractionOf(units);
  m.centre = fractionOf(centre_);
  m.reason = reason;
  m.centreSeconds = centreSeconds_;
  m.probeSeconds = probeSeconds;
  move_ = m;
  current_ = units;
}

}  // namespace caravan
