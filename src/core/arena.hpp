// An arena holds everything of one stream in one memory pool (the default pool or a
// private pool): its free pools, the blocks of its segments waiting for events, and its
// share of the statistics. Blocks never merge across segments and a segment belongs to one
// arena, so the hot path needs only the arena's lock.
//
// Device-wide peaks of the block statistics (the "baseline ledger"). The device's current
// value of a block statistic is the sum of the arenas' currents c_i; its peak P must be the
// maximum of that sum over time, which no arena can see alone. Each arena keeps, under its
// own lock, a baseline b_i per tracked counter with
//     P = sum of b_i,   and   b_i >= c_i  (except while an arena is "in debt", below).
// The baseline lives in the arena's own Stat::peak, less the counter's unsettled debt:
// Stat::increase already compares current with peak, so the hot path pays no extra check.
// A free lowers c_i: the arena gains headroom b_i - c_i at no cost. An increase beyond the
// peak raises the peak as usual and records the excess as debt, leaving the arena in debt;
// once the arena's lock is released (before the operation returns) the engine settles
// under every arena lock: per counter, with debt D (sum of c_i - b_i over arenas above
// their baseline) and room R (sum of b_i - c_i over the others), D > R means the device
// reached a new peak, so every b_i becomes c_i (P = sum of c_i); otherwise the debtors'
// baselines rise to their currents and D is taken from the others' room (largest room
// first), leaving P unchanged. Headroom stays with the arenas that had it, so streams that
// each oscillate within their share of the peak never settle again: the hot path writes no
// shared cache line.
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
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
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

struct Arena;

// A private memory pool (CUDA graph capture, torch.cuda.MemPool): an arena per stream of
// its own. Pools are never destroyed while the engine lives (a pool that is gone is only
// unlisted), so arenas may keep a plain pointer to theirs.
struct PrivatePool {
  PrivatePool(PoolId i, std::optional<SegmentSource> s) : id(i), source(std::move(s)) {}
  const PoolId id;
  const std::optional<SegmentSource> source;  // segments' origin instead of the device
  // Guarded by the engine's registry mutex (fields below, except where said).
  int use_count = 1;
  bool use_on_oom = false;
  std::unordered_map<StreamId, Arena*> arenas;
  // Read under the arena locks (carve), written under the registry mutex.
  std::atomic<bool> no_split{false};
  // Segments the pool holds (PyTorch's cudaMalloc_count): plain segments plus expandable
  // reservations. Changed under one of the pool's arena locks.
  std::atomic<std::int64_t> segments{0};
};

// One value per tracked counter: every block statistic of DeviceStats with a peak (each
// StatArray's aggregate, small and large entries) and oversize_allocations. Segment and
// reserved-memory statistics are device-wide (Engine::device_mutex_).
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

// Visits every tracked counter as fn(Stat& stat, std::int64_t& value).
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
  Arena(StreamId s, std::size_t index, PrivatePool* p = nullptr)
      : stream(s), order(index), owner(static_cast<SegmentMap::Owner>(index + 1)), pool(p) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  FreePool& pool_for(bool small) REQUIRES(mutex) { return small ? small_pool : large_pool; }

  // Stat::increase for a tracked counter of `stats`, recording a rise beyond its peak (the
  // baseline) as debt for the engine to settle.
  void increase(Stat& stat, std::int64_t& debt, std::int64_t n) REQUIRES(mutex) {
    stat.current += n;
    stat.allocated += n;
    if (stat.current > stat.peak) [[unlikely]] {
      debt += stat.current - stat.peak;
      stat.peak = stat.current;
      in_debt = true;
    }
  }

  ArenaMutex mutex;
  const StreamId stream;
  const std::size_t order;        // creation index: the order in which lock_all() takes arenas
  const SegmentMap::Owner owner;  // its segments' owner in the engine's SegmentMap
  PrivatePool* const pool;        // nullptr: the default pool

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
  // Frees of blocks used on other streams made while a capture was underway: their events
  // are recorded once no capture is underway (events must not be recorded or queried
  // during capture). Such a block is not allocated, has no events and keeps stream_uses.
  std::vector<Block*> deferred GUARDED_BY(mutex);
  // Statistics of the blocks of this arena (allocation, active, inactive_split and the
  // byte counts). Segment and reserved-memory statistics are device-wide.
  // For the tracked counters, Stat::peak less debts is this arena's baseline: its share of
  // the device-wide peak (see the header comment), not this stream's own peak.
  DeviceStats stats GUARDED_BY(mutex);
  // Per tracked counter, how far increase() raised Stat::peak since the last settlement.
  PeakBaselines debts GUARDED_BY(mutex);
  // Some debt is unsettled: the engine settles before the operation returns.
  bool in_debt GUARDED_BY(mutex) = false;

  // Number of events in `pending`; read without the lock to skip empty arenas.
  std::atomic<std::int64_t> pending_events{0};
  // Size of `deferred`; read without the lock likewise.
  std::atomic<std::int64_t> deferred_count{0};
};

}  // namespace ccalloc::core
