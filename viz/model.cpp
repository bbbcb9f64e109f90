#include "viz/model.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <numeric>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "core/rounding.hpp"

namespace ccalloc::viz {
namespace {

std::string hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

EventKind kind_of(TraceAction a) {
  switch (a) {
    case TraceAction::kAlloc:
      return EventKind::kAlloc;
    case TraceAction::kFreeRequested:
      return EventKind::kFreeRequested;
    case TraceAction::kFreeCompleted:
      return EventKind::kFreeCompleted;
    case TraceAction::kSegmentAlloc:
      return EventKind::kSegmentAlloc;
    case TraceAction::kSegmentFree:
      return EventKind::kSegmentFree;
    case TraceAction::kSegmentMap:
      return EventKind::kSegmentMap;
    case TraceAction::kSegmentUnmap:
      return EventKind::kSegmentUnmap;
    case TraceAction::kSnapshot:
      return EventKind::kSnapshot;
    case TraceAction::kOom:
      return EventKind::kOom;
  }
  return EventKind::kSnapshot;
}

// Interns strings, frames and stacks. Snapshots share one list between identical stacks,
// so the pointer is tried before the contents.
class StackInterner {
 public:
  explicit StackInterner(StackTable& table) : table_(table) {}

  std::int32_t intern(const Frames& frames) {
    if (!frames || frames->empty()) return -1;
    if (const auto it = by_pointer_.find(frames.get()); it != by_pointer_.end()) {
      return it->second;
    }
    std::vector<std::int32_t> ids;
    ids.reserve(frames->size());
    for (const Frame& f : *frames)
      ids.push_back(frame(f));
    auto [it, inserted] =
        by_content_.try_emplace(ids, static_cast<std::int32_t>(table_.stacks.size()));
    if (inserted) table_.stacks.push_back(std::move(ids));
    by_pointer_.emplace(frames.get(), it->second);
    return it->second;
  }

 private:
  std::int32_t string(const std::string& s) {
    auto [it, inserted] = strings_.try_emplace(s, static_cast<std::int32_t>(table_.strings.size()));
    if (inserted) table_.strings.push_back(s);
    return it->second;
  }
  std::int32_t frame(const Frame& f) {
    const StackTable::FrameRef ref{string(f.filename), f.line, string(f.name)};
    const auto key = std::make_tuple(ref.filename, ref.line, ref.name);
    auto [it, inserted] = frames_.try_emplace(key, static_cast<std::int32_t>(table_.frames.size()));
    if (inserted) table_.frames.push_back(ref);
    return it->second;
  }

  StackTable& table_;
  std::unordered_map<const void*, std::int32_t> by_pointer_;
  std::map<std::vector<std::int32_t>, std::int32_t> by_content_;
  std::unordered_map<std::string, std::int32_t> strings_;
  std::map<std::tuple<std::int32_t, std::int64_t, std::int32_t>, std::int32_t> frames_;
};

class StreamTable {
 public:
  explicit StreamTable(std::vector<std::string>& names) : names_(names) {}
  std::uint16_t index(StreamId s) {
    auto [it, inserted] = ids_.try_emplace(s, static_cast<std::uint16_t>(names_.size()));
    if (inserted) {
      if (names_.size() == 0xffff) {
        throw Error("viz: more than 65535 streams in one device's trace");
      }
      // As PyTorch writes it: the cudaStream_t's bits as a signed 64-bit integer.
      names_.push_back(std::to_string(static_cast<std::int64_t>(s)));
    }
    return it->second;
  }

 private:
  std::vector<std::string>& names_;
  std::unordered_map<StreamId, std::uint16_t> ids_;
};

Config parse_recorded_config(const Snapshot& s) {
  try {
    return Config::parse(recorded_config(s));
  } catch (const Error&) {
    return Config::parse("pytorch");  // settings this build does not know: PyTorch's defaults
  }
}

// The split rule leaves a remainder of at most this many bytes inside a block of
// `rounded` bytes (see Allocation::slack).
std::uint64_t slack_for(std::size_t rounded, const Config& config) {
  if (core::is_small_size(rounded) || config.expandable_segments) {
    return core::kMinBlockSize - 1;
  }
  if (core::is_oversize(rounded, config)) return config.max_non_split_rounding_size - 1;
  return core::kSmallSize;
}

// What build_model shares between its passes.
struct Builder {
  Model& m;
  const Config& config;
  std::vector<const SnapshotSegment*> segments;  // the device's, from the snapshot
  StackInterner stacks;
  StreamTable streams;

  void warn(std::size_t e, const std::string& what) {
    if (m.warnings.size() < 20) {
      m.warnings.push_back("event " + std::to_string(e) + " (trace entry " +
                           std::to_string(m.entry[e]) + "): " + what);
    } else if (m.warnings.size() == 20) {
      m.warnings.push_back("further inconsistencies are not listed");
    }
  }

  // The device's trace as events, collapsing adjacent free_requested/free_completed pairs.
  void events(const std::vector<SnapshotTraceEntry>& trace) {
    m.time0 = trace.empty() ? 0 : trace.front().time_us;
    for (std::size_t i = 0; i < trace.size(); ++i) {
      const SnapshotTraceEntry& t = trace[i];
      EventKind kind = kind_of(t.action);
      const std::size_t first = i;
      if (kind == EventKind::kFreeRequested && i + 1 < trace.size() &&
          trace[i + 1].action == TraceAction::kFreeCompleted && trace[i + 1].addr == t.addr) {
        kind = EventKind::kFree;
        ++i;
      }
      m.kind.push_back(kind);
      m.addr.push_back(t.addr);
      m.size.push_back(t.size);
      m.stream.push_back(streams.index(t.stream));
      m.time_us.push_back(t.time_us - m.time0);
      m.stack.push_back(stacks.intern(t.frames));
      m.alloc.push_back(-1);
      m.entry.push_back(static_cast<std::int32_t>(first));
    }
  }

  std::int32_t add_allocation(std::int32_t start, std::int32_t freed, std::int32_t end,
                              std::size_t e, std::uint8_t flags) {
    Allocation a;
    a.start = start;
    a.free_requested = freed;
    a.end = end;
    a.addr = m.addr[e];
    a.size = m.size[e];
    a.stack = m.stack[e];
    a.stream = m.stream[e];
    a.flags = flags;
    m.allocations.push_back(a);
    return static_cast<std::int32_t>(m.allocations.size() - 1);
  }

  // Pairs alloc and free events into allocations, in discovery order.
  void allocations() {
    const std::int32_t never = m.never();
    std::unordered_map<std::uint64_t, std::int32_t> live;  // address -> allocated or pending
    for (std::size_t e = 0; e < m.kind.size(); ++e) {
      const auto ei = static_cast<std::int32_t>(e);
      const std::uint64_t addr = m.addr[e];
      const auto it = live.find(addr);
      switch (m.kind[e]) {
        case EventKind::kAlloc:
          if (it != live.end()) {
            warn(e, "alloc at " + hex(addr) + ", which is live: the earlier block ends here");
            Allocation& old = m.allocations[static_cast<std::size_t>(it->second)];
            old.end = ei;
            if (old.free_requested == never) old.free_requested = ei;
          }
          live[addr] = m.alloc[e] = add_allocation(ei, never, never, e, 0);
          break;
        case EventKind::kFreeRequested:
          if (it == live.end()) {
            live[addr] = m.alloc[e] = add_allocation(
                -1, ei, never, e, Allocation::kBeforeTrace | Allocation::kStackFromFree);
          } else {
            Allocation& a = m.allocations[static_cast<std::size_t>(it->second)];
            if (a.free_requested != never) warn(e, "second free_requested of " + hex(addr));
            a.free_requested = ei;
            m.alloc[e] = it->second;
          }
          break;
        case EventKind::kFreeCompleted:
        case EventKind::kFree:
          if (it == live.end()) {
            // Freed without an alloc in the trace: live before the trace began (and a lone
            // free_completed was requested before it too).
            const std::int32_t freed = m.kind[e] == EventKind::kFree ? ei : -1;
            m.alloc[e] = add_allocation(-1, freed, ei, e,
                                        Allocation::kBeforeTrace | Allocation::kStackFromFree);
          } else {
            Allocation& a = m.allocations[static_cast<std::size_t>(it->second)];
            a.end = ei;
            if (a.free_requested == never) a.free_requested = ei;
            m.alloc[e] = it->second;
            live.erase(it);
          }
          break;
        default:
          break;
      }
    }

    // Blocks the snapshot still holds: the exact size of those the trace allocated, and
    // those allocated before the trace began.
    for (const SnapshotSegment* seg : segments) {
      for (const SnapshotBlock& b : seg->blocks) {
        if (b.state == BlockState::kInactive) continue;
        if (const auto it = live.find(b.address); it != live.end()) {
          m.allocations[static_cast<std::size_t>(it->second)].block_size = b.size;
          continue;
        }
        Allocation a;
        a.start = -1;
        a.free_requested = b.state == BlockState::kActiveAllocated ? never : -1;
        a.end = never;
        a.addr = b.address;
        a.size = b.requested_size;
        a.block_size = b.size;
        a.stack = stacks.intern(b.frames);
        a.stream = streams.index(seg->stream);
        a.flags = Allocation::kBeforeTrace;
        m.allocations.push_back(a);
      }
    }
    for (Allocation& a : m.allocations) {
      if (a.block_size != 0) continue;  // exact, from the snapshot
      a.block_size = core::round_size(a.size, config);
      a.slack = slack_for(a.block_size, config);
    }
  }

  // Stack order: blocks live before the trace at the bottom (by address), then by alloc
  // event. Event references follow the new numbering.
  void order_allocations() {
    std::vector<std::int32_t> order(m.allocations.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t x, std::int32_t y) {
      const Allocation& a = m.allocations[static_cast<std::size_t>(x)];
      const Allocation& b = m.allocations[static_cast<std::size_t>(y)];
      if (a.start != b.start) return a.start < b.start;
      return a.start < 0 && a.addr < b.addr;
    });
    std::vector<std::int32_t> renumber(order.size());
    std::vector<Allocation> sorted;
    sorted.reserve(order.size());
    for (std::size_t i = 0; i < order.size(); ++i) {
      renumber[static_cast<std::size_t>(order[i])] = static_cast<std::int32_t>(i);
      sorted.push_back(m.allocations[static_cast<std::size_t>(order[i])]);
    }
    m.allocations = std::move(sorted);
    for (std::int32_t& a : m.alloc) {
      if (a >= 0) a = renumber[static_cast<std::size_t>(a)];
    }
  }

  std::int32_t open_span(std::map<std::uint64_t, std::int32_t>& open, SegmentSpan s) {
    m.spans.push_back(s);
    const auto id = static_cast<std::int32_t>(m.spans.size() - 1);
    open[s.addr] = id;
    return id;
  }

  // Segment spans: one pass over the segment events, then what the snapshot still holds.
  void spans() {
    const std::int32_t never = m.never();
    std::map<std::uint64_t, std::int32_t> open;  // by address; open spans never overlap
    // The open spans overlapping [lo, hi), in address order.
    const auto overlapping = [&](std::uint64_t lo, std::uint64_t hi) {
      std::vector<std::map<std::uint64_t, std::int32_t>::iterator> out;
      auto it = open.upper_bound(lo);
      if (it != open.begin()) --it;
      for (; it != open.end() && it->first < hi; ++it) {
        const SegmentSpan& s = m.spans[static_cast<std::size_t>(it->second)];
        if (s.addr + s.size > lo) out.push_back(it);
      }
      return out;
    };
    // Bytes of [lo, hi) that no open span covers, as before-the-trace spans ending at e.
    const auto held_before = [&](std::uint64_t lo, std::uint64_t hi, std::int32_t end,
                                 std::uint16_t stream, std::uint8_t flags) {
      std::vector<std::pair<std::uint64_t, std::uint64_t>> pieces;
      std::uint64_t at = lo;
      for (const auto& it : overlapping(lo, hi)) {
        const SegmentSpan& s = m.spans[static_cast<std::size_t>(it->second)];
        if (s.addr > at) pieces.emplace_back(at, s.addr);
        at = std::max(at, s.addr + s.size);
      }
      if (at < hi) pieces.emplace_back(at, hi);
      for (const auto& [a, b] : pieces) {
        SegmentSpan s;
        s.start = -1;
        s.end = end;
        s.addr = a;
        s.size = b - a;
        s.stream = stream;
        s.flags = flags;
        m.spans.push_back(s);
      }
    };

    for (std::size_t e = 0; e < m.kind.size(); ++e) {
      const auto ei = static_cast<std::int32_t>(e);
      const std::uint64_t lo = m.addr[e];
      const std::uint64_t hi = lo + m.size[e];
      switch (m.kind[e]) {
        case EventKind::kSegmentAlloc:
        case EventKind::kSegmentMap: {
          for (const auto& it : overlapping(lo, hi)) {
            warn(e, "device memory at " + hex(lo) + " overlaps a segment still held");
            m.spans[static_cast<std::size_t>(it->second)].end = ei;
            open.erase(it);
          }
          SegmentSpan s;
          s.start = ei;
          s.end = never;
          s.addr = lo;
          s.size = m.size[e];
          s.stack = m.stack[e];
          s.stream = m.stream[e];
          s.flags = m.kind[e] == EventKind::kSegmentMap ? SegmentSpan::kExpandable : 0;
          open_span(open, s);
          break;
        }
        case EventKind::kSegmentFree:
        case EventKind::kSegmentUnmap: {
          const bool unmap = m.kind[e] == EventKind::kSegmentUnmap;
          held_before(lo, hi, ei, m.stream[e], unmap ? SegmentSpan::kExpandable : 0);
          for (const auto& it : overlapping(lo, hi)) {
            SegmentSpan s = m.spans[static_cast<std::size_t>(it->second)];
            m.spans[static_cast<std::size_t>(it->second)].end = ei;
            open.erase(it);
            if (!unmap) continue;  // a segment_free returns the whole segment
            // Pages outside the unmapped range stay mapped: they continue as new spans.
            SegmentSpan rest = s;
            rest.start = ei;
            if (s.addr < lo) {
              rest.addr = s.addr;
              rest.size = lo - s.addr;
              open_span(open, rest);
            }
            if (s.addr + s.size > hi) {
              rest.addr = hi;
              rest.size = s.addr + s.size - hi;
              open_span(open, rest);
            }
          }
          break;
        }
        case EventKind::kAlloc: {
          // The first block placed in a span tells its pool.
          const auto found = overlapping(lo, lo + 1);
          if (!found.empty()) {
            SegmentSpan& s = m.spans[static_cast<std::size_t>(found.front()->second)];
            if ((s.flags & SegmentSpan::kTypeKnown) == 0) {
              s.flags |= SegmentSpan::kTypeKnown;
              if (core::round_size(m.size[e], config) <= core::small_pool_max(config)) {
                s.flags |= SegmentSpan::kSmall;
              }
            }
          }
          break;
        }
        default:
          break;
      }
    }

    // What the snapshot holds: its pool types are exact, and memory no open span covers
    // was held since before the trace.
    for (const SnapshotSegment* seg : segments) {
      const std::uint8_t type = static_cast<std::uint8_t>(
          SegmentSpan::kTypeKnown | (seg->is_small ? SegmentSpan::kSmall : 0) |
          (seg->is_expandable ? SegmentSpan::kExpandable : 0));
      const std::uint64_t lo = seg->address;
      const std::uint64_t hi = lo + seg->total_size;
      for (const auto& it : overlapping(lo, hi)) {
        SegmentSpan& s = m.spans[static_cast<std::size_t>(it->second)];
        s.flags = static_cast<std::uint8_t>((s.flags & SegmentSpan::kExpandable) | type);
      }
      const std::size_t before = m.spans.size();
      held_before(lo, hi, never, streams.index(seg->stream), type);
      for (std::size_t i = before; i < m.spans.size(); ++i)
        m.spans[i].stack = stacks.intern(seg->frames);
    }
    for (SegmentSpan& s : m.spans) {
      // A 2 MiB cudaMalloc is a small-pool segment; large-pool segments are 20 MiB or more.
      if ((s.flags & SegmentSpan::kTypeKnown) == 0 && (s.flags & SegmentSpan::kExpandable) == 0 &&
          s.size == core::kSmallBuffer) {
        s.flags |= SegmentSpan::kSmall;
      }
    }
  }
};

}  // namespace

std::string recorded_config(const Snapshot& s) {
  const std::string& conf = s.allocator_settings.conf;
  const bool has_preset = conf.rfind("pytorch", 0) == 0 || conf.rfind("ccalloc", 0) == 0;
  std::string out = has_preset ? conf : conf.empty() ? "pytorch" : "pytorch," + conf;
  if (s.allocator_settings.expandable_segments &&
      out.find("expandable_segments:True") == std::string::npos) {
    out += ",expandable_segments:True";
  }
  return out;
}

Model build_model(const Snapshot& s, int device) {
  Model m;
  m.device = device;
  const Config config = parse_recorded_config(s);
  Builder b{m, config, {}, StackInterner(m.stacks), StreamTable(m.streams)};
  for (const SnapshotSegment& seg : s.segments) {
    if (seg.device == device) b.segments.push_back(&seg);
  }
  static const std::vector<SnapshotTraceEntry> kNoTrace;
  const bool has_trace = device >= 0 && static_cast<std::size_t>(device) < s.device_traces.size();
  b.events(has_trace ? s.device_traces[static_cast<std::size_t>(device)] : kNoTrace);
  b.allocations();
  b.order_allocations();
  b.spans();
  return m;
}

int default_device(const Snapshot& s) {
  std::size_t best = 0;
  int device = -1;
  for (std::size_t d = 0; d < s.device_traces.size(); ++d) {
    if (s.device_traces[d].size() > best) {
      best = s.device_traces[d].size();
      device = static_cast<int>(d);
    }
  }
  if (device >= 0) return device;
  return s.segments.empty() ? 0 : s.segments.front().device;
}

}  // namespace ccalloc::viz
