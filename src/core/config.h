// Run configuration: a TOML file validated against Caravan's schema, plus `--set key=value`
// overrides. Every key Caravan reads is declared once in the schema (config.cpp) with its
// type, default, range and documentation; `caravan train --help` and docs/config.md are
// generated from the same table, so a key means the same thing everywhere.
//
// Threading: a Config is immutable after loading and may be read from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace caravan {

using ConfigValue = std::variant<int64_t, double, bool, std::string>;

enum class ConfigType { kInt, kFloat, kBool, kString };

// One schema entry: "section.name", its type, default, bounds and meaning.
struct ConfigOption {
  std::string key;
  ConfigType type;
  ConfigValue defaultValue;
  std::string doc;
  double min = -1e300;  // numeric bounds, inclusive unless the *Exclusive flag is set
  double max = 1e300;
  bool minExclusive = false;
  std::vector<std::string> choices;  // allowed strings (empty = any)
};

// One [[data.sources]] table: a dataset of its own (the files data.dataset = FORMAT with
// data.path = PATH reads) and its share of the training samples (weight / the weights' sum).
// The other [data] keys (seq_len, token_dtype, vocab_size, ...) apply to every source.
struct DataSource {
  std::string path;
  std::string format;  // tokens | npy | text | idx
  double weight = 1.0;
  bool operator==(const DataSource& o) const {
    return path == o.path && format == o.format && weight == o.weight;
  }
};

class Config {
 public:
  // All defaults; no file.
  Config();

  // Parses TOML text (`source` names it in errors: a path or "<string>") and applies the
  // overrides ("key=value", value in TOML syntax; a bare word is taken as a string).
  // Throws ConfigError naming the key and the line for: a syntax error, an unknown key or
  // section, a wrong type, an out-of-range value or a value not among the choices.
  static Config fromString(const std::string& text, const std::string& source,
                           const std::vector<std::string>& overrides = {});
  // Reads and parses a file. A missing or unreadable file is a ConfigError.
  static Config fromFile(const std::string& path, const std::vector<std::string>& overrides = {});
  // This config with more overrides (as --set gives them), applied after its own.
  Config withOverrides(const std::vector<std::string>& overrides) const;

  int64_t i64(const std::string& key) const;
  double f64(const std::string& key) const;
  bool flag(const std::string& key) const;
  const std::string& str(const std::string& key) const;

  // The [[data.sources]] tables, in the file's order (empty: one dataset, data.dataset).
  // Checked at parse: path and format given, format one of DataSource's, weight finite and
  // above 0, no path twice. Set in the config file only (not by --set).
  const std::vector<DataSource>& dataSources() const { return sources_; }
  // Whether the user set the key (in the file or an override) rather than taking the default.
  bool isSet(const std::string& key) const;

  // The resolved configuration (every key, defaults filled in) as TOML.
  std::string toToml() const;

  // The schema, in documentation order.
  static const std::vector<ConfigOption>& schema();
  // The schema as a Markdown table (docs/config.md, the README) or plain text (--help).
  static std::string schemaMarkdown();
  static std::string schemaText();

 private:
  void assign(const std::string& key, const ConfigValue& value, const std::string& where);
  void applyOverrides(const std::vector<std::string>& overrides);
  std::string sourcesToml() const;
  const ConfigValue& value(const std::string& key, ConfigType expected) const;

  std::map<std::string, ConfigValue> values_;
  std::map<std::string, bool> set_;
  std::vector<DataSource> sources_;
};

// The items of a comma-separated config value ("3,6,9", "h, layers"), each trimmed of spaces;
// empty ones are kept (a caller refuses or skips them).
std::vector<std::string> listItems(const std::string& text);

}  // namespace caravan
