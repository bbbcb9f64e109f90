#include "io/trace_csv.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cstring>
#include <limits>
#include <system_error>

#include "ccalloc/errors.hpp"
#include "io/csv_text.hpp"
#include "io/gzip.hpp"

namespace ccalloc::io {
namespace {

constexpr std::string_view kHeader = "action,addr,size,stream,time_us";
constexpr std::size_t kNumActions = static_cast<std::size_t>(TraceAction::kOom) + 1;
// Longest row: the longest action name, four 20-character numbers, a sign, four commas
// and the newline.
constexpr std::size_t kMaxRowChars = 128;

enum class Column : std::uint8_t { kIgnored, kAction, kAddr, kSize, kStream, kTimeUs };

constexpr std::array<KnownColumn<Column>, 5> kKnownColumns = {{
    {"action", Column::kAction, true},
    {"addr", Column::kAddr, true},
    {"size", Column::kSize, true},
    {"stream", Column::kStream, false},
    {"time_us", Column::kTimeUs, false},
}};

std::string valid_actions() {
  std::string out;
  for (std::size_t i = 0; i < kNumActions; ++i) {
    if (i != 0) out += ", ";
    out += to_string(static_cast<TraceAction>(i));
  }
  return out;
}

class Parser final : public RecordReader {
 public:
  explicit Parser(LineReader& lines) : lines_(lines) {}

  bool next(TraceRecord& out) override {
    std::string_view line;
    if (!have_header_) {
      while (lines_.next(line)) {
        if (line.empty()) continue;
        parse_header(line);
        have_header_ = true;
        break;
      }
      if (!have_header_) {
        throw FormatError(lines_.name() + ": empty trace CSV (expected the header line '" +
                          std::string(kHeader) + "')");
      }
    }
    while (lines_.next(line)) {
      if (line.empty()) continue;
      out = {parse_row(line), lines_.line_no()};
      return true;
    }
    return false;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { lines_.fail(what); }

  void parse_header(std::string_view line) {
    const auto seen = map_header(line, kKnownColumns, /*ignore_case=*/false, lines_, columns_);
    for (std::size_t k = 0; k < kKnownColumns.size(); ++k) {
      if (kKnownColumns[k].required && !seen[k]) {
        fail("the header has no '" + std::string(kKnownColumns[k].name) + "' column (got " +
             quoted(line) + ", expected a header such as '" + std::string(kHeader) + "')");
      }
    }
  }

  TraceEntry parse_row(std::string_view line) {
    const std::size_t fields =
        1 + static_cast<std::size_t>(std::count(line.begin(), line.end(), ','));
    if (fields != columns_.size()) {
      fail("expected " + std::to_string(columns_.size()) + " fields (as in the header), got " +
           std::to_string(fields));
    }
    TraceEntry e;
    const char* p = line.data();
    const char* const end = p + line.size();
    for (const Column column : columns_) {
      const auto* comma =
          static_cast<const char*>(std::memchr(p, ',', static_cast<std::size_t>(end - p)));
      const char* const field_end = comma != nullptr ? comma : end;
      const std::string_view field(p, static_cast<std::size_t>(field_end - p));
      switch (column) {
        case Column::kIgnored:
          break;
        case Column::kAction: {
          const std::optional<TraceAction> action = parse_trace_action(field);
          if (!action) {
            fail("unknown action " + quoted(field) + " (expected one of: " + valid_actions() + ")");
          }
          e.action = *action;
          break;
        }
        case Column::kAddr:
          e.addr = parse_unsigned<DevicePtr>(field, column);
          break;
        case Column::kSize:
          e.size = parse_unsigned<std::size_t>(field, column);
          break;
        case Column::kStream:
          e.stream = parse_unsigned<StreamId>(field, column);
          break;
        case Column::kTimeUs:
          e.time_us = parse_signed(field, column);
          break;
      }
      p = field_end + (comma != nullptr ? 1 : 0);
    }
    return e;
  }

  template <typename T>
  T parse_unsigned(std::string_view field, Column column) const {
    T value{};
    // from_chars takes no sign, no blanks and no base prefix for an unsigned type: only
    // decimal digits get through.
    const auto [ptr, ec] = std::from_chars(field.data(), field.data() + field.size(), value);
    if (ec == std::errc::result_out_of_range) {
      fail("invalid " + column_name(column) + " " + quoted(field) +
           " (out of range: the largest accepted value is " +
           std::to_string(std::numeric_limits<T>::max()) + ")");
    }
    if (ec != std::errc() || ptr != field.data() + field.size()) {
      fail("invalid " + column_name(column) + " " + quoted(field) +
           " (expected an unsigned integer)");
    }
    return value;
  }

  std::int64_t parse_signed(std::string_view field, Column column) const {
    std::int64_t value = 0;
    const auto [ptr, ec] = std::from_chars(field.data(), field.data() + field.size(), value);
    if (ec == std::errc::result_out_of_range) {
      fail("invalid " + column_name(column) + " " + quoted(field) +
           " (out of range of a 64-bit signed integer)");
    }
    if (ec != std::errc() || ptr != field.data() + field.size()) {
      fail("invalid " + column_name(column) + " " + quoted(field) + " (expected an integer)");
    }
    return value;
  }

  static std::string column_name(Column column) {
    return std::string(io::column_name(kKnownColumns, column));
  }

  LineReader& lines_;
  bool have_header_ = false;
  std::vector<Column> columns_;  // the role of each field, in file order
};

// Formats one row into `buf` (at least kMaxRowChars long); returns its length.
std::size_t format_row(char* buf, const TraceEntry& e) {
  char* p = buf;
  char* const end = buf + kMaxRowChars;
  const std::string_view action = to_string(e.action);
  p = std::copy(action.begin(), action.end(), p);
  *p++ = ',';
  p = std::to_chars(p, end, e.addr).ptr;
  *p++ = ',';
  p = std::to_chars(p, end, e.size).ptr;
  *p++ = ',';
  p = std::to_chars(p, end, e.stream).ptr;
  *p++ = ',';
  p = std::to_chars(p, end, e.time_us).ptr;
  *p++ = '\n';
  return static_cast<std::size_t>(p - buf);
}

}  // namespace

std::unique_ptr<RecordReader> trace_csv_reader(LineReader& lines) {
  return std::make_unique<Parser>(lines);
}

std::vector<TraceRecord> read_all(RecordReader& reader) {
  std::vector<TraceRecord> records;
  TraceRecord r;
  while (reader.next(r))
    records.push_back(r);
  return records;
}

std::vector<TraceRecord> parse_trace_csv(std::string_view text, const std::string& name) {
  LineReader lines(text, name);
  Parser parser(lines);
  return read_all(parser);
}

std::vector<TraceRecord> read_trace_csv(const std::string& path) {
  const ReadLimits limits = ReadLimits::from_environment();
  ByteSource source(path, limits);
  LineReader lines(source, source.next(), limits.max_line_bytes);
  Parser parser(lines);
  return read_all(parser);
}

void write_trace_csv_header(std::ostream& out) {
  out << kHeader << '\n';
}

void write_trace_csv_row(std::ostream& out, const TraceEntry& e) {
  char buf[kMaxRowChars];
  out.write(buf, static_cast<std::streamsize>(format_row(buf, e)));
}

std::string format_trace_csv(const std::vector<TraceEntry>& entries) {
  std::string out;
  // Rows of the shared traces average about 45 characters.
  out.reserve(kHeader.size() + 1 + entries.size() * 48);
  out.append(kHeader);
  out += '\n';
  char buf[kMaxRowChars];
  for (const TraceEntry& e : entries)
    out.append(buf, format_row(buf, e));
  return out;
}

}  // namespace ccalloc::io
