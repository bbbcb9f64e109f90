// What the two engines that keep their blocks in per-stream arenas, core::Engine (src/native)
// and core::StitchEngine (src/stitch), do alike around an arena, written once: the end of an
// operation that held its arena's lock alone (debt read, lock released, peaks settled,
// invariants checked), record_stream, allocation_size and the lookup of a live allocation
// that shared_region starts with, and the list of arenas.
//
// Each engine befriends ArenaEngine, whose function templates reach the members both name
// alike: arena_of(ptr), throw_not_live, after_operation, settle_peak_debts, registry_mutex_
// and arenas_; and an arena's mutex, live index, stream and in_debt flag. They are inline
// templates: the hot path (malloc, free) pays no call and no indirection.
//
// Locks: each template states what it needs (core/thread_annotations.hpp) in terms of its
// arguments, so clang's -Wthread-safety checks callers and bodies as before. An operation
// that moves its arena's lock into a std::unique_lock (which the analysis does not follow)
// tells it with arena.mutex.assert_held(); a callback that runs under an arena's lock
// asserts it again, as the analysis does not carry the caller's locks into a lambda.
#pragma once

#include <cstddef>
#include <mutex>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "core/arena_mutex.hpp"
#include "core/common.hpp"
#include "core/thread_annotations.hpp"

namespace ccalloc::core {

struct ArenaEngine {
  // The end of an operation that held `arena`'s lock alone, in `lock`: the arena's debt
  // read under the lock, the lock released, the device-wide peaks settled where the
  // operation left the arena in debt (every lock taken afresh: core/peak_ledger.hpp), and
  // the invariants checked where asked.
  template <typename E, typename A>
  [[gnu::always_inline]] static void finish(E& engine, A& arena,
                                            std::unique_lock<ArenaMutex>& lock)
      REQUIRES(arena.mutex) {
    const bool debt = arena.in_debt;
    lock.unlock();
    if (debt) [[unlikely]] engine.settle_peak_debts();
    engine.after_operation();
  }

  // record_stream: the live allocation at `ptr` is used on `stream` too (its free waits for
  // that stream's work). Throws InvalidPointerError where nothing is live at `ptr`.
  template <typename E>
  static void record_stream(E& engine, DevicePtr ptr, StreamId stream) {
    if (auto* arena = engine.arena_of(ptr)) {
      Lock lock(arena->mutex);
      if (auto* block = arena->live.find(ptr)) {
        add_stream_use(block->stream_uses, arena->stream, stream);
        lock.unlock();
        engine.after_operation();
        return;
      }
    }
    engine.throw_not_live("record_stream", ptr);
  }

  // The size of the block handed out at `ptr`, or 0 where nothing is live there.
  template <typename E>
  static std::size_t allocation_size(const E& engine, DevicePtr ptr) {
    auto* arena = engine.arena_of(ptr);
    if (arena == nullptr) return 0;
    Lock lock(arena->mutex);
    const auto* block = arena->live.find(ptr);
    return block == nullptr ? 0 : block->size;
  }

  // f(arena, block) for the live allocation at `ptr` (pointers, never null), under its
  // arena's lock; its result. Throws InvalidPointerError for `what` where nothing is live at
  // `ptr`. shared_region() starts with it.
  template <typename E, typename F>
  static decltype(auto) with_live_block(const E& engine, DevicePtr ptr, const char* what,
                                        F&& f) {
    auto* arena = engine.arena_of(ptr);
    if (arena == nullptr) engine.throw_not_live(what, ptr);
    Lock lock(arena->mutex);
    const auto* block = arena->live.find(ptr);
    if (block == nullptr) engine.throw_not_live(what, ptr);
    return f(arena, block);
  }

  // The engine's arenas, in creation order (taken under the registry's lock).
  template <typename E>
  static auto arena_list(const E& engine) EXCLUDES(engine.registry_mutex_) {
    Lock lock(engine.registry_mutex_);
    std::vector<typename decltype(engine.arenas_)::value_type::element_type*> list;
    list.reserve(engine.arenas_.size());
    for (const auto& a : engine.arenas_)
      list.push_back(a.get());
    return list;
  }
};

}  // namespace ccalloc::core
