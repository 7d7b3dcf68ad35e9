// libFuzzer target: the config loader (src/core/config.cpp), TOML text plus --set overrides.
//
// Input: TOML text, then optionally NUL-separated overrides ("key=value", at most 8):
//   <toml text> \0 <override 1> \0 <override 2> ...
// A config that loads must print (toToml) as TOML that loads again to the same config.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/config.h"
#include "fuzz_util.h"

namespace {

constexpr size_t kMaxOverrides = 8;

// Seed mode: a dictionary of every schema key and section (libFuzzer -dict) and override
// seeds; scripts/fuzz.sh adds configs/*.toml.
void writeSeeds(const std::string& dir) {
  using caravan::Config;
  std::set<std::string> tokens;
  for (const auto& o : Config::schema()) {
    const std::string section = o.key.substr(0, o.key.find('.'));
    tokens.insert(o.key);
    tokens.insert(o.key.substr(section.size() + 1));
    tokens.insert("[" + section + "]");
    for (const auto& c : o.choices) tokens.insert("\"" + c + "\"");
  }
  for (const char* t :
       {"=", "\"", "'", "'''", "\"\"\"", "[[", "]]", "{", "}", ",", "#", "\n", "true", "false",
        "inf", "nan", "-inf", "+nan", "1e300", "0x7fffffffffffffff", "-9223372036854775808",
        "1979-05-27T07:32:00Z", "\\u0000", "\\U0001F600"}) {
    tokens.insert(t);
  }
  std::ofstream dict(std::filesystem::path(dir).parent_path() /
                     (std::filesystem::path(dir).filename().string() + ".dict"));
  for (const auto& t : tokens) {
    std::string escaped;
    for (char c : t) {
      if (c == '"' || c == '\\') escaped += '\\';
      if (c == '\n') {
        escaped += "\\x0A";
        continue;
      }
      escaped += c;
    }
    dict << "\"" << escaped << "\"\n";
  }
  using namespace std::string_literals;
  caravan::fuzz::writeSeed(dir, "overrides-1",
                           "[optim]\nlr = 0.1\n\0optim.name=adamw\0data.dataset=brown"s);
  caravan::fuzz::writeSeed(dir, "overrides-2",
                           "\0sync.mode=ps-ssp\0sync.staleness=2\0memory.budget=\"1GiB\""s
                           "\0train.epochs=3\0model.dropout=0.5\0optim.nesterov=true"s);
  caravan::fuzz::writeSeed(dir, "inline-tables",
                           "optim = { lr = 1e-3, name = \"adamw\" }\n[model]\nname = 'gpt'\n"
                           "depth = 2\n[sync]\ncompression = \"topk\"\ntopk_ratio = 0.5\n");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  return caravan::fuzz::initialize(writeSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t textEnd = input.find('\0');
  const std::string text = input.substr(0, textEnd);
  std::vector<std::string> overrides;
  for (size_t pos = textEnd; pos != std::string::npos && overrides.size() < kMaxOverrides;) {
    const size_t next = input.find('\0', pos + 1);
    overrides.push_back(input.substr(pos + 1, next == std::string::npos ? next : next - pos - 1));
    pos = next;
  }

  caravan::fuzz::runGuarded("config", [&] {
    const caravan::Config config = caravan::Config::fromString(text, "<fuzz>", overrides);
    // The resolved config (`caravan config`, RUN_DIR/config.toml) must load back unchanged.
    const std::string printed = config.toToml();
    std::string again;
    try {
      again = caravan::Config::fromString(printed, "<printed>").toToml();
    } catch (const caravan::Error& e) {
      std::fprintf(stderr, "\nfuzz config: the printed config does not load: %s\n%s\n", e.what(),
                   printed.c_str());
      std::abort();
    }
    if (again != printed) {
      std::fprintf(stderr, "\nfuzz config: printing is not stable:\n%s\n--- reloaded ---\n%s\n",
                   printed.c_str(), again.c_str());
      std::abort();
    }
  });
  return 0;
}
