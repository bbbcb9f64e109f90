// ProcessAllocator routing over simulated devices, and the C API on a machine without a
// GPU (errors as codes and messages, never exceptions).
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "ccalloc/ccalloc.h"
#include "ccalloc/cuda.hpp"
#include "ccalloc/process.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"

namespace {

using ccalloc::DevicePtr;
using ccalloc::ProcessAllocator;

thread_local int t_current_device = 0;

// A machine of `n` simulated GPUs whose current device is per thread, as with CUDA.
ProcessAllocator::Devices simulated_machine(int n) {
  ProcessAllocator::Devices d;
  d.count = n;
  d.make_driver = [](int device) {
    ccalloc::sim::Options o;
    o.device = device;
    o.capacity = std::size_t{8} << 30;
    o.base_address = 0x100000000000 + static_cast<DevicePtr>(device) * 0x10000000000;
    return std::make_unique<ccalloc::sim::SimDriver>(o);
  };
  d.current_device = [] { return t_current_device; };
  return d;
}

TEST(ProcessAllocator, MallocUsesTheCurrentDevice) {
  ProcessAllocator p(simulated_machine(2), ccalloc::Config::parse("pytorch"));
  t_current_device = 1;
  const DevicePtr ptr = p.malloc(4096);
  t_current_device = 0;
  EXPECT_EQ(p.device_of(ptr), 1);
  EXPECT_EQ(p.stats(1).allocation[ccalloc::kAggregate].current, 1);
  EXPECT_EQ(p.stats(0).allocation[ccalloc::kAggregate].current, 0);
  p.free(ptr);
}

TEST(ProcessAllocator, FreeFromAnotherThreadReturnsToTheOwningDevice) {
  ProcessAllocator p(simulated_machine(2), ccalloc::Config::parse("pytorch"));
  t_current_device = 0;
  const DevicePtr on0 = p.malloc(1 << 20, 0, 0);
  const DevicePtr on1 = p.malloc(1 << 20, 0, 1);
  std::thread([&] {
    t_current_device = 1;  // the "wrong" device for on0
    p.free(on0);
    t_current_device = 0;  // and for on1
    p.free(on1);
  }).join();
  for (int d : {0, 1}) {
    const auto s = p.stats(d);
    EXPECT_EQ(s.allocation[ccalloc::kAggregate].current, 0) << "device " << d;
    EXPECT_EQ(s.allocation[ccalloc::kAggregate].allocated, 1) << "device " << d;
  }
}

TEST(ProcessAllocator, UnknownPointerIsAnErrorNamingIt) {
  ProcessAllocator p(simulated_machine(2), ccalloc::Config::parse("pytorch"));
  const DevicePtr ptr = p.malloc(512, 0, 0);
  p.free(ptr);
  try {
    p.free(ptr);
    FAIL() << "double free accepted";
  } catch (const ccalloc::InvalidPointerError& e) {
    EXPECT_EQ(e.ptr(), ptr);
    EXPECT_NE(std::string(e.what()).find("0x100000000000"), std::string::npos) << e.what();
  }
  (void)p.malloc(512, 0, 1);  // two devices now: the search path
  EXPECT_THROW(p.free(ptr), ccalloc::InvalidPointerError);
  EXPECT_THROW(p.record_stream(ptr, 5), ccalloc::InvalidPointerError);
}

TEST(ProcessAllocator, DeviceOutOfRangeIsADriverError) {
  ProcessAllocator p(simulated_machine(2), ccalloc::Config::parse("pytorch"));
  EXPECT_THROW(p.malloc(512, 0, 2), ccalloc::DriverError);
  EXPECT_THROW(p.allocator(-5), ccalloc::DriverError);
}

TEST(ProcessAllocator, EmptyCacheOfAllDevicesReleasesEveryCachedSegment) {
  ProcessAllocator p(simulated_machine(2), ccalloc::Config::parse("pytorch"));
  p.free(p.malloc(1 << 20, 0, 0));
  p.free(p.malloc(1 << 20, 0, 1));
  p.empty_cache(ProcessAllocator::kAllDevices);
  for (int d : {0, 1})
    EXPECT_EQ(p.stats(d).reserved_bytes[ccalloc::kAggregate].current, 0);
}

TEST(ProcessAllocator, RecordStreamRoutesToTheOwningDevice) {
  ProcessAllocator p(simulated_machine(2), ccalloc::Config::parse("pytorch"));
  t_current_device = 0;
  (void)p.malloc(512, 0, 0);
  const DevicePtr ptr = p.malloc(512, 0, 1);
  p.record_stream(ptr, 9);
  p.free(ptr);
  // Pending on stream 9's event: still active on device 1.
  EXPECT_EQ(p.stats(1).active[ccalloc::kAggregate].current, 1);
}

TEST(ProcessAllocator, SnapshotHoldsEveryDeviceAndHistoryReachesLateDevices) {
  ProcessAllocator p(simulated_machine(2), ccalloc::Config::parse("pytorch"));
  const DevicePtr on0 = p.malloc(4096, 0, 0);
  ccalloc::HistoryOptions history;
  history.context = ccalloc::HistoryOptions::Context::kNone;
  p.record_history(history);
  const DevicePtr on1 = p.malloc(8192, 0, 1);  // device 1's allocator is created now
  p.free(on0);
  const ccalloc::Snapshot s = p.snapshot();
  ASSERT_EQ(s.segments.size(), 2u);
  EXPECT_EQ(s.segments[0].device, 0);
  EXPECT_EQ(s.segments[1].device, 1);
  ASSERT_EQ(s.device_traces.size(), 2u);
  // Device 0 recorded from record_history on: the free and the snapshot entry.
  ASSERT_EQ(s.device_traces[0].size(), 3u);
  EXPECT_EQ(s.device_traces[0][0].action, ccalloc::TraceAction::kFreeRequested);
  // Device 1 recorded from its creation: segment_alloc, alloc, snapshot.
  ASSERT_EQ(s.device_traces[1].size(), 3u);
  EXPECT_EQ(s.device_traces[1][1].action, ccalloc::TraceAction::kAlloc);
  EXPECT_EQ(s.device_traces[1][1].size, 8192u);
  p.free(on1);
}

// On a machine without a CUDA device every call reports an error through the C API.
TEST(CApi, WithoutAGpuCallsFailWithAReadableMessage) {
  if (ccalloc::cuda::device_count() > 0) GTEST_SKIP() << "a GPU is present";
  void* ptr = reinterpret_cast<void*>(1);
  EXPECT_EQ(ccalloc_malloc(&ptr, 1024, -1, nullptr), CCALLOC_ERROR_DRIVER);
  EXPECT_EQ(ptr, nullptr);
  EXPECT_NE(std::string(ccalloc_last_error()).find("CUDA"), std::string::npos)
      << ccalloc_last_error();
  EXPECT_EQ(ccalloc_torch_alloc(1024, 0, nullptr), nullptr);
  size_t free_bytes = 0, total = 0;
  EXPECT_EQ(ccalloc_mem_get_info(0, &free_bytes, &total), CCALLOC_ERROR_DRIVER);
}

TEST(CApi, NullArgumentsAreInvalidValues) {
  EXPECT_EQ(ccalloc_malloc(nullptr, 16, 0, nullptr), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_NE(std::string(ccalloc_last_error()).find("ptr is NULL"), std::string::npos);
  EXPECT_EQ(ccalloc_get_stat(0, nullptr, nullptr), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_EQ(ccalloc_mem_get_info(0, nullptr, nullptr), CCALLOC_ERROR_INVALID_VALUE);
}

TEST(CApi, PoolCallsCheckTheirArguments) {
  int count = -1;
  EXPECT_EQ(ccalloc_pool_create(0, ccalloc_pool_id{0, 0}), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_STREQ(ccalloc_last_error(),
               "ccalloc_pool_create: pool id {0, 0} is the default pool, not a private pool");
  EXPECT_EQ(ccalloc_pool_use_count(0, ccalloc_pool_id{0, 1}, nullptr), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc_pool_use_count: count is NULL");
  if (ccalloc::cuda::device_count() > 0) {
    // An unknown pool is an invalid value, named in the message.
    EXPECT_EQ(ccalloc_pool_use_count(0, ccalloc_pool_id{0, 987654}, &count),
              CCALLOC_ERROR_INVALID_VALUE);
    EXPECT_STREQ(ccalloc_last_error(), "ccalloc: no private pool (0, 987654) on device 0");
    ASSERT_EQ(ccalloc_pool_begin_allocate(0, ccalloc_pool_id{0, 987654}, nullptr, nullptr),
              CCALLOC_SUCCESS);
    EXPECT_EQ(ccalloc_pool_use_count(0, ccalloc_pool_id{0, 987654}, &count), CCALLOC_SUCCESS);
    EXPECT_EQ(count, 1);
    EXPECT_EQ(ccalloc_pool_end_allocate(0, ccalloc_pool_id{0, 987654}), CCALLOC_SUCCESS);
    EXPECT_EQ(ccalloc_pool_release(0, ccalloc_pool_id{0, 987654}), CCALLOC_SUCCESS);
    EXPECT_EQ(ccalloc_pool_empty_cache(0, ccalloc_pool_id{0, 987654}), CCALLOC_SUCCESS);
  } else {
    EXPECT_EQ(ccalloc_pool_create(0, ccalloc_pool_id{0, 1}), CCALLOC_ERROR_DRIVER);
  }
}

TEST(CApi, FreeOfNullSucceeds) {
  EXPECT_EQ(ccalloc_free(nullptr), CCALLOC_SUCCESS);
}

TEST(CApi, VersionIsTheProjectVersion) {
  EXPECT_STREQ(ccalloc_version(), "0.1.0");
}

}  // namespace
