// backend:cudaMallocAsync. Model and invariants: async/backend.hpp.
#include "async/backend.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "core/common.hpp"
#include "core/format.hpp"

namespace ccalloc::core {
namespace {

// PyTorch's layout (CUDAMallocAsyncAllocator.cpp), with ccalloc's name for the limit and
// "unlimited" where PyTorch would print UINT64_MAX.
std::string oom_message(int device, std::size_t used, std::size_t requested, const MemInfo& info,
                        const std::optional<std::size_t>& limit) {
  return "Allocation on device " + std::to_string(device) +
         " would exceed allowed memory. (out of memory)"
         "\nCurrently allocated     : " +
         format_size(used) + "\nRequested               : " + format_size(requested) +
         "\nDevice limit            : " + format_size(info.total_bytes) +
         "\nFree (according to CUDA): " + format_size(info.free_bytes) +
         "\nccalloc limit (set by user-supplied memory fraction)"
         "\n                        : " +
         (limit ? format_size(*limit) : std::string("unlimited"));
}

}  // namespace

AsyncBackend::AsyncBackend(Driver& driver, Config config)
    : driver_(driver), config_(std::move(config)) {
  const char* check = std::getenv("CCALLOC_CHECK_INVARIANTS");
  check_invariants_ = check != nullptr && std::strcmp(check, "1") == 0;
  capacity_ = driver_.mem_info().total_bytes;
  set_memory_fraction(config_.per_process_memory_fraction);
}

AsyncBackend::~AsyncBackend() {
  std::lock_guard lock(mutex_);
  try {
    capture_underway_ = false;
    release_deferred();
    for (const auto& [ptr, usage] : ptr_info_)
      release(ptr, usage);
    ptr_info_.clear();
    driver_.synchronize_device();
    driver_.pool_trim(0);
    for (const EventId e : spare_events_)
      driver_.destroy_event(e);
  } catch (const Error&) {
    // A destructor cannot report a failing device; the memory is lost to this process.
  }
}

DevicePtr AsyncBackend::malloc(std::size_t size, StreamId stream) {
  if (size == 0) return 0;
  const Origin stack =
      recorder_.capture_on_malloc.load(std::memory_order_relaxed) ? capture() : Origin{};
  for (bool retried = false;; retried = true) {
    std::unique_lock lock(mutex_);
    release_deferred();
    // The limit applies to the bytes handed out, checked before the pool is asked.
    const bool over_limit = limit_ && (size > *limit_ || used_bytes_ > *limit_ - size);
    const DevicePtr ptr = over_limit ? 0 : driver_.allocate_async(size, stream);
    if (ptr != 0) {
      ptr_info_.emplace(ptr, PtrUsage{size, stream, {}, stack});
      used_bytes_ += size;
      allocations_.increase(1);
      record_trace(TraceAction::kAlloc, ptr, size, stream, stack);
      lock.unlock();
      after_operation();
      return ptr;
    }
    // Memory held elsewhere may be given back; one retry if any was.
    if (!retried && !free_memory_callbacks_.empty()) {
      const auto callbacks = free_memory_callbacks_;
      lock.unlock();
      bool freed = false;
      for (const auto& callback : callbacks)
        freed = callback() || freed;
      if (freed) continue;
      lock.lock();
    }
    raise_oom(lock, size, stream, stack);
  }
}

void AsyncBackend::free(DevicePtr ptr) {
  if (ptr == 0) return;
  const Origin stack =
      recorder_.capture_on_free.load(std::memory_order_relaxed) ? capture() : Origin{};
  {
    std::lock_guard lock(mutex_);
    const auto it = ptr_info_.find(ptr);
    if (it == ptr_info_.end()) {
      throw InvalidPointerError(pointer_error("free", ptr, device()), ptr);
    }
    const PtrUsage& usage = it->second;
    release_deferred();
    if (capture_underway_ && !usage.recorded_streams.empty()) {
      // Events may not be recorded during capture: freed once the capture has ended.
      deferred_.emplace_back(ptr, usage);
    } else {
      release(ptr, usage);
    }
    used_bytes_ -= usage.size;
    allocations_.decrease(1);
    // The pool owns the memory from here: the free is requested and complete at once.
    // The free's own stack (context "all"), else the allocation's.
    const Origin& origin = stack ? stack : usage.stack;
    record_trace(TraceAction::kFreeRequested, ptr, usage.size, usage.creation_stream, origin);
    record_trace(TraceAction::kFreeCompleted, ptr, usage.size, usage.creation_stream, origin);
    ptr_info_.erase(it);
  }
  after_operation();
}

// Frees `ptr` in stream order after all its uses: the creation stream first waits for
// the work queued so far on every recorded stream (it is ordered after itself already).
void AsyncBackend::release(DevicePtr ptr, const PtrUsage& usage) {
  for (const StreamId s : usage.recorded_streams) {
    EventId e = 0;
    if (spare_events_.empty()) {
      e = driver_.create_event();
    } else {
      e = spare_events_.back();
      spare_events_.pop_back();
    }
    // A wait captures the event as recorded now, so the event is free for reuse at once.
    driver_.record_event(e, s);
    driver_.stream_wait_event(usage.creation_stream, e);
    spare_events_.push_back(e);
  }
  driver_.free_async(ptr, usage.size, usage.creation_stream);
}

void AsyncBackend::record_stream(DevicePtr ptr, StreamId stream) {
  {
    std::lock_guard lock(mutex_);
    const auto it = ptr_info_.find(ptr);
    if (it == ptr_info_.end()) {
      throw InvalidPointerError(pointer_error("record_stream", ptr, device()), ptr);
    }
    PtrUsage& usage = it->second;
    if (stream != usage.creation_stream &&
        std::find(usage.recorded_streams.begin(), usage.recorded_streams.end(), stream) ==
            usage.recorded_streams.end()) {
      usage.recorded_streams.push_back(stream);
    }
  }
  after_operation();
}

// Every free completes at the synchronize, so the trim can release all unused memory.
void AsyncBackend::release_deferred() {
  if (capture_underway_ || deferred_.empty()) return;
  for (const auto& [ptr, usage] : deferred_)
    release(ptr, usage);
  deferred_.clear();
}

void AsyncBackend::begin_allocate_to_pool(PoolId, Allocator::StreamFilter) {
  std::lock_guard lock(mutex_);
  if (capture_underway_) {
    throw Error("ccalloc: backend:cudaMallocAsync allows only one capture at a time in a process");
  }
  capture_underway_ = true;
}

void AsyncBackend::end_allocate_to_pool(PoolId) {
  std::lock_guard lock(mutex_);
  if (!capture_underway_) {
    throw Error("ccalloc: end_allocate_to_pool with backend:cudaMallocAsync, but no capture is "
                "underway");
  }
  capture_underway_ = false;
}

// The graph's allocations are the graph's: nothing to release (as PyTorch).
void AsyncBackend::release_pool(PoolId) {}

void AsyncBackend::empty_cache(PoolId) {
  empty_cache();
}

void AsyncBackend::empty_cache() {
  {
    std::lock_guard lock(mutex_);
    if (capture_underway_) return;  // synchronizing would break the capture
    release_deferred();
    driver_.synchronize_device();
    driver_.pool_trim(0);
  }
  after_operation();
}

DeviceStats AsyncBackend::stats() const {
  std::lock_guard lock(mutex_);
  const PoolUsage u = driver_.pool_usage();
  DeviceStats s;
  for (StatArray* bytes : {&s.allocated_bytes, &s.active_bytes}) {
    (*bytes)[kAggregate].current = static_cast<std::int64_t>(u.used_current);
    (*bytes)[kAggregate].peak = static_cast<std::int64_t>(u.used_high);
  }
  s.reserved_bytes[kAggregate].current = static_cast<std::int64_t>(u.reserved_current);
  s.reserved_bytes[kAggregate].peak = static_cast<std::int64_t>(u.reserved_high);
  s.allocation[kAggregate] = allocations_;
  s.num_ooms = num_ooms_;
  return s;
}

void AsyncBackend::reset_peak_stats() {
  std::lock_guard lock(mutex_);
  driver_.pool_reset_peaks();
  allocations_.reset_peak();
}

// PyTorch only warns here: the pool keeps no accumulated totals to reset.
void AsyncBackend::reset_accumulated_stats() {}

void AsyncBackend::set_memory_fraction(double fraction) {
  const std::optional<std::size_t> limit = fraction_limit(fraction, capacity_, device());
  std::lock_guard lock(mutex_);
  fraction_ = fraction;
  limit_ = limit;
}

bool AsyncBackend::reconfigure(const Config& next) {
  if (next.backend != config_.backend) {
    throw ConfigError(
        "ccalloc: allocator setting 'backend' cannot change while the allocator is live (it is "
        "cudaMallocAsync, the new settings ask for native); it applies to allocators created "
        "afterwards");
  }
  // As in Engine::reconfigure: only a changed fraction is applied, first (it validates).
  double configured_fraction;
  {
    std::lock_guard lock(mutex_);
    configured_fraction = config_.per_process_memory_fraction;
  }
  if (next.per_process_memory_fraction != configured_fraction) {
    set_memory_fraction(next.per_process_memory_fraction);
  }
  std::lock_guard lock(mutex_);
  config_ = next;
  return true;
}

double AsyncBackend::memory_fraction() const {
  std::lock_guard lock(mutex_);
  return fraction_;
}

// The size requested: the pool's own rounding is not visible.
std::size_t AsyncBackend::allocation_size(DevicePtr ptr) const {
  std::lock_guard lock(mutex_);
  const auto it = ptr_info_.find(ptr);
  return it == ptr_info_.end() ? 0 : it->second.size;
}

void AsyncBackend::add_oom_observer(Allocator::OomObserver observer) {
  std::lock_guard lock(mutex_);
  oom_observers_.push_back(std::move(observer));
}

void AsyncBackend::add_free_memory_callback(Allocator::FreeMemoryCallback callback) {
  std::lock_guard lock(mutex_);
  free_memory_callbacks_.push_back(std::move(callback));
}

void AsyncBackend::add_trace_observer(TraceObserver observer) {
  std::lock_guard lock(mutex_);
  trace_observers_.push_back(std::move(observer));
}

void AsyncBackend::record_trace(TraceAction action, DevicePtr addr, std::size_t size,
                                StreamId stream, const Origin& stack) {
  if (!recorder_.history_on && trace_observers_.empty()) return;
  const TraceEntry entry = recorder_.record(action, addr, size, stream, driver_.now_us(), stack);
  for (const TraceObserver& observer : trace_observers_)
    observer(entry);
}

void AsyncBackend::raise_oom(std::unique_lock<std::mutex>& lock, std::size_t size, StreamId stream,
                             const Origin& stack) {
  const MemInfo info = driver_.mem_info();
  ++num_ooms_;
  record_trace(TraceAction::kOom, info.free_bytes, size, stream, stack);
  const std::string message = oom_message(device(), used_bytes_, size, info, limit_);
  const std::size_t limit = limit_ ? *limit_ : info.total_bytes;
  const auto observers = oom_observers_;
  lock.unlock();
  for (const auto& observer : observers)
    observer(device(), size, limit, info.free_bytes);
  after_operation();
  throw OutOfMemoryError(message, device(), size);
}

// As the native engine: `all` keeps the history, `state` and `none` keep none (PyTorch
// keeps one entry unless everything is recorded), and stopping clears it. Stacks go on
// alloc and oom entries from context `alloc` up, and on free entries with context `all`.
void AsyncBackend::record_history(const HistoryOptions& options) {
  std::lock_guard lock(mutex_);
  // No block keeps a stack here (snapshots list no segments), but a free at context
  // "alloc" is traced with its allocation's.
  recorder_.configure(options, /*blocks_keep_stacks=*/false);
}

void AsyncBackend::annotate(std::string_view name, bool start) {
  std::lock_guard lock(mutex_);
  recorder_.annotate(name, start, device(), driver_.now_us());
}

// PyTorch refuses snapshots with this backend. ccalloc returns no segments (the pool's
// layout is the driver's secret) but the recorded history, annotations and settings.
Snapshot AsyncBackend::snapshot() {
  Snapshot s;
  std::vector<HistoryEntry> entries;
  {
    std::lock_guard lock(mutex_);
    record_trace(TraceAction::kSnapshot, 0, used_bytes_, 0, Origin{});
    s.allocator_settings = settings_of(config_);
    recorder_.fill(s, entries);
  }
  std::vector<StackTable::Id> ids;
  for (const HistoryEntry& e : entries) {
    if (e.stack.cpp != 0) ids.push_back(e.stack.cpp);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const auto frames = stack_table().symbolize(ids);

  s.device_traces.resize(static_cast<std::size_t>(device()) + 1);
  s.device_traces[static_cast<std::size_t>(device())] = snapshot_trace(entries, frames);
  return s;
}

void AsyncBackend::check_invariants() const {
  std::lock_guard lock(mutex_);
  const auto violated = [this](const std::string& what) {
    throw InvariantError("ccalloc: invariant violated on device " + std::to_string(device()) +
                         " (backend:cudaMallocAsync): " + what);
  };
  std::size_t total = 0;
  std::vector<std::pair<DevicePtr, std::size_t>> ranges;
  ranges.reserve(ptr_info_.size());
  for (const auto& [ptr, usage] : ptr_info_) {
    total += usage.size;
    ranges.emplace_back(ptr, usage.size);
    const auto& rs = usage.recorded_streams;
    for (auto s = rs.begin(); s != rs.end(); ++s) {
      if (*s == usage.creation_stream || std::find(s + 1, rs.end(), *s) != rs.end()) {
        violated("pointer " + hex_address(ptr) + " records stream " + std::to_string(*s) +
                 " twice or as its own creation stream");
      }
    }
  }
  if (total != used_bytes_) {
    violated("the live pointers hold " + std::to_string(total) + " bytes but used_bytes is " +
             std::to_string(used_bytes_));
  }
  if (static_cast<std::int64_t>(ptr_info_.size()) != allocations_.current) {
    violated(std::to_string(ptr_info_.size()) + " live pointers but the allocation count is " +
             std::to_string(allocations_.current));
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i - 1].first + ranges[i - 1].second > ranges[i].first) {
      violated("live allocations at " + hex_address(ranges[i - 1].first) + " and " +
               hex_address(ranges[i].first) + " overlap");
    }
  }
  // The pool rounds sizes up and may serve other users of the device's pool too, so its
  // used bytes bound ours from above.
  const PoolUsage u = driver_.pool_usage();
  if (used_bytes_ > u.used_current) {
    violated(std::to_string(used_bytes_) + " bytes are live but the pool uses only " +
             std::to_string(u.used_current));
  }
  if (u.used_current > u.reserved_current) {
    violated("the pool uses " + std::to_string(u.used_current) + " bytes but reserves only " +
             std::to_string(u.reserved_current));
  }
}

}  // namespace ccalloc::core
