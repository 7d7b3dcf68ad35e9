// CompletionQueue (see completion_queue.h).
#include "comm/completion_queue.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "core/errors.h"

namespace caravan {

struct CompletionQueue::State {
  std::mutex mutex;
  std::condition_variable done;
  std::deque<std::pair<int, std::exception_ptr>> finished;
};

CompletionQueue::CompletionQueue(std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()), timeout_(timeout) {}

void CompletionQueue::add(int id, WorkPtr work) {
  ++outstanding_;
  std::thread([state = state_, id, work = std::move(work), timeout = timeout_] {
    std::exception_ptr error;
    try {
      work->wait(timeout);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      state->finished.emplace_back(id, error);
    }
    state->done.notify_one();
  }).detach();
}

int CompletionQueue::next() {
  CARAVAN_CHECK(outstanding_ > 0, "CompletionQueue::next with nothing outstanding");
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->done.wait(lock, [&] { return !state_->finished.empty(); });
  auto [id, error] = state_->finished.front();
  state_->finished.pop_front();
  --outstanding_;
  if (error) std::rethrow_exception(error);
  return id;
}

}  // namespace caravan
