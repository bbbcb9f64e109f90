// What the PyTorch adapter (torch_allocator.cpp) needs from the engine beyond
// include/ccalloc/allocator.hpp: private memory pools (torch.cuda.MemPool, CUDA graph
// capture), their checkpoints (cudagraph trees, torch.compile(mode="reduce-overhead")),
// settings changed while allocators are live (torch.cuda.memory._set_allocator_settings) and
// sharing expandable segments between processes.
//
// The adapter calls only these functions for those features, with PyTorch's types already
// converted, so that serving a feature means implementing its function in pool_bridge.cpp
// against the engine and nothing in the adapter changes. A function the engine cannot serve
// yet throws NotSupported; the adapter turns that into a c10::Error naming the
// CUDAAllocator method. pool_bridge.cpp says which functions are served today.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"

namespace ccalloc::torch_bridge {

// PyTorch's MempoolId_t: {capture id, 0} for a graph's own pool, {0, uid} for a MemPool or
// graph_pool_handle(), {0, 0} for the default pool (every allocation outside private pools).
using PoolId = std::pair<std::uint64_t, std::uint64_t>;
inline constexpr PoolId kDefaultPool{0, 0};

// The engine cannot do this yet. what() names the missing engine feature.
class NotSupported : public Error {
 public:
  using Error::Error;
};

// Where a pool's segments come from when they do not come from the device: PyTorch's
// MemPool(allocator=...) passes another CUDAAllocator whose raw_alloc/raw_delete provide
// whole segments (vLLM's sleep-mode allocator, NCCL's ncclMemAlloc pools).
struct SegmentSource {
  std::function<DevicePtr(std::size_t bytes)> allocate;
  std::function<void(DevicePtr ptr)> free;
};

// --- Pools (torch.cuda.MemPool, use_mem_pool, CUDA graph pools). ---
// Creates pool `id` with use count 1, or adds one use to an existing pool.
void create_or_incref_pool(Allocator& allocator, PoolId id, std::optional<SegmentSource> source);
// Drops one use; at zero the pool's cached segments may be returned to the device once no
// allocation in it is live.
void release_pool(Allocator& allocator, PoolId id);
int pool_use_count(Allocator& allocator, PoolId id);
// When the default pool cannot serve a request, search this pool's free blocks too.
void set_use_on_oom(Allocator& allocator, PoolId id, bool use_on_oom);
// Blocks of this pool are never split.
void set_no_split(Allocator& allocator, PoolId id);
// From now until end_allocate_to_pool, allocations whose stream passes `filter` come from
// pool `id`. Called before a capture begins: the engine must also stop querying events and
// freeing segments while any capture is underway.
void begin_allocate_to_pool(Allocator& allocator, PoolId id, std::function<bool(StreamId)> filter);
void end_allocate_to_pool(Allocator& allocator, PoolId id);
// Returns the pool's cached, wholly free segments to their source.
void empty_pool_cache(Allocator& allocator, PoolId id);
// True when the live allocations of pool `id` are exactly `expected`.
bool pool_live_allocations_are(Allocator& allocator, PoolId id,
                               const std::vector<DevicePtr>& expected);
// Segments of pool `id` (snapshot(mempool_id) and NCCL's registerMemPool).
std::vector<SegmentInfo> pool_segments(Allocator& allocator, PoolId id);
// The pool that owns the segment starting at `segment_address`.
PoolId segment_pool(Allocator& allocator, DevicePtr segment_address);

// --- Sleepable pools (docs/sleep-wake.md, "PyTorch"). ---
// torch.cuda.MemPool() creates its pool in its constructor (createOrIncrefPool), before
// Python holds the object. While a request is set on a thread, the next pool that
// create_or_incref_pool creates on that thread is created sleepable
// (Allocator::create_sleepable_pool) and the request is consumed; a request with a segment
// source (MemPool(allocator=...)) throws Error instead, since a sleepable pool's segments
// must be CUDA virtual memory. Sets (`enable`) or clears the calling thread's request and
// returns whether one was pending before the call.
bool request_sleepable_pool(bool enable);
void sleep_pool(Allocator& allocator, PoolId id, bool save_contents);
void wake_pool(Allocator& allocator, PoolId id);
bool pool_asleep(Allocator& allocator, PoolId id);
PoolSleepInfo pool_sleep_info(Allocator& allocator, PoolId id);

// --- Provided by the adapter (torch_allocator.cpp) for the C entry points. ---
// The engine serving `device` (-1: the current device) for PyTorch. Error when ccalloc is
// not PyTorch's CUDA allocator (not installed natively) or the device does not exist.
Allocator& native_allocator(int device);

// --- Checkpoints of a pool (cudagraph trees). ---
struct PoolCheckpoint {
  virtual ~PoolCheckpoint() = default;
};
std::shared_ptr<PoolCheckpoint> checkpoint_pool(Allocator& allocator, PoolId id);
// What restoring a checkpoint changed: allocations that no longer exist and allocations
// that exist again (the adapter wraps those in DataPtrs with its deleter).
struct PoolRestore {
  std::vector<DevicePtr> freed;
  std::vector<DevicePtr> allocated;
};
PoolRestore restore_pool(Allocator& allocator, const PoolCheckpoint& checkpoint);

// --- Settings changed while the allocator is live. ---
// Makes `config` the allocator's config for every later decision (expandable_segments,
// max_split_size, roundup_power2_divisions, garbage_collection_threshold, ...). The memory
// fraction is applied by the adapter through Allocator::set_memory_fraction.
void reconfigure(Allocator& allocator, const Config& config);

// --- Sharing expandable segments between processes (PyTorch's handle type 'e'). ---
struct SharedRange {
  // PyTorch's 'e', or 'h': a ccalloc IPC handle (ipc.hpp) for memory of the stitching policy
  // whose physical allocations differ in size, which 'e' (one page size) cannot describe;
  // only ccalloc opens those.
  char type = 'e';
  std::string payload;  // what follows the type byte in PyTorch's handle
  DevicePtr start = 0;  // the first address the payload covers (offset = ptr - start)
};
SharedRange share_expandable(Allocator& allocator, DevicePtr ptr, std::size_t size);
// Maps the shared pages into this process on `device`; the pointer's deleter unmaps them.
std::shared_ptr<void> open_expandable(int device, std::string_view payload);
// The same for a type 'h' payload: the start of the region it shares.
std::shared_ptr<void> open_handles(int device, std::string_view payload);

}  // namespace ccalloc::torch_bridge
