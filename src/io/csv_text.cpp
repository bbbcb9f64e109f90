#include "io/csv_text.hpp"

#include "ccalloc/errors.hpp"
#include "io/limits.hpp"

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

LineReader::LineReader(std::string_view text, const std::string& name, std::size_t max_line_bytes)
    : chunk_(text), name_(name), max_line_bytes_(max_line_bytes) {
  if (chunk_.starts_with("\xef\xbb\xbf")) {
    chunk_.remove_prefix(3);
    offset_ = 3;
  }
}

LineReader::LineReader(ByteSource& source, std::string_view first, std::size_t max_line_bytes)
    : source_(&source), chunk_(first), name_(source.name()), max_line_bytes_(max_line_bytes) {
  if (chunk_.starts_with("\xef\xbb\xbf")) {
    chunk_.remove_prefix(3);
    offset_ = 3;
  }
}

bool LineReader::refill() {
  if (source_ == nullptr) return false;
  chunk_ = source_->next();
  return !chunk_.empty();
}

bool LineReader::next(std::string_view& line) {
  const auto too_long = [&] {
    line_offset_ = offset_ - carry_.size();
    ++line_no_;
    fail("the line starting at byte offset " + std::to_string(line_offset_) + " is longer than " +
         std::to_string(max_line_bytes_) +
         " bytes (rows of traces and RMM logs are far shorter: is this the right file?)" +
         limit_hint("max_line_bytes", max_line_bytes_, "CCALLOC_MAX_LINE_BYTES"));
  };
  carry_.clear();
  bool spans = false;  // the line is in carry_
  std::size_t consumed = 0;
  for (;;) {
    if (chunk_.empty() && !refill()) {
      if (!spans) return false;
      line = carry_;
      break;
    }
    const std::size_t nl = chunk_.find('\n');
    const std::size_t take = nl == std::string_view::npos ? chunk_.size() : nl;
    if (carry_.size() + take > max_line_bytes_) too_long();
    if (nl != std::string_view::npos && !spans) {
      line = chunk_.substr(0, nl);
    } else {
      carry_.append(chunk_.substr(0, take));
      spans = true;
      line = carry_;
    }
    chunk_.remove_prefix(take);
    offset_ += take;
    consumed += take;
    if (nl != std::string_view::npos) {
      chunk_.remove_prefix(1);
      ++offset_;
      ++consumed;
      break;
    }
  }
  line_offset_ = offset_ - consumed;
  ++line_no_;
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return true;
}

void LineReader::fail(const std::string& what) const {
  throw FormatError(name_ + ":" + std::to_string(line_no_) + ": " + what);
}

}  // namespace ccalloc::io
