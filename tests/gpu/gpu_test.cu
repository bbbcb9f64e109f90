// GPU tests: ccalloc on real CUDA devices, proven by data.
//
// Kernels write a pattern derived from (allocation id, word index) into every allocation
// and check it before the allocation is freed; an allocator that hands out memory still in
// use (overlapping live blocks, a cross-stream free reused too early) shows up as
// mismatching words. Every test skips itself when no CUDA device is visible, so the suite
// passes on CI machines without a GPU.
//
// The allocator tests run under every kConfigs entry: the native engine with PyTorch's and
// ccalloc's policies, expandable segments (CUDA virtual memory), the stitching policy (CUDA
// virtual memory in whole handles lent between ranges) and the cudaMallocAsync backend (the
// device's stream-ordered pool). SleepWakeGpu checks sleep and wake of a sleepable pool
// (docs/sleep-wake.md). GpuSnapshot.WritesASnapshotOfARealRun writes
// a snapshot of a real run for scripts/check_memory_viz.py; it runs only when
// CCALLOC_GPU_SNAPSHOT_OUT names the file (scripts/gpu-check sets it).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/cuda.hpp"
#include "ccalloc/process.hpp"
#include "ccalloc/snapshot.hpp"
#include "snapshot_file.hpp"
#if CCALLOC_GPU_TEST_HAVE_C_API
#include "ccalloc/ccalloc.h"
#endif

#include "gpu_support.cuh"

namespace {

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins for at least `want_ns` of wall time (the global timer) and `min_cycles` SM cycles,
// or `max_cycles` at most should the timer not advance, THEN writes pattern `id`.
__global__ void spin_then_fill_kernel(std::uint32_t* words, std::size_t count, std::uint32_t id,
                                      long long min_cycles, long long max_cycles,
                                      unsigned long long want_ns) {
  const long long c0 = clock64();
  const unsigned long long t0 = global_timer_ns();
  for (;;) {
    const long long cycles = clock64() - c0;
    const unsigned long long elapsed = global_timer_ns() - t0;
    if ((elapsed >= want_ns && cycles >= min_cycles) || cycles >= max_cycles) break;
  }
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    words[i] = pattern(id, i);
  }
}

// How long the late writer spins: ~`ms` of wall time, measured on the global timer, with
// cycle bounds from the device's peak clock rate as a floor and as a safety stop.
struct SpinPlan {
  long long min_cycles = 0;
  long long max_cycles = 0;
  unsigned long long want_ns = 0;
};

SpinPlan spin_plan(int device, double ms) {
  int khz = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device) != cudaSuccess || khz <= 0) {
    (void)cudaGetLastError();
    khz = 2'000'000;  // 2 GHz: above any current GPU's peak, so the floor stays short
  }
  const double cycles = static_cast<double>(khz) * ms;  // kHz x ms = cycles
  SpinPlan plan;
  plan.min_cycles = static_cast<long long>(cycles / 10);  // the timer may run fast: not < 10 %
  plan.max_cycles = static_cast<long long>(cycles * 20);  // the timer may be stuck: stop
  plan.want_ns = static_cast<unsigned long long>(ms * 1e6);
  return plan;
}

// ---------------------------------------------------------------------------------------
// One device allocator per test, under each configuration.

class GpuAllocatorTest : public ::testing::TestWithParam<const char*> {};

std::string config_test_name(const ::testing::TestParamInfo<const char*>& info) {
  std::string name;
  for (const char* c = info.param; *c != '\0'; ++c) {
    name += std::isalnum(static_cast<unsigned char>(*c)) ? *c : '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Configs, GpuAllocatorTest, ::testing::ValuesIn(kConfigs),
                         config_test_name);

// a. Four host threads, each owning one stream, run >= 100,000 random mallocs and frees;
// every allocation is filled on its stream and verified before it is freed, some also
// read on another stream and handed to record_stream. Any reuse of memory still in use
// corrupts a pattern.
TEST_P(GpuAllocatorTest, FuzzOnFourStreamsFromFourThreadsKeepsEveryAllocationIntact) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_CUDA(cudaSetDevice(0));
  ccalloc::cuda::CudaDriver drv(0);
  ccalloc::Allocator alloc(drv, ccalloc::Config::parse(GetParam()));

  constexpr int kThreads = 4;
  constexpr long kOpsPerThread = 25'000;  // 100,000 in all, before the final frees
  constexpr std::size_t kLiveTarget = 64;
  constexpr std::size_t kMinSize = 512;
  constexpr std::size_t kMaxSize = 8 * kMiB;
  constexpr double kOtherStreamMalloc = 0.05;  // share of mallocs on another thread's stream
  constexpr double kCrossStreamRead = 0.10;    // share of frees read on another stream first

  std::vector<cudaStream_t> streams(kThreads);
  for (auto& s : streams)
    ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  DeviceCounters mismatches(kThreads);

  std::atomic<std::uint32_t> next_id{1};
  std::atomic<long> operations{0};
  std::atomic<long> ooms{0};
  std::atomic<long> cross_stream_reads{0};
  std::atomic<long> bad_allocations{0};  // misaligned or too small
  // The native engine aligns every block to 512 B. The pool's alignment is the driver's:
  // CUDA documents 256 B for device allocations, so that is what the async mode requires;
  // pointers that are 256- but not 512-aligned are counted and reported.
  const bool async = is_async(GetParam());
  const std::size_t required_alignment = async ? 256 : 512;
  std::atomic<long> not_512_aligned{0};
  std::mutex errors_mutex;
  std::vector<std::string> errors;

  auto worker = [&](int self) {
    struct Live {
      DevicePtr ptr;
      std::size_t size;
      std::uint32_t id;
      int stream;  // index into `streams`
    };
    cudaEvent_t ready = nullptr;
    try {
      cuda_or_throw(cudaSetDevice(0), "cudaSetDevice");
      cuda_or_throw(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
      std::mt19937_64 rng(0x5EED0000u + static_cast<unsigned>(self));
      std::uniform_real_distribution<double> unit(0.0, 1.0);
      std::uniform_real_distribution<double> log_size(std::log(static_cast<double>(kMinSize)),
                                                      std::log(static_cast<double>(kMaxSize)));
      std::uniform_int_distribution<int> other_offset(1, kThreads - 1);
      auto other_stream = [&](int of) { return (of + other_offset(rng)) % kThreads; };
      std::vector<Live> live;
      live.reserve(2 * kLiveTarget);
      long ops = 0;

      auto release = [&](std::size_t k) {
        const Live a = live[k];
        live[k] = live.back();
        live.pop_back();
        if (unit(rng) < kCrossStreamRead) {
          const int o = other_stream(a.stream);
          cuda_or_throw(cudaEventRecord(ready, streams[a.stream]), "cudaEventRecord");
          cuda_or_throw(cudaStreamWaitEvent(streams[o], ready, 0), "cudaStreamWaitEvent");
          cuda_or_throw(launch_verify(a.ptr, a.size, a.id, streams[o], mismatches.at(self)),
                        "verify_kernel (other stream)");
          alloc.record_stream(a.ptr, stream_id(streams[o]));
          cross_stream_reads.fetch_add(1, std::memory_order_relaxed);
        }
        cuda_or_throw(launch_verify(a.ptr, a.size, a.id, streams[a.stream], mismatches.at(self)),
                      "verify_kernel");
        alloc.free(a.ptr);
        ++ops;
      };

      for (long step = 0; step < kOpsPerThread; ++step) {
        // The checker takes every arena lock: it must see a consistent state mid-run too.
        if (self == 0 && step % 5000 == 4999) alloc.check_invariants();
        const bool do_malloc = live.empty() || (live.size() < kLiveTarget && unit(rng) < 0.7);
        if (!do_malloc) {
          std::uniform_int_distribution<std::size_t> pick(0, live.size() - 1);
          release(pick(rng));
          continue;
        }
        const auto size =
            std::clamp(static_cast<std::size_t>(std::exp(log_size(rng))), kMinSize, kMaxSize);
        const int s = unit(rng) < kOtherStreamMalloc ? other_stream(self) : self;
        ++ops;
        DevicePtr ptr = 0;
        try {
          ptr = alloc.malloc(size, stream_id(streams[s]));
        } catch (const ccalloc::OutOfMemoryError&) {
          ooms.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        if (ptr % required_alignment != 0 || alloc.allocation_size(ptr) < size) {
          bad_allocations.fetch_add(1, std::memory_order_relaxed);
        }
        if (ptr % 512 != 0) not_512_aligned.fetch_add(1, std::memory_order_relaxed);
        const std::uint32_t id = next_id.fetch_add(1, std::memory_order_relaxed);
        cuda_or_throw(launch_fill(ptr, size, id, streams[s]), "fill_kernel");
        live.push_back({ptr, size, id, s});
      }
      while (!live.empty())
        release(live.size() - 1);
      operations.fetch_add(ops, std::memory_order_relaxed);
    } catch (const std::exception& e) {
      std::lock_guard lock(errors_mutex);
      errors.push_back("thread " + std::to_string(self) + ": " + e.what());
    }
    if (ready != nullptr) (void)cudaEventDestroy(ready);
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back(worker, t);
  for (auto& t : threads)
    t.join();

  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned long long> counts;
  ASSERT_NO_THROW(counts = mismatches.read());
  unsigned long long total_mismatches = 0;
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(counts[t], 0u) << "mismatching words seen by thread " << t;
    total_mismatches += counts[t];
  }
  for (const auto& e : errors)
    ADD_FAILURE() << e;
  EXPECT_EQ(total_mismatches, 0u);
  EXPECT_EQ(ooms.load(), 0) << "unexpected OutOfMemoryError";
  EXPECT_EQ(bad_allocations.load(), 0) << "allocations misaligned or smaller than requested";
  EXPECT_GE(operations.load(), kThreads * kOpsPerThread);
  EXPECT_GT(cross_stream_reads.load(), 0);
  EXPECT_NO_THROW(alloc.check_invariants());
  const ccalloc::DeviceStats stats = alloc.stats();
  EXPECT_EQ(stats.allocation[kAggregate].current, 0);
  EXPECT_EQ(stats.allocated_bytes[kAggregate].current, 0);

  RecordProperty("operations", std::to_string(operations.load()));
  RecordProperty("cross_stream_reads", std::to_string(cross_stream_reads.load()));
  RecordProperty("reserved_bytes_peak", std::to_string(stats.reserved_bytes[kAggregate].peak));
  RecordProperty("not_512_aligned", std::to_string(not_512_aligned.load()));
  std::printf(
      "fuzz [%s]: %ld operations, %ld cross-stream reads, %llu mismatching words, "
      "reserved peak %s, %ld pointers not 512-byte aligned\n",
      GetParam(), operations.load(), cross_stream_reads.load(), total_mismatches,
      ccalloc::format_size(static_cast<std::uint64_t>(stats.reserved_bytes[kAggregate].peak))
          .c_str(),
      not_512_aligned.load());
  for (auto s : streams)
    EXPECT_CUDA(cudaStreamDestroy(s));
}

// b. record_stream, proven by data. B is freed on the host while a kernel on another stream
// S2 is still going to write it; buffers then allocated on S1 must not include B until
// that kernel has finished, else its late write corrupts one of them.
// The cudaMallocAsync backend frees B on S1 behind a wait for S2's work, so the pool may
// hand B's memory to S1 at once: S1's later work is ordered after S2's kernel. There the
// data check alone is the proof; B's address coming back early is expected, and B (the
// pool's memory after the free) is not read.
struct RecordStreamRun {
  bool conclusive = false;  // S2's kernel still ran after every new buffer was queued
  unsigned long long corrupted_words = 0;
  unsigned long long b_words_not_late_pattern = 0;  // B must hold the late pattern (if kept)
  int early_reuses = 0;  // B returned while S2's kernel was provably still running
  bool b_handed_out = false;
  DevicePtr b = 0;
  DevicePtr after_sync = 0;
  double spin_ms = 0;
};

void run_record_stream_case(const char* conf, double spin_ms, RecordStreamRun& run) {
  constexpr std::size_t kSize = 1 * kMiB;
  constexpr int kBuffers = 15;  // odd: S1's 2 MiB small segments end fully used, B aside
  constexpr std::uint32_t kIdB = 1;
  constexpr std::uint32_t kIdLate = 2;
  constexpr std::uint32_t kIdFirstBuffer = 100;

  ASSERT_CUDA(cudaSetDevice(0));
  ccalloc::cuda::CudaDriver drv(0);
  ccalloc::Allocator alloc(drv, ccalloc::Config::parse(conf));
  cudaStream_t s1 = nullptr, s2 = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t ready = nullptr, done = nullptr;
  ASSERT_CUDA(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  ASSERT_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  DeviceCounters counters(2);  // 0: corruption of new buffers, 1: B's late pattern
  const SpinPlan plan = spin_plan(0, spin_ms);
  const std::size_t words = kSize / sizeof(std::uint32_t);

  const DevicePtr b = alloc.malloc(kSize, stream_id(s1));
  run.b = b;
  ASSERT_CUDA(launch_fill(b, kSize, kIdB, s1));
  ASSERT_CUDA(cudaEventRecord(ready, s1));
  ASSERT_CUDA(cudaStreamWaitEvent(s2, ready, 0));
  const auto t0 = std::chrono::steady_clock::now();
  spin_then_fill_kernel<<<1, kThreadsPerBlock, 0, s2>>>(reinterpret_cast<std::uint32_t*>(b), words,
                                                        kIdLate, plan.min_cycles, plan.max_cycles,
                                                        plan.want_ns);
  ASSERT_CUDA(cudaGetLastError());
  ASSERT_CUDA(cudaEventRecord(done, s2));
  alloc.record_stream(b, stream_id(s2));
  alloc.free(b);

  std::vector<DevicePtr> buffers;
  for (int i = 0; i < kBuffers; ++i) {
    const DevicePtr p = alloc.malloc(kSize, stream_id(s1));
    // Checked after malloc returned: if S2's kernel is still running now, it was when the
    // allocator looked at B's pending free.
    const bool kernel_done = event_done(done);
    if (p == b) {
      run.b_handed_out = true;
      if (!kernel_done) ++run.early_reuses;
    }
    ASSERT_CUDA(launch_fill(p, kSize, kIdFirstBuffer + static_cast<std::uint32_t>(i), s1));
    buffers.push_back(p);
  }
  run.conclusive = !event_done(done);

  // Only once both streams are idle has the late write landed: verify after that.
  ASSERT_CUDA(cudaStreamSynchronize(s2));
  run.spin_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_CUDA(cudaStreamSynchronize(s1));
  for (int i = 0; i < kBuffers; ++i) {
    ASSERT_CUDA(launch_verify(buffers[i], kSize, kIdFirstBuffer + static_cast<std::uint32_t>(i), s1,
                              counters.at(0)));
  }
  // B still cached by the allocator holds the late pattern; in the async backend B went
  // back to the pool and is not read.
  if (!run.b_handed_out && !is_async(conf)) {
    ASSERT_CUDA(launch_verify(b, kSize, kIdLate, s1, counters.at(1)));
  }
  ASSERT_CUDA(cudaStreamSynchronize(s1));
  std::vector<unsigned long long> counts;
  ASSERT_NO_THROW(counts = counters.read());
  run.corrupted_words = counts[0];
  run.b_words_not_late_pattern = counts[1];

  // S2 is idle: the next malloc processes B's pending free and, best fit at the lowest
  // address, returns B.
  run.after_sync = alloc.malloc(kSize, stream_id(s1));
  buffers.push_back(run.after_sync);
  for (DevicePtr p : buffers)
    alloc.free(p);
  EXPECT_NO_THROW(alloc.check_invariants());
  EXPECT_CUDA(cudaEventDestroy(ready));
  EXPECT_CUDA(cudaEventDestroy(done));
  EXPECT_CUDA(cudaStreamDestroy(s1));
  EXPECT_CUDA(cudaStreamDestroy(s2));
}

TEST_P(GpuAllocatorTest, BlockFreedWhileAnotherStreamStillUsesItIsNotReusedEarly) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const bool async = is_async(GetParam());
  // The host must queue every new buffer while S2's kernel still runs for the run to prove
  // anything; if it did not (a slow host), spin longer.
  RecordStreamRun run;
  for (double spin_ms : {50.0, 200.0, 800.0}) {
    run = RecordStreamRun{};
    run_record_stream_case(GetParam(), spin_ms, run);
    if (HasFatalFailure()) return;
    EXPECT_EQ(run.corrupted_words, 0u)
        << "a buffer handed out on S1 was overwritten by S2's late write (spin " << spin_ms
        << " ms): the allocator reused B before S2's work completed";
    if (async) {
      // Stream-ordered reuse: allowed, and shown for information.
      std::printf("async [spin %.0f ms]: B's address handed out %d time(s) while S2 still ran\n",
                  spin_ms, run.early_reuses);
      if (run.conclusive) break;
      continue;
    }
    // Secondary: B was never returned while S2's kernel was provably still running.
    EXPECT_EQ(run.early_reuses, 0) << "B (0x" << hex(run.b) << ") handed out before S2 finished";
    if (!run.b_handed_out) {
      EXPECT_EQ(run.b_words_not_late_pattern, 0u)
          << "S2's kernel did not write B: the test's late writer did not run";
      EXPECT_EQ(run.after_sync, run.b)
          << "after S2 synchronised, malloc should return B (best fit, lowest address)";
    }
    if (run.conclusive) break;
  }
  RecordProperty("conclusive", run.conclusive ? "1" : "0");
  RecordProperty("spin_ms", std::to_string(run.spin_ms));
  if (!run.conclusive) {
    std::printf(
        "warning: S2's kernel finished before the host queued every buffer, even "
        "spinning 800 ms: the record_stream test was inconclusive\n");
  }
}

// k. CUDA graph capture in global mode, as torch.cuda.graph does it: the captured
// allocations come from a private pool (a new segment is obtained in relaxed capture mode), a
// block used on another stream and freed during the capture waits for it to end, nothing the
// allocator does invalidates the capture, and replays write the captured addresses, which a
// default-pool allocation made while the graph lives never shares. Under the stitching policy
// the private pool is the native engine's beside it.
TEST_P(GpuAllocatorTest, GraphCaptureAllocatesFromAPrivatePoolAndReplays) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ccalloc::Config config = ccalloc::Config::parse(GetParam());
  const bool async = config.backend == ccalloc::BackendKind::kCudaMallocAsync;
  ccalloc::cuda::CudaDriver driver(0);
  ccalloc::Allocator alloc(driver, config);
  cudaStream_t s = nullptr;
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  const auto sid = reinterpret_cast<StreamId>(s);
  const DevicePtr before = alloc.malloc(kMiB, sid);
  ASSERT_EQ(launch_fill(before, kMiB, 1, s), cudaSuccess);
  alloc.record_stream(before, reinterpret_cast<StreamId>(other));
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);

  const ccalloc::PoolId pool{1, 0};
  alloc.begin_allocate_to_pool(pool, [&driver](StreamId st) { return driver.is_capturing(st); });
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  const DevicePtr a = alloc.malloc(3 * kMiB, sid);
  const DevicePtr b = alloc.malloc(64 * kMiB, sid);
  EXPECT_EQ(launch_fill(a, 3 * kMiB, 2, s), cudaSuccess);
  EXPECT_EQ(launch_fill(b, 64 * kMiB, 3, s), cudaSuccess);
  alloc.free(before);  // used on `other`: its event waits for the capture's end
  alloc.free(a);
  alloc.end_allocate_to_pool(pool);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess) << "the capture was invalidated";
  cudaGraphExec_t exec = nullptr;
  // The async backend's captured allocations are graph memory nodes that the graph does not
  // free: relaunching frees them first, as PyTorch instantiates such graphs.
  ASSERT_EQ(cudaGraphInstantiateWithFlags(&exec, graph,
                                          async ? cudaGraphInstantiateFlagAutoFreeOnLaunch : 0),
            cudaSuccess);

  const DevicePtr outside = alloc.malloc(64 * kMiB, sid);
  if (!async) {
    EXPECT_EQ(alloc.segment_pool(b), pool);
    EXPECT_EQ(alloc.segment_pool(outside), ccalloc::PoolId{});
    EXPECT_NE(outside, b);
  }
  ASSERT_EQ(launch_fill(outside, 64 * kMiB, 4, s), cudaSuccess);
  for (int replay = 0; replay < 3; ++replay)
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  DeviceCounters mismatches(2);
  ASSERT_EQ(launch_verify(b, 64 * kMiB, 3, s, mismatches.at(0)), cudaSuccess);
  ASSERT_EQ(launch_verify(outside, 64 * kMiB, 4, s, mismatches.at(1)), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(mismatches.read(), (std::vector<unsigned long long>{0, 0}));

  alloc.free(outside);
  alloc.free(b);
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  alloc.release_pool(pool);
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().allocation[kAggregate].current, 0);
  if (!async) {
    EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, 0);
    alloc.check_invariants();
  }
  ASSERT_EQ(cudaStreamDestroy(other), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

// l. graph_capture_record_stream_reuse on a real capture (docs/graph-capture-reuse.md): a
// block of the capturing stream read by a kernel on a forked stream and freed is not reused
// before the capturing stream joins the fork, and is reused after; the capture stays valid,
// and replays read the old contents on the fork before the capturing stream overwrites them.
// The cudaMallocAsync backend has no such setting (its pool orders reuse itself).
TEST_P(GpuAllocatorTest, GraphCaptureReusesABlockOnceItsReaderHasJoined) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ccalloc::Config config = ccalloc::Config::parse(GetParam());
  if (config.backend == ccalloc::BackendKind::kCudaMallocAsync) {
    GTEST_SKIP() << "the cudaMallocAsync backend does not reuse inside a capture";
  }
  config.graph_capture_record_stream_reuse = true;
  ccalloc::cuda::CudaDriver driver(0);
  ccalloc::Allocator alloc(driver, config);
  cudaStream_t s1 = nullptr;
  cudaStream_t s2 = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), cudaSuccess);
  const auto id1 = reinterpret_cast<StreamId>(s1);
  const auto id2 = reinterpret_cast<StreamId>(s2);
  DeviceCounters mismatches(2);

  ASSERT_EQ(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal), cudaSuccess);
  ccalloc::CaptureInfo info;
  ASSERT_TRUE(driver.capture_info(id1, info));
  const std::uint64_t capture = info.id;
  const ccalloc::PoolId pool{2, 0};
  alloc.begin_allocate_to_pool(pool, [&driver, capture](StreamId st) {
    ccalloc::CaptureInfo i;
    return driver.capture_info(st, i) && i.id == capture;
  });
  const DevicePtr a = alloc.malloc(kMiB, id1);
  EXPECT_EQ(launch_fill(a, kMiB, 5, s1), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(fork, s1), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(s2, fork, 0), cudaSuccess);
  EXPECT_EQ(launch_verify(a, kMiB, 5, s2, mismatches.at(0)), cudaSuccess);
  alloc.record_stream(a, id2);
  alloc.free(a);
  const DevicePtr b = alloc.malloc(kMiB, id1);
  EXPECT_NE(b, a) << "reused while the fork may still read it";
  ASSERT_EQ(cudaEventRecord(join, s2), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(s1, join, 0), cudaSuccess);
  const DevicePtr c = alloc.malloc(kMiB, id1);
  EXPECT_EQ(c, a) << "not reused after the capturing stream joined the fork";
  EXPECT_EQ(launch_fill(c, kMiB, 6, s1), cudaSuccess);
  EXPECT_EQ(launch_verify(c, kMiB, 6, s1, mismatches.at(1)), cudaSuccess);
  alloc.end_allocate_to_pool(pool);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s1, &graph), cudaSuccess) << "the capture was invalidated";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiateWithFlags(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 3; ++replay)
    ASSERT_EQ(cudaGraphLaunch(exec, s1), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s1), cudaSuccess);
  EXPECT_EQ(mismatches.read(), (std::vector<unsigned long long>{0, 0}));

  alloc.free(b);
  alloc.free(c);
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  alloc.release_pool(pool);
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().allocation[kAggregate].current, 0);
  EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, 0);
  alloc.check_invariants();
  ASSERT_EQ(cudaEventDestroy(join), cudaSuccess);
  ASSERT_EQ(cudaEventDestroy(fork), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(s2), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(s1), cudaSuccess);
}

// c. A real OOM: 1 GiB blocks until the device is full. The error says what was asked for;
// afterwards the allocator gives the memory back and serves 1 GiB again. With expandable
// segments the device fills page by page inside one reservation; with the async backend
// the pool grows until the driver refuses, and the error is PyTorch's
// CUDAMallocAsyncAllocator message.
TEST_P(GpuAllocatorTest, RealOutOfMemoryIsReportedAndTheAllocatorRecovers) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_CUDA(cudaSetDevice(0));
  const bool async = is_async(GetParam());
  ccalloc::cuda::CudaDriver drv(0);
  ccalloc::Allocator alloc(drv, ccalloc::Config::parse(GetParam()));
  const std::size_t total = alloc.mem_get_info().total_bytes;
  const std::size_t max_blocks = total / kGiB + 8;

  std::vector<DevicePtr> blocks;
  std::string message;
  bool oom = false;
  for (std::size_t i = 0; i < max_blocks && !oom; ++i) {
    try {
      blocks.push_back(alloc.malloc(kGiB));
    } catch (const ccalloc::OutOfMemoryError& e) {
      oom = true;
      message = e.what();
      EXPECT_EQ(e.requested_bytes(), kGiB);
      EXPECT_EQ(e.device(), 0);
    }
  }
  ASSERT_TRUE(oom) << "no OutOfMemoryError after " << blocks.size() << " GiB";
  EXPECT_GT(blocks.size(), 0u);
  EXPECT_TRUE(contains(message, "out of memory")) << message;
  if (async) {
    // "Allocation on device 0 would exceed allowed memory. (out of memory)\n...Requested
    // : 1024.00 MiB ...": the request in PyTorch's format_size.
    EXPECT_TRUE(contains(message, "Allocation on device 0 would exceed allowed memory")) << message;
    EXPECT_TRUE(contains(message, "Requested               : 1024.00 MiB")) << message;
  } else {
    // The request, in bytes and in PyTorch's format_size (1 GiB prints as "1024.00 MiB").
    EXPECT_TRUE(contains(message, "1073741824 bytes")) << message;
    EXPECT_TRUE(contains(message, "Tried to allocate 1024.00 MiB")) << message;
  }
  // The async backend fills only allocated/active/reserved bytes "all", the allocation
  // count and num_ooms: all of these hold in every mode.
  EXPECT_EQ(alloc.stats().num_ooms, 1);
  EXPECT_EQ(alloc.stats().allocation[kAggregate].current, static_cast<std::int64_t>(blocks.size()));
  EXPECT_GE(alloc.stats().allocated_bytes[kAggregate].current,
            static_cast<std::int64_t>(blocks.size() * kGiB));
  if (async) {
    // The pool's figures: active = allocated = its used bytes, within its reserved bytes;
    // what the pool does not report (segments, splits, retries) stays 0, as in PyTorch.
    const ccalloc::DeviceStats s = alloc.stats();
    EXPECT_EQ(s.active_bytes[kAggregate].current, s.allocated_bytes[kAggregate].current);
    EXPECT_LE(s.allocated_bytes[kAggregate].current, s.reserved_bytes[kAggregate].current);
    EXPECT_EQ(s.segment[kAggregate].current, 0);
    EXPECT_EQ(s.num_alloc_retries, 0);
  }
  EXPECT_NO_THROW(alloc.check_invariants());
  std::printf("OOM [%s] after %zu x 1 GiB: %s\n", GetParam(), blocks.size(), message.c_str());

  for (DevicePtr p : blocks)
    alloc.free(p);
  const std::int64_t reserved_before = alloc.stats().reserved_bytes[kAggregate].current;
  std::size_t free_before = 0, free_after = 0, total_now = 0;
  ASSERT_CUDA(cudaMemGetInfo(&free_before, &total_now));
  alloc.empty_cache();
  ASSERT_CUDA(cudaMemGetInfo(&free_after, &total_now));
  const std::int64_t reserved_after = alloc.stats().reserved_bytes[kAggregate].current;
  const std::int64_t released = reserved_before - reserved_after;
  EXPECT_GE(reserved_before, static_cast<std::int64_t>(blocks.size() * kGiB));
  if (async) {
    // cudaMemPoolTrimTo(0) after a device synchronize: the pool keeps nothing it can release.
    EXPECT_LE(reserved_after, static_cast<std::int64_t>(64 * kMiB));
  } else {
    EXPECT_EQ(reserved_after, 0);
  }
  EXPECT_GE(static_cast<std::int64_t>(free_after) - static_cast<std::int64_t>(free_before),
            released - static_cast<std::int64_t>(64 * kMiB))
      << "empty_cache released " << released << " bytes of segments, but the device's free "
      << "memory went from " << free_before << " to " << free_after;

  DevicePtr again = 0;
  EXPECT_NO_THROW(again = alloc.malloc(kGiB));
  EXPECT_NE(again, 0u);
  if (again != 0) alloc.free(again);
  EXPECT_EQ(alloc.stats().num_ooms, 1);
  EXPECT_NO_THROW(alloc.check_invariants());
}

// d. The per-process memory fraction caps reserved memory on a real device, and the OOM
// it causes names the setting. The async backend caps the bytes it has handed out (as
// PyTorch's does), so there the cap is on allocated bytes; its message names the limit.
TEST_P(GpuAllocatorTest, MemoryFractionCapsReservedMemory) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_CUDA(cudaSetDevice(0));
  const bool async = is_async(GetParam());
  ccalloc::cuda::CudaDriver drv(0);
  ccalloc::Allocator alloc(drv, ccalloc::Config::parse(GetParam()));
  constexpr double kFraction = 0.05;
  constexpr std::size_t kBlock = 256 * kMiB;
  // The async backend's peaks are the device pool's, which outlives allocators (the OOM
  // test filled it): start them afresh. A no-op for a new native allocator.
  alloc.reset_peak_stats();
  alloc.set_memory_fraction(kFraction);
  const std::size_t total = alloc.mem_get_info().total_bytes;
  const auto limit = static_cast<std::size_t>(kFraction * static_cast<double>(total));

  std::vector<DevicePtr> blocks;
  std::string message;
  bool oom = false;
  for (std::size_t i = 0; i < limit / kBlock + 8 && !oom; ++i) {
    try {
      blocks.push_back(alloc.malloc(kBlock));
    } catch (const ccalloc::OutOfMemoryError& e) {
      oom = true;
      message = e.what();
    }
  }
  ASSERT_TRUE(oom) << "no OutOfMemoryError after " << blocks.size() << " x 256 MiB";
  EXPECT_LE(blocks.size(), limit / kBlock);
  EXPECT_GE(blocks.size() + 1, limit / kBlock) << "the fraction refused memory below its limit";
  const ccalloc::DeviceStats stats = alloc.stats();
  if (async) {
    EXPECT_LE(stats.allocated_bytes[kAggregate].peak, static_cast<std::int64_t>(limit));
    EXPECT_TRUE(contains(message, "would exceed allowed memory")) << message;
    EXPECT_TRUE(contains(message, "memory fraction")) << message;
    EXPECT_TRUE(contains(message, ccalloc::format_size(limit))) << message;
  } else {
    EXPECT_LE(stats.reserved_bytes[kAggregate].peak, static_cast<std::int64_t>(limit));
    EXPECT_TRUE(contains(message, "per_process_memory_fraction")) << message;
  }
  for (DevicePtr p : blocks)
    alloc.free(p);
  EXPECT_NO_THROW(alloc.check_invariants());
  alloc.empty_cache();
}

// ---------------------------------------------------------------------------------------
// d2. Expandable segments give memory back: empty_cache unmaps the pages of wholly free
// ranges and releases their physical memory, which cudaMemGetInfo then sees free again;
// pages are mapped on demand, so the segment's reservation (address space for 9/8 of the
// device) costs no memory.

TEST(ExpandableSegmentsGpu, EmptyCacheReturnsUnmappedPagesToTheDevice) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_CUDA(cudaSetDevice(0));
  constexpr int kBlocks = 8;
  constexpr std::size_t kBytes = kBlocks * kGiB;
  constexpr std::int64_t kSlack = 64 * kMiB;  // partial pages, the driver's own bookkeeping
  // Mapping 8 GiB may cost the driver page tables too; the reservation, were it backed,
  // would cost 9/8 of the device: any bound far below that proves it is not.
  constexpr std::int64_t kMappingOverhead = 512 * kMiB;
  ccalloc::cuda::CudaDriver drv(0);
  ccalloc::Allocator alloc(drv, ccalloc::Config::parse("pytorch,expandable_segments:True"));
  DeviceCounters counters(1);
  ASSERT_CUDA(load_kernels(counters));
  const std::int64_t free0 = device_free_bytes();
  if (free0 < static_cast<std::int64_t>(kBytes + 2 * kGiB)) {
    GTEST_SKIP() << "needs " << kBlocks + 2 << " GiB of free device memory";
  }

  std::vector<DevicePtr> blocks;
  for (int i = 0; i < kBlocks; ++i) {
    const DevicePtr p = alloc.malloc(kGiB);
    ASSERT_NE(p, 0u);
    ASSERT_CUDA(launch_fill(p, kGiB, 500u + static_cast<std::uint32_t>(i), nullptr));
    blocks.push_back(p);
  }
  for (int i = 0; i < kBlocks; ++i) {
    ASSERT_CUDA(launch_verify(blocks[i], kGiB, 500u + static_cast<std::uint32_t>(i), nullptr,
                              counters.at(0)));
  }
  std::vector<unsigned long long> counts;
  ASSERT_NO_THROW(counts = counters.read());
  EXPECT_EQ(counts[0], 0u) << "mismatching words in the mapped pages";

  const std::int64_t free1 = device_free_bytes();
  const ccalloc::DeviceStats mapped = alloc.stats();
  const std::int64_t reserved = mapped.reserved_bytes[kAggregate].current;
  EXPECT_GE(reserved, static_cast<std::int64_t>(kBytes));
  EXPECT_LE(reserved, static_cast<std::int64_t>(kBytes) + kSlack);
  EXPECT_GE(free0 - free1, static_cast<std::int64_t>(kBytes))
      << "8 GiB live, but the device's free memory fell by only " << free0 - free1;
  EXPECT_LE(free0 - free1, static_cast<std::int64_t>(kBytes) + kMappingOverhead)
      << "pages are mapped on demand: the reservation itself should take no memory";
  const std::vector<ccalloc::SegmentInfo> segments = alloc.segments();
  ASSERT_EQ(segments.size(), 1u) << "one expandable segment for the stream's large pool";
  EXPECT_TRUE(segments[0].is_expandable);

  for (DevicePtr p : blocks)
    alloc.free(p);
  // Freed blocks stay mapped and cached until empty_cache.
  EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, reserved);
  const std::int64_t free2 = device_free_bytes();
  alloc.empty_cache();
  const std::int64_t free3 = device_free_bytes();
  const std::int64_t reserved_after = alloc.stats().reserved_bytes[kAggregate].current;
  EXPECT_EQ(reserved_after, 0) << "every page was wholly free";
  EXPECT_TRUE(alloc.segments().empty());
  EXPECT_GE(free3 - free2, static_cast<std::int64_t>(kBytes) - kSlack)
      << "empty_cache unmapped " << reserved - reserved_after << " bytes, but the device's "
      << "free memory went only from " << free2 << " to " << free3;
  EXPECT_NO_THROW(alloc.check_invariants());
  std::printf(
      "expandable: 8 x 1 GiB mapped %s (device free -%s); empty_cache gave back %s to the "
      "device\n",
      ccalloc::format_size(static_cast<std::uint64_t>(reserved)).c_str(),
      ccalloc::format_size(static_cast<std::uint64_t>(free0 - free1)).c_str(),
      ccalloc::format_size(static_cast<std::uint64_t>(std::max<std::int64_t>(0, free3 - free2)))
          .c_str());

  // The segment maps pages again on the next request.
  const DevicePtr again = alloc.malloc(kGiB);
  ASSERT_NE(again, 0u);
  ASSERT_CUDA(launch_fill(again, kGiB, 600u, nullptr));
  ASSERT_CUDA(launch_verify(again, kGiB, 600u, nullptr, counters.at(0)));
  ASSERT_NO_THROW(counts = counters.read());
  EXPECT_EQ(counts[0], 0u);
  alloc.free(again);
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, 0);
  EXPECT_NO_THROW(alloc.check_invariants());
}

}  // namespace

// d3. The snapshot test's workload. External linkage and never inlined, so that its name is
// a frame of every stack recorded inside it, also where stacks are symbolized from the
// dynamic symbol table alone (gpu_test links with -rdynamic). Its types are outside the
// unnamed namespace too: one of those in its signature would make the symbol local.
namespace ccalloc_gpu_test {

// One live allocation of the snapshot workload.
struct SnapshotLive {
  ccalloc::DevicePtr ptr = 0;
  std::size_t size = 0;
  std::uint32_t id = 0;
  cudaStream_t stream = nullptr;
};

__attribute__((noinline)) void WritesASnapshotOfARealRun_workload(ccalloc::Allocator& alloc,
                                                                  cudaStream_t s1, cudaStream_t s2,
                                                                  std::vector<SnapshotLive>& live,
                                                                  unsigned long long* mismatches) {
  // Small-pool and large-pool sizes, unrounded so that rounding shows as internal free.
  constexpr std::size_t kSizes[] = {
      512,      3000,          64 * kKiB, 700 * kKiB,     1 * kMiB, 2 * kMiB + 4 * kKiB,
      6 * kMiB, 13 * kMiB + 1, 40 * kMiB, 96 * kMiB + 100};
  constexpr int kFirstStep = 40;
  constexpr int kSecondStep = 8;
  std::vector<SnapshotLive> step;
  alloc.annotate("step_1", true);
  for (int i = 0; i < kFirstStep; ++i) {
    SnapshotLive a;
    a.size = kSizes[i % 10] + 1000 * static_cast<std::size_t>(i / 10);
    a.stream = i % 3 == 2 ? s2 : s1;
    a.id = 1000u + static_cast<std::uint32_t>(i);
    a.ptr = alloc.malloc(a.size, stream_id(a.stream));
    cuda_or_throw(launch_fill(a.ptr, a.size, a.id, a.stream), "fill_kernel");
    step.push_back(a);
  }
  // record_stream: S1's first block is read on S2, then freed while that read may still run.
  cudaEvent_t ready = nullptr;
  cuda_or_throw(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
  cuda_or_throw(cudaEventRecord(ready, step[0].stream), "cudaEventRecord");
  cuda_or_throw(cudaStreamWaitEvent(s2, ready, 0), "cudaStreamWaitEvent");
  cuda_or_throw(launch_verify(step[0].ptr, step[0].size, step[0].id, s2, mismatches),
                "verify_kernel (S2)");
  alloc.record_stream(step[0].ptr, stream_id(s2));
  // Two thirds are freed (after a check of their data), the recorded block among them.
  for (int i = 0; i < kFirstStep; ++i) {
    const SnapshotLive& a = step[static_cast<std::size_t>(i)];
    if (i % 3 == 0 && i != 0) {
      live.push_back(a);
      continue;
    }
    cuda_or_throw(launch_verify(a.ptr, a.size, a.id, a.stream, mismatches), "verify_kernel");
    alloc.free(a.ptr);
  }
  alloc.annotate("step_1", false);
  // Wholly free segments go back to the device (segment_free entries in the trace).
  alloc.empty_cache();
  alloc.annotate("step_2", true);
  for (int i = 0; i < kSecondStep; ++i) {
    SnapshotLive a;
    a.size = kSizes[(3 * i + 1) % 10] + 512 * static_cast<std::size_t>(i);
    a.stream = i % 2 == 1 ? s2 : s1;
    a.id = 2000u + static_cast<std::uint32_t>(i);
    a.ptr = alloc.malloc(a.size, stream_id(a.stream));
    cuda_or_throw(launch_fill(a.ptr, a.size, a.id, a.stream), "fill_kernel");
    live.push_back(a);
  }
  alloc.annotate("step_2", false);
  cuda_or_throw(cudaEventDestroy(ready), "cudaEventDestroy");
}

}  // namespace ccalloc_gpu_test

namespace {

using ccalloc_gpu_test::SnapshotLive;

// A snapshot of a real run, written for scripts/check_memory_viz.py (PyTorch's
// torch.cuda._memory_viz reads it there): history with C++ stacks on every entry, blocks
// live on two streams, cached free blocks, a record_stream and an empty_cache behind them.
TEST(GpuSnapshot, WritesASnapshotOfARealRun) {
  const char* out = std::getenv("CCALLOC_GPU_SNAPSHOT_OUT");
  if (out == nullptr || *out == '\0') {
    GTEST_SKIP() << "set CCALLOC_GPU_SNAPSHOT_OUT=FILE (.pickle, .json, optionally .gz) to run";
  }
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_CUDA(cudaSetDevice(0));
  ccalloc::cuda::CudaDriver drv(0);
  ccalloc::Allocator alloc(drv, ccalloc::Config::parse("pytorch"));
  ccalloc::HistoryOptions history;
  history.enabled = ccalloc::HistoryOptions::Enabled::kAll;
  history.context = ccalloc::HistoryOptions::Context::kAll;
  history.stacks = ccalloc::HistoryOptions::Stacks::kCpp;
  alloc.record_history(history);

  cudaStream_t s1 = nullptr, s2 = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  DeviceCounters mismatches(1);
  std::vector<SnapshotLive> live;
  ASSERT_NO_THROW(
      ccalloc_gpu_test::WritesASnapshotOfARealRun_workload(alloc, s1, s2, live, mismatches.at(0)));
  ASSERT_CUDA(cudaDeviceSynchronize());

  const ccalloc::Snapshot snap = alloc.snapshot();
  ASSERT_NO_THROW(ccalloc_gpu_test::write_snapshot_file(out, snap));
  std::printf("snapshot of a real run: %s\n", out);

  // Segments: on device 0, tiled by their blocks in address order, sizes adding up.
  ASSERT_FALSE(snap.segments.empty());
  std::size_t allocated_blocks = 0;
  for (const ccalloc::SnapshotSegment& seg : snap.segments) {
    SCOPED_TRACE("segment 0x" + hex(seg.address));
    EXPECT_EQ(seg.device, 0);
    ASSERT_FALSE(seg.blocks.empty());
    DevicePtr next = seg.address;
    std::size_t allocated = 0;
    for (const ccalloc::SnapshotBlock& b : seg.blocks) {
      EXPECT_EQ(b.address, next) << "blocks must tile the segment";
      next = b.address + b.size;
      if (b.state == ccalloc::BlockState::kActiveAllocated) {
        allocated += b.size;
        ++allocated_blocks;
        EXPECT_LE(b.requested_size, b.size);
        EXPECT_TRUE(b.frames != nullptr) << "a live block without the stack of its allocation";
      }
    }
    EXPECT_EQ(next, seg.address + seg.total_size) << "blocks must cover the segment";
    EXPECT_EQ(seg.allocated_size, allocated);
  }
  EXPECT_EQ(allocated_blocks, live.size());
  for (const SnapshotLive& a : live) {
    bool found = false;
    for (const ccalloc::SnapshotSegment& seg : snap.segments) {
      for (const ccalloc::SnapshotBlock& b : seg.blocks) {
        if (b.address == a.ptr && b.state == ccalloc::BlockState::kActiveAllocated) {
          found = true;
          EXPECT_EQ(b.requested_size, a.size);
          EXPECT_EQ(seg.stream, stream_id(a.stream));
        }
      }
    }
    EXPECT_TRUE(found) << "live block 0x" << hex(a.ptr) << " is not in the snapshot";
  }

  // The trace: every kind of entry the workload caused, stacks naming the workload.
  ASSERT_GE(snap.device_traces.size(), 1u);
  const auto& trace = snap.device_traces[0];
  ASSERT_FALSE(trace.empty());
  std::map<std::string, int> actions;
  int allocs = 0, allocs_naming_workload = 0, entries_with_frames = 0;
  for (const ccalloc::SnapshotTraceEntry& e : trace) {
    ++actions[std::string(ccalloc::to_string(e.action))];
    if (e.frames != nullptr && !e.frames->empty()) ++entries_with_frames;
    if (e.action != ccalloc::TraceAction::kAlloc) continue;
    ++allocs;
    bool names = false;
    if (e.frames != nullptr) {
      for (const ccalloc::Frame& f : *e.frames)
        names = names || contains(f.name, "WritesASnapshotOfARealRun");
    }
    if (names) ++allocs_naming_workload;
  }
  for (const char* action :
       {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "snapshot"}) {
    EXPECT_GT(actions[action], 0) << "no '" << action << "' entry in the trace";
  }
  EXPECT_EQ(allocs, 48);
  EXPECT_EQ(allocs_naming_workload, allocs)
      << "every alloc entry's stack should name WritesASnapshotOfARealRun_workload";
  EXPECT_EQ(snap.external_annotations.size(), 4u);
  if (!trace.empty() && trace.front().frames != nullptr) {
    std::printf("first entry's stack (%zu frames):\n", trace.front().frames->size());
    for (const ccalloc::Frame& f : *trace.front().frames)
      std::printf("  %s  %s:%lld\n", f.name.c_str(), f.filename.c_str(),
                  static_cast<long long>(f.line));
  }
  std::printf("%zu segments, %zu trace entries (%d with stacks), %zu live blocks\n",
              snap.segments.size(), trace.size(), entries_with_frames, live.size());

  // The file reads back as the same snapshot.
  ccalloc::Snapshot back;
  ASSERT_NO_THROW(back = ccalloc_gpu_test::read_snapshot_file(out));
  EXPECT_EQ(back.segments.size(), snap.segments.size());
  ASSERT_GE(back.device_traces.size(), 1u);
  EXPECT_EQ(back.device_traces[0].size(), trace.size());

  // The live data is intact; then everything goes back.
  for (const SnapshotLive& a : live)
    ASSERT_CUDA(launch_verify(a.ptr, a.size, a.id, a.stream, mismatches.at(0)));
  std::vector<unsigned long long> counts;
  ASSERT_NO_THROW(counts = mismatches.read());
  EXPECT_EQ(counts[0], 0u);
  for (const SnapshotLive& a : live)
    alloc.free(a.ptr);
  ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_NO_THROW(alloc.check_invariants());
  EXPECT_CUDA(cudaStreamDestroy(s1));
  EXPECT_CUDA(cudaStreamDestroy(s2));
}

}  // namespace
