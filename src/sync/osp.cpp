// OSP workers and servers (see osp.h).
#include "sync/osp.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <torch/torch.h>

#include "core/errors.h"
#include "sync/replicas.h"

namespace caravan {
namespace {

constexpr int kTagPush1 = 21;  // worker -> server: PushHeader (ps_message.h), g[I]
constexpr int kTagPull1 = 22;  // server -> worker: w[I]
constexpr int kTagPush2 = 23;  // worker -> server: g[U]
constexpr int kTagPull2 = 24;  // server -> worker: SplitHeader, w[U], next split flags
constexpr int kOspTagState = 25;  // server -> worker 0: its shard's optimizer state

// Of the measured rate, the share auto sizing counts on stage 2 getting while the next step
// computes (ours: the transfer competes with compute for the CPU and the link).
constexpr double kOverlapMargin = 0.95;
constexpr double kRateSmoothing = 0.3;  // weight of the newest measurement

using Clock = std::chrono::steady_clock;
double secondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int64_t stage1Count(int64_t chunks, double fraction) {
  if (chunks == 0) return 0;
  return std::clamp<int64_t>(static_cast<int64_t>(std::ceil(fraction * chunks)), 1, chunks);
}

// Shard-local element indices of the chunks with stage1 == `stage1`.
at::Tensor localIndices(const ChunkSplit& split, bool stage1) {
  std::vector<at::Tensor> parts;
  for (int64_t c = 0; c < split.numChunks(); ++c) {
    if ((split.stage1[c] != 0) == stage1) {
      parts.push_back(at::arange(split.begin(c), split.begin(c) + split.size(c), at::kLong));
    }
  }
  return parts.empty() ? at::empty({0}, at::kLong) : at::cat(parts);
}

}  // namespace

ChunkSplit initialSplit(int64_t shardSize, const OspOptions& options) {
  ChunkSplit s;
  s.shardSize = shardSize;
  s.chunk = std::max<int64_t>(1, options.chunkElements);
  const int64_t chunks = (shardSize + s.chunk - 1) / s.chunk;
  s.stage1.assign(static_cast<size_t>(chunks), 0);
  const int64_t k = stage1Count(chunks, options.fraction);
  for (int64_t c = 0; c < k; ++c) s.stage1[c] = 1;
  return s;
}

OspWorkerStrategy::OspWorkerStrategy(std::shared_ptr<Communicator> world,
                                     std::shared_ptr<Communicator> workers, int numServers,
                                     OspOptions options)
    : world_(std::move(world)),
      workers_(std::move(workers)),
      servers_(numServers),
      options_(std::move(options)) {
  CARAVAN_CHECK(world_ && workers_ && servers_ >= 1 &&
                    workers_->size() + servers_ == world_->size(),
                "OSP: {} servers in a world of {}", servers_, world_->size());
  CARAVAN_CHECK(options_.fraction > 0.0 && options_.fraction <= 1.0, "OSP fraction {}",
                options_.fraction);
}

void OspWorkerStrategy::attachModel(torch::nn::Module& model) {
  broadcastModel(*workers_, model);
  params_ = syncedParameters(model);
  layout_.servers = servers_;
  for (const auto& p : params_) layout_.total += p.numel();
  global_ = flatten(params_);
  // As for the parameter server: rank 0's optimizer holds the servers' state when resuming.
  seedServers(*world_, *workers_, global_,
              takeStateForServers(optimizer_, params_, workers_->rank() == 0), layout_);
  if (restoredPrevious_.defined() && restoredPrevious_.numel() == layout_.total) {
    previous_ = restoredPrevious_;
  }
  restoredPrevious_ = at::Tensor();
  splits_.clear();
  for (int s = 0; s < servers_; ++s) splits_.push_back(initialSplit(layout_.size(s), options_));
  commThread_ = std::make_unique<CommThread>();
}

at::Tensor OspWorkerStrategy::indices(int s, bool stage1) const {
  return localIndices(splits_[s], stage1).add_(layout_.begin(s));
}

void OspWorkerStrategy::install(const at::Tensor& index, const at::Tensor& values) {
  global_.index_copy_(0, index, values);
}

void OspWorkerStrategy::drainStage2() {
  if (!stage2_) return;
  stage2_->wait(world_->timeout());
  stage2_.reset();
  at::Tensor flat = flatten(params_);
  std::optional<SplitHeader> first;
  for (int s = 0; s < servers_; ++s) {
    const int server = servers().rank(s);
    const SplitHeader header = decodeSplit(stage2Reply_[s], server);
    const at::Tensor payload = splitPayload(stage2Reply_[s]);
    const int64_t n = stage2Index_[s].numel();
    const at::Tensor values = payload.narrow(0, 0, n);
    install(stage2Index_[s], values);
    flat.index_copy_(0, stage2Index_[s], values);  // the global values replace the LGP guess
    const float* flags = payload.data_ptr<float>() + n;
    int64_t marked = 0;
    for (int64_t c = 0; c < splits_[s].numChunks(); ++c) {
      splits_[s].stage1[c] = flags[c] != 0.0f ? 1 : 0;
      marked += splits_[s].stage1[c];
    }
    // Every server decides the same fraction (osp.h); a split that is not its share, or
    // servers that disagree, would leave workers and servers exchanging different chunks.
    if (!first) first = header;
    if (header.fraction != first->fraction ||
        marked != stage1Count(splits_[s].numChunks(), header.fraction)) {
      throw PeerError(fmt::format(
          "rank {} (server) split its shard at stage-1 fraction {} ({} of {} chunks) where "
          "rank {} chose {}; the servers run different versions of caravan",
          server, header.fraction, marked, splits_[s].numChunks(), servers().rank(0),
          first->fraction));
    }
  }
  unflattenInto(flat, params_);
  if (first && first->move) {
    const FractionMove& m = *first->move;
    StrategyEvent e;
    e.kind = "osp_fraction";
    e.step = firstStep_ + m.step;  // the servers count from this process's first step
    e.numbers = {{"from", m.from},
                 {"to", m.to},
                 {"centre", m.centre},
                 {"centre_s", m.centreSeconds},
                 {"probe_s", m.probeSeconds}};
    e.words = {{"reason", reasonName(m.reason)}, {"why", describe(m, options_.search)}};
    events_.push_back(std::move(e));
  }
}

std::vector<StrategyEvent> OspWorkerStrategy::takeEvents() { return std::exchange(events_, {}); }

std::map<std::string, double> OspWorkerStrategy::takeMetrics() {
  std::map<std::string, double> m;
  if (fractionSteps_ > 0) {
    m["stage1_fraction"] = fractionSum_ / static_cast<double>(fractionSteps_);
  }
  fractionSum_ = 0.0;
  fractionSteps_ = 0;
  return m;
}

double OspWorkerStrategy::requestedFraction() const {
  if (!options_.autoFraction || elementsPerSecond_ <= 0.0 || computeSeconds_ <= 0.0) {
    return options_.fraction;
  }
  const double overlapped = kOverlapMargin * elementsPerSecond_ * computeSeconds_;
  return std::clamp(1.0 - overlapped / static_cast<double>(layout_.total), 0.0, 1.0);
}

void OspWorkerStrategy::measure(double computeSeconds, int64_t elements, double seconds) {
  auto smooth = [](double& into, double value) {
    into = into <= 0.0 ? value : (1.0 - kRateSmoothing) * into + kRateSmoothing * value;
  };
  if (computeSeconds > 0.0) smooth(computeSeconds_, computeSeconds);
  if (elements > 0 && seconds > 0.0) smooth(elementsPerSecond_, elements / seconds);
}

void OspWorkerStrategy::finishGradients() {
  const auto entered = Clock::now();
  const double computeSeconds =
      lastReturn_ == Clock::time_point{} ? 0.0 : secondsBetween(lastReturn_, entered);
  drainStage2();  // w_t complete; the split for this step known
  // Heavy-ball LGP: the server's last update w_t - w_{t-1} is -lr * its momentum buffer.
  at::Tensor lastUpdate;
  if (options_.lgp && options_.lgpMomentum > 0.0) {
    if (previous_.defined()) lastUpdate = global_ - previous_;
    previous_ = global_.clone();
  }
  // The exchange rate from the last stage 2 (its own thread timed it) and this stage 1.
  measure(computeSeconds, stage2Timing_->elements, stage2Timing_->seconds);
  const at::Tensor g = flatGradients(params_);
  // Stage 1: blocking.
  const auto stage1Start = Clock::now();
  PushHeader header;
  header.learningRate = lr_;
  header.requestedFraction = requestedFraction();
  // The fraction search's sample (fraction_search.h): the last stage 1's round trip and the
  // time since its reply; 0 (not measured) at the first step and after a pause.
  if (lastStage1End_ != Clock::time_point{}) {
    header.stage1Seconds = lastStage1Seconds_;
    header.sinceStage1Seconds = secondsBetween(lastStage1End_, stage1Start);
  }
  std::vector<at::Tensor> idx1(servers_), idx2(servers_), push1(servers_), pull1(servers_);
  for (int s = 0; s < servers_; ++s) {
    idx1[s] = indices(s, true);
    idx2[s] = indices(s, false);
    pull1[s] = at::empty({idx1[s].numel()}, at::kFloat);
    push1[s] = encodePush(header, g.index_select(0, idx1[s]));
  }
  servers().exchange(kTagPush1, push1, kTagPull1, &pull1, world_->timeout());
  lastStage1End_ = Clock::now();
  lastStage1Seconds_ = secondsBetween(stage1Start, lastStage1End_);
  for (int s = 0; s < servers_; ++s) install(idx1[s], pull1[s]);
  int64_t stage1 = 0;
  for (int s = 0; s < servers_; ++s) stage1 += idx1[s].numel();
  measure(0.0, stage1, secondsBetween(stage1Start, Clock::now()));
  fractionSum_ +=
      static_cast<double>(stage1) / static_cast<double>(std::max<int64_t>(1, layout_.total));
  ++fractionSteps_;
  // The working copy: global values where known (I_t now), LGP (or stale) values for U_t.
  at::Tensor working = global_.clone();
  if (options_.lgp) {
    for (int s = 0; s < servers_; ++s) {
      working.index_add_(0, idx2[s], g.index_select(0, idx2[s]), -lr_);
      if (lastUpdate.defined()) {
        working.index_add_(0, idx2[s], lastUpdate.index_select(0, idx2[s]),
                           options_.lgpMomentum);
      }
    }
  }
  unflattenInto(working, params_);
  // Stage 2: in the background, overlapping the next step.
  stage2Index_ = idx2;
  stage2Reply_.assign(servers_, at::Tensor());
  std::vector<at::Tensor> push2(servers_);
  for (int s = 0; s < servers_; ++s) {
    push2[s] = g.index_select(0, idx2[s]);
    stage2Reply_[s] = splitBuffer(idx2[s].numel() + splits_[s].numChunks());
  }
  int64_t stage2Elements = 0;
  for (int s = 0; s < servers_; ++s) stage2Elements += idx2[s].numel();
  stage2Timing_ = std::make_shared<Stage2Timing>();
  stage2_ = commThread_->submit(
      fmt::format("rank {}: OSP stage 2", world_->rank()),
      [this, push2, replies = stage2Reply_, timing = stage2Timing_, stage2Elements] {
        const auto start = Clock::now();
        servers().exchange(kTagPush2, push2, kTagPull2, &replies, world_->timeout());
        timing->elements = stage2Elements;
        timing->seconds = secondsBetween(start, Clock::now());
      });
  lastReturn_ = Clock::now();
}

std::map<std::string, at::Tensor> OspWorkerStrategy::saveState() {
  drainStage2();
  lastStage1End_ = lastReturn_ = {};  // a checkpoint is not step time
  // A stage-1 round whose push header says "state": each server sends worker 0 its shard's
  // optimizer state and steps nothing.
  sendToServers(PushKind::kState);
  if (workers_->rank() == 0) {
    CARAVAN_CHECK(optimizer_ != nullptr, "OSP has no optimizer");
    receiveServerStates(*world_, layout_, kOspTagState, *optimizer_, params_);
  }
  // Heavy-ball LGP's w_{t-1} (the same on every worker).
  if (previous_.defined()) return {{"osp_previous", previous_.clone()}};
  return {};
}

void OspWorkerStrategy::restoreState(const std::map<std::string, at::Tensor>& state,
                                     int64_t savedWorkers) {
  auto it = state.find("osp_previous");
  if (it != state.end()) restoredPrevious_ = it->second.to(at::kFloat).contiguous();
}

double OspWorkerStrategy::consolidate() {
  drainStage2();
  lastStage1End_ = lastReturn_ = {};  // an evaluation or a checkpoint follows: not step time
  return 0.0;
}

void OspWorkerStrategy::finish() {
  if (finished_) return;
  finished_ = true;
  drainStage2();
  sendToServers(PushKind::kGoodbye);
}

void OspWorkerStrategy::sendToServers(PushKind kind) {
  // Sized like a stage-1 push (the servers' receive buffers are), the payload zeros.
  PushHeader header;
  header.kind = kind;
  std::vector<at::Tensor> messages;
  for (int s = 0; s < servers_; ++s) {
    messages.push_back(encodePush(header, at::zeros({indices(s, true).numel()}, at::kFloat)));
  }
  servers().exchange(kTagPush1, messages, 0, nullptr, world_->timeout());
}

void runOspServer(Communicator& world, int numWorkers, const OspOptions& options,
                  const OptimizerFactory& optimizer,
                  const std::function<void(int64_t)>& stepDone) {
  ShardLayout layout;
  FlatOptimizerState state;
  const at::Tensor shard = receiveShard(world, numWorkers, &layout, &state);
  ChunkSplit split = initialSplit(shard.numel(), options);
  // One optimizer parameter per chunk, so a stage steps exactly its chunks.
  std::vector<at::Tensor> chunks;
  for (int64_t c = 0; c < split.numChunks(); ++c) {
    chunks.push_back(shard.narrow(0, split.begin(c), split.size(c)).clone().set_requires_grad(true));
  }
  auto opt = optimizer(chunks);
  scatterOptimizerState(*opt, chunks, state);
  std::vector<double> score(chunks.size(), 0.0);  // mean |averaged gradient| of the last step
  // One stage: receive every worker's values for the chosen chunks (stage 1: after the push
  // header), average in rank order, step those chunks. Returns the chunks' new values; nothing
  // when stage 1's pushes ask for something other than a gradient (`kind`).
  // auto: the fraction each split uses comes from measured step times (fraction_search.h);
  // `move` says why the next split's differs from this one's.
  double fraction = options.fraction;
  FractionSearch search(options.fraction, options.search);
  std::optional<FractionMove> move;
  auto stage = [&](bool stage1, int tag, int64_t step, double* lr,
                   PushKind* kind) -> std::vector<at::Tensor> {
    std::vector<int64_t> chosen;
    int64_t n = 0;
    for (int64_t c = 0; c < split.numChunks(); ++c) {
      if ((split.stage1[c] != 0) == stage1) {
        chosen.push_back(c);
        n += split.size(c);
      }
    }
    std::vector<at::Tensor> msgs(numWorkers), payloads(numWorkers);
    for (int k = 0; k < numWorkers; ++k)
      msgs[k] = stage1 ? pushBuffer(n) : at::empty({n}, at::kFloat);
    // Workers may be evaluating between steps (parameter_server.h): no deadline here.
    receiveFromWorkers(world, tag, msgs, kServerWait);
    for (int k = 0; k < numWorkers; ++k) payloads[k] = stage1 ? pushPayload(msgs[k]) : msgs[k];
    if (stage1) {
      const std::vector<PushHeader> round = decodeRound(msgs, world.rank(), step + 1);
      *kind = round[0].kind;
      if (*kind != PushKind::kGradient) return {};
      *lr = round[0].learningRate;  // worker 0's
      // auto: what split step - 1 cost and the largest model-based guess (the same on every
      // server) into the search, which sizes the next split.
      if (options.autoFraction) {
        double guess = 0.0;
        std::vector<double> stage1Seconds, sinceSeconds;
        for (const PushHeader& h : round) {
          if (std::isfinite(h.requestedFraction)) guess = std::max(guess, h.requestedFraction);
          stage1Seconds.push_back(h.stage1Seconds);
          sinceSeconds.push_back(h.sinceStage1Seconds);
        }
        fraction = search.observe(step, splitSeconds(stage1Seconds, sinceSeconds), guess, &move);
      }
    }
    at::Tensor sum = averagePayloads(payloads, n);
    for (auto& c : chunks) c.mutable_grad() = at::Tensor();
    int64_t at = 0;
    for (int64_t c : chosen) {
      at::Tensor g = sum.narrow(0, at, split.size(c));
      chunks[c].mutable_grad() = g;
      score[c] = g.abs().mean().item<double>();
      at += split.size(c);
    }
    setServerLearningRate(*opt, *lr);
    opt->step();
    std::vector<at::Tensor> values;
    for (int64_t c : chosen) values.push_back(chunks[c].detach());
    return values;
  };
  auto catOrEmpty = [](const std::vector<at::Tensor>& v) {
    return v.empty() ? at::empty({0}, at::kFloat) : at::cat(v);
  };
  double lr = 0.0;
  for (int64_t step = 0;;) {
    PushKind kind = PushKind::kGradient;
    const auto w1 = stage(true, kTagPush1, step, &lr, &kind);
    if (kind == PushKind::kGoodbye) return;  // every worker said goodbye
    if (kind == PushKind::kState) {          // a checkpoint
      sendOptimizerState(world, gatherOptimizerState(*opt, chunks), 0, kOspTagState);
      continue;
    }
    if (kind != PushKind::kGradient) {
      throw PeerError(fmt::format("rank {} (server): the workers sent a sync request, which OSP "
                                  "does not use; they run another version of caravan",
                                  world.rank()));
    }
    sendToWorkers(world, numWorkers, catOrEmpty(w1), kTagPull1);
    PushKind none = PushKind::kGradient;
    const auto w2 = stage(false, kTagPush2, step, &lr, &none);
    // The split for the next step, from this step's full averaged gradient.
    ChunkSplit next = split;
    std::vector<int64_t> order(chunks.size());
    std::iota(order.begin(), order.end(), 0);
    if (options.policy == "magnitude") {
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return score[a] > score[b]; });
    }
    std::fill(next.stage1.begin(), next.stage1.end(), 0);
    const int64_t k = stage1Count(split.numChunks(), fraction);
    for (int64_t i = 0; i < k; ++i) next.stage1[order[i]] = 1;
    at::Tensor flags = at::empty({next.numChunks()}, at::kFloat);
    float* f = flags.data_ptr<float>();
    for (int64_t c = 0; c < next.numChunks(); ++c) f[c] = next.stage1[c] ? 1.0f : 0.0f;
    SplitHeader header;
    header.fraction = fraction;
    header.move = std::exchange(move, std::nullopt);
    sendToWorkers(world, numWorkers, encodeSplit(header, at::cat({catOrEmpty(w2), flags})),
                  kTagPull2);
    split = next;
    ++step;
    if (stepDone) stepDone(step);
  }
}

}  // namespace caravan
