// What the two engines that keep their blocks in per-stream arenas, core::Engine (src/native)
// and core::StitchEngine (src/stitch), do alike around an arena, written once: the end of an
// operation that held its arena's lock alone (debt read, lock released, peaks settled,
// invariants checked), record_stream, allocation_size and the lookup of a live allocation
// that shared_region starts with, the start of reconfigure() (the fixed keys, then the
// memory fraction where it changed), the peak ledger's settlement and reset, the invariant
// checkers' peaks_cover_current, the list of arenas, and the registration of OOM observers
// and free-memory callbacks.
//
// Each engine befriends ArenaEngine, whose function templates reach the members both name
// alike: arena_of(ptr), throw_not_live, after_operation, settle_peak_debts, ledger_shares,
// live_block(arena, ptr), AllArenasLock, joint_, config_, registry_mutex_, arenas_, device_mutex_,
// set_memory_fraction, observers_mutex_, oom_observers_, free_memory_callbacks_ and
// has_free_memory_callbacks_; and an arena's mutex, live index, stream and ledger (stats,
// debts, in_debt). They are inline templates: the hot path (malloc, free) pays no call and no
// indirection.
//
// Locks: each template states what it needs (sync/thread_annotations.hpp) in terms of its
// arguments, so clang's -Wthread-safety checks callers and bodies as before. An operation
// that moves its arena's lock into a std::unique_lock (which the analysis does not follow)
// tells it with arena.mutex.assert_held(); a callback that runs under an arena's lock
// asserts it again, as the analysis does not carry the caller's locks into a lambda.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "sync/arena_mutex.hpp"
#include "core/backend.hpp"
#include "core/common.hpp"
#include "core/peak_ledger.hpp"
#include "sync/thread_annotations.hpp"

namespace ccalloc::core {

struct ArenaEngine {
  // Unlocks the lock `lock` owns, inline (std::unique_lock::unlock's checks and call
  // spared: the caller owns it). The analysis cannot follow the lock through the unique_lock.
  [[gnu::always_inline]] static void release(std::unique_lock<ArenaMutex>& lock)
      NO_THREAD_SAFETY_ANALYSIS {
    lock.release()->unlock();
  }

  // The end of an operation that held `arena`'s lock alone, in `lock`: the arena's debt
  // read under the lock, the lock released, the device-wide peaks settled where the
  // operation left the arena in debt (every lock taken afresh: core/peak_ledger.hpp), and
  // the invariants checked where asked.
  template <typename E, typename A>
  [[gnu::always_inline]] static void finish(E& engine, A& arena,
                                            std::unique_lock<ArenaMutex>& lock)
      REQUIRES(arena.mutex) {
    const bool debt = arena.in_debt;
    release(lock);
    if (debt) [[unlikely]] engine.settle_peak_debts();
    engine.after_operation();
  }

  // record_stream: the live allocation at `ptr` is used on `stream` too (its free waits for
  // that stream's work). Throws InvalidPointerError where nothing is live at `ptr`.
  template <typename E>
  static void record_stream(E& engine, DevicePtr ptr, StreamId stream) {
    if (auto* arena = engine.arena_of(ptr)) {
      Lock lock(arena->mutex);
      if (auto* block = E::live_block(*arena, ptr)) {
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
    const auto* block = E::live_block(*arena, ptr);
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
    const auto* block = E::live_block(*arena, ptr);
    if (block == nullptr) engine.throw_not_live(what, ptr);
    return f(arena, block);
  }

  // reconfigure()'s first steps: the keys that cannot change are checked before anything
  // changes (ConfigError), then the memory fraction, which validates the value (a rejected
  // one changes nothing). Only a changed fraction is applied, so one set through
  // set_memory_fraction() stays otherwise.
  template <typename E>
  static void begin_reconfigure(E& engine, const Config& next) EXCLUDES(engine.device_mutex_) {
    check_fixed_keys(engine.config_, next);  // before anything changes
    double configured_fraction;
    {
      Lock device(engine.device_mutex_);
      configured_fraction = engine.config_.per_process_memory_fraction;
    }
    if (next.per_process_memory_fraction != configured_fraction) {
      engine.set_memory_fraction(next.per_process_memory_fraction);
    }
  }

  // Settles the debts of the engine's arenas (every arena lock held, in `all`), or, for an
  // engine settled together with another (JointSettlement), marks the settlement pending
  // where an arena is in debt.
  template <typename E, typename AllLock>
  static void settle_peak_debts(const E& engine, const AllLock& all) {
    const std::vector<LedgerShare> shares = engine.ledger_shares(all);
    if (engine.joint_ != nullptr) {
      if (in_debt(shares)) engine.joint_->mark();  // the owner settles both engines together
      return;
    }
    core::settle_peak_debts(shares);
  }

  // Every baseline of the arenas at its current, no debt left (reset_peak_stats; every arena
  // lock held, in `all`, whose held() tells the analysis).
  template <typename AllLock, typename Arenas>
  static void reset_peaks(const AllLock& all, const Arenas& arenas) {
    for (auto* arena : arenas) {
      all.held(*arena);
      sync_block_aggregates(arena->stats);  // the aggregates' currents first
      arena->stats.reset_peak();            // every baseline at its current
      arena->debts = PeakBaselines{};
      arena->in_debt = false;
    }
  }

  // The same, taking every arena lock (none held), where the engine settles alone; an engine
  // settled together with another marks the settlement pending, for the owner to settle.
  template <typename E>
  static void settle_peak_debts(const E& engine) {
    if (engine.joint_ != nullptr) {
      engine.joint_->mark();  // the owner settles both engines together
      return;
    }
    const typename E::AllArenasLock all(engine);
    engine.settle_peak_debts(all);
  }

  // Calls f with every arena's ledger share, under every arena lock.
  template <typename E>
  static void with_ledger_shares(const E& engine,
                                 const std::function<void(std::vector<LedgerShare>&)>& f) {
    const typename E::AllArenasLock all(engine);
    std::vector<LedgerShare> shares = engine.ledger_shares(all);
    f(shares);
  }

  // The invariant peaks_cover_current, over every arena (each lock held by the checker):
  // an arena not in peak debt is within its baselines (Stat::peak less its debt) and no debt
  // is negative; with no arena in debt, the device's peaks (the sums of the baselines) cover
  // its currents. `arena_at(element)` is the arena of an element of `arenas`. A violation is
  // reported, by the engine's own words, through
  // arena_violation(arena, j, current, baseline, debt, in_debt) for the j-th counter of an
  // arena (for_each_tracked's order) and device_violation(j, peak, current) for the device's.
  template <typename Range, typename ArenaAt, typename ArenaViolation, typename DeviceViolation>
  static void check_peaks_cover_current(const Range& arenas, ArenaAt&& arena_at,
                                        ArenaViolation&& arena_violation,
                                        DeviceViolation&& device_violation) {
    std::array<std::int64_t, kTrackedCounters> current_sum{};
    std::array<std::int64_t, kTrackedCounters> baseline_sum{};
    bool any_debt = false;
    for (const auto& element : arenas) {
      const auto* const arena = arena_at(element);
      arena->mutex.assert_held();  // the checker holds every arena lock
      const bool in_debt = arena->in_debt;
      any_debt = any_debt || in_debt;
      std::size_t j = 0;
      for_each_tracked(arena->stats, arena->debts, [&](const Stat& s, const std::int64_t& debt) {
        const std::int64_t baseline = s.peak - debt;
        current_sum[j] += s.current;
        baseline_sum[j] += baseline;
        if (debt < 0 || (!in_debt && (debt != 0 || s.current > baseline))) {
          arena_violation(*arena, j, s.current, baseline, debt, in_debt);
        }
        ++j;
      });
    }
    for (std::size_t j = 0; j < kTrackedCounters && !any_debt; ++j) {
      if (baseline_sum[j] < current_sum[j]) device_violation(j, baseline_sum[j], current_sum[j]);
    }
  }

  // Observers are kept under the engine's observers_mutex_ and copied out before they are
  // called without locks. The flag tells the OOM ladder that callbacks exist; `order` is
  // that of its store, which pairs with the ladder's load.
  template <typename E>
  static void add_oom_observer(E& engine, Allocator::OomObserver observer) {
    Lock lock(engine.observers_mutex_);
    engine.oom_observers_.push_back(std::move(observer));
  }
  template <typename E>
  static void add_free_memory_callback(E& engine, Allocator::FreeMemoryCallback callback,
                                       std::memory_order order) {
    Lock lock(engine.observers_mutex_);
    engine.free_memory_callbacks_.push_back(std::move(callback));
    engine.has_free_memory_callbacks_.store(true, order);
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
