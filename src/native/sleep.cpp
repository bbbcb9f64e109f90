// Sleep and wake of private pools (docs/sleep-wake.md): a sleepable pool takes its segments
// from a SleepableSegments (native/sleepable.hpp), each an address reservation with one
// physical allocation mapped into it. sleep_pool saves what must be saved and releases the
// physical memory; the blocks, the live index and the segment map stay as they are, so
// frees, record_stream and the statistics of live allocations work while the pool sleeps.
// wake_pool maps memory at the same addresses again and restores the saved bytes.
//
// Both hold every arena lock throughout (they synchronize the device and copy: this is not
// the malloc path). SleepableSegments' own mutex is a leaf.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <string>

#include "ccalloc/allocator.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/stats.hpp"
#include "native/engine.hpp"

namespace ccalloc {
namespace {

[[noreturn]] void cannot_save(const Driver& d, const std::string& what) {
  throw DriverError("ccalloc: " + d.name() + " has no host memory or copies (" + what +
                    "): it cannot save the contents of a sleeping pool");
}

}  // namespace

std::string_view to_string(SleepMode mode) {
  return mode == SleepMode::kSave ? "save" : "discard";
}

void* Driver::allocate_host(std::size_t bytes) {
  cannot_save(*this, "allocate_host of " + std::to_string(bytes) + " bytes");
}
void Driver::free_host(void*, std::size_t) {
  cannot_save(*this, "free_host");
}
void Driver::copy_to_host(void*, DevicePtr, std::size_t bytes) {
  cannot_save(*this, "copy_to_host of " + std::to_string(bytes) + " bytes");
}
void Driver::copy_to_device(DevicePtr, const void*, std::size_t bytes) {
  cannot_save(*this, "copy_to_device of " + std::to_string(bytes) + " bytes");
}

namespace core {
namespace {

std::string pool_text(PoolId id) {
  return "pool " + to_string(id);
}

}  // namespace

void Engine::throw_asleep(const PrivatePool& pool, const char* what) {
  throw Error("ccalloc: " + std::string(what) + ": " + pool_text(pool.id) +
              " is asleep (sleep_pool); wake_pool it before allocating to it");
}

bool Engine::segment_asleep(const Arena& arena, DevicePtr base) {
  return arena.pool != nullptr && arena.pool->sleepable && !arena.pool->sleepable->backed(base);
}

PrivatePool& Engine::sleepable_pool(PoolId id, const char* what) const {
  if (id.is_default()) {
    throw Error(std::string("ccalloc: ") + what +
                ": pool id (0, 0) is the default pool, which cannot sleep; create a pool with "
                "create_sleepable_pool");
  }
  const auto it = pools_.find(id);
  if (it == pools_.end()) {
    throw Error(std::string("ccalloc: ") + what + ": no private pool " + to_string(id) +
                " on device " + std::to_string(device()));
  }
  if (!it->second->sleepable) {
    throw Error(std::string("ccalloc: ") + what + ": " + pool_text(id) +
                " is not sleepable (its segments are not in virtual memory); create it with "
                "create_sleepable_pool");
  }
  return *it->second;
}

void Engine::refuse_during_capture(PoolId id, const char* what) const {
  if (captures_.empty()) return;
  for (const auto& [underway, filter] : captures_) {
    if (underway == id) {
      throw Error(std::string("ccalloc: ") + what + ": " + pool_text(id) +
                  " is being allocated to (begin_allocate_to_pool without "
                  "end_allocate_to_pool)");
    }
  }
  throw Error(std::string("ccalloc: ") + what + " of " + pool_text(id) + ": a capture into " +
              pool_text(captures_.front().first) +
              " is underway; the device cannot be synchronized until it ends");
}

void Engine::create_sleepable_pool(PoolId id) {
  if (id.is_default()) {
    throw Error(
        "ccalloc: create_sleepable_pool: pool id (0, 0) is the default pool, not a private pool");
  }
  if (config_.uncached) {
    throw Error(
        "ccalloc: create_sleepable_pool: uncached mode has no pools (every malloc is a "
        "device allocation)");
  }
  {
    Lock lock(registry_mutex_);
    const auto it = pools_.find(id);
    if (it != pools_.end()) {
      if (!it->second->sleepable) {
        throw Error("ccalloc: create_sleepable_pool: " + pool_text(id) +
                    " already exists and is not sleepable (made by create_pool or "
                    "begin_allocate_to_pool)");
      }
      create_or_incref_pool(id, std::nullopt);
    } else {
      auto segments = std::make_shared<SleepableSegments>(driver_);
      SegmentSource source;
      source.allocate = [segments](std::size_t bytes) { return segments->allocate(bytes); };
      source.free = [segments](DevicePtr ptr, std::size_t bytes) { segments->free(ptr, bytes); };
      create_or_incref_pool(id, std::move(source), std::move(segments));
    }
  }
  after_operation();
}

void Engine::sleep_pool(PoolId id, SleepMode mode) {
  {
    AllArenasLock all(*this);
    registry_held(all);
    PrivatePool& pool = sleepable_pool(id, "sleep_pool");
    if (pool.asleep.load(std::memory_order_relaxed)) {
      throw Error("ccalloc: sleep_pool: " + pool_text(id) + " is already asleep");
    }
    refuse_during_capture(id, "sleep_pool");
    SleepableSegments& segments = *pool.sleepable;
    std::vector<Arena*> arenas;
    for (Arena* arena : all.by_stream()) {
      if (arena->pool == &pool) arenas.push_back(arena);
    }

    // The pool's frees waiting for other streams complete, and no kernel still uses its
    // memory (nor the memory of pointers the program keeps into it).
    synchronize_and_free_events(all, &pool);
    driver_.synchronize_device();

    // Save first: if the host memory or a copy fails, nothing has changed.
    SleepableSegments::Saved saved;
    if (mode == SleepMode::kSave) {
      std::vector<const Block*> live;
      for (Arena* arena : arenas) {
        all.held(*arena);
        arena->live.for_each([&live](DevicePtr, const Block* b) { live.push_back(b); });
      }
      std::sort(live.begin(), live.end(),
                [](const Block* a, const Block* b) { return a->ptr < b->ptr; });
      for (const Block* b : live) {
        saved.ranges[b->ptr] = SleepableSegments::SavedRange{saved.bytes, b->size};
        saved.bytes += b->size;
      }
      if (saved.bytes > 0) {
        saved.host = driver_.allocate_host(saved.bytes);
        if (saved.host == nullptr) {
          throw OutOfMemoryError("ccalloc: sleep_pool: cannot allocate " +
                                     format_size(saved.bytes) + " (" + std::to_string(saved.bytes) +
                                     " bytes) of pinned host memory to save the live "
                                     "allocations of " +
                                     pool_text(id) + "; the pool is unchanged",
                                 device(), saved.bytes);
        }
        try {
          for (const Block* b : live) {
            driver_.copy_to_host(static_cast<char*>(saved.host) + saved.ranges[b->ptr].offset,
                                 b->ptr, b->size);
          }
        } catch (...) {
          driver_.free_host(saved.host, saved.bytes);
          throw;
        }
      }
    }

    // Wholly free segments go back entirely; the others keep their addresses.
    for (Arena* arena : arenas) {
      for (const bool small : {false, true})
        release_arena_cache(all, *arena, small);
    }
    pool.asleep.store(true, std::memory_order_relaxed);
    segments.saved() = std::move(saved);
    for (Arena* arena : arenas) {
      all.held(*arena);
      for (const auto& blocks : segments_of(*arena)) {
        const DevicePtr base = blocks.front()->ptr;
        std::size_t size = 0;
        for (const Block* b : blocks)
          size += b->size;
        segments.unback(base);
        Lock lock(device_mutex_);
        reserved_ -= size;
        add_segment_stats(blocks.front()->pool->is_small, size, -1);
      }
    }
  }
  after_operation();
}

bool Engine::back_pool(const AllArenasLock& all, PrivatePool& pool) {
  struct Todo {
    DevicePtr base;
    std::size_t size;
    bool small;
  };
  std::vector<Todo> todo;
  std::size_t total = 0;
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    if (arena->pool != &pool) continue;
    for (const auto& blocks : segments_of(*arena)) {
      // (All of them, unless a driver error stopped sleep_pool halfway.)
      if (pool.sleepable->backed(blocks.front()->ptr)) continue;
      Todo t{blocks.front()->ptr, 0, blocks.front()->pool->is_small};
      for (const Block* b : blocks)
        t.size += b->size;
      total += t.size;
      todo.push_back(t);
    }
  }
  {
    Lock lock(device_mutex_);
    if (limit_ && reserved_ + peer_reserved_.bytes() + total > *limit_) return false;
    reserved_ += total;  // claimed before the driver calls, as allocate_segment does
  }
  std::size_t done = 0;
  bool ok = true;
  try {
    for (; done < todo.size() && ok; ++done)
      ok = pool.sleepable->back(todo[done].base);
  } catch (...) {
    ok = false;
    for (std::size_t i = 0; i < done; ++i)
      pool.sleepable->unback(todo[i].base);
    Lock lock(device_mutex_);
    reserved_ -= total;
    throw;
  }
  if (!ok) {
    for (std::size_t i = 0; i + 1 < done; ++i)
      pool.sleepable->unback(todo[i].base);
    Lock lock(device_mutex_);
    reserved_ -= total;
    return false;
  }
  Lock lock(device_mutex_);
  for (const Todo& t : todo)
    add_segment_stats(t.small, t.size, +1);
  return true;
}

void Engine::wake_pool(PoolId id) {
  // An out-of-memory found under the locks, reported (observers, error) after them.
  struct Oom {
    std::string message;
    std::size_t needed = 0;
    std::size_t limit = 0;
    std::size_t device_free = 0;
  };
  std::optional<Oom> oom;
  {
    AllArenasLock all(*this);
    registry_held(all);
    PrivatePool& pool = sleepable_pool(id, "wake_pool");
    if (!pool.asleep.load(std::memory_order_relaxed)) {
      throw Error("ccalloc: wake_pool: " + pool_text(id) + " is not asleep");
    }
    refuse_during_capture(id, "wake_pool");
    SleepableSegments& segments = *pool.sleepable;
    // Segments whose allocations were all freed while asleep need no memory again: their
    // reservations go back (release_segment knows they hold no memory).
    for (Arena* arena : all.by_stream()) {
      all.held(*arena);
      if (arena->pool != &pool) continue;
      for (const bool small : {false, true})
        release_arena_cache(all, *arena, small);
    }
    bool ok = back_pool(all, pool);
    if (!ok) {
      // As a malloc would: empty the caches that may go (the default pool's, and those of
      // pools nobody uses), then try again.
      release_cached_segments(all);
      {
        Lock lock(device_mutex_);
        ++device_stats_.num_alloc_retries;
      }
      ok = back_pool(all, pool);
    }
    if (!ok) {
      const std::size_t needed = segments.segment_bytes();
      const MemInfo info = driver_.mem_info();
      std::size_t reserved = 0;
      std::optional<std::size_t> limit;
      {
        Lock lock(device_mutex_);
        reserved = reserved_;
        limit = limit_;
        ++device_stats_.num_ooms;
      }
      std::string m = "CUDA out of memory on device " + std::to_string(device()) +
                      ": wake_pool of " + pool_text(id) + " needs " + format_size(needed) + " (" +
                      std::to_string(needed) + " bytes in " +
                      std::to_string(segments.segment_count()) + " segments). " + driver_.name() +
                      " has a total capacity of " + format_size(info.total_bytes) + " of which " +
                      format_size(info.free_bytes) + " is free; ccalloc reserves " +
                      format_size(reserved);
      if (limit) m += " within a per-process limit of " + format_size(*limit);
      m += ". The pool stays asleep; free memory elsewhere and call wake_pool again.";
      oom = Oom{std::move(m), needed, limit ? *limit : info.total_bytes, info.free_bytes};
    } else {
      // The contents saved for allocations still live; those freed while asleep are dropped.
      // The pool is awake from here on: its memory is mapped. A copy that fails leaves it
      // awake with the contents restored so far, and drops the rest.
      pool.asleep.store(false, std::memory_order_relaxed);
      SleepableSegments::Saved& saved = segments.saved();
      try {
        for (Arena* arena : all.by_stream()) {
          all.held(*arena);
          if (arena->pool != &pool) continue;
          arena->live.for_each([&](DevicePtr ptr, const Block* b) {
            const auto it = saved.ranges.find(ptr);
            if (it == saved.ranges.end() || it->second.bytes != b->size) return;
            driver_.copy_to_device(ptr, static_cast<const char*>(saved.host) + it->second.offset,
                                   it->second.bytes);
          });
        }
      } catch (...) {
        segments.drop_saved();
        throw;
      }
      segments.drop_saved();
    }
  }
  if (oom) {
    // As a malloc's OOM: the observers first, without the allocator's locks.
    std::vector<OomObserver> observers;
    {
      Lock lock(observers_mutex_);
      observers = oom_observers_;
    }
    for (const auto& o : observers)
      o(device(), oom->needed, oom->limit, oom->device_free);
    throw OutOfMemoryError(oom->message, device(), oom->needed);
  }
  after_operation();
}

bool Engine::pool_asleep(PoolId id) const {
  if (id.is_default()) {
    throw Error("ccalloc: pool_asleep: pool id (0, 0) is the default pool, which never sleeps");
  }
  Lock lock(registry_mutex_);
  return pool_of(id).asleep.load(std::memory_order_relaxed);
}

PoolSleepInfo Engine::pool_sleep_info(PoolId id) const {
  AllArenasLock all(*this);
  registry_held(all);
  const PrivatePool& pool = sleepable_pool(id, "pool_sleep_info");
  PoolSleepInfo info;
  info.asleep = pool.asleep.load(std::memory_order_relaxed);
  info.segment_bytes = pool.sleepable->segment_bytes();
  info.physical_bytes = pool.sleepable->physical_bytes();
  info.saved_bytes = pool.sleepable->saved().bytes;
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    if (arena->pool != &pool) continue;
    arena->live.for_each([&info](DevicePtr, const Block* b) { info.live_bytes += b->size; });
  }
  return info;
}

}  // namespace core
}  // namespace ccalloc
