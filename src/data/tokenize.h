// Tokenizing UTF-8 text into token files with SentencePiece (Debian's libsentencepiece-dev) or
// bytes: the program caravan-tokenize (src/cli/tokenize_main.cpp), which `caravan data tokenize`
// runs. Kept out of caravan_lib: it must not share a process with LibTorch (see tokenize.cpp).
//
// Errors: DataError (input files, the tokenizer's own failures), ConfigError (options), IoError
// (the output directory); each one line. Threading: one call at a time per output directory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace caravan {

struct TokenizeOptions {
  std::vector<std::string> inputs;  // UTF-8 text files
  std::string outDir;               // gets train.bin, val.bin, tokens.json (+ tokenizer.model)
  // "" = train a SentencePiece model (unigram) of vocabSize pieces on the training text;
  // "bytes" = byte level (ids 0-255, no model); else a SentencePiece .model file to use.
  std::string tokenizer;
  int64_t vocabSize = 2000;
  double valFraction = 0.1;  // the tail of each input (cut at a line end) held out
};

struct TokenizeSummary {
  std::string tokenizer;  // "sentencepiece" | "bytes"
  int64_t vocabSize = 0;
  std::string dtype;  // "uint16" | "uint32": the smallest that holds the vocabulary
  int64_t trainTokens = 0;
  int64_t valTokens = 0;
};

// Writes OUT/train.bin and OUT/val.bin (the layout data.dataset = "tokens" reads), OUT/tokens.json
// (the summary and the config keys to train on them) and, for SentencePiece, OUT/tokenizer.model
// (a copy of the one used, or the one trained; OUT/tokenizer.log holds the trainer's log).
// SentencePiece encodes line by line (a line end is whitespace to it); bytes keep every byte.
// Refuses an OUT that already holds any of these files (nothing is overwritten); files appear
// complete or not at all (written beside, then renamed).
TokenizeSummary tokenizeText(const TokenizeOptions& options);

}  // namespace caravan
