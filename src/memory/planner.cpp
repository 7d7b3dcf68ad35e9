// The planner: profile, performance model, search (see planner.h).
#include "memory/planner.h"

#include <algorithm>
#include <chrono>
#include <limits>

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
double median(std::vector<double> v) {
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
  std::vector<bool> hadGrad;  // gradients the profile creates are removed again
  for (const auto& p : params) hadGrad.push_back(p.grad().defined());

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
    b.forwardSeconds = median(forward);
    b.backwardSeconds = median(backward);
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
    profile.lossSeconds = median(loss);
  }

  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor p = params[k];
    if (!hadGrad[k]) {
      p.mutable_grad() = at::Tensor();
    } else if (p.grad().defined()) {
      p.mutable_grad().zero_();
    }
  }
  {
    at::NoGradGuard noGrad;
    for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(savedBuffers[k]);
  }
  setDefaultRngState(rng);
  model->setRunner(runner);
  return profile;
}

Prediction predict(const ModelProfile& profile, const std::vector<BlockPolicy>& policies,
                   const TierBandwidth& bandwidth, int prefetchDepth, const WeightTraffic* weights,
                   int64_t activationLimit) {
  const auto& blocks = profile.blocks;
  const size_t n = blocks.size();
  CARAVAN_CHECK(policies.size() == n, "one policy per block");
  const double inf = std::numeric_limits<double>::infinity();
  auto offloaded = [&](size_t i) -> int64_t {  // bytes block i sends to the tier
    switch (policies[i]) {
      case BlockPolicy::kSwap: return blocks[i].savedBytes;
      case BlockPolicy::kSwapInput: return blocks[i].inputBytes;
      default: return 0;
    }
  };
  // What the tier stores of them (memory.tier_dtype = bf16: float32 storages at half).
  auto stored = [&](size_t i) -> int64_t {
    const int64_t bytes = offloaded(i);
    if (profile.activationsOnTier != TierDtype::kBf16 || bytes == 0) return bytes;
    const int64_t float32 = policies[i] == BlockPolicy::kSwap ? blocks[i].savedFloat32Bytes
                                                              : blocks[i].inputFloat32Bytes;
    return bytes - float32 / 2;
  };
  auto heldInMemory = [&](size_t i) -> int64_t {  // bytes block i holds until its backward
    switch (policies[i]) {
      case BlockPolicy::kKeep: return blocks[i].savedBytes;
      case BlockPolicy::kRecompute: return blocks[i].inputBytes;
      default: return 0;
    }
  };
  const double wbw = bandwidth.writeBytesPerSecond > 0 ? bandwidth.writeBytesPerSecond : 1e-9;
  const double rbw = bandwidth.readBytesPerSecond > 0 ? bandwidth.readBytesPerSecond : 1e-9;

  // Out-of-core weights: block i's weights read (once in forward, once in backward), queued on
  // the reader; -inf: in memory.
  const bool offload = weights != nullptr;
  if (offload) {
    CARAVAN_CHECK(weights->weightBytes.size() == n && weights->statePieces.size() == n &&
                      weights->updateSeconds.size() == n,
                  "one weight traffic entry per block");
  }
  // The reader serves reads in the order they are issued; the model books them in the order
  // it reaches them, which for the updater's next state pieces is later than reads backward
  // issues meanwhile. So a read takes the first gap on the reader after its issue time that
  // holds it (busy: the booked intervals, in time order).
  std::vector<std::pair<double, double>> readerBusy;
  auto bookRead = [&](double issue, int64_t bytes) {
    const double length = static_cast<double>(bytes) / rbw;
    double start = issue;
    auto it = readerBusy.begin();
    for (; it != readerBusy.end(); ++it) {
      if (it->second <= start) continue;
      if (it->first >= start + length) break;
      start = it->second;
    }
    readerBusy.insert(it, {start, start + length});
    return start + length;
  };
  std::vector<double> weightsRead(n, -inf);
  std::vector<bool> weightsIssued(n, false);
  auto readWeights = [&](size_t j, double when) {
    if (!offload || j >= n || weightsIssued[j]) return;
    weightsIssued[j] = true;
    if (weights->weightBytes[j] == 0) return;
    weightsRead[j] = bookRead(when, weights->weightBytes[j]);
  };
  const int weightPrefetch = offload ? std::max(weights->prefetch, 0) : 0;

  // Forward: compute and the write queue.
  std::vector<double> writeStart(n, inf), writeEnd(n, -inf);
  std::vector<double> forwardEnd(n, 0.0);
  double t = 0.0, writerFree = 0.0;
  // What block j holds at `when` once its forward ran (offloaded bytes until their write ends).
  auto residentAt = [&](size_t j, double when) -> int64_t {
    if (offloaded(j) > 0) return writeEnd[j] > when ? offloaded(j) : 0;
    return heldInMemory(j);
  };
  for (size_t i = 0; i < n; ++i) {
    readWeights(i, t);
    for (int k = 1; k <= weightPrefetch; ++k) readWeights(i + static_cast<size_t>(k), t);
    t = std::max(t, weightsRead[i]);
    if (activationLimit > 0) {  // the executor's backpressure: drain the writes
      int64_t held = 0;
      for (size_t j = 0; j < i; ++j) held += residentAt(j, t);
      if (held + blocks[i].savedBytes > activationLimit) t = std::max(t, writerFree);
    }
    const double start = t;
    t += blocks[i].forwardSeconds;
    forwardEnd[i] = t;
    const int64_t bytes = stored(i);
    if (bytes > 0) {
      const double issue = policies[i] == BlockPolicy::kSwapInput ? start : t;
      writeStart[i] = std::max(issue, writerFree);
      writeEnd[i] = writeStart[i] + static_cast<double>(bytes) / wbw;
      writerFree = writeEnd[i];
    }
  }
  const double forwardSeconds = t;
  t += profile.lossSeconds;

  // Memory during forward: after block i's forward, what blocks <= i hold (offloaded bytes
  // until their write ends).
  int64_t peak = 0;
  for (size_t i = 0; i < n; ++i) {
    int64_t live = 0;
    for (size_t j = 0; j <= i; ++j) live += residentAt(j, forwardEnd[i]);
    // A swap block's saves exist in memory while it computes, whatever the writer does.
    if (policies[i] == BlockPolicy::kSwap) {
      live += blocks[i].savedBytes - residentAt(i, forwardEnd[i]);
    }
    peak = std::max(peak, live);
    // The loss's forward runs after the last block's: what it saves joins what they hold.
    if (i + 1 == n) peak = std::max(peak, live + profile.lossSavedBytes);
  }

  // Backward: reads queued `prefetchDepth` blocks ahead, compute waits for its read.
  std::vector<double> readEnd(n, -inf);
  std::vector<bool> issued(n, false), cancelled(n, false);
  // The weights are read again in backward (the last block's stay); the update of block i
  // starts when its backward ended and the previous update did.
  if (offload) {
    std::fill(weightsIssued.begin(), weightsIssued.end(), false);
    std::fill(weightsRead.begin(), weightsRead.end(), -inf);
    weightsIssued[n - 1] = true;
    for (int k = 1; k <= weightPrefetch && static_cast<size_t>(k) < n; ++k) {
      readWeights(n - 1 - static_cast<size_t>(k), forwardSeconds);
    }
  }
  std::vector<double> updateEnd(n, -inf);
  double updaterFree = 0.0;
  std::vector<double> pieceWrites;  // end times of the pieces written, in order
  std::vector<std::pair<double, double>> steps, computing;  // optimizer; training thread
  const bool overlap = offload && weights->overlap;
  // Block i's update, its gradients in at `ready` (weights.cpp's update()): the first state
  // piece read from `ready` (overlapped) or when the update begins, each next one when the
  // previous is stepped; each piece written after its step, the updater waiting while
  // writesInFlight pieces are in flight; the block is done when its last piece's write is
  // queued, and the updater moves on once the weights' write is. A kept block (block 0) reads
  // and writes nothing. Returns when the block is done.
  auto runUpdate = [&](size_t i, double ready) {
    const bool kept = weights->weightBytes[i] == 0;
    double begin = std::max(ready, updaterFree);
    if (!overlap && !kept) {  // the weights left after backward: read again
      begin = bookRead(begin, weights->weightBytes[i]);
    }
    auto write = [&](int64_t bytes, double when) {  // returns when the updater may go on
      const size_t slots = static_cast<size_t>(std::max(weights->writesInFlight, 1));
      const double submit = pieceWrites.size() >= slots
                                ? std::max(when, pieceWrites[pieceWrites.size() - slots])
                                : when;
      const double start = std::max(submit, writerFree);
      writerFree = start + static_cast<double>(bytes) / wbw;
      pieceWrites.push_back(writerFree);
      return submit;
    };
    const std::vector<int64_t>& pieces = weights->statePieces[i];
    int64_t total = 0;
    for (int64_t b : pieces) total += b;
    double at = begin;
    if (pieces.empty() || kept) {
      steps.emplace_back(at, at + weights->updateSeconds[i]);
      at += weights->updateSeconds[i];
    } else {
      double readEnd = bookRead(overlap ? ready : begin, pieces[0]);
      for (size_t k = 0; k < pieces.size(); ++k) {
        const double stepStart = std::max(at, readEnd);
        if (k + 1 < pieces.size()) readEnd = bookRead(stepStart, pieces[k + 1]);
        const double share = total > 0 ? static_cast<double>(pieces[k]) / total : 1.0;
        const double stepEnd = stepStart + weights->updateSeconds[i] * share;
        steps.emplace_back(stepStart, stepEnd);
        at = write(pieces[k], stepEnd);
      }
    }
    updateEnd[i] = at;
    updaterFree = kept ? at : write(weights->weightBytes[i], at);
  };
  auto issueReads = [&](size_t above, double when) {  // backward reached block `above`
    for (size_t k = 1; k <= static_cast<size_t>(prefetchDepth) && k <= above; ++k) {
      const size_t j = above - k;
      if (issued[j] || offloaded(j) == 0) continue;
      issued[j] = true;
      if (when < writeStart[j]) {  // queued before its write started: cancelled
        cancelled[j] = true;
        readEnd[j] = when;
        continue;
      }
      readEnd[j] = bookRead(std::max(when, writeEnd[j]), stored(j));
    }
  };
  issueReads(n, forwardSeconds);
  for (size_t step = 0; step < n; ++step) {
    const size_t i = n - 1 - step;
    double start = t;
    if (offload) {
      // Backpressure: the updates of the blocks above i + updateBacklog have ended; then the
      // weights (read now, unless prefetched).
      const size_t above = i + 1 + static_cast<size_t>(std::max(weights->updateBacklog, 0));
      if (overlap && above < n) start = std::max(start, updateEnd[above]);
      readWeights(i, start);
      start = std::max(start, weightsRead[i]);
    }
    if (offloaded(i) > 0) {
      if (!issued[i]) issueReads(i + 1, t);
      start = std::max(start, readEnd[i]);
    }
    issueReads(i, start);
    // Memory while block i runs backward: what blocks below hold (offloaded bytes resident
    // again once their read was queued, or never written), plus its own saves rematerialized
    // (recompute also holds its input while rerunning).
    int64_t live = blocks[i].savedBytes;
    if (policies[i] == BlockPolicy::kRecompute || policies[i] == BlockPolicy::kSwapInput) {
      live += blocks[i].inputBytes;
    }
    for (size_t j = 0; j < i; ++j) {
      if (offloaded(j) > 0) {
        live += (issued[j] || cancelled[j] || writeEnd[j] > start) ? offloaded(j) : 0;
      } else {
        live += heldInMemory(j);
      }
    }
    peak = std::max(peak, live);
    const bool recomputes =
        policies[i] == BlockPolicy::kRecompute || policies[i] == BlockPolicy::kSwapInput;
    if (offload) {
      for (int k = 1; k <= weightPrefetch && static_cast<size_t>(k) <= i; ++k) {
        readWeights(i - static_cast<size_t>(k), start);
      }
    }
    t = start + blocks[i].backwardSeconds + (recomputes ? blocks[i].forwardSeconds : 0.0);
    computing.emplace_back(start, t);
    if (overlap) runUpdate(i, t);
  }
  double updatesEnd = 0.0;
  if (offload) {
    // With clipping every update waits for the end of backward (finishStep, top block first).
    if (!overlap) {
      for (size_t k = n; k-- > 0;) runUpdate(k, t);
    }
    for (double e : updateEnd) updatesEnd = std::max(updatesEnd, e);
  }
  // An updater without a core of its own takes the seconds its steps overlap the training
  // thread's backward compute from it.
  double shared = 0.0;
  if (offload && weights->updaterSharesCore) {
    for (const auto& [s0, s1] : steps) {
      for (const auto& [c0, c1] : computing)
        shared += std::max(0.0, std::min(s1, c1) - std::max(s0, c0));
    }
  }
  Prediction p;
  p.stepSeconds = t + shared;
  p.forwardSeconds = forwardSeconds;
  if (offload) p.updatesEndSeconds = std::max(updatesEnd + shared, p.stepSeconds);
  p.peakBytes = peak;
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

}  // namespace caravan
