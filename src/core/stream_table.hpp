// The order in which PyTorch's allocator visits streams: its table of outstanding events by
// stream (and each block's set of streams that used it) is an open-addressing hash table
// with Robin Hood probing and Fibonacci hashing of c10's stream hash (the `flat_hash_map` in
// c10/util). Which block returns to its pool first, when events of several streams complete
// at one malloc, follows the table's slots, and the merges of neighbouring blocks, with the
// counts of inactive splits, follow that. StreamTable reproduces the slots: the same keys
// inserted and erased in the same order land in the same slots and iterate in the same
// order (docs/pytorch-behaviour.md §2.10).
//
// The model, as the table defines it: 2^k slots plus max(4, k) overflow slots after them;
// a key's home slot is (key * 11400714819323198485) >> (64 - k); each occupied slot keeps
// its distance from home, inserting displaces a key closer to its home than the one being
// placed (Robin Hood), and the table doubles (at least 4 slots) before an insertion that
// would fill more than half of the slots or probe max_lookups slots, re-inserting the keys
// in slot order. Erasing shifts the following keys that are away from home back by one.
// Iteration visits slots in ascending order; erasing at the current slot continues at that
// slot when a key moved into it, else at the next occupied slot.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ccalloc::core {

class StreamTable {
 public:
  // Adds `key` if absent.
  void insert(std::uint64_t key);
  // Removes every key; the slots stay as many.
  void clear();
  bool contains(std::uint64_t key) const;
  std::size_t size() const { return count_; }

  // Iteration: slot indices, end() past the last.
  std::size_t begin() const { return next_occupied(0); }
  std::size_t end() const { return slots_.empty() ? 0 : slots_.size() - 1; }
  std::size_t next(std::size_t slot) const { return next_occupied(slot + 1); }
  std::uint64_t key(std::size_t slot) const { return slots_[slot].key; }
  // Removes the key at `slot`; returns where iteration continues.
  std::size_t erase(std::size_t slot);

  // The keys in iteration order.
  std::vector<std::uint64_t> keys() const;
  // The iteration order of a fresh table after inserting `keys` in this order.
  static std::vector<std::uint64_t> order_of(const std::vector<std::uint64_t>& keys);

 private:
  struct Slot {
    std::int8_t distance = -1;  // from the key's home slot; -1: empty
    std::uint64_t key = 0;
  };
  std::size_t home(std::uint64_t key) const;
  void grow();
  void rehash(std::size_t buckets);
  std::size_t next_occupied(std::size_t from) const;

  // num_buckets slots, then max_lookups - 1 overflow slots, then an end marker (an
  // "occupied" slot at distance 0 that stops probes and iteration); empty before the
  // first insertion.
  std::vector<Slot> slots_;
  std::size_t buckets_ = 0;
  int shift_ = 63;
  int max_lookups_ = 3;
  std::size_t count_ = 0;
};

}  // namespace ccalloc::core
