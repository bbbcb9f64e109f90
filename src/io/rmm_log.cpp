#include "io/rmm_log.hpp"

#include <array>
#include <charconv>
#include <cstdint>
#include <limits>
#include <optional>
#include <system_error>

#include "ccalloc/errors.hpp"
#include "io/csv_text.hpp"
#include "io/gzip.hpp"

namespace ccalloc::io {
namespace {

constexpr std::string_view kRmmHeader = "Thread,Time,Action,Pointer,Size,Stream";
constexpr std::int64_t kUsPerDay = std::int64_t{86400} * 1000000;
constexpr std::int64_t kMaxDays = 1000000;

enum class RmmColumn : std::uint8_t { kIgnored, kThread, kTime, kAction, kPointer, kSize, kStream };

constexpr std::array<KnownColumn<RmmColumn>, 6> kRmmColumns = {{
    {"Thread", RmmColumn::kThread, false},
    {"Time", RmmColumn::kTime, false},
    {"Action", RmmColumn::kAction, true},
    {"Pointer", RmmColumn::kPointer, true},
    {"Size", RmmColumn::kSize, true},
    {"Stream", RmmColumn::kStream, false},
}};

enum class Action : std::uint8_t { kAllocate, kFree, kFailure };

class RmmParser final : public RecordReader {
 public:
  explicit RmmParser(LineReader& lines) : lines_(lines) {}

  bool next(TraceRecord& out) override {
    if (pending_ < queued_.size()) {
      out = queued_[pending_++];
      return true;
    }
    queued_.clear();
    pending_ = 0;
    std::string_view line;
    if (!have_header_) {
      while (lines_.next(line)) {
        if (trim(line).empty()) continue;
        parse_header(line);
        have_header_ = true;
        break;
      }
      if (!have_header_) {
        throw FormatError(lines_.name() + ": empty RMM log (expected the header line '" +
                          std::string(kRmmHeader) + "')");
      }
    }
    while (lines_.next(line)) {
      if (trim(line).empty()) continue;
      parse_row(line, queued_);
      out = queued_[pending_++];
      return true;
    }
    return false;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { lines_.fail(what); }
  [[noreturn]] void fail_field(RmmColumn column, std::string_view field,
                               const std::string& why) const {
    fail("invalid " + std::string(column_name(kRmmColumns, column)) + " " + quoted(field) + " (" +
         why + ")");
  }

  void parse_header(std::string_view line) {
    const auto seen = map_header(line, kRmmColumns, /*ignore_case=*/true, lines_, columns_);
    std::string missing;
    for (std::size_t k = 0; k < kRmmColumns.size(); ++k) {
      if (kRmmColumns[k].required && !seen[k]) {
        missing += (missing.empty() ? "'" : ", '") + std::string(kRmmColumns[k].name) + "'";
      }
    }
    if (!missing.empty()) {
      fail("the header has no " + missing + " column (got " + quoted(line) +
           ", expected RMM's header '" + std::string(kRmmHeader) + "')");
    }
  }

  std::uint64_t parse_unsigned(std::string_view field, RmmColumn column, bool allow_hex) const {
    if (allow_hex && field == "(nil)") return 0;  // printf's %p of a null pointer
    int base = 10;
    std::string_view digits = field;
    if (allow_hex && (digits.starts_with("0x") || digits.starts_with("0X"))) {
      digits.remove_prefix(2);
      base = 16;
    }
    std::uint64_t v = 0;
    const auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v, base);
    if (ec == std::errc::result_out_of_range) fail_field(column, field, "out of 64-bit range");
    if (ec != std::errc() || ptr != digits.data() + digits.size() || digits.empty()) {
      fail_field(
          column, field,
          allow_hex ? "expected a hex (0x...) or decimal integer" : "expected an unsigned integer");
    }
    return v;
  }

  // Digits after a decimal point as microseconds (truncated beyond 6 digits).
  std::int64_t fraction_us(std::string_view frac, std::string_view field) const {
    std::int64_t us = 0;
    std::size_t n = 0;
    for (const char c : frac) {
      if (c < '0' || c > '9')
        fail_field(RmmColumn::kTime, field, "expected HH:MM:SS.ffffff or seconds");
      if (n < 6) us = us * 10 + (c - '0');
      ++n;
    }
    for (; n < 6; ++n)
      us *= 10;
    return us;
  }

  std::int64_t small_number(std::string_view digits, std::string_view field) const {
    std::int64_t v = 0;
    const auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
    // A bound that keeps the microsecond arithmetic far from overflow.
    if (ec != std::errc() || ptr != digits.data() + digits.size() || digits.empty() || v < 0 ||
        v > (std::int64_t{1} << 40)) {
      fail_field(RmmColumn::kTime, field, "expected HH:MM:SS.ffffff or seconds");
    }
    return v;
  }

  // RMM writes the time of day (HH:MM:SS.ffffff); older tools and its docs show seconds
  // (since the epoch, or since the first entry as format_rmm_log writes).
  std::int64_t parse_time(std::string_view field) {
    std::string_view s = field;
    bool negative = false;
    if (!s.empty() && s.front() == '-') {
      negative = true;
      s.remove_prefix(1);
    }
    std::string_view frac;
    if (const std::size_t dot = s.find('.'); dot != std::string_view::npos) {
      frac = s.substr(dot + 1);
      s = s.substr(0, dot);
    }
    const std::int64_t us = fraction_us(frac, field);
    if (s.find(':') == std::string_view::npos) {
      // Any 64-bit count of microseconds, so whatever format_rmm_log writes reads back.
      std::uint64_t secs = 0;
      const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), secs);
      if (ec != std::errc() || ptr != s.data() + s.size() || s.empty()) {
        fail_field(RmmColumn::kTime, field, "expected HH:MM:SS.ffffff or seconds");
      }
      constexpr std::uint64_t kLimit = std::uint64_t{1} << 63;  // |INT64_MIN|
      if (secs > kLimit / 1000000 ||
          secs * 1000000 + static_cast<std::uint64_t>(us) > kLimit - (negative ? 0 : 1)) {
        fail_field(RmmColumn::kTime, field, "out of the range of 64-bit microseconds");
      }
      const std::uint64_t mag = secs * 1000000 + static_cast<std::uint64_t>(us);
      return static_cast<std::int64_t>(negative ? 0 - mag : mag);
    }
    if (negative) fail_field(RmmColumn::kTime, field, "expected HH:MM:SS.ffffff or seconds");
    std::int64_t parts[3] = {0, 0, 0};
    int n = 0;
    for (;;) {
      const std::size_t colon = s.find(':');
      if (n == 3) fail_field(RmmColumn::kTime, field, "expected HH:MM:SS.ffffff");
      parts[n++] = small_number(s.substr(0, colon), field);
      if (colon == std::string_view::npos) break;
      s.remove_prefix(colon + 1);
    }
    if (n != 3 || parts[0] > 1000000 || parts[1] > 59 || parts[2] > 60) {
      fail_field(RmmColumn::kTime, field, "expected HH:MM:SS.ffffff");
    }
    std::int64_t t = ((parts[0] * 60 + parts[1]) * 60 + parts[2]) * 1000000 + us;
    // A time of day that jumps back by more than half a day crossed midnight.
    t += day_offset_;
    if (have_clock_ && t + kUsPerDay / 2 < last_clock_) {
      if (day_offset_ >= kMaxDays * kUsPerDay) fail("the log spans more than a million days");
      day_offset_ += kUsPerDay;
      t += kUsPerDay;
    }
    have_clock_ = true;
    last_clock_ = t;
    return t;
  }

  void parse_row(std::string_view line, std::vector<TraceRecord>& records) {
    std::size_t fields = 1;
    for (const char c : line)
      fields += c == ',' ? 1 : 0;
    if (fields != columns_.size()) {
      fail("expected " + std::to_string(columns_.size()) + " fields (as in the header), got " +
           std::to_string(fields));
    }
    Action action = Action::kAllocate;
    TraceEntry e;
    std::size_t start = 0;
    for (const RmmColumn column : columns_) {
      const std::size_t comma = line.find(',', start);
      const std::size_t end = comma == std::string_view::npos ? line.size() : comma;
      const std::string_view field = trim(line.substr(start, end - start));
      start = end + 1;
      switch (column) {
        case RmmColumn::kIgnored:
        case RmmColumn::kThread:
          break;
        case RmmColumn::kTime:
          e.time_us = parse_time(field);
          break;
        case RmmColumn::kAction:
          if (field == "allocate") {
            action = Action::kAllocate;
          } else if (field == "free" || field == "deallocate") {
            action = Action::kFree;
          } else if (field == "allocate failure") {
            action = Action::kFailure;
          } else {
            fail("unknown action " + quoted(field) +
                 " (expected 'allocate', 'free' or 'allocate failure')");
          }
          break;
        case RmmColumn::kPointer:
          e.addr = static_cast<DevicePtr>(parse_unsigned(field, column, true));
          break;
        case RmmColumn::kSize:
          e.size = static_cast<std::size_t>(parse_unsigned(field, column, false));
          break;
        case RmmColumn::kStream:
          e.stream = static_cast<StreamId>(parse_unsigned(field, column, true));
          break;
      }
    }
    switch (action) {
      case Action::kAllocate:
        e.action = TraceAction::kAlloc;
        records.push_back({e, lines_.line_no()});
        break;
      case Action::kFree:
        e.action = TraceAction::kFreeRequested;
        records.push_back({e, lines_.line_no()});
        e.action = TraceAction::kFreeCompleted;
        records.push_back({e, lines_.line_no()});
        break;
      case Action::kFailure:
        // RMM logs a null pointer; the device's free memory is not known.
        e.action = TraceAction::kOom;
        e.addr = 0;
        records.push_back({e, lines_.line_no()});
        break;
    }
  }

  LineReader& lines_;
  bool have_header_ = false;
  // The records of the last row (a free is two), handed out from pending_ on.
  std::vector<TraceRecord> queued_;
  std::size_t pending_ = 0;
  std::vector<RmmColumn> columns_;
  std::int64_t day_offset_ = 0;
  std::int64_t last_clock_ = 0;
  bool have_clock_ = false;
};

void append_hex(std::string& out, std::uint64_t v) {
  char buf[24];
  buf[0] = '0';
  buf[1] = 'x';
  const char* end = std::to_chars(buf + 2, buf + sizeof buf, v, 16).ptr;
  out.append(buf, static_cast<std::size_t>(end - buf));
}

void append_dec(std::string& out, std::uint64_t v) {
  char buf[24];
  const char* end = std::to_chars(buf, buf + sizeof buf, v).ptr;
  out.append(buf, static_cast<std::size_t>(end - buf));
}

void append_seconds(std::string& out, std::int64_t us) {
  // Magnitude as unsigned, so even INT64_MIN has one.
  std::uint64_t mag = us < 0 ? 0 - static_cast<std::uint64_t>(us) : static_cast<std::uint64_t>(us);
  if (us < 0) out += '-';
  append_dec(out, mag / 1000000);
  out += '.';
  char frac[6];
  std::uint64_t f = mag % 1000000;
  for (int i = 5; i >= 0; --i) {
    frac[i] = static_cast<char>('0' + f % 10);
    f /= 10;
  }
  out.append(frac, 6);
}

}  // namespace

std::unique_ptr<RecordReader> rmm_log_reader(LineReader& lines) {
  return std::make_unique<RmmParser>(lines);
}

std::vector<TraceRecord> parse_rmm_log(std::string_view text, const std::string& name) {
  LineReader lines(text, name);
  RmmParser parser(lines);
  return read_all(parser);
}

std::vector<TraceRecord> read_rmm_log(const std::string& path) {
  const ReadLimits limits = ReadLimits::from_environment();
  ByteSource source(path, limits);
  LineReader lines(source, source.next(), limits.max_line_bytes);
  RmmParser parser(lines);
  return read_all(parser);
}

std::string format_rmm_log(const std::vector<TraceEntry>& entries) {
  std::string out;
  out.reserve(kRmmHeader.size() + 1 + entries.size() * 64);
  out.append(kRmmHeader);
  out += '\n';
  const std::int64_t t0 = entries.empty() ? 0 : entries.front().time_us;
  for (const TraceEntry& e : entries) {
    std::string_view action;
    DevicePtr addr = e.addr;
    switch (e.action) {
      case TraceAction::kAlloc:
        action = "allocate";
        break;
      case TraceAction::kFreeCompleted:
        action = "free";
        break;
      case TraceAction::kOom:
        action = "allocate failure";
        addr = 0;
        break;
      default:
        continue;
    }
    out += "0,";
    // Wrapping arithmetic: a difference beyond 64 bits cannot come from real clocks.
    append_seconds(out, static_cast<std::int64_t>(static_cast<std::uint64_t>(e.time_us) -
                                                  static_cast<std::uint64_t>(t0)));
    out += ',';
    out.append(action);
    out += ',';
    append_hex(out, addr);
    out += ',';
    append_dec(out, e.size);
    out += ',';
    append_hex(out, e.stream);
    out += '\n';
  }
  return out;
}

}  // namespace ccalloc::io
