// The layering docs/architecture.md draws, checked on the sources: a file includes headers of
// its own layer and of layers below it only.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

// The layers in the order of the "## Layers" block: lines that start with "name/".
std::vector<std::string> documentedLayers() {
  std::ifstream in(std::string(CARAVAN_SOURCE_DIR) + "/docs/architecture.md");
  std::vector<std::string> layers;
  bool inLayers = false, inBlock = false;
  const std::regex layerLine("^([a-z]+)/ ");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("## ", 0) == 0) inLayers = line == "## Layers";
    if (!inLayers) continue;
    if (line.rfind("```", 0) == 0) {
      if (inBlock) break;
      inBlock = true;
      continue;
    }
    std::smatch m;
    if (inBlock && std::regex_search(line, m, layerLine)) layers.push_back(m[1]);
  }
  return layers;
}

}  // namespace

TEST(Architecture, NoLayerIncludesALayerAboveIt) {
  const std::vector<std::string> layers = documentedLayers();
  ASSERT_GE(layers.size(), 8u) << "docs/architecture.md lost its ## Layers block";
  std::map<std::string, size_t> rank;
  for (size_t i = 0; i < layers.size(); ++i) rank[layers[i]] = i;
  const fs::path src = fs::path(CARAVAN_SOURCE_DIR) / "src";
  const std::regex include("^#include \"([a-z_]+)/[^\"]+\"");
  int files = 0;
  for (const auto& dir : fs::directory_iterator(src)) {
    if (!dir.is_directory()) continue;
    const std::string layer = dir.path().filename();
    ASSERT_EQ(rank.count(layer), 1u) << "src/" << layer << "/ is not in docs/architecture.md";
    for (const auto& file : fs::directory_iterator(dir.path())) {
      std::ifstream in(file.path());
      ++files;
      int lineNo = 0;
      for (std::string line; std::getline(in, line);) {
        ++lineNo;
        std::smatch m;
        if (!std::regex_search(line, m, include)) continue;
        const std::string target = m[1];
        ASSERT_EQ(rank.count(target), 1u) << file.path() << ":" << lineNo << " " << line;
        EXPECT_LE(rank[target], rank[layer])
            << file.path().lexically_relative(src) << ":" << lineNo << " includes " << target
            << "/, a layer above " << layer << "/";
      }
    }
  }
  EXPECT_GT(files, 50);
}

// Library code tells the user things through core/log.h's one sink (which the CLI, tests and
// an embedding program control), never by writing to the process's streams itself.
TEST(Architecture, LibraryCodeWritesMessagesOnlyThroughTheLogSink) {
  const fs::path src = fs::path(CARAVAN_SOURCE_DIR) / "src";
  const std::regex direct(R"(fprintf\(stderr|std::cerr|std::cout|\bputs\(|\bperror\()");
  for (const auto& file : fs::recursive_directory_iterator(src)) {
    const fs::path rel = file.path().lexically_relative(src);
    if (!file.is_regular_file() || *rel.begin() == "cli" || rel == "core/log.cpp") continue;
    std::ifstream in(file.path());
    int lineNo = 0;
    for (std::string line; std::getline(in, line);) {
      ++lineNo;
      EXPECT_FALSE(std::regex_search(line, direct)) << rel << ":" << lineNo << ": " << line;
    }
  }
}

namespace {

// The lines of src/`path`.
std::vector<std::string> sourceLines(const std::string& path) {
  std::ifstream in(fs::path(CARAVAN_SOURCE_DIR) / "src" / path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

// The training loop drives a step engine (train/step_engine.h) and never asks which: a data-
// parallel step, a pipeline stage and, later, a sharded step are engines, not branches of the
// loop. Neither the word "pipeline" nor any engine's or strategy's type appears in it.
TEST(Architecture, TheTrainingLoopDoesNotBranchOnTheKindOfStep) {
  const std::regex word("pipeline", std::regex::icase);
  const std::regex type(
      R"(PipelineStep|DataParallelStep|\bStrategy\b|strategy_|SyncMode|sync\.mode|isDiloco|dynamic_cast)");
  int lines = 0;
  for (const std::string file : {"train/trainer.cpp", "train/trainer.h", "train/metrics_window.cpp",
                                 "train/metrics_window.h"}) {
    int lineNo = 0;
    for (const std::string& line : sourceLines(file)) {
      ++lineNo;
      ++lines;
      EXPECT_FALSE(std::regex_search(line, word) || std::regex_search(line, type))
          << file << ":" << lineNo << ": " << line;
    }
  }
  EXPECT_GT(lines, 500) << "train/trainer.cpp moved: point this test at the training loop";
}

// Functions in train/ stay short enough to read at once: none is over 80 lines. A function is
// a definition at column 0 whose body closes at column 0 (the house style, clang-format's).
TEST(Architecture, NoFunctionInTrainIsOver80Lines) {
  const fs::path train = fs::path(CARAVAN_SOURCE_DIR) / "src" / "train";
  const std::regex definition(R"(^[A-Za-z~][^;]*\()");
  const std::regex notAFunction(R"(^(namespace|struct|class|enum|using|template|typedef)\b)");
  int functions = 0;
  for (const auto& entry : fs::directory_iterator(train)) {
    const std::string file = "train/" + entry.path().filename().string();
    const std::vector<std::string> lines = sourceLines(file);
    for (size_t i = 0; i < lines.size(); ++i) {
      if (!std::regex_search(lines[i], definition) || std::regex_search(lines[i], notAFunction))
        continue;
      size_t open = i;  // the signature's last line ends with the body's brace
      while (open < lines.size() && open < i + 8 && lines[open].back() != '{' &&
             lines[open].back() != ';')
        ++open;
      if (open >= lines.size() || lines[open].empty() || lines[open].back() != '{') continue;
      size_t close = open + 1;
      while (close < lines.size() && lines[close].rfind('}', 0) != 0) ++close;
      ++functions;
      EXPECT_LE(close - i + 1, 80u) << file << ":" << i + 1 << ": " << lines[i];
      i = close;
    }
  }
  EXPECT_GT(functions, 100);
}
