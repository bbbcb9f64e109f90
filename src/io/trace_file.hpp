// Any file ccalloc reads a trace from, recognised by its content (gzip or plain): a
// snapshot (pickle or JSON, PyTorch's or ccalloc's), a trace CSV, or an RMM replay log.
#pragma once

#include <string>
#include <vector>

#include "ccalloc/snapshot.hpp"
#include "io/trace_csv.hpp"

namespace ccalloc::io {

enum class FileKind { kSnapshotPickle, kSnapshotJson, kTraceCsv, kRmmLog };

// What a file holds. Throws FormatError for something else.
FileKind detect_kind(const std::string& path);
const char* to_string(FileKind kind);

// The trace entries of a file: a snapshot's device trace (`device`), a trace CSV or an
// RMM log. Throws FormatError with the file name and the line or byte offset.
std::vector<TraceRecord> read_any_trace(const std::string& path, int device = 0);

}  // namespace ccalloc::io
