// A cluster for `caravan simulate` (sim/simulator.h): hosts, their cores and memory, the link
// each host has to the others, and its disk. Read from a TOML file's [cluster] table:
//
//   [cluster]
//   hosts = 8                 # required
//   link_mbit = 1000          # required: each host's link, in each direction
//   cores_per_host = 2        # cores a host gives its processes (a cgroup's share: 0.4)
//   shared_cores = 0          # > 0: the hosts are network namespaces of one machine whose
//                             # processes share this many cores (the bench's test hosts)
//   memory_gib = 24           # per host
//   latency_us = 50           # one message's fixed cost, host to host (alpha)
//   link_efficiency = 0.94    # what TCP delivers of the link rate (goodput / rate)
//   disk_mbps = 1200          # the disk's read and write rate (memory.swap_dir)
//   shm_gbps = 5              # a copy between two processes of one host
//   straggler_cv = 0          # each worker's step: lognormal with this coefficient of variation
//   straggler_step_ms = 0     # > 0: straggler_cv is that of a step computing this long; a
//                             # longer step computing T has cv * sqrt(this / T) (the delays are
//                             # the host's, in time, not a share of the step: a long step
//                             # averages them); a shorter one straggler_cv (not extrapolated)
//
// `caravan calibrate` measures this host (cores, memory, disk) and writes one; the link's rate
// and latency are given to it (a link to another host is not measurable from one host alone).
// Threading: plain values.
#pragma once

#include <cstdint>
#include <string>

namespace caravan::sim {

struct ClusterSpec {
  int hosts = 1;
  double coresPerHost = 1.0;
  double sharedCores = 0.0;  // 0: every host has its own cores
  double memoryBytesPerHost = 0.0;
  double linkBitsPerSecond = 1e9;
  double latencySeconds = 50e-6;
  double linkEfficiency = 1.0;
  double diskBytesPerSecond = 1e9;
  double shmBytesPerSecond = 5e9;
  double stragglerCv = 0.0;
  double stragglerStepSeconds = 0.0;  // 0: straggler_cv is every step's

  // The coefficient of variation of a step whose compute takes `computeSeconds`.
  double stragglerCvAt(double computeSeconds) const;

  // The rate one transfer gets on a host's link, in bytes per second.
  double linkBytesPerSecond() const { return linkBitsPerSecond * linkEfficiency / 8.0; }

  // ConfigError (one line, naming the file and key) for a missing or bad key, an unknown key
  // or a value out of range.
  static ClusterSpec fromString(const std::string& text, const std::string& source);
  static ClusterSpec fromFile(const std::string& path);
  // The [cluster] table fromString reads back to the same values.
  std::string toToml() const;
};

}  // namespace caravan::sim
