#include "io/json.hpp"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <system_error>

#include "ccalloc/errors.hpp"
#include "io/byte_input.hpp"

namespace ccalloc::io {
namespace {

class JsonParser final : public ValueParser {
 public:
  JsonParser(ByteInput& in, const std::string& name, std::size_t max_depth, TraceEntrySink* sink)
      : in_(in), name_(name), max_depth_(max_depth), sink_(sink) {}

  // With a sink, the top-level object is walked here member by member, and the arrays of
  // "device_traces" element by element, so each step parses one member or one entry.
  bool step() override {
    switch (state_) {
      case kStart:
        // A UTF-8 byte order mark is not part of the document.
        if (in_.ensure(3) && std::string_view(in_.here(), 3) == "\xef\xbb\xbf") in_.skip(3);
        skip_space();
        if (sink_ != nullptr && !at_end() && peek() == '{') {
          check_depth(1);
          in_.skip(1);
          top_ = Value::dict();
          skip_space();
          if (!at_end() && peek() == '}') {
            in_.skip(1);
            state_ = kEnd;
          } else {
            state_ = kKey;
          }
          return true;
        }
        top_ = value(0);
        state_ = kEnd;
        return true;
      case kKey: {
        skip_space();
        if (at_end() || peek() != '"')
          fail("unexpected " + describe() + " (expected a string key)");
        Value key(string());
        skip_space();
        if (at_end() || peek() != ':') fail("unexpected " + describe() + " (expected ':')");
        in_.skip(1);
        skip_space();
        if (key.as_string() == "device_traces" && !at_end() && peek() == '[') {
          check_depth(2);
          in_.skip(1);
          devices_ = Value::list();
          device_ = 0;
          skip_space();
          if (!at_end() && peek() == ']') {
            in_.skip(1);
            end_devices();
          } else {
            state_ = kDevice;
          }
          return true;
        }
        Value v = value(1);
        top_.mutable_dict().emplace_back(std::move(key), std::move(v));
        state_ = kAfterMember;
        return true;
      }
      case kAfterMember:
        skip_space();
        if (at_end()) fail("unexpected end of input (expected ',' or '}')");
        if (peek() == ',') {
          in_.skip(1);
          state_ = kKey;
          return true;
        }
        if (peek() == '}') {
          in_.skip(1);
          state_ = kEnd;
          return true;
        }
        fail("unexpected " + describe() + " (expected ',' or '}')");
      case kDevice:
        skip_space();
        if (!at_end() && peek() == '[') {
          check_depth(3);
          in_.skip(1);
          devices_.mutable_list().push_back(Value::list());
          entry_ = 0;
          skip_space();
          if (!at_end() && peek() == ']') {
            in_.skip(1);
            state_ = kAfterDevice;
          } else {
            state_ = kEntry;
          }
          return true;
        } else {
          // Not an array (null, or an error for the snapshot reader to name): kept whole.
          Value v = value(2);
          devices_.mutable_list().push_back(std::move(v));
          state_ = kAfterDevice;
          return true;
        }
      case kEntry: {
        skip_space();
        Value v = value(3);
        sink_->entry(device_, entry_++, std::move(v));
        skip_space();
        if (at_end()) fail("unexpected end of input (expected ',' or ']')");
        if (peek() == ',') {
          in_.skip(1);
          return true;
        }
        if (peek() == ']') {
          in_.skip(1);
          state_ = kAfterDevice;
          return true;
        }
        fail("unexpected " + describe() + " (expected ',' or ']')");
      }
      case kAfterDevice:
        skip_space();
        if (at_end()) fail("unexpected end of input (expected ',' or ']')");
        if (peek() == ',') {
          in_.skip(1);
          ++device_;
          state_ = kDevice;
          return true;
        }
        if (peek() == ']') {
          in_.skip(1);
          end_devices();
          return true;
        }
        fail("unexpected " + describe() + " (expected ',' or ']')");
      case kEnd:
        skip_space();
        if (!at_end()) fail("unexpected " + describe() + " after the JSON value");
        state_ = kDone;
        return false;
      case kDone:
        return false;
    }
    return false;
  }
  Value result() override { return std::move(top_); }

 private:
  enum State { kStart, kKey, kAfterMember, kDevice, kEntry, kAfterDevice, kEnd, kDone };

  void end_devices() {
    top_.mutable_dict().emplace_back(Value(std::string("device_traces")), std::move(devices_));
    devices_ = Value();
    state_ = kAfterMember;
  }

  [[noreturn]] void fail(const std::string& what) const { fail_at(in_.offset(), what); }
  [[noreturn]] void fail_at(std::uint64_t offset, const std::string& what) const {
    throw FormatError(name_ + ": byte " + std::to_string(offset) + ": " + what);
  }
  // The character at the cursor, for messages.
  std::string describe() {
    if (at_end()) return "end of input";
    const auto c = static_cast<unsigned char>(peek());
    if (c >= 0x20 && c < 0x7f) return std::string("character '") + static_cast<char>(c) + "'";
    static constexpr char kHex[] = "0123456789abcdef";
    return std::string("byte 0x") + kHex[c >> 4] + kHex[c & 0xf];
  }

  void skip_space() {
    while (!at_end()) {
      const char c = peek();
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') return;
      in_.skip(1);
    }
  }
  bool at_end() { return in_.at_end(); }
  char peek() const { return in_.peek(); }
  void expect_literal(std::string_view word) {
    if (!in_.ensure(word.size()) || std::string_view(in_.here(), word.size()) != word)
      fail("invalid literal (expected '" + std::string(word) + "')");
    in_.skip(word.size());
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
    in_.skip(1);  // '{'
    Value result = Value::dict();
    Dict& items = result.mutable_dict();
    skip_space();
    if (!at_end() && peek() == '}') {
      in_.skip(1);
      return result;
    }
    for (;;) {
      skip_space();
      if (at_end() || peek() != '"') fail("unexpected " + describe() + " (expected a string key)");
      Value key(string());
      skip_space();
      if (at_end() || peek() != ':') fail("unexpected " + describe() + " (expected ':')");
      in_.skip(1);
      skip_space();
      Value v = value(depth);
      items.emplace_back(std::move(key), std::move(v));
      skip_space();
      if (at_end()) fail("unexpected end of input (expected ',' or '}')");
      if (peek() == ',') {
        in_.skip(1);
        continue;
      }
      if (peek() == '}') {
        in_.skip(1);
        return result;
      }
      fail("unexpected " + describe() + " (expected ',' or '}')");
    }
  }

  Value array(std::size_t depth) {
    check_depth(depth);
    in_.skip(1);  // '['
    Value result = Value::list();
    List& items = result.mutable_list();
    skip_space();
    if (!at_end() && peek() == ']') {
      in_.skip(1);
      return result;
    }
    for (;;) {
      skip_space();
      items.push_back(value(depth));
      skip_space();
      if (at_end()) fail("unexpected end of input (expected ',' or ']')");
      if (peek() == ',') {
        in_.skip(1);
        continue;
      }
      if (peek() == ']') {
        in_.skip(1);
        return result;
      }
      fail("unexpected " + describe() + " (expected ',' or ']')");
    }
  }

  unsigned hex4() {
    if (!in_.ensure(4)) {
      in_.skip(in_.available());
      fail("unexpected end of input in a \\u escape");
    }
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = peek();
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
      in_.skip(1);
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
    const std::uint64_t start = in_.offset();
    in_.skip(1);  // '"'
    std::string out;
    for (;;) {
      // Copy the run up to the next quote, backslash or control character at once.
      const char* run = in_.here();
      const std::size_t n = in_.available();
      std::size_t k = 0;
      while (k < n) {
        const auto c = static_cast<unsigned char>(run[k]);
        if (c == '"' || c == '\\' || c < 0x20) break;
        ++k;
      }
      out.append(run, k);
      in_.skip(k);
      if (at_end()) fail_at(start, "unterminated string");
      if (k == n) continue;
      const char c = peek();
      if (c == '"') {
        in_.skip(1);
        return out;
      }
      if (c != '\\') fail("control character in a string (it must be escaped)");
      in_.skip(1);
      if (at_end()) fail("unexpected end of input in an escape");
      const char e = peek();
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          in_.skip(1);
          break;
        case 'b':
          out += '\b';
          in_.skip(1);
          break;
        case 'f':
          out += '\f';
          in_.skip(1);
          break;
        case 'n':
          out += '\n';
          in_.skip(1);
          break;
        case 'r':
          out += '\r';
          in_.skip(1);
          break;
        case 't':
          out += '\t';
          in_.skip(1);
          break;
        case 'u': {
          const std::uint64_t escape_at = in_.offset() - 1;
          in_.skip(1);
          std::uint32_t cp = hex4();
          if (cp >= 0xdc00 && cp <= 0xdfff) fail_at(escape_at, "unpaired low surrogate escape");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (!in_.ensure(2) || std::string_view(in_.here(), 2) != "\\u") {
              fail_at(escape_at, "high surrogate escape not followed by a low surrogate");
            }
            in_.skip(2);
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
    const std::uint64_t start = in_.offset();
    std::string text;
    auto digit = [&] { return !at_end() && peek() >= '0' && peek() <= '9'; };
    auto take = [&] {
      text += peek();
      in_.skip(1);
    };
    if (peek() == '-') take();
    if (!digit()) fail("invalid number (expected a digit)");
    if (peek() == '0') {
      take();
      if (digit()) fail_at(start, "invalid number (leading zero)");
    } else {
      while (digit())
        take();
    }
    bool integral = true;
    if (!at_end() && peek() == '.') {
      integral = false;
      take();
      if (!digit()) fail("invalid number (expected a digit after '.')");
      while (digit())
        take();
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      integral = false;
      take();
      if (!at_end() && (peek() == '+' || peek() == '-')) take();
      if (!digit()) fail("invalid number (expected a digit in the exponent)");
      while (digit())
        take();
    }
    const char* first = text.data();
    const char* last = text.data() + text.size();
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

  ByteInput& in_;
  const std::string& name_;
  std::size_t max_depth_;
  TraceEntrySink* sink_;
  State state_ = kStart;
  Value top_;
  Value devices_;
  std::size_t device_ = 0;
  std::size_t entry_ = 0;
};

// ---- writer ------------------------------------------------------------------------------

constexpr std::size_t kMaxJsonDepth = 1000;

class JsonWriter {
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
    if (depth > kMaxJsonDepth) {
      throw Error("write_json: values nested deeper than " + std::to_string(kMaxJsonDepth) +
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

std::unique_ptr<ValueParser> json_parser(ByteInput& in, const std::string& name,
                                         std::size_t max_depth, TraceEntrySink* sink) {
  return std::make_unique<JsonParser>(in, name, max_depth, sink);
}

Value parse_json(ByteInput& in, const std::string& name, std::size_t max_depth) {
  JsonParser parser(in, name, max_depth, nullptr);
  while (parser.step()) {
  }
  return parser.result();
}

Value parse_json(std::string_view text, const std::string& name, std::size_t max_depth) {
  ByteInput in(text);
  return parse_json(in, name, max_depth);
}

std::string write_json(const Value& v) {
  return JsonWriter().run(v);
}

}  // namespace ccalloc::io
