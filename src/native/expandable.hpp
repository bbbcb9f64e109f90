// An expandable segment: one large reservation of device address space per (stream, pool)
// in which physical pages are mapped on demand, lowest address first, and unmapped when
// wholly free. Pages are 2 MiB in the small pool and large_segment_size (20 MiB) in the
// large pool, one physical allocation each; the reservation defaults to 9/8 of device
// memory, so a segment never runs out of room before the device does.
#pragma once

#include <cstddef>
#include <vector>

#include "ccalloc/driver.hpp"

namespace ccalloc::core {

struct Arena;

struct Range {
  DevicePtr ptr = 0;
  std::size_t size = 0;
};

class ExpandableSegment {
 public:
  // Reserves `reserve` bytes (rounded up to whole pages) of address space.
  ExpandableSegment(Driver& driver, Arena* arena, bool small, std::size_t page,
                    std::size_t reserve);
  // Unmaps what is still mapped and frees the reservation.
  ~ExpandableSegment();
  ExpandableSegment(const ExpandableSegment&) = delete;
  ExpandableSegment& operator=(const ExpandableSegment&) = delete;

  // Maps the pages covering [ptr, ptr + size) (which must be unmapped). Returns the mapped
  // range (whole pages, starting at ptr's page), or a size of 0 when the device is out of
  // memory, in which case nothing stays mapped.
  Range map(Range r);
  // Unmaps the pages lying wholly inside [ptr, ptr + size), after synchronizing the
  // segment's stream (unmapping does not wait for work that used the pages). Returns the
  // unmapped range; size 0 when no whole page lies inside.
  Range unmap(Range r);

  // The pages covering [ptr, ptr + size) (all mapped): the first page's address and
  // their physical handles in address order, for sharing them with another process.
  DevicePtr pages_covering(Range r, std::vector<PhysicalHandle>& handles) const;

  DevicePtr base() const { return base_; }
  std::size_t size() const { return pages_.size() * page_; }
  std::size_t page() const { return page_; }
  std::size_t mapped_bytes() const { return mapped_bytes_; }
  bool contains(DevicePtr p) const { return p >= base_ && p < base_ + size(); }
  Arena* arena() const { return arena_; }
  bool small() const { return small_; }

 private:
  Driver& driver_;
  Arena* const arena_;
  const bool small_;
  const std::size_t page_;
  DevicePtr base_ = 0;
  std::vector<PhysicalHandle> pages_;  // 0: not mapped
  std::size_t mapped_bytes_ = 0;
};

}  // namespace ccalloc::core
