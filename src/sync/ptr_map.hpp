// An open-addressing hash map from device addresses to blocks: power-of-two capacity,
// linear probing, backward-shift deletion (no tombstones). Address 0 marks an empty slot;
// it is never a live allocation. Not thread safe: ActiveIndex guards each map.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ccalloc/driver.hpp"
#include "sync/cache_line.hpp"

namespace ccalloc::core {

template <typename V>
class PtrMap {
 public:
  PtrMap() { rehash(16); }

  // Inserts or overwrites. Inline into a hit's malloc (docs/hot-path.md).
  [[gnu::always_inline]] void insert(DevicePtr key, V value) {
    if ((size_ + 1) * 2 > capacity_) [[unlikely]] rehash(capacity_ * 2);
    std::size_t i = slot_of(key);
    while (slots_[i].key != 0 && slots_[i].key != key)
      i = (i + 1) & mask_;
    if (slots_[i].key == 0) ++size_;
    slots_[i] = Slot{key, value};
  }

  // The value for `key`, or V{} if absent.
  V find(DevicePtr key) const {
    for (std::size_t i = slot_of(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return slots_[i].value;
      if (slots_[i].key == 0) return V{};
    }
  }

  // Removes `key` and returns its value, or V{} if absent.
  V erase(DevicePtr key) {
    std::size_t i = slot_of(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == 0) return V{};
      i = (i + 1) & mask_;
    }
    const V value = slots_[i].value;
    // Shift later members of the probe run back so lookups never meet a hole early.
    for (std::size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
      const std::size_t home = slot_of(slots_[j].key);
      // Move j into the hole at i unless its home lies cyclically in (i, j].
      const bool home_in_range = i <= j ? (i < home && home <= j) : (i < home || home <= j);
      if (!home_in_range) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Slot{};
    --size_;
    return value;
  }

  std::size_t size() const { return size_; }

  template <typename Fn>
  void for_each(Fn&& fn) const {
    for (std::size_t i = 0; i < capacity_; ++i) {
      if (slots_[i].key != 0) fn(slots_[i].key, slots_[i].value);
    }
  }

 private:
  struct Slot {
    DevicePtr key = 0;
    V value{};
  };

  std::size_t slot_of(DevicePtr key) const {
    // Fibonacci hashing of the 512-byte granule: consecutive blocks spread evenly.
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void rehash(std::size_t capacity) {
    auto old = std::move(slots_);
    const std::size_t old_capacity = capacity_;
    slots_ = Slots(capacity);
    capacity_ = capacity;
    mask_ = capacity - 1;
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(capacity));
    size_ = 0;
    for (std::size_t i = 0; i < old_capacity; ++i) {
      if (old[i].key != 0) insert(old[i].key, old[i].value);
    }
  }

  // Whole cache lines (sync/cache_line.hpp): a map is written on every malloc and free of
  // its arena.
  using Slots = std::vector<Slot, CacheLineAllocator<Slot>>;
  Slots slots_;
  std::size_t capacity_ = 0;
  std::size_t mask_ = 0;
  unsigned shift_ = 64;
  std::size_t size_ = 0;
};

}  // namespace ccalloc::core
