// Snapshot files: PyTorch's schema in a pickle or JSON file, plain or gzip.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ccalloc/snapshot.hpp"
#include "ccalloc/snapshot_io.hpp"  // read_snapshot, write_snapshot
#include "io/byte_input.hpp"
#include "io/limits.hpp"
#include "io/pickle.hpp"
#include "io/trace_csv.hpp"
#include "io/value.hpp"
#include "io/value_stream.hpp"

namespace ccalloc::io {

enum class SnapshotFormat { kPickle, kJson };

// The format a file name asks for: ".json" / ".json.gz" -> JSON, else pickle.
SnapshotFormat format_for_path(const std::string& path);

// Reads any snapshot file: pickle or JSON (detected from the content), gzip or plain,
// parsed as the chunks arrive (the decompressed text is never held whole). Throws
// FormatError with the file name and byte offset.
Value read_value_file(const std::string& path);

// The limits of `limits` that apply to pickles.
PickleLimits pickle_limits(const ReadLimits& limits);
// A step-by-step parser for the snapshot `in` holds, pickle or JSON by its first bytes
// (which stay unread), streaming device_traces entries to `sink` if not null.
std::unique_ptr<ValueParser> value_parser(ByteInput& in, const std::string& path,
                                          const ReadLimits& limits, TraceEntrySink* sink);
// One device_traces element as a trace entry, its frames not read; nullopt for an
// annotation (no allocator event). Throws FormatError naming the key.
std::optional<SnapshotTraceEntry> trace_entry_of(const Value& v);
// Writes a data tree as pickle or JSON (by the path), gzip if the path ends in ".gz".
void write_value_file(const std::string& path, const Value& v);

// Schema conversions. to_value writes PyTorch's keys; from_value accepts PyTorch's own
// snapshots (including a bare list of segments, and entries without optional keys) and
// throws FormatError naming the missing or malformed key.
Value to_value(const Snapshot& s);
Snapshot snapshot_from_value(const Value& v, const std::string& name);

// The trace of one device of a snapshot as replayable records (line = entry index + 1).
std::vector<TraceRecord> trace_records(const Snapshot& s, int device);

}  // namespace ccalloc::io
