// The OOM ladder: what malloc does when its stream's pool has no fitting block, and the
// ways cached memory goes back to the device (empty_cache, GC, oversize release).
//
// Steps, in order, each tried only if the previous ones found nothing:
//   1. free-memory callbacks, then the pool again
//   2. age-based GC of cached segments (when garbage_collection_threshold is set)
//   3. a new segment from the device (within the memory limit)
//   4. release cached oversize blocks of this stream, then a new segment
//   5. wait for every pending cross-stream free, release every cached segment, then a new
//      segment (counted as num_alloc_retries)
//   6. the pool again: step 5 may have returned a fitting block. PyTorch omits this step
//      and raises OOM with the block in the pool (pytorch/pytorch#189504).
//   7. a free block of a use_on_oom private pool (default-pool requests only), as PyTorch
//      does before giving up.
//   8. OutOfMemoryError, after OOM observers.
// Steps 1, 3 and 4 need only this stream's arena; 2, 5, 6 and 7 take every arena's lock.
// While a capture is underway nothing goes back to the device (cudaFree and unmapping are
// illegal then): steps 2, 4 and 5 are skipped, as PyTorch skips its release_cached_blocks
// step (PyTorch still frees oversize blocks and collects garbage then; ccalloc does not).
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <optional>

#include "native/engine.hpp"
#include "core/arena_engine.hpp"
#include "core/common.hpp"
#include "core/rounding.hpp"

namespace ccalloc {
namespace {

thread_local int t_segment_source_calls = 0;

}  // namespace

bool in_segment_source() {
  return t_segment_source_calls > 0;
}

namespace core {
namespace {

// Marks the calling thread as inside a SegmentSource call while it lives.
struct SegmentSourceCall {
  SegmentSourceCall() { ++t_segment_source_calls; }
  ~SegmentSourceCall() { --t_segment_source_calls; }
  SegmentSourceCall(const SegmentSourceCall&) = delete;
  SegmentSourceCall& operator=(const SegmentSourceCall&) = delete;
};

}  // namespace

DevicePtr Engine::malloc_slow(Arena& arena, const Request& req, std::unique_lock<ArenaMutex> lock) {
  // The arena's lock arrives in `lock` and is later held through lock_all(); the analysis
  // follows neither, so it is told.
  arena.mutex.assert_held();
  FreePool& pool = arena.pool_for(req.small);
  // The block found so far: pooled at `pos`, or a fresh segment's block (pos == end()).
  Block* block = nullptr;
  PoolPos pos = pool.blocks.end();
  const auto search_pool = [&] {
    arena.mutex.assert_held();
    pos = find_free_block(arena, req, /*advance_gc_clock=*/false);
    block = pos == pool.blocks.end() ? nullptr : *pos;
  };

  if (has_free_memory_callbacks_.load(std::memory_order_acquire)) {
    lock.unlock();  // callbacks may free ccalloc memory
    const bool freed = run_free_memory_callbacks();
    lock.lock();
    if (freed) search_pool();
  }
  if (block == nullptr && !gc_enabled()) {
    block = allocate_segment(arena, req, /*is_retry=*/false);
    if (block == nullptr && !capturing() && release_oversize_blocks(arena, req)) {
      block = allocate_segment(arena, req, /*is_retry=*/false);
    }
  }
  if (block != nullptr) {
    const DevicePtr ptr = hand_out(arena, block, pos, req);
    ArenaEngine::finish(*this, arena, lock);
    return ptr;
  }

  // The steps that act on every stream. Another thread may have freed a fitting block
  // while no lock was held: look once more first.
  lock.unlock();
  auto all = std::make_unique<AllArenasLock>(*this);
  search_pool();
  const bool capture = capturing();
  if (block == nullptr && gc_enabled()) {
    if (!capture) collect_garbage(*all);
    block = allocate_segment(arena, req, /*is_retry=*/false);
    if (block == nullptr && !capture && release_oversize_blocks(arena, req)) {
      block = allocate_segment(arena, req, /*is_retry=*/false);
    }
  }
  if (block == nullptr && !capture) {
    release_cached_segments(*all);
    block = allocate_segment(arena, req, /*is_retry=*/true);
    if (block == nullptr) search_pool();
  }
  if (block == nullptr && arena.pool == nullptr) {
    if (const DevicePtr ptr = malloc_from_oom_pools(*all, req)) {
      settle_peak_debts(*all);
      all.reset();
      after_operation();
      return ptr;
    }
  }
  if (block == nullptr) raise_oom(arena, req, std::move(all));
  const DevicePtr ptr = hand_out(arena, block, pos, req);
  settle_peak_debts(*all);
  all.reset();
  after_operation();
  return ptr;
}

// A new segment for `req` from the device, or nullptr if the memory limit or the device
// refuses it. The segment's single block is in no pool yet.
Block* Engine::allocate_segment(Arena& arena, const Request& req, bool is_retry) {
  const std::size_t size = req.segment_size;
  const SegmentSource* source =
      arena.pool != nullptr && arena.pool->source ? &*arena.pool->source : nullptr;
  // Expandable segments map just the pages the request needs (map_block accounts them).
  // A pool whose segments come from elsewhere takes them whole.
  const bool whole = !expandable() || source != nullptr;
  {
    Lock lock(device_mutex_);
    if (is_retry) ++device_stats_.num_alloc_retries;
    if (limit_ && reserved_ + peer_reserved_.bytes() + size > *limit_) return nullptr;
    if (whole) reserved_ += size;  // claimed before the driver call: streams see it
  }
  if (!whole) return allocate_expandable(arena, req);
  DevicePtr ptr = 0;
  try {
    if (source != nullptr) {
      const SegmentSourceCall call;
      ptr = source->allocate(size);
    } else {
      ptr = driver_.allocate(size);
    }
  } catch (...) {
    Lock lock(device_mutex_);
    reserved_ -= size;
    throw;
  }
  {
    Lock lock(device_mutex_);
    if (ptr == 0) {
      reserved_ -= size;
      return nullptr;
    }
    add_segment_stats(req.small, size, +1);
    ++device_stats_.num_device_alloc;
    owners_.assign(ptr, size, arena.owner);
  }
  if (arena.pool != nullptr) arena.pool->segments.fetch_add(1, std::memory_order_relaxed);
  Block* block = arena.blocks.make();
  block->ptr = ptr;
  block->size = size;
  block->pool = &arena.pool_for(req.small);
  if (trace_flags_.load(std::memory_order_relaxed) & kStacksOnBlocks) {
    block->segment_stack = OperationContext::current();
  }
  record_trace(TraceAction::kSegmentAlloc, ptr, size, arena.stream, block);
  return block;
}

// Returns a free, unsplit segment (a block in its pool) to the device.
void Engine::release_segment(Arena& arena, Block* block) {
  if (capturing()) {
    throw Error("ccalloc internal error: a segment would be freed while a capture is underway");
  }
  block->pool->blocks.erase(block);
  record_trace(TraceAction::kSegmentFree, block->ptr, block->size, arena.stream, block);
  // A sleeping segment's memory left the reserved bytes when its pool went to sleep.
  const bool asleep = segment_asleep(arena, block->ptr);
  if (arena.pool != nullptr && arena.pool->source) {
    const SegmentSourceCall call;
    arena.pool->source->free(block->ptr, block->size);
  } else {
    driver_.free(block->ptr, block->size);
  }
  if (arena.pool != nullptr) arena.pool->segments.fetch_sub(1, std::memory_order_relaxed);
  {
    Lock lock(device_mutex_);
    ++device_stats_.num_device_free;
    owners_.clear(block->ptr, block->size);
    if (!asleep) {
      reserved_ -= block->size;
      add_segment_stats(block->pool->is_small, block->size, -1);
    }
  }
  arena.blocks.recycle(block);
}

void Engine::add_segment_stats(bool small, std::size_t size, std::int64_t sign) {
  const auto n = static_cast<std::int64_t>(size);
  add_pool_stat(device_stats_.segment, small, sign > 0 ? 1 : -1);
  if (device_reserved_ != nullptr) device_reserved_->add_segments(small, sign > 0 ? 1 : -1);
  add_reserved_bytes(small, sign > 0 ? n : -n);
  if (is_oversize(size, config_)) {
    if (sign > 0) {
      device_stats_.oversize_segments.increase(1);
    } else {
      device_stats_.oversize_segments.decrease(1);
    }
  }
}

void Engine::add_reserved_bytes(bool small, std::int64_t bytes) {
  add_pool_stat(device_stats_.reserved_bytes, small, bytes);
  if (device_reserved_ != nullptr) device_reserved_->add(small, bytes);
}

// Frees cached oversize segments of this stream: the smallest that covers the request, or
// else the largest ones until as many bytes as requested are freed. Only with
// max_split_size set.
bool Engine::release_oversize_blocks(Arena& arena, const Request& req) {
  if (config_.max_split_size == SIZE_MAX) return false;
  FreePool& pool = arena.pool_for(req.small);
  const std::size_t want = std::max(req.size, config_.max_split_size);
  // Oversize blocks are whole segments under a validated config (max_split_size >=
  // large_segment_size); the is_split() checks keep a partly used segment safe regardless.
  auto it = pool.lower_bound(want);
  if (it != pool.blocks.end() && !(*it)->is_split() && (*it)->segment == nullptr) {
    release_segment(arena, *it);
    return true;
  }
  if (it == pool.blocks.begin()) return false;
  std::size_t released = 0;
  --it;  // the largest block below `want`
  while (released < want && (*it)->size >= config_.max_split_size) {
    const auto cur = it;
    const bool is_first = cur == pool.blocks.begin();
    if (!is_first) --it;
    if (!(*cur)->is_split() && (*cur)->segment == nullptr) {
      released += (*cur)->size;
      release_segment(arena, *cur);
    }
    if (is_first) break;
  }
  return released >= want;
}

// Waits for every pending cross-stream free, then returns every free, unsplit segment of
// the default pool's streams and of the private pools whose use count is 0 to the device:
// large pools first, streams in order. Private pools in use keep their cache (PyTorch's
// release_cached_blocks); with `only`, just that pool's arenas (emptyCache(mempool_id)).
void Engine::release_cached_segments(const AllArenasLock& all, const PrivatePool* only,
                                     bool sync_counted) {
  registry_held(all);
  synchronize_and_free_events(all, only, sync_counted);
  for (const bool small : {false, true}) {
    for (Arena* arena : all.by_stream()) {
      all.held(*arena);
      if (only != nullptr ? arena->pool != only
                          : arena->pool != nullptr && arena->pool->use_count > 0) {
        continue;
      }
      release_arena_cache(all, *arena, small);
    }
  }
  // A pool nobody uses disappears with its last segment.
  for (auto it = pools_.begin(); it != pools_.end();) {
    PrivatePool& pool = *it->second;
    if (pool.use_count == 0 && pool.segments.load(std::memory_order_relaxed) == 0) {
      if (pool.sleepable) pool.sleepable->drop_saved();  // contents nobody can read again
      retired_pools_.push_back(std::move(it->second));
      it = pools_.erase(it);
    } else {
      ++it;
    }
  }
}

void Engine::release_arena_cache(const AllArenasLock& all, Arena& arena, bool small) {
  all.held(arena);
  FreePool& pool = arena.pool_for(small);
  std::vector<Block*> to_unmap;  // unmapping changes the pool: gather first
  for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
    Block* block = *it++;
    if (block->segment != nullptr) {
      to_unmap.push_back(block);
    } else if (!block->is_split()) {
      release_segment(arena, block);
    }
  }
  for (Block* block : to_unmap) {
    Block* unmapped = unmap_block(arena, block);
    if (unmapped != nullptr && !unmapped->is_split()) {
      release_expandable_segment(arena, unmapped);
    }
  }
}

DevicePtr Engine::malloc_on_oom(std::size_t size, StreamId stream) {
  if (size == 0 || size >= kOneExabyte || config_.uncached) return 0;
  auto all = std::make_unique<AllArenasLock>(*this);
  const Request req = make_request(size, stream);
  const DevicePtr ptr = malloc_from_oom_pools(*all, req);
  if (ptr != 0) settle_peak_debts(*all);
  all.reset();
  if (ptr != 0) after_operation();
  return ptr;
}

DevicePtr Engine::malloc_from_oom_pools(const AllArenasLock& all, const Request& req) {
  registry_held(all);
  for (const auto& [id, pool] : pools_) {
    if (!pool->use_on_oom || pool->asleep.load(std::memory_order_relaxed)) continue;
    const auto it = pool->arenas.find(req.stream);
    if (it == pool->arenas.end()) continue;
    Arena& arena = *it->second;
    all.held(arena);
    const PoolPos pos = find_free_block(arena, req, /*advance_gc_clock=*/false);
    if (pos != arena.pool_for(req.small).blocks.end()) return hand_out(arena, *pos, pos, req);
  }
  return 0;
}

// Age-based GC (garbage_collection_threshold): once reserved memory exceeds threshold x
// limit, frees whole cached large segments whose age (pool searches since they became
// free) is at least the average, repeating until enough is reclaimed. The limit is the
// per-process fraction when set, else device capacity (PyTorch requires a fraction;
// pytorch/pytorch#106660).
void Engine::collect_garbage(const AllArenasLock& all) {
  std::size_t reserved;
  std::size_t limit;
  {
    Lock lock(device_mutex_);
    reserved = reserved_;
    limit = memory_limit_locked();
  }
  const auto threshold =
      static_cast<std::size_t>(config_.garbage_collection_threshold * static_cast<double>(limit));
  if (reserved <= threshold) return;
  const std::size_t target = reserved - threshold;
  const std::uint64_t clock = pool_searches_[1].load(std::memory_order_relaxed);
  const auto age = [clock](const Block* b) { return clock - b->gc_count_base; };

  double total_age = 0.0;
  std::size_t candidates = 0;
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    if (arena->pool != nullptr) continue;  // only the default pool, as PyTorch
    for (const Block* b : arena->large_pool.blocks) {
      if (!b->is_split() && b->segment == nullptr) {
        total_age += static_cast<double>(age(b));
        ++candidates;
      }
    }
  }
  std::size_t reclaimed = 0;
  bool freed_some = true;
  while (reclaimed < target && freed_some && candidates > 0) {
    const double average_age = total_age / static_cast<double>(candidates);
    freed_some = false;
    for (Arena* arena : all.by_stream()) {
      all.held(*arena);
      if (arena->pool != nullptr) continue;
      auto& blocks = arena->large_pool.blocks;
      for (auto it = blocks.begin(); it != blocks.end();) {
        Block* b = *it++;
        if (!b->is_split() && b->segment == nullptr && static_cast<double>(age(b)) >= average_age) {
          freed_some = true;
          reclaimed += b->size;
          total_age -= static_cast<double>(age(b));
          --candidates;
          release_segment(*arena, b);
        }
      }
    }
  }
}

std::size_t Engine::memory_limit_locked() const {
  return limit_ ? *limit_ : capacity_;
}

bool Engine::run_free_memory_callbacks() {
  std::vector<FreeMemoryCallback> callbacks;
  {
    Lock lock(observers_mutex_);
    callbacks = free_memory_callbacks_;
  }
  bool freed = false;
  for (const auto& cb : callbacks)
    freed = cb() || freed;
  return freed;
}

void Engine::empty_cache() {
  if (config_.uncached) return;
  const unsigned flags = trace_flags_.load(std::memory_order_acquire);
  std::optional<OperationContext> context;
  if ((flags & kTraceHistory) && !OperationContext::active()) {
    context.emplace(flags & kCaptureOnFree ? capture(flags) : Origin{});
  }
  if (!capturing()) {  // nothing goes back to the device during capture
    AllArenasLock all(*this);
    if (!capturing()) release_cached_segments(all, nullptr, empty_cache_sync_counted_);
  }
  after_operation();
}

void Engine::set_memory_fraction(double fraction) {
  const std::optional<std::size_t> limit = fraction_limit(fraction, capacity_, device());
  Lock lock(device_mutex_);
  fraction_ = fraction;
  limit_ = limit;
}

double Engine::memory_fraction() const {
  Lock lock(device_mutex_);
  return fraction_;
}

// ---------------------------------------------------------------------------------------
// The error

namespace {

struct OomFacts {
  int device = 0;
  std::string device_name;
  StreamId stream = 0;
  std::size_t requested = 0;
  std::size_t rounded = 0;
  std::size_t segment_size = 0;
  std::size_t capacity = 0;
  std::size_t device_free = 0;
  std::optional<std::size_t> limit;
  double fraction = 1.0;
  std::size_t reserved = 0;
  std::size_t allocated = 0;
  std::size_t largest_free_same_stream = 0;  // in the pool the request needs
  std::size_t largest_free_anywhere = 0;
  std::size_t free_other_streams = 0;
  std::size_t free_in_other_pools = 0;  // cached in private pools other than the request's
  std::size_t free_in_private_pools = 0;  // cached in any private pool
  std::vector<Driver::ProcessMemory> processes;
  bool expandable = false;
};

std::string oom_message(const OomFacts& f) {
  PytorchOomFigures p;
  p.requested = f.requested;
  p.device = f.device;
  p.capacity = f.capacity;
  p.device_free = f.device_free;
  p.processes = f.processes;
  p.limit = f.limit;
  p.allocated = f.allocated;
  p.private_pools = f.free_in_private_pools;
  p.reserved = f.reserved;
  std::string m = pytorch_oom_text(p) + " The request: " + std::to_string(f.requested) +
                  " bytes on stream " + std::to_string(f.stream) + ", rounded to " +
                  format_size(f.rounded) + "; a new segment would take " +
                  format_size(f.segment_size) + " (" + f.device_name + "). ";
  if (f.limit) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "per_process_memory_fraction %.4g allows ", f.fraction);
    m += buf + format_size(*f.limit) + ". ";
  }
  const std::size_t unallocated = f.reserved - f.allocated;
  m += "The largest free block is " + format_size(f.largest_free_same_stream) + " on this stream";
  if (f.largest_free_anywhere > f.largest_free_same_stream) {
    m += " (" + format_size(f.largest_free_anywhere) + " on another stream)";
  }
  m += ". ";
  if (f.free_in_other_pools > 0) {
    m += format_size(f.free_in_other_pools) +
         " of the unallocated memory is cached in private pools (CUDA graphs, MemPools), which "
         "this request cannot use. ";
  }

  const bool limit_binds =
      f.limit && f.reserved + f.segment_size > *f.limit && f.device_free >= f.segment_size;
  // Enough bytes exist, cached and free on the device together, but in no single piece.
  const bool fragmented = unallocated > 0 && unallocated + f.device_free >= f.rounded;
  if (limit_binds) {
    m += "The per_process_memory_fraction limit refused it: raise the fraction "
         "(set_memory_fraction or per_process_memory_fraction) to let it succeed.";
  } else if (unallocated >= f.rounded && f.free_other_streams >= f.rounded) {
    m += "Enough memory is cached on other streams but free blocks stay with the stream "
         "that allocated them: allocate on fewer streams, or call empty_cache() after the "
         "other streams' work.";
  } else if (fragmented && !f.expandable) {
    m += "Free memory is fragmented: no cached block fits and the device cannot hold a "
         "whole new segment beside what is cached; set "
         "CCALLOC_CONF=expandable_segments:True to let segments grow instead of splitting, or "
         "max_split_size_mb to keep large blocks whole.";
  } else if (fragmented) {
    m += "Reserved but unallocated memory is pinned by live blocks in partly used pages; "
         "freeing long-lived allocations sooner would help.";
  } else {
    m += "The live allocations alone need more memory than the device has: reduce the "
         "working set (smaller batches, activation checkpointing) or use a device with more "
         "memory.";
  }
  return m;
}

}  // namespace

void Engine::raise_oom(Arena& arena, const Request& req, std::unique_ptr<AllArenasLock> all) {
  const MemInfo info = driver_.mem_info();
  record_trace(TraceAction::kOom, info.free_bytes, req.size, arena.stream, nullptr);

  OomFacts f;
  f.device = device();
  f.device_name = driver_.name();
  f.stream = req.stream;
  f.requested = req.requested;
  f.rounded = req.size;
  f.segment_size = req.segment_size;
  f.capacity = info.total_bytes;
  f.device_free = info.free_bytes;
  f.expandable = config_.expandable_segments;
  for (Arena* a : all->by_stream()) {
    all->held(*a);
    // A sleeping pool holds no memory: neither its allocations nor its free blocks are in
    // what is reserved (docs/sleep-wake.md).
    if (a->pool != nullptr && a->pool->asleep.load(std::memory_order_relaxed)) continue;
    f.allocated += static_cast<std::size_t>(pools_current(a->stats.allocated_bytes));
    for (const FreePool* pool : {&a->small_pool, &a->large_pool}) {
      std::size_t free_bytes = 0;
      for (const Block* b : pool->blocks)
        free_bytes += b->size;
      const std::size_t largest = pool->blocks.empty() ? 0 : (*pool->blocks.rbegin())->size;
      if (a->pool == arena.pool)
        f.largest_free_anywhere = std::max(f.largest_free_anywhere, largest);
      if (a == &arena && pool->is_small == req.small) f.largest_free_same_stream = largest;
      if (a->pool != nullptr) f.free_in_private_pools += free_bytes;
      if (a != &arena && a->pool != arena.pool) {
        f.free_in_other_pools += free_bytes;  // never usable by this request
      } else if (a != &arena) {
        f.free_other_streams += free_bytes;
      }
    }
  }
  {
    Lock lock(device_mutex_);
    ++device_stats_.num_ooms;
    f.reserved = reserved_;
    f.limit = limit_;
    f.fraction = fraction_;
  }
  all.reset();
  f.processes = driver_.processes_on_device();

  std::vector<OomObserver> observers;
  {
    Lock lock(observers_mutex_);
    observers = oom_observers_;
  }
  for (const auto& o : observers) {
    o(f.device, f.requested, f.limit ? *f.limit : f.capacity, f.device_free);
  }
  after_operation();
  throw OutOfMemoryError(oom_message(f), f.device, f.requested);
}

}  // namespace core
}  // namespace ccalloc
