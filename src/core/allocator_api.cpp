// ccalloc::Allocator: the public face of the engine, plus the engine's lifetime and the
// trace and observer plumbing.
#include <algorithm>

#include "core/engine.hpp"
#include "core/async_backend.hpp"
#include "core/stitch_engine.hpp"

namespace ccalloc {

namespace core {

// Returns every segment to the device. Pending events are returned to the pool first so
// that the event pool's destructor destroys them.
Engine::~Engine() {
  AllArenasLock all(*this);
  for (Arena* arena : all.by_stream()) {
    for (const auto& blocks : segments_of(*arena)) {
      if (blocks.front()->segment != nullptr) continue;  // freed with the arena
      std::size_t size = 0;
      for (const Block* b : blocks)
        size += b->size;
      driver_.free(blocks.front()->ptr, size);
    }
    for (const auto& [stream, queue] : arena->pending) {
      for (const PendingFree& f : queue)
        event_pool_.put(f.event);
    }
  }
  for (const auto& [ptr, size] : uncached_)
    driver_.free(ptr, size);
}

void Engine::record_trace_entry(TraceAction action, DevicePtr addr, std::size_t size,
                                StreamId stream, const Block* block) {
  const unsigned flags = trace_flags_.load(std::memory_order_relaxed);
  const std::int64_t now = driver_.now_us();
  // The operation's own stack and context; without them (a free at context "alloc"), those
  // of the allocation the entry is about.
  const Origin* origin = &OperationContext::current();
  if ((flags & kStacksOnEntries) && !*origin && block != nullptr) {
    const bool segment =
        action == TraceAction::kSegmentFree || action == TraceAction::kSegmentUnmap;
    origin = segment ? &block->segment_stack : &block->stack;
  }
  const bool on_entry = (flags & kStacksOnEntries) != 0;
  if (flags & kTraceHistory) {
    history_.push(HistoryEntry{action, addr, size, stream, now, on_entry ? *origin : Origin{},
                               current_metadata()});
  }
  if (flags & kTraceObservers) {
    Lock lock(trace_mutex_);
    const TraceEntry entry{action, addr, size, stream, now,
                           on_entry && origin->context ? &origin->context : nullptr};
    for (const TraceObserver& observer : trace_observers_)
      observer(entry);
  }
}

void Engine::add_oom_observer(OomObserver observer) {
  Lock lock(observers_mutex_);
  oom_observers_.push_back(std::move(observer));
}

void Engine::add_free_memory_callback(FreeMemoryCallback callback) {
  Lock lock(observers_mutex_);
  free_memory_callbacks_.push_back(std::move(callback));
  has_free_memory_callbacks_.store(true, std::memory_order_release);
}

void Engine::add_trace_observer(TraceObserver observer) {
  Lock lock(trace_mutex_);
  trace_observers_.push_back(std::move(observer));
  trace_flags_.fetch_or(kTraceObservers, std::memory_order_release);
}

}  // namespace core

Allocator::Allocator(Driver& driver, Config config)
    : impl_(core::make_backend(driver, std::move(config))) {}

Allocator::~Allocator() = default;

DevicePtr Allocator::malloc(std::size_t size, StreamId stream) {
  return impl_->malloc(size, stream);
}
void Allocator::free(DevicePtr ptr) {
  impl_->free(ptr);
}
void Allocator::record_stream(DevicePtr ptr, StreamId stream) {
  impl_->record_stream(ptr, stream);
}
void Allocator::empty_cache() {
  impl_->empty_cache();
}
DeviceStats Allocator::stats() const {
  return impl_->stats();
}
std::string Allocator::memory_summary(bool abbreviated) const {
  return ccalloc::memory_summary(impl_->stats(), impl_->device(), abbreviated);
}
void Allocator::reset_peak_stats() {
  impl_->reset_peak_stats();
}
void Allocator::reset_accumulated_stats() {
  impl_->reset_accumulated_stats();
}
void Allocator::set_memory_fraction(double fraction) {
  impl_->set_memory_fraction(fraction);
}
double Allocator::memory_fraction() const {
  return impl_->memory_fraction();
}
MemInfo Allocator::mem_get_info() {
  return impl_->driver().mem_info();
}
std::vector<SegmentInfo> Allocator::segments() const {
  return impl_->segments();
}
std::size_t Allocator::allocation_size(DevicePtr ptr) const {
  return impl_->allocation_size(ptr);
}
void Allocator::add_oom_observer(OomObserver observer) {
  impl_->add_oom_observer(std::move(observer));
}
void Allocator::add_free_memory_callback(FreeMemoryCallback callback) {
  impl_->add_free_memory_callback(std::move(callback));
}
void Allocator::add_trace_observer(TraceObserver observer) {
  impl_->add_trace_observer(std::move(observer));
}
void Allocator::record_history(const HistoryOptions& options) {
  impl_->record_history(options);
}
Snapshot Allocator::snapshot() {
  return impl_->snapshot();
}
void Allocator::annotate(std::string_view name, bool start) {
  impl_->annotate(name, start);
}
void Allocator::set_user_metadata(const std::string& metadata) {
  core::set_current_metadata(core::intern_metadata(metadata));
}
void Allocator::check_invariants() const {
  impl_->check_invariants();
}
void Allocator::set_check_invariants(bool on) {
  impl_->set_check_invariants(on);
}
const Config& Allocator::config() const {
  return impl_->config();
}
int Allocator::device() const {
  return impl_->device();
}
Driver& Allocator::driver() const {
  return impl_->driver();
}

}  // namespace ccalloc

namespace ccalloc::core {

std::unique_ptr<Backend> make_backend(Driver& driver, Config config) {
  if (config.backend == ccalloc::BackendKind::kCudaMallocAsync) {
    return std::make_unique<AsyncBackend>(driver, std::move(config));
  }
  if (config.stitch_segments && !config.uncached) {
    return std::make_unique<StitchEngine>(driver, std::move(config));
  }
  return std::make_unique<Engine>(driver, std::move(config));
}

}  // namespace ccalloc::core
