#include "io/json.hpp"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <system_error>

#include "ccalloc/errors.hpp"

namespace ccalloc::io {
namespace {

class Parser {
 public:
  Parser(std::string_view text, const std::string& name, std::size_t max_depth)
      : text_(text), name_(name), max_depth_(max_depth) {}

  Value run() {
    // A UTF-8 byte order mark is not part of the document.
    if (text_.starts_with("\xef\xbb\xbf")) pos_ = 3;
    skip_space();
    Value v = value(0);
    skip_space();
    if (pos_ != text_.size()) fail("unexpected " + describe() + " after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { fail_at(pos_, what); }
  [[noreturn]] void fail_at(std::size_t offset, const std::string& what) const {
    throw FormatError(name_ + ": byte " + std::to_string(offset) + ": " + what);
  }
  // The character at pos_, for messages.
  std::string describe() const {
    if (pos_ >= text_.size()) return "end of input";
    const auto c = static_cast<unsigned char>(text_[pos_]);
    if (c >= 0x20 && c < 0x7f) return std::string("character '") + static_cast<char>(c) + "'";
    static constexpr char kHex[] = "0123456789abcdef";
    return std::string("byte 0x") + kHex[c >> 4] + kHex[c & 0xf];
  }

  void skip_space() {
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') return;
      ++pos_;
    }
  }
  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }
  void expect_literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word)
      fail("invalid literal (expected '" + std::string(word) + "')");
    pos_ += word.size();
  }

  Value value(std::size_t depth) {
    if (at_end()) fail("unexpected end of input (expected a value)");
    switch (peek()) {
      case '{':
        return object(depth + 1);
      case '[':
        return array(depth + 1);
      case '"':
        return Value(string());
      case 't':
        expect_literal("true");
        return Value(true);
      case 'f':
        expect_literal("false");
        return Value(false);
      case 'n':
        expect_literal("null");
        return Value();
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return number();
        fail("unexpected " + describe() + " (expected a value)");
    }
  }

  void check_depth(std::size_t depth) const {
    if (depth > max_depth_) {
      fail("arrays and objects nested deeper than " + std::to_string(max_depth_) +
           " levels (limit); raise it with the environment variable CCALLOC_MAX_NESTING");
    }
  }

  Value object(std::size_t depth) {
    check_depth(depth);
    ++pos_;  // '{'
    Value result = Value::dict();
    Dict& items = result.mutable_dict();
    skip_space();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return result;
    }
    for (;;) {
      skip_space();
      if (at_end() || peek() != '"') fail("unexpected " + describe() + " (expected a string key)");
      Value key(string());
      skip_space();
      if (at_end() || peek() != ':') fail("unexpected " + describe() + " (expected ':')");
      ++pos_;
      skip_space();
      Value v = value(depth);
      items.emplace_back(std::move(key), std::move(v));
      skip_space();
      if (at_end()) fail("unexpected end of input (expected ',' or '}')");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return result;
      }
      fail("unexpected " + describe() + " (expected ',' or '}')");
    }
  }

  Value array(std::size_t depth) {
    check_depth(depth);
    ++pos_;  // '['
    Value result = Value::list();
    List& items = result.mutable_list();
    skip_space();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return result;
    }
    for (;;) {
      skip_space();
      items.push_back(value(depth));
      skip_space();
      if (at_end()) fail("unexpected end of input (expected ',' or ']')");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return result;
      }
      fail("unexpected " + describe() + " (expected ',' or ']')");
    }
  }

  unsigned hex4() {
    if (text_.size() - pos_ < 4) {
      pos_ = text_.size();
      fail("unexpected end of input in a \\u escape");
    }
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_];
      unsigned d = 0;
      if (c >= '0' && c <= '9') {
        d = static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        d = static_cast<unsigned>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        d = static_cast<unsigned>(c - 'A' + 10);
      } else {
        fail("invalid \\u escape (expected 4 hex digits)");
      }
      v = v * 16 + d;
      ++pos_;
    }
    return v;
  }

  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  // Strings are byte strings: UTF-8 passes through unchecked; escapes become UTF-8.
  std::string string() {
    const std::size_t start = pos_;
    ++pos_;  // '"'
    std::string out;
    for (;;) {
      // Copy the run up to the next quote, backslash or control character at once.
      const std::size_t run_start = pos_;
      while (pos_ < text_.size()) {
        const auto c = static_cast<unsigned char>(text_[pos_]);
        if (c == '"' || c == '\\' || c < 0x20) break;
        ++pos_;
      }
      out.append(text_.data() + run_start, pos_ - run_start);
      if (at_end()) fail_at(start, "unterminated string");
      const char c = text_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c != '\\') fail("control character in a string (it must be escaped)");
      ++pos_;
      if (at_end()) fail("unexpected end of input in an escape");
      const char e = text_[pos_];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          ++pos_;
          break;
        case 'b':
          out += '\b';
          ++pos_;
          break;
        case 'f':
          out += '\f';
          ++pos_;
          break;
        case 'n':
          out += '\n';
          ++pos_;
          break;
        case 'r':
          out += '\r';
          ++pos_;
          break;
        case 't':
          out += '\t';
          ++pos_;
          break;
        case 'u': {
          const std::size_t escape_at = pos_ - 1;
          ++pos_;
          std::uint32_t cp = hex4();
          if (cp >= 0xdc00 && cp <= 0xdfff) fail_at(escape_at, "unpaired low surrogate escape");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (text_.substr(pos_, 2) != "\\u") {
              fail_at(escape_at, "high surrogate escape not followed by a low surrogate");
            }
            pos_ += 2;
            const std::uint32_t lo = hex4();
            if (lo < 0xdc00 || lo > 0xdfff) {
              fail_at(escape_at, "high surrogate escape not followed by a low surrogate");
            }
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          append_utf8(out, cp);
          break;
        }
        default:
          fail("invalid escape '\\" + std::string(1, e) + "'");
      }
    }
  }

  Value number() {
    const std::size_t start = pos_;
    auto digit = [&] { return !at_end() && peek() >= '0' && peek() <= '9'; };
    if (peek() == '-') ++pos_;
    if (!digit()) fail("invalid number (expected a digit)");
    if (peek() == '0') {
      ++pos_;
      if (digit()) fail_at(start, "invalid number (leading zero)");
    } else {
      while (digit())
        ++pos_;
    }
    bool integral = true;
    if (!at_end() && peek() == '.') {
      integral = false;
      ++pos_;
      if (!digit()) fail("invalid number (expected a digit after '.')");
      while (digit())
        ++pos_;
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      integral = false;
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (!digit()) fail("invalid number (expected a digit in the exponent)");
      while (digit())
        ++pos_;
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    if (integral) {
      std::int64_t i = 0;
      const auto [ptr, ec] = std::from_chars(first, last, i);
      if (ec == std::errc() && ptr == last) return Value(i);
      // Too large for 64 bits: a float, as JavaScript reads every number.
    }
    double d = 0;
    const auto [ptr, ec] = std::from_chars(first, last, d);
    if (ec == std::errc::result_out_of_range) {
      fail_at(start, "number out of the range of a double");
    }
    if (ec != std::errc() || ptr != last) fail_at(start, "invalid number");
    return Value(d);
  }

  std::string_view text_;
  const std::string& name_;
  std::size_t max_depth_;
  std::size_t pos_ = 0;
};

// ---- writer ------------------------------------------------------------------------------

constexpr std::size_t kMaxWriteDepth = 1000;

class Writer {
 public:
  std::string run(const Value& v) {
    out_.reserve(std::size_t{1} << 16);
    write(v, 0);
    return std::move(out_);
  }

 private:
  void write_string(std::string_view s) {
    static constexpr char kHex[] = "0123456789abcdef";
    out_ += '"';
    std::size_t run = 0;
    for (std::size_t i = 0; i < s.size(); ++i) {
      const auto c = static_cast<unsigned char>(s[i]);
      if (c >= 0x20 && c != '"' && c != '\\') continue;
      out_.append(s.data() + run, i - run);
      run = i + 1;
      switch (c) {
        case '"':
          out_ += "\\\"";
          break;
        case '\\':
          out_ += "\\\\";
          break;
        case '\n':
          out_ += "\\n";
          break;
        case '\r':
          out_ += "\\r";
          break;
        case '\t':
          out_ += "\\t";
          break;
        case '\b':
          out_ += "\\b";
          break;
        case '\f':
          out_ += "\\f";
          break;
        default:
          out_ += "\\u00";
          out_ += kHex[c >> 4];
          out_ += kHex[c & 0xf];
      }
    }
    out_.append(s.data() + run, s.size() - run);
    out_ += '"';
  }

  void write_int(std::int64_t i) {
    char buf[24];
    out_.append(buf, static_cast<std::size_t>(std::to_chars(buf, buf + sizeof buf, i).ptr - buf));
  }

  void write_float(double d) {
    if (!std::isfinite(d)) {
      throw FormatError("write_json: " + std::string(std::isnan(d) ? "NaN" : "an infinity") +
                        " cannot be written as JSON");
    }
    char buf[32];
    const char* end = std::to_chars(buf, buf + sizeof buf, d).ptr;
    const std::string_view text(buf, static_cast<std::size_t>(end - buf));
    out_.append(text);
    // Keep it a float when read back ("1" would read as an int).
    if (text.find_first_of(".eE") == std::string_view::npos) out_ += ".0";
  }

  // Object keys must be strings: numbers, booleans and null become their JSON text, as
  // Python's json module writes them.
  void write_key(const Value& k) {
    switch (k.storage().index()) {
      case 0:
        return write_string("null");
      case 1:
        return write_string(k.as_bool() ? "true" : "false");
      case 2: {
        char buf[24];
        const char* end = std::to_chars(buf, buf + sizeof buf, k.as_int()).ptr;
        return write_string(std::string_view(buf, static_cast<std::size_t>(end - buf)));
      }
      case 3: {
        const std::size_t mark = out_.size();
        write_float(std::get<double>(k.storage()));
        const std::string text = out_.substr(mark);
        out_.resize(mark);
        return write_string(text);
      }
      case 4:
        return write_string(k.as_string());
      default:
        throw FormatError("write_json: a " + std::string(k.kind_name()) +
                          " cannot be an object key");
    }
  }

  void write_items(const List& items, std::size_t depth) {
    out_ += '[';
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (i != 0) out_ += ',';
      write(items[i], depth + 1);
    }
    out_ += ']';
  }

  void write(const Value& v, std::size_t depth) {
    if (depth > kMaxWriteDepth) {
      throw Error("write_json: values nested deeper than " + std::to_string(kMaxWriteDepth) +
                  " levels (a cycle?)");
    }
    const Value::Storage& s = v.storage();
    switch (s.index()) {
      case 0:
        out_ += "null";
        return;
      case 1:
        out_ += std::get<bool>(s) ? "true" : "false";
        return;
      case 2:
        return write_int(std::get<std::int64_t>(s));
      case 3:
        return write_float(std::get<double>(s));
      case 4:
        return write_string(std::get<std::string>(s));
      case 5:
      case 6:
        return write_items(v.as_list(), depth);
      case 7: {
        const Dict& d = v.as_dict();
        out_ += '{';
        for (std::size_t i = 0; i < d.size(); ++i) {
          if (i != 0) out_ += ',';
          write_key(d[i].first);
          out_ += ':';
          write(d[i].second, depth + 1);
        }
        out_ += '}';
        return;
      }
      default:
        return;
    }
  }

  std::string out_;
};

}  // namespace

Value parse_json(std::string_view text, const std::string& name, std::size_t max_depth) {
  return Parser(text, name, max_depth).run();
}

std::string write_json(const Value& v) {
  return Writer().run(v);
}

}  // namespace ccalloc::io
