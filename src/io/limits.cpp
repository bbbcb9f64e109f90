#include "io/limits.hpp"

#include <charconv>
#include <cstdlib>
#include <string_view>
#include <system_error>

#include "ccalloc/errors.hpp"

namespace ccalloc::io {
namespace {

template <typename T>
void override_from(const char* var, T& value) {
  const char* text = std::getenv(var);
  if (text == nullptr) return;
  const std::string_view s(text);
  T v{};
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || v == 0) {
    throw ConfigError(std::string(var) + "='" + std::string(s) +
                      "': expected a positive integer (a limit of the file readers)");
  }
  value = v;
}

}  // namespace

ReadLimits ReadLimits::from_environment() {
  ReadLimits l;
  override_from("CCALLOC_MAX_FILE_BYTES", l.max_file_bytes);
  override_from("CCALLOC_MAX_DATA_BYTES", l.max_data_bytes);
  override_from("CCALLOC_MAX_GZIP_RATIO", l.max_gzip_ratio);
  override_from("CCALLOC_MAX_LINE_BYTES", l.max_line_bytes);
  override_from("CCALLOC_MAX_ENTRIES", l.max_entries);
  override_from("CCALLOC_MAX_PICKLE_MEMO", l.max_pickle_memo);
  override_from("CCALLOC_MAX_PICKLE_VALUES", l.max_pickle_values);
  override_from("CCALLOC_MAX_NESTING", l.max_nesting);
  return l;
}

std::string limit_hint(const char* name, std::uint64_t value, const char* env_var) {
  return std::string(" (limit ") + name + " = " + std::to_string(value) +
         "; raise it with the environment variable " + env_var + ")";
}

}  // namespace ccalloc::io
