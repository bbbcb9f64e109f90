// Whole-file reads and writes, gzip or plain.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace ccalloc::io {

// Default cap on the bytes a reader accepts after decompression: input is untrusted.
inline constexpr std::size_t kDefaultMaxInputBytes = std::size_t{4} << 30;

// Reads `path`, decompressing it if it starts with the gzip magic bytes (whatever its
// name). Throws FormatError naming the file and the byte offset on a truncated or corrupt
// stream, or when the data would exceed `max_bytes`; Error if the file cannot be read.
std::string read_file(const std::string& path, std::size_t max_bytes = kDefaultMaxInputBytes);

// Decompresses a gzip stream held in memory (same errors as read_file; `name` is used in
// messages).
std::string gunzip(std::string_view data, const std::string& name,
                   std::size_t max_bytes = kDefaultMaxInputBytes);

// Writes `data` to `path`, gzip-compressed if the name ends in ".gz". Throws Error on
// failure.
void write_file(const std::string& path, std::string_view data);

}  // namespace ccalloc::io
