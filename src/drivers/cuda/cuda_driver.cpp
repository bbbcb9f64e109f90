// The CUDA driver over the CUDA runtime (linked statically: no libcudart needed at run
// time, and libcuda is only opened by the runtime when a device is asked for).
#include "ccalloc/cuda.hpp"

#include <chrono>
#include <cinttypes>
#include <cstdio>

#include "ccalloc/errors.hpp"
#include "ccalloc/stats.hpp"

#if CCALLOC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ccalloc::cuda {

#if CCALLOC_HAVE_CUDA
namespace {

[[noreturn]] void fail(const char* what, cudaError_t err, int device) {
  (void)cudaGetLastError();  // leave no sticky error behind
  char buf[320];
  std::snprintf(buf, sizeof buf, "ccalloc: %s failed on CUDA device %d: %s (%s)", what, device,
                cudaGetErrorString(err), cudaGetErrorName(err));
  throw DriverError(buf);
}

void check(cudaError_t err, const char* what, int device) {
  if (err != cudaSuccess) fail(what, err, device);
}

// Makes `device` current for the scope of one driver call and restores the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice", device);
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice", device);
  }
  ~DeviceGuard() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

cudaStream_t to_stream(StreamId s) { return reinterpret_cast<cudaStream_t>(s); }
cudaEvent_t to_event(EventId e) { return reinterpret_cast<cudaEvent_t>(e); }

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

int current_device() {
  int d = 0;
  check(cudaGetDevice(&d), "cudaGetDevice", -1);
  return d;
}

RuntimeInfo probe() {
  RuntimeInfo info;
  info.built_with_cuda = true;
  (void)cudaRuntimeGetVersion(&info.runtime_version);
  (void)cudaDriverGetVersion(&info.driver_version);
  const cudaError_t err = cudaGetDeviceCount(&info.device_count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    info.device_count = 0;
    info.error = std::string(cudaGetErrorString(err)) + " (" + cudaGetErrorName(err) + ")";
    return info;
  }
  if (info.device_count == 0) info.error = "the CUDA driver reports no devices";
  for (int d = 0; d < info.device_count; ++d) {
    DeviceInfo dev;
    dev.ordinal = d;
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess) {
      dev.name = prop.name;
      dev.total_bytes = prop.totalGlobalMem;
      dev.compute_capability_major = prop.major;
      dev.compute_capability_minor = prop.minor;
    }
    int previous = 0;
    if (cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(d) == cudaSuccess) {
      std::size_t free_bytes = 0, total_bytes = 0;
      if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
        dev.free_bytes = free_bytes;
        dev.total_bytes = total_bytes;
      }
      (void)cudaSetDevice(previous);
    }
    (void)cudaGetLastError();
    info.devices.push_back(std::move(dev));
  }
  return info;
}

CudaDriver::CudaDriver(int device) : device_(device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw DriverError(std::string("ccalloc: no CUDA device is usable in this process: ") +
                      cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")");
  }
  if (device < 0 || device >= count) {
    throw DriverError("ccalloc: CUDA device " + std::to_string(device) + " does not exist (" +
                      std::to_string(count) + " visible)");
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties", device);
  name_ = std::string(prop.name) + " (CUDA device " + std::to_string(device) + ", " +
          format_size(prop.totalGlobalMem) + ")";
}

CudaDriver::~CudaDriver() = default;

DevicePtr CudaDriver::allocate(std::size_t bytes) {
  DeviceGuard guard(device_);
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // OOM is a value: clear the error cudaMalloc left
    return 0;
  }
  check(err, "cudaMalloc", device_);
  return reinterpret_cast<DevicePtr>(p);
}

void CudaDriver::free(DevicePtr ptr, std::size_t /*bytes*/) {
  DeviceGuard guard(device_);
  check(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree", device_);
}

MemInfo CudaDriver::mem_info() {
  DeviceGuard guard(device_);
  MemInfo info;
  check(cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo", device_);
  return info;
}

EventId CudaDriver::create_event() {
  DeviceGuard guard(device_);
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags",
        device_);
  return reinterpret_cast<EventId>(e);
}

void CudaDriver::destroy_event(EventId event) {
  DeviceGuard guard(device_);
  check(cudaEventDestroy(to_event(event)), "cudaEventDestroy", device_);
}

void CudaDriver::record_event(EventId event, StreamId stream) {
  DeviceGuard guard(device_);
  check(cudaEventRecord(to_event(event), to_stream(stream)), "cudaEventRecord", device_);
}

bool CudaDriver::query_event(EventId event) {
  const cudaError_t err = cudaEventQuery(to_event(event));
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  fail("cudaEventQuery", err, device_);
}

void CudaDriver::synchronize_event(EventId event) {
  check(cudaEventSynchronize(to_event(event)), "cudaEventSynchronize", device_);
}

void CudaDriver::synchronize_stream(StreamId stream) {
  DeviceGuard guard(device_);
  check(cudaStreamSynchronize(to_stream(stream)), "cudaStreamSynchronize", device_);
}

#else  // built without the CUDA toolkit

namespace {
[[noreturn]] void unavailable() {
  throw DriverError("ccalloc: this build has no CUDA support (the CUDA toolkit was not found "
                    "when it was configured)");
}
}  // namespace

int device_count() { return 0; }
int current_device() { unavailable(); }
RuntimeInfo probe() {
  RuntimeInfo info;
  info.error = "ccalloc was built without CUDA support";
  return info;
}
CudaDriver::CudaDriver(int device) : device_(device) { unavailable(); }
CudaDriver::~CudaDriver() = default;
DevicePtr CudaDriver::allocate(std::size_t) { unavailable(); }
void CudaDriver::free(DevicePtr, std::size_t) { unavailable(); }
MemInfo CudaDriver::mem_info() { unavailable(); }
EventId CudaDriver::create_event() { unavailable(); }
void CudaDriver::destroy_event(EventId) { unavailable(); }
void CudaDriver::record_event(EventId, StreamId) { unavailable(); }
bool CudaDriver::query_event(EventId) { unavailable(); }
void CudaDriver::synchronize_event(EventId) { unavailable(); }
void CudaDriver::synchronize_stream(StreamId) { unavailable(); }

#endif

std::int64_t CudaDriver::now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}


// --- not yet implemented (virtual memory and the stream-ordered pool) ---
namespace {
[[noreturn]] void not_yet(const char* what) {
  throw ccalloc::DriverError(std::string("ccalloc: ") + what + " is not implemented yet");
}
}  // namespace
std::size_t CudaDriver::vm_granularity() { not_yet("vm_granularity"); }
DevicePtr CudaDriver::reserve_address_range(std::size_t) { not_yet("reserve_address_range"); }
void CudaDriver::free_address_range(DevicePtr, std::size_t) { not_yet("free_address_range"); }
PhysicalHandle CudaDriver::create_physical(std::size_t) { not_yet("create_physical"); }
void CudaDriver::release_physical(PhysicalHandle, std::size_t) { not_yet("release_physical"); }
void CudaDriver::map(DevicePtr, std::size_t, PhysicalHandle) { not_yet("map"); }
void CudaDriver::unmap(DevicePtr, std::size_t) { not_yet("unmap"); }
DevicePtr CudaDriver::allocate_async(std::size_t, StreamId) { not_yet("allocate_async"); }
void CudaDriver::free_async(DevicePtr, std::size_t, StreamId) { not_yet("free_async"); }
void CudaDriver::stream_wait_event(StreamId, EventId) { not_yet("stream_wait_event"); }
void CudaDriver::pool_trim(std::size_t) { not_yet("pool_trim"); }
PoolUsage CudaDriver::pool_usage() { not_yet("pool_usage"); }
void CudaDriver::pool_reset_peaks() { not_yet("pool_reset_peaks"); }
void CudaDriver::synchronize_device() { not_yet("synchronize_device"); }

}  // namespace ccalloc::cuda
