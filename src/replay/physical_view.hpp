// The stitching policy's physical memory as `ccalloc summary` and the viewer report it:
// per address range, the pages that are live (backing its segments), dead (mapping a piece
// lent to a later page) or unmapped, the free bytes inside its segments and their
// fragmentation; the spare pieces; and a check that the snapshot's pieces account for
// exactly the memory held (each piece behind at most one page or spare, the segments' and
// spare bytes adding up to the handles'). Computed from a snapshot alone.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "ccalloc/snapshot.hpp"

namespace ccalloc::replay {

struct RangeView {
  DevicePtr address = 0;
  std::size_t size = 0;      // address space reserved (not memory)
  std::size_t frontier = 0;  // bytes that have pages: live, dead or unmapped
  StreamId stream = 0;
  bool is_small = false;
  std::size_t segments = 0;         // runs of live pages
  std::size_t live_pages = 0;       // pages of its segments, each backed by its own piece
  std::size_t dead_pages = 0;       // mapped pieces live elsewhere (or spare): no memory
  std::size_t unmapped_pages = 0;   // below the frontier, neither live nor dead
  std::size_t mapped_bytes = 0;     // (live + dead pages) x piece size: address space mapped
  std::size_t physical_bytes = 0;   // live pages x piece size: the memory the range holds
  std::size_t allocated_bytes = 0;  // its allocated and pending-free blocks
  std::size_t free_bytes = 0;       // inactive blocks inside its segments
  std::size_t largest_free = 0;     // the largest of them
  // 1 - largest_free / free_bytes: the share of the free bytes that a request as large as
  // all of them could not use without stitching (0 when nothing or one block is free).
  double fragmentation = 0.0;
};

struct PhysicalView {
  int device = 0;
  std::size_t piece_size = 0;
  std::size_t handles = 0;
  std::size_t held_bytes = 0;     // the handles' pieces: reserved bytes
  std::size_t segment_bytes = 0;  // the device's segments' total_size: live pages
  std::size_t spare_pieces = 0;
  std::size_t spare_bytes = 0;
  std::size_t dead_pages = 0;
  std::vector<RangeView> ranges;  // by address
  // Where the snapshot's pieces do not account for its memory (a piece behind two pages,
  // a segment whose pieces do not add up to its size, ...); empty for a sound snapshot.
  std::vector<std::string> problems;
};

// The physical memory of `device`; nullopt when the snapshot has none (not the stitching
// policy).
std::optional<PhysicalView> physical_view(const Snapshot& s, int device);

// The per-range table and totals of `ccalloc summary`, one line per range.
std::string physical_summary(const PhysicalView& v);

}  // namespace ccalloc::replay
