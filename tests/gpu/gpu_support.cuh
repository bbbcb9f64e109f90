// What the GPU test programs share: CUDA helpers, the kernels that fill and verify an
// allocation's pattern, device counters, the configurations every allocator test runs under.
// Included by one .cu file per program part; everything here is internal to each.
#pragma once

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

namespace {

using ccalloc::DevicePtr;
using ccalloc::kAggregate;
using ccalloc::StreamId;

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * kKiB;
constexpr std::size_t kGiB = 1024 * kMiB;

// The allocator configurations every allocator test runs under.
// "ccalloc" is the stitching policy with private pools on expandable segments beside it;
// "ccalloc,expandable_segments:False" puts those pools on native segments.
constexpr const char* kConfigs[] = {"pytorch", "ccalloc", "pytorch,expandable_segments:True",
                                    "ccalloc,expandable_segments:False",
                                    "backend:cudaMallocAsync"};

// The cudaMallocAsync backend: the pool decides placement and reuse; statistics come from
// the pool (allocated/active/reserved bytes "all"), and its OOM message is PyTorch's
// CUDAMallocAsyncAllocator's.
inline bool is_async(const char* conf) {
  return ccalloc::Config::parse(conf).backend == ccalloc::BackendKind::kCudaMallocAsync;
}

// ---------------------------------------------------------------------------------------
// CUDA helpers

inline ::testing::AssertionResult CudaOk(const char* expr, cudaError_t err) {
  if (err == cudaSuccess) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << expr << " failed: " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ")";
}
#define ASSERT_CUDA(expr) ASSERT_PRED_FORMAT1(CudaOk, expr)
#define EXPECT_CUDA(expr) EXPECT_PRED_FORMAT1(CudaOk, expr)

// For code outside a test body (worker threads): a CUDA failure becomes an exception.
inline void cuda_or_throw(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
  }
}

// True once `event` has completed; never blocks.
inline bool event_done(cudaEvent_t event) {
  const cudaError_t err = cudaEventQuery(event);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  cuda_or_throw(err, "cudaEventQuery");
  return false;
}

inline StreamId stream_id(cudaStream_t stream) {
  return reinterpret_cast<std::uintptr_t>(stream);
}

inline std::string hex(std::uintptr_t value) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%" PRIxPTR, value);
  return buf;
}

inline std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ---------------------------------------------------------------------------------------
// Kernels: fill an allocation with its pattern, verify it, and a late writer.

__device__ __forceinline__ std::uint32_t pattern(std::uint32_t id, std::size_t word) {
  std::uint32_t x = id * 0x9E3779B1u ^ static_cast<std::uint32_t>(word) * 0x85EBCA77u ^
                    static_cast<std::uint32_t>(word >> 32) * 0xC2B2AE3Du;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  x *= 0x297A2D39u;
  x ^= x >> 15;
  return x;
}

__global__ void fill_kernel(std::uint32_t* words, std::size_t count, std::uint32_t id) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    words[i] = pattern(id, i);
  }
}

__global__ void verify_kernel(const std::uint32_t* words, std::size_t count, std::uint32_t id,
                              unsigned long long* mismatches) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    if (words[i] != pattern(id, i)) ++bad;
  }
  if (bad != 0) atomicAdd(mismatches, bad);
}

constexpr unsigned kThreadsPerBlock = 256;

inline unsigned grid_for(std::size_t words) {
  const std::size_t blocks = (words + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<unsigned>(std::clamp<std::size_t>(blocks, 1, 1024));
}

// Launches return the launch error (cudaGetLastError), cudaSuccess when queued.
inline cudaError_t launch_fill(DevicePtr ptr, std::size_t bytes, std::uint32_t id, cudaStream_t stream) {
  const std::size_t words = bytes / sizeof(std::uint32_t);
  fill_kernel<<<grid_for(words), kThreadsPerBlock, 0, stream>>>(
      reinterpret_cast<std::uint32_t*>(ptr), words, id);
  return cudaGetLastError();
}

inline cudaError_t launch_verify(DevicePtr ptr, std::size_t bytes, std::uint32_t id, cudaStream_t stream,
                          unsigned long long* mismatches) {
  const std::size_t words = bytes / sizeof(std::uint32_t);
  verify_kernel<<<grid_for(words), kThreadsPerBlock, 0, stream>>>(
      reinterpret_cast<const std::uint32_t*>(ptr), words, id, mismatches);
  return cudaGetLastError();
}

// Device memory outside any allocator, for mismatch counters.
class DeviceCounters {
 public:
  explicit DeviceCounters(std::size_t n) : n_(n) {
    cuda_or_throw(cudaMalloc(&counters_, n * sizeof(unsigned long long)), "cudaMalloc(counters)");
    cuda_or_throw(cudaMemset(counters_, 0, n * sizeof(unsigned long long)), "cudaMemset");
  }
  ~DeviceCounters() { (void)cudaFree(counters_); }
  DeviceCounters(const DeviceCounters&) = delete;
  DeviceCounters& operator=(const DeviceCounters&) = delete;

  unsigned long long* at(std::size_t i) const { return counters_ + i; }
  // Copies the counters back (synchronises with the device).
  std::vector<unsigned long long> read() const {
    std::vector<unsigned long long> host(n_);
    cuda_or_throw(
        cudaMemcpy(host.data(), counters_, n_ * sizeof(unsigned long long), cudaMemcpyDeviceToHost),
        "cudaMemcpy(counters)");
    return host;
  }

 private:
  std::size_t n_;
  unsigned long long* counters_ = nullptr;
};

// Free device memory as cudaMemGetInfo reports it.
inline std::int64_t device_free_bytes() {
  std::size_t free_bytes = 0, total = 0;
  cuda_or_throw(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
  return static_cast<std::int64_t>(free_bytes);
}

// Launches the fill and verify kernels once on nothing: lazy module loading takes device
// memory on a kernel's first launch, which a test that measures free memory must not see.
inline cudaError_t load_kernels(const DeviceCounters& counters) {
  cudaError_t err = launch_fill(0, 0, 0, nullptr);
  if (err == cudaSuccess) err = launch_verify(0, 0, 0, nullptr, counters.at(0));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  return err;
}

}  // namespace
