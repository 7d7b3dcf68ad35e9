// Operations on the model replicas of a data-parallel job, shared by the strategies: make every
// replica rank 0's (start of training), average the replicas (local SGD, consolidation), and
// measure how far they drifted apart (gossip's consensus distance).
//
// Parameters are the model's trainable float32 parameters in registration order; buffers are
// its floating-point buffers (batch-norm running statistics). Every rank must call each
// function at the same point (they are collectives).
//
// Threading: trainer thread only.
#pragma once

#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "core/torch_fwd.h"

namespace caravan {

// The trainable parameters a strategy synchronizes (float32; anything else is a bug).
std::vector<at::Tensor> syncedParameters(torch::nn::Module& model);

// The gradients of `params` as one flat float32 tensor; a parameter without a gradient this
// step contributes zeros.
at::Tensor flatGradients(const std::vector<at::Tensor>& params);

// One flat float32 copy of `tensors`, and back.
at::Tensor flatten(const std::vector<at::Tensor>& tensors);
void unflattenInto(const at::Tensor& flat, const std::vector<at::Tensor>& tensors);

// Rank 0's parameters and floating-point buffers on every rank.
void broadcastModel(Communicator& comm, torch::nn::Module& model);

// Every rank's parameters (and floating-point buffers) replaced by the mean over ranks.
void averageModel(Communicator& comm, torch::nn::Module& model);

// averageModel and the consensus distance the parameters had before it (consensusDistance,
// measured from the float32 mean) in one float32 all-reduce of the model and one of a number,
// instead of a float64 all-reduce, a number and a float32 all-reduce: what consolidate() of
// the strategies whose replicas drift (local SGD, gossip, DiLoCo) does.
double averageReplicas(Communicator& comm, torch::nn::Module& model);

// Every rank's `mine` (float32, the same numel on every rank) as the rows of one [W, n] tensor,
// on rank 0 (undefined elsewhere): per-rank state for a checkpoint, e.g. top-k residuals.
at::Tensor gatherRows(Communicator& comm, const at::Tensor& mine);
// What rank `rank` of `worldSize` resumes with from `rows` saved by rows.size(0) ranks: its own
// row when the count is the same, else the mean of the rows (resharding). CheckpointError when
// `rows` is not [ranks, numel] float32.
at::Tensor rowForRank(const at::Tensor& rows, int rank, int worldSize, int64_t numel);

// sqrt(mean over ranks of ||x_r - mean x||^2) over the synchronized parameters: 0 when every
// replica is equal. Every rank gets the same value.
double consensusDistance(Communicator& comm, torch::nn::Module& model);
double consensusDistance(Communicator& comm, const std::vector<at::Tensor>& params);

}  // namespace caravan
