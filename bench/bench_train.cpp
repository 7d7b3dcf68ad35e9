// caravan_bench: measures training throughput of a config with the same data loader and step
// function as `caravan train`, and the machine's matrix-multiply peak. Prints one JSON object
// per measurement on stdout. Driven by bench/train_throughput.py (one worker) and
// bench/ddp_step.py (data parallel).
//
//   caravan_bench train --config configs/fmnist-cnn.toml --steps 200 --warmup 20 --threads 1
//   RANK=r WORLD_SIZE=W MASTER_ADDR=127.0.0.1 MASTER_PORT=p caravan_bench train ...
//   caravan_bench matmul --size 1024 --threads 1
//   caravan_bench loader --config examples/gpt_tokens.toml --batches 2000
//
// With a multi-rank world in the environment (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or any
// launcher worldFromEnvironment reads), `train` runs data-parallel exactly as `caravan train`
// does: Distributed (rendezvous, communicator, AllReduceStrategy), the rank's shard of the data,
// the step engine (DataParallelStep) with the strategy and the per-step agreement all-reduce. Rank
// 0 prints one JSON object with the step time (per step the slowest rank's, median over steps), a
// per-phase breakdown and the fraction of gradient communication hidden behind backward.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <thread>

#include <sys/resource.h>
#include <time.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include "comm/communicator.h"
#include "comm/world.h"
#include "core/config.h"
#include "core/errors.h"
#include "core/openmp_env.h"
#include "data/loader.h"
#include "memory/saved_tensors.h"
#include "optim/fused.h"
#include "train/distributed.h"
#include "train/run_setup.h"
#include "train/setup.h"
#include "train/step.h"
#include "train/step_engine.h"
#include "train/timeline.h"

using namespace caravan;
using Clock = std::chrono::steady_clock;

namespace {

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// CPU seconds this process used so far (all its threads, user + system).
double processCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * t.tv_usec; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// Minor page faults of this process so far (first touches of memory the allocator got from the
// kernel: glibc returns freed activations to the kernel, and the next step faults them in again).
double minorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_minflt);
}

// CPU seconds the calling thread used so far.
double threadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// caravan_bench times the data-parallel step engine (DataParallelStep); a pipeline stage's step
// (PipelineStep) is timed from caravan train's metrics instead.
void refusePipelines(const RunOptions& options) {
  if (options.pipeline.active()) {
    throw ConfigError(
        "caravan_bench train does not time pipeline stages or micro-batches (parallel.*); time "
        "them with caravan train's metrics.jsonl (bench/pipeline_bubble.py)");
  }
}

int benchTrain(char** argv, const std::string& configPath, std::vector<std::string> overrides,
               int64_t steps, int64_t warmup, int64_t threads, const std::string& profilePath) {
  overrides.push_back("train.threads=" + std::to_string(threads));
  const Config config = Config::fromFile(configPath, overrides);
  // As caravan train does (core/openmp_env.h).
  restartWithOpenMpWaits(argv, threads, matrixProductsFor(config.str("train.precision")),
                         /*localProcesses=*/1);
  applyRuntimeOptions(RunOptions::read(config).runtime);
  refusePipelines(RunOptions::read(config));
  // The same run as `caravan train` builds in one process.
  RunSetup setup(config);
  setup.prepareTraining(std::nullopt);
  const std::unique_ptr<StepEngine> engine = setup.attach(nullptr);
  BlockModel& model = setup.model;
  const SamplerOptions& so = setup.sampler;
  Loader& loader = *setup.loader;
  model->train();
  double lossSum = 0.0;
  // memory.weights = offload: the step updates through the out-of-core store, as in train().
  for (int64_t i = 0; i < warmup; ++i) engine->step(loader.next().batch, i);
  std::vector<double> forward, backward;
  // --profile: LibTorch's autograd profiler over the timed steps (Chrome trace of every op).
  std::unique_ptr<torch::autograd::profiler::RecordProfile> profile;
  if (!profilePath.empty()) {
    profile = std::make_unique<torch::autograd::profiler::RecordProfile>(profilePath);
  }
  const double cpuStart = threadCpuSeconds();
  const double faultsStart = minorFaults();
  const auto start = Clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    Batch batch = loader.next().batch;
    const auto t0 = Clock::now();
    StepResult r = engine->step(batch, warmup + i);
    lossSum += r.loss;
    forward.push_back(seconds(t0, r.forwardEnd));
    backward.push_back(seconds(r.forwardEnd, r.backwardEnd));
  }
  const double s = seconds(start, Clock::now());
  const double cpu = threadCpuSeconds() - cpuStart;
  const double faults = minorFaults() - faultsStart;
  profile.reset();  // writes the trace
  const double samplesPerS = static_cast<double>(steps * so.batchSize) / s;
  const double flopsPerSample = 3.0 * model->forwardFlopsPerExample();
  nlohmann::json out = {{"bench", "train"},
                        {"config", configPath},
                        {"model", model->modelName()},
                        {"threads", threads},
                        {"openmp_wait_policy", openMpWaitPolicy()},
                        {"blas_threads", blasThreads()},
                        // train.precision's per-block choice ("0111"; "" in float32): a timed
                        // choice can differ from run to run on a busy machine
                        {"bf16_blocks", setup.precision.blocksText()},
                        {"batch_size", so.batchSize},
                        {"steps", steps},
                        {"seconds", s},
                        {"samples_per_s", samplesPerS},
                        {"train_flops_per_sample", flopsPerSample},
                        {"gflops", samplesPerS * flopsPerSample / 1e9},
                        {"forward_s_median", median(forward)},
                        {"backward_s_median", median(backward)},
                        {"trainer_thread_cpu_s_per_step", cpu / static_cast<double>(steps)},
                        {"minor_faults_per_step", faults / static_cast<double>(steps)},
                        {"mean_loss", lossSum / static_cast<double>(steps)}};
  std::cout << out.dump() << std::endl;
  return 0;
}

// ---- data parallel ----------------------------------------------------------------------------

// A Communicator that forwards everything to the real one and, while a step is being probed,
// learns when each all-reduce actually completed: a watcher thread waits on every probed Work
// in launch order and stamps the time its wait returned. (The strategy's event sink reports a
// bucket's end when finishGradients() got round to waiting for it, i.e. never before backward
// ended, so it cannot tell communication that finished during backward from communication that
// was waited for.) Work::wait may be called from any thread, and a second wait returns the same
// result at once, so the trainer's own wait is unaffected except for the watcher's wake-up.
class ProbedCommunicator final : public Communicator {
 public:
  struct Record {
    int64_t step = 0;
    int64_t bytes = 0;
    Clock::time_point launch, done;
    bool completed = false;
  };

  explicit ProbedCommunicator(std::shared_ptr<Communicator> inner)
      : inner_(std::move(inner)), watcher_([this] { watch(); }) {}
  ~ProbedCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    watcher_.join();
  }

  // All-reduces issued from now on belong to `step`; -1 stops probing.
  void probe(int64_t step) { step_.store(step); }

  // Waits until every probed Work was seen complete; returns the records.
  std::vector<Record> drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
    return records_;
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }

  WorkPtr allreduce(at::Tensor tensor, ReduceOp op) override {
    const int64_t step = step_.load();
    const auto launch = Clock::now();
    WorkPtr w = inner_->allreduce(tensor, op);
    if (step >= 0) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        Record r;
        r.step = step;
        r.bytes = static_cast<int64_t>(tensor.nbytes());
        r.launch = launch;
        records_.push_back(r);
        queue_.emplace_back(w, records_.size() - 1);
      }
      cv_.notify_all();
    }
    return w;
  }
  WorkPtr broadcast(at::Tensor tensor, int root) override {
    return inner_->broadcast(tensor, root);
  }
  WorkPtr allgather(at::Tensor output, at::Tensor input) override {
    return inner_->allgather(output, input);
  }
  WorkPtr reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) override {
    return inner_->reduceScatter(output, input, op);
  }
  WorkPtr send(at::Tensor tensor, int dstRank, int tag) override {
    return inner_->send(tensor, dstRank, tag);
  }
  WorkPtr recv(at::Tensor tensor, int srcRank, int tag) override {
    return inner_->recv(tensor, srcRank, tag);
  }
  WorkPtr barrier() override { return inner_->barrier(); }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      auto [work, index] = queue_.front();
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      bool ok = true;
      try {
        work->wait(inner_->timeout());
      } catch (const std::exception&) {
        ok = false;  // the trainer's own wait rethrows it
      }
      const auto done = Clock::now();
      lock.lock();
      records_[index].done = done;
      records_[index].completed = ok;
      busy_ = false;
      cv_.notify_all();
    }
  }

  std::shared_ptr<Communicator> inner_;
  std::atomic<int64_t> step_{-1};
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<WorkPtr, size_t>> queue_;
  std::vector<Record> records_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread watcher_;  // last: starts after the members above exist
};

using Interval = std::pair<Clock::time_point, Clock::time_point>;

// Length of the union of `intervals`, counting only the part at or after `from`.
double unionSeconds(std::vector<Interval> intervals, Clock::time_point from) {
  for (auto& iv : intervals) {
    iv.first = std::max(iv.first, from);
    iv.second = std::max(iv.second, from);
  }
  std::sort(intervals.begin(), intervals.end());
  double total = 0.0;
  Clock::time_point curStart{}, curEnd{};
  bool open = false;
  for (const auto& [a, b] : intervals) {
    if (!open || a > curEnd) {
      if (open) total += seconds(curStart, curEnd);
      curStart = a;
      curEnd = b;
      open = true;
    } else {
      curEnd = std::max(curEnd, b);
    }
  }
  if (open) total += seconds(curStart, curEnd);
  return total;
}

// Per-step measurements of one rank, in the order they are gathered (columns of one row).
enum Column : int {
  kStep = 0,   // loader.next() to the end of the agreement: what one step costs
  kLoader,     // waiting for the loader's batch
  kForward,    // forward and loss
  kBackward,   // backward (gradient hooks launch bucket all-reduces meanwhile)
  kSyncWait,   // finishGradients(): waiting for the buckets, averaging, writing .grad
  kOptimizer,  // clipping, optimizer step, loss.item()
  kAgree,      // the per-step agreement all-reduce (mean loss, stop flags)
  kComm,       // union of the step's bucket all-reduces, launch to completion
  kExposed,    // the part of kComm after backward ended (not hidden behind backward)
  kExposedAfterAll,  // the part of kComm after the last rank's backward ended (one host only)
  kHiddenBytes,  // bytes of the step's buckets whose all-reduce completed before backward ended
  kBytes,       // bytes of all the step's buckets
  kColumns
};

int benchTrainDistributed(const WorldInfo& world, const std::string& configPath,
                          std::vector<std::string> overrides, int64_t steps, int64_t warmup,
                          int64_t threads, bool agree, const std::string& tracePath) {
  overrides.push_back("train.threads=" + std::to_string(threads));
  const Config config = Config::fromFile(configPath, overrides);
  const RunOptions options = RunOptions::read(config);
  validate(options, world.worldSize);
  applyRuntimeOptions(options.runtime);
  // Only a file store (dist.store = "file" without dist.store_path) puts anything here.
  const std::string runDir = (std::filesystem::temp_directory_path() /
                              ("caravan_bench-" + std::to_string(world.masterPort)))
                                 .string();
  if (options.sync.store == "file" && options.sync.storePath.empty()) {
    std::filesystem::create_directories(runDir);
  }
  if (options.sync.usesServers()) {
    throw ConfigError(
        fmt::format("caravan_bench train times worker-only sync modes (allreduce, "
                    "local-sgd, gossip); sync.mode = {} needs parameter servers",
                    syncModeName(options.sync.mode)));
  }
  refusePipelines(options);
  // The same order as train(): rendezvous, then the run (data, model, optimizer, sampler
  // shard, loader, seed.dropout), then the strategy.
  Distributed dist(options, world, runDir);
  RunSetup setup(config, options, &dist);
  setup.prepareTraining(std::nullopt);
  std::shared_ptr<ProbedCommunicator> probe;
  dist.wrapWorkers([&probe](std::shared_ptr<Communicator> workers) {
    probe = std::make_shared<ProbedCommunicator>(std::move(workers));
    return probe;  // attach() hands it to the strategy
  });
  const std::unique_ptr<StepEngine> engine = setup.attach(&dist);
  BlockModel& model = setup.model;
  const SamplerOptions& so = setup.sampler;
  Loader& loader = *setup.loader;
  Timeline timeline(tracePath.empty() ? "" : tracePath + ".rank" + std::to_string(world.rank) +
                                                 ".json",
                    world.rank);
  model->train();

  std::vector<std::array<double, kColumns>> rows(static_cast<size_t>(steps));
  for (auto& row : rows) row.fill(0.0);
  std::vector<Clock::time_point> backwardEnds(static_cast<size_t>(steps));
  double lossSum = 0.0;
  Clock::time_point timedStart;
  double cpuStart = 0.0, threadCpuStart = 0.0, faultsStart = 0.0;
  for (int64_t i = -warmup; i < steps; ++i) {
    if (i == 0) {
      probe->barrier()->wait(probe->timeout());
      timedStart = Clock::now();
      cpuStart = processCpuSeconds();
      threadCpuStart = threadCpuSeconds();
      faultsStart = minorFaults();
    }
    const auto t0 = Clock::now();
    LoadedBatch lb = loader.next();
    const auto loaded = Clock::now();
    if (i >= 0) probe->probe(i);
    StepResult r = engine->step(lb.batch, i + warmup);
    probe->probe(-1);
    const auto stepped = Clock::now();
    double loss = r.loss;
    if (agree) loss = dist.agree(r.loss, false, false, 0.0).meanLoss;
    const auto agreed = Clock::now();
    dist.stepDone(i + warmup + 1);  // as the trainer does: the heartbeat publishes it
    if (i < 0) continue;
    lossSum += loss;
    auto& row = rows[static_cast<size_t>(i)];
    row[kStep] = seconds(t0, agreed);
    row[kLoader] = seconds(t0, loaded);
    row[kForward] = seconds(loaded, r.forwardEnd);
    row[kBackward] = seconds(r.forwardEnd, r.backwardEnd);
    row[kSyncWait] = seconds(r.backwardEnd, r.syncEnd);
    row[kOptimizer] = seconds(r.syncEnd, stepped);
    row[kAgree] = seconds(stepped, agreed);
    backwardEnds[static_cast<size_t>(i)] = r.backwardEnd;
    timeline.complete("loader", t0, loaded);
    timeline.complete("forward", loaded, r.forwardEnd);
    timeline.complete("backward", r.forwardEnd, r.backwardEnd);
    timeline.complete("gradient sync wait", r.backwardEnd, r.syncEnd);
    timeline.complete("optimizer", r.syncEnd, stepped);
    if (agree) timeline.complete("agree", stepped, agreed);
  }
  const double wall = seconds(timedStart, Clock::now());
  const double cpuPerStep = (processCpuSeconds() - cpuStart) / static_cast<double>(steps);
  const double threadCpuPerStep =
      (threadCpuSeconds() - threadCpuStart) / static_cast<double>(steps);
  const double faultsPerStep = (minorFaults() - faultsStart) / static_cast<double>(steps);

  // Communication per step from the probe: launch to completion of each bucket's all-reduce.
  std::vector<std::vector<Interval>> perStep(static_cast<size_t>(steps));
  int64_t probed = 0;
  for (const auto& rec : probe->drain()) {
    if (!rec.completed || rec.step < 0 || rec.step >= steps) continue;
    perStep[static_cast<size_t>(rec.step)].emplace_back(rec.launch, rec.done);
    auto& row = rows[static_cast<size_t>(rec.step)];
    row[kBytes] += static_cast<double>(rec.bytes);
    if (rec.done <= backwardEnds[static_cast<size_t>(rec.step)]) {
      row[kHiddenBytes] += static_cast<double>(rec.bytes);
    }
    timeline.complete("allreduce in flight", rec.launch, rec.done, /*track=*/1);
    ++probed;
  }
  // When every backward ended: steady_clock is CLOCK_MONOTONIC, one clock for all processes
  // of a host, so on one host this separates waiting for a slower rank (skew) from
  // communication. (Across hosts the clocks differ and kExposedAfterAll means nothing.)
  const int W = probe->size();
  at::Tensor ends = torch::empty({steps}, at::kDouble);
  for (int64_t i = 0; i < steps; ++i) {
    ends[i] = std::chrono::duration<double>(
                  backwardEnds[static_cast<size_t>(i)].time_since_epoch())
                  .count();
  }
  at::Tensor allEnds = torch::empty({W, steps}, at::kDouble);
  probe->allgather(allEnds, ends)->wait(probe->timeout());
  at::Tensor lastEnds = std::get<0>(allEnds.max(0));
  for (int64_t i = 0; i < steps; ++i) {
    auto& row = rows[static_cast<size_t>(i)];
    const auto& ivs = perStep[static_cast<size_t>(i)];
    const Clock::time_point lastEnd{std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(lastEnds[i].item<double>()))};
    row[kComm] = unionSeconds(ivs, Clock::time_point::min());
    row[kExposed] = unionSeconds(ivs, backwardEnds[static_cast<size_t>(i)]);
    row[kExposedAfterAll] =
        unionSeconds(ivs, std::max(lastEnd, backwardEnds[static_cast<size_t>(i)]));
  }
  timeline.flush();

  // Every rank's rows to every rank.
  at::Tensor mine = torch::empty({steps, kColumns}, at::kDouble);
  for (int64_t i = 0; i < steps; ++i) {
    for (int c = 0; c < kColumns; ++c) mine[i][c] = rows[static_cast<size_t>(i)][c];
  }
  at::Tensor all = torch::empty({W, steps, kColumns}, at::kDouble);
  probe->allgather(all, mine)->wait(probe->timeout());
  // CPU seconds per step summed over ranks: every thread of every worker, and the trainer
  // threads alone (they run forward, backward and the optimizer); minor page faults likewise.
  at::Tensor cpu = torch::tensor({cpuPerStep, threadCpuPerStep, faultsPerStep}, at::kDouble);
  probe->allreduce(cpu, ReduceOp::kSum)->wait(probe->timeout());
  if (world.rank != 0) return 0;

  auto acc = all.accessor<double, 3>();
  std::vector<double> stepMax, stepRank0;
  for (int64_t i = 0; i < steps; ++i) {
    double m = 0.0;
    for (int r = 0; r < W; ++r) m = std::max(m, acc[r][i][kStep]);
    stepMax.push_back(m);
    stepRank0.push_back(acc[0][i][kStep]);
  }
  auto columnMedian = [&](int c) {
    std::vector<double> v;
    for (int r = 0; r < W; ++r) {
      for (int64_t i = 0; i < steps; ++i) v.push_back(acc[r][i][c]);
    }
    return median(v);
  };
  double commSum = 0.0, exposedSum = 0.0, exposedAfterAllSum = 0.0, hiddenBytes = 0.0,
         bytes = 0.0;
  for (int r = 0; r < W; ++r) {
    for (int64_t i = 0; i < steps; ++i) {
      commSum += acc[r][i][kComm];
      exposedSum += acc[r][i][kExposed];
      exposedAfterAllSum += acc[r][i][kExposedAfterAll];
      hiddenBytes += acc[r][i][kHiddenBytes];
      bytes += acc[r][i][kBytes];
    }
  }
  const double stepMedian = median(stepMax);
  nlohmann::json phases = {{"loader_s", columnMedian(kLoader)},
                           {"forward_s", columnMedian(kForward)},
                           {"backward_s", columnMedian(kBackward)},
                           {"sync_wait_s", columnMedian(kSyncWait)},
                           {"optimizer_s", columnMedian(kOptimizer)},
                           {"agree_s", columnMedian(kAgree)}};
  nlohmann::json comm = {
      {"backend", probe->backend()},
      {"buckets_per_step", static_cast<double>(probed) / steps},
      {"bucket_mb", static_cast<double>(options.sync.allreduce.bucketBytes) / (1 << 20)},
      {"first_bucket_mb", static_cast<double>(options.sync.allreduce.firstBucketBytes) / (1 << 20)},
      {"comm_s_median", columnMedian(kComm)},
      {"exposed_s_median", columnMedian(kExposed)},
      {"hidden_fraction", commSum > 0 ? 1.0 - exposedSum / commSum : 0.0},
      {"exposed_after_all_backward_s_median", columnMedian(kExposedAfterAll)},
      {"hidden_fraction_excluding_skew", commSum > 0 ? 1.0 - exposedAfterAllSum / commSum : 0.0},
      {"bytes_per_step", bytes / W / static_cast<double>(steps)},
      {"bytes_done_during_backward_fraction", bytes > 0 ? hiddenBytes / bytes : 0.0}};
  nlohmann::json out = {{"bench", "train_dist"},
                        {"engine", "caravan"},
                        {"config", configPath},
                        {"model", model->modelName()},
                        {"workers", W},
                        {"threads", threads},
                        {"batch_size", so.batchSize},
                        {"steps", steps},
                        {"warmup", warmup},
                        {"agree", agree},
                        {"step_s_median", stepMedian},
                        {"step_s_median_rank0", median(stepRank0)},
                        {"step_s_mean", wall / static_cast<double>(steps)},
                        {"cpu_s_per_step", cpu[0].item<double>()},
                        {"trainer_thread_cpu_s_per_step", cpu[1].item<double>()},
                        {"minor_faults_per_step", cpu[2].item<double>()},
                        {"samples_per_s", static_cast<double>(W * so.batchSize) / stepMedian},
                        {"phases", phases},
                        {"comm", comm},
                        {"step_s_max_over_ranks", stepMax},
                        {"mean_loss", lossSum / static_cast<double>(steps)}};
  std::cout << out.dump() << std::endl;
  return 0;
}

int benchMatmul(int64_t n, int64_t threads, int64_t repeats, const std::string& dtype) {
  at::set_num_threads(static_cast<int>(threads));
  const Config c = Config::fromString("", "<bench>", {"train.threads=" + std::to_string(threads)});
  applyRuntimeOptions(RunOptions::read(c).runtime);
  const auto type = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  at::Tensor a = torch::randn({n, n}).to(type), b = torch::randn({n, n}).to(type);
  at::Tensor out = at::mm(a, b);
  double best = 1e300;
  for (int64_t r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    at::mm_out(out, a, b);
    best = std::min(best, seconds(t0, Clock::now()));
  }
  const double gflops = 2.0 * static_cast<double>(n) * n * n / best / 1e9;
  nlohmann::json j = {{"bench", "matmul"},    {"size", n},
                      {"threads", threads},   {"dtype", dtype},
                      {"best_seconds", best}, {"gflops", gflops}};
  std::cout << j.dump() << std::endl;
  return 0;
}

}  // namespace

// The training set's batches as the loader's thread makes them, on the calling thread (no
// training): samples/s and tokens/s of the data path alone, to compare with a model's step rate.
int benchLoader(const std::string& configPath, std::vector<std::string> overrides, int64_t batches,
                int64_t warmup) {
  const Config config = Config::fromFile(configPath, overrides);
  const RunOptions options = RunOptions::read(config);
  applyRuntimeOptions(options.runtime);
  const DatasetSplits data = makeDatasets(options.data, options.seed.data);
  Sampler sampler(makeSamplerOptions(options, data.train->size(), 0, 1));
  int64_t samples = 0, elements = 0;
  for (int64_t i = 0; i < warmup; ++i) data.train->get(sampler.next());
  const auto start = Clock::now();
  for (int64_t i = 0; i < batches; ++i) {
    const Batch b = data.train->get(sampler.next());
    samples += b.size();
    elements += b.target.numel();
  }
  const double s = seconds(start, Clock::now());
  nlohmann::json out = {{"bench", "loader"},
                        {"config", configPath},
                        {"dataset", options.data.dataset},
                        {"batches", batches},
                        {"batch_size", options.data.batchSize},
                        {"seconds", s},
                        {"samples_per_s", static_cast<double>(samples) / s},
                        {"targets_per_s", static_cast<double>(elements) / s}};
  std::cout << out.dump() << std::endl;
  return 0;
}

// ---- optimizer ---------------------------------------------------------------------------

// torch::optim against the fused optimizers (optim/fused.h) on the same parameters: `sizes`
// float32 buffers with fresh gradients, the steps of the two interleaved (A B A B), each
// timing the median of `repeats` steps. Prints bytes of parameters per second for each.
int benchOptim(const std::string& name, const std::vector<int64_t>& sizes, int64_t threads,
               int64_t repeats, int64_t rounds) {
  at::set_num_threads(static_cast<int>(threads));
  torch::manual_seed(0);
  std::vector<at::Tensor> a, b;
  int64_t elements = 0;
  for (int64_t n : sizes) {
    a.push_back(torch::randn({n}).requires_grad_(true));
    b.push_back(a.back().detach().clone().requires_grad_(true));
    a.back().mutable_grad() = torch::randn({n}) * 1e-3;
    b.back().mutable_grad() = a.back().grad().clone();
    elements += n;
  }
  auto make = [&](bool fused,
                  std::vector<at::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    if (name == "adamw") {
      torch::optim::AdamWOptions o(1e-3);
      o.weight_decay(0.01);
      if (fused) return std::make_unique<FusedAdamW>(params, o);
      return std::make_unique<torch::optim::AdamW>(params, o);
    }
    torch::optim::SGDOptions o(1e-3);
    o.momentum(0.9).nesterov(true).weight_decay(5e-4);
    if (fused) return std::make_unique<FusedSgd>(params, o);
    return std::make_unique<torch::optim::SGD>(params, o);
  };
  auto reference = make(false, a), fused = make(true, b);
  auto time = [&](torch::optim::Optimizer& o) {
    std::vector<double> t;
    for (int64_t r = 0; r < repeats; ++r) {
      const auto t0 = Clock::now();
      o.step();
      t.push_back(seconds(t0, Clock::now()));
    }
    return median(t);
  };
  reference->step();  // the state exists before timing
  fused->step();
  std::vector<double> ref, mine;
  for (int64_t r = 0; r < rounds; ++r) {
    ref.push_back(time(*reference));
    mine.push_back(time(*fused));
  }
  const double bytes = 4.0 * static_cast<double>(elements);
  nlohmann::json out = {{"bench", "optim"},
                        {"optimizer", name},
                        {"threads", threads},
                        {"tensors", sizes.size()},
                        {"parameter_bytes", bytes},
                        {"torch_s", median(ref)},
                        {"fused_s", median(mine)},
                        {"torch_gb_per_s", bytes / median(ref) / 1e9},
                        {"fused_gb_per_s", bytes / median(mine) / 1e9},
                        {"speedup", median(ref) / median(mine)},
                        {"fused_loop_isa", fusedLoopInstructionSet()}};
  std::cout << out.dump() << std::endl;
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"caravan_bench: training-step throughput and matmul peak (JSON on stdout)"};
  app.require_subcommand(1);
  std::string config, trace;
  std::vector<std::string> overrides;
  int64_t steps = 100, warmup = 10, threads = 1, size = 1024, repeats = 10;
  bool noAgree = false;
  auto* train = app.add_subcommand(
      "train", "time training steps of a config; data parallel when the environment names a "
               "multi-rank world (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT)");
  train->add_option("--config", config, "config file")->required();
  train->add_option("--set", overrides, "override a config key");
  train->add_option("--steps", steps, "timed steps");
  train->add_option("--warmup", warmup, "untimed steps first");
  train->add_option("--threads", threads, "compute threads");
  train->add_flag("--no-agree", noAgree,
                  "data parallel: skip the per-step agreement all-reduce caravan train does");
  train->add_option("--trace", trace,
                    "data parallel: write a Chrome trace of the timed steps to PATH.rank<r>.json; "
                    "one worker: LibTorch's autograd profiler trace (every op) to PATH");
  auto* mm = app.add_subcommand("matmul", "float32 matrix-multiply peak");
  mm->add_option("--size", size, "matrix size n (n x n times n x n)");
  mm->add_option("--threads", threads, "compute threads");
  mm->add_option("--repeats", repeats, "best of this many");
  std::string dtype = "float32";
  mm->add_option("--dtype", dtype, "float32 or bf16 (oneDNN's bf16 kernels)")
      ->check(CLI::IsMember({"float32", "bf16"}));
  int64_t batches = 1000;
  auto* load = app.add_subcommand(
      "loader", "time the training set's batches as the loader makes them, one thread, no model");
  load->add_option("--config", config, "config file")->required();
  load->add_option("--set", overrides, "override a config key");
  load->add_option("--batches", batches, "timed batches");
  load->add_option("--warmup", warmup, "untimed batches first");
  std::string optimizer = "adamw";
  std::vector<int64_t> sizes = {1 << 20};
  int64_t rounds = 5;
  auto* optim = app.add_subcommand(
      "optim", "torch::optim against the fused optimizer on float32 buffers, interleaved");
  optim->add_option("--optimizer", optimizer, "adamw or sgd (Nesterov momentum, weight decay)")
      ->check(CLI::IsMember({"adamw", "sgd"}));
  optim->add_option("--sizes", sizes, "elements of each parameter buffer");
  optim->add_option("--threads", threads, "compute threads");
  optim->add_option("--repeats", repeats, "steps per timing (median)");
  optim->add_option("--rounds", rounds, "timings of each, interleaved (median)");
  CLI11_PARSE(app, argc, argv);
  // As caravan train: the memory check profiles blocks under the saved-tensor engine.
  installSavedTensorEngine();
  try {
    if (*load) return benchLoader(config, overrides, batches, warmup);
    if (*train) {
      const WorldInfo world = worldFromEnvironment(processEnvironment());
      if (world.worldSize > 1) {
        return benchTrainDistributed(world, config, overrides, steps, warmup, threads, !noAgree,
                                     trace);
      }
      return benchTrain(argv, config, overrides, steps, warmup, threads, trace);
    }
    if (*optim) return benchOptim(optimizer, sizes, threads, repeats, rounds);
    return benchMatmul(size, threads, repeats, dtype);
  } catch (const Error& e) {
    std::cerr << "caravan_bench: error: " << e.what() << "\n";
    return e.exitCode();
  }
}
