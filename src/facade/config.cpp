// Parsing and printing of allocator configuration strings (PyTorch's grammar,
// docs/pytorch-behaviour.md §1). Parsing runs in three steps so that errors come out in a
// useful order and the options that depend on each other see their final inputs:
//   1. tokenize: `,` `:` `[` `]` are tokens, whitespace is dropped, every token keeps the
//      offset of its first character in the input;
//   2. structure: the optional preset, then key:value pairs, checked for shape and for
//      unknown keys;
//   3. values: large_segment_size_mb first (the minimums of max_split_size_mb and
//      max_non_split_rounding_mb and the default of the latter depend on it), then the rest.
#include "ccalloc/config.hpp"

#include <algorithm>
#include <bit>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <system_error>
#include <vector>

#include "ccalloc/errors.hpp"

namespace ccalloc {
namespace {

// PyTorch's defaults for its native allocator. Every field is set here on purpose rather
// than taken from Config's member initialisers: those are ccalloc's defaults and may
// change, while the `pytorch` preset must keep meaning PyTorch's behaviour. A field added
// to Config must be added here too.
Config pytorch_defaults() {
  Config c;
  c.preset = "pytorch";
  c.backend = BackendKind::kNative;
  c.max_split_size = SIZE_MAX;
  c.max_non_split_rounding_size = 20 * kMiB;
  c.large_segment_size = 20 * kMiB;
  c.roundup_power2_divisions.fill(0);
  c.garbage_collection_threshold = 0.0;
  c.expandable_segments = false;
  c.stitch_segments = false;
  c.stream_borrow_wait = true;  // read only under stitch_segments
  c.expandable_segments_reserve_fraction = 0.0;
  c.expandable_segments_reserve_bytes = 0;
  c.release_lock_on_cudamalloc = false;
  c.per_process_memory_fraction = 1.0;
  c.graph_capture_record_stream_reuse = false;
  c.pinned_use_cuda_host_register = false;
  c.pinned_num_register_threads = 1;
  c.pinned_use_background_threads = false;
  c.pinned_reserve_segment_size_mb = 0;
  c.uncached = false;
  c.source.clear();
  return c;
}

// ccalloc's defaults are Config's member initialisers, so that `Config{}` and `parse("")`
// agree whatever those become. Today they differ from pytorch_defaults() in the name, in
// stitch_segments (on) and in expandable_segments (on: the private pools' segments).
Config ccalloc_defaults() {
  return Config{};
}

constexpr std::string_view kPytorchPreset = "pytorch";
constexpr std::string_view kCcallocPreset = "ccalloc";

constexpr std::size_t kMinLargeSegmentMb = 10;  // large_segment_size_mb must exceed this
constexpr std::size_t kMaxRegisterThreads = 128;

constexpr std::string_view kKeyBackend = "backend";
constexpr std::string_view kKeyMaxSplit = "max_split_size_mb";
constexpr std::string_view kKeyMaxNonSplitRounding = "max_non_split_rounding_mb";
constexpr std::string_view kKeyLargeSegment = "large_segment_size_mb";
constexpr std::string_view kKeyRoundup = "roundup_power2_divisions";
constexpr std::string_view kKeyGcThreshold = "garbage_collection_threshold";
constexpr std::string_view kKeyExpandable = "expandable_segments";
constexpr std::string_view kKeyExpandableReserve = "expandable_segments_reserve";
constexpr std::string_view kKeyReleaseLock = "release_lock_on_cudamalloc";
constexpr std::string_view kKeyReleaseLockHip = "release_lock_on_hipmalloc";
constexpr std::string_view kKeyMemoryFraction = "per_process_memory_fraction";
constexpr std::string_view kKeyGraphReuse = "graph_capture_record_stream_reuse";
constexpr std::string_view kKeyHostRegister = "pinned_use_cuda_host_register";
constexpr std::string_view kKeyHostRegisterHip = "pinned_use_hip_host_register";
constexpr std::string_view kKeyRegisterThreads = "pinned_num_register_threads";
constexpr std::string_view kKeyBackgroundThreads = "pinned_use_background_threads";
constexpr std::string_view kKeyReserveSegment = "pinned_reserve_segment_size_mb";
constexpr std::string_view kKeyUncached = "uncached";
constexpr std::string_view kKeyStitch = "stitch_segments";
constexpr std::string_view kKeyBorrowWait = "stream_borrow_wait";
constexpr std::string_view kKeyHandleSize = "stitch_handle_mb";

constexpr std::string_view kAllKeys[] = {
    kKeyBackend,         kKeyMaxSplit,          kKeyMaxNonSplitRounding, kKeyLargeSegment,
    kKeyRoundup,         kKeyGcThreshold,       kKeyExpandable,          kKeyReleaseLock,
    kKeyReleaseLockHip,  kKeyMemoryFraction,    kKeyGraphReuse,          kKeyHostRegister,
    kKeyHostRegisterHip, kKeyRegisterThreads,   kKeyBackgroundThreads,   kKeyReserveSegment,
    kKeyUncached,        kKeyExpandableReserve, kKeyStitch,              kKeyBorrowWait,
    kKeyHandleSize,
};

bool is_known_key(std::string_view key) {
  return std::find(std::begin(kAllKeys), std::end(kAllKeys), key) != std::end(kAllKeys);
}

struct Token {
  std::string text;
  std::size_t offset = 0;  // of the token's first character in the input
};

bool is_punctuation(const Token& token) {
  return token.text == "," || token.text == ":" || token.text == "[" || token.text == "]";
}

// ConfigTokenizer's rules: whitespace is dropped everywhere, also inside a token, so
// "max_split_size_mb: 1 28" reads as max_split_size_mb:128.
std::vector<Token> tokenize(std::string_view text) {
  std::vector<Token> tokens;
  Token word;
  bool in_word = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == ',' || ch == ':' || ch == '[' || ch == ']') {
      if (in_word) tokens.push_back(std::move(word));
      word = Token{};
      in_word = false;
      tokens.push_back(Token{std::string(1, ch), i});
    } else if (!std::isspace(static_cast<unsigned char>(ch))) {
      if (!in_word) word.offset = i;
      in_word = true;
      word.text += ch;
    }
  }
  if (in_word) tokens.push_back(std::move(word));
  return tokens;
}

// One `k:v` inside a bracket value.
struct ListItem {
  Token key;
  Token value;
};

// One `key:value` of the config string.
struct Entry {
  Token key;
  // The value token; for a bracket value, the raw text from '[' to ']' and the offset of '['.
  Token value;
  bool is_list = false;
  std::vector<ListItem> items;
};

[[noreturn]] void throw_error(const std::string& message) {
  throw ConfigError("ccalloc config: " + message);
}

std::string at_offset(std::size_t offset) {
  return " at offset " + std::to_string(offset);
}

// The error for a well-formed pair whose value is not accepted: names the key, the value,
// where it is and what would have been accepted.
[[noreturn]] void throw_invalid_value(std::string_view key, const Token& value,
                                      std::string_view accepted) {
  throw_error("invalid value '" + value.text + "' for key '" + std::string(key) + "'" +
              at_offset(value.offset) + ": " + std::string(accepted));
}

// Checks the shape of the token stream and groups it into the preset and the entries.
class StructureParser {
 public:
  StructureParser(std::string_view text, std::vector<Token> tokens)
      : text_(text), tokens_(std::move(tokens)) {}

  // The preset named as the first element, if any. Call before entries().
  std::optional<Token> preset() {
    if (tokens_.empty() || is_punctuation(tokens_[0])) return std::nullopt;
    if (tokens_.size() > 1 && tokens_[1].text == ":") return std::nullopt;  // a key
    Token name = tokens_[0];
    // A known key without its value: let entries() report the missing ':'.
    if (is_known_key(name.text)) return std::nullopt;
    if (name.text != kPytorchPreset && name.text != kCcallocPreset) {
      throw_error("unknown preset '" + name.text + "'" + at_offset(name.offset) +
                  ": expected pytorch or ccalloc, or a key:value pair");
    }
    pos_ = 1;
    if (pos_ < tokens_.size()) expect(",", "after the preset '" + name.text + "'");
    return name;
  }

  std::vector<Entry> entries() {
    std::vector<Entry> entries;
    while (pos_ < tokens_.size()) {
      entries.push_back(entry());
      // PyTorch's loop accepts one trailing ',' after the last pair; so do we.
      if (pos_ < tokens_.size()) expect(",", "between key:value pairs");
    }
    return entries;
  }

 private:
  bool at_end() const { return pos_ >= tokens_.size(); }
  std::size_t end_offset() const { return text_.size(); }

  // Describes what stands at the current position, for "expected X but got Y" messages.
  std::string got() const {
    if (at_end()) return "the end of the string";
    return "'" + tokens_[pos_].text + "'";
  }
  std::size_t here() const { return at_end() ? end_offset() : tokens_[pos_].offset; }

  void expect(std::string_view punctuation, const std::string& context) {
    if (at_end() || tokens_[pos_].text != punctuation) {
      throw_error("expected '" + std::string(punctuation) + "' " + context + at_offset(here()) +
                  " but got " + got());
    }
    ++pos_;
  }

  Entry entry() {
    Entry e;
    if (is_punctuation(tokens_[pos_])) {
      throw_error("expected a key" + at_offset(here()) + " but got " + got());
    }
    e.key = tokens_[pos_++];
    const bool is_preset = e.key.text == kPytorchPreset || e.key.text == kCcallocPreset;
    if (is_preset && (at_end() || tokens_[pos_].text == ",")) {
      throw_error("preset '" + e.key.text + "'" + at_offset(e.key.offset) +
                  " must be the first element of the string");
    }
    expect(":", "after key '" + e.key.text + "'");
    if (!is_known_key(e.key.text)) {
      std::string known;
      for (std::string_view k : kAllKeys)
        known += (known.empty() ? "" : ", ") + std::string(k);
      throw_error("unrecognized key '" + e.key.text + "'" + at_offset(e.key.offset) +
                  ": expected one of " + known);
    }
    if (!at_end() && tokens_[pos_].text == "[") {
      list_value(e);
    } else if (at_end() || is_punctuation(tokens_[pos_])) {
      throw_error("expected a value for key '" + e.key.text + "'" + at_offset(here()) +
                  " but got " + got());
    } else {
      e.value = tokens_[pos_++];
    }
    return e;
  }

  // `[k:v,k:v,...]`, with an optional ',' before the ']' as PyTorch allows.
  void list_value(Entry& e) {
    const std::size_t open = tokens_[pos_++].offset;
    const std::string context = " in the value of key '" + e.key.text + "'";
    e.is_list = true;
    while (!at_end() && tokens_[pos_].text != "]") {
      ListItem item;
      if (is_punctuation(tokens_[pos_])) {
        throw_error("expected an interval or '>'" + context + at_offset(here()) + " but got " +
                    got());
      }
      item.key = tokens_[pos_++];
      expect(":", "after '" + item.key.text + "'" + context);
      if (at_end() || is_punctuation(tokens_[pos_])) {
        throw_error("expected a value after '" + item.key.text + ":'" + context +
                    at_offset(here()) + " but got " + got());
      }
      item.value = tokens_[pos_++];
      e.items.push_back(std::move(item));
      if (at_end() || tokens_[pos_].text == "]") break;
      expect(",", "or ']' between entries" + context);
    }
    if (at_end()) {
      throw_error("unterminated '[' for key '" + e.key.text + "'" + at_offset(open) +
                  ": expected ']' before the end of the string");
    }
    const std::size_t close = tokens_[pos_++].offset;
    e.value = Token{std::string(text_.substr(open, close - open + 1)), open};
  }

  std::string_view text_;
  std::vector<Token> tokens_;
  std::size_t pos_ = 0;
};

// Plain decimal digits that fit in size_t: no sign, no fraction, no suffix.
std::optional<std::size_t> to_size(std::string_view text) {
  if (text.empty()) return std::nullopt;
  std::size_t value = 0;
  for (char ch : text) {
    if (ch < '0' || ch > '9') return std::nullopt;
    const auto digit = static_cast<std::size_t>(ch - '0');
    if (value > (SIZE_MAX - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  return value;
}

// A finite decimal number, consuming the whole token. std::from_chars rather than strtod so
// that the result does not depend on the process's LC_NUMERIC locale.
std::optional<double> to_double(std::string_view text) {
  double value = 0.0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end || !std::isfinite(value)) return std::nullopt;
  return value;
}

// MB to bytes, clamped as PyTorch does so that the product cannot overflow.
std::size_t mb_to_bytes(std::size_t mb) {
  return std::min(mb, SIZE_MAX / kMiB) * kMiB;
}

std::size_t scalar_size(const Entry& e, std::string_view accepted) {
  if (e.is_list) throw_invalid_value(e.key.text, e.value, accepted);
  const std::optional<std::size_t> value = to_size(e.value.text);
  if (!value) throw_invalid_value(e.key.text, e.value, accepted);
  return *value;
}

double scalar_double(const Entry& e, std::string_view accepted) {
  if (e.is_list) throw_invalid_value(e.key.text, e.value, accepted);
  const std::optional<double> value = to_double(e.value.text);
  if (!value) throw_invalid_value(e.key.text, e.value, accepted);
  return *value;
}

bool scalar_bool(const Entry& e) {
  if (!e.is_list && e.value.text == "True") return true;
  if (!e.is_list && e.value.text == "False") return false;
  throw_invalid_value(e.key.text, e.value, "expected True or False");
}

void set_large_segment_size(Config& c, const Entry& e) {
  const std::string accepted =
      "expected a whole number of MB > " + std::to_string(kMinLargeSegmentMb);
  const std::size_t mb = scalar_size(e, accepted);
  if (mb <= kMinLargeSegmentMb) {
    throw_invalid_value(e.key.text, e.value,
                        "must be > " + std::to_string(kMinLargeSegmentMb) + " MB");
  }
  c.large_segment_size = mb_to_bytes(mb);
}

// max_split_size_mb and max_non_split_rounding_mb: at least the large segment size.
std::size_t size_at_least_large_segment(const Config& c, const Entry& e) {
  const std::string minimum = std::to_string(c.large_segment_size / kMiB);
  const std::size_t mb = scalar_size(e, "expected a whole number of MB >= " + minimum);
  if (mb < c.large_segment_size / kMiB) {
    throw_invalid_value(e.key.text, e.value,
                        "too small, must be >= " + minimum + " (large_segment_size_mb)");
  }
  return mb_to_bytes(mb);
}

bool is_power_of_two_or_zero(std::size_t n) {
  return n == 0 || std::has_single_bit(n);
}

// Form (a) `N` fills the table; form (b) `[K:N,...,>:N]` as in §1.4: K in MB names the
// interval [K MB, 2K MB), the first K also fills every interval below it, and `>` fills the
// intervals after the last K named before it.
void set_roundup_divisions(Config& c, const Entry& e) {
  constexpr std::string_view kDivisions = "the divisions has to be power of 2 or 0";
  std::array<std::size_t, Config::kRoundupIntervals> table{};
  if (!e.is_list) {
    const std::size_t n =
        scalar_size(e, std::string("expected N or [K:N,...,>:N]; ") + std::string(kDivisions));
    if (!is_power_of_two_or_zero(n)) throw_invalid_value(e.key.text, e.value, kDivisions);
    table.fill(n);
    c.roundup_power2_divisions = table;
    return;
  }
  bool first = true;
  std::size_t last_index = 0;
  for (const ListItem& item : e.items) {
    const std::optional<std::size_t> n = to_size(item.value.text);
    if (!n || !is_power_of_two_or_zero(*n)) {
      throw_invalid_value(e.key.text, item.value, kDivisions);
    }
    if (item.key.text == ">") {
      std::fill(table.begin() + static_cast<std::ptrdiff_t>(last_index) + 1, table.end(), *n);
      continue;
    }
    const std::optional<std::size_t> interval_mb = to_size(item.key.text);
    if (!interval_mb || !std::has_single_bit(*interval_mb)) {
      throw_invalid_value(e.key.text, item.key,
                          "expected an interval in MB or '>'; the intervals have to be power "
                          "of 2");
    }
    const std::size_t index =
        std::min<std::size_t>(std::bit_width(*interval_mb) - 1, Config::kRoundupIntervals - 1);
    if (first) std::fill(table.begin(), table.begin() + static_cast<std::ptrdiff_t>(index), *n);
    first = false;
    table[index] = *n;
    last_index = index;
  }
  c.roundup_power2_divisions = table;
}

// expandable_segments_reserve: a fraction of device memory in (0, 1.125] ("0.5"), or a
// size with a unit ("40G", "40GiB", "512M", "512MiB", "40GB").
void set_expandable_reserve(Config& c, const Entry& e) {
  constexpr std::string_view kForm =
      "expected a fraction of device memory in (0, 1.125] such as 0.5, or a size such as 40G";
  if (e.is_list) throw_invalid_value(e.key.text, e.value, kForm);
  const std::string& text = e.value.text;
  std::size_t digits = 0;
  while (digits < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) {
    ++digits;
  }
  const std::string_view unit = std::string_view(text).substr(digits);
  double value = 0.0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + digits, value);
  if (digits == 0 || ec != std::errc() || end != text.data() + digits || !(value > 0.0)) {
    throw_invalid_value(e.key.text, e.value, kForm);
  }
  if (unit.empty()) {
    if (value > 1.125) throw_invalid_value(e.key.text, e.value, kForm);
    c.expandable_segments_reserve_fraction = value;
    c.expandable_segments_reserve_bytes = 0;
    return;
  }
  double factor = 0.0;
  if (unit == "G" || unit == "GiB") factor = 0x1p30;
  if (unit == "GB") factor = 1e9;
  if (unit == "M" || unit == "MiB") factor = 0x1p20;
  if (unit == "MB") factor = 1e6;
  if (factor == 0.0 || value * factor > 0x1p62) throw_invalid_value(e.key.text, e.value, kForm);
  c.expandable_segments_reserve_bytes = static_cast<std::size_t>(value * factor);
  c.expandable_segments_reserve_fraction = 0.0;
}

void set_value(Config& c, const Entry& e) {
  const std::string_view key = e.key.text;
  if (key == kKeyBackend) {
    if (!e.is_list && e.value.text == "native") {
      c.backend = BackendKind::kNative;
    } else if (!e.is_list && e.value.text == "cudaMallocAsync") {
      c.backend = BackendKind::kCudaMallocAsync;
    } else {
      throw_invalid_value(key, e.value,
                          "unknown allocator backend, options are native and cudaMallocAsync");
    }
  } else if (key == kKeyMaxSplit) {
    c.max_split_size = size_at_least_large_segment(c, e);
  } else if (key == kKeyMaxNonSplitRounding) {
    c.max_non_split_rounding_size = size_at_least_large_segment(c, e);
  } else if (key == kKeyLargeSegment) {
    // Applied in the first pass.
  } else if (key == kKeyRoundup) {
    set_roundup_divisions(c, e);
  } else if (key == kKeyGcThreshold) {
    constexpr std::string_view kRange = "expected a number; set it in (0.0, 1.0)";
    const double v = scalar_double(e, kRange);
    if (!(v > 0.0 && v < 1.0)) throw_invalid_value(key, e.value, kRange);
    c.garbage_collection_threshold = v;
  } else if (key == kKeyMemoryFraction) {
    // PyTorch's words, which its tests and users look for.
    constexpr std::string_view kRange =
        "expected a number; per_process_memory_fraction is invalid, set it in [0.0, 1.0]";
    const double v = scalar_double(e, kRange);
    if (!(v >= 0.0 && v <= 1.0)) throw_invalid_value(key, e.value, kRange);
    c.per_process_memory_fraction = v;
  } else if (key == kKeyRegisterThreads) {
    constexpr std::string_view kForm = "expected a power of 2 <= 128";
    const std::size_t n = scalar_size(e, kForm);
    if (!std::has_single_bit(n) || n > kMaxRegisterThreads) {
      throw_invalid_value(key, e.value, kForm);
    }
    c.pinned_num_register_threads = n;
  } else if (key == kKeyReserveSegment) {
    constexpr std::string_view kForm = "expected a whole number of MB greater than 0";
    const std::size_t mb = scalar_size(e, kForm);
    if (mb == 0) throw_invalid_value(key, e.value, kForm);
    c.pinned_reserve_segment_size_mb = mb;
  } else if (key == kKeyExpandable) {
    c.expandable_segments = scalar_bool(e);
  } else if (key == kKeyExpandableReserve) {
    set_expandable_reserve(c, e);
  } else if (key == kKeyReleaseLock || key == kKeyReleaseLockHip) {
    c.release_lock_on_cudamalloc = scalar_bool(e);
  } else if (key == kKeyGraphReuse) {
    c.graph_capture_record_stream_reuse = scalar_bool(e);
  } else if (key == kKeyHostRegister || key == kKeyHostRegisterHip) {
    c.pinned_use_cuda_host_register = scalar_bool(e);
  } else if (key == kKeyBackgroundThreads) {
    c.pinned_use_background_threads = scalar_bool(e);
  } else if (key == kKeyUncached) {
    c.uncached = scalar_bool(e);
  } else if (key == kKeyStitch) {
    c.stitch_segments = scalar_bool(e);
  } else if (key == kKeyBorrowWait) {
    c.stream_borrow_wait = scalar_bool(e);
  } else if (key == kKeyHandleSize) {
    c.stitch_handle_size =
        mb_to_bytes(scalar_size(e, "expected a whole number of MB (0: sized by the room left)"));
  }
}

// The shortest text that reads back as exactly `value`.
std::string format_double(double value) {
  char buffer[64];
  const auto [ptr, ec] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return ec == std::errc() ? std::string(buffer, ptr) : std::to_string(value);
}

const char* format_bool(bool value) {
  return value ? "True" : "False";
}

}  // namespace

Config Config::parse(std::string_view text) {
  StructureParser structure(text, tokenize(text));
  const std::optional<Token> preset = structure.preset();
  const std::vector<Entry> entries = structure.entries();

  Config c = preset && preset->text == kPytorchPreset ? pytorch_defaults() : ccalloc_defaults();
  c.preset = preset ? preset->text : std::string(kCcallocPreset);
  c.source = std::string(text);

  // Under backend:cudaMallocAsync PyTorch reads no key but the backend (its stream-ordered
  // backend never parses the others), so a value it would refuse under the native backend
  // passes there. ccalloc's async backend uses only the backend and the memory fraction; it
  // checks those two and, as PyTorch, lets a malformed value of any other key pass unused.
  const bool async = std::any_of(entries.begin(), entries.end(), [](const Entry& e) {
    return e.key.text == kKeyBackend && !e.is_list && e.value.text == "cudaMallocAsync";
  });
  const auto apply = [&](const Entry& e, void (*set)(Config&, const Entry&)) {
    if (!async || e.key.text == kKeyBackend || e.key.text == kKeyMemoryFraction) {
      set(c, e);
      return;
    }
    try {
      set(c, e);
    } catch (const ConfigError&) {
      // Unused by the async backend, and left unchecked by PyTorch's.
    }
  };
  for (const Entry& e : entries) {
    if (e.key.text == kKeyLargeSegment) apply(e, set_large_segment_size);
  }
  c.max_non_split_rounding_size = c.large_segment_size;
  for (const Entry& e : entries)
    apply(e, set_value);
  return c;
}

Config Config::from_environment() {
  // CCALLOC_CONF picks the preset (and may set keys); PyTorch's own variable, the first of
  // its two names that is set (as PyTorch reads it), applies its keys on top.
  const auto read = [](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);
    if (value == nullptr) return std::nullopt;
    // Each variable alone first, so that an error names the variable and the offset in it.
    try {
      (void)parse(value);
    } catch (const ConfigError& e) {
      throw ConfigError(std::string(e.what()) + " (in environment variable " + name + "=\"" +
                        value + "\")");
    }
    return std::string(value);
  };
  const std::optional<std::string> ours = read("CCALLOC_CONF");
  std::optional<std::string> pytorch;
  const char* pytorch_name = nullptr;
  for (const char* name : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
    if ((pytorch = read(name))) {
      pytorch_name = name;
      break;
    }
  }
  Config c;
  const auto blank = [](const std::optional<std::string>& v) {
    return !v || v->find_first_not_of(" \t") == std::string::npos;
  };
  if (blank(ours) || blank(pytorch)) {
    if (!blank(ours)) c = parse(*ours);
    if (!blank(pytorch)) c = parse(*pytorch);
  } else {
    try {
      c = parse(*ours + "," + *pytorch);
    } catch (const ConfigError& e) {
      // Each parses alone: PyTorch's variable names a preset, which only CCALLOC_CONF may.
      throw ConfigError(std::string(e.what()) + " (in " + pytorch_name + "=\"" + *pytorch +
                        "\", applied on top of CCALLOC_CONF=\"" + *ours +
                        "\": name the preset in CCALLOC_CONF only)");
    }
  }
  // Only the exact value "1" counts, as PyTorch's check_env.
  for (const char* name : {"CCALLOC_NO_CACHING", "PYTORCH_NO_CUDA_MEMORY_CACHING"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::string_view(value) == "1") c.uncached = true;
  }
  return c;
}

std::string Config::to_string() const {
  std::string out = preset;
  const auto add = [&out](std::string_view key, const std::string& value) {
    out += ',';
    out += key;
    out += ':';
    out += value;
  };
  add(kKeyBackend, backend == BackendKind::kNative ? "native" : "cudaMallocAsync");
  // Unlimited, the "off" threshold and the "no reserve" size have no spelling in the
  // grammar (each key rejects them), so they are written by leaving the key out.
  if (max_split_size != SIZE_MAX) add(kKeyMaxSplit, std::to_string(max_split_size / kMiB));
  add(kKeyMaxNonSplitRounding, std::to_string(max_non_split_rounding_size / kMiB));
  add(kKeyLargeSegment, std::to_string(large_segment_size / kMiB));
  const auto& table = roundup_power2_divisions;
  if (std::all_of(table.begin(), table.end(), [&](std::size_t n) { return n == table[0]; })) {
    add(kKeyRoundup, std::to_string(table[0]));
  } else {
    std::string list = "[";
    for (std::size_t i = 0; i < table.size(); ++i) {
      if (i > 0) list += ',';
      list += std::to_string(std::size_t{1} << i) + ':' + std::to_string(table[i]);
    }
    add(kKeyRoundup, list + ']');
  }
  if (garbage_collection_threshold != 0.0) {
    add(kKeyGcThreshold, format_double(garbage_collection_threshold));
  }
  add(kKeyExpandable, format_bool(expandable_segments));
  if (expandable_segments_reserve_fraction != 0.0) {
    add(kKeyExpandableReserve, format_double(expandable_segments_reserve_fraction));
  } else if (expandable_segments_reserve_bytes != 0) {
    add(kKeyExpandableReserve, std::to_string(expandable_segments_reserve_bytes / kMiB) + "M");
  }
  add(kKeyReleaseLock, format_bool(release_lock_on_cudamalloc));
  add(kKeyMemoryFraction, format_double(per_process_memory_fraction));
  add(kKeyGraphReuse, format_bool(graph_capture_record_stream_reuse));
  add(kKeyHostRegister, format_bool(pinned_use_cuda_host_register));
  add(kKeyRegisterThreads, std::to_string(pinned_num_register_threads));
  add(kKeyBackgroundThreads, format_bool(pinned_use_background_threads));
  if (pinned_reserve_segment_size_mb != 0) {
    add(kKeyReserveSegment, std::to_string(pinned_reserve_segment_size_mb));
  }
  add(kKeyUncached, format_bool(uncached));
  if (stitch_segments) {
    add(kKeyStitch, format_bool(stitch_segments));
    add(kKeyBorrowWait, format_bool(stream_borrow_wait));
    if (stitch_handle_size != 0) add(kKeyHandleSize, std::to_string(stitch_handle_size / kMiB));
  }
  return out;
}

}  // namespace ccalloc
