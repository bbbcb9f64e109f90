// The CUDA driver over the CUDA runtime (linked statically: no libcudart needed at run
// time, and libcuda is only opened by the runtime when a device is asked for). The
// virtual-memory calls are driver API functions that the runtime looks up for us, so
// libcuda stays a run-time dependency only.
#include <dlfcn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ccalloc/cuda.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/stats.hpp"
#include "core/format.hpp"

#if CCALLOC_HAVE_CUDA
// <cuda.h> and <cudaTypedefs.h> are headers only: the driver API's types, enums and
// function-pointer types. No cu* function is called by name.
#include <cuda.h>
#include <cudaTypedefs.h>
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
// bind_context: also when it is current already, because cudaSetDevice is what binds the
// device's primary context to this thread, which driver API calls (cuMem*) need; a
// runtime call would bind it lazily, a driver API call does not.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device, bool bind_context = false) {
    check(cudaGetDevice(&previous_), "cudaGetDevice", device);
    if (previous_ != device || bind_context) check(cudaSetDevice(device), "cudaSetDevice", device);
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

cudaStream_t to_stream(StreamId s) {
  return reinterpret_cast<cudaStream_t>(s);
}
cudaEvent_t to_event(EventId e) {
  return reinterpret_cast<cudaEvent_t>(e);
}

// The driver API functions used for virtual memory, looked up once per process. The
// function-pointer types are those of the ABI version each symbol has had since CUDA 10.2.
struct DriverApi {
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 get_allocation_granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 export_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 import_handle = nullptr;
};

// The ABI version asked for: the newest version of each symbol at or below it.
constexpr unsigned kDriverApiVersion = 12000;

template <typename Fn>
void load_entry_point(const char* symbol, Fn& fn, int device) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &p, kDriverApiVersion, cudaEnableDefault, &status);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(symbol, &p, cudaEnableDefault, &status);
#endif
  if (err != cudaSuccess) {
    fail((std::string("looking up the driver entry point ") + symbol).c_str(), err, device);
  }
  if (status != cudaDriverEntryPointSuccess || p == nullptr) {
    throw DriverError(std::string("ccalloc: the CUDA driver of device ") + std::to_string(device) +
                      " has no entry point " + symbol + " (query status " +
                      std::to_string(static_cast<int>(status)) +
                      "): virtual memory needs a driver for CUDA 10.2 or later");
  }
  fn = reinterpret_cast<Fn>(p);
}

const DriverApi& driver_api(int device) {
  static std::once_flag once;
  static DriverApi api;
  // A lookup that throws leaves the flag unset, so a later call tries again.
  std::call_once(once, [device] {
    DriverApi a;
    load_entry_point("cuGetErrorName", a.get_error_name, device);
    load_entry_point("cuMemGetAllocationGranularity", a.get_allocation_granularity, device);
    load_entry_point("cuMemAddressReserve", a.address_reserve, device);
    load_entry_point("cuMemAddressFree", a.address_free, device);
    load_entry_point("cuMemCreate", a.create, device);
    load_entry_point("cuMemRelease", a.release, device);
    load_entry_point("cuMemMap", a.map, device);
    load_entry_point("cuMemSetAccess", a.set_access, device);
    load_entry_point("cuMemUnmap", a.unmap, device);
    load_entry_point("cuMemExportToShareableHandle", a.export_handle, device);
    load_entry_point("cuMemImportFromShareableHandle", a.import_handle, device);
    api = a;
  });
  return api;
}

// `call` names the driver API call and its arguments, e.g. "cuMemMap(0x7f.., 2097152 bytes)".
[[noreturn]] void cu_fail(const DriverApi& api, CUresult r, const std::string& call, int device) {
  const char* name = nullptr;
  if (api.get_error_name == nullptr || api.get_error_name(r, &name) != CUDA_SUCCESS ||
      name == nullptr) {
    name = "unknown error";
  }
  throw DriverError("ccalloc: " + call + " failed on CUDA device " + std::to_string(device) + ": " +
                    name + " (" + std::to_string(static_cast<int>(r)) + ")");
}

void cu_check(const DriverApi& api, CUresult r, const std::string& call, int device) {
  if (r != CUDA_SUCCESS) cu_fail(api, r, call, device);
}

std::string range_args(DevicePtr va, std::size_t bytes) {
  return hex_address(va) + ", " + std::to_string(bytes) + " bytes";
}

// Pinned device memory on `device`: what expandable segments map.
CUmemAllocationProp device_allocation(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

cudaMemPool_t to_pool(void* p) {
  return static_cast<cudaMemPool_t>(p);
}

// Lets device `peer` read and write the stream-ordered pool of `device`.
void grant_pool_access(cudaMemPool_t pool, int peer, int device) {
  cudaMemAccessDesc desc{};
  desc.location.type = cudaMemLocationTypeDevice;
  desc.location.id = peer;
  desc.flags = cudaMemAccessFlagsProtReadWrite;
  check(cudaMemPoolSetAccess(pool, &desc, 1), "cudaMemPoolSetAccess", device);
}

// Obtaining new memory may happen while a CUDA graph is being captured (allocations to a
// private pool): in relaxed capture mode cudaMalloc and the cuMem* calls that back an
// expandable segment are legal and stay out of the graph (PyTorch's
// cudaMallocMaybeCapturing). The calling thread's mode is restored afterwards.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};
// The CUDA handle type of a share kind. Fabric handles exist since CUDA 12.3.
CUmemAllocationHandleType handle_type(ShareKind kind, int device) {
  if (kind == ShareKind::kPosixFd) return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
#if CUDA_VERSION >= 12030
  (void)device;
  return CU_MEM_HANDLE_TYPE_FABRIC;
#else
  throw DriverError("ccalloc: this build's CUDA (before 12.3) has no fabric handles (device " +
                    std::to_string(device) + ")");
#endif
}

unsigned requested_handle_types(unsigned kinds, int device) {
  unsigned types = 0;
  for (const ShareKind k : {ShareKind::kPosixFd, ShareKind::kFabric}) {
    if (kinds & share_kind_bit(k)) types |= static_cast<unsigned>(handle_type(k, device));
  }
  return types;
}

unsigned initial_exportable_kinds() {
  const char* env = std::getenv("TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC");
  if (env != nullptr && std::strcmp(env, "0") == 0) return 0;
  return share_kind_bit(ShareKind::kPosixFd);
}

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

// This process's copy of descriptor `fd` of process `pid`.
int copy_descriptor(int pid, int fd, int device) {
  const auto fail_with = [&](const char* call, int err) {
    throw DriverError(std::string("ccalloc: ") + call + " for descriptor " + std::to_string(fd) +
                      " of process " + std::to_string(pid) + " failed on CUDA device " +
                      std::to_string(device) + ": " + std::strerror(err) +
                      (err == ENOSYS ? " (the kernel lacks it: Linux 5.6 or later is needed)"
                       : err == EPERM ? " (this process may not ptrace the exporter)"
                                      : ""));
  };
  const long pidfd = syscall(SYS_pidfd_open, pid, 0);
  if (pidfd < 0) fail_with("pidfd_open", errno);
  const long mine = syscall(SYS_pidfd_getfd, pidfd, fd, 0);
  const int err = errno;
  close(static_cast<int>(pidfd));
  if (mine < 0) fail_with("pidfd_getfd", err);
  return static_cast<int>(mine);
}

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

CudaDriver::CudaDriver(int device) : device_(device), exportable_kinds_(initial_exportable_kinds()) {
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

CudaDriver::~CudaDriver() {
  for (const auto& [handle, fd] : exported_fds_)
    close(fd);
}

class CudaDriver::Counted {
 public:
  // Counts one call of each kind named (cuMemMap and cuMemSetAccess go together).
  Counted(std::atomic<std::uint64_t>& ns, std::initializer_list<std::atomic<std::uint64_t>*> kinds)
      : ns_(ns), start_(std::chrono::steady_clock::now()) {
    for (std::atomic<std::uint64_t>* k : kinds)
      k->fetch_add(1, std::memory_order_relaxed);
  }
  ~Counted() {
    const auto d = std::chrono::steady_clock::now() - start_;
    ns_.fetch_add(
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()),
        std::memory_order_relaxed);
  }
  Counted(const Counted&) = delete;
  Counted& operator=(const Counted&) = delete;

 private:
  std::atomic<std::uint64_t>& ns_;
  std::chrono::steady_clock::time_point start_;
};

CudaDriver::MemoryCalls CudaDriver::memory_calls() const {
  MemoryCalls c;
  c.malloc = malloc_calls_.load(std::memory_order_relaxed);
  c.free = free_calls_.load(std::memory_order_relaxed);
  c.create = create_calls_.load(std::memory_order_relaxed);
  c.release = release_calls_.load(std::memory_order_relaxed);
  c.map = map_calls_.load(std::memory_order_relaxed);
  c.set_access = set_access_calls_.load(std::memory_order_relaxed);
  c.unmap = unmap_calls_.load(std::memory_order_relaxed);
  c.ns = call_ns_.load(std::memory_order_relaxed);
  return c;
}

DevicePtr CudaDriver::allocate(std::size_t bytes) {
  DeviceGuard guard(device_);
  const RelaxedCaptureMode relaxed;
  const Counted counted(call_ns_, {&malloc_calls_});
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
  const Counted counted(call_ns_, {&free_calls_});
  check(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree", device_);
}

MemInfo CudaDriver::mem_info() {
  DeviceGuard guard(device_);
  MemInfo info;
  check(cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo", device_);
  return info;
}

// NVML, loaded on first use (libnvidia-ml.so.1 comes with the driver): the compute processes
// on a device, for the out-of-memory message. The structure is NVML's nvmlProcessInfo_v2_t,
// which its _v3 query fills; no NVML header is needed at build time.
namespace {

struct NvmlProcessInfo {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};

struct Nvml {
  using Init = int (*)();
  using HandleByPciBusId = int (*)(const char*, void**);
  using ComputeProcesses = int (*)(void*, unsigned int*, NvmlProcessInfo*);
  HandleByPciBusId handle_by_pci_bus_id = nullptr;
  ComputeProcesses compute_processes = nullptr;
  bool ok = false;
};

const Nvml& nvml() {
  static const Nvml loaded = [] {
    Nvml n;
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (lib == nullptr) return n;
    const auto init = reinterpret_cast<Nvml::Init>(dlsym(lib, "nvmlInit_v2"));
    n.handle_by_pci_bus_id =
        reinterpret_cast<Nvml::HandleByPciBusId>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    n.compute_processes = reinterpret_cast<Nvml::ComputeProcesses>(
        dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
    n.ok = init != nullptr && n.handle_by_pci_bus_id != nullptr && n.compute_processes != nullptr &&
           init() == 0;
    return n;
  }();
  return loaded;
}

}  // namespace

std::vector<Driver::ProcessMemory> CudaDriver::processes_on_device() {
  const Nvml& n = nvml();
  if (!n.ok) return {};
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  void* handle = nullptr;
  if (n.handle_by_pci_bus_id(bus_id, &handle) != 0) return {};
  constexpr int kInsufficientSize = 7;  // NVML_ERROR_INSUFFICIENT_SIZE
  std::vector<NvmlProcessInfo> infos(8);
  for (int tries = 0; tries < 4; ++tries) {
    auto count = static_cast<unsigned int>(infos.size());
    const int r = n.compute_processes(handle, &count, infos.data());
    if (r == kInsufficientSize) {
      infos.resize(std::size_t{count} + 8);
      continue;
    }
    if (r != 0) return {};
    std::vector<ProcessMemory> out;
    for (unsigned int i = 0; i < count && i < infos.size(); ++i) {
      out.push_back(ProcessMemory{static_cast<long>(infos[i].pid),
                                  static_cast<std::size_t>(infos[i].used_gpu_memory)});
    }
    return out;
  }
  return {};
}

EventId CudaDriver::create_event() {
  DeviceGuard guard(device_);
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags", device_);
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

bool CudaDriver::is_capturing(StreamId stream) {
  DeviceGuard guard(device_);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(to_stream(stream), &status), "cudaStreamIsCapturing", device_);
  return status != cudaStreamCaptureStatusNone;
}

bool CudaDriver::capture_info(StreamId stream, CaptureInfo& out) {
  DeviceGuard guard(device_);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  std::size_t n = 0;
  check(cudaStreamGetCaptureInfo(to_stream(stream), &status, &id, nullptr, &deps, &edges, &n),
        "cudaStreamGetCaptureInfo", device_);
  // An invalidated capture will fail at its end: nothing in it is worth reusing.
  out.capturing = status == cudaStreamCaptureStatusActive;
  out.id = out.capturing ? id : 0;
  out.terminals.clear();
  if (out.capturing) {
    for (std::size_t i = 0; i < n; ++i)
      out.terminals.push_back(reinterpret_cast<GraphNode>(deps[i]));
  }
  return out.capturing;
}

void CudaDriver::node_dependencies(GraphNode node, std::vector<GraphNode>& out) {
  DeviceGuard guard(device_);
  const auto n = reinterpret_cast<cudaGraphNode_t>(node);
  std::size_t count = 0;
  check(cudaGraphNodeGetDependencies(n, nullptr, nullptr, &count), "cudaGraphNodeGetDependencies",
        device_);
  std::vector<cudaGraphNode_t> deps(count);
  std::vector<cudaGraphEdgeData> edges(count);
  if (count != 0) {
    check(cudaGraphNodeGetDependencies(n, deps.data(), edges.data(), &count),
          "cudaGraphNodeGetDependencies", device_);
  }
  out.clear();
  for (std::size_t i = 0; i < count && i < deps.size(); ++i)
    out.push_back(reinterpret_cast<GraphNode>(deps[i]));
}

// --- Virtual memory (driver API) ---

std::size_t CudaDriver::vm_granularity() {
  std::lock_guard lock(lazy_mutex_);
  if (granularity_ == 0) {
    const DriverApi& api = driver_api(device_);
    DeviceGuard guard(device_, /*bind_context=*/true);
    const CUmemAllocationProp prop = device_allocation(device_);
    std::size_t g = 0;
    cu_check(api, api.get_allocation_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
             "cuMemGetAllocationGranularity", device_);
    granularity_ = g;
  }
  return granularity_;
}

DevicePtr CudaDriver::reserve_address_range(std::size_t bytes) {
  const DriverApi& api = driver_api(device_);
  DeviceGuard guard(device_, /*bind_context=*/true);
  const RelaxedCaptureMode relaxed;
  CUdeviceptr base = 0;
  cu_check(api, api.address_reserve(&base, bytes, 0, 0, 0),
           "cuMemAddressReserve(" + std::to_string(bytes) + " bytes)", device_);
  return static_cast<DevicePtr>(base);
}

void CudaDriver::free_address_range(DevicePtr base, std::size_t bytes) {
  const DriverApi& api = driver_api(device_);
  DeviceGuard guard(device_, /*bind_context=*/true);
  cu_check(api, api.address_free(static_cast<CUdeviceptr>(base), bytes),
           "cuMemAddressFree(" + range_args(base, bytes) + ")", device_);
}

PhysicalHandle CudaDriver::create_physical(std::size_t bytes) {
  const DriverApi& api = driver_api(device_);
  DeviceGuard guard(device_, /*bind_context=*/true);
  const RelaxedCaptureMode relaxed;
  CUmemAllocationProp prop = device_allocation(device_);
  prop.requestedHandleTypes = static_cast<CUmemAllocationHandleType>(
      requested_handle_types(exportable_kinds_.load(std::memory_order_relaxed), device_));
  CUmemGenericAllocationHandle handle = 0;
  const CUresult r = [&] {
    const Counted counted(call_ns_, {&create_calls_});
    return api.create(&handle, bytes, &prop, 0);
  }();
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    (void)cudaGetLastError();  // OOM is a value: leave no error behind
    return 0;
  }
  cu_check(api, r, "cuMemCreate(" + std::to_string(bytes) + " bytes)", device_);
  return static_cast<PhysicalHandle>(handle);
}

void CudaDriver::release_physical(PhysicalHandle handle, std::size_t bytes) {
  {
    std::lock_guard lock(fds_mutex_);
    const auto fd = exported_fds_.find(handle);
    if (fd != exported_fds_.end()) {
      close(fd->second);
      exported_fds_.erase(fd);
    }
  }
  const DriverApi& api = driver_api(device_);
  DeviceGuard guard(device_, /*bind_context=*/true);
  const RelaxedCaptureMode relaxed;
  const Counted counted(call_ns_, {&release_calls_});
  cu_check(api, api.release(static_cast<CUmemGenericAllocationHandle>(handle)),
           "cuMemRelease(handle of " + std::to_string(bytes) + " bytes)", device_);
}

void CudaDriver::map(DevicePtr va, std::size_t bytes, PhysicalHandle handle) {
  const DriverApi& api = driver_api(device_);
  DeviceGuard guard(device_, /*bind_context=*/true);
  const RelaxedCaptureMode relaxed;
  const auto ptr = static_cast<CUdeviceptr>(va);
  const Counted counted(call_ns_, {&map_calls_, &set_access_calls_});
  cu_check(api, api.map(ptr, bytes, 0, static_cast<CUmemGenericAllocationHandle>(handle), 0),
           "cuMemMap(" + range_args(va, bytes) + ")", device_);
  std::lock_guard lock(peers_mutex_);
  set_access_or_unmap(va, bytes);
}

void CudaDriver::set_access_or_unmap(DevicePtr va, std::size_t bytes) {
  const DriverApi& api = driver_api(device_);
  const auto ptr = static_cast<CUdeviceptr>(va);
  std::vector<CUmemAccessDesc> access(1 + peers_.size());
  for (std::size_t i = 0; i < access.size(); ++i) {
    access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[i].location.id = i == 0 ? device_ : peers_[i - 1];
    access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  const CUresult r = api.set_access(ptr, bytes, access.data(), access.size());
  if (r != CUDA_SUCCESS) {
    (void)api.unmap(ptr, bytes);  // leave the range as it was
    cu_fail(api, r,
            "cuMemSetAccess(" + range_args(va, bytes) + ", read/write for " +
                std::to_string(access.size()) + " device(s))",
            device_);
  }
  mapped_[va] = bytes;
}

void CudaDriver::add_peer(int peer) {
  if (peer == device_ || peer < 0) {
    throw DriverError("ccalloc: add_peer(" + std::to_string(peer) + ") on device " +
                      std::to_string(device_) + ": a peer is another, existing device");
  }
  const DriverApi& api = driver_api(device_);
  DeviceGuard guard(device_, /*bind_context=*/true);
  {
    std::lock_guard lock(peers_mutex_);
    if (std::find(peers_.begin(), peers_.end(), peer) != peers_.end()) return;
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = peer;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // Contiguous mappings in one call (a range may span several whole mappings).
    for (auto it = mapped_.begin(); it != mapped_.end();) {
      const DevicePtr start = it->first;
      DevicePtr end = start + it->second;
      for (++it; it != mapped_.end() && it->first == end; ++it)
        end += it->second;
      const Counted counted(call_ns_, {&set_access_calls_});
      cu_check(api, api.set_access(static_cast<CUdeviceptr>(start), end - start, &access, 1),
               "cuMemSetAccess(" + range_args(start, end - start) + ", read/write for peer " +
                   std::to_string(peer) + ")",
               device_);
    }
    peers_.push_back(peer);
  }
  std::lock_guard lock(lazy_mutex_);
  if (pool_ != nullptr) grant_pool_access(to_pool(pool_), peer, device_);
}

std::vector<int> CudaDriver::peers() const {
  std::lock_guard lock(peers_mutex_);
  return peers_;
}

void CudaDriver::map_range(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                           std::size_t offset) {
  const DriverApi& api = driver_api(device_);
  DeviceGuard guard(device_, /*bind_context=*/true);
  const auto ptr = static_cast<CUdeviceptr>(va);
  const Counted counted(call_ns_, {&map_calls_, &set_access_calls_});
  cu_check(api, api.map(ptr, bytes, offset, static_cast<CUmemGenericAllocationHandle>(handle), 0),
           "cuMemMap(" + range_args(va, bytes) + ", offset " + std::to_string(offset) + ")",
           device_);
  std::lock_guard lock(peers_mutex_);
  set_access_or_unmap(va, bytes);
}

void CudaDriver::unmap(DevicePtr va, std::size_t bytes) {
  const DriverApi& api = driver_api(device_);
  DeviceGuard guard(device_, /*bind_context=*/true);
  const Counted counted(call_ns_, {&unmap_calls_});
  cu_check(api, api.unmap(static_cast<CUdeviceptr>(va), bytes),
           "cuMemUnmap(" + range_args(va, bytes) + ")", device_);
  std::lock_guard lock(peers_mutex_);
  mapped_.erase(mapped_.lower_bound(va), mapped_.lower_bound(va + bytes));
}

// --- Sharing with other processes ---

void CudaDriver::set_exportable_kinds(unsigned kinds) {
  (void)requested_handle_types(kinds, device_);  // throws for a kind this build lacks
  exportable_kinds_.store(kinds, std::memory_order_relaxed);
}

unsigned CudaDriver::exportable_kinds() const {
  return exportable_kinds_.load(std::memory_order_relaxed);
}

std::string CudaDriver::export_physical(PhysicalHandle handle, ShareKind kind) {
  const DriverApi& api = driver_api(device_);
  if (kind == ShareKind::kPosixFd) {
    std::lock_guard lock(fds_mutex_);
    auto it = exported_fds_.find(handle);
    if (it == exported_fds_.end()) {
      DeviceGuard guard(device_, /*bind_context=*/true);
      int fd = -1;
      cu_check(api,
               api.export_handle(&fd, static_cast<CUmemGenericAllocationHandle>(handle),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               "cuMemExportToShareableHandle(POSIX file descriptor)", device_);
      it = exported_fds_.emplace(handle, fd).first;
    }
    const std::int32_t fd = it->second;
    return std::string(reinterpret_cast<const char*>(&fd), sizeof fd);
  }
  DeviceGuard guard(device_, /*bind_context=*/true);
  std::string out(share_kind_bytes(kind), '\0');
  cu_check(api,
           api.export_handle(out.data(), static_cast<CUmemGenericAllocationHandle>(handle),
                             handle_type(kind, device_), 0),
           "cuMemExportToShareableHandle(fabric)", device_);
  return out;
}

PhysicalHandle CudaDriver::import_physical(std::string_view exported, ShareKind kind, int pid,
                                           std::size_t bytes) {
  const DriverApi& api = driver_api(device_);
  if (exported.size() != share_kind_bytes(kind)) {
    throw DriverError("ccalloc: import_physical of " + std::to_string(exported.size()) +
                      " bytes on CUDA device " + std::to_string(device_) + ": expected " +
                      std::to_string(share_kind_bytes(kind)));
  }
  DeviceGuard guard(device_, /*bind_context=*/true);
  CUmemGenericAllocationHandle handle = 0;
  if (kind == ShareKind::kPosixFd) {
    std::int32_t theirs = 0;
    std::memcpy(&theirs, exported.data(), sizeof theirs);
    const int mine = copy_descriptor(pid, theirs, device_);
    const CUresult r = api.import_handle(
        &handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(mine)),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(mine);
    cu_check(api, r,
             "cuMemImportFromShareableHandle(descriptor " + std::to_string(theirs) +
                 " of process " + std::to_string(pid) + ", " + std::to_string(bytes) + " bytes)",
             device_);
  } else {
    std::string copy(exported);
    cu_check(api, api.import_handle(&handle, copy.data(), handle_type(kind, device_)),
             "cuMemImportFromShareableHandle(fabric handle of process " + std::to_string(pid) + ")",
             device_);
  }
  return static_cast<PhysicalHandle>(handle);
}

std::string CudaDriver::export_allocation(DevicePtr base) {
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)), "cudaIpcGetMemHandle", device_);
  static_assert(sizeof h == kAllocationHandleBytes);
  return std::string(reinterpret_cast<const char*>(&h), sizeof h);
}

DevicePtr CudaDriver::open_allocation(std::string_view exported) {
  if (exported.size() != kAllocationHandleBytes) {
    throw DriverError("ccalloc: open_allocation of " + std::to_string(exported.size()) +
                      " bytes on CUDA device " + std::to_string(device_) +
                      ": a cudaIpcMemHandle_t has 64");
  }
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, exported.data(), sizeof h);
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle",
        device_);
  return reinterpret_cast<DevicePtr>(p);
}

void CudaDriver::close_allocation(DevicePtr ptr) {
  DeviceGuard guard(device_);
  check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle", device_);
}

// --- The stream-ordered pool (runtime API) ---

void* CudaDriver::default_pool() {
  std::lock_guard lock(lazy_mutex_);
  if (pool_ == nullptr) {
    DeviceGuard guard(device_);
    cudaMemPool_t pool = nullptr;
    check(cudaDeviceGetDefaultMemPool(&pool, device_), "cudaDeviceGetDefaultMemPool", device_);
    // Keep what the pool reserves: the default threshold (0) returns memory to the OS at
    // every synchronize.
    cuuint64_t threshold = UINT64_MAX;
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
          "cudaMemPoolSetAttribute(ReleaseThreshold)", device_);
    int on = 1;
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseFollowEventDependencies, &on),
          "cudaMemPoolSetAttribute(ReuseFollowEventDependencies)", device_);
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowOpportunistic, &on),
          "cudaMemPoolSetAttribute(ReuseAllowOpportunistic)", device_);
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &on),
          "cudaMemPoolSetAttribute(ReuseAllowInternalDependencies)", device_);
    for (const int peer : peers())  // peers added before the pool's first use
      grant_pool_access(pool, peer, device_);
    pool_ = pool;
  }
  return pool_;
}

// From the default pool by name rather than the device's current pool (cudaMallocAsync),
// so that allocations, trims and usage all concern the one pool configured above.
DevicePtr CudaDriver::allocate_async(std::size_t bytes, StreamId stream) {
  cudaMemPool_t pool = to_pool(default_pool());
  DeviceGuard guard(device_);
  void* p = nullptr;
  const cudaError_t err = cudaMallocFromPoolAsync(&p, bytes, pool, to_stream(stream));
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // OOM is a value: clear the error
    return 0;
  }
  check(err, "cudaMallocFromPoolAsync", device_);
  return reinterpret_cast<DevicePtr>(p);
}

void CudaDriver::free_async(DevicePtr ptr, std::size_t /*bytes*/, StreamId stream) {
  DeviceGuard guard(device_);
  check(cudaFreeAsync(reinterpret_cast<void*>(ptr), to_stream(stream)), "cudaFreeAsync", device_);
}

void CudaDriver::stream_wait_event(StreamId stream, EventId event) {
  DeviceGuard guard(device_);
  check(cudaStreamWaitEvent(to_stream(stream), to_event(event), 0), "cudaStreamWaitEvent", device_);
}

void CudaDriver::pool_trim(std::size_t keep_bytes) {
  cudaMemPool_t pool = to_pool(default_pool());
  DeviceGuard guard(device_);
  check(cudaMemPoolTrimTo(pool, keep_bytes), "cudaMemPoolTrimTo", device_);
}

PoolUsage CudaDriver::pool_usage() {
  cudaMemPool_t pool = to_pool(default_pool());
  DeviceGuard guard(device_);
  const auto get = [&](cudaMemPoolAttr attr, const char* what) {
    cuuint64_t v = 0;
    check(cudaMemPoolGetAttribute(pool, attr, &v), what, device_);
    return static_cast<std::size_t>(v);
  };
  PoolUsage u;
  u.reserved_current =
      get(cudaMemPoolAttrReservedMemCurrent, "cudaMemPoolGetAttribute(ReservedMemCurrent)");
  u.reserved_high = get(cudaMemPoolAttrReservedMemHigh, "cudaMemPoolGetAttribute(ReservedMemHigh)");
  u.used_current = get(cudaMemPoolAttrUsedMemCurrent, "cudaMemPoolGetAttribute(UsedMemCurrent)");
  u.used_high = get(cudaMemPoolAttrUsedMemHigh, "cudaMemPoolGetAttribute(UsedMemHigh)");
  return u;
}

// The high-water marks can only be reset to zero.
void CudaDriver::pool_reset_peaks() {
  cudaMemPool_t pool = to_pool(default_pool());
  DeviceGuard guard(device_);
  cuuint64_t zero = 0;
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero),
        "cudaMemPoolSetAttribute(ReservedMemHigh)", device_);
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero),
        "cudaMemPoolSetAttribute(UsedMemHigh)", device_);
}

void CudaDriver::synchronize_device() {
  DeviceGuard guard(device_);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", device_);
}

// --- Host memory and copies (sleeping pools) ---

void* CudaDriver::allocate_host(std::size_t bytes) {
  DeviceGuard guard(device_);
  void* p = nullptr;
  const cudaError_t err = cudaMallocHost(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // out of memory is a value: leave no error behind
    return nullptr;
  }
  check(err, "cudaMallocHost", device_);
  return p;
}

void CudaDriver::free_host(void* ptr, std::size_t /*bytes*/) {
  DeviceGuard guard(device_);
  check(cudaFreeHost(ptr), "cudaFreeHost", device_);
}

void CudaDriver::copy_to_host(void* dst, DevicePtr src, std::size_t bytes) {
  DeviceGuard guard(device_);
  check(cudaMemcpy(dst, reinterpret_cast<const void*>(src), bytes, cudaMemcpyDeviceToHost),
        ("cudaMemcpy(device " + hex_address(src) + " to host, " + std::to_string(bytes) + " bytes)")
            .c_str(),
        device_);
}

void CudaDriver::copy_to_device(DevicePtr dst, const void* src, std::size_t bytes) {
  DeviceGuard guard(device_);
  check(cudaMemcpy(reinterpret_cast<void*>(dst), src, bytes, cudaMemcpyHostToDevice),
        ("cudaMemcpy(host to device " + hex_address(dst) + ", " + std::to_string(bytes) + " bytes)")
            .c_str(),
        device_);
}

#else  // built without the CUDA toolkit

namespace {
[[noreturn]] void unavailable() {
  throw DriverError(
      "ccalloc: this build has no CUDA support (the CUDA toolkit was not found "
      "when it was configured)");
}
}  // namespace

int device_count() {
  return 0;
}
int current_device() {
  unavailable();
}
RuntimeInfo probe() {
  RuntimeInfo info;
  info.error = "ccalloc was built without CUDA support";
  return info;
}
CudaDriver::CudaDriver(int device) : device_(device), exportable_kinds_(0) {
  unavailable();
}
CudaDriver::MemoryCalls CudaDriver::memory_calls() const {
  return {};
}
std::vector<Driver::ProcessMemory> CudaDriver::processes_on_device() {
  unavailable();
}
CudaDriver::~CudaDriver() = default;
DevicePtr CudaDriver::allocate(std::size_t) {
  unavailable();
}
void CudaDriver::free(DevicePtr, std::size_t) {
  unavailable();
}
MemInfo CudaDriver::mem_info() {
  unavailable();
}
EventId CudaDriver::create_event() {
  unavailable();
}
void CudaDriver::destroy_event(EventId) {
  unavailable();
}
void CudaDriver::record_event(EventId, StreamId) {
  unavailable();
}
bool CudaDriver::query_event(EventId) {
  unavailable();
}
void CudaDriver::synchronize_event(EventId) {
  unavailable();
}
void CudaDriver::synchronize_stream(StreamId) {
  unavailable();
}
bool CudaDriver::is_capturing(StreamId) {
  unavailable();
}
bool CudaDriver::capture_info(StreamId, CaptureInfo&) {
  unavailable();
}
void CudaDriver::node_dependencies(GraphNode, std::vector<GraphNode>&) {
  unavailable();
}
std::size_t CudaDriver::vm_granularity() {
  unavailable();
}
DevicePtr CudaDriver::reserve_address_range(std::size_t) {
  unavailable();
}
void CudaDriver::free_address_range(DevicePtr, std::size_t) {
  unavailable();
}
PhysicalHandle CudaDriver::create_physical(std::size_t) {
  unavailable();
}
void CudaDriver::release_physical(PhysicalHandle, std::size_t) {
  unavailable();
}
void CudaDriver::map(DevicePtr, std::size_t, PhysicalHandle) {
  unavailable();
}
void CudaDriver::unmap(DevicePtr, std::size_t) {
  unavailable();
}
void CudaDriver::map_range(DevicePtr, std::size_t, PhysicalHandle, std::size_t) {
  unavailable();
}
DevicePtr CudaDriver::allocate_async(std::size_t, StreamId) {
  unavailable();
}
void CudaDriver::free_async(DevicePtr, std::size_t, StreamId) {
  unavailable();
}
void CudaDriver::stream_wait_event(StreamId, EventId) {
  unavailable();
}
void CudaDriver::pool_trim(std::size_t) {
  unavailable();
}
PoolUsage CudaDriver::pool_usage() {
  unavailable();
}
void CudaDriver::pool_reset_peaks() {
  unavailable();
}
void CudaDriver::synchronize_device() {
  unavailable();
}
void* CudaDriver::allocate_host(std::size_t) {
  unavailable();
}
void CudaDriver::free_host(void*, std::size_t) {
  unavailable();
}
void CudaDriver::copy_to_host(void*, DevicePtr, std::size_t) {
  unavailable();
}
void CudaDriver::copy_to_device(DevicePtr, const void*, std::size_t) {
  unavailable();
}
void* CudaDriver::default_pool() {
  unavailable();
}
void CudaDriver::add_peer(int) {
  unavailable();
}
std::vector<int> CudaDriver::peers() const {
  return {};
}
void CudaDriver::set_exportable_kinds(unsigned) {
  unavailable();
}
unsigned CudaDriver::exportable_kinds() const {
  return 0;
}
std::string CudaDriver::export_physical(PhysicalHandle, ShareKind) {
  unavailable();
}
PhysicalHandle CudaDriver::import_physical(std::string_view, ShareKind, int, std::size_t) {
  unavailable();
}
std::string CudaDriver::export_allocation(DevicePtr) {
  unavailable();
}
DevicePtr CudaDriver::open_allocation(std::string_view) {
  unavailable();
}
void CudaDriver::close_allocation(DevicePtr) {
  unavailable();
}

#endif

std::int64_t CudaDriver::now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace ccalloc::cuda
