// Optimizer state laid end to end (see optimizer_state.h).
#include "sync/optimizer_state.h"

#include <memory>

#include <torch/torch.h>

#include "core/errors.h"
#include "optim/fused.h"

namespace caravan {
namespace {

// The state tensors of one parameter, in slot order (empty: none), and AdamW's step.
std::vector<at::Tensor> slotsOf(torch::optim::Optimizer& optimizer, const at::Tensor& p,
                                int64_t* step) {
  auto& all = optimizer.state();
  auto it = all.find(optimizerStateKey(p));
  if (it == all.end()) return {};
  if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
    if (!s->momentum_buffer().defined()) return {};
    return {s->momentum_buffer()};
  }
  if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
    *step = a->step();
    return {a->exp_avg(), a->exp_avg_sq()};
  }
  CARAVAN_CHECK(false, "optimizer state of an unsupported optimizer");
  return {};
}

}  // namespace

FlatOptimizerState FlatOptimizerState::narrow(int64_t begin, int64_t n) const {
  FlatOptimizerState s;
  s.step = step;
  if (rows() > 0) s.slots = slots.narrow(1, begin, n).contiguous();
  return s;
}

FlatOptimizerState gatherOptimizerState(torch::optim::Optimizer& optimizer,
                                        const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  FlatOptimizerState out;
  std::vector<std::vector<at::Tensor>> perParam;
  size_t rows = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    int64_t step = 0;
    perParam.push_back(slotsOf(optimizer, params[i], &step));
    if (i == 0) {
      rows = perParam.back().size();
      out.step = step;
    }
    CARAVAN_CHECK(perParam.back().size() == rows && step == out.step,
                  "parameters {} and 0 are in different optimizer states", i);
  }
  if (rows == 0) return out;
  out.slots = at::empty({static_cast<int64_t>(rows), n}, at::kFloat);
  int64_t at = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t m = params[i].numel();
    for (size_t r = 0; r < rows; ++r) {
      out.slots[static_cast<int64_t>(r)].narrow(0, at, m).copy_(perParam[i][r].reshape({m}));
    }
    at += m;
  }
  return out;
}

void scatterOptimizerState(torch::optim::Optimizer& optimizer,
                           const std::vector<at::Tensor>& params,
                           const FlatOptimizerState& state) {
  const bool sgd = dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr;
  const bool adamw = dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr;
  CARAVAN_CHECK(sgd || adamw, "optimizer state of an unsupported optimizer");
  const int64_t rows = state.rows();
  CARAVAN_CHECK(rows == 0 || rows == (sgd ? 1 : 2), "{} rows of optimizer state for {}", rows,
                sgd ? "SGD" : "AdamW");
  auto& all = optimizer.state();
  int64_t at = 0;
  for (const auto& p : params) {
    const int64_t m = p.numel();
    all.erase(optimizerStateKey(p));
    if (rows > 0) {
      auto slot = [&](int64_t r) {
        return state.slots[r].narrow(0, at, m).reshape(p.sizes()).to(p.scalar_type()).clone();
      };
      if (sgd) {
        auto s = std::make_unique<torch::optim::SGDParamState>();
        s->momentum_buffer(slot(0));
        all[optimizerStateKey(p)] = std::move(s);
      } else {
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->step(state.step);
        s->exp_avg(slot(0));
        s->exp_avg_sq(slot(1));
        all[optimizerStateKey(p)] = std::move(s);
      }
    }
    at += m;
  }
  CARAVAN_CHECK(rows == 0 || at == state.slots.size(1), "optimizer state of {} elements for {}",
                state.slots.size(1), at);
}

void sendOptimizerState(Communicator& comm, const FlatOptimizerState& state, int dst, int tag) {
  at::Tensor head = at::tensor({state.rows(), state.step}, at::kLong);
  comm.send(head, dst, tag)->wait(comm.timeout());
  if (state.rows() > 0) comm.send(state.slots, dst, tag)->wait(comm.timeout());
}

FlatOptimizerState recvOptimizerState(Communicator& comm, int64_t n, int src, int tag,
                                      std::chrono::milliseconds timeout) {
  at::Tensor head = at::empty({2}, at::kLong);
  comm.recv(head, src, tag)->wait(timeout);
  FlatOptimizerState state;
  const int64_t rows = head[0].item<int64_t>();
  state.step = head[1].item<int64_t>();
  if (rows < 0 || rows > 2 || state.step < 0) {
    throw PeerError(fmt::format("rank {} sent optimizer state with {} rows and step {}; it runs "
                                "another version of caravan or is not part of this job",
                                src, rows, state.step));
  }
  if (rows > 0) {
    state.slots = at::empty({rows, n}, at::kFloat);
    comm.recv(state.slots, src, tag)->wait(timeout);
  }
  return state;
}

}  // namespace caravan
