// The CUDA driver: real device memory behind the Driver interface.
//
// Built on the CUDA runtime, linked statically, so the library loads on machines without a
// CUDA driver or GPU; there, creating a CudaDriver throws DriverError saying why, and
// probe() reports it. Every call makes the driver's device current and restores the
// caller's device afterwards.
//
// Sharing with other processes: device allocations through cudaIpc*MemHandle, physical
// allocations through cuMemExportToShareableHandle / cuMemImportFromShareableHandle. Physical
// allocations are created exportable as POSIX file descriptors unless
// TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0 (PyTorch's switch for the same thing); an imported
// descriptor is copied from the exporting process with pidfd_getfd (Linux 5.6), which needs
// the right to ptrace it (same user; see docs/ipc.md).
//
// Virtual memory goes through the CUDA driver API (cuMem*), whose entry points are looked
// up at run time through the runtime (cudaGetDriverEntryPointByVersion), so the library
// never links against libcuda. The stream-ordered pool is the device's default
// cudaMemPool_t, configured on first use to keep what it reserves (release threshold
// UINT64_MAX) and to reuse memory across streams (the three reuse attributes on).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ccalloc/driver.hpp"

namespace ccalloc::cuda {

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  std::size_t total_bytes = 0;
  std::size_t free_bytes = 0;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
};

struct RuntimeInfo {
  bool built_with_cuda = false;
  int runtime_version = 0;  // e.g. 13000 for CUDA 13.0; 0 if unknown
  int driver_version = 0;   // 0: no CUDA driver found
  int device_count = 0;
  std::string error;  // why no device is visible, if none is
  std::vector<DeviceInfo> devices;
};

// What CUDA this process sees. Never throws.
RuntimeInfo probe();

// The current device of the calling thread (cudaGetDevice); throws DriverError without a
// usable CUDA device.
int current_device();
// Number of visible devices; 0 without a driver or GPU. Never throws.
int device_count();

class CudaDriver final : public Driver {
 public:
  // Throws DriverError if `device` does not exist or CUDA is unusable here.
  explicit CudaDriver(int device);
  ~CudaDriver() override;

  int device() const override { return device_; }
  DevicePtr allocate(std::size_t bytes) override;
  void free(DevicePtr ptr, std::size_t bytes) override;
  MemInfo mem_info() override;
  // From NVML (libnvidia-ml.so.1, loaded on first use): the compute processes on the device
  // and the memory each uses; empty where NVML is missing or fails.
  std::vector<ProcessMemory> processes_on_device() override;
  EventId create_event() override;
  void destroy_event(EventId event) override;
  void record_event(EventId event, StreamId stream) override;
  bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void synchronize_stream(StreamId stream) override;
  bool is_capturing(StreamId stream) override;
  // cudaStreamGetCaptureInfo and cudaGraphNodeGetDependencies (with their edge data, so that
  // edges with data are no lossy query).
  bool capture_info(StreamId stream, CaptureInfo& out) override;
  void node_dependencies(GraphNode node, std::vector<GraphNode>& out) override;
  std::int64_t now_us() override;
  bool wall_clock() const override { return true; }
  std::size_t vm_granularity() override;
  DevicePtr reserve_address_range(std::size_t bytes) override;
  void free_address_range(DevicePtr base, std::size_t bytes) override;
  PhysicalHandle create_physical(std::size_t bytes) override;
  void release_physical(PhysicalHandle handle, std::size_t bytes) override;
  void map(DevicePtr va, std::size_t bytes, PhysicalHandle handle) override;
  void unmap(DevicePtr va, std::size_t bytes) override;
  void map_range(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                 std::size_t offset) override;
  void set_exportable_kinds(unsigned kinds) override;
  unsigned exportable_kinds() const override;
  std::string export_physical(PhysicalHandle handle, ShareKind kind) override;
  PhysicalHandle import_physical(std::string_view exported, ShareKind kind, int pid,
                                 std::size_t bytes) override;
  std::string export_allocation(DevicePtr base) override;
  DevicePtr open_allocation(std::string_view exported) override;
  void close_allocation(DevicePtr ptr) override;
  DevicePtr allocate_async(std::size_t bytes, StreamId stream) override;
  void free_async(DevicePtr ptr, std::size_t bytes, StreamId stream) override;
  void stream_wait_event(StreamId stream, EventId event) override;
  void pool_trim(std::size_t keep_bytes) override;
  PoolUsage pool_usage() override;
  void pool_reset_peaks() override;
  void synchronize_device() override;
  void* allocate_host(std::size_t bytes) override;
  void free_host(void* ptr, std::size_t bytes) override;
  void copy_to_host(void* dst, DevicePtr src, std::size_t bytes) override;
  void copy_to_device(DevicePtr dst, const void* src, std::size_t bytes) override;
  std::string name() const override { return name_; }
  void add_peer(int peer) override;
  // The devices granted access by add_peer(), in the order added.
  std::vector<int> peers() const;

  // The calls that obtain, map and give back device memory since the driver was made, and
  // the wall time spent in them: what a benchmark reports per step (bench/torch/scale.py).
  struct MemoryCalls {
    std::uint64_t malloc = 0;      // cudaMalloc
    std::uint64_t free = 0;        // cudaFree
    std::uint64_t create = 0;      // cuMemCreate
    std::uint64_t release = 0;     // cuMemRelease
    std::uint64_t map = 0;         // cuMemMap
    std::uint64_t set_access = 0;  // cuMemSetAccess
    std::uint64_t unmap = 0;       // cuMemUnmap
    std::uint64_t ns = 0;          // in all of them
  };
  MemoryCalls memory_calls() const;

 private:
  // One memory call of `count`'s kind, timed into ns_ while it lives.
  class Counted;
  void* default_pool();  // the configured cudaMemPool_t
  // Grants read/write access to [va, va + bytes) for this device and every peer; on
  // failure unmaps the range. peers_mutex_ held.
  void set_access_or_unmap(DevicePtr va, std::size_t bytes);

  int device_;
  std::string name_;
  // Set on first use, under lazy_mutex_.
  std::mutex lazy_mutex_;
  std::size_t granularity_ = 0;
  void* pool_ = nullptr;
  std::atomic<unsigned> exportable_kinds_;
  // Descriptors exported per physical allocation, closed when it is released.
  std::mutex fds_mutex_;
  std::unordered_map<PhysicalHandle, int> exported_fds_;
  // Peers granted access (add_peer) and the ranges mapped by map() and map_range() (start,
  // bytes), which a new peer is granted access to.
  mutable std::mutex peers_mutex_;
  std::vector<int> peers_;
  std::map<DevicePtr, std::size_t> mapped_;
  std::atomic<std::uint64_t> malloc_calls_{0}, free_calls_{0}, create_calls_{0}, release_calls_{0},
      map_calls_{0}, set_access_calls_{0}, unmap_calls_{0}, call_ns_{0};
};

}  // namespace ccalloc::cuda
