// The hot path: malloc, free, record_stream, and the block operations they use.
// The OOM ladder lives in oom_ladder.cpp, events in events.cpp.
#include "native/engine.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "sync/arena_cache.hpp"
#include "core/arena_engine.hpp"
#include "core/common.hpp"
#include "core/rounding.hpp"

namespace ccalloc::core {
// The steps of a cache hit's malloc and free, defined below and inlined into
// malloc_cached and free_cached, their callers on the hot path (docs/hot-path.md: a call
// frame each spared). Other files call them out of line.
#pragma GCC diagnostic ignored "-Wattributes"
#define CCALLOC_HOT [[gnu::always_inline]]

namespace {

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Public operations

Engine::Engine(Driver& driver, Config config)
    : driver_(driver), config_(std::move(config)), uid_(next_engine_uid()), event_pool_(driver) {
  check_invariants_ = env_flag("CCALLOC_CHECK_INVARIANTS");
  capacity_ = driver_.mem_info().total_bytes;
  device_stats_.max_split_size =
      config_.max_split_size == SIZE_MAX ? -1 : static_cast<std::int64_t>(config_.max_split_size);
  set_memory_fraction(config_.per_process_memory_fraction);
}

DevicePtr Engine::malloc(std::size_t size, StreamId stream) {
  if (size == 0) return 0;
  if (size >= kOneExabyte) {
    throw OutOfMemoryError("CUDA out of memory. Tried to allocate more than 1EB memory.",
                           driver_.device(), size);
  }
  if (config_.uncached) return malloc_uncached(size);
  const unsigned flags = trace_flags_.load(std::memory_order_acquire);
  if (flags & (kTraceHistory | kCaptureOnMalloc)) [[unlikely]] {
    const OperationContext context(flags & kCaptureOnMalloc ? capture(flags) : Origin{});
    return malloc_cached(size, stream);
  }
  return malloc_body(size, stream);
}

DevicePtr Engine::malloc_cached(std::size_t size, StreamId stream) {
  return malloc_body(size, stream);
}

CCALLOC_HOT DevicePtr Engine::malloc_body(std::size_t size, StreamId stream) {
  // During capture events may be neither queried nor recorded: pending frees wait.
  poll_events();
  const bool capture = capturing();
  Arena& arena = capture ? arena_for_capture(stream) : arena_for(stream);
  std::unique_lock lock(arena.mutex);  // moved into malloc_slow
  arena.mutex.assert_held();
  // Only captures route requests to private pools; a sleeping pool takes none (sleep_pool
  // and begin_allocate_to_pool see to it, and this catches a malloc that raced with them).
  if (capture && arena.pool != nullptr && arena.pool->asleep.load(std::memory_order_relaxed))
      [[unlikely]] {
    throw_asleep(*arena.pool, "malloc");
  }
  if (capture && arena.deferred_marked != 0 && config_.graph_capture_record_stream_reuse)
      [[unlikely]] {
    reuse_in_capture(arena);
  }
  const Request req = make_request(size, stream);  // reads the config: under the lock
  if (arena.parked != nullptr) {
    if (const DevicePtr ptr = take_parked(arena, req)) {
      ArenaEngine::finish(*this, arena, lock);
      return ptr;
    }
  }
  const PoolPos pos = find_free_block(arena, req, /*advance_gc_clock=*/true);
  if (pos == arena.pool_for(req.small).blocks.end()) {
    return malloc_slow(arena, req, std::move(lock));
  }
  const DevicePtr ptr = hand_out(arena, *pos, pos, req);
  ArenaEngine::finish(*this, arena, lock);
  return ptr;
}

void Engine::free(DevicePtr ptr) {
  if (ptr == 0) return;
  if (config_.uncached) {
    free_uncached(ptr);
    return;
  }
  const unsigned flags = trace_flags_.load(std::memory_order_acquire);
  if (flags & kTraceHistory) [[unlikely]] {
    const OperationContext context(flags & kCaptureOnFree ? capture(flags) : Origin{});
    free_cached(ptr);
    return;
  }
  free_body(ptr);
}

void Engine::free_cached(DevicePtr ptr) {
  free_body(ptr);
}

// free and record_stream look the pointer up once: the SegmentMap names the arena (no
// lock), and one probe of the arena's live index under its lock yields the block (free
// removes it in the same probe).
CCALLOC_HOT void Engine::free_body(DevicePtr ptr) {
  if (Arena* arena = arena_of(ptr)) {
    std::unique_lock lock(arena->mutex);
    arena->mutex.assert_held();
    if (Block* block = live_block(*arena, ptr)) {
      if (!park(*arena, block)) {  // a parked block stays in the live index
        arena->live.erase(ptr);
        release_allocation(*arena, block);
      }
      ArenaEngine::finish(*this, *arena, lock);
      return;
    }
  }
  throw_not_live("free", ptr);
}

void Engine::record_stream(DevicePtr ptr, StreamId stream) {
  if (config_.uncached) return;  // uncached memory is freed synchronously
  ArenaEngine::record_stream(*this, ptr, stream);
}

std::size_t Engine::allocation_size(DevicePtr ptr) const {
  return ArenaEngine::allocation_size(*this, ptr);
}

void Engine::throw_not_live(const char* what, DevicePtr ptr) const {
  throw InvalidPointerError(pointer_error(what, ptr, device()), ptr);
}

Arena* Engine::arena_by_owner(SegmentMap::Owner owner) const {
  if (owner == 0) return nullptr;
  return arena_table_.get(owner);
}

// ---------------------------------------------------------------------------------------
// Block operations (the arena's lock is held)

CCALLOC_HOT Request Engine::make_request(std::size_t size, StreamId stream) const {
  Request r;
  r.requested = size;
  r.size = round_size(size, config_);
  r.small = is_small_size(r.size);
  r.segment_size = segment_size_for(r.size, config_);
  r.stream = stream;
  return r;
}

CCALLOC_HOT Engine::PoolPos Engine::find_free_block(Arena& arena, const Request& req,
                                                    bool advance_gc_clock) {
  FreePool& pool = arena.pool_for(req.small);
  if (advance_gc_clock && gc_enabled()) {
    pool_searches_[req.small ? 0 : 1].fetch_add(1, std::memory_order_relaxed);
  }
  PoolPos pos = pool.lower_bound(req.size);
  if (pos == pool.blocks.end()) return pos;
  if ((*pos)->segment != nullptr) {
    // A free block at the end of an expandable segment can grow into the unmapped range
    // after it: for best fit, count that room too, and prefer a larger block that fits
    // more tightly.
    const auto room = [](const Block* b) {
      return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0);
    };
    for (auto next = std::next(pos);
         (*pos)->segment != nullptr && next != pool.blocks.end() && room(*next) < room(*pos);
         ++next) {
      pos = next;
    }
  }
  if (!oversize_allows((*pos)->size, req.size, config_)) return pool.blocks.end();
  return pos;
}

CCALLOC_HOT DevicePtr Engine::hand_out(Arena& arena, Block* block, PoolPos pos,
                                       const Request& req) {
  block = carve(arena, block, pos, req);
  arena.live.insert(block->ptr, block);
  record_trace(TraceAction::kAlloc, block->ptr, req.requested, arena.stream, block);
  return block->ptr;
}

// Takes req.size bytes from the low end of `block`, leaving the rest free in the pool when
// should_split() says it is worth a block of its own. A remainder that was in the pool
// keeps its place there when its shrunken size still sorts after its predecessor.
CCALLOC_HOT Block* Engine::carve(Arena& arena, Block* block, PoolPos pos, const Request& req) {
  FreePool& pool = *block->pool;
  const bool pooled = pos != pool.blocks.end();
  const bool already_split = block->is_split();
  DeviceStats& st = arena.stats;
  PeakBaselines& debt = arena.debts;  // increases go through arena.increase(): see arena.hpp
  // The pool's entries; the aggregates keep their peaks only (core/peak_ledger.hpp).
  const StatType t = pool_stat(pool.is_small);
  const auto increase = [&](StatArray& stat, PeakBaselines::Array& d,
                            std::int64_t n) __attribute__((always_inline)) {
    arena.mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
    ledger_increase_pool(stat, d[t], d[kAggregate], arena.in_debt, t, n);
  };

  const bool expandable_block = block->segment != nullptr;
  const bool no_split =
      arena.pool != nullptr && arena.pool->no_split.load(std::memory_order_relaxed);
  if (req.exact ? block->size > req.size
                : !no_split && should_split(block->size, req.size,
                                            pool.is_small || expandable_block, config_)) {
    Block* remaining = block;
    block = arena.blocks.make();
    block->ptr = remaining->ptr;
    block->size = req.size;
    block->pool = &pool;
    block->segment = remaining->segment;
    block->prev = remaining->prev;
    if (block->prev != nullptr) block->prev->next = block;
    block->next = remaining;
    remaining->prev = block;
    remaining->ptr += req.size;
    remaining->size -= req.size;
    if (remaining->segment_stack)
      std::swap(block->segment_stack, remaining->segment_stack);  // the new head's
    if (pooled) {
      remaining->gc_count_base = gc_clock(pool);
      fix_pool_position(pool, pos, Change::kShrank);
    } else {
      insert_into_pool(pool, remaining);
    }
    // Expandable blocks never count as inactive_split: their free pages can always be
    // unmapped.
    if (!expandable_block && already_split) {
      st.inactive_split_bytes[t].decrease(static_cast<std::int64_t>(block->size));
    } else if (!expandable_block) {
      increase(st.inactive_split_bytes, debt.inactive_split_bytes,
               static_cast<std::int64_t>(remaining->size));
      increase(st.inactive_split, debt.inactive_split, 1);
    }
  } else {
    if (pooled) pool.blocks.erase(pos);
    if (already_split && !expandable_block) {
      st.inactive_split_bytes[t].decrease(static_cast<std::int64_t>(block->size));
      st.inactive_split[t].decrease(1);
    }
  }

  count_handed_out(arena, block, req, t);
  return block;
}

CCALLOC_HOT void Engine::count_handed_out(Arena& arena, Block* block, const Request& req,
                                          StatType t) {
  DeviceStats& st = arena.stats;
  PeakBaselines& debt = arena.debts;
  const auto increase = [&](StatArray& stat, PeakBaselines::Array& d,
                            std::int64_t n) __attribute__((always_inline)) {
    arena.mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
    ledger_increase_pool(stat, d[t], d[kAggregate], arena.in_debt, t, n);
  };
  block->allocated = true;
  block->requested_size = req.requested;
  if (trace_flags_.load(std::memory_order_relaxed) & kStacksOnBlocks) {
    block->stack = OperationContext::current();
  }
  const auto size = static_cast<std::int64_t>(block->size);
  increase(st.allocation, debt.allocation, 1);
  increase(st.allocated_bytes, debt.allocated_bytes, size);
  increase(st.active, debt.active, 1);
  increase(st.active_bytes, debt.active_bytes, size);
  increase(st.requested_bytes, debt.requested_bytes, static_cast<std::int64_t>(req.requested));
  if (is_oversize(block->size, config_)) {
    arena.increase(st.oversize_allocations, debt.oversize_allocations, 1);
  }
}

// The program freed `block`: it returns to its pool now, or once events on the other
// streams that used it have completed.
CCALLOC_HOT void Engine::count_released(Arena& arena, const Block* block) {
  arena.park_exact = false;
  DeviceStats& st = arena.stats;
  const StatType t = pool_stat(block->pool->is_small);  // the pool's entries only
  st.allocation[t].decrease(1);
  st.allocated_bytes[t].decrease(static_cast<std::int64_t>(block->size));
  if (is_oversize(block->size, config_)) st.oversize_allocations.decrease(1);
}

CCALLOC_HOT void Engine::release_allocation(Arena& arena, Block* block) {
  block->allocated = false;
  count_released(arena, block);
  record_trace(TraceAction::kFreeRequested, block->ptr, block->requested_size, arena.stream, block);
  if (block->stream_uses.empty()) {
    free_block(arena, block);
  } else if (capturing()) [[unlikely]] {
    // Recording an event during capture is illegal: the events are recorded at the first
    // operation after every capture has ended (PyTorch's
    // needs_events_deferred_until_no_capture), unless the capture graph shows earlier that
    // every use is over (graph_capture_record_stream_reuse).
    DeferredFree d{block, {}, 0, deferred_seq_.fetch_add(1, std::memory_order_relaxed)};
    if (config_.graph_capture_record_stream_reuse)
      d.markers = free_markers(arena, block, d.capture);
    if (!d.markers.empty()) ++arena.deferred_marked;
    arena.deferred.push_back(std::move(d));
    arena.deferred_count.fetch_add(1, std::memory_order_relaxed);
    deferred_frees_.fetch_add(1, std::memory_order_relaxed);
  } else {
    insert_events(arena, block);
  }
}

// Returns a block with no outstanding uses to its pool, merged with its free neighbours.
CCALLOC_HOT void Engine::free_block(Arena& arena, Block* block) {
  record_trace(TraceAction::kFreeCompleted, block->ptr, block->requested_size, arena.stream, block);
  if (Block* const p = arena.parked; p != nullptr &&
      (block->next == p || block->prev == p || (block->prev != nullptr && block->prev->prev == p)))
      [[unlikely]] {
    // Its merges would reach the parked block, or the free block after it, which the pools
    // hold merged with it: pool the parked block first, as it was when it was freed (with
    // this block not yet free, so that the parked one does not merge with it).
    block->allocated = true;
    unpark(arena);
    block->allocated = false;
  }
  const auto original_size = static_cast<std::int64_t>(block->size);
  const auto requested = block->requested_size;
  std::int64_t net_split_blocks = 0;
  std::int64_t net_split_bytes = 0;
  const bool small = block->pool->is_small;
  merge_into_pool(arena, block, net_split_blocks, net_split_bytes);
  count_pooled(arena, small, net_split_blocks, net_split_bytes, original_size, requested);
}

// The merged block reuses a free neighbour's place in the pool when it can (its size only
// grew), which spares the tree an erase and an insert.
CCALLOC_HOT Block* Engine::merge_into_pool(Arena& arena, Block* block,
                                           std::int64_t& net_split_blocks,
                                           std::int64_t& net_split_bytes) {
  const auto requested = block->requested_size;
  FreePool& pool = *block->pool;
  Block* const prev = is_free(block->prev) ? block->prev : nullptr;
  Block* const next = is_free(block->next) ? block->next : nullptr;

  Block* merged = block;
  if (prev != nullptr || next != nullptr) {
    // The survivor is a neighbour already in the pool; the others are absorbed into it.
    merged = prev != nullptr ? prev : next;
    const PoolPos pos = pool.blocks.find(merged);
    if (prev != nullptr && next != nullptr) pool.blocks.erase(next);
    for (const Block* neighbour : {prev, next}) {
      if (neighbour != nullptr) {
        net_split_blocks -= 1;
        net_split_bytes -= static_cast<std::int64_t>(neighbour->size);
      }
    }
    const DevicePtr start = prev != nullptr ? prev->ptr : block->ptr;
    const Block* const last = next != nullptr ? next : block;
    Block* const before = prev != nullptr ? prev->prev : block->prev;
    Block* const after = last->next;
    const std::size_t size = last->end() - start;
    Origin segment_stack = std::move((prev != nullptr ? prev : block)->segment_stack);
    for (Block* absorbed : {prev, block, next}) {
      if (absorbed != nullptr && absorbed != merged) arena.blocks.recycle(absorbed);
    }
    merged->ptr = start;
    merged->size = size;
    merged->prev = before;
    merged->next = after;
    if (before != nullptr) before->next = merged;
    if (after != nullptr) after->prev = merged;
    merged->requested_size = requested;  // as PyTorch, the freed block's stale value
    merged->segment_stack = std::move(segment_stack);
    merged->gc_count_base = gc_clock(pool);
    fix_pool_position(pool, pos, Change::kGrew);
  } else {
    insert_into_pool(pool, block);
  }
  merged->stack.clear();  // a free block has no allocation context
  if (merged->is_split()) {
    net_split_blocks += 1;
    net_split_bytes += static_cast<std::int64_t>(merged->size);
  }
  if (merged->segment != nullptr) net_split_blocks = net_split_bytes = 0;  // see carve()
  return merged;
}

CCALLOC_HOT void Engine::count_pooled(Arena& arena, bool small, std::int64_t net_split_blocks,
                                      std::int64_t net_split_bytes, std::int64_t size,
                                      std::size_t requested) {
  arena.park_exact = false;
  const StatType t = pool_stat(small);  // the pool's entries only
  count_inactive_split(arena, t, net_split_blocks, net_split_bytes);
  count_deactivated(arena, t, size, requested);
}

CCALLOC_HOT void Engine::count_inactive_split(Arena& arena, StatType t,
                                              std::int64_t net_split_blocks,
                                              std::int64_t net_split_bytes) {
  DeviceStats& st = arena.stats;
  PeakBaselines& debt = arena.debts;
  if (net_split_blocks > 0) {
    ledger_increase_pool(st.inactive_split, debt.inactive_split[t], debt.inactive_split[kAggregate],
                         arena.in_debt, t, net_split_blocks);
  }
  if (net_split_blocks < 0) st.inactive_split[t].decrease(-net_split_blocks);
  if (net_split_bytes > 0) {
    ledger_increase_pool(st.inactive_split_bytes, debt.inactive_split_bytes[t],
                         debt.inactive_split_bytes[kAggregate], arena.in_debt, t, net_split_bytes);
  }
  if (net_split_bytes < 0) st.inactive_split_bytes[t].decrease(-net_split_bytes);
}

CCALLOC_HOT void Engine::count_deactivated(Arena& arena, StatType t, std::int64_t size,
                                           std::size_t requested) {
  DeviceStats& st = arena.stats;
  st.active[t].decrease(1);
  st.active_bytes[t].decrease(size);
  st.requested_bytes[t].decrease(static_cast<std::int64_t>(requested));
}

void Engine::flush_taken(Arena& arena) {
  arena.taken.flush(arena.stats);
  arena.stats.oversize_allocations.allocated += arena.taken_oversize;
  arena.stats.oversize_allocations.freed += arena.taken_oversize;
  arena.taken_oversize = 0;
}

// ---------------------------------------------------------------------------------------
// The parked block: a one-block cache in front of the pools, for the hit whose free and
// malloc would merge a block into its pool and split it out again at the same address.
// Pooled, a freed block b with no free block before it starts a free block at its own
// address, merged with the free block after it (`after`) if there is one. The next request
// of b's rounded size for b's pool is served from that merged block when it is the
// request's best fit (it sorts before every other pooled block that fits, `after` aside),
// passes the oversize rules and, with `after`, is split (the rest is `after` as it is): b
// comes back as it is. So the stream keeps its last freed block out of the pools: a take
// hands out exactly what best fit would, and any other request, a free whose merges
// reach b, and every operation that takes every arena lock pool it first. The inactive
// split counts change at the park and the take as the pools' free and malloc would change
// them, peaks included. The allocation, active, requested and oversize counts fall only
// when the block is pooled (unpark): a take restores them exactly, and every operation
// that could raise them or read them pools the parked block first, so counting its
// release late changes no value anyone sees (Arena::taken keeps the pairs' cumulative
// counts until they are read).

CCALLOC_HOT bool Engine::park(Arena& arena, Block* b) {
  if (!b->stream_uses.empty() || b->segment != nullptr || arena.pool != nullptr ||
      b->stack || trace_flags_.load(std::memory_order_relaxed) != 0 || capturing() ||
      gc_enabled() || !parking_) {
    return false;
  }
  if (arena.parked != nullptr) unpark(arena);  // the last one parked goes to its pool
  if (is_free(b->prev)) return false;          // it would merge with what lies before it
  b->allocated = false;
  // Pooled, b would merge with `after` into a block that is split unless it is the
  // segment.
  const Block* const after = is_free(b->next) ? b->next : nullptr;
  const std::int64_t after_size = after != nullptr ? static_cast<std::int64_t>(after->size) : 0;
  const auto size = static_cast<std::int64_t>(b->size);
  const bool split = b->prev != nullptr || (after != nullptr ? after->next : b->next) != nullptr;
  count_inactive_split(arena, pool_stat(b->pool->is_small),
                       (after != nullptr ? -1 : 0) + (split ? 1 : 0),
                       -after_size + (split ? size + after_size : 0));
  arena.parked = b;
  arena.park_exact = true;
  return true;
}

CCALLOC_HOT DevicePtr Engine::take_parked(Arena& arena, const Request& req) {
  Block* const b = arena.parked;
  FreePool& pool = arena.pool_for(req.small);
  if (b->size == req.size && b->pool == &pool && !req.exact &&
      trace_flags_.load(std::memory_order_relaxed) == 0) {
    Block* const after = is_free(b->next) ? b->next : nullptr;
    const std::size_t merged = b->size + (after != nullptr ? after->size : 0);
    // Best fit: the merged block sorts before every pooled block that fits but `after`. An
    // unchanged pool (its version) keeps the answer of the last take of this block.
    bool best = b == arena.fit_block && pool.blocks.version() == arena.fit_version;
    if (!best) {
      PoolPos pos = pool.lower_bound(req.size);
      if (pos != pool.blocks.end() && *pos == after) ++pos;
      best = pos == pool.blocks.end() ||
             ((*pos)->segment == nullptr &&
              (merged < (*pos)->size || (merged == (*pos)->size && b->ptr < (*pos)->ptr)));
      if (best) {
        arena.fit_block = b;
        arena.fit_version = pool.blocks.version();
      }
    }
    if (best && oversize_allows(merged, req.size, config_) &&
        (after == nullptr || should_split(merged, req.size, pool.is_small, config_))) {
      arena.parked = nullptr;
      // carve()'s statistics for the merged block: split into b and `after`, or b whole.
      // The inactive split counts its park changed return to their values before it where
      // nothing else changed the statistics since (park_exact), which the peaks cover;
      // otherwise a free since may have raised them, and the peaks are checked.
      DeviceStats& st = arena.stats;
      const StatType t = pool_stat(pool.is_small);
      const bool exact = arena.park_exact;
      const auto increase = [&](StatArray& stat, PeakBaselines::Array& d,
                                std::int64_t n) __attribute__((always_inline)) {
        arena.mutex.assert_held();  // the analysis does not carry the caller's locks
        ledger_increase_pool(stat, d[t], d[kAggregate], arena.in_debt, t, n, exact);
      };
      const bool already_split =
          b->prev != nullptr || (after != nullptr ? after->next : b->next) != nullptr;
      if (after != nullptr) {
        after->requested_size = b->requested_size;  // the merged block's stale value
        after->gc_count_base = gc_clock(pool);
        if (already_split) {
          st.inactive_split_bytes[t].decrease(static_cast<std::int64_t>(b->size));
        } else {
          increase(st.inactive_split_bytes, arena.debts.inactive_split_bytes,
                   static_cast<std::int64_t>(after->size));
          increase(st.inactive_split, arena.debts.inactive_split, 1);
        }
      } else if (already_split) {
        st.inactive_split_bytes[t].decrease(static_cast<std::int64_t>(b->size));
        st.inactive_split[t].decrease(1);
      }
      // The allocation, active and oversize counts still count b (its release is counted
      // at its unpark): the pair adds to their cumulative counts alone. No stack: no trace
      // flag is set. (Still in the live index.)
      b->allocated = true;
      arena.taken.take(st, arena.debts, arena.in_debt, t, static_cast<std::int64_t>(b->size),
                       b->requested_size, req.requested);
      if (is_oversize(b->size, config_)) ++arena.taken_oversize;
      return b->ptr;
    }
  }
  unpark(arena);
  return 0;
}

void Engine::unpark(Arena& arena) {
  Block* const b = arena.parked;
  arena.parked = nullptr;
  arena.fit_block = nullptr;
  arena.live.erase(b->ptr);
  count_released(arena, b);  // the release its park left uncounted
  count_deactivated(arena, pool_stat(b->pool->is_small), static_cast<std::int64_t>(b->size),
                    b->requested_size);
  std::int64_t net_split_blocks = 0, net_split_bytes = 0;  // counted at the park
  merge_into_pool(arena, b, net_split_blocks, net_split_bytes);
}

CCALLOC_HOT void Engine::insert_into_pool(FreePool& pool, Block* block) {
  block->gc_count_base = gc_clock(pool);
  pool.blocks.insert(block);
}

CCALLOC_HOT void Engine::fix_pool_position(FreePool& pool, PoolPos pos, Change change) {
  pool.blocks.touch();  // the block's size and address changed in place
  const BySizeThenAddress less;
  const bool in_order = change == Change::kShrank
                            ? pos == pool.blocks.begin() || less(*std::prev(pos), *pos)
                            : std::next(pos) == pool.blocks.end() || less(*pos, *std::next(pos));
  if (in_order) return;
  Block* const block = *pos;
  pool.blocks.erase(pos);
  pool.blocks.insert(block);
}

// ---------------------------------------------------------------------------------------
// Arenas and the active-block index

Arena& Engine::arena_for_registry(StreamId stream) {
  Arena* arena;
  {
    Lock lock(registry_mutex_);
    auto it = arena_by_stream_.find(stream);
    if (it == arena_by_stream_.end()) {
      it = arena_by_stream_.emplace(stream, &make_arena(stream, nullptr)).first;
    }
    arena = it->second;
  }
  ThreadArenaCache<Arena>::put(uid_, stream, arena);
  return *arena;
}

Arena& Engine::arena_for_capture(StreamId stream) {
  {
    Lock lock(registry_mutex_);
    // The most recently begun capture that takes the stream wins, so nested
    // use_mem_pool contexts allocate to the innermost pool.
    for (auto it = captures_.rbegin(); it != captures_.rend(); ++it) {
      if (it->second(stream)) return pool_arena(pool_of(it->first), stream);
    }
  }
  return arena_for(stream);
}

Arena& Engine::pool_arena(PrivatePool& pool, StreamId stream) {
  auto it = pool.arenas.find(stream);
  if (it == pool.arenas.end()) it = pool.arenas.emplace(stream, &make_arena(stream, &pool)).first;
  return *it->second;
}

Arena& Engine::make_arena(StreamId stream, PrivatePool* pool) {
  const std::size_t index = arenas_.size();
  if (index + 1 > SegmentMap::kMaxOwner) {
    throw Error("ccalloc: too many streams on device " + std::to_string(device()) + " (" +
                std::to_string(index) + ")");
  }
  arenas_.push_back(std::make_unique<Arena>(stream, index, pool));
  Arena* arena = arenas_.back().get();
  arena_table_.set(arena->owner, arena);
  return *arena;
}

std::vector<Arena*> Engine::arena_list() const {
  return ArenaEngine::arena_list(*this);
}

Engine::AllArenasLock::AllArenasLock(const Engine& engine)
    : engine_(engine), registry_(engine.registry_mutex_) {
  by_stream_.reserve(engine.arenas_.size());
  for (const auto& a : engine.arenas_) {
    a->mutex.lock();
    by_stream_.push_back(a.get());
  }
  // A stream's default arena first, then its private pools' arenas by creation.
  std::sort(by_stream_.begin(), by_stream_.end(), [](const Arena* x, const Arena* y) {
    return x->stream != y->stream ? x->stream < y->stream : x->order < y->order;
  });
  // A parked block is free memory that every view, count and ladder step sees pooled.
  for (Arena* a : by_stream_) {
    if (a->parked != nullptr) const_cast<Engine&>(engine).unpark(*a);
    flush_taken(*a);
  }
}

Engine::AllArenasLock::~AllArenasLock() {
  for (const auto& a : engine_.arenas_)
    a->mutex.unlock();
}

NodeRecycler::~NodeRecycler() {
  while (free_ != nullptr) {
    FreeNode* n = free_;
    free_ = n->next;
    ::operator delete(n, storage_alignment(node_align_));
  }
}

// The first node fixes the size this recycler serves (take()'s inline path for the rest).
void* NodeRecycler::take_new(std::size_t bytes, std::size_t align) {
  if (node_bytes_ == 0) {
    node_bytes_ = node_size(bytes);
    node_align_ = node_alignment(align);
  }
  if (free_ != nullptr && node_size(bytes) == node_bytes_ && node_alignment(align) == node_align_) {
    FreeNode* n = free_;
    free_ = n->next;
    return n;
  }
  return ::operator new(cache_lines(node_size(bytes)), storage_alignment(node_alignment(align)));
}

void NodeRecycler::give_back_other(void* node, std::size_t bytes, std::size_t align) {
  if (node_size(bytes) != node_bytes_ || node_alignment(align) != node_align_) {
    ::operator delete(node, storage_alignment(node_alignment(align)));
    return;
  }
  auto* n = static_cast<FreeNode*>(node);
  n->next = free_;
  free_ = n;
}

// ---------------------------------------------------------------------------------------
// Uncached mode: every malloc is a device allocation, every free a device free.

DevicePtr Engine::malloc_uncached(std::size_t size) {
  const DevicePtr ptr = driver_.allocate(size);
  if (ptr == 0) {
    const MemInfo info = driver_.mem_info();
    throw OutOfMemoryError("CUDA out of memory. Tried to allocate " + format_size(size) +
                               " (uncached mode) on device " + std::to_string(device()) +
                               ", which has " + format_size(info.free_bytes) + " free of " +
                               format_size(info.total_bytes) + ".",
                           device(), size);
  }
  Lock lock(uncached_mutex_);
  uncached_.emplace(ptr, size);
  return ptr;
}

void Engine::free_uncached(DevicePtr ptr) {
  std::size_t size;
  {
    Lock lock(uncached_mutex_);
    const auto it = uncached_.find(ptr);
    if (it == uncached_.end()) throw InvalidPointerError(pointer_error("free", ptr, device()), ptr);
    size = it->second;
    uncached_.erase(it);
  }
  driver_.free(ptr, size);
}

}  // namespace ccalloc::core
