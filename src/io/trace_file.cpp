#include "io/trace_file.hpp"

#include <cctype>
#include <deque>
#include <string_view>

#include "ccalloc/errors.hpp"
#include "io/csv_text.hpp"
#include "io/gzip.hpp"
#include "io/rmm_log.hpp"
#include "io/snapshot_io.hpp"

namespace ccalloc::io {
namespace {

FileKind kind_of(std::string_view data, const std::string& path) {
  std::size_t i = 0;
  while (i < data.size() && std::isspace(static_cast<unsigned char>(data[i])))
    ++i;
  if (i == data.size()) throw FormatError(path + ": the file is empty");
  if (static_cast<unsigned char>(data[i]) == 0x80) return FileKind::kSnapshotPickle;
  if (data[i] == '{' || data[i] == '[') return FileKind::kSnapshotJson;
  const std::string_view first_line = data.substr(i, data.find('\n', i) - i);
  if (first_line.rfind("action", 0) == 0 || first_line.find(",action") != std::string_view::npos) {
    return FileKind::kTraceCsv;
  }
  std::string lower(first_line);
  for (char& c : lower)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower.find("action") != std::string::npos && lower.find("pointer") != std::string::npos) {
    return FileKind::kRmmLog;
  }
  throw FormatError(path +
                    ": not a snapshot (pickle or JSON), a trace CSV (header "
                    "action,addr,size,stream,time_us) or an RMM log (header "
                    "Thread,Time,Action,Pointer,Size,Stream)");
}

// The first chunk of `source`, which decides the kind: it must hold more than blanks.
std::string_view first_chunk(ByteSource& source) {
  const std::string_view first = source.next();
  if (!first.empty() && first.find_first_not_of(" \t\r\n\f\v") == std::string_view::npos) {
    throw FormatError(source.name() + ": the file is empty or its first " +
                      std::to_string(first.size()) +
                      " bytes are blank (expected a snapshot, a trace CSV or an RMM log)");
  }
  return first;
}

}  // namespace

// The snapshot being streamed: entries of every device are checked, those of `device` kept
// until next() hands them out (one opcode or one JSON entry's worth at a time).
struct TraceReader::Snapshot final : TraceEntrySink {
  Snapshot(ByteSource& source, std::string_view first, const std::string& path, int dev,
           const ReadLimits& limits)
      : name(path), device(dev), input(source, first) {
    parser = value_parser(input, path, limits, this);
  }
  void entry(std::size_t d, std::size_t index, Value v) override {
    std::optional<SnapshotTraceEntry> e;
    try {
      e = trace_entry_of(v);
    } catch (const FormatError& err) {
      throw FormatError(name + ": device_traces[" + std::to_string(d) + "][" +
                        std::to_string(index) + "]: " + err.what());
    }
    if (!e || device < 0 || d != static_cast<std::size_t>(device)) return;
    ++kept;
    queue.push_back({TraceEntry{e->action, e->addr, e->size, e->stream, e->time_us}, kept});
  }
  // The next record, or false once the document is through (and the rest checked).
  bool next(TraceRecord& out) {
    while (queue.empty()) {
      if (done) return false;
      if (!parser->step()) {
        done = true;
        // The rest of the snapshot (its device_traces lists now empty) must still be one.
        (void)snapshot_from_value(parser->result(), name);
      }
    }
    out = queue.front();
    queue.pop_front();
    return true;
  }

  std::string name;
  int device;
  ByteInput input;
  std::unique_ptr<ValueParser> parser;
  std::deque<TraceRecord> queue;
  std::uint64_t kept = 0;
  bool done = false;
};

FileKind detect_kind(const std::string& path) {
  ByteSource source(path, ReadLimits::from_environment());
  return kind_of(first_chunk(source), path);
}

const char* to_string(FileKind kind) {
  switch (kind) {
    case FileKind::kSnapshotPickle:
      return "snapshot (pickle)";
    case FileKind::kSnapshotJson:
      return "snapshot (JSON)";
    case FileKind::kTraceCsv:
      return "trace CSV";
    case FileKind::kRmmLog:
      return "RMM log";
  }
  return "unknown";
}

TraceReader::TraceReader(const std::string& path, int device, const ReadLimits& limits)
    : path_(path), limits_(limits), source_(std::make_unique<ByteSource>(path, limits)) {
  const std::string_view first = first_chunk(*source_);
  kind_ = kind_of(first, path);
  switch (kind_) {
    case FileKind::kTraceCsv:
    case FileKind::kRmmLog:
      lines_ = std::make_unique<LineReader>(*source_, first, limits.max_line_bytes);
      rows_ = kind_ == FileKind::kTraceCsv ? trace_csv_reader(*lines_) : rmm_log_reader(*lines_);
      return;
    case FileKind::kSnapshotPickle:
    case FileKind::kSnapshotJson:
      break;
  }
  snapshot_ = std::make_unique<Snapshot>(*source_, first, path, device, limits);
}

TraceReader::~TraceReader() = default;

bool TraceReader::next(TraceRecord& out) {
  if (rows_) {
    if (!rows_->next(out)) return false;
  } else if (!snapshot_->next(out)) {
    return false;
  }
  if (++count_ > limits_.max_entries) {
    throw FormatError(path_ + ":" + std::to_string(out.line) + ": more than " +
                      std::to_string(limits_.max_entries) + " trace entries" +
                      limit_hint("max_entries", limits_.max_entries,
                                 "CCALLOC_MAX_ENTRIES or `ccalloc replay --max-entries`"));
  }
  return true;
}

void for_each_entry(const std::string& path, int device,
                    const std::function<void(const TraceRecord&)>& fn) {
  TraceReader reader(path, device);
  TraceRecord r;
  while (reader.next(r))
    fn(r);
}

std::vector<TraceRecord> read_any_trace(const std::string& path, int device) {
  TraceReader reader(path, device);
  std::vector<TraceRecord> records;
  TraceRecord r;
  while (reader.next(r))
    records.push_back(r);
  return records;
}

int first_device_with_entries(const std::string& path, const ReadLimits& limits) {
  constexpr int kDevicesTried = 16;
  for (int d = 0; d < kDevicesTried; ++d) {
    TraceReader reader(path, d, limits);
    TraceRecord r;
    if (reader.next(r)) return d;
    if (reader.kind() != FileKind::kSnapshotPickle && reader.kind() != FileKind::kSnapshotJson) {
      break;  // one device only
    }
  }
  return 0;
}

}  // namespace ccalloc::io
