// Shared by the fuzz targets: an invariant that fails is a finding, reported as a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "ccalloc/errors.hpp"
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

// Parses `text` whole (`whole(text)`) and 3 bytes at a time (`chunked(ByteInput&)`): both
// must give the same value, or fail with the same FormatError at the same offset. Returns
// the value, or nullopt when the parser refused the input.
inline std::optional<io::Value> parse_both_ways(std::string_view text, const auto& whole,
                                                const auto& chunked) {
  io::Value v;
  try {
    v = whole(text);
  } catch (const FormatError& e) {
    std::string streamed = "accepted";
    try {
      parse_in_chunks(text, chunked);
    } catch (const FormatError& f) {
      streamed = f.what();
    }
    check(streamed == e.what(), "the parse in chunks fails differently");
    return std::nullopt;
  }
  check(parse_in_chunks(text, chunked) == v, "the parse in chunks differs");
  return v;
}

}  // namespace ccalloc::fuzz
