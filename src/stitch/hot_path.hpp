// The block operations every cache hit runs, defined inline: handing a block out with its
// split, the free's accounting (release), returning a block to its pool with its merges,
// and the arena's recycling of block objects. They are what a malloc and a free that find
// their memory cached cost (docs/hot-path.md): inlined into malloc and free they spare a
// call frame each (about 70 instructions of a pair's 710). engine.hpp includes this file
// at its end; the rest of the blocks' concern (find_free, turning pages void) is in
// blocks.cpp.
#pragma once

#include <algorithm>
#include <iterator>

#include "core/rounding.hpp"
#include "stitch/engine.hpp"

// Forces inlining where the hot path calls; elsewhere the compiler inlines as it sees fit.
#define CCALLOC_HOT [[gnu::always_inline]] inline

namespace ccalloc::core {

// Blocks are recycled by their arena: splits and merges on the hot path do not allocate.
// A spare keeps its (empty) stream-use vector's capacity and needs only the fields a block
// may have changed reset.
CCALLOC_HOT StitchEngine::Block* StitchEngine::new_block(Arena& arena) {
  Block* b = arena.spare_blocks;
  if (b == nullptr) return new (arena.block_nodes.take(sizeof(Block), alignof(Block))) Block();
  arena.spare_blocks = b->next;
  b->ptr = 0;
  b->size = 0;
  b->requested = 0;
  b->prev = b->next = nullptr;
  b->space = nullptr;
  b->kind = Block::Kind::kFree;
  b->small = false;
  b->event_count = 0;
  b->pool_pos = {};
  return b;
}

CCALLOC_HOT void StitchEngine::delete_block(Arena& arena, Block* b) {
  b->stream_uses.clear();
  b->stack.clear();
  b->next = arena.spare_blocks;
  arena.spare_blocks = b;
}

// Cuts the first `size` bytes of b into a new block of b's kind, linked before it.
CCALLOC_HOT StitchEngine::Block* StitchEngine::split_off_front(Arena& arena, Block* b,
                                                               std::size_t size) {
  Block* f = new_block(arena);
  f->ptr = b->ptr;
  f->size = size;
  f->space = b->space;
  f->kind = b->kind;
  f->small = b->small;
  f->prev = b->prev;
  f->next = b;
  if (f->prev != nullptr) {
    f->prev->next = f;
  } else {
    b->space->first = f;
  }
  b->prev = f;
  b->ptr += size;
  b->size -= size;
  return f;
}

// The rest of a split keeps the block's place in the pool when its smaller key still sorts
// after its predecessor (no tree operation on the usual hit).
CCALLOC_HOT DevicePtr StitchEngine::hand_out(Arena& arena, Pool::iterator pos, std::size_t size,
                                             std::size_t requested, const Origin& stack) {
  Block* block = *pos;
  const bool small = block->small;
  Pool& pool = arena.pool(small);
  if (block->size - size >= kMinBlockSize) {
    Block* rest = block;
    block = split_off_front(arena, rest, size);
    if (pos != pool.begin() && !BySizeThenAddress{}(*std::prev(pos), rest)) {
      pool.erase(pos);
      pool.insert(rest);
    }
  } else {
    pool.erase(pos);
  }
  if (!small) count_large(arena, *block);
  arena.live.insert(block->ptr, block);
  return mark_handed_out(arena, *block, requested, stack);
}

// What growth and islands decide by: the large bytes handed out since the stream's last
// growth and its largest large block.
CCALLOC_HOT void StitchEngine::count_large(Arena& arena, const Block& block) {
  arena.large_served += block.size;
  arena.largest_large = std::max(arena.largest_large, block.size);
}

CCALLOC_HOT DevicePtr StitchEngine::mark_handed_out(Arena& arena, Block& block,
                                                    std::size_t requested, const Origin& stack) {
  block.kind = Block::Kind::kAllocated;
  block.requested = requested;
  if (stack) block.stack = stack;  // a free or parked block has none
  DeviceStats& st = arena.stats;
  PeakBaselines& debt = arena.debts;  // rises beyond the baselines: core/peak_ledger.hpp
  const auto bytes = static_cast<std::int64_t>(block.size);
  // The segment's pool's entries; the aggregates keep their peaks only
  // (core/peak_ledger.hpp).
  const StatType t = pool_stat(block.space->small);
  const auto increase = [&](StatArray& stat, PeakBaselines::Array& d, std::int64_t n) {
    arena.mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
    ledger_increase_pool(stat, d[t], d[kAggregate], arena.in_debt, t, n);
  };
  increase(st.allocation, debt.allocation, 1);
  increase(st.allocated_bytes, debt.allocated_bytes, bytes);
  increase(st.active, debt.active, 1);
  increase(st.active_bytes, debt.active_bytes, bytes);
  increase(st.requested_bytes, debt.requested_bytes, static_cast<std::int64_t>(requested));
  record_trace(TraceAction::kAlloc, block.ptr, requested, arena.stream, stack);
  return block.ptr;
}

// A free's statistics, in pool `t`: the block's segment's (an island's in the large one, as
// PyTorch's tools rebuild them from the snapshot's segments), its entries only
// (core/peak_ledger.hpp): no longer allocated at the free, no longer active once its uses
// are done. Frees lower the block statistics only: no peak debt to settle.
CCALLOC_HOT void StitchEngine::count_release(Arena& arena, const Block& b, StatType t) {
  arena.stats.allocation[t].decrease(1);
  arena.stats.allocated_bytes[t].decrease(static_cast<std::int64_t>(b.size));
}

CCALLOC_HOT void StitchEngine::count_inactive(Arena& arena, const Block& b, StatType t) {
  arena.stats.active[t].decrease(1);
  arena.stats.active_bytes[t].decrease(static_cast<std::int64_t>(b.size));
  arena.stats.requested_bytes[t].decrease(static_cast<std::int64_t>(b.requested));
}

// The cache in front of the pools. A free that would pool its block at once (no other
// stream's use, so no event) with no history or trace to record and no capture underway
// parks it instead, when no free block lies before it: pooled, it would be a free block
// starting at its own address, merged at most with the free block after it. The next
// request on the stream for the block's pool takes it as it is where best fit would serve
// that request from that merged block's start (the same address, the rest pooled as it is
// now); any other pools it first, as does a free next to it, a growth and every operation
// that takes all arena locks. So the blocks handed out, and every statistic, are those of
// the pools alone; what is saved is the merge, the split and the tree updates of a pair,
// and its statistics: the park counts no release and the take no allocation (the block's
// release is counted if it is pooled; the pair's cumulative counts wait in Arena::taken
// until the statistics are read: core/peak_ledger.hpp, TakenPairs).
// Small and large blocks alike, but not an island's (a small block in a large space, whose
// pooling may end the island).
CCALLOC_HOT bool StitchEngine::park(Arena& arena, Block* b, const Origin& stack) {
  if (b->space->small != b->small || !b->stream_uses.empty() || stack || b->stack ||
      tracing_.load(std::memory_order_relaxed) || capturing() || !parking_) {
    return false;
  }
  if (arena.parked != nullptr) unpark(arena);  // the last one parked goes to its pool
  const Block* const prev = b->prev;
  if (prev != nullptr && prev->kind == Block::Kind::kFree) return false;  // (same pool)
  b->kind = Block::Kind::kParked;
  // Stamped (and the fences polled) as the free would: a stream that takes its pages later
  // sees the same stamps, whether or not it was parked meanwhile.
  if (sharing_.load(std::memory_order_relaxed)) [[unlikely]]
    note_free(arena, *b);
  arena.parked = b;
  return true;
}

// Pooled, the parked block b would merge with a free block after it into one that starts
// at b: a request of b's size for b's pool is served at b when that merged block is the
// request's best fit, that is, when it sorts before every other pooled block that fits. A
// large request first returns the small pool's kept islands where they would not stay
// (malloc): then the pools alone decide.
CCALLOC_HOT DevicePtr StitchEngine::take_parked(Arena& arena, std::size_t rounded, bool small,
                                                std::size_t requested, const Origin& stack) {
  Block* const b = arena.parked;
  if (b->size == rounded && b->small == small && (small || !arena.keeps_island)) {
    // An island's free block after a large one would not merge with it (the small pool's):
    // counted in, it only makes `merged` larger, so the take is refused where it would be
    // right, never made where it would be wrong; that rare case is not worth a test per hit.
    Block* const after =
        b->next != nullptr && b->next->kind == Block::Kind::kFree ? b->next : nullptr;
    Pool& pool = arena.pool(small);
    auto pos = pool.lower_bound(BySizeThenAddress::Key{rounded, 0});
    if (pos != pool.end() && *pos == after) {
      // The next one, unless after is the only one (a page's free rest, on the usual hit).
      pos = pool.size() == 1 ? pool.end() : std::next(pos);
    }
    const std::size_t merged = b->size + (after != nullptr ? after->size : 0);
    if (pos == pool.end() || merged < (*pos)->size ||
        (merged == (*pos)->size && b->ptr < (*pos)->ptr)) {
      arena.parked = nullptr;
      if (!small) count_large(arena, *b);
      // Still in the live index, and counted allocated: the pair adds to the cumulative
      // counts alone, and to the requested bytes what it asks beyond the park's.
      b->kind = Block::Kind::kAllocated;
      if (stack) b->stack = stack;
      const StatType t = pool_stat(small);  // (not an island: its space's pool)
      arena.taken.take(arena.stats, arena.debts, arena.in_debt, t,
                       static_cast<std::int64_t>(b->size), b->requested, requested);
      record_trace(TraceAction::kAlloc, b->ptr, requested, arena.stream, stack);
      return b->ptr;
    }
  }
  unpark(arena);
  return 0;
}

// The stamp of a free on a stream that shares: its pages' epoch, then the fence poll
// unless a skip granted by the last cycle-counter read is left (share.cpp, note_free_poll).
CCALLOC_HOT void StitchEngine::note_free(Arena& arena, const Block& b) {
  Space& s = *b.space;
  const std::size_t p0 = page_index(b.ptr - s.base);
  const std::size_t p1 = page_index(b.end() - s.base + page_ - 1);
  for (std::size_t p = p0; p < p1; ++p)
    s.pages[p].freed = arena.epoch;
  arena.unfenced = true;
  if (arena.fence_skips != 0 && arena.fence_clock_span != 0) {
    --arena.fence_skips;
    return;
  }
  note_free_poll(arena);
}

// Returns a block with no outstanding uses to its pool, merged with free neighbours.
CCALLOC_HOT void StitchEngine::free_block(Arena& arena, Block* b) {
  count_inactive(arena, *b, pool_stat(b->space->small));
  record_trace(TraceAction::kFreeCompleted, b->ptr, b->requested, arena.stream, b->stack);
  b->kind = Block::Kind::kFree;
  b->stack.clear();
  if (sharing_.load(std::memory_order_relaxed)) [[unlikely]]
    note_free(arena, *b);
  pool_free(arena, b);
}

CCALLOC_HOT StitchEngine::Block* StitchEngine::pool_free(Arena& arena, Block* b, bool keep_island) {
  if (Block* const p = arena.parked; p != nullptr && (p == b->prev || p == b->next)) [[unlikely]] {
    // The parked neighbour was pooled when it was freed, for all the pools know: pool it
    // first (with b not yet free), then merge b with what holds it.
    const Block::Kind kind = b->kind;
    b->kind = Block::Kind::kAllocated;
    unpark(arena);
    b->kind = kind;
  }
  Space& s = *b->space;
  Pool& pool = arena.pool(b->small);
  const auto joins = [b](const Block* n) {
    return n != nullptr && n->kind == Block::Kind::kFree && n->small == b->small;
  };
  Block* const prev = joins(b->prev) ? b->prev : nullptr;
  Block* const next = joins(b->next) ? b->next : nullptr;
  if (prev == nullptr && next == nullptr) {
    pool.insert(b);
    return keep_island || !b->in_island() ? b : end_island_if_free(arena, b);
  }
  // The survivor is a neighbour already in the pool; the others are absorbed into it. It
  // only grew, so it keeps its place unless it now sorts after its successor.
  Block* const merged = prev != nullptr ? prev : next;
  const Pool::iterator pos = pool.find(merged);
  if (prev != nullptr && next != nullptr) pool.erase(next);
  const DevicePtr start = prev != nullptr ? prev->ptr : b->ptr;
  Block* const last = next != nullptr ? next : b;
  Block* const before = prev != nullptr ? prev->prev : b->prev;
  Block* const after = last->next;
  merged->size = last->end() - start;
  merged->ptr = start;
  merged->requested = b->requested;  // the freed block's, as before the merge
  merged->prev = before;
  merged->next = after;
  if (before != nullptr) {
    before->next = merged;
  } else {
    s.first = merged;
  }
  if (after != nullptr) {
    after->prev = merged;
  } else {
    s.last = merged;
  }
  delete_block(arena, b);  // absorbed, as is `next` when both neighbours were free
  if (prev != nullptr && next != nullptr) delete_block(arena, next);
  if (std::next(pos) != pool.end() && !BySizeThenAddress{}(merged, *std::next(pos))) {
    pool.erase(pos);
    pool.insert(merged);
  }
  return keep_island || !merged->in_island() ? merged : end_island_if_free(arena, merged);
}

CCALLOC_HOT void StitchEngine::release(Arena& arena, Block* b, const Origin& stack) {
  count_release(arena, *b, pool_stat(b->space->small));
  // The free's own stack (context "all"), else the allocation's.
  record_trace(TraceAction::kFreeRequested, b->ptr, b->requested, arena.stream,
               stack ? stack : b->stack);
  if (stack) b->stack = stack;
  if (b->stream_uses.empty()) {
    free_block(arena, b);
    return;
  }
  // Reuse waits for the work queued so far on every other stream that used the block.
  b->kind = Block::Kind::kPending;
  if (capturing()) [[unlikely]] {  // no event may be recorded now
    arena.deferred.push_back(b);
    deferred_frees_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  record_events(arena, b);
}

}  // namespace ccalloc::core

#undef CCALLOC_HOT
