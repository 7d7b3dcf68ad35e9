// DiLoCo (sync.mode = "diloco", ALGORITHMS.md §1.6): every worker takes H = `period` steps of
// the run's own optimizer (the inner optimizer, whose state stays on the worker), then the
// workers exchange their pseudo-gradients Δ_r = θ_sync − θ_r and an outer optimizer (SGD with
// Nesterov momentum `outerMomentum`, learning rate `outerLr`) applies the mean to the shared
// parameters θ_sync, which every worker then continues from.
//
// Streaming (fragments F > 1): the flat parameter vector is cut into F equal fragments;
// fragment f syncs when t, the steps done, is positive and t ≡ floor((f + 1) H / F) (mod H)
// (fragmentDue below; the first time at t = floor((f + 1) H / F)), so fragments go in order
// 0, 1, ... F-1, each every H steps, one at a time. Its exchange is launched after step t and
// applied after step t + 1 (it overlaps one inner step): θ_f ← θ_f^sync + (θ_f^now − θ_f^sent),
// keeping the local progress made meanwhile (mixing factor 1; ours). F = 1 is blocking DiLoCo: the
// exchange is applied right after the step that launched it.
//
// Compression (none | int8 | int4, compression.h): int8/int4 pseudo-gradients travel block-
// scaled with error feedback (every worker's residual), gathered from every rank and summed in
// rank order; none: a float32 all-reduce.
//
// Consistency: θ_sync, the outer momentum and (with compression) the sum are the same on every
// rank; a fragment's parameters are equal on every rank right after a blocking sync, and differ
// by each rank's one overlapped step after a streaming one. With H = 1, outer lr 1, no outer
// momentum and a linear inner optimizer (SGD with momentum) the mean of θ_r is what BSP
// all-reduce computes, up to float rounding.
//
// Checkpoints (saveState, after consolidate(): in-flight exchange applied, replicas averaged):
// θ_sync, the outer momentum, every rank's residual and every rank's inner optimizer state, so a
// resumed run on the same workers continues exactly; on another number of workers the residuals
// and the inner state are the mean of the saved ranks' (replicas.h rowForRank).
//
// Floating-point buffers (batch-norm statistics) are not exchanged at syncs: consolidate()
// averages them with the parameters, before every evaluation and checkpoint.
//
// Bytes: none sends a float32 ring all-reduce (2 (W-1)/W x 4 bytes per element per sync);
// int8/int4 gather every rank's message, (W-1) x 1 or 0.5 bytes per element: less than float32
// below 8 (int8) or 16 (int4) workers, more above.
//
// Through parameter servers (sync.mode = ps-diloco): the same schedule, fragments and
// compression, but the servers hold θ_sync and the outer momentum and take the outer step
// (diloco_servers.h); workers keep θ̂, the parameters the servers last replied with (θ_sync
// itself in float32), and a checkpoint fetches the momentum (and θ_sync) from the servers.
//
// Threading: trainer thread; the exchange runs on the communicator's own thread. lockstep() is
// false when fragments stream: the trainer's per-step agreement would queue behind an
// overlapped exchange.
#pragma once

#include <memory>
#include <optional>
#include <utility>

#include "sync/compression.h"
#include "sync/strategy.h"
#include "sync/sync_mode.h"

namespace caravan {

struct DilocoOptions {
  int64_t period = 4;          // H: inner steps between a fragment's syncs, >= 1
  double outerLr = 0.7;        // > 0
  double outerMomentum = 0.9;  // Nesterov, in [0, 1); 0: plain outer SGD
  int64_t fragments = 1;       // F in [1, H]: > 1 streams fragments, each overlapping a step
  Compression compression = Compression::kNone;  // none | int8 | int4
  int64_t firstStep = 0;  // steps before this one are not counted (local-sgd's BSP phase)
};

// Which fragment syncs when `stepsDone` steps are done (-1: none), for H = period, F =
// fragments: f with stepsDone > 0 and stepsDone ≡ floor((f + 1) H / F) (mod H).
int64_t fragmentDue(int64_t stepsDone, int64_t period, int64_t fragments);
// The next sync after `stepsDone` (>= 0) steps: {t, f}, the smallest t > stepsDone at which
// fragment f is due.
std::pair<int64_t, int64_t> nextSync(int64_t stepsDone, int64_t period, int64_t fragments);
// [begin, end) of fragment f of `fragments` in a flat vector of `numel` values.
std::pair<int64_t, int64_t> fragmentRange(int64_t numel, int64_t fragment, int64_t fragments);
// The mean pseudo-gradient of n values from every worker's message, summed in rank order, then
// divided by their number: int8/int4 messages through `codec`, float32 values without one.
// (Among the workers the gathered messages, on a ps-diloco server the pushes' pieces.)
at::Tensor meanOfChanges(const std::optional<QuantCodec>& codec,
                         const std::vector<at::Tensor>& messages, int64_t n);
// The outer step, SGD with Nesterov momentum as torch.optim.SGD: m = μ m + Δ;
// θ_sync -= lr (Δ + μ m) (μ = 0: θ_sync -= lr Δ, m untouched). In place on `anchor` and
// `momentum` (views allowed); `mean` is the mean pseudo-gradient Δ.
void outerNesterovStep(at::Tensor anchor, at::Tensor momentum, const at::Tensor& mean, double lr,
                       double mu);

class Communicator;
class DilocoServerRoute;

class DilocoStrategy : public Strategy {
 public:
  // Among the workers of `comm`; or, with `world` and `servers` >= 1 (sync.mode = ps-diloco),
  // through the servers that close `world` (diloco_servers.h), `comm` being the workers' group.
  DilocoStrategy(std::shared_ptr<Communicator> comm, DilocoOptions options,
                 std::shared_ptr<Communicator> world = nullptr, int servers = 0);
  ~DilocoStrategy() override;
  // The outer step moves the parameters too: its rate is as likely a cause.
  std::string rateKeys() const override { return "sync.outer_lr or optim.lr"; }
  std::string name() const override {
    return syncModeName(servers_ > 0 ? SyncMode::kPsDiloco : SyncMode::kDiloco);
  }
  void finishGradients() override {}  // the inner optimizer applies the local gradient
  void afterStep(int64_t step) override;
  double consolidate() override;
  // Blocking DiLoCo leaves nothing in flight between steps; a streamed fragment's exchange
  // would hold the trainer's per-step agreement back (it queues behind it).
  bool lockstep() const override { return options_.fragments == 1; }
  std::map<std::string, at::Tensor> saveState() override;
  // ps-diloco: goodbye to the servers (after the final checkpoint's saveState).
  void finish() override;
  // θ_sync := the current parameters (every rank's equal): local-sgd at the end of its BSP
  // phase. Only between exchanges.
  void rebase();

 protected:
  void attachModel(torch::nn::Module& model) override;
  void restoreState(const std::map<std::string, at::Tensor>& state, int64_t savedWorkers) override;

 private:
  struct InFlight;
  void launch(int64_t fragment, int64_t step);
  void complete();
  // Among the workers: the mean pseudo-gradient of the exchange `f` of n values, once done.
  at::Tensor meanChange(const InFlight& f, int64_t n) const;
  // The checkpoint's state (restored_) into anchor_, momentum_, residual_, the optimizer.
  void restore();
  // [begin, end) of fragment f in the flat parameter vector.
  std::pair<int64_t, int64_t> range(int64_t fragment) const;

  std::shared_ptr<Communicator> comm_;
  DilocoOptions options_;
  std::shared_ptr<Communicator> world_;  // ps-diloco: workers then servers
  int servers_ = 0;
  std::unique_ptr<DilocoServerRoute> route_;  // ps-diloco, from attachModel()
  int64_t stepsDone_ = 0;                     // the schedule's clock (AttachContext::startStep)
  bool finished_ = false;
  std::optional<QuantCodec> codec_;
  torch::nn::Module* model_ = nullptr;
  std::vector<at::Tensor> params_;
  int64_t numel_ = 0;
  at::Tensor anchor_;        // θ_sync, flat (ps-diloco: θ̂, the servers' last reply)
  at::Tensor momentum_;      // the outer momentum, flat (ps-diloco: the servers', undefined here)
  at::Tensor serverParams_;  // ps-diloco int8/int4: a checkpoint's θ_sync, until seeded
  at::Tensor residual_;      // error feedback (compressed only), flat
  std::unique_ptr<InFlight> inFlight_;
  std::map<std::string, at::Tensor> restored_;  // a checkpoint's, until attachModel()
};

}  // namespace caravan
