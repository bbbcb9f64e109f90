// Expandable segments (expandable_segments:True): one address reservation per (stream,
// pool), pages mapped on demand lowest address first, only wholly free pages unmapped.
// Expected values follow docs/pytorch-behaviour.md §2.16.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"
#include "io/trace_csv.hpp"
#include "replay/replay.hpp"

namespace {

using ccalloc::Allocator;
using ccalloc::Config;
using ccalloc::DevicePtr;
using ccalloc::kAggregate;
using ccalloc::kLargePool;
using ccalloc::kSmallPool;
using ccalloc::TraceAction;
using ccalloc::TraceEntry;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr DevicePtr kVa = 0x600000000000;  // the simulated GPU's first reservation

struct Fixture {
  explicit Fixture(std::size_t capacity = 8 * kGiB,
                   const char* conf = "pytorch,expandable_segments:True")
      : gpu(options(capacity)), alloc(gpu, Config::parse(conf)) {
    alloc.set_check_invariants(true);
    alloc.add_trace_observer([this](const TraceEntry& e) { trace.push_back(e); });
  }
  static ccalloc::sim::Options options(std::size_t capacity) {
    ccalloc::sim::Options o;
    o.capacity = capacity;
    return o;
  }
  std::vector<TraceEntry> of(TraceAction a) const {
    std::vector<TraceEntry> out;
    for (const TraceEntry& e : trace) {
      if (e.action == a) out.push_back(e);
    }
    return out;
  }
  ccalloc::sim::SimDriver gpu;
  Allocator alloc;
  std::vector<TraceEntry> trace;
};

// 9/8 of 8 GiB, in whole pages.
constexpr std::size_t kSmallReserve = 9 * kGiB;
constexpr std::size_t kLargeReserve = (9 * kGiB + 20 * kMiB - 1) / (20 * kMiB) * (20 * kMiB);
// On an 80 MiB device: 90 MiB, rounded up to 20 MiB pages.
constexpr std::size_t kLargeReserveFor80MiB = 100 * kMiB;

TEST(Expandable, FirstSmallAllocationMapsOneTwoMiBPageOfANewReservation) {
  Fixture f;
  const DevicePtr p = f.alloc.malloc(512);
  EXPECT_EQ(p, kVa);
  const auto maps = f.of(TraceAction::kSegmentMap);
  ASSERT_EQ(maps.size(), 1u);
  EXPECT_EQ(maps[0].addr, kVa);
  EXPECT_EQ(maps[0].size, 2 * kMiB);
  EXPECT_TRUE(f.of(TraceAction::kSegmentAlloc).empty());
  const auto s = f.alloc.stats();
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(s.reserved_bytes[kSmallPool].current, static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(s.segment[kAggregate].current, 0) << "mapping does not count as a segment";
  EXPECT_EQ(s.num_device_alloc, 1);
  EXPECT_EQ(f.gpu.counters().reserve_calls, 1u);
  EXPECT_EQ(f.gpu.counters().physical_creates, 1u);
  f.alloc.free(p);
}

TEST(Expandable, LargeRequestsMapWholeTwentyMiBPagesInOneCall) {
  Fixture f;
  const DevicePtr a = f.alloc.malloc(150 * kMiB);  // 8 pages of 20 MiB
  EXPECT_EQ(a, kVa);
  const DevicePtr b = f.alloc.malloc(5 * kMiB);  // fits in the mapped tail: no new map
  EXPECT_EQ(b, kVa + 150 * kMiB);
  const auto maps = f.of(TraceAction::kSegmentMap);
  ASSERT_EQ(maps.size(), 1u);
  EXPECT_EQ(maps[0].size, 160 * kMiB);
  const DevicePtr c = f.alloc.malloc(6 * kMiB);  // 5 MiB left mapped: map one more page
  EXPECT_EQ(c, kVa + 155 * kMiB);
  const auto maps2 = f.of(TraceAction::kSegmentMap);
  ASSERT_EQ(maps2.size(), 2u);
  EXPECT_EQ(maps2[1].addr, kVa + 160 * kMiB);
  EXPECT_EQ(maps2[1].size, 20 * kMiB);
  const auto s = f.alloc.stats();
  EXPECT_EQ(s.reserved_bytes[kLargePool].current, static_cast<std::int64_t>(180 * kMiB));
  EXPECT_EQ(s.num_device_alloc, 2);
  // Blocks of one segment stay contiguous across the two mappings: one snapshot segment.
  const auto segs = f.alloc.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_TRUE(segs[0].is_expandable);
  EXPECT_EQ(segs[0].total_size, 180 * kMiB);
  for (const DevicePtr p : {a, b, c})
    f.alloc.free(p);
}

TEST(Expandable, SmallAndLargePoolsHaveTheirOwnReservations) {
  Fixture f;
  const DevicePtr large = f.alloc.malloc(2 * kMiB);
  const DevicePtr small = f.alloc.malloc(512);
  EXPECT_EQ(large, kVa);
  EXPECT_EQ(small, kVa + kLargeReserve);
  EXPECT_EQ(f.gpu.counters().reserve_calls, 2u);
  f.alloc.free(large);
  f.alloc.free(small);
  (void)kSmallReserve;
}

TEST(Expandable, EmptyCacheUnmapsWhollyFreePagesAndReleasesAnEmptySegment) {
  Fixture f;
  const DevicePtr a = f.alloc.malloc(30 * kMiB);       // pages 0-1 (40 MiB mapped)
  const DevicePtr b = f.alloc.malloc(1 * kMiB + 512);  // at 30 MiB, in page 1
  f.alloc.free(a);
  f.alloc.empty_cache();
  // Page 0 is wholly free and unmapped; page 1 holds b.
  auto unmaps = f.of(TraceAction::kSegmentUnmap);
  ASSERT_EQ(unmaps.size(), 1u);
  EXPECT_EQ(unmaps[0].addr, kVa);
  EXPECT_EQ(unmaps[0].size, 20 * kMiB);
  auto s = f.alloc.stats();
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(20 * kMiB));
  EXPECT_EQ(s.num_device_free, 1);
  const auto segs = f.alloc.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].address, kVa + 20 * kMiB);
  EXPECT_EQ(segs[0].total_size, 20 * kMiB);
  f.alloc.free(b);
  f.alloc.empty_cache();
  unmaps = f.of(TraceAction::kSegmentUnmap);
  ASSERT_EQ(unmaps.size(), 2u);
  EXPECT_EQ(unmaps[1].addr, kVa + 20 * kMiB);
  s = f.alloc.stats();
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, 0);
  EXPECT_EQ(f.gpu.counters().address_frees, 1u) << "the empty reservation is given back";
  EXPECT_TRUE(f.alloc.segments().empty());
}

TEST(Expandable, FreedMemoryIsReusedBeforeMappingMore) {
  Fixture f;
  const DevicePtr a = f.alloc.malloc(20 * kMiB);
  f.alloc.free(a);
  const DevicePtr b = f.alloc.malloc(12 * kMiB);
  EXPECT_EQ(b, kVa);
  EXPECT_EQ(f.of(TraceAction::kSegmentMap).size(), 1u);
  f.alloc.free(b);
}

// A free block at the end of the mapped range can grow into the unmapped space after it;
// the allocator counts that room when choosing the best fit.
TEST(Expandable, BestFitCountsTheUnmappedRoomAfterAFreeBlock) {
  Fixture f;
  const DevicePtr a = f.alloc.malloc(20 * kMiB);     // page 0
  const DevicePtr keep = f.alloc.malloc(2 * kMiB);   // page 1 starts
  const DevicePtr tail = f.alloc.malloc(10 * kMiB);  // page 1 continues
  f.alloc.free(a);                                   // free 20 MiB at the start, followed by `keep`
  f.alloc.free(tail);  // free 8 MiB at the end, followed by unmapped space
  // 8 MiB fits both: the end block is smaller (8 MiB) but can grow to the whole reserve;
  // the 20 MiB block is the tighter fit by that measure.
  const DevicePtr c = f.alloc.malloc(8 * kMiB);
  EXPECT_EQ(c, kVa);
  f.alloc.free(c);
  f.alloc.free(keep);
}

// The large pool caches 80 MiB of mapped, free pages on an 80 MiB device; a small request
// needs a page of its own: the ladder unmaps the cached pages, then maps it.
TEST(Expandable, OutOfPhysicalMemoryUnmapsCachedPagesAndRetries) {
  Fixture f(/*capacity=*/80 * kMiB);
  f.alloc.free(f.alloc.malloc(80 * kMiB));
  const DevicePtr small = f.alloc.malloc(512);
  EXPECT_EQ(small, kVa + kLargeReserveFor80MiB);
  const auto unmaps = f.of(TraceAction::kSegmentUnmap);
  ASSERT_EQ(unmaps.size(), 1u);
  EXPECT_EQ(unmaps[0].addr, kVa);
  EXPECT_EQ(unmaps[0].size, 80 * kMiB);
  const auto s = f.alloc.stats();
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_sync_all_streams, 1);
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(f.gpu.counters().address_frees, 1u);
  f.alloc.free(small);
}

TEST(Expandable, OutOfMemoryLeavesNothingMappedForTheFailedRequest) {
  Fixture f(/*capacity=*/100 * kMiB);
  const DevicePtr a = f.alloc.malloc(60 * kMiB);
  EXPECT_THROW(f.alloc.malloc(60 * kMiB), ccalloc::OutOfMemoryError);
  const auto s = f.alloc.stats();
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(60 * kMiB));
  EXPECT_EQ(f.gpu.used_bytes(), 60 * kMiB);
  f.alloc.free(a);
  EXPECT_NE(f.alloc.malloc(60 * kMiB), 0u);
}

TEST(Expandable, NoInactiveSplitAccountingForExpandableBlocks) {
  Fixture f;
  const DevicePtr a = f.alloc.malloc(4 * kMiB);
  const DevicePtr b = f.alloc.malloc(4 * kMiB);
  f.alloc.free(a);
  const auto s = f.alloc.stats();
  EXPECT_EQ(s.inactive_split[kAggregate].current, 0);
  EXPECT_EQ(s.inactive_split_bytes[kAggregate].current, 0);
  f.alloc.free(b);
}

TEST(Expandable, ReserveIsConfigurable) {
  Fixture f(8 * kGiB, "pytorch,expandable_segments:True,expandable_segments_reserve:1G");
  (void)f.alloc.malloc(2 * kMiB);
  const DevicePtr small = f.alloc.malloc(512);
  // 1 GiB in whole 20 MiB pages: 52 pages, 1040 MiB.
  EXPECT_EQ(small, kVa + 1040 * kMiB) << "the large segment reserved about 1 GiB";
}

// Acceptance: PyTorch's own traces recorded with expandable_segments:True replay with the
// same peak reserved memory and the same number of mappings (device_allocs).
class RecordedExpandable : public testing::TestWithParam<std::string> {};

TEST_P(RecordedExpandable, ReplayMatchesRecordedPeakAndMappings) {
  const auto trace = ccalloc::io::read_trace_csv(std::string(CCALLOC_TRACES_DIR) + "/" +
                                                 GetParam() + ".expandable.csv.gz");
  ccalloc::replay::Options options;
  options.conf = "pytorch,expandable_segments:True";
  options.keep_trace = true;
  const auto result = ccalloc::replay::run(trace, options);
  const auto recorded = ccalloc::replay::recorded_figures(trace);
  EXPECT_EQ(result.peak_reserved_bytes, recorded.peak_reserved_bytes);
  EXPECT_EQ(result.device_allocs, recorded.device_allocs);
  // Every entry's action and size, in order (addresses depend on the reservation's base).
  ASSERT_EQ(result.emitted.size(), trace.size());
  for (std::size_t i = 0; i < trace.size(); ++i) {
    ASSERT_EQ(result.emitted[i].action, trace[i].entry.action) << "entry " << i;
    ASSERT_EQ(result.emitted[i].size, trace[i].entry.size) << "entry " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(SharedTraces, RecordedExpandable,
                         testing::Values("resnet50_train", "gpt2_train_varlen", "moe_train"));

}  // namespace
