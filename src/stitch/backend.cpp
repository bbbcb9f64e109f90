// The stitching policy with private pools beside it; the routing rules: stitch/backend.hpp.
#include "stitch/backend.hpp"

#include <algorithm>
#include <iterator>

#include "core/rounding.hpp"

namespace ccalloc::core {
namespace {

Config without_stitching(Config config) {
  config.stitch_segments = false;
  return config;
}

void add_stats(DeviceStats& into, const DeviceStats& other) {
  for (StatArray DeviceStats::*field : {&DeviceStats::allocation, &DeviceStats::segment, &DeviceStats::active,
                      &DeviceStats::inactive_split, &DeviceStats::allocated_bytes,
                      &DeviceStats::reserved_bytes, &DeviceStats::active_bytes,
                      &DeviceStats::inactive_split_bytes, &DeviceStats::requested_bytes}) {
    for (std::size_t t = 0; t < (into.*field).size(); ++t)
      (into.*field)[t] += (other.*field)[t];
  }
  into.num_alloc_retries += other.num_alloc_retries;
  into.num_ooms += other.num_ooms;
  into.num_sync_all_streams += other.num_sync_all_streams;
  into.num_device_alloc += other.num_device_alloc;
  into.num_device_free += other.num_device_free;
  into.oversize_allocations += other.oversize_allocations;
  into.oversize_segments += other.oversize_segments;
}

}  // namespace

StitchBackend::StitchBackend(Driver& driver, Config config)
    : config_(std::move(config)),
      stitch_(std::make_unique<StitchEngine>(driver, config_)),
      pools_(std::make_unique<Engine>(driver, without_stitching(config_))) {
  stitch_->set_peer_reserved(&pools_->published_reserved());
  pools_->set_peer_reserved(&stitch_->published_reserved());
  stitch_->set_device_reserved(&device_reserved_);
  pools_->set_empty_cache_sync_counted_elsewhere();
  pools_->set_expandable_large_page(kSmallBuffer);
  pools_->set_device_reserved(&device_reserved_);
  stitch_->set_joint_settlement(&joint_);
  pools_->set_joint_settlement(&joint_);
  // A default-pool request that the policy cannot serve: the private pools' cached
  // segments go back to the device (the policy then searches and grows again), then a
  // use_on_oom pool's free block serves it.
  StitchEngine::OomFallbacks fallbacks;
  fallbacks.release_cache = [this] {
    const std::size_t before = pools_->published_reserved().load(std::memory_order_relaxed);
    pools_->empty_cache();
    return pools_->published_reserved().load(std::memory_order_relaxed) < before;
  };
  fallbacks.serve = [this](std::size_t size, StreamId stream) {
    return pools_->malloc_on_oom(size, stream);
  };
  stitch_->set_oom_fallbacks(std::move(fallbacks));
}

void StitchBackend::settle_now() const {
  stitch_->with_ledger_shares([this](std::vector<LedgerShare>& shares) {
    pools_->with_ledger_shares([&shares](std::vector<LedgerShare>& pooled) {
      shares.insert(shares.end(), pooled.begin(), pooled.end());
      settle_peak_debts(shares);
    });
  });
}

// The private pools go first: their segments may have come from a segment source.
StitchBackend::~StitchBackend() {
  pools_.reset();
  stitch_.reset();
}

bool StitchBackend::capture_takes(StreamId stream) const {
  Lock lock(captures_mutex_);
  return std::any_of(captures_.rbegin(), captures_.rend(),
                     [stream](const auto& c) { return !c.second || c.second(stream); });
}

DevicePtr StitchBackend::malloc(std::size_t size, StreamId stream) {
  DevicePtr ptr = 0;
  if (captures_underway_.load(std::memory_order_acquire) != 0 && capture_takes(stream)) {
    ptr = pools_->malloc(size, stream);
  } else {
    pools_->poll_events();  // the private pools' cross-stream frees, as PyTorch's malloc
    try {
      // The engine's ladder ends with the private pools' (see the constructor).
      ptr = stitch_->malloc(size, stream);
    } catch (const OutOfMemoryError&) {
      settle_pending();
      throw;
    }
  }
  settle_pending();
  return ptr;
}

void StitchBackend::free(DevicePtr ptr) {
  if (ptr != 0 && !stitch_->free_owned(ptr)) pools_->free(ptr);
  settle_pending();
}

void StitchBackend::record_stream(DevicePtr ptr, StreamId stream) {
  if (stitch_->owns(ptr)) {
    stitch_->record_stream(ptr, stream);
  } else {
    pools_->record_stream(ptr, stream);
  }
}

std::size_t StitchBackend::allocation_size(DevicePtr ptr) const {
  return stitch_->owns(ptr) ? stitch_->allocation_size(ptr) : pools_->allocation_size(ptr);
}

ipc::SharedRegion StitchBackend::shared_region(DevicePtr ptr) const {
  return stitch_->owns(ptr) ? stitch_->shared_region(ptr) : pools_->shared_region(ptr);
}

void StitchBackend::empty_cache() {
  // One origin for both engines' releases: the caller's stack is taken once.
  const std::optional<OperationContext> context = stitch_->empty_cache_context();
  pools_->empty_cache();
  stitch_->empty_cache();
  settle_pending();
}

DeviceStats StitchBackend::stats() const {
  settle_pending();
  DeviceStats total = stitch_->stats();
  add_stats(total, pools_->stats());
  // Operations of other threads between the settlement and the reads may leave a debt for
  // their own settlement: no peak is reported below its current.
  PeakBaselines unused;
  for_each_tracked(total, unused,
                   [](Stat& s, std::int64_t&) { s.peak = std::max(s.peak, s.current); });
  // Summed reserved bytes and segment counts overstate their peaks once both engines have
  // held memory: the ledger's are exact (read last, so that no peak is below the current
  // taken before it).
  const StatArray reserved = device_reserved_.reserved();
  const StatArray segments = device_reserved_.segments();
  for (std::size_t t = 0; t < reserved.size(); ++t) {
    Stat& r = total.reserved_bytes[t];
    r.peak = std::max(reserved[t].peak, r.current);
    Stat& s = total.segment[t];
    s.peak = std::max(segments[t].peak, s.current);
  }
  return total;
}

void StitchBackend::reset_peak_stats() {
  stitch_->reset_peak_stats();
  pools_->reset_peak_stats();
  device_reserved_.reset_peaks();
}

void StitchBackend::reset_accumulated_stats() {
  stitch_->reset_accumulated_stats();
  pools_->reset_accumulated_stats();
}

void StitchBackend::set_memory_fraction(double fraction) {
  stitch_->set_memory_fraction(fraction);  // checks the value first
  pools_->set_memory_fraction(fraction);
}

// The private pools' engine first: it validates the fraction before changing anything, so
// once it has applied the settings the stitching engine's cannot fail.
bool StitchBackend::reconfigure(const Config& next) {
  check_fixed_keys(config_, next);
  pools_->reconfigure(without_stitching(next));
  stitch_->reconfigure(next);
  config_ = next;
  settle_pending();
  return true;
}

double StitchBackend::memory_fraction() const {
  return stitch_->memory_fraction();
}

std::vector<SegmentInfo> StitchBackend::segments() const {
  std::vector<SegmentInfo> all = stitch_->segments();
  std::vector<SegmentInfo> pooled = pools_->segments();
  all.insert(all.end(), std::make_move_iterator(pooled.begin()),
             std::make_move_iterator(pooled.end()));
  std::sort(all.begin(), all.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  return all;
}

void StitchBackend::add_oom_observer(Allocator::OomObserver observer) {
  stitch_->add_oom_observer(observer);
  pools_->add_oom_observer(std::move(observer));
}

void StitchBackend::add_free_memory_callback(Allocator::FreeMemoryCallback callback) {
  stitch_->add_free_memory_callback(callback);
  pools_->add_free_memory_callback(std::move(callback));
}

void StitchBackend::add_trace_observer(TraceObserver observer) {
  stitch_->add_trace_observer(observer);
  pools_->add_trace_observer(std::move(observer));
}

void StitchBackend::record_history(const HistoryOptions& options) {
  stitch_->record_history(options);
  pools_->record_history(options);
}

void StitchBackend::annotate(std::string_view name, bool start) {
  stitch_->annotate(name, start);
}

// One snapshot of the device, as one engine would give: the private pools' engine records no
// snapshot entry, the policy's counts both engines' active bytes, and the merged history
// keeps the newest entries one ring of the same length would.
Snapshot StitchBackend::snapshot() {
  Snapshot pooled = pools_->snapshot(/*trace_entry=*/false, 0);
  std::int64_t pooled_active = 0;
  for (const SnapshotSegment& seg : pooled.segments)
    pooled_active += seg.active_size;
  Snapshot snap = stitch_->snapshot(pooled_active);
  snap.segments.insert(snap.segments.end(), std::make_move_iterator(pooled.segments.begin()),
                       std::make_move_iterator(pooled.segments.end()));
  std::stable_sort(snap.segments.begin(), snap.segments.end(),
                   [](const SnapshotSegment& a, const SnapshotSegment& b) {
                     return a.device != b.device ? a.device < b.device : a.address < b.address;
                   });
  if (snap.device_traces.size() < pooled.device_traces.size()) {
    snap.device_traces.resize(pooled.device_traces.size());
  }
  for (std::size_t d = 0; d < pooled.device_traces.size(); ++d) {
    auto& into = snap.device_traces[d];
    auto& from = pooled.device_traces[d];
    if (from.empty()) continue;
    const auto middle = static_cast<std::ptrdiff_t>(into.size());
    into.insert(into.end(), std::make_move_iterator(from.begin()),
                std::make_move_iterator(from.end()));
    std::inplace_merge(into.begin(), into.begin() + middle, into.end(),
                       [](const SnapshotTraceEntry& a, const SnapshotTraceEntry& b) {
                         return a.seq < b.seq;
                       });
  }
  AllocatorSettings& settings = snap.allocator_settings;
  settings.trace_alloc_overflowed =
      settings.trace_alloc_overflowed || pooled.allocator_settings.trace_alloc_overflowed;
  const auto capacity = static_cast<std::size_t>(settings.trace_alloc_max_entries);
  for (auto& trace : snap.device_traces) {
    if (trace.size() <= capacity) continue;
    trace.erase(trace.begin(), trace.end() - static_cast<std::ptrdiff_t>(capacity));
    settings.trace_alloc_overflowed = true;
  }
  return snap;
}

void StitchBackend::check_invariants() const {
  stitch_->check_invariants();
  pools_->check_invariants();
}

void StitchBackend::set_check_invariants(bool on) {
  stitch_->set_check_invariants(on);
  pools_->set_check_invariants(on);
}

// ---------------------------------------------------------------------------------------
// Private pools: the native engine's.

void StitchBackend::create_pool(PoolId id, std::optional<SegmentSource> source) {
  pools_->create_pool(id, std::move(source));
}
void StitchBackend::release_pool(PoolId id) {
  pools_->release_pool(id);
}
int StitchBackend::pool_use_count(PoolId id) const {
  return pools_->pool_use_count(id);
}
void StitchBackend::set_pool_use_on_oom(PoolId id, bool use_on_oom) {
  pools_->set_pool_use_on_oom(id, use_on_oom);
}
void StitchBackend::set_pool_no_split(PoolId id) {
  pools_->set_pool_no_split(id);
}

// The native engine checks the request (and throws, changing nothing) before the stitching
// engine is told; the capture ends in the reverse order.
void StitchBackend::begin_allocate_to_pool(PoolId id, Allocator::StreamFilter filter) {
  pools_->begin_allocate_to_pool(id, filter);
  stitch_->begin_capture();
  Lock lock(captures_mutex_);
  captures_.emplace_back(id, std::move(filter));
  captures_underway_.fetch_add(1, std::memory_order_acq_rel);
}

void StitchBackend::end_allocate_to_pool(PoolId id) {
  pools_->end_allocate_to_pool(id);
  {
    Lock lock(captures_mutex_);
    const auto it = std::find_if(captures_.begin(), captures_.end(),
                                 [id](const auto& c) { return c.first == id; });
    if (it != captures_.end()) {
      captures_.erase(it);
      captures_underway_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
  stitch_->end_capture();
  settle_pending();
}

void StitchBackend::empty_cache(PoolId id) {
  if (id.is_default()) {
    empty_cache();
    return;
  }
  pools_->empty_cache(id);
}
std::vector<DevicePtr> StitchBackend::pool_live_allocations(PoolId id) const {
  return pools_->pool_live_allocations(id);
}
std::vector<SegmentInfo> StitchBackend::pool_segments(PoolId id) const {
  return pools_->pool_segments(id);
}
PoolId StitchBackend::segment_pool(DevicePtr address) const {
  return stitch_->owns(address) ? PoolId{} : pools_->segment_pool(address);
}
std::shared_ptr<const PoolCheckpoint> StitchBackend::checkpoint_pool(PoolId id) {
  return pools_->checkpoint_pool(id);
}
PoolRestore StitchBackend::restore_pool(const PoolCheckpoint& checkpoint) {
  PoolRestore restored = pools_->restore_pool(checkpoint);
  settle_pending();
  return restored;
}
void StitchBackend::create_sleepable_pool(PoolId id) {
  pools_->create_sleepable_pool(id);
}
void StitchBackend::sleep_pool(PoolId id, SleepMode mode) {
  pools_->sleep_pool(id, mode);
  settle_pending();
}
// The pool's own engine empties its caches and retries once before it gives up; the memory
// the default pools cache is the stitching engine's, so that goes back too before a last try.
void StitchBackend::wake_pool(PoolId id) {
  try {
    pools_->wake_pool(id);
    settle_pending();
    return;
  } catch (const OutOfMemoryError&) {
    if (stitch_->capturing()) throw;
  }
  stitch_->empty_cache();
  pools_->wake_pool(id);
  settle_pending();
}
bool StitchBackend::pool_asleep(PoolId id) const {
  return pools_->pool_asleep(id);
}
PoolSleepInfo StitchBackend::pool_sleep_info(PoolId id) const {
  return pools_->pool_sleep_info(id);
}

}  // namespace ccalloc::core
