// The lock of an arena.
#pragma once

#include <atomic>
#include <cassert>

#include "core/thread_annotations.hpp"

namespace ccalloc::core {

// The lock of an arena: uncontended lock and unlock are one atomic read-modify-write each
// and stay inline; a waiter spins briefly, then sleeps on the futex (a holder may be
// inside a device call of tens of microseconds). States: 0 free, 1 held, 2 held with
// sleepers.
class CAPABILITY("mutex") ArenaMutex {
 public:
  void lock() ACQUIRE() {
    int expected = 0;
    if (state_.compare_exchange_strong(expected, 1, std::memory_order_acquire)) return;
    lock_contended();
  }
  bool try_lock() TRY_ACQUIRE(true) {
    int expected = 0;
    return state_.compare_exchange_strong(expected, 1, std::memory_order_acquire);
  }
  void unlock() RELEASE() {
    if (state_.exchange(0, std::memory_order_release) == 2) state_.notify_one();
  }
  // Tells the analysis the lock is held where it cannot see the acquisition: a lock taken
  // through lock_all() or handed over in a std::unique_lock. Checks only that someone
  // holds it.
  void assert_held() const ASSERT_CAPABILITY(this) {
    assert(state_.load(std::memory_order_relaxed) != 0);
  }

 private:
  void lock_contended() {
    for (int spins = 0; spins < 100; ++spins) {
      __builtin_ia32_pause();
      int expected = 0;
      if (state_.load(std::memory_order_relaxed) == 0 &&
          state_.compare_exchange_strong(expected, 1, std::memory_order_acquire)) {
        return;
      }
    }
    // Announce a sleeper (2) whenever taking the lock, so the unlock that follows wakes the
    // next one.
    while (state_.exchange(2, std::memory_order_acquire) != 0)
      state_.wait(2);
  }

  std::atomic<int> state_{0};
};

}  // namespace ccalloc::core
