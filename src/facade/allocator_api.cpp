// ccalloc::Allocator: the public face of the engine, plus the engine's lifetime and the
// trace and observer plumbing.
#include <algorithm>

#include "async/backend.hpp"
#include "core/arena_engine.hpp"
#include "native/engine.hpp"
#include "core/rounding.hpp"
#include "stitch/backend.hpp"

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
      if (arena->pool != nullptr && arena->pool->source) {
        arena->pool->source->free(blocks.front()->ptr, size);
      } else {
        driver_.free(blocks.front()->ptr, size);
      }
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
  ArenaEngine::add_oom_observer(*this, std::move(observer));
}

void Engine::add_free_memory_callback(FreeMemoryCallback callback) {
  // The OOM ladder reads the flag with acquire.
  ArenaEngine::add_free_memory_callback(*this, std::move(callback), std::memory_order_release);
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
void Allocator::set_stream_order_key(StreamId stream, std::uint64_t key) {
  impl_->set_stream_order_key(stream, key);
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

void Allocator::enable_peer_access(int peer) {
  if (peer < 0 || peer == device()) {
    throw Error("ccalloc: enable_peer_access(" + std::to_string(peer) + ") on device " +
                std::to_string(device()) + ": the peer must be another device");
  }
  impl_->driver().add_peer(peer);
}

std::string to_string(PoolId id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}
void Allocator::create_pool(PoolId id, std::optional<SegmentSource> source) {
  impl_->create_pool(id, std::move(source));
}
void Allocator::release_pool(PoolId id) {
  impl_->release_pool(id);
}
int Allocator::pool_use_count(PoolId id) const {
  return impl_->pool_use_count(id);
}
void Allocator::set_pool_use_on_oom(PoolId id, bool use_on_oom) {
  impl_->set_pool_use_on_oom(id, use_on_oom);
}
void Allocator::set_pool_no_split(PoolId id) {
  impl_->set_pool_no_split(id);
}
void Allocator::begin_allocate_to_pool(PoolId id, StreamFilter filter) {
  if (!filter) throw Error("ccalloc: begin_allocate_to_pool needs a stream filter");
  impl_->begin_allocate_to_pool(id, std::move(filter));
}
void Allocator::end_allocate_to_pool(PoolId id) {
  impl_->end_allocate_to_pool(id);
}
void Allocator::empty_cache(PoolId id) {
  if (id.is_default()) {
    impl_->empty_cache();
  } else {
    impl_->empty_cache(id);
  }
}
std::vector<DevicePtr> Allocator::pool_live_allocations(PoolId id) const {
  return impl_->pool_live_allocations(id);
}
std::vector<SegmentInfo> Allocator::pool_segments(PoolId id) const {
  return impl_->pool_segments(id);
}
PoolId Allocator::segment_pool(DevicePtr address) const {
  return impl_->segment_pool(address);
}
std::shared_ptr<const PoolCheckpoint> Allocator::checkpoint_pool(PoolId id) {
  return impl_->checkpoint_pool(id);
}
PoolRestore Allocator::restore_pool(const PoolCheckpoint& checkpoint) {
  return impl_->restore_pool(checkpoint);
}
void Allocator::create_sleepable_pool(PoolId id) {
  impl_->create_sleepable_pool(id);
}
void Allocator::sleep_pool(PoolId id, SleepMode mode) {
  impl_->sleep_pool(id, mode);
}
void Allocator::wake_pool(PoolId id) {
  impl_->wake_pool(id);
}
bool Allocator::pool_asleep(PoolId id) const {
  return impl_->pool_asleep(id);
}
PoolSleepInfo Allocator::pool_sleep_info(PoolId id) const {
  return impl_->pool_sleep_info(id);
}

}  // namespace ccalloc

namespace ccalloc::core {

namespace {
[[noreturn]] void no_pools(const Backend& b, const char* what) {
  throw Error(std::string("ccalloc: ") + b.policy_name() + " has no private memory pools (" +
              what + "); use the native policy for CUDA graphs and MemPools");
}
}  // namespace

void Backend::create_pool(PoolId, std::optional<SegmentSource>) {
  no_pools(*this, "create_pool");
}
void Backend::release_pool(PoolId) {
  no_pools(*this, "release_pool");
}
int Backend::pool_use_count(PoolId) const {
  no_pools(*this, "pool_use_count");
}
void Backend::set_pool_use_on_oom(PoolId, bool) {
  no_pools(*this, "set_pool_use_on_oom");
}
void Backend::set_pool_no_split(PoolId) {
  no_pools(*this, "set_pool_no_split");
}
void Backend::begin_allocate_to_pool(PoolId, Allocator::StreamFilter) {
  no_pools(*this, "begin_allocate_to_pool");
}
void Backend::end_allocate_to_pool(PoolId) {
  no_pools(*this, "end_allocate_to_pool");
}
void Backend::empty_cache(PoolId) {
  no_pools(*this, "empty_cache of a pool");
}
std::vector<DevicePtr> Backend::pool_live_allocations(PoolId) const {
  no_pools(*this, "pool_live_allocations");
}
std::vector<SegmentInfo> Backend::pool_segments(PoolId) const {
  no_pools(*this, "pool_segments");
}
PoolId Backend::segment_pool(DevicePtr) const {
  return PoolId{};
}
std::shared_ptr<const PoolCheckpoint> Backend::checkpoint_pool(PoolId) {
  no_pools(*this, "checkpoint_pool");
}
PoolRestore Backend::restore_pool(const PoolCheckpoint&) {
  no_pools(*this, "restore_pool");
}
void Backend::create_sleepable_pool(PoolId) {
  no_pools(*this, "create_sleepable_pool");
}
void Backend::sleep_pool(PoolId, SleepMode) {
  no_pools(*this, "sleep_pool");
}
void Backend::wake_pool(PoolId) {
  no_pools(*this, "wake_pool");
}
bool Backend::pool_asleep(PoolId) const {
  no_pools(*this, "pool_asleep");
}
PoolSleepInfo Backend::pool_sleep_info(PoolId) const {
  no_pools(*this, "pool_sleep_info");
}

std::unique_ptr<Backend> make_backend(Driver& driver, Config config) {
  if (config.backend == ccalloc::BackendKind::kCudaMallocAsync) {
    return std::make_unique<AsyncBackend>(driver, std::move(config));
  }
  if (stitches(config)) {
    return std::make_unique<StitchBackend>(driver, std::move(config));
  }
  return std::make_unique<Engine>(driver, std::move(config));
}

}  // namespace ccalloc::core
