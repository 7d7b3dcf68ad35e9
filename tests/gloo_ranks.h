// Ranks as threads: runs a body on W threads of this process, each one rank with its own
// GlooCommunicator over an in-memory store (c10d::HashStore), for tests of the comm/ and sync/
// layers without processes.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/gloo_communicator.h"

namespace caravan::test {

// Runs body(comm) for the ranks in `ranks` (default all of 0..size-1) of a world of `size`.
// Returns each rank's exception message ("" when it returned normally).
inline std::vector<std::string> runGlooRanks(
    int size, const GlooOptions& options,
    const std::function<void(std::shared_ptr<Communicator>)>& body,
    c10::intrusive_ptr<c10d::Store> store = {}, const std::vector<int>& ranks = {}) {
  if (!store) store = c10::make_intrusive<c10d::HashStore>();
  std::vector<int> which = ranks;
  if (which.empty()) {
    for (int r = 0; r < size; ++r) which.push_back(r);
  }
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int r : which) {
    threads.emplace_back([&, r] {
      try {
        body(std::make_shared<GlooCommunicator>(store, r, size, options));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

inline GlooOptions loopbackOptions(std::chrono::milliseconds timeout) {
  GlooOptions o;
  o.timeout = timeout;
  o.hostname = "127.0.0.1";
  return o;
}

}  // namespace caravan::test
