// The `ccalloc` preset's policy: construction, malloc and its ladder, free, record_stream
// and the streams' arenas. Model, rules and invariants: stitch/engine.hpp; the other
// files of this folder hold the rest, one concern each (src/stitch/README.md).
#include "stitch/engine.hpp"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <string>

#include "sync/arena_cache.hpp"
#include "core/arena_engine.hpp"
#include "core/common.hpp"
#include "core/format.hpp"
#include "core/rounding.hpp"
#include "stitch/tunables.hpp"

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

StitchEngine::StitchEngine(Driver& driver, Config config)
    : driver_(driver),
      config_(std::move(config)),
      uid_(next_engine_uid()),
      fence_gate_(kFenceIntervalUs, 0.9, driver.wall_clock()),
      event_pool_(driver) {
  const char* check = std::getenv("CCALLOC_CHECK_INVARIANTS");
  check_invariants_ = check != nullptr && std::strcmp(check, "1") == 0;
  capacity_ = driver_.mem_info().total_bytes;
  page_ = driver_.vm_granularity();
  if (page_ > 1 && std::has_single_bit(page_)) page_shift_ = std::countr_zero(page_);
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
      recorder_.capture_on_malloc.load(std::memory_order_relaxed) ? capture() : Origin{};
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
  if (arena.parked != nullptr) {
    if (const DevicePtr ptr = take_parked(arena, rounded, small, size, stack)) {
      ArenaEngine::finish(*this, arena, lock);
      return ptr;
    }
  }
  Pool& pool = arena.pool(small);
  auto pos = pool.lower_bound(BySizeThenAddress::Key{rounded, 0});
  // A growth may take the pages a parked block leaves wholly free once pooled.
  if (pos == pool.end() && arena.parked != nullptr) unpark(arena);
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
  ArenaEngine::finish(*this, arena, lock);
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
    ArenaEngine::finish(*this, arena, lock);
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
      recorder_.capture_on_free.load(std::memory_order_relaxed) ? capture() : Origin{};
  Lock lock(arena->mutex);
  Block* b = live_block(*arena, ptr);
  if (b == nullptr) {
    lock.unlock();
    throw_not_live("free", ptr);
  }
  if (!park(*arena, b, stack)) {  // a parked block stays in the live index
    arena->live.erase(ptr);
    release(*arena, b, stack);
  }
  lock.unlock();
  after_operation();
  return true;
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
  ArenaEngine::record_stream(*this, ptr, stream);
}

// A live block's pages are live, and each is covered by the one live mapping of its handle
// (handles are mapped, lent and unmapped whole): the region is those mappings, whole. They
// stay while the block is live, since only handles wholly inside free blocks are lent and
// only mappings with no live block are unmapped.
ipc::SharedRegion StitchEngine::shared_region(DevicePtr ptr) const {
  // Under the arena's lock.
  const auto region_of = [&](const Arena*, const Block* b) {
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
  };
  return ArenaEngine::with_live_block(*this, ptr, "shared_region", region_of);
}

void StitchEngine::throw_not_live(const char* what, DevicePtr ptr) const {
  throw InvalidPointerError(pointer_error(what, ptr, device()), ptr);
}

// ---------------------------------------------------------------------------------------
// Blocks

StitchEngine::Arena& StitchEngine::arena_for_registry(StreamId stream) {
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
  return ArenaEngine::arena_list(*this);
}

StitchEngine::AllArenasLock::AllArenasLock(const StitchEngine& engine, Parked parked)
    : engine_(engine) {
  engine.registry_mutex_.lock();
  arenas_.reserve(engine.arenas_.size());
  for (const auto& a : engine.arenas_) {
    a->mutex.lock();
    arenas_.push_back(a.get());
  }
  // A parked block is free memory that every view, count and ladder step sees pooled:
  // pooling it changes nothing a caller can observe, so a const operation may do it. The
  // takes' cumulative counts join the statistics.
  for (Arena* a : arenas_) {
    if (a->parked != nullptr && parked == Parked::kPool) {
      const_cast<StitchEngine&>(engine).unpark(*a);
    }
    a->taken.flush(a->stats);
  }
}

StitchEngine::AllArenasLock::~AllArenasLock() {
  for (Arena* a : arenas_)
    a->mutex.unlock();
  engine_.registry_mutex_.unlock();
}

}  // namespace ccalloc::core
