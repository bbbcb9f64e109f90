// The stitching policy as the allocator's backend (`stitch_segments:True`, the `ccalloc`
// preset's default): a StitchEngine serves the default pool of every stream, and a native
// Engine beside it serves the private pools (CUDA graph capture, torch.cuda.MemPool, pools
// with a segment source, sleepable pools) on the config's segments (expandable segments in
// the `ccalloc` preset). Private pools keep all their rules (checkpoint and restore, no_split,
// use_on_oom, sleep and wake) because they are the native engine's; the default pools, where
// nearly all of a workload's memory lives, get the stitching policy's packing.
//
// Routing (docs/ccalloc-policy.md, "Private pools"):
//   malloc           a private pool's while a begin_allocate_to_pool takes the stream (the
//                    most recent first, as the native engine decides), else the stitching
//                    engine's. A default-pool request the stitching engine cannot serve is
//                    retried once after the private pools' cache is released (no capture
//                    underway), then offered to the use_on_oom pools, then raised.
//   free, record_stream, allocation_size, shared_region
//                    the engine whose address ranges hold the pointer (a lock-free lookup in
//                    the stitching engine's segment map; the rest are the native engine's).
//   begin/end_allocate_to_pool
//                    both: the native engine routes the capture, and the stitching engine
//                    stops recording and querying events and releasing memory meanwhile.
//   empty_cache, record_history, observers, reset_*, set_memory_fraction
//                    both.
//   pool calls       the native engine.
//
// Memory limit: each engine counts the other's reserved bytes (published without locks) against
// the per-process fraction, so the two together stay within it. Statistics: the sum of both.
// Reserved bytes' and segment counts' device-wide peaks are exact: both engines report each
// change of them to one ledger (core/device_reserved.hpp). The block statistics' device-wide
// peaks are exact too: the engines settle their arenas' peak debts together
// (core/peak_ledger.hpp, JointSettlement), here, after each operation that left one pending.
// Snapshots: both engines' segments by address, their history entries in the order they
// were recorded, the stitching engine's physical memory, annotations and settings.
#pragma once

#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include "core/backend.hpp"
#include "native/engine.hpp"
#include "stitch/engine.hpp"
#include "sync/thread_annotations.hpp"

namespace ccalloc::core {

class StitchBackend final : public Backend {
 public:
  StitchBackend(Driver& driver, Config config);
  ~StitchBackend() override;
  StitchBackend(const StitchBackend&) = delete;
  StitchBackend& operator=(const StitchBackend&) = delete;

  DevicePtr malloc(std::size_t size, StreamId stream) override;
  void free(DevicePtr ptr) override;
  void record_stream(DevicePtr ptr, StreamId stream) override;
  void empty_cache() override;
  DeviceStats stats() const override;
  void reset_peak_stats() override;
  void reset_accumulated_stats() override;
  void set_memory_fraction(double fraction) override;
  double memory_fraction() const override;
  std::vector<SegmentInfo> segments() const override;
  std::size_t allocation_size(DevicePtr ptr) const override;
  void add_oom_observer(Allocator::OomObserver observer) override;
  void add_free_memory_callback(Allocator::FreeMemoryCallback callback) override;
  void add_trace_observer(TraceObserver observer) override;
  void record_history(const HistoryOptions& options) override;
  Snapshot snapshot() override;
  void annotate(std::string_view name, bool start) override;
  void check_invariants() const override;
  void set_check_invariants(bool on) override;
  // The live config; reconfigure() changes it in place (as Engine::config()).
  const Config& config() const override { return config_; }
  // Applies `config` to both engines: the private pools' engine takes it as a native engine
  // does (expandable_segments, max_split_size and the rest apply to new private segments),
  // the stitching engine as StitchEngine::reconfigure says. ConfigError, changing nothing,
  // for backend, stitch_segments or uncached.
  bool reconfigure(const Config& config) override;
  const char* policy_name() const override { return "the stitching policy (stitch_segments)"; }
  Driver& driver() const override { return stitch_->driver(); }
  ipc::SharedRegion shared_region(DevicePtr ptr) const override;

  void create_pool(PoolId id, std::optional<SegmentSource> source) override;
  void release_pool(PoolId id) override;
  int pool_use_count(PoolId id) const override;
  void set_pool_use_on_oom(PoolId id, bool use_on_oom) override;
  void set_pool_no_split(PoolId id) override;
  void begin_allocate_to_pool(PoolId id, Allocator::StreamFilter filter) override;
  void end_allocate_to_pool(PoolId id) override;
  void empty_cache(PoolId id) override;
  std::vector<DevicePtr> pool_live_allocations(PoolId id) const override;
  std::vector<SegmentInfo> pool_segments(PoolId id) const override;
  PoolId segment_pool(DevicePtr address) const override;
  std::shared_ptr<const PoolCheckpoint> checkpoint_pool(PoolId id) override;
  PoolRestore restore_pool(const PoolCheckpoint& checkpoint) override;
  void create_sleepable_pool(PoolId id) override;
  void sleep_pool(PoolId id, SleepMode mode) override;
  void wake_pool(PoolId id) override;
  bool pool_asleep(PoolId id) const override;
  PoolSleepInfo pool_sleep_info(PoolId id) const override;

  // The two engines, for tests and the views (stitch/engine.hpp's piece counts).
  const StitchEngine& stitch_engine() const { return *stitch_; }
  const Engine& pool_engine() const { return *pools_; }

 private:
  // Whether a begin_allocate_to_pool underway takes `stream`.
  bool capture_takes(StreamId stream) const EXCLUDES(captures_mutex_);
  // Settles both engines' peak debts together when an operation left one pending (none of
  // either engine's locks held): the stitching engine's arena locks, then the private
  // pools' engine's.
  void settle_pending() const {
    if (joint_.take()) [[unlikely]] settle_now();
  }
  void settle_now() const;

  Config config_;  // written only by reconfigure()
  DeviceReserved device_reserved_;  // declared before the engines: outlives them
  mutable JointSettlement joint_;   // likewise
  std::unique_ptr<StitchEngine> stitch_;
  std::unique_ptr<Engine> pools_;
  mutable Mutex captures_mutex_;
  std::vector<std::pair<PoolId, Allocator::StreamFilter>> captures_ GUARDED_BY(captures_mutex_);
  std::atomic<int> captures_underway_{0};
};

}  // namespace ccalloc::core
