// Config schema validation: unknown keys, wrong types, ranges and overrides, with file lines.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/config.h"
#include "core/errors.h"
#include "core/log.h"

using namespace caravan;

namespace {

// Returns the ConfigError message for parsing `text` (fails the test if nothing is thrown).
std::string configError(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    Config::fromString(text, "test.toml", overrides);
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.exitCode(), 2);
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError for:\n" << text;
  return "";
}

}  // namespace

TEST(Config, DefaultsAndTypedValues) {
  Config c = Config::fromString("[optim]\nlr = 0.5\nname = \"adamw\"\n[train]\nepochs = 3\n",
                                "test.toml");
  EXPECT_DOUBLE_EQ(c.f64("optim.lr"), 0.5);
  EXPECT_EQ(c.str("optim.name"), "adamw");
  EXPECT_EQ(c.i64("train.epochs"), 3);
  EXPECT_EQ(c.i64("data.batch_size"), 64);  // default
  EXPECT_TRUE(c.isSet("optim.lr"));
  EXPECT_FALSE(c.isSet("data.batch_size"));
}

TEST(Config, IntegerAcceptedForFloat) {
  Config c = Config::fromString("[optim]\nlr = 1\n", "test.toml");
  EXPECT_DOUBLE_EQ(c.f64("optim.lr"), 1.0);
}

TEST(Config, UnknownKeyNamesKeyAndLine) {
  std::string m = configError("[optim]\nlr = 0.1\nlrr = 0.2\n");
  EXPECT_NE(m.find("test.toml:3"), std::string::npos) << m;
  EXPECT_NE(m.find("optim.lrr"), std::string::npos) << m;
  EXPECT_NE(m.find("lr"), std::string::npos) << m;
}

TEST(Config, UnknownSectionAndTopLevelKey) {
  std::string m = configError("\n[optimizer]\nlr = 0.1\n");
  EXPECT_NE(m.find("test.toml:2"), std::string::npos) << m;
  EXPECT_NE(m.find("[optimizer]"), std::string::npos) << m;
  m = configError("lr = 0.1\n");
  EXPECT_NE(m.find("test.toml:1"), std::string::npos) << m;
}

TEST(Config, WrongTypeNamesKeyAndLine) {
  std::string m = configError("[train]\n\nepochs = \"five\"\n");
  EXPECT_NE(m.find("test.toml:3"), std::string::npos) << m;
  EXPECT_NE(m.find("train.epochs must be an integer"), std::string::npos) << m;
  m = configError("[train]\nepochs = 2.5\n");
  EXPECT_NE(m.find("train.epochs must be an integer"), std::string::npos) << m;
}

TEST(Config, OutOfRangeAndChoices) {
  std::string m = configError("[optim]\nlr = -0.1\n");
  EXPECT_NE(m.find("test.toml:2"), std::string::npos) << m;
  EXPECT_NE(m.find("optim.lr = -0.1 is out of range"), std::string::npos) << m;
  m = configError("[data]\nbatch_size = 0\n");
  EXPECT_NE(m.find("data.batch_size = 0 is out of range"), std::string::npos) << m;
  m = configError("[model]\nname = \"vgg\"\n");
  EXPECT_NE(m.find("model.name = \"vgg\" is not one of"), std::string::npos) << m;
}

TEST(Config, SyntaxErrorHasLine) {
  std::string m = configError("[optim]\nlr = = 3\n");
  EXPECT_NE(m.find("test.toml:2"), std::string::npos) << m;
  EXPECT_NE(m.find("invalid TOML"), std::string::npos) << m;
}

TEST(Config, Overrides) {
  Config c = Config::fromString("[optim]\nlr = 0.5\n", "test.toml",
                                {"optim.lr=0.25", "data.dataset=brown", "optim.nesterov=true",
                                 "data.path=\"/x y\""});
  EXPECT_DOUBLE_EQ(c.f64("optim.lr"), 0.25);
  EXPECT_EQ(c.str("data.dataset"), "brown");
  EXPECT_TRUE(c.flag("optim.nesterov"));
  EXPECT_EQ(c.str("data.path"), "/x y");
  std::string m = configError("", {"optim.lrr=1"});
  EXPECT_NE(m.find("--set optim.lrr=1"), std::string::npos) << m;
  m = configError("", {"train.epochs=abc"});
  EXPECT_NE(m.find("train.epochs must be an integer"), std::string::npos) << m;
  m = configError("", {"novalue"});
  EXPECT_NE(m.find("expected key=value"), std::string::npos) << m;
  // A bare word that is not UTF-8 would print (toToml, RUN_DIR/config.toml) as another string
  // (found by fuzz/fuzz_config.cpp).
  m = configError("", {"memory.budget=\xe4\xce"});
  EXPECT_NE(m.find("--set memory.budget=\xe4\xce: the value is not valid UTF-8"),
            std::string::npos) << m;
  EXPECT_EQ(Config::fromString("", "test.toml", {"data.path=/d\xc3\xa4ta"}).str("data.path"),
            "/d\xc3\xa4ta");
}

TEST(Config, ResolvedTomlRoundTrips) {
  Config a = Config::fromString("[optim]\nlr = 0.125\nname = \"adamw\"\n[model]\nname=\"gpt\"\n",
                                "test.toml", {"data.path=a\"b"});
  Config b = Config::fromString(a.toToml(), "resolved.toml");
  for (const auto& o : Config::schema()) {
    switch (o.type) {
      case ConfigType::kInt: EXPECT_EQ(a.i64(o.key), b.i64(o.key)) << o.key; break;
      case ConfigType::kFloat: EXPECT_EQ(a.f64(o.key), b.f64(o.key)) << o.key; break;
      case ConfigType::kBool: EXPECT_EQ(a.flag(o.key), b.flag(o.key)) << o.key; break;
      case ConfigType::kString: EXPECT_EQ(a.str(o.key), b.str(o.key)) << o.key; break;
    }
  }
  // Strings that toml++'s multi-line or literal forms would not read back (found by
  // fuzz/fuzz_config.cpp).
  for (const std::string path : {"\nx", "x'''y", "a'\n", "t\tab\\\"\x01\xc3\xa4"}) {
    const Config c = Config::fromString("", "test.toml", {"data.path=" + path});
    ASSERT_EQ(c.str("data.path"), path);
    EXPECT_EQ(Config::fromString(c.toToml(), "resolved.toml").str("data.path"), path);
  }
}

TEST(Config, MissingFile) {
  EXPECT_THROW(Config::fromFile("/nonexistent/config.toml"), ConfigError);
}

TEST(Config, ExampleConfigsAreValid) {
  for (const char* name : {"fmnist-mlp", "fmnist-cnn", "fmnist-resnet", "brown-gpt"}) {
    std::string path = std::string(CARAVAN_SOURCE_DIR) + "/configs/" + name + ".toml";
    EXPECT_NO_THROW(Config::fromFile(path)) << path;
  }
}

TEST(Config, DocsMatchSchema) {
  std::ifstream in(std::string(CARAVAN_SOURCE_DIR) + "/docs/config.md");
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find(Config::schemaMarkdown()), std::string::npos)
      << "docs/config.md is stale: regenerate it with caravan config --schema";
}

// CARAVAN_CHECK_EQ/LE/LT name the expression and both values, and evaluate each side once.
TEST(Check, ComparisonFailureNamesBothValues) {
  int calls = 0;
  auto next = [&] { return ++calls; };
  EXPECT_NO_THROW(CARAVAN_CHECK_LE(next(), 1, "first call"));
  EXPECT_EQ(calls, 1);
  try {
    const int64_t rows = 3;
    CARAVAN_CHECK_EQ(rows, int64_t{4}, "rows of {}", "w");
    ADD_FAILURE() << "CARAVAN_CHECK_EQ passed 3 == 4";
  } catch (const caravan::InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("rows == int64_t{4} (3 vs 4) (rows of w)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(CARAVAN_CHECK_LT(2.5, 2.5, "equal"), caravan::InternalError);
}

// Library messages (warnings, stall reports) go to the one installed sink, whole lines, from
// any thread; without one they go to stderr.
TEST(Log, LinesGoToTheInstalledSinkFromAnyThread) {
  std::vector<std::string> lines;
  caravan::LogSink previous =
      caravan::setLogSink([&](const std::string& l) { lines.push_back(l); });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 50; ++i) caravan::logLine("warning: " + std::to_string(t));
    });
  }
  for (auto& th : threads) th.join();
  caravan::setLogSink(std::move(previous));
  ASSERT_EQ(lines.size(), 200u);
  for (const auto& l : lines) EXPECT_EQ(l.rfind("warning: ", 0), 0u) << l;
}

// A --set value is one value: a newline followed by more TOML is refused, not half-applied.
TEST(Config, OverrideWithMoreThanOneValueIsRefused) {
  try {
    Config::fromString("", "<t>", {"data.path=\"x\"\n[model]\nname = \"gpt\""});
    ADD_FAILURE() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("more than one TOML value"), std::string::npos)
        << e.what();
    // One line: the value's line breaks are shown, not printed (they made a 3-line error).
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--set data.path=\"x\"\\n[model]\\nname"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(Config::fromString("", "<t>", {"data.path=\"x\""}).str("data.path"), "x");
}

// [[data.sources]]: read in order, written back by toToml so that a run's config.toml reads
// back the same; each bad table is one line naming the line.
TEST(Config, DataSourcesReadBackAndBadOnesAreNamed) {
  const std::string good =
      "[data]\nbatch_size = 8\n\n[[data.sources]]\npath = \"a b\"\nformat = \"tokens\"\n"
      "weight = 3\n\n[[data.sources]]\npath = \"c\"\nformat = \"npy\"\n\n[model]\nname = "
      "\"gpt\"\n";
  const Config c = Config::fromString(good, "good.toml");
  ASSERT_EQ(c.dataSources().size(), 2u);
  EXPECT_EQ(c.dataSources()[0], (DataSource{"a b", "tokens", 3.0}));
  EXPECT_EQ(c.dataSources()[1], (DataSource{"c", "npy", 1.0}));
  EXPECT_EQ(c.i64("data.batch_size"), 8);
  EXPECT_EQ(c.str("model.name"), "gpt");
  const Config again = Config::fromString(c.toToml(), "resolved");
  EXPECT_EQ(again.dataSources(), c.dataSources());
  EXPECT_EQ(again.toToml(), c.toToml());

  const std::string head = "[data]\nbatch_size = 8\n";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"[[data.sources]]\npath = \"a\"\nformat = \"tokens\"\nweight = 0\n",
       "bad.toml:6: data.sources weight must be a finite number above 0"},
      {"[[data.sources]]\npath = \"a\"\nformat = \"tokens\"\nweight = -1.5\n", "above 0"},
      {"[[data.sources]]\npath = \"a\"\nformat = \"tokens\"\nweight = nan\n", "finite"},
      {"[[data.sources]]\npath = \"a\"\nformat = \"tokens\"\nweight = inf\n", "finite"},
      {"[[data.sources]]\npath = \"a\"\nformat = \"tokens\"\n[[data.sources]]\npath = \"./a\"\n"
       "format = \"npy\"\n",
       "lists ./a twice"},
      {"[[data.sources]]\npath = \"a\"\n", "needs path and format"},
      {"[[data.sources]]\npath = \"a\"\nformat = \"csv\"\n", "format = \"csv\" is not one of"},
      {"[[data.sources]]\npath = \"a\"\nformat = \"npy\"\nshare = 2\n", "unknown key 'share'"},
      {"sources = 3\n", "must be tables"}};
  for (const auto& [text, says] : bad) {
    SCOPED_TRACE(text);
    try {
      Config::fromString(head + text, "bad.toml");
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
      EXPECT_NE(m.find(says), std::string::npos) << m;
    }
  }
  EXPECT_THROW(Config::fromString("", "x", {"data.sources=[]"}), ConfigError);
}
