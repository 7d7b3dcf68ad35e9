// Replica operations (see replicas.h).
#include "sync/replicas.h"

#include <cmath>

#include <fmt/format.h>
#include <torch/torch.h>

#include "core/errors.h"

namespace caravan {

std::vector<at::Tensor> syncedParameters(torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  for (auto& p : model.parameters()) {
    if (!p.requires_grad()) continue;
    CARAVAN_CHECK(p.scalar_type() == at::kFloat, "strategies synchronize float32 parameters");
    out.push_back(p);
  }
  return out;
}

at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views;
  views.reserve(tensors.size());
  for (const auto& t : tensors) views.push_back(t.detach().reshape({-1}));
  return views.empty() ? at::zeros({0}, at::kFloat) : at::cat(views);
}

at::Tensor flatGradients(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const auto& p : params) grads.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
  return flatten(grads);
}

void unflattenInto(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  torch::NoGradGuard noGrad;
  int64_t offset = 0;
  for (const auto& t : tensors) {
    t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  CARAVAN_CHECK_EQ(offset, flat.numel(), "elements of the tensors vs the flat buffer");
}

namespace {

std::vector<at::Tensor> floatBuffers(torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  for (auto& b : model.buffers()) {
    if (b.scalar_type() == at::kFloat) out.push_back(b);
  }
  return out;
}

}  // namespace

void broadcastModel(Communicator& comm, torch::nn::Module& model) {
  torch::NoGradGuard noGrad;
  for (auto& p : model.parameters()) comm.broadcast(p.data(), 0)->wait(comm.timeout());
  for (auto& b : model.buffers()) {
    if (b.is_floating_point()) comm.broadcast(b, 0)->wait(comm.timeout());
  }
}

void averageModel(Communicator& comm, torch::nn::Module& model) {
  std::vector<at::Tensor> all = syncedParameters(model);
  for (auto& b : floatBuffers(model)) all.push_back(b);
  at::Tensor flat = flatten(all);
  comm.allreduce(flat, ReduceOp::kSum)->wait(comm.timeout());
  flat.div_(static_cast<double>(comm.size()));
  unflattenInto(flat, all);
}

double averageReplicas(Communicator& comm, torch::nn::Module& model) {
  std::vector<at::Tensor> all = syncedParameters(model);
  const size_t parameters = all.size();
  for (auto& b : floatBuffers(model)) all.push_back(b);
  at::Tensor flat = flatten(all);
  int64_t n = 0;
  for (size_t i = 0; i < parameters; ++i) n += all[i].numel();
  const at::Tensor mine = flat.narrow(0, 0, n).to(at::kDouble);
  comm.allreduce(flat, ReduceOp::kSum)->wait(comm.timeout());
  flat.div_(static_cast<double>(comm.size()));
  at::Tensor sq = (mine - flat.narrow(0, 0, n).to(at::kDouble)).pow(2).sum().reshape({1});
  comm.allreduce(sq, ReduceOp::kSum)->wait(comm.timeout());
  unflattenInto(flat, all);
  return std::sqrt(sq.item<double>() / static_cast<double>(comm.size()));
}

double consensusDistance(Communicator& comm, torch::nn::Module& model) {
  return consensusDistance(comm, syncedParameters(model));
}

double consensusDistance(Communicator& comm, const std::vector<at::Tensor>& params) {
  at::Tensor x = flatten(params).to(at::kDouble);
  at::Tensor mean = x.clone();
  comm.allreduce(mean, ReduceOp::kSum)->wait(comm.timeout());
  mean.div_(static_cast<double>(comm.size()));
  at::Tensor sq = (x - mean).pow(2).sum().reshape({1});
  comm.allreduce(sq, ReduceOp::kSum)->wait(comm.timeout());
  return std::sqrt(sq.item<double>() / static_cast<double>(comm.size()));
}

at::Tensor gatherRows(Communicator& comm, const at::Tensor& mine) {
  constexpr int kTagRows = 951;
  const at::Tensor input = mine.to(at::kFloat).contiguous().reshape({-1});
  if (comm.rank() != 0) {
    comm.send(input, 0, kTagRows)->wait(comm.timeout());
    return at::Tensor();
  }
  at::Tensor rows = at::empty({comm.size(), input.numel()}, at::kFloat);
  rows[0].copy_(input);
  for (int r = 1; r < comm.size(); ++r) {
    at::Tensor row = rows[r];
    comm.recv(row, r, kTagRows)->wait(comm.timeout());
  }
  return rows;
}

at::Tensor rowForRank(const at::Tensor& rows, int rank, int worldSize, int64_t numel) {
  if (rows.dim() != 2 || rows.size(0) < 1 || rows.size(1) != numel ||
      rows.scalar_type() != at::kFloat) {
    throw CheckpointError(fmt::format(
        "the checkpoint's per-worker state has shape {} ({}), not [workers, {}] float32: it is "
        "damaged or from another model",
        c10::str(rows.sizes()), c10::toString(rows.scalar_type()), numel));
  }
  if (rows.size(0) == worldSize) return rows[rank].clone();
  return rows.mean(0);
}

}  // namespace caravan
