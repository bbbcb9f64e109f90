// The Driver interface: everything the engine needs from a device.
//
// The engine (src/core) never calls CUDA. It talks to one Driver per device: the
// simulated GPU (src/drivers/sim) for tests, replay and CI, or the CUDA driver
// (src/drivers/cuda) for real devices. Out-of-memory is reported as a value, never as an
// exception, because it is an expected outcome that the OOM ladder handles.
//
// Thread safety: every method may be called from any thread concurrently; implementations
// synchronise internally. Units: bytes and microseconds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ccalloc {

// A device address. 0 is never a valid allocation.
using DevicePtr = std::uintptr_t;

// A stream handle as an integer (cudaStream_t cast to an integer; 0 is the legacy default
// stream). The engine only compares and hashes streams.
using StreamId = std::uint64_t;

// An event handle owned by the driver. Events are created with timing disabled.
using EventId = std::uint64_t;

struct MemInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

// A node of a CUDA graph being captured (cudaGraphNode_t as an integer).
using GraphNode = std::uint64_t;

// A stream's part in a graph capture (Driver::capture_info).
struct CaptureInfo {
  bool capturing = false;
  std::uint64_t id = 0;  // the capture sequence's id, unique in the process
  // The nodes the stream's next captured work will depend on; empty while it has captured
  // nothing and joined nothing that has.
  std::vector<GraphNode> terminals;
};

// A physical memory allocation for virtual-memory mapping (CUmemGenericAllocationHandle).
using PhysicalHandle = std::uint64_t;

// Usage of the device's stream-ordered memory pool (cudaMemPoolAttr*).
struct PoolUsage {
  std::size_t reserved_current = 0;
  std::size_t reserved_high = 0;
  std::size_t used_current = 0;
  std::size_t used_high = 0;
};

// How a physical allocation is shared with another process (CUmemAllocationHandleType).
enum class ShareKind : std::uint8_t {
  // A file descriptor of the exporting process, as a 4-byte int; the importer takes its own
  // copy of it through pidfd_getfd, so it needs the exporter's pid.
  kPosixFd = 1,
  // A CUmemFabricHandle: 64 opaque bytes valid in any process of the NVLink fabric (needs
  // the IMEX service; refused on most single-node machines).
  kFabric = 2,
};
// Bytes of one exported handle of `kind`.
constexpr std::size_t share_kind_bytes(ShareKind kind) {
  return kind == ShareKind::kPosixFd ? 4 : 64;
}
// Bit of `kind` in Driver::exportable_kinds().
constexpr unsigned share_kind_bit(ShareKind kind) {
  return 1u << static_cast<unsigned>(kind);
}
// Bytes of a cudaIpcMemHandle_t (export_allocation).
inline constexpr std::size_t kAllocationHandleBytes = 64;

class Driver {
 public:
  virtual ~Driver() = default;

  // Device ordinal this driver serves.
  virtual int device() const = 0;

  // Allocates `bytes` of device memory. Returns 0 when the device is out of memory (the
  // driver clears any sticky error); throws DriverError on any other failure.
  virtual DevicePtr allocate(std::size_t bytes) = 0;
  // Frees memory returned by allocate(). `bytes` is the size that was allocated.
  virtual void free(DevicePtr ptr, std::size_t bytes) = 0;
  virtual MemInfo mem_info() = 0;
  // The processes that hold memory on the device, with the bytes each holds, as the driver
  // knows them (NVML on a GPU), this process among them; empty where the driver cannot tell.
  // Only the out-of-memory message reads it, as PyTorch's does.
  struct ProcessMemory {
    long pid = 0;
    std::size_t bytes = 0;
    bool operator==(const ProcessMemory&) const = default;
  };
  virtual std::vector<ProcessMemory> processes_on_device() { return {}; }

  virtual EventId create_event() = 0;
  virtual void destroy_event(EventId event) = 0;
  // Records `event` on `stream`: it completes when the work queued on the stream so far has.
  virtual void record_event(EventId event, StreamId stream) = 0;
  // True when the event has completed; never blocks.
  virtual bool query_event(EventId event) = 0;
  // Blocks until the event has completed.
  virtual void synchronize_event(EventId event) = 0;
  virtual void synchronize_stream(StreamId stream) = 0;
  // True while `stream` is being captured into a CUDA graph (cudaStreamIsCapturing): a
  // stream filter for Allocator::begin_allocate_to_pool. A driver without graphs says no.
  virtual bool is_capturing(StreamId stream) {
    (void)stream;
    return false;
  }
  // The capture graph, for reusing memory inside a capture (graph_capture_record_stream_reuse,
  // docs/graph-capture-reuse.md). A driver without graphs reports no capture, and the engine
  // then keeps such memory until the capture ends.
  //
  // Fills `out` with the capture `stream` takes part in (cudaStreamGetCaptureInfo): whether
  // it is capturing (an invalidated capture counts as none), the capture's id, and the
  // stream's terminal nodes, the nodes its next captured work will depend on. Returns
  // out.capturing.
  virtual bool capture_info(StreamId stream, CaptureInfo& out) {
    (void)stream;
    out.capturing = false;
    out.id = 0;
    out.terminals.clear();
    return false;
  }
  // Replaces `out` with the nodes `node` depends on (cudaGraphNodeGetDependencies). `node` is
  // one capture_info reported, or a dependency of one, of a capture still underway.
  virtual void node_dependencies(GraphNode node, std::vector<GraphNode>& out) {
    (void)node;
    out.clear();
  }

  // --- Virtual memory, for expandable segments (cuMem*). ---
  // The mapping granularity: reservations, physical allocations and mappings are
  // multiples of it.
  virtual std::size_t vm_granularity() = 0;
  // Reserves `bytes` of address space (no memory behind it). Throws DriverError on failure.
  virtual DevicePtr reserve_address_range(std::size_t bytes) = 0;
  virtual void free_address_range(DevicePtr base, std::size_t bytes) = 0;
  // Creates `bytes` of physical device memory; returns 0 when the device is out of memory.
  virtual PhysicalHandle create_physical(std::size_t bytes) = 0;
  virtual void release_physical(PhysicalHandle handle, std::size_t bytes) = 0;
  // Maps a whole physical allocation at `va` (inside a reservation) and makes it readable
  // and writable by the device.
  virtual void map(DevicePtr va, std::size_t bytes, PhysicalHandle handle) = 0;
  // Unmaps [va, va + bytes), which covers one or more whole mappings. Does not synchronize:
  // the caller waits for the work that used the range first.
  virtual void unmap(DevicePtr va, std::size_t bytes) = 0;
  // Maps bytes [offset, offset + bytes) of a physical allocation at `va` and makes them
  // readable and writable (cuMemMap with an offset). Unlike map(), a handle may be mapped
  // this way at several addresses at once, each such mapping unmapped on its own. The
  // default throws DriverError: a driver without it cannot serve the `ccalloc` policy.
  virtual void map_range(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                         std::size_t offset);

  // --- Peer access (several devices in one process) ---
  // Makes this device's virtual-memory mappings, present and future, and its stream-ordered
  // pool readable and writable by device `peer`, once that device has enabled peer access
  // to this one (PyTorch's enablePeerAccess): mapped memory is reached from another device
  // only with access granted per range, unlike cudaMalloc memory. The default does nothing
  // (a driver whose memory needs no grant).
  virtual void add_peer(int /*peer*/) {}

  // --- Host memory and copies, for sleeping pools (docs/sleep-wake.md). ---
  // The defaults throw DriverError naming the driver: it cannot save device memory.
  //
  // Page-locked host memory (cudaMallocHost); nullptr when the host cannot provide it.
  virtual void* allocate_host(std::size_t bytes);
  // Frees what allocate_host returned; `bytes` is the size that was asked for.
  virtual void free_host(void* ptr, std::size_t bytes);
  // Synchronous copies between device memory and host memory (cudaMemcpy): they return
  // once the copy has completed. The caller waits for the device work that uses the range.
  virtual void copy_to_host(void* dst, DevicePtr src, std::size_t bytes);
  virtual void copy_to_device(DevicePtr dst, const void* src, std::size_t bytes);

  // --- Sharing memory with other processes (docs/ipc.md). ---
  // The defaults throw DriverError naming the driver: it cannot share memory.
  //
  // The kinds (share_kind_bit mask) that physical allocations created from now on can be
  // exported as; 0: none. The CUDA driver starts with kPosixFd, as PyTorch creates the pages
  // of expandable segments (set TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0 to create them
  // unexportable); the simulated GPU exports any.
  virtual void set_exportable_kinds(unsigned kinds);
  virtual unsigned exportable_kinds() const;
  // The shareable handle of a physical allocation, share_kind_bytes(kind) bytes. A file
  // descriptor stays open, owned by the driver, until the allocation is released; exporting
  // it again returns the same one.
  virtual std::string export_physical(PhysicalHandle handle, ShareKind kind);
  // A physical allocation of `bytes` that process `pid` exported as `exported`
  // (export_physical there). Mapped, unmapped and released like one's own; the memory
  // lives until every process has released it. Throws DriverError naming the handle when it
  // cannot be imported (unknown, closed, of another size).
  virtual PhysicalHandle import_physical(std::string_view exported, ShareKind kind, int pid,
                                         std::size_t bytes);
  // cudaIpcGetMemHandle of a device allocation, `base` as allocate() returned it:
  // kAllocationHandleBytes bytes.
  virtual std::string export_allocation(DevicePtr base);
  // cudaIpcOpenMemHandle: maps a device allocation another process exported, returns its
  // address in this process. Valid until close_allocation.
  virtual DevicePtr open_allocation(std::string_view exported);
  virtual void close_allocation(DevicePtr ptr);

  // --- The device's stream-ordered memory pool, for backend:cudaMallocAsync. ---
  // The pool is configured to keep what it reserves (release threshold: unlimited).
  // Allocates in stream order on `stream`; returns 0 when the device is out of memory.
  virtual DevicePtr allocate_async(std::size_t bytes, StreamId stream) = 0;
  // Frees in stream order on `stream`.
  virtual void free_async(DevicePtr ptr, std::size_t bytes, StreamId stream) = 0;
  // Makes `stream` wait for `event` (cudaStreamWaitEvent).
  virtual void stream_wait_event(StreamId stream, EventId event) = 0;
  // Releases the pool's unused memory down to `keep_bytes`: the pool keeps at least that
  // much reserved (cudaMemPoolTrimTo). Memory whose free has not completed may stay.
  virtual void pool_trim(std::size_t keep_bytes) = 0;
  virtual PoolUsage pool_usage() = 0;
  virtual void pool_reset_peaks() = 0;
  virtual void synchronize_device() = 0;

  // Wall time in microseconds since the Unix epoch, used to stamp trace entries. The
  // simulated GPU returns its virtual clock instead.
  virtual std::int64_t now_us() = 0;
  // Whether now_us() is wall time, so that the allocator may skip a read where the
  // processor's cycle counter shows that too little time has passed to change an answer
  // (sync/cycle_gate.hpp). A virtual clock (the simulated GPU's) says false: every read is
  // made.
  virtual bool wall_clock() const { return false; }

  // A short description for messages, e.g. "simulated GPU 0 (141.00 GiB)".
  virtual std::string name() const = 0;
};

}  // namespace ccalloc
