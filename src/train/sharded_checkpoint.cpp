// Sharded checkpoints: each rank's slice file and the manifest (see sharded_checkpoint.h).
#include "train/sharded_checkpoint.h"

#include <exception>
#include <filesystem>
#include <random>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "core/errors.h"
#include "sync/sharding.h"
#include "train/checkpoint_file.h"

namespace caravan {
namespace fs = std::filesystem;
namespace {

// The manifest's "sharded" entry's format. 2: slice files are zips of raw records, written a
// unit at a time (sharded_checkpoint.h); 1 (slice files as LibTorch archives) is not read.
constexpr int kFormat = 2;

int64_t elementsOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// How a unit's slices split its elements (sync/sharding.h).
std::vector<ShardGroup> shardGroups(const ShardedLayout::Unit& unit) {
  std::vector<ShardGroup> groups;
  for (const auto& g : unit.groups) groups.push_back({g.numel, g.padded});
  return groups;
}

// Where each slice file of a set is, and what its header must say.
struct SliceRef {
  std::string file;  // name in checkpoints/
  ArchiveSum sum;
};

// The model's tensors that a manifest holds whole: its buffers and the parameters no unit
// holds (frozen ones), by name.
std::vector<std::pair<std::string, at::Tensor>> commonTensors(torch::nn::Module& model,
                                                              const ShardedLayout& layout) {
  const auto named = model.named_parameters();
  std::set<const c10::TensorImpl*> inUnits;
  for (const auto& unit : layout.units) {
    for (const auto& p : unit.params) {
      if (const at::Tensor* t = named.find(p.name)) inUnits.insert(t->unsafeGetTensorImpl());
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : named) {
    if (inUnits.count(p.value().unsafeGetTensorImpl()) == 0) out.emplace_back(p.key(), p.value());
  }
  for (const auto& b : model.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

// The manifest's buffers and unsharded parameters into `model`: every one the model has, of
// its shape.
void loadCommon(const std::string& path, torch::serialize::InputArchive& archive,
                torch::nn::Module& model, const ShardedLayout& layout) {
  c10::IValue v;
  archive.read("common", v);
  std::map<std::string, at::Tensor> stored;
  for (const auto& entry : v.toGenericDict()) {
    stored[entry.key().toStringRef()] = entry.value().toTensor();
  }
  torch::NoGradGuard noGrad;
  const auto wanted = commonTensors(model, layout);
  for (const auto& [name, tensor] : wanted) {
    auto it = stored.find(name);
    if (it == stored.end() || it->second.sizes() != tensor.sizes()) {
      throw CheckpointError(fmt::format(
          "checkpoint {} does not fit this model: {} {}; it belongs to another model", path, name,
          it == stored.end()
              ? std::string("is not in it")
              : fmt::format("is [{}] in it, [{}] in the model", fmt::join(it->second.sizes(), ", "),
                            fmt::join(tensor.sizes(), ", "))));
    }
    tensor.copy_(it->second);
    stored.erase(it);
  }
  if (!stored.empty()) {
    throw CheckpointError(
        fmt::format("checkpoint {} holds {}, which this model does not have; it "
                    "belongs to another model",
                    path, stored.begin()->first));
  }
}

// Rank `rank`'s slice file, checked against the layout and the set's step.
ShardedSlices readSlice(const std::string& manifest, const std::string& file, int rank,
                        const ShardedLayout& layout, int64_t step) {
  ShardedSlices s;
  s.layout = layout;
  s.rank = rank;
  const std::string remedy = fmt::format(
      "it is rank {}'s slice of checkpoint {}: move {} out of checkpoints/ to "
      "resume from the previous checkpoint",
      rank, manifest, manifest);
  auto damaged = [&](const std::string& what) {
    return CheckpointError(
        fmt::format("rank {}'s slice file {} of checkpoint {} {}; move {} out of "
                    "checkpoints/ to resume from the previous checkpoint",
                    rank, file, manifest, what, manifest));
  };
  readRecordsFile(
      file,
      [&](caffe2::serialize::PyTorchStreamReader& zip) {
        if (!zip.hasRecord("slice")) throw damaged("is not a slice file");
        const auto [text, textBytes] = zip.getRecord("slice");
        const nlohmann::json head =
            nlohmann::json::parse(std::string(static_cast<const char*>(text.get()), textBytes));
        if (head.at("step").get<int64_t>() != step || head.at("rank").get<int>() != rank ||
            head.at("world_size").get<int64_t>() != layout.worldSize) {
          throw damaged(fmt::format("says step {}, rank {} of {}", head.at("step").dump(),
                                    head.at("rank").dump(), head.at("world_size").dump()));
        }
        const nlohmann::json& units = head.at("units");
        const size_t n = layout.units.size();
        if (!units.is_array() || units.size() != n) {
          throw damaged(fmt::format("holds {} units, the manifest {}", units.size(), n));
        }
        // Record `name` as a float32 tensor of `shape`; undefined when it is not that size.
        auto floats = [&](const std::string& name, std::vector<int64_t> shape) {
          at::Tensor t = at::empty(shape, at::kFloat);
          if (!zip.hasRecord(name) || zip.getRecordSize(name) != t.nbytes()) return at::Tensor();
          zip.getRecord(name, t.data_ptr(), t.nbytes());
          return t;
        };
        for (size_t u = 0; u < n; ++u) {
          const int64_t shard = layout.units[u].padded / layout.worldSize;
          const int64_t rows = units[u].at("rows").get<int64_t>();
          FlatOptimizerState state;
          state.step = units[u].at("step").get<int64_t>();
          const at::Tensor w = floats(fmt::format("weights/{}", u), {shard});
          if (rows > 0 && rows <= 2)
            state.slots = floats(fmt::format("optimizer/{}", u), {rows, shard});
          if (!w.defined() || rows < 0 || rows > 2 || (rows > 0 && !state.slots.defined()) ||
              state.step < 0) {
            throw damaged(fmt::format("has a slice of unit {} that is not [{}] float32", u, shard));
          }
          s.weights.push_back(w);
          s.optimizer.push_back(std::move(state));
        }
      },
      remedy);
  return s;
}

// Every slice file is there and is the one the manifest was written with (its header's size
// and CRC); the first that is not is refused, naming its rank.
void checkSliceFiles(const std::string& manifest, const std::vector<SliceRef>& slices) {
  const fs::path dir = fs::path(manifest).parent_path();
  for (size_t r = 0; r < slices.size(); ++r) {
    const std::string file = (dir / slices[r].file).string();
    std::error_code ec;
    if (!fs::is_regular_file(file, ec)) {
      throw CheckpointError(fmt::format(
          "checkpoint {} is missing rank {}'s slice file {}; put it back, or move {} out of "
          "checkpoints/ to resume from the previous checkpoint",
          manifest, r, file, manifest));
    }
    const ArchiveSum sum = readArchiveHeader(
        file, fmt::format("it is rank {}'s slice of checkpoint {}: move {} out of checkpoints/ "
                          "to resume from the previous checkpoint",
                          r, manifest, manifest));
    if (sum.size != slices[r].sum.size || sum.crc != slices[r].sum.crc) {
      throw CheckpointError(fmt::format(
          "rank {}'s slice file {} is not the one checkpoint {} was written with (its size or "
          "CRC differs); put the right one back, or move {} out of checkpoints/ to resume from "
          "the previous checkpoint",
          r, file, manifest, manifest));
    }
  }
}

// A unit's parameters in `model`, by the layout's names and shapes.
std::vector<at::Tensor> unitParameters(const std::string& path, torch::nn::Module& model,
                                       const ShardedLayout::Unit& unit) {
  const auto named = model.named_parameters();
  std::vector<at::Tensor> out;
  for (const auto& p : unit.params) {
    const at::Tensor* t = named.find(p.name);
    if (t == nullptr || t->sizes() != at::IntArrayRef(p.shape)) {
      throw CheckpointError(fmt::format(
          "checkpoint {} does not fit this model: its parameter {} is [{}]{}; it belongs to "
          "another model",
          path, p.name, fmt::join(p.shape, ", "),
          t == nullptr ? ", which the model does not have"
                       : fmt::format(", the model's [{}]", fmt::join(t->sizes(), ", "))));
    }
    out.push_back(*t);
  }
  return out;
}

// Every rank's slices put together: the whole parameters into `model`, the whole optimizer
// state into `optimizer`. (Every parameter of the model is a unit's, found by its name here,
// or the manifest's common part, which loadCommon required.)
void reassemble(const std::string& path, const std::vector<ShardedSlices>& ranks,
                torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  const ShardedLayout& layout = ranks.front().layout;
  const int64_t expectedRows = dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr ? 2 : 1;
  torch::NoGradGuard noGrad;
  for (size_t u = 0; u < layout.units.size(); ++u) {
    const ShardedLayout::Unit& unit = layout.units[u];
    const std::vector<at::Tensor> params = unitParameters(path, model, unit);
    std::vector<at::Tensor> weights, rows;
    const int64_t rowCount = ranks.front().optimizer[u].rows();
    const int64_t step = ranks.front().optimizer[u].step;
    for (const ShardedSlices& r : ranks) {
      weights.push_back(r.weights[u]);
      if (r.optimizer[u].rows() != rowCount || r.optimizer[u].step != step) {
        throw CheckpointError(fmt::format(
            "checkpoint {} is damaged: its slices of unit {} are in different optimizer states "
            "(rank 0 and rank {}); move it out of checkpoints/ to resume from the previous "
            "checkpoint",
            path, u, r.rank));
      }
      if (rowCount > 0) rows.push_back(r.optimizer[u].slots);
    }
    if (rowCount != 0 && rowCount != expectedRows) {
      throw CheckpointError(fmt::format(
          "checkpoint {} holds {} rows of optimizer state per parameter; the config's optimizer "
          "keeps {}",
          path, rowCount, expectedRows));
    }
    const std::vector<ShardGroup> groups = shardGroups(unit);
    const at::Tensor flat = joinSlices(weights, groups);  // [numel]
    for (size_t k = 0; k < params.size(); ++k) {
      const ShardedLayout::Parameter& p = unit.params[k];
      params[k].copy_(flat.narrow(0, p.offset, params[k].numel()).view(params[k].sizes()));
    }
    FlatOptimizerState whole;
    whole.step = step;
    if (rowCount > 0) whole.slots = joinSlices(rows, groups);  // [rows, numel]
    scatterOptimizerState(optimizer, params, whole);
  }
}

}  // namespace

nlohmann::json ShardedLayout::toJson() const {
  nlohmann::json units = nlohmann::json::array();
  for (const Unit& u : this->units) {
    nlohmann::json params = nlohmann::json::array();
    for (const Parameter& p : u.params) {
      params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
    }
    nlohmann::json unit = {{"params", params}, {"numel", u.numel}, {"padded", u.padded}};
    if (u.groups.size() != 1 || u.groups.front().dtype != "float32") {
      nlohmann::json groups = nlohmann::json::array();
      for (const Group& g : u.groups) {
        groups.push_back({{"numel", g.numel}, {"padded", g.padded}, {"dtype", g.dtype}});
      }
      unit["groups"] = groups;
    }
    units.push_back(unit);
  }
  return {{"world_size", worldSize}, {"level", level}, {"units", units}};
}

ShardedLayout ShardedLayout::fromJson(const nlohmann::json& j, const std::string& path) {
  ShardedLayout l;
  l.worldSize = j.at("world_size").get<int64_t>();
  l.level = j.at("level").get<std::string>();
  auto bad = [&](const std::string& what) {
    return CheckpointError(fmt::format(
        "checkpoint {} is damaged: its unit layout {}; move it out of checkpoints/ to resume "
        "from the previous checkpoint",
        path, what));
  };
  if (l.worldSize < 1 || l.worldSize > (1 << 20)) {
    throw bad(fmt::format("says {} workers", l.worldSize));
  }
  for (const auto& ju : j.at("units")) {
    Unit u;
    u.numel = ju.at("numel").get<int64_t>();
    u.padded = ju.at("padded").get<int64_t>();
    for (const auto& jp : ju.at("params")) {
      Parameter p;
      p.name = jp.at("name").get<std::string>();
      p.shape = jp.at("shape").get<std::vector<int64_t>>();
      p.offset = jp.at("offset").get<int64_t>();
      for (int64_t d : p.shape) {
        if (d < 0) throw bad(fmt::format("gives {} a negative size", p.name));
      }
      if (p.offset < 0 || p.offset + elementsOf(p.shape) > u.numel) {
        throw bad(fmt::format("puts {} outside its unit", p.name));
      }
      u.params.push_back(std::move(p));
    }
    if (u.numel < 0 || u.padded < u.numel || u.padded % l.worldSize != 0) {
      throw bad(
          fmt::format("pads {} elements to {} for {} workers", u.numel, u.padded, l.worldSize));
    }
    if (!ju.contains("groups")) {
      u.groups.push_back({u.numel, u.padded, "float32"});
    } else {
      int64_t numel = 0, padded = 0;
      for (const auto& jg : ju.at("groups")) {
        Group g{jg.at("numel").get<int64_t>(), jg.at("padded").get<int64_t>(),
                jg.at("dtype").get<std::string>()};
        if (g.numel < 0 || g.padded < g.numel || g.padded % l.worldSize != 0 ||
            (g.dtype != "float32" && g.dtype != "bfloat16")) {
          throw bad(fmt::format("has a group of {} elements padded to {} in {} for {} workers",
                                g.numel, g.padded, g.dtype, l.worldSize));
        }
        numel += g.numel;
        padded += g.padded;
        u.groups.push_back(std::move(g));
      }
      if (u.groups.empty() || numel != u.numel || padded != u.padded) {
        throw bad(fmt::format("splits a unit of {} elements ({} padded) into groups of {} ({})",
                              u.numel, u.padded, numel, padded));
      }
    }
    l.units.push_back(std::move(u));
  }
  return l;
}

bool ShardedLayout::sameUnits(const ShardedLayout& other) const {
  if (worldSize != other.worldSize || units.size() != other.units.size()) return false;
  for (size_t u = 0; u < units.size(); ++u) {
    const Unit &a = units[u], &b = other.units[u];
    if (a.numel != b.numel || a.padded != b.padded || a.params.size() != b.params.size() ||
        a.groups.size() != b.groups.size()) {
      return false;
    }
    for (size_t g = 0; g < a.groups.size(); ++g) {
      if (a.groups[g].numel != b.groups[g].numel || a.groups[g].padded != b.groups[g].padded ||
          a.groups[g].dtype != b.groups[g].dtype) {
        return false;
      }
    }
    for (size_t k = 0; k < a.params.size(); ++k) {
      if (a.params[k].name != b.params[k].name || a.params[k].shape != b.params[k].shape ||
          a.params[k].offset != b.params[k].offset) {
        return false;
      }
    }
  }
  return true;
}

namespace {

std::string sliceName(int64_t step, int rank, int world, uint32_t token) {
  return fmt::format("step-{:08d}.rank{}-of-{}.{:08x}.slice", step, rank, world, token);
}

// Writes `t`'s elements (contiguous float32) as record `name`.
void writeFloats(caffe2::serialize::PyTorchStreamWriter& zip, const std::string& name,
                 const at::Tensor& t) {
  const at::Tensor elements = t.detach().contiguous();
  zip.writeRecord(name, elements.data_ptr(), elements.nbytes());
}

// This rank's slice file `name` in `dir`, a unit at a time; what its header says.
ArchiveSum writeSliceFile(const CheckpointDir& dir, const std::string& name, int rank,
                          const ShardedLayout& layout, const SliceSource& slices, int64_t step) {
  std::error_code ec;
  fs::create_directories(dir.dir(), ec);
  if (ec) throw IoError(fmt::format("cannot create {}: {}", dir.dir(), ec.message()));
  return writeRecordsFile(
      (fs::path(dir.dir()) / name).string(), [&](caffe2::serialize::PyTorchStreamWriter& zip) {
        nlohmann::json units = nlohmann::json::array();
        slices([&](size_t u, const at::Tensor& weights, const FlatOptimizerState& state) {
          const int64_t shard =
              u < layout.units.size() ? layout.units[u].padded / layout.worldSize : -1;
          CARAVAN_CHECK(u == units.size() && weights.scalar_type() == at::kFloat &&
                            weights.numel() == shard &&
                            (state.rows() == 0 || (state.slots.scalar_type() == at::kFloat &&
                                                   state.slots.size(1) == shard)),
                        "unit {}'s slices do not fit the sharded checkpoint's layout", u);
          writeFloats(zip, fmt::format("weights/{}", u), weights);
          if (state.rows() > 0) writeFloats(zip, fmt::format("optimizer/{}", u), state.slots);
          units.push_back({{"rows", state.rows()}, {"step", state.step}});
        });
        CARAVAN_CHECK_EQ(units.size(), layout.units.size(),
                         "a sharded checkpoint's slices do not fit its layout");
        const std::string head = nlohmann::json{
            {"step", step},
            {"rank", rank},
            {"world_size", layout.worldSize},
            {"units", units}}.dump();
        zip.writeRecord("slice", head.data(), head.size());
      });
}

// Rank 0, after the barrier: every rank's slice file (`written`: [ok, size, crc, token] per
// rank) is there as this rank sees it; then the manifest, and retention. Returns its path.
std::string writeManifest(const CheckpointDir& dir, const at::Tensor& written,
                          const ShardedLayout& layout, torch::nn::Module& model,
                          const TrainingState& state) {
  const auto* w = written.data_ptr<int64_t>();
  const int world = static_cast<int>(layout.worldSize);
  nlohmann::json slices = nlohmann::json::array();
  std::vector<std::string> names;
  for (int r = 0; r < world; ++r) {
    const std::string file = sliceName(state.step, r, world, static_cast<uint32_t>(w[4 * r + 3]));
    const std::string full = (fs::path(dir.dir()) / file).string();
    ArchiveSum seen;
    try {
      seen = readArchiveHeader(full);
    } catch (const CheckpointError&) {
      seen.size = ~uint64_t{0};
    }
    if (seen.size != static_cast<uint64_t>(w[4 * r + 1]) ||
        seen.crc != static_cast<uint32_t>(w[4 * r + 2])) {
      throw IoError(fmt::format(
          "rank {} wrote its slice of the checkpoint of step {} to {}, which rank 0 does not "
          "see as written; sharded checkpoints need the run directory on a file system every "
          "rank shares",
          r, state.step, full));
    }
    slices.push_back({{"rank", r},
                      {"file", file},
                      {"size", static_cast<uint64_t>(w[4 * r + 1])},
                      {"crc", static_cast<uint32_t>(w[4 * r + 2])}});
    names.push_back(file);
  }
  torch::serialize::OutputArchive archive;
  archive.write("sharded", c10::IValue(nlohmann::json{
                               {"format", kFormat}, {"layout", layout.toJson()}, {"slices", slices}}
                                           .dump()));
  c10::Dict<std::string, at::Tensor> common;
  for (const auto& [n, t] : commonTensors(model, layout)) common.insert(n, ownStorage(t.detach()));
  archive.write("common", c10::IValue(common));
  writeTrainingState(archive, state);
  const std::string path = dir.pathFor(state.step);
  writeArchiveFile(path, archive);
  dir.prune(state.step, names);
  return path;
}

}  // namespace

std::string saveShardedCheckpoint(const CheckpointDir& dir, Communicator& comm,
                                  const ShardedLayout& layout, const SliceSource& slices,
                                  torch::nn::Module& model, const TrainingState& state) {
  const int rank = comm.rank(), world = comm.size();
  CARAVAN_CHECK_EQ(layout.worldSize, world, "a sharded checkpoint's layout is for other workers");
  // 1. This rank's slice file, under a token of its own: a second write of the same step
  // (a run resumed at its last step) never replaces the files a manifest names.
  const auto token = static_cast<uint32_t>(std::random_device{}());
  at::Tensor written = at::zeros({4}, at::kLong);  // [ok, size, crc, token]
  std::exception_ptr failure;
  try {
    const ArchiveSum sum = writeSliceFile(dir, sliceName(state.step, rank, world, token), rank,
                                          layout, slices, state.step);
    written[0] = 1;
    written[1] = static_cast<int64_t>(sum.size);
    written[2] = static_cast<int64_t>(sum.crc);
    written[3] = static_cast<int64_t>(token);
  } catch (...) {
    failure = std::current_exception();
  }
  // 2. The barrier: what every rank wrote (a rank that failed takes part, then reports).
  at::Tensor all = at::zeros({4 * world}, at::kLong);
  comm.allgather(all, written)->wait(comm.timeout());
  if (failure) std::rethrow_exception(failure);
  for (int r = 0; r < world; ++r) {
    if (all[4 * r].item<int64_t>() != 1) {
      throw IoError(fmt::format(
          "rank {} could not write its slice of the checkpoint of step {} (its error is in its "
          "output); the checkpoint was not written",
          r, state.step));
    }
  }
  // 3. Rank 0: the manifest, last.
  return rank == 0 ? writeManifest(dir, all, layout, model, state) : dir.pathFor(state.step);
}

bool isShardedManifest(torch::serialize::InputArchive& archive) {
  c10::IValue v;
  return archive.try_read("sharded", v);
}

bool isSliceFile(const std::string& path) { return recordsFileHas(path, "slice"); }

std::shared_ptr<ShardedSlices> loadShardedCheckpoint(const std::string& path,
                                                     torch::serialize::InputArchive& archive,
                                                     torch::nn::Module& model,
                                                     torch::optim::Optimizer& optimizer,
                                                     const std::optional<SliceOwner>& own) {
  c10::IValue v;
  archive.read("sharded", v);
  const nlohmann::json manifest = nlohmann::json::parse(v.toStringRef());
  if (manifest.at("format").get<int>() != kFormat) {
    throw CheckpointError(fmt::format(
        "checkpoint {} is a sharded checkpoint of format {}, which this build does not read "
        "(it reads format {}); resume it with the caravan that wrote it",
        path, manifest.at("format").dump(), kFormat));
  }
  const ShardedLayout layout = ShardedLayout::fromJson(manifest.at("layout"), path);
  archive.read("step", v);
  const int64_t step = v.toInt();
  std::vector<SliceRef> slices(static_cast<size_t>(layout.worldSize));
  std::vector<bool> named(slices.size(), false);
  for (const auto& s : manifest.at("slices")) {
    const int64_t r = s.at("rank").get<int64_t>();
    const std::string file = s.at("file").get<std::string>();
    if (r < 0 || r >= layout.worldSize || named[r] || file.find('/') != std::string::npos ||
        !CheckpointDir::sliceStepOf(file)) {
      throw CheckpointError(
          fmt::format("checkpoint {} is damaged: it names {} as rank {}'s slice; move it out of "
                      "checkpoints/ to resume from the previous checkpoint",
                      path, file, r));
    }
    named[r] = true;
    slices[r] = {file, {s.at("size").get<uint64_t>(), s.at("crc").get<uint32_t>()}};
  }
  for (size_t r = 0; r < named.size(); ++r) {
    if (!named[r]) {
      throw CheckpointError(fmt::format(
          "checkpoint {} is damaged: it names no slice of rank {}; move it out of checkpoints/ "
          "to resume from the previous checkpoint",
          path, r));
    }
  }
  // Before anything loads: every rank's slice is there (every rank refuses alike).
  checkSliceFiles(path, slices);
  loadCommon(path, archive, model, layout);
  const fs::path dir = fs::path(path).parent_path();
  auto fileOf = [&](size_t r) { return (dir / slices[r].file).string(); };
  if (own && own->workers == layout.worldSize) {
    return std::make_shared<ShardedSlices>(
        readSlice(path, fileOf(static_cast<size_t>(own->rank)), own->rank, layout, step));
  }
  std::vector<ShardedSlices> ranks;
  for (size_t r = 0; r < slices.size(); ++r) {
    ranks.push_back(readSlice(path, fileOf(r), static_cast<int>(r), layout, step));
  }
  reassemble(path, ranks, model, optimizer);
  return nullptr;
}

}  // namespace caravan
