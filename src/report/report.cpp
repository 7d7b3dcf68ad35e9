// `caravan report` (see report.h).
#include "report/report.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <openssl/evp.h>
#include <toml++/toml.h>

#include "core/errors.h"
#include "core/files.h"
#include "core/output_path.h"
#include "core/scope_guard.h"
#include "core/subprocess.h"
#include "report/assets.h"
#include "train/metrics.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace caravan::report {
namespace {

std::string readText(const fs::path& path) {
  std::string why;
  std::optional<std::string> text = readRegularFile(path.string(), &why);
  if (!text) throw IoError(fmt::format("cannot read {}: {}", path.string(), why));
  return std::move(*text);
}

// Six significant digits: what a chart can show, and a third of the page's size.
json compact(const json& v) {
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d)) return nullptr;
    // strtod, not stod: a subnormal such as 1e-310 reads back (stod throws out_of_range).
    return std::strtod(fmt::format("{:.6g}", d).c_str(), nullptr);
  }
  if (v.is_array()) {
    json out = json::array();
    for (const auto& e : v) out.push_back(compact(e));
    return out;
  }
  if (v.is_object()) {
    json out = json::object();
    for (const auto& [key, e] : v.items()) out[key] = compact(e);
    return out;
  }
  return v;
}

bool chartable(const json& v) {
  if (v.is_number()) return true;
  if (!v.is_array()) return false;
  for (const auto& e : v) {
    if (!e.is_number() && !e.is_null()) return false;
  }
  return true;
}

// Records of one kind as columns: every numeric (or numeric-array) key, null where a record
// lacks it.
class Columns {
 public:
  void add(const json& record) {
    for (const auto& [key, value] : record.items()) {
      if (!chartable(value)) continue;
      auto it = columns_.find(key);
      if (it == columns_.end()) {
        it = columns_.emplace(key, json::array()).first;
        for (size_t i = 0; i < rows_; ++i) it->second.push_back(nullptr);
      }
      it->second.push_back(compact(value));
    }
    ++rows_;
    for (auto& [key, column] : columns_) {
      while (column.size() < rows_) column.push_back(nullptr);
    }
  }
  json toJson() const {
    json out = json::object();
    for (const auto& [key, column] : columns_) out[key] = column;
    return out;
  }
  size_t rows() const { return rows_; }

 private:
  std::map<std::string, json> columns_;
  size_t rows_ = 0;
};

// A pipeline_timeline record (docs/metrics.md) as the page draws it: {step, schedule,
// micro_batches, stages: [[[action, micro-batch, start_s, end_s], ...], ...]}, or null when it
// does not have that shape (the page then leaves it out with a note).
json timelineOf(const json& record) {
  const auto stages = record.find("stages");
  if (stages == record.end() || !stages->is_array() || stages->empty() || stages->size() > 1024)
    return nullptr;
  json out = {{"step", record.value("step", json())},
              {"schedule", record.value("schedule", json())},
              {"micro_batches", record.value("micro_batches", json())},
              {"stages", json::array()}};
  if (!out["step"].is_number_integer() || !out["schedule"].is_string() ||
      !out["micro_batches"].is_number_integer())
    return nullptr;
  for (const json& stage : *stages) {
    if (!stage.is_array() || stage.size() > 1000000) return nullptr;
    for (const json& span : stage) {
      if (!span.is_array() || span.size() != 4 || !span[0].is_string() ||
          !span[1].is_number_integer() || !span[2].is_number() || !span[3].is_number())
        return nullptr;
    }
    out["stages"].push_back(stage);
  }
  return out;
}

void flatten(const toml::table& table, const std::string& prefix, json& out) {
  for (const auto& [key, node] : table) {
    const std::string name = prefix.empty() ? std::string(key.str())
                                            : prefix + "." + std::string(key.str());
    if (const toml::table* sub = node.as_table()) {
      flatten(*sub, name, out);
    } else if (const auto* s = node.as_string()) {
      out[name] = s->get();
    } else {
      std::ostringstream text;
      node.visit([&text](const auto& n) { text << n; });
      out[name] = text.str();
    }
  }
}

fs::path benchFile(const fs::path& source) {
  return fs::is_directory(source) ? source / "charts.json" : source;
}

void requireArray(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j[key].is_array()) {
    throw DataError(fmt::format("{}: \"{}\" must be an array (format: docs/report.md)", where, key));
  }
}

std::string findChromium() {
  if (const char* env = std::getenv("CARAVAN_CHROMIUM"); env != nullptr && *env != '\0') {
    if (::access(env, X_OK) != 0) {
      throw ConfigError(fmt::format("CARAVAN_CHROMIUM={} is not an executable", env));
    }
    return env;
  }
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    for (const char* name : {"chromium", "chromium-browser", "google-chrome"}) {
      const fs::path candidate = fs::path(dir.empty() ? "." : dir) / name;
      if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    }
  }
  throw ConfigError("caravan report --png draws the charts in headless Chromium, and none was "
                    "found: install it (apt-get install chromium) or set CARAVAN_CHROMIUM");
}

struct Captured {
  int status = -1;  // waitpid status
  std::string out;
  bool timedOut = false;
  bool interrupted = false;  // SIGINT or SIGTERM arrived: the process was killed
};

// Set by SIGINT/SIGTERM while Chromium runs, so the temporary files go with it.
volatile std::sig_atomic_t gInterrupted = 0;
extern "C" void onInterrupt(int) { gInterrupted = 1; }

// Runs `argv` with stdout captured and stderr into `errPath`, in its own process group, killed
// (with its children) after `timeout`.
Captured runCaptured(std::vector<std::string> argv, const std::string& errPath,
                     std::chrono::seconds timeout) {
  std::vector<char*> args = execArgv(argv);
  int pipeFds[2];
  if (::pipe2(pipeFds, O_CLOEXEC) != 0) throw IoError("cannot create a pipe for Chromium");
  const int errFd = ::open(errPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(pipeFds[0]);
    ::close(pipeFds[1]);
    if (errFd >= 0) ::close(errFd);
    throw IoError("cannot fork to start Chromium");
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(pipeFds[1], STDOUT_FILENO);
    if (errFd >= 0) ::dup2(errFd, STDERR_FILENO);
    ::close(pipeFds[0]);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(pipeFds[1]);
  if (errFd >= 0) ::close(errFd);
  Captured c;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  char buffer[65536];
  bool exited = false, eof = false;
  // Until the output ends or the process itself exits (a helper it leaves behind may hold the
  // pipe open), whichever is first; then what is left in the pipe.
  while (!eof && !exited) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      c.timedOut = true;
      break;
    }
    if (gInterrupted) {
      c.interrupted = true;
      break;
    }
    pollfd p{pipeFds[0], POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 200)));
    if (ready > 0) {
      const ssize_t n = ::read(pipeFds[0], buffer, sizeof(buffer));
      if (n > 0) c.out.append(buffer, static_cast<size_t>(n));
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) eof = true;
    }
    exited = ::waitpid(pid, &c.status, WNOHANG) == pid;
  }
  if (exited && !eof) {
    ::fcntl(pipeFds[0], F_SETFL, O_NONBLOCK);
    ssize_t n;
    while ((n = ::read(pipeFds[0], buffer, sizeof(buffer))) > 0) {
      c.out.append(buffer, static_cast<size_t>(n));
    }
  }
  ::close(pipeFds[0]);
  ::kill(-pid, SIGKILL);  // on a timeout, and any helper it left behind
  if (!exited) {
    while (::waitpid(pid, &c.status, 0) < 0 && errno == EINTR) {
    }
  }
  return c;
}

// The bytes of a base64 text (a PNG data URL's, padded as canvas.toDataURL writes it).
std::string decodeBase64(const std::string& in) {
  // EVP_DecodeBlock takes whole groups of 4 characters and decodes the padding ('=') to zero
  // bytes, which are cut off after.
  const size_t padding = in.size() - (in.find_last_not_of('=') + 1);  // npos + 1 is 0
  std::string out(in.size() / 4 * 3, '\0');
  const int n = in.size() % 4 == 0 && padding <= 2
                    ? EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                      reinterpret_cast<const unsigned char*>(in.data()),
                                      static_cast<int>(in.size()))
                    : -1;
  if (n < 0) throw IoError("Chromium returned a chart that is not base64");
  out.resize(static_cast<size_t>(n) - padding);
  return out;
}

std::string lastLine(const std::string& path) {
  std::ifstream in(path);
  std::string line, lastNonEmpty;
  while (std::getline(in, line)) {
    if (!line.empty()) lastNonEmpty = line;
  }
  return lastNonEmpty;
}

// The text between <pre id="ID"> and </pre> of Chromium's dumped DOM, or nullopt. The last
// one: the page appends it after its scripts, whose text the dump holds too.
std::optional<std::string> preText(const std::string& dom, const std::string& id) {
  const std::string open = "<pre id=\"" + id + "\">";
  const size_t start = dom.rfind(open);
  if (start == std::string::npos) return std::nullopt;
  const size_t end = dom.find("</pre>", start);
  if (end == std::string::npos) return std::nullopt;
  return dom.substr(start + open.size(), end - start - open.size());
}

// The bench format (docs/report.md); json::exception for a value of another type.
void checkBench(const json& bench, const std::string& where) {
  if (!bench.is_object() || bench.value("format", "") != "caravan-bench-1") {
    throw DataError(
        fmt::format("{} is not a bench result: it needs \"format\": "
                    "\"caravan-bench-1\" (docs/report.md)",
                    where));
  }
  requireArray(bench, "charts", where);
  for (size_t i = 0; i < bench["charts"].size(); ++i) {
    const json& c = bench["charts"][i];
    const std::string at = fmt::format("{}: charts[{}]", where, i);
    if (!c.is_object() || !c.contains("title") || !c["title"].is_string()) {
      throw DataError(at + ": needs a \"title\" string (docs/report.md)");
    }
    requireArray(c, "series", at);
    const bool bar = c.value("type", "line") == "bar";
    if (bar) requireArray(c, "labels", at);
    auto numbers = [](const json& values) {
      return std::all_of(values.begin(), values.end(),
                         [](const json& v) { return v.is_number() || v.is_null(); });
    };
    for (const auto& s : c["series"]) {
      if (!s.is_object() || !s.contains("name") || !s.contains("y") || !s["y"].is_array() ||
          (!bar && (!s.contains("x") || !s["x"].is_array() || s["x"].size() != s["y"].size())) ||
          (bar && s["y"].size() != c["labels"].size())) {
        throw DataError(at +
                        ": every series needs a \"name\" and \"y\" (and for a line chart "
                        "an \"x\" as long as \"y\"; for a bar chart one y per label)");
      }
      if (!numbers(s["y"]) || (!bar && !numbers(s["x"]))) {
        throw DataError(at + ": a series' x and y hold numbers or null only");
      }
    }
  }
}

}  // namespace

json readRun(const std::string& dirName) {
  const fs::path dir(dirName);
  const fs::path metricsPath = dir / "metrics.jsonl";
  if (!fs::is_regular_file(metricsPath)) {
    throw ConfigError(fmt::format("{} has no metrics.jsonl: caravan report takes run directories "
                                  "(as caravan train --run-dir writes them) and bench results "
                                  "(charts.json)",
                                  dirName));
  }
  json run = {{"path", dirName}, {"notes", json::array()}, {"config", json::object()}};
  const std::string text = readText(metricsPath);
  Columns train, eval;
  for (const MetricsLine& line : readMetricsLines(text)) {
    if (line.cut) {
      run["notes"].push_back(
          fmt::format("metrics.jsonl line {} is cut short; left out", line.number));
      continue;
    }
    if (!line.problem.empty()) {
      throw DataError(fmt::format("{}:{} {}; repair or remove that line", metricsPath.string(),
                                  line.number, line.problem));
    }
    const auto kind = line.record.find("kind");
    if (kind == line.record.end() || !kind->is_string()) continue;  // not a record of ours
    if (*kind == "train") train.add(line.record);
    if (*kind == "eval") eval.add(line.record);
    if (*kind == "pipeline_timeline") {  // the last one is drawn
      json timeline = timelineOf(line.record);
      if (timeline.is_null()) {
        run["notes"].push_back(fmt::format(
            "metrics.jsonl line {}: a pipeline_timeline record of another shape; left out",
            line.number));
      } else {
        run["pipeline_timeline"] = std::move(timeline);
      }
    }
  }
  if (train.rows() == 0 && eval.rows() == 0) {
    run["notes"].push_back("no train or eval records yet (a run that stopped before its first "
                           "train.log_every steps)");
  }
  run["train"] = train.toJson();
  run["eval"] = eval.toJson();
  int64_t workers = 1;
  if (run["train"].contains("workers")) {
    for (const auto& w : run["train"]["workers"]) {
      if (w.is_number_integer() && w.get<int64_t>() > 0) workers = w.get<int64_t>();
    }
  } else if (run["train"].contains("rank_compute_s")) {
    for (const auto& w : run["train"]["rank_compute_s"]) {
      if (w.is_array()) workers = static_cast<int64_t>(w.size());
    }
  }
  run["workers"] = workers;
  // parallel.layout = auto: the chosen layout and its prediction, drawn against the measured.
  const fs::path layoutPath = dir / "layout.json";
  if (fs::is_regular_file(layoutPath)) {
    const json layout = json::parse(readText(layoutPath), nullptr, false);
    if (layout.is_object() && layout.contains("chosen") && layout["chosen"].is_object()) {
      const json& c = layout["chosen"];
      run["layout"] = {{"name", c.value("name", "")},
                       {"predicted_samples_per_s", c.value("predicted_samples_per_s", 0.0)},
                       {"memory_bytes", c.value("memory_bytes", int64_t{0})},
                       {"reasons", c.value("reasons", "")}};
    } else {
      run["notes"].push_back("layout.json does not parse; the layout's prediction not shown");
    }
  }
  const fs::path configPath = dir / "config.toml";
  if (fs::is_regular_file(configPath)) {
    try {
      json flat = json::object();
      flatten(toml::parse_file(configPath.string()), "", flat);
      run["config"] = flat;
    } catch (const toml::parse_error& e) {
      run["notes"].push_back(fmt::format("config.toml does not parse ({}); configs not shown",
                                         e.description()));
    }
  } else {
    run["notes"].push_back("no config.toml");
  }
  return run;
}

json readBench(const std::string& source) {
  const fs::path path = benchFile(source);
  if (path.filename() == "metrics.jsonl") {
    throw ConfigError(fmt::format("{} is a run's metrics: give caravan report its run directory "
                                  "({})",
                                  source, path.parent_path().string()));
  }
  if (!fs::is_regular_file(path)) {
    throw ConfigError(fmt::format("{} is neither a run directory (metrics.jsonl) nor a bench "
                                  "result (charts.json)",
                                  source));
  }
  json bench;
  try {
    bench = json::parse(readText(path));
  } catch (const json::exception& e) {  // parse_error; out_of_range for a number such as 1e400
    throw DataError(fmt::format("{} is not JSON ({}); rerun the bench that wrote it", path.string(),
                                boundedQuote(e.what(), 200)));
  }
  const std::string where = path.string();
  try {
    checkBench(bench, where);
  } catch (const json::exception& e) {  // a value of another type than the format's
    throw DataError(fmt::format("{} does not follow the bench format ({}); see docs/report.md",
                                where, boundedQuote(e.what(), 200)));
  }
  if (!bench.contains("name")) {
    const fs::path parent = fs::absolute(path).parent_path();
    bench["name"] = parent.filename().string();
  }
  return compact(bench);
}

void checkOutputIsNoInput(const std::string& output, const std::vector<std::string>& sources) {
  // What the page reads: the sources, and in a source directory the files collect() opens.
  std::vector<std::string> inputs;
  std::error_code ec;
  for (const std::string& source : sources) {
    inputs.push_back(source);
    if (!fs::is_directory(source, ec)) continue;
    for (const char* name :
         {"metrics.jsonl", "config.toml", "summary.json", "charts.json", "layout.json"}) {
      inputs.push_back((fs::path(source) / name).string());
    }
  }
  checkOutputPath({"--output", output}, inputs);
}

json collect(const std::vector<std::string>& sources, const std::string& title) {
  if (sources.empty()) {
    throw ConfigError("caravan report needs at least one RUN_DIR or bench result");
  }
  json runs = json::array(), benches = json::array();
  std::vector<fs::path> runPaths;
  for (const std::string& source : sources) {
    if (!fs::exists(source)) {
      throw ConfigError(fmt::format("{} does not exist", source));
    }
    if (fs::is_directory(source) && !fs::exists(fs::path(source) / "charts.json")) {
      fs::path p = fs::absolute(source).lexically_normal();
      if (p.filename().empty()) p = p.parent_path();  // "run/" as "run"
      if (std::find(runPaths.begin(), runPaths.end(), p) != runPaths.end()) {
        throw ConfigError(fmt::format("{} is given twice", source));
      }
      runs.push_back(readRun(source));
      runPaths.push_back(p);
    } else {
      benches.push_back(readBench(source));
    }
  }
  // Names: the directory's own; where two are alike, each of those with as many parents as it
  // takes to tell them apart.
  auto nameAt = [](const fs::path& p, size_t depth) {
    std::vector<std::string> parts;
    for (const auto& part : p) {
      if (!part.empty() && part != "/") parts.push_back(part.string());
    }
    std::string name;
    for (size_t k = parts.size() > depth ? parts.size() - depth : 0; k < parts.size(); ++k) {
      name += (name.empty() ? "" : "/") + parts[k];
    }
    return name;
  };
  std::vector<size_t> depth(runPaths.size(), 1);
  for (bool deeper = true; deeper;) {
    deeper = false;
    std::map<std::string, std::vector<size_t>> byName;
    for (size_t i = 0; i < runPaths.size(); ++i) byName[nameAt(runPaths[i], depth[i])].push_back(i);
    for (const auto& [name, members] : byName) {
      if (members.size() < 2) continue;
      for (size_t i : members) {
        if (nameAt(runPaths[i], depth[i] + 1) != name) {  // a parent is left to add
          ++depth[i];
          deeper = true;
        }
      }
    }
  }
  for (size_t i = 0; i < runPaths.size(); ++i) runs[i]["name"] = nameAt(runPaths[i], depth[i]);
  std::time_t now = std::time(nullptr);
  char stamp[64];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M:%S %Z", std::localtime(&now));
  return {{"title", title.empty() ? "Caravan report" : title}, {"generated", stamp},
          {"sources", sources}, {"runs", runs}, {"benches", benches}};
}

bool haveChartLibrary() { return !assets::chartJs().empty(); }

std::string renderHtml(const json& data) {
  if (!haveChartLibrary()) {
    throw ConfigError("this caravan was built without Chart.js: run `npm ci --prefix report` in "
                      "the source tree (scripts/setup.sh does) and rebuild");
  }
  // The data block may hold any text (config values, paths). Outside strings JSON has no <,
  // > or &, so each is written as its \u escape, which JSON reads the same: no "</script>",
  // "<!--" or "<script" can change where the HTML parser ends the element.
  const std::string dumped = data.dump(-1, ' ', false, json::error_handler_t::replace);
  std::string block;
  block.reserve(dumped.size() + dumped.size() / 64);
  for (const char c : dumped) {
    if (c == '<') {
      block += "\\u003c";
    } else if (c == '>') {
      block += "\\u003e";
    } else if (c == '&') {
      block += "\\u0026";
    } else {
      block += c;
    }
  }
  std::string chartJs(assets::chartJs());
  if (const size_t map = chartJs.rfind("//# sourceMappingURL="); map != std::string::npos) {
    chartJs.erase(map);  // the page is self-contained: no source map to look for
  }
  std::string html;
  html.reserve(block.size() + chartJs.size() + 65536);
  html += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  html += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  html += "<title>Caravan report</title>\n<style>\n";
  html += assets::reportCss();
  html += "</style>\n</head>\n<body>\n<h1 id=\"title\"></h1>\n<p id=\"generated\"></p>\n";
  html += "<main id=\"content\"></main>\n";
  html += "<script type=\"application/json\" id=\"caravan-data\">";
  html += block;
  html += "</script>\n<script>\n";
  html += chartJs;
  html += "\n</script>\n<script>\n";
  html += assets::reportJs();
  html += "\n</script>\n</body>\n</html>\n";
  return html;
}

std::vector<std::string> writePngs(const std::string& html, const std::string& dirName) {
  const std::string chromium = findChromium();
  std::string tmpl = (fs::temp_directory_path() / "caravan-report-XXXXXX").string();
  if (::mkdtemp(tmpl.data()) == nullptr) {
    throw IoError(fmt::format("cannot create a temporary directory like {} (set TMPDIR)", tmpl));
  }
  const fs::path tmp(tmpl);
  const auto cleanup = onScopeExit([tmp] {
    std::error_code ec;
    fs::remove_all(tmp, ec);
  });
  const fs::path page = tmp / "report.html";
  writeFileAtomic(page.string(), html);
  // Flags: no sandbox (root), no GPU, and none of the background connections a closed
  // network refuses. The virtual-time budget lets the page finish before the DOM is dumped.
  const std::vector<std::string> argv = {
      chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
      "--user-data-dir=" + (tmp / "profile").string(), "--window-size=1000,1000",
      "--virtual-time-budget=60000", "--dump-dom", "file://" + page.string() + "#png"};
  const std::string errPath = (tmp / "chromium.log").string();
  Captured c;
  {
    // Chromium runs in its own process group, so the terminal's Ctrl-C reaches only caravan:
    // SIGINT and SIGTERM are caught while it runs, the previous handlers back after.
    gInterrupted = 0;
    const ScopedSignalHandler interrupts({SIGINT, SIGTERM}, onInterrupt);
    c = runCaptured(argv, errPath, std::chrono::seconds(300));
  }
  if (c.interrupted) {
    throw Error(ExitCode::kInterrupted, "interrupted while Chromium drew the charts; no PNG written");
  }
  const std::string fix = "check that it starts (" + chromium +
                          " --headless --dump-dom about:blank) or set CARAVAN_CHROMIUM";
  if (c.timedOut) {
    throw IoError(fmt::format("{} did not finish drawing within 300 s; {}", chromium, fix));
  }
  if (!WIFEXITED(c.status) || WEXITSTATUS(c.status) != 0) {
    throw IoError(fmt::format("{} failed ({}; its last words: {}); {}", chromium,
                              WIFEXITED(c.status) ? fmt::format("exit {}", WEXITSTATUS(c.status))
                                                  : std::string("killed by a signal"),
                              lastLine(errPath), fix));
  }
  if (const auto errors = preText(c.out, "caravan-errors")) {
    throw IoError("the report page failed in Chromium: " + *errors);
  }
  const auto charts = preText(c.out, "caravan-png");
  if (!charts) {
    throw IoError(fmt::format("{} returned no charts (the page did not finish; its last words: "
                              "{}); {}",
                              chromium, lastLine(errPath), fix));
  }
  std::error_code ec;
  fs::create_directories(dirName, ec);
  if (ec) throw IoError(fmt::format("cannot create {}: {}", dirName, ec.message()));
  std::vector<std::string> written;
  std::istringstream lines(*charts);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t space = line.find(' ');
    if (space == std::string::npos) continue;
    const std::string name = line.substr(0, space);
    if (name.find('/') != std::string::npos || name.rfind('.', 0) == 0) {
      throw IoError(fmt::format("{} returned a chart named '{}'; not written", chromium, name));
    }
    const std::string png = decodeBase64(line.substr(space + 1));
    if (png.size() < 8 || png.compare(1, 3, "PNG") != 0) {
      throw IoError(fmt::format("chart {} did not draw in Chromium", name));
    }
    const std::string path = (fs::path(dirName) / name).string();
    writeFileAtomic(path, png);
    written.push_back(path);
  }
  return written;
}

}  // namespace caravan::report
