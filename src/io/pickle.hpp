// Python pickles of plain data, the only kind a memory snapshot is.
//
// The reader accepts protocols 2-5 opcodes for None, bool, int, float, str, bytes-free
// containers and the memo; it never imports or calls anything (GLOBAL, REDUCE, BUILD,
// ... are errors), so untrusted input cannot run code. Input size, nesting depth, memo
// size and container sizes are bounded; every error names the byte offset.
//
// The writer emits protocol 2 with only opcodes PyTorch's memory viewer understands:
// PROTO, EMPTY_DICT/MARK/SETITEMS, EMPTY_LIST/MARK/APPENDS, EMPTY_TUPLE/TUPLE1-3/TUPLE,
// BINUNICODE, BININT1/BININT2/BININT/LONG1, BINFLOAT, NEWTRUE/NEWFALSE, NONE,
// BINPUT/LONG_BINPUT, BINGET/LONG_BINGET, STOP. Shared containers and repeated strings
// are written once and referenced through the memo.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "io/value.hpp"

namespace ccalloc::io {

struct PickleLimits {
  std::size_t max_depth = 256;
  std::size_t max_memo = std::size_t{1} << 26;
  // Total values created, and values the result holds when each reference to a shared
  // container counts in full (so no traversal of the result can blow up).
  std::size_t max_items = std::size_t{1} << 28;
  // Total bytes of the strings created (memo references copy theirs).
  std::size_t max_string_bytes = std::size_t{4} << 30;
};

// Parses a pickle held in memory. `name` is used in error messages. Throws FormatError
// ("<name>: byte <offset>: <what>").
Value parse_pickle(std::string_view data, const std::string& name, PickleLimits limits = {});
std::string write_pickle(const Value& v);

}  // namespace ccalloc::io
