// memory_stats() recovered from a snapshot: by replaying its trace when the trace covers
// the whole run, else from the state of its segments.
#include <string>

#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "io/snapshot_io.hpp"
#include "replay/replay.hpp"

namespace ccalloc::replay {
namespace {

// The current values PyTorch's stats would have in the state the segments show.
DeviceStats stats_from_segments(const Snapshot& s, int device) {
  DeviceStats st;
  const std::int64_t max_split = s.allocator_settings.max_split_size;
  const auto oversize = [max_split](std::size_t size) {
    return max_split >= 0 && static_cast<std::int64_t>(size) >= max_split;
  };
  const auto add = [](StatArray& a, StatType pool, std::int64_t n) {
    a[kAggregate].current += n;
    a[pool].current += n;
  };
  for (const SnapshotSegment& seg : s.segments) {
    if (seg.device != device) continue;
    const StatType pool = seg.is_small ? kSmallPool : kLargePool;
    // A sleeping pool's segment holds no memory (docs/sleep-wake.md).
    if (!seg.is_asleep) add(st.reserved_bytes, pool, static_cast<std::int64_t>(seg.total_size));
    if (!seg.is_expandable && !seg.is_asleep) {
      add(st.segment, pool, 1);
      if (oversize(seg.total_size)) st.oversize_segments.current += 1;
    }
    const bool split = seg.blocks.size() > 1;
    for (const SnapshotBlock& b : seg.blocks) {
      const auto size = static_cast<std::int64_t>(b.size);
      if (b.state == BlockState::kActiveAllocated) {
        add(st.allocation, pool, 1);
        add(st.allocated_bytes, pool, size);
        if (oversize(b.size)) st.oversize_allocations.current += 1;
      }
      if (b.state != BlockState::kInactive) {
        add(st.active, pool, 1);
        add(st.active_bytes, pool, size);
        add(st.requested_bytes, pool, static_cast<std::int64_t>(b.requested_size));
      } else if (split && !seg.is_expandable) {
        add(st.inactive_split, pool, 1);
        add(st.inactive_split_bytes, pool, size);
      }
    }
  }
  // The stitching policy reserves physical pieces, live behind the segments' pages or
  // spare, and counts each handle as a segment: reserved bytes are the handles' pieces.
  if (const PhysicalMemory* p = s.physical_of(device)) {
    for (StatArray* a : {&st.reserved_bytes, &st.segment}) {
      for (Stat& stat : *a)
        stat.current = 0;
    }
    for (const PhysicalHandleInfo& h : p->handles) {
      const StatType pool = h.is_small ? kSmallPool : kLargePool;
      add(st.reserved_bytes, pool,
          static_cast<std::int64_t>(std::size_t{h.pieces} * p->piece_size));
      add(st.segment, pool, 1);
    }
  }
  st.reset_peak();
  st.max_split_size = max_split;
  return st;
}

bool same_current(const DeviceStats& a, const DeviceStats& b) {
  for (int t = 0; t < 3; ++t) {
    if (a.reserved_bytes[t].current != b.reserved_bytes[t].current ||
        a.allocated_bytes[t].current != b.allocated_bytes[t].current ||
        a.active_bytes[t].current != b.active_bytes[t].current ||
        a.requested_bytes[t].current != b.requested_bytes[t].current ||
        a.allocation[t].current != b.allocation[t].current) {
      return false;
    }
  }
  return true;
}

}  // namespace

DeviceStats stats_from_snapshot(const Snapshot& s, int device, std::string* method) {
  const DeviceStats from_segments = stats_from_segments(s, device);
  if (method != nullptr) *method = "segments";
  if (s.allocator_settings.trace_alloc_overflowed || device < 0 ||
      static_cast<std::size_t>(device) >= s.device_traces.size()) {
    return from_segments;
  }
  const auto trace = io::trace_records(s, device);
  // A trace that starts with the run has segment events adding up to what is reserved.
  std::int64_t reserved = 0;
  for (const io::TraceRecord& r : trace) {
    const auto size = static_cast<std::int64_t>(r.entry.size);
    if (r.entry.action == TraceAction::kSegmentAlloc ||
        r.entry.action == TraceAction::kSegmentMap) {
      reserved += size;
    } else if (r.entry.action == TraceAction::kSegmentFree ||
               r.entry.action == TraceAction::kSegmentUnmap) {
      reserved -= size;
    }
  }
  if (trace.empty() || reserved != from_segments.reserved_bytes[kAggregate].current) {
    return from_segments;
  }
  Options options;
  const std::string& conf = s.allocator_settings.conf;
  const bool has_preset = conf.rfind("pytorch", 0) == 0 || conf.rfind("ccalloc", 0) == 0;
  options.conf = has_preset ? conf : conf.empty() ? "pytorch" : "pytorch," + conf;
  if (s.allocator_settings.expandable_segments) options.conf += ",expandable_segments:True";
  options.address_oracle = true;
  try {
    const Result replayed = run(trace, options);
    if (!same_current(replayed.stats, from_segments)) return from_segments;
    if (method != nullptr) *method = "replay";
    return replayed.stats;
  } catch (const Error&) {
    return from_segments;  // settings this build cannot parse, or an inconsistent trace
  }
}

}  // namespace ccalloc::replay
