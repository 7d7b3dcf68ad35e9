// Heartbeat and failure diagnosis (see liveness.h).
#include "comm/liveness.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "comm/comm_util.h"
#include "core/log.h"

namespace caravan {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string key(int rank) { return fmt::format("caravan/hb/{}", rank); }
const std::string kLostKey = "caravan/lost";

// One rank's published beat: "<beat> <step> <state>[ <reason>]".
struct Beat {
  int64_t beat = 0;
  int64_t step = -1;
  std::string state;  // "run" | "left"
  std::string reason;
};

std::optional<Beat> parse(const std::vector<uint8_t>& raw) {
  std::istringstream in(std::string(raw.begin(), raw.end()));
  Beat b;
  if (!(in >> b.beat >> b.step >> b.state)) return std::nullopt;
  std::getline(in, b.reason);
  if (!b.reason.empty() && b.reason.front() == ' ') b.reason.erase(0, 1);
  return b;
}

// Every other rank's beat, or nullopt for a rank that has not written one. Throws what the
// store throws.
std::map<int, std::optional<Beat>> readAll(c10d::Store& store, int self, int size) {
  std::map<int, std::optional<Beat>> out;
  for (int r = 0; r < size; ++r) {
    if (r == self) continue;
    out[r] = store.check({key(r)}) ? parse(store.get(key(r))) : std::nullopt;
  }
  return out;
}

std::string joinLines(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

}  // namespace

Heartbeat::Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                     HeartbeatOptions options)
    : store_(std::move(store)), rank_(rank), size_(size), options_(std::move(options)) {
  publish("run");  // before the first collective, so no rank is ever seen without a beat
  thread_ = std::thread([this] { run(); });
}

Heartbeat::~Heartbeat() {
  leave("finished");
  if (!options_.hostsStore || storeLost_) return;
  // Keep the store up until every other rank left or is lost, so that ranks still diagnosing
  // a failure can read the beats (bounded by linger).
  const auto deadline = Clock::now() + options_.linger;
  std::map<int, std::pair<int64_t, Clock::time_point>> lastChange;  // rank -> (beat, when)
  while (Clock::now() < deadline) {
    bool waiting = false;
    try {
      for (const auto& [r, b] : readAll(*store_, rank_, size_)) {
        if ((b && b->state == "left") || knownLost_.count(r) != 0) continue;
        const int64_t beat = b ? b->beat : -1;
        auto it = lastChange.find(r);
        if (it == lastChange.end() || it->second.first != beat) {
          lastChange[r] = {beat, Clock::now()};
          waiting = true;
        } else if (Clock::now() - it->second.second < options_.window) {
          waiting = true;
        }
      }
    } catch (const std::exception&) {
      return;
    }
    if (!waiting) return;
    std::this_thread::sleep_for(options_.interval / 2);
  }
}

void Heartbeat::publish(const std::string& state) {
  const std::string value = fmt::format("{} {} {}", ++beat_, step_.load(), state);
  store_->set(key(rank_), std::vector<uint8_t>(value.begin(), value.end()));
}

void Heartbeat::setProgressProbe(std::function<CollectiveProgress()> probe) {
  std::lock_guard<std::mutex> lock(mutex_);
  probe_ = std::move(probe);
}

void Heartbeat::reportStall(const CollectiveProgress& p) {
  // Two reads of every beat two intervals apart (this rank beating in between, as the others
  // do while they report too): who has not reached the collective, and whose beat stood
  // still (stopped, or cut off from the store).
  // Called without mutex_ (leave() may take it meanwhile and cut the wait short).
  auto first = readAll(*store_, rank_, size_);
  for (int i = 0; i < 2; ++i) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (wake_.wait_for(lock, options_.interval, [this] { return stop_; })) return;
    publish(fmt::format("run c{}", p.issued));
  }
  auto second = readAll(*store_, rank_, size_);
  std::vector<std::string> behind, silent;
  for (const auto& [r, b] : second) {
    if (!b) {
      behind.push_back(fmt::format("rank {} (no heartbeat yet)", r));
      continue;
    }
    int64_t issued = -1;
    std::istringstream words(b->reason);
    for (std::string w; words >> w;) {
      if (w.size() > 1 && w[0] == 'c') issued = std::atoll(w.c_str() + 1);
    }
    if (b->state == "run" && issued >= 0 && issued < p.waitingIn) {
      behind.push_back(fmt::format("rank {} (at collective #{}, last completed step {})", r,
                                   issued, b->step));
    }
    if (first[r] && first[r]->beat == b->beat && b->state == "run") {
      silent.push_back(fmt::format("rank {}", r));
    }
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string out;
    for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
    return out;
  };
  std::string line =
      fmt::format("stall: rank {} has waited {:.0f} s in collective #{} ({}) after step {}; ",
                  rank_, p.waitedSeconds, p.waitingIn, p.what, step_.load());
  line += behind.empty() ? std::string("every rank has issued it")
                         : "not reached by " + join(behind);
  if (!silent.empty()) {
    line += fmt::format("; no heartbeat from {} for {:.1f} s", join(silent),
                        2.0 * std::chrono::duration<double>(options_.interval).count());
  }
  logLine(line);
}

void Heartbeat::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, options_.interval, [this] { return stop_; });
    if (stop_) break;
    try {
      const CollectiveProgress progress = probe_ ? probe_() : CollectiveProgress{};
      publish(probe_ ? fmt::format("run c{}", progress.issued) : std::string("run"));
      if (options_.stallReport.count() > 0 && progress.waitingIn > reportedStall_ &&
          progress.waitedSeconds * 1000.0 >= static_cast<double>(options_.stallReport.count())) {
        reportedStall_ = progress.waitingIn;
        lock.unlock();
        reportStall(progress);
        lock.lock();
      }
      if (store_->check({kLostKey})) {
        const auto v = store_->get(kLostKey);
        std::lock_guard<std::mutex> loss(lossMutex_);
        publishedLoss_.assign(v.begin(), v.end());
      }
    } catch (const std::exception&) {
      storeLost_ = true;  // nothing to beat into; diagnose() says so
      return;
    }
  }
}

void Heartbeat::leave(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) return;
    stop_ = true;
    leftReason_ = joinLines(reason);
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (storeLost_) return;
  try {
    publish("left " + leftReason_);
  } catch (const std::exception&) {
    storeLost_ = true;
  }
}

std::vector<RankStatus> Heartbeat::diagnose() {
  std::map<int, RankStatus> status;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) status[r].rank = r;
  }
  std::map<int, int64_t> firstBeat;  // -1: no beat yet
  const auto start = Clock::now();
  bool first = true;
  for (;;) {
    std::map<int, std::optional<Beat>> beats;
    try {
      beats = readAll(*store_, rank_, size_);
    } catch (const std::exception&) {
      storeLost_ = true;
      break;
    }
    bool undecided = false;
    for (auto& [r, s] : status) {
      const std::optional<Beat>& b = beats[r];
      if (b) s.lastStep = b->step;
      if (b && b->state == "left") {
        s.state = RankStatus::State::kLeft;
        s.reason = b->reason;
        continue;
      }
      const int64_t beat = b ? b->beat : -1;
      if (first) firstBeat[r] = beat;
      if (s.state == RankStatus::State::kAlive) continue;
      if (beat != firstBeat[r]) {
        s.state = RankStatus::State::kAlive;
      } else {
        undecided = true;
      }
    }
    first = false;
    if (!undecided) break;
    if (Clock::now() - start >= options_.window) {
      for (auto& [r, s] : status) {
        if (s.state == RankStatus::State::kUnknown) s.state = RankStatus::State::kLost;
      }
      break;
    }
    std::this_thread::sleep_for(options_.interval / 4);
  }
  std::vector<RankStatus> out;
  for (auto& [r, s] : status) {
    if (s.state == RankStatus::State::kLost) knownLost_.insert(r);
    out.push_back(s);
  }
  return out;
}

std::string Heartbeat::explain(const std::string& seen) {
  const std::vector<RankStatus> statuses = diagnose();
  auto after = [](int64_t step) {
    return step < 0 ? std::string("it had reported no completed step")
                    : fmt::format("it last reported step {}", step);
  };
  auto role = [this](int r) { return r < options_.workers ? "worker" : "server"; };
  std::vector<std::string> parts;
  if (storeLost_ && !options_.storeOnRank0) {
    parts.push_back(fmt::format("the rendezvous store {} stopped answering",
                                options_.storeAddress));
  } else if (storeLost_ && !options_.hostsStore) {
    parts.push_back(fmt::format("rank 0 ({}, host of the rendezvous store {}) is lost: the store "
                                "stopped answering",
                                role(0), options_.storeAddress));
  }
  for (const RankStatus& s : statuses) {
    if (s.state == RankStatus::State::kLost) {
      parts.push_back(fmt::format("rank {} ({}) is lost: no heartbeat for {} ({})", s.rank,
                                  role(s.rank), comm::formatDuration(options_.window),
                                  after(s.lastStep)));
    }
  }
  if (parts.empty()) {
    // Nobody lost: name the first rank that left with an error of its own.
    for (const RankStatus& s : statuses) {
      if (s.state == RankStatus::State::kLeft && s.reason != "finished") {
        parts.push_back(fmt::format("rank {} ({}) failed ({}): {}", s.rank, role(s.rank),
                                    after(s.lastStep), s.reason));
        break;
      }
    }
  }
  std::string found;
  for (const auto& p : parts) found += p + "; ";
  if (!parts.empty() && !storeLost_) {
    // Tell the ranks still blocked in a collective what was lost, before the store goes.
    try {
      store_->set(kLostKey, std::vector<uint8_t>(found.begin(), found.end()));
    } catch (const std::exception&) {
    }
  }
  {
    // The store went silent, but another rank had already named the loss: trust that.
    std::lock_guard<std::mutex> loss(lossMutex_);
    if (storeLost_ && !publishedLoss_.empty()) found = publishedLoss_;
  }
  if (found.empty()) return seen;
  std::string out = found;
  // The communication errors start "rank <self>: "; say it as what this rank saw.
  const std::string self = fmt::format("rank {}: ", rank_);
  const std::string what = seen.rfind(self, 0) == 0 ? seen.substr(self.size()) : seen;
  return out + fmt::format("rank {} saw: {}", rank_, what);
}

}  // namespace caravan
