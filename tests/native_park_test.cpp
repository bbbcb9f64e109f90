// The native engine's one-block cache (native/engine.cpp, park()): a free that parks its
// block and a malloc that takes it back must do what PyTorch's pools alone would. Each test
// runs the same calls on two engines over two identical simulated GPUs, one of them with
// parking off, and compares every address and OOM, the statistics with their peaks, the
// segments with every block (the stale requested size of free blocks included) and the
// driver's calls.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "native/engine.hpp"
#include "park_pair.hpp"

namespace ccalloc::core {

struct EngineTestAccess {
  static void set_parking(Engine& e, bool on) { e.parking_ = on; }
  // The stream's parked block's address (0: none).
  static DevicePtr parked(Engine& e, StreamId stream) NO_THREAD_SAFETY_ANALYSIS {
    const Block* b = e.arena_for(stream).parked;
    return b == nullptr ? 0 : b->ptr;
  }
};

}  // namespace ccalloc::core

namespace {

using ccalloc::DevicePtr;
using ccalloc::StreamId;
using ccalloc::core::Engine;
using Access = ccalloc::core::EngineTestAccess;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Two native engines, parking on and off (park_pair.hpp); large: above 1 MiB.
struct Pair : ccalloc::test::ParkPair<Engine, Access> {
  explicit Pair(std::size_t capacity, const char* config = "pytorch")
      : ParkPair(capacity, config, kMiB) {}
  // Everything a caller can see, the stale requested sizes of free blocks included, and the
  // parking engine's invariants.
  void expect_same() {
    expect_same_views([](const ccalloc::SegmentInfo& a, const ccalloc::SegmentInfo& b) {
      EXPECT_EQ(a.requested_size, b.requested_size);
      for (std::size_t j = 0; j < a.blocks.size(); ++j) {
        EXPECT_EQ(a.blocks[j].requested_size, b.blocks[j].requested_size)
            << "block " << j << " of the segment at " << a.address;
      }
    });
    parked.check_invariants();
  }
};

TEST(NativePark, AFreedBlockIsParkedAndTakenBackByTheNextRequestOfItsSize) {
  Pair p(64 * kMiB);
  const DevicePtr a = p.malloc(512, 0);
  p.free(a);
  EXPECT_EQ(Access::parked(p.parked, 0), a);
  EXPECT_EQ(p.malloc(512, 0), a);
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  EXPECT_EQ(p.takes, 1);
  p.expect_same();
}

// A request of the same rounded size may ask for more bytes than the parked block's: the
// take checks the requested bytes' peak.
TEST(NativePark, ATakeThatAsksForMoreBytesRaisesTheRequestedPeak) {
  Pair p(64 * kMiB);
  p.expect_take_raises_requested_peak();
  p.expect_same();
}

// The park leaves the allocation, active, requested and oversize counts as they were and
// the take changes none of them: what the pairs add to their cumulative counts is added
// when the statistics are read, exactly as the pools' frees and mallocs would count them.
TEST(NativePark, PairsOfParkAndTakeAddToTheCumulativeCounts) {
  Pair p(160 * kMiB, "pytorch,max_split_size_mb:24");
  const DevicePtr big = p.malloc(26 * kMiB, 0);  // oversize: a segment of its own
  const DevicePtr small = p.malloc(4096, 0);
  for (int i = 0; i < 3; ++i) {
    p.free(big);
    ASSERT_EQ(Access::parked(p.parked, 0), big);
    ASSERT_EQ(p.malloc(26 * kMiB, 0), big);
    p.free(small);
    ASSERT_EQ(Access::parked(p.parked, 0), small);
    ASSERT_EQ(p.malloc(4096, 0), small);
  }
  EXPECT_EQ(p.takes, 6);
  const auto stats = p.parked.stats();
  EXPECT_EQ(stats.allocation[ccalloc::kAggregate].allocated, 8);
  EXPECT_EQ(stats.allocation[ccalloc::kAggregate].freed, 6);
  EXPECT_EQ(stats.oversize_allocations.allocated, 4);
  EXPECT_EQ(stats.oversize_allocations.freed, 3);
  EXPECT_EQ(stats.oversize_allocations.current, 1);
  EXPECT_EQ(stats.requested_bytes[ccalloc::kSmallPool].allocated, 4 * 4096);
  EXPECT_EQ(stats.active_bytes[ccalloc::kLargePool].freed, 3 * 26 * static_cast<long>(kMiB));
  p.expect_same();
}

// A reset of the cumulative counts while a block is parked clears its free and its takes
// too, as it clears the pools' counts of them.
TEST(NativePark, AResetWhileParkedClearsTheParkedBlocksCounts) {
  Pair p(64 * kMiB);
  const DevicePtr a = p.malloc(4096, 0);
  p.free(a);
  ASSERT_EQ(p.malloc(4096, 0), a);
  p.free(a);
  ASSERT_EQ(Access::parked(p.parked, 0), a);
  p.parked.reset_accumulated_stats();
  p.pooled.reset_accumulated_stats();
  p.malloc(8192, 0);  // pools the parked block
  const auto stats = p.parked.stats();
  EXPECT_EQ(stats.allocation[ccalloc::kAggregate].allocated, 1);
  EXPECT_EQ(stats.allocation[ccalloc::kAggregate].freed, 0);
  p.expect_same();
}

TEST(NativePark, StatisticsReadWhileParkedAreThoseOfThePools) {
  Pair p(64 * kMiB);
  const DevicePtr a = p.malloc(4096, 0);
  p.free(a);
  ASSERT_EQ(Access::parked(p.parked, 0), a);
  // stats() pools the parked block first: the inactive split block is the segment's
  // whole free rest.
  const auto stats = p.parked.stats();
  EXPECT_EQ(stats.allocated_bytes[ccalloc::kAggregate].current, 0);
  EXPECT_EQ(stats.inactive_split[ccalloc::kAggregate].current, 0);  // the whole segment
  EXPECT_EQ(stats.inactive_split_bytes[ccalloc::kAggregate].peak, 2 * kMiB - 4096);
  EXPECT_EQ(stats, p.pooled.stats());
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  p.expect_same();
}

// A park that raises a peak (here of the inactive split blocks) leaves the arena in peak
// debt, which the engine settles under every arena lock before the free returns: the block
// is pooled at once. Once the peaks stand, the same free stays parked.
TEST(NativePark, AParkThatRaisesAPeakIsPooledAtOnce) {
  Pair p(64 * kMiB);
  const DevicePtr x = p.malloc(1024, 0);
  p.malloc(512, 0);
  p.free(x);  // x and the segment's rest: two inactive split blocks, a new peak
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  EXPECT_EQ(p.malloc(1024, 0), x);
  p.free(x);  // the same two: no new peak
  EXPECT_EQ(Access::parked(p.parked, 0), x);
  p.expect_same();
}

TEST(NativePark, ARequestThatBestFitServesElsewhereTakesItsBestFit) {
  Pair p(64 * kMiB);
  // [x 1024][y 512][a 512][z 512][rest]; a first round of frees sets the peaks.
  const DevicePtr x = p.malloc(1024, 0);
  p.malloc(512, 0);
  const DevicePtr a = p.malloc(512, 0);
  p.malloc(512, 0);
  for (int round = 0; round < 2; ++round) {
    p.free(x);
    p.free(a);  // parks a, pools x (the last parked goes to its pool)
    EXPECT_EQ(Access::parked(p.parked, 0), round == 0 ? 0u : a);
    EXPECT_EQ(p.malloc(512, 0), a);  // a, pooled, is the best fit: taken back
    p.free(a);
    EXPECT_EQ(p.malloc(1024, 0), x);  // a does not fit: pooled first, best fit is x
    EXPECT_EQ(Access::parked(p.parked, 0), 0u);
    EXPECT_EQ(p.malloc(512, 0), a);
  }
  EXPECT_EQ(p.takes, 1);
  p.expect_same();
}

TEST(NativePark, AFreeWhoseMergesReachTheParkedBlockPoolsItFirst) {
  Pair p(64 * kMiB);
  // [a][b][c][d][rest]; a first free and malloc of a set the peaks.
  const DevicePtr a = p.malloc(512, 0);
  const DevicePtr b = p.malloc(512, 0);
  const DevicePtr c = p.malloc(512, 0);
  const DevicePtr d = p.malloc(512, 0);
  p.free(a);
  EXPECT_EQ(p.malloc(512, 0), a);
  p.free(a);
  EXPECT_EQ(Access::parked(p.parked, 0), a);
  p.free(b);  // merges with a: a is pooled first
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  EXPECT_EQ(p.malloc(1024, 0), a);
  p.expect_same();
  // The same from the other side: c parked, d freed after it.
  p.free(c);
  EXPECT_EQ(Access::parked(p.parked, 0), c);
  p.free(d);
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  p.expect_same();
}

TEST(NativePark, AFreeAfterTheFreeBlockAfterTheParkedOneKeepsTheRequestedSizesOfThePools) {
  Pair p(64 * kMiB);
  // [b 512][n 1024][m 1536][rest]: n freed, then b (parked; pooled it would merge with n),
  // then m, used on stream 1: its free completes when a malloc on stream 1 finds stream 1's
  // work done. m then merges with n, which the pools hold merged with b: b is pooled first,
  // so that the merged block's stale requested size is m's, as in the pools.
  const DevicePtr b = p.malloc(512, 0);
  const DevicePtr n = p.malloc(1024, 0);
  const DevicePtr m = p.malloc(1536, 0);
  p.record_stream(m, 1);
  p.free(n);
  p.free(b);
  EXPECT_EQ(Access::parked(p.parked, 0), b);
  p.free(m);  // waits for stream 1
  EXPECT_EQ(Access::parked(p.parked, 0), b);
  p.complete_stream(1);
  p.malloc(512, 1);  // completes m's free
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  p.expect_same();
}

// Between the park and the take, another free (here one that waited for stream 1) raised
// a statistic the park had lowered: the take must check the peaks again. [X][Y][rest] in a
// large segment (X freed and taken once: two inactive split blocks at the peak), [B][rest]
// in a small one. B's park makes its segment whole (one inactive split block fewer), X's
// free makes X one more (two, as at the peak), and B's take adds the small rest again:
// three, a new peak.
TEST(NativePark, ATakeAfterAnotherChangeOfTheStatisticsChecksThePeaks) {
  Pair p(64 * kMiB);
  const DevicePtr x = p.malloc(2 * kMiB + 512, 0);
  p.malloc(2 * kMiB, 0);
  p.free(x);
  EXPECT_EQ(p.malloc(2 * kMiB + 512, 0), x);
  const DevicePtr b = p.malloc(512, 0);
  EXPECT_EQ(p.parked.stats().inactive_split[ccalloc::kAggregate].peak, 2);
  p.record_stream(x, 1);
  p.free(x);  // waits for stream 1
  p.free(b);
  EXPECT_EQ(Access::parked(p.parked, 0), b);
  p.complete_stream(1);
  const int takes = p.takes;
  EXPECT_EQ(p.malloc(512, 0), b);  // completes x's free, then takes b back
  EXPECT_EQ(p.takes, takes + 1);
  EXPECT_EQ(p.parked.stats().inactive_split[ccalloc::kAggregate].peak, 3);
  p.expect_same();
}

// The take keeps its best-fit answer while the pool is unchanged. A pooled block that grows
// in place (a free merged into it, which keeps its place in the pool) changes the pool: in
// [Z 512][X 4096][W 512][B 4096][rest], X's free (waiting for stream 1) makes Z 4608 bytes,
// a better fit for B's size than B merged with the rest.
TEST(NativePark, APooledBlockThatGrewInPlaceEndsTheKeptBestFit) {
  Pair p(64 * kMiB);
  const DevicePtr z = p.malloc(512, 0);
  const DevicePtr x = p.malloc(4096, 0);
  p.malloc(512, 0);
  const DevicePtr b = p.malloc(4096, 0);
  p.free(z);
  for (int round = 0; round < 3; ++round) {
    p.free(b);
    EXPECT_EQ(p.malloc(4096, 0), b);
  }
  EXPECT_GE(p.takes, 1);  // the best fit is kept
  p.record_stream(x, 1);
  p.free(x);
  p.free(b);
  EXPECT_EQ(Access::parked(p.parked, 0), b);
  p.complete_stream(1);
  EXPECT_EQ(p.malloc(4096, 0), z);  // x's free completes first: z is the best fit now
  p.expect_same();
}

TEST(NativePark, AParkedPointerIsNotLive) {
  Pair p(64 * kMiB);
  const DevicePtr a = p.malloc(512, 0);
  p.free(a);
  ASSERT_EQ(Access::parked(p.parked, 0), a);
  EXPECT_THROW(p.parked.free(a), ccalloc::InvalidPointerError);
  EXPECT_THROW(p.parked.record_stream(a, 1), ccalloc::InvalidPointerError);
  EXPECT_EQ(p.parked.allocation_size(a), 0u);
  EXPECT_EQ(Access::parked(p.parked, 0), a);  // untouched by the refused calls
  EXPECT_EQ(p.malloc(512, 0), a);
  p.expect_same();
}

TEST(NativePark, ABlockUsedOnAnotherStreamIsNotParked) {
  Pair p(64 * kMiB);
  const DevicePtr a = p.malloc(512, 0);
  p.record_stream(a, 1);
  p.free(a);
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  p.complete_stream(1);
  EXPECT_EQ(p.malloc(512, 0), a);
  p.expect_same();
}

// Random work on three streams (record_stream, completions, empty_cache, a device small
// enough for the OOM ladder), frees biased to the most recent allocation so that parking
// is frequent, under several of PyTorch's settings: every address, OOM and statistic equal
// to the pools' alone.
struct Counts {
  int parks = 0, large_parks = 0, takes = 0, large_takes = 0;
};

Counts random_work(const char* config, unsigned seed) {
  SCOPED_TRACE(std::string(config) + ", seed " + std::to_string(seed));
  Pair p(160 * kMiB, config);
  static constexpr std::size_t kSizes[] = {512,      1024,     1536,      4096,
                                           8192,     65536,    100000,    262144,
                                           1 * kMiB, 3 * kMiB, 9 * kMiB,  12 * kMiB,
                                           25 * kMiB, 2 * kMiB + 512};
  // Compared whenever no stream has a parked block (the comparison pools them), and every
  // 500 operations.
  ccalloc::test::random_park_work(p, seed, kSizes, 4000, [&](int i) {
    if (i % 500 == 0 || (Access::parked(p.parked, 0) == 0 && Access::parked(p.parked, 1) == 0 &&
                         Access::parked(p.parked, 2) == 0)) {
      p.expect_same();
    }
  });
  if (testing::Test::HasFailure()) return {};
  p.expect_same();
  std::printf("%s, seed %u: %d parks (%d large), %d taken back (%d large)\n", config, seed,
              p.parks, p.large_parks, p.takes, p.large_takes);
  return {p.parks, p.large_parks, p.takes, p.large_takes};
}

// The cache was at work, for large blocks too.
void expect_busy(const Counts& c) {
  EXPECT_GT(c.parks, 500);
  EXPECT_GT(c.takes, 80);
  EXPECT_GT(c.large_parks, 20);
  EXPECT_GT(c.large_takes, 5);
}

TEST(NativePark, RandomWorkHandsOutWhatThePoolsAloneWould) {
  for (const unsigned seed : {1u, 2u, 3u}) expect_busy(random_work("pytorch", seed));
}

TEST(NativePark, RandomWorkUnderOtherSettingsHandsOutWhatThePoolsAloneWould) {
  expect_busy(random_work("pytorch,max_split_size_mb:24", 4));
  expect_busy(random_work("pytorch,roundup_power2_divisions:4", 5));
  // Under the age-based GC and with expandable segments nothing parks: the pools serve.
  EXPECT_EQ(random_work("pytorch,garbage_collection_threshold:0.6", 6).parks, 0);
  EXPECT_EQ(random_work("pytorch,expandable_segments:True", 7).parks, 0);
}

}  // namespace
