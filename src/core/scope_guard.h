// onScopeExit(f): runs `f` when the returned guard leaves scope, however it leaves (return or
// exception), in place of a one-off struct with a destructor. `f` must not throw.
//   auto closeFd = onScopeExit([fd] { ::close(fd); });
#pragma once

#include <utility>

namespace caravan {

template <typename F>
class [[nodiscard]] ScopeGuard {
 public:
  explicit ScopeGuard(F f) : f_(std::move(f)) {}
  ~ScopeGuard() { f_(); }
  ScopeGuard(const ScopeGuard&) = delete;
  ScopeGuard& operator=(const ScopeGuard&) = delete;

 private:
  F f_;
};

template <typename F>
ScopeGuard<F> onScopeExit(F f) {
  return ScopeGuard<F>(std::move(f));  // guaranteed elision: the guard is never copied
}

}  // namespace caravan
