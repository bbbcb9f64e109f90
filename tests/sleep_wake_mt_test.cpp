// Sleep and wake under concurrency (docs/sleep-wake.md): one thread sleeps and wakes its
// sleepable pool again and again, checking its allocations' bytes after each wake, while
// other threads allocate and free on their own streams in the default pool and in private
// pools of their own (begin_allocate_to_pool ... end_allocate_to_pool), and one of them
// sleeps and wakes a second sleepable pool. Sleep and wake refuse while any capture is
// underway; the sleepers retry until no capture is. Invariants are checked after every
// operation. Run under ThreadSanitizer by scripts/test tsan (label "concurrency").
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/stats.hpp"

namespace ccalloc {
namespace {

constexpr std::size_t kGiB = 1024 * kMiB;

// Bytes that differ per seed and per offset. Built from one 64 KiB period, copied: the
// sanitizers instrument every store of a byte loop, and the 25 MiB blocks' patterns were
// most of this test's time under ThreadSanitizer. (i * 29 mod 256 repeats every 256 bytes.)
std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  constexpr std::size_t kPeriod = 64 * 1024;
  std::vector<unsigned char> out(n);
  const std::size_t head = std::min(n, kPeriod);
  for (std::size_t i = 0; i < head; ++i)
    out[i] = static_cast<unsigned char>((i * 29 + seed * 13) & 0xff);
  for (std::size_t at = head; at < n; at += kPeriod)
    std::memcpy(out.data() + at, out.data(), std::min(kPeriod, n - at));
  return out;
}

// Calls `f` until it does not fail for a capture underway elsewhere.
template <typename F>
void retry_while_capturing(F&& f) {
  for (;;) {
    try {
      f();
      return;
    } catch (const OutOfMemoryError&) {
      throw;
    } catch (const Error& e) {
      if (std::string(e.what()).find("is underway") == std::string::npos) throw;
      std::this_thread::yield();
    }
  }
}

// Sleeps and wakes `pool` `cycles` times; returns the number of allocations whose bytes
// differed after a wake.
int sleeper(Allocator& alloc, sim::SimDriver& driver, PoolId pool, StreamId stream, int cycles,
            unsigned seed) {
  alloc.create_sleepable_pool(pool);
  const std::vector<std::size_t> sizes = {4096, 3 * kMiB, 25 * kMiB};
  std::vector<DevicePtr> ptrs;
  retry_while_capturing(
      [&] { alloc.begin_allocate_to_pool(pool, [stream](StreamId s) { return s == stream; }); });
  for (const std::size_t n : sizes)
    ptrs.push_back(alloc.malloc(n, stream));
  alloc.end_allocate_to_pool(pool);
  int mismatches = 0;
  for (int c = 0; c < cycles; ++c) {
    for (std::size_t i = 0; i < ptrs.size(); ++i) {
      const auto bytes = pattern(sizes[i], seed + static_cast<unsigned>(c * 3 + i));
      driver.write(ptrs[i], bytes.data(), bytes.size());
    }
    const SleepMode mode = c % 3 == 2 ? SleepMode::kDiscard : SleepMode::kSave;
    retry_while_capturing([&] { alloc.sleep_pool(pool, mode); });
    if (!alloc.pool_asleep(pool)) ++mismatches;
    std::this_thread::yield();
    retry_while_capturing([&] { alloc.wake_pool(pool); });
    if (mode == SleepMode::kDiscard) continue;
    for (std::size_t i = 0; i < ptrs.size(); ++i) {
      std::vector<unsigned char> back(sizes[i]);
      driver.read(ptrs[i], back.data(), back.size());
      if (back != pattern(sizes[i], seed + static_cast<unsigned>(c * 3 + i))) ++mismatches;
    }
  }
  if (alloc.pool_live_allocations(pool) != ptrs) ++mismatches;
  for (const DevicePtr p : ptrs)
    alloc.free(p);
  return mismatches;
}

// Allocates and frees on `stream` in the default pool and, every few steps, in private
// pool `pool` while allocating to it.
void worker(Allocator& alloc, PoolId pool, StreamId stream, int steps, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::size_t> size(1, 12 * kMiB);
  std::vector<DevicePtr> live;
  for (int i = 0; i < steps; ++i) {
    if (i % 8 == 0) {
      retry_while_capturing([&] {
        alloc.begin_allocate_to_pool(pool, [stream](StreamId s) { return s == stream; });
      });
      const DevicePtr a = alloc.malloc(size(rng), stream);
      const DevicePtr b = alloc.malloc(size(rng) / 8 + 1, stream);
      alloc.end_allocate_to_pool(pool);
      alloc.free(a);
      live.push_back(b);
    }
    live.push_back(alloc.malloc(size(rng), stream));
    if (live.size() > 6) {
      const std::size_t k = rng() % live.size();
      alloc.free(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  for (const DevicePtr p : live)
    alloc.free(p);
}

TEST(SleepWakeMt, PoolsSleepAndWakeWhileOtherThreadsAllocateElsewhere) {
  sim::Options o;
  o.capacity = 8 * kGiB;
  sim::SimDriver driver(o);
  Allocator alloc(driver, Config::parse(""));
  alloc.set_check_invariants(true);

  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  threads.emplace_back([&] { mismatches += sleeper(alloc, driver, PoolId{0, 100}, 100, 12, 1); });
  threads.emplace_back([&] {
    // A worker that also sleeps a pool of its own, concurrently with the first sleeper.
    worker(alloc, PoolId{0, 201}, 201, 40, 7);
    mismatches += sleeper(alloc, driver, PoolId{0, 101}, 101, 6, 50);
  });
  for (unsigned t = 0; t < 3; ++t) {
    threads.emplace_back([&alloc, t] { worker(alloc, PoolId{0, 300 + t}, 300 + t, 120, 11 + t); });
  }
  for (std::thread& t : threads)
    t.join();

  EXPECT_EQ(mismatches.load(), 0);
  alloc.check_invariants();
  const DeviceStats s = alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].current, 0);
  EXPECT_EQ(s.active_bytes[kAggregate].current, 0);
  EXPECT_FALSE(alloc.pool_asleep(PoolId{0, 100}));
  EXPECT_FALSE(alloc.pool_asleep(PoolId{0, 101}));
  EXPECT_EQ(driver.host_bytes(), 0u);
  // Everything goes back once the pools are released.
  for (const PoolId id : {PoolId{0, 100}, PoolId{0, 101}, PoolId{0, 201}, PoolId{0, 300},
                          PoolId{0, 301}, PoolId{0, 302}}) {
    while (alloc.pool_use_count(id) > 0)
      alloc.release_pool(id);
  }
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, 0);
  EXPECT_EQ(driver.used_bytes(), 0u);
  const sim::Counters c = driver.counters();
  EXPECT_EQ(c.host_allocates, c.host_frees);
  EXPECT_EQ(c.reserve_calls, c.address_frees);
}

}  // namespace
}  // namespace ccalloc
