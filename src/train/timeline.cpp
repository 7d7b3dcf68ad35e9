// Chrome-trace timeline (see timeline.h).
#include "train/timeline.h"

#include <nlohmann/json.hpp>

#include "core/files.h"

namespace caravan {

Timeline::Timeline(std::string path, int rank) : path_(std::move(path)), rank_(rank), origin_() {}

void Timeline::complete(const std::string& name, TimePoint start, TimePoint end, int track) {
  if (!enabled()) return;
  auto us = [this](TimePoint t) {
    return std::chrono::duration<double, std::micro>(t - origin_).count();
  };
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back({name, us(start), us(end) - us(start), track});
}

void Timeline::flush() {
  if (!enabled()) return;
  nlohmann::json events = nlohmann::json::array();
  const char* tracks[] = {"compute", "communication"};
  for (int t = 0; t < 2; ++t) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", t},
                      {"args", {{"name", tracks[t]}}}});
  }
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank_},
                    {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& e : events_) {
    events.push_back({{"name", e.name}, {"ph", "X"}, {"ts", e.startUs}, {"dur", e.durUs},
                      {"pid", rank_}, {"tid", e.track}});
  }
  writeFileAtomic(path_, nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump());
}

}  // namespace caravan
