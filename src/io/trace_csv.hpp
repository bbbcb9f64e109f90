// The trace CSV format of data/traces: a header line, then one row per trace entry:
//
//   action,addr,size,stream,time_us
//
// with PyTorch's action names (alloc, free_requested, free_completed, segment_alloc,
// segment_free, segment_map, segment_unmap, snapshot, oom). For `oom`, addr holds the
// device's free bytes. Columns are found by their header names; stream and time_us may be
// absent (read as 0).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "ccalloc/trace.hpp"

namespace ccalloc::io {

struct TraceRecord {
  TraceEntry entry;
  std::size_t line = 0;  // 1-based line in the file it came from (0 if not from a file)
};

// Trace records pulled one at a time, so a reader of any length holds one row's worth.
class RecordReader {
 public:
  virtual ~RecordReader() = default;
  // The next record, or false at the end. Throws FormatError as the parse functions do.
  virtual bool next(TraceRecord& out) = 0;
};

class LineReader;
// Reads trace CSV rows from `lines`, which must outlive the reader.
std::unique_ptr<RecordReader> trace_csv_reader(LineReader& lines);
// Every record `reader` yields.
std::vector<TraceRecord> read_all(RecordReader& reader);

// Parses trace CSV text. Throws FormatError naming `name`, the line number and the field
// for any malformed row (unknown action, non-numeric or negative field, wrong column
// count, missing header).
std::vector<TraceRecord> parse_trace_csv(std::string_view text, const std::string& name);
// Streams the file (gzip or plain) through trace_csv_reader under the environment's
// ReadLimits.
std::vector<TraceRecord> read_trace_csv(const std::string& path);

// Writes the header line.
void write_trace_csv_header(std::ostream& out);
// Writes one row.
void write_trace_csv_row(std::ostream& out, const TraceEntry& e);
// Whole trace as CSV text, header included.
std::string format_trace_csv(const std::vector<TraceEntry>& entries);

}  // namespace ccalloc::io
