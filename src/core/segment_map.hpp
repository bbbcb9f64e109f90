// Which arena owns the segment at an address, readable without any lock.
//
// free(ptr) must find the arena (stream) that holds ptr before it can take that arena's
// lock. Segments change rarely (a device allocation or release), so ownership is kept per
// 2 MiB granule of the address space in a three-level radix table: a reader does three
// dependent loads and no atomic read-modify-write. A segment is at least 2 MiB long, so a
// granule meets at most two segments: one ending inside it and one starting there. Each
// granule's entry packs (boundary, owner below it, owner from it on) into one 64-bit word.
//
// Owners are small integers (arena creation index + 1); 0 is "no segment". Writers are
// serialised by the caller (the engine's device mutex). A reader that obtained ptr from
// malloc, directly or through the program's own synchronisation, sees the entry written
// before that malloc returned.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ccalloc/driver.hpp"

namespace ccalloc::core {

class SegmentMap {
 public:
  using Owner = std::uint32_t;
  static constexpr Owner kMaxOwner = (Owner{1} << 21) - 1;

  SegmentMap() = default;
  SegmentMap(const SegmentMap&) = delete;
  SegmentMap& operator=(const SegmentMap&) = delete;

  // [base, base + size) now belongs to `owner`. size >= 2 MiB; ranges never overlap.
  void assign(DevicePtr base, std::size_t size, Owner owner);
  // [base, base + size) no longer belongs to anyone.
  void clear(DevicePtr base, std::size_t size);
  // The owner of the segment containing `ptr`, or 0.
  Owner owner_of(DevicePtr ptr) const {
    const std::atomic<std::uint64_t>* entry = find(ptr);
    if (entry == nullptr) return 0;
    const std::uint64_t e = entry->load(std::memory_order_acquire);
    return (ptr & kGranuleMask) < boundary(e) ? below(e) : above(e);
  }

 private:
  static constexpr unsigned kGranuleBits = 21;  // 2 MiB
  static constexpr DevicePtr kGranuleMask = (DevicePtr{1} << kGranuleBits) - 1;
  static constexpr unsigned kLevelBits = 12;  // 4096 entries a level; 57-bit addresses
  static constexpr std::size_t kLevelSize = std::size_t{1} << kLevelBits;
  static constexpr unsigned kAddressBits = kGranuleBits + 3 * kLevelBits;

  using Leaf = std::array<std::atomic<std::uint64_t>, kLevelSize>;
  using Middle = std::array<std::atomic<Leaf*>, kLevelSize>;

  // Entry layout: bits 0-21 boundary offset (0 .. 2 MiB), 22-42 owner below, 43-63 above.
  static std::uint64_t boundary(std::uint64_t e) { return e & ((1ull << 22) - 1); }
  static Owner below(std::uint64_t e) { return static_cast<Owner>((e >> 22) & kMaxOwner); }
  static Owner above(std::uint64_t e) { return static_cast<Owner>(e >> 43); }
  static std::uint64_t pack(std::uint64_t boundary_offset, Owner below_owner, Owner above_owner) {
    return boundary_offset | (std::uint64_t{below_owner} << 22) |
           (std::uint64_t{above_owner} << 43);
  }

  // Inline: every free and record_stream looks its pointer's owner up.
  const std::atomic<std::uint64_t>* find(DevicePtr ptr) const {
    if ((ptr >> kAddressBits) != 0) return nullptr;
    const DevicePtr g = ptr >> kGranuleBits;
    const Middle* middle =
        top_[(g >> (2 * kLevelBits)) & (kLevelSize - 1)].load(std::memory_order_acquire);
    if (middle == nullptr) return nullptr;
    const Leaf* leaf =
        (*middle)[(g >> kLevelBits) & (kLevelSize - 1)].load(std::memory_order_acquire);
    if (leaf == nullptr) return nullptr;
    return &(*leaf)[g & (kLevelSize - 1)];
  }
  std::atomic<std::uint64_t>& entry(DevicePtr granule_base);  // creates levels; writers only
  // Sets the owner of [from, to) within one granule (from < to, same granule).
  void set_part(DevicePtr from, DevicePtr to, Owner owner);

  std::array<std::atomic<Middle*>, kLevelSize> top_{};
  std::vector<std::unique_ptr<Middle>> middles_;  // ownership of created levels
  std::vector<std::unique_ptr<Leaf>> leaves_;
};

// Owner -> object (an engine's arenas), readable without a lock. Writers are serialised by
// the caller; an object, once set, lives as long as the table.
template <typename T>
class OwnerTable {
 public:
  OwnerTable() = default;
  OwnerTable(const OwnerTable&) = delete;
  OwnerTable& operator=(const OwnerTable&) = delete;

  // The object of `owner`, or nullptr (also for 0, "no segment").
  T* get(SegmentMap::Owner owner) const {
    if (owner == 0) return nullptr;
    const std::size_t i = owner - 1;
    const Chunk* chunk = table_[i / kChunk].load(std::memory_order_acquire);
    return chunk == nullptr ? nullptr : (*chunk)[i % kChunk].load(std::memory_order_acquire);
  }
  // owner in 1 .. SegmentMap::kMaxOwner.
  void set(SegmentMap::Owner owner, T* object) {
    const std::size_t i = owner - 1;
    auto& slot = table_[i / kChunk];
    Chunk* chunk = slot.load(std::memory_order_relaxed);
    if (chunk == nullptr) {
      chunks_.push_back(std::make_unique<Chunk>());
      chunk = chunks_.back().get();
      slot.store(chunk, std::memory_order_release);
    }
    (*chunk)[i % kChunk].store(object, std::memory_order_release);
  }

 private:
  static constexpr std::size_t kChunk = 1024;
  using Chunk = std::array<std::atomic<T*>, kChunk>;
  std::array<std::atomic<Chunk*>, (SegmentMap::kMaxOwner + 1) / kChunk> table_{};
  std::vector<std::unique_ptr<Chunk>> chunks_;
};

}  // namespace ccalloc::core
