// The allocator's rules, observed through its public API on the simulated GPU with the
// `pytorch` preset: where blocks land (exact addresses), how segments are sized, best fit,
// splitting and merging, per-stream pools, record_stream, empty_cache, every statistic,
// uncached mode and the errors. Every expected value is worked out by hand from §2 and §3
// of docs/pytorch-behaviour.md; comments show the arithmetic.
//
// Addresses: the simulated GPU places each device allocation at the lowest 2 MiB-aligned
// address >= 0x7f0000000000 that overlaps no live allocation (docs/simulated-gpu.md).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/stats.hpp"
#include "ccalloc/trace.hpp"

namespace ccalloc {
namespace {

constexpr DevicePtr kBase = 0x7f0000000000;
constexpr std::size_t M = kMiB;
constexpr std::size_t kOneEB = std::size_t{1} << 60;  // 1,152,921,504,606,846,976

constexpr BlockState kAllocated = BlockState::kActiveAllocated;
constexpr BlockState kPending = BlockState::kActivePendingFree;
constexpr BlockState kFree = BlockState::kInactive;

// ---------------------------------------------------------------------------------------
// Harness: a simulated GPU, an allocator with the pytorch preset and the invariant checker
// on, and a recorder of every trace entry.

struct Harness {
  explicit Harness(std::string_view conf = "pytorch") : alloc(gpu, Config::parse(conf)) {
    alloc.set_check_invariants(true);
    alloc.add_trace_observer([this](const TraceEntry& e) { trace.push_back(e); });
  }
  // The trace entries recorded since the last call.
  std::vector<TraceEntry> TakeTrace() { return std::exchange(trace, {}); }

  sim::SimDriver gpu;
  Allocator alloc;
  std::vector<TraceEntry> trace;
};

std::string Hex(DevicePtr p) {
  std::ostringstream os;
  os << "0x" << std::hex << p;
  return os.str();
}

// ---- trace entries ----

struct Ev {
  TraceAction action;
  DevicePtr addr;
  std::size_t size;
  StreamId stream = 0;
};

std::string Describe(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream) {
  std::ostringstream os;
  os << to_string(action) << "(" << Hex(addr) << ", " << size << ", stream " << stream << ")";
  return os.str();
}

testing::AssertionResult TraceIs(const std::vector<TraceEntry>& got, const std::vector<Ev>& want) {
  bool same = got.size() == want.size();
  for (std::size_t i = 0; same && i < got.size(); ++i) {
    same = got[i].action == want[i].action && got[i].addr == want[i].addr &&
           got[i].size == want[i].size && got[i].stream == want[i].stream;
  }
  if (same) return testing::AssertionSuccess();
  auto result = testing::AssertionFailure() << "\n  expected:";
  for (const Ev& e : want)
    result << "\n    " << Describe(e.action, e.addr, e.size, e.stream);
  result << "\n  actual:";
  for (const TraceEntry& e : got)
    result << "\n    " << Describe(e.action, e.addr, e.size, e.stream);
  return result;
}

// ---- segments and blocks ----

struct Blk {
  DevicePtr address;
  std::size_t size;
  BlockState state;
};

struct Seg {
  DevicePtr address;
  std::size_t total_size;
  bool is_small;
  StreamId stream;
  std::vector<Blk> blocks;
};

std::string Describe(const Seg& s) {
  std::ostringstream os;
  os << "segment " << Hex(s.address) << " size " << s.total_size
     << (s.is_small ? " small" : " large") << " stream " << s.stream << ":";
  for (const Blk& b : s.blocks) {
    os << "\n      [" << Hex(b.address) << " " << b.size << " " << to_string(b.state) << "]";
  }
  return os.str();
}

Seg ToSeg(const SegmentInfo& info) {
  Seg s{info.address, info.total_size, info.is_small, info.stream, {}};
  for (const BlockInfo& b : info.blocks)
    s.blocks.push_back({b.address, b.size, b.state});
  return s;
}

testing::AssertionResult SegmentsAre(const std::vector<SegmentInfo>& got,
                                     const std::vector<Seg>& want) {
  bool same = got.size() == want.size();
  for (std::size_t i = 0; same && i < got.size(); ++i) {
    const Seg g = ToSeg(got[i]);
    const Seg& w = want[i];
    same = g.address == w.address && g.total_size == w.total_size && g.is_small == w.is_small &&
           g.stream == w.stream && g.blocks.size() == w.blocks.size();
    for (std::size_t j = 0; same && j < g.blocks.size(); ++j) {
      same = g.blocks[j].address == w.blocks[j].address && g.blocks[j].size == w.blocks[j].size &&
             g.blocks[j].state == w.blocks[j].state;
    }
  }
  if (same) return testing::AssertionSuccess();
  auto result = testing::AssertionFailure() << "\n  expected:";
  for (const Seg& s : want)
    result << "\n    " << Describe(s);
  result << "\n  actual:";
  for (const SegmentInfo& s : got)
    result << "\n    " << Describe(ToSeg(s));
  return result;
}

// Every field of the segment listing, requested sizes included.
testing::AssertionResult SameSegments(const std::vector<SegmentInfo>& a,
                                      const std::vector<SegmentInfo>& b) {
  bool same = a.size() == b.size();
  for (std::size_t i = 0; same && i < a.size(); ++i) {
    same = a[i].device == b[i].device && a[i].address == b[i].address &&
           a[i].total_size == b[i].total_size && a[i].allocated_size == b[i].allocated_size &&
           a[i].active_size == b[i].active_size && a[i].requested_size == b[i].requested_size &&
           a[i].stream == b[i].stream && a[i].is_small == b[i].is_small &&
           a[i].is_expandable == b[i].is_expandable && a[i].blocks.size() == b[i].blocks.size();
    for (std::size_t j = 0; same && j < a[i].blocks.size(); ++j) {
      const BlockInfo& x = a[i].blocks[j];
      const BlockInfo& y = b[i].blocks[j];
      same = x.address == y.address && x.size == y.size && x.requested_size == y.requested_size &&
             x.state == y.state;
    }
  }
  if (same) return testing::AssertionSuccess();
  auto result = testing::AssertionFailure() << "\n  before:";
  for (const SegmentInfo& s : a)
    result << "\n    " << Describe(ToSeg(s));
  result << "\n  after:";
  for (const SegmentInfo& s : b)
    result << "\n    " << Describe(ToSeg(s));
  return result;
}

// ---- statistics ----

std::string Describe(const Stat& s) {
  std::ostringstream os;
  os << "{current " << s.current << ", peak " << s.peak << ", allocated " << s.allocated
     << ", freed " << s.freed << "}";
  return os.str();
}

// {aggregate, small pool, large pool}, in StatArray order.
StatArray Pools(Stat all, Stat small, Stat large) {
  return StatArray{all, small, large};
}

// Compares every field of two DeviceStats, naming each one that differs.
testing::AssertionResult StatsAre(const DeviceStats& got, const DeviceStats& want) {
  std::ostringstream diff;
  const std::pair<const char*, StatArray DeviceStats::*> arrays[] = {
      {"allocation", &DeviceStats::allocation},
      {"segment", &DeviceStats::segment},
      {"active", &DeviceStats::active},
      {"inactive_split", &DeviceStats::inactive_split},
      {"allocated_bytes", &DeviceStats::allocated_bytes},
      {"reserved_bytes", &DeviceStats::reserved_bytes},
      {"active_bytes", &DeviceStats::active_bytes},
      {"inactive_split_bytes", &DeviceStats::inactive_split_bytes},
      {"requested_bytes", &DeviceStats::requested_bytes},
  };
  const char* const pools[] = {"all", "small_pool", "large_pool"};
  for (const auto& [name, member] : arrays) {
    for (int pool = 0; pool < 3; ++pool) {
      const Stat& g = (got.*member)[pool];
      const Stat& w = (want.*member)[pool];
      if (!(g == w)) {
        diff << "\n  " << name << "." << pools[pool] << ": expected " << Describe(w) << ", actual "
             << Describe(g);
      }
    }
  }
  const std::pair<const char*, Stat DeviceStats::*> singles[] = {
      {"oversize_allocations", &DeviceStats::oversize_allocations},
      {"oversize_segments", &DeviceStats::oversize_segments},
  };
  for (const auto& [name, member] : singles) {
    if (!(got.*member == want.*member)) {
      diff << "\n  " << name << ": expected " << Describe(want.*member) << ", actual "
           << Describe(got.*member);
    }
  }
  const std::pair<const char*, std::int64_t DeviceStats::*> counters[] = {
      {"num_alloc_retries", &DeviceStats::num_alloc_retries},
      {"num_ooms", &DeviceStats::num_ooms},
      {"num_sync_all_streams", &DeviceStats::num_sync_all_streams},
      {"num_device_alloc", &DeviceStats::num_device_alloc},
      {"num_device_free", &DeviceStats::num_device_free},
      {"max_split_size", &DeviceStats::max_split_size},
  };
  for (const auto& [name, member] : counters) {
    if (got.*member != want.*member) {
      diff << "\n  " << name << ": expected " << want.*member << ", actual " << got.*member;
    }
  }
  const std::string text = diff.str();
  if (text.empty() && got == want) return testing::AssertionSuccess();
  return testing::AssertionFailure() << text;
}

// ---- errors ----

// The what() of the InvalidPointerError that `op` throws for `ptr`; fails if none is thrown.
std::string InvalidPointerMessage(DevicePtr ptr, const std::function<void()>& op) {
  try {
    op();
  } catch (const InvalidPointerError& e) {
    EXPECT_EQ(e.ptr(), ptr);
    return e.what();
  }
  ADD_FAILURE() << "no InvalidPointerError for " << Hex(ptr);
  return "";
}

// Runs `op`, which must throw InvalidPointerError naming `ptr`, and checks that it left the
// allocator exactly as it was: same stats, same segments, no trace entry, no driver call,
// invariants intact.
void ExpectRejectedWithoutEffect(Harness& h, DevicePtr ptr, const std::function<void()>& op) {
  const DeviceStats stats_before = h.alloc.stats();
  const std::vector<SegmentInfo> segments_before = h.alloc.segments();
  const sim::Counters counters_before = h.gpu.counters();
  h.TakeTrace();

  const std::string message = InvalidPointerMessage(ptr, op);
  EXPECT_NE(message.find(Hex(ptr)), std::string::npos) << message;

  EXPECT_TRUE(StatsAre(h.alloc.stats(), stats_before));
  EXPECT_TRUE(SameSegments(segments_before, h.alloc.segments()));
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {}));
  EXPECT_EQ(h.gpu.counters(), counters_before);
  EXPECT_NO_THROW(h.alloc.check_invariants());
}

// =======================================================================================
// Placement and segment sizes (§2.3 rounding, §2.4 segment size, §2.8 split)

TEST(AllocatorRules, SmallRequestCreatesOneTwoMiBSmallSegmentAtBase) {
  Harness h;
  EXPECT_EQ(h.alloc.malloc(512), kBase);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kSegmentAlloc, kBase, 2 * M},
                                      {TraceAction::kAlloc, kBase, 512}}));
  // The 2 MiB block is split: 512 B handed out, the rest cached.
  EXPECT_TRUE(SegmentsAre(
      h.alloc.segments(),
      {{kBase, 2 * M, true, 0, {{kBase, 512, kAllocated}, {kBase + 512, 2 * M - 512, kFree}}}}));
  EXPECT_EQ(h.gpu.counters().allocate_calls, 1u);
  EXPECT_EQ(h.gpu.used_bytes(), 2 * M);
}

TEST(AllocatorRules, ConsecutiveSmallRequestsPackContiguouslyIn512ByteSteps) {
  Harness h;
  EXPECT_EQ(h.alloc.malloc(1), kBase);            // 512
  EXPECT_EQ(h.alloc.malloc(512), kBase + 512);    // 512
  EXPECT_EQ(h.alloc.malloc(513), kBase + 1024);   // 1024
  EXPECT_EQ(h.alloc.malloc(1000), kBase + 2048);  // 1024
  EXPECT_EQ(h.alloc.malloc(1536), kBase + 3072);  // 1536
  EXPECT_EQ(h.alloc.malloc(1), kBase + 4608);     // 512
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase,
                                                2 * M,
                                                true,
                                                0,
                                                {{kBase, 512, kAllocated},
                                                 {kBase + 512, 512, kAllocated},
                                                 {kBase + 1024, 1024, kAllocated},
                                                 {kBase + 2048, 1024, kAllocated},
                                                 {kBase + 3072, 1536, kAllocated},
                                                 {kBase + 4608, 512, kAllocated},
                                                 {kBase + 5120, 2 * M - 5120, kFree}}}}));
  EXPECT_EQ(h.gpu.counters().allocate_calls, 1u);
}

TEST(AllocatorRules, OneMiBRequestsPackTwoPerSmallSegment) {
  Harness h;
  EXPECT_EQ(h.alloc.malloc(1 * M), kBase);
  EXPECT_EQ(h.alloc.malloc(1 * M), kBase + 1 * M);  // the whole remainder: no split
  EXPECT_EQ(h.gpu.counters().allocate_calls, 1u);
  h.TakeTrace();

  EXPECT_EQ(h.alloc.malloc(1 * M), kBase + 2 * M);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kSegmentAlloc, kBase + 2 * M, 2 * M},
                                      {TraceAction::kAlloc, kBase + 2 * M, 1 * M}}));
  EXPECT_TRUE(SegmentsAre(
      h.alloc.segments(),
      {{kBase, 2 * M, true, 0, {{kBase, 1 * M, kAllocated}, {kBase + 1 * M, 1 * M, kAllocated}}},
       {kBase + 2 * M,
        2 * M,
        true,
        0,
        {{kBase + 2 * M, 1 * M, kAllocated}, {kBase + 3 * M, 1 * M, kFree}}}}));
}

TEST(AllocatorRules, OneMiBPlus512RequestGetsATwentyMiBLargeSegment) {
  Harness h;
  EXPECT_EQ(h.alloc.malloc(1 * M + 512), kBase);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kSegmentAlloc, kBase, 20 * M},
                                      {TraceAction::kAlloc, kBase, 1 * M + 512}}));
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase,
                                                20 * M,
                                                false,
                                                0,
                                                {{kBase, 1 * M + 512, kAllocated},
                                                 {kBase + 1 * M + 512, 19 * M - 512, kFree}}}}));
}

TEST(AllocatorRules, OneMiBPlusOneRoundsIntoTheLargePool) {
  Harness h;
  // 1 MiB + 1 rounds to 1 MiB + 512 > 1 MiB: large pool, 20 MiB segment.
  EXPECT_EQ(h.alloc.malloc(1 * M + 1), kBase);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kSegmentAlloc, kBase, 20 * M},
                                      {TraceAction::kAlloc, kBase, 1 * M + 1}}));
  EXPECT_EQ(h.alloc.allocation_size(kBase), 1 * M + 512);
}

TEST(AllocatorRules, TenMiBMinus512RequestGetsATwentyMiBLargeSegment) {
  Harness h;
  EXPECT_EQ(h.alloc.malloc(10 * M - 512), kBase);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kSegmentAlloc, kBase, 20 * M},
                                      {TraceAction::kAlloc, kBase, 10 * M - 512}}));
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase,
                                                20 * M,
                                                false,
                                                0,
                                                {{kBase, 10 * M - 512, kAllocated},
                                                 {kBase + 10 * M - 512, 10 * M + 512, kFree}}}}));
}

TEST(AllocatorRules, TwoMidSizedRequestsShareOneTwentyMiBSegment) {
  Harness h;
  EXPECT_EQ(h.alloc.malloc(10 * M - 512), kBase);
  // The 10 MiB + 512 remainder serves the second request whole: 1 KiB left is <= 1 MiB.
  EXPECT_EQ(h.alloc.malloc(10 * M - 512), kBase + 10 * M - 512);
  EXPECT_EQ(h.gpu.counters().allocate_calls, 1u);
  // A third needs a second 20 MiB segment.
  EXPECT_EQ(h.alloc.malloc(1 * M + 512), kBase + 20 * M);
  EXPECT_EQ(h.gpu.counters().allocate_calls, 2u);
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase,
                                                20 * M,
                                                false,
                                                0,
                                                {{kBase, 10 * M - 512, kAllocated},
                                                 {kBase + 10 * M - 512, 10 * M + 512, kAllocated}}},
                                               {kBase + 20 * M,
                                                20 * M,
                                                false,
                                                0,
                                                {{kBase + 20 * M, 1 * M + 512, kAllocated},
                                                 {kBase + 21 * M + 512, 19 * M - 512, kFree}}}}));
}

TEST(AllocatorRules, TwoOneMiBPlus512RequestsShareOneTwentyMiBSegment) {
  Harness h;
  EXPECT_EQ(h.alloc.malloc(1 * M + 512), kBase);
  EXPECT_EQ(h.alloc.malloc(1 * M + 512), kBase + 1 * M + 512);
  EXPECT_EQ(h.gpu.counters().allocate_calls, 1u);
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase,
                                                20 * M,
                                                false,
                                                0,
                                                {{kBase, 1 * M + 512, kAllocated},
                                                 {kBase + 1 * M + 512, 1 * M + 512, kAllocated},
                                                 {kBase + 2 * M + 1024, 18 * M - 1024, kFree}}}}));
}

TEST(AllocatorRules, TenMiBAndLargerRequestsGetTheirOwnTwoMiBMultipleSegment) {
  Harness h;
  // 10 MiB: a segment of exactly 10 MiB.
  EXPECT_EQ(h.alloc.malloc(10 * M), kBase);
  // 10 MiB + 1 -> 10 MiB + 512 -> a 12 MiB segment; the 2 MiB - 512 left (> 1 MiB) splits.
  EXPECT_EQ(h.alloc.malloc(10 * M + 1), kBase + 10 * M);
  // 25 MiB -> a 26 MiB segment; 1 MiB left does not split.
  EXPECT_EQ(h.alloc.malloc(25 * M), kBase + 22 * M);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kSegmentAlloc, kBase, 10 * M},
                                      {TraceAction::kAlloc, kBase, 10 * M},
                                      {TraceAction::kSegmentAlloc, kBase + 10 * M, 12 * M},
                                      {TraceAction::kAlloc, kBase + 10 * M, 10 * M + 1},
                                      {TraceAction::kSegmentAlloc, kBase + 22 * M, 26 * M},
                                      {TraceAction::kAlloc, kBase + 22 * M, 25 * M}}));
  EXPECT_TRUE(SegmentsAre(
      h.alloc.segments(),
      {{kBase, 10 * M, false, 0, {{kBase, 10 * M, kAllocated}}},
       {kBase + 10 * M,
        12 * M,
        false,
        0,
        {{kBase + 10 * M, 10 * M + 512, kAllocated}, {kBase + 20 * M + 512, 2 * M - 512, kFree}}},
       {kBase + 22 * M, 26 * M, false, 0, {{kBase + 22 * M, 26 * M, kAllocated}}}}));
}

// =======================================================================================
// Best fit (§2.6) and merging (§2.9)

TEST(AllocatorRules, BestFitTakesTheSmallestAdequateFreeBlock) {
  Harness h;
  const DevicePtr a = h.alloc.malloc(1024);  // base
  h.alloc.malloc(512);                       // base + 1024
  const DevicePtr c = h.alloc.malloc(2048);  // base + 1536
  h.alloc.malloc(512);                       // base + 3584; free rest from base + 4096
  h.alloc.free(a);
  h.alloc.free(c);
  // Free: 1024 @ base, 2048 @ base + 1536, 2 MiB - 4096 @ base + 4096.
  // 1500 -> 1536: the 2048 block is the smallest that fits; 512 B splits off.
  EXPECT_EQ(h.alloc.malloc(1500), kBase + 1536);
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase,
                                                2 * M,
                                                true,
                                                0,
                                                {{kBase, 1024, kFree},
                                                 {kBase + 1024, 512, kAllocated},
                                                 {kBase + 1536, 1536, kAllocated},
                                                 {kBase + 3072, 512, kFree},
                                                 {kBase + 3584, 512, kAllocated},
                                                 {kBase + 4096, 2 * M - 4096, kFree}}}}));
  // 1024: the 1024 block at base, not the larger one.
  EXPECT_EQ(h.alloc.malloc(1024), kBase);
  // 512: the 512 B remainder, not the 2 MiB tail.
  EXPECT_EQ(h.alloc.malloc(512), kBase + 3072);
}

TEST(AllocatorRules, BestFitPrefersTheLowestAddressAmongEqualSizes) {
  Harness h;
  const DevicePtr a = h.alloc.malloc(1024);  // base
  h.alloc.malloc(512);                       // base + 1024
  const DevicePtr c = h.alloc.malloc(1024);  // base + 1536
  h.alloc.malloc(512);                       // base + 2560; free rest from base + 3072
  h.alloc.free(c);                           // freed first ...
  h.alloc.free(a);                           // ... but at the higher address
  EXPECT_EQ(h.alloc.malloc(1000), kBase);
  EXPECT_EQ(h.alloc.malloc(1000), kBase + 1536);
  EXPECT_EQ(h.alloc.malloc(1000), kBase + 3072);
}

TEST(AllocatorRules, FreedBlockMergesWithFreeNeighbours) {
  Harness h;
  const DevicePtr a = h.alloc.malloc(512);
  const DevicePtr b = h.alloc.malloc(512);
  const DevicePtr c = h.alloc.malloc(512);

  h.alloc.free(a);  // neighbours: none before, b allocated after
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase,
                                                2 * M,
                                                true,
                                                0,
                                                {{kBase, 512, kFree},
                                                 {kBase + 512, 512, kAllocated},
                                                 {kBase + 1024, 512, kAllocated},
                                                 {kBase + 1536, 2 * M - 1536, kFree}}}}));
  h.alloc.free(c);  // merges with the free tail
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase,
                                                2 * M,
                                                true,
                                                0,
                                                {{kBase, 512, kFree},
                                                 {kBase + 512, 512, kAllocated},
                                                 {kBase + 1024, 2 * M - 1024, kFree}}}}));
  h.alloc.free(b);  // merges with both
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase, 2 * M, true, 0, {{kBase, 2 * M, kFree}}}}));
  const DeviceStats s = h.alloc.stats();
  EXPECT_EQ(s.inactive_split[kAggregate].current, 0);
  EXPECT_EQ(s.inactive_split_bytes[kAggregate].current, 0);
}

// =======================================================================================
// The large-pool split rule (§2.8): a leftover of 1 MiB or less stays in the block

TEST(AllocatorRules, LargePoolLeftoverOfOneMiBStaysInsideTheBlock) {
  Harness h;
  // 19 MiB -> a 20 MiB segment; 1 MiB left is not > 1 MiB: the block is the whole 20 MiB.
  EXPECT_EQ(h.alloc.malloc(19 * M), kBase);
  EXPECT_TRUE(
      SegmentsAre(h.alloc.segments(), {{kBase, 20 * M, false, 0, {{kBase, 20 * M, kAllocated}}}}));
  EXPECT_EQ(h.alloc.segments()[0].blocks[0].requested_size, 19 * M);
  EXPECT_EQ(h.alloc.allocation_size(kBase), 20 * M);
  const DeviceStats s = h.alloc.stats();
  for (int pool : {kAggregate, kLargePool}) {
    EXPECT_EQ(s.allocated_bytes[pool].current, std::int64_t{20 * M});
    EXPECT_EQ(s.active_bytes[pool].current, std::int64_t{20 * M});
    EXPECT_EQ(s.requested_bytes[pool].current, std::int64_t{19 * M});
  }
}

TEST(AllocatorRules, CachedLargeBlockWithOneMiBLeftoverIsHandedOutWhole) {
  Harness h;
  EXPECT_EQ(h.alloc.malloc(9 * M), kBase);  // 20 MiB segment: 9 MiB + 11 MiB free
  // 10 MiB from the 11 MiB block leaves exactly 1 MiB: no split.
  EXPECT_EQ(h.alloc.malloc(10 * M), kBase + 9 * M);
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(),
                          {{kBase,
                            20 * M,
                            false,
                            0,
                            {{kBase, 9 * M, kAllocated}, {kBase + 9 * M, 11 * M, kAllocated}}}}));
  EXPECT_EQ(h.alloc.allocation_size(kBase + 9 * M), 11 * M);
  const DeviceStats s = h.alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].current, std::int64_t{20 * M});
  EXPECT_EQ(s.requested_bytes[kAggregate].current, std::int64_t{19 * M});
  EXPECT_EQ(s.inactive_split[kAggregate].current, 0);
  EXPECT_EQ(h.gpu.counters().allocate_calls, 1u);
}

TEST(AllocatorRules, LargePoolLeftoverAboveOneMiBIsSplitOff) {
  Harness h;
  // 19 MiB - 512 -> a 20 MiB segment; 1 MiB + 512 left is > 1 MiB: split.
  EXPECT_EQ(h.alloc.malloc(19 * M - 512), kBase);
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase,
                                                20 * M,
                                                false,
                                                0,
                                                {{kBase, 19 * M - 512, kAllocated},
                                                 {kBase + 19 * M - 512, 1 * M + 512, kFree}}}}));
  EXPECT_EQ(h.alloc.stats().allocated_bytes[kAggregate].current, std::int64_t{19 * M - 512});
}

// =======================================================================================
// Streams (§2.2 pools keyed by stream, §2.10 record_stream and events)

TEST(AllocatorRules, FreeBlocksAreReusedOnlyByTheirOwnStream) {
  Harness h;
  const DevicePtr p = h.alloc.malloc(512, /*stream=*/1);
  EXPECT_EQ(p, kBase);
  h.alloc.free(p);
  h.TakeTrace();
  // Stream 2 cannot use stream 1's cached segment: a new one.
  EXPECT_EQ(h.alloc.malloc(512, 2), kBase + 2 * M);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kSegmentAlloc, kBase + 2 * M, 2 * M, 2},
                                      {TraceAction::kAlloc, kBase + 2 * M, 512, 2}}));
  // Stream 1 reuses its own.
  EXPECT_EQ(h.alloc.malloc(512, 1), kBase);
  EXPECT_EQ(h.gpu.counters().allocate_calls, 2u);
  EXPECT_TRUE(SegmentsAre(
      h.alloc.segments(),
      {{kBase, 2 * M, true, 1, {{kBase, 512, kAllocated}, {kBase + 512, 2 * M - 512, kFree}}},
       {kBase + 2 * M,
        2 * M,
        true,
        2,
        {{kBase + 2 * M, 512, kAllocated}, {kBase + 2 * M + 512, 2 * M - 512, kFree}}}}));
}

TEST(AllocatorRules, RecordStreamDefersReuseUntilTheEventCompletesAndAMallocRuns) {
  Harness h;
  const DevicePtr p = h.alloc.malloc(512);  // stream 0
  ASSERT_EQ(p, kBase);
  h.alloc.record_stream(p, 7);
  h.TakeTrace();

  h.alloc.free(p);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kFreeRequested, kBase, 512}}));
  EXPECT_EQ(h.gpu.counters().event_records, 1u);
  EXPECT_TRUE(SegmentsAre(
      h.alloc.segments(),
      {{kBase, 2 * M, true, 0, {{kBase, 512, kPending}, {kBase + 512, 2 * M - 512, kFree}}}}));
  // Freed but still active: allocation and allocated_bytes drop at the free request,
  // active, active_bytes and requested_bytes only when the free completes (§3.2).
  DeviceStats s = h.alloc.stats();
  EXPECT_EQ(s.allocation[kAggregate].current, 0);
  EXPECT_EQ(s.allocated_bytes[kAggregate].current, 0);
  EXPECT_EQ(s.active[kAggregate].current, 1);
  EXPECT_EQ(s.active_bytes[kAggregate].current, 512);
  EXPECT_EQ(s.requested_bytes[kAggregate].current, 512);

  // The event on stream 7 has not completed: the block is not reused.
  EXPECT_EQ(h.alloc.malloc(512), kBase + 512);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kAlloc, kBase + 512, 512}}));

  // Completing the event alone changes nothing until the next malloc polls it.
  h.gpu.complete_stream(7);
  EXPECT_EQ(h.alloc.segments()[0].blocks[0].state, kPending);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {}));

  // The next malloc first completes the free, then reuses the block.
  EXPECT_EQ(h.alloc.malloc(512), kBase);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kFreeCompleted, kBase, 512},
                                      {TraceAction::kAlloc, kBase, 512}}));
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase,
                                                2 * M,
                                                true,
                                                0,
                                                {{kBase, 512, kAllocated},
                                                 {kBase + 512, 512, kAllocated},
                                                 {kBase + 1024, 2 * M - 1024, kFree}}}}));
  s = h.alloc.stats();
  EXPECT_EQ(s.active[kAggregate].current, 2);
  EXPECT_EQ(s.active_bytes[kAggregate].current, 1024);
  EXPECT_EQ(s.requested_bytes[kAggregate].current, 1024);
}

TEST(AllocatorRules, RecordStreamOnTheBlocksOwnStreamIsIgnored) {
  Harness h;
  const DevicePtr p = h.alloc.malloc(512, 3);
  h.alloc.record_stream(p, 3);
  h.TakeTrace();
  h.alloc.free(p);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kFreeRequested, kBase, 512, 3},
                                      {TraceAction::kFreeCompleted, kBase, 512, 3}}));
  EXPECT_EQ(h.gpu.counters().event_records, 0u);
  EXPECT_TRUE(SegmentsAre(h.alloc.segments(), {{kBase, 2 * M, true, 3, {{kBase, 2 * M, kFree}}}}));
  EXPECT_EQ(h.alloc.malloc(512, 3), kBase);
}

// =======================================================================================
// empty_cache (§2.13)

TEST(AllocatorRules, EmptyCacheWaitsForPendingFreesAndReleasesOnlyWhollyFreeSegments) {
  Harness h;
  EXPECT_EQ(h.alloc.malloc(512), kBase);                  // small segment, stays in use
  const DevicePtr b = h.alloc.malloc(20 * M);             // 20 MiB segment
  const DevicePtr c = h.alloc.malloc(512, /*stream=*/5);  // small segment of stream 5
  const DevicePtr d = h.alloc.malloc(12 * M);             // 12 MiB segment
  ASSERT_EQ(b, kBase + 2 * M);
  ASSERT_EQ(c, kBase + 22 * M);
  ASSERT_EQ(d, kBase + 24 * M);
  h.alloc.free(c);
  h.alloc.free(b);
  h.alloc.record_stream(d, 9);
  h.alloc.free(d);  // pending on stream 9's event
  h.TakeTrace();
  ASSERT_EQ(h.gpu.counters().event_synchronizes, 0u);

  h.alloc.empty_cache();
  // First the pending free completes (after a wait on its event), then every free unsplit
  // segment goes: the large pool, by (stream, size, address), then the small pool. The
  // stream-0 small segment is split (512 B live) and stays.
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {{TraceAction::kFreeCompleted, kBase + 24 * M, 12 * M},
                                      {TraceAction::kSegmentFree, kBase + 24 * M, 12 * M},
                                      {TraceAction::kSegmentFree, kBase + 2 * M, 20 * M},
                                      {TraceAction::kSegmentFree, kBase + 22 * M, 2 * M, 5}}));
  EXPECT_TRUE(SegmentsAre(
      h.alloc.segments(),
      {{kBase, 2 * M, true, 0, {{kBase, 512, kAllocated}, {kBase + 512, 2 * M - 512, kFree}}}}));
  EXPECT_EQ(h.gpu.counters().event_synchronizes, 1u);
  EXPECT_EQ(h.gpu.counters().free_calls, 3u);
  EXPECT_EQ(h.gpu.used_bytes(), 2 * M);
  DeviceStats s = h.alloc.stats();
  EXPECT_EQ(s.num_sync_all_streams, 1);
  EXPECT_EQ(s.num_device_free, 3);
  EXPECT_EQ(s.segment[kAggregate].current, 1);
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, std::int64_t{2 * M});

  // Each call counts one sync of all streams, even with nothing to wait for or release.
  h.alloc.empty_cache();
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {}));
  s = h.alloc.stats();
  EXPECT_EQ(s.num_sync_all_streams, 2);
  EXPECT_EQ(s.num_device_free, 3);
  EXPECT_EQ(h.gpu.counters().event_synchronizes, 1u);
  EXPECT_EQ(h.gpu.counters().free_calls, 3u);
}

// =======================================================================================
// Statistics (§3.1, §3.2): every field after every step of one sequence on stream 0

TEST(AllocatorRules, EveryStatisticFollowsAMixedPoolSequence) {
  Harness h;
  DeviceStats want;  // everything 0, max_split_size -1 (unlimited)
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want));

  // 1. malloc(1000) -> 1024 B from a new 2 MiB small segment; 2 MiB - 1 KiB split off.
  const DevicePtr a = h.alloc.malloc(1000);
  ASSERT_EQ(a, kBase);
  want.segment = Pools({1, 1, 1, 0}, {1, 1, 1, 0}, {});
  want.reserved_bytes = Pools({2 * M, 2 * M, 2 * M, 0}, {2 * M, 2 * M, 2 * M, 0}, {});
  want.allocation = Pools({1, 1, 1, 0}, {1, 1, 1, 0}, {});
  want.active = want.allocation;
  want.allocated_bytes = Pools({1024, 1024, 1024, 0}, {1024, 1024, 1024, 0}, {});
  want.active_bytes = want.allocated_bytes;
  want.requested_bytes = Pools({1000, 1000, 1000, 0}, {1000, 1000, 1000, 0}, {});
  want.inactive_split = Pools({1, 1, 1, 0}, {1, 1, 1, 0}, {});
  want.inactive_split_bytes = Pools({2 * M - 1024, 2 * M - 1024, 2 * M - 1024, 0},
                                    {2 * M - 1024, 2 * M - 1024, 2 * M - 1024, 0}, {});
  want.num_device_alloc = 1;
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after step 1";

  // 2. malloc(3 MiB) -> a new 20 MiB large segment; 17 MiB split off.
  const DevicePtr b = h.alloc.malloc(3 * M);
  ASSERT_EQ(b, kBase + 2 * M);
  want.segment = Pools({2, 2, 2, 0}, {1, 1, 1, 0}, {1, 1, 1, 0});
  want.reserved_bytes =
      Pools({22 * M, 22 * M, 22 * M, 0}, {2 * M, 2 * M, 2 * M, 0}, {20 * M, 20 * M, 20 * M, 0});
  want.allocation = Pools({2, 2, 2, 0}, {1, 1, 1, 0}, {1, 1, 1, 0});
  want.active = want.allocation;
  want.allocated_bytes = Pools({3 * M + 1024, 3 * M + 1024, 3 * M + 1024, 0}, {1024, 1024, 1024, 0},
                               {3 * M, 3 * M, 3 * M, 0});
  want.active_bytes = want.allocated_bytes;
  want.requested_bytes = Pools({3 * M + 1000, 3 * M + 1000, 3 * M + 1000, 0}, {1000, 1000, 1000, 0},
                               {3 * M, 3 * M, 3 * M, 0});
  want.inactive_split = Pools({2, 2, 2, 0}, {1, 1, 1, 0}, {1, 1, 1, 0});
  want.inactive_split_bytes =
      Pools({19 * M - 1024, 19 * M - 1024, 19 * M - 1024, 0},
            {2 * M - 1024, 2 * M - 1024, 2 * M - 1024, 0}, {17 * M, 17 * M, 17 * M, 0});
  want.num_device_alloc = 2;
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after step 2";

  // 3. malloc(500) -> 512 B from the small remainder, which was already split: the
  //    inactive split bytes drop by 512, the count stays.
  const DevicePtr c = h.alloc.malloc(500);
  ASSERT_EQ(c, kBase + 1024);
  want.allocation = Pools({3, 3, 3, 0}, {2, 2, 2, 0}, {1, 1, 1, 0});
  want.active = want.allocation;
  want.allocated_bytes = Pools({3 * M + 1536, 3 * M + 1536, 3 * M + 1536, 0}, {1536, 1536, 1536, 0},
                               {3 * M, 3 * M, 3 * M, 0});
  want.active_bytes = want.allocated_bytes;
  want.requested_bytes = Pools({3 * M + 1500, 3 * M + 1500, 3 * M + 1500, 0}, {1500, 1500, 1500, 0},
                               {3 * M, 3 * M, 3 * M, 0});
  want.inactive_split_bytes =
      Pools({19 * M - 1536, 19 * M - 1024, 19 * M - 1024, 512},
            {2 * M - 1536, 2 * M - 1024, 2 * M - 1024, 512}, {17 * M, 17 * M, 17 * M, 0});
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after step 3";

  // 4. free(a): its neighbour c is allocated, so the 1 KiB block is a new inactive split.
  h.alloc.free(a);
  want.allocation = Pools({2, 3, 3, 1}, {1, 2, 2, 1}, {1, 1, 1, 0});
  want.active = want.allocation;
  want.allocated_bytes = Pools({3 * M + 512, 3 * M + 1536, 3 * M + 1536, 1024},
                               {512, 1536, 1536, 1024}, {3 * M, 3 * M, 3 * M, 0});
  want.active_bytes = want.allocated_bytes;
  want.requested_bytes = Pools({3 * M + 500, 3 * M + 1500, 3 * M + 1500, 1000},
                               {500, 1500, 1500, 1000}, {3 * M, 3 * M, 3 * M, 0});
  want.inactive_split = Pools({3, 3, 3, 0}, {2, 2, 2, 0}, {1, 1, 1, 0});
  want.inactive_split_bytes =
      Pools({19 * M - 512, 19 * M - 512, 19 * M, 512}, {2 * M - 512, 2 * M - 512, 2 * M, 512},
            {17 * M, 17 * M, 17 * M, 0});
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after step 4";

  // 5. malloc(16 MiB + 1) -> 16 MiB + 512 from the cached 17 MiB block; 1 MiB - 512 left
  //    does not split, so the block is 17 MiB and leaves the inactive split set.
  const DevicePtr d = h.alloc.malloc(16 * M + 1);
  ASSERT_EQ(d, kBase + 5 * M);
  want.allocation = Pools({3, 3, 4, 1}, {1, 2, 2, 1}, {2, 2, 2, 0});
  want.active = want.allocation;
  want.allocated_bytes = Pools({20 * M + 512, 20 * M + 512, 20 * M + 1536, 1024},
                               {512, 1536, 1536, 1024}, {20 * M, 20 * M, 20 * M, 0});
  want.active_bytes = want.allocated_bytes;
  want.requested_bytes = Pools({19 * M + 501, 19 * M + 501, 19 * M + 1501, 1000},
                               {500, 1500, 1500, 1000}, {19 * M + 1, 19 * M + 1, 19 * M + 1, 0});
  want.inactive_split = Pools({2, 3, 3, 1}, {2, 2, 2, 0}, {0, 1, 1, 1});
  want.inactive_split_bytes =
      Pools({2 * M - 512, 19 * M - 512, 19 * M, 17 * M + 512},
            {2 * M - 512, 2 * M - 512, 2 * M, 512}, {0, 17 * M, 17 * M, 17 * M});
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after step 5";

  // 6. free(b): its neighbour d is allocated: a new 3 MiB inactive split.
  h.alloc.free(b);
  want.allocation = Pools({2, 3, 4, 2}, {1, 2, 2, 1}, {1, 2, 2, 1});
  want.active = want.allocation;
  want.allocated_bytes = Pools({17 * M + 512, 20 * M + 512, 20 * M + 1536, 3 * M + 1024},
                               {512, 1536, 1536, 1024}, {17 * M, 20 * M, 20 * M, 3 * M});
  want.active_bytes = want.allocated_bytes;
  want.requested_bytes =
      Pools({16 * M + 501, 19 * M + 501, 19 * M + 1501, 3 * M + 1000}, {500, 1500, 1500, 1000},
            {16 * M + 1, 19 * M + 1, 19 * M + 1, 3 * M});
  want.inactive_split = Pools({3, 3, 4, 1}, {2, 2, 2, 0}, {1, 1, 2, 1});
  want.inactive_split_bytes =
      Pools({5 * M - 512, 19 * M - 512, 22 * M, 17 * M + 512},
            {2 * M - 512, 2 * M - 512, 2 * M, 512}, {3 * M, 17 * M, 20 * M, 17 * M});
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after step 6";

  // 7. malloc(40 MiB): the 3 MiB block is too small: a new 40 MiB segment, taken whole.
  const DevicePtr e = h.alloc.malloc(40 * M);
  ASSERT_EQ(e, kBase + 22 * M);
  want.segment = Pools({3, 3, 3, 0}, {1, 1, 1, 0}, {2, 2, 2, 0});
  want.reserved_bytes =
      Pools({62 * M, 62 * M, 62 * M, 0}, {2 * M, 2 * M, 2 * M, 0}, {60 * M, 60 * M, 60 * M, 0});
  want.allocation = Pools({3, 3, 5, 2}, {1, 2, 2, 1}, {2, 2, 3, 1});
  want.active = want.allocation;
  want.allocated_bytes = Pools({57 * M + 512, 57 * M + 512, 60 * M + 1536, 3 * M + 1024},
                               {512, 1536, 1536, 1024}, {57 * M, 57 * M, 60 * M, 3 * M});
  want.active_bytes = want.allocated_bytes;
  want.requested_bytes =
      Pools({56 * M + 501, 56 * M + 501, 59 * M + 1501, 3 * M + 1000}, {500, 1500, 1500, 1000},
            {56 * M + 1, 56 * M + 1, 59 * M + 1, 3 * M});
  want.num_device_alloc = 3;
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after step 7";

  // 8. free(d): merges with the free 3 MiB before it into the whole 20 MiB segment, which
  //    is no longer split.
  h.alloc.free(d);
  want.allocation = Pools({2, 3, 5, 3}, {1, 2, 2, 1}, {1, 2, 3, 2});
  want.active = want.allocation;
  want.allocated_bytes = Pools({40 * M + 512, 57 * M + 512, 60 * M + 1536, 20 * M + 1024},
                               {512, 1536, 1536, 1024}, {40 * M, 57 * M, 60 * M, 20 * M});
  want.active_bytes = want.allocated_bytes;
  want.requested_bytes =
      Pools({40 * M + 500, 56 * M + 501, 59 * M + 1501, 19 * M + 1001}, {500, 1500, 1500, 1000},
            {40 * M, 56 * M + 1, 59 * M + 1, 19 * M + 1});
  want.inactive_split = Pools({2, 3, 4, 2}, {2, 2, 2, 0}, {0, 1, 2, 2});
  want.inactive_split_bytes =
      Pools({2 * M - 512, 19 * M - 512, 22 * M, 20 * M + 512},
            {2 * M - 512, 2 * M - 512, 2 * M, 512}, {0, 17 * M, 20 * M, 20 * M});
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after step 8";

  // 9. empty_cache(): the free 20 MiB segment goes; the small one (split) and e's stay.
  h.alloc.empty_cache();
  want.segment = Pools({2, 3, 3, 1}, {1, 1, 1, 0}, {1, 2, 2, 1});
  want.reserved_bytes = Pools({42 * M, 62 * M, 62 * M, 20 * M}, {2 * M, 2 * M, 2 * M, 0},
                              {40 * M, 60 * M, 60 * M, 20 * M});
  want.num_device_free = 1;
  want.num_sync_all_streams = 1;
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after step 9";
}

// The state both reset tests start from, on stream 0:
//   a = malloc(3 MiB)  a 20 MiB large segment, 17 MiB split off
//   b = malloc(512)    a 2 MiB small segment, 2 MiB - 512 split off
//   free(a)            merges back into the whole 20 MiB segment
//   empty_cache()      releases it
DeviceStats ResetScenario(Harness& h) {
  const DevicePtr a = h.alloc.malloc(3 * M);
  EXPECT_EQ(h.alloc.malloc(512), kBase + 20 * M);
  h.alloc.free(a);
  h.alloc.empty_cache();

  DeviceStats s;
  s.allocation = Pools({1, 2, 2, 1}, {1, 1, 1, 0}, {0, 1, 1, 1});
  s.active = s.allocation;
  s.segment = s.allocation;
  s.allocated_bytes =
      Pools({512, 3 * M + 512, 3 * M + 512, 3 * M}, {512, 512, 512, 0}, {0, 3 * M, 3 * M, 3 * M});
  s.active_bytes = s.allocated_bytes;
  s.requested_bytes = s.allocated_bytes;
  s.reserved_bytes =
      Pools({2 * M, 22 * M, 22 * M, 20 * M}, {2 * M, 2 * M, 2 * M, 0}, {0, 20 * M, 20 * M, 20 * M});
  s.inactive_split = Pools({1, 2, 2, 1}, {1, 1, 1, 0}, {0, 1, 1, 1});
  s.inactive_split_bytes =
      Pools({2 * M - 512, 19 * M - 512, 19 * M - 512, 17 * M},
            {2 * M - 512, 2 * M - 512, 2 * M - 512, 0}, {0, 17 * M, 17 * M, 17 * M});
  s.num_device_alloc = 2;
  s.num_device_free = 1;
  s.num_sync_all_streams = 1;
  return s;
}

TEST(AllocatorRules, ResetPeakStatsSetsEveryPeakToCurrentAndNothingElse) {
  Harness h;
  DeviceStats want = ResetScenario(h);
  ASSERT_TRUE(StatsAre(h.alloc.stats(), want));

  h.alloc.reset_peak_stats();
  want.allocation = Pools({1, 1, 2, 1}, {1, 1, 1, 0}, {0, 0, 1, 1});
  want.active = want.allocation;
  want.segment = want.allocation;
  want.allocated_bytes =
      Pools({512, 512, 3 * M + 512, 3 * M}, {512, 512, 512, 0}, {0, 0, 3 * M, 3 * M});
  want.active_bytes = want.allocated_bytes;
  want.requested_bytes = want.allocated_bytes;
  want.reserved_bytes =
      Pools({2 * M, 2 * M, 22 * M, 20 * M}, {2 * M, 2 * M, 2 * M, 0}, {0, 0, 20 * M, 20 * M});
  want.inactive_split = Pools({1, 1, 2, 1}, {1, 1, 1, 0}, {0, 0, 1, 1});
  want.inactive_split_bytes =
      Pools({2 * M - 512, 2 * M - 512, 19 * M - 512, 17 * M},
            {2 * M - 512, 2 * M - 512, 2 * M - 512, 0}, {0, 0, 17 * M, 17 * M});
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after reset_peak_stats";

  // Peaks grow again from the reset level: 1 KiB more from the small remainder.
  EXPECT_EQ(h.alloc.malloc(1024), kBase + 20 * M + 512);
  const DeviceStats s = h.alloc.stats();
  EXPECT_EQ(Describe(s.allocated_bytes[kAggregate]),
            Describe(Stat{1536, 1536, 3 * M + 1536, 3 * M}));
  EXPECT_EQ(Describe(s.allocated_bytes[kSmallPool]), Describe(Stat{1536, 1536, 1536, 0}));
  EXPECT_EQ(Describe(s.allocation[kAggregate]), Describe(Stat{2, 2, 3, 1}));
}

TEST(AllocatorRules, ResetAccumulatedStatsZeroesTotalsAndCountersAndNothingElse) {
  Harness h;
  DeviceStats want = ResetScenario(h);
  ASSERT_TRUE(StatsAre(h.alloc.stats(), want));

  h.alloc.reset_accumulated_stats();
  want.allocation = Pools({1, 2, 0, 0}, {1, 1, 0, 0}, {0, 1, 0, 0});
  want.active = want.allocation;
  want.segment = want.allocation;
  want.allocated_bytes = Pools({512, 3 * M + 512, 0, 0}, {512, 512, 0, 0}, {0, 3 * M, 0, 0});
  want.active_bytes = want.allocated_bytes;
  want.requested_bytes = want.allocated_bytes;
  want.reserved_bytes = Pools({2 * M, 22 * M, 0, 0}, {2 * M, 2 * M, 0, 0}, {0, 20 * M, 0, 0});
  want.inactive_split = Pools({1, 2, 0, 0}, {1, 1, 0, 0}, {0, 1, 0, 0});
  want.inactive_split_bytes =
      Pools({2 * M - 512, 19 * M - 512, 0, 0}, {2 * M - 512, 2 * M - 512, 0, 0}, {0, 17 * M, 0, 0});
  want.num_device_alloc = 0;
  want.num_device_free = 0;
  want.num_sync_all_streams = 0;
  EXPECT_TRUE(StatsAre(h.alloc.stats(), want)) << "after reset_accumulated_stats";

  // Totals restart from zero; the peak of 3 MiB + 512 still stands.
  EXPECT_EQ(h.alloc.malloc(1024), kBase + 20 * M + 512);
  const DeviceStats s = h.alloc.stats();
  EXPECT_EQ(Describe(s.allocated_bytes[kAggregate]), Describe(Stat{1536, 3 * M + 512, 1024, 0}));
  EXPECT_EQ(Describe(s.allocation[kAggregate]), Describe(Stat{2, 2, 1, 0}));
}

// =======================================================================================
// Uncached mode, mem_get_info, null sizes and pointers

TEST(AllocatorRules, UncachedModeMapsEachMallocAndFreeToOneExactDriverCall) {
  Harness h("uncached:True");
  const DevicePtr p = h.alloc.malloc(1000);
  const DevicePtr q = h.alloc.malloc(1 * M + 1);
  EXPECT_EQ(p, kBase);
  EXPECT_EQ(q, kBase + 2 * M);
  EXPECT_EQ(h.gpu.counters().allocate_calls, 2u);
  EXPECT_EQ(h.gpu.used_bytes(), 1000 + 1 * M + 1);  // exact sizes, no rounding

  h.alloc.free(p);
  EXPECT_EQ(h.gpu.counters().free_calls, 1u);
  EXPECT_EQ(h.gpu.used_bytes(), 1 * M + 1);
  h.alloc.free(q);
  EXPECT_EQ(h.gpu.counters().free_calls, 2u);
  EXPECT_EQ(h.gpu.used_bytes(), 0u);

  EXPECT_TRUE(StatsAre(h.alloc.stats(), DeviceStats{}));
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {}));
  EXPECT_TRUE(h.alloc.segments().empty());
}

TEST(AllocatorRules, MemGetInfoEqualsTheDrivers) {
  Harness h;
  const std::size_t capacity = 141 * sim::kGiB;
  MemInfo info = h.alloc.mem_get_info();
  EXPECT_EQ(info.free_bytes, capacity);
  EXPECT_EQ(info.total_bytes, capacity);

  h.alloc.malloc(512);  // reserves one 2 MiB segment
  info = h.alloc.mem_get_info();
  EXPECT_EQ(info.free_bytes, capacity - 2 * M);
  EXPECT_EQ(info.total_bytes, capacity);
  const MemInfo driver = h.gpu.mem_info();
  EXPECT_EQ(info.free_bytes, driver.free_bytes);
  EXPECT_EQ(info.total_bytes, driver.total_bytes);
}

TEST(AllocatorRules, MallocOfZeroBytesReturnsNullAndDoesNothing) {
  Harness h;
  const sim::Counters before = h.gpu.counters();
  EXPECT_EQ(h.alloc.malloc(0), 0u);
  EXPECT_EQ(h.alloc.malloc(0, 4), 0u);
  EXPECT_EQ(h.gpu.counters(), before);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {}));
  EXPECT_TRUE(StatsAre(h.alloc.stats(), DeviceStats{}));
  EXPECT_TRUE(h.alloc.segments().empty());
}

TEST(AllocatorRules, FreeOfNullIsANoOp) {
  Harness h;
  h.alloc.malloc(512);
  const DeviceStats stats = h.alloc.stats();
  const std::vector<SegmentInfo> segments = h.alloc.segments();
  const sim::Counters counters = h.gpu.counters();
  h.TakeTrace();
  EXPECT_NO_THROW(h.alloc.free(0));
  EXPECT_TRUE(StatsAre(h.alloc.stats(), stats));
  EXPECT_TRUE(SameSegments(segments, h.alloc.segments()));
  EXPECT_EQ(h.gpu.counters(), counters);
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {}));
}

// =======================================================================================
// Errors: InvalidPointerError names the pointer and changes nothing

TEST(AllocatorRules, FreeOfANeverAllocatedPointerThrowsNamingIt) {
  Harness h;
  h.alloc.malloc(512);
  // base + 512 is the start of the cached remainder, never handed out.
  ExpectRejectedWithoutEffect(h, 0x7f0000000200, [&] { h.alloc.free(0x7f0000000200); });
  ExpectRejectedWithoutEffect(h, 0x1234, [&] { h.alloc.free(0x1234); });
}

TEST(AllocatorRules, DoubleFreeThrowsNamingThePointer) {
  Harness h;
  const DevicePtr p = h.alloc.malloc(512);
  h.alloc.malloc(512);
  h.alloc.free(p);
  ExpectRejectedWithoutEffect(h, 0x7f0000000000, [&] { h.alloc.free(p); });
}

TEST(AllocatorRules, DoubleFreeOfABlockPendingOnAnotherStreamThrows) {
  Harness h;
  const DevicePtr p = h.alloc.malloc(512);
  h.alloc.record_stream(p, 6);
  h.alloc.free(p);  // pending on stream 6
  ExpectRejectedWithoutEffect(h, 0x7f0000000000, [&] { h.alloc.free(p); });
}

TEST(AllocatorRules, FreeOfAnInteriorPointerThrowsNamingIt) {
  Harness h;
  const DevicePtr p = h.alloc.malloc(1024);
  ExpectRejectedWithoutEffect(h, 0x7f0000000200, [&] { h.alloc.free(p + 512); });
  // The allocation itself is untouched and can still be freed.
  EXPECT_EQ(h.alloc.allocation_size(p), 1024u);
  EXPECT_NO_THROW(h.alloc.free(p));
}

TEST(AllocatorRules, RecordStreamOfAFreedPointerThrowsNamingIt) {
  Harness h;
  const DevicePtr p = h.alloc.malloc(512);
  h.alloc.malloc(512);
  h.alloc.free(p);
  ExpectRejectedWithoutEffect(h, 0x7f0000000000, [&] { h.alloc.record_stream(p, 4); });
  // No stream use was recorded: reusing and freeing the block records no event.
  EXPECT_EQ(h.alloc.malloc(512), p);
  h.alloc.free(p);
  EXPECT_EQ(h.gpu.counters().event_records, 0u);
}

// Throws OutOfMemoryError mentioning "1EB" for `size`, without touching the device.
void ExpectExabyteGuard(std::size_t size) {
  Harness h;
  try {
    h.alloc.malloc(size);
    ADD_FAILURE() << "malloc(" << size << ") did not throw";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("1EB"), std::string::npos) << e.what();
  }
  EXPECT_EQ(h.gpu.counters().allocate_calls, 0u);
  EXPECT_TRUE(StatsAre(h.alloc.stats(), DeviceStats{}));
  EXPECT_TRUE(TraceIs(h.TakeTrace(), {}));
  // Still usable.
  EXPECT_EQ(h.alloc.malloc(512), kBase);
}

TEST(AllocatorRules, RequestAboveOneExabyteThrowsOutOfMemory) {
  ExpectExabyteGuard(kOneEB + 1);
  ExpectExabyteGuard(SIZE_MAX);
}

// PyTorch's guard is TORCH_CHECK(size < one_exa_bytes): exactly 1 EB is refused too.
TEST(AllocatorRules, RequestOfExactlyOneExabyteIsRefusedByTheGuard) {
  ExpectExabyteGuard(kOneEB);
}

}  // namespace
}  // namespace ccalloc
