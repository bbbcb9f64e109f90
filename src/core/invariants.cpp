// The state checker (docs/design.md#invariants) and the segment listing it shares with
// snapshots. Both walk every segment under every arena lock.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <unordered_map>
#include <unordered_set>

#include "core/engine.hpp"
#include "core/rounding.hpp"

namespace ccalloc::core {
namespace {

[[noreturn]] void violation(const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  throw InvariantError(std::string("ccalloc invariant violated: ") + buf);
}

BlockState state_of(const Block* b) {
  if (b->allocated) return BlockState::kActiveAllocated;
  if (b->event_count > 0) return BlockState::kActivePendingFree;
  return BlockState::kInactive;
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

std::vector<SegmentInfo> Engine::segments() const {
  AllArenasLock all(*this);
  std::vector<SegmentInfo> out;
  for (Arena* arena : all.by_stream()) {
    for (const auto& blocks : reported_segments(*arena)) {
      SegmentInfo seg;
      seg.device = device();
      seg.address = blocks.front()->ptr;
      seg.stream = arena->stream;
      seg.is_small = blocks.front()->pool->is_small;
      seg.is_expandable = blocks.front()->segment != nullptr;
      for (const Block* b : blocks) {
        const BlockState state = state_of(b);
        seg.total_size += b->size;
        if (state == BlockState::kActiveAllocated) seg.allocated_size += b->size;
        if (state != BlockState::kInactive) {
          seg.active_size += b->size;
          seg.requested_size += b->requested_size;
        }
        seg.blocks.push_back(BlockInfo{b->ptr, b->size, b->requested_size, state});
      }
      out.push_back(std::move(seg));
    }
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  return out;
}

void Engine::check_invariants() const {
  AllArenasLock all(*this);

  // Where each block is held: its arena's live index, a pool, or pending-event queues.
  std::unordered_map<const Block*, int> pending_refs;
  std::unordered_set<const Block*> in_pool;
  std::unordered_set<const Block*> in_index;
  for (Arena* arena : all.by_stream()) {
    arena->live.for_each([&](DevicePtr ptr, const Block* b) {
      if (!b->allocated || b->ptr != ptr || b->pool->arena != arena) {
        violation("block 0x%" PRIxPTR " is indexed as live at 0x%" PRIxPTR
                  " but is not allocated there",
                  b->ptr, ptr);
      }
      if (owners_.owner_of(ptr) != arena->owner) {
        violation("live block 0x%" PRIxPTR " is not in a segment its stream owns", ptr);
      }
      in_index.insert(b);
    });
  }

  std::size_t reserved_recount = 0;
  DeviceStats recount;                                  // device-wide recount of the current values
  std::vector<std::pair<DevicePtr, std::size_t>> live;  // allocated ranges
  std::vector<std::pair<DevicePtr, std::size_t>> extents;  // segment ranges
  std::int64_t pending_total = 0;

  for (Arena* arena : all.by_stream()) {
    std::int64_t pending_events = 0;
    for (const auto& [stream, queue] : arena->pending) {
      for (const PendingFree& f : queue) {
        ++pending_refs[f.block];
        ++pending_events;
      }
    }
    if (pending_events != arena->pending_events.load()) {
      violation("stream %" PRIu64 " counts %lld pending events but holds %lld", arena->stream,
                static_cast<long long>(arena->pending_events.load()),
                static_cast<long long>(pending_events));
    }
    pending_total += pending_events;
    for (const FreePool* pool : {&arena->small_pool, &arena->large_pool}) {
      for (const Block* b : pool->blocks) {
        if (b->pool != pool)
          violation("free block 0x%" PRIxPTR " is in a pool not its own", b->ptr);
        if (b->allocated || b->event_count != 0) {
          violation("block 0x%" PRIxPTR " is in a free pool but is allocated or pending", b->ptr);
        }
        if (!b->mapped) violation("unmapped block 0x%" PRIxPTR " is in a free pool", b->ptr);
        if (!in_pool.insert(b).second) violation("block 0x%" PRIxPTR " is pooled twice", b->ptr);
      }
      for (const Block* b : pool->unmapped) {
        if (b->mapped || b->segment == nullptr || b->allocated || b->event_count != 0 ||
            b->pool != pool) {
          violation("block 0x%" PRIxPTR " is listed as unmapped but is not an unmapped range",
                    b->ptr);
        }
        if (!in_pool.insert(b).second) violation("block 0x%" PRIxPTR " is pooled twice", b->ptr);
      }
    }

    // Recount this arena's statistics from its blocks.
    DeviceStats mine;
    for (const auto& blocks : segments_of(*arena)) {
      const bool small = blocks.front()->pool->is_small;
      const StatType kinds[2] = {kAggregate, small ? kSmallPool : kLargePool};
      std::size_t seg_size = 0;
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const Block* b = blocks[i];
        seg_size += b->size;
        if (b->pool != blocks.front()->pool) {
          violation("segment 0x%" PRIxPTR " mixes pools", blocks.front()->ptr);
        }
        if (b->size == 0 || b->size % kMinBlockSize != 0) {
          violation("block 0x%" PRIxPTR " has size %zu, not a positive multiple of 512", b->ptr,
                    b->size);
        }
        if (i + 1 < blocks.size()) {
          const Block* n = blocks[i + 1];
          if (n->prev != b) violation("block 0x%" PRIxPTR " is not linked back", n->ptr);
          if (b->end() != n->ptr) {
            violation("blocks 0x%" PRIxPTR " and 0x%" PRIxPTR " do not tile their segment", b->ptr,
                      n->ptr);
          }
          if (state_of(b) == BlockState::kInactive && state_of(n) == BlockState::kInactive &&
              b->mapped == n->mapped) {
            violation("adjacent free blocks 0x%" PRIxPTR " and 0x%" PRIxPTR " were not merged",
                      b->ptr, n->ptr);
          }
        }
        const BlockState state = state_of(b);
        const int homes = static_cast<int>(in_index.count(b)) + static_cast<int>(in_pool.count(b)) +
                          (pending_refs.count(b) ? 1 : 0);
        if (homes != 1) {
          violation("block 0x%" PRIxPTR " (state %d) is held in %d places, not 1", b->ptr,
                    static_cast<int>(state), homes);
        }
        if (state == BlockState::kActivePendingFree && pending_refs[b] != b->event_count) {
          violation("block 0x%" PRIxPTR " waits for %d events but %d are queued", b->ptr,
                    b->event_count, pending_refs[b]);
        }
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
        if (state == BlockState::kActiveAllocated) {
          live.emplace_back(b->ptr, b->size);
          if (is_oversize(b->size, config_)) mine.oversize_allocations.current += 1;
        }
      }
      extents.emplace_back(blocks.front()->ptr, seg_size);
      if (const ExpandableSegment* es = blocks.front()->segment) {
        // Only mapped pages are reserved; the segment count is of device allocations.
        std::size_t mapped = 0;
        for (const Block* b : blocks)
          mapped += b->mapped ? b->size : 0;
        if (mapped != es->mapped_bytes() || seg_size != es->size() ||
            blocks.front()->ptr != es->base()) {
          violation("expandable segment 0x%" PRIxPTR " maps %zu bytes but its blocks add up to %zu",
                    es->base(), es->mapped_bytes(), mapped);
        }
        reserved_recount += mapped;
        for (StatType t : kinds)
          recount.reserved_bytes[t].current += static_cast<std::int64_t>(mapped);
        continue;
      }
      reserved_recount += seg_size;
      for (StatType t : kinds) {
        recount.segment[t].current += 1;
        recount.reserved_bytes[t].current += static_cast<std::int64_t>(seg_size);
      }
      if (is_oversize(seg_size, config_)) recount.oversize_segments.current += 1;
    }

    const auto check = [&](const char* name, const StatArray& want, const StatArray& have) {
      for (int t = 0; t < 3; ++t) {
        if (want[t].current != have[t].current) {
          violation("stream %" PRIu64 ": %s[%d] is %lld but the blocks add up to %lld",
                    arena->stream, name, t, static_cast<long long>(have[t].current),
                    static_cast<long long>(want[t].current));
        }
        if (have[t].current < 0 || have[t].peak < have[t].current) {
          violation("stream %" PRIu64 ": %s[%d] current %lld, peak %lld", arena->stream, name, t,
                    static_cast<long long>(have[t].current), static_cast<long long>(have[t].peak));
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
      violation("stream %" PRIu64 ": oversize_allocations is %lld but the blocks add up to %lld",
                arena->stream, static_cast<long long>(s.oversize_allocations.current),
                static_cast<long long>(mine.oversize_allocations.current));
    }
  }

  // Every block reachable from a segment was counted above; every held block must be
  // reachable (no orphans).
  std::size_t reachable = 0;
  for (Arena* arena : all.by_stream()) {
    for (const auto& blocks : segments_of(*arena))
      reachable += blocks.size();
  }
  const std::size_t held = in_index.size() + in_pool.size() + pending_refs.size();
  if (reachable != held) {
    violation("%zu blocks are held but %zu are reachable from segments", held, reachable);
  }
  if (pending_total != pending_events_.load()) {
    violation("device counts %lld pending events but arenas hold %lld",
              static_cast<long long>(pending_events_.load()),
              static_cast<long long>(pending_total));
  }

  const auto no_overlap = [](std::vector<std::pair<DevicePtr, std::size_t>>& ranges,
                             const char* what) {
    std::sort(ranges.begin(), ranges.end());
    for (std::size_t i = 1; i < ranges.size(); ++i) {
      if (ranges[i - 1].first + ranges[i - 1].second > ranges[i].first) {
        violation("%s 0x%" PRIxPTR " and 0x%" PRIxPTR " overlap", what, ranges[i - 1].first,
                  ranges[i].first);
      }
    }
  };
  no_overlap(live, "live allocations");
  no_overlap(extents, "segments");

  std::lock_guard lock(device_mutex_);
  if (reserved_recount != reserved_) {
    violation("reserved is %zu bytes but segments add up to %zu", reserved_, reserved_recount);
  }
  if (reserved_ > capacity_) {
    violation("reserved %zu bytes exceeds the device capacity of %zu", reserved_, capacity_);
  }
  for (int t = 0; t < 3; ++t) {
    if (recount.segment[t].current != device_stats_.segment[t].current ||
        recount.reserved_bytes[t].current != device_stats_.reserved_bytes[t].current) {
      violation("segment/reserved_bytes[%d] are %lld/%lld but segments add up to %lld/%lld", t,
                static_cast<long long>(device_stats_.segment[t].current),
                static_cast<long long>(device_stats_.reserved_bytes[t].current),
                static_cast<long long>(recount.segment[t].current),
                static_cast<long long>(recount.reserved_bytes[t].current));
    }
  }
  if (recount.oversize_segments.current != device_stats_.oversize_segments.current) {
    violation("oversize_segments is %lld but segments add up to %lld",
              static_cast<long long>(device_stats_.oversize_segments.current),
              static_cast<long long>(recount.oversize_segments.current));
  }
}

}  // namespace ccalloc::core
