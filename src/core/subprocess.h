// What the places that start child processes share: cli/launcher.cpp (the workers of
// `caravan train --workers N`), report/report.cpp (headless Chromium for `caravan report --png`)
// and cli/export_model.cpp (the project's Python).
//
// Only the pieces that are the same in each: how they fork, wait and take signals differ on
// purpose (the launcher blocks its signals and waits for them with sigtimedwait, across many
// workers; the report polls Chromium's output pipe with a deadline and a handler's flag).
// Threading: execArgv any thread; ScopedSignalHandler changes process-wide dispositions, so
// create it on the main thread.
#pragma once

#include <signal.h>

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace caravan {

// The null-terminated array execv/execve take, pointing into `strings` (which must outlive it,
// unchanged). Made before fork(): between fork and exec the child may only make
// async-signal-safe calls, so it allocates nothing.
std::vector<char*> execArgv(std::vector<std::string>& strings);

// Sets the disposition of each of `signals` to `handler` (a function, SIG_DFL or SIG_IGN) for
// the object's lifetime (no flags, no signals blocked in the handler); the previous ones are
// restored when it goes.
class ScopedSignalHandler {
 public:
  ScopedSignalHandler(std::initializer_list<int> signals, void (*handler)(int));
  ~ScopedSignalHandler();
  ScopedSignalHandler(const ScopedSignalHandler&) = delete;
  ScopedSignalHandler& operator=(const ScopedSignalHandler&) = delete;

 private:
  std::vector<std::pair<int, struct sigaction>> previous_;
};

}  // namespace caravan
