#include "core/segment_map.hpp"

#include <cinttypes>
#include <cstdio>

#include "ccalloc/errors.hpp"

namespace ccalloc::core {

std::atomic<std::uint64_t>& SegmentMap::entry(DevicePtr granule_base) {
  if ((granule_base >> kAddressBits) != 0) {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "ccalloc: device address 0x%" PRIxPTR
                  " is beyond the 57-bit address space "
                  "the allocator indexes",
                  granule_base);
    throw DriverError(buf);
  }
  const DevicePtr g = granule_base >> kGranuleBits;
  auto& middle_slot = top_[(g >> (2 * kLevelBits)) & (kLevelSize - 1)];
  Middle* middle = middle_slot.load(std::memory_order_relaxed);
  if (middle == nullptr) {
    middles_.push_back(std::make_unique<Middle>());
    middle = middles_.back().get();
    middle_slot.store(middle, std::memory_order_release);
  }
  auto& leaf_slot = (*middle)[(g >> kLevelBits) & (kLevelSize - 1)];
  Leaf* leaf = leaf_slot.load(std::memory_order_relaxed);
  if (leaf == nullptr) {
    leaves_.push_back(std::make_unique<Leaf>());
    leaf = leaves_.back().get();
    leaf_slot.store(leaf, std::memory_order_release);
  }
  return (*leaf)[g & (kLevelSize - 1)];
}

// A segment (>= 2 MiB) covers a granule whole, or from its start to a boundary (the
// segment ends there), or from a boundary to its end (the segment starts there). The other
// side of the boundary keeps its owner: an address in a gap may map to a neighbour, which
// is harmless, since the owner's own index has the final word on what is live.
void SegmentMap::set_part(DevicePtr from, DevicePtr to, Owner owner) {
  const DevicePtr granule = from & ~kGranuleMask;
  const std::uint64_t a = from - granule;
  const std::uint64_t b = to - granule;
  std::atomic<std::uint64_t>& slot = entry(granule);
  const std::uint64_t e = slot.load(std::memory_order_relaxed);
  std::uint64_t next;
  if (a == 0 && b == kGranuleMask + 1) {
    next = pack(0, 0, owner);
  } else if (a == 0) {
    next = pack(b, owner, above(e));
  } else {
    next = pack(a, below(e), owner);
  }
  slot.store(next, std::memory_order_release);
}

void SegmentMap::assign(DevicePtr base, std::size_t size, Owner owner) {
  const DevicePtr end = base + size;
  for (DevicePtr from = base; from < end;) {
    const DevicePtr to = std::min<DevicePtr>((from & ~kGranuleMask) + kGranuleMask + 1, end);
    set_part(from, to, owner);
    from = to;
  }
}

void SegmentMap::clear(DevicePtr base, std::size_t size) {
  assign(base, size, 0);
}

}  // namespace ccalloc::core
