// Whole-file reads and writes, gzip or plain.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

#include "io/limits.hpp"

namespace ccalloc::io {

// Default cap on the bytes a reader accepts after decompression: input is untrusted.
inline constexpr std::size_t kDefaultMaxInputBytes = std::size_t{4} << 30;

// Reads `path`, decompressing it if it starts with the gzip magic bytes (whatever its
// name). Throws FormatError naming the file and the byte offset on a truncated or corrupt
// stream, or when the data would exceed `max_bytes`; Error if the file cannot be read.
std::string read_file(const std::string& path, std::size_t max_bytes = kDefaultMaxInputBytes);

// The same under `limits` (through ByteSource: the compressed bytes are never held whole).
std::string read_file(const std::string& path, const ReadLimits& limits);

// Decompresses a gzip stream held in memory (same errors as read_file; `name` is used in
// messages).
std::string gunzip(std::string_view data, const std::string& name,
                   std::size_t max_bytes = kDefaultMaxInputBytes);

// A file's bytes in chunks, decompressed on the way if the file starts with the gzip magic
// bytes: memory stays at a few chunks whatever the file's size. Throws FormatError naming
// the file, the byte offset and the limit (max_file_bytes, max_data_bytes, max_gzip_ratio)
// that was hit, or the corruption; Error if the file cannot be opened or read.
class ByteSource {
 public:
  ByteSource(const std::string& path, const ReadLimits& limits);
  ~ByteSource();
  ByteSource(const ByteSource&) = delete;
  ByteSource& operator=(const ByteSource&) = delete;

  // The next chunk (never empty), or an empty view at the end of the data. Valid until the
  // next call.
  std::string_view next();
  // Bytes handed out so far (decompressed).
  std::uint64_t offset() const { return offset_; }
  bool compressed() const;
  const std::string& name() const { return path_; }

 private:
  struct Inflater;
  std::string_view read_raw();

  std::string path_;
  ReadLimits limits_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file_;
  std::unique_ptr<char[]> raw_;
  std::string_view raw_left_;  // read from disk, not yet inflated
  std::uint64_t file_bytes_ = 0;
  bool raw_eof_ = false;
  std::unique_ptr<Inflater> inflater_;  // null for a plain file
  std::unique_ptr<char[]> out_;
  std::uint64_t offset_ = 0;
};

// Writes `data` to `path`, gzip-compressed if the name ends in ".gz". Throws Error on
// failure.
void write_file(const std::string& path, std::string_view data);

}  // namespace ccalloc::io
