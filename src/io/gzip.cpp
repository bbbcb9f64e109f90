#include "io/gzip.hpp"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "ccalloc/errors.hpp"

namespace ccalloc::io {
namespace {

constexpr std::size_t kChunk = std::size_t{256} << 10;
// ByteSource's reads from disk and its decompressed chunks.
constexpr std::size_t kStreamChunk = std::size_t{64} << 10;
// zlib counts in uInt; larger inputs are fed in slices of this size.
constexpr std::size_t kMaxZlibSlice = std::size_t{1} << 30;

bool has_gzip_magic(std::string_view data) {
  return data.size() >= 2 && static_cast<unsigned char>(data[0]) == 0x1f &&
         static_cast<unsigned char>(data[1]) == 0x8b;
}

std::string system_error_text(int err) {
  return std::strerror(err);
}

struct FileCloser {
  void operator()(std::FILE* f) const {
    if (f != nullptr) std::fclose(f);
  }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

// Ends the zlib stream on every exit path, including exceptions.
struct InflateGuard {
  z_stream* zs;
  ~InflateGuard() { inflateEnd(zs); }
};
struct DeflateGuard {
  z_stream* zs;
  ~DeflateGuard() { deflateEnd(zs); }
};

std::string zlib_message(const z_stream& zs, int rc) {
  if (zs.msg != nullptr) return zs.msg;
  return "zlib error " + std::to_string(rc);
}

std::string exceeds_limit(const std::string& name, std::size_t max_bytes) {
  return name + ": data exceeds the limit of " + std::to_string(max_bytes) + " bytes";
}

void write_all(std::FILE* f, const std::string& path, const void* data, std::size_t n) {
  if (n != 0 && std::fwrite(data, 1, n, f) != n) {
    throw Error("cannot write '" + path + "': " + system_error_text(errno));
  }
}

std::string gzip_bytes(std::string_view data, const std::string& path) {
  z_stream zs{};
  // windowBits 15 + 16 asks zlib for a gzip header and trailer instead of zlib's own.
  int rc = deflateInit2(&zs, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  if (rc == Z_MEM_ERROR) throw std::bad_alloc();
  if (rc != Z_OK) throw Error("cannot compress '" + path + "': " + zlib_message(zs, rc));
  DeflateGuard guard{&zs};

  std::string out;
  // Not zeroed: zlib writes it before anything reads it.
  const auto buf = std::make_unique_for_overwrite<unsigned char[]>(kChunk);
  const auto* begin = reinterpret_cast<const Bytef*>(data.data());
  std::size_t fed = 0;
  zs.next_in = const_cast<Bytef*>(begin);  // zlib's API is not const-correct
  zs.avail_in = 0;
  for (;;) {
    if (zs.avail_in == 0 && fed < data.size()) {
      const std::size_t slice = std::min(data.size() - fed, kMaxZlibSlice);
      zs.next_in = const_cast<Bytef*>(begin + fed);
      zs.avail_in = static_cast<uInt>(slice);
      fed += slice;
    }
    const int flush = (fed == data.size()) ? Z_FINISH : Z_NO_FLUSH;
    zs.next_out = buf.get();
    zs.avail_out = static_cast<uInt>(kChunk);
    rc = deflate(&zs, flush);
    if (rc == Z_STREAM_ERROR) {
      throw Error("cannot compress '" + path + "': " + zlib_message(zs, rc));
    }
    out.append(reinterpret_cast<const char*>(buf.get()), kChunk - zs.avail_out);
    if (rc == Z_STREAM_END) break;
  }
  return out;
}

}  // namespace

std::string gunzip(std::string_view data, const std::string& name, std::size_t max_bytes) {
  if (!has_gzip_magic(data)) {
    throw FormatError(name + ": not a gzip stream (missing the magic bytes 1f 8b at offset 0)");
  }
  z_stream zs{};
  // 15 + 16: gzip framing only. zlib's automatic detection (+32) would also accept zlib
  // streams, which a .gz file never holds.
  int rc = inflateInit2(&zs, 15 + 16);
  if (rc == Z_MEM_ERROR) throw std::bad_alloc();
  if (rc != Z_OK) throw Error(name + ": cannot start decompression: " + zlib_message(zs, rc));
  InflateGuard guard{&zs};

  const auto* begin = reinterpret_cast<const Bytef*>(data.data());
  auto offset = [&] { return static_cast<std::size_t>(zs.next_in - begin); };
  std::string out;
  // Not zeroed: zlib writes it before anything reads it.
  const auto buf = std::make_unique_for_overwrite<unsigned char[]>(kChunk);
  zs.next_in = const_cast<Bytef*>(begin);  // zlib's API is not const-correct
  zs.avail_in = 0;
  for (;;) {
    if (zs.avail_in == 0 && offset() < data.size()) {
      zs.avail_in = static_cast<uInt>(std::min(data.size() - offset(), kMaxZlibSlice));
    }
    zs.next_out = buf.get();
    zs.avail_out = static_cast<uInt>(kChunk);
    rc = inflate(&zs, Z_NO_FLUSH);
    const std::size_t produced = kChunk - zs.avail_out;
    if (produced > max_bytes - out.size()) throw FormatError(exceeds_limit(name, max_bytes));
    out.append(reinterpret_cast<const char*>(buf.get()), produced);

    switch (rc) {
      case Z_OK:
        continue;
      case Z_STREAM_END:
        if (offset() == data.size()) return out;
        // Another member follows (gzip files may be concatenated, as `cat a.gz b.gz`
        // makes); anything else after the member fails its header check as corrupt.
        rc = inflateReset(&zs);
        if (rc != Z_OK) throw Error(name + ": cannot continue decompression");
        continue;
      case Z_BUF_ERROR:
        // No progress is possible with output space free, so the input ran out.
        throw FormatError(name + ": truncated gzip stream: the compressed data ends at byte " +
                          std::to_string(data.size()) + " before the end of the stream");
      case Z_MEM_ERROR:
        throw std::bad_alloc();
      case Z_DATA_ERROR:
      case Z_NEED_DICT:
        throw FormatError(name + ": corrupt gzip stream at compressed byte offset " +
                          std::to_string(offset()) + ": " + zlib_message(zs, rc));
      default:
        throw Error(name + ": decompression failed at compressed byte offset " +
                    std::to_string(offset()) + ": " + zlib_message(zs, rc));
    }
  }
}

struct ByteSource::Inflater {
  z_stream zs{};
  bool started = false;
  ~Inflater() {
    if (started) inflateEnd(&zs);
  }
};

ByteSource::ByteSource(const std::string& path, const ReadLimits& limits)
    : path_(path),
      limits_(limits),
      file_(std::fopen(path.c_str(), "rb"), &std::fclose),
      raw_(std::make_unique_for_overwrite<char[]>(kStreamChunk)) {
  if (!file_) throw Error("cannot open '" + path + "': " + system_error_text(errno));
  const std::string_view head = read_raw();
  raw_left_ = head;
  if (!has_gzip_magic(head)) return;
  inflater_ = std::make_unique<Inflater>();
  const int rc = inflateInit2(&inflater_->zs, 15 + 16);
  if (rc == Z_MEM_ERROR) throw std::bad_alloc();
  if (rc != Z_OK) {
    throw Error(path_ + ": cannot start decompression: " + zlib_message(inflater_->zs, rc));
  }
  inflater_->started = true;
  out_ = std::make_unique_for_overwrite<char[]>(kStreamChunk);
}

ByteSource::~ByteSource() = default;

bool ByteSource::compressed() const {
  return inflater_ != nullptr;
}

std::string_view ByteSource::read_raw() {
  if (raw_eof_) return {};
  const std::size_t n = std::fread(raw_.get(), 1, kStreamChunk, file_.get());
  if (n < kStreamChunk) {
    if (std::ferror(file_.get())) {
      throw Error("cannot read '" + path_ + "': " + system_error_text(errno));
    }
    raw_eof_ = true;
  }
  file_bytes_ += n;
  if (file_bytes_ > limits_.max_file_bytes) {
    throw FormatError(
        path_ + ": the file is larger than " + std::to_string(limits_.max_file_bytes) + " bytes" +
        limit_hint("max_file_bytes", limits_.max_file_bytes, "CCALLOC_MAX_FILE_BYTES"));
  }
  return {raw_.get(), n};
}

std::string_view ByteSource::next() {
  std::string_view chunk;
  if (!inflater_) {
    chunk = raw_left_.empty() ? read_raw() : raw_left_;
    raw_left_ = {};
  } else {
    z_stream& zs = inflater_->zs;
    for (;;) {
      if (raw_left_.empty()) raw_left_ = read_raw();
      // A clean end: the file ends where a member ended (inflateReset zeroes the totals).
      if (raw_left_.empty() && zs.total_in == 0 && zs.total_out == 0) return {};
      zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw_left_.data()));
      zs.avail_in = static_cast<uInt>(raw_left_.size());
      zs.next_out = reinterpret_cast<Bytef*>(out_.get());
      zs.avail_out = static_cast<uInt>(kStreamChunk);
      const int rc = inflate(&zs, Z_NO_FLUSH);
      const std::uint64_t consumed_at = file_bytes_ - (raw_left_.size() - zs.avail_in);
      raw_left_.remove_prefix(raw_left_.size() - zs.avail_in);
      const std::size_t produced = kStreamChunk - zs.avail_out;
      switch (rc) {
        case Z_OK:
          break;
        case Z_BUF_ERROR:
          // No progress with output space free: more input is needed, and there is none.
          if (raw_left_.empty() && raw_eof_) {
            throw FormatError(path_ + ": truncated gzip stream: the compressed data ends at byte " +
                              std::to_string(file_bytes_) + " before the end of the stream");
          }
          break;
        case Z_STREAM_END:
          // Another member may follow (`cat a.gz b.gz`); anything else after the member
          // fails its header check as corrupt.
          if (inflateReset(&zs) != Z_OK) throw Error(path_ + ": cannot continue decompression");
          break;
        case Z_MEM_ERROR:
          throw std::bad_alloc();
        default:
          throw FormatError(path_ + ": corrupt gzip stream at compressed byte offset " +
                            std::to_string(consumed_at) + ": " + zlib_message(zs, rc));
      }
      if (produced == 0) continue;
      chunk = {out_.get(), produced};
      const std::uint64_t out_total = offset_ + produced;
      if (out_total > kRatioGraceBytes &&
          out_total / std::max<std::uint64_t>(consumed_at, 1) > limits_.max_gzip_ratio) {
        throw FormatError(
            path_ + ": decompresses more than " + std::to_string(limits_.max_gzip_ratio) +
            " times over (" + std::to_string(out_total) + " bytes from the first " +
            std::to_string(consumed_at) + " compressed bytes): not a trace or snapshot" +
            limit_hint("max_gzip_ratio", limits_.max_gzip_ratio, "CCALLOC_MAX_GZIP_RATIO"));
      }
      break;
    }
  }
  if (chunk.size() > limits_.max_data_bytes - std::min(offset_, limits_.max_data_bytes)) {
    throw FormatError(
        path_ + ": data exceeds the limit of " + std::to_string(limits_.max_data_bytes) +
        " bytes at byte offset " + std::to_string(limits_.max_data_bytes) +
        limit_hint("max_data_bytes", limits_.max_data_bytes, "CCALLOC_MAX_DATA_BYTES"));
  }
  offset_ += chunk.size();
  return chunk;
}

std::string read_file(const std::string& path, std::size_t max_bytes) {
  FilePtr f(std::fopen(path.c_str(), "rb"));
  if (!f) throw Error("cannot open '" + path + "': " + system_error_text(errno));

  std::string raw;
  const auto buf = std::make_unique_for_overwrite<char[]>(kChunk);
  for (;;) {
    const std::size_t n = std::fread(buf.get(), 1, kChunk, f.get());
    raw.append(buf.get(), n);
    // A plain file is the output itself, so it is held to the limit while it is read.
    if (raw.size() > max_bytes && raw.size() >= 2 && !has_gzip_magic(raw)) {
      throw FormatError(exceeds_limit(path, max_bytes));
    }
    if (n < kChunk) break;
  }
  if (std::ferror(f.get())) {
    throw Error("cannot read '" + path + "': " + system_error_text(errno));
  }
  if (has_gzip_magic(raw)) return gunzip(raw, path, max_bytes);
  if (raw.size() > max_bytes) throw FormatError(exceeds_limit(path, max_bytes));
  return raw;
}

std::string read_file(const std::string& path, const ReadLimits& limits) {
  ByteSource source(path, limits);
  std::string out;
  for (std::string_view chunk = source.next(); !chunk.empty(); chunk = source.next())
    out.append(chunk);
  return out;
}

void write_file(const std::string& path, std::string_view data) {
  const bool compress = path.size() >= 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
  // Compressed before the file is opened, so a compression failure leaves no stub behind.
  const std::string packed = compress ? gzip_bytes(data, path) : std::string();
  const std::string_view bytes = compress ? std::string_view(packed) : data;

  FilePtr f(std::fopen(path.c_str(), "wb"));
  if (!f) throw Error("cannot open '" + path + "' for writing: " + system_error_text(errno));
  write_all(f.get(), path, bytes.data(), bytes.size());
  // fclose flushes: its failure is a write failure (a full disk shows up here).
  if (std::fclose(f.release()) != 0) {
    throw Error("cannot write '" + path + "': " + system_error_text(errno));
  }
}

}  // namespace ccalloc::io
