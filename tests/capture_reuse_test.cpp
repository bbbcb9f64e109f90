// Reuse inside a CUDA graph capture (graph_capture_record_stream_reuse,
// docs/graph-capture-reuse.md): a block freed during a capture while other captured streams
// still use it (record_stream) is free again for its stream's later allocations of the same
// capture once the capture graph orders every use before that stream's next work, and never
// before. Without the setting, or when a using stream is not in the capture, it waits for
// the capture's end as PyTorch's allocator makes it wait.
//
// The simulated GPU models the capture graph (capture_work adds a node on a stream,
// capture_join stands for an event recorded on one captured stream and waited for on
// another) and throws on any event record or query during capture, so these tests also
// prove the allocator orders reuse from the graph alone. Invariants are checked after every
// operation. Addresses are compared with the freed block's, never as constants, so each test
// runs under both presets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/stats.hpp"
#include "core/backend_access.hpp"
#include "test_support.hpp"

namespace ccalloc {
namespace {

using ccalloc_test::CapturedBlock;
using ccalloc_test::check_reuse_in_capture;
using ccalloc_test::ReuseCheck;

constexpr PoolId kGraphPool{3, 0};
constexpr std::size_t kGiB = 1024 * kMiB;

class CaptureReuse : public ::testing::TestWithParam<const char*> {
 protected:
  CaptureReuse() : driver(options()), alloc(driver, Config::parse(GetParam())) {
    alloc.set_check_invariants(true);
  }
  static sim::Options options() {
    sim::Options o;
    o.capacity = kGiB;
    return o;
  }
  void set_reuse(bool on) {
    Config c = alloc.config();
    c.graph_capture_record_stream_reuse = on;
    ASSERT_TRUE(core::reconfigure(alloc, c));
  }
  // Begins a capture on `origin` into kGraphPool as torch.cuda.graph does: every stream of
  // the same capture allocates to the pool.
  void begin(StreamId origin) {
    driver.begin_capture(origin);
    CaptureInfo info;
    ASSERT_TRUE(driver.capture_info(origin, info));
    sim::SimDriver* d = &driver;
    const std::uint64_t id = info.id;
    alloc.begin_allocate_to_pool(kGraphPool, [d, id](StreamId s) {
      CaptureInfo i;
      return d->capture_info(s, i) && i.id == id;
    });
  }
  void end(StreamId origin) {
    alloc.end_allocate_to_pool(kGraphPool);
    driver.end_capture(origin);
  }
  // A block of stream 1 that stream `reader` reads in a kernel after forking from stream 1,
  // then freed; `bytes` large.
  DevicePtr freed_after_read_on(StreamId reader, std::size_t bytes = 4096) {
    const DevicePtr a = alloc.malloc(bytes, 1);
    driver.capture_join(reader, 1);
    driver.capture_work(reader);
    alloc.record_stream(a, reader);
    alloc.free(a);
    return a;
  }
  // After the captures: empty_cache records the one deferred free's event and waits for it,
  // so nothing is active any more.
  void expect_one_event_after_the_captures() {
    alloc.empty_cache();
    EXPECT_EQ(driver.counters().event_records, 1u);
    EXPECT_EQ(alloc.stats().active[kAggregate].current, 0);
  }

  sim::SimDriver driver;
  Allocator alloc;
};

INSTANTIATE_TEST_SUITE_P(Presets, CaptureReuse, ::testing::Values("pytorch", "ccalloc"),
                         [](const auto& p) { return std::string(p.param); });

// PyTorch's own example: a block of stream 1 is read by a kernel on stream 2 and freed. Until
// stream 1 waits for stream 2 it stays taken; after the join and stream 1's next kernel the
// next request of its size gets it back.
TEST_P(CaptureReuse, ABlockIsReusedOnceItsStreamHasJoinedTheStreamThatUsedIt) {
  set_reuse(true);
  begin(1);
  const DevicePtr sink = alloc.malloc(32, 1);
  const DevicePtr data1 = alloc.malloc(32, 1);
  driver.capture_join(2, 1);
  const DevicePtr buf2 = alloc.malloc(32, 2);
  driver.capture_work(2);  // buf2 = data1 + 2
  alloc.record_stream(data1, 2);
  alloc.free(data1);
  const DevicePtr data2 = alloc.malloc(32, 1);
  EXPECT_NE(data2, data1) << "reused before stream 1 waited for stream 2";
  driver.capture_join(1, 2);
  driver.capture_work(1);  // sink.fill_(1)
  const DevicePtr data3 = alloc.malloc(32, 1);
  EXPECT_EQ(data3, data1) << "not reused after stream 1 joined stream 2";
  EXPECT_EQ(alloc.segment_pool(data3), kGraphPool);
  for (DevicePtr p : {sink, buf2, data2, data3})
    alloc.free(p);
  end(1);
  EXPECT_EQ(driver.counters().event_records, 0u);
  EXPECT_EQ(alloc.stats().allocated_bytes[kAggregate].current, 0);
}

// The join alone suffices: a stream that has captured nothing since it waited has the other
// stream's terminals as its own.
TEST_P(CaptureReuse, AJoinWithNoLaterWorkIsEnough) {
  set_reuse(true);
  begin(1);
  driver.capture_work(1);
  const DevicePtr a = freed_after_read_on(2);
  driver.capture_join(1, 2);
  const DevicePtr b = alloc.malloc(4096, 1);
  EXPECT_EQ(b, a);
  alloc.free(b);
  end(1);
}

// Without the setting (PyTorch's default) the block waits for the capture's end: its events
// are recorded at the first operation after it.
TEST_P(CaptureReuse, WithoutTheSettingTheBlockWaitsForTheCapturesEnd) {
  begin(1);
  driver.capture_work(1);
  const DevicePtr a = freed_after_read_on(2);
  driver.capture_join(1, 2);
  driver.capture_work(1);
  const DevicePtr b = alloc.malloc(4096, 1);
  EXPECT_NE(b, a);
  alloc.free(b);
  end(1);
  EXPECT_EQ(driver.counters().event_records, 0u);
  expect_one_event_after_the_captures();
}

// Every using stream must have joined: two readers, the first joined only.
TEST_P(CaptureReuse, EveryStreamThatUsedTheBlockMustHaveJoined) {
  set_reuse(true);
  begin(1);
  driver.capture_work(1);
  const DevicePtr a = alloc.malloc(1 << 20, 1);
  driver.capture_join(2, 1);
  driver.capture_join(3, 1);
  driver.capture_work(2);
  driver.capture_work(3);
  alloc.record_stream(a, 2);
  alloc.record_stream(a, 3);
  alloc.free(a);
  driver.capture_join(1, 2);
  driver.capture_work(1);
  const DevicePtr b = alloc.malloc(1 << 20, 1);
  EXPECT_NE(b, a) << "reused while stream 3 may still read it";
  driver.capture_join(1, 3);
  const DevicePtr c = alloc.malloc(1 << 20, 1);
  EXPECT_EQ(c, a);
  // Work a using stream queues after the free does not hold the block back.
  driver.capture_work(2);
  alloc.free(b);
  alloc.free(c);
  end(1);
  EXPECT_EQ(driver.counters().event_records, 0u);
}

// A stream that used the block but is not in the capture cannot be ordered by the graph:
// the block waits for the capture's end, then for its event.
TEST_P(CaptureReuse, AUsingStreamOutsideTheCaptureKeepsTheBlockUntilTheEnd) {
  set_reuse(true);
  begin(1);
  driver.capture_work(1);
  const DevicePtr a = alloc.malloc(4096, 1);
  alloc.record_stream(a, 7);  // stream 7 never joins
  alloc.free(a);
  driver.capture_work(1);
  const DevicePtr b = alloc.malloc(4096, 1);
  EXPECT_NE(b, a);
  alloc.free(b);
  end(1);
  expect_one_event_after_the_captures();
}

// A use on the legacy default stream (0), whose capture state CUDA refuses to report while
// another stream captures: the free neither fails nor loses the block, which waits for the
// capture's end; allocations on the other streams go on reusing what the graph orders.
TEST_P(CaptureReuse, AUseOnTheLegacyStreamWaitsForTheEndWithoutAnError) {
  set_reuse(true);
  begin(1);
  driver.capture_work(1);
  CaptureInfo info;
  EXPECT_THROW(driver.capture_info(0, info), DriverError);
  const DevicePtr a = alloc.malloc(4096, 1);
  alloc.record_stream(a, 0);
  alloc.free(a);
  const DevicePtr c = freed_after_read_on(2);
  driver.capture_join(1, 2);
  driver.capture_work(1);
  const DevicePtr b = alloc.malloc(4096, 1);
  EXPECT_EQ(b, c) << "the block read on stream 2 is free again";
  const DevicePtr d = alloc.malloc(4096, 1);
  EXPECT_NE(d, a) << "the block used on the legacy stream was reused during the capture";
  alloc.free(b);
  alloc.free(d);
  end(1);
  expect_one_event_after_the_captures();
}

// A block used on a stream of another capture: no graph orders both, so it waits.
TEST_P(CaptureReuse, AUseInAnotherCaptureWaitsForTheEnd) {
  set_reuse(true);
  begin(1);
  driver.begin_capture(2);  // a capture of its own
  driver.capture_work(1);
  driver.capture_work(2);
  const DevicePtr a = alloc.malloc(4096, 1);
  alloc.record_stream(a, 2);
  alloc.free(a);
  driver.capture_work(2);
  driver.capture_work(1);
  const DevicePtr b = alloc.malloc(4096, 1);
  EXPECT_NE(b, a);
  alloc.free(b);
  driver.end_capture(2);
  end(1);
  expect_one_event_after_the_captures();
}

// Nothing captured yet on any using stream: the graph orders nothing, so the block waits.
TEST_P(CaptureReuse, UsesBeforeAnyCapturedWorkAreNotOrderedByTheGraph) {
  set_reuse(true);
  begin(1);
  const DevicePtr a = alloc.malloc(4096, 1);
  driver.capture_join(2, 1);
  alloc.record_stream(a, 2);
  alloc.free(a);
  driver.capture_work(2);
  driver.capture_join(1, 2);
  driver.capture_work(1);
  const DevicePtr b = alloc.malloc(4096, 1);
  EXPECT_NE(b, a);
  alloc.free(b);
  end(1);
}

// Markers are nodes of one capture: a block deferred in a capture that has ended is not
// compared with the nodes of the next one, and gets its events at the first operation after
// the captures.
TEST_P(CaptureReuse, MarkersOfAnEndedCaptureAreNotComparedWithTheNextOnes) {
  set_reuse(true);
  begin(1);
  driver.capture_work(1);
  const DevicePtr a = freed_after_read_on(2);
  end(1);  // no operation between the two captures: the free is still deferred
  begin(1);
  driver.capture_join(2, 1);
  driver.capture_work(2);
  driver.capture_join(1, 2);
  driver.capture_work(1);
  const DevicePtr b = alloc.malloc(4096, 1);
  EXPECT_NE(b, a);
  alloc.free(b);
  end(1);
  expect_one_event_after_the_captures();
}

// A random capture on three streams that fork and join at random, with kernels that read
// blocks of other streams (record_stream). Whenever an allocation overlaps memory an earlier
// allocation of the capture had, every node that used the earlier one must be an ancestor
// of the allocating stream's terminals: the graph orders the new use after the old ones.
// The setting must also have made such reuse happen; without it no cross-stream block is
// reused inside the capture.
TEST_P(CaptureReuse, RandomCapturesNeverReuseMemoryBeforeTheGraphOrdersIt) {
  for (const bool on : {true, false}) {
    SCOPED_TRACE(on ? "reuse on" : "reuse off");
    sim::SimDriver d(options());
    Allocator a(d, Config::parse(GetParam()));
    a.set_check_invariants(true);
    Config c = a.config();
    c.graph_capture_record_stream_reuse = on;
    ASSERT_TRUE(core::reconfigure(a, c));
    std::mt19937_64 rng(on ? 7 : 8);
    const StreamId streams[] = {1, 2, 3};
    std::size_t cross_reuses = 0;
    for (int capture = 0; capture < 6; ++capture) {
      const std::uint64_t records_before = d.counters().event_records;
      d.begin_capture(1);
      CaptureInfo origin;
      ASSERT_TRUE(d.capture_info(1, origin));
      sim::SimDriver* dp = &d;
      const std::uint64_t id = origin.id;
      a.begin_allocate_to_pool(kGraphPool, [dp, id](StreamId s) {
        CaptureInfo i;
        return dp->capture_info(s, i) && i.id == id;
      });
      std::vector<CapturedBlock> live;
      std::vector<CapturedBlock> freed;
      std::set<StreamId> in_capture{1};
      for (int step = 0; step < 400; ++step) {
        const int op = static_cast<int>(rng() % 100);
        std::vector<StreamId> members(in_capture.begin(), in_capture.end());
        const StreamId s = members[rng() % members.size()];
        if (op < 30) {
          const std::size_t size = rng() % 3 == 0 ? (1 + rng() % 6) << 20 : 512 * (1 + rng() % 64);
          const DevicePtr p = a.malloc(size, s);
          const ReuseCheck r = check_reuse_in_capture(d, s, p, size, freed);
          ASSERT_EQ(r.failures, 0u);
          cross_reuses += r.cross;
          live.push_back(CapturedBlock{p, size, s, {}, false});
        } else if (op < 55 && !live.empty()) {
          // A kernel on s reads or writes some live blocks.
          const GraphNode node = d.capture_work(s);
          for (int k = 0; k < 2; ++k) {
            CapturedBlock& l = live[rng() % live.size()];
            if (l.stream != s) {
              a.record_stream(l.ptr, s);
              l.cross = true;
            }
            l.uses.push_back(node);
          }
        } else if (op < 75 && !live.empty()) {
          const std::size_t i = rng() % live.size();
          a.free(live[i].ptr);
          freed.push_back(std::move(live[i]));
          live[i] = std::move(live.back());
          live.pop_back();
        } else if (op < 95) {
          const StreamId waiter = streams[rng() % 3];
          if (waiter != s) {
            d.capture_join(waiter, s);
            in_capture.insert(waiter);
          }
        } else {
          d.capture_work(s);
        }
      }
      for (const CapturedBlock& l : live)
        a.free(l.ptr);
      a.end_allocate_to_pool(kGraphPool);
      d.end_capture(1);
      EXPECT_EQ(d.counters().event_records, records_before) << "capture " << capture;
      d.complete_all();
    }
    if (on) {
      EXPECT_GT(cross_reuses, 20u) << "the setting reused too few cross-stream blocks";
    } else {
      EXPECT_EQ(cross_reuses, 0u);
    }
  }
}

}  // namespace
}  // namespace ccalloc
