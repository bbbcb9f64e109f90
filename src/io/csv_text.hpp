// Pieces shared by the line-oriented CSV readers (trace CSV, RMM logs): a numbered line
// reader whose errors name the file and line, header-to-column mapping, and the quoting of
// offending text in messages.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/gzip.hpp"

namespace ccalloc::io {

// The offending text as it goes into a message: bounded, so a huge garbage line cannot
// make a huge message, and with unprintable bytes escaped, so it cannot mangle a terminal.
std::string quoted(std::string_view text);
// `s` without leading and trailing blanks and tabs.
std::string_view trim(std::string_view s);
// Equal ignoring ASCII case.
bool iequals(std::string_view a, std::string_view b);

// The lines of a text held in memory or pulled from a ByteSource, numbered from 1, without
// the line ends (\n or \r\n) and without a leading UTF-8 byte order mark (spreadsheet
// programs write one). A line longer than `max_line_bytes` fails as soon as that many bytes
// have come without a line end, so a file without line ends cannot fill memory.
class LineReader {
 public:
  LineReader(std::string_view text, const std::string& name,
             std::size_t max_line_bytes = static_cast<std::size_t>(-1));
  // Reads from `source`, starting with `first`, a chunk already taken from it.
  LineReader(ByteSource& source, std::string_view first, std::size_t max_line_bytes);
  bool next(std::string_view& line);
  std::size_t line_no() const { return line_no_; }
  // Byte offset (after decompression) where the current line starts.
  std::uint64_t line_offset() const { return line_offset_; }
  const std::string& name() const { return name_; }
  // Throws FormatError "NAME:LINE: what" for the current line.
  [[noreturn]] void fail(const std::string& what) const;

 private:
  bool refill();

  ByteSource* source_ = nullptr;
  std::string_view chunk_;  // not yet returned
  std::string carry_;       // a line that spans chunks
  std::string name_;
  std::size_t max_line_bytes_;
  std::size_t line_no_ = 0;
  std::uint64_t line_offset_ = 0;
  std::uint64_t offset_ = 0;  // of chunk_'s first byte
};

// A header name the reader understands; `Column` is the reader's own enum, whose
// kIgnored stands for every other field.
template <typename Column>
struct KnownColumn {
  std::string_view name;
  Column column;
  bool required;
};

// Maps each comma-separated header field, blanks trimmed, to the known column of that name
// (compared exactly, or ignoring case), appending the roles to `columns` in file order.
// A known name that appears twice fails. Returns which known columns were present.
template <typename Column, std::size_t N>
std::array<bool, N> map_header(std::string_view line,
                               const std::array<KnownColumn<Column>, N>& known, bool ignore_case,
                               const LineReader& reader, std::vector<Column>& columns) {
  std::array<bool, N> seen{};
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = line.find(',', start);
    const std::size_t end = comma == std::string_view::npos ? line.size() : comma;
    const std::string_view field = trim(line.substr(start, end - start));
    Column column = Column::kIgnored;
    for (std::size_t k = 0; k < N; ++k) {
      if (!(ignore_case ? iequals(known[k].name, field) : known[k].name == field)) continue;
      if (seen[k]) reader.fail("duplicate column " + quoted(field) + " in the header");
      seen[k] = true;
      column = known[k].column;
    }
    columns.push_back(column);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return seen;
}

// The header name of `column`, for messages.
template <typename Column, std::size_t N>
std::string_view column_name(const std::array<KnownColumn<Column>, N>& known, Column column) {
  for (const KnownColumn<Column>& k : known) {
    if (k.column == column) return k.name;
  }
  return "column";
}

}  // namespace ccalloc::io
