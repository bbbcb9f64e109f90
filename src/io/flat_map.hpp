// A small open-addressing hash map for the writers' memo tables (pointer identity or
// string content to an index): several times faster than std::unordered_map on the
// millions of lookups a large snapshot needs. Internal to src/io.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

namespace ccalloc::io::detail {

inline std::uint64_t mix64(std::uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

inline std::uint64_t hash_key(const void* p) {
  return mix64(static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)));
}

inline std::uint64_t hash_key(std::string_view s) {
  std::uint64_t h = 0x9e3779b97f4a7c15ULL ^ s.size();
  const char* p = s.data();
  std::size_t n = s.size();
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * 0x100000001b3ULL;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  std::uint64_t w = 0;
  std::memcpy(&w, p, n);
  h = (h ^ w) * 0x100000001b3ULL;
  return mix64(h);
}

// Keys are copied as they are (a string_view must outlive the map).
template <typename Key, typename Mapped>
class FlatMap {
 public:
  // The mapped value for `key`, inserting `value` if the key is new; the bool says whether
  // it was inserted. The pointer is valid until the next insertion.
  std::pair<Mapped*, bool> try_emplace(const Key& key, Mapped value) {
    if (2 * (count_ + 1) > slots_.size()) grow();
    const std::uint64_t h = hash_key(key);
    std::size_t i = static_cast<std::size_t>(h) & (slots_.size() - 1);
    for (;;) {
      Slot& s = slots_[i];
      if (!s.used) {
        s = Slot{key, h, std::move(value), true};
        ++count_;
        return {&s.value, true};
      }
      if (s.hash == h && s.key == key) return {&s.value, false};
      i = (i + 1) & (slots_.size() - 1);
    }
  }

  Mapped* find(const Key& key) {
    if (slots_.empty()) return nullptr;
    const std::uint64_t h = hash_key(key);
    std::size_t i = static_cast<std::size_t>(h) & (slots_.size() - 1);
    for (;;) {
      Slot& s = slots_[i];
      if (!s.used) return nullptr;
      if (s.hash == h && s.key == key) return &s.value;
      i = (i + 1) & (slots_.size() - 1);
    }
  }

  std::size_t size() const { return count_; }

 private:
  struct Slot {
    Key key{};
    std::uint64_t hash = 0;
    Mapped value{};
    bool used = false;
  };

  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(old.empty() ? 64 : old.size() * 2, Slot{});
    for (Slot& s : old) {
      if (!s.used) continue;
      std::size_t i = static_cast<std::size_t>(s.hash) & (slots_.size() - 1);
      while (slots_[i].used)
        i = (i + 1) & (slots_.size() - 1);
      slots_[i] = std::move(s);
    }
  }

  std::vector<Slot> slots_;
  std::size_t count_ = 0;
};

}  // namespace ccalloc::io::detail
