// ProcessAllocator routing over simulated devices, and the C API on a machine without a
// GPU (errors as codes and messages, never exceptions).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <thread>

#include "api/c_context.hpp"
#include "ccalloc/ccalloc.h"
#include "ccalloc/cuda.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/process.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"
#include "ccalloc/snapshot_io.hpp"

namespace {

using ccalloc::DevicePtr;
using ccalloc::ProcessAllocator;

thread_local int t_current_device = 0;

// A machine of `n` simulated GPUs whose current device is per thread, as with CUDA.
ProcessAllocator::Devices simulated_machine(int n) {
  ProcessAllocator::Devices d;
  d.count = [n] { return n; };
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

// As PyTorch at its lazy CUDA initialization: neither the devices nor the config are read
// before a call needs them, and each is read once (a malformed config again at the next).
TEST(ProcessAllocator, ReadsDevicesAndConfigAtTheFirstCallThatNeedsThem) {
  int counted = 0, read = 0;
  ProcessAllocator::Devices devices = simulated_machine(2);
  devices.count = [&counted] {
    ++counted;
    return 2;
  };
  bool malformed = true;
  ProcessAllocator p(std::move(devices), [&]() -> ccalloc::Config {
    ++read;
    if (malformed) throw ccalloc::ConfigError("malformed");
    return ccalloc::Config::parse("pytorch,max_split_size_mb:64");
  });
  EXPECT_EQ(p.existing(0), nullptr);
  EXPECT_FALSE(p.config_resolved());
  EXPECT_EQ(counted, 0);
  EXPECT_EQ(read, 0);
  p.empty_cache(ProcessAllocator::kAllDevices);  // no device made: counts, reads no config
  EXPECT_EQ(counted, 1);
  EXPECT_EQ(read, 0);
  t_current_device = 0;
  EXPECT_THROW(p.malloc(4096), ccalloc::ConfigError);
  EXPECT_EQ(read, 1);
  EXPECT_EQ(p.existing(0), nullptr);  // the failed call made no allocator
  malformed = false;
  const DevicePtr ptr = p.malloc(4096);
  EXPECT_EQ(read, 2);
  EXPECT_TRUE(p.config_resolved());
  EXPECT_EQ(p.allocator(0).config().max_split_size, std::size_t{64} << 20);
  p.free(p.malloc(1 << 20, 0, 1));
  p.free(ptr);
  EXPECT_EQ(counted, 1);
  EXPECT_EQ(read, 2);
  EXPECT_EQ(p.device_count(), 2);
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

TEST(ProcessAllocator, OneVisibleDeviceIsTheCurrentOneWithoutAsking) {
  int asked = 0;
  ProcessAllocator::Devices one = simulated_machine(1);
  one.current_device = [&asked] {
    ++asked;
    return 0;
  };
  ProcessAllocator p(std::move(one), ccalloc::Config::parse("pytorch"));
  const DevicePtr a = p.malloc(4096);
  p.free(a);
  EXPECT_EQ(p.stats().allocation[ccalloc::kAggregate].allocated, 1);
  EXPECT_EQ(asked, 0);
  // With two, malloc asks for the current device.
  int asked_two = 0;
  ProcessAllocator::Devices two = simulated_machine(2);
  two.current_device = [&asked_two] {
    ++asked_two;
    return 1;
  };
  ProcessAllocator q(std::move(two), ccalloc::Config::parse("pytorch"));
  const DevicePtr b = q.malloc(4096);
  EXPECT_EQ(q.device_of(b), 1);
  q.free(b);
  EXPECT_GE(asked_two, 1);
}

TEST(ProcessAllocator, PeerAccessIsGrantedByTheOwningDevicesDriver) {
  ProcessAllocator p(simulated_machine(2), ccalloc::Config::parse("ccalloc"));
  // Device 0 may access device 1's memory: device 1's allocator grants it, once.
  p.allocator(1).enable_peer_access(0);
  p.allocator(1).enable_peer_access(0);
  const auto& one = dynamic_cast<const ccalloc::sim::SimDriver&>(p.allocator(1).driver());
  const auto& zero = dynamic_cast<const ccalloc::sim::SimDriver&>(p.allocator(0).driver());
  EXPECT_EQ(one.peers(), std::vector<int>{0});
  EXPECT_EQ(zero.peers(), std::vector<int>{});
  for (const int bad : {1, -1}) {
    try {
      p.allocator(1).enable_peer_access(bad);
      ADD_FAILURE() << "peer " << bad << " was accepted";
    } catch (const ccalloc::Error& e) {
      EXPECT_NE(std::string(e.what()).find("enable_peer_access(" + std::to_string(bad) + ")"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(one.peers(), std::vector<int>{0});
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

TEST(ProcessAllocator, SleepablePoolsSleepAndWakeOnTheirDevice) {
  ProcessAllocator p(simulated_machine(2), ccalloc::Config::parse(""));
  const ccalloc::PoolId id{0, 42};
  p.create_sleepable_pool(id, 1);
  ccalloc::Allocator& a = p.allocator(1);
  auto& driver = static_cast<ccalloc::sim::SimDriver&>(a.driver());
  a.begin_allocate_to_pool(id, [](ccalloc::StreamId) { return true; });
  const DevicePtr ptr = p.malloc(30 << 20, 0, 1);
  a.end_allocate_to_pool(id);
  const std::string bytes(30 << 20, 'z');
  driver.write(ptr, bytes.data(), bytes.size());
  const std::size_t free_awake = p.mem_get_info(1).free_bytes;
  p.sleep_pool(id, ccalloc::SleepMode::kSave, 1);
  EXPECT_TRUE(p.pool_asleep(id, 1));
  EXPECT_EQ(p.mem_get_info(1).free_bytes, free_awake + (30u << 20));
  EXPECT_EQ(p.stats(1).reserved_bytes[ccalloc::kAggregate].current, 0);
  // The pool lives on device 1 only.
  t_current_device = 0;
  EXPECT_THROW(p.pool_asleep(id), ccalloc::Error);
  EXPECT_THROW(p.wake_pool(id), ccalloc::Error);
  p.wake_pool(id, 1);
  EXPECT_FALSE(p.pool_asleep(id, 1));
  std::string back(30 << 20, '\0');
  driver.read(ptr, back.data(), back.size());
  EXPECT_EQ(back, bytes);
  EXPECT_EQ(p.device_of(ptr), 1);
  p.free(ptr);
}

// On a machine without a CUDA device every call reports an error through the C API.
// The file that holds the code at `address`.
std::string library_of(const void* address) {
  Dl_info info{};
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "(none)";
  return std::filesystem::path(info.dli_fname).filename().string();
}

TEST(ProcessAllocator, OneEngineInAProcessThatLinksTheSharedLibrary) {
  // This program links libccalloc.so alone, as the PyTorch adapter does: the C API, the
  // process allocator and the engine's code are all that library's, so every route reaches
  // one ProcessAllocator (a second, static copy of the engine would be a second allocator).
  EXPECT_EQ(library_of(reinterpret_cast<const void*>(&ccalloc_malloc)), "libccalloc.so");
  EXPECT_EQ(library_of(reinterpret_cast<const void*>(&ProcessAllocator::instance)),
            "libccalloc.so");
  EXPECT_EQ(library_of(reinterpret_cast<const void*>(&ccalloc::Config::from_environment)),
            "libccalloc.so");
  // The config that devices first used get is shared by the C++ and C routes; setting it
  // (as the adapter does for PyTorch's run-time settings) is seen by the next reader.
  ProcessAllocator& process = ProcessAllocator::instance();
  const ccalloc::Config before = process.config();
  ccalloc::Config changed = before;
  changed.max_split_size = std::size_t{40} << 20;
  process.set_config(changed);
  EXPECT_EQ(ProcessAllocator::instance().config().max_split_size, std::size_t{40} << 20);
  process.set_config(before);
  EXPECT_EQ(ProcessAllocator::instance().config(), before);
  if (ccalloc::cuda::device_count() == 0) {
    EXPECT_EQ(process.existing(0), nullptr);  // no GPU here: nothing was created
  }
  EXPECT_EQ(process.existing(-1), nullptr);
  EXPECT_EQ(process.existing(ProcessAllocator::kMaxDevices), nullptr);
}

TEST(CApi, WithoutAGpuCallsFailWithAReadableMessage) {
  if (ccalloc::cuda::device_count() > 0) GTEST_SKIP() << "a GPU is present";
  void* ptr = reinterpret_cast<void*>(1);
  EXPECT_EQ(ccalloc_malloc(&ptr, 1024, -1, nullptr), CCALLOC_ERROR_DRIVER);
  EXPECT_EQ(ptr, nullptr);
  EXPECT_NE(std::string(ccalloc_last_error()).find("CUDA"), std::string::npos)
      << ccalloc_last_error();
  EXPECT_EQ(ccalloc_torch_alloc(1024, 0, nullptr), nullptr);
  // The hooks without a status: NULL, and the status kept for the caller to ask.
  EXPECT_EQ(ccalloc_hook_malloc(1024, 0, nullptr), nullptr);
  EXPECT_EQ(ccalloc_last_status(), CCALLOC_ERROR_DRIVER);
  size_t free_bytes = 0, total = 0;
  EXPECT_EQ(ccalloc_mem_get_info(0, &free_bytes, &total), CCALLOC_ERROR_DRIVER);
}

TEST(CApi, AHookFreeThatFailsSaysSoOnStderr) {
  testing::internal::CaptureStderr();
  ccalloc_hook_free(reinterpret_cast<void*>(0x7f0000001000), 0);
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("0x7f0000001000"), std::string::npos) << said;
  EXPECT_EQ(said, std::string(ccalloc_last_error()) + "\n");
  EXPECT_NE(ccalloc_last_status(), CCALLOC_SUCCESS);
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

TEST(CApi, SleepCallsCheckTheirArguments) {
  EXPECT_EQ(ccalloc_pool_sleep(0, ccalloc_pool_id{0, 0}, 1), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_STREQ(ccalloc_last_error(),
               "ccalloc_pool_sleep: pool id {0, 0} is the default pool, not a private pool");
  EXPECT_EQ(ccalloc_pool_wake(0, ccalloc_pool_id{0, 0}), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_EQ(ccalloc_pool_create_sleepable(0, ccalloc_pool_id{0, 0}), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_EQ(ccalloc_pool_is_asleep(0, ccalloc_pool_id{0, 3}, nullptr), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc_pool_is_asleep: asleep is NULL");
  int asleep = -1;
  if (ccalloc::cuda::device_count() == 0) {
    EXPECT_EQ(ccalloc_pool_create_sleepable(0, ccalloc_pool_id{0, 3}), CCALLOC_ERROR_DRIVER);
    EXPECT_EQ(ccalloc_pool_is_asleep(0, ccalloc_pool_id{0, 3}, &asleep), CCALLOC_ERROR_DRIVER);
    return;
  }
  // With a GPU: the whole cycle, and misuse as invalid values naming the pool.
  const ccalloc_pool_id pool{0, 876543};
  EXPECT_EQ(ccalloc_pool_is_asleep(0, pool, &asleep), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: no private pool (0, 876543) on device 0");
  ASSERT_EQ(ccalloc_pool_create_sleepable(0, pool), CCALLOC_SUCCESS);
  ASSERT_EQ(ccalloc_pool_begin_allocate(
                0, pool, [](void*, void*) { return 1; }, nullptr),
            CCALLOC_SUCCESS);
  void* ptr = nullptr;
  ASSERT_EQ(ccalloc_malloc(&ptr, 8 << 20, 0, nullptr), CCALLOC_SUCCESS);
  ASSERT_EQ(ccalloc_pool_end_allocate(0, pool), CCALLOC_SUCCESS);
  EXPECT_EQ(ccalloc_pool_wake(0, pool), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: wake_pool: pool (0, 876543) is not asleep");
  ASSERT_EQ(ccalloc_pool_sleep(0, pool, 1), CCALLOC_SUCCESS);
  EXPECT_EQ(ccalloc_pool_is_asleep(0, pool, &asleep), CCALLOC_SUCCESS);
  EXPECT_EQ(asleep, 1);
  EXPECT_EQ(ccalloc_pool_sleep(0, pool, 0), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: sleep_pool: pool (0, 876543) is already asleep");
  EXPECT_EQ(ccalloc_pool_begin_allocate(0, pool, nullptr, nullptr), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_NE(std::string(ccalloc_last_error()).find("pool (0, 876543) is asleep"),
            std::string::npos);
  ASSERT_EQ(ccalloc_pool_wake(0, pool), CCALLOC_SUCCESS);
  EXPECT_EQ(ccalloc_pool_is_asleep(0, pool, &asleep), CCALLOC_SUCCESS);
  EXPECT_EQ(asleep, 0);
  EXPECT_EQ(ccalloc_free(ptr), CCALLOC_SUCCESS);
  EXPECT_EQ(ccalloc_pool_release(0, pool), CCALLOC_SUCCESS);
  EXPECT_EQ(ccalloc_pool_release(0, pool), CCALLOC_SUCCESS);
  EXPECT_EQ(ccalloc_pool_empty_cache(0, pool), CCALLOC_SUCCESS);
}

TEST(CApi, FreeOfNullSucceeds) {
  EXPECT_EQ(ccalloc_free(nullptr), CCALLOC_SUCCESS);
}

TEST(CApi, VersionIsTheProjectVersion) {
  EXPECT_STREQ(ccalloc_version(), "0.1.0");
}

// Caller contexts as C sees them: malloc'ed ints, counted as they are taken and released.
struct CContexts {
  std::atomic<int> taken{0};
  std::atomic<int> released{0};
  std::atomic<int> bad_releases{0};  // a handle released twice, or one never handed out
  static void* capture(void* user) {
    auto* c = static_cast<CContexts*>(user);
    auto* id = static_cast<int*>(std::malloc(sizeof(int)));
    *id = ++c->taken;
    return id;
  }
  static void release(void* context, void* user) {
    auto* c = static_cast<CContexts*>(user);
    auto* id = static_cast<int*>(context);
    if (*id <= 0 || *id > c->taken) ++c->bad_releases;
    *id = -1;  // poison: a second release is caught above (before the memory is reused)
    std::free(id);
    ++c->released;
  }
  static void frames(void* context, ccalloc_frame_emit_fn emit, void* sink, void*) {
    const std::string name = "caller_" + std::to_string(*static_cast<int*>(context));
    emit(sink, "app.c", 7, name.c_str());
  }
};

int c_id(void* context) {
  return context != nullptr ? *static_cast<int*>(context) : 0;
}

// The C API's conversions and snapshot accessors over a simulated two-device machine.
TEST(CApiContext, HandlesAreKeptReportedAndReleasedExactlyOnce) {
  CContexts c;
  {
    ProcessAllocator p(simulated_machine(2), ccalloc::Config::parse("pytorch"));
    p.record_history(ccalloc::capi::history_options("all", "all", "none", 100,
                                                    &CContexts::capture, &CContexts::release, &c));
    const DevicePtr a = p.malloc(4096, 0, 0);  // 1
    const DevicePtr b = p.malloc(4096, 0, 1);  // 2 (device 1 gets the options when created)
    p.free(a);                                 // 3
    auto* snap = new ccalloc_snapshot{p.snapshot()};
    size_t length = 0;
    ASSERT_EQ(ccalloc_snapshot_trace_length(snap, 0, &length), CCALLOC_SUCCESS);
    ASSERT_EQ(length, 5u);  // segment_alloc, alloc, free_requested, free_completed, snapshot
    const int want0[] = {1, 1, 3, 3, 0};
    for (size_t i = 0; i < length; ++i) {
      ccalloc_trace_entry e{};
      ASSERT_EQ(ccalloc_snapshot_trace_entry(snap, 0, i, &e), CCALLOC_SUCCESS);
      EXPECT_EQ(c_id(e.context), want0[i]) << i;
    }
    ccalloc_trace_entry e{};
    ASSERT_EQ(ccalloc_snapshot_trace_entry(snap, 1, 1, &e), CCALLOC_SUCCESS);
    EXPECT_EQ(e.action, CCALLOC_TRACE_ALLOC);
    EXPECT_EQ(e.addr, static_cast<uintptr_t>(b));
    EXPECT_EQ(c_id(e.context), 2);
    EXPECT_EQ(ccalloc_snapshot_trace_entry(snap, 1, 99, &e), CCALLOC_ERROR_INVALID_VALUE);
    EXPECT_NE(std::string(ccalloc_last_error()).find("no entry 99"), std::string::npos);

    size_t segments = 0;
    ASSERT_EQ(ccalloc_snapshot_segment_count(snap, &segments), CCALLOC_SUCCESS);
    ASSERT_EQ(segments, 2u);
    ccalloc_segment_info seg{};
    ASSERT_EQ(ccalloc_snapshot_segment(snap, 1, &seg), CCALLOC_SUCCESS);
    EXPECT_EQ(seg.device, 1);
    EXPECT_EQ(c_id(seg.context), 2);
    ASSERT_EQ(seg.block_count, 2u);
    ccalloc_block_info blk{};
    ASSERT_EQ(ccalloc_snapshot_block(snap, 1, 0, &blk), CCALLOC_SUCCESS);
    EXPECT_EQ(blk.state, CCALLOC_BLOCK_ACTIVE_ALLOCATED);
    EXPECT_EQ(c_id(blk.context), 2);
    ASSERT_EQ(ccalloc_snapshot_block(snap, 0, 0, &blk), CCALLOC_SUCCESS);
    EXPECT_EQ(blk.state, CCALLOC_BLOCK_INACTIVE);
    EXPECT_EQ(blk.context, nullptr);
    EXPECT_EQ(ccalloc_snapshot_block(snap, 0, 5, &blk), CCALLOC_ERROR_INVALID_VALUE);

    // Written with the caller's frames.
    const std::string path = (std::filesystem::temp_directory_path() / "ccalloc_c_ctx.json").string();
    ASSERT_EQ(ccalloc_snapshot_write(snap, path.c_str(), &CContexts::frames, nullptr),
              CCALLOC_SUCCESS)
        << ccalloc_last_error();
    const ccalloc::Snapshot back = ccalloc::io::read_snapshot(path);
    std::filesystem::remove(path);
    ASSERT_TRUE(back.segments[1].blocks[0].frames);
    ASSERT_EQ(back.segments[1].blocks[0].frames->size(), 1u);
    EXPECT_EQ((*back.segments[1].blocks[0].frames)[0], (ccalloc::Frame{"app.c", 7, "caller_2"}));

    p.record_history(ccalloc::capi::history_options("none", "none", "none", 1, nullptr, nullptr,
                                                    nullptr));
    p.free(b);
    p.empty_cache(ProcessAllocator::kAllDevices);
    EXPECT_EQ(c.released, 0) << "the allocators hold none; the snapshot holds all three";
    ccalloc_snapshot_free(snap);
    EXPECT_EQ(c.released, 3);
  }
  EXPECT_EQ(c.taken, 3);
  EXPECT_EQ(c.released, 3);
  EXPECT_EQ(c.bad_releases, 0);
}

TEST(CApiContext, CaptureWithoutReleaseIsAnInvalidValue) {
  EXPECT_EQ(ccalloc_record_history_context("all", "all", "none", 10, &CContexts::capture, nullptr,
                                           nullptr),
            CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_NE(std::string(ccalloc_last_error()).find("release is NULL"), std::string::npos);
  EXPECT_EQ(ccalloc_snapshot_take(nullptr), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_EQ(ccalloc_record_history_context("all", "sometimes", "none", 10, nullptr, nullptr,
                                           nullptr),
            CCALLOC_ERROR_CONFIG);
  EXPECT_NE(std::string(ccalloc_last_error()).find("'sometimes'"), std::string::npos);
}

// Through the exported entry points on the process's devices: exact counts with a GPU;
// without one, failing mallocs take no context.
TEST(CApiContext, ProcessHistoryTakesAndReleasesEveryContext) {
  CContexts c;
  ASSERT_EQ(ccalloc_record_history_context("all", "all", "none", 3, &CContexts::capture,
                                           &CContexts::release, &c),
            CCALLOC_SUCCESS)
      << ccalloc_last_error();
  void* ptr = nullptr;
  if (ccalloc::cuda::device_count() == 0) {
    EXPECT_EQ(ccalloc_malloc(&ptr, 1024, -1, nullptr), CCALLOC_ERROR_DRIVER);
    EXPECT_EQ(c.taken, 0);
  } else {
    for (int i = 0; i < 10; ++i) {
      ASSERT_EQ(ccalloc_malloc(&ptr, 1024, -1, nullptr), CCALLOC_SUCCESS) << ccalloc_last_error();
      ASSERT_EQ(ccalloc_free(ptr), CCALLOC_SUCCESS);
    }
    EXPECT_EQ(c.taken, 20);
    ccalloc_snapshot* snap = nullptr;
    ASSERT_EQ(ccalloc_snapshot_take(&snap), CCALLOC_SUCCESS);
    size_t length = 0;
    ASSERT_EQ(ccalloc_snapshot_trace_length(snap, 0, &length), CCALLOC_SUCCESS);
    ASSERT_EQ(length, 3u);
    ccalloc_trace_entry e{};
    ASSERT_EQ(ccalloc_snapshot_trace_entry(snap, 0, 0, &e), CCALLOC_SUCCESS);
    EXPECT_EQ(e.action, CCALLOC_TRACE_FREE_REQUESTED);
    EXPECT_EQ(c_id(e.context), 20);
    ccalloc_snapshot_free(snap);
  }
  ASSERT_EQ(ccalloc_record_history_context("none", "none", "none", 1, nullptr, nullptr, nullptr),
            CCALLOC_SUCCESS);
  ASSERT_EQ(ccalloc_empty_cache(-2), CCALLOC_SUCCESS);
  EXPECT_EQ(c.released, c.taken) << "the process's allocators hold none";
  EXPECT_EQ(c.bad_releases, 0);
}

}  // namespace
