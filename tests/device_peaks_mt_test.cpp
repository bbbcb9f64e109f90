// Device-wide peaks under concurrency (label "concurrency": run under ThreadSanitizer).
// Worker threads, each on its own stream, move in phases separated by barriers: in a growing
// phase every thread only allocates, in a shrinking phase every thread only frees (blocks of
// its own and of its neighbour's stream). Within a phase every counter moves one way, so
// whatever the interleaving the true peak is known at each barrier: the maximum of the
// sums seen at the barriers. An inspector thread meanwhile reads the statistics (no peak
// below its current value) and runs the invariant checker.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"

namespace ccalloc {
namespace {

constexpr int kThreads = 8;
constexpr int kRounds = 12;

struct Held {
  DevicePtr ptr;
  std::int64_t size;       // block size
  std::int64_t requested;  // request
};

// The modelled counters: allocation, allocated_bytes, active_bytes, requested_bytes
// (aggregate). Active equals allocated here: no block is used on another stream.
struct Sums {
  std::int64_t allocation = 0, bytes = 0, requested = 0;
};

void ExpectPeaksCoverCurrent(const DeviceStats& s) {
  for (const StatArray* a : {&s.allocation, &s.active, &s.inactive_split, &s.allocated_bytes,
                             &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
    for (int t = 0; t < 3; ++t)
      EXPECT_GE((*a)[t].peak, (*a)[t].current);
  }
  EXPECT_GE(s.oversize_allocations.peak, s.oversize_allocations.current);
}

// Under PyTorch's policy one engine holds every block. Under the `ccalloc` preset the odd
// threads' streams allocate to a private pool (a MemPool), so the stitching engine and the
// private pools' engine both hold blocks and settle their peaks together.
class DevicePeaksMt : public ::testing::TestWithParam<std::string> {};

TEST_P(DevicePeaksMt, PhasedThreadsOnTheirOwnStreamsGiveTheExactPeak) {
  sim::SimDriver gpu;
  Allocator alloc(gpu, Config::parse(GetParam()));
  const bool pooled = GetParam() == "ccalloc";
  const PoolId pool{0, 1};
  if (pooled) {
    alloc.create_pool(pool);
    alloc.begin_allocate_to_pool(pool, [](StreamId s) { return s >= 10 && s % 2 == 1; });
  }
  std::array<std::vector<Held>, kThreads> held;  // held[t]: blocks of thread t's stream
  std::barrier sync(kThreads);
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};

  Sums expected_peak;
  const auto sum_held = [&] {
    Sums s;
    for (const auto& h : held) {
      for (const Held& b : h) {
        s.allocation += 1;
        s.bytes += b.size;
        s.requested += b.requested;
      }
    }
    return s;
  };
  // Runs at each barrier on thread 0 while the others wait at the next one.
  const auto check = [&](int round, const char* phase) {
    const Sums now = sum_held();
    expected_peak.allocation = std::max(expected_peak.allocation, now.allocation);
    expected_peak.bytes = std::max(expected_peak.bytes, now.bytes);
    expected_peak.requested = std::max(expected_peak.requested, now.requested);
    const DeviceStats s = alloc.stats();
    const std::string where = "round " + std::to_string(round) + " " + phase;
    EXPECT_EQ(s.allocation[kAggregate].current, now.allocation) << where;
    EXPECT_EQ(s.allocated_bytes[kAggregate].current, now.bytes) << where;
    EXPECT_EQ(s.requested_bytes[kAggregate].current, now.requested) << where;
    EXPECT_EQ(s.allocation[kAggregate].peak, expected_peak.allocation) << where;
    EXPECT_EQ(s.active[kAggregate].peak, expected_peak.allocation) << where;
    EXPECT_EQ(s.allocated_bytes[kAggregate].peak, expected_peak.bytes) << where;
    EXPECT_EQ(s.active_bytes[kAggregate].peak, expected_peak.bytes) << where;
    EXPECT_EQ(s.requested_bytes[kAggregate].peak, expected_peak.requested) << where;
    alloc.check_invariants();
    if (::testing::Test::HasFailure()) failures.fetch_add(1);
    if (round % 4 == 3 && std::string(phase) == "shrink") {
      alloc.reset_peak_stats();
      expected_peak = now;
    }
  };

  const auto worker = [&](int t) {
    std::mt19937 rng(static_cast<std::uint32_t>(100 + t));
    const StreamId stream = static_cast<StreamId>(10 + t);
    for (int round = 0; round < kRounds; ++round) {
      // Grow: allocate a round-dependent number of blocks, small and large.
      const int n = 2 + static_cast<int>(rng() % 6) + (round % 3) * 3;
      for (int i = 0; i < n; ++i) {
        const std::size_t size = rng() % 3 == 0 ? 1 + rng() % (12u << 20) : 1 + rng() % (1u << 20);
        const DevicePtr p = alloc.malloc(size, stream);
        if ((alloc.segment_pool(p) == pool) != (pooled && t % 2 == 1)) failures.fetch_add(1);
        held[static_cast<std::size_t>(t)].push_back(
            Held{p, static_cast<std::int64_t>(alloc.allocation_size(p)),
                 static_cast<std::int64_t>(size)});
      }
      sync.arrive_and_wait();
      if (t == 0) check(round, "grow");
      sync.arrive_and_wait();
      // Shrink: free most of the neighbour's blocks (frees on another thread than the
      // malloc), then some of one's own. Each list has one writer per phase.
      auto& theirs = held[static_cast<std::size_t>((t + 1) % kThreads)];
      sync.arrive_and_wait();  // everyone has finished reading its own list
      std::vector<Held> keep;
      for (const Held& b : theirs) {
        if (rng() % 4 == 0) {
          keep.push_back(b);
        } else {
          alloc.free(b.ptr);
        }
      }
      theirs = std::move(keep);
      sync.arrive_and_wait();
      if (t == 0) check(round, "shrink");
      sync.arrive_and_wait();
    }
  };

  std::thread inspector([&] {
    while (!done.load()) {
      ExpectPeaksCoverCurrent(alloc.stats());
      alloc.check_invariants();
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back(worker, t);
  for (auto& th : threads)
    th.join();
  done.store(true);
  inspector.join();
  EXPECT_EQ(failures.load(), 0);

  for (const auto& h : held) {
    for (const Held& b : h)
      alloc.free(b.ptr);
  }
  if (pooled) {
    alloc.end_allocate_to_pool(pool);
    alloc.release_pool(pool);
  }
  const DeviceStats s = alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].current, 0);
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, expected_peak.bytes);
  ExpectPeaksCoverCurrent(s);
}

INSTANTIATE_TEST_SUITE_P(Presets, DevicePeaksMt, ::testing::Values("pytorch", "ccalloc"));

// Threads hammering their own streams with malloc/free pairs: the peak of each counter is
// between the largest current seen at quiescent points and the sum of each stream's own
// maximum, and never below the current value.
TEST(DevicePeaksPairsMt, ConcurrentPairsKeepPeaksWithinBounds) {
  sim::SimDriver gpu;
  Allocator alloc(gpu, Config::parse("pytorch"));
  alloc.set_check_invariants(true);
  constexpr std::int64_t kBlock = 512;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const StreamId stream = static_cast<StreamId>(20 + t);
      for (int i = 0; i < 300; ++i) {
        const DevicePtr a = alloc.malloc(kBlock, stream);
        const DevicePtr b = alloc.malloc(kBlock, stream);
        alloc.free(a);
        alloc.free(b);
        if (i % 50 == 0) ExpectPeaksCoverCurrent(alloc.stats());
      }
    });
  }
  for (auto& th : threads)
    th.join();
  const DeviceStats s = alloc.stats();
  // Each stream holds at most two blocks at once.
  EXPECT_GE(s.allocation[kAggregate].peak, 2);
  EXPECT_LE(s.allocation[kAggregate].peak, 2 * kThreads);
  EXPECT_LE(s.allocated_bytes[kAggregate].peak, 2 * kThreads * kBlock);
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak % kBlock, 0);
  EXPECT_EQ(s.allocation[kAggregate].current, 0);
  ExpectPeaksCoverCurrent(s);
}

}  // namespace
}  // namespace ccalloc
