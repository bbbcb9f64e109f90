// The allocator implementation behind ccalloc::Allocator: the native caching engine
// (core::Engine) or the stream-ordered pool backend (core::AsyncBackend), chosen by the
// config's `backend` key when the allocator is created.
#pragma once

#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/ipc.hpp"
#include "ccalloc/snapshot.hpp"

namespace ccalloc::core {

class Backend {
 public:
  virtual ~Backend() = default;

  virtual DevicePtr malloc(std::size_t size, StreamId stream) = 0;
  virtual void free(DevicePtr ptr) = 0;
  virtual void record_stream(DevicePtr ptr, StreamId stream) = 0;
  // Allocator::set_stream_order_key; only the native engine orders by it.
  virtual void set_stream_order_key(StreamId /*stream*/, std::uint64_t /*key*/) {}
  virtual void empty_cache() = 0;
  virtual DeviceStats stats() const = 0;
  virtual void reset_peak_stats() = 0;
  virtual void reset_accumulated_stats() = 0;
  virtual void set_memory_fraction(double fraction) = 0;
  virtual double memory_fraction() const = 0;
  virtual std::vector<SegmentInfo> segments() const = 0;
  virtual std::size_t allocation_size(DevicePtr ptr) const = 0;
  virtual void add_oom_observer(Allocator::OomObserver observer) = 0;
  virtual void add_free_memory_callback(Allocator::FreeMemoryCallback callback) = 0;
  virtual void add_trace_observer(TraceObserver observer) = 0;
  virtual void record_history(const HistoryOptions& options) = 0;
  virtual Snapshot snapshot() = 0;
  virtual void annotate(std::string_view name, bool start) = 0;
  virtual void check_invariants() const = 0;
  virtual void set_check_invariants(bool on) = 0;
  virtual const Config& config() const = 0;

  // Private pools (allocator.hpp). A backend without them throws Error naming itself.
  virtual void create_pool(PoolId id, std::optional<SegmentSource> source);
  virtual void release_pool(PoolId id);
  virtual int pool_use_count(PoolId id) const;
  virtual void set_pool_use_on_oom(PoolId id, bool use_on_oom);
  virtual void set_pool_no_split(PoolId id);
  virtual void begin_allocate_to_pool(PoolId id, Allocator::StreamFilter filter);
  virtual void end_allocate_to_pool(PoolId id);
  virtual void empty_cache(PoolId id);
  virtual std::vector<DevicePtr> pool_live_allocations(PoolId id) const;
  virtual std::vector<SegmentInfo> pool_segments(PoolId id) const;
  virtual PoolId segment_pool(DevicePtr address) const;
  virtual std::shared_ptr<const PoolCheckpoint> checkpoint_pool(PoolId id);
  virtual PoolRestore restore_pool(const PoolCheckpoint& checkpoint);
  // Sleepable pools (allocator.hpp, docs/sleep-wake.md); the defaults throw as above.
  virtual void create_sleepable_pool(PoolId id);
  virtual void sleep_pool(PoolId id, SleepMode mode);
  virtual void wake_pool(PoolId id);
  virtual bool pool_asleep(PoolId id) const;
  virtual PoolSleepInfo pool_sleep_info(PoolId id) const;
  // For the messages of the defaults: "the stitching policy".
  virtual const char* policy_name() const { return "this backend"; }
  // Applies `config` to the live allocator (torch.cuda.memory._set_allocator_settings).
  // Returns false, changing nothing, where this backend cannot change its settings live.
  // Throws ConfigError naming a key that cannot change while the allocator is live.
  virtual bool reconfigure(const Config& config) {
    (void)config;
    return false;
  }
  virtual Driver& driver() const = 0;
  // The memory another process maps to see the live allocation `ptr` (ipc.hpp). The
  // default: this backend cannot share, Error naming it.
  virtual ipc::SharedRegion shared_region(DevicePtr ptr) const;
  int device() const { return driver().device(); }
};

// Creates the backend the config names. Throws ConfigError for one this build lacks.
std::unique_ptr<Backend> make_backend(Driver& driver, Config config);

// For reconfigure(): throws ConfigError naming the key if `next` changes one that picks the
// implementation (backend, stitch_segments, uncached); reconfigure.cpp.
void check_fixed_keys(const Config& now, const Config& next);

}  // namespace ccalloc::core
