// A serial task thread returning Works (see comm_thread.h).
#include "comm/comm_thread.h"

#include <future>

#include <fmt/format.h>

#include "comm/comm_util.h"

namespace caravan {
namespace {

class TaskWork : public Work {
 public:
  TaskWork(std::string what, std::shared_future<void> done)
      : what_(std::move(what)), done_(std::move(done)) {}
  void wait(std::chrono::milliseconds timeout) override {
    if (done_.wait_for(comm::atLeastOneMs(timeout)) != std::future_status::ready) {
      throw PeerError(
          fmt::format("{} did not complete within {}", what_, comm::formatDuration(timeout)));
    }
    done_.get();
  }
  bool isCompleted() override {
    return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

 private:
  std::string what_;
  std::shared_future<void> done_;
};

}  // namespace

CommThread::CommThread() : thread_([this] { run(); }) {}

CommThread::~CommThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

WorkPtr CommThread::submit(std::string what, std::function<void()> task) {
  auto promise = std::make_shared<std::promise<void>>();
  std::shared_future<void> done = promise->get_future().share();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back([promise, task = std::move(task)] {
      try {
        task();
        promise->set_value();
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    });
  }
  wake_.notify_all();
  return std::make_shared<TaskWork>(std::move(what), std::move(done));
}

void CommThread::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    auto task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    task();
    lock.lock();
  }
}

}  // namespace caravan
