// JSON for the same data trees: the format the newest PyTorch memory viewer reads directly.
// Tuples are written as arrays. The reader bounds nesting depth and names the byte offset
// of any error.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "io/value.hpp"

namespace ccalloc::io {

Value parse_json(std::string_view text, const std::string& name, std::size_t max_depth = 256);
// Compact JSON (no spaces); strings escaped per RFC 8259, non-ASCII kept as UTF-8.
std::string write_json(const Value& v);

}  // namespace ccalloc::io
