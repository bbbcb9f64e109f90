// An arena holds everything of one stream: its free pools, the blocks of its segments
// waiting for events, and its share of the statistics. Blocks never merge across segments
// and a segment belongs to one stream, so the hot path needs only the arena's lock.
//
// Device-wide peaks of the block statistics (the "baseline ledger"). The device's current
// value of a block statistic is the sum of the arenas' currents c_i; its peak P must be the
// maximum of that sum over time, which no arena can see alone. Each arena keeps, under its
// own lock, a baseline b_i per tracked counter with
//     P = sum of b_i,   and   b_i >= c_i  (except while an arena is "in debt", below).
// A free lowers c_i: the arena gains headroom b_i - c_i at no cost. An operation that raises
// a counter above its baseline leaves the arena in debt; once the arena's lock is released
// (before the operation returns) the engine settles under every arena lock: per counter,
// with debt D (sum of c_i - b_i over arenas above their baseline) and room R (sum of
// b_i - c_i over the others), D > R means the device reached a new peak, so every b_i
// becomes c_i (P = sum of c_i); otherwise the debtors' baselines rise to their currents and
// D is taken from the others' room (largest room first), leaving P unchanged. Headroom thus
// stays with the arenas that had it, so streams that each oscillate within their share of
// the peak never settle again: the hot path writes no shared cache line.
// The peak is exact for any program whose operations do not overlap in time (every
// single-threaded program, whatever its streams); with overlapping operations it is the peak
// of one order of those operations. It is never below a state the device actually reached.
#pragma once

#include <array>
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

// The baselines b_i of the tracked counters: every block statistic of DeviceStats with a
// peak (each StatArray's aggregate, small and large entries) and oversize_allocations.
// Segment and reserved-memory statistics are device-wide (Engine::device_mutex_).
inline constexpr std::size_t kTrackedCounters = 7 * 3 + 1;
struct PeakBaselines {
  using Array = std::array<std::int64_t, 3>;
  Array allocation{};
  Array active{};
  Array inactive_split{};
  Array allocated_bytes{};
  Array active_bytes{};
  Array inactive_split_bytes{};
  Array requested_bytes{};
  std::int64_t oversize_allocations = 0;
};

// Visits every tracked counter as fn(Stat& stat, std::int64_t& baseline).
template <typename Stats, typename Baselines, typename Fn>
constexpr void for_each_tracked(Stats& s, Baselines& b, Fn&& fn) {
  for (int t = 0; t < 3; ++t) {
    fn(s.allocation[t], b.allocation[t]);
    fn(s.active[t], b.active[t]);
    fn(s.inactive_split[t], b.inactive_split[t]);
    fn(s.allocated_bytes[t], b.allocated_bytes[t]);
    fn(s.active_bytes[t], b.active_bytes[t]);
    fn(s.inactive_split_bytes[t], b.inactive_split_bytes[t]);
    fn(s.requested_bytes[t], b.requested_bytes[t]);
  }
  fn(s.oversize_allocations, b.oversize_allocations);
}

constexpr std::size_t count_tracked() {
  PeakBaselines b;
  std::size_t n = 0;
  for_each_tracked(b, b, [&n](const std::int64_t&, const std::int64_t&) { ++n; });
  return n;
}
static_assert(count_tracked() == kTrackedCounters);

struct alignas(64) Arena {
  Arena(StreamId s, std::size_t index)
      : stream(s), order(index), owner(static_cast<SegmentMap::Owner>(index + 1)) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  FreePool& pool_for(bool small) REQUIRES(mutex) { return small ? small_pool : large_pool; }

  // Whether a counter of the aggregate or `pool` entries, or oversize_allocations, exceeds
  // its baseline: the check at the end of an allocation, which may raise any of them.
  bool over_baselines(int pool) const REQUIRES(mutex) {
    const PeakBaselines& b = baselines;
    bool over = stats.oversize_allocations.current > b.oversize_allocations;
    for (const int t : {0, pool}) {
      over |= stats.allocation[t].current > b.allocation[t];
      over |= stats.active[t].current > b.active[t];
      over |= stats.inactive_split[t].current > b.inactive_split[t];
      over |= stats.allocated_bytes[t].current > b.allocated_bytes[t];
      over |= stats.active_bytes[t].current > b.active_bytes[t];
      over |= stats.inactive_split_bytes[t].current > b.inactive_split_bytes[t];
      over |= stats.requested_bytes[t].current > b.requested_bytes[t];
    }
    return over;
  }
  // The same for the inactive-split counters, the only ones a free can raise.
  bool split_over_baselines(int pool) const REQUIRES(mutex) {
    bool over = false;
    for (const int t : {0, pool}) {
      over |= stats.inactive_split[t].current > baselines.inactive_split[t];
      over |= stats.inactive_split_bytes[t].current > baselines.inactive_split_bytes[t];
    }
    return over;
  }

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
  // Their Stat::peak is this stream's own peak, not a share of the device's.
  DeviceStats stats GUARDED_BY(mutex);
  // This arena's share of the device-wide peaks (see the header comment).
  PeakBaselines baselines GUARDED_BY(mutex);
  // Some counter exceeds its baseline: the engine settles before the operation returns.
  bool in_debt GUARDED_BY(mutex) = false;

  // Number of events in `pending`; read without the lock to skip empty arenas.
  std::atomic<std::int64_t> pending_events{0};
};

}  // namespace ccalloc::core
