// GPU tests of the process-wide allocator (ProcessAllocator, two devices, peer access), sleep
// and wake of a sleepable pool, and the C API, on real CUDA devices, proven by data as in
// gpu_test.cu (the same program). Every test skips itself without the devices it needs.
#include "gpu_support.cuh"

namespace {

// ---------------------------------------------------------------------------------------
// e. The process-wide allocator on real devices.

TEST(ProcessAllocatorGpu, PointerFreedFromAnotherThreadReturnsToItsDevice) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto& pa = ccalloc::ProcessAllocator::instance();
  const int devices = ccalloc::cuda::device_count();
  ASSERT_CUDA(cudaSetDevice(0));

  // Frees `ptr` on a new thread; `other_device` >= 0 makes that device current there first,
  // -1 leaves the thread without any CUDA call of its own.
  auto free_elsewhere = [&](DevicePtr ptr, int other_device) {
    std::string error;
    int current_after = -1;
    std::thread t([&] {
      try {
        if (other_device >= 0) cuda_or_throw(cudaSetDevice(other_device), "cudaSetDevice");
        pa.free(ptr);
        if (other_device >= 0) cuda_or_throw(cudaGetDevice(&current_after), "cudaGetDevice");
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
    t.join();
    EXPECT_EQ(error, "");
    if (other_device >= 0) {
      EXPECT_EQ(current_after, other_device) << "free changed the thread's current device";
    }
  };

  std::vector<int> variants = {-1};
  if (devices >= 2) variants.push_back(1);
  for (int other : variants) {
    SCOPED_TRACE(other < 0 ? "freed from a thread that never touched CUDA"
                           : "freed from a thread whose current device is 1");
    const std::int64_t before = pa.stats(0).allocation[kAggregate].current;
    const std::int64_t bytes_before = pa.stats(0).allocated_bytes[kAggregate].current;
    const DevicePtr p = pa.malloc(1 * kMiB, 0, -1);  // current device: 0
    ASSERT_NE(p, 0u);
    EXPECT_EQ(pa.device_of(p), 0);
    EXPECT_EQ(pa.stats(0).allocation[kAggregate].current, before + 1);
    free_elsewhere(p, other);
    EXPECT_EQ(pa.device_of(p), -1);
    EXPECT_EQ(pa.stats(0).allocation[kAggregate].current, before);
    EXPECT_EQ(pa.stats(0).allocated_bytes[kAggregate].current, bytes_before);
  }
  pa.empty_cache(0);
}

TEST(ProcessAllocatorGpu, TwoDevicesEachKeepTheirAllocationsAndData) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (ccalloc::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  auto& pa = ccalloc::ProcessAllocator::instance();
  constexpr std::size_t kSize = 4 * kMiB;
  constexpr int kDevices = 2;

  std::int64_t before[kDevices] = {};
  DevicePtr ptrs[kDevices] = {};
  unsigned long long* counters[kDevices] = {};
  for (int d = 0; d < kDevices; ++d) {
    ASSERT_CUDA(cudaSetDevice(d));
    before[d] = pa.stats(d).allocation[kAggregate].current;
    ASSERT_CUDA(cudaMalloc(&counters[d], sizeof(unsigned long long)));
    ASSERT_CUDA(cudaMemset(counters[d], 0, sizeof(unsigned long long)));
  }
  for (int d = 0; d < kDevices; ++d) {
    ASSERT_CUDA(cudaSetDevice(d));
    ptrs[d] = pa.malloc(kSize, 0, -1);  // the current device
    ASSERT_NE(ptrs[d], 0u);
    EXPECT_EQ(pa.device_of(ptrs[d]), d);
    ASSERT_CUDA(launch_fill(ptrs[d], kSize, 1000u + static_cast<std::uint32_t>(d), nullptr));
  }
  for (int d = 0; d < kDevices; ++d) {
    EXPECT_EQ(pa.stats(d).allocation[kAggregate].current, before[d] + 1) << "device " << d;
  }
  for (int d = 0; d < kDevices; ++d) {
    ASSERT_CUDA(cudaSetDevice(d));
    ASSERT_CUDA(
        launch_verify(ptrs[d], kSize, 1000u + static_cast<std::uint32_t>(d), nullptr, counters[d]));
    ASSERT_CUDA(cudaDeviceSynchronize());
    unsigned long long bad = 0;
    ASSERT_CUDA(cudaMemcpy(&bad, counters[d], sizeof bad, cudaMemcpyDeviceToHost));
    EXPECT_EQ(bad, 0u) << "device " << d;
  }
  // Free each with the other device current.
  for (int d = 0; d < kDevices; ++d) {
    const int other = 1 - d;
    ASSERT_CUDA(cudaSetDevice(other));
    const std::int64_t other_before = pa.stats(other).allocation[kAggregate].current;
    pa.free(ptrs[d]);
    int current = -1;
    ASSERT_CUDA(cudaGetDevice(&current));
    EXPECT_EQ(current, other) << "free changed the current device";
    EXPECT_EQ(pa.stats(d).allocation[kAggregate].current, before[d]) << "device " << d;
    EXPECT_EQ(pa.stats(other).allocation[kAggregate].current, other_before)
        << "freeing device " << d << "'s pointer touched device " << other << "'s stats";
  }
  for (int d = 0; d < kDevices; ++d) {
    ASSERT_CUDA(cudaSetDevice(d));
    EXPECT_CUDA(cudaFree(counters[d]));
    pa.empty_cache(d);
  }
  ASSERT_CUDA(cudaSetDevice(0));
}

// Mapped memory (expandable segments, the stitching policy's pieces) of device 1 is read
// by a copy on device 0 once device 0 enabled peer access and device 1's allocator granted
// it (Allocator::enable_peer_access, as the PyTorch adapter's enablePeerAccess does); also
// memory mapped after the grant. cudaMalloc memory needs only the runtime's peer access.
TEST(ProcessAllocatorGpu, PeerAccessReachesMappedMemoryOfTheOtherDevice) {
  if (ccalloc::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  int can = 0;
  ASSERT_CUDA(cudaDeviceCanAccessPeer(&can, 0, 1));
  if (can == 0) GTEST_SKIP() << "device 0 cannot access device 1";
  ASSERT_CUDA(cudaSetDevice(0));
  const cudaError_t enabled = cudaDeviceEnablePeerAccess(1, 0);
  if (enabled == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
  } else {
    ASSERT_CUDA(enabled);
  }
  for (const char* conf : {"pytorch,expandable_segments:True", "ccalloc"}) {
    SCOPED_TRACE(conf);
    ccalloc::cuda::CudaDriver driver(1);
    ccalloc::Allocator alloc(driver, ccalloc::Config::parse(conf));
    ASSERT_CUDA(cudaSetDevice(1));
    const DevicePtr before = alloc.malloc(6 * kMiB, 0);  // mapped before the grant
    ASSERT_CUDA(launch_fill(before, 6 * kMiB, 77u, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    alloc.enable_peer_access(0);
    const DevicePtr after = alloc.malloc(30 * kMiB, 0);  // mapped after it
    ASSERT_CUDA(launch_fill(after, 30 * kMiB, 78u, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(driver.peers(), std::vector<int>{0});
    ASSERT_CUDA(cudaSetDevice(0));
    unsigned long long* bad = nullptr;
    ASSERT_CUDA(cudaMalloc(&bad, sizeof *bad));
    for (const auto& [ptr, bytes, seed] :
         {std::tuple{before, 6 * kMiB, 77u}, std::tuple{after, 30 * kMiB, 78u}}) {
      void* copy = nullptr;
      ASSERT_CUDA(cudaMalloc(&copy, bytes));
      ASSERT_CUDA(cudaMemset(bad, 0, sizeof *bad));
      // A plain device-to-device copy run by device 0, reading device 1's mapped memory.
      ASSERT_CUDA(cudaMemcpyAsync(copy, reinterpret_cast<void*>(ptr), bytes,
                                  cudaMemcpyDeviceToDevice, nullptr));
      ASSERT_CUDA(launch_verify(reinterpret_cast<DevicePtr>(copy), bytes, seed, nullptr, bad));
      ASSERT_CUDA(cudaDeviceSynchronize());
      unsigned long long wrong = 1;
      ASSERT_CUDA(cudaMemcpy(&wrong, bad, sizeof wrong, cudaMemcpyDeviceToHost));
      EXPECT_EQ(wrong, 0u) << bytes << " bytes";
      ASSERT_CUDA(cudaFree(copy));
    }
    ASSERT_CUDA(cudaFree(bad));
    ASSERT_CUDA(cudaSetDevice(1));
    alloc.free(before);
    alloc.free(after);
    alloc.empty_cache();
    ASSERT_CUDA(cudaSetDevice(0));
  }
}

// ---------------------------------------------------------------------------------------
// g. Sleep and wake of a sleepable pool (docs/sleep-wake.md): the physical memory of ~1 GiB
// of live allocations goes back to the device (cudaMemGetInfo sees it free) while their
// addresses stay reserved; other memory is allocated and written into the freed space;
// wake maps memory at the same addresses and restores every byte, and a CUDA graph
// captured before the sleep, which reads one allocation of the pool and writes another,
// replays correctly afterwards.

TEST(SleepWakeGpu, SleepReleasesMemoryAndWakeRestoresContentsAndGraphs) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_CUDA(cudaSetDevice(0));
  constexpr int kAllocs = 4;
  constexpr std::size_t kEach = 256 * kMiB;
  constexpr std::size_t kSlept = kAllocs * kEach;  // 1 GiB of live allocations
  ccalloc::cuda::CudaDriver drv(0);
  ccalloc::Allocator alloc(drv, ccalloc::Config::parse("pytorch"));
  alloc.set_check_invariants(true);
  DeviceCounters counters(kAllocs + 2);
  ASSERT_CUDA(load_kernels(counters));
  if (device_free_bytes() < static_cast<std::int64_t>(3 * kSlept)) {
    GTEST_SKIP() << "needs 3 GiB of free device memory";
  }
  cudaStream_t s = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const StreamId sid = stream_id(s);

  const ccalloc::PoolId pool{0, 4242};
  alloc.create_sleepable_pool(pool);
  alloc.begin_allocate_to_pool(pool, [sid](StreamId st) { return st == sid; });
  std::vector<DevicePtr> ptrs;
  for (int i = 0; i < kAllocs; ++i)
    ptrs.push_back(alloc.malloc(kEach, sid));
  // The graph's output: a mismatch counter in the pool too.
  const DevicePtr out = alloc.malloc(sizeof(unsigned long long), sid);
  alloc.end_allocate_to_pool(pool);
  for (int i = 0; i < kAllocs; ++i)
    ASSERT_CUDA(launch_fill(ptrs[i], kEach, 700u + static_cast<std::uint32_t>(i), s));
  ASSERT_CUDA(cudaMemsetAsync(reinterpret_cast<void*>(out), 0, sizeof(unsigned long long), s));

  // The graph: count the words of ptrs[0] that lack their pattern into `out`, and write
  // pattern 790 over ptrs[3]. Captured before the sleep, replayed after the wake.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaStreamSynchronize(s));
  ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  ASSERT_CUDA(launch_verify(ptrs[0], kEach, 700u, s, reinterpret_cast<unsigned long long*>(out)));
  ASSERT_CUDA(launch_fill(ptrs[3], kEach, 790u, s));
  ASSERT_CUDA(cudaStreamEndCapture(s, &graph));
  ASSERT_CUDA(cudaGraphInstantiateWithFlags(&exec, graph, 0));
  ASSERT_CUDA(cudaStreamSynchronize(s));

  const std::int64_t free_awake = device_free_bytes();
  const std::int64_t reserved_awake = alloc.stats().reserved_bytes[kAggregate].current;
  alloc.sleep_pool(pool, ccalloc::SleepMode::kSave);
  ASSERT_TRUE(alloc.pool_asleep(pool));
  const std::int64_t free_asleep = device_free_bytes();
  EXPECT_GE(free_asleep - free_awake, static_cast<std::int64_t>(0.95 * kSlept))
      << "cudaMemGetInfo free grew by " << (free_asleep - free_awake) << " bytes";
  EXPECT_LE(alloc.stats().reserved_bytes[kAggregate].current,
            reserved_awake - static_cast<std::int64_t>(kSlept));
  EXPECT_EQ(alloc.pool_sleep_info(pool).physical_bytes, 0u);

  // Other work takes the freed memory and writes it.
  std::vector<DevicePtr> others;
  for (int i = 0; i < kAllocs; ++i) {
    others.push_back(alloc.malloc(kEach, sid));
    ASSERT_CUDA(launch_fill(others.back(), kEach, 900u + static_cast<std::uint32_t>(i), s));
  }
  for (int i = 0; i < kAllocs; ++i) {
    ASSERT_CUDA(launch_verify(others[i], kEach, 900u + static_cast<std::uint32_t>(i), s,
                              counters.at(static_cast<std::size_t>(i))));
  }
  ASSERT_CUDA(cudaStreamSynchronize(s));
  for (const DevicePtr p : others)
    alloc.free(p);
  alloc.empty_cache();

  alloc.wake_pool(pool);
  EXPECT_FALSE(alloc.pool_asleep(pool));
  std::vector<DevicePtr> live = ptrs;
  live.push_back(out);
  std::sort(live.begin(), live.end());
  EXPECT_EQ(alloc.pool_live_allocations(pool), live);
  EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, reserved_awake);
  // Byte for byte: every word of every allocation holds its pattern again.
  DeviceCounters restored(kAllocs);
  for (int i = 0; i < kAllocs; ++i) {
    ASSERT_CUDA(launch_verify(ptrs[i], kEach, 700u + static_cast<std::uint32_t>(i), s,
                              restored.at(static_cast<std::size_t>(i))));
  }
  ASSERT_CUDA(cudaStreamSynchronize(s));
  EXPECT_EQ(restored.read(), std::vector<unsigned long long>(kAllocs, 0));
  unsigned long long out_value = 1;
  ASSERT_CUDA(cudaMemcpy(&out_value, reinterpret_cast<void*>(out), sizeof out_value,
                         cudaMemcpyDeviceToHost));
  EXPECT_EQ(out_value, 0u) << "the counter's saved value";

  // The graph captured before the sleep replays on the woken memory.
  ASSERT_CUDA(cudaGraphLaunch(exec, s));
  ASSERT_CUDA(launch_verify(ptrs[3], kEach, 790u, s, counters.at(kAllocs)));
  // A control: ptrs[1] does not hold ptrs[0]'s pattern, so the graph's check can fail.
  ASSERT_CUDA(launch_verify(ptrs[1], kEach, 700u, s, counters.at(kAllocs + 1)));
  ASSERT_CUDA(cudaStreamSynchronize(s));
  ASSERT_CUDA(cudaMemcpy(&out_value, reinterpret_cast<void*>(out), sizeof out_value,
                         cudaMemcpyDeviceToHost));
  EXPECT_EQ(out_value, 0u) << "words of ptrs[0] the replayed graph found wrong";
  const std::vector<unsigned long long> c = counters.read();
  for (int i = 0; i < kAllocs; ++i)
    EXPECT_EQ(c[static_cast<std::size_t>(i)], 0u) << "other work " << i;
  EXPECT_EQ(c[kAllocs], 0u) << "words of ptrs[3] the replayed graph did not write";
  // (A word of another pattern matches by chance with probability 2^-32.)
  EXPECT_GE(c[kAllocs + 1], kEach / sizeof(std::uint32_t) - 64) << "the control";

  ASSERT_CUDA(cudaGraphExecDestroy(exec));
  ASSERT_CUDA(cudaGraphDestroy(graph));
  for (const DevicePtr p : live)
    alloc.free(p);
  alloc.release_pool(pool);
  alloc.release_pool(pool);
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, 0);
  ASSERT_CUDA(cudaStreamDestroy(s));
}

// ---------------------------------------------------------------------------------------
// f. The C API on a GPU.

TEST(CApiGpu, MallocFreeStatsSummaryAndErrors) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
#if !CCALLOC_GPU_TEST_HAVE_C_API
  GTEST_SKIP() << "built without the C API library";
#else
  ASSERT_CUDA(cudaSetDevice(0));
  constexpr std::size_t kSize = 1 * kMiB;
  std::int64_t count_before = 0;
  ASSERT_EQ(ccalloc_get_stat(0, "allocation.all.current", &count_before), CCALLOC_SUCCESS)
      << ccalloc_last_error();

  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(&p, kSize, 0, nullptr), CCALLOC_SUCCESS) << ccalloc_last_error();
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 512, 0u);
  // Real device memory: write it and read it back.
  ASSERT_CUDA(cudaMemset(p, 0xA5, kSize));
  std::vector<unsigned char> host(kSize);
  ASSERT_CUDA(cudaMemcpy(host.data(), p, kSize, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::all_of(host.begin(), host.end(), [](unsigned char c) { return c == 0xA5; }));

  std::int64_t count = 0, bytes = 0;
  ASSERT_EQ(ccalloc_get_stat(0, "allocation.all.current", &count), CCALLOC_SUCCESS);
  EXPECT_EQ(count, count_before + 1);
  ASSERT_EQ(ccalloc_get_stat(0, "allocated_bytes.all.current", &bytes), CCALLOC_SUCCESS);
  EXPECT_GE(bytes, static_cast<std::int64_t>(kSize));

  // memory_summary: size with capacity 0, then the whole text, then a truncated copy.
  std::size_t length = 0;
  ASSERT_EQ(ccalloc_memory_summary(0, 0, nullptr, 0, &length), CCALLOC_SUCCESS)
      << ccalloc_last_error();
  ASSERT_GT(length, 0u);
  std::string summary(length + 1, 'x');
  std::size_t length2 = 0;
  ASSERT_EQ(ccalloc_memory_summary(0, 0, summary.data(), summary.size(), &length2),
            CCALLOC_SUCCESS);
  EXPECT_EQ(length2, length);
  EXPECT_EQ(std::strlen(summary.c_str()), length);
  EXPECT_TRUE(contains(summary, "memory summary, device ID 0")) << summary;
  char small[16];
  std::memset(small, 'x', sizeof small);
  std::size_t length3 = 0;
  (void)ccalloc_memory_summary(0, 0, small, sizeof small, &length3);
  EXPECT_EQ(length3, length);
  EXPECT_EQ(small[sizeof small - 1], '\0');
  EXPECT_EQ(std::string(small), summary.substr(0, sizeof small - 1));

  ASSERT_EQ(ccalloc_free(p), CCALLOC_SUCCESS) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_get_stat(0, "allocation.all.current", &count), CCALLOC_SUCCESS);
  EXPECT_EQ(count, count_before);
  EXPECT_EQ(ccalloc_free(nullptr), CCALLOC_SUCCESS);

  // Errors name the pointer.
  void* bogus = reinterpret_cast<void*>(std::uintptr_t{0xdead0000200});
  EXPECT_EQ(ccalloc_free(bogus), CCALLOC_ERROR_INVALID_POINTER);
  EXPECT_TRUE(contains(lower(ccalloc_last_error()), hex(0xdead0000200))) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_free(p), CCALLOC_ERROR_INVALID_POINTER) << "double free";
  EXPECT_TRUE(contains(lower(ccalloc_last_error()), hex(reinterpret_cast<std::uintptr_t>(p))))
      << ccalloc_last_error();
  EXPECT_EQ(ccalloc_empty_cache(0), CCALLOC_SUCCESS);
#endif
}

}  // namespace
