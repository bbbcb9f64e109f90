// Settings changed while the allocator is live (PyTorch's
// torch.cuda.memory._set_allocator_settings; vLLM toggles expandable_segments this way).
//
// What may change, as in PyTorch: max_split_size, max_non_split_rounding_size,
// roundup_power2_divisions, garbage_collection_threshold, expandable_segments (new segments
// only: existing segments keep their kind, and the engine holds both kinds side by side),
// the expandable reserve and large segment size (new segments only),
// graph_capture_record_stream_reuse (read at each free and allocation made during a
// capture), release_lock_on_cudamalloc (accepted, no effect here),
// the pinned-host keys (no host allocator: recorded, ignored) and the memory fraction.
// What may not: the backend, the stitching policy and uncached mode pick the implementation
// and how existing allocations are freed; asking to change one is a ConfigError naming it.
//
// The engine reads its config on the hot path under an arena lock (and on device-wide paths
// under device_mutex_ or every arena lock), so a change takes every arena lock and
// device_mutex_: an operation sees the old settings or the new ones, never a mixture.
// Fields that do not change are not written at all, so the few reads made without a lock
// (the fixed keys) never race with a reconfiguration.
#include <string>

#include "native/engine.hpp"
#include "core/arena_engine.hpp"
#include "core/rounding.hpp"

namespace ccalloc::core {
namespace {

template <typename T>
void assign_if_changed(T& field, const T& value) {
  if (!(field == value)) field = value;
}

[[noreturn]] void fixed_key(const char* key, const std::string& now, const std::string& asked) {
  throw ConfigError(std::string("ccalloc: allocator setting '") + key +
                    "' cannot change while the allocator is live (it is " + now +
                    ", the new settings ask for " + asked +
                    "); it applies to allocators created afterwards");
}

std::string bool_name(bool b) { return b ? "True" : "False"; }
std::string backend_name(BackendKind k) {
  return k == BackendKind::kCudaMallocAsync ? "cudaMallocAsync" : "native";
}

}  // namespace

void check_fixed_keys(const Config& now, const Config& next) {
  if (next.backend != now.backend) {
    fixed_key("backend", backend_name(now.backend), backend_name(next.backend));
  }
  if (next.stitch_segments != now.stitch_segments) {
    fixed_key("stitch_segments", bool_name(now.stitch_segments), bool_name(next.stitch_segments));
  }
  if (next.uncached != now.uncached) {
    fixed_key("uncached", bool_name(now.uncached), bool_name(next.uncached));
  }
}

bool Engine::reconfigure(const Config& next) {
  ArenaEngine::begin_reconfigure(*this, next);  // the fixed keys, then the fraction
  {
    const AllArenasLock all(*this);
    Lock lock(device_mutex_);
    const bool split_changed = next.max_split_size != config_.max_split_size;
    Config& c = config_;
    assign_if_changed(c.preset, next.preset);
    assign_if_changed(c.max_split_size, next.max_split_size);
    assign_if_changed(c.max_non_split_rounding_size, next.max_non_split_rounding_size);
    assign_if_changed(c.large_segment_size, next.large_segment_size);
    assign_if_changed(c.roundup_power2_divisions, next.roundup_power2_divisions);
    assign_if_changed(c.garbage_collection_threshold, next.garbage_collection_threshold);
    assign_if_changed(c.expandable_segments, next.expandable_segments);
    assign_if_changed(c.expandable_segments_reserve_fraction,
                      next.expandable_segments_reserve_fraction);
    assign_if_changed(c.expandable_segments_reserve_bytes, next.expandable_segments_reserve_bytes);
    assign_if_changed(c.release_lock_on_cudamalloc, next.release_lock_on_cudamalloc);
    assign_if_changed(c.per_process_memory_fraction, next.per_process_memory_fraction);
    assign_if_changed(c.graph_capture_record_stream_reuse, next.graph_capture_record_stream_reuse);
    assign_if_changed(c.pinned_use_cuda_host_register, next.pinned_use_cuda_host_register);
    assign_if_changed(c.pinned_num_register_threads, next.pinned_num_register_threads);
    assign_if_changed(c.pinned_use_background_threads, next.pinned_use_background_threads);
    assign_if_changed(c.pinned_reserve_segment_size_mb, next.pinned_reserve_segment_size_mb);
    assign_if_changed(c.source, next.source);
    if (!(c == next)) {
      throw Error("ccalloc: internal error: reconfigure() does not apply every Config field");
    }
    if (split_changed) recount_oversize(all);
  }
  after_operation();
  return true;
}

// Whether a block or segment is oversize depends on max_split_size: after a change the
// oversize counters are recounted, so that a free decrements what the counter holds (PyTorch
// keeps the old counts and lets frees under the new threshold skew them).
void Engine::recount_oversize(const AllArenasLock& all) {
  std::int64_t oversize_segments = 0;
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    std::int64_t live_oversize = 0;
    arena->live.for_each([&](DevicePtr, const Block* b) {
      if (is_oversize(b->size, config_)) ++live_oversize;
    });
    Stat& st = arena->stats.oversize_allocations;
    if (live_oversize > st.current) {
      arena->increase(st, arena->debts.oversize_allocations, live_oversize - st.current);
    }
    if (live_oversize < st.current) st.decrease(st.current - live_oversize);
    for (const auto& blocks : segments_of(*arena)) {
      if (blocks.front()->segment != nullptr) continue;  // expandable: not a device allocation
      std::size_t size = 0;
      for (const Block* b : blocks)
        size += b->size;
      if (is_oversize(size, config_)) ++oversize_segments;
    }
  }
  Stat& segs = device_stats_.oversize_segments;
  if (oversize_segments > segs.current) segs.increase(oversize_segments - segs.current);
  if (oversize_segments < segs.current) segs.decrease(segs.current - oversize_segments);
  // The reported max_split_size stays the value the allocator was created with: PyTorch
  // sets that statistic once, when its device allocator is constructed, and a live change
  // does not reach it (observed with torch 2.11: -1 after max_split_size_mb:64 set live).
  settle_peak_debts(all);
}

}  // namespace ccalloc::core
