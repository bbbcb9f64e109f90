// The arena lock (sync/arena_mutex.hpp): mutual exclusion with spinning and sleeping
// waiters, try_lock, and waiters that sleep while the holder is away for longer than the
// spin phase lasts.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "sync/arena_mutex.hpp"

namespace ccalloc::core {
namespace {

// Threads increment plain counters under the lock; some holders stay for a while, so that
// the others go through the spin phase into a sleep and are woken (or look again after a
// slice). Any lapse of exclusion loses increments or breaks the pair's equality.
TEST(ArenaMutex, ExcludesWithSpinningAndSleepingWaiters) {
  ArenaMutex mutex;
  long first = 0;
  long second = 0;
  std::atomic<int> inside{0};
  std::atomic<int> overlaps{0};
  constexpr int kThreads = 6;
  constexpr int kRounds = 4000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        std::lock_guard lock(mutex);
        if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
        ++first;
        if ((i + t) % 500 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));
        ++second;
        inside.fetch_sub(1);
      }
    });
  }
  for (auto& th : threads)
    th.join();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(first, long{kThreads} * kRounds);
  EXPECT_EQ(second, first);
}

TEST(ArenaMutex, TryLockFailsWhileHeldAndSucceedsAfter) {
  ArenaMutex mutex;
  ASSERT_TRUE(mutex.try_lock());
  std::atomic<bool> other{true};
  std::thread([&] { other = mutex.try_lock(); }).join();
  EXPECT_FALSE(other.load());
  mutex.unlock();
  std::thread([&] {
    other = mutex.try_lock();
    if (other) mutex.unlock();
  }).join();
  EXPECT_TRUE(other.load());
}

// Waiters that find the lock held far longer than their spins all sleep, and each gets the
// lock once it is free: the holder's release is seen by every one of them, in turn.
TEST(ArenaMutex, SleepersGetTheLockAfterALongHold) {
  ArenaMutex mutex;
  mutex.lock();
  std::atomic<int> started{0};
  std::vector<int> order;
  std::vector<std::thread> waiters;
  for (int t = 0; t < 4; ++t) {
    waiters.emplace_back([&, t] {
      started.fetch_add(1);
      std::lock_guard lock(mutex);
      order.push_back(t);
    });
  }
  while (started.load() != 4)
    std::this_thread::yield();
  // Several sleep slices: the waiters are asleep (or between slices) when the lock frees.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_TRUE(order.empty());
  mutex.unlock();
  for (auto& th : waiters)
    th.join();
  ASSERT_EQ(order.size(), 4u);
  std::vector<int> seen(4, 0);
  for (const int t : order)
    ++seen[static_cast<std::size_t>(t)];
  EXPECT_EQ(seen, std::vector<int>(4, 1));
  // And the lock is free again.
  EXPECT_TRUE(mutex.try_lock());
  mutex.unlock();
}

}  // namespace
}  // namespace ccalloc::core
