// An arena holds everything of one stream in one memory pool (the default pool or a
// private pool): its free pools, the blocks of its segments waiting for events, and its
// share of the statistics. Blocks never merge across segments and a segment belongs to one
// arena, so the hot path needs only the arena's lock.
//
// Device-wide peaks of the block statistics: each arena keeps its share of the peak (the
// baseline ledger of core/peak_ledger.hpp) in its Stat::peak, less its unsettled debts.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/stats.hpp"
#include "sync/arena_mutex.hpp"
#include "core/block.hpp"
#include "native/expandable.hpp"
#include "core/peak_ledger.hpp"
#include "sync/ptr_map.hpp"
#include "core/segment_map.hpp"

namespace ccalloc::core {

// A free of a block used on another stream, waiting for the event recorded there.
struct PendingFree {
  EventId event;
  Block* block;
  std::uint64_t seq = 0;  // the engine's count of events recorded before this one
};

// A free made during a capture of a block used on other streams (Arena::deferred).
struct DeferredFree {
  Block* block;
  // With graph_capture_record_stream_reuse: the terminal nodes of the block's stream and of
  // every stream that used it, when it was freed (its free markers). Once all of them are
  // ancestors of its stream's terminals, later work on that stream follows every use, and
  // the block is free again inside the capture. Empty: it waits for the capture's end.
  std::vector<GraphNode> markers;
  std::uint64_t capture = 0;  // the capture the markers are nodes of
  std::uint64_t seq = 0;      // the engine's count of frees deferred before this one
};

// What reaches a stream's terminals in the capture graph: every node from which one of
// them can be reached, the terminals included. Built incrementally: captured work only adds
// dependencies, so a node that reached the stream's terminals once reaches the later ones.
struct CaptureReach {
  std::uint64_t capture = 0;  // the capture the set belongs to; 0: none
  std::unordered_set<GraphNode> ancestors;
  // Scratch space, kept to spare allocations.
  CaptureInfo info;
  std::vector<GraphNode> stack;
  std::vector<GraphNode> parents;
};

struct Arena;
class SleepableSegments;  // native/sleepable.hpp

// A private memory pool (CUDA graph capture, torch.cuda.MemPool): an arena per stream of
// its own. Pools are never destroyed while the engine lives (a pool that is gone is only
// unlisted), so arenas may keep a plain pointer to theirs.
struct PrivatePool {
  PrivatePool(PoolId i, std::optional<SegmentSource> s,
              std::shared_ptr<SleepableSegments> v = nullptr)
      : id(i), source(std::move(s)), sleepable(std::move(v)) {}
  const PoolId id;
  const std::optional<SegmentSource> source;  // segments' origin instead of the device
  // A sleepable pool's segments (docs/sleep-wake.md), which `source` hands out; else null.
  const std::shared_ptr<SleepableSegments> sleepable;
  // sleep_pool ... wake_pool. Written under every arena lock (and the registry mutex), so
  // any one of the pool's arena locks, or the registry mutex, suffices to read it.
  std::atomic<bool> asleep{false};
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

struct alignas(64) Arena {
  Arena(StreamId s, std::size_t index, PrivatePool* p = nullptr)
      : stream(s), order(index), owner(static_cast<SegmentMap::Owner>(index + 1)), pool(p) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  FreePool& pool_for(bool small) REQUIRES(mutex) { return small ? small_pool : large_pool; }

  // Stat::increase for a tracked counter of `stats`, recording a rise beyond its peak (the
  // baseline) as debt for the engine to settle.
  void increase(Stat& stat, std::int64_t& debt, std::int64_t n) REQUIRES(mutex) {
    ledger_increase(stat, debt, in_debt, n);
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
  // The live (allocated) blocks of this arena by address, and the parked one.
  PtrMap<Block*> live GUARDED_BY(mutex);
  // The stream's last freed block, parked instead of pooled (engine.cpp, park()), if any:
  // free memory, not allocated, still in `live`, in no pool. Default pool only.
  Block* parked GUARDED_BY(mutex) = nullptr;
  // Since the park, nothing else changed the statistics (count_released and count_pooled
  // clear it): a take returns the inactive split counts to their values before the park,
  // which the peaks already cover (a free since may have raised them).
  bool park_exact GUARDED_BY(mutex) = false;
  // What the takes of parked blocks add to the statistics' cumulative counts, until they
  // are read (core/peak_ledger.hpp; the oversize count's here).
  TakenPairs taken GUARDED_BY(mutex);
  std::int64_t taken_oversize GUARDED_BY(mutex) = 0;  // oversize_allocations
  // The parked block last found the best fit of a request of its size (take_parked), and
  // its pool's version then: while both hold, it still is.
  const Block* fit_block GUARDED_BY(mutex) = nullptr;
  std::uint64_t fit_version GUARDED_BY(mutex) = 0;
  // This stream's expandable segments (usually one per pool).
  std::vector<std::unique_ptr<ExpandableSegment>> expandable GUARDED_BY(mutex);
  // Per stream that used one of this arena's blocks: FIFO of frees waiting for its events.
  // Events on one stream complete in order, so processing stops at the first pending one.
  std::vector<std::pair<StreamId, std::deque<PendingFree>>> pending GUARDED_BY(mutex);
  // Frees of blocks used on other streams made while a capture was underway: their events
  // are recorded once no capture is underway (events must not be recorded or queried
  // during capture). Such a block is not allocated, has no events and keeps stream_uses.
  std::vector<DeferredFree> deferred GUARDED_BY(mutex);
  // How many of `deferred` have free markers, and the capture graph they are checked against.
  std::size_t deferred_marked GUARDED_BY(mutex) = 0;
  CaptureReach reach GUARDED_BY(mutex);
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
