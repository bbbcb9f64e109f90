// The simulated GPU: a first-class Driver that models a device without one.
//
// It has a capacity; hands out deterministic, 2 MiB-aligned addresses (or, with an address
// oracle, a given sequence of addresses, e.g. the ones a recorded trace got from
// cudaMalloc); reports OOM as a value; keeps streams and events whose completion the
// caller controls; models virtual memory (reservations, physical handles, per-handle
// mappings) and a stream-ordered pool (cudaMallocAsync); counts every driver call; and
// accumulates simulated driver time from a cost model. Tests, `ccalloc replay` and CI run
// on it.
//
// Event model: work queued on a stream completes in order. An event recorded on a stream
// completes when the caller completes that event, a later event on the same stream, or the
// whole stream; synchronize calls complete what they wait for. With
// `events_complete_immediately`, every stream is always idle.
//
// Address space, lowest region first: the stream-ordered pool's allocations (from
// Options::pool_base_address), address reservations (from Options::vm_base_address), device
// allocations (from Options::base_address). Every placement avoids every other range, so
// no two of them ever overlap whatever the options.
//
// Capacity: device allocations, physical allocations and the pool's reserved pages all
// count against it; used_bytes() and mem_info() report their sum.
//
// The stream-ordered pool (docs/simulated-gpu.md, "The stream-ordered pool"): requests are
// rounded to 512 B. Requests of 1 MiB and more take whole pages (vm_granularity) from any
// free pages of the pool (the real driver remaps pages into contiguous address space), so
// they never suffer external fragmentation; smaller ones are carved best-fit out of pages
// set aside for small allocations. Freed memory is reusable at once by the freeing stream,
// by a stream that waited (stream_wait_event) on an event recorded after the free, and by
// every stream once the free has completed. The pool grows by the missing pages only when
// no free memory fits, keeps what it reserves, and returns 0 when growing would exceed the
// capacity.
//
// Sharing between processes (docs/simulated-gpu.md, "Sharing between processes"): physical
// allocations and device allocations can be exported and imported through a registry
// shared by every SimDriver of the process, so two SimDrivers stand for two processes on
// one device. An exported POSIX file descriptor is a number unique in the process, a fabric
// or allocation handle 64 bytes naming a registry entry; an exporter's release (or free)
// removes its entries, and importing an unknown one is a DriverError naming it. Memory has
// contents (write/read, zero until written), so a test can see that both sides of a
// sharing see the same bytes. Imported memory counts against the exporter's capacity only.
//
// Host memory and copies (docs/simulated-gpu.md, "Host memory and copies"): pinned host
// memory is plain memory bounded by Options::host_capacity; copy_to_host / copy_to_device
// move the contents write() and read() see, so a sleeping pool's saved bytes can be checked.
//
// Thread safety: all methods are safe to call concurrently.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ccalloc/driver.hpp"

namespace ccalloc::sim {

inline constexpr std::size_t kGiB = std::size_t{1} << 30;

// Simulated cost of each driver call, in microseconds. Defaults from published measurements,
// whose sources docs/simulated-gpu.md lists: cudaMalloc averaged 59.2 us and cudaFree 46 us
// in ResNet-50 training (JuliaGPU/CuArrays.jl PR #414). Synchronisation has no published
// per-call figure; its default is an assumption, stated as such in docs/simulated-gpu.md.
//
// Virtual memory: medians of 300 calls measured by bench/gpu/vmm_cost.cpp on an H100 (CUDA
// 13, 2 MiB handles; docs/simulated-gpu.md has the table). A real mapping is cuMemMap followed
// by cuMemSetAccess, so each map() is charged both. cuMemAddressFree was not measured (0).
//
// The stream-ordered pool: cudaMallocAsync from a warm pool averaged 1.19 us
// (JuliaGPU/CUDA.jl PR #2162). cudaFreeAsync has no published figure (0). Growing and
// trimming the pool have no published figure either; their defaults are estimates from the
// VMM calls the driver presumably makes: one physical allocation created, mapped and made
// accessible per growth (VMM cost goes with the number of handles, not their size), one unmap
// and one release per trim that releases memory.
struct CostModel {
  double allocate_us = 59.2;
  double free_us = 46.0;
  double synchronize_us = 10.0;  // also synchronize_device
  double event_record_us = 0.0;
  double event_query_us = 0.0;
  // Virtual memory.
  double reserve_us = 1.71;           // cuMemAddressReserve
  double address_free_us = 0.0;       // cuMemAddressFree: unmeasured
  double physical_create_us = 8.02;   // cuMemCreate, also when it reports OOM
  double physical_release_us = 10.07; // cuMemRelease
  double map_us = 0.65;               // cuMemMap, charged per map() ...
  double set_access_us = 34.60;       // ... together with cuMemSetAccess
  double unmap_us = 26.58;            // cuMemUnmap, per unmap() call
  // The stream-ordered pool.
  double async_allocate_us = 1.19;  // cudaMallocAsync, also when it reports OOM
  double async_free_us = 0.0;       // cudaFreeAsync: unmeasured
  double pool_grow_us = 43.27;      // per growth of the pool: an estimate (8.02 + 0.65 + 34.60)
  double pool_trim_us = 36.65;      // per pool_trim that releases memory: an estimate (26.58 + 10.07)
  double stream_wait_us = 0.0;      // cudaStreamWaitEvent: unmeasured
  // Host memory and copies (sleeping pools). cudaMallocHost and cudaFreeHost: unmeasured
  // (0; pinning costs grow with the size). A copy is charged a fixed latency plus its bytes
  // at a bandwidth: both assumptions (PCIe 5.0 x16 with pinned memory), not measurements.
  double host_allocate_us = 0.0;       // cudaMallocHost: unmeasured
  double host_free_us = 0.0;           // cudaFreeHost: unmeasured
  double copy_latency_us = 10.0;       // per cudaMemcpy between host and device: assumed
  double copy_bytes_per_us = 50000.0;  // 50 GB/s: assumed
};

struct Counters {
  std::uint64_t allocate_calls = 0;  // including the ones that returned OOM
  std::uint64_t allocate_ooms = 0;
  std::uint64_t free_calls = 0;
  std::uint64_t mem_info_calls = 0;
  std::uint64_t event_creates = 0;
  std::uint64_t event_destroys = 0;
  std::uint64_t event_records = 0;
  std::uint64_t event_queries = 0;
  std::uint64_t event_synchronizes = 0;
  std::uint64_t stream_synchronizes = 0;
  // Virtual memory.
  std::uint64_t reserve_calls = 0;
  std::uint64_t address_frees = 0;
  std::uint64_t physical_creates = 0;  // including the ones that returned OOM
  std::uint64_t physical_create_ooms = 0;
  std::uint64_t physical_releases = 0;
  std::uint64_t maps = 0;
  std::uint64_t unmaps = 0;
  // The stream-ordered pool.
  std::uint64_t async_allocates = 0;  // including the ones that returned OOM
  std::uint64_t async_allocate_ooms = 0;
  std::uint64_t async_frees = 0;
  std::uint64_t pool_grows = 0;        // times the pool reserved more memory
  std::uint64_t pool_pages_grown = 0;  // pages it reserved then
  std::uint64_t pool_trims = 0;
  std::uint64_t pool_pages_trimmed = 0;  // pages pool_trim released
  std::uint64_t pool_usage_queries = 0;
  std::uint64_t pool_peak_resets = 0;
  std::uint64_t stream_waits = 0;
  std::uint64_t device_synchronizes = 0;
  // Host memory and copies.
  std::uint64_t host_allocates = 0;  // including the ones refused (host_capacity)
  std::uint64_t host_allocate_failures = 0;
  std::uint64_t host_frees = 0;
  std::uint64_t copies_to_host = 0;
  std::uint64_t copies_to_device = 0;
  std::uint64_t bytes_to_host = 0;
  std::uint64_t bytes_to_device = 0;
  bool operator==(const Counters&) const = default;
};

struct Options {
  std::size_t capacity = 141 * kGiB;
  int device = 0;
  CostModel cost;
  // First address handed out; addresses are `alignment`-aligned, lowest free range first.
  DevicePtr base_address = DevicePtr{0x7f0000000000};
  std::size_t alignment = std::size_t{2} << 20;
  bool events_complete_immediately = false;
  // A GPU that runs behind the host: an event recorded on a stream below
  // `lagged_streams_end` completes, with the work queued before it, once the time
  // (set_time_us) has passed its recording by `gpu_lag_us`; negative: only when the caller
  // completes it. The replay of a recorded trace uses it for the allocator's own events on
  // the trace's streams (docs/simulated-gpu.md, "Events").
  std::int64_t gpu_lag_us = -1;
  StreamId lagged_streams_end = ~StreamId{0};
  // Virtual memory: the granularity of reservations, physical allocations and mappings,
  // and of the stream-ordered pool's pages (a power of two, at least 1 MiB).
  std::size_t vm_granularity = std::size_t{2} << 20;
  // First address reserve_address_range hands out.
  DevicePtr vm_base_address = DevicePtr{0x600000000000};
  // First address of the stream-ordered pool's allocations.
  DevicePtr pool_base_address = DevicePtr{0x400000000000};
  // Pinned host memory allocate_host may hand out in all; beyond it, it returns nullptr.
  std::size_t host_capacity = SIZE_MAX;
  // What wall_clock() says: whether the allocator may treat the virtual clock as wall time
  // (skip reads the processor's cycle counter shows unneeded, sync/cycle_gate.hpp). For
  // tests that count the allocator's clock reads (clock_reads()); a replay keeps false.
  // Where set, the clock runs in real time from whatever set_time_us() last set, as a wall
  // clock does: a clock read inside an operation then reads the time of that read, not of
  // an earlier set (a test preempted between the two would otherwise look to the cycle
  // gate like a slow cycle counter).
  bool wall_clock = false;
};

// One device allocation a recorded run obtained: the oracle hands `address` to the next
// allocation if it asks for `size` bytes.
struct OracleEntry {
  DevicePtr address = 0;
  std::size_t size = 0;
};

class SimDriver final : public Driver {
 public:
  explicit SimDriver(Options options = {});
  ~SimDriver() override;

  // Successive device allocations get these addresses while their sizes match; from the
  // first mismatch on (or once the sequence is used up) addresses come from the
  // deterministic allocator again.
  void set_address_oracle(std::vector<OracleEntry> sequence);
  // Number of allocations that got their address from the oracle.
  std::size_t oracle_hits() const;
  // True once the oracle was abandoned because a size differed.
  bool oracle_diverged() const;

  // CUDA graph capture: while any stream is marked capturing, what capture forbids throws
  // DriverError (querying, recording or synchronizing events, synchronizing streams or the
  // device, freeing device memory, unmapping pages or freeing address ranges, trimming the
  // pool), so tests prove an allocator never does it then. Stream-ordered allocations and
  // frees stay legal, and so does releasing a physical allocation (an expandable segment
  // gives back the pages it created but could not map).
  //
  // The capture graph (docs/simulated-gpu.md, "Capture graphs"): begin_capture starts a new
  // capture with `stream` as its origin and no nodes. capture_work adds a node for work
  // queued on a capturing stream; it depends on the stream's terminals and becomes its only
  // terminal. capture_join stands for an event recorded on `waited` and waited for by
  // `waiter` (cudaEventRecord + cudaStreamWaitEvent) while `waited` captures: `waiter` joins
  // that capture if it was not capturing, and its terminals gain `waited`'s. end_capture of
  // a capture's origin ends the capture for every stream in it (its nodes are forgotten);
  // of another stream, that stream's part only.
  void begin_capture(StreamId stream);
  void end_capture(StreamId stream);
  GraphNode capture_work(StreamId stream);
  void capture_join(StreamId waiter, StreamId waited);
  bool is_capturing(StreamId stream) override;
  bool capture_info(StreamId stream, CaptureInfo& out) override;
  void node_dependencies(GraphNode node, std::vector<GraphNode>& out) override;

  void complete_event(EventId event);
  void complete_stream(StreamId stream);
  void complete_all();
  // Whether `waiter` has waited (stream_wait_event) for `event`'s position on its stream or
  // a later one: work queued on `waiter` since then runs after the event's work.
  bool waited_for(StreamId waiter, EventId event);
  // Sets the virtual clock returned by now_us() (from which it runs on in real time under
  // Options::wall_clock).
  void set_time_us(std::int64_t t);

  // Copies bytes into or out of device memory: device allocations, mapped physical
  // allocations and opened allocations, a range possibly spanning several of them. Throws
  // DriverError naming the first address that is none of these.
  void write(DevicePtr ptr, const void* data, std::size_t bytes);
  void read(DevicePtr ptr, void* data, std::size_t bytes) const;
  // Physical allocations imported from another SimDriver and not yet released.
  std::size_t imported_handles() const;
  // Pinned host memory handed out by allocate_host and not yet freed.
  std::size_t host_bytes() const;

  Counters counters() const;
  // Calls of now_us() so far, counted where Options::wall_clock is set (else 0).
  std::uint64_t clock_reads() const { return clock_reads_.load(std::memory_order_relaxed); }
  double simulated_driver_us() const;
  // Device memory in use: device allocations, physical allocations and the pool's reserved
  // pages together (what counts against the capacity).
  std::size_t used_bytes() const;
  std::size_t capacity() const { return options_.capacity; }
  const Options& options() const { return options_; }

  // Driver
  int device() const override { return options_.device; }
  DevicePtr allocate(std::size_t bytes) override;
  void free(DevicePtr ptr, std::size_t bytes) override;
  MemInfo mem_info() override;
  // This process alone, holding what the simulated device has in use.
  std::vector<ProcessMemory> processes_on_device() override;
  EventId create_event() override;
  void destroy_event(EventId event) override;
  void record_event(EventId event, StreamId stream) override;
  bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void synchronize_stream(StreamId stream) override;
  std::int64_t now_us() override;
  bool wall_clock() const override { return options_.wall_clock; }
  std::size_t vm_granularity() override;
  DevicePtr reserve_address_range(std::size_t bytes) override;
  void free_address_range(DevicePtr base, std::size_t bytes) override;
  PhysicalHandle create_physical(std::size_t bytes) override;
  void release_physical(PhysicalHandle handle, std::size_t bytes) override;
  void map(DevicePtr va, std::size_t bytes, PhysicalHandle handle) override;
  void unmap(DevicePtr va, std::size_t bytes) override;
  void map_range(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                 std::size_t offset) override;
  // Records the peer (the simulated device grants every device access): peers() lists them.
  void add_peer(int peer) override;
  std::vector<int> peers() const;
  // The mappings lying in [base, base + bytes), lowest address first (for checks of an
  // allocator's model against the device).
  struct MappingInfo {
    DevicePtr va = 0;
    std::size_t bytes = 0;
    PhysicalHandle handle = 0;
    std::size_t offset = 0;  // into the handle
    bool operator==(const MappingInfo&) const = default;
  };
  std::vector<MappingInfo> mappings_in(DevicePtr base, std::size_t bytes) const;
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
  // Host memory is plain memory counted against Options::host_capacity. The copies move
  // the contents write() and read() see, are forbidden during capture, and are charged
  // CostModel::copy_latency_us plus their bytes at copy_bytes_per_us.
  void* allocate_host(std::size_t bytes) override;
  void free_host(void* ptr, std::size_t bytes) override;
  void copy_to_host(void* dst, DevicePtr src, std::size_t bytes) override;
  void copy_to_device(DevicePtr dst, const void* src, std::size_t bytes) override;
  std::string name() const override;

 private:
  // Throws when a capture is underway; `what` names the call. mutex_ held.
  void forbid_during_capture(const char* what) const;
  // Checks and charges one host copy of `bytes` (copy_to_host / copy_to_device; `what`
  // names it) and counts it in `copies` / `copied`. mutex_ held.
  void charge_copy(const char* what, std::size_t bytes, std::uint64_t& copies,
                   std::uint64_t& copied);
  struct Event {
    bool recorded = false;
    StreamId stream = 0;
    std::uint64_t sequence = 0;  // position in its stream's queue
  };
  struct StreamState {
    std::uint64_t recorded = 0;   // events (and pool frees) recorded so far
    std::uint64_t completed = 0;  // events completed so far (a prefix)
    // With Options::gpu_lag_us: (time recorded, position) of events not yet completed.
    std::deque<std::pair<std::int64_t, std::uint64_t>> lagging;
    // Its waits on other streams (stream_wait_event), in the order queued: work queued
    // after position `at` here runs only once `stream` has completed through `through`.
    struct Wait {
      std::uint64_t at = 0;
      StreamId stream = 0;
      std::uint64_t through = 0;
    };
    std::vector<Wait> waits;
  };
  struct Mapping {
    std::size_t bytes = 0;
    PhysicalHandle handle = 0;
    std::size_t offset = 0;
    bool ranged = false;  // made by map_range()
  };
  // The bytes of an allocation, shared by every process that maps it (ipc_model.cpp).
  struct Contents;
  struct Physical {
    std::size_t bytes = 0;
    DevicePtr mapped_at = 0;         // 0: not mapped by map()
    std::size_t range_mappings = 0;  // mappings made by map_range()
    unsigned exportable = 0;         // share kinds it can be exported as
    bool imported = false;           // from another process: not counted in physical_bytes_
    std::shared_ptr<Contents> contents;  // made on first write or export
    std::vector<std::uint64_t> exports;  // its registry entries, removed on release
  };
  // An allocation of another process opened here (open_allocation).
  struct Opened {
    std::size_t bytes = 0;
    std::shared_ptr<Contents> contents;
  };
  // A pool free: complete once `stream`'s queue passes `sequence`.
  struct FreeMark {
    StreamId stream = 0;
    std::uint64_t sequence = 0;
  };
  // The frees that free pool memory waits for; none left: every stream may reuse it.
  using FreeMarks = std::vector<FreeMark>;
  // Address range of a large pool allocation or of a small-allocation page. A freed slot
  // stays until its frees are usable by the stream that wants the addresses: work queued
  // before the free may still touch them.
  struct PoolSlot {
    std::size_t bytes = 0;
    bool live = false;
    FreeMarks marks;
  };
  // Free whole pages of the pool that share their frees; oldest first.
  struct PageRun {
    std::size_t pages = 0;
    FreeMarks marks;
  };
  struct SmallBlock {
    std::size_t size = 0;
    bool allocated = false;
    FreeMarks marks;  // free blocks only
  };
  struct PoolAllocation {
    std::size_t bytes = 0;    // as requested: counted in the pool's used bytes
    std::size_t rounded = 0;  // what it occupies
    bool small = false;
  };

  // All require mutex_.
  DevicePtr place(std::size_t bytes);
  DevicePtr first_fit(DevicePtr start, std::size_t bytes, std::size_t alignment) const;
  bool overlaps_any(DevicePtr addr, DevicePtr end) const;
  // The handle a mapping of [va, va + bytes) may use: the range aligned, inside one
  // reservation and overlapping no mapping, the handle live and of exactly `bytes` bytes.
  // Otherwise fail(what + reason).
  Physical& mapping_target(const std::string& what, DevicePtr va, std::size_t bytes,
                           PhysicalHandle handle);
  std::size_t device_used() const;
  bool event_done(const Event& e) const;
  // Completes what Options::gpu_lag_us says the GPU has run by now on `stream`. mutex_ held.
  void catch_up(StreamId stream);
  // Completes `stream` through position `through`, and with it, through their positions,
  // the streams its waits queued before there waited for: the GPU cannot have run past a
  // wait before the work it waits for. mutex_ held.
  void advance(StreamId stream, std::uint64_t through);
  // advance() through `e` and what was queued before it on its stream, where recorded.
  void complete_through(const Event& e);
  // Whether work queued on `waiter` now runs after position `sequence` of `stream`: a wait
  // on it there or later, directly or through the waits of the streams waited for (each
  // counting those queued before the position waited for). mutex_ held.
  bool ordered_after(StreamId waiter, StreamId stream, std::uint64_t sequence) const;
  Event& event_ref(EventId event);
  FreeMark mark_free(StreamId stream);
  bool mark_done(const FreeMark& m) const;
  bool usable_by(FreeMarks& marks, StreamId stream) const;  // prunes completed marks
  void merge_marks(FreeMarks& into, const FreeMarks& from) const;
  bool grow_pool(std::size_t pages);
  DevicePtr place_in_pool(std::size_t bytes, StreamId stream);
  void release_pool_slot(DevicePtr va, FreeMarks marks);
  void add_free_pages(std::size_t pages, FreeMarks marks);
  DevicePtr allocate_small(std::size_t rounded, StreamId stream);
  DevicePtr allocate_large(std::size_t rounded, StreamId stream);
  void free_small(DevicePtr ptr, const FreeMark& mark);
  void add_small_free(DevicePtr addr, std::size_t size) { small_free_.emplace(size, addr); }
  [[noreturn]] void fail(const std::string& what) const;
  // The contents behind `ptr` and the bytes of it from `ptr` on (ipc_model.cpp).
  std::pair<Contents*, std::size_t> contents_at(DevicePtr ptr, std::size_t& offset);
  void forget_exports(std::vector<std::uint64_t>& tokens);
  void forget_allocation(DevicePtr base);  // free() of a device allocation

  const Options options_;
  mutable std::mutex mutex_;
  std::vector<int> peers_;  // add_peer(), guarded by mutex_
  // Capture graphs (guarded by mutex_). A stream's part in a capture: the capture's id and
  // the stream's terminal nodes.
  struct CaptureMember {
    std::uint64_t id = 0;
    std::vector<GraphNode> terminals;
  };
  struct GraphNodeInfo {
    std::uint64_t capture = 0;  // the capture it belongs to
    std::vector<GraphNode> dependencies;
  };
  // capturing_'s entry of `stream`; a DriverError "<call> stream <stream>, which is not
  // capturing" if there is none.
  std::map<StreamId, CaptureMember>::iterator capture_member(StreamId stream,
                                                             const std::string& call);
  std::map<StreamId, CaptureMember> capturing_;                  // streams being captured
  std::unordered_map<std::uint64_t, StreamId> capture_origins_;  // capture id -> origin
  std::unordered_map<GraphNode, GraphNodeInfo> graph_nodes_;     // nodes of captures underway
  std::uint64_t next_capture_id_ = 1;
  GraphNode next_graph_node_ = 1;
  std::map<DevicePtr, std::size_t> live_;  // address -> size
  std::size_t used_ = 0;
  std::vector<OracleEntry> oracle_;
  std::size_t oracle_next_ = 0;
  std::size_t oracle_hits_ = 0;
  bool oracle_diverged_ = false;
  std::unordered_map<EventId, Event> events_;
  EventId next_event_ = 1;
  std::unordered_map<StreamId, StreamState> streams_;
  // Virtual memory.
  std::map<DevicePtr, std::size_t> reservations_;  // base -> bytes
  std::map<DevicePtr, Mapping> mappings_;          // va -> one physical allocation
  std::unordered_map<PhysicalHandle, Physical> physical_;
  PhysicalHandle next_handle_ = 1;
  std::size_t physical_bytes_ = 0;
  // Sharing between processes (ipc_model.cpp).
  unsigned exportable_kinds_ = share_kind_bit(ShareKind::kPosixFd) | share_kind_bit(ShareKind::kFabric);
  std::map<DevicePtr, std::shared_ptr<Contents>> allocation_contents_;  // written or exported
  std::map<DevicePtr, std::uint64_t> allocation_exports_;  // base -> registry entry
  std::map<DevicePtr, Opened> opened_;
  // The stream-ordered pool.
  std::map<DevicePtr, PoolSlot> pool_slots_;
  std::vector<PageRun> free_pages_;
  std::size_t pool_pages_ = 0;                                        // pages reserved
  std::map<DevicePtr, std::map<DevicePtr, SmallBlock>> small_pages_;  // page -> its blocks
  std::set<std::pair<std::size_t, DevicePtr>> small_free_;            // (size, address)
  std::map<DevicePtr, PoolAllocation> pool_live_;
  std::size_t pool_used_ = 0;
  std::size_t pool_used_high_ = 0;
  std::size_t pool_reserved_high_ = 0;
  std::map<const void*, std::size_t> host_;  // allocate_host's allocations
  std::size_t host_bytes_ = 0;
  Counters counters_;
  double driver_us_ = 0.0;
  // The virtual clock's reading; under Options::wall_clock, its offset from steady_us().
  std::int64_t clock_us() const;
  static std::int64_t steady_us();
  std::atomic<std::int64_t> time_us_{0};
  std::atomic<std::uint64_t> clock_reads_{0};
};

}  // namespace ccalloc::sim
