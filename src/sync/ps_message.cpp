// Parameter-server message headers and group round trips (see ps_message.h).
#include "sync/ps_message.h"

#include <cmath>
#include <cstring>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "core/errors.h"

namespace caravan {
namespace {

constexpr uint32_t kPushMagic = 0x43525651;  // "QVRC": a Caravan push, this layout
constexpr uint32_t kPullMagic = 0x43524c50;  // "PLRC"
constexpr uint32_t kSplitMagic = 0x43525053;  // "SPRC"

static_assert(PushHeader::kWords * sizeof(float) ==
              2 * sizeof(uint32_t) + 4 * sizeof(double) + sizeof(int64_t));
static_assert(PullHeader::kWords * sizeof(float) == 2 * sizeof(uint32_t) + sizeof(int64_t));
static_assert(SplitHeader::kWords * sizeof(float) ==
              2 * sizeof(uint32_t) + sizeof(int64_t) + 5 * sizeof(double));

template <typename T>
void put(uint8_t*& at, T value) {
  std::memcpy(at, &value, sizeof(T));
  at += sizeof(T);
}

template <typename T>
T take(const uint8_t*& at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  at += sizeof(T);
  return value;
}

at::Tensor withHeader(int64_t headerWords, const at::Tensor& payload) {
  at::Tensor message = at::empty({headerWords + payload.numel()}, at::kFloat);
  if (payload.numel() > 0) {
    message.narrow(0, headerWords, payload.numel()).copy_(payload.reshape({-1}));
  }
  return message;
}

uint8_t* headerBytes(at::Tensor& message) { return static_cast<uint8_t*>(message.data_ptr()); }

const uint8_t* headerBytes(const at::Tensor& message, int64_t words, const char* what) {
  CARAVAN_CHECK(
      message.scalar_type() == at::kFloat && message.is_contiguous() && message.numel() >= words,
      "a {} buffer of {} elements", what, message.numel());
  return static_cast<const uint8_t*>(message.data_ptr());
}

// A server's reply (`what`) this worker cannot read.
PeerError unreadableReply(int serverRank, const char* what) {
  return PeerError(
      fmt::format("rank {} (a server) sent {} this worker cannot read; it runs "
                  "another version of caravan or is not part of this job",
                  serverRank, what));
}

const char* kindName(PushKind kind) {
  switch (kind) {
    case PushKind::kGradient: return "gradient";
    case PushKind::kGoodbye: return "goodbye";
    case PushKind::kSync: return "sync";
    case PushKind::kState: return "checkpoint";
  }
  return "?";
}

}  // namespace

at::Tensor encodePush(const PushHeader& header, const at::Tensor& payload) {
  at::Tensor message = withHeader(PushHeader::kWords, payload);
  uint8_t* at = headerBytes(message);
  put(at, kPushMagic);
  put(at, static_cast<uint32_t>(header.kind));
  put(at, header.learningRate);
  put(at, header.requestedFraction);
  put(at, header.stage1Seconds);
  put(at, header.sinceStage1Seconds);
  put(at, header.round);
  return message;
}

at::Tensor encodePull(const PullHeader& header, const at::Tensor& payload) {
  at::Tensor message = withHeader(PullHeader::kWords, payload);
  uint8_t* at = headerBytes(message);
  put(at, kPullMagic);
  put(at, uint32_t{0});
  put(at, header.staleness);
  return message;
}

at::Tensor encodeSplit(const SplitHeader& header, const at::Tensor& payload) {
  at::Tensor message = withHeader(SplitHeader::kWords, payload);
  uint8_t* at = headerBytes(message);
  const FractionMove m = header.move.value_or(FractionMove{});
  put(at, kSplitMagic);
  put(at, header.move ? static_cast<uint32_t>(m.reason) : uint32_t{0});
  put(at, header.fraction);
  put(at, m.step);
  put(at, m.from);
  put(at, m.centre);
  put(at, m.centreSeconds);
  put(at, m.probeSeconds);
  return message;
}

at::Tensor pushBuffer(int64_t payloadWords) {
  return at::empty({PushHeader::kWords + payloadWords}, at::kFloat);
}

at::Tensor pullBuffer(int64_t payloadWords) {
  return at::empty({PullHeader::kWords + payloadWords}, at::kFloat);
}

at::Tensor splitBuffer(int64_t payloadWords) {
  return at::empty({SplitHeader::kWords + payloadWords}, at::kFloat);
}

at::Tensor pushPayload(const at::Tensor& message) {
  return message.narrow(0, PushHeader::kWords, message.numel() - PushHeader::kWords);
}

at::Tensor pullPayload(const at::Tensor& message) {
  return message.narrow(0, PullHeader::kWords, message.numel() - PullHeader::kWords);
}

at::Tensor splitPayload(const at::Tensor& message) {
  return message.narrow(0, SplitHeader::kWords, message.numel() - SplitHeader::kWords);
}

PushHeader decodePush(const at::Tensor& message, int worker, int serverRank) {
  const uint8_t* at = headerBytes(message, PushHeader::kWords, "push");
  const auto foreign = [&](const std::string& what) {
    return PeerError(
        fmt::format("rank {} (server): worker {} sent {}; it runs another version "
                    "of caravan or is not part of this job",
                    serverRank, worker, what));
  };
  const auto magic = take<uint32_t>(at);
  if (magic != kPushMagic)
    throw foreign(fmt::format("a message that is no push (0x{:08x})", magic));
  const auto kind = take<uint32_t>(at);
  if (kind > static_cast<uint32_t>(PushKind::kState)) {
    throw foreign(fmt::format("a message of unknown kind {}", kind));
  }
  PushHeader h;
  h.kind = static_cast<PushKind>(kind);
  h.learningRate = take<double>(at);
  h.requestedFraction = take<double>(at);
  h.stage1Seconds = take<double>(at);
  h.sinceStage1Seconds = take<double>(at);
  h.round = take<int64_t>(at);
  if (!std::isfinite(h.learningRate) || h.learningRate < 0.0) {
    throw foreign(fmt::format("learning rate {}", h.learningRate));
  }
  return h;
}

PullHeader decodePull(const at::Tensor& message, int serverRank) {
  const uint8_t* at = headerBytes(message, PullHeader::kWords, "pull");
  const auto magic = take<uint32_t>(at);
  take<uint32_t>(at);
  PullHeader h;
  h.staleness = take<int64_t>(at);
  if (magic != kPullMagic || h.staleness < 0) throw unreadableReply(serverRank, "a reply");
  return h;
}

SplitHeader decodeSplit(const at::Tensor& message, int serverRank) {
  const uint8_t* at = headerBytes(message, SplitHeader::kWords, "split");
  const auto magic = take<uint32_t>(at);
  const auto reason = take<uint32_t>(at);
  SplitHeader h;
  h.fraction = take<double>(at);
  FractionMove m;
  m.step = take<int64_t>(at);
  m.from = take<double>(at);
  m.centre = take<double>(at);
  m.centreSeconds = take<double>(at);
  m.probeSeconds = take<double>(at);
  m.to = h.fraction;
  const bool known = reason <= static_cast<uint32_t>(FractionReason::kOriginFaster);
  if (magic != kSplitMagic || !known || !(h.fraction > 0.0 && h.fraction <= 1.0)) {
    throw unreadableReply(serverRank, "an OSP split");
  }
  if (reason != 0) {
    m.reason = static_cast<FractionReason>(reason);
    h.move = m;
  }
  return h;
}

std::vector<PushHeader> decodeRound(const std::vector<at::Tensor>& messages, int serverRank,
                                    int64_t step) {
  CARAVAN_CHECK(!messages.empty(), "a round without workers");
  std::vector<PushHeader> headers;
  for (size_t k = 0; k < messages.size(); ++k) {
    headers.push_back(decodePush(messages[k], static_cast<int>(k), serverRank));
    if (headers[k].kind != headers[0].kind) {
      throw PeerError(
          fmt::format("rank {} (server): at step {} worker 0 sent a {} push and "
                      "worker {} a {} push; the workers disagree about the step",
                      serverRank, step, kindName(headers[0].kind), k, kindName(headers[k].kind)));
    }
  }
  return headers;
}

at::Tensor averagePayloads(const std::vector<at::Tensor>& payloads, int64_t n) {
  at::Tensor sum = payloads[0].narrow(0, 0, n).clone();
  for (size_t k = 1; k < payloads.size(); ++k) sum.add_(payloads[k].narrow(0, 0, n));
  return sum.mul_(1.0 / static_cast<double>(payloads.size()));
}

void ServerGroup::exchange(int tag, const std::vector<at::Tensor>& messages, int replyTag,
                           const std::vector<at::Tensor>* replies,
                           std::chrono::milliseconds timeout) const {
  CARAVAN_CHECK_EQ(messages.size(), static_cast<size_t>(count_), "one message per server");
  std::vector<WorkPtr> work;
  if (replies != nullptr) {
    CARAVAN_CHECK_EQ(replies->size(), static_cast<size_t>(count_), "one reply per server");
    for (int s = 0; s < count_; ++s) work.push_back(world_->recv((*replies)[s], rank(s), replyTag));
  }
  for (int s = 0; s < count_; ++s) work.push_back(world_->send(messages[s], rank(s), tag));
  for (auto& w : work) w->wait(timeout);
}

void receiveFromWorkers(Communicator& world, int tag, std::vector<at::Tensor>& messages,
                        std::chrono::milliseconds timeout) {
  std::vector<WorkPtr> work;
  for (size_t k = 0; k < messages.size(); ++k) {
    work.push_back(world.recv(messages[k], static_cast<int>(k), tag));
  }
  for (auto& w : work) w->wait(timeout);
}

void sendToWorkers(Communicator& world, int workers, const at::Tensor& message, int tag) {
  std::vector<WorkPtr> work;
  for (int k = 0; k < workers; ++k) work.push_back(world.send(message, k, tag));
  for (auto& w : work) w->wait(world.timeout());
}

}  // namespace caravan
