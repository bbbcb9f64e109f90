// Any file ccalloc reads a trace from, recognised by its content (gzip or plain): a
// snapshot (pickle or JSON, PyTorch's or ccalloc's), a trace CSV, or an RMM replay log.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ccalloc/snapshot.hpp"
#include "io/limits.hpp"
#include "io/trace_csv.hpp"

namespace ccalloc::io {

enum class FileKind { kSnapshotPickle, kSnapshotJson, kTraceCsv, kRmmLog };

// What a file holds, from its first bytes. Throws FormatError for something else.
FileKind detect_kind(const std::string& path);
const char* to_string(FileKind kind);

// The trace entries of a file, one at a time: a trace CSV or RMM log is streamed (memory
// stays at a few chunks and one line, whatever the file's length); a snapshot is parsed as
// it is read, its device_traces entries handed out as the parser completes each one and
// not kept (memory: the rest of the snapshot plus the parser's bounded state; see
// pickle.hpp for the memo). The snapshot's other keys are checked once the trace is
// through, so a malformed segment shows up as an error from the last next(). Throws
// FormatError with the file name and the line or byte offset, or the limit that was hit.
class TraceReader {
 public:
  explicit TraceReader(const std::string& path, int device = 0,
                       const ReadLimits& limits = ReadLimits::from_environment());
  ~TraceReader();
  TraceReader(const TraceReader&) = delete;
  TraceReader& operator=(const TraceReader&) = delete;

  FileKind kind() const { return kind_; }
  // The next record, or false at the end. Fails past limits.max_entries.
  bool next(TraceRecord& out);
  // Records handed out so far.
  std::uint64_t count() const { return count_; }

 private:
  std::string path_;
  ReadLimits limits_;
  FileKind kind_;
  std::unique_ptr<class ByteSource> source_;
  std::unique_ptr<class LineReader> lines_;
  std::unique_ptr<RecordReader> rows_;
  struct Snapshot;
  std::unique_ptr<Snapshot> snapshot_;
  std::uint64_t count_ = 0;
};

// Calls `fn` with every record of the file, in order.
void for_each_entry(const std::string& path, int device,
                    const std::function<void(const TraceRecord&)>& fn);

// All of the file's records in memory (for callers that need random access).
std::vector<TraceRecord> read_any_trace(const std::string& path, int device = 0);

// The device whose trace `path` holds: the first of a snapshot's devices (up to 16) with
// entries (a rank's recording holds only its own device's), else 0; 0 for a CSV or RMM log.
int first_device_with_entries(const std::string& path,
                              const ReadLimits& limits = ReadLimits::from_environment());

}  // namespace ccalloc::io
