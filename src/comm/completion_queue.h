// CompletionQueue: waits on several Works at once and hands back the id of each as it
// completes — the "receive from whichever peer is first" an asynchronous parameter server
// needs. Built on ordinary per-peer recvs, so a failure still names its peer and a peer that
// exits fails its own recv at once (a recv-from-any would wait for the timeout).
//
// add() starts a thread that waits on the Work (with `timeout`); next() blocks until one
// finished and returns its id, or rethrows its failure. The waiting threads are detached and
// share the queue's state, so destroying the queue with works outstanding does not block;
// they end when their works do (the communicator's destruction or process exit at the latest).
//
// Threading: add() and next() from one thread (the owner issues operations anyway).
#pragma once

#include <chrono>
#include <memory>

#include "comm/communicator.h"

namespace caravan {

class CompletionQueue {
 public:
  explicit CompletionQueue(std::chrono::milliseconds timeout);
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  void add(int id, WorkPtr work);
  // The id of a completed work, in completion order; rethrows that work's failure.
  int next();
  // Works added and not yet returned by next().
  int outstanding() const { return outstanding_; }

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::chrono::milliseconds timeout_;
  int outstanding_ = 0;
};

}  // namespace caravan
