// The `ccalloc` preset's policy (src/stitch/engine.hpp): physical memory in handles of
// 2 MiB pieces, each handle mapped whole; wholly free handles stitched into the range that
// needs them, dead pages until empty_cache or the OOM ladder. Exact values on the simulated
// GPU. Most tests use devices too small for a 20 MiB chunk, so that new memory is exactly
// what a request lacks (the policy's fallback); two tests cover the chunk and the handle cap.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "stitch/engine.hpp"
#include "io/trace_csv.hpp"
#include "replay/fit.hpp"
#include "test_support.hpp"

namespace {

using ccalloc::Config;
using ccalloc::DevicePtr;
using ccalloc::kAggregate;
using ccalloc::core::StitchEngine;
using ccalloc_test::message_of;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr DevicePtr kVa = 0x600000000000;  // the simulated GPU's first reservation
// Growth on the small devices of these tests creates exactly what a request lacks (a 20 MiB
// chunk would not fit), in handles of two pieces, set: the room left on so small a device
// would give single pieces (HandlesAreAtMostA2048thOfTheRoomLeftUnderTheLimit).
constexpr const char* kExact = "ccalloc,stitch_segments:True,stitch_handle_mb:4";
// The small pool takes rounded requests of at most 256 KiB.
constexpr std::size_t kLargestSmall = 256 * 1024;
constexpr std::size_t kSmallRequest = 128 * 1024;

struct Fixture {
  explicit Fixture(std::size_t capacity = 18 * kMiB, const char* conf = kExact)
      : gpu(options(capacity)), engine(gpu, Config::parse(conf)) {
    engine.set_check_invariants(true);
  }
  static ccalloc::sim::Options options(std::size_t capacity) {
    ccalloc::sim::Options o;
    o.capacity = capacity;
    return o;
  }
  std::int64_t reserved() const { return engine.stats().reserved_bytes[kAggregate].current; }
  ccalloc::sim::SimDriver gpu;
  StitchEngine engine;
};

TEST(StitchPolicy, TheStitchSegmentsKeySelectsItAndTheCcallocPresetDoes) {
  EXPECT_TRUE(Config::parse("").stitch_segments);
  EXPECT_TRUE(Config::parse("ccalloc").stitch_segments);
  EXPECT_FALSE(Config::parse("ccalloc,stitch_segments:False").stitch_segments);
  EXPECT_FALSE(Config::parse("pytorch").stitch_segments);
  EXPECT_TRUE(Config::parse("ccalloc,stitch_segments:True").stitch_segments);
  EXPECT_TRUE(Config::parse("pytorch,stitch_segments:True").stitch_segments);
  EXPECT_EQ(Config::parse("stitch_segments:True").to_string().find("stitch_segments:True") !=
                std::string::npos,
            true);
}

TEST(StitchPolicy, LargeRequestsPackContiguouslyInWholePages) {
  Fixture f;
  const DevicePtr a = f.engine.malloc(3 * kMiB, 0);
  const DevicePtr b = f.engine.malloc(3 * kMiB, 0);
  EXPECT_EQ(a, kVa);
  EXPECT_EQ(b, kVa + 3 * kMiB);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(6 * kMiB));  // not two 4 MiB blocks
  // One handle per growth, mapped whole by one call: a's two pieces, then the one piece b
  // lacks beyond a's free 1 MiB.
  EXPECT_EQ(f.gpu.counters().physical_creates, 2u);
  EXPECT_EQ(f.gpu.counters().maps, 2u);
  using M = ccalloc::sim::SimDriver::MappingInfo;
  const auto m = f.gpu.mappings_in(kVa, 1 * kGiB);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0], (M{kVa, 4 * kMiB, m[0].handle, 0}));
  EXPECT_EQ(m[1], (M{kVa + 4 * kMiB, 2 * kMiB, m[1].handle, 0}));
}

TEST(StitchPolicy, SmallRequestsShareOneSmallPoolPage) {
  Fixture f;
  const DevicePtr large = f.engine.malloc(3 * kMiB, 0);
  std::vector<DevicePtr> small;
  for (int i = 0; i < 4; ++i)
    small.push_back(f.engine.malloc(kLargestSmall, 0));
  for (int i = 1; i < 4; ++i)
    EXPECT_EQ(small[i], small[0] + static_cast<std::size_t>(i) * kLargestSmall);
  EXPECT_NE(small[0] / (2 * kMiB), large / (2 * kMiB));  // the small pool's own space
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(4 * kMiB + 2 * kMiB));
  EXPECT_EQ(f.engine.stats().reserved_bytes[ccalloc::kSmallPool].current,
            static_cast<std::int64_t>(2 * kMiB));
}

// A request just above the small pool's largest goes to the large range, packed after the
// large block before it; the small pool's own page starts with the first small request.
TEST(StitchPolicy, RequestsAbove256KiBArePackedInTheLargeRange) {
  Fixture f;
  const DevicePtr large = f.engine.malloc(3 * kMiB, 0);
  const DevicePtr medium = f.engine.malloc(kLargestSmall + 512, 0);
  EXPECT_EQ(medium, large + 3 * kMiB);
  EXPECT_EQ(f.engine.stats().reserved_bytes[ccalloc::kSmallPool].current, 0);
  const DevicePtr small = f.engine.malloc(kLargestSmall, 0);
  EXPECT_NE(small / (2 * kMiB), large / (2 * kMiB));  // the small pool's own space
  EXPECT_EQ(f.engine.stats().reserved_bytes[ccalloc::kSmallPool].current,
            static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(f.engine.stats().allocated_bytes[ccalloc::kLargePool].current,
            static_cast<std::int64_t>(3 * kMiB + kLargestSmall + 512));
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(4 * kMiB + 2 * kMiB));
}

TEST(StitchPolicy, SmallGrowthTakesAWholeFreeLargePageInPlaceAndGivesItBackWhenFree) {
  Fixture f;
  const DevicePtr a = f.engine.malloc(4 * kMiB, 0);
  const DevicePtr b = f.engine.malloc(4 * kMiB, 0);
  ASSERT_EQ(a, kVa);
  ASSERT_EQ(b, kVa + 4 * kMiB);
  f.engine.free(a);  // a large free block that is not the frontier's tail
  const auto creates = f.gpu.counters().physical_creates;
  const auto maps = f.gpu.counters().maps;
  // The small pool has no page: it takes a's first page in place (an island).
  const DevicePtr s1 = f.engine.malloc(kSmallRequest, 0);
  const DevicePtr s2 = f.engine.malloc(kLargestSmall, 0);
  EXPECT_EQ(s1, kVa);
  EXPECT_EQ(s2, kVa + kSmallRequest);
  EXPECT_EQ(f.gpu.counters().physical_creates, creates);
  EXPECT_EQ(f.gpu.counters().maps, maps);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(8 * kMiB));
  // The statistics count blocks in their segment's pool, as PyTorch's tools rebuild them
  // from a snapshot: the island's blocks in the large one, where its memory stays.
  const auto st = f.engine.stats();
  EXPECT_EQ(st.allocated_bytes[ccalloc::kSmallPool].current, 0);
  EXPECT_EQ(st.allocated_bytes[ccalloc::kLargePool].current,
            static_cast<std::int64_t>(4 * kMiB + kSmallRequest + kLargestSmall));
  EXPECT_EQ(st.reserved_bytes[ccalloc::kSmallPool].current, 0);
  // The island's free rest serves small requests only; a large one takes the page after it.
  const DevicePtr c = f.engine.malloc(2 * kMiB, 0);
  EXPECT_EQ(c, kVa + 2 * kMiB);
  f.engine.free(c);
  f.engine.free(s1);
  const auto segs = f.engine.segments();
  ASSERT_EQ(segs.size(), 1u);
  // s1's free space, s2, the island's free rest, c's free page, b.
  ASSERT_EQ(segs[0].blocks.size(), 5u);
  EXPECT_EQ(segs[0].blocks[0].size, kSmallRequest);
  EXPECT_EQ(segs[0].blocks[1].size, kLargestSmall);
  // Not merged with the large free block.
  EXPECT_EQ(segs[0].blocks[2].size, 2 * kMiB - kSmallRequest - kLargestSmall);
  EXPECT_EQ(segs[0].blocks[3].size, 2 * kMiB);
  EXPECT_EQ(segs[0].blocks[4].size, 4 * kMiB);
  // Wholly free, the island goes back: a's 4 MiB serve a large request again, in place.
  f.engine.free(s2);
  EXPECT_EQ(f.engine.malloc(4 * kMiB, 0), kVa);
  EXPECT_EQ(f.gpu.counters().physical_creates, creates);
  EXPECT_EQ(f.gpu.counters().maps, maps);
}

TEST(StitchPolicy, SmallGrowthLeavesTheFreeTailOfAStreamThatHasNotSettled) {
  Fixture f;
  f.engine.free(f.engine.malloc(4 * kMiB, 0));  // the whole large range: its free tail
  const DevicePtr s = f.engine.malloc(kSmallRequest, 0);
  EXPECT_GE(s, kVa + 4 * kMiB);  // the small pool's own space
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(6 * kMiB));
  EXPECT_EQ(f.engine.stats().reserved_bytes[ccalloc::kSmallPool].current,
            static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(f.engine.malloc(4 * kMiB, 0), kVa);
}

TEST(StitchPolicy, SmallGrowthTakesASettledStreamsFreeTailThatStillHoldsItsLargestBlock) {
  // Two 4 MiB growths, freed, then handed out again: 12 MiB served since the last
  // creation, more than the 8 MiB range (settled); the free tail is 8 MiB, the largest
  // block 4 MiB.
  const auto build = [](Fixture& f) {
    const DevicePtr x = f.engine.malloc(4 * kMiB, 0);
    const DevicePtr y = f.engine.malloc(4 * kMiB, 0);
    ASSERT_EQ(x, kVa);
    ASSERT_EQ(y, kVa + 4 * kMiB);
    f.engine.free(x);
    f.engine.free(y);
  };
  {
    Fixture f;
    build(f);
    f.engine.free(f.engine.malloc(4 * kMiB, 0));
    f.engine.free(f.engine.malloc(4 * kMiB, 0));
    const auto creates = f.gpu.counters().physical_creates;
    const auto maps = f.gpu.counters().maps;
    // The tail's first page becomes an island: no driver call, no new memory.
    const DevicePtr s = f.engine.malloc(kSmallRequest, 0);
    EXPECT_EQ(s, kVa);
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(8 * kMiB));
    EXPECT_EQ(f.engine.stats().reserved_bytes[ccalloc::kSmallPool].current, 0);
    // The 6 MiB left of the tail hold more than the largest block: in place.
    const DevicePtr big = f.engine.malloc(6 * kMiB, 0);
    EXPECT_EQ(big, kVa + 2 * kMiB);
    EXPECT_EQ(f.gpu.counters().physical_creates, creates);
    EXPECT_EQ(f.gpu.counters().maps, maps);
    // Freed, the island is the large pool's again: the whole range serves 8 MiB in place.
    f.engine.free(s);
    f.engine.free(big);
    EXPECT_EQ(f.engine.malloc(8 * kMiB, 0), kVa);
    EXPECT_EQ(f.gpu.counters().physical_creates, creates);
  }
  {
    // Not settled: 4 MiB served since the last creation, for an 8 MiB range.
    Fixture f;
    build(f);
    EXPECT_GE(f.engine.malloc(kSmallRequest, 0), kVa + 8 * kMiB);
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(10 * kMiB));
  }
  {
    // Settled, but a 7 MiB block was handed out: the 8 MiB tail less a page would not
    // hold it.
    Fixture f;
    build(f);
    f.engine.free(f.engine.malloc(7 * kMiB, 0));
    EXPECT_GE(f.engine.malloc(kSmallRequest, 0), kVa + 8 * kMiB);
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(10 * kMiB));
    EXPECT_EQ(f.engine.malloc(8 * kMiB, 0), kVa);
  }
}

// An 8 MiB large range, wholly free, on a settled stream (16 MiB handed out since its
// creation) whose largest block was 4 MiB: its free tail may lend a page to the small pool.
void settle_an_8_mib_range(Fixture& f) {
  const DevicePtr x = f.engine.malloc(4 * kMiB, 0);
  f.engine.malloc(4 * kMiB, 0);
  f.engine.free(x);
  f.engine.free(x + 4 * kMiB);
  f.engine.free(f.engine.malloc(4 * kMiB, 0));
  f.engine.free(f.engine.malloc(4 * kMiB, 0));
}

// The blocks of the small pool's islands, as (address, allocated), in address order.
using Islands = std::vector<std::pair<DevicePtr, bool>>;
Islands islands_of(Fixture& f) {
  Islands out;
  for (const auto& seg : f.engine.snapshot().segments) {
    for (const auto& b : seg.blocks) {
      if (b.island) out.emplace_back(b.address, b.state == ccalloc::BlockState::kActiveAllocated);
    }
  }
  return out;
}

// A small block freed and allocated in a loop, with nothing else of the small pool free:
// its page bounces between the pools (freed whole, the island goes back to the large pool;
// the next request takes it back). From the third bounce on the small pool keeps it, and
// the loop hits the cache; the next large request takes it back, as if it had never left.
TEST(StitchPolicy, ThePageOfASmallBlockFreedAndAllocatedInALoopStaysAnIslandUntilALargeRequest) {
  Fixture f;
  settle_an_8_mib_range(f);
  const auto island_blocks = [&f] { return islands_of(f); };
  const auto creates = f.gpu.counters().physical_creates;
  for (int i = 1; i <= 6; ++i) {
    const DevicePtr s = f.engine.malloc(kSmallRequest, 0);
    ASSERT_EQ(s, kVa) << "round " << i;
    EXPECT_EQ(island_blocks(), (Islands{{kVa, true}, {kVa + kSmallRequest, false}}));
    f.engine.free(s);
    // Taken back for the first time in round 2: the third bounce is round 4's.
    if (i < 4) {
      EXPECT_EQ(island_blocks(), Islands{}) << "round " << i << ": returned";
    } else {
      EXPECT_EQ(island_blocks(), (Islands{{kVa, false}})) << "round " << i << ": kept";
    }
  }
  EXPECT_EQ(f.gpu.counters().physical_creates, creates);
  EXPECT_EQ(f.engine.stats().reserved_bytes[ccalloc::kSmallPool].current, 0);
  // A large request finds the range whole, where the island was.
  const DevicePtr big = f.engine.malloc(6 * kMiB, 0);
  EXPECT_EQ(big, kVa);
  EXPECT_EQ(island_blocks(), Islands{});
  f.engine.free(big);
  // The count starts again: the next loop returns the page at first.
  f.engine.free(f.engine.malloc(kSmallRequest, 0));
  EXPECT_EQ(island_blocks(), Islands{});
  EXPECT_EQ(f.gpu.counters().physical_creates, creates);
}

// A kept island stays the small pool's across a large request that lands where it would if
// the island went back (merged with its free neighbours): a loop of a large and a small
// request then hits the cache. A large request that would land elsewhere returns it first.
TEST(StitchPolicy, AKeptIslandStaysAcrossALargeRequestThatLandsWhereItWouldAnyway) {
  Fixture f;
  settle_an_8_mib_range(f);
  const auto island_blocks = [&f] { return islands_of(f); };
  const auto creates = f.gpu.counters().physical_creates;
  // A 1 MiB large block in front: the small request's island is the free tail's first
  // whole page, [2, 4) MiB; from the fourth round on it is kept.
  const DevicePtr front = f.engine.malloc(kMiB, 0);
  ASSERT_EQ(front, kVa);
  for (int i = 0; i < 4; ++i)
    f.engine.free(f.engine.malloc(kSmallRequest, 0));
  ASSERT_EQ(island_blocks(), (Islands{{kVa + 2 * kMiB, false}}));
  // The loop: a 1 MiB request fits the free MiB below the island exactly, where it would
  // land were the island merged back into [1, 8) MiB; the island stays, and the small
  // request hits it.
  f.engine.free(front);
  for (int i = 0; i < 3; ++i) {
    const DevicePtr large = f.engine.malloc(kMiB, 0);
    EXPECT_EQ(large, kVa) << "round " << i;
    EXPECT_EQ(island_blocks(), (Islands{{kVa + 2 * kMiB, false}})) << "round " << i;
    const DevicePtr small = f.engine.malloc(kSmallRequest, 0);
    EXPECT_EQ(small, kVa + 2 * kMiB) << "round " << i;
    f.engine.free(large);
    f.engine.free(small);
    EXPECT_EQ(island_blocks(), (Islands{{kVa + 2 * kMiB, false}})) << "round " << i;
  }
  // 1.5 MiB still fits below it. 3 MiB does not: without the island it would land in the
  // 4 MiB above, but returned, the island merges into one free [0, 8) MiB block that takes
  // it at its front: the island goes back first.
  const DevicePtr below = f.engine.malloc(3 * kMiB / 2, 0);
  EXPECT_EQ(below, kVa);
  EXPECT_EQ(island_blocks(), (Islands{{kVa + 2 * kMiB, false}}));
  f.engine.free(below);
  const DevicePtr mid = f.engine.malloc(3 * kMiB, 0);
  EXPECT_EQ(mid, kVa);
  EXPECT_EQ(island_blocks(), Islands{});
  f.engine.free(mid);
  EXPECT_EQ(f.gpu.counters().physical_creates, creates);
  EXPECT_EQ(f.engine.stats().reserved_bytes[ccalloc::kSmallPool].current, 0);
}

// A kept island goes back to the large pool when the cache is released, and its page is
// unmapped with the rest of the free range.
TEST(StitchPolicy, EmptyCacheReleasesAKeptIsland) {
  Fixture f;
  settle_an_8_mib_range(f);
  for (int i = 0; i < 6; ++i) {
    ASSERT_EQ(f.engine.malloc(kSmallRequest, 0), kVa);  // round 4 on: a cache hit
    f.engine.free(kVa);
  }
  ASSERT_TRUE(f.engine.snapshot().segments.at(0).blocks.at(0).island);
  f.engine.empty_cache();
  EXPECT_EQ(f.reserved(), 0);
  for (const auto& seg : f.engine.snapshot().segments) {
    for (const auto& b : seg.blocks)
      EXPECT_FALSE(b.island) << b.address;
  }
  EXPECT_EQ(f.engine.malloc(8 * kMiB, 0), kVa);
}

TEST(StitchPolicy, NewMemoryIsAChunkMappedWholeAndItsRestIsTheFreeTail) {
  Fixture f(256 * kGiB, "ccalloc,stitch_segments:True");  // handles of up to 64 MiB
  const DevicePtr a = f.engine.malloc(5 * kMiB, 0);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(20 * kMiB));  // one 20 MiB handle
  EXPECT_EQ(f.engine.piece_counts().total, 10u);
  EXPECT_EQ(f.engine.piece_counts().spare, 0u);  // all mapped: the rest is a free block
  EXPECT_EQ(f.gpu.counters().physical_creates, 1u);
  EXPECT_EQ(f.gpu.counters().maps, 1u);
  // The next request fits the chunk's free rest: no driver call.
  EXPECT_EQ(f.engine.malloc(5 * kMiB, 0), a + 5 * kMiB);
  EXPECT_EQ(f.gpu.counters().physical_creates, 1u);
  EXPECT_EQ(f.gpu.counters().maps, 1u);
  // 16 MiB lacks 6 MiB beyond the free 10 MiB: another chunk, one create and one map.
  EXPECT_EQ(f.engine.malloc(16 * kMiB, 0), a + 10 * kMiB);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(40 * kMiB));
  EXPECT_EQ(f.gpu.counters().physical_creates, 2u);
  EXPECT_EQ(f.gpu.counters().maps, 2u);
}

TEST(StitchPolicy, LargeGrowthIsCreatedInHandlesOfAtMost64MiB) {
  Fixture f(256 * kGiB, "ccalloc,stitch_segments:True");  // 1/2048 of the room is 128 MiB
  f.engine.malloc(100 * kMiB, 0);  // 50 pieces: 32 + 18
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(100 * kMiB));
  EXPECT_EQ(f.gpu.counters().physical_creates, 2u);
  EXPECT_EQ(f.gpu.counters().maps, 2u);
  const auto m = f.gpu.mappings_in(kVa, 1 * kGiB);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0].bytes, 64 * kMiB);
  EXPECT_EQ(m[1].bytes, 36 * kMiB);
}

// The handles' sizes as the mappings show them, in address order, in MiB.
std::vector<std::size_t> mapped_mib(Fixture& f) {
  std::vector<std::size_t> out;
  for (const auto& m : f.gpu.mappings_in(kVa, 64 * kGiB))
    out.push_back(m.bytes / kMiB);
  return out;
}

TEST(StitchPolicy, HandlesAreAtMostA2048thOfTheRoomLeftUnderTheLimit) {
  using V = std::vector<std::size_t>;
  {
    Fixture f(32 * kGiB, "ccalloc,stitch_segments:True");  // 16 MiB handles
    f.engine.malloc(40 * kMiB, 0);
    EXPECT_EQ(mapped_mib(f), (V{16, 16, 8}));
    EXPECT_EQ(f.gpu.counters().physical_creates, 3u);
    EXPECT_EQ(f.gpu.counters().maps, 3u);
  }
  {
    Fixture f(256 * kGiB, "ccalloc,stitch_segments:True");  // at most 64 MiB, however large
    f.engine.malloc(150 * kMiB, 0);
    EXPECT_EQ(mapped_mib(f), (V{64, 64, 22}));
  }
  {
    // The limit, not the device: a quarter of 128 GiB gives 16 MiB handles.
    Fixture f(128 * kGiB, "ccalloc,stitch_segments:True,per_process_memory_fraction:0.25");
    f.engine.malloc(40 * kMiB, 0);
    EXPECT_EQ(mapped_mib(f), (V{16, 16, 8}));
  }
  {
    // The room shrinks as memory is held: 8 MiB handles on an empty 16 GiB device, 6 MiB
    // with 40 MiB held (the room just under 16 GiB), single pieces with 12 GiB more held.
    Fixture f(16 * kGiB, "ccalloc,stitch_segments:True");
    f.engine.malloc(40 * kMiB, 0);
    EXPECT_EQ(mapped_mib(f), (V{8, 8, 8, 8, 8}));
    const DevicePtr big = f.engine.malloc(12 * kGiB, 0);
    const auto bigs = f.gpu.mappings_in(big, 12 * kGiB);
    ASSERT_EQ(bigs.size(), 2048u);
    EXPECT_EQ(bigs.front().bytes, 6 * kMiB);
    EXPECT_EQ(bigs.back().bytes, 6 * kMiB);
    const DevicePtr last = f.engine.malloc(20 * kMiB, 0);
    const auto lasts = f.gpu.mappings_in(last, 20 * kMiB);
    ASSERT_EQ(lasts.size(), 10u);
    for (const auto& m : lasts)
      EXPECT_EQ(m.bytes, 2 * kMiB);
  }
  {
    // A size set in the configuration takes precedence, in whole pages, one at the least.
    Fixture f(256 * kGiB, "ccalloc,stitch_segments:True,stitch_handle_mb:6");
    f.engine.malloc(20 * kMiB, 0);
    EXPECT_EQ(mapped_mib(f), (V{6, 6, 6, 2}));
    Fixture g(256 * kGiB, "ccalloc,stitch_segments:True,stitch_handle_mb:1");
    g.engine.malloc(6 * kMiB, 0);  // a 20 MiB chunk, in pieces
    EXPECT_EQ(g.gpu.counters().physical_creates, 10u);
  }
}

// Grows a stream's large range to `mib` MiB, then frees and allocates it whole again: the
// stream has handed out more than its range since the pool last created memory (settled).
DevicePtr settle(Fixture& f, std::size_t mib) {
  const DevicePtr p = f.engine.malloc(mib * kMiB, 0);
  f.engine.free(p);
  EXPECT_EQ(f.engine.malloc(mib * kMiB, 0), p);  // a cache hit: no creation
  f.engine.free(p);
  return p;
}

TEST(StitchPolicy, ASettledStreamCreatesBeyondItsNeedAtMostASixtyFourthOfTheReservation) {
  // Not settled: 2 MiB lacking beyond the free 40 MiB creates a whole 20 MiB chunk.
  {
    Fixture f(1 * kGiB, kExact);
    f.engine.free(f.engine.malloc(40 * kMiB, 0));
    f.engine.malloc(42 * kMiB, 0);
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(60 * kMiB));
  }
  // Settled on 40 MiB: 1/64 of it is less than a piece, so the growth is exact.
  {
    Fixture f(1 * kGiB, kExact);
    const DevicePtr p = settle(f, 40);
    EXPECT_EQ(f.engine.malloc(42 * kMiB, 0), p);
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(42 * kMiB));
    // The growth created memory: settled again only after another turnover.
    f.engine.malloc(2 * kMiB, 0);  // lacks 2 MiB: a whole chunk again
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(62 * kMiB));
  }
  // Settled on 640 MiB: 1/64 is 10 MiB, five pieces, less than the chunk.
  {
    Fixture f(2 * kGiB, kExact);
    settle(f, 640);
    f.engine.malloc(642 * kMiB, 0);
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(650 * kMiB));
  }
  // Settled on 1280 MiB and more: 1/64 is the chunk or more, which stays.
  {
    Fixture f(4 * kGiB, kExact);
    settle(f, 1280);
    f.engine.malloc(1282 * kMiB, 0);
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(1300 * kMiB));
  }
}

// a | b | c, 4 MiB each (one 2-piece handle each); a freed; a request of 4 MiB + 512 fits
// no free block: a's handle, wholly free, is lent to the frontier and only one new piece is
// created.
struct Stitched : Fixture {
  Stitched() {
    a = engine.malloc(4 * kMiB, 0);
    b = engine.malloc(4 * kMiB, 0);
    c = engine.malloc(4 * kMiB, 0);
    engine.free(a);
    d = engine.malloc(4 * kMiB + 512, 0);
  }
  DevicePtr a = 0, b = 0, c = 0, d = 0;
};

TEST(StitchPolicy, StitchingLendsFreePagesInsteadOfCreatingMemory) {
  Stitched f;
  EXPECT_EQ(f.d, kVa + 12 * kMiB);                                // at the frontier
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(14 * kMiB));  // growth alone: 18 MiB
  // a, b and c: three handles; d: a's handle lent (one map) and one new piece.
  EXPECT_EQ(f.gpu.counters().physical_creates, 4u);
  EXPECT_EQ(f.gpu.counters().maps, 3u + 2u);
  EXPECT_EQ(f.gpu.counters().unmaps, 0u);
  EXPECT_EQ(f.engine.piece_counts().dead_pages, 2u);
  EXPECT_EQ(f.engine.piece_counts().spare, 0u);
  // a's handle at two virtual addresses: a's old pages and d's first two.
  const auto old_map = f.gpu.mappings_in(kVa, 4 * kMiB);
  const auto new_map = f.gpu.mappings_in(kVa + 12 * kMiB, 4 * kMiB);
  ASSERT_EQ(old_map.size(), 1u);
  ASSERT_EQ(new_map.size(), 1u);
  EXPECT_EQ(old_map[0].handle, new_map[0].handle);
  EXPECT_EQ(new_map[0].bytes, 4 * kMiB);
}

TEST(StitchPolicy, DeadPagesAreNeitherFreeNorReported) {
  Stitched f;
  f.engine.free(f.b);  // next to a's dead pages: it must not merge with them
  const auto segs = f.engine.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].address, kVa + 4 * kMiB);
  EXPECT_EQ(segs[0].total_size, 14 * kMiB);
  ASSERT_EQ(segs[0].blocks.size(), 4u);
  EXPECT_EQ(segs[0].blocks[0].size, 4 * kMiB);  // b, free
  EXPECT_EQ(segs[0].blocks[0].state, ccalloc::BlockState::kInactive);
  EXPECT_EQ(segs[0].blocks[3].size, 6 * kMiB - 4 * kMiB - 512);  // d's unused tail
  // A 6 MiB request fits no free block (b: 4 MiB): it stitches b's pages, not a's.
  f.engine.malloc(6 * kMiB, 0);
  EXPECT_EQ(f.engine.piece_counts().dead_pages, 4u);
}

TEST(StitchPolicy, EmptyCacheUnmapsDeadAndFreePagesAndReleasesUnusedMemory) {
  Stitched f;
  f.engine.free(f.b);
  f.engine.free(f.d);
  f.engine.empty_cache();
  // c's handle stays (c is live); everything else is unmapped and released.
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(f.gpu.used_bytes(), 4 * kMiB);
  EXPECT_EQ(f.engine.piece_counts().dead_pages, 0u);
  EXPECT_EQ(f.gpu.counters().physical_releases, 3u);               // of 4 handles
  EXPECT_EQ(f.gpu.counters().unmaps, 4u);                          // a's two, b's, d's piece
  EXPECT_EQ(f.gpu.mappings_in(kVa, 1 * kGiB).size(), 1u);          // c's
  EXPECT_EQ(f.gpu.counters().stream_synchronizes, 1u);
  f.engine.free(f.c);
  f.engine.empty_cache();
  EXPECT_EQ(f.reserved(), 0);
  EXPECT_EQ(f.gpu.used_bytes(), 0u);
  EXPECT_TRUE(f.engine.segments().empty());
}

TEST(StitchPolicy, MallocAndFreeNeverSynchronizeOrUnmap) {
  Stitched f;
  f.engine.free(f.b);
  f.engine.free(f.d);
  f.engine.malloc(9 * kMiB, 0);
  const auto c = f.gpu.counters();
  EXPECT_EQ(c.unmaps, 0u);
  EXPECT_EQ(c.stream_synchronizes + c.event_synchronizes + c.device_synchronizes, 0u);
}

TEST(StitchPolicy, OomLadderReleasesOtherStreamsCacheAndRetries) {
  Fixture f(16 * kMiB);
  f.engine.free(f.engine.malloc(8 * kMiB, 1));  // cached on stream 1
  const DevicePtr p = f.engine.malloc(12 * kMiB, 0);
  EXPECT_NE(p, 0u);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(12 * kMiB));
  EXPECT_EQ(f.engine.stats().num_alloc_retries, 1);
  // Stream 1's 8 MiB: two handles of two pieces (the most a 16 MiB device allows), each
  // mapped on its own.
  EXPECT_EQ(f.gpu.counters().physical_releases, 2u);
  EXPECT_EQ(f.gpu.counters().unmaps, 2u);
  // The device's capacity refuses the creation without a driver call.
  EXPECT_EQ(f.gpu.counters().physical_create_ooms, 0u);
}

TEST(StitchPolicy, OomWhenNothingIsLeftToReleaseNamesTheRequest) {
  Fixture f(16 * kMiB);
  f.engine.malloc(12 * kMiB, 0);
  const std::string message =
      message_of<ccalloc::OutOfMemoryError>([&] { f.engine.malloc(6 * kMiB, 0); });
  // PyTorch's opening, word for word (its suite matches it), then ccalloc's details.
  EXPECT_EQ(message.rfind("CUDA out of memory. Tried to allocate 6.00 MiB. GPU 0 has a total "
                          "capacity of ",
                          0),
            0u)
      << message;
  EXPECT_NE(message.find("The request: 6291456 bytes on stream 0"), std::string::npos) << message;
  EXPECT_EQ(f.engine.stats().num_ooms, 1);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(12 * kMiB));
}

TEST(StitchPolicy, MemoryFractionCapsReservedAndFallsBackToExactGrowth) {
  Fixture f(64 * kMiB, "ccalloc,stitch_segments:True,per_process_memory_fraction:0.25");  // 16 MiB
  f.engine.malloc(10 * kMiB, 0);  // a 20 MiB chunk would pass the limit: exactly 10 MiB
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(10 * kMiB));
  const std::string message =
      message_of<ccalloc::OutOfMemoryError>([&] { f.engine.malloc(8 * kMiB, 0); });
  EXPECT_NE(message.find("per_process_memory_fraction 0.25 allows 16.00 MiB"), std::string::npos)
      << message;
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(10 * kMiB));
  f.engine.set_memory_fraction(0.5);  // 32 MiB: now a whole 20 MiB chunk fits
  EXPECT_NE(f.engine.malloc(8 * kMiB, 0), 0u);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(30 * kMiB));
}

TEST(StitchPolicy, GcThresholdReleasesTheCacheBeforeCreatingPastIt) {
  // Without stream_borrow_wait, which would take stream 1's pages behind a wait on its
  // fence instead (stitch_share_test).
  Fixture f(64 * kMiB,
            "ccalloc,stitch_segments:True,garbage_collection_threshold:0.5,"
            "stream_borrow_wait:False,stitch_handle_mb:4");
  f.engine.free(f.engine.malloc(20 * kMiB, 1));
  f.engine.malloc(16 * kMiB, 0);  // 20 + 16 > 32 MiB: stream 1's cache goes first
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(20 * kMiB));  // one new 20 MiB chunk
  EXPECT_EQ(f.gpu.counters().physical_releases, 5u);  // stream 1's chunk: 5 handles of 4 MiB
  EXPECT_EQ(f.engine.stats().num_alloc_retries, 0);
}

TEST(StitchPolicy, CrossStreamFreeWaitsForTheEventAndItsPagesAreNotLent) {
  Fixture f;
  const DevicePtr a = f.engine.malloc(4 * kMiB, 0);
  f.engine.record_stream(a, 7);
  f.engine.free(a);
  const DevicePtr b = f.engine.malloc(4 * kMiB, 0);  // a is pending: new memory
  EXPECT_EQ(b, a + 4 * kMiB);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(f.engine.piece_counts().dead_pages, 0u);
  EXPECT_EQ(f.engine.stats().active[kAggregate].current, 2);
  f.gpu.complete_stream(7);
  EXPECT_EQ(f.engine.malloc(4 * kMiB, 0), a);  // the event completed: a is reused
  EXPECT_EQ(f.gpu.counters().event_synchronizes, 0u);
}

TEST(StitchPolicy, OomLadderWaitsForPendingFreesBeforeReleasing) {
  Fixture f(8 * kMiB);
  const DevicePtr a = f.engine.malloc(8 * kMiB, 0);
  f.engine.record_stream(a, 7);
  f.engine.free(a);
  EXPECT_EQ(f.engine.malloc(8 * kMiB, 0), a);
  EXPECT_EQ(f.gpu.counters().event_synchronizes, 1u);
  EXPECT_EQ(f.engine.stats().num_sync_all_streams, 1);
  EXPECT_EQ(f.engine.stats().num_alloc_retries, 0);
}

TEST(StitchPolicy, InvariantCheckerComparesTheDevicesMappingsWithTheModel) {
  Fixture f;
  f.engine.set_check_invariants(false);
  const DevicePtr a = f.engine.malloc(4 * kMiB, 0);
  f.engine.check_invariants();
  const auto m = f.gpu.mappings_in(a, 4 * kMiB);
  ASSERT_EQ(m.size(), 1u);
  f.gpu.unmap(a, 4 * kMiB);  // behind the allocator's back
  const std::string message =
      message_of<ccalloc::InvariantError>([&] { f.engine.check_invariants(); });
  EXPECT_NE(
      message.find("the device's mappings in the space at 0x600000000000 are not the model's"),
      std::string::npos)
      << message;
  for (const auto& x : m) f.gpu.map_range(x.va, x.bytes, x.handle, x.offset);  // restored
  f.engine.check_invariants();
}

// The simulated GPU's map_range: part of a handle, one handle at several addresses.
TEST(SimMapRange, MapsAWholeHandleAtSeveralAddressesAndCountsThem) {
  ccalloc::sim::SimDriver gpu(Fixture::options(64 * kMiB));
  const DevicePtr r = gpu.reserve_address_range(32 * kMiB);
  const ccalloc::PhysicalHandle h = gpu.create_physical(2 * kMiB);
  gpu.map_range(r, 2 * kMiB, h, 0);
  gpu.map_range(r + 16 * kMiB, 2 * kMiB, h, 0);  // the same piece again
  using M = ccalloc::sim::SimDriver::MappingInfo;
  EXPECT_EQ(gpu.mappings_in(r, 32 * kMiB),
            (std::vector<M>{{r, 2 * kMiB, h, 0}, {r + 16 * kMiB, 2 * kMiB, h, 0}}));
  EXPECT_EQ(gpu.used_bytes(), 2 * kMiB);  // physical memory, not mappings
  EXPECT_EQ(gpu.counters().maps, 2u);
  const std::string busy =
      message_of<ccalloc::DriverError>([&] { gpu.release_physical(h, 2 * kMiB); });
  EXPECT_NE(busy.find("it is still mapped at 2 addresses"), std::string::npos) << busy;
  const std::string whole =
      message_of<ccalloc::DriverError>([&] { gpu.map(r + 8 * kMiB, 2 * kMiB, h); });
  EXPECT_NE(whole.find("the handle is already mapped by map_range"), std::string::npos) << whole;
  gpu.unmap(r, 2 * kMiB);
  gpu.unmap(r + 16 * kMiB, 2 * kMiB);
  gpu.release_physical(h, 2 * kMiB);
  EXPECT_EQ(gpu.used_bytes(), 0u);
}

// cuMemMap answers CUDA_ERROR_NOT_SUPPORTED for an offset into a handle; so does the model.
TEST(SimMapRange, RejectsAnOffsetAndAPartOfAHandleAsCudaDoes) {
  ccalloc::sim::SimDriver gpu(Fixture::options(64 * kMiB));
  const DevicePtr r = gpu.reserve_address_range(32 * kMiB);
  const ccalloc::PhysicalHandle h = gpu.create_physical(4 * kMiB);
  const std::string offset =
      message_of<ccalloc::DriverError>([&] { gpu.map_range(r, 2 * kMiB, h, 2 * kMiB); });
  EXPECT_NE(offset.find("offset must be 0"), std::string::npos) << offset;
  const std::string part =
      message_of<ccalloc::DriverError>([&] { gpu.map_range(r, 2 * kMiB, h, 0); });
  EXPECT_NE(part.find("a mapping covers a whole physical allocation"), std::string::npos) << part;
  const std::string odd =
      message_of<ccalloc::DriverError>([&] { gpu.map_range(r + 4096, 4 * kMiB, h, 0); });
  EXPECT_NE(odd.find("must be multiples of the granularity"), std::string::npos) << odd;
  EXPECT_EQ(gpu.counters().maps, 0u);
}

// Access is set per handle (an H100 measurement, docs/simulated-gpu.md): each map_range maps
// one whole handle and is charged one cuMemMap + cuMemSetAccess whatever the handle's size;
// a range over several handles is several calls, never one cheaper call.
TEST(SimMapRange, ChargesOneMapAndAccessPerHandleWhateverItsSize) {
  ccalloc::sim::SimDriver gpu(Fixture::options(64 * kMiB));
  const ccalloc::sim::CostModel cost;
  const double per_map = cost.map_us + cost.set_access_us;
  const DevicePtr r = gpu.reserve_address_range(64 * kMiB);
  const ccalloc::PhysicalHandle big = gpu.create_physical(20 * kMiB);
  std::vector<ccalloc::PhysicalHandle> pieces;
  for (int i = 0; i < 10; ++i)
    pieces.push_back(gpu.create_physical(2 * kMiB));
  const double created = gpu.simulated_driver_us();
  EXPECT_DOUBLE_EQ(created, cost.reserve_us + 11 * cost.physical_create_us);
  gpu.map_range(r, 20 * kMiB, big, 0);
  EXPECT_DOUBLE_EQ(gpu.simulated_driver_us() - created, per_map);
  // Two pieces side by side cannot be mapped by one call over both.
  const std::string both =
      message_of<ccalloc::DriverError>([&] { gpu.map_range(r + 20 * kMiB, 4 * kMiB, pieces[0], 0); });
  EXPECT_NE(both.find("a mapping covers a whole physical allocation"), std::string::npos) << both;
  for (std::size_t i = 0; i < pieces.size(); ++i)
    gpu.map_range(r + 20 * kMiB + i * 2 * kMiB, 2 * kMiB, pieces[i], 0);
  EXPECT_DOUBLE_EQ(gpu.simulated_driver_us() - created, 11 * per_map);
  EXPECT_EQ(gpu.counters().maps, 11u);
}

// fit: a 3 MiB and a 3 MiB block (6 MiB mapped in three one-piece handles: on a device this
// small handles are single pages), the first freed, then 5 MiB. The first block's first page
// is wholly free and is lent to the frontier; its second page holds the second block's
// start, so 5 MiB is that lent page and two new pieces: 10 MiB held. On 8 MiB the creation
// fails and the ladder can release only the free page, which leaves room for two new pieces
// of the three. PyTorch's policy needs one 20 MiB segment for requests of 1-10 MiB.
// One trace record: an action on `size` bytes at `addr`.
ccalloc::io::TraceRecord row(ccalloc::TraceAction a, DevicePtr addr, std::size_t size) {
  ccalloc::io::TraceRecord r;
  r.entry.action = a;
  r.entry.addr = addr;
  r.entry.size = size;
  return r;
}

std::vector<ccalloc::io::TraceRecord> small_trace() {
  using ccalloc::TraceAction;
  return {row(TraceAction::kAlloc, 0x1000000, 3 * kMiB),
          row(TraceAction::kAlloc, 0x2000000, 3 * kMiB),
          row(TraceAction::kFreeRequested, 0x1000000, 3 * kMiB),
          row(TraceAction::kFreeCompleted, 0x1000000, 3 * kMiB),
          row(TraceAction::kAlloc, 0x3000000, 5 * kMiB),
          row(TraceAction::kFreeRequested, 0x3000000, 5 * kMiB),
          row(TraceAction::kFreeCompleted, 0x3000000, 5 * kMiB),
          row(TraceAction::kFreeRequested, 0x2000000, 3 * kMiB),
          row(TraceAction::kFreeCompleted, 0x2000000, 3 * kMiB)};
}

TEST(StitchFit, FindsTheSmallestPassingCapacityAndVerifiesIt) {
  ccalloc::replay::FitOptions options;
  options.conf = "ccalloc,stitch_segments:True";
  const auto r = ccalloc::replay::fit(small_trace(), options);
  EXPECT_EQ(r.floor_bytes, static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(r.capacity, 10 * kMiB);
  EXPECT_EQ(r.peak_reserved_bytes, static_cast<std::int64_t>(10 * kMiB));
  EXPECT_TRUE(r.passes_at_capacity);
  EXPECT_TRUE(r.fails_below);
}

// A block's free completes (its event) after the next allocation on the same stream has
// taken its memory: the floor counts both live (8 MiB), the allocator needs one (4 MiB).
// The answer lies below the floor, and is verified on both sides.
TEST(StitchFit, FindsACapacityBelowTheFloorWhereTheFreeCompletesLate) {
  using ccalloc::TraceAction;
  const std::vector<ccalloc::io::TraceRecord> trace = {
      row(TraceAction::kAlloc, 0x1000000, 4 * kMiB),
      row(TraceAction::kFreeRequested, 0x1000000, 4 * kMiB),
      row(TraceAction::kAlloc, 0x2000000, 4 * kMiB),
      row(TraceAction::kFreeCompleted, 0x1000000, 4 * kMiB),
      row(TraceAction::kFreeRequested, 0x2000000, 4 * kMiB),
      row(TraceAction::kFreeCompleted, 0x2000000, 4 * kMiB)};
  ccalloc::replay::FitOptions options;
  options.conf = kExact;
  const auto r = ccalloc::replay::fit(trace, options);
  EXPECT_EQ(r.floor_bytes, static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(r.capacity, 4 * kMiB);
  EXPECT_TRUE(r.verified());
}

TEST(StitchFit, PytorchPolicyNeedsAWholeSegment) {
  ccalloc::replay::FitOptions options;
  options.conf = "pytorch";
  const auto r = ccalloc::replay::fit(small_trace(), options);
  EXPECT_EQ(r.capacity, 20 * kMiB);
  EXPECT_TRUE(r.verified());
}

TEST(StitchFit, ATraceWithoutAllocationsIsAnError) {
  ccalloc::replay::FitOptions options;
  const std::string message =
      message_of<ccalloc::Error>([&] { ccalloc::replay::fit({}, options); });
  EXPECT_NE(message.find("allocates nothing"), std::string::npos) << message;
}

}  // namespace

// PyTorch counts one synchronization of every stream per empty_cache(); under the preset
// both the policy and the private pools beside it synchronize, and count once together.
TEST(StitchPolicy, EmptyCacheCountsOneSynchronizationOfAllStreams) {
  for (const char* preset : {"ccalloc", "pytorch", "pytorch,expandable_segments:True"}) {
    ccalloc::sim::SimDriver gpu;
    ccalloc::Allocator a(gpu, Config::parse(preset));
    a.set_check_invariants(true);
    const auto syncs = [&a] { return a.stats().num_sync_all_streams; };
    a.free(a.malloc(3 * kMiB, 0));
    const ccalloc::PoolId pool{0, 1};
    a.begin_allocate_to_pool(pool, [](ccalloc::StreamId s) { return s == 7; });
    a.free(a.malloc(1000, 7));
    a.end_allocate_to_pool(pool);
    EXPECT_EQ(syncs(), 0) << preset;
    a.empty_cache();
    EXPECT_EQ(syncs(), 1) << preset;
    a.empty_cache();
    EXPECT_EQ(syncs(), 2) << preset;
    a.release_pool(pool);
  }
}
