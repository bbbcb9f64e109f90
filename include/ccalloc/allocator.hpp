// ccalloc::Allocator — the caching allocator of one device.
//
// Memory comes from the device in segments; a segment is split into blocks that tile it.
// Freed blocks stay cached in per-stream pools (small <= 1 MiB, large > 1 MiB) and are
// reused best-fit; neighbouring free blocks merge. A block used on another stream
// (record_stream) returns to its pool only once events recorded on those streams at free
// time have completed. When the cache cannot serve a request, the OOM ladder frees cached
// memory step by step before giving up with OutOfMemoryError. Behaviour follows PyTorch's
// CUDACachingAllocator unless the config says otherwise (see config.hpp).
//
// Thread safety: every public method may be called concurrently from any thread. Each
// stream has its own arena and lock, so threads working on different streams do not
// contend on the hot path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ccalloc/config.hpp"
#include "ccalloc/driver.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/stats.hpp"
#include "ccalloc/trace.hpp"

namespace ccalloc {

namespace core {
class Backend;
struct BackendAccess;  // src/core/backend_access.hpp: the implementation, for tests
}
struct HistoryOptions;
struct Snapshot;

enum class BlockState : std::uint8_t {
  kActiveAllocated,    // handed out to the program
  kActivePendingFree,  // freed, waiting for events on other streams
  kInactive,           // free and cached
};
std::string_view to_string(BlockState state);

struct BlockInfo {
  DevicePtr address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;  // stale for inactive blocks, as in PyTorch
  BlockState state = BlockState::kInactive;
  ContextHandle context = nullptr;  // caller context of its allocation (active blocks only)
};

// A private memory pool (PyTorch's MempoolId_t): {capture id, 0} for a CUDA graph's own
// pool, {0, uid} for a torch.cuda.MemPool or graph_pool_handle(). {0, 0} is the default
// pool, which holds every allocation made outside private pools.
struct PoolId {
  std::uint64_t first = 0;
  std::uint64_t second = 0;
  bool is_default() const { return first == 0 && second == 0; }
  // Spelled out (not a defaulted <=>) so that every compiler, nvcc's included, accepts them.
  friend bool operator==(const PoolId& a, const PoolId& b) {
    return a.first == b.first && a.second == b.second;
  }
  friend bool operator!=(const PoolId& a, const PoolId& b) { return !(a == b); }
  friend bool operator<(const PoolId& a, const PoolId& b) {
    return a.first != b.first ? a.first < b.first : a.second < b.second;
  }
};
std::string to_string(PoolId id);  // "(first, second)"

// Where a private pool's segments come from instead of the device (PyTorch's
// MemPool(allocator=...)): allocate returns 0 when it has no memory; free gets back exactly
// what allocate returned, with the size asked for.
struct SegmentSource {
  std::function<DevicePtr(std::size_t bytes)> allocate;
  std::function<void(DevicePtr ptr, std::size_t bytes)> free;
};

// Whether the calling thread is inside a SegmentSource call that an allocator makes (a
// private pool taking or returning a segment). A source that is ccalloc itself (PyTorch's
// MemPool(allocator=...) over libccalloc.so's ccalloc_torch_alloc/ccalloc_torch_free in a
// process where ccalloc is also PyTorch's allocator: one allocator per process) then serves
// the segment straight from the device instead of calling back into the pool.
bool in_segment_source();

// The state of a private pool at one moment (checkpoint_pool), to be restored later.
class PoolCheckpoint {
 public:
  virtual ~PoolCheckpoint() = default;
};
// What restore_pool changed: allocations that no longer exist, and allocations that exist
// again (the caller owns them, as if malloc had returned them).
struct PoolRestore {
  std::vector<DevicePtr> freed;
  std::vector<DevicePtr> allocated;
};

// Stitching policy (stitch_segments) only: `count` consecutive pieces of one physical
// handle, pieces [first, first + count), each of the policy's piece size (the device's
// mapping granularity). A segment's runs, concatenated, name the piece behind each of its
// pages in address order.
struct PieceRun {
  PhysicalHandle handle = 0;
  std::uint32_t first = 0;
  std::uint32_t count = 0;
  bool operator==(const PieceRun&) const = default;
};

struct SegmentInfo {
  int device = 0;
  DevicePtr address = 0;
  std::size_t total_size = 0;
  std::size_t allocated_size = 0;  // sum of allocated blocks
  std::size_t active_size = 0;     // allocated or pending-free blocks
  std::size_t requested_size = 0;  // requested bytes of active blocks
  StreamId stream = 0;
  bool is_small = false;  // small pool (<= 1 MiB requests)
  bool is_expandable = false;
  // Its pool is asleep (sleep_pool): the address range stays reserved, but no physical
  // memory is behind it and it does not count as reserved memory.
  bool is_asleep = false;
  PoolId pool;                    // the private pool that owns it; {0, 0}: the default pool
  ContextHandle context = nullptr;  // caller context of the device allocation (or first mapping)
  std::vector<BlockInfo> blocks;  // address order, tiling the segment
  // Stitching policy only (empty for the others): the physical pieces behind the segment's
  // pages, in address order; they add up to total_size. Each piece backs one page at most.
  std::vector<PieceRun> pieces;
};

// What sleep_pool does with the contents of the pool's live allocations.
enum class SleepMode : std::uint8_t {
  kDiscard,  // dropped: after wake_pool the allocations hold undefined bytes
  kSave,     // copied to pinned host memory and copied back by wake_pool
};
std::string_view to_string(SleepMode mode);

// The sleep state of a sleepable pool (pool_sleep_info).
struct PoolSleepInfo {
  bool asleep = false;
  std::size_t segment_bytes = 0;   // bytes of the pool's segments (reserved address ranges)
  std::size_t physical_bytes = 0;  // of which backed by physical memory now (0 while asleep)
  std::size_t saved_bytes = 0;     // pinned host memory holding saved contents (while asleep)
  std::size_t live_bytes = 0;      // bytes of the pool's live allocations (block sizes)
};

class Allocator {
 public:
  // Called on OOM before the error is thrown, without allocator locks held:
  // (device, requested bytes, memory limit, device free bytes).
  using OomObserver = std::function<void(int, std::size_t, std::size_t, std::size_t)>;
  // Asked to free memory held elsewhere when the cache misses; returns true if it freed
  // anything. Called without allocator locks held; it may free ccalloc memory.
  using FreeMemoryCallback = std::function<bool()>;

  // The driver must outlive the allocator.
  explicit Allocator(Driver& driver, Config config = Config::from_environment());
  // Returns every segment to the device; pointers handed out become invalid.
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // Returns `size` bytes usable on `stream`, 512-byte aligned. size 0 returns 0.
  // Throws OutOfMemoryError.
  DevicePtr malloc(std::size_t size, StreamId stream = 0);
  // Frees a pointer returned by malloc. Throws InvalidPointerError for any other pointer.
  void free(DevicePtr ptr);
  // Marks `ptr` as used on `stream`: when freed, it is reused only after the work queued on
  // `stream` up to the free has completed.
  void record_stream(DevicePtr ptr, StreamId stream);
  // Names `stream` by the key PyTorch's allocator hashes it with (c10::Stream::hash()), so
  // that the native engine returns blocks whose cross-stream events complete at the same
  // malloc in PyTorch's order, the order of its hash table of streams
  // (docs/pytorch-behaviour.md §2.10). The PyTorch adapter calls it for every stream given
  // to recordStream; without keys the engine returns them in stream order. Other policies
  // ignore it.
  void set_stream_order_key(StreamId stream, std::uint64_t key);
  // Returns every cached, wholly free segment to the device (after waiting for pending
  // cross-stream frees), including those of private pools whose use count is 0. Does
  // nothing while a capture is underway (begin_allocate_to_pool).
  void empty_cache();

  // --- Private memory pools (CUDA graph capture, torch.cuda.MemPool) ---
  // A private pool has its own segments: its blocks never serve requests outside it (but
  // see set_pool_use_on_oom) and default-pool blocks never serve it. It lives while its use
  // count is positive; at 0 its cached segments go back to the device at the next
  // empty_cache() (or empty_cache(id), or OOM retry), and the pool disappears once it holds
  // no segment. Backends without pools (stitching policy) throw Error.
  //
  // Creates pool `id` with use count 1 and segments from `source` (the device if none), or
  // adds a use to the existing pool (whose source cannot change then). Throws Error for the
  // default id.
  void create_pool(PoolId id, std::optional<SegmentSource> source = std::nullopt);
  // Drops one use (Error if the pool does not exist or has none left).
  void release_pool(PoolId id);
  int pool_use_count(PoolId id) const;
  // When a default-pool request would raise OutOfMemoryError, it may take a free block of
  // this pool instead.
  void set_pool_use_on_oom(PoolId id, bool use_on_oom);
  // Blocks of this pool are never split: each allocation takes a whole free block.
  void set_pool_no_split(PoolId id);
  // From now until end_allocate_to_pool(id), requests on streams for which `filter` is true
  // come from pool `id` (created or incref'd as by create_pool). While any such capture is
  // underway the allocator queries and records no events and returns no memory to the
  // device: frees of blocks used on other streams wait until no capture is underway, and
  // the OOM steps that free memory are skipped. Error if `id` is already being allocated to.
  using StreamFilter = std::function<bool(StreamId)>;
  void begin_allocate_to_pool(PoolId id, StreamFilter filter);
  void end_allocate_to_pool(PoolId id);
  // As PyTorch's emptyCache(mempool_id): returns the cached, wholly free segments of pool
  // `id` if its use count is 0 ({0, 0}: as empty_cache()).
  void empty_cache(PoolId id);
  // The live allocations of pool `id`, by address.
  std::vector<DevicePtr> pool_live_allocations(PoolId id) const;
  // The segments of pool `id`, sorted by address.
  std::vector<SegmentInfo> pool_segments(PoolId id) const;
  // The pool owning the segment that contains `address` ({0, 0}: the default pool or none).
  PoolId segment_pool(DevicePtr address) const;

  // --- Sleep and wake (docs/sleep-wake.md) ---
  // A sleepable pool is a private pool whose segments always live in CUDA virtual memory
  // (an address reservation with physical memory mapped into it), whatever the config, so
  // its physical memory can be released and mapped again at the same addresses. Otherwise
  // it is a private pool like any other (begin_allocate_to_pool, release_pool, ...).
  // Creates pool `id` with use count 1, or adds a use to an existing sleepable pool; Error
  // for the default id, for an existing pool that is not sleepable, and for backends or
  // modes without private pools.
  void create_sleepable_pool(PoolId id);
  // Releases the physical memory of pool `id` while its addresses stay reserved: waits for
  // the device's work, saves the bytes of its live allocations to pinned host memory when
  // `mode` is kSave, returns its wholly free cached segments to the device, then unmaps
  // and releases the physical memory of the others. Pointers into the pool stay valid
  // addresses but must not be touched until wake_pool. Error, changing nothing, for the
  // default pool, an unknown or non-sleepable pool, one already asleep, or while any
  // capture is underway (begin_allocate_to_pool); Error also when the pinned host memory
  // cannot be had (nothing changed then either).
  void sleep_pool(PoolId id, SleepMode mode);
  // Maps physical memory at the sleeping pool's addresses again and copies the saved
  // contents back. OutOfMemoryError when the device cannot provide it even after the
  // other pools' caches were emptied: the pool then stays asleep and the allocator usable.
  // Error for a pool that is not asleep (or as sleep_pool).
  void wake_pool(PoolId id);
  // True while pool `id` sleeps (Error for the default or an unknown pool).
  bool pool_asleep(PoolId id) const;
  // Sizes of a sleepable pool's memory (Error for other pools).
  PoolSleepInfo pool_sleep_info(PoolId id) const;

  // The layout of pool `id`'s segments and which of its blocks are allocated (cudagraph
  // trees). No capture may be underway for it.
  std::shared_ptr<const PoolCheckpoint> checkpoint_pool(PoolId id);
  // Frees every live allocation of the checkpoint's pool, then re-creates the checkpoint's
  // blocks: those allocated then are allocated again (their addresses in `allocated`).
  // Every segment of the checkpoint must still be in the pool.
  PoolRestore restore_pool(const PoolCheckpoint& checkpoint);

  DeviceStats stats() const;
  std::map<std::string, std::int64_t> memory_stats() const { return stats().to_map(); }
  std::string memory_summary(bool abbreviated = false) const;
  void reset_peak_stats();
  void reset_accumulated_stats();

  // Caps reserved memory at fraction x device capacity; 1.0 removes the cap.
  // Throws ConfigError outside [0, 1].
  void set_memory_fraction(double fraction);
  double memory_fraction() const;
  MemInfo mem_get_info();

  // Segments and their blocks, sorted by address (the snapshot's `segments`).
  std::vector<SegmentInfo> segments() const;
  // Size of the block behind a live allocation (rounded), or 0 if `ptr` is not live.
  std::size_t allocation_size(DevicePtr ptr) const;

  void add_oom_observer(OomObserver observer);
  void add_free_memory_callback(FreeMemoryCallback callback);
  // Observers see every trace entry in order, with the caller context history gives it
  // (TraceEntry::context); calls are serialised by the allocator.
  void add_trace_observer(TraceObserver observer);

  // Starts, changes or stops recording history (trace entries, C++ stacks, the caller's
  // context handles): see HistoryOptions in snapshot.hpp.
  void record_history(const HistoryOptions& options);
  // Segments, blocks, the recorded history and the settings, with stacks symbolized and
  // the caller's contexts attached. Appends a `snapshot` entry to the history.
  Snapshot snapshot();
  // Marks the start or end of a named region (a training step, say) in the history's
  // external_annotations; recorded only while history is recorded.
  void annotate(std::string_view name, bool start);
  // Attaches `metadata` to every trace entry the calling thread records from now on, on
  // any device ("" detaches it).
  static void set_user_metadata(const std::string& metadata);

  // Verifies every invariant of the allocator's state (docs/design.md#invariants); throws
  // InvariantError naming the first violation.
  void check_invariants() const;
  // When on, check_invariants() runs after every public operation. Defaults to the
  // environment variable CCALLOC_CHECK_INVARIANTS=1.
  void set_check_invariants(bool on);

  const Config& config() const;
  int device() const;
  Driver& driver() const;

  // Lets device `peer`, which has enabled peer access to this allocator's device, read and
  // write this allocator's memory: its virtual-memory mappings (expandable segments, the
  // stitching policy's pieces) and its stream-ordered pool, now and later
  // (Driver::add_peer). cudaMalloc memory needs only the peer's own enabling. Throws Error
  // for a peer that is this device or negative.
  void enable_peer_access(int peer);

 private:
  friend struct core::BackendAccess;
  std::unique_ptr<core::Backend> impl_;
};

}  // namespace ccalloc
