// DiLoCo through parameter servers (see diloco_servers.h).
#include "sync/diloco_servers.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "core/errors.h"
#include "sync/optimizer_state.h"
#include "sync/ps_message.h"

namespace caravan {
namespace {

constexpr int kTagPush = 21;   // worker -> server: PushHeader, pseudo-gradient piece
constexpr int kTagPull = 22;   // server -> worker: PullHeader, θ̂ piece (values or a message)
constexpr int kTagState = 23;  // server -> worker 0: momentum (and θ_sync) of its shard

// Where [begin, end) of the flat vector meets server s's shard: [first, second), or {begin,
// begin} when they do not meet.
std::pair<int64_t, int64_t> piece(const ShardLayout& layout, int s, int64_t begin, int64_t end) {
  const int64_t b = std::max(begin, layout.begin(s));
  const int64_t e = std::min(end, layout.end(s));
  if (e <= b) return {begin, begin};
  return {b, e};
}

// The words a piece of n values takes on the wire.
int64_t pieceWords(const std::optional<QuantCodec>& codec, int64_t n) {
  return codec ? codec->words(n) : n;
}

}  // namespace

struct DilocoServerRoute::Round {
  int64_t begin = 0, end = 0;
  std::vector<at::Tensor> pushes, pulls;
  std::vector<WorkPtr> work;
};

DilocoServerRoute::DilocoServerRoute(std::shared_ptr<Communicator> world,
                                     std::shared_ptr<Communicator> workers, int servers,
                                     const DilocoOptions& options, int64_t numel)
    : world_(std::move(world)), workers_(std::move(workers)) {
  CARAVAN_CHECK(world_ && workers_, "ps-diloco needs both communicators");
  CARAVAN_CHECK(servers >= 1 && workers_->size() + servers == world_->size(),
                "{} workers + {} servers in a world of {}", workers_->size(), servers,
                world_->size());
  layout_.total = numel;
  layout_.servers = servers;
  if (isQuantized(options.compression)) codec_.emplace(options.compression);
}

DilocoServerRoute::~DilocoServerRoute() = default;

void DilocoServerRoute::seed(const at::Tensor& anchor, const at::Tensor& momentum,
                             const at::Tensor& serverParams, int64_t stepsDone) {
  // The servers' state as rows over the flat vector: [momentum] or [momentum, θ_sync].
  if (workers_->rank() != 0) return;  // only worker 0 seeds
  FlatOptimizerState state;
  state.step = stepsDone;
  state.slots = codec_ ? at::stack({momentum, serverParams.defined() ? serverParams : anchor})
                       : momentum.unsqueeze(0);
  seedServers(*world_, *workers_, anchor, state, layout_);
}

std::vector<at::Tensor> DilocoServerRoute::pushes(int64_t round, int64_t begin, int64_t end,
                                                  PushKind kind, const at::Tensor& delta,
                                                  const at::Tensor& residual) {
  std::vector<at::Tensor> out;
  PushHeader header;
  header.kind = kind;
  header.round = round;
  for (int s = 0; s < layout_.servers; ++s) {
    const auto [b, e] = piece(layout_, s, begin, end);
    at::Tensor payload;
    if (kind != PushKind::kGradient) {
      payload = at::zeros({pieceWords(codec_, e - b)}, at::kFloat);
    } else if (codec_) {
      payload = codec_->encode(delta.narrow(0, b - begin, e - b).contiguous(),
                               residual.narrow(0, b - begin, e - b));
    } else {
      payload = delta.narrow(0, b - begin, e - b);
    }
    out.push_back(encodePush(header, payload));
  }
  return out;
}

void DilocoServerRoute::launch(int64_t round, int64_t begin, int64_t end, const at::Tensor& delta,
                               const at::Tensor& residual) {
  CARAVAN_CHECK(round_ == nullptr, "ps-diloco launched a round with another in flight");
  auto r = std::make_unique<Round>();
  r->begin = begin;
  r->end = end;
  r->pushes = pushes(round, begin, end, PushKind::kGradient, delta, residual);
  const ServerGroup servers(world_.get(), layout_.servers);
  for (int s = 0; s < layout_.servers; ++s) {
    const auto [b, e] = piece(layout_, s, begin, end);
    r->pulls.push_back(pullBuffer(pieceWords(codec_, e - b)));
    r->work.push_back(world_->recv(r->pulls[s], servers.rank(s), kTagPull));
  }
  for (int s = 0; s < layout_.servers; ++s) {
    r->work.push_back(world_->send(r->pushes[s], servers.rank(s), kTagPush));
  }
  round_ = std::move(r);
}

void DilocoServerRoute::complete(at::Tensor anchor) {
  CARAVAN_CHECK(round_ != nullptr, "ps-diloco completed a round it did not launch");
  std::unique_ptr<Round> r = std::move(round_);
  for (auto& w : r->work) w->wait(world_->timeout());
  const ServerGroup servers(world_.get(), layout_.servers);
  for (int s = 0; s < layout_.servers; ++s) {
    decodePull(r->pulls[s], servers.rank(s));  // PeerError when it is not one
    const auto [b, e] = piece(layout_, s, r->begin, r->end);
    at::Tensor mine = anchor.narrow(0, b, e - b);
    const at::Tensor payload = pullPayload(r->pulls[s]);
    if (codec_) {
      codec_->addDecoded(payload, mine);
    } else {
      mine.copy_(payload);
    }
  }
}

void DilocoServerRoute::fetchState(int64_t round, int64_t begin, int64_t end, at::Tensor* momentum,
                                   at::Tensor* serverParams) {
  CARAVAN_CHECK(round_ == nullptr, "ps-diloco checkpoint with a round in flight");
  const ServerGroup servers(world_.get(), layout_.servers);
  servers.exchange(kTagPush, pushes(round, begin, end, PushKind::kState, {}, {}), 0, nullptr,
                   world_->timeout());
  if (workers_->rank() != 0) return;
  std::vector<at::Tensor> m, p;
  for (int s = 0; s < layout_.servers; ++s) {
    FlatOptimizerState part =
        recvOptimizerState(*world_, layout_.size(s), servers.rank(s), kTagState, world_->timeout());
    if (part.rows() != (codec_ ? 2 : 1)) {
      throw PeerError(fmt::format("server rank {} sent {} rows of state where ps-diloco keeps {}",
                                  servers.rank(s), part.rows(), codec_ ? 2 : 1));
    }
    m.push_back(part.slots[0]);
    if (codec_) p.push_back(part.slots[1]);
  }
  *momentum = at::cat(m);
  *serverParams = codec_ ? at::cat(p) : at::Tensor();
}

void DilocoServerRoute::goodbye(int64_t round, int64_t begin, int64_t end) {
  CARAVAN_CHECK(round_ == nullptr, "ps-diloco goodbye with a round in flight");
  const ServerGroup servers(world_.get(), layout_.servers);
  servers.exchange(kTagPush, pushes(round, begin, end, PushKind::kGoodbye, {}, {}), 0, nullptr,
                   world_->timeout());
}

void runDilocoServer(Communicator& world, int numWorkers, const DilocoOptions& options,
                     const std::function<void(int64_t)>& stepDone) {
  ShardLayout layout;
  FlatOptimizerState state;
  // θ̂ (what the workers hold), and the state rows [momentum] or [momentum, θ_sync].
  at::Tensor hat = receiveShard(world, numWorkers, &layout, &state);
  const int s = world.rank() - numWorkers;
  std::optional<QuantCodec> codec;
  if (isQuantized(options.compression)) codec.emplace(options.compression);
  // Worker 0 always seeds both rows, or the momentum alone in float32 (θ_sync = θ̂).
  if (state.rows() != (codec ? 2 : 1)) {
    throw PeerError(
        fmt::format("rank {} (server): worker 0 seeded {} rows of state where "
                    "ps-diloco keeps {}; it runs another version of caravan",
                    world.rank(), state.rows(), codec ? 2 : 1));
  }
  at::Tensor momentum = state.slots[0].clone();
  at::Tensor theta = codec ? state.slots[1].clone() : hat;
  int64_t stepsDone = state.step;
  std::vector<at::Tensor> pushes(numWorkers);
  for (;;) {
    const auto [t, fragment] = nextSync(stepsDone, options.period, options.fragments);
    const auto [fb, fe] = fragmentRange(layout.total, fragment, options.fragments);
    const auto [b, e] = piece(layout, s, fb, fe);
    const int64_t len = e - b, begin = len > 0 ? b - layout.begin(s) : 0;
    for (auto& p : pushes) p = pushBuffer(pieceWords(codec, len));
    receiveFromWorkers(world, kTagPush, pushes, kServerWait);
    const std::vector<PushHeader> round = decodeRound(pushes, world.rank(), t);
    for (int k = 0; k < numWorkers; ++k) {
      if (round[k].round != t) {
        throw PeerError(fmt::format(
            "rank {} (server): worker {} sent the ps-diloco round of step {} where this server's "
            "schedule has step {} next; the workers and servers disagree about the steps done",
            world.rank(), k, round[k].round, t));
      }
    }
    const PushKind kind = round[0].kind;
    if (kind == PushKind::kGoodbye) return;
    if (kind == PushKind::kState) {
      FlatOptimizerState out;
      out.step = stepsDone;
      out.slots = codec ? at::stack({momentum, theta}) : momentum.unsqueeze(0);
      sendOptimizerState(world, out, 0, kTagState);
      continue;
    }
    if (kind != PushKind::kGradient) {
      throw PeerError(
          fmt::format("rank {} (server): the workers sent a push ps-diloco does not "
                      "know; they run another version of caravan",
                      world.rank()));
    }
    // The mean pseudo-gradient, summed in rank order, then the outer step on θ_sync.
    std::vector<at::Tensor> payloads;
    for (const at::Tensor& p : pushes) payloads.push_back(pushPayload(p));
    const at::Tensor mean = meanOfChanges(codec, payloads, len);
    at::Tensor thetaPiece = theta.narrow(0, begin, len);
    outerNesterovStep(thetaPiece, momentum.narrow(0, begin, len), mean, options.outerLr,
                      options.outerMomentum);
    at::Tensor reply;
    if (codec) {
      // θ̂ moves towards θ_sync by what one message carries; the workers add the same.
      at::Tensor hatPiece = hat.narrow(0, begin, len);
      at::Tensor gap = thetaPiece - hatPiece;
      reply = codec->encode(gap, at::zeros_like(gap));
      codec->addDecoded(reply, hatPiece);
    } else {
      reply = thetaPiece;
    }
    sendToWorkers(world, numWorkers, encodePull(PullHeader{}, reply), kTagPull);
    stepsDone = t;
    if (stepDone) stepDone(t);
  }
}

}  // namespace caravan
