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
#include <memory>
#include <string>
#include <string_view>

#include "io/byte_input.hpp"
#include "io/value.hpp"
#include "io/value_stream.hpp"

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

// Parses a pickle held in memory, or read from `in` as it goes. `name` is used in error
// messages. Throws FormatError ("<name>: byte <offset>: <what>", the offset counted from
// the start of the data).
Value parse_pickle(std::string_view data, const std::string& name, PickleLimits limits = {});
Value parse_pickle(ByteInput& in, const std::string& name, PickleLimits limits = {});

// A pickle parser to drive step by step; with `sink`, the entries of device_traces are
// streamed to it (value_stream.hpp). What stays in memory while streaming: the stack (the
// open containers), the rest of the snapshot, and the memo. A streamed entry's own memo slot
// is released (a later reference to it is an error, which no snapshot writer produces);
// what the entry memoized inside it stays, since later entries may reference it: strings
// (Python's pickler memoizes every str object, so a writer that makes a fresh string per
// entry costs its bytes per entry) and frames lists and frame dicts. Besides, every memo
// index costs one slot (48 bytes) and every container one record (40 bytes) until the parse
// ends. So the parser's memory grows with the memoized objects, by about 150 bytes per
// entry of a snapshot written by PyTorch (one memoized dict and string each), against the
// whole entry tree (~900 bytes per entry) it used to hold; a JSON snapshot has no memo.
std::unique_ptr<ValueParser> pickle_parser(ByteInput& in, const std::string& name,
                                           const PickleLimits& limits, TraceEntrySink* sink);
std::string write_pickle(const Value& v);

}  // namespace ccalloc::io
