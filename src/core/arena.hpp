// An arena holds everything of one stream in one memory pool (the default pool or a
// private pool): its free pools, the blocks of its segments waiting for events, and its
// share of the statistics. Blocks never merge across segments and a segment belongs to one
// arena, so the hot path needs only the arena's lock.
#pragma once

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

struct alignas(64) Arena {
  Arena(StreamId s, std::size_t index, PrivatePool* p = nullptr)
      : stream(s), order(index), owner(static_cast<SegmentMap::Owner>(index + 1)), pool(p) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  FreePool& pool_for(bool small) REQUIRES(mutex) { return small ? small_pool : large_pool; }

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
  DeviceStats stats GUARDED_BY(mutex);

  // Number of events in `pending`; read without the lock to skip empty arenas.
  std::atomic<std::int64_t> pending_events{0};
  // Size of `deferred`; read without the lock likewise.
  std::atomic<std::int64_t> deferred_count{0};
};

}  // namespace ccalloc::core
