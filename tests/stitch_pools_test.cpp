// The stitching policy with private pools beside it (src/stitch/backend.hpp), as the
// `ccalloc` preset runs it: captures and MemPool contexts allocate to the native engine's
// private pools, everything else to the stitched spaces; events wait while a capture is
// underway; one memory limit covers both engines; use_on_oom pools lend to default requests;
// sleepable pools sleep and wake beside stitched memory; statistics, segments and snapshots
// cover both engines. Exact values on the simulated GPU, invariants checked after every call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"
#include "test_support.hpp"

namespace ccalloc {
namespace {

using ccalloc_test::message_of;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr PoolId kGraph{7, 0};
constexpr PoolId kPool{0, 1};

struct Fixture {
  explicit Fixture(std::size_t capacity = kGiB, const std::string& conf = "ccalloc")
      : driver(options(capacity)), alloc(driver, Config::parse(conf)) {
    alloc.set_check_invariants(true);
  }
  static sim::Options options(std::size_t capacity) {
    sim::Options o;
    o.capacity = capacity;
    return o;
  }
  // As torch.cuda.graph does: the pool is allocated to first, then the stream captures.
  void begin(PoolId pool, StreamId stream) {
    alloc.begin_allocate_to_pool(pool, [stream](StreamId s) { return s == stream; });
    driver.begin_capture(stream);
  }
  void end(PoolId pool, StreamId stream) {
    driver.end_capture(stream);
    alloc.end_allocate_to_pool(pool);
  }
  // History of every action, without stacks.
  void record_history(std::size_t max_entries = HistoryOptions{}.max_entries) {
    HistoryOptions o;
    o.stacks = HistoryOptions::Stacks::kNone;
    o.max_entries = max_entries;
    alloc.record_history(o);
  }
  std::int64_t reserved() const { return alloc.stats().reserved_bytes[kAggregate].current; }
  std::int64_t allocations() const { return alloc.stats().allocation[kAggregate].current; }
  // Reserved bytes recounted from the segments (the stitching engine keeps no spare pieces
  // between operations, so its segments' sizes add up to its physical memory).
  std::int64_t segment_bytes() const {
    std::int64_t total = 0;
    for (const SegmentInfo& s : alloc.segments())
      total += static_cast<std::int64_t>(s.total_size);
    return total;
  }

  sim::SimDriver driver;
  Allocator alloc;
};

TEST(StitchPools, TheCcallocPresetServesCapturesFromPrivatePoolsAndTheRestByStitching) {
  Fixture f;
  const DevicePtr a = f.alloc.malloc(4096, 1);
  f.alloc.free(a);  // cached in stream 1's stitched small space
  f.begin(kGraph, 1);
  const DevicePtr b = f.alloc.malloc(4096, 1);        // the pool's, not the cached block
  const DevicePtr big = f.alloc.malloc(8 * kMiB, 1);  // the pool's
  const DevicePtr other = f.alloc.malloc(4096, 2);    // stream 2 is not captured
  f.end(kGraph, 1);
  EXPECT_NE(b, a);
  EXPECT_EQ(f.alloc.segment_pool(b), kGraph);
  EXPECT_EQ(f.alloc.segment_pool(big), kGraph);
  EXPECT_EQ(f.alloc.segment_pool(other), PoolId{});
  EXPECT_EQ(f.alloc.segment_pool(a), PoolId{});
  const DevicePtr c = f.alloc.malloc(4096, 1);  // after the capture: the stitched cache
  EXPECT_EQ(c, a);
  EXPECT_EQ(f.alloc.allocation_size(big), 8 * kMiB);
  EXPECT_EQ(f.alloc.allocation_size(c), 4096u);

  // The pool's segments are the native engine's (expandable, as the preset says) and the
  // device's segments list both engines' by address.
  const std::vector<SegmentInfo> pool = f.alloc.pool_segments(kGraph);
  ASSERT_FALSE(pool.empty());
  for (const SegmentInfo& s : pool) {
    EXPECT_EQ(s.pool, kGraph);
    EXPECT_TRUE(s.is_expandable);
  }
  const std::vector<SegmentInfo> all = f.alloc.segments();
  EXPECT_TRUE(std::is_sorted(all.begin(), all.end(), [](const SegmentInfo& x, const SegmentInfo& y) {
    return x.address < y.address;
  }));
  std::set<PoolId> pools;
  for (const SegmentInfo& s : all)
    pools.insert(s.pool);
  EXPECT_EQ(pools, (std::set<PoolId>{PoolId{}, kGraph}));
  EXPECT_EQ(f.allocations(), 4);
  EXPECT_EQ(f.reserved(), f.segment_bytes());
  const Snapshot snap = f.alloc.snapshot();
  ASSERT_EQ(snap.physical.size(), 1u);  // the stitching engine's pieces
  std::size_t graph_segments = 0;
  for (const SnapshotSegment& s : snap.segments)
    graph_segments += (s.pool_id == std::pair<std::int64_t, std::int64_t>{7, 0}) ? 1 : 0;
  EXPECT_EQ(graph_segments, pool.size());
  EXPECT_EQ(snap.segments.size(), all.size());

  for (const DevicePtr p : {b, big, other, c})
    f.alloc.free(p);
  EXPECT_EQ(f.alloc.pool_live_allocations(kGraph), std::vector<DevicePtr>{});
  f.alloc.release_pool(kGraph);
  f.alloc.empty_cache();
  EXPECT_EQ(f.reserved(), 0);
  EXPECT_EQ(f.allocations(), 0);
  EXPECT_EQ(f.driver.used_bytes(), 0u);
}

// A graph's memory costs no more than on PyTorch: beside the policy the private pools'
// expandable segments map 2 MiB pages in the large pool too, so a capture's segment ends
// less than 2 MiB past its blocks (20 MiB pages left up to 20 MiB mapped and unused,
// where PyTorch's plain segments of 20 MiB or the request's size leave less). Under
// `pytorch,expandable_segments:True` the pages stay PyTorch's 20 MiB.
TEST(StitchPools, PrivatePoolsMapTwoMiBPagesBesideThePolicy) {
  for (const bool stitched : {true, false}) {
    Fixture f(kGiB, stitched ? "ccalloc" : "pytorch,expandable_segments:True");
    f.begin(kGraph, 1);
    const DevicePtr a = f.alloc.malloc(33 * kMiB, 1);       // a cuBLAS workspace's size
    const DevicePtr b = f.alloc.malloc(3 * kMiB + 5, 1);
    f.end(kGraph, 1);
    std::size_t mapped = 0;
    for (const SegmentInfo& s : f.alloc.pool_segments(kGraph)) {
      EXPECT_TRUE(s.is_expandable);
      EXPECT_FALSE(s.is_small);
      mapped += s.total_size;
    }
    // 33 MiB + 3 MiB + 512 B in whole pages.
    EXPECT_EQ(mapped, stitched ? 38 * kMiB : 40 * kMiB) << (stitched ? "ccalloc" : "pytorch");
    EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(mapped));
    f.alloc.free(a);
    f.alloc.free(b);
    f.alloc.release_pool(kGraph);
    f.alloc.empty_cache();
    EXPECT_EQ(f.driver.used_bytes(), 0u);
  }
}

TEST(StitchPools, CrossStreamFreesDuringACaptureWaitUntilItEnds) {
  Fixture f;
  const DevicePtr a = f.alloc.malloc(4096, 0);  // stitched, used on stream 5
  f.alloc.record_stream(a, 5);
  const DevicePtr big = f.alloc.malloc(6 * kMiB, 0);
  f.alloc.record_stream(big, 6);
  f.begin(kGraph, 1);
  f.alloc.free(a);  // no event may be recorded now: the free waits
  f.alloc.free(big);
  const DevicePtr b = f.alloc.malloc(4096, 0);  // stream 0 is not captured; a is not free
  EXPECT_NE(b, a);
  const DevicePtr again = f.alloc.malloc(6 * kMiB, 0);  // nor is big
  EXPECT_NE(again, big);
  f.alloc.empty_cache();  // nothing goes back during a capture
  EXPECT_EQ(f.driver.counters().event_records, 0u);
  EXPECT_EQ(f.driver.counters().event_queries, 0u);
  EXPECT_EQ(f.driver.counters().unmaps, 0u);
  std::size_t pending = 0;
  for (const SegmentInfo& s : f.alloc.segments()) {
    for (const BlockInfo& blk : s.blocks)
      pending += blk.state == BlockState::kActivePendingFree ? 1 : 0;
  }
  EXPECT_EQ(pending, 2u);
  f.end(kGraph, 1);
  EXPECT_EQ(f.driver.counters().event_records, 0u);
  // The next malloc records the deferred events; streams 5 and 6 have not completed.
  const DevicePtr c = f.alloc.malloc(4096, 0);
  EXPECT_NE(c, a);
  EXPECT_EQ(f.driver.counters().event_records, 2u);
  f.driver.complete_all();
  const DevicePtr d = f.alloc.malloc(4096, 0);  // a is back in its pool
  EXPECT_EQ(d, a);
  for (const DevicePtr p : {b, again, c, d})
    f.alloc.free(p);
  EXPECT_EQ(f.allocations(), 0);
}

// A private pool's block used on another stream and freed during a capture: after the
// capture, the next malloc records its event and, once that has completed, the malloc after
// returns it to the pool, even though both mallocs go to the stitching policy (PyTorch's
// every malloc processes every event). The statistics say so.
TEST(StitchPools, PrivatePoolFreesWaitingForEventsReturnAtDefaultMallocs) {
  Fixture f;
  f.begin(kGraph, 1);
  const DevicePtr p = f.alloc.malloc(4096, 1);  // the pool's, used on stream 2
  f.alloc.record_stream(p, 2);
  f.alloc.free(p);
  f.end(kGraph, 1);
  const auto active = [&f] { return f.alloc.stats().active[kAggregate].current; };
  EXPECT_EQ(active(), 1);  // pending
  const DevicePtr a = f.alloc.malloc(4096, 0);
  EXPECT_EQ(f.driver.counters().event_records, 1u);
  EXPECT_EQ(active(), 2);
  f.driver.complete_all();
  const DevicePtr b = f.alloc.malloc(4096, 0);
  EXPECT_EQ(active(), 2);  // a and b: p is free in its pool
  EXPECT_EQ(f.alloc.pool_live_allocations(kGraph), std::vector<DevicePtr>{});
  f.alloc.free(a);
  f.alloc.free(b);
  EXPECT_EQ(active(), 0);
}

TEST(StitchPools, OneMemoryFractionCoversBothEngines) {
  Fixture f(kGiB);
  f.alloc.set_memory_fraction(0.5);  // 512 MiB
  const DevicePtr stitched = f.alloc.malloc(400 * kMiB, 0);
  f.begin(kGraph, 1);
  const std::string m = message_of<OutOfMemoryError>([&] { f.alloc.malloc(200 * kMiB, 1); });
  EXPECT_NE(m.find("per_process_memory_fraction"), std::string::npos) << m;
  const DevicePtr pooled = f.alloc.malloc(80 * kMiB, 1);  // 400 + 80 fits the limit
  f.end(kGraph, 1);
  EXPECT_LE(f.reserved(), static_cast<std::int64_t>(512 * kMiB));
  // The other way round: the pool's memory counts against the stitching engine's growth.
  EXPECT_THROW(f.alloc.malloc(100 * kMiB, 0), OutOfMemoryError);
  EXPECT_LE(f.reserved(), static_cast<std::int64_t>(512 * kMiB));
  f.alloc.free(pooled);
  f.alloc.release_pool(kGraph);
  const DevicePtr more = f.alloc.malloc(100 * kMiB, 0);  // the pool's cache gave way
  EXPECT_EQ(f.alloc.segment_pool(more), PoolId{});
  EXPECT_LE(f.reserved(), static_cast<std::int64_t>(512 * kMiB));
  f.alloc.free(more);
  f.alloc.free(stitched);
  f.alloc.empty_cache();
  EXPECT_EQ(f.reserved(), 0);
}

// Each engine's own peaks are exact; their sum is not the device's once both have held memory
// at different times. Reserved bytes' device-wide peaks come from one ledger of both.
// The block statistics' device-wide peaks are those of the two engines' blocks together
// (settled jointly), not the sum of each engine's peak.
TEST(StitchPools, BlockPeaksAreTheDevicesNotTheSumOfTheEngines) {
  Fixture f;
  const auto stats = [&f] { return f.alloc.stats(); };
  const DevicePtr stitched = f.alloc.malloc(100 * kMiB, 0);
  f.alloc.free(stitched);
  f.begin(kGraph, 1);
  const DevicePtr pooled = f.alloc.malloc(60 * kMiB, 1);  // the private pool's engine
  f.end(kGraph, 1);
  ASSERT_EQ(f.alloc.segment_pool(pooled), kGraph);
  // 100 MiB, then 60: the device never held 160 MiB of blocks, nor two at once.
  EXPECT_EQ(stats().allocated_bytes[kAggregate].peak, static_cast<std::int64_t>(100 * kMiB));
  EXPECT_EQ(stats().allocated_bytes[kLargePool].peak, static_cast<std::int64_t>(100 * kMiB));
  EXPECT_EQ(stats().active_bytes[kAggregate].peak, static_cast<std::int64_t>(100 * kMiB));
  EXPECT_EQ(stats().requested_bytes[kAggregate].peak, static_cast<std::int64_t>(100 * kMiB));
  EXPECT_EQ(stats().allocation[kAggregate].peak, 1);
  EXPECT_EQ(stats().active[kAggregate].peak, 1);
  // 50 MiB more beside the pool's 60: 110 is a new peak, and two blocks at once.
  const DevicePtr more = f.alloc.malloc(50 * kMiB, 0);
  EXPECT_EQ(stats().allocated_bytes[kAggregate].peak, static_cast<std::int64_t>(110 * kMiB));
  EXPECT_EQ(stats().allocation[kAggregate].peak, 2);
  // Small blocks count in their pool and in the aggregate, at once with the others.
  const DevicePtr tiny = f.alloc.malloc(4096, 0);
  EXPECT_EQ(stats().allocated_bytes[kSmallPool].peak, 4096);
  EXPECT_EQ(stats().allocated_bytes[kAggregate].peak,
            static_cast<std::int64_t>(110 * kMiB + 4096));
  EXPECT_EQ(stats().allocation[kAggregate].peak, 3);
  f.alloc.free(more);
  f.alloc.free(tiny);
  // The pool's block goes, then the stitched engine rises to 150: the peak is 150, not
  // the 110 before it plus anything of the pool's.
  f.alloc.free(pooled);
  const DevicePtr big = f.alloc.malloc(150 * kMiB, 0);
  EXPECT_EQ(stats().allocated_bytes[kAggregate].peak, static_cast<std::int64_t>(150 * kMiB));
  EXPECT_EQ(stats().allocation[kAggregate].peak, 3);
  f.alloc.reset_peak_stats();
  EXPECT_EQ(stats().allocated_bytes[kAggregate].peak, static_cast<std::int64_t>(150 * kMiB));
  EXPECT_EQ(stats().allocation[kAggregate].peak, 1);
  f.alloc.free(big);
  f.alloc.release_pool(kGraph);
  EXPECT_EQ(stats().allocated_bytes[kAggregate].current, 0);
  EXPECT_EQ(stats().allocated_bytes[kAggregate].peak, static_cast<std::int64_t>(150 * kMiB));
}

// Segment counts likewise (private pools on native segments, which count one each).
TEST(StitchPools, SegmentPeaksAreTheDevicesNotTheSumOfTheEngines) {
  Fixture f(32 * kGiB, "ccalloc,expandable_segments:False,stitch_handle_mb:64");
  const auto segments = [&f] { return f.alloc.stats().segment; };
  f.alloc.free(f.alloc.malloc(100 * kMiB, 0));  // two handles: 64 + 36 MiB
  EXPECT_EQ(segments()[kAggregate].current, 2);
  f.alloc.empty_cache();
  f.begin(kGraph, 1);
  const DevicePtr pooled = f.alloc.malloc(60 * kMiB, 1);  // one segment of the pool's engine
  f.end(kGraph, 1);
  ASSERT_EQ(f.alloc.segment_pool(pooled), kGraph);
  EXPECT_EQ(segments()[kAggregate].current, 1);
  EXPECT_EQ(segments()[kAggregate].peak, 2);  // never three at once
  EXPECT_EQ(segments()[kLargePool].peak, 2);
  const DevicePtr more = f.alloc.malloc(30 * kMiB, 0);  // one more handle beside the pool's
  EXPECT_EQ(segments()[kAggregate].current, 2);
  EXPECT_EQ(segments()[kAggregate].peak, 2);
  const DevicePtr tiny = f.alloc.malloc(4096, 0);  // a small handle: three at once
  EXPECT_EQ(segments()[kAggregate].peak, 3);
  EXPECT_EQ(segments()[kSmallPool].peak, 1);
  f.alloc.free(more);
  f.alloc.free(tiny);
  f.alloc.empty_cache();
  f.alloc.reset_peak_stats();
  EXPECT_EQ(segments()[kAggregate].peak, 1);
  f.alloc.free(pooled);
  f.alloc.release_pool(kGraph);
  f.alloc.empty_cache();
  EXPECT_EQ(segments()[kAggregate].current, 0);
  EXPECT_EQ(segments()[kAggregate].peak, 1);
}

TEST(StitchPools, ReservedPeaksAreTheDevicesNotTheSumOfTheEngines) {
  Fixture f;
  const auto peak = [&f](StatType t) { return f.alloc.stats().reserved_bytes[t].peak; };
  const DevicePtr stitched = f.alloc.malloc(100 * kMiB, 0);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(100 * kMiB));
  f.alloc.free(stitched);
  f.alloc.empty_cache();
  EXPECT_EQ(f.reserved(), 0);
  f.begin(kGraph, 1);
  const DevicePtr pooled = f.alloc.malloc(60 * kMiB, 1);  // the private pool's engine
  f.end(kGraph, 1);
  EXPECT_EQ(f.alloc.segment_pool(pooled), kGraph);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(60 * kMiB));
  // 100 MiB, then 60: the device never held 160.
  EXPECT_EQ(peak(kAggregate), static_cast<std::int64_t>(100 * kMiB));
  EXPECT_EQ(peak(kLargePool), static_cast<std::int64_t>(100 * kMiB));
  EXPECT_EQ(peak(kSmallPool), 0);
  // Both at once: 60 + 70 is a new peak.
  const DevicePtr more = f.alloc.malloc(70 * kMiB, 0);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(130 * kMiB));
  EXPECT_EQ(peak(kAggregate), static_cast<std::int64_t>(130 * kMiB));
  const DevicePtr tiny = f.alloc.malloc(4096, 0);  // a small page of the stitched engine
  EXPECT_EQ(peak(kSmallPool), static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(peak(kAggregate), static_cast<std::int64_t>(132 * kMiB));
  f.alloc.free(more);
  f.alloc.free(tiny);
  f.alloc.empty_cache();  // the pool's segment stays: its block is live
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(60 * kMiB));
  EXPECT_EQ(peak(kAggregate), static_cast<std::int64_t>(132 * kMiB));
  f.alloc.reset_peak_stats();
  for (StatType t : {kAggregate, kSmallPool, kLargePool}) {
    EXPECT_EQ(peak(t), f.alloc.stats().reserved_bytes[t].current) << t;
  }
  EXPECT_EQ(peak(kAggregate), static_cast<std::int64_t>(60 * kMiB));
  f.alloc.free(pooled);
  f.alloc.release_pool(kGraph);
  f.alloc.empty_cache();
  EXPECT_EQ(f.reserved(), 0);
  EXPECT_EQ(peak(kAggregate), static_cast<std::int64_t>(60 * kMiB));
}

TEST(StitchPools, AUseOnOomPoolLendsItsFreeBlockToADefaultRequest) {
  Fixture f(64 * kMiB);
  int observed = 0;
  f.alloc.add_oom_observer([&observed](int, std::size_t, std::size_t, std::size_t) { ++observed; });
  f.alloc.create_pool(kPool);
  f.alloc.set_pool_use_on_oom(kPool, true);
  f.begin(kPool, 0);
  const DevicePtr held = f.alloc.malloc(40 * kMiB, 0);
  f.end(kPool, 0);
  f.alloc.free(held);  // cached in the pool, which is still in use: not released
  const DevicePtr p = f.alloc.malloc(30 * kMiB, 0);  // 24 MiB left on the device
  EXPECT_EQ(f.alloc.segment_pool(p), kPool);
  EXPECT_EQ(p, held);
  // An OOM the pool averts is none: not counted, not observed (as PyTorch's ladder).
  EXPECT_EQ(f.alloc.stats().num_ooms, 0);
  EXPECT_EQ(observed, 0);
  f.alloc.free(p);
  // Without use_on_oom the same request is an OOM that leaves the allocator usable.
  f.alloc.set_pool_use_on_oom(kPool, false);
  EXPECT_THROW(f.alloc.malloc(30 * kMiB, 0), OutOfMemoryError);
  EXPECT_EQ(f.alloc.stats().num_ooms, 1);
  EXPECT_EQ(observed, 1);
  const DevicePtr small = f.alloc.malloc(4096, 0);
  EXPECT_EQ(f.alloc.segment_pool(small), PoolId{});
  f.alloc.free(small);
  for (int n = f.alloc.pool_use_count(kPool); n > 0; --n)
    f.alloc.release_pool(kPool);
  f.alloc.empty_cache();
  EXPECT_EQ(f.reserved(), 0);
}

// A default-pool request the policy cannot serve first has the private pools' cached
// segments released (a graph pool no longer in use): the request is then served by the
// policy, and no OOM is counted, traced or observed.
TEST(StitchPools, ReleasingAFreedGraphPoolsCacheAvertsAnOom) {
  Fixture f(64 * kMiB);
  int observed = 0;
  f.alloc.add_oom_observer([&observed](int, std::size_t, std::size_t, std::size_t) { ++observed; });
  f.record_history();
  f.begin(kGraph, 0);
  const DevicePtr captured = f.alloc.malloc(40 * kMiB, 0);
  f.end(kGraph, 0);
  f.alloc.free(captured);
  f.alloc.release_pool(kGraph);  // its cached segment waits for a release of the cache
  ASSERT_GE(f.reserved(), static_cast<std::int64_t>(40 * kMiB));
  const DevicePtr p = f.alloc.malloc(30 * kMiB, 0);
  EXPECT_EQ(f.alloc.segment_pool(p), PoolId{});
  EXPECT_EQ(f.alloc.stats().num_ooms, 0);
  EXPECT_EQ(observed, 0);
  const Snapshot snap = f.alloc.snapshot();
  for (const SnapshotTraceEntry& e : snap.device_traces.at(0))
    EXPECT_NE(e.action, TraceAction::kOom);
  f.alloc.free(p);
  f.alloc.empty_cache();
  EXPECT_EQ(f.reserved(), 0);
}

TEST(StitchPools, ASleepablePoolSleepsAndWakesBesideStitchedMemory) {
  Fixture f(256 * kMiB);
  f.alloc.create_sleepable_pool(kPool);
  f.alloc.begin_allocate_to_pool(kPool, [](StreamId s) { return s == 0; });
  const DevicePtr w = f.alloc.malloc(64 * kMiB, 0);
  f.alloc.end_allocate_to_pool(kPool);
  std::vector<unsigned char> bytes(64 * kMiB);
  for (std::size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<unsigned char>(i * 7 + 3);
  f.driver.write(w, bytes.data(), bytes.size());
  const std::int64_t before = f.reserved();
  f.alloc.sleep_pool(kPool, SleepMode::kSave);
  EXPECT_EQ(f.reserved(), before - static_cast<std::int64_t>(64 * kMiB));
  // Other work takes the memory the pool gave back, then frees it into the stitched cache.
  const DevicePtr other = f.alloc.malloc(220 * kMiB, 0);
  EXPECT_EQ(f.alloc.segment_pool(other), PoolId{});
  EXPECT_THROW(f.alloc.wake_pool(kPool), OutOfMemoryError);
  EXPECT_TRUE(f.alloc.pool_asleep(kPool));
  f.alloc.free(other);
  f.alloc.wake_pool(kPool);  // the stitched cache gives way
  EXPECT_FALSE(f.alloc.pool_asleep(kPool));
  std::vector<unsigned char> back(bytes.size());
  f.driver.read(w, back.data(), back.size());
  EXPECT_EQ(back, bytes);
  f.alloc.free(w);
}

TEST(StitchPools, HistoryOfBothEnginesIsOneTimeline) {
  Fixture f;
  f.record_history();
  const DevicePtr x = f.alloc.malloc(4096, 0);
  f.begin(kGraph, 1);
  const DevicePtr y = f.alloc.malloc(4096, 1);
  f.end(kGraph, 1);
  const DevicePtr z = f.alloc.malloc(3 * kMiB, 0);
  for (const DevicePtr p : {x, y, z})
    f.alloc.free(p);
  const Snapshot snap = f.alloc.snapshot();
  ASSERT_FALSE(snap.device_traces.empty());
  const auto& trace = snap.device_traces[0];
  EXPECT_TRUE(std::is_sorted(trace.begin(), trace.end(),
                             [](const SnapshotTraceEntry& a, const SnapshotTraceEntry& b) {
                               return a.seq < b.seq;
                             }));
  std::vector<DevicePtr> allocs;
  for (const SnapshotTraceEntry& e : trace) {
    if (e.action == TraceAction::kAlloc) allocs.push_back(e.addr);
  }
  EXPECT_EQ(allocs, (std::vector<DevicePtr>{x, y, z}));
}

// A snapshot of both engines reads as one allocator's: one snapshot entry counting the
// active bytes of both, and a history no longer than one ring of the requested length.
TEST(StitchPools, OneSnapshotEntryAndOneRingLengthForBothEngines) {
  Fixture f;
  f.record_history(/*max_entries=*/5);
  const DevicePtr x = f.alloc.malloc(4096, 0);
  f.begin(kGraph, 1);
  const DevicePtr y = f.alloc.malloc(8192, 1);
  f.end(kGraph, 1);
  const DevicePtr z = f.alloc.malloc(3 * kMiB, 0);
  {
    const Snapshot snap = f.alloc.snapshot();
    const auto& trace = snap.device_traces.at(0);
    std::vector<std::pair<TraceAction, DevicePtr>> got;
    for (const SnapshotTraceEntry& e : trace)
      got.emplace_back(e.action, e.addr);
    // The newest five: the mappings of z's growth, its alloc, the snapshot.
    ASSERT_EQ(trace.size(), 5u);
    EXPECT_EQ(got[0].first, TraceAction::kSegmentMap);
    EXPECT_EQ(got[3], std::make_pair(TraceAction::kAlloc, z));
    EXPECT_EQ(trace.back().action, TraceAction::kSnapshot);
    EXPECT_EQ(trace.back().size, 4096 + 8192 + 3 * kMiB);
    EXPECT_TRUE(snap.allocator_settings.trace_alloc_overflowed);
  }
  for (const DevicePtr p : {x, y, z})
    f.alloc.free(p);
  const Snapshot again = f.alloc.snapshot();
  const auto& trace = again.device_traces.at(0);
  ASSERT_EQ(trace.size(), 5u);
  int snapshots = 0;
  for (const SnapshotTraceEntry& e : trace)
    snapshots += e.action == TraceAction::kSnapshot ? 1 : 0;
  EXPECT_EQ(snapshots, 1);  // the first snapshot's entry is older than the newest five
  EXPECT_EQ(trace.back().size, 0u);
}

TEST(StitchPools, BadPointersAreReportedByName) {
  Fixture f;
  const DevicePtr p = f.alloc.malloc(4096, 0);
  const std::string m = message_of<InvalidPointerError>([&] { f.alloc.free(p + 16); });
  EXPECT_NE(m.find("free"), std::string::npos) << m;
  EXPECT_THROW(f.alloc.record_stream(0x1234, 2), InvalidPointerError);
  f.alloc.free(p);
  EXPECT_THROW(f.alloc.free(p), InvalidPointerError);
  EXPECT_EQ(f.allocations(), 0);
}

}  // namespace
}  // namespace ccalloc
