// The stitching policy (src/stitch/engine.hpp) under concurrency (label "concurrency":
// run under ThreadSanitizer). Its hot path takes only the stream's arena lock, growth the
// device lock too, and the GC / OOM ladder / stats / invariant checker every lock.
//   * Phased threads, each on its own stream: within a phase every counter moves one way,
//     so the true device-wide peak is known at each barrier; the peaks must equal it
//     exactly (the baseline ledger, core/peak_ledger.hpp) while an inspector thread reads
//     the stats and runs the invariant checker.
//   * A device too small for every thread at once: growth, lending, the GC threshold and the
//     OOM ladder run concurrently with other streams' hot paths and with empty_cache; the
//     state stays consistent and everything is returned at the end.
//   * record_stream frees waiting for events, completed by other threads' mallocs.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "stitch/engine.hpp"

namespace ccalloc {
namespace {

using core::StitchEngine;

constexpr int kThreads = 8;
constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr const char* kStitch = "ccalloc,stitch_segments:True";

sim::Options device_of(std::size_t capacity) {
  sim::Options o;
  o.capacity = capacity;
  return o;
}

struct Held {
  DevicePtr ptr;
  std::int64_t size;       // block size
  std::int64_t requested;  // request
};

void ExpectPeaksCoverCurrent(const DeviceStats& s) {
  for (const StatArray* a : {&s.allocation, &s.active, &s.allocated_bytes, &s.active_bytes,
                             &s.requested_bytes, &s.reserved_bytes, &s.segment}) {
    for (int t = 0; t < 3; ++t)
      EXPECT_GE((*a)[t].peak, (*a)[t].current);
  }
}

// Memory returned: no block, no piece (empty_cache releases every handle once nothing is
// live).
void ExpectAllReturned(StitchEngine& engine) {
  engine.empty_cache();
  const DeviceStats s = engine.stats();
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(s.allocation[t].current, 0);
    EXPECT_EQ(s.active[t].current, 0);
    EXPECT_EQ(s.allocated_bytes[t].current, 0);
    EXPECT_EQ(s.active_bytes[t].current, 0);
    EXPECT_EQ(s.requested_bytes[t].current, 0);
    EXPECT_EQ(s.reserved_bytes[t].current, 0);
    EXPECT_EQ(s.segment[t].current, 0);
  }
  const StitchEngine::PieceCounts pieces = engine.piece_counts();
  EXPECT_EQ(pieces.total, 0u);
  EXPECT_EQ(pieces.dead_pages, 0u);
  EXPECT_TRUE(engine.segments().empty());
  engine.check_invariants();
}

TEST(StitchMt, PhasedThreadsOnTheirOwnStreamsGiveTheExactPeak) {
  sim::SimDriver gpu(device_of(4ull << 30));
  StitchEngine engine(gpu, Config::parse(kStitch));
  std::array<std::vector<Held>, kThreads> held;  // held[t]: blocks of thread t's stream
  std::barrier sync(kThreads);
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};

  struct Sums {
    std::int64_t allocation = 0, bytes = 0, requested = 0;
    std::int64_t small_bytes = 0, large_bytes = 0;
  };
  Sums expected_peak;
  const auto sum_held = [&] {
    // A block counts in its segment's pool: a small request served in an island of a large
    // space counts in the large pool.
    std::map<DevicePtr, bool> small_segment;
    for (const auto& seg : engine.segments()) {
      for (const auto& b : seg.blocks)
        small_segment[b.address] = seg.is_small;
    }
    Sums s;
    for (const auto& h : held) {
      for (const Held& b : h) {
        s.allocation += 1;
        s.bytes += b.size;
        s.requested += b.requested;
        (small_segment.at(b.ptr) ? s.small_bytes : s.large_bytes) += b.size;
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
    expected_peak.small_bytes = std::max(expected_peak.small_bytes, now.small_bytes);
    expected_peak.large_bytes = std::max(expected_peak.large_bytes, now.large_bytes);
    const DeviceStats s = engine.stats();
    const std::string where = std::string("round ") + std::to_string(round) + " " + phase;
    EXPECT_EQ(s.allocation[kAggregate].current, now.allocation) << where;
    EXPECT_EQ(s.allocated_bytes[kAggregate].current, now.bytes) << where;
    EXPECT_EQ(s.active_bytes[kAggregate].current, now.bytes) << where;
    EXPECT_EQ(s.requested_bytes[kAggregate].current, now.requested) << where;
    EXPECT_EQ(s.allocated_bytes[kSmallPool].current, now.small_bytes) << where;
    EXPECT_EQ(s.allocated_bytes[kLargePool].current, now.large_bytes) << where;
    EXPECT_EQ(s.allocation[kAggregate].peak, expected_peak.allocation) << where;
    EXPECT_EQ(s.active[kAggregate].peak, expected_peak.allocation) << where;
    EXPECT_EQ(s.allocated_bytes[kAggregate].peak, expected_peak.bytes) << where;
    EXPECT_EQ(s.active_bytes[kAggregate].peak, expected_peak.bytes) << where;
    EXPECT_EQ(s.requested_bytes[kAggregate].peak, expected_peak.requested) << where;
    EXPECT_EQ(s.allocated_bytes[kSmallPool].peak, expected_peak.small_bytes) << where;
    EXPECT_EQ(s.allocated_bytes[kLargePool].peak, expected_peak.large_bytes) << where;
    engine.check_invariants();  // includes: stats equal a recount, peaks cover currents
    if (::testing::Test::HasFailure()) failures.fetch_add(1);
    if (round % 4 == 3 && std::string(phase) == "shrink") {
      engine.reset_peak_stats();
      expected_peak = now;
    }
  };

  constexpr int kRounds = 10;
  const auto worker = [&](int t) {
    std::mt19937 rng(static_cast<std::uint32_t>(300 + t));
    const StreamId stream = static_cast<StreamId>(10 + t);
    for (int round = 0; round < kRounds; ++round) {
      // Grow: small and large blocks, so the spaces grow, stitch and lend.
      const int n = 2 + static_cast<int>(rng() % 6) + (round % 3) * 3;
      for (int i = 0; i < n; ++i) {
        const std::size_t size = rng() % 3 == 0 ? 1 + rng() % (12 * kMiB) : 1 + rng() % kMiB;
        const DevicePtr p = engine.malloc(size, stream);
        const auto block = static_cast<std::int64_t>(engine.allocation_size(p));
        held[static_cast<std::size_t>(t)].push_back(
            Held{p, block, static_cast<std::int64_t>(size)});
      }
      sync.arrive_and_wait();
      if (t == 0) check(round, "grow");
      sync.arrive_and_wait();
      // Shrink: free most of the neighbour's blocks (frees on another thread than the
      // malloc, into another stream's arena), then keep the rest.
      auto& theirs = held[static_cast<std::size_t>((t + 1) % kThreads)];
      sync.arrive_and_wait();
      std::vector<Held> keep;
      for (const Held& b : theirs) {
        if (rng() % 4 == 0) {
          keep.push_back(b);
        } else {
          engine.free(b.ptr);
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
      ExpectPeaksCoverCurrent(engine.stats());
      engine.check_invariants();
      (void)engine.segments();
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
      engine.free(b.ptr);
  }
  ExpectAllReturned(engine);
}

// 8 threads on a 64 MiB device: growth competes for pieces, the GC threshold and the OOM
// ladder release other streams' cache while those streams run their hot paths, and a ninth
// thread empties the cache. Out-of-memory errors are expected; the state must stay
// consistent throughout (the checker runs after every operation) and every byte held
// must be accounted for.
TEST(StitchMt, GrowthLendingAndTheOomLadderRaceWithTheHotPath) {
  sim::SimDriver gpu(device_of(64 * kMiB));
  StitchEngine engine(
      gpu, Config::parse("ccalloc,stitch_segments:True,garbage_collection_threshold:0.8"));
  engine.set_check_invariants(true);
  std::atomic<int> ooms{0};
  std::atomic<bool> done{false};
  std::atomic<int> freed_by_callback{0};
  engine.add_free_memory_callback([&] {
    freed_by_callback.fetch_add(1);
    return false;
  });
  const auto worker = [&](int t) {
    std::mt19937 rng(static_cast<std::uint32_t>(700 + t));
    const StreamId stream = static_cast<StreamId>(t + 1);
    std::vector<DevicePtr> mine;
    for (int i = 0; i < 400; ++i) {
      if (!mine.empty() && (rng() % 3 == 0 || mine.size() > 10)) {
        const std::size_t k = rng() % mine.size();
        engine.free(mine[k]);
        mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
        continue;
      }
      const std::size_t size = rng() % 2 == 0 ? 1 + rng() % (6 * kMiB) : 1 + rng() % (64 * 1024);
      try {
        mine.push_back(engine.malloc(size, stream));
      } catch (const OutOfMemoryError&) {
        ooms.fetch_add(1);
      }
    }
    for (const DevicePtr p : mine)
      engine.free(p);
  };
  std::thread emptier([&] {
    while (!done.load()) {
      engine.empty_cache();
      ExpectPeaksCoverCurrent(engine.stats());
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back(worker, t);
  for (auto& th : threads)
    th.join();
  done.store(true);
  emptier.join();
  const DeviceStats s = engine.stats();
  EXPECT_EQ(s.num_ooms, ooms.load());
  // Each OOM passed the free-memory callbacks and released the cache first.
  EXPECT_GE(freed_by_callback.load(), ooms.load());
  EXPECT_GE(s.num_alloc_retries, s.num_ooms);
  EXPECT_LE(s.reserved_bytes[kAggregate].peak, static_cast<std::int64_t>(64 * kMiB));
  ExpectAllReturned(engine);
}

// Blocks used on other streams: each thread frees blocks another stream used, so frees
// record events and the blocks return when other threads' mallocs poll them. The simulated
// events complete as soon as they are recorded, so the last malloc completes every free.
TEST(StitchMt, RecordStreamFreesCompleteUnderOtherThreadsMallocs) {
  sim::Options device = device_of(1ull << 30);
  device.events_complete_immediately = true;
  sim::SimDriver gpu(device);
  StitchEngine engine(gpu, Config::parse(kStitch));
  engine.set_check_invariants(true);
  std::barrier sync(kThreads);
  const auto worker = [&](int t) {
    std::mt19937 rng(static_cast<std::uint32_t>(900 + t));
    const StreamId stream = static_cast<StreamId>(100 + t);
    const StreamId other = static_cast<StreamId>(100 + (t + 1) % kThreads);
    for (int round = 0; round < 4; ++round) {
      std::vector<DevicePtr> mine;
      for (int i = 0; i < 40; ++i) {
        const DevicePtr p = engine.malloc(1 + rng() % (2 * kMiB), stream);
        if (i % 2 == 0) engine.record_stream(p, other);
        mine.push_back(p);
      }
      for (const DevicePtr p : mine)
        engine.free(p);
      sync.arrive_and_wait();
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back(worker, t);
  for (auto& th : threads)
    th.join();
  // A malloc polls the events: every pending free completes and is counted.
  engine.free(engine.malloc(512, 100));
  const DeviceStats s = engine.stats();
  EXPECT_EQ(s.active[kAggregate].current, 0);
  EXPECT_EQ(s.active_bytes[kAggregate].current, 0);
  EXPECT_EQ(s.allocation[kAggregate].allocated, s.allocation[kAggregate].freed);
  EXPECT_EQ(s.active[kAggregate].allocated, s.active[kAggregate].freed);
  EXPECT_EQ(s.num_sync_all_streams, 0);
  ExpectAllReturned(engine);
}

}  // namespace
}  // namespace ccalloc
