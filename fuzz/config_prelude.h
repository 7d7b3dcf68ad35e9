// Included before src/core/config.cpp in fuzz_config (compile option -include).
//
// toml++ is compiled into the target header-only, so the fuzzer sees the TOML parser's
// branches. Caravan links the release shared library, where toml++'s assertions are compiled
// out; do the same here (toml++ 3.3 asserts in parse_key on "[\x7f", which the release library
// reports as a parse error). Not through NDEBUG: with NDEBUG and clang toml++ turns them into
// __builtin_assume, undefined behaviour on such input.
#pragma once
#undef NDEBUG
#define TOML_ASSERT(expr) static_assert(true)
