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
// the memo keeps what the entry memoized inside it (strings; and frames lists and frame
// dicts, which later entries may reference), so a snapshot with frames costs the memo its
// distinct strings plus its memoized frames, and every memo index costs one slot (~48
// bytes) and every container one small record (40 bytes) for as long as the parse runs.
std::unique_ptr<ValueParser> pickle_parser(ByteInput& in, const std::string& name,
                                           const PickleLimits& limits, TraceEntrySink* sink);
std::string write_pickle(const Value& v);

}  // namespace ccalloc::io
