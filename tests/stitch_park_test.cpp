// The stitching policy's one-block cache in front of the small pool (stitch/hot_path.hpp,
// park()): a free that parks its block and a malloc that takes it back must hand out what
// the pools alone would. Each test runs the same calls on two engines over two identical
// simulated GPUs, one of them with parking off, and compares every address, the statistics,
// the segments and the driver's calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ccalloc/config.hpp"
#include "ccalloc/sim.hpp"
#include "stitch/engine.hpp"
#include "stitch/tunables.hpp"

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

using ccalloc::Config;
using ccalloc::DevicePtr;
using ccalloc::StreamId;
using ccalloc::core::StitchEngine;
using Access = ccalloc::core::StitchEngineTestAccess;

constexpr std::size_t kMiB = std::size_t{1} << 20;

ccalloc::sim::Options device(std::size_t capacity) {
  ccalloc::sim::Options o;
  o.capacity = capacity;
  return o;
}

// Two engines, parking on (`parked`) and off (`pooled`), each on a GPU of its own.
struct Pair {
  explicit Pair(std::size_t capacity, const char* config = "ccalloc")
      : gpu_a(device(capacity)), gpu_b(device(capacity)),
        parked(gpu_a, Config::parse(config)), pooled(gpu_b, Config::parse(config)) {
    Access::set_parking(pooled, false);
  }
  // malloc on both: the same address, or the same OOM.
  DevicePtr malloc(std::size_t size, StreamId stream) {
    const auto attempt = [&](StitchEngine& e, bool& oom) -> DevicePtr {
      try {
        return e.malloc(size, stream);
      } catch (const ccalloc::OutOfMemoryError&) {
        oom = true;
        return 0;
      }
    };
    bool oom_a = false, oom_b = false;
    const DevicePtr was_parked = Access::parked(parked, stream);
    const DevicePtr a = attempt(parked, oom_a);
    if (a != 0 && a == was_parked) {
      ++takes;
      if (size > ccalloc::core::kSmallPoolMax) ++large_takes;
    }
    const DevicePtr b = attempt(pooled, oom_b);
    EXPECT_EQ(oom_a, oom_b) << size << " B on stream " << stream;
    EXPECT_EQ(a, b) << size << " B on stream " << stream;
    return a;
  }
  // free on both; counts the frees that parked (`stream`: the allocation's).
  void free(DevicePtr p, StreamId stream = 0, std::size_t size = 0) {
    parked.free(p);
    pooled.free(p);
    if (Access::parked(parked, stream) == p) {
      ++parks;
      if (size > ccalloc::core::kSmallPoolMax) ++large_parks;
    }
  }
  // The parking engine's invariants with its parked blocks in place; then everything a
  // caller can see, equal (the views pool the parked blocks).
  void expect_same() {
    parked.check_invariants();
    EXPECT_EQ(parked.stats(), pooled.stats());
    const auto sa = parked.segments(), sb = pooled.segments();
    ASSERT_EQ(sa.size(), sb.size());
    for (std::size_t i = 0; i < sa.size(); ++i) {
      EXPECT_EQ(sa[i].address, sb[i].address);
      EXPECT_EQ(sa[i].total_size, sb[i].total_size);
      EXPECT_EQ(sa[i].allocated_size, sb[i].allocated_size);
      EXPECT_EQ(sa[i].active_size, sb[i].active_size);
      ASSERT_EQ(sa[i].blocks.size(), sb[i].blocks.size()) << "segment " << i;
      for (std::size_t j = 0; j < sa[i].blocks.size(); ++j) {
        EXPECT_EQ(sa[i].blocks[j].address, sb[i].blocks[j].address);
        EXPECT_EQ(sa[i].blocks[j].size, sb[i].blocks[j].size);
        EXPECT_EQ(sa[i].blocks[j].state, sb[i].blocks[j].state);
      }
      EXPECT_EQ(sa[i].pieces, sb[i].pieces);
    }
    EXPECT_EQ(gpu_a.counters(), gpu_b.counters());
    for (StreamId s = 0; s < 3; ++s)
      EXPECT_EQ(Access::large_state(parked, s), Access::large_state(pooled, s)) << s;
  }

  ccalloc::sim::SimDriver gpu_a, gpu_b;
  StitchEngine parked, pooled;
  int parks = 0, large_parks = 0, takes = 0, large_takes = 0;
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
  const DevicePtr a = p.malloc(500, 0);
  p.free(a);
  EXPECT_EQ(Access::parked(p.parked, 0), a);
  EXPECT_EQ(p.malloc(512, 0), a);
  EXPECT_EQ(p.takes, 1);
  EXPECT_EQ(p.parked.stats().requested_bytes[ccalloc::kAggregate].peak, 512);
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
  p.parked.record_stream(x, 1);
  p.pooled.record_stream(x, 1);
  p.free(x);  // pending: waits for stream 1's work
  p.free(a);
  EXPECT_EQ(Access::parked(p.parked, 0), a);
  p.gpu_a.complete_stream(1);
  p.gpu_b.complete_stream(1);
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
    std::mt19937 rng(seed);
    struct Live {
      DevicePtr ptr;
      StreamId stream;
      std::size_t size;
    };
    std::vector<Live> live;
    const std::size_t sizes[] = {512, 1024, 1536, 4096, 8192, 65536, 100000, 262144,
                                 300000, 1 * kMiB, 3 * kMiB, 9 * kMiB};
    std::int64_t now = 0;
    for (int i = 0; i < 4000; ++i) {
      now += static_cast<std::int64_t>(rng() % 500);
      p.gpu_a.set_time_us(now);
      p.gpu_b.set_time_us(now);
      const unsigned op = rng() % 100;
      if (op < 48 || live.empty()) {
        const StreamId s = rng() % 4 == 0 ? 1 + rng() % 2 : 0;
        const std::size_t size = rng() % 3 == 0 ? 1 + rng() % 262144 : sizes[rng() % 12];
        const DevicePtr ptr = p.malloc(size, s);
        if (ptr != 0) live.push_back(Live{ptr, s, size});
      } else if (op < 96) {
        const std::size_t k = rng() % 3 != 0 ? live.size() - 1 : rng() % live.size();
        const Live l = live[k];
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
        if (rng() % 8 == 0) {
          const StreamId other = (l.stream + 1) % 3;
          p.parked.record_stream(l.ptr, other);
          p.pooled.record_stream(l.ptr, other);
        }
        p.free(l.ptr, l.stream, l.size);
      } else if (op < 99) {
        const StreamId s = rng() % 3;
        p.gpu_a.complete_stream(s);
        p.gpu_b.complete_stream(s);
      } else {
        p.parked.empty_cache();
        p.pooled.empty_cache();
      }
      if (i % 500 == 0) p.expect_same();
      if (testing::Test::HasFailure()) return;
    }
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
