#include "io/trace_csv.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cstring>
#include <limits>
#include <system_error>

#include "ccalloc/errors.hpp"
#include "io/gzip.hpp"

namespace ccalloc::io {
namespace {

constexpr std::string_view kHeader = "action,addr,size,stream,time_us";
constexpr std::size_t kNumActions = static_cast<std::size_t>(TraceAction::kOom) + 1;
// Longest row: the longest action name, four 20-character numbers, a sign, four commas
// and the newline.
constexpr std::size_t kMaxRowChars = 128;

enum class Column : std::uint8_t { kIgnored, kAction, kAddr, kSize, kStream, kTimeUs };

struct KnownColumn {
  std::string_view name;
  Column column;
  bool required;
};
constexpr std::array<KnownColumn, 5> kKnownColumns = {{
    {"action", Column::kAction, true},
    {"addr", Column::kAddr, true},
    {"size", Column::kSize, true},
    {"stream", Column::kStream, false},
    {"time_us", Column::kTimeUs, false},
}};

// The offending text as it goes into a message: bounded, so a huge garbage line cannot
// make a huge message, and with unprintable bytes escaped, so it cannot mangle a terminal.
std::string quoted(std::string_view text) {
  constexpr std::size_t kMaxShown = 64;
  std::string out = "'";
  for (const char c : text.substr(0, kMaxShown)) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) {
      out += c;
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 0xf];
    }
  }
  if (text.size() > kMaxShown) out += "...";
  out += '\'';
  return out;
}

std::string valid_actions() {
  std::string out;
  for (std::size_t i = 0; i < kNumActions; ++i) {
    if (i != 0) out += ", ";
    out += to_string(static_cast<TraceAction>(i));
  }
  return out;
}

std::string_view trim(std::string_view s) {
  const auto is_space = [](char c) { return c == ' ' || c == '\t'; };
  while (!s.empty() && is_space(s.front()))
    s.remove_prefix(1);
  while (!s.empty() && is_space(s.back()))
    s.remove_suffix(1);
  return s;
}

class Parser {
 public:
  Parser(std::string_view text, const std::string& name) : text_(text), name_(name) {
    // A UTF-8 byte order mark, as spreadsheet programs write, is not part of the header.
    if (text_.starts_with("\xef\xbb\xbf")) text_.remove_prefix(3);
  }

  std::vector<TraceRecord> parse() {
    std::string_view line;
    bool have_header = false;
    while (next_line(line)) {
      if (line.empty()) continue;
      parse_header(line);
      have_header = true;
      break;
    }
    if (!have_header) {
      throw FormatError(name_ + ": empty trace CSV (expected the header line '" +
                        std::string(kHeader) + "')");
    }
    std::vector<TraceRecord> records;
    while (next_line(line)) {
      if (line.empty()) continue;
      records.push_back({parse_row(line), line_no_});
    }
    return records;
  }

 private:
  bool next_line(std::string_view& line) {
    if (pos_ >= text_.size()) return false;
    const std::size_t nl = text_.find('\n', pos_);
    const std::size_t end = nl == std::string_view::npos ? text_.size() : nl;
    line = text_.substr(pos_, end - pos_);
    pos_ = nl == std::string_view::npos ? text_.size() : nl + 1;
    ++line_no_;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    return true;
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(name_ + ":" + std::to_string(line_no_) + ": " + what);
  }

  void parse_header(std::string_view line) {
    std::array<bool, kKnownColumns.size()> seen{};
    std::size_t start = 0;
    for (;;) {
      const std::size_t comma = line.find(',', start);
      const std::size_t end = comma == std::string_view::npos ? line.size() : comma;
      const std::string_view field = trim(line.substr(start, end - start));
      Column column = Column::kIgnored;
      for (std::size_t k = 0; k < kKnownColumns.size(); ++k) {
        if (kKnownColumns[k].name != field) continue;
        if (seen[k]) fail("duplicate column " + quoted(field) + " in the header");
        seen[k] = true;
        column = kKnownColumns[k].column;
        names_[static_cast<std::size_t>(column)] = kKnownColumns[k].name;
      }
      columns_.push_back(column);
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
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

  std::string column_name(Column column) const {
    return std::string(names_[static_cast<std::size_t>(column)]);
  }

  std::string_view text_;
  const std::string& name_;
  std::size_t pos_ = 0;
  std::size_t line_no_ = 0;
  std::vector<Column> columns_;              // the role of each field, in file order
  std::array<std::string_view, 6> names_{};  // header name of each Column, for messages
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

std::vector<TraceRecord> parse_trace_csv(std::string_view text, const std::string& name) {
  return Parser(text, name).parse();
}

std::vector<TraceRecord> read_trace_csv(const std::string& path) {
  return parse_trace_csv(read_file(path), path);
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
