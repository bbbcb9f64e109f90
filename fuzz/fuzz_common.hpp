// Shared by the fuzz targets: an invariant that fails is a finding, reported as a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "io/byte_input.hpp"
#include "io/value.hpp"

namespace ccalloc::fuzz {

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Aborts (a libFuzzer crash with the input saved) when a round trip breaks.
inline void check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
  std::abort();
}

// Parses `text` handed to the parser 3 bytes at a time (the pickle and JSON targets compare
// it with the whole-buffer parse).
inline io::Value parse_in_chunks(std::string_view text, const auto& parse) {
  io::detail::test_chunk_cap = 3;
  try {
    io::ByteInput in(text);
    io::Value v = parse(in);
    io::detail::test_chunk_cap = 0;
    return v;
  } catch (...) {
    io::detail::test_chunk_cap = 0;
    throw;
  }
}

}  // namespace ccalloc::fuzz
