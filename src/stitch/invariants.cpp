// The policy's invariant checker (docs/ccalloc-policy.md, "Invariants").
#include <algorithm>
#include <array>
#include <string>
#include <tuple>

#include "ccalloc/sim.hpp"
#include "core/arena_engine.hpp"
#include "core/format.hpp"
#include "stitch/engine.hpp"

namespace ccalloc::core {

// ---------------------------------------------------------------------------------------
// Invariants

void StitchEngine::check_invariants() const {
  const AllArenasLock all(*this, AllArenasLock::Parked::kKeep);  // checks them as they are
  Lock device(device_mutex_);
  check_locked(all);
}

void StitchEngine::check_locked(const AllArenasLock& all) const {
  const auto violated = [this](const std::string& what) {
    throw InvariantError("ccalloc: invariant violated on device " + std::to_string(device()) +
                         " (ccalloc policy): " + what);
  };
  using Kind = Block::Kind;
  sync_block_aggregates_of(all, all.arenas());  // aggregates from their pools'
  std::vector<DeviceStats> recount(all.arenas().size());  // by arena (owner - 1)
  std::size_t free_blocks = 0, allocated_blocks = 0, pending_blocks = 0;
  std::size_t parked_in_spaces = 0, parked_blocks = 0;
  // Physical bytes of live blocks: (handle, piece, first byte, end byte in the piece).
  std::vector<std::tuple<PhysicalHandle, std::uint32_t, std::size_t, std::size_t, DevicePtr>> used;
  std::map<std::pair<PhysicalHandle, std::uint32_t>, std::uint32_t> page_maps;
  std::size_t live_pieces = 0;
  const auto* sim = dynamic_cast<const sim::SimDriver*>(&driver_);
  std::size_t live_entries = 0, pending_entries = 0, pending_outstanding = 0;
  std::size_t deferred_entries = 0;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    live_entries += arena->live.size();
    for (const PendingEvent& p : arena->pending) {
      pending_outstanding += p.block->kind == Kind::kPending ? 1 : 0;
      if (p.block->space->arena != arena) violated("an event waits in another stream's list");
    }
    pending_entries += arena->pending.size();
    deferred_entries += arena->deferred.size();
    if (arena->pending_events.load(std::memory_order_relaxed) !=
        static_cast<std::int64_t>(arena->pending.size())) {
      violated("stream " + std::to_string(arena->stream) + " counts pending events wrongly");
    }
    std::size_t free_islands = 0;  // wholly free islands of this stream
    const bool kept = arena->keeps_island;
    for (int k = 0; k < 2; ++k) {
      const bool small = k == 1;
      for (const auto& sp : arena->spaces[k]) {
        const Space& s = *sp;
        if (s.small != small || s.arena != arena) violated("a space is in the wrong list");
        if (arena_of(s.base) != arena || arena_of(page_va(s, s.reserved_pages) - 1) != arena) {
          violated("the space at " + hex_address(s.base) +
                   " is not its stream's in the segment map");
        }
        const DevicePtr frontier = page_va(s, s.pages.size());
        DevicePtr at = s.base;
        const Block* prev = nullptr;
        // Islands: runs of small blocks in a large space, whole pages; wholly free only as
        // the one the small pool keeps (end_island_if_free).
        DevicePtr island = 0;
        bool island_used = false;
        const auto end_island = [&](DevicePtr end) {
          if (end % page_ != 0) {
            violated("the island of the small pool at " + hex_address(island) + " ends at " +
                     hex_address(end) + ", not on a page boundary");
          }
          if (!island_used && (++free_islands > 1 || !kept)) {
            violated("the island of the small pool at " + hex_address(island) + " is wholly free" +
                     (kept ? ", and another is too" : " and not kept"));
          }
          island = 0;
        };
        for (const Block* b = s.first; b != nullptr; prev = b, b = b->next) {
          if (b->small != small && (s.small || b->kind == Kind::kVoid)) {
            violated("block " + hex_address(b->ptr) + " is in the wrong pool for its space");
          }
          if (b->in_island() && island == 0) {
            if (b->ptr % page_ != 0)
              violated("an island begins inside a page at " + hex_address(b->ptr));
            island = b->ptr;
            island_used = false;
          }
          if (!b->in_island() && island != 0) end_island(b->ptr);
          if (island != 0 && b->kind != Kind::kFree) island_used = true;
          if (b->ptr != at || b->size == 0 || b->prev != prev || b->space != &s) {
            violated("the blocks of the space at " + hex_address(s.base) + " do not tile it at " +
                     hex_address(at));
          }
          at = b->end();
          if (b->kind == Kind::kFree && prev != nullptr && prev->kind == Kind::kFree &&
              prev->small == b->small) {
            violated("free blocks at " + hex_address(prev->ptr) + " and " + hex_address(b->ptr) +
                     " are adjacent");
          }
          const bool in_pool = arena->pools[b->small ? 1 : 0].holds(b);
          if (in_pool != (b->kind == Kind::kFree)) {
            violated("block " + hex_address(b->ptr) + " is " + (in_pool ? "" : "not ") +
                     "in its pool but is " + (b->kind == Kind::kFree ? "free" : "not free"));
          }
          const bool is_live = arena->live.find(b->ptr) == b;
          if (is_live != (b->kind == Kind::kAllocated || b->kind == Kind::kParked)) {
            violated("block " + hex_address(b->ptr) +
                     " is in the live index iff allocated or parked: it is not so");
          }
          const bool deferred = std::count(arena->deferred.begin(), arena->deferred.end(), b) != 0;
          if (deferred && (b->kind != Kind::kPending || b->event_count != 0 ||
                           b->stream_uses.empty())) {
            violated("deferred free " + hex_address(b->ptr) +
                     " is not pending with stream uses and no events");
          }
          if ((b->kind == Kind::kPending) != (b->event_count > 0 || deferred)) {
            violated("block " + hex_address(b->ptr) +
                     " is pending iff it waits for events or a capture");
          }
          const std::size_t p0 = (b->ptr - s.base) / page_;
          const std::size_t p1 = (b->end() - s.base + page_ - 1) / page_;
          if (b->kind == Kind::kVoid) {
            if (b->ptr % page_ != 0 || b->size % page_ != 0) {
              violated("void block " + hex_address(b->ptr) + " is not page-aligned");
            }
            for (std::size_t p = p0; p < p1; ++p) {
              const Page& pg = s.pages[p];
              if (pg.handle != nullptr && pg.handle->live_at[pg.piece] == page_va(s, p)) {
                violated("void block " + hex_address(b->ptr) + " covers the live page " +
                         hex_address(page_va(s, p)));
              }
            }
            continue;
          }
          for (std::size_t p = p0; p < p1; ++p) {
            const Page& pg = s.pages[p];
            if (pg.handle == nullptr || pg.handle->live_at[pg.piece] != page_va(s, p)) {
              violated("block " + hex_address(b->ptr) + " covers the page " +
                       hex_address(page_va(s, p)) + ", which is not live");
            }
          }
          if (b->kind == Kind::kFree) {
            ++free_blocks;
            continue;
          }
          // Allocated, pending or parked; a parked block is counted allocated until it is
          // pooled (core/peak_ledger.hpp, TakenPairs).
          DeviceStats& rc = recount[arena->owner - 1];
          for (StatType t : {kAggregate, pool_stat(s.small)}) {  // the segment's pool
            if (b->kind != Kind::kPending) {
              rc.allocation[t].current += 1;
              rc.allocated_bytes[t].current += static_cast<std::int64_t>(b->size);
            }
            rc.active[t].current += 1;
            rc.active_bytes[t].current += static_cast<std::int64_t>(b->size);
            rc.requested_bytes[t].current += static_cast<std::int64_t>(b->requested);
          }
          if (b->kind == Kind::kParked) {  // free memory: no live byte
            ++parked_in_spaces;
            ++parked_blocks;
            continue;
          }
          (b->kind == Kind::kAllocated ? allocated_blocks : pending_blocks) += 1;
          for (std::size_t p = p0; p < p1; ++p) {
            const Page& pg = s.pages[p];
            const DevicePtr va = page_va(s, p);
            const std::size_t lo = std::max(b->ptr, va) - va;
            const std::size_t hi = std::min(b->end(), va + page_) - va;
            used.emplace_back(pg.handle->id, pg.piece, lo, hi, b->ptr);
          }
        }
        if (island != 0) end_island(at);
        if (at != frontier) {
          violated("the blocks of the space at " + hex_address(s.base) + " end at " +
                   hex_address(at) + ", not at its frontier " + hex_address(frontier));
        }
        if ((s.first == nullptr) != (s.last == nullptr) || (prev != s.last)) {
          violated("the space at " + hex_address(s.base) + " has a wrong last block");
        }
        if (s.pages.size() > s.reserved_pages) violated("a space passes its reservation");
        // Mappings: contiguous pieces of one handle, exactly over the mapped pages.
        std::vector<sim::SimDriver::MappingInfo> model;
        std::size_t mapped_pages = 0;
        for (const auto& [first, m] : s.mappings) {
          for (std::size_t i = 0; i < m.pages; ++i) {
            const Page& pg = s.pages.at(first + i);
            if (pg.handle != m.handle || pg.piece != m.first_piece + i) {
              violated("page " + hex_address(page_va(s, first + i)) +
                       " disagrees with its mapping");
            }
            page_maps[{pg.handle->id, pg.piece}] += 1;
          }
          mapped_pages += m.pages;
          model.push_back({page_va(s, first), m.pages * page_, m.handle->id,
                           std::size_t{m.first_piece} * page_});
        }
        std::size_t pages_with_piece = 0;
        for (std::size_t p = 0; p < s.pages.size(); ++p) {
          const Page& pg = s.pages[p];
          if (pg.freed > arena->epoch) {
            violated("page " + hex_address(page_va(s, p)) + " is stamped " +
                     std::to_string(pg.freed) + ", past its stream's epoch " +
                     std::to_string(arena->epoch));
          }
          if (pg.handle == nullptr) continue;
          ++pages_with_piece;
          if (pg.handle->live_at[pg.piece] != page_va(s, p)) continue;
          ++live_pieces;
          if (pg.handle->counted_small != s.small) {
            violated("handle " + std::to_string(pg.handle->id) + ", live in a " +
                     (s.small ? "small" : "large") + " space, counts in the other pool");
          }
        }
        if (pages_with_piece != mapped_pages) {
          violated("the space at " + hex_address(s.base) + " has pages outside its mappings");
        }
        if (sim != nullptr && sim->mappings_in(s.base, s.reserved_pages * page_) != model) {
          violated("the device's mappings in the space at " + hex_address(s.base) +
                   " are not the model's");
        }
      }
    }
    // The parked block: a block of the stream in its space's own pool (not an island's)
    // with no free block before it (pooled, it would start a free block at its own
    // address).
    if (const Block* b = arena->parked) {
      if (b->kind != Kind::kParked || b->space->arena != arena || b->space->small != b->small ||
          (b->prev != nullptr && b->prev->kind == Kind::kFree)) {
        violated("the parked block " + hex_address(b->ptr) + " of stream " +
                 std::to_string(arena->stream) +
                 " is not a parked block of the stream, outside islands, with no free block "
                 "before it");
      }
      if (parked_in_spaces-- == 0) violated("the parked block " + hex_address(b->ptr) +
                                            " is in no space, or parked twice");
    }
    for (const Pool& pool : arena->pools) {
      for (auto it = pool.begin(); it != pool.end(); ++it) {
        const Block* b = *it;
        if (b->kind != Kind::kFree || b->space->arena != arena) {
          violated("pool holds block " + hex_address(b->ptr) + ", which is not a free block of it");
        }
        if (b->pool_pos != it) {
          violated("the free block " + hex_address(b->ptr) + " has lost its place in its pool");
        }
      }
    }
    // Sharing (stitch/share.cpp): the fences in flight close increasing epochs after the
    // safe one and before the current one; nothing is stamped or fenced before sharing.
    std::uint64_t closed = arena->safe_epoch;
    for (const Fence& f : arena->fences) {
      if (f.epoch <= closed || f.epoch >= arena->epoch) {
        violated("stream " + std::to_string(arena->stream) + " has a fence of epoch " +
                 std::to_string(f.epoch) + " after epoch " + std::to_string(closed) +
                 " with its current epoch " + std::to_string(arena->epoch));
      }
      closed = f.epoch;
    }
    if (arena->safe_epoch >= arena->epoch) {
      violated("stream " + std::to_string(arena->stream) + " is safe up to its current epoch");
    }
    if (!sharing_.load(std::memory_order_relaxed) &&
        (!arena->fences.empty() || arena->unfenced || arena->epoch != 1)) {
      violated("stream " + std::to_string(arena->stream) + " fences frees with one stream");
    }
  }
  std::size_t pooled = 0;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    pooled += arena->pools[0].size() + arena->pools[1].size();
  }
  if (pooled != free_blocks) violated("the pools hold blocks that are not in any space");
  if (parked_in_spaces != 0) violated("a block is parked but not its stream's parked block");
  if (live_entries != allocated_blocks + parked_blocks) {
    violated("a live index holds blocks that are not in any space");
  }
  if (pending_outstanding != pending_entries) {
    violated("an event waits for a block that is not pending");
  }
  const auto pending_total = static_cast<std::int64_t>(pending_entries);
  if (pending_events_.load(std::memory_order_relaxed) != pending_total) {
    violated("the device counts pending events wrongly");
  }
  if (deferred_frees_.load(std::memory_order_relaxed) !=
      static_cast<std::int64_t>(deferred_entries)) {
    violated("the device counts deferred frees wrongly");
  }

  // Pieces.
  std::size_t pieces = 0, spare = 0, live_anywhere = 0;
  for (const auto& [id, h] : handles_) {
    if (h->id != id || h->live_at.size() != h->mappings.size()) violated("a handle is malformed");
    for (std::uint32_t i = 0; i < h->live_at.size(); ++i) {
      ++pieces;
      const auto pm = page_maps.find({id, i});
      const std::uint32_t maps = pm == page_maps.end() ? 0 : pm->second;
      if (maps != h->mappings[i]) {
        violated("piece " + std::to_string(i) + " of handle " + std::to_string(id) + " counts " +
                 std::to_string(h->mappings[i]) + " mappings but " + std::to_string(maps) +
                 " pages map it");
      }
      const bool is_spare = spare_.count({id, i}) != 0;
      if (is_spare != (h->live_at[i] == 0)) {
        violated("piece " + std::to_string(i) + " of handle " + std::to_string(id) +
                 (is_spare ? " is spare but live" : " is live nowhere but not spare"));
      }
      spare += is_spare ? 1 : 0;
      live_anywhere += h->live_at[i] != 0 ? 1 : 0;
    }
  }
  if (spare != spare_.size()) violated("the spare set names pieces that do not exist");
  // Each pool's reserved bytes and segments are those of the handles it counts.
  for (const bool small : {true, false}) {
    std::size_t pool_pieces = 0, pool_handles = 0;
    for (const auto& [id, h] : handles_) {
      if (h->counted_small != small) continue;
      pool_pieces += h->live_at.size();
      ++pool_handles;
    }
    const StatType t = pool_stat(small);
    if (static_cast<std::int64_t>(pool_pieces * page_) != stats_.reserved_bytes[t].current ||
        static_cast<std::int64_t>(pool_handles) != stats_.segment[t].current) {
      violated(std::string("the ") + (small ? "small" : "large") + " pool counts " +
               std::to_string(stats_.reserved_bytes[t].current) + " reserved bytes and " +
               std::to_string(stats_.segment[t].current) + " segments, but its handles hold " +
               std::to_string(pool_pieces * page_) + " bytes in " + std::to_string(pool_handles));
    }
  }
  if (live_anywhere != live_pieces) {
    violated(std::to_string(live_anywhere) + " pieces claim a live page but " +
             std::to_string(live_pieces) + " pages are live");
  }
  if (reserved_ != pieces * page_ ||
      static_cast<std::int64_t>(reserved_) != stats_.reserved_bytes[kAggregate].current) {
    violated("reserved is " + std::to_string(reserved_) + " bytes but " + std::to_string(pieces) +
             " pieces are held");
  }
  // reserved may exceed the limit after set_memory_fraction lowered it; growth never
  // passes it (grow() checks before creating).
  // No two live blocks share a physical byte.
  std::sort(used.begin(), used.end());
  for (std::size_t i = 1; i < used.size(); ++i) {
    const auto& a = used[i - 1];
    const auto& b = used[i];
    if (std::get<0>(a) == std::get<0>(b) && std::get<1>(a) == std::get<1>(b) &&
        std::get<3>(a) > std::get<2>(b)) {
      violated("live blocks " + hex_address(std::get<4>(a)) + " and " +
               hex_address(std::get<4>(b)) + " share physical memory (piece " +
               std::to_string(std::get<1>(a)) + " of handle " + std::to_string(std::get<0>(a)) +
               ")");
    }
  }
  // Statistics: each arena's block statistics equal a recount of its blocks (so the
  // device's, their sums, do too).
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    const DeviceStats st = arena->stats;  // a copy: the analysis does not follow the alias
    const DeviceStats& rc = recount[arena->owner - 1];
    for (StatType t : {kAggregate, kSmallPool, kLargePool}) {
      const auto differs = [&](const StatArray& a, const StatArray& b, const char* name) {
        if (a[t].current != b[t].current) {
          violated(std::string(name) + " of stream " + std::to_string(arena->stream) + " is " +
                   std::to_string(a[t].current) + " but a recount gives " +
                   std::to_string(b[t].current));
        }
      };
      differs(st.allocation, rc.allocation, "allocation");
      differs(st.allocated_bytes, rc.allocated_bytes, "allocated_bytes");
      differs(st.active, rc.active, "active");
      differs(st.active_bytes, rc.active_bytes, "active_bytes");
      differs(st.requested_bytes, rc.requested_bytes, "requested_bytes");
    }
  }
  // peaks_cover_current: an arena not in peak debt is within its baselines (Stat::peak less
  // its debt); with no arena in debt, the device's peaks (the sums of the baselines) cover
  // its currents.
  ArenaEngine::check_peaks_cover_current(
      all.arenas(), [](const Arena* arena) { return arena; },
      [&](const Arena& arena, std::size_t j, std::int64_t current, std::int64_t baseline,
          std::int64_t debt, bool) {
        violated("peaks_cover_current: stream " + std::to_string(arena.stream) + ": " +
                 tracked_counter_name(j) + " is " + std::to_string(current) + ", baseline " +
                 std::to_string(baseline) + ", debt " + std::to_string(debt));
      },
      [&](std::size_t j, std::int64_t peak, std::int64_t current) {
        violated("peaks_cover_current: " + tracked_counter_name(j) + ": device peak " +
                 std::to_string(peak) + " is below its current " + std::to_string(current));
      });
}

}  // namespace ccalloc::core
