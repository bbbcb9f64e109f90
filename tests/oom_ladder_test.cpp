// The OOM ladder, free-memory callbacks, the OOM error and its observers, the per-process
// memory fraction and the age-based garbage collector, against
// docs/pytorch-behaviour.md §2.5-§2.15 and src/native/oom_ladder.cpp's ladder:
//   free list -> free-memory callbacks -> (GC) -> new segment -> release oversize blocks of
//   the stream + new segment -> wait for pending frees, release every cached segment + new
//   segment (a retry) -> free list again (ccalloc's fix of pytorch#189504) -> OOM.
//
// Every scenario runs on a small simulated GPU whose first-fit, 2 MiB-aligned addresses
// start at 0x7f0000000000, so each expected address, size and counter below is worked out
// by hand from the reference; the comments show the arithmetic.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/stats.hpp"
#include "ccalloc/trace.hpp"
#include "core/common.hpp"

namespace ccalloc::sim {
// Readable failure messages for driver counters.
void PrintTo(const Counters& c, std::ostream* os) {
  *os << "{allocate_calls=" << c.allocate_calls << " allocate_ooms=" << c.allocate_ooms
      << " free_calls=" << c.free_calls << " mem_info_calls=" << c.mem_info_calls
      << " event_creates=" << c.event_creates << " event_destroys=" << c.event_destroys
      << " event_records=" << c.event_records << " event_queries=" << c.event_queries
      << " event_synchronizes=" << c.event_synchronizes
      << " stream_synchronizes=" << c.stream_synchronizes << "}";
}
}  // namespace ccalloc::sim

namespace ccalloc {
namespace {

constexpr std::size_t kGiB = 1024 * kMiB;
constexpr DevicePtr kBase = 0x7f0000000000;

// The device address `mib` MiB above the simulated GPU's first address.
constexpr DevicePtr At(std::size_t mib) {
  return kBase + mib * kMiB;
}
constexpr std::size_t MiB(std::size_t n) {
  return n * kMiB;
}

// One trace entry without its timestamp.
struct Row {
  TraceAction action;
  DevicePtr addr;
  std::size_t size;
  StreamId stream;
  bool operator==(const Row&) const = default;
};

void PrintTo(const Row& r, std::ostream* os) {
  *os << to_string(r.action) << "(0x" << std::hex << r.addr << std::dec << ", " << r.size
      << ", stream " << r.stream << ")";
}

Row SegmentAlloc(DevicePtr addr, std::size_t size, StreamId stream = 0) {
  return {TraceAction::kSegmentAlloc, addr, size, stream};
}
Row SegmentFree(DevicePtr addr, std::size_t size, StreamId stream = 0) {
  return {TraceAction::kSegmentFree, addr, size, stream};
}
Row Alloc(DevicePtr addr, std::size_t size, StreamId stream = 0) {
  return {TraceAction::kAlloc, addr, size, stream};
}
Row FreeRequested(DevicePtr addr, std::size_t size, StreamId stream = 0) {
  return {TraceAction::kFreeRequested, addr, size, stream};
}
Row FreeCompleted(DevicePtr addr, std::size_t size, StreamId stream = 0) {
  return {TraceAction::kFreeCompleted, addr, size, stream};
}
Row Oom(std::size_t device_free, std::size_t rounded, StreamId stream = 0) {
  return {TraceAction::kOom, device_free, rounded, stream};
}

// Driver counters accumulated since `before`.
sim::Counters Since(const sim::Counters& before, const sim::Counters& now) {
  sim::Counters d;
  d.allocate_calls = now.allocate_calls - before.allocate_calls;
  d.allocate_ooms = now.allocate_ooms - before.allocate_ooms;
  d.free_calls = now.free_calls - before.free_calls;
  d.mem_info_calls = now.mem_info_calls - before.mem_info_calls;
  d.event_creates = now.event_creates - before.event_creates;
  d.event_destroys = now.event_destroys - before.event_destroys;
  d.event_records = now.event_records - before.event_records;
  d.event_queries = now.event_queries - before.event_queries;
  d.event_synchronizes = now.event_synchronizes - before.event_synchronizes;
  d.stream_synchronizes = now.stream_synchronizes - before.stream_synchronizes;
  return d;
}

sim::Options GpuOptions(std::size_t capacity, int device) {
  sim::Options o;
  o.capacity = capacity;
  o.device = device;
  return o;
}

// A simulated GPU, an allocator with invariant checks on, and the trace it emits.
class Rig {
  // Declared before the allocator, which appends to it, so that it outlives it.
  std::vector<Row> trace_;
  sim::Counters mark_;

 public:
  Rig(std::size_t capacity, std::string_view conf, int device = 0)
      : gpu(GpuOptions(capacity, device)), alloc(gpu, Config::parse(conf)) {
    alloc.set_check_invariants(true);
    alloc.add_trace_observer([this](const TraceEntry& e) {
      trace_.push_back({e.action, e.addr, e.size, e.stream});
    });
    mark();
  }

  // Starts a new step: later calls to trace() and counters() report only what follows.
  void mark() {
    trace_.clear();
    mark_ = gpu.counters();
  }
  const std::vector<Row>& trace() const { return trace_; }
  sim::Counters counters() const { return Since(mark_, gpu.counters()); }
  // Allocates and frees a 2 MiB block that fits a cached 2 MiB block exactly: one large-pool
  // search (one tick of the GC's age clock) with no device call.
  void tick() { alloc.free(alloc.malloc(MiB(2))); }

  sim::SimDriver gpu;
  Allocator alloc;
};

// The OutOfMemoryError that rig.alloc.malloc(size, stream) throws; fails the test if none.
std::string OomMessage(Rig& rig, std::size_t size, StreamId stream = 0) {
  try {
    rig.alloc.malloc(size, stream);
  } catch (const OutOfMemoryError& e) {
    return e.what();
  }
  ADD_FAILURE() << "malloc(" << size << ") did not throw OutOfMemoryError";
  return "";
}

testing::AssertionResult Contains(const std::string& text, std::string_view part) {
  if (text.find(part) != std::string::npos) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "'" << text << "' lacks '" << part << "'";
}

// ---------------------------------------------------------------------------------------
// The ladder, one rung per test

// (a) The pool has no fitting block: a new segment, and the cached segment that did not fit
// stays cached. No release, no sync, no retry.
TEST(OomLadder, NewSegmentWhenThePoolHasNoFit) {
  Rig rig(MiB(64), "pytorch");
  // 5 MiB is a 1-10 MiB request: a 20 MiB segment at the first address.
  const DevicePtr p = rig.alloc.malloc(MiB(5));
  rig.alloc.free(p);
  // 30 MiB: the cached 20 MiB block is too small; a 30 MiB segment goes above it.
  const DevicePtr q = rig.alloc.malloc(MiB(30));
  EXPECT_EQ(p, At(0));
  EXPECT_EQ(q, At(20));
  EXPECT_EQ(rig.trace(),
            (std::vector<Row>{SegmentAlloc(At(0), MiB(20)), Alloc(At(0), MiB(5)),
                              FreeRequested(At(0), MiB(5)), FreeCompleted(At(0), MiB(5)),
                              SegmentAlloc(At(20), MiB(30)), Alloc(At(20), MiB(30))}));
  sim::Counters want;
  want.allocate_calls = 2;
  EXPECT_EQ(rig.counters(), want);
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.num_device_alloc, 2);
  EXPECT_EQ(s.num_device_free, 0);
  EXPECT_EQ(s.num_alloc_retries, 0);
  EXPECT_EQ(s.num_sync_all_streams, 0);
  EXPECT_EQ(s.num_ooms, 0);
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(MiB(50)));
}

// (b) §2.12: with max_split_size set, when the device refuses the segment, the smallest
// cached oversize block of the request's stream that covers max(size, max_split_size) is
// released, then the segment is allocated (not a retry). Another stream's smaller
// oversize block is left alone.
TEST(OomLadder, ReleasesSmallestCoveringOversizeBlockOfTheSameStream) {
  Rig rig(MiB(96), "pytorch,max_split_size_mb:20");
  const DevicePtr p40 = rig.alloc.malloc(MiB(40), 0);  // [0, 40)
  const DevicePtr p22 = rig.alloc.malloc(MiB(22), 7);  // [40, 62), stream 7
  const DevicePtr p24 = rig.alloc.malloc(MiB(24), 0);  // [62, 86)
  ASSERT_EQ(p22, At(40));
  ASSERT_EQ(p24, At(62));
  for (DevicePtr p : {p40, p22, p24}) {
    rig.alloc.free(p);
  }
  rig.mark();

  // 12 MiB < max_split: the cached 24 and 40 MiB blocks are oversize and may not serve it
  // (§2.6); 86 + 12 > 96 refuses the segment. want = max(12, 20) = 20 MiB: the smallest
  // block >= 20 MiB on stream 0 is the 24 MiB one. The new 12 MiB segment lands in its hole.
  const DevicePtr q = rig.alloc.malloc(MiB(12), 0);
  EXPECT_EQ(q, At(62));
  EXPECT_EQ(rig.trace(), (std::vector<Row>{SegmentFree(At(62), MiB(24)),
                                           SegmentAlloc(At(62), MiB(12)), Alloc(At(62), MiB(12))}));
  sim::Counters want;
  want.allocate_calls = 2;
  want.allocate_ooms = 1;
  want.free_calls = 1;
  EXPECT_EQ(rig.counters(), want);
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.num_alloc_retries, 0);
  EXPECT_EQ(s.num_sync_all_streams, 0);
  EXPECT_EQ(s.num_device_free, 1);
  EXPECT_EQ(s.oversize_segments.current, 2);  // 40 MiB and stream 7's 22 MiB
}

// (b) §2.12: no single cached oversize block covers the request, so they are released from
// the largest down until the released bytes reach the request; smaller ones stay cached.
TEST(OomLadder, ReleasesLargestOversizeBlocksUntilEnough) {
  Rig rig(MiB(80), "pytorch,max_split_size_mb:20");
  const DevicePtr p20 = rig.alloc.malloc(MiB(20));  // [0, 20)
  const DevicePtr p26 = rig.alloc.malloc(MiB(26));  // [20, 46)
  const DevicePtr p28 = rig.alloc.malloc(MiB(28));  // [46, 74)
  ASSERT_EQ(p28, At(46));
  for (DevicePtr p : {p20, p26, p28}) {
    rig.alloc.free(p);
  }
  rig.mark();

  // 50 MiB: no cached block fits; 74 + 50 > 80. want = 50 MiB: release 28 (28 < 50), then
  // 26 (54 >= 50) and stop; the 20 MiB block stays. 20 + 50 <= 80: the segment goes at 20.
  const DevicePtr q = rig.alloc.malloc(MiB(50));
  EXPECT_EQ(q, At(20));
  EXPECT_EQ(rig.trace(),
            (std::vector<Row>{SegmentFree(At(46), MiB(28)), SegmentFree(At(20), MiB(26)),
                              SegmentAlloc(At(20), MiB(50)), Alloc(At(20), MiB(50))}));
  sim::Counters want;
  want.allocate_calls = 2;
  want.allocate_ooms = 1;
  want.free_calls = 2;
  EXPECT_EQ(rig.counters(), want);
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.num_alloc_retries, 0);
  EXPECT_EQ(s.num_sync_all_streams, 0);
  EXPECT_EQ(s.segment[kAggregate].current, 2);
}

// (c) §2.13: the device refuses the segment and no oversize rule helps: wait for every
// pending cross-stream free, release every whole cached segment of every stream (large
// pool first, each pool in (stream, size, address) order), then retry the segment.
TEST(OomLadder, ReleasesEverythingCachedAfterSyncingEventsThenRetries) {
  Rig rig(MiB(64), "pytorch");
  const DevicePtr a = rig.alloc.malloc(4096, 0);     // small: 2 MiB segment [0, 2)
  const DevicePtr f = rig.alloc.malloc(MiB(12), 0);  // [2, 14), stays live
  const DevicePtr b = rig.alloc.malloc(MiB(5), 0);   // 20 MiB segment [14, 34)
  const DevicePtr c = rig.alloc.malloc(MiB(10), 5);  // [34, 44), stream 5
  const DevicePtr d = rig.alloc.malloc(MiB(16), 0);  // b's 15 MiB rest is too small: [44, 60)
  ASSERT_EQ(f, At(2));
  ASSERT_EQ(b, At(14));
  ASSERT_EQ(c, At(34));
  ASSERT_EQ(d, At(44));
  rig.alloc.record_stream(c, 9);
  rig.alloc.free(c);  // pending: its event on stream 9 has not completed
  for (DevicePtr p : {a, b, d}) {
    rig.alloc.free(p);
  }
  rig.mark();

  // 22 MiB: stream 0 caches 16 and 20 MiB blocks, too small; 60 + 22 > 64.
  const DevicePtr q = rig.alloc.malloc(MiB(22), 0);
  EXPECT_EQ(q, At(14));
  EXPECT_EQ(rig.trace(), (std::vector<Row>{
                             FreeCompleted(At(34), MiB(10), 5),  // the sync frees c
                             SegmentFree(At(44), MiB(16), 0),    // large pool, stream 0, by size
                             SegmentFree(At(14), MiB(20), 0),
                             SegmentFree(At(34), MiB(10), 5),   // large pool, stream 5
                             SegmentFree(At(0), MiB(2), 0),     // small pool last
                             SegmentAlloc(At(14), MiB(22), 0),  // the retry: 12 + 22 <= 64
                             Alloc(At(14), MiB(22), 0),
                         }));
  sim::Counters want;
  want.allocate_calls = 2;
  want.allocate_ooms = 1;
  want.free_calls = 4;
  want.event_queries = 1;       // process_events at the start of malloc: not ready
  want.event_synchronizes = 1;  // synchronize_and_free_events
  EXPECT_EQ(rig.counters(), want);
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_sync_all_streams, 1);
  EXPECT_EQ(s.num_device_alloc, 6);
  EXPECT_EQ(s.num_device_free, 4);
  EXPECT_EQ(s.num_ooms, 0);
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(MiB(34)));
}

// (d) §2.14: every rung fails. The cache is emptied (the retry counts), then OOM: num_ooms
// +1 and an `oom` trace entry whose addr is the device's free bytes and whose size is the
// rounded request.
TEST(OomLadder, RaisesOutOfMemoryWhenNothingHelps) {
  Rig rig(MiB(40), "pytorch");
  rig.alloc.malloc(MiB(12));               // [0, 12)
  rig.alloc.malloc(MiB(20));               // [12, 32)
  rig.alloc.free(rig.alloc.malloc(1000));  // a cached small segment [32, 34)
  rig.mark();

  // 5 MiB - 100 rounds to 5 MiB and needs a 20 MiB segment: 34 + 20 > 40, and after the
  // small segment is released 32 + 20 > 40 still. Device free: 40 - 32 = 8 MiB.
  const std::size_t request = MiB(5) - 100;
  try {
    rig.alloc.malloc(request);
    FAIL() << "no OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.requested_bytes(), request);
    EXPECT_EQ(e.device(), 0);
  }
  EXPECT_EQ(rig.trace(), (std::vector<Row>{SegmentFree(At(32), MiB(2)), Oom(MiB(8), MiB(5))}));
  sim::Counters want;
  want.allocate_calls = 2;
  want.allocate_ooms = 2;
  want.free_calls = 1;
  want.mem_info_calls = 1;  // cudaMemGetInfo for the message
  EXPECT_EQ(rig.counters(), want);
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.num_ooms, 1);
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_sync_all_streams, 1);
  EXPECT_EQ(s.num_device_free, 1);
}

// ---------------------------------------------------------------------------------------
// Free-memory callbacks (§2.5: get_free_block || (callbacks && get_free_block))

TEST(FreeMemoryCallbacks, RunOnACacheMissBeforeANewSegment) {
  Rig rig(MiB(64), "pytorch");
  std::vector<std::uint64_t> device_allocs_seen;
  rig.alloc.add_free_memory_callback([&] {
    device_allocs_seen.push_back(rig.gpu.counters().allocate_calls);
    return false;
  });
  const DevicePtr p = rig.alloc.malloc(MiB(5));  // miss: callback, then a 20 MiB segment
  EXPECT_EQ(device_allocs_seen, std::vector<std::uint64_t>{0});
  const DevicePtr q = rig.alloc.malloc(MiB(5));  // hit in the 15 MiB remainder: no callback
  EXPECT_EQ(device_allocs_seen, std::vector<std::uint64_t>{0});
  EXPECT_EQ(p, At(0));
  EXPECT_EQ(q, At(5));
  EXPECT_EQ(rig.gpu.counters().allocate_calls, 1u);
}

TEST(FreeMemoryCallbacks, CallbackThatFreesABlockLetsMallocReuseIt) {
  Rig rig(MiB(64), "pytorch");
  DevicePtr held = rig.alloc.malloc(MiB(20));  // a whole 20 MiB segment at 0
  int calls = 0;
  rig.alloc.add_free_memory_callback([&] {
    ++calls;
    if (held == 0) return false;
    rig.alloc.free(held);
    held = 0;
    return true;
  });
  rig.mark();
  const DevicePtr q = rig.alloc.malloc(MiB(20));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(q, At(0));
  EXPECT_EQ(rig.trace(), (std::vector<Row>{FreeRequested(At(0), MiB(20)),
                                           FreeCompleted(At(0), MiB(20)), Alloc(At(0), MiB(20))}));
  EXPECT_EQ(rig.counters(), sim::Counters{});  // no device call at all
}

// §2.5: the callbacks come before the age-based GC, which comes before the new segment.
TEST(FreeMemoryCallbacks, RunBeforeGarbageCollection) {
  Rig rig(MiB(100), "pytorch,garbage_collection_threshold:0.5");  // threshold 50 MiB
  rig.alloc.malloc(MiB(30));                                      // clock 1: [0, 30)
  rig.alloc.free(rig.alloc.malloc(MiB(22)));  // clock 2: [30, 52) cached; reserved 52
  std::vector<std::size_t> trace_len_seen;
  rig.alloc.add_free_memory_callback([&] {
    trace_len_seen.push_back(rig.trace().size());
    return false;
  });
  rig.mark();
  // clock 3: miss; callbacks; GC (52 > 50: the 22 MiB block, age 1, goes); new segment.
  const DevicePtr q = rig.alloc.malloc(MiB(24));
  EXPECT_EQ(q, At(30));
  EXPECT_EQ(trace_len_seen, std::vector<std::size_t>{0});
  EXPECT_EQ(rig.trace(), (std::vector<Row>{SegmentFree(At(30), MiB(22)),
                                           SegmentAlloc(At(30), MiB(24)), Alloc(At(30), MiB(24))}));
}

// The pool is searched again only when a callback reports that it freed something.
TEST(FreeMemoryCallbacks, CallbackReportingNothingFreedLeadsToANewSegment) {
  Rig rig(MiB(64), "pytorch");
  DevicePtr held = rig.alloc.malloc(MiB(20));
  rig.alloc.add_free_memory_callback([&] {
    if (held != 0) rig.alloc.free(held);
    held = 0;
    return false;
  });
  rig.mark();
  const DevicePtr q = rig.alloc.malloc(MiB(20));
  EXPECT_EQ(q, At(20));
  EXPECT_EQ(rig.trace(),
            (std::vector<Row>{FreeRequested(At(0), MiB(20)), FreeCompleted(At(0), MiB(20)),
                              SegmentAlloc(At(20), MiB(20)), Alloc(At(20), MiB(20))}));
}

// ---------------------------------------------------------------------------------------
// pytorch/pytorch#189504

// A freed block waits for an event on another stream. The device has no room for a new
// segment; the release-everything rung syncs the event, which puts the block back in its
// pool, but the block's segment also holds live blocks so it is not released and the retry
// fails. PyTorch raises OOM here; ccalloc searches the pool once more and serves it.
TEST(Issue189504, ReturnsFreeBlockAfterEventsSyncOnOom_Issue189504) {
  Rig rig(MiB(20), "pytorch");
  const DevicePtr a = rig.alloc.malloc(MiB(4));  // 20 MiB segment: [0, 4) + 16 MiB free
  const DevicePtr b = rig.alloc.malloc(MiB(8));  // [4, 12) + 8 MiB free
  const DevicePtr c = rig.alloc.malloc(MiB(8));  // [12, 20): the segment is full
  ASSERT_EQ(a, At(0));
  ASSERT_EQ(b, At(4));
  ASSERT_EQ(c, At(12));
  rig.alloc.record_stream(b, 3);
  rig.alloc.free(b);
  rig.mark();

  // 6 MiB fits b's 8 MiB; a new 20 MiB segment does not fit the device (twice).
  const DevicePtr q = rig.alloc.malloc(MiB(6));
  EXPECT_EQ(q, At(4));
  EXPECT_EQ(rig.trace(), (std::vector<Row>{FreeCompleted(At(4), MiB(8)), Alloc(At(4), MiB(6))}));
  sim::Counters want;
  want.allocate_calls = 2;
  want.allocate_ooms = 2;
  want.event_queries = 1;
  want.event_synchronizes = 1;
  EXPECT_EQ(rig.counters(), want);
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.num_ooms, 0);
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_sync_all_streams, 1);
  // 8 - 6 = 2 MiB > 1 MiB: split off, a free block inside a split segment.
  EXPECT_EQ(s.inactive_split_bytes[kAggregate].current, static_cast<std::int64_t>(MiB(2)));
}

// ---------------------------------------------------------------------------------------
// After an OOM

TEST(OomRecovery, AllocatorStaysConsistentAndUsable) {
  Rig rig(MiB(40), "pytorch");
  const DevicePtr f = rig.alloc.malloc(MiB(12));             // [0, 12)
  const DevicePtr g = rig.alloc.malloc(MiB(20));             // [12, 32)
  EXPECT_THROW(rig.alloc.malloc(MiB(5)), OutOfMemoryError);  // needs 20 MiB, 8 MiB free
  EXPECT_NO_THROW(rig.alloc.check_invariants());
  {
    const DeviceStats s = rig.alloc.stats();
    EXPECT_EQ(s.allocated_bytes[kAggregate].current, static_cast<std::int64_t>(MiB(32)));
    EXPECT_EQ(s.allocation[kAggregate].current, 2);
    EXPECT_EQ(s.active[kAggregate].current, 2);
    EXPECT_EQ(s.requested_bytes[kAggregate].current, static_cast<std::int64_t>(MiB(32)));
  }

  rig.alloc.free(g);  // its whole 20 MiB segment is cached
  rig.mark();
  const DevicePtr r = rig.alloc.malloc(MiB(5));  // served from g's segment, split
  EXPECT_EQ(r, At(12));
  EXPECT_EQ(rig.counters(), sim::Counters{});
  EXPECT_NO_THROW(rig.alloc.check_invariants());

  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.num_ooms, 1);
  EXPECT_EQ(s.allocated_bytes[kAggregate].current, static_cast<std::int64_t>(MiB(17)));
  EXPECT_EQ(s.allocation[kAggregate].current, 2);
  EXPECT_EQ(s.segment[kAggregate].current, 2);
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(rig.gpu.used_bytes()));
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(MiB(32)));
  EXPECT_EQ(s.inactive_split_bytes[kAggregate].current, static_cast<std::int64_t>(MiB(15)));
  rig.alloc.free(f);
  rig.alloc.free(r);
  EXPECT_EQ(rig.alloc.stats().allocated_bytes[kAggregate].current, 0);
}

// ---------------------------------------------------------------------------------------
// The message (docs/design.md#errors-and-bad-input: request, capacity, free, allocated vs
// reserved but unallocated, largest free block, the config that would help)

// "Tried to allocate" states the request, not the 20 MiB segment PyTorch reports (§7).
TEST(OomMessage, StatesTheRequestedSizeNotTheSegmentSize) {
  Rig rig(MiB(40), "pytorch");
  rig.alloc.malloc(MiB(30));
  const std::string m = OomMessage(rig, MiB(5));  // would need a 20 MiB segment
  EXPECT_TRUE(Contains(m, "Tried to allocate 5.00 MiB"));
  EXPECT_FALSE(Contains(m, "Tried to allocate 20.00 MiB"));
}

TEST(OomMessage, StatesRequestCapacityAndFreeMemoryInFormatSize) {
  Rig rig(4 * kGiB, "pytorch");
  rig.alloc.malloc(2 * kGiB);
  const std::string m = OomMessage(rig, 3 * kGiB);
  EXPECT_TRUE(Contains(m, "Tried to allocate 3.00 GiB"));
  EXPECT_TRUE(Contains(m, "4.00 GiB"));  // capacity
  EXPECT_TRUE(Contains(m, "2.00 GiB"));  // free
}

// Free memory in a partly used segment that no single request fits: fragmentation, so the
// message suggests expandable segments (and says nothing about a fraction, none is set).
TEST(OomMessage, FragmentationSuggestsExpandableSegments) {
  Rig rig(MiB(60), "pytorch");
  rig.alloc.free(rig.alloc.malloc(MiB(48)));       // one cached 48 MiB segment
  const DevicePtr q1 = rig.alloc.malloc(MiB(14));  // [0, 14)
  rig.alloc.malloc(MiB(10));                       // [14, 24)
  const DevicePtr q3 = rig.alloc.malloc(MiB(14));  // [24, 38)
  rig.alloc.malloc(MiB(10));                       // [38, 48)
  rig.alloc.free(q1);
  rig.alloc.free(q3);
  // Reserved 48, allocated 20, unallocated 28 in two 14 MiB holes; device free 12 MiB.
  const std::string m = OomMessage(rig, MiB(22));
  EXPECT_TRUE(Contains(m, "Tried to allocate 22.00 MiB"));
  EXPECT_TRUE(Contains(m, "60.00 MiB"));  // capacity
  EXPECT_TRUE(Contains(m, "12.00 MiB"));  // free on the device
  EXPECT_TRUE(Contains(m, "20.00 MiB"));  // allocated
  EXPECT_TRUE(Contains(m, "28.00 MiB"));  // reserved but unallocated
  EXPECT_TRUE(Contains(m, "reserved but unallocated"));
  EXPECT_LT(m.find("28.00 MiB"), m.find("reserved but unallocated"));
  EXPECT_TRUE(Contains(m, "largest free block"));
  EXPECT_TRUE(Contains(m, "14.00 MiB"));
  EXPECT_TRUE(Contains(m, "expandable_segments:True"));
  EXPECT_FALSE(Contains(m, "per_process_memory_fraction"));
}

// The device has room but the fraction refused the segment: the advice is about the
// fraction, not about fragmentation.
TEST(OomMessage, FractionRefusalAdvisesTheFraction) {
  Rig rig(MiB(100), "pytorch,per_process_memory_fraction:0.5");  // 50 MiB allowed
  rig.alloc.malloc(MiB(40));
  const std::string m = OomMessage(rig, MiB(20));  // 40 + 20 > 50; the device has 60 free
  EXPECT_TRUE(Contains(m, "Tried to allocate 20.00 MiB"));
  EXPECT_TRUE(Contains(m, "100.00 MiB"));  // capacity
  EXPECT_TRUE(Contains(m, "60.00 MiB"));   // free
  EXPECT_TRUE(Contains(m, "50.00 MiB"));   // allowed
  EXPECT_TRUE(Contains(m, "per_process_memory_fraction"));
  // PyTorch's words always end with its hint; ccalloc's explanation after them does not
  // suggest expandable segments here.
  const std::string ours = m.substr(m.find(" The request: "));
  EXPECT_FALSE(Contains(ours, "expandable_segments:True")) << ours;
}

// PyTorch's message word for word (tools and PyTorch's own tests match it), with the
// request for "Tried to allocate" (§7), then ccalloc's explanation.
TEST(OomMessage, OpensWithPytorchsMessageWordForWord) {
  Rig rig(MiB(100), "pytorch,per_process_memory_fraction:0.5");  // 50 MiB allowed
  rig.alloc.malloc(MiB(40));
  const std::string m = OomMessage(rig, MiB(20));
  const std::string pytorch =
      "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 100.00 MiB "
      "of which 60.00 MiB is free. Including non-PyTorch memory, this process has 40.00 MiB "
      "memory in use. 50.00 MiB allowed; Of the allocated memory 40.00 MiB is allocated by "
      "PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but "
      "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
      "to avoid fragmentation.  See documentation for Memory Management  "
      "(https://docs.pytorch.org/docs/stable/notes/cuda.html"
      "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf) The request: 20971520 bytes on "
      "stream 0";
  EXPECT_EQ(m.substr(0, pytorch.size()), pytorch) << m;
}

// Another process on the device is named before this one, as NVML lists them.
TEST(OomMessage, NamesTheProcessesThatHoldMemoryOnTheDevice) {
  ccalloc::core::PytorchOomFigures f;
  f.requested = MiB(3);
  f.capacity = MiB(100);
  f.device_free = MiB(1);
  f.processes = {{4242, MiB(30)}, {static_cast<long>(::getpid()), MiB(69)}};
  f.allocated = MiB(50);
  f.private_pools = MiB(4);
  f.reserved = MiB(60);
  const std::string m = ccalloc::core::pytorch_oom_text(f);
  // (1 MiB reads as 1024.00 KiB, as PyTorch's format_size writes it.)
  EXPECT_TRUE(Contains(m, "of which 1024.00 KiB is free. Process 4242 has 30.00 MiB memory in use. "
                          "Including non-PyTorch memory, this process has 69.00 MiB memory in "
                          "use. Of the allocated memory 54.00 MiB is allocated by PyTorch, with "
                          "4.00 MiB allocated in private pools (e.g., CUDA Graphs), and 6.00 MiB "
                          "is reserved by PyTorch but unallocated."))
      << m;
}

// ---------------------------------------------------------------------------------------
// OOM observers (§2.14 step 5): (device, requested bytes, limit, device free), before the
// throw, after num_ooms and the oom trace entry. PyTorch passes the segment size where
// ccalloc's Allocator::OomObserver passes the bytes the program asked for.

TEST(OomObservers, ReceiveDeviceRequestCapacityAndFreeBeforeTheThrow) {
  Rig rig(MiB(40), "pytorch", /*device=*/2);
  rig.alloc.malloc(MiB(30));
  using Call = std::tuple<int, std::size_t, std::size_t, std::size_t>;
  std::vector<std::string> order;
  std::vector<Call> calls;
  std::int64_t ooms_seen = -1;
  std::size_t trace_len_seen = 0;
  rig.alloc.add_oom_observer(
      [&](int dev, std::size_t req, std::size_t limit, std::size_t device_free) {
        order.push_back("first");
        calls.emplace_back(dev, req, limit, device_free);
        ooms_seen = rig.alloc.stats().num_ooms;  // called without allocator locks held
        trace_len_seen = rig.trace().size();
      });
  rig.alloc.add_oom_observer(
      [&](int, std::size_t, std::size_t, std::size_t) { order.push_back("second"); });
  rig.mark();
  // 15 MiB - 7 rounds to 15 MiB, a 16 MiB segment; 30 + 16 > 40; 10 MiB free.
  const std::size_t request = MiB(15) - 7;
  try {
    rig.alloc.malloc(request);
  } catch (const OutOfMemoryError& e) {
    order.push_back("caught");
    EXPECT_EQ(e.device(), 2);
    EXPECT_EQ(e.requested_bytes(), request);
  }
  EXPECT_EQ(order, (std::vector<std::string>{"first", "second", "caught"}));
  EXPECT_EQ(calls, (std::vector<Call>{{2, request, MiB(40), MiB(10)}}));
  EXPECT_EQ(ooms_seen, 1);
  EXPECT_EQ(trace_len_seen, 1u);
  EXPECT_EQ(rig.trace(), (std::vector<Row>{Oom(MiB(10), MiB(15))}));
}

TEST(OomObservers, LimitIsTheFractionOfCapacityWhenOneIsSet) {
  Rig rig(MiB(40), "pytorch,per_process_memory_fraction:0.5", /*device=*/2);  // 20 MiB
  rig.alloc.malloc(MiB(16));
  using Call = std::tuple<int, std::size_t, std::size_t, std::size_t>;
  std::vector<Call> calls;
  rig.alloc.add_oom_observer(
      [&](int dev, std::size_t req, std::size_t limit, std::size_t device_free) {
        calls.emplace_back(dev, req, limit, device_free);
      });
  // 4 MiB needs a 20 MiB segment: 16 + 20 > 20. The device still has 24 MiB free.
  EXPECT_THROW(rig.alloc.malloc(MiB(4)), OutOfMemoryError);
  EXPECT_EQ(calls, (std::vector<Call>{{2, MiB(4), MiB(20), MiB(24)}}));
}

// ---------------------------------------------------------------------------------------
// per_process_memory_fraction (§2.15): limit = floor(fraction x capacity) on RESERVED bytes,
// checked before the device is asked.

TEST(MemoryFraction, ConfigKeyCapsReservedBytesWhileTheDeviceHasRoom) {
  Rig rig(MiB(100), "pytorch,per_process_memory_fraction:0.25");  // 25 MiB
  EXPECT_EQ(rig.alloc.memory_fraction(), 0.25);
  rig.alloc.malloc(MiB(24));  // 24 <= 25
  // A small request needs a 2 MiB segment: 24 + 2 > 25, although 76 MiB are free.
  EXPECT_THROW(rig.alloc.malloc(512), OutOfMemoryError);
  EXPECT_EQ(rig.alloc.mem_get_info().free_bytes, MiB(76));
  sim::Counters want;
  want.allocate_calls = 1;  // the refused segments never reached the device
  want.mem_info_calls = 2;  // the OOM message and mem_get_info
  EXPECT_EQ(rig.counters(), want);
  EXPECT_EQ(rig.alloc.stats().num_ooms, 1);
}

TEST(MemoryFraction, LimitIsTheFloorOfFractionTimesCapacity) {
  Rig rig(MiB(64) + 1, "pytorch");
  rig.alloc.set_memory_fraction(0.5);  // 0.5 x (64 MiB + 1) = 32 MiB + 0.5 -> 32 MiB
  EXPECT_EQ(rig.alloc.memory_fraction(), 0.5);
  std::size_t limit_seen = 0;
  rig.alloc.add_oom_observer(
      [&](int, std::size_t, std::size_t limit, std::size_t) { limit_seen = limit; });
  EXPECT_NO_THROW(rig.alloc.malloc(MiB(32)));  // exactly at the limit
  EXPECT_THROW(rig.alloc.malloc(512), OutOfMemoryError);
  EXPECT_EQ(limit_seen, MiB(32));
}

// Cached (reserved, unallocated) segments count against the limit: the first attempt is
// refused although nothing is allocated; releasing the cache makes the retry fit.
TEST(MemoryFraction, CachedSegmentsCountAgainstTheLimit) {
  Rig rig(MiB(100), "pytorch,per_process_memory_fraction:0.25");  // 25 MiB
  rig.alloc.free(rig.alloc.malloc(MiB(20)));
  rig.mark();
  // 22 MiB: the cached 20 MiB block is too small; 20 + 22 > 25 refused; release it; 22 <= 25.
  const DevicePtr q = rig.alloc.malloc(MiB(22));
  EXPECT_EQ(q, At(0));
  EXPECT_EQ(rig.trace(), (std::vector<Row>{SegmentFree(At(0), MiB(20)),
                                           SegmentAlloc(At(0), MiB(22)), Alloc(At(0), MiB(22))}));
  sim::Counters want;
  want.allocate_calls = 1;
  want.free_calls = 1;
  EXPECT_EQ(rig.counters(), want);
  EXPECT_EQ(rig.alloc.stats().num_alloc_retries, 1);
  EXPECT_EQ(rig.alloc.stats().num_sync_all_streams, 1);
}

TEST(MemoryFraction, ZeroRefusesEveryNewSegment) {
  Rig rig(MiB(64), "pytorch,per_process_memory_fraction:0");
  EXPECT_EQ(rig.alloc.memory_fraction(), 0.0);
  EXPECT_THROW(rig.alloc.malloc(1), OutOfMemoryError);
  EXPECT_EQ(rig.gpu.counters().allocate_calls, 0u);
  EXPECT_EQ(rig.alloc.stats().num_ooms, 1);
}

TEST(MemoryFraction, OneMeansNoCap) {
  Rig rig(MiB(64), "pytorch,per_process_memory_fraction:1");
  EXPECT_EQ(rig.alloc.memory_fraction(), 1.0);
  const DevicePtr p = rig.alloc.malloc(MiB(64));  // the whole device
  EXPECT_EQ(p, At(0));
  rig.alloc.free(p);
  rig.alloc.empty_cache();

  rig.alloc.set_memory_fraction(0.5);
  EXPECT_THROW(rig.alloc.malloc(MiB(64)), OutOfMemoryError);
  rig.alloc.set_memory_fraction(1.0);  // removes the cap again
  EXPECT_EQ(rig.alloc.memory_fraction(), 1.0);
  EXPECT_EQ(rig.alloc.malloc(MiB(64)), At(0));
}

TEST(MemoryFraction, OutOfRangeValuesAreConfigErrors) {
  EXPECT_THROW(Config::parse("pytorch,per_process_memory_fraction:-0.1"), ConfigError);
  EXPECT_THROW(Config::parse("pytorch,per_process_memory_fraction:1.1"), ConfigError);
  Rig rig(MiB(64), "pytorch,per_process_memory_fraction:0.5");
  EXPECT_THROW(rig.alloc.set_memory_fraction(-0.1), ConfigError);
  EXPECT_THROW(rig.alloc.set_memory_fraction(1.1), ConfigError);
  EXPECT_THROW(rig.alloc.set_memory_fraction(std::numeric_limits<double>::quiet_NaN()),
               ConfigError);
  EXPECT_EQ(rig.alloc.memory_fraction(), 0.5);  // unchanged
}

// §2.15: the fraction gates new segments only. Lowering it below what is already reserved
// is allowed (PyTorch just sets allowed_memory_maximum); existing segments stay usable and
// only new segments are refused.
TEST(MemoryFraction, LoweringBelowReservedKeepsExistingSegments) {
  Rig rig(MiB(100), "pytorch");
  const DevicePtr p = rig.alloc.malloc(MiB(40));
  EXPECT_NO_THROW(rig.alloc.set_memory_fraction(0.25));  // 25 MiB < 40 MiB reserved
  EXPECT_NO_THROW(rig.alloc.free(p));
  DevicePtr q = 0;
  EXPECT_NO_THROW(q = rig.alloc.malloc(MiB(40)));  // the cached segment, no new one
  EXPECT_EQ(q, At(0));
  EXPECT_THROW(rig.alloc.malloc(MiB(12)), OutOfMemoryError);  // 40 + 12 > 25
  EXPECT_EQ(rig.gpu.counters().allocate_calls, 1u);
}

// ---------------------------------------------------------------------------------------
// garbage_collection_threshold (§2.6 age clock, §2.11). The age of a cached block is the
// number of large-pool searches (one per malloc of a large size) since it became free.

// Without a fraction the limit is the device capacity (PyTorch's GC silently needs a
// fraction, pytorch#106660). Candidate ages 5, 5, 1: the average is 11/3, so both blocks of
// age 5 go, although the first alone already reaches the target: a pass does not stop at
// the target. The oldest cached block of all (age 8) sits in a split segment and the small
// pool holds a cached segment too: neither is collected. GC runs before the new segment,
// although the device has room for it.
TEST(GarbageCollection, WorksWithoutAFractionAndFreesEveryOldBlockInAPass_Issue106660) {
  Rig rig(MiB(160), "pytorch,garbage_collection_threshold:0.5");  // threshold 80 MiB
  rig.alloc.free(rig.alloc.malloc(MiB(1)));  // a cached small segment [0, 2); no tick
  rig.alloc.malloc(MiB(9));                  // clock 1: a 20 MiB segment [2, 22)
  rig.alloc.malloc(MiB(9));                  // clock 2: [11, 20); the 2 MiB tick block [20, 22)
  rig.alloc.malloc(MiB(9));  // clock 3: a 20 MiB segment [22, 42); 11 MiB free [31, 42), base 3
  const DevicePtr a = rig.alloc.malloc(MiB(12));  // clock 4: [42, 54)
  const DevicePtr b = rig.alloc.malloc(MiB(14));  // clock 5: [54, 68)
  const DevicePtr c = rig.alloc.malloc(MiB(16));  // clock 6: [68, 84); reserved 84
  ASSERT_EQ(c, At(68));
  rig.alloc.free(a);  // base 6
  rig.alloc.free(b);  // base 6
  for (int i = 0; i < 4; ++i) {
    rig.tick();  // clocks 7 to 10
  }
  rig.alloc.free(c);  // base 10
  rig.mark();

  // clock 11; miss (18 MiB fits no cached block); reserved 84 > 80, target 4 MiB.
  // Candidates (whole large segments): a age 5, b age 5, c age 1. The split 11 MiB block
  // (age 8) and the 2 MiB tick block are not candidates.
  const DevicePtr d = rig.alloc.malloc(MiB(18));
  EXPECT_EQ(d, At(42));
  EXPECT_EQ(rig.trace(),
            (std::vector<Row>{SegmentFree(At(42), MiB(12)), SegmentFree(At(54), MiB(14)),
                              SegmentAlloc(At(42), MiB(18)), Alloc(At(42), MiB(18))}));
  sim::Counters want;
  want.allocate_calls = 1;
  want.free_calls = 2;
  EXPECT_EQ(rig.counters(), want);
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.num_alloc_retries, 0);
  EXPECT_EQ(s.num_sync_all_streams, 0);
  EXPECT_EQ(s.segment[kAggregate].current, 5);  // small, two split, c, d
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(MiB(76)));
}

// With a fraction the limit is fraction x capacity. Ages 6, 2, 1, target 16 MiB: the first
// pass (average 3) frees only the 10 MiB block; short of the target, a second pass over
// the rest (average 3/2) frees the 12 MiB block; 22 >= 16 stops it.
TEST(GarbageCollection, WithAFractionRepeatsPassesUntilTheTarget) {
  // limit 0.8 x 100 MiB = 80 MiB; threshold 0.5 x 80 = 40 MiB.
  Rig rig(MiB(100), "pytorch,per_process_memory_fraction:0.8,garbage_collection_threshold:0.5");
  rig.alloc.malloc(MiB(9));                       // clock 1: 20 MiB segment [0, 20)
  rig.alloc.malloc(MiB(9));                       // clock 2: 2 MiB free at [18, 20)
  const DevicePtr a = rig.alloc.malloc(MiB(10));  // clock 3: [20, 30)
  const DevicePtr b = rig.alloc.malloc(MiB(12));  // clock 4: [30, 42)
  const DevicePtr c = rig.alloc.malloc(MiB(14));  // clock 5: [42, 56); GC finds no candidate
  ASSERT_EQ(c, At(42));
  rig.alloc.free(a);  // base 5
  for (int i = 0; i < 4; ++i) {
    rig.tick();  // clocks 6 to 9
  }
  rig.alloc.free(b);  // base 9
  rig.tick();         // clock 10
  rig.alloc.free(c);  // base 10
  rig.mark();

  // clock 11; reserved 56 > 40, target 16. Ages: a 6, b 2, c 1.
  const DevicePtr d = rig.alloc.malloc(MiB(16));
  EXPECT_EQ(d, At(20));
  EXPECT_EQ(rig.trace(),
            (std::vector<Row>{SegmentFree(At(20), MiB(10)), SegmentFree(At(30), MiB(12)),
                              SegmentAlloc(At(20), MiB(16)), Alloc(At(20), MiB(16))}));
  sim::Counters want;
  want.allocate_calls = 1;
  want.free_calls = 2;
  EXPECT_EQ(rig.counters(), want);
}

// §2.5 runs the GC on any miss, §2.11 collects only the large pool, and §2.6 keeps one age
// clock per pool: a small-pool miss collects a large segment whose clock has not moved since
// it was freed (age 0 >= average 0).
TEST(GarbageCollection, SmallPoolMissCollectsLargeSegments) {
  Rig rig(MiB(100), "pytorch,garbage_collection_threshold:0.5");  // threshold 50 MiB
  rig.alloc.malloc(MiB(30));                                      // large clock 1: [0, 30)
  rig.alloc.free(rig.alloc.malloc(MiB(22)));  // large clock 2: [30, 52) cached, base 2
  rig.mark();
  // A small request: its pool is empty, a miss. Reserved 52 > 50, target 2 MiB.
  const DevicePtr q = rig.alloc.malloc(1000);
  EXPECT_EQ(q, At(30));
  EXPECT_EQ(rig.trace(), (std::vector<Row>{SegmentFree(At(30), MiB(22)),
                                           SegmentAlloc(At(30), MiB(2)), Alloc(At(30), 1000)}));
}

// §2.11: `if total_allocated_memory <= gc_threshold: return`. At exactly the threshold the
// old cached block survives the miss.
TEST(GarbageCollection, NothingIsCollectedAtTheThreshold) {
  Rig rig(MiB(100), "pytorch,garbage_collection_threshold:0.5");  // 50 MiB
  rig.alloc.malloc(MiB(30));                                      // clock 1: [0, 30)
  rig.alloc.free(rig.alloc.malloc(MiB(20)));  // clock 2: [30, 50), cached; reserved 50
  rig.mark();
  // clock 3: miss; reserved 50 <= 50, so the 20 MiB block (age 1, the only candidate) stays.
  const DevicePtr q = rig.alloc.malloc(MiB(22));
  EXPECT_EQ(q, At(50));
  EXPECT_EQ(rig.trace(), (std::vector<Row>{SegmentAlloc(At(50), MiB(22)), Alloc(At(50), MiB(22))}));
}

// Just above the threshold the same block is collected before the new segment.
TEST(GarbageCollection, AboveTheThresholdTheOnlyCandidateIsCollected) {
  Rig rig(MiB(100), "pytorch,garbage_collection_threshold:0.5");  // 50 MiB
  rig.alloc.malloc(MiB(32));                                      // clock 1: [0, 32)
  rig.alloc.free(rig.alloc.malloc(MiB(20)));  // clock 2: [32, 52), cached; reserved 52
  rig.mark();
  // clock 3: reserved 52 > 50; one candidate, age 1 >= average 1: released first.
  const DevicePtr q = rig.alloc.malloc(MiB(22));
  EXPECT_EQ(q, At(32));
  EXPECT_EQ(rig.trace(), (std::vector<Row>{SegmentFree(At(32), MiB(20)),
                                           SegmentAlloc(At(32), MiB(22)), Alloc(At(32), MiB(22))}));
}

}  // namespace
}  // namespace ccalloc
