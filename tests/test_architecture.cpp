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
