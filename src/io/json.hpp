// JSON for the same data trees: the format the newest PyTorch memory viewer reads directly.
// Tuples are written as arrays. The reader bounds nesting depth and names the byte offset
// of any error.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "io/byte_input.hpp"
#include "io/value.hpp"
#include "io/value_stream.hpp"

namespace ccalloc::io {

// In memory, or read from `in` as it goes; offsets in messages count from the data's start.
Value parse_json(std::string_view text, const std::string& name, std::size_t max_depth = 256);
Value parse_json(ByteInput& in, const std::string& name, std::size_t max_depth = 256);
// A parser to drive step by step; with `sink`, the elements of the top-level object's
// "device_traces" arrays are streamed to it (value_stream.hpp); the parser then holds the
// rest of the document plus one entry.
std::unique_ptr<ValueParser> json_parser(ByteInput& in, const std::string& name,
                                         std::size_t max_depth, TraceEntrySink* sink);
// Compact JSON (no spaces); strings escaped per RFC 8259, non-ASCII kept as UTF-8.
std::string write_json(const Value& v);

}  // namespace ccalloc::io
