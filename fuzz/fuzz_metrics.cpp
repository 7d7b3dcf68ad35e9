// libFuzzer target: the metrics.jsonl reader (src/train/metrics.cpp readMetricsLines) and both
// of its users, a resumed run's MetricsSink and `caravan report`'s readRun.
//
// Input: byte 0 is the checkpoint step a resume keeps up to (0-255); the rest is the file.
// Properties checked, beyond "only a caravan::Error escapes":
// - the lines read are the file's lines, in order, each a view of the text;
// - a resume keeps every line but a cut last one and records of later steps, byte for byte and
//   in order, and what it keeps reads back with no cut line;
// - a report of a file whose only problem is a cut last line succeeds.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "report/assets.h"
#include "report/report.h"
#include "train/metrics.h"

// readRun needs none of the page's files; report.cpp's other functions link against these.
namespace caravan::report::assets {
std::string_view chartJs() { return ""; }
std::string_view reportJs() { return ""; }
std::string_view reportCss() { return ""; }
}  // namespace caravan::report::assets

namespace {

void fail(const char* what) {
  std::fprintf(stderr, "\nfuzz metrics: %s\n", what);
  std::abort();
}

std::string readBack(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void writeSeeds(const std::string& dir) {
  using caravan::fuzz::writeSeed;
  const std::string run =
      "{\"kind\":\"train\",\"step\":10,\"loss\":2.5,\"time_s\":1.0,\"rank_compute_s\":[0.1,0.2],"
      "\"workers\":2}\n{\"kind\":\"eval\",\"step\":10,\"accuracy\":0.5,\"loss\":1.9}\n"
      "{\"kind\":\"train\",\"step\":20,\"loss\":1.25,\"comm_s\":0.01,\"lr\":1e-310}\n";
  writeSeed(dir, "run", std::string(1, '\x0f') + run);
  writeSeed(dir, "cut", std::string(1, '\x0a') + run + "{\"kind\":\"train\",\"st");
  writeSeed(dir, "foreign", std::string(1, '\x05') + "# a note\n\n" + run + "[1,2]\n");
  writeSeed(dir, "pipeline",
            std::string(1, '\x0f') + run +
                "{\"kind\":\"pipeline_timeline\",\"step\":3,\"schedule\":\"1f1b\","
                "\"micro_batches\":2,\"stages\":[[[\"F\",0,0.0,0.5],[\"B\",0,1.0,2.0]],"
                "[[\"recv-act\",0,0.0,0.5]]]}\n");
  std::ofstream dict(dir + ".dict");
  for (const char* token : {"\"kind\"",
                            "\"train\"",
                            "\"eval\"",
                            "\"step\"",
                            "\"workers\"",
                            "\"rank_compute_s\"",
                            "\"pipeline_timeline\"",
                            "\"stages\"",
                            "\"schedule\"",
                            "\"micro_batches\"",
                            "1e400",
                            "-1",
                            "18446744073709551615",
                            "\\ud800",
                            "\\n",
                            "{",
                            "}",
                            "[",
                            "]",
                            "null"}) {
    dict << '"';
    for (const char* c = token; *c != '\0'; ++c)
      dict << (*c == '"' || *c == '\\' ? "\\" : "") << *c;
    dict << "\"\n";
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) { return caravan::fuzz::initialize(writeSeeds); }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int64_t keepUpTo = data[0];
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  namespace fs = std::filesystem;
  static const std::string dir = caravan::fuzz::scratchPath("metrics-run");
  static const std::string path = dir + "/metrics.jsonl";
  fs::create_directories(dir);

  const auto lines = caravan::readMetricsLines(text);
  std::string joined;
  bool cutSeen = false;
  for (const auto& line : lines) {
    if (cutSeen) fail("a cut line that is not the last");
    cutSeen = line.cut;
    if (line.text.data() < text.data() ||
        line.text.data() + line.text.size() > text.data() + text.size())
      fail("a line outside the text");
    if (!line.record.is_null() && (!line.record.is_object() || !line.problem.empty()))
      fail("a record that is not an object, or has a problem");
    if (line.problem.size() > 260) fail("an unbounded problem");
    joined.append(line.text).push_back('\n');
  }
  if (joined != text && joined != text + "\n") fail("the lines are not the file's");

  caravan::fuzz::writeFile(path, text.data(), text.size());
  caravan::fuzz::runGuarded("metrics", [&] {
    { caravan::MetricsSink sink(path, keepUpTo); }
    const std::string kept = readBack(path);
    size_t from = 0;  // each kept line is the next one of the input's it keeps
    for (const auto& line : caravan::readMetricsLines(kept)) {
      if (line.cut) fail("a resume kept a cut line");
      bool found = false;
      for (; from < lines.size() && !found; ++from) found = lines[from].text == line.text;
      if (!found) fail("a resume kept a line not in the input, or out of order");
    }
  });

  caravan::fuzz::writeFile(path, text.data(), text.size());
  bool onlyCut = true;
  for (const auto& line : lines) onlyCut = onlyCut && (line.cut || line.problem.empty());
  bool read = false;
  caravan::fuzz::runGuarded("metrics", [&] {
    caravan::report::readRun(dir);
    read = true;
  });
  if (onlyCut && !read) fail("a report refused a file with no damaged line");
  return 0;
}
