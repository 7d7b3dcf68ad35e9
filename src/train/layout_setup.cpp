#include "train/layout_setup.h"

#include <filesystem>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "comm/store.h"
#include "core/errors.h"
#include "train/run_options.h"

namespace caravan {
namespace {

constexpr const char* kLayoutKey = "caravan/layout";
constexpr const char* kRefused = "refused\n";
constexpr const char* kFailed = "failed\n";

std::vector<uint8_t> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }

std::string join(const std::vector<std::string>& keys) {
  std::string out;
  for (const std::string& k : keys) out += k + "\n";
  return out;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
    out.push_back(text.substr(start, end - start));
  }
  return out;
}

}  // namespace

bool layoutIsAuto(const Config& config) { return config.str("parallel.layout") == "auto"; }

Config resolveLayout(const Config& config, const WorldInfo& world, const std::string& runDir,
                     bool resume, c10d::Store* store, const LayoutChooser& choose, bool log) {
  if (!choose) {
    throw ConfigError(
        "parallel.layout = auto needs the layout search, which this program was built without; "
        "run it with caravan train, or set parallel.layout = manual");
  }
  if (world.worldSize > 1 && store == nullptr) {
    throw ConfigError(
        "parallel.layout = auto needs the job's store to agree on the layout (dist.backend = mpi "
        "has none); set dist.backend = auto, or parallel.layout = manual with the keys caravan "
        "plan --cluster prints");
  }
  const auto rendezvous = RunOptions::read(config).sync.rendezvousTimeout;
  auto key = [](const char* what, int r) { return fmt::format("caravan/layout-{}/{}", what, r); };
  std::vector<std::string> keys;
  if (world.rank == 0) {
    try {
      if (store != nullptr) {
        store->set(key("arrived", 0), bytesOf("1"));
        waitForRanks(
            *store, 0, world.worldSize, [&](int r) { return key("arrived", r); }, rendezvous,
            "reached the layout search");
      }
      keys = choose(config, world.worldSize - serverCount(config),
                    (std::filesystem::path(runDir) / "layout.json").string(), resume, log);
    } catch (const std::exception& e) {
      // Every failure reaches the other ranks (a refusal as theirs, anything else as rank 0's
      // failure), and they have read it before this rank's store goes with it.
      if (store != nullptr) {
        const bool refused = dynamic_cast<const ConfigError*>(&e) != nullptr;
        store->set(kLayoutKey, bytesOf((refused ? kRefused : kFailed) + std::string(e.what())));
        store->set(key("read", 0), bytesOf("1"));
        try {
          waitForRanks(
              *store, 0, world.worldSize, [&](int r) { return key("read", r); }, rendezvous,
              "read rank 0's layout");
        } catch (const std::exception&) {  // a rank gone already: nothing to hand it
        }
      }
      throw;
    }
    if (store != nullptr) store->set(kLayoutKey, bytesOf(join(keys)));
  } else {
    store->set(key("arrived", world.rank), bytesOf("1"));
    std::string text;
    try {
      store->wait({kLayoutKey}, kLayoutWait);
      const std::vector<uint8_t> got = store->get(kLayoutKey);
      text.assign(got.begin(), got.end());
      store->set(key("read", world.rank), bytesOf("1"));
    } catch (const std::exception& e) {
      throw PeerError(fmt::format("rank {}: no layout from rank 0 within {} min ({})", world.rank,
                                  kLayoutWait.count(), e.what()));
    }
    if (text.rfind(kRefused, 0) == 0) throw ConfigError(text.substr(std::string(kRefused).size()));
    if (text.rfind(kFailed, 0) == 0) {
      throw PeerError(fmt::format("rank 0 failed choosing the layout: {}",
                                  text.substr(std::string(kFailed).size())));
    }
    keys = split(text);
  }
  return config.withOverrides(keys);
}

}  // namespace caravan
