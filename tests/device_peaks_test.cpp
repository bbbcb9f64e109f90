// Device-wide peaks of the block statistics with several streams (the baseline ledger of
// src/native/arena.hpp): a peak is the maximum over time of the sum over every stream, as
// PyTorch's single lock gives it, not the sum of the streams' own peaks. Deterministic
// sequences with hand-worked values, a randomized comparison against a model that keeps one
// device-wide current and its maximum, and the other backends (which keep one set of
// statistics under one lock).
//
// Sizes: 8 MiB rounds to itself and takes a 20 MiB large segment (rounded < 10 MiB), split
// into the block and a 12 MiB free remainder; 4 MiB likewise (16 MiB remainder).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"

namespace ccalloc {
namespace {

constexpr std::int64_t M = 1 << 20;
constexpr StreamId kS0 = 0;
constexpr StreamId kS1 = 1;
constexpr StreamId kS2 = 2;

struct Rig {
  explicit Rig(const char* conf = "pytorch") : alloc(gpu, Config::parse(conf)) {
    alloc.set_check_invariants(true);
  }
  DevicePtr malloc(std::int64_t bytes, StreamId stream) {
    return alloc.malloc(static_cast<std::size_t>(bytes), stream);
  }
  sim::SimDriver gpu;
  Allocator alloc;
};

TEST(DevicePeaks, TwoStreamsTakingTurnsPeakAtOneAllocation) {
  Rig rig;
  rig.alloc.free(rig.malloc(8 * M, kS1));
  rig.alloc.free(rig.malloc(8 * M, kS2));
  const DeviceStats s = rig.alloc.stats();
  for (const int t : {kAggregate, kLargePool}) {
    // Summing the streams' peaks would give 16 MiB, 2 allocations, 24 MiB of split bytes.
    EXPECT_EQ(s.allocated_bytes[t].peak, 8 * M);
    EXPECT_EQ(s.active_bytes[t].peak, 8 * M);
    EXPECT_EQ(s.requested_bytes[t].peak, 8 * M);
    EXPECT_EQ(s.allocation[t].peak, 1);
    EXPECT_EQ(s.active[t].peak, 1);
    // While s1's block was live: its 12 MiB remainder; while s2's was: s2's remainder, and
    // s1's segment was whole again.
    EXPECT_EQ(s.inactive_split[t].peak, 1);
    EXPECT_EQ(s.inactive_split_bytes[t].peak, 12 * M);
    // Segments are device-wide already: both 20 MiB segments stay cached.
    EXPECT_EQ(s.segment[t].peak, 2);
    EXPECT_EQ(s.reserved_bytes[t].peak, 40 * M);
    EXPECT_EQ(s.allocated_bytes[t].current, 0);
    EXPECT_EQ(s.allocated_bytes[t].allocated, 16 * M);
    EXPECT_EQ(s.allocated_bytes[t].freed, 16 * M);
  }
  EXPECT_EQ(s.allocated_bytes[kSmallPool].peak, 0);
}

TEST(DevicePeaks, SimultaneousBlocksOnTwoStreamsAddUp) {
  Rig rig;
  const DevicePtr a = rig.malloc(8 * M, kS1);
  const DevicePtr b = rig.malloc(4 * M, kS2);
  rig.alloc.free(a);
  rig.alloc.free(b);
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, 12 * M);
  EXPECT_EQ(s.allocation[kAggregate].peak, 2);
  EXPECT_EQ(s.inactive_split[kAggregate].peak, 2);
  EXPECT_EQ(s.inactive_split_bytes[kAggregate].peak, 28 * M);  // 12 + 16
}

TEST(DevicePeaks, FreesInEitherOrderGiveTheSamePeaks) {
  for (const bool first_a : {true, false}) {
    Rig rig;
    const DevicePtr a = rig.malloc(8 * M, kS1);
    const DevicePtr b = rig.malloc(8 * M, kS2);
    rig.alloc.free(first_a ? a : b);
    rig.alloc.free(first_a ? b : a);
    const DevicePtr c = rig.malloc(4 * M, kS1);
    const DeviceStats s = rig.alloc.stats();
    EXPECT_EQ(s.allocated_bytes[kAggregate].peak, 16 * M) << first_a;
    EXPECT_EQ(s.allocated_bytes[kAggregate].current, 4 * M) << first_a;
    EXPECT_EQ(s.allocation[kAggregate].peak, 2) << first_a;
    rig.alloc.free(c);
  }
}

// A block used on a side stream stays active after its free until the event completes.
TEST(DevicePeaks, RecordStreamAndCrossStreamFreeCountOnceEach) {
  Rig rig;
  const DevicePtr a = rig.malloc(8 * M, kS0);
  rig.alloc.record_stream(a, kS1);
  rig.alloc.free(a);  // pending: active, no longer allocated
  const DevicePtr b = rig.malloc(8 * M, kS1);
  rig.gpu.complete_stream(kS1);
  rig.alloc.free(b);
  const DevicePtr c = rig.malloc(8 * M, kS2);  // completes a's free first
  const DeviceStats s = rig.alloc.stats();
  // Allocated: one block at a time. Active: a (pending) and b together. Summing the three
  // streams' peaks would give 24 MiB for both.
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, 8 * M);
  EXPECT_EQ(s.allocation[kAggregate].peak, 1);
  EXPECT_EQ(s.active_bytes[kAggregate].peak, 16 * M);
  EXPECT_EQ(s.active[kAggregate].peak, 2);
  EXPECT_EQ(s.requested_bytes[kAggregate].peak, 16 * M);
  EXPECT_EQ(s.active_bytes[kAggregate].current, 8 * M);
  rig.alloc.free(c);
}

// The frees completed by one malloc each count as an operation: a peak between two of them
// is kept even though the next lowers the counter again.
TEST(DevicePeaks, PeakBetweenTwoCompletedFreesIsKept) {
  Rig rig;
  // One 20 MiB segment on s0: a [0,4) b [4,8) c [8,12), free [12,20).
  const DevicePtr a = rig.malloc(4 * M, kS0);
  const DevicePtr b = rig.malloc(4 * M, kS0);
  const DevicePtr c = rig.malloc(4 * M, kS0);
  rig.alloc.free(c);  // free [8,20): 1 split block of 12 MiB
  rig.alloc.record_stream(a, kS1);
  rig.alloc.record_stream(b, kS1);
  rig.alloc.free(b);  // b's event is first on s1
  rig.alloc.free(a);
  rig.alloc.reset_peak_stats();
  DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.inactive_split_bytes[kAggregate].peak, 12 * M);
  rig.gpu.complete_stream(kS1);
  // b's free merges into [4,20) (16 MiB), then a's makes the segment whole (0 MiB); then
  // the small request splits a 2 MiB small segment on s2.
  const DevicePtr d = rig.alloc.malloc(512, kS2);
  s = rig.alloc.stats();
  EXPECT_EQ(s.inactive_split_bytes[kAggregate].peak, 16 * M);
  EXPECT_EQ(s.inactive_split_bytes[kLargePool].peak, 16 * M);
  EXPECT_EQ(s.inactive_split_bytes[kSmallPool].peak, 2 * M - 512);
  EXPECT_EQ(s.inactive_split_bytes[kAggregate].current, 2 * M - 512);
  EXPECT_EQ(s.inactive_split[kAggregate].peak, 1);
  rig.alloc.free(d);
}

TEST(DevicePeaks, ResetPeakStatsThenMoreOperations) {
  Rig rig;
  const DevicePtr a = rig.malloc(8 * M, kS1);
  const DevicePtr b = rig.malloc(8 * M, kS2);
  rig.alloc.free(a);
  rig.alloc.reset_peak_stats();
  DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, 8 * M);  // b alone
  // s1 has room again (its baseline is 0 after the reset): 4 MiB there is a new peak.
  const DevicePtr c = rig.malloc(4 * M, kS1);
  s = rig.alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, 12 * M);
  rig.alloc.free(b);
  rig.alloc.free(c);
  const DevicePtr d = rig.malloc(6 * M, kS2);
  s = rig.alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, 12 * M);
  EXPECT_EQ(s.allocated_bytes[kAggregate].current, 6 * M);
  rig.alloc.reset_peak_stats();
  s = rig.alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, 6 * M);
  EXPECT_EQ(s.allocation[kAggregate].peak, 1);
  rig.alloc.free(d);
}

// ---------------------------------------------------------------------------------------
// Randomized: the same operations replayed into a model that sums every stream's blocks
// into one current per statistic and keeps its maximum, as one device-wide lock would.

struct Model {
  struct Live {
    StreamId stream;
    std::int64_t size;       // the block's size (allocation_size)
    std::int64_t requested;  // the request
    std::set<StreamId> uses;
  };
  struct Pending {
    std::int64_t size;
    std::int64_t requested;
    bool large;
    std::set<StreamId> waiting;  // streams whose events have not completed
  };
  // The counters modelled, per pool kind [all, small, large].
  struct Counts {
    std::array<std::int64_t, 3> allocation{}, allocated_bytes{}, active{}, active_bytes{},
        requested_bytes{};
    std::int64_t oversize = 0;
  };

  explicit Model(std::int64_t max_split) : max_split_size(max_split) {}

  void malloc(DevicePtr p, StreamId stream, std::int64_t size, std::int64_t requested) {
    retire(false);
    live[p] = Live{stream, size, requested, {}};
    const bool large = size > M;
    for (const int t : {0, large ? 2 : 1}) {
      cur.allocation[t] += 1;
      cur.allocated_bytes[t] += size;
      cur.active[t] += 1;
      cur.active_bytes[t] += size;
      cur.requested_bytes[t] += requested;
    }
    if (size >= max_split_size) cur.oversize += 1;
    observe();
  }
  void record_stream(DevicePtr p, StreamId stream) {
    Live& l = live.at(p);
    if (stream != l.stream) l.uses.insert(stream);
  }
  void free(DevicePtr p) {
    const Live l = live.at(p);
    live.erase(p);
    const bool large = l.size > M;
    for (const int t : {0, large ? 2 : 1}) {
      cur.allocation[t] -= 1;
      cur.allocated_bytes[t] -= l.size;
    }
    if (l.size >= max_split_size) cur.oversize -= 1;
    pending.push_back(Pending{l.size, l.requested, large, l.uses});
    retire_one_if_done(pending.size() - 1, false);
  }
  void complete_stream(StreamId s) {
    for (Pending& p : pending)
      p.waiting.erase(s);
  }
  void empty_cache() { retire(true); }
  void reset_peak() { peak = cur; }

  // Frees whose events completed return their blocks (all of them with `sync`).
  void retire(bool sync) {
    for (std::size_t i = pending.size(); i-- > 0;)
      retire_one_if_done(i, sync);
  }
  void retire_one_if_done(std::size_t i, bool sync) {
    if (!sync && !pending[i].waiting.empty()) return;
    const Pending p = pending[i];
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    for (const int t : {0, p.large ? 2 : 1}) {
      cur.active[t] -= 1;
      cur.active_bytes[t] -= p.size;
      cur.requested_bytes[t] -= p.requested;
    }
  }
  void observe() {
    for (int t = 0; t < 3; ++t) {
      peak.allocation[t] = std::max(peak.allocation[t], cur.allocation[t]);
      peak.allocated_bytes[t] = std::max(peak.allocated_bytes[t], cur.allocated_bytes[t]);
      peak.active[t] = std::max(peak.active[t], cur.active[t]);
      peak.active_bytes[t] = std::max(peak.active_bytes[t], cur.active_bytes[t]);
      peak.requested_bytes[t] = std::max(peak.requested_bytes[t], cur.requested_bytes[t]);
    }
    peak.oversize = std::max(peak.oversize, cur.oversize);
  }

  std::int64_t max_split_size;
  std::map<DevicePtr, Live> live;
  std::vector<Pending> pending;
  Counts cur, peak;
};

void ExpectMatchesModel(const DeviceStats& s, const Model& m, const std::string& where) {
  const auto same = [&](const char* name, const StatArray& have,
                        const std::array<std::int64_t, 3>& cur,
                        const std::array<std::int64_t, 3>& peak) {
    for (int t = 0; t < 3; ++t) {
      EXPECT_EQ(have[t].current, cur[t]) << where << " " << name << "[" << t << "]";
      EXPECT_EQ(have[t].peak, peak[t]) << where << " " << name << "[" << t << "] peak";
    }
  };
  same("allocation", s.allocation, m.cur.allocation, m.peak.allocation);
  same("allocated_bytes", s.allocated_bytes, m.cur.allocated_bytes, m.peak.allocated_bytes);
  same("active", s.active, m.cur.active, m.peak.active);
  same("active_bytes", s.active_bytes, m.cur.active_bytes, m.peak.active_bytes);
  same("requested_bytes", s.requested_bytes, m.cur.requested_bytes, m.peak.requested_bytes);
  EXPECT_EQ(s.oversize_allocations.current, m.cur.oversize) << where;
  EXPECT_EQ(s.oversize_allocations.peak, m.peak.oversize) << where;
}

TEST(DevicePeaks, RandomOperationsOnFourStreamsMatchASingleLockModel) {
  for (const std::uint32_t seed : {1u, 2u, 3u, 4u}) {
    Rig rig("pytorch,max_split_size_mb:24");
    Model model(24 * M);
    std::mt19937 rng(seed);
    const auto pick = [&rng](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
    std::vector<DevicePtr> live;
    std::array<std::int64_t, 2> split_peak_seen{};  // max current of inactive_split(_bytes)
    for (int op = 0; op < 1500; ++op) {
      const std::string where = "seed " + std::to_string(seed) + " op " + std::to_string(op);
      const int kind = pick(100);
      if (kind < 45 || live.empty()) {
        const StreamId stream = static_cast<StreamId>(pick(4));
        const std::int64_t size = pick(3) == 0 ? 1 + pick(40 * static_cast<int>(M))
                                               : 1 + pick(static_cast<int>(M));
        const DevicePtr p = rig.alloc.malloc(static_cast<std::size_t>(size), stream);
        model.malloc(p, stream, static_cast<std::int64_t>(rig.alloc.allocation_size(p)), size);
        live.push_back(p);
      } else if (kind < 85) {
        const std::size_t i = static_cast<std::size_t>(pick(static_cast<int>(live.size())));
        rig.alloc.free(live[i]);
        model.free(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (kind < 93) {
        const DevicePtr p = live[static_cast<std::size_t>(pick(static_cast<int>(live.size())))];
        const StreamId stream = static_cast<StreamId>(pick(4));
        rig.alloc.record_stream(p, stream);
        model.record_stream(p, stream);
      } else if (kind < 98) {
        const StreamId stream = static_cast<StreamId>(pick(4));
        rig.gpu.complete_stream(stream);
        model.complete_stream(stream);
      } else if (kind < 99) {
        rig.alloc.reset_peak_stats();
        model.reset_peak();
        split_peak_seen = {};
      } else {
        rig.alloc.empty_cache();
        model.empty_cache();
      }
      const DeviceStats s = rig.alloc.stats();
      ExpectMatchesModel(s, model, where);
      // The split counters depend on block layout, which the model does not follow: their
      // peak is at least every current seen (and, where the frees completed by one malloc
      // raise them between two frees, above it).
      split_peak_seen[0] = std::max(split_peak_seen[0], s.inactive_split[kAggregate].current);
      split_peak_seen[1] =
          std::max(split_peak_seen[1], s.inactive_split_bytes[kAggregate].current);
      EXPECT_GE(s.inactive_split[kAggregate].peak, split_peak_seen[0]) << where;
      EXPECT_GE(s.inactive_split_bytes[kAggregate].peak, split_peak_seen[1]) << where;
      if (::testing::Test::HasFailure()) return;
    }
    for (const DevicePtr p : live)
      rig.alloc.free(p);
  }
}

// ---------------------------------------------------------------------------------------
// The other backends keep one set of statistics under one lock: their peaks are already
// device-wide.

TEST(DevicePeaks, StitchingPolicyPeaksAreDeviceWide) {
  Rig rig("ccalloc,stitch_segments:True");
  rig.alloc.free(rig.malloc(8 * M, kS1));
  rig.alloc.free(rig.malloc(8 * M, kS2));
  const DevicePtr a = rig.malloc(8 * M, kS1);
  rig.alloc.record_stream(a, kS2);
  rig.alloc.free(a);
  const DevicePtr b = rig.malloc(4 * M, kS2);
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, 8 * M);
  EXPECT_EQ(s.allocation[kAggregate].peak, 1);
  EXPECT_EQ(s.active_bytes[kAggregate].peak, 12 * M);  // a pending + b
  EXPECT_EQ(s.active[kAggregate].peak, 2);
  rig.alloc.free(b);
}

TEST(DevicePeaks, AsyncBackendPeaksAreDeviceWide) {
  Rig rig("backend:cudaMallocAsync");
  rig.alloc.free(rig.malloc(8 * M, kS1));
  rig.alloc.free(rig.malloc(8 * M, kS2));
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, 8 * M);
  EXPECT_EQ(s.allocation[kAggregate].peak, 1);
}

}  // namespace
}  // namespace ccalloc
