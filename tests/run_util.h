// Helpers for tests that read what a training run left: its losses, its final weights, and
// runs under a file size limit (a real tier write error).
#pragma once

#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/config.h"
#include "core/errors.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/run_setup.h"
#include "train/setup.h"

namespace caravan::test {

// The budget in bytes that a refusal of memory.budget names as the smallest that fits: the
// planner's ("... the smallest budget the planner can fit is 1.9 MiB (1972844 bytes) ...") or a
// run's measured step ("... the smallest budget that works for this model, batch and ... is
// 1.4 MiB (1421700 bytes) ..."); fails the test and returns -1 when the message names none.
inline int64_t smallestBudgetNamed(const std::string& message) {
  std::smatch m;
  if (!std::regex_search(message, m,
                         std::regex("smallest budget (the planner can fit|that works for [^;]*) "
                                    "is [^(]* \\((\\d+) bytes"))) {
    ADD_FAILURE() << "no smallest budget named: " << message;
    return -1;
  }
  return std::stoll(m[m.size() - 1]);
}

// The loss of every record of `kind` ("train", "eval") in RUN_DIR/metrics.jsonl.
inline std::vector<double> losses(const std::string& runDir, const std::string& kind) {
  std::vector<double> out;
  std::istringstream lines(readFile(runDir + "/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == kind) out.push_back(j.at("loss").get<double>());
  }
  return out;
}

// The loss of every train record in RUN_DIR/metrics.jsonl.
inline std::vector<double> trainLosses(const std::string& runDir) {
  return losses(runDir, "train");
}

// `t` (float32, uint8 or int64, any shape) as a version-1.0 .npy file, as np.save writes it
// (the reader's oracle is NumPy's own writer, tests/python/npy_fixtures.py; this one exports
// tensors made in C++).
inline void writeNpy(const std::string& path, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const char* descr = c.scalar_type() == at::kFloat  ? "<f4"
                      : c.scalar_type() == at::kByte ? "|u1"
                                                     : "<i8";
  std::string shape;
  for (int64_t d : c.sizes()) shape += std::to_string(d) + ", ";
  std::string header =
      "{'descr': '" + std::string(descr) + "', 'fortran_order': False, 'shape': (" + shape + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string bytes = std::string("\x93NUMPY\x01\x00", 8);
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>(header.size() >> 8);
  bytes += header;
  bytes.append(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  writeFile(path, bytes);
}

// Parameters and buffers of the newest checkpoint in `runDir`, loaded into a fresh model.
inline std::map<std::string, at::Tensor> finalWeights(const Config& config,
                                                      const std::string& runDir) {
  RunSetup setup(config);
  BlockModel& model = setup.model;
  CheckpointDir dir(runDir, 3);
  loadCheckpoint(*dir.latest(), *model, *setup.optimizer, setup.identity);
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  for (const auto& b : model->named_buffers()) out[b.key()] = b.value().detach().clone();
  return out;
}

// `n` random examples of `shape` (token ids for language models, normal images otherwise),
// drawn from the default generator seeded with `seed`.
inline Batch randomBatch(const DataShape& shape, int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  Batch b;
  if (shape.task == TaskKind::kLanguageModel) {
    b.input = torch::randint(0, shape.vocabSize, {n, shape.seqLen}, torch::kLong);
    b.target = torch::randint(0, shape.vocabSize, {n, shape.seqLen}, torch::kLong);
  } else {
    b.input = torch::randn({n, shape.channels, shape.height, shape.width});
    b.target = torch::randint(0, shape.numClasses, {n}, torch::kLong);
  }
  return b;
}

// `caravan ARGS` under `ulimit -f LIMIT_KIB`; the exit code is -1 if it did not exit.
inline CommandResult runCaravanWithFileLimit(int limitKiB, const std::string& args) {
  return runShell("sh -c 'ulimit -f " + std::to_string(limitKiB) + "; exec " +
                  std::string(CARAVAN_BINARY) + " " + args + "'");
}

// The CNN trained on synthetic data for 3 steps with `settings` (--set ...) and the disk tier in
// a fresh directory, under `ulimit -f LIMIT_KIB`: expects exit 5 with one line naming the
// failed tier write and memory.swap_dir, and no checkpoint. Returns false (nothing checked)
// where the temp dir is tmpfs, which the disk tier refuses: the caller skips.
inline bool expectTierWriteFailure(int limitKiB, const std::string& settings) {
  TempDir run, swap;
  writeFile(run / "c.toml", "[model]\nname = \"cnn\"\n");
  const CommandResult r = runCaravanWithFileLimit(
      limitKiB, "train --config " + (run / "c.toml") +
                    " --set data.dataset=synthetic --set data.synthetic_size=256 --set "
                    "data.batch_size=64 --set train.max_steps=3 " + settings +
                    " --set memory.swap_dir=" + swap.path() + " --run-dir " + (run / "r") +
                    " --quiet");
  const std::string& err = r.err;
  if (r.exitCode == static_cast<int>(ExitCode::kConfig) && err.find("tmpfs") != std::string::npos) {
    return false;
  }
  EXPECT_EQ(r.exitCode, static_cast<int>(ExitCode::kIo)) << err;
  EXPECT_NE(err.find("memory tier: writing"), std::string::npos) << err;
  EXPECT_NE(err.find("File too large"), std::string::npos) << err;
  EXPECT_NE(err.find("memory.swap_dir"), std::string::npos) << err;
  // One line, and no checkpoint was half-written.
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_FALSE(std::filesystem::exists(run / "r/checkpoints")) << "a checkpoint was written";
  return true;
}

}  // namespace caravan::test
