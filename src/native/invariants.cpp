// The state checker (docs/design.md#invariants) and the segment listing it shares with
// snapshots. Both walk every segment under every arena lock.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <unordered_map>
#include <unordered_set>

#include "native/engine.hpp"
#include "core/arena_engine.hpp"
#include "core/rounding.hpp"

namespace ccalloc::core {
namespace {

// `invariant` is the name of the check (its function's name without "check_"), so a
// message says which rule of the engine header's list broke.
[[noreturn]] void violation(const char* invariant, const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  throw InvariantError(std::string("ccalloc invariant ") + invariant + " violated: " + buf);
}

}  // namespace

std::vector<std::vector<const Block*>> Engine::segments_of(const Arena& arena) const {
  std::vector<const Block*> heads;
  const auto consider = [&heads](const Block* b) {
    if (b->prev == nullptr) heads.push_back(b);
  };
  for (const FreePool* pool : {&arena.small_pool, &arena.large_pool}) {
    for (const Block* b : pool->blocks)
      consider(b);
    for (const Block* b : pool->unmapped)
      consider(b);
  }
  arena.live.for_each([&](DevicePtr, const Block* b) { consider(b); });
  for (const auto& [stream, queue] : arena.pending) {
    for (const PendingFree& f : queue)
      consider(f.block);
  }
  for (const DeferredFree& d : arena.deferred)
    consider(d.block);
  std::sort(heads.begin(), heads.end(),
            [](const Block* a, const Block* b) { return a->ptr < b->ptr; });
  heads.erase(std::unique(heads.begin(), heads.end()), heads.end());

  std::vector<std::vector<const Block*>> segments;
  segments.reserve(heads.size());
  for (const Block* head : heads) {
    auto& blocks = segments.emplace_back();
    for (const Block* b = head; b != nullptr; b = b->next)
      blocks.push_back(b);
  }
  return segments;
}

std::vector<std::vector<const Block*>> Engine::reported_segments(const Arena& arena) const {
  std::vector<std::vector<const Block*>> out;
  for (auto& chain : segments_of(arena)) {
    if (chain.front()->segment == nullptr) {
      out.push_back(std::move(chain));
      continue;
    }
    // An expandable segment is reported as one segment per run of mapped blocks.
    std::vector<const Block*> run;
    for (const Block* b : chain) {
      if (b->mapped) {
        run.push_back(b);
      } else if (!run.empty()) {
        out.push_back(std::move(run));
        run.clear();
      }
    }
    if (!run.empty()) out.push_back(std::move(run));
  }
  return out;
}

BlockState Engine::state_of(const Block* b) {
  if (b->allocated) return BlockState::kActiveAllocated;
  // A free deferred during capture keeps its stream uses until its events are recorded.
  if (b->event_count > 0 || !b->stream_uses.empty()) return BlockState::kActivePendingFree;
  return BlockState::kInactive;
}

template <typename Segment>
void Engine::describe_segment(Segment& seg, const Arena& arena,
                              const std::vector<const Block*>& blocks) const {
  seg.device = device();
  seg.address = blocks.front()->ptr;
  seg.stream = arena.stream;
  seg.is_small = blocks.front()->pool->is_small;
  seg.is_expandable = blocks.front()->segment != nullptr;
  seg.is_asleep = segment_asleep(arena, blocks.front()->ptr);
  for (const Block* b : blocks) {
    const BlockState state = state_of(b);
    seg.total_size += b->size;
    if (state == BlockState::kActiveAllocated) seg.allocated_size += b->size;
    if (state != BlockState::kInactive) {
      seg.active_size += b->size;
      seg.requested_size += b->requested_size;
    }
  }
}
template void Engine::describe_segment(SegmentInfo&, const Arena&,
                                       const std::vector<const Block*>&) const;
template void Engine::describe_segment(SnapshotSegment&, const Arena&,
                                       const std::vector<const Block*>&) const;

std::vector<SegmentInfo> Engine::segments() const {
  AllArenasLock all(*this);
  std::vector<SegmentInfo> out;
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    for (const auto& blocks : reported_segments(*arena)) {
      SegmentInfo seg;
      describe_segment(seg, *arena, blocks);
      if (arena->pool != nullptr) seg.pool = arena->pool->id;
      seg.context = blocks.front()->segment_stack.context;
      for (const Block* b : blocks) {
        const BlockState state = state_of(b);
        seg.blocks.push_back(BlockInfo{b->ptr, b->size, b->requested_size, state,
                                      state != BlockState::kInactive ? b->stack.context : nullptr});
      }
      out.push_back(std::move(seg));
    }
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  return out;
}

Engine::InvariantWalk Engine::walk_for_invariants(const AllArenasLock& all) const {
  InvariantWalk walk;
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    walk.arenas.push_back({arena, segments_of(*arena)});
  }
  return walk;
}

void Engine::check_invariants() const {
  AllArenasLock all(*this);
  sync_block_aggregates_of(all, all.by_stream());  // aggregates from their pools'
  const InvariantWalk walk = walk_for_invariants(all);
  check_blocks_tile_segments(walk);
  check_free_blocks_merged(walk);
  check_pool_membership(walk);
  check_expandable_segments(walk);
  check_stats_match_blocks(walk);
  check_peaks_cover_current(walk);
  check_reserved_within_capacity();
  check_live_allocations_disjoint(walk);
  check_private_pool_blocks(walk);
  check_sleepable_pools(walk);
}

void Engine::check_blocks_tile_segments(const InvariantWalk& walk) const {
  constexpr const char* kName = "blocks_tile_segments";
  std::vector<std::pair<DevicePtr, std::size_t>> extents;
  for (const auto& [arena, segments] : walk.arenas) {
    arena->mutex.assert_held();  // check_invariants() holds every arena lock
    for (const auto& blocks : segments) {
      const Block* head = blocks.front();
      std::size_t seg_size = 0;
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const Block* b = blocks[i];
        seg_size += b->size;
        if (b->pool != head->pool) {
          violation(kName, "segment 0x%" PRIxPTR " mixes pools at block 0x%" PRIxPTR, head->ptr,
                    b->ptr);
        }
        if (b->size == 0 || b->size % kMinBlockSize != 0) {
          violation(kName,
                    "segment 0x%" PRIxPTR ": block 0x%" PRIxPTR
                    " has size %zu, not a positive multiple of %zu",
                    head->ptr, b->ptr, b->size, kMinBlockSize);
        }
        if (i + 1 < blocks.size()) {
          const Block* n = blocks[i + 1];
          if (n->prev != b) {
            violation(kName, "segment 0x%" PRIxPTR ": block 0x%" PRIxPTR " is not linked back",
                      head->ptr, n->ptr);
          }
          if (b->end() != n->ptr) {
            violation(kName,
                      "segment 0x%" PRIxPTR ": block 0x%" PRIxPTR " (%zu bytes) ends at 0x%" PRIxPTR
                      " but the next block starts at 0x%" PRIxPTR,
                      head->ptr, b->ptr, b->size, b->end(), n->ptr);
          }
        }
      }
      extents.emplace_back(head->ptr, seg_size);
    }
  }
  std::sort(extents.begin(), extents.end());
  for (std::size_t i = 1; i < extents.size(); ++i) {
    if (extents[i - 1].first + extents[i - 1].second > extents[i].first) {
      violation(kName, "segments 0x%" PRIxPTR " (%zu bytes) and 0x%" PRIxPTR " overlap",
                extents[i - 1].first, extents[i - 1].second, extents[i].first);
    }
  }
}

void Engine::check_free_blocks_merged(const InvariantWalk& walk) const {
  for (const auto& [arena, segments] : walk.arenas) {
    arena->mutex.assert_held();  // check_invariants() holds every arena lock
    for (const auto& blocks : segments) {
      for (std::size_t i = 0; i + 1 < blocks.size(); ++i) {
        const Block* b = blocks[i];
        const Block* n = blocks[i + 1];
        if (state_of(b) == BlockState::kInactive && state_of(n) == BlockState::kInactive &&
            b->mapped == n->mapped) {
          violation("free_blocks_merged",
                    "segment 0x%" PRIxPTR ": adjacent free blocks 0x%" PRIxPTR " (%zu bytes) and 0x%" PRIxPTR
                    " (%zu bytes) were not merged",
                    blocks.front()->ptr, b->ptr, b->size, n->ptr, n->size);
        }
      }
    }
  }
}

void Engine::check_pool_membership(const InvariantWalk& walk) const {
  constexpr const char* kName = "pool_membership";
  // Where each block is held: its arena's live index, a pool, or pending-event queues.
  std::unordered_map<const Block*, int> pending_refs;
  std::unordered_set<const Block*> in_pool;
  std::unordered_set<const Block*> in_index;
  for (const auto& [arena, segments] : walk.arenas) {
    arena->mutex.assert_held();  // check_invariants() holds every arena lock
    arena->live.for_each([&, arena = arena](DevicePtr ptr, const Block* b) {
      if (!b->allocated || b->ptr != ptr || b->pool->arena != arena) {
        violation(kName, "block 0x%" PRIxPTR " is indexed as live at 0x%" PRIxPTR
                  " but is not allocated there",
                  b->ptr, ptr);
      }
      if (owners_.owner_of(ptr) != arena->owner) {
        violation(kName, "live block 0x%" PRIxPTR " is not in a segment stream %" PRIu64 " owns",
                  ptr, arena->stream);
      }
      in_index.insert(b);
    });
    for (const auto& [stream, queue] : arena->pending) {
      for (const PendingFree& f : queue)
        ++pending_refs[f.block];
    }
    std::size_t marked = 0;
    for (const DeferredFree& d : arena->deferred) {  // a deferred free is held there, once
      const Block* b = d.block;
      if (b->allocated || b->event_count != 0 || b->stream_uses.empty()) {
        violation(kName,
                  "deferred free 0x%" PRIxPTR
                  " is allocated, waits for events or has no stream uses",
                  b->ptr);
      }
      if (!d.markers.empty()) {
        ++marked;
        if (d.capture == 0) {
          violation(kName, "deferred free 0x%" PRIxPTR " has free markers of no capture", b->ptr);
        }
      }
      ++pending_refs[b];
    }
    if (marked != arena->deferred_marked) {
      violation(kName,
                "stream %" PRIu64 " counts %zu deferred frees with free markers but holds %zu",
                arena->stream, arena->deferred_marked, marked);
    }
    for (const FreePool* pool : {&arena->small_pool, &arena->large_pool}) {
      for (auto it = pool->blocks.begin(); it != pool->blocks.end(); ++it) {
        const Block* b = *it;
        if (b->pool_pos != it) {
          violation(kName, "free block 0x%" PRIxPTR " has lost its place in its pool", b->ptr);
        }
        if (b->pool != pool) {
          violation(kName, "free block 0x%" PRIxPTR " is in a pool not its own", b->ptr);
        }
        if (b->allocated || b->event_count != 0) {
          violation(kName,
                    "block 0x%" PRIxPTR " is in a free pool but is allocated (%d) or waits for %d events",
                    b->ptr, static_cast<int>(b->allocated), b->event_count);
        }
        if (!b->mapped) violation(kName, "unmapped block 0x%" PRIxPTR " is in a free pool", b->ptr);
        if (!in_pool.insert(b).second) {
          violation(kName, "block 0x%" PRIxPTR " is pooled twice", b->ptr);
        }
      }
      for (const Block* b : pool->unmapped) {
        if (!in_pool.insert(b).second) {
          violation(kName, "block 0x%" PRIxPTR " is pooled twice", b->ptr);
        }
      }
    }
  }

  std::size_t reachable = 0;
  for (const auto& [arena, segments] : walk.arenas) {
    arena->mutex.assert_held();  // check_invariants() holds every arena lock
    for (const auto& blocks : segments) {
      reachable += blocks.size();
      for (const Block* b : blocks) {
        const int homes = static_cast<int>(in_index.count(b)) + static_cast<int>(in_pool.count(b)) +
                          (pending_refs.count(b) ? 1 : 0);
        if (homes != 1) {
          violation(kName, "block 0x%" PRIxPTR " (state %d) is held in %d places, not 1", b->ptr,
                    static_cast<int>(state_of(b)), homes);
        }
        const auto refs = pending_refs.find(b);
        if (state_of(b) == BlockState::kActivePendingFree && b->event_count > 0 &&
            (refs == pending_refs.end() || refs->second != b->event_count)) {
          violation(kName, "block 0x%" PRIxPTR " waits for %d events but %d are queued", b->ptr,
                    b->event_count, refs == pending_refs.end() ? 0 : refs->second);
        }
      }
    }
  }
  // Every held block must be reachable from a segment (no orphans).
  const std::size_t held = in_index.size() + in_pool.size() + pending_refs.size();
  if (reachable != held) {
    violation(kName, "%zu blocks are held but %zu are reachable from segments", held, reachable);
  }
}

void Engine::check_expandable_segments(const InvariantWalk& walk) const {
  constexpr const char* kName = "expandable_segments";
  for (const auto& [arena, segments] : walk.arenas) {
    arena->mutex.assert_held();  // check_invariants() holds every arena lock
    for (const FreePool* pool : {&arena->small_pool, &arena->large_pool}) {
      for (const Block* b : pool->unmapped) {
        if (b->mapped || b->segment == nullptr || b->allocated || b->event_count != 0 ||
            b->pool != pool) {
          violation(kName,
                    "block 0x%" PRIxPTR " (%zu bytes) is listed as unmapped but is %s",
                    b->ptr, b->size,
                    b->mapped ? "mapped" : b->segment == nullptr ? "not in an expandable segment"
                                                                 : "in use or in another pool");
        }
      }
    }
    for (const auto& blocks : segments) {
      const ExpandableSegment* es = blocks.front()->segment;
      if (es == nullptr) continue;
      // Only mapped pages are reserved; the blocks span the whole reservation.
      std::size_t mapped = 0;
      std::size_t size = 0;
      for (const Block* b : blocks) {
        mapped += b->mapped ? b->size : 0;
        size += b->size;
      }
      if (mapped != es->mapped_bytes() || size != es->size() || blocks.front()->ptr != es->base()) {
        violation(kName,
                  "expandable segment 0x%" PRIxPTR " maps %zu of %zu bytes but its blocks from 0x%" PRIxPTR
                  " map %zu of %zu",
                  es->base(), es->mapped_bytes(), es->size(), blocks.front()->ptr, mapped, size);
      }
    }
  }
}

void Engine::check_stats_match_blocks(const InvariantWalk& walk) const {
  constexpr const char* kName = "stats_match_blocks";
  std::size_t reserved_recount = 0;
  DeviceStats recount;  // device-wide recount of the current values
  std::int64_t pending_total = 0;

  for (const auto& [arena, segments] : walk.arenas) {
    arena->mutex.assert_held();  // check_invariants() holds every arena lock
    std::int64_t pending_events = 0;
    for (const auto& [stream, queue] : arena->pending)
      pending_events += static_cast<std::int64_t>(queue.size());
    if (pending_events != arena->pending_events.load()) {
      violation(kName, "stream %" PRIu64 " counts %lld pending events but holds %lld",
                arena->stream, static_cast<long long>(arena->pending_events.load()),
                static_cast<long long>(pending_events));
    }
    pending_total += pending_events;

    DeviceStats mine;
    for (const auto& blocks : segments) {
      const bool small = blocks.front()->pool->is_small;
      const StatType kinds[2] = {kAggregate, small ? kSmallPool : kLargePool};
      std::size_t seg_size = 0;
      std::size_t mapped = 0;
      for (const Block* b : blocks) {
        seg_size += b->size;
        mapped += b->mapped ? b->size : 0;
        const BlockState state = state_of(b);
        const auto sz = static_cast<std::int64_t>(b->size);
        for (StatType t : kinds) {
          if (state == BlockState::kActiveAllocated) {
            mine.allocation[t].current += 1;
            mine.allocated_bytes[t].current += sz;
          }
          if (state != BlockState::kInactive) {
            mine.active[t].current += 1;
            mine.active_bytes[t].current += sz;
            mine.requested_bytes[t].current += static_cast<std::int64_t>(b->requested_size);
          } else if (b->is_split() && b->segment == nullptr) {
            mine.inactive_split[t].current += 1;
            mine.inactive_split_bytes[t].current += sz;
          }
        }
        if (state == BlockState::kActiveAllocated && is_oversize(b->size, config_)) {
          mine.oversize_allocations.current += 1;
        }
      }
      if (blocks.front()->segment != nullptr) {
        // Only mapped pages are reserved; the segment count is of device allocations.
        reserved_recount += mapped;
        for (StatType t : kinds)
          recount.reserved_bytes[t].current += static_cast<std::int64_t>(mapped);
        continue;
      }
      // A sleeping segment holds no memory: neither reserved nor a segment (sleep.cpp).
      if (segment_asleep(*arena, blocks.front()->ptr)) continue;
      reserved_recount += seg_size;
      for (StatType t : kinds) {
        recount.segment[t].current += 1;
        recount.reserved_bytes[t].current += static_cast<std::int64_t>(seg_size);
      }
      if (is_oversize(seg_size, config_)) recount.oversize_segments.current += 1;
    }

    const auto check = [&, arena = arena](const char* name, const StatArray& want,
                                          const StatArray& have) {
      for (int t = 0; t < 3; ++t) {
        if (want[t].current != have[t].current) {
          violation(kName, "stream %" PRIu64 ": %s[%d] is %lld but the blocks add up to %lld",
                    arena->stream, name, t, static_cast<long long>(have[t].current),
                    static_cast<long long>(want[t].current));
        }
        if (have[t].current < 0 || have[t].peak < have[t].current) {
          violation(kName, "stream %" PRIu64 ": %s[%d] current %lld, peak %lld", arena->stream,
                    name, t, static_cast<long long>(have[t].current),
                    static_cast<long long>(have[t].peak));
        }
      }
    };
    const DeviceStats& s = arena->stats;
    check("allocation", mine.allocation, s.allocation);
    check("allocated_bytes", mine.allocated_bytes, s.allocated_bytes);
    check("active", mine.active, s.active);
    check("active_bytes", mine.active_bytes, s.active_bytes);
    check("requested_bytes", mine.requested_bytes, s.requested_bytes);
    check("inactive_split", mine.inactive_split, s.inactive_split);
    check("inactive_split_bytes", mine.inactive_split_bytes, s.inactive_split_bytes);
    if (mine.oversize_allocations.current != s.oversize_allocations.current) {
      violation(kName,
                "stream %" PRIu64 ": oversize_allocations is %lld but the blocks add up to %lld",
                arena->stream, static_cast<long long>(s.oversize_allocations.current),
                static_cast<long long>(mine.oversize_allocations.current));
    }
  }
  if (pending_total != pending_events_.load()) {
    violation(kName, "device counts %lld pending events but arenas hold %lld",
              static_cast<long long>(pending_events_.load()),
              static_cast<long long>(pending_total));
  }

  Lock lock(device_mutex_);
  if (reserved_recount != reserved_) {
    violation(kName, "reserved is %zu bytes but segments add up to %zu",
              static_cast<std::size_t>(reserved_),
              reserved_recount);
  }
  for (int t = 0; t < 3; ++t) {
    if (recount.segment[t].current != device_stats_.segment[t].current ||
        recount.reserved_bytes[t].current != device_stats_.reserved_bytes[t].current) {
      violation(kName,
                "segment/reserved_bytes[%d] are %lld/%lld but segments add up to %lld/%lld", t,
                static_cast<long long>(device_stats_.segment[t].current),
                static_cast<long long>(device_stats_.reserved_bytes[t].current),
                static_cast<long long>(recount.segment[t].current),
                static_cast<long long>(recount.reserved_bytes[t].current));
    }
  }
  if (recount.oversize_segments.current != device_stats_.oversize_segments.current) {
    violation(kName, "oversize_segments is %lld but segments add up to %lld",
              static_cast<long long>(device_stats_.oversize_segments.current),
              static_cast<long long>(recount.oversize_segments.current));
  }
}

// An arena in debt has an operation under way (between its lock's release and the
// settlement): only its own counters may exceed their baselines. The baseline is the
// counter's Stat::peak less its unsettled debt (arena.hpp).
void Engine::check_peaks_cover_current(const InvariantWalk& walk) const {
  constexpr const char* kName = "peaks_cover_current";
  // check_invariants() holds every arena lock.
  ArenaEngine::check_peaks_cover_current(
      walk.arenas, [](const InvariantWalk::ArenaBlocks& entry) { return entry.arena; },
      [&](const Arena& arena, std::size_t j, std::int64_t current, std::int64_t baseline,
          std::int64_t debt, bool in_debt) {
        violation(kName,
                  "stream %" PRIu64 ": %s is %lld, baseline %lld, debt %lld, arena %s in debt",
                  arena.stream, tracked_counter_name(j).c_str(), static_cast<long long>(current),
                  static_cast<long long>(baseline), static_cast<long long>(debt),
                  in_debt ? "marked" : "not marked");
      },
      [&](std::size_t j, std::int64_t peak, std::int64_t current) {
        violation(kName, "%s: device peak %lld is below its current %lld",
                  tracked_counter_name(j).c_str(), static_cast<long long>(peak),
                  static_cast<long long>(current));
      });
}

void Engine::check_reserved_within_capacity() const {
  Lock lock(device_mutex_);
  if (reserved_ > capacity_) {
    violation("reserved_within_capacity",
              "reserved %zu bytes exceeds the device capacity of %zu bytes",
              static_cast<std::size_t>(reserved_), capacity_);
  }
}

void Engine::check_live_allocations_disjoint(const InvariantWalk& walk) const {
  std::vector<std::pair<DevicePtr, std::size_t>> live;
  for (const auto& [arena, segments] : walk.arenas) {
    arena->mutex.assert_held();  // check_invariants() holds every arena lock
    arena->live.for_each([&live](DevicePtr ptr, const Block* b) { live.emplace_back(ptr, b->size); });
  }
  std::sort(live.begin(), live.end());
  for (std::size_t i = 1; i < live.size(); ++i) {
    if (live[i - 1].first + live[i - 1].second > live[i].first) {
      violation("live_allocations_disjoint",
                "live allocations 0x%" PRIxPTR " (%zu bytes) and 0x%" PRIxPTR " overlap",
                live[i - 1].first, live[i - 1].second, live[i].first);
    }
  }
}

}  // namespace ccalloc::core

namespace ccalloc::core {

void Engine::check_private_pool_blocks(const InvariantWalk& walk) const {
  constexpr const char* kName = "private_pool_blocks";
  // The walk holds every arena lock and, through AllArenasLock, the registry.
  registry_mutex_.assert_held();
  std::unordered_map<const PrivatePool*, std::int64_t> segments;
  std::int64_t deferred = 0;
  for (const auto& [arena, chains] : walk.arenas) {
    arena->mutex.assert_held();  // check_invariants() holds every arena lock
    if (arena->pool != nullptr) {
      const auto it = arena->pool->arenas.find(arena->stream);
      if (it == arena->pool->arenas.end() || it->second != arena) {
        violation(kName, "an arena of pool %s for stream %" PRIu64 " is not listed by the pool",
                  to_string(arena->pool->id).c_str(), arena->stream);
      }
    } else {
      const auto it = arena_by_stream_.find(arena->stream);
      if (it == arena_by_stream_.end() || it->second != arena) {
        violation(kName, "a default-pool arena for stream %" PRIu64 " is not listed",
                  arena->stream);
      }
    }
    std::int64_t n = 0;
    for (const auto& blocks : chains) {
      if (blocks.front()->segment == nullptr) ++n;  // expandable ones: counted below
      // A segment's blocks share one owner (blocks_tile_segments): one lookup per mapped run.
      bool run_checked = false;
      for (const Block* b : blocks) {
        if (b->pool->arena != arena) {
          violation(kName, "block 0x%" PRIxPTR " of one arena returns to another's pool", b->ptr);
        }
        if (!b->mapped) {
          run_checked = false;
        } else if (!run_checked) {
          run_checked = true;
          if (owners_.owner_of(b->ptr) != arena->owner) {
            violation(kName, "block 0x%" PRIxPTR " lies in a segment its arena does not own",
                      b->ptr);
          }
        }
      }
    }
    n += static_cast<std::int64_t>(arena->expandable.size());
    if (arena->pool != nullptr) segments[arena->pool] += n;
    deferred += static_cast<std::int64_t>(arena->deferred.size());
    if (static_cast<std::int64_t>(arena->deferred.size()) != arena->deferred_count.load()) {
      violation(kName, "stream %" PRIu64 " counts %lld deferred frees but holds %zu", arena->stream,
                static_cast<long long>(arena->deferred_count.load()), arena->deferred.size());
    }
  }
  {
    for (const auto& [id, pool] : pools_) {
      const std::int64_t counted = pool->segments.load();
      const std::int64_t held = segments.count(pool.get()) ? segments[pool.get()] : 0;
      if (counted != held) {
        violation(kName, "pool %s counts %lld segments but its arenas hold %lld",
                  to_string(id).c_str(), static_cast<long long>(counted),
                  static_cast<long long>(held));
      }
      if (pool->use_count < 0) {
        violation(kName, "pool %s has use count %d", to_string(id).c_str(), pool->use_count);
      }
    }
  }
  for (const auto& pool : retired_pools_) {
    if (segments.count(pool.get()) && segments[pool.get()] != 0) {
      violation(kName, "pool %s is gone but holds segments", to_string(pool->id).c_str());
    }
  }
  if (deferred != deferred_frees_.load()) {
    violation(kName, "%lld deferred frees are counted but %lld are held",
              static_cast<long long>(deferred_frees_.load()), static_cast<long long>(deferred));
  }
}

// A sleepable pool's segments are exactly those its SleepableSegments hold, all backed by
// physical memory while it is awake and none while it sleeps; saved contents exist only
// while it sleeps, and each saved range is that of one of its blocks.
void Engine::check_sleepable_pools(const InvariantWalk& walk) const {
  constexpr const char* kName = "sleepable_pools";
  registry_mutex_.assert_held();
  std::unordered_map<const PrivatePool*, std::size_t> held;
  for (const auto& [arena, chains] : walk.arenas) {
    arena->mutex.assert_held();
    if (arena->pool == nullptr || !arena->pool->sleepable) continue;
    const PrivatePool& pool = *arena->pool;
    const bool asleep = pool.asleep.load(std::memory_order_relaxed);
    for (const auto& blocks : chains) {
      const DevicePtr base = blocks.front()->ptr;
      std::size_t size = 0;
      for (const Block* b : blocks)
        size += b->size;
      if (blocks.front()->segment != nullptr || !pool.sleepable->holds(base, size)) {
        violation(kName, "segment 0x%" PRIxPTR " of %zu bytes of pool %s is not a sleepable one",
                  base, size, to_string(pool.id).c_str());
      }
      if (pool.sleepable->backed(base) == asleep) {
        violation(kName, "segment 0x%" PRIxPTR " of pool %s %s physical memory while the pool %s",
                  base, to_string(pool.id).c_str(), asleep ? "has" : "lacks",
                  asleep ? "sleeps" : "is awake");
      }
      ++held[&pool];
    }
  }
  const auto check_pool = [&](const PrivatePool& pool) {
    if (!pool.sleepable) return;
    const std::size_t mine = held.count(&pool) ? held[&pool] : 0;
    if (pool.sleepable->segment_count() != mine) {
      violation(kName, "pool %s has %zu sleepable segments but its arenas hold %zu",
                to_string(pool.id).c_str(), pool.sleepable->segment_count(), mine);
    }
    const auto& saved = pool.sleepable->saved();
    if (!pool.asleep.load(std::memory_order_relaxed) &&
        (saved.host != nullptr || !saved.ranges.empty())) {
      violation(kName, "pool %s is awake but holds saved contents", to_string(pool.id).c_str());
    }
    std::size_t end = 0;
    for (const auto& [ptr, range] : saved.ranges) {
      end = std::max(end, range.offset + range.bytes);
    }
    if (end > saved.bytes) {
      violation(kName, "pool %s saves %zu bytes in a host buffer of %zu",
                to_string(pool.id).c_str(), end, saved.bytes);
    }
  };
  for (const auto& [id, pool] : pools_)
    check_pool(*pool);
}

}  // namespace ccalloc::core
