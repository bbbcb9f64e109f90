#include "core/stream_table.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <utility>

namespace ccalloc::core {
namespace {

constexpr std::uint64_t kFibonacci = 11400714819323198485ull;
constexpr int kMinLookups = 4;
constexpr double kMaxLoadFactor = 0.5;

}  // namespace

std::size_t StreamTable::home(std::uint64_t key) const {
  return static_cast<std::size_t>((kFibonacci * key) >> shift_);
}

std::size_t StreamTable::next_occupied(std::size_t from) const {
  const std::size_t last = end();
  std::size_t i = from;
  while (i < last && slots_[i].distance < 0) ++i;
  return std::min(i, last);
}

bool StreamTable::contains(std::uint64_t key) const {
  if (buckets_ == 0) return false;
  std::size_t i = home(key);
  for (std::int8_t d = 0; slots_[i].distance >= d; ++d, ++i) {
    if (i != end() && slots_[i].key == key) return true;
  }
  return false;
}

void StreamTable::insert(std::uint64_t key) {
  if (buckets_ == 0) {  // the empty table: the first insertion grows it
    grow();
    insert(key);
    return;
  }
  std::size_t i = home(key);
  std::int8_t distance = 0;
  for (; slots_[i].distance >= distance; ++i, ++distance) {
    if (i != end() && slots_[i].key == key) return;
  }
  if (distance == max_lookups_ ||
      static_cast<double>(count_ + 1) > static_cast<double>(buckets_) * kMaxLoadFactor) {
    grow();
    insert(key);
    return;
  }
  if (slots_[i].distance < 0) {
    slots_[i] = Slot{distance, key};
    ++count_;
    return;
  }
  // Robin Hood: the new key takes this slot, the one it displaces moves on.
  std::uint64_t carried = key;
  std::swap(distance, slots_[i].distance);
  std::swap(carried, slots_[i].key);
  const std::size_t placed = i;
  for (++distance, ++i;; ++i) {
    if (slots_[i].distance < 0) {
      slots_[i] = Slot{distance, carried};
      ++count_;
      return;
    }
    if (slots_[i].distance < distance) {
      std::swap(distance, slots_[i].distance);
      std::swap(carried, slots_[i].key);
      ++distance;
    } else {
      ++distance;
      if (distance == max_lookups_) {
        // Too far from home: the key last carried goes back where the new one was
        // placed, the table grows and the new key is inserted again.
        std::swap(carried, slots_[placed].key);
        grow();
        insert(carried);
        return;
      }
    }
  }
}

void StreamTable::grow() {
  rehash(std::max<std::size_t>(4, 2 * buckets_));
}

void StreamTable::rehash(std::size_t buckets) {
  buckets = std::max<std::size_t>(
      buckets, static_cast<std::size_t>(std::ceil(static_cast<double>(count_) / kMaxLoadFactor)));
  buckets = std::max<std::size_t>(2, std::bit_ceil(buckets));
  if (buckets == buckets_) return;
  std::vector<Slot> old = std::move(slots_);
  const std::size_t old_end = old.empty() ? 0 : old.size() - 1;
  const int log2 = std::bit_width(buckets) - 1;
  buckets_ = buckets;
  shift_ = 64 - log2;
  max_lookups_ = std::max(kMinLookups, log2);
  slots_.assign(buckets + static_cast<std::size_t>(max_lookups_), Slot{});
  slots_.back().distance = 0;  // the end marker
  count_ = 0;
  for (std::size_t i = 0; i < old_end; ++i) {
    if (old[i].distance >= 0) insert(old[i].key);
  }
}

std::size_t StreamTable::erase(std::size_t slot) {
  slots_[slot].distance = -1;
  --count_;
  std::size_t current = slot;
  for (std::size_t next = slot + 1; slots_[next].distance > 0; ++current, ++next) {
    slots_[current] = Slot{static_cast<std::int8_t>(slots_[next].distance - 1), slots_[next].key};
    slots_[next].distance = -1;
  }
  return slots_[slot].distance >= 0 ? slot : next_occupied(slot + 1);
}

void StreamTable::clear() {
  for (std::size_t i = 0; i < end(); ++i)
    slots_[i].distance = -1;
  count_ = 0;
}

std::vector<std::uint64_t> StreamTable::keys() const {
  std::vector<std::uint64_t> out;
  for (std::size_t i = begin(); i != end(); i = next(i))
    out.push_back(slots_[i].key);
  return out;
}

std::vector<std::uint64_t> StreamTable::order_of(const std::vector<std::uint64_t>& keys) {
  StreamTable t;
  for (const std::uint64_t k : keys)
    t.insert(k);
  return t.keys();
}

}  // namespace ccalloc::core
