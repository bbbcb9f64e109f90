// The `ccalloc` preset's policy. Model, ladder and invariants: stitch_engine.hpp.
#include "core/stitch_engine.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>

#include "ccalloc/sim.hpp"
#include "core/arena_cache.hpp"
#include "core/common.hpp"
#include "core/format.hpp"
#include "core/rounding.hpp"

namespace ccalloc {

// Drivers that cannot map part of a handle, or one handle twice, cannot serve this policy.
void Driver::map_range(DevicePtr va, std::size_t bytes, PhysicalHandle handle, std::size_t offset) {
  throw DriverError("ccalloc: " + name() + " cannot map part of a physical allocation (handle " +
                    std::to_string(handle) + ", offset " + std::to_string(offset) + ", " +
                    std::to_string(bytes) + " bytes at " + std::to_string(va) +
                    "); use the `pytorch` preset with this driver");
}

}  // namespace ccalloc

namespace ccalloc::core {
namespace {

std::size_t align_up(std::size_t v, std::size_t a) {
  return (v + a - 1) / a * a;
}

std::size_t align_down(std::size_t v, std::size_t a) {
  return v / a * a;
}

// See grow(): new memory is created in handles of at most this many pieces (64 MiB of 2 MiB),
// and of at most 1/kHandleLimitDivisor of the memory limit, but never capped below
// kMinHandleCap pieces.
constexpr std::size_t kMaxHandlePieces = 32;
constexpr std::size_t kHandleLimitDivisor = 512;
constexpr std::size_t kMinHandleCap = 2;

// See grow(): once a stream has handed out its large range's bytes again since the large
// pool last created memory, a growth creates beyond what it lacks at most this fraction of
// the reserved bytes (1/64, under 1.6 %), when that is less than the chunk.
constexpr std::size_t kSettledExtraDivisor = 64;

// Rounded requests of at most this many bytes go to the small pool, the rest to the large
// pool (PyTorch splits its pools at 1 MiB). The small pool grows a page (one piece) at a
// time, each growth a creation and a mapping, and the two pools reach their peaks at
// different times; a block in a large range costs neither and is packed as expandable
// segments pack it, but keeps the large handle under it from being lent. The measurements
// behind 256 KiB are in docs/ccalloc-policy.md (rule 1); the viewer reads the same rule.
constexpr std::size_t kSmallPoolMax = kStitchSmallSize;

// Bounces of one page between the pools (end_island_if_free) after which the small pool
// keeps it. On the seventeen recordings and 240 generated workloads, keeping it from the
// third on changes no peak; from the first, one generated server's.
constexpr std::size_t kIslandBounces = 3;

}  // namespace

StitchEngine::StitchEngine(Driver& driver, Config config)
    : driver_(driver), config_(std::move(config)), uid_(next_engine_uid()), event_pool_(driver) {
  const char* check = std::getenv("CCALLOC_CHECK_INVARIANTS");
  check_invariants_ = check != nullptr && std::strcmp(check, "1") == 0;
  capacity_ = driver_.mem_info().total_bytes;
  page_ = driver_.vm_granularity();
  // Dead pages use address space until empty_cache or the OOM ladder unmaps them, so a
  // space reserves twice the device; a full space is followed by a new one.
  space_pages_ = std::max<std::size_t>(1, 2 * (capacity_ / page_ + 1));
  chunk_pieces_ = std::max<std::size_t>(1, config_.large_segment_size / page_);
  stats_.max_split_size = -1;
  set_memory_fraction(config_.per_process_memory_fraction);
}

StitchEngine::~StitchEngine() {
  const AllArenasLock all(*this);
  Lock device(device_mutex_);
  try {
    for (Arena* arena : all.arenas()) {
      all.held(*arena);
      for (const PendingEvent& p : arena->pending)
        driver_.destroy_event(p.event);
      for (const Fence& f : arena->fences)
        driver_.destroy_event(f.event);
      for (const auto& spaces : arena->spaces) {
        for (const auto& s : spaces) {
          for (const auto& [first, m] : s->mappings)
            driver_.unmap(page_va(*s, first), m.pages * page_);
          driver_.free_address_range(s->base, s->reserved_pages * page_);
          for (Block* b = s->first; b != nullptr;) {
            Block* next = b->next;
            delete_block(*arena, b);
            b = next;
          }
        }
      }
    }
    for (const auto& [id, h] : handles_)
      driver_.release_physical(id, h->live_at.size() * page_);
  } catch (const Error&) {
    // A destructor cannot report a failing device; the memory is lost to this process.
  }
}

// ---------------------------------------------------------------------------------------
// malloc, free, record_stream

DevicePtr StitchEngine::malloc(std::size_t size, StreamId stream) {
  if (size == 0) return 0;
  if (size >= kOneExabyte) {
    throw OutOfMemoryError("CUDA out of memory. Tried to allocate more than 1EB memory.",
                           driver_.device(), size);
  }
  const Origin stack =
      capture_on_malloc_.load(std::memory_order_relaxed) ? capture() : Origin{};
  // During a capture events may be neither recorded nor queried: pending frees wait.
  if ((pending_events_.load(std::memory_order_relaxed) |
       deferred_frees_.load(std::memory_order_relaxed)) != 0 &&
      !capturing()) [[unlikely]] {
    catch_up_events();
  }
  Arena& arena = arena_for(stream);
  std::unique_lock lock(arena.mutex);  // moved into malloc_slow
  arena.mutex.assert_held();
  const std::size_t rounded = round_size(size, config_);  // under the lock: see reconfigure()
  const bool small = rounded <= kSmallPoolMax;
  Pool& pool = arena.pool(small);
  auto pos = pool.lower_bound(BySizeThenAddress::Key{rounded, 0});
  // A large request lands where it would if the small pool kept no island.
  if (!small && arena.keeps_island && !kept_island_stays(arena, pos, rounded)) [[unlikely]] {
    return_kept_islands(arena);
    pos = pool.lower_bound(BySizeThenAddress::Key{rounded, 0});
  }
  if (pos == pool.end()) {
    // An island (grow()'s first step for the small pool) needs only the stream's lock.
    Block* island = small ? take_island(arena) : nullptr;
    if (island == nullptr) {
      return malloc_slow(arena, std::move(lock), size, rounded, small, stack);
    }
    pos = pool.find(island);
  }
  const DevicePtr ptr = hand_out(arena, pos, rounded, size, stack);
  const bool debt = arena.in_debt;
  lock.unlock();
  if (debt) [[unlikely]] settle_peak_debts();
  after_operation();
  return ptr;
}

// Growth needs only the stream's own arena and the device lock. The GC and the OOM ladder
// act on every stream: they run under every lock, taken afresh (lock order), so the pools
// are searched again first, as another thread may have freed into them meanwhile.
DevicePtr StitchEngine::malloc_slow(Arena& arena, std::unique_lock<ArenaMutex> lock,
                                    std::size_t size, std::size_t rounded, bool small,
                                    const Origin& stack) {
  arena.mutex.assert_held();
  // The mappings this malloc makes, and the unmappings of its OOM ladder, are traced with
  // its stack (unless it runs within another operation, whose stack they take).
  std::optional<OperationContext> operation;
  if (!OperationContext::active()) operation.emplace(stack);
  Block* block = nullptr;
  Grow g = Grow::kDone;
  // Nothing goes back to the device while a capture is underway: no GC, no waiting for
  // events, no release of the cache (the ladder goes from the callbacks to the error).
  const bool capture = capturing();
  {
    Lock device(device_mutex_);
    // malloc() found no island under the same lock.
    g = grow(arena, small, rounded, /*gc_allowed=*/!capture, &block, /*try_island=*/false);
  }
  if (g == Grow::kDone) {
    const DevicePtr ptr = hand_out(arena, arena.pool(small).find(block), rounded, size, stack);
    const bool debt = arena.in_debt;
    lock.unlock();
    if (debt) settle_peak_debts();
    after_operation();
    return ptr;
  }
  lock.unlock();

  auto all = std::make_unique<AllArenasLock>(*this);
  Lock device(device_mutex_);
  all->held(arena);
  // The count is stable while any arena lock is held (begin_capture takes them all).
  const bool capture_now = capturing();
  bool gc_done = capture_now, callbacks_done = false, synchronized = capture_now,
       released = capture_now, others_released = capture_now;
  // The first round answers grow()'s result above; later ones search and grow again.
  bool retry = false;
  for (;; retry = true) {
    if (retry) {
      block = find_free(arena, small, rounded);
      g = block != nullptr ? Grow::kDone
                           : grow(arena, small, rounded, !gc_done, &block, true, all.get());
    } else if ((block = find_free(arena, small, rounded)) != nullptr) {
      g = Grow::kDone;  // freed by another thread meanwhile
    }
    if (g == Grow::kDone) break;
    if (g == Grow::kNeedsGc) {
      if (!gc_done) release_cache(*all);  // (gc_done from the start during a capture)
      gc_done = true;
      continue;
    }
    if (!callbacks_done && has_free_memory_callbacks_.load(std::memory_order_relaxed)) {
      callbacks_done = true;
      std::vector<Allocator::FreeMemoryCallback> callbacks;
      {
        Lock observers(observers_mutex_);
        callbacks = free_memory_callbacks_;
      }
      device.unlock();
      all.reset();
      bool freed = false;
      for (const auto& callback : callbacks)
        freed = callback() || freed;
      catch_up_events();
      all = std::make_unique<AllArenasLock>(*this);
      device.lock();
      all->held(arena);
      if (capturing()) gc_done = synchronized = released = others_released = true;
      if (freed) continue;
    }
    if (!synchronized && (pending_events_.load(std::memory_order_relaxed) > 0 ||
                          deferred_frees_.load(std::memory_order_relaxed) > 0)) {
      synchronized = true;
      synchronize_events(*all);
      continue;
    }
    if (!released) {
      released = true;
      ++stats_.num_alloc_retries;
      release_cache(*all);
      continue;
    }
    // What the engines beside this one hold comes last, as PyTorch's ladder ends: their
    // cached memory back to the device, then a free block of a use_on_oom pool. An OOM they
    // avert is no OOM: not counted, traced or observed.
    if (oom_fallbacks_.serve || (oom_fallbacks_.release_cache && !others_released)) {
      device.unlock();
      all.reset();
      // Released memory is searched and grown into again before anything is served.
      const bool freed =
          !others_released && oom_fallbacks_.release_cache && oom_fallbacks_.release_cache();
      others_released = true;
      if (!freed && oom_fallbacks_.serve) {
        if (const DevicePtr elsewhere = oom_fallbacks_.serve(size, arena.stream)) {
          after_operation();
          return elsewhere;
        }
      }
      all = std::make_unique<AllArenasLock>(*this);
      device.lock();
      all->held(arena);
      if (freed) continue;
    }
    const OomReport report = prepare_oom(*all, arena, size, rounded, small, stack);
    device.unlock();
    all.reset();
    raise_oom(report);
  }
  const DevicePtr ptr = hand_out(arena, arena.pool(small).find(block), rounded, size, stack);
  settle_peak_debts(*all);
  device.unlock();
  all.reset();
  after_operation();
  return ptr;
}

void StitchEngine::free(DevicePtr ptr) {
  if (ptr != 0 && !free_owned(ptr)) throw_not_live("free", ptr);
}

bool StitchEngine::free_owned(DevicePtr ptr) {
  Arena* arena = arena_of(ptr);
  if (arena == nullptr) return false;
  const Origin stack =
      capture_on_free_.load(std::memory_order_relaxed) ? capture() : Origin{};
  Lock lock(arena->mutex);
  Block* b = arena->live.erase(ptr);
  if (b == nullptr) {
    lock.unlock();
    throw_not_live("free", ptr);
  }
  release(*arena, b, stack);
  lock.unlock();
  after_operation();
  return true;
}

// Frees lower the block statistics only: no peak debt to settle.
void StitchEngine::release(Arena& arena, Block* b, const Origin& stack) {
  // Block statistics count a block in its segment's pool (an island's in the large one),
  // as PyTorch's tools rebuild them from the snapshot's segments.
  for_pool_stats(b->space->small, [&](StatType t) {
    arena.mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
    arena.stats.allocation[t].decrease(1);
    arena.stats.allocated_bytes[t].decrease(static_cast<std::int64_t>(b->size));
  });
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

void StitchEngine::record_events(Arena& arena, Block* b) {
  for (const StreamId s : b->stream_uses) {
    const EventId e = event_pool_.get();
    driver_.record_event(e, s);
    arena.pending.push_back(PendingEvent{e, b});
    ++b->event_count;
  }
  const auto n = static_cast<std::int64_t>(b->stream_uses.size());
  arena.pending_events.fetch_add(n, std::memory_order_relaxed);
  pending_events_.fetch_add(n, std::memory_order_relaxed);
  b->stream_uses.clear();
}

void StitchEngine::record_stream(DevicePtr ptr, StreamId stream) {
  if (Arena* arena = arena_of(ptr)) {
    Lock lock(arena->mutex);
    if (Block* b = arena->live.find(ptr)) {
      // Uses on the block's own stream are ordered by the stream itself.
      if (stream != arena->stream &&
          std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end()) {
        b->stream_uses.push_back(stream);
      }
      lock.unlock();
      after_operation();
      return;
    }
  }
  throw_not_live("record_stream", ptr);
}

// A live block's pages are live, and each is covered by the one live mapping of its handle
// (handles are mapped, lent and unmapped whole): the region is those mappings, whole. They
// stay while the block is live, since only handles wholly inside free blocks are lent and
// only mappings with no live block are unmapped.
ipc::SharedRegion StitchEngine::shared_region(DevicePtr ptr) const {
  Arena* arena = arena_of(ptr);
  if (arena == nullptr) throw_not_live("shared_region", ptr);
  Lock lock(arena->mutex);
  const Block* b = arena->live.find(ptr);
  if (b == nullptr) throw_not_live("shared_region", ptr);
  const Space& s = *b->space;
  const std::size_t p0 = (b->ptr - s.base) / page_;
  const std::size_t p1 = (b->end() - s.base + page_ - 1) / page_;
  ipc::SharedRegion r;
  r.kind = ipc::RegionKind::kHandles;
  r.allocation = b->ptr;
  r.allocation_size = b->size;
  Lock device(device_mutex_);
  auto it = s.mapping_at(p0);
  if (it == s.mappings.end()) throw_not_live("shared_region", ptr);
  r.base = page_va(s, it->first);
  for (; it != s.mappings.end() && it->first < p1; ++it) {
    const Mapping& m = it->second;
    if (m.first_piece != 0 || m.pages != m.handle->live_at.size() ||
        m.handle->live_at[0] != page_va(s, it->first)) {
      throw InvariantError("ccalloc: the live allocation " + hex_address(ptr) +
                           " lies on the mapping at " + hex_address(page_va(s, it->first)) +
                           ", which is not its handle's live one");
    }
    r.pages.push_back(m.handle->id);
    r.page_sizes.push_back(m.pages * page_);
    r.size += m.pages * page_;
  }
  if (r.base + r.size < b->end()) throw_not_live("shared_region", ptr);
  return r;
}

void StitchEngine::throw_not_live(const char* what, DevicePtr ptr) const {
  throw InvalidPointerError(pointer_error(what, ptr, device()), ptr);
}

// ---------------------------------------------------------------------------------------
// Blocks

StitchEngine::Arena& StitchEngine::arena_for(StreamId stream) {
  if (Arena* cached = ThreadArenaCache<Arena>::find(uid_, stream)) return *cached;
  Arena* a = nullptr;
  {
    Lock lock(registry_mutex_);
    const auto it = arena_by_stream_.find(stream);
    if (it != arena_by_stream_.end()) {
      a = it->second;
    } else {
      const std::size_t index = arenas_.size();
      if (index + 1 > SegmentMap::kMaxOwner) {
        throw Error("ccalloc: too many streams on device " + std::to_string(device()) + " (" +
                    std::to_string(index) + ")");
      }
      arenas_.push_back(std::make_unique<Arena>(stream, index));
      a = arenas_.back().get();
      arena_table_.set(a->owner, a);
      arena_count_.store(arenas_.size(), std::memory_order_release);
      arena_by_stream_.emplace(stream, a);
      if (index == 1) begin_sharing();
    }
  }
  ThreadArenaCache<Arena>::put(uid_, stream, a);
  return *a;
}

std::vector<StitchEngine::Arena*> StitchEngine::arena_list() const {
  Lock lock(registry_mutex_);
  std::vector<Arena*> list;
  list.reserve(arenas_.size());
  for (const auto& a : arenas_)
    list.push_back(a.get());
  return list;
}

StitchEngine::AllArenasLock::AllArenasLock(const StitchEngine& engine) : engine_(engine) {
  engine.registry_mutex_.lock();
  arenas_.reserve(engine.arenas_.size());
  for (const auto& a : engine.arenas_) {
    a->mutex.lock();
    arenas_.push_back(a.get());
  }
}

StitchEngine::AllArenasLock::~AllArenasLock() {
  for (Arena* a : arenas_)
    a->mutex.unlock();
  engine_.registry_mutex_.unlock();
}

// Blocks are recycled by their arena: splits and merges on the hot path do not allocate.
StitchEngine::Block* StitchEngine::new_block(Arena& arena) {
  return new (arena.block_nodes.take(sizeof(Block), alignof(Block))) Block();
}

void StitchEngine::delete_block(Arena& arena, Block* b) {
  b->~Block();
  arena.block_nodes.give_back(b, sizeof(Block), alignof(Block));
}

StitchEngine::Block* StitchEngine::find_free(Arena& arena, bool small, std::size_t size) {
  Pool& pool = arena.pool(small);
  const auto it = pool.lower_bound(BySizeThenAddress::Key{size, 0});
  return it == pool.end() ? nullptr : *it;
}

// Cuts the first `size` bytes of b into a new block of b's kind, linked before it.
StitchEngine::Block* StitchEngine::split_off_front(Arena& arena, Block* b, std::size_t size) {
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
DevicePtr StitchEngine::hand_out(Arena& arena, Pool::iterator pos, std::size_t size,
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
  block->kind = Block::Kind::kAllocated;
  block->requested = requested;
  if (!small) {
    arena.large_served += block->size;
    arena.largest_large = std::max(arena.largest_large, block->size);
  }
  block->stack = stack;
  arena.live.insert(block->ptr, block);
  DeviceStats& st = arena.stats;
  PeakBaselines& debt = arena.debts;  // rises beyond the baselines: core/peak_ledger.hpp
  const auto bytes = static_cast<std::int64_t>(block->size);
  for_pool_stats(block->space->small, [&](StatType t) {
    arena.mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
    ledger_increase(st.allocation[t], debt.allocation[t], arena.in_debt, 1);
    ledger_increase(st.allocated_bytes[t], debt.allocated_bytes[t], arena.in_debt, bytes);
    ledger_increase(st.active[t], debt.active[t], arena.in_debt, 1);
    ledger_increase(st.active_bytes[t], debt.active_bytes[t], arena.in_debt, bytes);
    ledger_increase(st.requested_bytes[t], debt.requested_bytes[t], arena.in_debt,
                    static_cast<std::int64_t>(requested));
  });
  record_trace(TraceAction::kAlloc, block->ptr, requested, arena.stream, stack);
  return block->ptr;
}

// Returns a block with no outstanding uses to its pool, merged with free neighbours.
void StitchEngine::free_block(Arena& arena, Block* b) {
  for_pool_stats(b->space->small, [&](StatType t) {
    arena.mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
    arena.stats.active[t].decrease(1);
    arena.stats.active_bytes[t].decrease(static_cast<std::int64_t>(b->size));
    arena.stats.requested_bytes[t].decrease(static_cast<std::int64_t>(b->requested));
  });
  record_trace(TraceAction::kFreeCompleted, b->ptr, b->requested, arena.stream, b->stack);
  b->kind = Block::Kind::kFree;
  b->stack = {};
  if (sharing_.load(std::memory_order_relaxed)) [[unlikely]]
    note_free(arena, *b);
  pool_free(arena, b);
}

StitchEngine::Block* StitchEngine::pool_free(Arena& arena, Block* b, bool keep_island) {
  Space& s = *b->space;
  Pool& pool = arena.pool(b->small);
  const auto joins = [b](const Block* n) {
    return n != nullptr && n->kind == Block::Kind::kFree && n->small == b->small;
  };
  Block* const prev = joins(b->prev) ? b->prev : nullptr;
  Block* const next = joins(b->next) ? b->next : nullptr;
  if (prev == nullptr && next == nullptr) {
    pool.insert(b);
    return keep_island ? b : end_island_if_free(arena, b);
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
  return keep_island ? merged : end_island_if_free(arena, merged);
}

bool StitchEngine::whole_free_island(const Block* b) {
  const auto same_pool = [b](const Block* n) { return n != nullptr && n->small == b->small; };
  return b->in_island() && !same_pool(b->prev) && !same_pool(b->next);
}

StitchEngine::Block* StitchEngine::end_island_if_free(Arena& arena, Block* b) {
  if (!whole_free_island(b)) return b;
  // The small pool keeps it instead while the stream bounces one page between the pools
  // (frees it whole, then takes it back as an island, again and again: a small block freed
  // and allocated in a loop while nothing else of the small pool is free). A bounce costs
  // no memory and no driver call, but several tree operations on each side; kept, the
  // loop hits the cache. It stays the large pool's at the next large request.
  if (arena.island_bounces >= kIslandBounces && arena.pool(true).size() == 1) {
    arena.keeps_island = true;
    return b;
  }
  arena.last_returned_island = b->ptr;
  return island_to_large_pool(arena, b);
}

StitchEngine::Block* StitchEngine::island_to_large_pool(Arena& arena, Block* b) {
  arena.pool(true).erase(b);
  b->small = b->space->small;
  return pool_free(arena, b);  // merged with the large free blocks around it
}

bool StitchEngine::kept_island_stays(Arena& arena, Pool::iterator pos, std::size_t rounded) {
  Pool& large = arena.pool(false);
  Pool& small = arena.pool(true);
  if (pos == large.end() || small.size() != 1) return false;
  const Block* kept = *small.begin();
  if (!whole_free_island(kept)) return false;
  const auto free_large = [](Block* n) {
    return n != nullptr && n->kind == Block::Kind::kFree && !n->small ? n : nullptr;
  };
  const Block* prev = free_large(kept->prev);
  const Block* next = free_large(kept->next);
  // Returned, the island would merge with its free neighbours into one block at `start`.
  const std::size_t merged = kept->size + (prev ? prev->size : 0) + (next ? next->size : 0);
  const DevicePtr start = prev != nullptr ? prev->ptr : kept->ptr;
  auto other = pos;  // the best fit among the blocks the return leaves as they are
  while (other != large.end() && (*other == prev || *other == next))
    ++other;
  const bool merged_wins =
      merged >= rounded &&
      (other == large.end() || BySizeThenAddress{}(BySizeThenAddress::Key{merged, start}, *other));
  if (!merged_wins) return other == pos;
  // The merged block's front is the free neighbour below's: the request lands there when
  // that neighbour is the best fit, and its block is as long when the rest splits off.
  const std::size_t rest = (*pos)->size - rounded;
  return *pos == prev && (rest == 0 || rest >= kMinBlockSize);
}

void StitchEngine::return_kept_islands(Arena& arena) {
  if (!arena.keeps_island) return;
  arena.keeps_island = false;
  arena.island_bounces = 0;
  Pool& small = arena.pool(true);
  for (auto it = small.begin(); it != small.end();) {
    Block* b = *it;
    ++it;
    if (whole_free_island(b)) island_to_large_pool(arena, b);
  }
}

// Turns the page-aligned [lo, hi), covered by free and void blocks starting with `from`
// (which contains lo), into one void block; the free parts outside it stay in the pool.
void StitchEngine::make_void(Arena& arena, Space& s, Block* from, DevicePtr lo, DevicePtr hi) {
  Block* first_void = nullptr;
  for (Block* b = from; b != nullptr && b->ptr < hi;) {
    Block* next = b->next;
    if (b->kind == Block::Kind::kFree) {
      Pool& pool = arena.pool(b->small);
      pool.erase(b);
      if (b->ptr < lo) pool.insert(split_off_front(arena, b, lo - b->ptr));
      if (b->end() > hi) {
        Block* mid = split_off_front(arena, b, hi - b->ptr);
        pool.insert(b);
        b = mid;
      }
      b->kind = Block::Kind::kVoid;
      b->small = s.small;
    }
    if (first_void == nullptr) first_void = b;
    b = next;
  }
  if (first_void != nullptr) merge_void_around(arena, s, first_void);
}

void StitchEngine::merge_void_around(Arena& arena, Space& s, Block* b) {
  while (b->prev != nullptr && b->prev->kind == Block::Kind::kVoid) {
    Block* p = b->prev;
    b->ptr = p->ptr;
    b->size += p->size;
    b->prev = p->prev;
    if (b->prev != nullptr) {
      b->prev->next = b;
    } else {
      s.first = b;
    }
    delete_block(arena, p);
  }
  while (b->next != nullptr && b->next->kind == Block::Kind::kVoid) {
    Block* n = b->next;
    b->size += n->size;
    b->next = n->next;
    if (b->next != nullptr) {
      b->next->prev = b;
    } else {
      s.last = b;
    }
    delete_block(arena, n);
  }
}

// ---------------------------------------------------------------------------------------
// Growth: spare pieces, then lent pages, then new memory

StitchEngine::Block* StitchEngine::revive_small_piece(Arena& arena) {
  // The candidates as growth would lend them: smallest large free block first, then by
  // address; the large space's last block included (it is not the growing space's tail).
  for (Block* b : arena.pool(false)) {
    Handle* h = nullptr;
    DevicePtr from = 0, at = 0;
    Space* small_space = nullptr;
    find_whole_handle(*b, [&](DevicePtr va, Handle* candidate) {
      arena.mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
      device_mutex_.assert_held();
      if (!candidate->small || candidate->live_at.size() != 1 || candidate->mappings[0] < 2) {
        return false;
      }
      // The small page that still maps it, dead there.
      for (const auto& space : arena.spaces[1]) {
        for (const auto& [first, m] : space->mappings) {
          if (m.handle != candidate) continue;
          h = candidate;
          from = va;
          at = page_va(*space, first);
          small_space = space.get();
          return true;
        }
      }
      return false;
    });
    if (h == nullptr) continue;
    const std::uint64_t stamp = stamp_of(*b->space, from, 1);  // its latest uses are there
    make_void(arena, *b->space, b, from, from + page_);  // b may be split or absorbed
    Block* v = small_space->first;
    while (v->end() <= at)
      v = v->next;
    // v is the void block holding the page: split the page out and free it.
    if (v->ptr < at) split_off_front(arena, v, at - v->ptr);
    if (v->end() > at + page_) v = split_off_front(arena, v, page_);
    v->kind = Block::Kind::kFree;
    h->live_at[0] = at;
    Page& revived = small_space->pages[(at - small_space->base) / page_];
    revived.freed = std::max(revived.freed, stamp);
    move_handle_stats(*h, true);
    return pool_free(arena, v);
  }
  return nullptr;
}

// Islands: the small pool grows into a whole free page of the large pool's free blocks in
// place, with no driver call (see grow()).
StitchEngine::Block* StitchEngine::take_island(Arena& arena) {
  // The smallest large free block first (as lending goes); its first whole page. A space's
  // free tail, which the next large growth extends, only once the stream has settled and
  // the tail would still hold the largest block its large pool has handed out.
  Pool& large = arena.pool(false);
  for (Block* b : large) {
    if (b->next == nullptr && (b->size < arena.largest_large + page_ || !settled(arena))) {
      continue;
    }
    const DevicePtr lo = align_up(b->ptr, page_);
    if (lo + page_ > b->end()) continue;
    large.erase(b);  // returns before the loop goes on
    Block* island = b;
    if (lo > b->ptr) large.insert(split_off_front(arena, b, lo - b->ptr));
    if (island->size > page_) {
      Block* page = split_off_front(arena, island, page_);
      large.insert(island);
      island = page;
    }
    island->small = true;
    if (island->ptr == arena.last_returned_island) {
      ++arena.island_bounces;
    } else {
      arena.island_bounces = 0;
    }
    // Merged with the free end of an island just below; handed out at once.
    return pool_free(arena, island, /*keep_island=*/true);
  }
  return nullptr;
}

bool StitchEngine::settled(const Arena& arena) const {
  std::size_t frontier = 0;  // bytes of the stream's large spaces below their frontiers
  for (const auto& space : arena.spaces[0])
    frontier += space->pages.size() * page_;
  return arena.large_served > frontier;
}

// A handle moves and is released only whole: a live block anywhere in it keeps all its
// pieces where they are, neither lendable nor releasable. 64 MiB handles keep creations and
// mappings few on a large device; where the limit is small the pieces they strand are what
// runs it out of memory, so a handle is also at most 1/512 of the limit (a 16 GiB limit
// gets 32 MiB handles, 2 GiB and less two pieces).
std::size_t StitchEngine::handle_cap() const {
  return std::clamp<std::size_t>(limit() / kHandleLimitDivisor / page_, kMinHandleCap,
                                 kMaxHandlePieces);
}

std::size_t StitchEngine::least_large_growth(const Arena& arena) const {
  if (!settled(arena)) return chunk_pieces_;
  const std::size_t reserved = reserved_;
  return std::clamp<std::size_t>(reserved / kSettledExtraDivisor / page_, 1, chunk_pieces_);
}

StitchEngine::Space& StitchEngine::new_space(Arena& arena, bool small) {
  auto s = std::make_unique<Space>();
  s->arena = &arena;
  s->small = small;
  s->reserved_pages = space_pages_;
  s->base = driver_.reserve_address_range(space_pages_ * page_);
  owners_.assign(s->base, space_pages_ * page_, arena.owner);  // free finds the arena here
  arena.spaces[small ? 1 : 0].push_back(std::move(s));
  return *arena.spaces[small ? 1 : 0].back();
}

StitchEngine::Grow StitchEngine::grow(Arena& arena, bool small, std::size_t size, bool gc_allowed,
                                      Block** out, bool try_island, const AllArenasLock* all) {
  if (!small && arena.keeps_island) {
    return_kept_islands(arena);
    if (Block* b = find_free(arena, false, size)) {
      *out = b;
      return Grow::kDone;
    }
  }
  if (small) {
    if (Block* island = try_island ? take_island(arena) : nullptr) {
      *out = island;
      return Grow::kDone;
    }
    if (Block* revived = revive_small_piece(arena)) {
      *out = revived;
      return Grow::kDone;
    }
  }
  auto& spaces = arena.spaces[small ? 1 : 0];
  Space* s = spaces.empty() ? nullptr : spaces.back().get();
  Block* tail = s != nullptr && s->last != nullptr && s->last->kind == Block::Kind::kFree &&
                        s->last->small == small
                    ? s->last
                    : nullptr;
  bool fresh = s == nullptr;
  std::size_t pages = 0;

  // Plan without changing anything, so that running out of memory leaves all as it was.
  // CUDA maps a handle only whole, so the frontier receives whole handles: spare ones, then
  // lent ones, then new ones. Whole handles may pass what the request lacks; the rest
  // extends the new free block.
  std::vector<Handle*> from_spare;
  std::vector<Lend> lends;
  std::size_t have = 0;  // pages of the spare and lent handles
  const auto pieces_of = [](const Handle* h) { return h->live_at.size(); };
  const auto plan = [&] {
    arena.mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
    device_mutex_.assert_held();
    from_spare.clear();
    lends.clear();
    have = 0;
    for (auto it = spare_.begin(); it != spare_.end() && have < pages; ++it) {
      if (it->second != 0) continue;  // a handle is spare whole: name it once
      Handle* h = handles_.at(it->first).get();
      from_spare.push_back(h);
      have += pieces_of(h);
    }
    if (have >= pages) return;
    // Handles live wholly inside the whole pages of one free block of the stream: any
    // handle of the pool's own free blocks; from the other pool, the large pool takes any
    // (a small page freed whole joins a large range) and the small pool only the one-piece
    // handles that its own growth created (they come back; a large handle of up to 64 MiB
    // would sit in a small space behind blocks of at most 256 KiB).
    std::vector<Lend> candidates;
    for (const Pool& pool : arena.pools) {
      const bool other = &pool != &arena.pool(small);
      for (Block* b : pool) {
        if (b == tail || b->in_island()) continue;
        find_whole_handle(*b, [&](DevicePtr va, Handle* h) {
          if (!other || !small || (h->small && pieces_of(h) == 1)) {
            candidates.push_back(Lend{h, b, va});
          }
          return false;
        });
      }
    }
    // The smallest free blocks are the least useful to keep whole.
    std::sort(candidates.begin(), candidates.end(), [](const Lend& x, const Lend& y) {
      if (x.block != y.block) return BySizeThenAddress{}(x.block, y.block);
      return x.lo < y.lo;
    });
    for (const Lend& l : candidates) {
      if (have >= pages) break;
      lends.push_back(l);
      have += pieces_of(l.handle);
    }
  };
  // Other streams' arenas whose free pages this growth may take (plan_borrow), locked until
  // it returns.
  std::vector<std::unique_lock<ArenaMutex>> donors;
  std::size_t lacking = 0, created = 0;
  for (;;) {
    if (fresh) tail = nullptr;
    pages = align_up(size - (tail != nullptr ? tail->size : 0), page_) / page_;
    if (fresh && pages > space_pages_) return Grow::kOutOfMemory;  // more than twice the device
    if (!fresh && s->pages.size() + pages > s->reserved_pages) {
      fresh = true;
      continue;
    }
    plan();
    lacking = have < pages ? pages - have : 0;
    // A move between the pools is made only where the moves spare creating memory
    // altogether: when memory is created anyway, the other pool's pages stay where they are
    // (each move costs a map, and the pool that gave them would create them again).
    if (lacking > 0) {
      std::erase_if(lends, [&](const Lend& l) {
        if (l.block->space->small == small) return false;
        have -= pieces_of(l.handle);
        return true;
      });
      lacking = pages - have;
    }
    // Then other streams' free pages whose uses are all done, where they spare creating.
    if (lacking > 0) {
      const std::size_t least = small ? 0 : least_large_growth(arena);
      have += plan_borrow(arena, small, lacking, least, all, donors, lends);
      lacking = have < pages ? pages - have : 0;
    }
    created = 0;
    if (lacking > 0) {
      // Large growth creates at least a chunk (large_segment_size), so that creations and
      // mappings stay as few as expandable segments' (one per 20 MiB page); the small pool
      // and a chunk that would not fit the limit create exactly what is lacking. A stream
      // that has handed out its large range's bytes again since the pool's last creation
      // has settled: growth is rare from then on and each one may set the peak, so what
      // it creates beyond its need is also held to 1/64 of the reserved bytes (which on
      // a device's worth of memory is more than the chunk and changes nothing).
      const std::size_t chunk =
          small ? lacking : std::max(lacking, least_large_growth(arena));
      for (const std::size_t tried : {chunk, lacking}) {
        if (tried * page_ > limit() || held() > limit() - tried * page_) continue;
        created = tried;
        break;
      }
    }
    const std::size_t room = fresh ? space_pages_ : s->reserved_pages - s->pages.size();
    if (have + std::max(created, lacking) <= room || fresh) break;
    fresh = true;  // the whole handles would pass the reservation: start a new space
  }
  if (lacking > 0) {
    const std::size_t bytes = lacking * page_;
    if (gc_allowed && config_.garbage_collection_threshold > 0.0 &&
        static_cast<double>(held() + bytes) >
            config_.garbage_collection_threshold * static_cast<double>(limit())) {
      return Grow::kNeedsGc;
    }
    if (created == 0) return Grow::kOutOfMemory;
  }
  if (have + created > (fresh ? space_pages_ : s->reserved_pages - s->pages.size())) {
    return Grow::kOutOfMemory;
  }
  // New memory in handles of at most handle_cap() pieces: large enough that creating and
  // mapping stay cheap, small enough that the free pages of a large freed block hold whole
  // handles that can be lent, and that a handle partly in use strands little of the limit.
  const std::size_t cap = handle_cap();
  std::vector<std::size_t> sizes;
  std::vector<PhysicalHandle> ids;
  const auto create_all = [&](std::size_t n) {
    sizes.clear();
    ids.clear();
    for (std::size_t left = n; left > 0;) {
      const std::size_t k = std::min(left, cap);
      const PhysicalHandle id = driver_.create_physical(k * page_);
      if (id == 0) {
        for (std::size_t j = 0; j < ids.size(); ++j)
          driver_.release_physical(ids[j], sizes[j] * page_);
        sizes.clear();
        ids.clear();
        return false;
      }
      sizes.push_back(k);
      ids.push_back(id);
      left -= k;
    }
    return true;
  };
  if (created > 0 && !create_all(created)) {
    if (created == lacking || !create_all(lacking)) return Grow::kOutOfMemory;
    created = lacking;
  }

  // Commit.
  if (fresh) s = &new_space(arena, small);
  std::vector<Handle*> order;  // as mapped at the frontier
  // The stamp each one's pages take there (Arena::epoch): a handle moved within the
  // stream keeps its pages' latest; one with its uses done (spare, another stream's, new)
  // comes with none.
  std::vector<std::uint64_t> stamps;
  for (Handle* h : from_spare) {
    for (std::uint32_t i = 0; i < pieces_of(h); ++i)
      spare_.erase({h->id, i});
    order.push_back(h);
    stamps.push_back(0);
  }
  // In address order, so that each lend's block still starts at or below its range:
  // make_void keeps the block object for the free part above the voided range.
  std::sort(lends.begin(), lends.end(), [](const Lend& x, const Lend& y) { return x.lo < y.lo; });
  for (const Lend& l : lends) {
    Arena& owner = *l.block->space->arena;
    owner.mutex.assert_held();  // this arena's, or a donor's (plan_borrow)
    const std::size_t n = pieces_of(l.handle);
    stamps.push_back(&owner == &arena ? stamp_of(*l.block->space, l.lo, n) : 0);
    if (&owner != &arena) {
      ++borrowed_handles_;
      borrowed_pieces_ += n;
    }
    make_void(owner, *l.block->space, l.block, l.lo, l.lo + n * page_);
    order.push_back(l.handle);
  }
  for (std::size_t j = 0; j < ids.size(); ++j) {
    auto h = std::make_unique<Handle>();
    h->id = ids[j];
    h->small = small;
    h->counted_small = small;
    h->live_at.assign(sizes[j], 0);
    h->mappings.assign(sizes[j], 0);
    order.push_back(h.get());
    stamps.push_back(0);
    handles_.emplace(ids[j], std::move(h));
  }
  if (created > 0) {
    if (!small) arena.large_served = 0;
    add_reserved(small, static_cast<std::int64_t>(created * page_));
    stats_.num_device_alloc += ids.size();
    add_segments(small, static_cast<std::int64_t>(ids.size()));
  }
  // One map_range per handle, each whole.
  const std::size_t start = s->pages.size();
  const std::size_t mapped = have + created;
  s->pages.resize(start + mapped);
  std::size_t k = 0;
  for (std::size_t j = 0; j < order.size(); ++j) {
    Handle* h = order[j];
    const std::size_t len = pieces_of(h);
    const DevicePtr va = page_va(*s, start + k);
    driver_.map_range(va, len * page_, h->id, 0);
    s->mappings.emplace(start + k, Mapping{len, h, 0, OperationContext::current()});
    move_handle_stats(*h, small);
    for (std::uint32_t i = 0; i < len; ++i) {
      h->live_at[i] = va + i * page_;
      ++h->mappings[i];
      s->pages[start + k + i] = Page{h, i, stamps[j]};
    }
    record_trace(TraceAction::kSegmentMap, va, len * page_, arena.stream,
                 OperationContext::current());
    k += len;
  }
  Pool& pool = arena.pool(small);
  if (tail != nullptr) {
    pool.erase(tail);
    tail->size += mapped * page_;
    pool.insert(tail);
    *out = tail;
  } else {
    Block* b = new_block(arena);
    b->ptr = page_va(*s, start);
    b->size = mapped * page_;
    b->space = s;
    b->small = small;
    b->prev = s->last;
    if (s->last != nullptr) {
      s->last->next = b;
    } else {
      s->first = b;
    }
    s->last = b;
    pool.insert(b);
    *out = b;
  }
  return Grow::kDone;
}

void StitchEngine::add_reserved(bool small, std::int64_t bytes) {
  reserved_ = static_cast<std::size_t>(static_cast<std::int64_t>(reserved_) + bytes);
  add_pool_stat(stats_.reserved_bytes, small, bytes);
  if (device_reserved_ != nullptr) device_reserved_->add(small, bytes);
}

void StitchEngine::move_handle_stats(Handle& h, bool to_small) {
  if (h.counted_small == to_small) return;
  h.counted_small = to_small;
  const auto bytes = static_cast<std::int64_t>(h.live_at.size() * page_);
  move_pool_stat(stats_.reserved_bytes, to_small, bytes);
  move_pool_stat(stats_.segment, to_small, 1);
  if (device_reserved_ != nullptr) device_reserved_->move(to_small, bytes, 1);
}

void StitchEngine::add_segments(bool small, std::int64_t n) {
  add_pool_stat(stats_.segment, small, n);
  if (device_reserved_ != nullptr) device_reserved_->add_segments(small, n);
}

// ---------------------------------------------------------------------------------------
// Events, releasing the cache

// A pending block is in its own arena's list: completing it needs only that arena's lock.
void StitchEngine::process_events(Arena& arena) {
  if (capturing()) return;  // as insert_deferred_events
  std::vector<PendingEvent>& pending = arena.pending;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending.size(); ++i) {
    const PendingEvent p = pending[i];
    if (!driver_.query_event(p.event)) {
      pending[kept++] = p;
      continue;
    }
    event_pool_.put(p.event);
    if (--p.block->event_count == 0) free_block(arena, p.block);
  }
  const auto completed = static_cast<std::int64_t>(pending.size() - kept);
  pending.resize(kept);
  arena.pending_events.fetch_sub(completed, std::memory_order_relaxed);
  pending_events_.fetch_sub(completed, std::memory_order_relaxed);
}

void StitchEngine::insert_deferred_events(Arena& arena) {
  // A capture may have begun since the caller looked; under the arena's lock it cannot.
  if (arena.deferred.empty() || capturing()) return;
  const auto n = static_cast<std::int64_t>(arena.deferred.size());
  for (Block* b : arena.deferred)
    record_events(arena, b);
  arena.deferred.clear();
  deferred_frees_.fetch_sub(n, std::memory_order_relaxed);
}

void StitchEngine::begin_capture() {
  const AllArenasLock all(*this);
  captures_underway_.fetch_add(1, std::memory_order_acq_rel);
}

void StitchEngine::end_capture() {
  {
    const AllArenasLock all(*this);
    captures_underway_.fetch_sub(1, std::memory_order_acq_rel);
  }
  // Frees deferred during the capture get their events at the next malloc or empty_cache.
  after_operation();
}

void StitchEngine::catch_up_events() {
  if (deferred_frees_.load(std::memory_order_relaxed) != 0) {
    for (Arena* arena : arena_list()) {
      Lock lock(arena->mutex);
      insert_deferred_events(*arena);
    }
  }
  if (pending_events_.load(std::memory_order_relaxed) > 0) process_events_everywhere();
}

void StitchEngine::process_events_everywhere() {
  for (Arena* arena : arena_list()) {
    if (arena->pending_events.load(std::memory_order_relaxed) == 0) continue;
    Lock lock(arena->mutex);
    process_events(*arena);
  }
}

void StitchEngine::synchronize_events(const AllArenasLock& all) {
  ++stats_.num_sync_all_streams;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    insert_deferred_events(*arena);
    for (const PendingEvent& p : arena->pending) {
      driver_.synchronize_event(p.event);
      event_pool_.put(p.event);
      if (--p.block->event_count == 0) free_block(*arena, p.block);
    }
    const auto n = static_cast<std::int64_t>(arena->pending.size());
    arena->pending.clear();
    arena->pending_events.fetch_sub(n, std::memory_order_relaxed);
    pending_events_.fetch_sub(n, std::memory_order_relaxed);
  }
}

// Unmaps every mapping whose pages are all dead or free, then releases the handles left
// with no live piece and no mapping. Waits for every stream whose pages it unmaps.
void StitchEngine::release_cache(const AllArenasLock& all) {
  synchronize_events(all);
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    return_kept_islands(*arena);
    bool synchronized = false;
    for (auto& spaces : arena->spaces) {
      for (auto it = spaces.begin(); it != spaces.end();) {
        Space& s = **it;
        // Pages touched by an allocated block cannot be unmapped.
        std::vector<bool> busy(s.pages.size(), false);
        for (const Block* b = s.first; b != nullptr; b = b->next) {
          if (b->kind != Block::Kind::kAllocated && b->kind != Block::Kind::kPending) continue;
          for (std::size_t p = (b->ptr - s.base) / page_;
               p < (b->end() - s.base + page_ - 1) / page_; ++p) {
            busy[p] = true;
          }
        }
        for (auto m = s.mappings.begin(); m != s.mappings.end();) {
          const std::size_t first = m->first;
          const std::size_t n = m->second.pages;
          if (std::any_of(busy.begin() + static_cast<std::ptrdiff_t>(first),
                          busy.begin() + static_cast<std::ptrdiff_t>(first + n),
                          [](bool x) { return x; })) {
            ++m;
            continue;
          }
          if (!synchronized) {
            driver_.synchronize_stream(arena->stream);
            synchronized = true;
          }
          const DevicePtr va = page_va(s, first);
          driver_.unmap(va, n * page_);
          const Origin& unmapping = OperationContext::current();
          record_trace(TraceAction::kSegmentUnmap, va, n * page_, arena->stream,
                       unmapping ? unmapping : m->second.stack);
          for (std::size_t i = 0; i < n; ++i) {
            Page& page = s.pages[first + i];
            Handle* h = page.handle;
            --h->mappings[page.piece];
            if (h->live_at[page.piece] == va + i * page_) {
              h->live_at[page.piece] = 0;
              spare_.emplace(h->id, page.piece);
            }
            page = Page{};
          }
          m = s.mappings.erase(m);
        }
        // Free pages now unmapped become void.
        for (Block* b = s.first; b != nullptr;) {
          if (b->kind != Block::Kind::kFree) {
            b = b->next;
            continue;
          }
          const DevicePtr lo = align_up(b->ptr, page_);
          const DevicePtr hi = align_down(b->end(), page_);
          DevicePtr run = 0;
          DevicePtr cut_lo = 0, cut_hi = 0;
          for (DevicePtr va = lo; va < hi; va += page_) {
            const bool unmapped = s.pages[(va - s.base) / page_].handle == nullptr;
            if (unmapped && run == 0) run = va;
            if (run != 0 && (!unmapped || va + page_ == hi)) {
              cut_lo = run;
              cut_hi = unmapped ? va + page_ : va;
              break;
            }
          }
          if (cut_hi == 0) {
            b = b->next;
            continue;
          }
          make_void(*arena, s, b, cut_lo, cut_hi);
          // Rescan from the block after the new void one.
          Block* v = s.first;
          while (v != nullptr && !(v->ptr <= cut_lo && cut_lo < v->end()))
            v = v->next;
          b = v != nullptr ? v->next : nullptr;
        }
        // Give back address space: unmapped void pages at the end, then an empty space.
        while (s.last != nullptr && s.last->kind == Block::Kind::kVoid) {
          Block* v = s.last;
          const std::size_t first = (v->ptr - s.base) / page_;
          bool all_unmapped = true;
          for (std::size_t p = first; p < s.pages.size(); ++p)
            all_unmapped = all_unmapped && s.pages[p].handle == nullptr;
          if (!all_unmapped) break;
          s.pages.resize(first);
          s.last = v->prev;
          if (s.last != nullptr) {
            s.last->next = nullptr;
          } else {
            s.first = nullptr;
          }
          delete_block(*arena, v);
        }
        if (s.first == nullptr) {
          owners_.clear(s.base, s.reserved_pages * page_);
          driver_.free_address_range(s.base, s.reserved_pages * page_);
          it = spaces.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  release_spare_handles();
}

void StitchEngine::release_spare_handles() {
  for (auto it = handles_.begin(); it != handles_.end();) {
    Handle& h = *it->second;
    const bool unused =
        std::all_of(h.live_at.begin(), h.live_at.end(), [](DevicePtr v) { return v == 0; }) &&
        std::all_of(h.mappings.begin(), h.mappings.end(), [](std::uint32_t n) { return n == 0; });
    if (!unused) {
      ++it;
      continue;
    }
    const std::size_t n = h.live_at.size();
    driver_.release_physical(h.id, n * page_);
    for (std::uint32_t i = 0; i < n; ++i)
      spare_.erase({h.id, i});
    add_reserved(h.counted_small, -static_cast<std::int64_t>(n * page_));
    ++stats_.num_device_free;
    add_segments(h.counted_small, -1);
    it = handles_.erase(it);
  }
}

std::optional<OperationContext> StitchEngine::empty_cache_context() {
  if (OperationContext::active()) return std::nullopt;
  return std::optional<OperationContext>(
      std::in_place, capture_on_free_.load(std::memory_order_relaxed) ? capture() : Origin{});
}

void StitchEngine::empty_cache() {
  // With history of every action ("all"), the unmaps carry the caller's stack, as
  // PyTorch's segment frees and unmaps do.
  const std::optional<OperationContext> context = empty_cache_context();
  if (!capturing()) {  // nothing goes back to the device during a capture
    const AllArenasLock all(*this);
    Lock device(device_mutex_);
    if (!capturing()) release_cache(all);
  }
  after_operation();
}

// ---------------------------------------------------------------------------------------
// Stats, settings, observers, history

std::vector<LedgerShare> StitchEngine::ledger_shares(const AllArenasLock& all) const {
  return ledger_shares_of(all, all.arenas());
}

void StitchEngine::settle_peak_debts(const AllArenasLock& all) const {
  const std::vector<LedgerShare> shares = ledger_shares(all);
  if (joint_ != nullptr) {
    if (in_debt(shares)) joint_->mark();  // the owner settles both engines together
    return;
  }
  core::settle_peak_debts(shares);
}

void StitchEngine::with_ledger_shares(
    const std::function<void(std::vector<LedgerShare>&)>& f) const {
  const AllArenasLock all(*this);
  std::vector<LedgerShare> shares = ledger_shares(all);
  f(shares);
}

// The block statistics' currents are sums over the arenas, their peaks the sums of the
// arenas' baselines (core/peak_ledger.hpp), settled first so no peak is below its current.
DeviceStats StitchEngine::stats_locked(const AllArenasLock& all) const {
  settle_peak_debts(all);
  DeviceStats total = stats_;
  PeakBaselines peaks;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    add_block_stats(total, peaks, arena->stats, arena->debts);
  }
  set_tracked_peaks(total, peaks);
  return total;
}

DeviceStats StitchEngine::stats() const {
  const AllArenasLock all(*this);
  Lock device(device_mutex_);
  return stats_locked(all);
}

void StitchEngine::reset_peak_stats() {
  const AllArenasLock all(*this);
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    arena->stats.reset_peak();  // every baseline at its current
    arena->debts = PeakBaselines{};
    arena->in_debt = false;
  }
  Lock device(device_mutex_);
  stats_.reset_peak();
}

void StitchEngine::reset_accumulated_stats() {
  const AllArenasLock all(*this);
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    arena->stats.reset_accumulated();
  }
  Lock device(device_mutex_);
  stats_.reset_accumulated();
}

void StitchEngine::set_memory_fraction(double fraction) {
  const std::optional<std::size_t> limit = fraction_limit(fraction, capacity_, device());
  Lock device(device_mutex_);
  fraction_ = fraction;
  limit_ = limit;
}

bool StitchEngine::reconfigure(const Config& next) {
  check_fixed_keys(config_, next);  // before anything changes
  // The fraction first: it validates the value, and a rejected one changes nothing. Only a
  // changed fraction is applied, so one set through set_memory_fraction() stays otherwise.
  double configured_fraction;
  {
    Lock device(device_mutex_);
    configured_fraction = config_.per_process_memory_fraction;
  }
  if (next.per_process_memory_fraction != configured_fraction) {
    set_memory_fraction(next.per_process_memory_fraction);
  }
  {
    // malloc rounds under its arena's lock and grow() reads the rest under device_mutex_.
    const AllArenasLock all(*this);
    Lock device(device_mutex_);
    config_ = next;
    chunk_pieces_ = std::max<std::size_t>(1, config_.large_segment_size / page_);
  }
  after_operation();
  return true;
}

double StitchEngine::memory_fraction() const {
  Lock device(device_mutex_);
  return fraction_;
}

std::size_t StitchEngine::allocation_size(DevicePtr ptr) const {
  Arena* arena = arena_of(ptr);
  if (arena == nullptr) return 0;
  Lock lock(arena->mutex);
  const Block* b = arena->live.find(ptr);
  return b == nullptr ? 0 : b->size;
}

StitchEngine::PieceCounts StitchEngine::piece_counts() const {
  const AllArenasLock all(*this);
  Lock device(device_mutex_);
  PieceCounts c;
  for (const auto& [id, h] : handles_)
    c.total += h->live_at.size();
  c.spare = spare_.size();
  c.fences = fences_recorded_.load(std::memory_order_relaxed);
  c.borrow_waits = borrow_waits_.load(std::memory_order_relaxed);
  c.fence_latency_us = fence_latency_us_.load(std::memory_order_relaxed);
  c.fence_latency_samples = fence_latency_samples_.load(std::memory_order_relaxed);
  c.borrowed_handles = borrowed_handles_;
  c.borrowed_pieces = borrowed_pieces_;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    for (const auto& spaces : arena->spaces) {
      for (const auto& s : spaces) {
        for (std::size_t p = 0; p < s->pages.size(); ++p) {
          const Page& page = s->pages[p];
          if (page.handle != nullptr && page.handle->live_at[page.piece] != page_va(*s, p)) {
            ++c.dead_pages;
          }
        }
      }
    }
  }
  return c;
}

void StitchEngine::add_oom_observer(Allocator::OomObserver observer) {
  Lock lock(observers_mutex_);
  oom_observers_.push_back(std::move(observer));
}

void StitchEngine::add_free_memory_callback(Allocator::FreeMemoryCallback callback) {
  Lock lock(observers_mutex_);
  free_memory_callbacks_.push_back(std::move(callback));
  has_free_memory_callbacks_.store(true, std::memory_order_relaxed);
}

void StitchEngine::add_trace_observer(TraceObserver observer) {
  Lock lock(trace_mutex_);
  trace_observers_.push_back(std::move(observer));
  tracing_.store(true, std::memory_order_relaxed);
}

void StitchEngine::record_trace_entry(TraceAction action, DevicePtr addr, std::size_t size,
                                      StreamId stream, const Origin& stack) {
  Lock lock(trace_mutex_);
  const std::int64_t now = driver_.now_us();
  // Blocks keep their stacks from context "state" on; entries carry them from "alloc" on.
  const Origin& origin = stacks_on_entries_ ? stack : OperationContext::none();
  if (history_on_) {
    history_.push(HistoryEntry{action, addr, size, stream, now, origin, current_metadata()});
  }
  const ContextHandle* context = origin.context ? &origin.context : nullptr;
  const TraceEntry entry{action, addr, size, stream, now, context};
  for (const TraceObserver& observer : trace_observers_)
    observer(entry);
}

StitchEngine::OomReport StitchEngine::prepare_oom(const AllArenasLock& all, Arena& arena,
                                                  std::size_t requested, std::size_t rounded,
                                                  bool small, const Origin& stack) {
  const MemInfo info = driver_.mem_info();
  const std::vector<Driver::ProcessMemory> processes = driver_.processes_on_device();
  ++stats_.num_ooms;
  record_trace(TraceAction::kOom, info.free_bytes, rounded, arena.stream, stack);
  const Pool& pool = arena.pool(small);
  const std::size_t largest = pool.empty() ? 0 : (*pool.rbegin())->size;
  std::size_t allocated = 0;
  for (Arena* a : all.arenas()) {
    all.held(*a);
    allocated += static_cast<std::size_t>(a->stats.allocated_bytes[kAggregate].current);
  }
  PytorchOomFigures p;
  p.requested = requested;
  p.device = device();
  p.capacity = info.total_bytes;
  p.device_free = info.free_bytes;
  p.processes = processes;
  p.limit = limit_;
  p.allocated = allocated;
  p.reserved = reserved_;
  std::string m = pytorch_oom_text(p) + " The request: " + std::to_string(requested) +
                  " bytes on stream " + std::to_string(arena.stream) + ", rounded to " +
                  format_size(rounded) + " (" + driver_.name() + "). ";
  if (limit_) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "per_process_memory_fraction %.4g allows ", fraction_);
    m += buf + format_size(*limit_) + ". ";
  }
  m += "The " + format_size(reserved_ - allocated) +
       " reserved but unallocated lies in pages shared with live blocks (free pages were "
       "already stitched or returned); the largest free block is " +
       format_size(largest) + " on this stream.";
  if (limit_ && info.free_bytes >= rounded) {
    m += " The per_process_memory_fraction limit refused it: raise the fraction "
         "(set_memory_fraction or per_process_memory_fraction) to let it succeed.";
  }
  return OomReport{std::move(m), requested, limit(), info.free_bytes};
}

void StitchEngine::raise_oom(const OomReport& report) {
  std::vector<Allocator::OomObserver> observers;
  {
    Lock lock(observers_mutex_);
    observers = oom_observers_;
  }
  for (const auto& observer : observers)
    observer(device(), report.requested, report.limit, report.free_bytes);
  after_operation();
  throw OutOfMemoryError(report.message, device(), report.requested);
}

void StitchEngine::record_history(const HistoryOptions& options) {
  using O = HistoryOptions;
  const HistorySwitches sw = history_switches(options);
  const bool on = options.enabled != O::Enabled::kNone;
  Lock lock(trace_mutex_);
  history_on_ = sw.history;
  stacks_on_entries_ = sw.stacks_on_entries;
  tracing_.store(history_on_ || !trace_observers_.empty(), std::memory_order_relaxed);
  contexts_.set(options.capture_context);
  capture_cpp_.store(sw.cpp, std::memory_order_relaxed);
  capture_caller_.store(sw.caller, std::memory_order_relaxed);
  capture_on_malloc_.store(sw.stacks_on_blocks, std::memory_order_relaxed);
  capture_on_free_.store(sw.capture_on_free && sw.history, std::memory_order_relaxed);
  history_.configure(options.enabled == O::Enabled::kAll ? options.max_entries : 1,
                     options.clear || !on);
  if (!on || options.clear) annotations_.clear();
}

void StitchEngine::annotate(std::string_view name, bool start) {
  Lock lock(trace_mutex_);
  if (!history_on_) return;
  annotations_.push_back(
      Annotation{std::string(name), start ? "START" : "END", device(), driver_.now_us()});
}

namespace {

BlockState state_of(bool allocated, bool pending) {
  if (allocated) return BlockState::kActiveAllocated;
  return pending ? BlockState::kActivePendingFree : BlockState::kInactive;
}

// A segment (SegmentInfo or SnapshotSegment) of a space's run of blocks starting at `first`.
template <class Segment, class Block>
void start_segment(Segment& seg, int device, const Block& first, StreamId stream, bool small) {
  seg.device = device;
  seg.address = first.ptr;
  seg.stream = stream;
  seg.is_small = small;
  seg.is_expandable = true;
}

// Adds a non-void block to its segment's totals; returns the block's state.
template <class Segment, class Block>
BlockState count_block(Segment& seg, const Block& b) {
  const bool allocated = b.kind == Block::Kind::kAllocated;
  const bool pending = b.kind == Block::Kind::kPending;
  seg.total_size += b.size;
  if (allocated) seg.allocated_size += b.size;
  if (allocated || pending) {
    seg.active_size += b.size;
    seg.requested_size += b.requested;
  }
  return state_of(allocated, pending);
}

// Appends the piece mapped at `page` of `space` to `runs`, extending the last run when the
// piece follows it in the same handle.
template <class Space>
void append_piece(std::vector<PieceRun>& runs, const Space& space, std::size_t page) {
  const auto& p = space.pages[page];
  if (!runs.empty() && runs.back().handle == p.handle->id &&
      runs.back().first + runs.back().count == p.piece) {
    ++runs.back().count;
    return;
  }
  runs.push_back(PieceRun{p.handle->id, p.piece, 1});
}

// The origin of the mapping that holds `ptr` of `space` (empty when none was recorded).
template <class Space>
const Origin& mapped_by(const Space& space, DevicePtr ptr, std::size_t page_size) {
  const auto it = space.mapping_at((ptr - space.base) / page_size);
  return it != space.mappings.end() ? it->second.stack : OperationContext::none();
}

SegmentInfo& segment_of(SegmentInfo& s) {
  return s;
}
template <class Stacks>
SnapshotSegment& segment_of(std::pair<SnapshotSegment, Stacks>& s) {
  return s.first;
}

// Sets the pieces of the segments [from, end) of `out`, all of space `space`: their pages
// are live, so each maps the piece that backs it.
template <class Segments, class Space>
void add_pieces(Segments& out, std::size_t from, const Space& space, std::size_t page_size) {
  for (std::size_t i = from; i < out.size(); ++i) {
    auto& seg = segment_of(out[i]);
    const std::size_t first = (seg.address - space.base) / page_size;
    for (std::size_t p = first; p < first + seg.total_size / page_size; ++p)
      append_piece(seg.pieces, space, p);
  }
}

// The physical memory behind the spaces of `arenas`: every handle, the spare pieces and,
// per space, the pages below its frontier that are dead (map a piece whose live page is
// elsewhere, or none).
template <class Arenas, class Handles, class Spare>
PhysicalMemory physical_memory(const Arenas& arenas, const Handles& handles, const Spare& spare,
                               int device, std::size_t page_size) {
  PhysicalMemory phys;
  phys.device = device;
  phys.piece_size = page_size;
  for (const auto& [id, h] : handles) {
    phys.handles.push_back(
        PhysicalHandleInfo{id, static_cast<std::uint32_t>(h->live_at.size()), h->counted_small});
  }
  const auto extend = [](PieceRun& run, PhysicalHandle id, std::uint32_t piece) {
    if (run.handle != id || run.first + run.count != piece) return false;
    ++run.count;
    return true;
  };
  for (const auto& [id, piece] : spare) {
    if (phys.spare.empty() || !extend(phys.spare.back(), id, piece)) {
      phys.spare.push_back(PieceRun{id, piece, 1});
    }
  }
  for (const auto& arena : arenas) {
    for (const auto& spaces : arena->spaces) {
      for (const auto& sp : spaces) {
        AddressRange& range = phys.ranges.emplace_back();
        range.address = sp->base;
        range.size = sp->reserved_pages * page_size;
        range.frontier = sp->pages.size() * page_size;
        range.stream = arena->stream;
        range.is_small = sp->small;
        for (std::size_t p = 0; p < sp->pages.size(); ++p) {
          const auto& page = sp->pages[p];
          const DevicePtr va = sp->base + p * page_size;
          if (page.handle == nullptr || page.handle->live_at[page.piece] == va) continue;
          DeadPages* last = range.dead.empty() ? nullptr : &range.dead.back();
          if (last == nullptr ||
              last->address + std::size_t{last->pieces.count} * page_size != va ||
              !extend(last->pieces, page.handle->id, page.piece)) {
            range.dead.push_back(DeadPages{va, PieceRun{page.handle->id, page.piece, 1}});
          }
        }
      }
    }
  }
  std::sort(phys.ranges.begin(), phys.ranges.end(),
            [](const AddressRange& a, const AddressRange& b) { return a.address < b.address; });
  return phys;
}

}  // namespace

// Each run of non-void blocks of a space is one segment (void pages hold no memory of
// theirs), as expandable segments report their mapped runs; its pages are live, so its
// pieces add up to its size and, with the spare pieces, to the reserved bytes.
std::vector<SegmentInfo> StitchEngine::segments() const {
  const AllArenasLock all(*this);
  std::vector<SegmentInfo> out;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    for (const auto& spaces : arena->spaces) {
      for (const auto& s : spaces) {
        const std::size_t from = out.size();
        SegmentInfo* seg = nullptr;
        for (const Block* b = s->first; b != nullptr; b = b->next) {
          if (b->kind == Block::Kind::kVoid) {
            seg = nullptr;
            continue;
          }
          if (seg == nullptr) {
            seg = &out.emplace_back();
            start_segment(*seg, device(), *b, arena->stream, s->small);
            seg->context = mapped_by(*s, b->ptr, page_).context;
          }
          const BlockState state = count_block(*seg, *b);
          seg->blocks.push_back(BlockInfo{b->ptr, b->size, b->requested, state,
                                          state != BlockState::kInactive ? b->stack.context : nullptr});
        }
        add_pieces(out, from, *s, page_);
      }
    }
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  return out;
}

Snapshot StitchEngine::snapshot() {
  return snapshot(0);
}

Snapshot StitchEngine::snapshot(std::int64_t other_active_bytes) {
  Snapshot s;
  std::vector<HistoryEntry> entries;
  std::vector<std::pair<SnapshotSegment, std::vector<Origin>>> segs;
  {
    const AllArenasLock all(*this);
    std::int64_t active_bytes = 0;
    for (Arena* arena : all.arenas()) {
      all.held(*arena);
      active_bytes += arena->stats.active_bytes[kAggregate].current;
    }
    record_trace(TraceAction::kSnapshot, 0,
                 static_cast<std::size_t>(active_bytes + other_active_bytes), 0, Origin{});
    entries = history_.entries();
    s.allocator_settings = settings_of(config_);
    s.allocator_settings.trace_alloc_overflowed = history_.overflowed();
    s.allocator_settings.trace_alloc_max_entries = static_cast<std::int64_t>(history_.capacity());
    {
      Lock lock(trace_mutex_);
      s.external_annotations = annotations_;
    }
    {
      Lock device_lock(device_mutex_);
      s.physical.push_back(physical_memory(all.arenas(), handles_, spare_, device(), page_));
    }
    for (Arena* arena : all.arenas()) {
      all.held(*arena);
      for (const auto& spaces : arena->spaces) {
        for (const auto& sp : spaces) {
          const std::size_t from = segs.size();
          SnapshotSegment* seg = nullptr;
          for (const Block* b = sp->first; b != nullptr; b = b->next) {
            if (b->kind == Block::Kind::kVoid) {
              seg = nullptr;
              continue;
            }
            if (seg == nullptr) {
              seg = &segs.emplace_back().first;
              start_segment(*seg, device(), *b, arena->stream, sp->small);
              segs.back().second.push_back(mapped_by(*sp, b->ptr, page_));
            }
            SnapshotBlock block;
            block.address = b->ptr;
            block.size = b->size;
            block.requested_size = b->requested;
            block.island = b->in_island();
            block.state = count_block(*seg, *b);
            seg->blocks.push_back(block);
            segs.back().second.push_back(block.state != BlockState::kInactive ? b->stack : Origin{});
          }
          add_pieces(segs, from, *sp, page_);
        }
      }
    }
  }
  std::vector<StackTable::Id> ids;
  for (const HistoryEntry& e : entries) {
    if (e.stack.cpp != 0) ids.push_back(e.stack.cpp);
  }
  for (const auto& [seg, stacks] : segs) {
    for (const Origin& o : stacks) {
      if (o.cpp != 0) ids.push_back(o.cpp);
    }
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const auto frames = stack_table().symbolize(ids);
  // stacks: the segment's own (its first page's mapping), then one per block.
  for (auto& [seg, stacks] : segs) {
    seg.frames = StackTable::frames_of(frames, stacks[0].cpp);
    seg.context = std::move(stacks[0].context);
    for (std::size_t i = 0; i < seg.blocks.size(); ++i) {
      seg.blocks[i].frames = StackTable::frames_of(frames, stacks[i + 1].cpp);
      seg.blocks[i].context = std::move(stacks[i + 1].context);
    }
    s.segments.push_back(std::move(seg));
  }
  std::sort(
      s.segments.begin(), s.segments.end(),
      [](const SnapshotSegment& a, const SnapshotSegment& b) { return a.address < b.address; });
  s.device_traces.resize(static_cast<std::size_t>(device()) + 1);
  s.device_traces[static_cast<std::size_t>(device())] = snapshot_trace(entries, frames);
  return s;
}

// ---------------------------------------------------------------------------------------
// Invariants

void StitchEngine::check_invariants() const {
  const AllArenasLock all(*this);
  Lock device(device_mutex_);
  check_locked(all);
}

void StitchEngine::check_locked(const AllArenasLock& all) const {
  const auto violated = [this](const std::string& what) {
    throw InvariantError("ccalloc: invariant violated on device " + std::to_string(device()) +
                         " (ccalloc policy): " + what);
  };
  using Kind = Block::Kind;
  std::vector<DeviceStats> recount(all.arenas().size());  // by arena (owner - 1)
  std::size_t free_blocks = 0, allocated_blocks = 0, pending_blocks = 0;
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
          if (is_live != (b->kind == Kind::kAllocated)) {
            violated("block " + hex_address(b->ptr) + " is live iff allocated: it is not so");
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
          (b->kind == Kind::kAllocated ? allocated_blocks : pending_blocks) += 1;
          DeviceStats& rc = recount[arena->owner - 1];
          for (StatType t : {kAggregate, pool_stat(s.small)}) {  // the segment's pool
            if (b->kind == Kind::kAllocated) {
              rc.allocation[t].current += 1;
              rc.allocated_bytes[t].current += static_cast<std::int64_t>(b->size);
            }
            rc.active[t].current += 1;
            rc.active_bytes[t].current += static_cast<std::int64_t>(b->size);
            rc.requested_bytes[t].current += static_cast<std::int64_t>(b->requested);
          }
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
    // Sharing (stitch_share.cpp): the fences in flight close increasing epochs after the
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
  if (live_entries != allocated_blocks) {
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
  std::array<std::int64_t, kTrackedCounters> current_sum{};
  std::array<std::int64_t, kTrackedCounters> baseline_sum{};
  bool any_debt = false;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    const bool in_debt = arena->in_debt;
    any_debt = any_debt || in_debt;
    std::size_t j = 0;
    for_each_tracked(arena->stats, arena->debts, [&](const Stat& st, const std::int64_t& debt) {
      const std::int64_t baseline = st.peak - debt;
      current_sum[j] += st.current;
      baseline_sum[j] += baseline;
      if (debt < 0 || (!in_debt && (debt != 0 || st.current > baseline))) {
        violated("peaks_cover_current: stream " + std::to_string(arena->stream) + ": " +
                 tracked_counter_name(j) + " is " + std::to_string(st.current) + ", baseline " +
                 std::to_string(baseline) + ", debt " + std::to_string(debt));
      }
      ++j;
    });
  }
  for (std::size_t j = 0; j < kTrackedCounters && !any_debt; ++j) {
    if (baseline_sum[j] < current_sum[j]) {
      violated("peaks_cover_current: " + tracked_counter_name(j) + ": device peak " +
               std::to_string(baseline_sum[j]) + " is below its current " +
               std::to_string(current_sum[j]));
    }
  }
}

}  // namespace ccalloc::core
