// ccalloc as PyTorch's CUDA allocator: c10::cuda::CUDACachingAllocator::CUDAAllocator
// implemented over one ccalloc::Allocator per device, installed in place of PyTorch's own
// (the `allocator` atomic every torch.cuda memory API reads, and c10's device allocator
// table that torch.accelerator and c10::GetAllocator read).
//
// The per-device allocators are the process's (ccalloc::ProcessAllocator in libccalloc.so,
// which this library links): memory allocated through libccalloc.so's C API in the same
// process comes from the same allocators and shows in torch.cuda's statistics, and the
// other way round. A device's allocator made through the C API first is adopted here on
// first sight (PyTorch's observers and history attached).
//
// Built against the headers of the torch it is loaded into: the interface changes between
// minor versions, so a library built for another torch must not be loaded (install() checks
// nothing it cannot see; the build does).
//
// History: PyTorch's _record_memory_history passes a function that gathers Python and C++
// frames into a GatheredContext. The adapter hands it to the engine as its caller-context
// callback (HistoryOptions::capture_context), so the engine keeps those objects (not
// copies) on live blocks and segments and gives each trace entry its context, by PyTorch's
// rules; torch.cuda.memory._snapshot() shows Python frames exactly as with PyTorch's
// allocator. Trace entries come from the engine's trace observer, with their context; the
// adapter keeps the ring buffer of PyTorch's TraceEntry (compile context, user metadata,
// skipped actions).
#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/cuda.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/process.hpp"
#include "ccalloc/snapshot.hpp"
#include "ccalloc/stats.hpp"
#include "ccalloc/trace.hpp"
#include "core/backend_access.hpp"
#include "stitch/backend.hpp"
#include "pool_bridge.hpp"
#include "torch_history.hpp"

namespace {

namespace c10a = c10::cuda::CUDACachingAllocator;
namespace bridge = ccalloc::torch_bridge;
using c10::CachingDeviceAllocator::AnnotationEntry;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::TraceEntry;
using c10::MempoolId_t;

using bridge::History;
using bridge::kMaxDevices;
using bridge::now_us;
// PyTorch's handle format for Storage._share_cuda_: version byte, type byte, payload.
constexpr char kShareableHandleVersion = 2;
constexpr char kShareableCudaMalloc = 'c';
constexpr char kShareableExpandableSegment = 'e';
// ccalloc's own: memory of the stitching policy in physical allocations of different sizes
// (ipc_bridge.cpp); PyTorch's allocator refuses the type, ccalloc opens it.
constexpr char kShareableCcallocHandles = 'h';

void local_raw_delete(void* ptr);

bridge::PoolId pool_id(const MempoolId_t& id) {
  return {id.first, id.second};
}

// Runs `fn`, turning the engine's errors into PyTorch's: OutOfMemoryError for an
// out-of-memory, "not supported yet" naming the CUDAAllocator method for a missing engine
// feature, c10::Error otherwise.
template <typename Fn>
auto translated(const char* method, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const ccalloc::OutOfMemoryError& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  } catch (const bridge::NotSupported& e) {
    TORCH_CHECK(false, "ccalloc does not yet support ", method, ": ", e.what());
  } catch (const ccalloc::InvalidPointerError& e) {
    TORCH_CHECK(false, e.what());
  } catch (const ccalloc::Error& e) {
    TORCH_CHECK(false, method, ": ", e.what());
  }
}

void copy_stat(const ccalloc::Stat& from, c10::CachingAllocator::Stat& to) {
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
}

void copy_stats(const ccalloc::StatArray& from, c10::CachingAllocator::StatArray& to) {
  for (std::size_t i = 0; i < from.size(); ++i)
    copy_stat(from[i], to[i]);
}

c10a::DeviceStats to_c10(const ccalloc::DeviceStats& s) {
  c10a::DeviceStats out;
  copy_stats(s.allocation, out.allocation);
  copy_stats(s.segment, out.segment);
  copy_stats(s.active, out.active);
  copy_stats(s.inactive_split, out.inactive_split);
  copy_stats(s.allocated_bytes, out.allocated_bytes);
  copy_stats(s.reserved_bytes, out.reserved_bytes);
  copy_stats(s.active_bytes, out.active_bytes);
  copy_stats(s.inactive_split_bytes, out.inactive_split_bytes);
  copy_stats(s.requested_bytes, out.requested_bytes);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  copy_stat(s.oversize_allocations, out.oversize_allocations);
  copy_stat(s.oversize_segments, out.oversize_segments);
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  out.max_split_size = s.max_split_size;
  return out;
}

// The backend PyTorch's allocator variable names ("backend:native" or
// "backend:cudaMallocAsync", in PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF), if any.
std::optional<std::string> backend_named_by_pytorch() {
  for (const char* variable : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
    const char* value = std::getenv(variable);
    if (value == nullptr) continue;
    std::stringstream in(value);
    std::string item;
    std::optional<std::string> named;
    while (std::getline(in, item, ',')) {
      const auto colon = item.find(':');
      if (colon == std::string::npos) continue;
      const auto trim = [](std::string t) {
        const auto b = t.find_first_not_of(" \t");
        const auto e = t.find_last_not_of(" \t");
        return b == std::string::npos ? std::string() : t.substr(b, e - b + 1);
      };
      if (trim(item.substr(0, colon)) == "backend") named = trim(item.substr(colon + 1));
    }
    return named;  // the first variable set is the one PyTorch reads
  }
  return std::nullopt;
}

std::int64_t reported_max_split(const ccalloc::Config& c) {
  return c.max_split_size == SIZE_MAX ? -1 : static_cast<std::int64_t>(c.max_split_size);
}


// One entry of the IPC cache: memory another process shared, opened once per process
// (cudaIpcOpenMemHandle refuses a second open of the same handle).
struct IpcEntry {
  c10::DeviceIndex device = 0;
  void* cuda_ipc_ptr = nullptr;        // a 'c' handle
  std::shared_ptr<void> expandable;    // an 'e' handle, mapped by the engine
  std::weak_ptr<void> handed_out;
  void* ptr() const { return cuda_ipc_ptr != nullptr ? cuda_ipc_ptr : expandable.get(); }
};

class TorchAllocator final : public c10a::CUDAAllocator {
 public:
  // Makes no CUDA call and reads no variable: the configuration, the backend's name and
  // the devices are read when PyTorch initializes CUDA (init()) or at the first allocation,
  // as PyTorch reads its own, so that installing ccalloc at interpreter start leaves a
  // process free to set its variables and to fork before its first CUDA use.
  TorchAllocator() : process_(ccalloc::ProcessAllocator::instance()) {}

  // --- c10::Allocator ---

  c10::DataPtr allocate(size_t size) override {
    constexpr size_t kOneExaByte = 1152921504606846976ULL;
    TORCH_CHECK_WITH(OutOfMemoryError, size < kOneExaByte,
                     "CUDA out of memory. Tried to allocate more than 1EB memory.");
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    const c10::Device where(c10::DeviceType::CUDA, device);
    if (!enabled_.load(std::memory_order_relaxed)) {
      void* ptr = uncached_allocate(size);
      return {ptr, ptr, &uncached_delete, where};
    }
    void* ptr = nullptr;
    if (size != 0) ptr = malloc(device, size, c10::cuda::getCurrentCUDAStream(device).stream());
    return {ptr, ptr, &local_raw_delete, where};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return enabled_.load(std::memory_order_relaxed) ? &local_raw_delete : &uncached_delete;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // --- c10::DeviceAllocator ---

  bool initialized() override { return device_count_.load(std::memory_order_acquire) > 0; }

  void emptyCache(MempoolId_t mempool_id) override {
    translated("emptyCache", [&] {
      for (int d = 0; d < kMaxDevices; ++d) {
        ccalloc::Allocator* a = existing(d);
        if (a == nullptr) continue;
        if (mempool_id == MempoolId_t{0, 0}) {
          a->empty_cache();
        } else {
          bridge::empty_pool_cache(*a, pool_id(mempool_id));
        }
      }
    });
  }

  c10a::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    c10a::DeviceStats out;
    if (ccalloc::Allocator* a = existing(device)) out = to_c10(a->stats());
    std::lock_guard lock(create_mutex_);
    out.max_split_size = init_max_split_ ? *init_max_split_ : reported_max_split(config_locked());
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device);
    if (ccalloc::Allocator* a = existing(device)) a->reset_accumulated_stats();
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    if (ccalloc::Allocator* a = existing(device)) a->reset_peak_stats();
  }

  // --- CUDAAllocator ---

  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    if (!enabled_.load(std::memory_order_relaxed)) return uncached_allocate(nbytes);
    return malloc(device, nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    if (!enabled_.load(std::memory_order_relaxed)) return uncached_allocate(nbytes);
    return malloc(device, nbytes, stream);
  }

  void raw_delete(void* ptr) override {
    if (!enabled_.load(std::memory_order_relaxed)) {
      uncached_delete(ptr);
    } else {
      free(ptr);
    }
  }

  void init(int device_count) override {
    TORCH_CHECK(device_count <= kMaxDevices, "ccalloc serves at most ", kMaxDevices,
                " devices; this process sees ", device_count);
    int expected = device_count_.load();
    while (expected < device_count && !device_count_.compare_exchange_weak(expected, device_count)) {
    }
    // PyTorch creates every device's allocator here, and memory_stats() reports the
    // max_split_size of that moment whatever is set later; ccalloc's engines come on first
    // use, so the value is kept here.
    std::lock_guard lock(create_mutex_);
    if (!init_max_split_) init_max_split_ = reported_max_split(config_locked());
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    check_device(device);
    if (ccalloc::Allocator* a = existing(device)) return a->memory_fraction();
    std::lock_guard lock(create_mutex_);
    return config_locked().per_process_memory_fraction;
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(0 <= fraction && fraction <= 1, "invalid fraction:", fraction,
                ". Please set within [0, 1].");
    translated("setMemoryFraction", [&] { allocator(device).set_memory_fraction(fraction); });
  }

  std::vector<c10a::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override {
    check_device(device);
    std::vector<c10a::StreamSegmentSize> out;
    if (ccalloc::Allocator* a = existing(device)) {
      for (const ccalloc::SegmentInfo& s : a->segments()) {
        if (s.is_expandable) {
          out.emplace_back(reinterpret_cast<cudaStream_t>(s.stream), s.is_small, s.total_size);
        }
      }
    }
    return out;
  }

  void enable(bool value) override { enabled_.store(value, std::memory_order_relaxed); }
  bool isEnabled() const override { return enabled_.load(std::memory_order_relaxed); }

  // The largest cached free block of the device, as cuDNN sizes its workspace with: with
  // *largestBlock 0 on entry, the device's free memory is the first guess (as PyTorch).
  // Under backend:cudaMallocAsync, the largest request the device's pool serves now, found
  // as PyTorch's cudaMallocAsync backend finds it (async_workspace_guess).
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    check_device(device);
    translated("cacheInfo", [&] {
      ccalloc::Allocator& a = allocator(device);
      if (a.config().backend == ccalloc::BackendKind::kCudaMallocAsync) {
        *largestBlock = async_workspace_guess(a, device);
        return;
      }
      if (*largestBlock == 0) *largestBlock = a.mem_get_info().free_bytes;
      for (const ccalloc::SegmentInfo& s : a.segments()) {
        for (const ccalloc::BlockInfo& b : s.blocks) {
          if (b.state == ccalloc::BlockState::kInactive) *largestBlock = std::max(*largestBlock, b.size);
        }
      }
    });
  }

  // cuDNN's benchmark takes the workspace it may use from cacheInfo, then asks for it and
  // skips algorithms whose request raises OutOfMemoryError. The pool cannot say what it
  // would serve, so, as PyTorch's backend: from the device's free memory (at most what the
  // memory fraction leaves), halve a trial request on the current stream until one
  // succeeds, and give it back to the pool (kept there, not returned to the device). The
  // trials bypass the allocator's statistics and history, and a refused one leaves no
  // CUDA error behind (the driver clears it).
  static std::size_t async_workspace_guess(ccalloc::Allocator& a, c10::DeviceIndex device) {
    const ccalloc::MemInfo info = a.mem_get_info();
    std::size_t guess = info.free_bytes;
    if (a.memory_fraction() < 1.0) {
      const auto limit =
          static_cast<std::size_t>(a.memory_fraction() * static_cast<double>(info.total_bytes));
      const auto used =
          static_cast<std::size_t>(a.stats().allocated_bytes[ccalloc::kAggregate].current);
      guess = std::min(guess, limit > used ? limit - used : 0);
    }
    const auto stream =
        reinterpret_cast<ccalloc::StreamId>(c10::cuda::getCurrentCUDAStream(device).stream());
    ccalloc::Driver& driver = a.driver();
    for (; guess > 0; guess >>= 1) {
      if (const ccalloc::DevicePtr trial = driver.allocate_async(guess, stream)) {
        driver.free_async(trial, guess, stream);
        return guess;
      }
    }
    return 0;
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    const Located found = locate(ptr);
    TORCH_CHECK(!found.segment.is_expandable,
                "Tensors allocated with expandable_segments:True cannot be shared between "
                "processes. Consider using expandable_segments:False in data loading workers via "
                "torch.cuda.memory._set_allocator_settings('expandable_segments:False')");
    if (size != nullptr) *size = found.segment.total_size;
    return reinterpret_cast<void*>(found.segment.address);
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // Empty tensors have no block; storages shared by another process have another
    // deleter and are kept alive by torch.multiprocessing's reference counting instead.
    if (ptr.get() == nullptr || ptr.get_deleter() != &local_raw_delete) return;
    translated("recordStream", [&] {
      ccalloc::Allocator& a = owner(ptr.get());
      const auto s = reinterpret_cast<ccalloc::StreamId>(stream.stream());
      // PyTorch's allocator hashes streams by c10::Stream::hash(): with the key, the native
      // engine returns frees completing together in PyTorch's order (§2.10).
      a.set_stream_order_key(s, stream.unwrap().hash());
      a.record_stream(reinterpret_cast<ccalloc::DevicePtr>(ptr.get()), s);
    });
  }

  c10a::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    return translated("snapshot", [&] {
      c10a::SnapshotInfo result;
      result.external_annotations = history_.annotations();
      const int devices = device_count();
      for (int d = 0; d < devices; ++d) {
        result.device_traces.push_back(include_traces ? history_.trace(d)
                                                      : std::vector<TraceEntry>{});
        ccalloc::Allocator* a = existing(d);
        if (a == nullptr) continue;
        const std::vector<ccalloc::SegmentInfo> segments =
            mempool_id == MempoolId_t{0, 0} ? a->segments()
                                            : bridge::pool_segments(*a, pool_id(mempool_id));
        std::size_t active = 0;
        for (const ccalloc::SegmentInfo& s : segments) {
          result.segments.push_back(segment_to_c10(*a, s));
          active += s.active_size;
        }
        history_.record_snapshot(d, active);
      }
      fill_config_metadata(result.config_metadata);
      return result;
    });
  }

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    check_device(device);
    translated("beginAllocateToPool", [&] {
      bridge::begin_allocate_to_pool(
          allocator(device), pool_id(mempool_id),
          [filter = std::move(filter)](ccalloc::StreamId s) {
            return filter(reinterpret_cast<cudaStream_t>(s));
          });
    });
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    translated("endAllocateToPool",
               [&] { bridge::end_allocate_to_pool(allocator(device), pool_id(mempool_id)); });
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    translated("releasePool", [&] { bridge::release_pool(allocator(device), pool_id(mempool_id)); });
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    return translated("getPoolUseCount",
                      [&] { return bridge::pool_use_count(allocator(device), pool_id(mempool_id)); });
  }

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<c10a::CUDAAllocator> pool_allocator) override {
    check_device(device);
    std::optional<bridge::SegmentSource> source;
    if (pool_allocator) {
      // The pool's segments come from the other allocator's raw_alloc/raw_delete, on the
      // device current when they are requested (the engine makes the pool's device current).
      source = bridge::SegmentSource{
          [pool_allocator](std::size_t bytes) {
            return reinterpret_cast<ccalloc::DevicePtr>(pool_allocator->raw_alloc(bytes));
          },
          [pool_allocator](ccalloc::DevicePtr ptr) {
            pool_allocator->raw_delete(reinterpret_cast<void*>(ptr));
          }};
    }
    translated("createOrIncrefPool", [&] {
      bridge::create_or_incref_pool(allocator(device), pool_id(mempool_id), std::move(source));
    });
  }

  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override {
    check_device(device);
    translated("setUseOnOOM", [&] {
      bridge::set_use_on_oom(allocator(device), pool_id(mempool_id), use_on_oom);
    });
  }

  void setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    translated("setNoSplit", [&] { bridge::set_no_split(allocator(device), pool_id(mempool_id)); });
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override {
    check_device(device);
    std::vector<ccalloc::DevicePtr> expected;
    expected.reserve(expected_live_allocations.size());
    for (void* p : expected_live_allocations)
      expected.push_back(reinterpret_cast<ccalloc::DevicePtr>(p));
    return translated("checkPoolLiveAllocations", [&] {
      return bridge::pool_live_allocations_are(allocator(device), pool_id(mempool_id), expected);
    });
  }

  // PyTorch's format: [version 2]['c'][cudaIpcMemHandle_t of the segment base], with the
  // offset of `ptr` in that segment; the receiver opens the whole segment once.
  c10a::ShareableHandle shareIpcHandle(void* ptr) override {
    const Located found = locate(ptr);
    std::ostringstream ss;
    ss.put(kShareableHandleVersion);
    if (!found.segment.is_expandable) {
      ss.put(kShareableCudaMalloc);
      cudaIpcMemHandle_t handle;
      C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(found.segment.address)));
      ss.write(reinterpret_cast<const char*>(&handle), CUDA_IPC_HANDLE_SIZE);
      return {static_cast<ptrdiff_t>(found.block.address - found.segment.address), ss.str()};
    }
    const bridge::SharedRange range = translated("shareIpcHandle", [&] {
      return bridge::share_expandable(*found.allocator, found.block.address, found.block.size);
    });
    ss.put(range.type);
    ss.write(range.payload.data(), static_cast<std::streamsize>(range.payload.size()));
    return {static_cast<ptrdiff_t>(found.block.address - range.start), ss.str()};
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard lock(ipc_mutex_);
    auto it = ipc_cache_.find(handle);
    if (it != ipc_cache_.end()) {
      std::shared_ptr<void> ptr = it->second.handed_out.lock();
      TORCH_INTERNAL_ASSERT(ptr, "ccalloc: IPC cache entry without a live pointer");
      return ptr;
    }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    IpcEntry entry;
    entry.device = device;
    char type = kShareableCudaMalloc;
    std::size_t payload = 0;
    // A 64-byte string is a raw cudaIpcMemHandle_t from a PyTorch before handle versions.
    if (handle.size() != CUDA_IPC_HANDLE_SIZE) {
      TORCH_CHECK(handle.size() >= 2, "ccalloc: IPC handle of ", handle.size(),
                  " bytes is too short to be a PyTorch shareable handle");
      TORCH_CHECK(handle[0] <= kShareableHandleVersion,
                  "received sharable handle from a future version of torch that this version "
                  "does not know how to handle");
      type = handle[1];
      payload = 2;
    }
    if (type == kShareableCudaMalloc) {
      TORCH_CHECK(handle.size() - payload == CUDA_IPC_HANDLE_SIZE, "ccalloc: IPC handle of type 'c' has ",
                  handle.size() - payload, " payload bytes, expected ", CUDA_IPC_HANDLE_SIZE);
      cudaIpcMemHandle_t cuda_handle;
      std::memcpy(&cuda_handle, handle.data() + payload, CUDA_IPC_HANDLE_SIZE);
      C10_CUDA_CHECK(
          cudaIpcOpenMemHandle(&entry.cuda_ipc_ptr, cuda_handle, cudaIpcMemLazyEnablePeerAccess));
    } else if (type == kShareableExpandableSegment) {
      entry.expandable = translated("getIpcDevPtr", [&] {
        return bridge::open_expandable(device, std::string_view(handle).substr(payload));
      });
    } else if (type == kShareableCcallocHandles) {
      entry.expandable = translated("getIpcDevPtr", [&] {
        return bridge::open_handles(device, std::string_view(handle).substr(payload));
      });
    } else {
      TORCH_CHECK(false, "ccalloc: unexpected or ill-formed shareable handle type ",
                  static_cast<int>(type));
    }
    auto inserted = ipc_cache_.emplace(handle, std::move(entry)).first;
    std::shared_ptr<void> sp(inserted->second.ptr(), [this, handle](void*) {
      std::unique_lock deleter_lock(ipc_mutex_);
      auto found = ipc_cache_.find(handle);
      TORCH_INTERNAL_ASSERT(found != ipc_cache_.end());
      IpcEntry closing = std::move(found->second);
      ipc_cache_.erase(found);
      deleter_lock.unlock();
      if (closing.cuda_ipc_ptr != nullptr) {
        c10::cuda::CUDAGuard guard(closing.device);
        C10_CUDA_CHECK(cudaIpcCloseMemHandle(closing.cuda_ipc_ptr));
      }
    });
    inserted->second.handed_out = sp;
    return sp;
  }

  bool isHistoryEnabled() override { return history_.recording(); }

  void recordHistory(bool enabled, c10a::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    history_.record_history(enabled, context_recorder, alloc_trace_max_entries, when, clearHistory,
                            skip_actions);
    {
      std::lock_guard lock(create_mutex_);
      const ccalloc::HistoryOptions engine = history_.engine_history();
      for (int d = 0; d < kMaxDevices; ++d) {
        if (ccalloc::Allocator* a = existing_locked(d)) a->record_history(engine);
      }
    }
    if (enabled) observe_all();
  }

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    history_.annotate(md);
  }
  // As PyTorch: on the current device's allocator, and only while history is recorded.
  void pushCompileContext(std::string& md) override {
    if (history_.recording()) history_.push_compile_context(current_device(), md);
  }
  void popCompileContext() override {
    if (history_.recording()) history_.pop_compile_context(current_device());
  }
  void setUserMetadata(const std::string& metadata) override {
    history_.set_user_metadata(current_device(), metadata);
  }
  std::string getUserMetadata() override { return history_.user_metadata(current_device()); }

  void attachOutOfMemoryObserver(c10a::OutOfMemoryObserver observer) override {
    std::lock_guard lock(create_mutex_);
    oom_observers_.push_back(observer);
    for (int d = 0; d < kMaxDevices; ++d) {
      if (ccalloc::Allocator* a = existing_locked(d)) add_oom_observer(*a, observer);
    }
  }

  void attachAllocatorTraceTracker(c10a::AllocatorTraceTracker tracker) override {
    history_.attach_tracker(std::move(tracker));
    observe_all();
  }

  // `dev` may access `dev_to_access`'s memory: cudaMalloc memory through the runtime's
  // peer access, mapped memory (expandable segments, stitched pieces, the stream-ordered
  // pool) only once `dev_to_access`'s allocator grants `dev` access to it, as PyTorch's
  // addPeerAccess does.
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    {
      c10::cuda::CUDAGuard device_guard(dev);
      cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // already enabled: clear the sticky error
      } else {
        C10_CUDA_CHECK(err);
      }
    }
    check_device(dev_to_access);
    translated("enablePeerAccess", [&] { allocator(dev_to_access).enable_peer_access(dev); });
  }

  // Memory that is not from cudaMalloc (expandable segments, the stream-ordered pool) can
  // be copied between devices without peer access only by cudaMemcpyPeerAsync.
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || srcDevice == dstDevice ||
        (!may_hold_mapped_memory(dstDevice) && !may_hold_mapped_memory(srcDevice))) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::shared_ptr<c10a::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                           MempoolId_t id) override {
    check_device(device);
    auto checkpoint = translated(
        "getCheckpointState", [&] { return bridge::checkpoint_pool(allocator(device), pool_id(id)); });
    return std::make_shared<CheckpointState>(std::move(checkpoint));
  }

  c10a::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                               std::shared_ptr<c10a::AllocatorState> pps) override {
    check_device(device);
    auto state = std::dynamic_pointer_cast<CheckpointState>(pps);
    TORCH_CHECK(state && state->checkpoint, "ccalloc: setCheckpointPoolState expects a state from "
                                            "ccalloc's getCheckpointState");
    const bridge::PoolRestore restored = translated(
        "setCheckpointPoolState", [&] { return bridge::restore_pool(allocator(device), *state->checkpoint); });
    c10a::CheckpointDelta delta;
    for (ccalloc::DevicePtr p : restored.freed)
      delta.ptrs_freed.push_back(reinterpret_cast<void*>(p));
    for (ccalloc::DevicePtr p : restored.allocated) {
      void* v = reinterpret_cast<void*>(p);
      delta.dataptrs_allocd.emplace_back(v, v, &local_raw_delete,
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // "ccalloc", unless PyTorch's own variable names a backend: PyTorch parses that variable
  // again at run time (capture, cuDNN, settings changed live) and asserts that the backend
  // it names is the allocator's name, so ccalloc answers with that name ("native" or
  // "cudaMallocAsync"; docs/pytorch-behaviour.md, §1.1). The name in force is the one of
  // initialization (init() or the first allocation); before it, what the variables say now.
  std::string name() override {
    if (const std::string* named = name_.load(std::memory_order_acquire)) return *named;
    return backend_named_by_pytorch().value_or("ccalloc");
  }

  // --- Used by the deleter, the install entry point and the sleep entry points. ---

  // The engine of `device` (created on first use), for sleep_api.cpp's entry points: a
  // device that does not exist is a ccalloc::Error, as their other misuse.
  ccalloc::Allocator& device_engine(int device) {
    const int devices = device_count();
    if (device < 0 || device >= devices) {
      throw ccalloc::Error("ccalloc: no CUDA device " + std::to_string(device) +
                           " (this process sees " + std::to_string(devices) + ")");
    }
    return allocator(device);
  }

  void free(void* ptr) {
    if (ptr == nullptr) return;
    trace_gpu_free(ptr);
    translated("free", [&] {
      ccalloc::Allocator& a = owner(ptr);
      const auto p = reinterpret_cast<ccalloc::DevicePtr>(ptr);
      if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
        const std::size_t bytes = a.allocation_size(p);
        a.free(p);
        report_to_profiler(a, ptr, -static_cast<std::int64_t>(bytes));
        return;
      }
      a.free(p);
    });
  }

  // torch.cuda.memory._set_allocator_settings(): PyTorch has parsed `settings` into its
  // config singletons; ccalloc merges the keys over its own config as PyTorch's parser
  // does: max_split_size_mb, roundup_power2_divisions and garbage_collection_threshold go
  // back to their defaults on every call, so a string that leaves them out resets them;
  // the other keys keep their values. Devices first used afterwards get the merged
  // config; live allocators take the memory fraction at once and the rest through the
  // engine's live reconfiguration.
  void apply_settings(const std::string& settings) {
    std::lock_guard lock(create_mutex_);
    const ccalloc::Config current = config_locked();
    ccalloc::Config merged;
    try {
      ccalloc::Config base = current;
      const ccalloc::Config defaults;
      base.max_split_size = defaults.max_split_size;
      base.roundup_power2_divisions = defaults.roundup_power2_divisions;
      base.garbage_collection_threshold = defaults.garbage_collection_threshold;
      merged = ccalloc::Config::parse(base.to_string() + "," + settings);
    } catch (const ccalloc::ConfigError& e) {
      TORCH_WARN("ccalloc ignores allocator settings \"", settings, "\": ", e.what());
      return;
    }
    const bool fraction_changed =
        merged.per_process_memory_fraction != current.per_process_memory_fraction;
    ccalloc::Config others = merged;
    others.per_process_memory_fraction = current.per_process_memory_fraction;
    others.source = current.source;
    const bool others_changed = !(others == current);
    std::string kept;
    bool changed_any = false;
    for (int d = 0; d < kMaxDevices; ++d) {
      ccalloc::Allocator* a = existing_locked(d);
      if (a == nullptr) continue;
      if (others_changed) {
        try {
          bridge::reconfigure(*a, merged);
          changed_any = true;
        } catch (const bridge::NotSupported&) {
          kept += (kept.empty() ? "" : ", ") + std::to_string(d);
        } catch (const ccalloc::ConfigError& e) {
          // A key that cannot change while the allocator lives (backend, ...): every
          // device refuses it alike, at the first one, before anything changed.
          TORCH_CHECK(!changed_any, "ccalloc: allocator settings \"", settings,
                      "\" were applied to some devices only: ", e.what());
          TORCH_CHECK(false, "ccalloc cannot apply allocator settings \"", settings, "\": ", e.what());
        }
      }
      if (fraction_changed) a->set_memory_fraction(merged.per_process_memory_fraction);
    }
    config_ = merged;
    process_.set_config(merged);  // for devices first used from now on, whatever the route
    if (merged.expandable_segments) expandable_seen_.store(true);
    if (!kept.empty()) {
      TORCH_WARN("ccalloc: allocator settings \"", settings,
                 "\" apply to devices first used from now on; device(s) ", kept,
                 " keep the settings they started with (their backend cannot change them live)");
    }
  }

 private:
  struct Located {
    ccalloc::Allocator* allocator = nullptr;
    ccalloc::SegmentInfo segment;
    ccalloc::BlockInfo block;
  };

  struct CheckpointState final : c10a::AllocatorState {
    explicit CheckpointState(std::shared_ptr<bridge::PoolCheckpoint> c) : checkpoint(std::move(c)) {}
    std::shared_ptr<bridge::PoolCheckpoint> checkpoint;
  };

  static void* uncached_allocate(size_t size) {
    void* ptr = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&ptr, size));
    trace_gpu_alloc(ptr);
    return ptr;
  }

  static void uncached_delete(void* ptr) {
    trace_gpu_free(ptr);
    C10_CUDA_CHECK(cudaFree(ptr));
  }

  // torch.cuda's sanitizer hooks (CUDA_SANITIZER=1), as PyTorch's allocator calls them.
  static void trace_gpu_alloc(void* ptr) {
    const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
    if (C10_UNLIKELY(interp)) {
      (*interp)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<uintptr_t>(ptr));
    }
  }
  static void trace_gpu_free(void* ptr) {
    const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
    if (C10_UNLIKELY(interp)) {
      (*interp)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<uintptr_t>(ptr));
    }
  }

  void* malloc(c10::DeviceIndex device, size_t size, cudaStream_t stream) {
    ccalloc::Allocator& a = allocator(device);
    void* ptr = translated("malloc", [&] {
      try {
        return reinterpret_cast<void*>(
            a.malloc(size, reinterpret_cast<ccalloc::StreamId>(stream)));
      } catch (const ccalloc::OutOfMemoryError&) {
        if (c10::memoryProfilingEnabled()) {
          const ccalloc::DeviceStats s = a.stats();
          c10::reportOutOfMemoryToProfiler(
              static_cast<std::int64_t>(size),
              static_cast<std::size_t>(s.allocated_bytes[ccalloc::kAggregate].current),
              static_cast<std::size_t>(s.reserved_bytes[ccalloc::kAggregate].current),
              c10::Device(c10::DeviceType::CUDA, device));
        }
        throw;
      }
    });
    trace_gpu_alloc(ptr);
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
      report_to_profiler(a, ptr, static_cast<std::int64_t>(
                                     a.allocation_size(reinterpret_cast<ccalloc::DevicePtr>(ptr))));
    }
    return ptr;
  }

  // PyTorch's profiler (profile_memory=True on this thread) hears of every allocation and
  // free with the device's allocated and reserved totals after it, as from PyTorch's
  // allocator: torch.profiler's memory view, export_memory_timeline and _memory_viz's
  // profile plot are built from these events. Negative `bytes`: a free.
  static void report_to_profiler(ccalloc::Allocator& a, void* ptr, std::int64_t bytes) {
    const ccalloc::DeviceStats s = a.stats();
    c10::reportMemoryUsageToProfiler(
        ptr, bytes, static_cast<std::size_t>(s.allocated_bytes[ccalloc::kAggregate].current),
        static_cast<std::size_t>(s.reserved_bytes[ccalloc::kAggregate].current),
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(a.driver().device())));
  }

  static int current_device() {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return device;
  }

  int device_count() const {
    const int n = device_count_.load(std::memory_order_acquire);
    return n > 0 ? n : std::min(ccalloc::cuda::device_count(), kMaxDevices);
  }

  void check_device(c10::DeviceIndex device) const {
    TORCH_CHECK(0 <= device && device < device_count(), "Invalid device argument ",
                static_cast<int>(device), ": did you call init?");
  }

  ccalloc::Allocator* adopted(int device) const {
    if (device < 0 || device >= kMaxDevices) return nullptr;
    return adopted_[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
  }

  // The allocator of `device` if the process has one (made here or through libccalloc.so's
  // C API), else nullptr; never creates one.
  ccalloc::Allocator* existing(int device) {
    if (ccalloc::Allocator* a = adopted(device)) return a;
    if (process_.existing(device) == nullptr) return nullptr;
    std::lock_guard lock(create_mutex_);
    return existing_locked(device);
  }

  // existing(), with create_mutex_ held.
  ccalloc::Allocator* existing_locked(int device) {
    if (ccalloc::Allocator* a = adopted(device)) return a;
    if (process_.existing(device) == nullptr) return nullptr;
    return adopt_locked(device);
  }

  // The allocator of `device`, created on first use.
  ccalloc::Allocator& allocator(int device) {
    if (ccalloc::Allocator* a = adopted(device)) return *a;
    check_device(static_cast<c10::DeviceIndex>(device));
    std::lock_guard lock(create_mutex_);
    if (ccalloc::Allocator* a = adopted(device)) return *a;
    (void)config_locked();
    // The process allocator's config for new devices is config_ (apply_settings keeps them
    // equal).
    translated("init", [&] { (void)process_.allocator(device); });
    return *adopt_locked(device);
  }

  // Attaches PyTorch's observers and history to the process's allocator of `device` and
  // publishes it; create_mutex_ held, the allocator exists.
  ccalloc::Allocator* adopt_locked(int device) {
    ccalloc::Allocator* a = process_.existing(device);
    for (const auto& observer : oom_observers_)
      add_oom_observer(*a, observer);
    if (history_.recording()) a->record_history(history_.engine_history());
    if (history_.observed()) observe(device, *a);
    adopted_[static_cast<std::size_t>(device)].store(a, std::memory_order_release);
    const int sole = sole_device_.load();
    sole_device_.store(sole == -1 ? device : -2, std::memory_order_release);
    return a;
  }

  // The allocator holding `ptr` live. While one device has an allocator (the common case)
  // that is the one; else the current device is tried first.
  ccalloc::Allocator& owner(void* ptr) {
    const int sole = sole_device_.load(std::memory_order_acquire);
    if (sole >= 0) return *existing(sole);
    const auto p = reinterpret_cast<ccalloc::DevicePtr>(ptr);
    c10::DeviceIndex current = 0;
    if (c10::cuda::GetDevice(&current) == cudaSuccess) {
      ccalloc::Allocator* a = existing(current);
      if (a != nullptr && a->allocation_size(p) != 0) return *a;
    }
    for (int d = 0; d < kMaxDevices; ++d) {
      ccalloc::Allocator* a = existing(d);
      if (a != nullptr && d != current && a->allocation_size(p) != 0) return *a;
    }
    TORCH_CHECK(false, "invalid device pointer: ", ptr);
  }

  // The live allocation at `ptr` (exactly its start, as PyTorch requires) with its segment.
  Located locate(void* ptr) {
    const auto p = reinterpret_cast<ccalloc::DevicePtr>(ptr);
    Located found;
    found.allocator = &owner(ptr);
    for (const ccalloc::SegmentInfo& s : found.allocator->segments()) {
      if (p < s.address || p >= s.address + s.total_size) continue;
      for (const ccalloc::BlockInfo& b : s.blocks) {
        if (b.address == p && b.state == ccalloc::BlockState::kActiveAllocated) {
          found.segment = s;
          found.block = b;
          return found;
        }
      }
    }
    TORCH_CHECK(false, "invalid device pointer: ", ptr);
  }

  static void add_oom_observer(ccalloc::Allocator& a, const c10a::OutOfMemoryObserver& observer) {
    a.add_oom_observer([observer](int device, std::size_t requested, std::size_t limit,
                                  std::size_t device_free) {
      observer(device, requested, limit, device_free);
    });
  }

  // create_mutex_ held.
  void observe(int device, ccalloc::Allocator& a) {
    bool& observed = observed_[static_cast<std::size_t>(device)];
    if (observed) return;
    a.add_trace_observer(
        [this, device](const ccalloc::TraceEntry& e) { history_.on_entry(device, e); });
    observed = true;
  }

  void observe_all() {
    std::lock_guard lock(create_mutex_);
    for (int d = 0; d < kMaxDevices; ++d) {
      if (ccalloc::Allocator* a = existing_locked(d)) observe(d, *a);
    }
  }

  bool may_hold_mapped_memory(int device) {
    if (device < 0 || device >= kMaxDevices) return false;
    const ccalloc::Allocator* a = existing(device);
    if (a == nullptr) return false;
    // Expandable segments outlive a switch back to expandable_segments:False, and the
    // engine's config may be changing meanwhile: once seen in any config, assume them.
    return expandable_seen_.load() || a->config().backend == ccalloc::BackendKind::kCudaMallocAsync;
  }

  c10a::SegmentInfo segment_to_c10(ccalloc::Allocator& a, const ccalloc::SegmentInfo& s) {
    c10a::SegmentInfo out;
    out.device = static_cast<c10::DeviceIndex>(s.device);
    out.address = s.address;
    out.total_size = s.total_size;
    out.requested_size = s.requested_size;
    out.allocated_size = s.allocated_size;
    out.active_size = s.active_size;
    out.stream = reinterpret_cast<void*>(s.stream);
    out.is_large = !s.is_small;
    out.is_expandable = s.is_expandable;
    const bridge::PoolId owner_pool = bridge::segment_pool(a, s.address);
    out.owner_private_pool_id = {owner_pool.first, owner_pool.second};
    if (s.context && history_.segment_keeps_context(s.address)) {
      out.context_when_allocated = History::gathered(s.context);
    }
    out.blocks.reserve(s.blocks.size());
    for (const ccalloc::BlockInfo& b : s.blocks) {
      c10a::BlockInfo block;
      block.size = b.size;
      block.requested_size = b.requested_size;
      block.allocated = b.state == ccalloc::BlockState::kActiveAllocated;
      block.active = b.state != ccalloc::BlockState::kInactive;
      if (block.active && b.context) block.context_when_allocated = History::gathered(b.context);
      out.blocks.push_back(std::move(block));
    }
    return out;
  }

  void fill_config_metadata(c10a::AllocatorConfigInfo& md) {
    std::lock_guard lock(create_mutex_);
    const ccalloc::Config& c = config_locked();
    md.garbage_collection_threshold = c.garbage_collection_threshold;
    md.max_split_size = c.max_split_size;
    md.pinned_num_register_threads = c.pinned_num_register_threads;
    md.expandable_segments = c.expandable_segments;
    md.release_lock_on_malloc = c.release_lock_on_cudamalloc;
    md.pinned_use_host_register = c.pinned_use_cuda_host_register;
    md.graph_capture_record_stream_reuse = c.graph_capture_record_stream_reuse;
    md.last_allocator_settings = c10::CachingAllocator::getAllocatorSettings();
    if (md.last_allocator_settings.empty()) md.last_allocator_settings = c.source;
    md.roundup_power2_divisions.assign(c.roundup_power2_divisions.begin(),
                                       c.roundup_power2_divisions.end());
  }

  // The configuration and the backend's name, read once, at initialization (init() or the
  // first allocation); create_mutex_ held. The process allocator reads the variables then
  // (unless the C API made a device's allocator first, which read them at that call).
  const ccalloc::Config& config_locked() {
    if (!config_) {
      config_ = process_.config();
      if (config_->expandable_segments) expandable_seen_.store(true);
      if (name_.load(std::memory_order_acquire) == nullptr) {
        // Never freed: name() hands out copies without a lock.
        name_.store(new std::string(backend_named_by_pytorch().value_or("ccalloc")),
                    std::memory_order_release);
      }
    }
    return *config_;
  }

  std::atomic<bool> enabled_{true};
  std::atomic<int> device_count_{0};
  std::atomic<const std::string*> name_{nullptr};  // set at initialization
  ccalloc::ProcessAllocator& process_;  // the per-device allocators
  std::mutex create_mutex_;
  // For devices created from now on, once initialized; guarded by create_mutex_.
  std::optional<ccalloc::Config> config_;
  // memory_stats()'s max_split_size: the config's at init(), as PyTorch reports it.
  std::optional<std::int64_t> init_max_split_;  // guarded by create_mutex_
  // Some config (at start or set live) had expandable_segments:True.
  std::atomic<bool> expandable_seen_{false};
  std::vector<c10a::OutOfMemoryObserver> oom_observers_;  // guarded by create_mutex_
  // The process's allocators this adapter has adopted (observers attached), by device.
  std::array<std::atomic<ccalloc::Allocator*>, kMaxDevices> adopted_{};
  std::array<bool, kMaxDevices> observed_{};  // guarded by create_mutex_
  // The one device with an allocator while there is exactly one; -1 before the first, -2
  // once there are several.
  std::atomic<int> sole_device_{-1};
  History history_;
  std::mutex ipc_mutex_;
  std::unordered_map<std::string, IpcEntry> ipc_cache_;
};

// Deliberately never destroyed: tensors freed by static destructors and at interpreter exit
// still reach it, possibly after CUDA has shut down.
TorchAllocator* g_allocator = nullptr;

void local_raw_delete(void* ptr) {
  g_allocator->free(ptr);
}

void copy_error(const char* message, char* error, size_t capacity) {
  if (error != nullptr && capacity > 0) {
    std::strncpy(error, message, capacity - 1);
    error[capacity - 1] = '\0';
  }
}

}  // namespace

namespace ccalloc::torch_bridge {

Allocator& native_allocator(int device) {
  if (g_allocator == nullptr || c10a::allocator.load() != g_allocator) {
    throw Error(
        "ccalloc is not PyTorch's CUDA allocator: sleepable pools need ccalloc installed "
        "natively (ccalloc_torch.install() with libccalloc_torch.so built for this torch)");
  }
  if (device < 0) {
    c10::DeviceIndex current = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&current));
    device = current;
  }
  return g_allocator->device_engine(device);
}

}  // namespace ccalloc::torch_bridge

extern "C" {

// Makes ccalloc PyTorch's CUDA allocator: the allocator behind every torch.cuda memory API
// (c10::cuda::CUDACachingAllocator::get()) and c10's CUDA device allocator
// (c10::GetAllocator, torch.accelerator). Must run after torch's libraries are loaded and
// before CUDA is initialised by torch. Returns 0 on success (also when already installed);
// else writes the reason into `error` (NUL-terminated, at most `capacity` bytes) and
// returns 1.
__attribute__((visibility("default"))) int ccalloc_torch_native_install(char* error,
                                                                         size_t capacity) {
  try {
    static std::once_flag created;
    std::call_once(created, [] { g_allocator = new TorchAllocator(); });
    c10a::CUDAAllocator* current = c10a::allocator.load();
    if (current == g_allocator) return 0;
    TORCH_CHECK(current == nullptr || !current->initialized(), "PyTorch's CUDA allocator (",
                current ? current->name() : std::string("none"),
                ") is already initialized: install ccalloc before anything initialises CUDA in "
                "torch (the first CUDA tensor, torch.cuda.init(), torch.cuda.memory_stats()...)");
    c10a::allocator.store(g_allocator);
    c10::SetAllocator(c10::DeviceType::CUDA, g_allocator, /*priority=*/0);
    // _set_allocator_settings() reaches allocators through c10's device config hook; chain
    // ccalloc after the hook CUDA registered so both configs see every change.
    auto& hook = c10::CachingAllocator::AcceleratorAllocatorConfig::getConfigParserHook();
    hook = [previous = hook](const std::string& settings) {
      if (previous) previous(settings);
      g_allocator->apply_settings(settings);
    };
    return 0;
  } catch (const ccalloc::Error& e) {
    copy_error(e.what(), error, capacity);
  } catch (const c10::Error& e) {
    copy_error(e.what_without_backtrace(), error, capacity);
  } catch (const std::exception& e) {
    copy_error(e.what(), error, capacity);
  }
  return 1;
}

// 1 when ccalloc is the allocator torch.cuda uses, else 0.
__attribute__((visibility("default"))) int ccalloc_torch_native_installed(void) {
  return g_allocator != nullptr && c10a::allocator.load() == g_allocator ? 1 : 0;
}

// What bench/torch/scale.py reads after every step: the device's memory calls since its
// allocator was made (cudaMalloc, cudaFree, cuMemCreate, cuMemRelease, cuMemMap,
// cuMemSetAccess, cuMemUnmap, nanoseconds in all of them), then the stitching policy's
// sharing between streams (fences recorded, handles and pieces one stream took from
// another, growths that waited on the device for a fence, the fences' recent average
// latency in microseconds, and those of the waits on a stream with fences in flight; zeros
// under another policy). Fills at most `n` values of `out`
// and returns how many it has (14), or -1 with the reason in `error` (device -1: current).
__attribute__((visibility("default"))) int ccalloc_torch_memory_calls(int device,
                                                                      std::uint64_t* out, size_t n,
                                                                      char* error,
                                                                      size_t capacity) {
  try {
    ccalloc::Allocator& a = ccalloc::torch_bridge::native_allocator(device);
    std::vector<std::uint64_t> v(14, 0);
    if (const auto* cuda = dynamic_cast<const ccalloc::cuda::CudaDriver*>(&a.driver())) {
      const auto c = cuda->memory_calls();
      v = {c.malloc, c.free, c.create, c.release, c.map, c.set_access, c.unmap, c.ns,
           0,        0,      0,        0,         0,     0};
    }
    if (const auto* stitch = dynamic_cast<const ccalloc::core::StitchBackend*>(
            &ccalloc::core::BackendAccess::of(a))) {
      const auto p = stitch->stitch_engine().piece_counts();
      v[8] = p.fences;
      v[9] = p.borrowed_handles;
      v[10] = p.borrowed_pieces;
      v[11] = p.borrow_waits;
      v[12] = static_cast<std::uint64_t>(p.fence_latency_us);
      v[13] = p.busy_borrow_waits;
    }
    for (size_t i = 0; i < n && i < v.size(); ++i)
      out[i] = v[i];
    return static_cast<int>(v.size());
  } catch (const std::exception& e) {
    copy_error(e.what(), error, capacity);
  }
  return -1;
}

}  // extern "C"
