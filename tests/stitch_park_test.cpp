// The stitching policy's one-block cache in front of the small pool (stitch/hot_path.hpp,
// park()): a free that parks its block and a malloc that takes it back must hand out what
// the pools alone would. Each test runs the same calls on two engines over two identical
// simulated GPUs, one of them with parking off, and compares every address, the statistics,
// the segments and the driver's calls.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <tuple>

#include "stitch/engine.hpp"
#include "stitch/tunables.hpp"
#include "park_pair.hpp"

namespace ccalloc::core {

struct StitchEngineTestAccess {
  static void set_parking(StitchEngine& e, bool on) { e.parking_ = on; }
  // The stream's parked block's address (0: none).
  static DevicePtr parked(StitchEngine& e, StreamId stream) NO_THREAD_SAFETY_ANALYSIS {
    const StitchEngine::Block* b = e.arena_for(stream).parked;
    return b == nullptr ? 0 : b->ptr;
  }
  // What the stream's growths and islands decide by: the large bytes served since its last
  // growth, its largest large block, whether its small pool keeps an island.
  static std::tuple<std::size_t, std::size_t, bool> large_state(StitchEngine& e,
                                                                StreamId stream)
      NO_THREAD_SAFETY_ANALYSIS {
    const StitchEngine::Arena& a = e.arena_for(stream);
    return {a.large_served, a.largest_large, a.keeps_island};
  }
};

}  // namespace ccalloc::core

namespace {

using ccalloc::DevicePtr;
using ccalloc::StreamId;
using ccalloc::core::StitchEngine;
using Access = ccalloc::core::StitchEngineTestAccess;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Two stitching engines, parking on and off (park_pair.hpp); large: above the small pool.
struct Pair : ccalloc::test::ParkPair<StitchEngine, Access> {
  explicit Pair(std::size_t capacity, const char* config = "ccalloc")
      : ParkPair(capacity, config, ccalloc::core::kSmallPoolMax) {}
  // The parking engine's invariants with its parked blocks in place; then everything a
  // caller can see, equal (the views pool the parked blocks), with the segments' pieces and
  // each stream's growth and island state.
  void expect_same() {
    parked.check_invariants();
    expect_same_views([](const ccalloc::SegmentInfo& a, const ccalloc::SegmentInfo& b) {
      EXPECT_EQ(a.pieces, b.pieces);
    });
    for (StreamId s = 0; s < 3; ++s)
      EXPECT_EQ(Access::large_state(parked, s), Access::large_state(pooled, s)) << s;
  }
};

TEST(StitchPark, AFreedSmallBlockIsParkedAndTakenBackByTheNextRequestOfItsSize) {
  Pair p(64 * kMiB);
  const DevicePtr a = p.malloc(512, 0);
  p.free(a);
  EXPECT_EQ(Access::parked(p.parked, 0), a);
  EXPECT_EQ(p.parked.stats().allocated_bytes[ccalloc::kAggregate].current, 0);
  EXPECT_EQ(p.malloc(512, 0), a);
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  p.expect_same();
}

// The take restores the counts its park lowered without checking their peaks, but a
// request of the same rounded size may ask for more bytes: the requested bytes' peak rises.
TEST(StitchPark, ATakeThatAsksForMoreBytesRaisesTheRequestedPeak) {
  Pair p(64 * kMiB);
  p.expect_take_raises_requested_peak();
  p.expect_same();
}

TEST(StitchPark, ARequestThatBestFitServesElsewhereTakesItsBestFit) {
  Pair p(64 * kMiB);
  // [x 1024][y 512][a 512][z 512][rest]: x and a freed, x pooled (free, before y), a parked.
  const DevicePtr x = p.malloc(1024, 0);
  p.malloc(512, 0);
  const DevicePtr a = p.malloc(512, 0);
  p.malloc(512, 0);
  p.free(x);  // parked
  p.free(a);  // parks a, pools x (the last parked goes to its pool)
  EXPECT_EQ(Access::parked(p.parked, 0), a);
  // 512 B: a, pooled, would be the best fit (512 B against x's 1 KiB): a is taken back.
  EXPECT_EQ(p.malloc(512, 0), a);
  p.free(a);
  // 1 KiB: a does not fit; x does, and the parked block is pooled first.
  EXPECT_EQ(p.malloc(1024, 0), x);
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  p.expect_same();
}

TEST(StitchPark, AFreeNextToTheParkedBlockMergesWithIt) {
  Pair p(64 * kMiB);
  const DevicePtr a = p.malloc(512, 0);
  const DevicePtr b = p.malloc(512, 0);
  p.malloc(512, 0);
  p.free(a);
  EXPECT_EQ(Access::parked(p.parked, 0), a);
  p.free(b);  // b's free would merge with a: a is pooled first, then b merges
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  EXPECT_EQ(p.malloc(1024, 0), a);
  p.expect_same();
}

// A large block is parked too, and a large request takes it back where best fit would
// serve there; but while the small pool keeps an island (a page it bounced), a large
// request first lets the pools decide whether the island goes back (here it stays: the
// request lands where it would were the island merged back, below it).
TEST(StitchPark, ALargeBlockIsParkedAndTakenBackUnlessAnIslandIsKept) {
  Pair p(18 * kMiB, "ccalloc,stitch_segments:True,stitch_handle_mb:4");
  // An 8 MiB range of the large pool, settled, with a 1 MiB block at its front.
  const DevicePtr x = p.malloc(4 * kMiB, 0);
  p.malloc(4 * kMiB, 0);
  p.free(x, 0, 4 * kMiB);
  p.free(x + 4 * kMiB, 0, 4 * kMiB);
  for (int i = 0; i < 2; ++i)
    p.free(p.malloc(4 * kMiB, 0), 0, 4 * kMiB);
  const DevicePtr front = p.malloc(kMiB, 0);
  ASSERT_EQ(front, x);
  p.free(front, 0, kMiB);
  EXPECT_EQ(Access::parked(p.parked, 0), front);
  const int takes = p.takes;
  EXPECT_EQ(p.malloc(kMiB, 0), front);
  EXPECT_EQ(p.takes, takes + 1);
  p.expect_same();
  // A small block freed and taken again in a loop with nothing else small free: its page
  // bounces between the pools until the small pool keeps it.
  for (int i = 0; i < 4; ++i)
    p.free(p.malloc(128 * 1024, 0), 0, 128 * 1024);
  ASSERT_TRUE(std::get<2>(Access::large_state(p.parked, 0)));
  p.free(front, 0, kMiB);
  EXPECT_EQ(Access::parked(p.parked, 0), front);
  EXPECT_EQ(p.malloc(kMiB, 0), front);  // pooled first; the pools keep the island
  EXPECT_TRUE(std::get<2>(Access::large_state(p.parked, 0)));
  p.expect_same();
}

TEST(StitchPark, ABlockBeforeTheParkedOneFreedLaterMergesWithIt) {
  Pair p(64 * kMiB);
  const DevicePtr x = p.malloc(1024, 0);
  const DevicePtr a = p.malloc(512, 0);
  p.malloc(512, 0);
  p.record_stream(x, 1);
  p.free(x);  // pending: waits for stream 1's work
  p.free(a);
  EXPECT_EQ(Access::parked(p.parked, 0), a);
  p.complete_stream(1);
  // The next malloc completes x's free first: pooled, x and a are one free block of
  // 1.5 KiB at x, the request's best fit; a alone would not be.
  EXPECT_EQ(p.malloc(512, 0), x);
  EXPECT_EQ(Access::parked(p.parked, 0), 0u);
  p.expect_same();
}

// Random work on three streams (record_stream, empty_cache, a device small enough for the
// OOM ladder), mostly small requests, frees biased to the most recent allocation so that
// parking is frequent: every address, OOM and statistic equal to the pools' alone.
TEST(StitchPark, RandomWorkHandsOutWhatThePoolsAloneWould) {
  for (const unsigned seed : {1u, 2u, 3u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Pair p(96 * kMiB);
    static constexpr std::size_t kSizes[] = {512,    1024,     1536,     4096,
                                             8192,   65536,    100000,   262144,
                                             300000, 1 * kMiB, 3 * kMiB, 9 * kMiB};
    ccalloc::test::random_park_work(p, seed, kSizes, 4000, [&](int i) {
      if (i % 500 == 0) p.expect_same();
    });
    if (testing::Test::HasFailure()) return;
    p.expect_same();
    EXPECT_GT(p.parks, 500);  // the cache was at work
    EXPECT_GT(p.takes, 80);
    EXPECT_GT(p.large_parks, 20);  // large blocks too
    EXPECT_GT(p.large_takes, 5);
    std::printf("seed %u: %d parks (%d large), %d taken back (%d large)\n", seed, p.parks,
                p.large_parks, p.takes, p.large_takes);
  }
}

}  // namespace
