#include "io/csv_text.hpp"

#include "ccalloc/errors.hpp"

namespace ccalloc::io {

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

std::string_view trim(std::string_view s) {
  const auto is_space = [](char c) { return c == ' ' || c == '\t'; };
  while (!s.empty() && is_space(s.front()))
    s.remove_prefix(1);
  while (!s.empty() && is_space(s.back()))
    s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  const auto lower = [](char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c; };
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

LineReader::LineReader(std::string_view text, const std::string& name) : text_(text), name_(name) {
  if (text_.starts_with("\xef\xbb\xbf")) text_.remove_prefix(3);
}

bool LineReader::next(std::string_view& line) {
  if (pos_ >= text_.size()) return false;
  const std::size_t nl = text_.find('\n', pos_);
  const std::size_t end = nl == std::string_view::npos ? text_.size() : nl;
  line = text_.substr(pos_, end - pos_);
  pos_ = nl == std::string_view::npos ? text_.size() : nl + 1;
  ++line_no_;
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return true;
}

void LineReader::fail(const std::string& what) const {
  throw FormatError(name_ + ":" + std::to_string(line_no_) + ": " + what);
}

}  // namespace ccalloc::io
