// Incremental parsing of snapshot files (pickle or JSON) from a ByteInput.
//
// With a TraceEntrySink, the elements of the top-level dict's `device_traces[d]` lists are
// handed to the sink as each is completed and are not kept: the parsed result holds those
// lists empty. Everything else is kept as usual, so what a parse holds is the rest of the
// snapshot plus bounded parser state (see pickle.hpp for what the pickle memo keeps).
#pragma once

#include <cstddef>

#include "io/value.hpp"

namespace ccalloc::io {

class TraceEntrySink {
 public:
  virtual ~TraceEntrySink() = default;
  // Element `index` of device_traces[`device`], in file order.
  virtual void entry(std::size_t device, std::size_t index, Value v) = 0;
};

class ValueParser {
 public:
  virtual ~ValueParser() = default;
  // Parses a little more: one opcode of a pickle (an APPENDS hands the sink its batch,
  // 1000 entries from Python's pickler) or one member or entry of JSON. False once the
  // whole document has been read and checked.
  virtual bool step() = 0;
  // The document, after step() returned false.
  virtual Value result() = 0;
};

}  // namespace ccalloc::io
