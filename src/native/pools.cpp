// Private memory pools: CUDA graph capture (beginAllocateToPool / endAllocateToPool),
// torch.cuda.MemPool, and checkpoints of a pool's state (cudagraph trees). The rules are
// PyTorch's (docs/design.md#private-pools); the routing of allocations lives in engine.cpp
// (arena_for_capture), the release of pools' segments in oom_ladder.cpp.
#include <algorithm>

#include "core/common.hpp"
#include "native/engine.hpp"
#include "core/rounding.hpp"

namespace ccalloc::core {
namespace {

void check_not_default(PoolId id, const char* what) {
  if (id.is_default()) {
    throw Error(std::string("ccalloc: ") + what +
                ": pool id (0, 0) is the default pool, not a private pool");
  }
}

// What checkpoint_pool() saw: every segment of the pool, block by block.
struct EngineCheckpoint final : PoolCheckpoint {
  struct BlockState {
    DevicePtr ptr = 0;
    std::size_t size = 0;
    std::size_t requested = 0;
    bool allocated = false;
    bool mapped = true;
  };
  struct SegmentState {
    StreamId stream = 0;
    bool small = false;
    std::vector<BlockState> blocks;  // address order, from the segment's first block
  };
  std::uint64_t engine_uid = 0;
  PoolId id;
  std::vector<SegmentState> segments;
};

}  // namespace

PrivatePool& Engine::pool_of(PoolId id) const {
  const auto it = pools_.find(id);
  if (it == pools_.end()) {
    throw Error("ccalloc: no private pool " + to_string(id) + " on device " +
                std::to_string(device()));
  }
  return *it->second;
}

// PyTorch's create_or_incref_pool.
PrivatePool& Engine::create_or_incref_pool(PoolId id, std::optional<SegmentSource> source,
                                           std::shared_ptr<SleepableSegments> sleepable) {
  if (source && (!source->allocate || !source->free)) {
    throw Error("ccalloc: the segment source of pool " + to_string(id) +
                " needs both allocate and free");
  }
  const auto it = pools_.find(id);
  if (it == pools_.end()) {
    auto pool = std::make_unique<PrivatePool>(id, std::move(source), std::move(sleepable));
    return *pools_.emplace(id, std::move(pool)).first->second;
  }
  PrivatePool& pool = *it->second;
  if (pool.use_count == 0) {
    throw Error("ccalloc: pool " + to_string(id) +
                " was released (use count 0) and cannot be used again; empty_cache() returns "
                "its segments");
  }
  if (source) {
    throw Error("ccalloc: pool " + to_string(id) +
                " already exists: its segment source cannot be given again");
  }
  ++pool.use_count;
  return pool;
}

void Engine::create_pool(PoolId id, std::optional<SegmentSource> source) {
  check_not_default(id, "create_pool");
  {
    Lock lock(registry_mutex_);
    create_or_incref_pool(id, std::move(source));
  }
  after_operation();
}

void Engine::release_pool(PoolId id) {
  check_not_default(id, "release_pool");
  {
    Lock lock(registry_mutex_);
    PrivatePool& pool = pool_of(id);
    if (pool.use_count <= 0) {
      throw Error("ccalloc: release_pool: pool " + to_string(id) + " has no use left to release");
    }
    // At 0 the pool's cache may go back to the device (release_cached_segments) once its
    // blocks are free: no graph replays into it any more.
    --pool.use_count;
  }
  after_operation();
}

int Engine::pool_use_count(PoolId id) const {
  check_not_default(id, "pool_use_count");
  Lock lock(registry_mutex_);
  return pool_of(id).use_count;
}

void Engine::set_pool_use_on_oom(PoolId id, bool use_on_oom) {
  check_not_default(id, "set_pool_use_on_oom");
  Lock lock(registry_mutex_);
  pool_of(id).use_on_oom = use_on_oom;
}

void Engine::set_pool_no_split(PoolId id) {
  check_not_default(id, "set_pool_no_split");
  Lock lock(registry_mutex_);
  pool_of(id).no_split.store(true, std::memory_order_relaxed);
}

void Engine::begin_allocate_to_pool(PoolId id, Allocator::StreamFilter filter) {
  check_not_default(id, "begin_allocate_to_pool");
  if (config_.uncached) {
    throw Error(
        "ccalloc: begin_allocate_to_pool: uncached mode has no pools (every malloc is "
        "a device allocation)");
  }
  {
    // Every arena lock: an operation holding one sees the count unchanged until it lets go,
    // and one that saw no capture is done before the caller begins capturing.
    AllArenasLock all(*this);
    registry_held(all);
    for (const auto& [underway, f] : captures_) {
      if (underway == id) {
        throw Error("ccalloc: begin_allocate_to_pool: already allocating to pool " +
                    to_string(id));
      }
    }
    const auto existing = pools_.find(id);
    if (existing != pools_.end() && existing->second->asleep.load(std::memory_order_relaxed)) {
      throw_asleep(*existing->second, "begin_allocate_to_pool");
    }
    create_or_incref_pool(id, std::nullopt);
    captures_.emplace_back(id, std::move(filter));
    captures_underway_.fetch_add(1, std::memory_order_acq_rel);
  }
  after_operation();
}

void Engine::end_allocate_to_pool(PoolId id) {
  check_not_default(id, "end_allocate_to_pool");
  {
    AllArenasLock all(*this);  // as in begin_allocate_to_pool
    registry_held(all);
    const auto it = std::find_if(captures_.begin(), captures_.end(),
                                 [id](const auto& c) { return c.first == id; });
    if (it == captures_.end()) {
      throw Error("ccalloc: end_allocate_to_pool: pool " + to_string(id) +
                  " is not being allocated to");
    }
    captures_.erase(it);
    captures_underway_.fetch_sub(1, std::memory_order_acq_rel);
  }
  // Frees deferred during the capture get their events at the next malloc or empty_cache.
  after_operation();
}

void Engine::empty_cache(PoolId id) {
  if (config_.uncached) return;
  if (!capturing()) {
    AllArenasLock all(*this);
    registry_held(all);
    const auto it = pools_.find(id);
    // As PyTorch: only a pool nobody uses any more gives its cache back.
    if (!capturing() && it != pools_.end() && it->second->use_count == 0) {
      release_cached_segments(all, it->second.get());
    }
  }
  after_operation();
}

std::vector<DevicePtr> Engine::pool_live_allocations(PoolId id) const {
  check_not_default(id, "pool_live_allocations");
  std::vector<DevicePtr> out;
  const AllArenasLock all(*this);
  registry_held(all);
  for (const auto& [stream, arena] : pool_of(id).arenas) {
    all.held(*arena);
    arena->live.for_each([&out](DevicePtr ptr, const Block*) { out.push_back(ptr); });
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<SegmentInfo> Engine::pool_segments(PoolId id) const {
  check_not_default(id, "pool_segments");
  std::vector<SegmentInfo> all = segments();
  std::erase_if(all, [id](const SegmentInfo& s) { return s.pool != id; });
  return all;
}

PoolId Engine::segment_pool(DevicePtr address) const {
  const Arena* arena = arena_of(address);
  return arena == nullptr || arena->pool == nullptr ? PoolId{} : arena->pool->id;
}

// PyTorch's getCheckpointState: the pool's segments and which blocks are allocated.
std::shared_ptr<const PoolCheckpoint> Engine::checkpoint_pool(PoolId id) {
  check_not_default(id, "checkpoint_pool");
  auto cp = std::make_shared<EngineCheckpoint>();
  cp->engine_uid = uid_;
  cp->id = id;
  {
    AllArenasLock all(*this);
    registry_held(all);
    PrivatePool& pool = pool_of(id);
    if (pool.use_count == 0) {
      throw Error("ccalloc: checkpoint_pool: pool " + to_string(id) + " was released");
    }
    std::vector<Arena*> arenas;
    for (const auto& [stream, arena] : pool.arenas)
      arenas.push_back(arena);
    std::sort(arenas.begin(), arenas.end(),
              [](const Arena* a, const Arena* b) { return a->stream < b->stream; });
    for (Arena* arena : arenas) {
      all.held(*arena);
      if (!capturing()) insert_deferred_events(*arena);
      for (const auto& chain : segments_of(*arena)) {
        EngineCheckpoint::SegmentState seg;
        seg.stream = arena->stream;
        seg.small = chain.front()->pool->is_small;
        for (const Block* b : chain) {
          seg.blocks.push_back({b->ptr, b->size, b->requested_size, b->allocated, b->mapped});
        }
        cp->segments.push_back(std::move(seg));
      }
    }
  }
  return cp;
}

// PyTorch's setCheckpointPoolState: frees every live block of the pool, then carves each
// checkpointed segment into its blocks again, allocating those that were allocated.
PoolRestore Engine::restore_pool(const PoolCheckpoint& checkpoint) {
  const auto* cp = dynamic_cast<const EngineCheckpoint*>(&checkpoint);
  if (cp == nullptr || cp->engine_uid != uid_) {
    throw Error("ccalloc: restore_pool: the checkpoint is not one of this allocator's");
  }
  PoolRestore out;
  {
    AllArenasLock all(*this);
    registry_held(all);
    PrivatePool& pool = pool_of(cp->id);
    if (pool.use_count == 0) {
      throw Error("ccalloc: restore_pool: pool " + to_string(cp->id) + " was released");
    }
    if (pool.asleep.load(std::memory_order_relaxed)) throw_asleep(pool, "restore_pool");
    bool waits = false;
    for (const auto& [stream, arena] : pool.arenas) {
      all.held(*arena);
      std::vector<DevicePtr> live;
      arena->live.for_each([&live](DevicePtr ptr, const Block*) { live.push_back(ptr); });
      std::sort(live.begin(), live.end());
      for (const DevicePtr ptr : live) {
        release_allocation(*arena, arena->live.erase(ptr));
        out.freed.push_back(ptr);
      }
      waits = waits || !arena->pending.empty() || !arena->deferred.empty();
    }
    if (waits) {
      if (capturing()) {
        throw Error("ccalloc: restore_pool: blocks of pool " + to_string(cp->id) +
                    " wait for other streams and a capture is underway");
      }
      synchronize_and_free_events(all, &pool);
    }

    const auto fail = [&](const char* what, DevicePtr ptr) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(ptr));
      throw Error("ccalloc: restore_pool: pool " + to_string(cp->id) +
                  " no longer matches its "
                  "checkpoint: " +
                  what + " at " + buf);
    };
    for (const auto& seg : cp->segments) {
      const auto ait = pool.arenas.find(seg.stream);
      if (seg.blocks.empty()) fail("a segment without blocks", 0);
      if (ait == pool.arenas.end()) fail("no segment", seg.blocks.front().ptr);
      Arena& arena = *ait->second;
      all.held(arena);
      FreePool& fp = arena.pool_for(seg.small);
      // The segment's first block, free now: a pooled block or an unmapped range.
      Block* cur = nullptr;
      for (Block* b : fp.blocks) {
        if (b->ptr == seg.blocks.front().ptr) cur = b;
      }
      for (Block* b : fp.unmapped) {
        if (b->ptr == seg.blocks.front().ptr) cur = b;
      }
      if (cur == nullptr || cur->prev != nullptr) fail("no free segment", seg.blocks.front().ptr);
      std::vector<const EngineCheckpoint::BlockState*> carved;
      for (std::size_t i = 0; i < seg.blocks.size(); ++i) {
        const auto& bs = seg.blocks[i];
        if (!bs.mapped) {
          // The last unmapped range may have shrunk since (pages mapped at its start).
          if (i + 1 == seg.blocks.size()) break;
          if (cur == nullptr || cur->mapped || cur->ptr != bs.ptr || cur->size != bs.size) {
            fail("the unmapped range changed", bs.ptr);
          }
          cur = cur->next;
          continue;
        }
        if (cur == nullptr || !cur->mapped || cur->allocated || cur->ptr != bs.ptr ||
            cur->size < bs.size) {
          fail("the free memory differs", bs.ptr);
        }
        const PoolPos pos = fp.blocks.search(cur);
        if (pos == fp.blocks.end()) fail("a block is not free", bs.ptr);
        Request req;
        req.requested = bs.requested;
        req.size = bs.size;
        req.small = seg.small;
        req.segment_size = bs.size;
        req.stream = arena.stream;
        req.exact = true;
        const DevicePtr ptr = hand_out(arena, cur, pos, req);
        cur = arena.live.find(ptr)->next;
        carved.push_back(&bs);
      }
      for (const auto* bs : carved) {
        if (bs->allocated) {
          out.allocated.push_back(bs->ptr);
        } else {
          release_allocation(arena, arena.live.erase(bs->ptr));
        }
      }
    }
    settle_peak_debts(all);  // the restore counts as one operation for the peaks
  }
  after_operation();
  return out;
}

}  // namespace ccalloc::core
