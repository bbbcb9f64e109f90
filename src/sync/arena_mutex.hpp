// The lock of an arena.
#pragma once

#include <atomic>
#include <cassert>
#include <cerrno>
#include <ctime>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <thread>
#endif

#include "sync/thread_annotations.hpp"

namespace ccalloc::core {

// The lock of an arena. An uncontended lock is one atomic read-modify-write and an unlock
// is a plain store followed by a plain load, both inline: an arena is locked by one thread
// at a time nearly always (its stream's), and the two read-modify-writes of a lock that
// announces its sleepers through the lock word (compare-exchange to lock, exchange to
// unlock) were half the hit path's atomic cost (docs/hot-path.md).
//
// A waiter spins briefly, then sleeps on the futex of the lock word; a holder may be inside
// a device call of tens of microseconds. Sleepers announce themselves in a counter of their
// own, which an unlock reads after releasing. Without a fence between that store and that
// load (the fence would cost what the exchange did) an unlock can miss a sleeper that
// announced itself at the same moment: so a sleeper never sleeps longer than kSleepSliceNs
// before it looks again. A missed wake-up costs at most that slice; mutual exclusion rests
// on the compare-exchange alone and is never at stake.
class CAPABILITY("mutex") ArenaMutex {
 public:
  // The longest a sleeper sleeps before it tries the lock again.
  static constexpr long kSleepSliceNs = 200'000;

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
    state_.store(0, std::memory_order_release);
    if (sleepers_.load(std::memory_order_relaxed) != 0) [[unlikely]]
      wake_one();
  }
  // Tells the analysis the lock is held where it cannot see the acquisition: a lock taken
  // through lock_all() or handed over in a std::unique_lock. Checks only that someone
  // holds it.
  void assert_held() const ASSERT_CAPABILITY(this) {
    assert(state_.load(std::memory_order_relaxed) != 0);
  }

 private:
  bool try_acquire() {
    int expected = 0;
    return state_.load(std::memory_order_relaxed) == 0 &&
           state_.compare_exchange_strong(expected, 1, std::memory_order_acquire);
  }

  [[gnu::noinline]] void lock_contended() {
    for (int spins = 0; spins < 100; ++spins) {
      pause();
      if (try_acquire()) return;
    }
    for (;;) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      // Tried after the announcement: an unlock that came before it is seen here; one that
      // comes after it wakes the sleeper, or, where it missed the announcement, the slice
      // ends the sleep.
      const bool taken = try_acquire();
      if (!taken) sleep_while_held();
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      if (taken || try_acquire()) return;
    }
  }

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // Sleeps while the lock word reads 1 (held), for one slice at most.
  void sleep_while_held() {
#if defined(__linux__)
    timespec slice{0, kSleepSliceNs};
    (void)syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAIT_PRIVATE, 1, &slice,
                  nullptr, 0);
#else
    std::this_thread::yield();
#endif
  }
  [[gnu::noinline]] void wake_one() {
#if defined(__linux__)
    (void)syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAKE_PRIVATE, 1, nullptr,
                  nullptr, 0);
#endif
  }

  std::atomic<int> state_{0};     // 0 free, 1 held
  std::atomic<int> sleepers_{0};  // threads inside or about to enter a sleep on state_
};

static_assert(sizeof(std::atomic<int>) == sizeof(int));

}  // namespace ccalloc::core
