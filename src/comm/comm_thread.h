// CommThread: runs a strategy's blocking communication tasks (a ring of send/recv, a server's
// exchange) one after another on a thread of its own, so they overlap the caller's compute.
// submit() returns a Work: wait(timeout) blocks until the task ran and rethrows its exception,
// or throws PeerError naming `what` after the timeout.
//
// Tasks run in submission order, so when every rank submits the same tasks in the same order
// the collectives inside them line up. The destructor runs what was submitted, then joins.
//
// Threading: submit() from any thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "comm/communicator.h"

namespace caravan {

class CommThread {
 public:
  CommThread();
  ~CommThread();
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  WorkPtr submit(std::string what, std::function<void()> task);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace caravan
