// RAPIDS RMM's replay log (logging_resource_adaptor):
//
//   Thread,Time,Action,Pointer,Size,Stream
//   140234,11:02:03.123456,allocate,0x7f5a40000000,1024,0x0
//
// Actions: allocate, allocate failure, free. Read into trace records (allocate -> alloc;
// free -> free_requested immediately followed by free_completed; allocate failure -> oom),
// and written from a trace.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "io/trace_csv.hpp"

namespace ccalloc::io {

// Reads RMM log rows from `lines`, which must outlive the reader.
std::unique_ptr<RecordReader> rmm_log_reader(LineReader& lines);
// Throws FormatError naming the line and the column.
std::vector<TraceRecord> parse_rmm_log(std::string_view text, const std::string& name);
std::vector<TraceRecord> read_rmm_log(const std::string& path);
// alloc -> allocate, free_completed -> free, oom -> allocate failure; other actions are
// not part of the RMM format and are skipped. Time is written as seconds since the first
// entry with microsecond precision; Thread is 0.
std::string format_rmm_log(const std::vector<TraceEntry>& entries);

}  // namespace ccalloc::io
