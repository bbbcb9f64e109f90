// backend:cudaMallocAsync — the allocator behind ccalloc::Allocator when the device's
// stream-ordered pool does the caching (PyTorch's CUDAMallocAsyncAllocator,
// docs/pytorch-behaviour.md §2.18).
//
// Model. Every malloc is a Driver::allocate_async on the caller's stream and every free a
// Driver::free_async; the driver's pool keeps freed memory and decides reuse. This backend
// only keeps what the pool cannot: for each live pointer its size, the stream that
// allocated it and the other streams that used it (record_stream). Freeing a pointer used
// on other streams makes its creation stream wait for an event recorded on each of them,
// then frees it on the creation stream, so the pool reuses it only after all that work.
// PyTorch frees on a separate "unifying free stream" instead; in the Driver interface a
// stream is just an id, and the creation stream serves the purpose without a new one.
//
// A memory fraction caps the bytes this backend has handed out (not the pool's reserve).
// Statistics: allocated_bytes.all and active_bytes.all come from the pool's used bytes,
// reserved_bytes.all from its reserved bytes, allocation.all counts live pointers,
// num_ooms counts OOMs; every other key is 0, as in PyTorch. Unlike PyTorch, history
// recording works (alloc, free_requested, free_completed, oom, snapshot entries), and
// snapshot() returns that history and the settings with no segments.
//
// Locking: one mutex guards everything, driver calls included. Trace observers are called
// with it held; OOM observers and free-memory callbacks without it.
//
// Invariants (check_invariants()): used_bytes_ is the sum of the live sizes and
// allocations_.current their number; live pointers do not overlap; no pointer records its
// own creation stream or a stream twice; the live bytes do not exceed the pool's used
// bytes, which do not exceed its reserved bytes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/snapshot.hpp"
#include "core/backend.hpp"
#include "history/history.hpp"

namespace ccalloc::core {

class AsyncBackend final : public Backend {
 public:
  AsyncBackend(Driver& driver, Config config);
  // Frees every live pointer, waits for the device and trims the pool to nothing.
  ~AsyncBackend() override;
  AsyncBackend(const AsyncBackend&) = delete;
  AsyncBackend& operator=(const AsyncBackend&) = delete;

  DevicePtr malloc(std::size_t size, StreamId stream) override;
  void free(DevicePtr ptr) override;
  void record_stream(DevicePtr ptr, StreamId stream) override;
  void empty_cache() override;
  DeviceStats stats() const override;
  void reset_peak_stats() override;
  void reset_accumulated_stats() override;
  void set_memory_fraction(double fraction) override;
  double memory_fraction() const override;
  std::vector<SegmentInfo> segments() const override { return {}; }
  std::size_t allocation_size(DevicePtr ptr) const override;
  void add_oom_observer(Allocator::OomObserver observer) override;
  void add_free_memory_callback(Allocator::FreeMemoryCallback callback) override;
  void add_trace_observer(TraceObserver observer) override;
  void record_history(const HistoryOptions& options) override;
  Snapshot snapshot() override;
  void annotate(std::string_view name, bool start) override;
  void check_invariants() const override;
  void set_check_invariants(bool on) override { check_invariants_.store(on); }
  // The live config: reconfigure() replaces it (reading it meanwhile on another thread is a
  // data race).
  const Config& config() const override { return config_; }
  // Every key but `backend` may change; the pool uses none of them but the memory fraction.
  bool reconfigure(const Config& config) override;
  Driver& driver() const override { return driver_; }

  // CUDA graph capture as PyTorch's CudaMallocAsync backend does it: allocations during
  // capture are stream-ordered allocations on the capturing stream (the graph owns them),
  // so there are no private pools; one capture at a time. Frees of pointers used on other
  // streams made during capture wait until it has ended (no events during capture), and
  // empty_cache() does nothing then. The pool functions PyTorch lacks throw Error.
  void begin_allocate_to_pool(PoolId id, Allocator::StreamFilter filter) override;
  void end_allocate_to_pool(PoolId id) override;
  void release_pool(PoolId id) override;
  void empty_cache(PoolId id) override;
  std::vector<SegmentInfo> pool_segments(PoolId) const override { return {}; }
  const char* policy_name() const override { return "backend:cudaMallocAsync"; }

 private:
  struct PtrUsage {
    std::size_t size = 0;  // as requested
    StreamId creation_stream = 0;
    std::vector<StreamId> recorded_streams;  // other streams that used it
    Origin stack;                            // of its allocation, while history wants it
  };

  // All require mutex_.
  void release(DevicePtr ptr, const PtrUsage& usage);
  // Releases the frees deferred during capture, once none is underway.
  void release_deferred();
  void record_trace(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream,
                    const Origin& stack);
  // Counts the OOM, traces it, calls the OOM observers (after unlocking) and throws.
  [[noreturn]] void raise_oom(std::unique_lock<std::mutex>& lock, std::size_t size, StreamId stream,
                              const Origin& stack);
  void after_operation() const {
    if (check_invariants_.load(std::memory_order_relaxed)) check_invariants();
  }

  Driver& driver_;
  Config config_;  // written by reconfigure() under mutex_
  std::atomic<bool> check_invariants_{false};
  // History (record_history): its switches (the capture ones read before taking the lock),
  // ring and annotations, under mutex_.
  HistoryRecorder recorder_;
  // The origin of the operation starting now; inlined, so capture_origin skips its frame.
  [[gnu::always_inline]] Origin capture() const { return recorder_.capture(); }

  mutable std::mutex mutex_;
  std::unordered_map<DevicePtr, PtrUsage> ptr_info_;
  std::size_t used_bytes_ = 0;  // sum of the live sizes (PyTorch's pytorch_used_bytes)
  std::size_t capacity_ = 0;    // device memory, read once at construction
  std::optional<std::size_t> limit_;
  double fraction_ = 1.0;
  Stat allocations_;
  std::int64_t num_ooms_ = 0;
  std::vector<EventId> spare_events_;  // for cross-stream frees
  bool capture_underway_ = false;
  std::vector<std::pair<DevicePtr, PtrUsage>> deferred_;  // cross-stream frees during capture
  std::vector<TraceObserver> trace_observers_;
  std::vector<Allocator::OomObserver> oom_observers_;
  std::vector<Allocator::FreeMemoryCallback> free_memory_callbacks_;
};

}  // namespace ccalloc::core
