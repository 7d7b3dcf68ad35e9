// What starting child processes shares (see subprocess.h).
#include "core/subprocess.h"

namespace caravan {

std::vector<char*> execArgv(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

ScopedSignalHandler::ScopedSignalHandler(std::initializer_list<int> signals, void (*handler)(int)) {
  struct sigaction sa {};
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  for (const int sig : signals) {
    struct sigaction old {};
    ::sigaction(sig, &sa, &old);
    previous_.emplace_back(sig, old);
  }
}

ScopedSignalHandler::~ScopedSignalHandler() {
  for (const auto& [sig, old] : previous_) ::sigaction(sig, &old, nullptr);
}

}  // namespace caravan
