// backend:cudaMallocAsync on the simulated GPU (src/async/backend.hpp; PyTorch's
// CUDAMallocAsyncAllocator, docs/pytorch-behaviour.md §2.18).
#include "async/backend.hpp"
#include "core/backend_access.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"
#include "test_support.hpp"

namespace ccalloc {
namespace {

using ccalloc_test::message_of;

constexpr std::size_t kGiB = 1024 * kMiB;
constexpr DevicePtr kPool = DevicePtr{0x400000000000};  // the simulated pool's first address
constexpr StreamId kS1 = 1;
constexpr StreamId kS2 = 2;
constexpr StreamId kS3 = 3;

sim::Options with_capacity(std::size_t capacity) {
  sim::Options o;
  o.capacity = capacity;
  return o;
}

struct Rig {
  explicit Rig(std::size_t capacity = kGiB, const char* conf = "backend:cudaMallocAsync")
      : gpu(with_capacity(capacity)), alloc(gpu, Config::parse(conf)) {
    alloc.set_check_invariants(true);
  }
  sim::SimDriver gpu;
  Allocator alloc;
};

TEST(AsyncBackend, TheConfigSelectsIt) {
  Rig rig;
  EXPECT_NE(dynamic_cast<core::AsyncBackend*>(&core::BackendAccess::of(rig.alloc)), nullptr);
  Rig native(kGiB, "");
  EXPECT_EQ(dynamic_cast<core::AsyncBackend*>(&core::BackendAccess::of(native.alloc)), nullptr);
}

TEST(AsyncBackend, MallocAndFreeGoToTheStreamOrderedPool) {
  Rig rig;
  const DevicePtr p = rig.alloc.malloc(1000, kS1);
  EXPECT_EQ(p, kPool);
  EXPECT_EQ(rig.alloc.allocation_size(p), 1000u);  // as requested: the pool's rounding is hidden
  rig.alloc.free(p);
  const sim::Counters c = rig.gpu.counters();
  EXPECT_EQ(c.async_allocates, 1u);
  EXPECT_EQ(c.async_frees, 1u);
  EXPECT_EQ(c.allocate_calls, 0u);  // never cudaMalloc
  EXPECT_EQ(c.event_records, 0u);   // no other stream used it
  EXPECT_EQ(rig.alloc.allocation_size(p), 0u);
  EXPECT_TRUE(rig.alloc.segments().empty());
}

TEST(AsyncBackend, MallocOfZeroBytesReturnsNullWithoutADriverCall) {
  Rig rig;
  EXPECT_EQ(rig.alloc.malloc(0, kS1), 0u);
  rig.alloc.free(0);
  EXPECT_EQ(rig.gpu.counters().async_allocates, 0u);
}

TEST(AsyncBackend, FreedMemoryIsReusedByItsStreamAtOnceAndByOthersOnceTheFreeCompletes) {
  Rig rig;
  const DevicePtr p = rig.alloc.malloc(4 * kMiB, kS1);
  rig.alloc.free(p);
  EXPECT_EQ(rig.alloc.malloc(4 * kMiB, kS1), p);
  rig.alloc.free(p);
  const DevicePtr q = rig.alloc.malloc(4 * kMiB, kS2);
  EXPECT_EQ(q, p + 4 * kMiB);
  rig.gpu.complete_stream(kS1);
  EXPECT_EQ(rig.alloc.malloc(4 * kMiB, kS3), p);
}

TEST(AsyncBackend, FreeingAfterRecordStreamMakesTheCreationStreamWaitForTheUsers) {
  Rig rig;
  const DevicePtr p = rig.alloc.malloc(4 * kMiB, kS1);
  rig.alloc.record_stream(p, kS2);
  rig.alloc.record_stream(p, kS2);  // once is enough
  rig.alloc.record_stream(p, kS1);  // its own stream orders itself
  rig.alloc.free(p);
  sim::Counters c = rig.gpu.counters();
  EXPECT_EQ(c.event_creates, 1u);
  EXPECT_EQ(c.event_records, 1u);  // on kS2 only
  EXPECT_EQ(c.stream_waits, 1u);   // kS1 waits for it
  EXPECT_EQ(c.async_frees, 1u);
  // Freed on kS1, after kS2's work: kS1 reuses it at once, kS2 only once kS1 gets there.
  EXPECT_EQ(rig.alloc.malloc(4 * kMiB, kS1), p);
  rig.alloc.free(p);
  EXPECT_EQ(rig.alloc.malloc(4 * kMiB, kS2), p + 4 * kMiB);
  rig.gpu.complete_stream(kS1);
  EXPECT_EQ(rig.alloc.malloc(4 * kMiB, kS3), p);
}

TEST(AsyncBackend, CrossStreamFreesReuseOneEvent) {
  Rig rig;
  for (int i = 0; i < 3; ++i) {
    const DevicePtr p = rig.alloc.malloc(kMiB, kS1);
    rig.alloc.record_stream(p, kS2);
    rig.alloc.record_stream(p, kS3);
    rig.alloc.free(p);
  }
  const sim::Counters c = rig.gpu.counters();
  EXPECT_EQ(c.event_creates, 1u);
  EXPECT_EQ(c.event_records, 6u);
  EXPECT_EQ(c.stream_waits, 6u);
}

TEST(AsyncBackend, UnknownPointersAreErrorsNamingThePointer) {
  Rig rig;
  const DevicePtr p = rig.alloc.malloc(1000, kS1);
  try {
    rig.alloc.free(p + 512);
    ADD_FAILURE() << "expected InvalidPointerError";
  } catch (const InvalidPointerError& e) {
    EXPECT_EQ(e.ptr(), p + 512);
    EXPECT_NE(std::string(e.what()).find("free of pointer 0x400000000200 on device 0"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(rig.alloc.record_stream(p + 512, kS2), InvalidPointerError);
  rig.alloc.free(p);
  EXPECT_THROW(rig.alloc.free(p), InvalidPointerError);
}

TEST(AsyncBackend, TheMemoryFractionCapsBytesHandedOutWithPyTorchsMessage) {
  Rig rig;
  rig.alloc.set_memory_fraction(0.5);
  EXPECT_EQ(rig.alloc.memory_fraction(), 0.5);
  std::vector<std::tuple<int, std::size_t, std::size_t, std::size_t>> observed;
  rig.alloc.add_oom_observer([&](int d, std::size_t req, std::size_t limit, std::size_t free) {
    observed.emplace_back(d, req, limit, free);
  });
  const DevicePtr p = rig.alloc.malloc(300 * kMiB, kS1);
  EXPECT_EQ(message_of<OutOfMemoryError>([&] { rig.alloc.malloc(300 * kMiB, kS1); }),
            "Allocation on device 0 would exceed allowed memory. (out of memory)\n"
            "Currently allocated     : 300.00 MiB\n"
            "Requested               : 300.00 MiB\n"
            "Device limit            : 1024.00 MiB\n"  // PyTorch's format_size
            "Free (according to CUDA): 724.00 MiB\n"
            "ccalloc limit (set by user-supplied memory fraction)\n"
            "                        : 512.00 MiB");
  EXPECT_EQ(rig.gpu.counters().async_allocates, 1u);  // refused before asking the pool
  ASSERT_EQ(observed.size(), 1u);
  EXPECT_EQ(observed[0], std::make_tuple(0, 300 * kMiB, 512 * kMiB, 724 * kMiB));
  EXPECT_EQ(rig.alloc.stats().num_ooms, 1);
  // The limit is on bytes handed out, to the byte.
  const DevicePtr q = rig.alloc.malloc(212 * kMiB, kS1);
  EXPECT_THROW(rig.alloc.malloc(1, kS1), OutOfMemoryError);
  rig.alloc.free(p);
  rig.alloc.free(q);
  rig.alloc.set_memory_fraction(1.0);
  EXPECT_NO_THROW(rig.alloc.free(rig.alloc.malloc(600 * kMiB, kS1)));
  EXPECT_THROW(rig.alloc.set_memory_fraction(1.5), ConfigError);
}

TEST(AsyncBackend, TheFractionCanComeFromTheConfig) {
  Rig rig(kGiB, "backend:cudaMallocAsync,per_process_memory_fraction:0.25");
  EXPECT_EQ(rig.alloc.memory_fraction(), 0.25);
  EXPECT_THROW(rig.alloc.malloc(256 * kMiB + 1, kS1), OutOfMemoryError);
  EXPECT_NE(rig.alloc.malloc(256 * kMiB, kS1), 0u);
}

TEST(AsyncBackend, PoolOutOfMemoryIsAnErrorAndTheAllocatorStaysUsable) {
  Rig rig(64 * kMiB);
  const DevicePtr p = rig.alloc.malloc(40 * kMiB, kS1);
  EXPECT_EQ(message_of<OutOfMemoryError>([&] { rig.alloc.malloc(30 * kMiB, kS1); }),
            "Allocation on device 0 would exceed allowed memory. (out of memory)\n"
            "Currently allocated     : 40.00 MiB\n"
            "Requested               : 30.00 MiB\n"
            "Device limit            : 64.00 MiB\n"
            "Free (according to CUDA): 24.00 MiB\n"
            "ccalloc limit (set by user-supplied memory fraction)\n"
            "                        : unlimited");
  EXPECT_EQ(rig.gpu.counters().async_allocate_ooms, 1u);
  rig.alloc.free(p);
  EXPECT_EQ(rig.alloc.malloc(30 * kMiB, kS1), p);
  EXPECT_EQ(rig.alloc.stats().num_ooms, 1);
}

TEST(AsyncBackend, FreeMemoryCallbacksGetOneChanceBeforeOom) {
  Rig rig(8 * kMiB);
  DevicePtr held = rig.alloc.malloc(6 * kMiB, kS1);
  int calls = 0;
  rig.alloc.add_free_memory_callback([&] {
    ++calls;
    if (held == 0) return false;
    rig.alloc.free(held);
    held = 0;
    return true;
  });
  EXPECT_EQ(rig.alloc.malloc(6 * kMiB, kS1), kPool);  // the freed memory, on its own stream
  EXPECT_EQ(calls, 1);
  EXPECT_THROW(rig.alloc.malloc(4 * kMiB, kS1), OutOfMemoryError);
  EXPECT_EQ(calls, 2);
}

TEST(AsyncBackend, StatsFillOnlyThePoolsBytesTheAllocationCountAndOoms) {
  Rig rig;
  const DevicePtr a = rig.alloc.malloc(1000, kS1);
  const DevicePtr b = rig.alloc.malloc(3 * kMiB, kS2);
  rig.alloc.free(a);
  const auto m = rig.alloc.memory_stats();
  const std::set<std::string> filled = {"allocated_bytes.all.current",
                                        "allocated_bytes.all.peak",
                                        "active_bytes.all.current",
                                        "active_bytes.all.peak",
                                        "reserved_bytes.all.current",
                                        "reserved_bytes.all.peak",
                                        "allocation.all.current",
                                        "allocation.all.peak",
                                        "allocation.all.allocated",
                                        "allocation.all.freed",
                                        "max_split_size"};
  EXPECT_EQ(m.at("allocated_bytes.all.current"), static_cast<std::int64_t>(3 * kMiB));
  EXPECT_EQ(m.at("allocated_bytes.all.peak"), static_cast<std::int64_t>(3 * kMiB + 1000));
  EXPECT_EQ(m.at("active_bytes.all.current"), static_cast<std::int64_t>(3 * kMiB));
  EXPECT_EQ(m.at("active_bytes.all.peak"), static_cast<std::int64_t>(3 * kMiB + 1000));
  EXPECT_EQ(m.at("reserved_bytes.all.current"), static_cast<std::int64_t>(6 * kMiB));
  EXPECT_EQ(m.at("reserved_bytes.all.peak"), static_cast<std::int64_t>(6 * kMiB));
  EXPECT_EQ(m.at("allocation.all.current"), 1);
  EXPECT_EQ(m.at("allocation.all.peak"), 2);
  EXPECT_EQ(m.at("allocation.all.allocated"), 2);
  EXPECT_EQ(m.at("allocation.all.freed"), 1);
  EXPECT_EQ(m.at("max_split_size"), -1);
  for (const auto& [key, value] : m) {
    if (filled.count(key) == 0) {
      EXPECT_EQ(value, 0) << key;
    }
  }
  EXPECT_FALSE(rig.alloc.memory_summary().empty());
  rig.alloc.free(b);
}

TEST(AsyncBackend, ResetPeakStatsResetsThePoolsHighWaterMarks) {
  Rig rig;
  const DevicePtr a = rig.alloc.malloc(8 * kMiB, kS1);
  const DevicePtr b = rig.alloc.malloc(2 * kMiB, kS1);
  rig.alloc.free(a);
  rig.alloc.reset_peak_stats();
  const DeviceStats s = rig.alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(s.reserved_bytes[kAggregate].peak, static_cast<std::int64_t>(10 * kMiB));
  EXPECT_EQ(s.allocation[kAggregate].peak, 1);
  rig.alloc.reset_accumulated_stats();  // a no-op, as in PyTorch
  EXPECT_EQ(rig.alloc.stats().allocation[kAggregate].allocated, 2);
  rig.alloc.free(b);
}

TEST(AsyncBackend, EmptyCacheSynchronizesAndTrimsThePool) {
  Rig rig;
  const DevicePtr a = rig.alloc.malloc(8 * kMiB, kS1);
  const DevicePtr b = rig.alloc.malloc(1000, kS2);
  const DevicePtr c = rig.alloc.malloc(4 * kMiB, kS2);
  rig.alloc.free(a);
  rig.alloc.free(c);
  EXPECT_EQ(rig.alloc.stats().reserved_bytes[kAggregate].current,
            static_cast<std::int64_t>(14 * kMiB));
  rig.alloc.empty_cache();
  EXPECT_EQ(rig.alloc.stats().reserved_bytes[kAggregate].current,
            static_cast<std::int64_t>(2 * kMiB));  // the page b lives in
  const sim::Counters cnt = rig.gpu.counters();
  EXPECT_EQ(cnt.device_synchronizes, 1u);
  EXPECT_EQ(cnt.pool_trims, 1u);
  EXPECT_EQ(cnt.pool_pages_trimmed, 6u);
  EXPECT_EQ(rig.alloc.mem_get_info().free_bytes, kGiB - 2 * kMiB);
  rig.alloc.free(b);
}

TEST(AsyncBackend, TraceObserversSeeAllocFreeAndOom) {
  Rig rig(16 * kMiB);
  std::vector<TraceEntry> seen;
  rig.alloc.add_trace_observer([&](const TraceEntry& e) { seen.push_back(e); });
  rig.gpu.set_time_us(7);
  const DevicePtr p = rig.alloc.malloc(1000, kS2);
  rig.alloc.free(p);
  EXPECT_THROW(rig.alloc.malloc(20 * kMiB, kS1), OutOfMemoryError);
  ASSERT_EQ(seen.size(), 4u);
  EXPECT_EQ(seen[0].action, TraceAction::kAlloc);
  EXPECT_EQ(seen[0].addr, p);
  EXPECT_EQ(seen[0].size, 1000u);
  EXPECT_EQ(seen[0].stream, kS2);
  EXPECT_EQ(seen[0].time_us, 7);
  EXPECT_EQ(seen[1].action, TraceAction::kFreeRequested);
  EXPECT_EQ(seen[2].action, TraceAction::kFreeCompleted);
  for (int i : {1, 2}) {
    EXPECT_EQ(seen[i].addr, p);
    EXPECT_EQ(seen[i].size, 1000u);
    EXPECT_EQ(seen[i].stream, kS2);
  }
  EXPECT_EQ(seen[3].action, TraceAction::kOom);
  EXPECT_EQ(seen[3].addr, 14 * kMiB);  // the device's free bytes
  EXPECT_EQ(seen[3].size, 20 * kMiB);
  EXPECT_EQ(seen[3].stream, kS1);
}

TEST(AsyncBackend, HistoryIsRecordedAndSnapshotsCarryItWithoutSegments) {
  Rig rig;
  HistoryOptions all;
  all.context = HistoryOptions::Context::kNone;
  all.stacks = HistoryOptions::Stacks::kNone;
  rig.alloc.record_history(all);
  rig.alloc.annotate("step", true);
  const DevicePtr p = rig.alloc.malloc(1000, kS1);
  rig.alloc.free(p);
  const Snapshot s = rig.alloc.snapshot();
  EXPECT_TRUE(s.segments.empty());
  ASSERT_EQ(s.device_traces.size(), 1u);
  const auto& t = s.device_traces[0];
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[0].action, TraceAction::kAlloc);
  EXPECT_EQ(t[1].action, TraceAction::kFreeRequested);
  EXPECT_EQ(t[2].action, TraceAction::kFreeCompleted);
  EXPECT_EQ(t[3].action, TraceAction::kSnapshot);
  EXPECT_EQ(t[0].addr, p);
  EXPECT_EQ(t[0].size, 1000u);
  EXPECT_EQ(s.allocator_settings.conf, "backend:cudaMallocAsync");
  EXPECT_EQ(s.allocator_settings.trace_alloc_max_entries, 1 << 20);
  ASSERT_EQ(s.external_annotations.size(), 1u);
  EXPECT_EQ(s.external_annotations[0].name, "step");

  HistoryOptions off;
  off.enabled = HistoryOptions::Enabled::kNone;
  rig.alloc.record_history(off);
  rig.alloc.free(rig.alloc.malloc(1000, kS1));
  const Snapshot after = rig.alloc.snapshot();
  EXPECT_TRUE(after.device_traces[0].empty());
  EXPECT_TRUE(after.external_annotations.empty());
}

[[gnu::noinline]] DevicePtr AsyncAllocateFromKnownFunction(Allocator& a, std::size_t size) {
  const DevicePtr p = a.malloc(size, kS1);
  asm volatile("" ::: "memory");
  return p;
}

TEST(AsyncBackend, HistoryEntriesCarryStacksWhenAsked) {
  Rig rig;
  HistoryOptions o;  // all, all, cpp
  rig.alloc.record_history(o);
  const DevicePtr p = AsyncAllocateFromKnownFunction(rig.alloc, 1000);
  rig.alloc.free(p);
  const Snapshot s = rig.alloc.snapshot();
  ASSERT_GE(s.device_traces[0].size(), 3u);
  EXPECT_NE(s.device_traces[0][0].frames, nullptr);
  EXPECT_NE(s.device_traces[0][1].frames, nullptr);
}

TEST(AsyncBackend, InvariantsHoldAndTheDestructorReturnsEverything) {
  sim::SimDriver gpu(with_capacity(kGiB));
  {
    Allocator alloc(gpu, Config::parse("backend:cudaMallocAsync"));
    alloc.set_check_invariants(true);
    std::vector<DevicePtr> live;
    for (int i = 0; i < 200; ++i) {
      const StreamId s = 1 + static_cast<StreamId>(i % 3);
      live.push_back(alloc.malloc(static_cast<std::size_t>(1 + (i * 7919) % (3 * kMiB)), s));
      if (i % 5 == 0) alloc.record_stream(live.back(), s + 1);
      if (i % 3 == 0) {
        alloc.free(live.front());
        live.erase(live.begin());
      }
      if (i % 50 == 0) gpu.complete_all();
    }
    alloc.check_invariants();
    EXPECT_EQ(alloc.stats().allocation[kAggregate].current, static_cast<std::int64_t>(live.size()));
  }
  EXPECT_EQ(gpu.used_bytes(), 0u);
  const PoolUsage u = gpu.pool_usage();
  EXPECT_EQ(u.used_current, 0u);
  EXPECT_EQ(u.reserved_current, 0u);
}

}  // namespace
}  // namespace ccalloc
