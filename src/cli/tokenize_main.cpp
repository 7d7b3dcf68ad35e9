// caravan-tokenize: UTF-8 text into token files (data/tokenize.h). `caravan data tokenize ARGS`
// runs this program with ARGS; it is its own process because SentencePiece and LibTorch cannot
// share one (src/data/tokenize.cpp). Exit codes as caravan's: 2 options, 3 data, 5 files.
#include <cstdio>
#include <iostream>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/errors.h"
#include "data/tokenize.h"

int main(int argc, char** argv) {
  using namespace caravan;
  CLI::App app{
      "caravan data tokenize: UTF-8 text into token files (train.bin, val.bin, tokens.json) for "
      "data.dataset = \"tokens\": trains a SentencePiece model on the training text, uses one "
      "(--model), or bytes (--model bytes)"};
  app.name("caravan data tokenize");
  TokenizeOptions o;
  app.add_option("--input,-i", o.inputs, "UTF-8 text files")->required();
  app.add_option("--out,-o", o.outDir, "the directory to write")->required();
  app.add_option("--model", o.tokenizer,
                 "a SentencePiece .model to use; \"bytes\" for byte level (ids 0-255); default: "
                 "train one on the training text");
  app.add_option("--vocab-size", o.vocabSize, "pieces of the model to train (default 2000)");
  app.add_option("--val-fraction", o.valFraction,
                 "the tail of each input held out for validation, cut at a line end (default 0.1)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "caravan: error: %s (see caravan data tokenize --help)\n", e.what());
    return static_cast<int>(ExitCode::kConfig);
  }
  try {
    const TokenizeSummary t = tokenizeText(o);
    std::cout << fmt::format(
        "{}: {} training and {} validation tokens, {} tokenizer, vocabulary {}\n"
        "train on them with:\n[data]\ndataset = \"tokens\"\npath = \"{}\"\n"
        "token_dtype = \"{}\"\nvocab_size = {}\n",
        o.outDir, t.trainTokens, t.valTokens, t.tokenizer, t.vocabSize, o.outDir, t.dtype,
        t.vocabSize);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "caravan: error: %s\n", e.what());
    return e.exitCode();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "caravan: error: %s\n", e.what());
    return static_cast<int>(ExitCode::kIo);
  }
}
