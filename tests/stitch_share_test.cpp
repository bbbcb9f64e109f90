// Sharing physical memory between streams under the `ccalloc` preset (src/stitch/share.cpp,
// docs/ccalloc-policy.md rule 9): a stream's growth takes the handles of another stream's
// free pages once a fence recorded on that stream after their frees has completed; where
// every fence of that stream has completed, behind a device-side wait on a fence recorded
// then; and under stream_borrow_wait (the default) also while that stream's work may still
// reach their frees, behind a device-side wait on the oldest fence that covers them. Never
// while their uses may still run without a wait. Exact values on the simulated GPU, whose
// events complete only when a test completes them.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "stitch/engine.hpp"

namespace {

using ccalloc::Config;
using ccalloc::DevicePtr;
using ccalloc::kAggregate;
using ccalloc::StreamId;
using ccalloc::core::StitchEngine;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// A device too small for a 20 MiB chunk: growth creates exactly what a request lacks, in
// handles of two pieces (4 MiB, set: the room left on so small a device would give one).
constexpr const char* kTwoPieces = "ccalloc,stitch_handle_mb:4";

struct Fixture {
  explicit Fixture(std::size_t capacity = 18 * kMiB, const char* conf = kTwoPieces)
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

TEST(StitchShare, OneStreamRecordsNoFence) {
  Fixture f;
  for (int i = 0; i < 20; ++i) {
    const DevicePtr a = f.engine.malloc(4 * kMiB, 0);
    const DevicePtr b = f.engine.malloc(1 * kMiB, 0);
    f.engine.free(a);
    f.engine.free(b);
  }
  EXPECT_EQ(f.engine.piece_counts().fences, 0u);
  EXPECT_EQ(f.gpu.counters().event_records, 0u);
  EXPECT_EQ(f.gpu.counters().event_queries, 0u);
}

TEST(StitchShare, AGrowthTakesAnotherStreamsFreeHandleOnceItsFenceHasCompleted) {
  Fixture f;
  const DevicePtr b = f.engine.malloc(4 * kMiB, 0);
  const DevicePtr a = f.engine.malloc(4 * kMiB, 1);  // a second stream: sharing begins
  f.engine.free(a);  // stamps a's pages; the free records stream 1's first fence
  EXPECT_EQ(f.engine.piece_counts().fences, 1u);
  f.gpu.complete_stream(1);
  const DevicePtr c = f.engine.malloc(4 * kMiB, 0);
  EXPECT_EQ(c, b + 4 * kMiB);  // stream 0's frontier, backed by stream 1's handle
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(f.gpu.counters().physical_creates, 2u);
  const StitchEngine::PieceCounts counts = f.engine.piece_counts();
  EXPECT_EQ(counts.borrowed_handles, 1u);
  EXPECT_EQ(counts.borrowed_pieces, 2u);
  EXPECT_EQ(counts.borrow_waits, 0u);
  EXPECT_EQ(counts.dead_pages, 2u);  // a's pages in stream 1's space
  EXPECT_EQ(f.gpu.counters().stream_waits, 0u);
  EXPECT_EQ(f.gpu.counters().event_synchronizes + f.gpu.counters().stream_synchronizes, 0u);
  // Stream 1 has nothing left to give: its next request creates memory.
  f.engine.malloc(4 * kMiB, 1);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(12 * kMiB));
}

constexpr const char* kNoWait = "ccalloc,stream_borrow_wait:False,stitch_handle_mb:4";

TEST(StitchShare, WithoutBorrowWaitsPagesWhoseStreamMayStillUseThemAreNotTaken) {
  Fixture f(18 * kMiB, kNoWait);
  f.engine.malloc(4 * kMiB, 0);
  const DevicePtr a = f.engine.malloc(4 * kMiB, 1);
  f.engine.free(a);  // its fence has not completed: stream 1 may still be using a
  f.engine.malloc(4 * kMiB, 0);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(12 * kMiB));
  EXPECT_EQ(f.engine.piece_counts().borrowed_handles, 0u);
  EXPECT_EQ(f.engine.piece_counts().dead_pages, 0u);
  EXPECT_EQ(f.gpu.counters().stream_waits, 0u);
}

// reconfigure() switches the waits live: off, the busy stream's pages stay; on again, the
// next growth takes them.
TEST(StitchShare, BorrowWaitsSwitchLiveWithReconfigure) {
  Fixture f(18 * kMiB, kNoWait);
  f.engine.malloc(4 * kMiB, 0);
  const DevicePtr a = f.engine.malloc(4 * kMiB, 1);
  f.engine.free(a);  // its fence is pending
  f.engine.malloc(2 * kMiB, 0);
  EXPECT_EQ(f.engine.piece_counts().borrowed_handles, 0u);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(10 * kMiB));
  ASSERT_TRUE(f.engine.reconfigure(Config::parse(kTwoPieces)));
  EXPECT_TRUE(f.engine.config().stream_borrow_wait);
  f.engine.malloc(4 * kMiB, 0);
  EXPECT_EQ(f.engine.piece_counts().borrowed_handles, 1u);
  EXPECT_EQ(f.engine.piece_counts().busy_borrow_waits, 1u);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(10 * kMiB));
}

TEST(StitchShare, ABusyStreamsPagesServeBehindAWaitOnTheFenceAfterTheirFree) {
  Fixture f;
  const DevicePtr b = f.engine.malloc(4 * kMiB, 0);
  const DevicePtr a = f.engine.malloc(4 * kMiB, 1);
  f.engine.free(a);  // fence 1 over a, pending: stream 1 may still be using a
  const ccalloc::EventId later = f.gpu.create_event();
  f.gpu.record_event(later, 1);  // stream 1's work after the fence
  const DevicePtr c = f.engine.malloc(4 * kMiB, 0);
  EXPECT_EQ(c, b + 4 * kMiB);  // a's handle, mapped at stream 0's frontier
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(8 * kMiB));
  const StitchEngine::PieceCounts counts = f.engine.piece_counts();
  EXPECT_EQ(counts.borrowed_handles, 1u);
  EXPECT_EQ(counts.borrow_waits, 1u);
  EXPECT_EQ(counts.busy_borrow_waits, 1u);
  EXPECT_EQ(counts.fences, 1u);  // the fence in flight, not a new one
  EXPECT_EQ(counts.dead_pages, 2u);
  EXPECT_EQ(f.gpu.counters().stream_waits, 1u);
  EXPECT_EQ(f.gpu.counters().event_synchronizes + f.gpu.counters().stream_synchronizes, 0u);
  EXPECT_FALSE(f.gpu.waited_for(0, later));  // stream 1's later work is not waited for
}

TEST(StitchShare, TheWaitIsOnTheOldestFenceThatCoversWhatIsTaken) {
  Fixture f;
  f.engine.malloc(2 * kMiB, 0);
  const DevicePtr x = f.engine.malloc(4 * kMiB, 1);
  f.engine.malloc(4 * kMiB, 1);  // kept: x and a are not one free block
  const DevicePtr a = f.engine.malloc(4 * kMiB, 1);
  const ccalloc::EventId use_of_x = f.gpu.create_event();
  f.gpu.record_event(use_of_x, 1);
  f.gpu.set_time_us(0);
  f.engine.free(x);  // fence 1 over x
  const ccalloc::EventId between = f.gpu.create_event();
  f.gpu.record_event(between, 1);
  f.gpu.set_time_us(2000);
  f.engine.free(a);  // fence 2 over a
  EXPECT_EQ(f.engine.piece_counts().fences, 2u);
  // Stream 0 lacks one handle: x's (of two blocks of one size, the lower address), behind
  // fence 1 alone.
  f.engine.malloc(4 * kMiB, 0);
  const StitchEngine::PieceCounts counts = f.engine.piece_counts();
  EXPECT_EQ(counts.borrowed_handles, 1u);
  EXPECT_EQ(counts.busy_borrow_waits, 1u);
  EXPECT_EQ(counts.fences, 2u);
  EXPECT_EQ(f.gpu.counters().stream_waits, 1u);
  EXPECT_TRUE(f.gpu.waited_for(0, use_of_x));
  EXPECT_FALSE(f.gpu.waited_for(0, between));
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(14 * kMiB));
}

TEST(StitchShare, HandlesThatNeedNoWaitOnPendingWorkAreTakenFirst) {
  Fixture f;
  f.engine.malloc(2 * kMiB, 0);
  const DevicePtr small = f.engine.malloc(4 * kMiB, 1);
  const DevicePtr big = f.engine.malloc(8 * kMiB, 2);  // two handles of 4 MiB
  f.gpu.set_time_us(0);
  f.engine.free(big);  // stream 2's fence, completed below
  f.gpu.complete_stream(2);
  f.engine.free(small);  // stream 1's fence, pending
  f.engine.malloc(4 * kMiB, 0);
  // Stream 1's block is the smaller, but its work may still run: one of stream 2's
  // handles serves, with no wait.
  const StitchEngine::PieceCounts counts = f.engine.piece_counts();
  EXPECT_EQ(counts.borrowed_handles, 1u);
  EXPECT_EQ(counts.borrow_waits, 0u);
  EXPECT_EQ(f.gpu.counters().stream_waits, 0u);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(14 * kMiB));
}

// A handle taken behind a wait carries it: a third stream that takes it from the borrower
// is ordered after the first stream's use too (through the borrower's fence).
TEST(StitchShare, AHandleTakenBehindAWaitPassesOnOnlyBehindTheBorrowersFence) {
  Fixture f;
  const DevicePtr a = f.engine.malloc(4 * kMiB, 2);
  const ccalloc::EventId use_of_a = f.gpu.create_event();
  f.gpu.record_event(use_of_a, 2);
  f.engine.free(a);  // stream 2's fence, pending
  const DevicePtr b = f.engine.malloc(4 * kMiB, 1);  // a's handle, behind a wait
  EXPECT_EQ(f.engine.piece_counts().borrowed_handles, 1u);
  f.engine.free(b);  // stream 1's fence over b; stream 1 has run nothing yet
  f.engine.malloc(4 * kMiB, 3);  // the same handle again, behind stream 1's fence
  EXPECT_EQ(f.engine.piece_counts().borrowed_handles, 2u);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(4 * kMiB));
  EXPECT_TRUE(f.gpu.waited_for(3, use_of_a));
}

TEST(StitchShare, AnIdleStreamsNewerFreesServeBehindAWaitOnAFenceRecordedThen) {
  Fixture f;
  f.engine.malloc(2 * kMiB, 0);
  const DevicePtr a = f.engine.malloc(4 * kMiB, 1);
  const DevicePtr x = f.engine.malloc(4 * kMiB, 1);
  f.engine.free(a);  // fence 1
  f.gpu.complete_stream(1);
  f.engine.free(x);  // within the fence interval of the last poll: no fence covers x yet
  EXPECT_EQ(f.engine.piece_counts().fences, 1u);
  const std::uint64_t waits = f.gpu.counters().stream_waits;
  f.engine.malloc(8 * kMiB, 0);
  // Both of stream 1's handles, x's behind a wait of stream 0 on stream 1's new fence.
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(10 * kMiB));
  const StitchEngine::PieceCounts counts = f.engine.piece_counts();
  EXPECT_EQ(counts.borrowed_handles, 2u);
  EXPECT_EQ(counts.borrow_waits, 1u);
  EXPECT_EQ(counts.fences, 2u);
  EXPECT_EQ(f.gpu.counters().stream_waits, waits + 1);
}

TEST(StitchShare, WithoutBorrowWaitsAStreamWithAFenceInFlightLendsOnlyWhatItsFencesCover) {
  Fixture f(18 * kMiB, kNoWait);
  f.engine.malloc(2 * kMiB, 0);
  const DevicePtr a = f.engine.malloc(4 * kMiB, 1);
  const DevicePtr x = f.engine.malloc(4 * kMiB, 1);
  f.gpu.set_time_us(0);
  f.engine.free(a);  // fence 1, at 0 us
  f.gpu.complete_stream(1);
  f.gpu.set_time_us(5000);
  f.engine.free(x);  // polls: fence 1 completed; records fence 2 over x, pending
  EXPECT_EQ(f.engine.piece_counts().fences, 2u);
  f.engine.malloc(8 * kMiB, 0);  // a's handle alone would leave 4 MiB to create: none taken
  EXPECT_EQ(f.engine.piece_counts().borrowed_handles, 0u);
  f.engine.malloc(4 * kMiB, 0);  // a's handle covers it
  EXPECT_EQ(f.engine.piece_counts().borrowed_handles, 1u);
  EXPECT_EQ(f.engine.piece_counts().borrow_waits, 0u);
  EXPECT_EQ(f.reserved(), static_cast<std::int64_t>(18 * kMiB));
}

TEST(StitchShare, ACaptureRecordsAndQueriesNoFence) {
  Fixture f(64 * kMiB);
  f.engine.malloc(2 * kMiB, 0);
  f.engine.free(f.engine.malloc(4 * kMiB, 1));
  const std::size_t fences = f.engine.piece_counts().fences;
  const std::size_t borrowed = f.engine.piece_counts().borrowed_handles;
  f.gpu.begin_capture(9);  // every event call throws while a stream captures
  f.engine.begin_capture();
  for (StreamId s : {StreamId{0}, StreamId{1}}) {
    const DevicePtr p = f.engine.malloc(6 * kMiB, s);
    f.engine.free(p);
  }
  f.engine.end_capture();
  f.gpu.end_capture(9);
  EXPECT_EQ(f.engine.piece_counts().fences, fences);
  EXPECT_EQ(f.engine.piece_counts().borrowed_handles, borrowed);
}

// Random work on three streams, with record_stream, completions that come late and the
// clock moving on: whenever a malloc hands out memory on a handle that another stream's
// allocations used last, their work (an event the test records, before each free, on every
// stream that used the allocation) has completed, or the new stream waited for it.
// The random work below on a device of `capacity` (its handles: 2 pieces up to 2 GiB, 32
// pieces from 32 GiB), the requests above 1 MiB scaled by `scale`.
struct ShareRun {
  std::size_t capacity;
  std::size_t scale;
  unsigned seed;
  int ops = 3000;  // 30 ms in a plain build at 96 MiB
};

class StitchShareRandom : public testing::TestWithParam<ShareRun> {};

TEST_P(StitchShareRandom, NoStreamGetsAHandleWhileAnotherStreamsUseOfItMayStillRun) {
  Fixture f(GetParam().capacity);
  std::mt19937 rng(GetParam().seed);
  struct Use {
    StreamId stream;
    ccalloc::EventId event;
  };
  std::map<ccalloc::PhysicalHandle, std::vector<Use>> used;  // earlier allocations' uses
  std::map<ccalloc::PhysicalHandle, StreamId> owner;         // the stream that last used it
  struct Live {
    DevicePtr ptr;
    StreamId stream;
    std::vector<StreamId> uses;
  };
  std::vector<Live> live;
  const std::size_t m = GetParam().scale;
  const std::size_t sizes[] = {128 * 1024, 1 * kMiB, 3 * kMiB * m, 6 * kMiB * m, 10 * kMiB * m,
                               24 * kMiB * m};
  std::int64_t now = 0;
  int checked = 0;
  const int ops = GetParam().ops;  // no scaling for the sanitizers
  for (int i = 0; i < ops; ++i) {
    now += static_cast<std::int64_t>(rng() % 3000);
    f.gpu.set_time_us(now);
    const unsigned op = rng() % 10;
    if (op < 5 || live.empty()) {
      const StreamId s = 1 + rng() % 3;
      DevicePtr p = 0;
      try {
        p = f.engine.malloc(sizes[rng() % std::size(sizes)], s);
      } catch (const ccalloc::OutOfMemoryError&) {
        continue;
      }
      for (ccalloc::PhysicalHandle h : f.engine.shared_region(p).pages) {
        auto& uses = used[h];
        // Within one stream, the rest of a handle serves while part of it waits; a handle
        // that changed streams was wholly free, and all of its uses must be done.
        const auto [was, fresh] = owner.try_emplace(h, s);
        const bool moved = !fresh && was->second != s;
        was->second = s;
        for (const Use& u : uses) {
          if (!moved || u.stream == s) continue;
          ++checked;
          EXPECT_TRUE(f.gpu.query_event(u.event) || f.gpu.waited_for(s, u.event))
              << "op " << i << ": stream " << s << " got handle " << h << " while stream "
              << u.stream << "'s use may still run";
        }
        std::erase_if(uses, [&](const Use& u) { return f.gpu.query_event(u.event); });
      }
      live.push_back(Live{p, s, {}});
    } else if (op < 9) {
      const std::size_t k = rng() % live.size();
      Live l = live[k];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      if (rng() % 4 == 0) {
        const StreamId other = 1 + (l.stream + rng() % 2) % 3;
        f.engine.record_stream(l.ptr, other);
        l.uses.push_back(other);
      }
      l.uses.push_back(l.stream);
      const auto handles = f.engine.shared_region(l.ptr).pages;
      for (StreamId u : l.uses) {  // before the free: the engine's events come after these
        const ccalloc::EventId e = f.gpu.create_event();
        f.gpu.record_event(e, u);
        for (ccalloc::PhysicalHandle h : handles)
          used[h].push_back(Use{u, e});
      }
      f.engine.free(l.ptr);
    } else {
      f.gpu.complete_stream(1 + rng() % 3);
    }
  }
  const StitchEngine::PieceCounts counts = f.engine.piece_counts();
  EXPECT_GT(counts.borrowed_handles, 0u);
  EXPECT_GT(counts.borrow_waits, 0u);
  EXPECT_GT(counts.busy_borrow_waits, 0u);
  EXPECT_GT(checked, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Devices, StitchShareRandom,
    testing::Values(ShareRun{96 * kMiB, 1, 37}, ShareRun{96 * kMiB, 1, 38},
                    // Handles of 32 pieces: a growth may take one that its request does
                    // not reach (the borrowed-behind-a-wait stamp, grow.cpp).
                    ShareRun{std::size_t{32} << 30, 24, 40, 1200},
                    ShareRun{std::size_t{32} << 30, 24, 41, 1200}),
    [](const testing::TestParamInfo<ShareRun>& p) {
      return std::to_string(p.param.capacity >> 20) + "MiB_x" + std::to_string(p.param.scale) +
             "_seed" + std::to_string(p.param.seed);
    });

}  // namespace

// ---------------------------------------------------------------------------------------
// The cycle gate (sync/cycle_gate.hpp): a free skips its poll's clock read only where the
// processor's cycle counter shows that the poll cannot be due.

namespace gate {

using ccalloc::core::cycle_count;
using ccalloc::core::CycleGate;
using Steady = std::chrono::steady_clock;

std::int64_t us_since(Steady::time_point t0) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Steady::now() - t0).count();
}

void spin_for_us(std::int64_t us) {
  const auto t0 = Steady::now();
  while (us_since(t0) < us) {
  }
}

// Calibrates a gate made just before (its first read after kCalibrationUs); its ticks.
std::uint64_t calibrated(CycleGate& g) {
  spin_for_us(CycleGate::kCalibrationUs + 1000);
  g.observe(cycle_count(), 0, 0, 0);
  return g.ticks();
}

}  // namespace gate

TEST(CycleGate, StaysShutWithoutAWallClock) {
  ccalloc::core::CycleGate g(1000, 0.9, /*on=*/false);
  gate::spin_for_us(ccalloc::core::CycleGate::kCalibrationUs + 2000);
  g.observe(ccalloc::core::cycle_count(), 20'000, 1, 0);
  EXPECT_EQ(g.ticks(), 0u);
  EXPECT_EQ(g.ticks_for(1000), 0u);
}

TEST(CycleGate, CalibratesAfterTenMillisecondsAndItsTicksFallWithinTheInterval) {
  using namespace gate;
  if (cycle_count() == 0) GTEST_SKIP() << "no cycle counter on this processor";
  const auto made = Steady::now();
  CycleGate g(1000, 0.9, /*on=*/true);
  g.observe(cycle_count(), 0, 0, 0);
  if (us_since(made) < CycleGate::kCalibrationUs) {  // (unless the test was preempted)
    EXPECT_EQ(g.ticks(), 0u) << "calibrated before kCalibrationUs";
  }
  spin_for_us(CycleGate::kCalibrationUs + 1000);
  g.observe(cycle_count(), 0, 0, 0);
  ASSERT_GT(g.ticks(), 0u);
  EXPECT_EQ(g.ticks_for(0), 0u);
  EXPECT_EQ(g.ticks_for(-5), 0u);
  EXPECT_NEAR(static_cast<double>(g.ticks_for(500)), static_cast<double>(g.ticks()) / 2,
              static_cast<double>(g.ticks()) / 100);
  // The gate's ticks take at most 90 % of the interval (1 ms): a spin until they have
  // passed lasts under the interval, and near 0.9 ms. The shortest of five spins: a busy
  // machine may preempt one, which only lengthens it.
  std::int64_t shortest = std::numeric_limits<std::int64_t>::max();
  for (int attempt = 0; attempt < 5; ++attempt) {
    const auto t0 = Steady::now();
    const std::uint64_t c0 = cycle_count();
    while (cycle_count() - c0 < g.ticks()) {
    }
    shortest = std::min(shortest, us_since(t0));
  }
  EXPECT_LT(shortest, 1000);
  EXPECT_GT(shortest, 700);
}

TEST(CycleGate, ShutsForGoodWhereTheCounterRunsSlowerThanCalibrated) {
  using namespace gate;
  if (cycle_count() == 0) GTEST_SKIP() << "no cycle counter on this processor";
  CycleGate g(1000, 0.9, /*on=*/true);
  const std::uint64_t gate_ticks = calibrated(g);
  ASSERT_GT(gate_ticks, 0u);
  // A read 1 ms after the previous one by the clock but after 10 % of that by the counter:
  // a skip could have hidden a due poll.
  g.observe(1'000'000 + gate_ticks / 9, 1000, 1'000'000, 0);
  EXPECT_TRUE(g.shut());
  EXPECT_EQ(g.ticks(), 0u);
  EXPECT_EQ(g.ticks_for(1000), 0u);
}

TEST(CycleGate, KeepsOpenWhereTheCounterKeepsItsRate) {
  using namespace gate;
  if (cycle_count() == 0) GTEST_SKIP() << "no cycle counter on this processor";
  CycleGate g(1000, 0.9, /*on=*/true);
  const std::uint64_t gate_ticks = calibrated(g);
  ASSERT_GT(gate_ticks, 0u);
  // 1 ms by the clock, the calibrated rate's ticks by the counter (gate / 0.9).
  g.observe(1'000'000 + gate_ticks * 10 / 9, 1000, 1'000'000, 0);
  EXPECT_FALSE(g.shut());
  EXPECT_EQ(g.ticks(), gate_ticks);
}

// After a counter read that found the poll not due, the next frees skip even the counter
// read: as many as fit in half the ticks left at the rate of the frees before, at most the
// cap, none where that rate is unknown or the counter went backwards.
TEST(CycleGate, FreesWithinHalfTheTicksLeftAtTheRecentRate) {
  using ccalloc::core::frees_within;
  EXPECT_EQ(frees_within(1000, 10, 3000, 16), 15u);     // 100 ticks a free: 1500 / 100
  EXPECT_EQ(frees_within(1000, 10, 100'000, 16), 16u);  // capped
  EXPECT_EQ(frees_within(1000, 10, 3000, 4), 4u);
  EXPECT_EQ(frees_within(1000, 10, 199, 16), 0u);       // less than one free's worth
  EXPECT_EQ(frees_within(1000, 1, 1'000'000, 16), 16u);
  EXPECT_EQ(frees_within(5, 10, 20, 16), 10u);          // under a tick a free: one each
  EXPECT_EQ(frees_within(1000, 0, 3000, 16), 0u);
  EXPECT_EQ(frees_within(~std::uint64_t{0} - 5, 1, 1'000'000, 16), 0u);  // went backwards
  EXPECT_EQ(frees_within(1000, 10, 3000, 0), 0u);
}

// With a wall clock the frees of a stream that shares (two streams allocate) read the clock
// a few times per poll interval instead of once each, and still poll: the fences are
// recorded as without the gate. Under Options::wall_clock the simulated GPU's clock runs in
// real time, as a wall clock does: each read is of the moment it is made. (A clock set
// before each free read stale wherever the thread was preempted between the set and the
// read, and looked to the gate like a slow counter, which shuts it: CycleGate's check.)
TEST(StitchShare, FreesReadTheClockOnlyWhereTheirPollMayBeDue) {
  using namespace gate;
  if (cycle_count() == 0) GTEST_SKIP() << "no cycle counter on this processor";
  ccalloc::sim::Options o;
  o.wall_clock = true;
  ccalloc::sim::SimDriver gpu(o);
  StitchEngine engine(gpu, Config::parse("ccalloc"));
  const auto t0 = Steady::now();
  gpu.set_time_us(1'000'000);
  // Another stream allocates: sharing begins with the loop's stream, 0.
  engine.free(engine.malloc(kMiB, 1));
  const auto pair = [&] { engine.free(engine.malloc(512, 0)); };
  // Calibration: the first poll at least kCalibrationUs after the engine was made. A thread
  // preempted after such a free's calibration read and before the loop's check may leave
  // the loop with no free past kCalibrationUs yet: it runs until one was (or a second).
  EXPECT_FALSE(engine.piece_counts().clock_gate_open);
  while (us_since(t0) < CycleGate::kCalibrationUs + 2000 ||
         (!engine.piece_counts().clock_gate_open && us_since(t0) < 1'000'000)) {
    pair();
  }
  EXPECT_TRUE(engine.piece_counts().clock_gate_open);
  EXPECT_FALSE(engine.piece_counts().clock_gate_shut);
  const std::uint64_t reads0 = gpu.clock_reads();
  const std::size_t fences0 = engine.piece_counts().fences;
  constexpr int kFrees = 20000;
  const auto start = Steady::now();
  for (int i = 0; i < kFrees; ++i)
    pair();
  const std::int64_t took_us = us_since(start);
  const std::uint64_t reads = gpu.clock_reads() - reads0;
  // Without the gate every free reads the clock at least once (kFrees). With it: a read at
  // each poll (at most one per interval, with its fence's), and a few as a poll comes due.
  EXPECT_LT(reads, static_cast<std::uint64_t>(kFrees / 4)) << took_us << " us";
  // The stream still polled and fenced: about one fence per interval it ran.
  if (took_us > 3000) {
    EXPECT_GE(engine.piece_counts().fences, fences0 + 1) << took_us << " us";
  }
  EXPECT_FALSE(engine.piece_counts().clock_gate_shut);
}

// The simulated GPU's own clock is virtual (replays): the gate never opens, and no
// decision depends on the processor's counter.
TEST(StitchShare, NoClockGateOnAVirtualClock) {
  ccalloc::sim::SimDriver gpu;
  StitchEngine engine(gpu, Config::parse("ccalloc"));
  engine.free(engine.malloc(kMiB, 1));
  gate::spin_for_us(gate::CycleGate::kCalibrationUs + 2000);
  for (int i = 0; i < 100; ++i)
    engine.free(engine.malloc(512, 0));
  EXPECT_FALSE(engine.piece_counts().clock_gate_open);
  EXPECT_FALSE(engine.piece_counts().clock_gate_shut);
}
