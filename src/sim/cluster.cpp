#include "sim/cluster.h"

#include <cmath>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "core/errors.h"
#include "core/files.h"

namespace caravan::sim {
namespace {

struct Key {
  const char* name;
  double min, max;  // accepted range, inclusive
  bool required;
  const char* meaning;
};

// Every key [cluster] accepts, with its range.
const Key kKeys[] = {
    {"hosts", 1, 1e6, true, "hosts"},
    {"link_mbit", 1e-3, 1e7, true, "each host's link rate in Mbit/s"},
    {"cores_per_host", 0.01, 1e4, false, "cores per host"},
    {"shared_cores", 0, 1e4, false, "cores the hosts share (0: each has its own)"},
    {"memory_gib", 0, 1e6, false, "memory per host in GiB"},
    {"latency_us", 0, 1e7, false, "a message's fixed cost in microseconds"},
    {"link_efficiency", 0.01, 1, false, "goodput over link rate"},
    {"disk_mbps", 1e-3, 1e7, false, "disk rate in MB/s"},
    {"shm_gbps", 1e-3, 1e4, false, "same-host copy rate in GB/s"},
    {"straggler_cv", 0, 10, false, "coefficient of variation of a worker's step"},
    {"straggler_step_ms", 0, 1e7, false, "the step length straggler_cv was seen at"},
};

std::string keyList() {
  std::string s;
  for (const Key& k : kKeys) s += (s.empty() ? "" : ", ") + std::string(k.name);
  return s;
}

}  // namespace

ClusterSpec ClusterSpec::fromString(const std::string& text, const std::string& source) {
  toml::table table;
  try {
    table = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw ConfigError(
        fmt::format("{}:{}: invalid TOML: {}", source, e.source().begin.line, e.description()));
  }
  const toml::table* cluster = table["cluster"].as_table();
  if (cluster == nullptr) {
    throw ConfigError(fmt::format(
        "{} has no [cluster] table; write one with hosts and link_mbit (caravan calibrate "
        "writes one for this host)",
        source));
  }
  for (const auto& [name, node] : table) {
    if (name.str() != "cluster") {
      throw ConfigError(fmt::format("{}: unknown table [{}]; a cluster file has [cluster] only",
                                    source, name.str()));
    }
  }
  std::map<std::string, double> values;
  for (const auto& [name, node] : *cluster) {
    const Key* key = nullptr;
    for (const Key& k : kKeys) key = name.str() == k.name ? &k : key;
    if (key == nullptr) {
      throw ConfigError(fmt::format("{}: unknown key cluster.{}; the keys are {}", source,
                                    name.str(), keyList()));
    }
    const std::optional<double> v = node.value<double>();
    if (!v || !std::isfinite(*v) || *v < key->min || *v > key->max) {
      throw ConfigError(fmt::format("{}:{}: cluster.{} ({}) must be a number in [{}, {}]", source,
                                    node.source().begin.line, key->name, key->meaning, key->min,
                                    key->max));
    }
    if (std::string(key->name) == "hosts" && *v != std::floor(*v)) {
      throw ConfigError(fmt::format("{}: cluster.hosts must be a whole number", source));
    }
    values[key->name] = *v;
  }
  for (const Key& k : kKeys) {
    if (k.required && values.count(k.name) == 0) {
      throw ConfigError(fmt::format("{}: cluster.{} ({}) is required", source, k.name, k.meaning));
    }
  }
  auto get = [&](const char* name, double fallback) {
    auto it = values.find(name);
    return it == values.end() ? fallback : it->second;
  };
  ClusterSpec c;
  c.hosts = static_cast<int>(get("hosts", 1));
  c.linkBitsPerSecond = get("link_mbit", 1000) * 1e6;
  c.coresPerHost = get("cores_per_host", 1);
  c.sharedCores = get("shared_cores", 0);
  c.memoryBytesPerHost = get("memory_gib", 0) * 1073741824.0;
  c.latencySeconds = get("latency_us", 50) * 1e-6;
  c.linkEfficiency = get("link_efficiency", 1);
  c.diskBytesPerSecond = get("disk_mbps", 1000) * 1e6;
  c.shmBytesPerSecond = get("shm_gbps", 5) * 1e9;
  c.stragglerCv = get("straggler_cv", 0);
  c.stragglerStepSeconds = get("straggler_step_ms", 0) * 1e-3;
  return c;
}

double ClusterSpec::stragglerCvAt(double computeSeconds) const {
  if (stragglerStepSeconds <= 0.0 || computeSeconds <= stragglerStepSeconds) return stragglerCv;
  return stragglerCv * std::sqrt(stragglerStepSeconds / computeSeconds);
}

ClusterSpec ClusterSpec::fromFile(const std::string& path) {
  std::string why;
  const std::optional<std::string> text = readRegularFile(path, &why, false, size_t{1} << 20);
  if (!text) {
    throw ConfigError(
        fmt::format("cannot read cluster file {}: it {}; pass a TOML file with a [cluster] table "
                    "(caravan calibrate writes one)",
                    path, why));
  }
  return fromString(*text, path);
}

std::string ClusterSpec::toToml() const {
  return fmt::format(
      "[cluster]\nhosts = {}\nlink_mbit = {:.12g}\ncores_per_host = {:.12g}\n"
      "shared_cores = {:.12g}\nmemory_gib = {:.12g}\nlatency_us = {:.12g}\n"
      "link_efficiency = {:.12g}\ndisk_mbps = {:.12g}\nshm_gbps = {:.12g}\n"
      "straggler_cv = {:.12g}\nstraggler_step_ms = {:.12g}\n",
      hosts, linkBitsPerSecond / 1e6, coresPerHost, sharedCores, memoryBytesPerHost / 1073741824.0,
      latencySeconds * 1e6, linkEfficiency, diskBytesPerSecond / 1e6, shmBytesPerSecond / 1e9,
      stragglerCv, stragglerStepSeconds * 1e3);
}

}  // namespace caravan::sim
