// DiLoCo and its streaming variant (see diloco.h).
#include "sync/diloco.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/communicator.h"
#include "core/errors.h"
#include "core/log.h"
#include "sync/diloco_servers.h"
#include "sync/optimizer_state.h"
#include "sync/replicas.h"

namespace caravan {

using Clock = std::chrono::steady_clock;

int64_t fragmentDue(int64_t stepsDone, int64_t period, int64_t fragments) {
  if (stepsDone <= 0) return -1;
  const int64_t phase = stepsDone % period;
  for (int64_t f = 0; f < fragments; ++f) {
    if ((f + 1) * period / fragments % period == phase) return f;
  }
  return -1;
}

std::pair<int64_t, int64_t> nextSync(int64_t stepsDone, int64_t period, int64_t fragments) {
  CARAVAN_CHECK(stepsDone >= 0 && fragments >= 1 && fragments <= period,
                "nextSync({}, {}, {}) outside its domain", stepsDone, period, fragments);
  // Within a period fragment f is due at floor((f + 1) H / F), increasing in f (F <= H), the last
  // at H (the next period's 0): the first one past this period's phase.
  const int64_t start = stepsDone - stepsDone % period, phase = stepsDone % period;
  for (int64_t f = 0;; ++f) {
    const int64_t at = (f + 1) * period / fragments;
    if (at > phase) return {start + at, f};
  }
}

std::pair<int64_t, int64_t> fragmentRange(int64_t numel, int64_t fragment, int64_t fragments) {
  return {numel * fragment / fragments, numel * (fragment + 1) / fragments};
}

at::Tensor meanOfChanges(const std::optional<QuantCodec>& codec,
                         const std::vector<at::Tensor>& messages, int64_t n) {
  at::Tensor mean = at::zeros({n}, at::kFloat);
  for (const at::Tensor& m : messages) {
    if (codec) {
      codec->addDecoded(m, mean);
    } else {
      mean.add_(m);
    }
  }
  return mean.div_(static_cast<int64_t>(messages.size()));
}

void outerNesterovStep(at::Tensor anchor, at::Tensor momentum, const at::Tensor& mean, double lr,
                       double mu) {
  if (mu > 0.0) {
    momentum.mul_(mu).add_(mean);
    anchor.sub_(mean.add(momentum, mu), lr);
  } else {
    anchor.sub_(mean, lr);
  }
}

// One fragment's exchange between launch() and complete().
struct DilocoStrategy::InFlight {
  int64_t fragment = 0;
  int64_t dueStep = 0;  // complete() after this step at the latest
  at::Tensor sent;      // the fragment's parameters when it was launched
  at::Tensor reduced;   // none: the all-reduced sum of pseudo-gradients
  at::Tensor gathered;  // int8/int4: every rank's message
  WorkPtr work;
  Clock::time_point start;
};

DilocoStrategy::DilocoStrategy(std::shared_ptr<Communicator> comm, DilocoOptions options,
                               std::shared_ptr<Communicator> world, int servers)
    : comm_(std::move(comm)), options_(options), world_(std::move(world)), servers_(servers) {
  CARAVAN_CHECK(comm_ != nullptr, "diloco needs a communicator");
  CARAVAN_CHECK(servers_ == 0 || (world_ != nullptr && options_.firstStep == 0),
                "ps-diloco needs the world's communicator and has no BSP phase");
  CARAVAN_CHECK(options_.period >= 1, "diloco period {} < 1", options_.period);
  CARAVAN_CHECK(options_.fragments >= 1 && options_.fragments <= options_.period,
                "diloco fragments {} outside [1, period {}]", options_.fragments, options_.period);
  CARAVAN_CHECK(options_.outerLr > 0.0, "diloco outer lr {} <= 0", options_.outerLr);
  CARAVAN_CHECK(options_.outerMomentum >= 0.0 && options_.outerMomentum < 1.0,
                "diloco outer momentum {} outside [0, 1)", options_.outerMomentum);
  if (isQuantized(options_.compression)) {
    codec_.emplace(options_.compression);
  } else {
    CARAVAN_CHECK(options_.compression == Compression::kNone,
                  "diloco pseudo-gradients travel as float32, int8 or int4");
  }
}

DilocoStrategy::~DilocoStrategy() = default;

std::pair<int64_t, int64_t> DilocoStrategy::range(int64_t fragment) const {
  return fragmentRange(numel_, fragment, options_.fragments);
}

void DilocoStrategy::attachModel(torch::nn::Module& model) {
  broadcastModel(*comm_, model);  // rank 0's initial parameters (and buffers) everywhere
  model_ = &model;
  params_ = syncedParameters(model);
  const at::Tensor flat = flatten(params_);
  numel_ = flat.numel();
  anchor_ = flat.clone();
  momentum_ = at::zeros({numel_}, at::kFloat);
  if (codec_) residual_ = at::zeros({numel_}, at::kFloat);
  stepsDone_ = startStep_;
  if (!restored_.empty()) restore();
  if (servers_ > 0) {
    route_ = std::make_unique<DilocoServerRoute>(world_, comm_, servers_, options_, numel_);
    route_->seed(anchor_, momentum_, serverParams_, stepsDone_);
    serverParams_ = momentum_ = at::Tensor();  // the servers keep them
  }
}

void DilocoStrategy::restore() {
  auto take = [&](const std::string& key, int64_t rows) -> std::optional<at::Tensor> {
    auto it = restored_.find(key);
    if (it == restored_.end()) return std::nullopt;
    const at::Tensor& t = it->second;
    if (t.scalar_type() != at::kFloat || t.dim() != 1 || t.numel() != rows) {
      throw CheckpointError(fmt::format(
          "the checkpoint's {} holds {} values where this model has {}: it was written for "
          "another model; start a new run directory",
          key, t.numel(), rows));
    }
    return t;
  };
  if (auto a = take("diloco_anchor", numel_)) anchor_.copy_(*a);
  if (auto m = take("diloco_momentum", numel_)) momentum_.copy_(*m);
  if (auto p = take("diloco_server_params", numel_)) {
    if (servers_ > 0 && codec_) {
      serverParams_ = p->clone();
    } else if (comm_->rank() == 0) {
      // θ_sync is ahead of θ̂ by what the quantized replies have not carried yet (rounding).
      logLine(fmt::format(
          "warning: the checkpoint's servers held θ_sync up to {:.3g} from the workers' "
          "parameters (int8/int4 replies of ps-diloco); {} continues from the workers' and "
          "drops that remainder",
          (*p - anchor_).abs().max().item<double>(), name()));
    }
  }
  const int rank = comm_->rank(), world = comm_->size();
  auto it = restored_.find("diloco_residuals");
  if (codec_ && it != restored_.end()) {
    residual_.copy_(rowForRank(it->second, rank, world, numel_));
  }
  it = restored_.find("diloco_inner_state");
  if (optimizer_ != nullptr && it != restored_.end()) {
    // [workers, rows * n + 1]: this run's optimizer must have as many rows (SGD with momentum
    // 1, AdamW 2) for this model.
    const FlatOptimizerState own = gatherOptimizerState(*optimizer_, params_);
    const int64_t width = own.rows() * numel_ + 1;
    if (own.rows() == 0 || it->second.dim() != 2 || it->second.size(1) != width) {
      throw CheckpointError(fmt::format(
          "the checkpoint's per-worker optimizer state ({}) does not fit this run's optimizer "
          "and model ({} values per worker); resume with the optimizer that wrote it, or start "
          "a new run directory",
          c10::str(it->second.sizes()), width));
    }
    const at::Tensor row = rowForRank(it->second, rank, world, width);
    FlatOptimizerState inner;
    inner.slots = row.narrow(0, 0, width - 1).view({own.rows(), numel_});
    inner.step = static_cast<int64_t>(std::lround(row[width - 1].item<double>()));
    scatterOptimizerState(*optimizer_, params_, inner);
  }
  restored_.clear();
}

void DilocoStrategy::restoreState(const std::map<std::string, at::Tensor>& state,
                                  int64_t /*savedWorkers: rowForRank sees the rows*/) {
  restored_ = state;  // attachModel() knows the parameters
}

void DilocoStrategy::rebase() {
  CARAVAN_CHECK(inFlight_ == nullptr, "diloco rebase with an exchange in flight");
  anchor_.copy_(flatten(params_));
}

void DilocoStrategy::afterStep(int64_t step) {
  stepsDone_ = step + 1;
  if (inFlight_ != nullptr && inFlight_->dueStep <= step) complete();
  const int64_t fragment =
      fragmentDue(step + 1 - options_.firstStep, options_.period, options_.fragments);
  if (fragment < 0) return;
  launch(fragment, step);
  if (options_.fragments == 1) complete();  // blocking DiLoCo
}

void DilocoStrategy::launch(int64_t fragment, int64_t step) {
  CARAVAN_CHECK(inFlight_ == nullptr, "diloco launched a fragment with another in flight");
  auto f = std::make_unique<InFlight>();
  f->fragment = fragment;
  f->dueStep = step + 1;
  f->start = Clock::now();
  const auto [begin, end] = range(fragment);
  f->sent = flatten(params_).narrow(0, begin, end - begin).clone();
  at::Tensor delta = anchor_.narrow(0, begin, end - begin) - f->sent;  // Δ = θ_sync − θ
  if (route_) {
    route_->launch(step + 1, begin, end, delta,
                   codec_ ? residual_.narrow(0, begin, end - begin) : at::Tensor());
  } else if (codec_) {
    const at::Tensor message = codec_->encode(delta, residual_.narrow(0, begin, end - begin));
    f->gathered = at::empty({comm_->size() * message.numel()}, at::kFloat);
    f->work = comm_->allgather(f->gathered, message);
  } else {
    f->reduced = delta;
    f->work = comm_->allreduce(f->reduced, ReduceOp::kSum);
  }
  inFlight_ = std::move(f);
}

void DilocoStrategy::complete() {
  std::unique_ptr<InFlight> f = std::move(inFlight_);
  const auto [begin, end] = range(f->fragment);
  const int64_t n = end - begin;
  at::Tensor anchor = anchor_.narrow(0, begin, n);
  if (route_) {
    route_->complete(anchor_);  // the servers took the outer step
  } else {
    f->work->wait(comm_->timeout());
    outerNesterovStep(anchor, momentum_.narrow(0, begin, n), meanChange(*f, n), options_.outerLr,
                      options_.outerMomentum);
  }
  // The fragment becomes θ_sync plus what this rank did since it sent (nothing when blocking).
  at::Tensor flat = flatten(params_);
  at::Tensor now = flat.narrow(0, begin, n);
  if (options_.fragments == 1) {
    now.copy_(anchor);
  } else {
    now.sub_(f->sent).add_(anchor);
  }
  unflattenInto(flat, params_);
  if (sink_) sink_(fmt::format("outer sync of fragment {}", f->fragment), f->start, Clock::now());
}

at::Tensor DilocoStrategy::meanChange(const InFlight& f, int64_t n) const {
  if (!codec_) return f.reduced.div_(comm_->size());  // the all-reduced sum
  std::vector<at::Tensor> messages;
  const int64_t words = f.gathered.numel() / comm_->size();
  for (int r = 0; r < comm_->size(); ++r)
    messages.push_back(f.gathered.narrow(0, r * words, words));
  return meanOfChanges(codec_, messages, n);
}

void DilocoStrategy::finish() {
  if (!route_ || finished_) return;
  if (inFlight_ != nullptr) complete();
  const auto [round, fragment] = nextSync(stepsDone_, options_.period, options_.fragments);
  const auto [begin, end] = range(fragment);
  route_->goodbye(round, begin, end);
  finished_ = true;
}

double DilocoStrategy::consolidate() {
  if (inFlight_ != nullptr) complete();
  return averageReplicas(*comm_, *model_);  // parameters and floating-point buffers
}

std::map<std::string, at::Tensor> DilocoStrategy::saveState() {
  std::map<std::string, at::Tensor> state = {{"diloco_anchor", anchor_.clone()}};
  if (route_) {  // the outer momentum (and θ_sync, when the replies are quantized) is theirs
    const auto [round, fragment] = nextSync(stepsDone_, options_.period, options_.fragments);
    const auto [begin, end] = range(fragment);
    at::Tensor momentum, serverParams;
    route_->fetchState(round, begin, end, &momentum, &serverParams);
    if (momentum.defined()) state["diloco_momentum"] = momentum;
    if (serverParams.defined()) state["diloco_server_params"] = serverParams;
  } else {
    state["diloco_momentum"] = momentum_.clone();
  }
  if (codec_) state["diloco_residuals"] = gatherRows(*comm_, residual_);
  if (optimizer_ == nullptr) return state;
  // Every worker's inner optimizer state, as one row each: its slots, then its step count.
  // The ranks first agree that every one has state of one shape (none before the first step; a
  // parameter that never got a gradient has none, which gatherOptimizerState refuses; a worker
  // that skipped non-finite steps may have none yet), so the gather is entered by all or none.
  FlatOptimizerState inner;
  int64_t rows = -1;  // -1: this rank cannot say
  try {
    inner = gatherOptimizerState(*optimizer_, params_);
    rows = inner.rows();
  } catch (const Error&) {
  }
  at::Tensor agree =
      at::tensor({static_cast<double>(rows), -static_cast<double>(rows)}, at::kDouble);
  comm_->allreduce(agree, ReduceOp::kMax)->wait(comm_->timeout());
  const double most = agree[0].item<double>(), least = -agree[1].item<double>();
  if (most == least && least >= 1) {
    const at::Tensor row =
        at::cat({inner.slots.reshape({-1}), at::tensor({static_cast<float>(inner.step)})});
    state["diloco_inner_state"] = gatherRows(*comm_, row);
  } else if (most > 0) {
    if (comm_->rank() == 0) {
      logLine(fmt::format(
          "warning: the workers' inner optimizer states differ in shape ({} to {} rows; a "
          "parameter without gradients has none): the checkpoint holds worker 0's only, and a "
          "resumed run starts every worker from it",
          least, most));
    }
  }
  return state;
}

}  // namespace caravan
