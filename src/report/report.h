// `caravan report`: one self-contained HTML page comparing runs and bench results, and the
// same charts as PNG files.
//
// Sources are run directories (RUN_DIR/config.toml and metrics.jsonl, as `caravan train`
// writes them) and bench results (a charts.json, or a directory holding one, as the scripts
// in bench/ write them; format in docs/report.md). The page embeds Chart.js (npm, pinned in
// report/package.json) and report/report.js, which draws every chart from the data block this
// module writes; nothing is fetched when it opens. PNGs come from the same page rendered by
// headless Chromium (report.js's PNG mode).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace caravan::report {

// A run directory as the page's data: {name, path, workers, config: {"section.key": value
// text}, train: {column: [values]}, eval: {column: [values]}, notes: [...]}. A missing value
// in a record is null; a column holding arrays (per-rank numbers) keeps them. A last line cut
// short (a run killed while writing it) is dropped with a note; any other bad line is a
// DataError naming the file and line. ConfigError when `dir` has no metrics.jsonl.
nlohmann::json readRun(const std::string& dir);

// A bench result (charts.json, or a directory with one) as the page's data, checked against
// the format: DataError naming the file and what is wrong.
nlohmann::json readBench(const std::string& path);

// Every source, in order, into the page's data block: {title, generated, sources, runs,
// benches}. Run names are the directory names, made unique with their parents when needed.
nlohmann::json collect(const std::vector<std::string>& sources, const std::string& title);

// Refuses (ConfigError) an output file the page may not replace (core/output_path.h), among them
// the files the report reads from `sources` (a run's metrics.jsonl, config.toml or
// summary.json, a bench's charts.json).
void checkOutputIsNoInput(const std::string& output, const std::vector<std::string>& sources);

// Whether this build carries Chart.js (report/node_modules was installed when it was built).
bool haveChartLibrary();

// The page: CSS, Chart.js, the data block and report.js, inline.
std::string renderHtml(const nlohmann::json& data);

// Renders `html` in headless Chromium ($CARAVAN_CHROMIUM, else chromium or google-chrome on
// PATH) and writes every chart into `dir` as NAME.png. Returns the files written. Throws
// ConfigError when no Chromium is found; IoError when it fails, times out (300 s) or returns
// a chart that is not a PNG. The page draws no chart that has no data.
std::vector<std::string> writePngs(const std::string& html, const std::string& dir);

}  // namespace caravan::report
