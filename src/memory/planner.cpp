// The planner: profile, performance model, search (see planner.h).
#include "memory/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <set>

#include <fmt/format.h>
#include <torch/nn/modules/container/any.h>

#include "core/clock.h"
#include "core/errors.h"
#include "memory/saved_tensors.h"
#include "memory/tracker.h"
#include "models/loss.h"

namespace caravan {

namespace {

using Clock = std::chrono::steady_clock;

// 0 for no measurement (profileModel with repeats = 0: sizes only).
double upperMedian(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

ModelProfile profileModel(BlockModel& model, const Batch& batch, int repeats) {
  CARAVAN_CHECK(repeats >= 0, "profile repeats");
  BlockRunner* runner = model->runner();
  model->setRunner(nullptr);
  // Leave no trace: the RNG (dropout) and buffers (batch norm) are put back afterwards.
  const at::Tensor rng = defaultRngState();
  std::vector<at::Tensor> buffers = model->buffers(), savedBuffers;
  {
    at::NoGradGuard noGrad;
    for (const auto& b : buffers) savedBuffers.push_back(b.clone());
  }
  const std::vector<at::Tensor> params = model->parameters();
  // Gradients the profile creates are removed again, a block's as soon as it is profiled: the
  // profile holds one block's gradients at a time, not the whole model's (4 bytes a parameter
  // on every worker before a sharded run slices it).
  std::set<const c10::TensorImpl*> hadGrad;
  for (const auto& p : params) {
    if (p.grad().defined()) hadGrad.insert(p.unsafeGetTensorImpl());
  }
  auto removeProfileGradients = [&](const std::vector<at::Tensor>& ps) {
    for (at::Tensor p : ps) {
      if (hadGrad.count(p.unsafeGetTensorImpl()) == 0) {
        p.mutable_grad() = at::Tensor();
      } else if (p.grad().defined()) {
        p.mutable_grad().zero_();
      }
    }
  };

  // Every block's input, from one forward; its context (values crossing besides the
  // activation) has, at the end, what every block reads of it.
  BlockModelImpl::Context context(model->contextSlots());
  BlockModelImpl::ContextScope contextScope(*model, context);
  std::vector<at::Tensor> inputs;
  at::Tensor output;
  {
    at::NoGradGuard noGrad;
    at::Tensor x = batch.input;
    for (size_t i = 0; i < model->numBlocks(); ++i) {
      inputs.push_back(x);
      x = model->block(i).forward(x);
    }
    output = x;
  }

  ModelProfile profile;
  // Whether block i's input carries a gradient in training: the data does not; a block's
  // output does when its input or one of its parameters does (a leading Flatten's does not).
  bool inputNeedsGrad = false;
  for (size_t i = 0; i < model->numBlocks(); ++i) {
    BlockProfile b;
    b.label = model->blockLabel(i);
    b.inputBytes = static_cast<int64_t>(inputs[i].storage().nbytes());
    b.inputFloat32Bytes = inputs[i].scalar_type() == at::kFloat ? b.inputBytes : 0;
    std::vector<double> forward, backward;
    bool outputNeedsGrad = false;
    for (int r = 0; r <= repeats; ++r) {  // r = 0 warms up
      at::Tensor x = inputs[i].detach();
      if (inputNeedsGrad && x.is_floating_point()) x.requires_grad_(true);
      MemoryTracker tracker;
      at::Tensor y, g;
      double f = 0.0;
      {
        SavedTensorScope scope(tracker, params);
        const auto t0 = Clock::now();
        y = model->block(i).forward(x);
        f = secondsSince(t0);
        b.savedBytes = tracker.live(MemoryCategory::kActivations);
        b.savedFloat32Bytes = activeAccounting()->liveFloat32Bytes();
        outputNeedsGrad = y.requires_grad();  // else nothing to differentiate: no backward
        if (outputNeedsGrad) g = at::randn_like(y);
        const auto t1 = Clock::now();
        if (outputNeedsGrad) y.backward(g);
        if (r > 0) backward.push_back(secondsSince(t1));
      }
      if (r > 0) forward.push_back(f);
    }
    inputNeedsGrad = outputNeedsGrad;
    removeProfileGradients(model->block(i).ptr()->parameters());
    b.forwardSeconds = upperMedian(forward);
    b.backwardSeconds = upperMedian(backward);
    profile.blocks.push_back(b);
  }
  {
    std::vector<double> loss;
    for (int r = 0; r <= repeats; ++r) {
      at::Tensor logits = output.detach().requires_grad_(true);
      MemoryTracker tracker;
      SavedTensorScope scope(tracker, params);
      const auto t0 = Clock::now();
      at::Tensor l = model->loss(logits, batch.target);
      profile.lossSavedBytes = tracker.live(MemoryCategory::kActivations);
      l.backward();
      if (r > 0) loss.push_back(secondsSince(t0));
    }
    profile.lossSeconds = upperMedian(loss);
  }

  removeProfileGradients(params);  // the loss's, and a weight one block reads of another's
  {
    at::NoGradGuard noGrad;
    for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(savedBuffers[k]);
  }
  setDefaultRngState(rng);
  model->setRunner(runner);
  return profile;
}

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

}  // namespace

Prediction predict(const ModelProfile& profile, const std::vector<BlockPolicy>& policies,
                   const TierBandwidth& bandwidth, int prefetchDepth, const WeightTraffic* weights,
                   int64_t activationLimit) {
  StepPredictor model(profile, policies, bandwidth, prefetchDepth, weights, activationLimit);
  model.runForward();
  model.runBackward();
  return model.finish();
}

StepPredictor::StepPredictor(const ModelProfile& profile, const std::vector<BlockPolicy>& policies,
                             const TierBandwidth& bandwidth, int prefetchDepth,
                             const WeightTraffic* weights, int64_t activationLimit)
    : profile_(profile),
      policies_(policies),
      weights_(weights),
      blockCount_(profile.blocks.size()),
      prefetchDepth_(prefetchDepth),
      activationLimit_(activationLimit),
      writeBytesPerSecond_(bandwidth.writeBytesPerSecond > 0 ? bandwidth.writeBytesPerSecond
                                                             : 1e-9),
      readBytesPerSecond_(bandwidth.readBytesPerSecond > 0 ? bandwidth.readBytesPerSecond : 1e-9),
      weightPrefetch_(weights != nullptr ? std::max(weights->prefetch, 0) : 0),
      overlap_(weights != nullptr && weights->overlap),
      weightsRead_(blockCount_, -kInfinity),
      weightsIssued_(blockCount_, false),
      forwardEnd_(blockCount_, 0.0),
      writeStart_(blockCount_, kInfinity),
      writeEnd_(blockCount_, -kInfinity),
      readEnd_(blockCount_, -kInfinity),
      issued_(blockCount_, false),
      cancelled_(blockCount_, false),
      updateEnd_(blockCount_, -kInfinity) {
  CARAVAN_CHECK(policies.size() == blockCount_, "one policy per block");
  if (weights != nullptr) {
    CARAVAN_CHECK(weights->weightBytes.size() == blockCount_ &&
                      weights->statePieces.size() == blockCount_ &&
                      weights->updateSeconds.size() == blockCount_,
                  "one weight traffic entry per block");
  }
}

int64_t StepPredictor::offloaded(size_t i) const {
  switch (policies_[i]) {
    case BlockPolicy::kSwap: return profile_.blocks[i].savedBytes;
    case BlockPolicy::kSwapInput: return profile_.blocks[i].inputBytes;
    default: return 0;
  }
}

// memory.tier_dtype = bf16: float32 storages at half.
int64_t StepPredictor::stored(size_t i) const {
  const int64_t bytes = offloaded(i);
  if (profile_.activationsOnTier != TierDtype::kBf16 || bytes == 0) return bytes;
  const BlockProfile& b = profile_.blocks[i];
  const int64_t float32 =
      policies_[i] == BlockPolicy::kSwap ? b.savedFloat32Bytes : b.inputFloat32Bytes;
  return bytes - float32 / 2;
}

int64_t StepPredictor::heldInMemory(size_t i) const {  // until its backward
  switch (policies_[i]) {
    case BlockPolicy::kKeep: return profile_.blocks[i].savedBytes;
    case BlockPolicy::kRecompute: return profile_.blocks[i].inputBytes;
    default: return 0;
  }
}

bool StepPredictor::recomputes(size_t i) const {
  return policies_[i] == BlockPolicy::kRecompute || policies_[i] == BlockPolicy::kSwapInput;
}

// What block j holds at `when` once its forward ran (offloaded bytes until their write ends).
int64_t StepPredictor::residentAt(size_t j, double when) const {
  if (offloaded(j) > 0) return writeEnd_[j] > when ? offloaded(j) : 0;
  return heldInMemory(j);
}

// The reader serves reads in the order they are issued; the model books them in the order it
// reaches them, which for the updater's next state pieces is later than reads backward issues
// meanwhile. So a read takes the first gap on the reader after its issue time that holds it.
// Returns when it ends.
double StepPredictor::bookRead(double issue, int64_t bytes) {
  const double length = static_cast<double>(bytes) / readBytesPerSecond_;
  double start = issue;
  auto it = readerBusy_.begin();
  for (; it != readerBusy_.end(); ++it) {
    if (it->second <= start) continue;
    if (it->first >= start + length) break;
    start = it->second;
  }
  readerBusy_.insert(it, {start, start + length});
  return start + length;
}

// Out-of-core weights: block j's weights read at `when` (once in forward, once in backward);
// a block kept in memory (0 bytes) reads nothing (weightsRead_ stays -inf).
void StepPredictor::readWeights(size_t j, double when) {
  if (weights_ == nullptr || j >= blockCount_ || weightsIssued_[j]) return;
  weightsIssued_[j] = true;
  if (weights_->weightBytes[j] == 0) return;
  weightsRead_[j] = bookRead(when, weights_->weightBytes[j]);
}

double StepPredictor::runForward() {
  double t = 0.0;
  for (size_t i = 0; i < blockCount_; ++i) {
    readWeights(i, t);
    for (int k = 1; k <= weightPrefetch_; ++k) readWeights(i + static_cast<size_t>(k), t);
    t = std::max(t, weightsRead_[i]);
    if (activationLimit_ > 0) {  // the executor's backpressure: drain the writes
      int64_t held = 0;
      for (size_t j = 0; j < i; ++j) held += residentAt(j, t);
      if (held + profile_.blocks[i].savedBytes > activationLimit_) t = std::max(t, writerFree_);
    }
    const double start = t;
    t += profile_.blocks[i].forwardSeconds;
    forwardEnd_[i] = t;
    queueWrite(i, start, t);
  }
  forwardSeconds_ = t;
  return t;
}

// Block i's write, its forward having run from `start` to `end`: FIFO on the writer.
void StepPredictor::queueWrite(size_t i, double start, double end) {
  const int64_t bytes = stored(i);
  if (bytes <= 0) return;
  const double issue = policies_[i] == BlockPolicy::kSwapInput ? start : end;
  writeStart_[i] = std::max(issue, writerFree_);
  writeEnd_[i] = writeStart_[i] + static_cast<double>(bytes) / writeBytesPerSecond_;
  writerFree_ = writeEnd_[i];
}

int64_t StepPredictor::forwardPeakBytes() const {
  int64_t peak = 0;
  for (size_t i = 0; i < blockCount_; ++i) {
    int64_t live = 0;
    for (size_t j = 0; j <= i; ++j) live += residentAt(j, forwardEnd_[i]);
    // A swap block's saves exist in memory while it computes, whatever the writer does.
    if (policies_[i] == BlockPolicy::kSwap) {
      live += profile_.blocks[i].savedBytes - residentAt(i, forwardEnd_[i]);
    }
    peak = std::max(peak, live);
    // The loss's forward runs after the last block's: what it saves joins what they hold.
    if (i + 1 == blockCount_) peak = std::max(peak, live + profile_.lossSavedBytes);
  }
  return peak;
}

// The weights are read again in backward (the last block's stay), the blocks below the last
// prefetched from the end of forward.
void StepPredictor::prefetchWeightsForBackward() {
  std::fill(weightsIssued_.begin(), weightsIssued_.end(), false);
  std::fill(weightsRead_.begin(), weightsRead_.end(), -kInfinity);
  weightsIssued_[blockCount_ - 1] = true;
  for (int k = 1; k <= weightPrefetch_ && static_cast<size_t>(k) < blockCount_; ++k) {
    readWeights(blockCount_ - 1 - static_cast<size_t>(k), forwardSeconds_);
  }
}

// Backward reached block `above` at `when`: the reads of the `prefetchDepth` blocks below it.
void StepPredictor::issueReads(size_t above, double when) {
  for (size_t k = 1; k <= static_cast<size_t>(prefetchDepth_) && k <= above; ++k) {
    const size_t j = above - k;
    if (issued_[j] || offloaded(j) == 0) continue;
    issued_[j] = true;
    if (when < writeStart_[j]) {  // queued before its write started: cancelled
      cancelled_[j] = true;
      readEnd_[j] = when;
      continue;
    }
    readEnd_[j] = bookRead(std::max(when, writeEnd_[j]), stored(j));
  }
}

double StepPredictor::runBackward() {
  double t = forwardSeconds_ + profile_.lossSeconds;
  if (weights_ != nullptr) prefetchWeightsForBackward();
  issueReads(blockCount_, forwardSeconds_);
  for (size_t step = 0; step < blockCount_; ++step) {
    const size_t i = blockCount_ - 1 - step;
    const double start = startBackward(i, t);
    backwardPeak_ = std::max(backwardPeak_, backwardLiveBytes(i, start));
    if (weights_ != nullptr) {
      for (int k = 1; k <= weightPrefetch_ && static_cast<size_t>(k) <= i; ++k) {
        readWeights(i - static_cast<size_t>(k), start);
      }
    }
    const BlockProfile& b = profile_.blocks[i];
    t = start + b.backwardSeconds + (recomputes(i) ? b.forwardSeconds : 0.0);
    computing_.emplace_back(start, t);
    if (overlap_) runUpdate(i, t);
  }
  backwardEnd_ = t;
  return t;
}

double StepPredictor::startBackward(size_t i, double previousEnd) {
  double start = previousEnd;
  if (weights_ != nullptr) {
    // Backpressure: the updates of the blocks above i + updateBacklog have ended; then the
    // weights (read now, unless prefetched).
    const size_t above = i + 1 + static_cast<size_t>(std::max(weights_->updateBacklog, 0));
    if (overlap_ && above < blockCount_) start = std::max(start, updateEnd_[above]);
    readWeights(i, start);
    start = std::max(start, weightsRead_[i]);
  }
  if (offloaded(i) > 0) {
    if (!issued_[i]) issueReads(i + 1, previousEnd);
    start = std::max(start, readEnd_[i]);
  }
  issueReads(i, start);
  return start;
}

int64_t StepPredictor::backwardLiveBytes(size_t i, double start) const {
  int64_t live = profile_.blocks[i].savedBytes;
  if (recomputes(i)) live += profile_.blocks[i].inputBytes;
  for (size_t j = 0; j < i; ++j) {
    if (offloaded(j) > 0) {
      live += (issued_[j] || cancelled_[j] || writeEnd_[j] > start) ? offloaded(j) : 0;
    } else {
      live += heldInMemory(j);
    }
  }
  return live;
}

// A piece's write queued at `when` (weights.cpp's update()): the updater waits while
// writesInFlight pieces are in flight. Returns when the updater may go on.
double StepPredictor::writePiece(int64_t bytes, double when) {
  const size_t slots = static_cast<size_t>(std::max(weights_->writesInFlight, 1));
  const double submit = pieceWrites_.size() >= slots
                            ? std::max(when, pieceWrites_[pieceWrites_.size() - slots])
                            : when;
  const double start = std::max(submit, writerFree_);
  writerFree_ = start + static_cast<double>(bytes) / writeBytesPerSecond_;
  pieceWrites_.push_back(writerFree_);
  return submit;
}

// The first state piece read from `ready` (overlapped) or when the update begins, each next
// one when the previous is stepped; each piece written after its step. A kept block (block 0)
// reads and writes nothing.
double StepPredictor::runUpdate(size_t i, double ready) {
  const bool kept = weights_->weightBytes[i] == 0;
  double begin = std::max(ready, updaterFree_);
  if (!overlap_ && !kept) {  // the weights left after backward: read again
    begin = bookRead(begin, weights_->weightBytes[i]);
  }
  const std::vector<int64_t>& pieces = weights_->statePieces[i];
  const double seconds = weights_->updateSeconds[i];
  int64_t total = 0;
  for (int64_t b : pieces) total += b;
  double at = begin;
  if (pieces.empty() || kept) {
    steps_.emplace_back(at, at + seconds);
    at += seconds;
  } else {
    double pieceRead = bookRead(overlap_ ? ready : begin, pieces[0]);  // when it is in
    for (size_t k = 0; k < pieces.size(); ++k) {
      const double stepStart = std::max(at, pieceRead);
      if (k + 1 < pieces.size()) pieceRead = bookRead(stepStart, pieces[k + 1]);
      const double share = total > 0 ? static_cast<double>(pieces[k]) / total : 1.0;
      const double stepEnd = stepStart + seconds * share;
      steps_.emplace_back(stepStart, stepEnd);
      at = writePiece(pieces[k], stepEnd);
    }
  }
  updateEnd_[i] = at;
  updaterFree_ = kept ? at : writePiece(weights_->weightBytes[i], at);
  return at;
}

void StepPredictor::runUpdatesAfterBackward() {
  for (size_t k = blockCount_; k-- > 0;) runUpdate(k, backwardEnd_);
}

double StepPredictor::updaterSharedSeconds() const {
  double shared = 0.0;
  if (weights_ == nullptr || !weights_->updaterSharesCore) return shared;
  for (const auto& [s0, s1] : steps_) {
    for (const auto& [c0, c1] : computing_) {
      shared += std::max(0.0, std::min(s1, c1) - std::max(s0, c0));
    }
  }
  return shared;
}

Prediction StepPredictor::finish() {
  double updatesEnd = 0.0;
  if (weights_ != nullptr) {
    // With clipping every update waits for the end of backward (finishStep, top block first).
    if (!overlap_) runUpdatesAfterBackward();
    for (double e : updateEnd_) updatesEnd = std::max(updatesEnd, e);
  }
  const double shared = updaterSharedSeconds();
  Prediction p;
  p.stepSeconds = backwardEnd_ + shared;
  p.forwardSeconds = forwardSeconds_;
  if (weights_ != nullptr) p.updatesEndSeconds = std::max(updatesEnd + shared, p.stepSeconds);
  p.peakBytes = std::max(forwardPeakBytes(), backwardPeak_);
  return p;
}

namespace {

// Lexicographic: fitting first, then time (fitting) or peak (not fitting).
bool better(const Plan& a, const Plan& b) {
  if (a.fits != b.fits) return a.fits;
  if (a.fits) return a.prediction.stepSeconds < b.prediction.stepSeconds;
  return a.prediction.peakBytes < b.prediction.peakBytes;
}

}  // namespace

Plan planPolicies(const ModelProfile& profile, const TierBandwidth& bandwidth,
                  int64_t activationBudget, int prefetchDepth, const WeightTraffic* weights,
                  int64_t writeLimit) {
  const size_t n = profile.blocks.size();
  auto evaluate = [&](std::vector<BlockPolicy> policies) {
    Plan p;
    p.prediction = predict(profile, policies, bandwidth, prefetchDepth, weights,
                           std::max<int64_t>(writeLimit, 0));
    p.fits = activationBudget <= 0 || p.prediction.peakBytes <= activationBudget;
    p.policies = std::move(policies);
    return p;
  };
  const bool canSwap = bandwidth.writeBytesPerSecond > 0 && bandwidth.readBytesPerSecond > 0;
  std::vector<BlockPolicy> choices = {BlockPolicy::kKeep, BlockPolicy::kRecompute};
  if (canSwap) {
    choices.push_back(BlockPolicy::kSwap);
    choices.push_back(BlockPolicy::kSwapInput);
  }

  // Every plan one block's policy away from `p`, evaluated.
  auto neighbours = [&](const Plan& p) {
    std::vector<Plan> out;
    for (size_t i = 0; i < n; ++i) {
      for (BlockPolicy c : choices) {
        if (c == p.policies[i]) continue;
        std::vector<BlockPolicy> q = p.policies;
        q[i] = c;
        out.push_back(evaluate(std::move(q)));
      }
    }
    return out;
  };

  // Hill-climbing over single-block changes.
  auto climb = [&](Plan p) {
    for (int round = 0; round < 100; ++round) {
      Plan best = p;
      for (Plan& candidate : neighbours(p)) {
        if (better(candidate, best)) best = std::move(candidate);
      }
      if (!better(best, p)) break;
      p = std::move(best);
    }
    return p;
  };

  // Greedy from all-keep: most peak bytes freed per second added, until it fits.
  Plan greedy = evaluate(std::vector<BlockPolicy>(n, BlockPolicy::kKeep));
  while (!greedy.fits) {
    Plan pick;
    double bestScore = -1.0;
    for (Plan& candidate : neighbours(greedy)) {
      const double freed =
          static_cast<double>(greedy.prediction.peakBytes - candidate.prediction.peakBytes);
      if (freed <= 0) continue;
      const double added =
          std::max(candidate.prediction.stepSeconds - greedy.prediction.stepSeconds, 1e-9);
      if (freed / added > bestScore) {
        bestScore = freed / added;
        pick = std::move(candidate);
      }
    }
    if (bestScore < 0) break;  // nothing frees more
    greedy = std::move(pick);
  }

  Plan best = climb(greedy);
  for (BlockPolicy c : choices) {
    Plan uniform = evaluate(std::vector<BlockPolicy>(n, c));
    Plan climbed = climb(uniform);
    if (better(climbed, best)) best = std::move(climbed);
    if (better(uniform, best)) best = std::move(uniform);
  }
  return best;
}

std::string formatPlan(const ModelProfile& profile, const Plan& plan,
                       const TierBandwidth& bandwidth, int prefetchDepth) {
  std::string s = fmt::format("{:>5}  {:<16} {:>10} {:>10} {:>10} {:>10}  {}\n", "block", "label",
                              "fwd ms", "bwd ms", "input", "saved", "policy");
  int64_t saved = 0;
  for (size_t i = 0; i < profile.blocks.size(); ++i) {
    const BlockProfile& b = profile.blocks[i];
    saved += b.savedBytes;
    s += fmt::format("{:>5}  {:<16} {:>10.2f} {:>10.2f} {:>10} {:>10}  {}\n", i, b.label,
                     b.forwardSeconds * 1e3, b.backwardSeconds * 1e3, formatBytes(b.inputBytes),
                     formatBytes(b.savedBytes), policyName(plan.policies[i]));
  }
  s += fmt::format(
      "loss {:.2f} ms; all blocks save {}; tier write {:.2f} GB/s, read {:.2f} GB/s; prefetch "
      "{} block(s) ahead{}\n",
      profile.lossSeconds * 1e3, formatBytes(saved), bandwidth.writeBytesPerSecond / 1e9,
      bandwidth.readBytesPerSecond / 1e9, prefetchDepth,
      profile.activationsOnTier == TierDtype::kBf16
          ? "; swapped float32 activations stored as bf16 (memory.tier_dtype)"
          : "");
  s += fmt::format("predicted: forward+backward {:.1f} ms (forward {:.1f} ms), activation peak {} "
                   "({} bytes){}\n",
                   plan.prediction.stepSeconds * 1e3, plan.prediction.forwardSeconds * 1e3,
                   formatBytes(plan.prediction.peakBytes), plan.prediction.peakBytes,
                   plan.fits ? "" : " -- does NOT fit the budget");
  return s;
}

int64_t plannedActivationBudget(int64_t budget, int64_t persistent) {
  return std::max<int64_t>(
      static_cast<int64_t>(kPlanMargin * static_cast<double>(budget - persistent)), 1);
}

int64_t budgetForPlannedPeak(int64_t peakBytes, int64_t persistent) {
  return persistent +
         static_cast<int64_t>(std::ceil(static_cast<double>(peakBytes) / kPlanMargin)) + 1;
}

}  // namespace caravan
