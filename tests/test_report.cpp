// `caravan report` (src/report/): what it reads from run directories and bench results, how
// it refuses bad input, that data cannot break out of the page, and the page itself drawing
// every chart of two real runs in headless Chromium (report/browser_check.mjs).
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "report/report.h"
#include "test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace caravan;
using caravan::test::CommandResult;
using caravan::test::readFile;
using caravan::test::runCaravan;
using caravan::test::TempDir;
using caravan::test::writeFile;

namespace {

std::string metricsLines() {
  return R"({"kind":"train","step":10,"loss":2.5,"time_s":1.0,"rank_compute_s":[0.1,0.2]}
{"kind":"eval","step":10,"accuracy":0.5,"loss":1.9,"time_s":1.5}
{"kind":"train","step":20,"loss":1.25,"time_s":2.0,"comm_s":0.01,"rank_compute_s":[0.1,0.3]}
)";
}

void makeRun(const std::string& dir, const std::string& metrics,
             const std::string& config = "[optim]\nlr = 0.5\n[data]\npath = \"/d\"\n") {
  fs::create_directories(dir);
  writeFile(dir + "/metrics.jsonl", metrics);
  writeFile(dir + "/config.toml", config);
}

template <typename E>
std::string expectThrows(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

}  // namespace

TEST(ReportData, RunColumnsKeepEveryRecordAndMarkWhatIsMissing) {
  TempDir tmp;
  makeRun(tmp / "run", metricsLines());
  const json run = report::readRun(tmp / "run");
  EXPECT_EQ(run["train"]["step"], json({10, 20}));
  EXPECT_EQ(run["train"]["loss"], json({2.5, 1.25}));
  EXPECT_EQ(run["train"]["comm_s"], json({nullptr, 0.01}));  // absent from the first record
  EXPECT_EQ(run["train"]["rank_compute_s"], json({{0.1, 0.2}, {0.1, 0.3}}));
  EXPECT_FALSE(run["train"].contains("kind"));  // text is not a chartable column
  EXPECT_EQ(run["eval"]["accuracy"], json({0.5}));
  EXPECT_EQ(run["workers"], 2);  // from the per-rank columns when records lack "workers"
  EXPECT_EQ(run["config"]["optim.lr"], "0.5");
  EXPECT_EQ(run["config"]["data.path"], "/d");
  EXPECT_TRUE(run["notes"].empty());
}

// The last pipeline_timeline record of the shape docs/metrics.md gives is drawn; one of another
// shape is left out with a note naming its line (never an error: it loses no other record).
TEST(ReportData, APipelineTimelineOfAnotherShapeIsLeftOutWithANote) {
  TempDir tmp;
  const std::string good =
      R"({"kind":"pipeline_timeline","step":3,"schedule":"1f1b","micro_batches":2,)"
      R"("stages":[[["F",0,0.0,0.5],["B",0,1.0,2.0]],[["recv-act",0,0.0,0.5],["F",0,0.5,0.9]]]})"
      "\n";
  makeRun(tmp / "run",
          metricsLines() + good +
              R"({"kind":"pipeline_timeline","step":4,"schedule":"1f1b","micro_batches":2,)"
              R"("stages":[[["F","zero",0.0,0.5]]]})"
              "\n");
  const json run = report::readRun(tmp / "run");
  ASSERT_TRUE(run.contains("pipeline_timeline"));
  EXPECT_EQ(run["pipeline_timeline"]["step"], 3);
  EXPECT_EQ(run["pipeline_timeline"]["stages"][1][1], json({"F", 0, 0.5, 0.9}));
  ASSERT_EQ(run["notes"].size(), 1u);
  EXPECT_NE(run["notes"][0].get<std::string>().find(
                "line 5: a pipeline_timeline record of another shape"),
            std::string::npos)
      << run["notes"];
  EXPECT_EQ(run["train"]["step"], json({10, 20}));
}

// parallel.layout = auto: the run's layout.json gives the page the chosen layout's prediction;
// one that does not parse is left out with a note.
TEST(ReportData, ARunsLayoutPredictionIsReadBesideItsRecords) {
  TempDir tmp;
  makeRun(tmp / "run", metricsLines());
  writeFile(tmp / "run/layout.json",
            R"j({"format":"caravan-layout-1","chosen":{"name":"allreduce+pipeline(2x4)",)j"
            R"j("predicted_samples_per_s":812.5,"memory_bytes":1024,"reasons":"2 stages"}})j");
  const json run = report::readRun(tmp / "run");
  ASSERT_TRUE(run.contains("layout"));
  EXPECT_EQ(run["layout"]["name"], "allreduce+pipeline(2x4)");
  EXPECT_EQ(run["layout"]["predicted_samples_per_s"], 812.5);
  EXPECT_TRUE(run["notes"].empty());
  writeFile(tmp / "run/layout.json", "{not json");
  const json damaged = report::readRun(tmp / "run");
  EXPECT_FALSE(damaged.contains("layout"));
  ASSERT_EQ(damaged["notes"].size(), 1u);
}

TEST(ReportData, NumbersKeepSixSignificantDigits) {
  TempDir tmp;
  makeRun(tmp / "run", R"({"kind":"train","step":1,"loss":0.123456789012,"time_s":12345.678901})"
                       "\n");
  const json run = report::readRun(tmp / "run");
  EXPECT_DOUBLE_EQ(run["train"]["loss"][0].get<double>(), 0.123457);
  EXPECT_DOUBLE_EQ(run["train"]["time_s"][0].get<double>(), 12345.7);
}

TEST(ReportData, SubnormalAndHugeNumbersReadBack) {
  TempDir tmp;
  makeRun(tmp / "run", R"({"kind":"train","step":1,"lr":1e-310,"loss":1e300})" "\n");
  const json run = report::readRun(tmp / "run");
  EXPECT_GT(run["train"]["lr"][0].get<double>(), 0.0);
  EXPECT_LT(run["train"]["lr"][0].get<double>(), 1e-300);
  EXPECT_DOUBLE_EQ(run["train"]["loss"][0].get<double>(), 1e300);
}

TEST(ReportData, ALastLineCutShortIsLeftOutWithANote) {
  TempDir tmp;
  makeRun(tmp / "run", metricsLines() + R"({"kind":"train","step":30,"lo)");
  const json run = report::readRun(tmp / "run");
  EXPECT_EQ(run["train"]["step"], json({10, 20}));
  ASSERT_EQ(run["notes"].size(), 1u);
  EXPECT_NE(run["notes"][0].get<std::string>().find("line 4 is cut short"), std::string::npos);
}

TEST(ReportData, ADamagedLineIsRefusedNamingFileAndLine) {
  TempDir tmp;
  makeRun(tmp / "run", "{\"kind\":\"train\",\"step\":1,\"loss\":1}\nnot json\n{\"kind\":\"train\"}\n");
  const std::string what = expectThrows<DataError>([&] { report::readRun(tmp / "run"); });
  EXPECT_NE(what.find("metrics.jsonl:2 is not JSON"), std::string::npos) << what;
  makeRun(tmp / "run2", "[1, 2]\n");
  const std::string what2 = expectThrows<DataError>([&] { report::readRun(tmp / "run2"); });
  EXPECT_NE(what2.find("metrics.jsonl:1 is not a JSON object"), std::string::npos) << what2;
}

TEST(ReportData, SourcesThatAreNeitherRunsNorBenchesAreRefused) {
  TempDir tmp;
  fs::create_directories(tmp / "empty");
  makeRun(tmp / "run", metricsLines());
  const std::string what =
      expectThrows<ConfigError>([&] { report::collect({tmp / "empty"}, ""); });
  EXPECT_NE(what.find("has no metrics.jsonl"), std::string::npos) << what;
  expectThrows<ConfigError>([&] { report::collect({tmp / "absent"}, ""); });
  expectThrows<ConfigError>([&] { report::collect({}, ""); });
  const std::string direct =
      expectThrows<ConfigError>([&] { report::collect({tmp / "run/metrics.jsonl"}, ""); });
  EXPECT_NE(direct.find("give caravan report its run directory"), std::string::npos) << direct;
  const std::string twice =
      expectThrows<ConfigError>([&] { report::collect({tmp / "run", tmp / "run/"}, ""); });
  EXPECT_NE(twice.find("is given twice"), std::string::npos) << twice;
  writeFile(tmp / "other.json", "{\"a\": 1}");
  const std::string bench =
      expectThrows<DataError>([&] { report::collect({tmp / "other.json"}, ""); });
  EXPECT_NE(bench.find("caravan-bench-1"), std::string::npos) << bench;
}

TEST(ReportData, BenchResultsAreCheckedAgainstTheFormat) {
  TempDir tmp;
  const json good = {
      {"format", "caravan-bench-1"},
      {"title", "t"},
      {"charts",
       {{{"title", "line"}, {"series", {{{"name", "a"}, {"x", {1, 2}}, {"y", {3, nullptr}}}}}},
        {{"title", "bar"},
         {"type", "bar"},
         {"labels", {"p", "q"}},
         {"series", {{{"name", "b"}, {"y", {1, 2}}}}}}}}};
  fs::create_directories(tmp / "mybench");
  writeFile(tmp / "mybench/charts.json", good.dump());
  const json b = report::readBench(tmp / "mybench");
  EXPECT_EQ(b["name"], "mybench");  // the directory's name when the file gives none
  EXPECT_EQ(b["charts"].size(), 2u);

  auto refused = [&](json bad, const std::string& expected) {
    writeFile(tmp / "bad.json", bad.dump());
    const std::string what = expectThrows<DataError>([&] { report::readBench(tmp / "bad.json"); });
    EXPECT_NE(what.find(expected), std::string::npos) << what;
  };
  json noCharts = good;
  noCharts.erase("charts");
  refused(noCharts, "\"charts\" must be an array");
  json shortX = good;
  shortX["charts"][0]["series"][0]["x"] = {1};
  refused(shortX, "charts[0]: every series needs");
  json shortBar = good;
  shortBar["charts"][1]["series"][0]["y"] = {1, 2, 3};
  refused(shortBar, "charts[1]: every series needs");
  json text = good;
  text["charts"][0]["series"][0]["x"] = {"1", "2"};
  refused(text, "numbers or null only");
  json noTitle = good;
  noTitle["charts"][0].erase("title");
  refused(noTitle, "charts[0]: needs a \"title\"");
  writeFile(tmp / "bad.json", "{\"format\": ");
  expectThrows<DataError>([&] { report::readBench(tmp / "bad.json"); });
}

TEST(ReportData, RunNamesAreMadeUniqueWithTheirParents) {
  TempDir tmp;
  makeRun(tmp / "a/run", metricsLines());
  makeRun(tmp / "b/run", metricsLines());
  makeRun(tmp / "c/other", metricsLines());
  makeRun(tmp / "x/a/deep", metricsLines());
  makeRun(tmp / "y/a/deep", metricsLines());
  const json data = report::collect(
      {tmp / "a/run", tmp / "b/run/", tmp / "c/other", tmp / "x/a/deep", tmp / "y/a/deep"}, "T");
  EXPECT_EQ(data["runs"][0]["name"], "a/run");
  EXPECT_EQ(data["runs"][1]["name"], "b/run");
  EXPECT_EQ(data["runs"][2]["name"], "other");  // no clash: its own name only
  EXPECT_EQ(data["runs"][3]["name"], "x/a/deep");
  EXPECT_EQ(data["runs"][4]["name"], "y/a/deep");
  EXPECT_EQ(data["title"], "T");
  const json one = report::collect({tmp / "c/other"}, "");
  EXPECT_EQ(one["runs"][0]["name"], "other");
}

TEST(ReportPage, DataCannotCloseItsScriptElement) {
  if (!report::haveChartLibrary()) GTEST_SKIP() << "built without report/node_modules";
  TempDir tmp;
  // A closing tag, and "<!--<script>", which puts the HTML parser in the state where the real
  // </script> no longer ends the element (the rest of the page would become data).
  for (const std::string hostile :
       {std::string("</script><script>alert(1)</script>"), std::string("<!--<script>"),
        std::string("a & b > c")}) {
    makeRun(tmp / "run", metricsLines(), "[data]\npath = \"" + hostile + "\"\n");
    const json data = report::collect({tmp / "run"}, hostile);
    const std::string html = report::renderHtml(data);
    const std::string open = "<script type=\"application/json\" id=\"caravan-data\">";
    const size_t start = html.find(open) + open.size();
    const size_t end = html.find("</script>", start);
    const std::string block = html.substr(start, end - start);
    EXPECT_EQ(block.find_first_of("<>&"), std::string::npos) << hostile;
    // The block reads back as the same data.
    const json back = json::parse(block);
    EXPECT_EQ(back["runs"][0]["config"]["data.path"], hostile);
    EXPECT_EQ(back["title"], hostile);
    // Three scripts close: the data block, Chart.js and report.js; nothing else.
    size_t closes = 0;
    for (size_t at = html.find("</script>"); at != std::string::npos;
         at = html.find("</script>", at + 1)) {
      ++closes;
    }
    EXPECT_EQ(closes, 3u) << hostile;
    EXPECT_EQ(html.find("sourceMappingURL"), std::string::npos);  // nothing to fetch
  }
}

TEST(ReportCli, BadSourcesExitNonZeroInOneLineAndWriteNothing) {
  TempDir tmp;
  makeRun(tmp / "good", metricsLines());
  makeRun(tmp / "damaged", "{\"kind\":\"train\"}\n{oops\n{\"kind\":\"train\"}\n");
  const std::string out = tmp / "r.html";
  CommandResult r = runCaravan("report " + (tmp / "good") + " " + (tmp / "missing") + " -o " + out);
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
  r = runCaravan("report " + (tmp / "good") + " " + (tmp / "damaged") + " -o " + out);
  EXPECT_EQ(r.exitCode, 3) << r.err;
  EXPECT_NE(r.err.find("metrics.jsonl:2 is not JSON"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out));
  r = runCaravan("report");
  EXPECT_EQ(r.exitCode, 2) << r.err;
}

// JSON of a surprising shape or size is a data error naming the file (and line), in one
// bounded line; a path that cannot be looked at is an I/O error naming it. None is an
// "internal error".
TEST(ReportCli, OddJsonIsOneBoundedLineNamingTheFileNeverAnInternalError) {
  TempDir tmp;
  struct Case {
    std::string what, metrics;
    int exitCode;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"a number past double's range", "{\"kind\":\"train\",\"loss\":1e400}\n", 3,
       "metrics.jsonl:1 is not JSON"},
      {"a 2 MB unterminated string",
       "{\"kind\":\"train\"}\n{\"kind\":\"" + std::string(2 << 20, 'a') + "\n", 3,
       "metrics.jsonl:2 is not JSON"},
      {"invalid UTF-8", "{\"kind\":\"tr\xff\xfein\"}\n", 3, "metrics.jsonl:1 is not JSON"},
  };
  for (const Case& c : cases) {
    makeRun(tmp / "run", c.metrics);
    const CommandResult r = runCaravan("report " + (tmp / "run") + " -o " + (tmp / "r.html"));
    EXPECT_EQ(r.exitCode, c.exitCode) << c.what << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.what;
    EXPECT_LT(r.err.size(), 600u) << c.what;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << c.what << ": " << r.err;
    EXPECT_FALSE(fs::exists(tmp / "r.html")) << c.what;
  }
  // Records whose fields have other types than Caravan writes are not Caravan's records: a
  // "kind" that is a number is skipped, a "workers" of 1e300 is not a worker count.
  makeRun(tmp / "typed",
          "{\"kind\":5,\"step\":1}\n{\"kind\":\"train\",\"step\":2,"
          "\"loss\":1,\"workers\":1e300}\n");
  const json run = report::readRun(tmp / "typed");
  EXPECT_EQ(run["train"]["step"], json({2}));
  EXPECT_EQ(run["workers"], 1);
  // Bench results: a "format" or chart "type" of another type.
  writeFile(tmp / "format.json", "{\"format\": 5}");
  writeFile(tmp / "type.json",
            "{\"format\":\"caravan-bench-1\",\"charts\":[{\"title\":\"t\","
            "\"type\":3,\"series\":[]}]}");
  writeFile(tmp / "huge.json", "[1e400]");
  for (const std::string name : {"format.json", "type.json", "huge.json"}) {
    const CommandResult r = runCaravan("report " + (tmp / name) + " -o " + (tmp / "r.html"));
    EXPECT_EQ(r.exitCode, 3) << name << ": " << r.err;
    EXPECT_NE(r.err.find(tmp / name), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
  }
  // A symbolic-link loop where a source should be.
  fs::create_symlink(tmp / "loop-b", tmp / "loop-a");
  fs::create_symlink(tmp / "loop-a", tmp / "loop-b");
  const CommandResult loop = runCaravan("report " + (tmp / "loop-a") + " -o " + (tmp / "r.html"));
  EXPECT_EQ(loop.exitCode, 5) << loop.err;
  EXPECT_NE(loop.err.find("caravan: error: " + (tmp / "loop-a") + ": Too many levels of symbolic"),
            std::string::npos)
      << loop.err;
}

// The page never overwrites what it reads: an --output that is one of a run's files (or a
// bench result) is refused before anything is written, and the file is left as it was.
TEST(ReportCli, AnOutputThatIsAnInputIsRefusedAndLeftAlone) {
  TempDir tmp;
  makeRun(tmp / "run", metricsLines());
  fs::create_directories(tmp / "run/checkpoints");
  writeFile(tmp / "run/checkpoints/step-00000004.ckpt", "a checkpoint");
  writeFile(tmp / "run/model.pt", "weights");
  // Every file of a run given as a source (the probe overwrote a checkpoint and model.pt).
  for (const std::string& name :
       {"metrics.jsonl", "config.toml", "checkpoints/step-00000004.ckpt", "model.pt"}) {
    const std::string target = tmp / ("run/" + name);
    const std::string before = readFile(target);
    const CommandResult r = runCaravan("report " + (tmp / "run") + " -o " + target);
    EXPECT_EQ(r.exitCode, 2) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("is a file of the run"), std::string::npos) << r.err;
    EXPECT_EQ(readFile(target), before) << name;
  }
  // A bench result named as the output, from outside any run directory.
  writeFile(tmp / "bench.json", "{}");
  const CommandResult bench = runCaravan("report " + (tmp / "run") + " " + (tmp / "bench.json") +
                                         " -o " + (tmp / "bench.json"));
  EXPECT_EQ(bench.exitCode, 2) << bench.err;
  EXPECT_EQ(readFile(tmp / "bench.json"), "{}");
  // What is not a regular file is not replaced by one (the page is renamed over its output:
  // /dev/null became a regular file when run as root).
  ASSERT_EQ(::mkfifo((tmp / "fifo").c_str(), 0600), 0);
  fs::create_symlink(tmp / "run/model.pt", tmp / "link.html");
  for (const std::string name : {"fifo", "link.html"}) {
    const CommandResult r = runCaravan("report " + (tmp / "run") + " -o " + (tmp / name));
    EXPECT_EQ(r.exitCode, 2) << r.err;
    EXPECT_NE(r.err.find("is not a regular file"), std::string::npos) << r.err;
  }
  EXPECT_TRUE(fs::is_fifo(tmp / "fifo"));
  EXPECT_TRUE(fs::is_symlink(tmp / "link.html"));
  EXPECT_EQ(readFile(tmp / "run/model.pt"), "weights");
  // Beside the inputs is fine.
  const CommandResult ok =
      runCaravan("report " + (tmp / "run") + " -o " + (tmp / "run/report.html"));
  EXPECT_EQ(ok.exitCode, 0) << ok.err;
}

// The whole path: three real short runs (one process; two workers; two pipeline stages), one page,
// opened in headless Chromium where every chart must draw with no console error and no request
// leaving the page; a screenshot is kept; the same charts as PNG files.
TEST(ReportBrowser, ThreeRealRunsDrawEveryChartInChromium) {
  const bool ci = std::getenv("CI") != nullptr;
  const fs::path checker = fs::path(CARAVAN_SOURCE_DIR) / "report/browser_check.mjs";
  const bool ready = report::haveChartLibrary() && std::system("command -v node >/dev/null") == 0 &&
                     fs::exists("/usr/bin/chromium") &&
                     fs::exists(fs::path(CARAVAN_SOURCE_DIR) / "report/node_modules/playwright-core");
  if (!ready) {
    if (ci) FAIL() << "CI must have node, chromium and report/node_modules (scripts/setup.sh)";
    GTEST_SKIP() << "needs node, chromium and `npm ci --prefix report` (scripts/setup.sh)";
  }
  TempDir tmp;
  const std::string common =
      " -c " + std::string(CARAVAN_SOURCE_DIR) +
      "/configs/fmnist-mlp.toml --quiet --set train.max_steps=60 --set train.log_every=5 "
      "--set train.eval_every=20 --set train.eval_batches=2 --set train.threads=1 "
      "--set checkpoint.every=0";
  CommandResult r = runCaravan("train --run-dir " + (tmp / "one") + common);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  r = runCaravan("train --workers 2 --run-dir " + (tmp / "two") + common);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  r = runCaravan("train --workers 2 --run-dir " + (tmp / "pipe") + common +
                 " --set parallel.pipeline_stages=2 --set parallel.micro_batches=4");
  ASSERT_EQ(r.exitCode, 0) << r.err;
  // The pipeline's timeline: both stages' forwards and backwards of the 4 micro-batches, each
  // action within the step and after the one before it on its stage.
  const json pipe = report::readRun(tmp / "pipe");
  ASSERT_TRUE(pipe.contains("pipeline_timeline")) << pipe["notes"];
  EXPECT_EQ(pipe["pipeline_timeline"]["step"], 3);
  ASSERT_EQ(pipe["pipeline_timeline"]["stages"].size(), 2u);
  for (const json& stage : pipe["pipeline_timeline"]["stages"]) {
    int forwards = 0, backwards = 0;
    double last = 0.0;
    for (const json& span : stage) {
      forwards += span[0] == "F";
      backwards += span[0] == "B";
      EXPECT_GE(span[2].get<double>(), last - 1e-9) << span;
      EXPECT_GE(span[3].get<double>(), span[2].get<double>()) << span;
      last = span[3].get<double>();
    }
    EXPECT_EQ(forwards, 4);
    EXPECT_EQ(backwards, 4);
  }
  // The two-worker run's records carry both workers' numbers, rank 0's equal to its own.
  const json two = report::readRun(tmp / "two");
  ASSERT_TRUE(two["train"].contains("rank_compute_s"));
  for (size_t i = 0; i < two["train"]["step"].size(); ++i) {
    const json& ranks = two["train"]["rank_compute_s"][i];
    ASSERT_EQ(ranks.size(), 2u);
    EXPECT_EQ(two["train"]["rank_sync_wait_s"][i].size(), 2u);
    EXPECT_NEAR(ranks[0].get<double>(), two["train"]["compute_s"][i].get<double>(),
                1e-5 * two["train"]["compute_s"][i].get<double>());
    EXPECT_EQ(two["train"]["workers"][i], 2);
  }
  EXPECT_TRUE(two["train"].contains("comm_outstanding_s"));
  const std::string page = tmp / "report.html";
  r = runCaravan("report " + (tmp / "one") + " " + (tmp / "two") + " " + (tmp / "pipe") + " -o " +
                 page + " --png " + (tmp / "png"));
  ASSERT_EQ(r.exitCode, 0) << r.err;

  const fs::path artifacts = fs::current_path() / "test-artifacts";
  fs::create_directories(artifacts);
  const std::string shot = (artifacts / "report-two-runs.png").string();
  auto check = [&](const std::string& file, int runs, const std::string& screenshot) {
    TempDir io;
    const std::string cmd = "node " + checker.string() + " " + file + " --runs " +
                            std::to_string(runs) +
                            (screenshot.empty() ? "" : " --screenshot " + screenshot) + " >" +
                            (io / "out") +
                            " 2>" + (io / "err");
    const int status = std::system(cmd.c_str());
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1,
                          readFile(io / "out") + readFile(io / "err"));
  };
  const auto [status, out] = check(page, 3, shot);
  ASSERT_EQ(status, 0) << out;
  const json result = json::parse(out.substr(out.rfind('{', out.rfind("\"ok\""))));
  EXPECT_TRUE(result["ok"].get<bool>()) << out;
  // loss and accuracy (4), throughput, time split, rank skew, per-rank times, the pipeline's
  // timeline, peak and resident memory, memory by category (one run at a time on the page).
  EXPECT_EQ(result["charts"], 12) << out;
  EXPECT_GT(fs::file_size(shot), 50000u);  // a full page, kept for people to look at

  // The PNGs: every chart, and the per-run ones for every run (memory for all three, per-rank
  // times for the two-worker runs, the timeline for the pipeline), each a real PNG.
  std::set<std::string> pngs;
  for (const auto& f : fs::directory_iterator(tmp / "png")) {
    pngs.insert(f.path().filename().string());
    const std::string bytes = readFile(f.path().string());
    EXPECT_EQ(bytes.substr(1, 3), "PNG") << f.path();
    EXPECT_GT(bytes.size(), 10000u) << f.path();
  }
  for (const char* name :
       {"loss-vs-step.png", "accuracy-vs-time.png", "time-split.png", "rank-skew.png",
        "ranks-two.png", "memory-one.png", "memory-two.png", "pipeline-pipe.png"}) {
    EXPECT_TRUE(pngs.count(name)) << name;
  }
  EXPECT_EQ(pngs.size(), 15u);

  // The checker fails a page that logs an error: it is an oracle, not a formality.
  std::string broken = readFile(page);
  broken.insert(broken.rfind("</body>"), "<script>console.error('injected')</script>");
  writeFile(tmp / "broken.html", broken);
  const auto [brokenStatus, brokenOut] = check(tmp / "broken.html", 3, "");
  EXPECT_EQ(brokenStatus, 1) << brokenOut;
  EXPECT_NE(brokenOut.find("console error: injected"), std::string::npos) << brokenOut;
}

// The per-rank columns ride on the agreement of the log steps only; an asynchronous strategy
// agrees only then, so its ranks must still agree on the agreement's size, with log_every not
// dividing the steps and a stop in the middle.
TEST(ReportData, AsynchronousRunsCarryEveryWorkersNumbers) {
  TempDir tmp;
  const std::string common =
      " -c " + std::string(CARAVAN_SOURCE_DIR) +
      "/configs/fmnist-mlp.toml --quiet --set train.max_steps=23 --set train.log_every=5 "
      "--set train.eval_every=0 --set train.eval_batches=2 --set train.threads=1 "
      "--set checkpoint.every=0 --set data.synthetic_size=4096 --set data.dataset=synthetic "
      "--set sync.mode=ps-asp --set sync.servers=1";  // 2 workers + 1 server
  CommandResult r = runCaravan("train --workers 2 --run-dir " + (tmp / "asp") + common);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const json run = report::readRun(tmp / "asp");
  EXPECT_EQ(run["train"]["step"], json({5, 10, 15, 20, 23}));
  for (const json& ranks : run["train"]["rank_compute_s"]) EXPECT_EQ(ranks.size(), 2u);
  r = runCaravan("train --workers 2 --stop-at-step 12 --run-dir " + (tmp / "stopped") + common);
  ASSERT_EQ(r.exitCode, 0) << r.err;  // a stop with a checkpoint, as asked
  r = runCaravan("train --workers 2 --resume " + (tmp / "stopped") + " --quiet");
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const json resumed = report::readRun(tmp / "stopped");
  EXPECT_EQ(resumed["train"]["step"], json({5, 10, 15, 20, 23}));  // stopped at 15, resumed
  for (const json& ranks : resumed["train"]["rank_compute_s"]) EXPECT_EQ(ranks.size(), 2u);
}

// --png with a Chromium that fails, returns garbage, or leaves a helper holding its output
// open: one line and exit 5 each time, at once, and no file outside the directory asked for.
TEST(ReportCli, ChromiumFailuresAreOneLineAndQuick) {
  if (!report::haveChartLibrary()) GTEST_SKIP() << "built without report/node_modules";
  TempDir tmp;
  makeRun(tmp / "run", metricsLines());
  auto withChromium = [&](const std::string& script) {
    const std::string fake = tmp / "chromium";
    writeFile(fake, "#!/bin/sh\n" + script);
    fs::permissions(fake, fs::perms::owner_all);
    ::setenv("CARAVAN_CHROMIUM", fake.c_str(), 1);
    const auto start = std::chrono::steady_clock::now();
    CommandResult r = runCaravan("report " + (tmp / "run") + " --png " + (tmp / "png"));
    ::unsetenv("CARAVAN_CHROMIUM");
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(r.exitCode, 5) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_LT(seconds, 10.0) << r.err;
    return r.err;
  };
  std::string err = withChromium("echo 'cannot open display' >&2; exit 3\n");
  EXPECT_NE(err.find("failed (exit 3; its last words: cannot open display)"), std::string::npos)
      << err;
  EXPECT_NE(err.find("set CARAVAN_CHROMIUM"), std::string::npos) << err;
  err = withChromium("echo '<html></html>'\n");
  EXPECT_NE(err.find("returned no charts"), std::string::npos) << err;
  // A helper that keeps stdout open for 60 s must not hold caravan: it stops with the process.
  err = withChromium("echo '<pre id=\"caravan-png\">loss.png AAAA</pre>'; sleep 60 &\nexit 0\n");
  EXPECT_NE(err.find("chart loss.png did not draw"), std::string::npos) << err;
  err = withChromium("echo '<pre id=\"caravan-png\">../evil.png iVBORw0KGgo=</pre>'\n");
  EXPECT_NE(err.find("not written"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(tmp / "evil.png"));
  ::setenv("CARAVAN_CHROMIUM", (tmp / "absent").c_str(), 1);
  CommandResult r = runCaravan("report " + (tmp / "run") + " --png " + (tmp / "png"));
  ::unsetenv("CARAVAN_CHROMIUM");
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_NE(r.err.find("is not an executable"), std::string::npos) << r.err;
}

// Ctrl-C while Chromium draws: caravan stops it, removes its temporary files, exits 130.
TEST(ReportCli, InterruptedPngStopsChromiumAndLeavesNothing) {
  if (!report::haveChartLibrary()) GTEST_SKIP() << "built without report/node_modules";
  TempDir tmp;
  makeRun(tmp / "run", metricsLines());
  fs::create_directories(tmp / "tmpdir");
  const std::string fake = tmp / "chromium";
  writeFile(fake, "#!/bin/sh\nsleep 60\n");
  fs::permissions(fake, fs::perms::owner_all);
  const std::string cmd = "CARAVAN_CHROMIUM=" + fake + " TMPDIR=" + (tmp / "tmpdir") + " " +
                          std::string(CARAVAN_BINARY) + " report " + (tmp / "run") + " --png " +
                          (tmp / "png") + " 2>" + (tmp / "err") + " & pid=$!; sleep 1; " +
                          "kill -INT $pid; wait $pid; echo $? >" + (tmp / "code");
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(std::system(("bash -c '" + cmd + "'").c_str()), 0);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(readFile(tmp / "code"), "130\n") << readFile(tmp / "err");
  EXPECT_NE(readFile(tmp / "err").find("interrupted while Chromium drew"), std::string::npos)
      << readFile(tmp / "err");
  EXPECT_LT(seconds, 10.0);
  EXPECT_TRUE(fs::is_empty(tmp / "tmpdir"));  // its page, profile and log are gone
  EXPECT_FALSE(fs::exists(tmp / "png"));
}
