// Private memory pools (CUDA graph capture, torch.cuda.MemPool) against PyTorch's rules
// (docs/design.md#private-pools): isolation of a pool's segments, sharing a pool between
// captures, use counts and the release of a pool's cache, use_on_oom, no_split, segment
// sources, frees deferred during capture, the OOM ladder during capture, checkpoints, and
// the backends without the native engine's pools.
//
// The simulated GPU throws on any event query or record, synchronization or free of device
// memory while a stream is marked capturing, so every test that captures also proves the
// allocator does none of those during capture. Invariants are checked after every
// operation. Addresses: first-fit, 2 MiB aligned from 0x7f0000000000.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"
#include "ccalloc/stats.hpp"
#include "test_support.hpp"

namespace ccalloc {
namespace {

using ccalloc_test::message_of;

constexpr std::size_t kGiB = 1024 * kMiB;
constexpr DevicePtr kBase = 0x7f0000000000;
constexpr DevicePtr At(std::size_t mib) {
  return kBase + mib * kMiB;
}
constexpr PoolId kPool{0, 1};
constexpr PoolId kGraphPool{7, 0};

struct Fixture {
  // PyTorch's native policy unless a test says otherwise: the addresses below are its.
  explicit Fixture(const std::string& conf = "pytorch", std::size_t capacity = kGiB)
      : driver(make_options(capacity)), alloc(driver, Config::parse(conf)) {
    alloc.set_check_invariants(true);
  }
  static sim::Options make_options(std::size_t capacity) {
    sim::Options o;
    o.capacity = capacity;
    return o;
  }
  // Captures `stream` into `pool` as torch.cuda.graph does: the pool is allocated to first,
  // then the stream captures; at the end the pool stops first.
  void begin(PoolId pool, StreamId stream) {
    alloc.begin_allocate_to_pool(pool, [stream](StreamId s) { return s == stream; });
    driver.begin_capture(stream);
  }
  void end(PoolId pool, StreamId stream) {
    alloc.end_allocate_to_pool(pool);
    driver.end_capture(stream);
  }
  std::int64_t reserved() const { return alloc.stats().reserved_bytes[kAggregate].current; }

  sim::SimDriver driver;
  Allocator alloc;
};

std::vector<DevicePtr> addresses(const std::vector<SegmentInfo>& segments) {
  std::vector<DevicePtr> out;
  for (const SegmentInfo& s : segments)
    out.push_back(s.address);
  return out;
}

TEST(PrivatePools, CapturedAllocationsComeFromThePoolsOwnSegments) {
  Fixture f;
  const DevicePtr a = f.alloc.malloc(4096, 1);  // default pool, small segment at 0
  f.alloc.free(a);                              // cached there, free
  f.begin(kGraphPool, 1);
  const DevicePtr b = f.alloc.malloc(4096, 1);      // not the cached block: a pool segment
  const DevicePtr other = f.alloc.malloc(4096, 2);  // stream 2 is not captured: default
  f.end(kGraphPool, 1);
  EXPECT_EQ(a, At(0));
  EXPECT_EQ(b, At(2));
  EXPECT_EQ(other, At(4));
  EXPECT_EQ(f.alloc.segment_pool(b), kGraphPool);
  EXPECT_EQ(f.alloc.segment_pool(a), PoolId{});
  EXPECT_EQ(f.alloc.segment_pool(other), PoolId{});
  f.alloc.free(b);
  // After the capture the pool's free block serves no default request on its stream.
  const DevicePtr c = f.alloc.malloc(4096, 1);
  EXPECT_EQ(c, At(0));
  const DevicePtr d = f.alloc.malloc(2 * 4096, 1);  // still not the pool's block
  EXPECT_EQ(d, At(0) + 4096);
  EXPECT_EQ(addresses(f.alloc.pool_segments(kGraphPool)), std::vector<DevicePtr>{At(2)});
  const std::vector<SegmentInfo> all = f.alloc.segments();
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[1].pool, kGraphPool);
  EXPECT_EQ(all[0].pool, PoolId{});
  const Snapshot snap = f.alloc.snapshot();  // PyTorch's segment_pool_id
  ASSERT_EQ(snap.segments.size(), 3u);
  EXPECT_EQ(snap.segments[1].pool_id, (std::pair<std::int64_t, std::int64_t>{7, 0}));
  EXPECT_EQ(snap.segments[0].pool_id, (std::pair<std::int64_t, std::int64_t>{0, 0}));
  EXPECT_EQ(f.alloc.pool_use_count(kGraphPool), 1);
  f.alloc.free(c);
  f.alloc.free(d);
  f.alloc.free(other);
}

TEST(PrivatePools, APoolIsSharedBetweenCapturesAndReusesItsFreeBlocks) {
  Fixture f;
  f.begin(kGraphPool, 1);
  const DevicePtr x = f.alloc.malloc(8 * kMiB, 1);  // 20 MiB segment, split
  f.alloc.free(x);                                  // freed within the capture: reusable
  const DevicePtr out1 = f.alloc.malloc(4 * kMiB, 1);
  f.end(kGraphPool, 1);
  EXPECT_EQ(x, At(0));
  EXPECT_EQ(out1, At(0));
  // torch.cuda.graph(g2, pool=g1.pool()): a second capture shares the pool.
  f.begin(kGraphPool, 3);
  EXPECT_EQ(f.alloc.pool_use_count(kGraphPool), 2);
  const DevicePtr y = f.alloc.malloc(4 * kMiB, 3);  // stream 3: the pool's own arena for it
  f.end(kGraphPool, 3);
  EXPECT_EQ(y, At(20));
  EXPECT_EQ(f.alloc.segment_pool(y), kGraphPool);
  EXPECT_EQ(f.alloc.pool_live_allocations(kGraphPool), (std::vector<DevicePtr>{out1, y}));
  // A default request never takes the pool's 16 MiB free remainder.
  const DevicePtr z = f.alloc.malloc(4 * kMiB, 1);
  EXPECT_EQ(z, At(40));
  f.alloc.free(z);
  f.alloc.free(out1);
  f.alloc.free(y);
}

TEST(PrivatePools, UseCountZeroLetsEmptyCacheReturnThePoolsSegments) {
  Fixture f;
  f.alloc.create_pool(kPool);
  EXPECT_EQ(f.alloc.pool_use_count(kPool), 1);
  f.alloc.begin_allocate_to_pool(kPool, [](StreamId) { return true; });  // use_mem_pool
  EXPECT_EQ(f.alloc.pool_use_count(kPool), 2);
  const DevicePtr live = f.alloc.malloc(30 * kMiB, 0);
  const DevicePtr freed = f.alloc.malloc(30 * kMiB, 0);
  f.alloc.end_allocate_to_pool(kPool);
  f.alloc.free(freed);
  f.alloc.release_pool(kPool);
  EXPECT_EQ(f.alloc.pool_use_count(kPool), 1);
  // In use: empty_cache keeps the pool's cache, and so does empty_cache(id).
  f.alloc.empty_cache();
  f.alloc.empty_cache(kPool);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(60 * kMiB));
  f.alloc.release_pool(kPool);
  EXPECT_EQ(f.alloc.pool_use_count(kPool), 0);
  EXPECT_EQ(message_of<Error>([&] { f.alloc.release_pool(kPool); }),
            "ccalloc: release_pool: pool (0, 1) has no use left to release");
  const std::uint64_t frees = f.driver.counters().free_calls;
  f.alloc.empty_cache(kPool);  // the free segment goes; the live one stays
  EXPECT_EQ(f.driver.counters().free_calls, frees + 1);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(30 * kMiB));
  EXPECT_EQ(addresses(f.alloc.pool_segments(kPool)), std::vector<DevicePtr>{live});
  f.alloc.free(live);
  f.alloc.empty_cache();  // the last segment goes, and the pool with it
  EXPECT_EQ(f.reserved(), 0);
  EXPECT_EQ(message_of<Error>([&] { f.alloc.pool_use_count(kPool); }),
            "ccalloc: no private pool (0, 1) on device 0");
  // The id may be used again for a new pool.
  f.alloc.create_pool(kPool);
  EXPECT_EQ(f.alloc.pool_use_count(kPool), 1);
}

TEST(PrivatePools, UseOnOomLendsThePoolsFreeBlockToADefaultRequest) {
  for (const bool use_on_oom : {false, true}) {
    SCOPED_TRACE(use_on_oom);
    Fixture f("pytorch", 64 * kMiB);
    f.alloc.create_pool(kPool);
    f.alloc.set_pool_use_on_oom(kPool, use_on_oom);
    f.alloc.begin_allocate_to_pool(kPool, [](StreamId) { return true; });
    const DevicePtr p = f.alloc.malloc(40 * kMiB, 0);
    f.alloc.end_allocate_to_pool(kPool);
    f.alloc.free(p);
    // 24 MiB left on the device: a 30 MiB default request fails unless the pool lends.
    if (use_on_oom) {
      const DevicePtr q = f.alloc.malloc(30 * kMiB, 0);
      EXPECT_EQ(q, p);
      EXPECT_EQ(f.alloc.segment_pool(q), kPool);
      EXPECT_EQ(f.alloc.pool_live_allocations(kPool), std::vector<DevicePtr>{q});
      f.alloc.free(q);
    } else {
      const std::string message =
          message_of<OutOfMemoryError>([&] { f.alloc.malloc(30 * kMiB, 0); });
      EXPECT_NE(message.find("40.00 MiB of the unallocated memory is cached in private pools "
                             "(CUDA graphs, MemPools), which this request cannot use."),
                std::string::npos)
          << message;
    }
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(40 * kMiB));  // the pool kept it
  }
}

TEST(PrivatePools, NoSplitGivesEachAllocationAWholeBlock) {
  Fixture f;
  f.alloc.create_pool(kPool);
  f.alloc.create_pool(PoolId{0, 2});
  f.alloc.set_pool_no_split(kPool);
  f.alloc.begin_allocate_to_pool(kPool, [](StreamId s) { return s == 0; });
  const DevicePtr whole = f.alloc.malloc(4 * kMiB, 0);  // a 20 MiB segment, kept whole
  const DevicePtr small = f.alloc.malloc(4096, 0);      // a 2 MiB segment, kept whole
  f.alloc.end_allocate_to_pool(kPool);
  f.alloc.begin_allocate_to_pool(PoolId{0, 2}, [](StreamId s) { return s == 0; });
  const DevicePtr split = f.alloc.malloc(4 * kMiB, 0);
  f.alloc.end_allocate_to_pool(PoolId{0, 2});
  EXPECT_EQ(f.alloc.allocation_size(whole), 20 * kMiB);
  EXPECT_EQ(f.alloc.allocation_size(small), 2 * kMiB);
  EXPECT_EQ(f.alloc.allocation_size(split), 4 * kMiB);
  f.alloc.free(whole);
  f.alloc.free(small);
  f.alloc.free(split);
}

TEST(PrivatePools, ASegmentSourceProvidesAndTakesBackThePoolsSegments) {
  for (const std::string conf : {"pytorch", "pytorch,expandable_segments:True"}) {
    SCOPED_TRACE(conf);
    Fixture f(conf);
    std::vector<std::pair<DevicePtr, std::size_t>> given;
    std::vector<std::pair<DevicePtr, std::size_t>> taken;
    // Each call is marked as the engine's (in_segment_source(), which lets ccalloc's own
    // PyTorch entry points serve a pool of the same allocator from the device).
    int unmarked = 0;
    SegmentSource source{[&](std::size_t bytes) {
                           unmarked += in_segment_source() ? 0 : 1;
                           const DevicePtr p = f.driver.allocate(bytes);
                           given.emplace_back(p, bytes);
                           return p;
                         },
                         [&](DevicePtr p, std::size_t bytes) {
                           unmarked += in_segment_source() ? 0 : 1;
                           taken.emplace_back(p, bytes);
                           f.driver.free(p, bytes);
                         }};
    EXPECT_FALSE(in_segment_source());
    f.alloc.create_pool(kPool, source);
    EXPECT_EQ(message_of<Error>([&] { f.alloc.create_pool(kPool, source); }),
              "ccalloc: pool (0, 1) already exists: its segment source cannot be given again");
    f.alloc.begin_allocate_to_pool(kPool, [](StreamId) { return true; });
    const DevicePtr a = f.alloc.malloc(4096, 0);
    const DevicePtr b = f.alloc.malloc(12 * kMiB, 0);
    f.alloc.end_allocate_to_pool(kPool);
    const DevicePtr c = f.alloc.malloc(4096, 0);  // default pool: from the device
    EXPECT_EQ(given, (std::vector<std::pair<DevicePtr, std::size_t>>{{At(0), 2 * kMiB},
                                                                     {At(2), 12 * kMiB}}));
    f.alloc.free(a);
    f.alloc.free(b);
    f.alloc.free(c);
    f.alloc.release_pool(kPool);  // use_mem_pool's exit: begin's use
    f.alloc.release_pool(kPool);  // the MemPool's own
    f.alloc.empty_cache();
    EXPECT_EQ(taken, (std::vector<std::pair<DevicePtr, std::size_t>>{{At(2), 12 * kMiB},
                                                                     {At(0), 2 * kMiB}}));
    EXPECT_EQ(f.reserved(), 0);
    EXPECT_EQ(unmarked, 0);
    EXPECT_FALSE(in_segment_source());
  }
}

TEST(PrivatePools, CrossStreamFreesDuringCaptureWaitUntilItEnds) {
  Fixture f;
  const DevicePtr a = f.alloc.malloc(4096, 0);  // default pool, used on stream 5
  f.alloc.record_stream(a, 5);
  f.begin(kGraphPool, 1);
  const DevicePtr p = f.alloc.malloc(4096, 1);  // the pool's block, used on stream 2
  f.alloc.record_stream(p, 2);
  f.alloc.free(a);  // no event may be recorded now: deferred
  f.alloc.free(p);
  const DevicePtr q = f.alloc.malloc(4096, 1);  // p is not free yet
  EXPECT_EQ(q, p + 4096);
  const DevicePtr b = f.alloc.malloc(4096, 0);  // nor is a
  EXPECT_EQ(b, a + 4096);
  for (const SegmentInfo& s : f.alloc.segments()) {
    EXPECT_EQ(s.blocks[0].state, BlockState::kActivePendingFree) << std::hex << s.address;
  }
  f.end(kGraphPool, 1);
  EXPECT_EQ(f.driver.counters().event_records, 0u);
  EXPECT_EQ(f.driver.counters().event_queries, 0u);
  // The next operation records the deferred events (their streams have not completed).
  const DevicePtr c = f.alloc.malloc(4096, 0);
  EXPECT_EQ(c, a + 2 * 4096);
  EXPECT_EQ(f.driver.counters().event_records, 2u);
  f.driver.complete_all();
  const DevicePtr d = f.alloc.malloc(4096, 0);  // a is back in its pool
  EXPECT_EQ(d, a);
  for (const DevicePtr x : {b, c, d, q})
    f.alloc.free(x);
  EXPECT_EQ(f.alloc.pool_live_allocations(kGraphPool), std::vector<DevicePtr>{});
}

TEST(PrivatePools, OomDuringCaptureFreesNothingAndTheAllocatorStaysUsable) {
  // ccalloc: the stitching policy's default pools beside private pools on expandable
  // segments, or on native segments.
  for (const std::string conf : {"pytorch", "pytorch,expandable_segments:True", "ccalloc",
                                 "ccalloc,expandable_segments:False"}) {
    SCOPED_TRACE(conf);
    Fixture f(conf, 64 * kMiB);
    const DevicePtr cached = f.alloc.malloc(40 * kMiB, 1);
    f.alloc.free(cached);  // 40 MiB cached in the default pool, 24 MiB left on the device
    f.begin(kGraphPool, 1);
    const sim::Counters before = f.driver.counters();
    EXPECT_THROW(f.alloc.malloc(30 * kMiB, 1), OutOfMemoryError);
    f.alloc.empty_cache();  // nothing goes back during capture
    EXPECT_EQ(f.driver.counters().free_calls, before.free_calls);
    EXPECT_EQ(f.driver.counters().unmaps, before.unmaps);
    EXPECT_EQ(f.alloc.stats().num_alloc_retries, 0);
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(40 * kMiB));
    const DevicePtr fits = f.alloc.malloc(20 * kMiB, 1);  // still serves what fits
    EXPECT_EQ(f.alloc.segment_pool(fits), kGraphPool);
    f.end(kGraphPool, 1);
    // After the capture the default pool's cache serves it.
    const DevicePtr big = f.alloc.malloc(30 * kMiB, 1);
    EXPECT_EQ(big, cached);
    EXPECT_EQ(f.alloc.stats().num_alloc_retries, 0);
    f.alloc.free(big);
    // And cached memory goes back to the device again; the pool's live segment stays.
    f.alloc.empty_cache();
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(20 * kMiB));
    f.alloc.free(fits);
  }
}

TEST(PrivatePools, ExpandableSegmentsKeepPoolsApart) {
  Fixture f("expandable_segments:True");
  const DevicePtr a = f.alloc.malloc(4 * kMiB, 1);
  f.alloc.free(a);
  f.begin(kGraphPool, 1);
  const DevicePtr b = f.alloc.malloc(4 * kMiB, 1);
  f.end(kGraphPool, 1);
  EXPECT_NE(b, a);
  EXPECT_EQ(f.alloc.segment_pool(b), kGraphPool);
  EXPECT_EQ(f.alloc.segment_pool(a), PoolId{});
  const std::vector<SegmentInfo> pool = f.alloc.pool_segments(kGraphPool);
  ASSERT_EQ(pool.size(), 1u);
  EXPECT_TRUE(pool[0].is_expandable);
  EXPECT_EQ(pool[0].address, b);
  f.alloc.free(b);
  f.alloc.release_pool(kGraphPool);
  f.alloc.empty_cache();
  EXPECT_EQ(f.reserved(), 0);
  EXPECT_EQ(message_of<Error>([&] { f.alloc.pool_use_count(kGraphPool); }),
            "ccalloc: no private pool (7, 0) on device 0");
}

TEST(PrivatePools, CheckpointRestoresTheLayoutAndTheLiveBlocks) {
  for (const std::string conf : {"pytorch", "pytorch,expandable_segments:True"}) {
    SCOPED_TRACE(conf);
    Fixture f(conf);
    f.begin(kGraphPool, 1);
    const DevicePtr a = f.alloc.malloc(4 * kMiB, 1);
    const DevicePtr b = f.alloc.malloc(4 * kMiB, 1);
    const DevicePtr c = f.alloc.malloc(4 * kMiB, 1);
    const DevicePtr s = f.alloc.malloc(4096, 1);
    f.alloc.free(b);
    f.end(kGraphPool, 1);
    const std::vector<SegmentInfo> layout = f.alloc.pool_segments(kGraphPool);
    const auto checkpoint = f.alloc.checkpoint_pool(kGraphPool);
    // Replays change what is live: a dies, d is born (in b's old place).
    f.alloc.free(a);
    f.begin(kGraphPool, 1);
    const DevicePtr d = f.alloc.malloc(6 * kMiB, 1);
    f.end(kGraphPool, 1);
    const PoolRestore r = f.alloc.restore_pool(*checkpoint);
    std::vector<DevicePtr> freed = r.freed;
    std::vector<DevicePtr> allocated = r.allocated;
    std::sort(freed.begin(), freed.end());
    std::sort(allocated.begin(), allocated.end());
    std::vector<DevicePtr> want_freed{c, d, s};
    std::vector<DevicePtr> want_allocated{a, c, s};
    std::sort(want_freed.begin(), want_freed.end());
    std::sort(want_allocated.begin(), want_allocated.end());
    EXPECT_EQ(freed, want_freed);
    EXPECT_EQ(allocated, want_allocated);
    EXPECT_EQ(f.alloc.pool_live_allocations(kGraphPool), want_allocated);
    const std::vector<SegmentInfo> now = f.alloc.pool_segments(kGraphPool);
    ASSERT_EQ(now.size(), layout.size());
    for (std::size_t i = 0; i < now.size(); ++i) {
      EXPECT_EQ(now[i].address, layout[i].address);
      EXPECT_EQ(now[i].allocated_size, layout[i].allocated_size);
      ASSERT_EQ(now[i].blocks.size(), layout[i].blocks.size());
      for (std::size_t j = 0; j < now[i].blocks.size(); ++j) {
        EXPECT_EQ(now[i].blocks[j].address, layout[i].blocks[j].address);
        EXPECT_EQ(now[i].blocks[j].size, layout[i].blocks[j].size);
        EXPECT_EQ(now[i].blocks[j].state, layout[i].blocks[j].state);
      }
    }
    for (const DevicePtr x : want_allocated)
      f.alloc.free(x);
  }
}

TEST(PrivatePools, NestedPoolContextsAllocateToTheInnermost) {
  Fixture f;
  const PoolId outer{0, 1};
  const PoolId inner{0, 2};
  f.alloc.begin_allocate_to_pool(outer, [](StreamId) { return true; });
  const DevicePtr a = f.alloc.malloc(4096, 0);
  f.alloc.begin_allocate_to_pool(inner, [](StreamId) { return true; });
  const DevicePtr b = f.alloc.malloc(4096, 0);
  f.alloc.end_allocate_to_pool(inner);
  const DevicePtr c = f.alloc.malloc(4096, 0);
  f.alloc.end_allocate_to_pool(outer);
  const DevicePtr d = f.alloc.malloc(4096, 0);
  EXPECT_EQ(f.alloc.segment_pool(a), outer);
  EXPECT_EQ(f.alloc.segment_pool(b), inner);
  EXPECT_EQ(f.alloc.segment_pool(c), outer);
  EXPECT_EQ(c, a + 4096);
  EXPECT_EQ(f.alloc.segment_pool(d), PoolId{});
  EXPECT_EQ(f.alloc.pool_live_allocations(outer), (std::vector<DevicePtr>{a, c}));
  EXPECT_EQ(f.alloc.pool_live_allocations(inner), std::vector<DevicePtr>{b});
  for (const DevicePtr p : {a, b, c, d})
    f.alloc.free(p);
}

TEST(PrivatePools, MisuseIsReportedByName) {
  Fixture f;
  EXPECT_EQ(message_of<Error>([&] { f.alloc.create_pool(PoolId{}); }),
            "ccalloc: create_pool: pool id (0, 0) is the default pool, not a private pool");
  EXPECT_EQ(message_of<Error>([&] { f.alloc.end_allocate_to_pool(kPool); }),
            "ccalloc: end_allocate_to_pool: pool (0, 1) is not being allocated to");
  EXPECT_EQ(message_of<Error>([&] { f.alloc.release_pool(kPool); }),
            "ccalloc: no private pool (0, 1) on device 0");
  f.alloc.begin_allocate_to_pool(kPool, [](StreamId) { return false; });
  EXPECT_EQ(message_of<Error>(
                [&] { f.alloc.begin_allocate_to_pool(kPool, [](StreamId) { return false; }); }),
            "ccalloc: begin_allocate_to_pool: already allocating to pool (0, 1)");
  f.alloc.end_allocate_to_pool(kPool);
  EXPECT_EQ(f.alloc.pool_use_count(kPool), 1);
  EXPECT_EQ(message_of<Error>([&] { f.alloc.begin_allocate_to_pool(kPool, nullptr); }),
            "ccalloc: begin_allocate_to_pool needs a stream filter");
}

TEST(PrivatePools, CudaMallocAsyncCapturesOnTheCapturingStream) {
  Fixture f("backend:cudaMallocAsync");
  const DevicePtr before = f.alloc.malloc(4096, 0);
  f.alloc.record_stream(before, 4);
  f.begin(kGraphPool, 1);
  const DevicePtr p = f.alloc.malloc(4096, 1);
  EXPECT_NE(p, 0u);
  f.alloc.free(before);  // used on stream 4: waits for the capture's end
  f.alloc.free(p);
  f.alloc.empty_cache();  // no synchronization during capture
  EXPECT_EQ(message_of<Error>([&] {
              f.alloc.begin_allocate_to_pool(PoolId{8, 0}, nullptr);
            }),
            "ccalloc: begin_allocate_to_pool needs a stream filter");
  EXPECT_EQ(message_of<Error>([&] {
              f.alloc.begin_allocate_to_pool(PoolId{8, 0}, [](StreamId) { return true; });
            }),
            "ccalloc: backend:cudaMallocAsync allows only one capture at a time in a process");
  f.end(kGraphPool, 1);
  EXPECT_EQ(f.driver.counters().event_records, 0u);
  f.alloc.release_pool(kGraphPool);  // nothing to release, as PyTorch
  f.alloc.empty_cache();             // the deferred free happens first
  EXPECT_EQ(f.driver.counters().event_records, 1u);
  EXPECT_EQ(f.alloc.stats().allocation[kAggregate].current, 0);
  EXPECT_EQ(message_of<Error>([&] { f.alloc.create_pool(kPool); }),
            "ccalloc: backend:cudaMallocAsync has no private memory pools (create_pool); use "
            "the native policy for CUDA graphs and MemPools");
}

// Random operations on two streams with pools, captures and checkpoints interleaved; the
// invariants (checked after each operation) include that a pool's blocks stay in its own
// arenas, and each live pointer must belong to the pool it was allocated in.
TEST(PrivatePools, RandomizedOperationsKeepPoolsApart) {
  for (const std::string conf : {"pytorch", "pytorch,expandable_segments:True", "ccalloc",
                                 "ccalloc,expandable_segments:False"}) {
    SCOPED_TRACE(conf);
    Fixture f(conf, 512 * kMiB);
    std::mt19937_64 rng(42);
    struct Live {
      DevicePtr ptr;
      PoolId pool;
    };
    std::vector<Live> live;
    const PoolId pools[] = {PoolId{1, 0}, PoolId{0, 5}};
    std::optional<PoolId> capturing;
    const StreamId capture_stream = 1;
    for (int step = 0; step < 3000; ++step) {
      const int op = static_cast<int>(rng() % 100);
      if (op < 45) {
        const std::size_t size = rng() % 2 ? 1 + rng() % (1 << 20) : 1 + rng() % (24 * kMiB);
        const StreamId stream = rng() % 2;
        try {
          const DevicePtr p = f.alloc.malloc(size, stream);
          const PoolId expected = capturing && stream == capture_stream ? *capturing : PoolId{};
          ASSERT_EQ(f.alloc.segment_pool(p), expected);
          live.push_back({p, expected});
        } catch (const OutOfMemoryError&) {
        }
      } else if (op < 85 && !live.empty()) {
        const std::size_t i = rng() % live.size();
        if (rng() % 4 == 0) f.alloc.record_stream(live[i].ptr, 2 + rng() % 2);
        f.alloc.free(live[i].ptr);
        live[i] = live.back();
        live.pop_back();
      } else if (op < 92) {
        if (capturing) {
          f.end(*capturing, capture_stream);
          capturing.reset();
          f.driver.complete_all();
        } else {
          capturing = pools[rng() % 2];
          f.begin(*capturing, capture_stream);
        }
      } else if (op < 96) {
        f.alloc.empty_cache();
      } else if (!capturing) {
        f.driver.complete_all();
      }
    }
    if (capturing) f.end(*capturing, capture_stream);
    for (const Live& l : live) {
      EXPECT_EQ(f.alloc.segment_pool(l.ptr), l.pool);
      f.alloc.free(l.ptr);
    }
    for (const PoolId id : pools) {
      try {
        for (int n = f.alloc.pool_use_count(id); n > 0; --n)
          f.alloc.release_pool(id);
      } catch (const Error&) {  // never captured into
      }
    }
    f.driver.complete_all();
    f.alloc.empty_cache();
    EXPECT_EQ(f.alloc.stats().allocated_bytes[kAggregate].current, 0);
    EXPECT_EQ(f.reserved(), 0);
  }
}

}  // namespace
}  // namespace ccalloc
