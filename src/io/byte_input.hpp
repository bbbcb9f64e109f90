// The input of the snapshot parsers: bytes held in memory or pulled from a ByteSource in
// chunks, seen through a window that is only copied where a token spans chunks. Offsets
// are absolute (from the first byte of the data), so error messages name the same byte
// whichever way the data arrives.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "io/gzip.hpp"

namespace ccalloc::io {

namespace detail {
// Test hook: when non-zero, every ByteInput hands its parser at most this many bytes per
// chunk, so that tests can make every token span chunks.
inline std::atomic<std::size_t> test_chunk_cap{0};
}  // namespace detail

class ByteInput {
 public:
  // In memory: the size is known, so announced lengths can be checked before reading.
  explicit ByteInput(std::string_view data) : pending_(data), total_(data.size()) {}
  // From `source`, starting with `first`, a chunk already taken from it (may be empty).
  ByteInput(ByteSource& source, std::string_view first) : source_(&source), pending_(first) {}

  std::uint64_t offset() const { return base_ + pos_; }
  // The data's total size when known (in memory).
  std::optional<std::uint64_t> total() const { return total_; }
  // Bytes contiguous at the cursor.
  std::size_t available() const { return window_.size() - pos_; }
  const char* here() const { return window_.data() + pos_; }
  char peek() const { return window_[pos_]; }
  void skip(std::size_t n) { pos_ += n; }

  // True at the end of the data (otherwise at least one byte is available).
  bool at_end() { return pos_ == window_.size() && !ensure(1); }

  // Makes `n` bytes contiguous at the cursor, pulling chunks as needed; false when the data
  // ends first (available() then says how many remain). Pointers from here() are valid
  // until the next call.
  bool ensure(std::size_t n) {
    if (available() >= n) return true;
    if (available() == 0) {
      // The common case: the window is used up; the next chunk becomes it without a copy.
      base_ += window_.size();
      pos_ = 0;
      window_ = pull();
      carry_.clear();
      if (window_.size() >= n) return true;
      if (window_.empty()) return false;
    }
    std::string joined(window_.substr(pos_));
    base_ += pos_;
    pos_ = 0;
    while (joined.size() < n) {
      const std::string_view c = pull();
      if (c.empty()) break;
      joined.append(c);
    }
    carry_ = std::move(joined);
    window_ = carry_;
    return window_.size() >= n;
  }

 private:
  // The next chunk (empty at the end); valid until the next call.
  std::string_view pull() {
    if (pending_.empty() && source_ != nullptr && !eof_) {
      pending_ = source_->next();
      eof_ = pending_.empty();
    }
    std::size_t n = pending_.size();
    if (const std::size_t cap = detail::test_chunk_cap.load(); cap != 0 && cap < n) n = cap;
    const std::string_view c = pending_.substr(0, n);
    pending_.remove_prefix(n);
    return c;
  }

  ByteSource* source_ = nullptr;
  std::string_view pending_;  // of the current chunk, not yet in the window
  std::string_view window_;
  std::string carry_;  // the window when a token spans chunks
  std::size_t pos_ = 0;
  std::uint64_t base_ = 0;  // offset of window_[0]
  std::optional<std::uint64_t> total_;
  bool eof_ = false;
};

}  // namespace ccalloc::io
