#include "io/trace_file.hpp"

#include <cctype>
#include <string_view>

#include "ccalloc/errors.hpp"
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

}  // namespace

FileKind detect_kind(const std::string& path) {
  return kind_of(read_file(path), path);
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

std::vector<TraceRecord> read_any_trace(const std::string& path, int device) {
  const std::string data = read_file(path);
  switch (kind_of(data, path)) {
    case FileKind::kTraceCsv:
      return parse_trace_csv(data, path);
    case FileKind::kRmmLog:
      return parse_rmm_log(data, path);
    case FileKind::kSnapshotPickle:
    case FileKind::kSnapshotJson:
      break;
  }
  return trace_records(read_snapshot(path), device);
}

}  // namespace ccalloc::io
