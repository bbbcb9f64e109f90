// An arena holds everything of one stream: its free pools, the blocks of its segments
// waiting for events, and its share of the statistics. Blocks never merge across segments
// and a segment belongs to one stream, so the hot path needs only the arena's lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "ccalloc/stats.hpp"
#include "core/arena_mutex.hpp"
#include "core/block.hpp"
#include "core/expandable.hpp"
#include "core/ptr_map.hpp"
#include "core/segment_map.hpp"

namespace ccalloc::core {

// A free of a block used on another stream, waiting for the event recorded there.
struct PendingFree {
  EventId event;
  Block* block;
};

struct alignas(64) Arena {
  Arena(StreamId s, std::size_t index)
      : stream(s), order(index), owner(static_cast<SegmentMap::Owner>(index + 1)) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  FreePool& pool_for(bool small) REQUIRES(mutex) { return small ? small_pool : large_pool; }

  ArenaMutex mutex;
  const StreamId stream;
  const std::size_t order;        // creation index: the order in which lock_all() takes arenas
  const SegmentMap::Owner owner;  // its segments' owner in the engine's SegmentMap

  // Everything below is guarded by `mutex`.
  FreePool small_pool GUARDED_BY(mutex){true, this};
  FreePool large_pool GUARDED_BY(mutex){false, this};
  BlockRecycler blocks GUARDED_BY(mutex);
  // The live (allocated) blocks of this arena by address.
  PtrMap<Block*> live GUARDED_BY(mutex);
  // This stream's expandable segments (usually one per pool).
  std::vector<std::unique_ptr<ExpandableSegment>> expandable GUARDED_BY(mutex);
  // Per stream that used one of this arena's blocks: FIFO of frees waiting for its events.
  // Events on one stream complete in order, so processing stops at the first pending one.
  std::vector<std::pair<StreamId, std::deque<PendingFree>>> pending GUARDED_BY(mutex);
  // Statistics of the blocks of this arena (allocation, active, inactive_split and the
  // byte counts). Segment and reserved-memory statistics are device-wide.
  DeviceStats stats GUARDED_BY(mutex);

  // Number of events in `pending`; read without the lock to skip empty arenas.
  std::atomic<std::int64_t> pending_events{0};
};

}  // namespace ccalloc::core
