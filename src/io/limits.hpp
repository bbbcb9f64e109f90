// Bounds on what the file readers accept. Input is untrusted: each bound turns a file that
// would take unbounded time or memory into a FormatError that names the bound, where in
// the file it was hit, and the environment variable that raises it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ccalloc::io {

struct ReadLimits {
  // Bytes read from disk (compressed or not). CCALLOC_MAX_FILE_BYTES.
  std::uint64_t max_file_bytes = std::uint64_t{16} << 30;
  // Bytes after decompression. CCALLOC_MAX_DATA_BYTES.
  std::uint64_t max_data_bytes = std::uint64_t{4} << 30;
  // Decompressed bytes per compressed byte, checked once kRatioGraceBytes have come out:
  // gzip's ceiling is about 1032, which only runs of one byte reach; real traces stay far
  // below 100. CCALLOC_MAX_GZIP_RATIO.
  std::uint64_t max_gzip_ratio = 500;
  // One line of a trace CSV or RMM log, line end excluded. Rows are under 128 bytes.
  // CCALLOC_MAX_LINE_BYTES.
  std::size_t max_line_bytes = std::size_t{64} << 10;
  // Trace entries one file may yield. CCALLOC_MAX_ENTRIES (or `ccalloc replay
  // --max-entries`).
  std::uint64_t max_entries = std::uint64_t{1} << 32;
  // Snapshots: pickle memo entries (CCALLOC_MAX_PICKLE_MEMO), values created
  // (CCALLOC_MAX_PICKLE_VALUES) and container nesting of pickle and JSON
  // (CCALLOC_MAX_NESTING).
  std::size_t max_pickle_memo = std::size_t{1} << 26;
  std::size_t max_pickle_values = std::size_t{1} << 28;
  std::size_t max_nesting = 256;

  // The defaults above, overridden by the CCALLOC_MAX_* variables that are set. Throws
  // ConfigError naming a variable that is not a positive integer.
  static ReadLimits from_environment();
};

// Below this much output the ratio is not checked: small files of repeated text are legal.
inline constexpr std::uint64_t kRatioGraceBytes = std::uint64_t{64} << 20;

// " (limit NAME = VALUE; raise it with the environment variable VAR)": the tail of every
// limit message.
std::string limit_hint(const char* name, std::uint64_t value, const char* env_var);

}  // namespace ccalloc::io
