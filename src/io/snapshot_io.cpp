#include "io/snapshot_io.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "ccalloc/errors.hpp"
#include "io/flat_map.hpp"
#include "io/gzip.hpp"
#include "io/json.hpp"
#include "io/pickle.hpp"

namespace ccalloc::io {
namespace {

constexpr std::size_t kRoundupIntervals = 16;  // roundup_power2_divisions: 1 MiB .. 32 GiB

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// ---- Snapshot -> Value -------------------------------------------------------------------

std::int64_t to_int(std::uint64_t v, const char* what) {
  if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
    throw Error("snapshot: " + std::string(what) + " " + std::to_string(v) +
                " does not fit a 64-bit signed integer");
  }
  return static_cast<std::int64_t>(v);
}
// PyTorch writes a stream as cudaStream_t cast to int64_t: the same bits.
std::int64_t stream_int(StreamId s) {
  return static_cast<std::int64_t>(s);
}

class ToValue {
 public:
  Value snapshot(const Snapshot& s) {
    List segments;
    segments.reserve(s.segments.size());
    for (const SnapshotSegment& seg : s.segments)
      segments.push_back(segment(seg));
    List traces;
    traces.reserve(s.device_traces.size());
    for (const auto& trace : s.device_traces) {
      List entries;
      entries.reserve(trace.size());
      for (const SnapshotTraceEntry& e : trace)
        entries.push_back(entry(e));
      traces.push_back(Value::list(std::move(entries)));
    }
    List annotations;
    annotations.reserve(s.external_annotations.size());
    for (const Annotation& a : s.external_annotations) {
      annotations.push_back(Value::dict({
          {"stage", a.stage},
          {"name", a.name},
          {"device", a.device},
          {"time_us", a.time_us},
      }));
    }
    Dict top;
    top.reserve(5);
    top.emplace_back("segments", Value::list(std::move(segments)));
    top.emplace_back("device_traces", Value::list(std::move(traces)));
    top.emplace_back("allocator_settings", settings(s.allocator_settings));
    top.emplace_back("external_annotations", Value::list(std::move(annotations)));
    // The stitching policy's physical memory: a key of ccalloc's own, which PyTorch's
    // viewer and _memory_viz ignore. Absent for the other policies.
    if (!s.physical.empty()) {
      List devices;
      devices.reserve(s.physical.size());
      for (const PhysicalMemory& p : s.physical)
        devices.push_back(physical(p));
      top.emplace_back("physical_memory", Value::list(std::move(devices)));
    }
    return Value::dict(std::move(top));
  }

 private:
  static Value piece_run(const PieceRun& r) {
    return Value::dict({{"handle", to_int(r.handle, "physical handle")},
                        {"piece", std::int64_t{r.first}},
                        {"count", std::int64_t{r.count}}});
  }
  static Value piece_runs(const std::vector<PieceRun>& runs) {
    List out;
    out.reserve(runs.size());
    for (const PieceRun& r : runs)
      out.push_back(piece_run(r));
    return Value::list(std::move(out));
  }

  static Value physical(const PhysicalMemory& p) {
    List handles;
    handles.reserve(p.handles.size());
    for (const PhysicalHandleInfo& h : p.handles) {
      handles.push_back(Value::dict({{"handle", to_int(h.handle, "physical handle")},
                                     {"pieces", std::int64_t{h.pieces}},
                                     {"segment_type", h.is_small ? "small" : "large"}}));
    }
    List ranges;
    ranges.reserve(p.ranges.size());
    for (const AddressRange& r : p.ranges) {
      List dead;
      dead.reserve(r.dead.size());
      for (const DeadPages& d : r.dead) {
        dead.push_back(Value::dict({{"address", to_int(d.address, "dead page address")},
                                    {"handle", to_int(d.pieces.handle, "physical handle")},
                                    {"piece", std::int64_t{d.pieces.first}},
                                    {"count", std::int64_t{d.pieces.count}}}));
      }
      ranges.push_back(Value::dict({{"address", to_int(r.address, "range address")},
                                    {"size", to_int(r.size, "range size")},
                                    {"frontier", to_int(r.frontier, "range frontier")},
                                    {"stream", stream_int(r.stream)},
                                    {"segment_type", r.is_small ? "small" : "large"},
                                    {"dead", Value::list(std::move(dead))}}));
    }
    return Value::dict({{"device", p.device},
                        {"piece_size", to_int(p.piece_size, "piece_size")},
                        {"handles", Value::list(std::move(handles))},
                        {"spare", piece_runs(p.spare)},
                        {"ranges", Value::list(std::move(ranges))}});
  }

  Value segment(const SnapshotSegment& seg) {
    List blocks;
    blocks.reserve(seg.blocks.size());
    for (const SnapshotBlock& b : seg.blocks) {
      Dict d{
          {"address", to_int(b.address, "block address")},
          {"size", to_int(b.size, "block size")},
          {"requested_size", to_int(b.requested_size, "block requested_size")},
          {"state", std::string(to_string(b.state))},
          {"frames", frames(b.frames)},
      };
      if (b.island) d.emplace_back("island", true);  // the stitching policy's islands only
      blocks.push_back(Value::dict(std::move(d)));
    }
    Dict d{
        {"device", seg.device},
        {"address", to_int(seg.address, "segment address")},
        {"total_size", to_int(seg.total_size, "segment total_size")},
        {"allocated_size", to_int(seg.allocated_size, "segment allocated_size")},
        {"active_size", to_int(seg.active_size, "segment active_size")},
        {"requested_size", to_int(seg.requested_size, "segment requested_size")},
        {"stream", stream_int(seg.stream)},
        {"segment_type", seg.is_small ? "small" : "large"},
        {"segment_pool_id", Value::tuple({seg.pool_id.first, seg.pool_id.second})},
        {"is_expandable", seg.is_expandable},
        {"frames", frames(seg.frames)},
        {"blocks", Value::list(std::move(blocks))},
    };
    if (!seg.pieces.empty()) d.emplace_back("pieces", piece_runs(seg.pieces));
    if (seg.is_asleep) d.emplace_back("is_asleep", true);  // sleeping pools only
    return Value::dict(std::move(d));
  }

  Value entry(const SnapshotTraceEntry& e) {
    Dict d;
    d.reserve(7);
    d.emplace_back("action", std::string(to_string(e.action)));
    d.emplace_back(e.action == TraceAction::kOom ? "device_free" : "addr",
                   to_int(e.addr, "trace addr"));
    d.emplace_back("size", to_int(e.size, "trace size"));
    d.emplace_back("stream", stream_int(e.stream));
    d.emplace_back("time_us", e.time_us);
    if (!e.user_metadata.empty()) d.emplace_back("user_metadata", e.user_metadata);
    if (e.frames) d.emplace_back("frames", frames(e.frames));
    return Value::dict(std::move(d));
  }

  static Value settings(const AllocatorSettings& a) {
    Dict divisions;
    const std::size_t n = std::max(a.roundup_power2_divisions.size(), kRoundupIntervals);
    for (std::size_t i = 0; i < n && i < 63; ++i) {
      const std::int64_t v =
          i < a.roundup_power2_divisions.size() ? a.roundup_power2_divisions[i] : 0;
      divisions.emplace_back(std::to_string(std::uint64_t{1} << i), v);
    }
    return Value::dict({
        {"PYTORCH_CUDA_ALLOC_CONF", a.conf},
        {"max_split_size", a.max_split_size},
        {"garbage_collection_threshold", a.garbage_collection_threshold},
        {"expandable_segments", a.expandable_segments},
        {"pinned_num_register_threads", a.pinned_num_register_threads},
        {"release_lock_on_cudamalloc", a.release_lock_on_cudamalloc},
        {"pinned_use_cuda_host_register", a.pinned_use_cuda_host_register},
        {"graph_capture_record_stream_reuse", a.graph_capture_record_stream_reuse},
        {"roundup_power2_divisions", Value::dict(std::move(divisions))},
        {"trace_alloc_overflowed", a.trace_alloc_overflowed},
        {"trace_alloc_max_entries", a.trace_alloc_max_entries},
    });
  }

  // A stack as a list of frame dicts. One Frames object becomes one list, and equal frames
  // one dict, so the pickle memo writes each once (as PyTorch's own snapshots do).
  Value frames(const Frames& f) {
    if (!f || f->empty()) return Value::list();
    const auto [slot, inserted] = lists_.try_emplace(f.get(), Value());
    if (!inserted) return *slot;
    List items;
    items.reserve(f->size());
    for (const Frame& fr : *f)
      items.push_back(frame(fr));
    Value list = Value::list(std::move(items));
    *lists_.find(f.get()) = list;
    return list;
  }

  Value frame(const Frame& f) {
    std::string key;
    key.reserve(f.filename.size() + f.name.size() + 24);
    key.append(f.filename).append(1, '\0').append(f.name).append(1, '\0');
    key.append(std::to_string(f.line));
    const auto [it, inserted] = frame_dicts_.try_emplace(std::move(key));
    if (inserted) {
      it->second = Value::dict({{"filename", f.filename}, {"line", f.line}, {"name", f.name}});
    }
    return it->second;
  }

  detail::FlatMap<const void*, Value> lists_;
  std::unordered_map<std::string, Value> frame_dicts_;
};

// ---- Value -> Snapshot -------------------------------------------------------------------

[[noreturn]] void bad(const std::string& what) {
  throw FormatError(what);
}

std::string kind_error(std::string_view key, const Value& v, std::string_view expected) {
  return "'" + std::string(key) + "' is a " + std::string(v.kind_name()) + ", expected " +
         std::string(expected);
}

// Optional keys: absent or None gives the default.
const Value* field(const Value& d, std::string_view key) {
  const Value* v = d.find(key);
  return (v == nullptr || v->is_none()) ? nullptr : v;
}
const Value& required(const Value& d, std::string_view key) {
  const Value* v = field(d, key);
  if (v == nullptr) bad("missing key '" + std::string(key) + "'");
  return *v;
}

std::int64_t int_of(std::string_view key, const Value& v) {
  if (v.is_int()) return v.as_int();
  if (v.is_bool()) return v.as_bool() ? 1 : 0;  // Python's bool is an int
  bad(kind_error(key, v, "an int"));
}
std::uint64_t uint_of(std::string_view key, const Value& v) {
  const std::int64_t i = int_of(key, v);
  if (i < 0) bad("'" + std::string(key) + "' is negative (" + std::to_string(i) + ")");
  return static_cast<std::uint64_t>(i);
}
std::int64_t opt_int(const Value& d, std::string_view key, std::int64_t def) {
  const Value* v = field(d, key);
  return v ? int_of(key, *v) : def;
}
std::uint64_t opt_uint(const Value& d, std::string_view key, std::uint64_t def) {
  const Value* v = field(d, key);
  return v ? uint_of(key, *v) : def;
}
std::uint64_t req_uint(const Value& d, std::string_view key) {
  return uint_of(key, required(d, key));
}
bool opt_bool(const Value& d, std::string_view key, bool def) {
  const Value* v = field(d, key);
  if (v == nullptr) return def;
  if (v->is_bool()) return v->as_bool();
  if (v->is_int()) return v->as_int() != 0;
  bad(kind_error(key, *v, "a bool"));
}
double opt_number(const Value& d, std::string_view key, double def) {
  const Value* v = field(d, key);
  if (v == nullptr) return def;
  if (v->is_int() || v->is_float()) return v->as_number();
  bad(kind_error(key, *v, "a number"));
}
std::string opt_string(const Value& d, std::string_view key) {
  const Value* v = field(d, key);
  if (v == nullptr) return {};
  if (!v->is_string()) bad(kind_error(key, *v, "a str"));
  return v->as_string();
}
const List& list_of(std::string_view key, const Value& v) {
  if (!v.is_list() && !v.is_tuple()) bad(kind_error(key, v, "a list"));
  return v.as_list();
}
void require_dict(const Value& v, std::string_view what) {
  if (!v.is_dict())
    bad(std::string(what) + " is a " + std::string(v.kind_name()) + ", expected a dict");
}
StreamId stream_of(const Value& d) {
  const Value* v = field(d, "stream");
  return v ? static_cast<StreamId>(int_of("stream", *v)) : 0;
}

// Adds "<where>: " to a FormatError thrown by `f`.
template <typename F>
auto located(const std::string& where, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const FormatError& e) {
    throw FormatError(where + ": " + e.what());
  }
}

class FromValue {
 public:
  FromValue() = default;
  explicit FromValue(bool with_frames) : with_frames_(with_frames) {}
  // One trace entry without its frames; nullopt for an annotation.
  std::optional<SnapshotTraceEntry> entry_only(const Value& v) {
    std::vector<SnapshotTraceEntry> out;
    trace_entry(v, out);
    if (out.empty()) return std::nullopt;
    return std::move(out.back());
  }

  Snapshot run(const Value& v) {
    Snapshot s;
    if (v.is_list() || v.is_tuple()) {
      // An old-style snapshot: the list of segments alone.
      segments(v.as_list(), s);
      return s;
    }
    if (!v.is_dict()) {
      bad("a snapshot is a dict (or a list of segments), got a " + std::string(v.kind_name()));
    }
    const Value* segs = field(v, "segments");
    const Value* traces = field(v, "device_traces");
    if (segs == nullptr && traces == nullptr) {
      bad("not a memory snapshot: it has neither 'segments' nor 'device_traces'");
    }
    if (segs) segments(list_of("segments", *segs), s);
    if (traces) {
      const List& devices = list_of("device_traces", *traces);
      s.device_traces.resize(devices.size());
      for (std::size_t d = 0; d < devices.size(); ++d) {
        if (devices[d].is_none()) continue;
        const List& entries = list_of("device_traces[" + std::to_string(d) + "]", devices[d]);
        auto& out = s.device_traces[d];
        out.reserve(entries.size());
        for (std::size_t i = 0; i < entries.size(); ++i) {
          try {
            trace_entry(entries[i], out);
          } catch (const FormatError& e) {
            bad("device_traces[" + std::to_string(d) + "][" + std::to_string(i) + "]: " + e.what());
          }
        }
      }
    }
    if (const Value* a = field(v, "allocator_settings")) {
      located("allocator_settings", [&] { settings(*a, s.allocator_settings); });
    }
    if (const Value* p = field(v, "physical_memory")) {
      const List& devices = list_of("physical_memory", *p);
      s.physical.reserve(devices.size());
      for (std::size_t i = 0; i < devices.size(); ++i) {
        located("physical_memory[" + std::to_string(i) + "]",
                [&] { s.physical.push_back(physical(devices[i])); });
      }
    }
    if (const Value* a = field(v, "external_annotations")) {
      const List& items = list_of("external_annotations", *a);
      s.external_annotations.reserve(items.size());
      for (std::size_t i = 0; i < items.size(); ++i) {
        located("external_annotations[" + std::to_string(i) + "]", [&] {
          const Value& it = items[i];
          require_dict(it, "an annotation");
          s.external_annotations.push_back(
              Annotation{opt_string(it, "name"), opt_string(it, "stage"),
                         static_cast<int>(opt_int(it, "device", 0)), opt_int(it, "time_us", 0)});
        });
      }
    }
    return s;
  }

 private:
  void segments(const List& items, Snapshot& s) {
    s.segments.reserve(items.size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      try {
        s.segments.push_back(segment(items[i]));
      } catch (const FormatError& e) {
        bad("segments[" + std::to_string(i) + "]: " + e.what());
      }
    }
  }

  SnapshotSegment segment(const Value& v) {
    require_dict(v, "a segment");
    SnapshotSegment seg;
    seg.device = static_cast<int>(opt_int(v, "device", 0));
    seg.address = static_cast<DevicePtr>(req_uint(v, "address"));
    seg.total_size = static_cast<std::size_t>(req_uint(v, "total_size"));
    seg.stream = stream_of(v);
    const std::string type = opt_string(v, "segment_type");
    if (type == "small") {
      seg.is_small = true;
    } else if (type != "large" && !type.empty()) {
      bad("'segment_type' is '" + type + "', expected 'small' or 'large'");
    }
    if (const Value* pool = field(v, "segment_pool_id")) {
      const List& ids = list_of("segment_pool_id", *pool);
      if (ids.size() != 2)
        bad("'segment_pool_id' has " + std::to_string(ids.size()) + " items, expected 2");
      seg.pool_id = {int_of("segment_pool_id", ids[0]), int_of("segment_pool_id", ids[1])};
    }
    seg.is_expandable = opt_bool(v, "is_expandable", false);
    seg.is_asleep = opt_bool(v, "is_asleep", false);
    seg.frames = stack(v, false);
    std::size_t allocated = 0;
    std::size_t active = 0;
    std::size_t requested = 0;
    if (const Value* blocks = field(v, "blocks")) {
      const List& items = list_of("blocks", *blocks);
      seg.blocks.reserve(items.size());
      // As PyTorch's viewer: a block without an address follows the one before it.
      DevicePtr next = seg.address;
      for (std::size_t i = 0; i < items.size(); ++i) {
        located("blocks[" + std::to_string(i) + "]", [&] {
          const Value& b = items[i];
          require_dict(b, "a block");
          SnapshotBlock block;
          block.address = static_cast<DevicePtr>(opt_uint(b, "address", next));
          block.size = static_cast<std::size_t>(req_uint(b, "size"));
          block.requested_size =
              static_cast<std::size_t>(opt_uint(b, "requested_size", block.size));
          block.state = state_of(required(b, "state"));
          block.island = opt_bool(b, "island", false);
          block.frames = stack(b, false);
          next = block.address + block.size;
          if (block.state != BlockState::kInactive) {
            active += block.size;
            requested += block.requested_size;
          }
          if (block.state == BlockState::kActiveAllocated) allocated += block.size;
          seg.blocks.push_back(std::move(block));
        });
      }
    }
    if (const Value* p = field(v, "pieces")) seg.pieces = piece_runs("pieces", *p);
    seg.allocated_size = static_cast<std::size_t>(opt_uint(v, "allocated_size", allocated));
    seg.active_size = static_cast<std::size_t>(opt_uint(v, "active_size", active));
    seg.requested_size = static_cast<std::size_t>(opt_uint(v, "requested_size", requested));
    return seg;
  }

  static std::uint32_t u32_of(const Value& d, std::string_view key) {
    const std::uint64_t v = req_uint(d, key);
    if (v > std::numeric_limits<std::uint32_t>::max()) {
      bad("'" + std::string(key) + "' is " + std::to_string(v) + ", more than 4294967295");
    }
    return static_cast<std::uint32_t>(v);
  }
  static bool small_of(const Value& d) {
    const std::string type = opt_string(d, "segment_type");
    if (type != "small" && type != "large") {
      bad("'segment_type' is '" + type + "', expected 'small' or 'large'");
    }
    return type == "small";
  }
  // {"handle", "piece", "count"}: a run of `count` (at least 1) pieces of one handle.
  static PieceRun piece_run(const Value& d) {
    require_dict(d, "a piece run");
    PieceRun r{req_uint(d, "handle"), u32_of(d, "piece"), u32_of(d, "count")};
    if (r.count == 0) bad("'count' is 0, expected at least 1");
    if (std::uint64_t{r.first} + r.count > std::numeric_limits<std::uint32_t>::max()) {
      bad("pieces " + std::to_string(r.first) + " + " + std::to_string(r.count) +
          " pass 4294967295");
    }
    return r;
  }
  static std::vector<PieceRun> piece_runs(std::string_view key, const Value& v) {
    const List& items = list_of(key, v);
    std::vector<PieceRun> out;
    out.reserve(items.size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      located(std::string(key) + "[" + std::to_string(i) + "]",
              [&] { out.push_back(piece_run(items[i])); });
    }
    return out;
  }

  static PhysicalMemory physical(const Value& v) {
    require_dict(v, "physical memory");
    PhysicalMemory p;
    p.device = static_cast<int>(opt_int(v, "device", 0));
    p.piece_size = static_cast<std::size_t>(req_uint(v, "piece_size"));
    if (p.piece_size == 0) bad("'piece_size' is 0");
    if (const Value* h = field(v, "handles")) {
      const List& items = list_of("handles", *h);
      p.handles.reserve(items.size());
      for (std::size_t i = 0; i < items.size(); ++i) {
        located("handles[" + std::to_string(i) + "]", [&] {
          require_dict(items[i], "a handle");
          p.handles.push_back(PhysicalHandleInfo{req_uint(items[i], "handle"),
                                                 u32_of(items[i], "pieces"), small_of(items[i])});
        });
      }
    }
    if (const Value* sp = field(v, "spare")) p.spare = piece_runs("spare", *sp);
    if (const Value* r = field(v, "ranges")) {
      const List& items = list_of("ranges", *r);
      p.ranges.reserve(items.size());
      for (std::size_t i = 0; i < items.size(); ++i) {
        located("ranges[" + std::to_string(i) + "]", [&] {
          const Value& it = items[i];
          require_dict(it, "an address range");
          AddressRange range;
          range.address = static_cast<DevicePtr>(req_uint(it, "address"));
          range.size = static_cast<std::size_t>(req_uint(it, "size"));
          range.frontier = static_cast<std::size_t>(req_uint(it, "frontier"));
          if (range.frontier > range.size) {
            bad("'frontier' " + std::to_string(range.frontier) + " passes 'size' " +
                std::to_string(range.size));
          }
          range.stream = stream_of(it);
          range.is_small = small_of(it);
          if (const Value* dead = field(it, "dead")) {
            const List& runs = list_of("dead", *dead);
            range.dead.reserve(runs.size());
            for (std::size_t j = 0; j < runs.size(); ++j) {
              located("dead[" + std::to_string(j) + "]", [&] {
                const PieceRun run = piece_run(runs[j]);
                range.dead.push_back(
                    DeadPages{static_cast<DevicePtr>(req_uint(runs[j], "address")), run});
              });
            }
          }
          p.ranges.push_back(std::move(range));
        });
      }
    }
    return p;
  }

  static BlockState state_of(const Value& v) {
    if (!v.is_string()) bad(kind_error("state", v, "a str"));
    const std::string& s = v.as_string();
    if (s == "active_allocated") return BlockState::kActiveAllocated;
    // PyTorch's docstring spells the middle state "active_awaiting_free".
    if (s == "active_pending_free" || s == "active_awaiting_free") {
      return BlockState::kActivePendingFree;
    }
    if (s == "inactive") return BlockState::kInactive;
    bad("'state' is '" + s + "', expected 'active_allocated', 'active_pending_free' or 'inactive'");
  }

  void trace_entry(const Value& v, std::vector<SnapshotTraceEntry>& out) {
    require_dict(v, "a trace entry");
    const Value& action = required(v, "action");
    if (!action.is_string()) bad(kind_error("action", action, "a str"));
    const std::optional<TraceAction> a = parse_trace_action(action.as_string());
    if (!a) {
      // Newer PyTorch records user annotations in the trace; they are not allocator events.
      if (action.as_string() == "annotate") return;
      bad("unknown action '" + action.as_string() + "'");
    }
    SnapshotTraceEntry e;
    e.action = *a;
    if (e.action == TraceAction::kOom) {
      const Value* device_free = field(v, "device_free");
      e.addr = static_cast<DevicePtr>(device_free ? uint_of("device_free", *device_free)
                                                  : opt_uint(v, "addr", 0));
    } else {
      e.addr = static_cast<DevicePtr>(req_uint(v, "addr"));
    }
    e.size = static_cast<std::size_t>(req_uint(v, "size"));
    e.stream = stream_of(v);
    e.time_us = opt_int(v, "time_us", 0);
    if (with_frames_) e.frames = stack(v, true);
    e.user_metadata = opt_string(v, "user_metadata");
    out.push_back(std::move(e));
  }

  static void settings(const Value& v, AllocatorSettings& a) {
    require_dict(v, "allocator_settings");
    a.conf = opt_string(v, "PYTORCH_CUDA_ALLOC_CONF");
    a.max_split_size = opt_int(v, "max_split_size", a.max_split_size);
    a.garbage_collection_threshold =
        opt_number(v, "garbage_collection_threshold", a.garbage_collection_threshold);
    a.expandable_segments = opt_bool(v, "expandable_segments", a.expandable_segments);
    a.pinned_num_register_threads =
        opt_int(v, "pinned_num_register_threads", a.pinned_num_register_threads);
    a.release_lock_on_cudamalloc =
        opt_bool(v, "release_lock_on_cudamalloc", a.release_lock_on_cudamalloc);
    a.pinned_use_cuda_host_register =
        opt_bool(v, "pinned_use_cuda_host_register", a.pinned_use_cuda_host_register);
    a.graph_capture_record_stream_reuse =
        opt_bool(v, "graph_capture_record_stream_reuse", a.graph_capture_record_stream_reuse);
    a.trace_alloc_overflowed = opt_bool(v, "trace_alloc_overflowed", a.trace_alloc_overflowed);
    a.trace_alloc_max_entries = opt_int(v, "trace_alloc_max_entries", a.trace_alloc_max_entries);
    a.roundup_power2_divisions.assign(kRoundupIntervals, 0);
    const Value* r = field(v, "roundup_power2_divisions");
    if (r == nullptr) return;
    if (r->is_dict()) {
      // Keyed by the interval's start in MiB: "1", "2", "4", ... "32768".
      for (const auto& [key, value] : r->as_dict()) {
        if (!key.is_string()) continue;
        const std::string& k = key.as_string();
        for (std::size_t i = 0; i < kRoundupIntervals; ++i) {
          if (k == std::to_string(std::uint64_t{1} << i)) {
            a.roundup_power2_divisions[i] = int_of("roundup_power2_divisions", value);
          }
        }
      }
    } else {
      const List& items = list_of("roundup_power2_divisions", *r);
      for (std::size_t i = 0; i < items.size() && i < kRoundupIntervals; ++i)
        a.roundup_power2_divisions[i] = int_of("roundup_power2_divisions", items[i]);
    }
  }

  // The `frames` of a segment, block or trace entry. Lists that are one object in the
  // file (the pickle memo), or have the same frames, become one shared Frames. Segments
  // and blocks always carry the key ([] for none): theirs map [] to null.
  Frames stack(const Value& d, bool keep_empty) {
    const Value* v = field(d, "frames");
    if (v == nullptr) return nullptr;
    const List& items = list_of("frames", *v);
    if (items.empty()) {
      if (!keep_empty) return nullptr;
      if (!empty_) empty_ = std::make_shared<const std::vector<Frame>>();
      return empty_;
    }
    if (Frames* seen = by_identity_.find(v->identity())) return *seen;
    std::vector<Frame> frames;
    frames.reserve(items.size());
    std::size_t h = items.size();
    for (std::size_t i = 0; i < items.size(); ++i) {
      const Value& f = items[i];
      located("frames[" + std::to_string(i) + "]", [&] {
        require_dict(f, "a frame");
        frames.push_back(
            Frame{opt_string(f, "filename"), opt_int(f, "line", 0), opt_string(f, "name")});
      });
      const Frame& fr = frames.back();
      h = h * 1000003 ^ std::hash<std::string>{}(fr.filename);
      h = h * 1000003 ^ std::hash<std::string>{}(fr.name);
      h = h * 1000003 ^ std::hash<std::int64_t>{}(fr.line);
    }
    Frames result;
    auto& bucket = by_content_[h];
    for (const Frames& candidate : bucket) {
      if (*candidate == frames) {
        result = candidate;
        break;
      }
    }
    if (!result) {
      result = std::make_shared<const std::vector<Frame>>(std::move(frames));
      bucket.push_back(result);
    }
    // Keyed by the list's address, which lives as long as `d` (the caller's tree).
    by_identity_.try_emplace(v->identity(), result);
    return result;
  }

  bool with_frames_ = true;
  Frames empty_;
  detail::FlatMap<const void*, Frames> by_identity_;
  std::unordered_map<std::size_t, std::vector<Frames>> by_content_;
};

}  // namespace

SnapshotFormat format_for_path(const std::string& path) {
  return ends_with(path, ".json") || ends_with(path, ".json.gz") ? SnapshotFormat::kJson
                                                                 : SnapshotFormat::kPickle;
}

PickleLimits pickle_limits(const ReadLimits& limits) {
  PickleLimits pickle;
  pickle.max_depth = limits.max_nesting;
  pickle.max_memo = limits.max_pickle_memo;
  pickle.max_items = limits.max_pickle_values;
  return pickle;
}

SnapshotFormat detect_value_format(ByteInput& in, const std::string& path) {
  std::size_t i = 0;
  if (in.ensure(3) && std::string_view(in.here(), 3) == "\xef\xbb\xbf") i = 3;
  while (in.ensure(i + 1) && (in.here()[i] == ' ' || in.here()[i] == '\t' || in.here()[i] == '\n' ||
                              in.here()[i] == '\r'))
    ++i;
  if (!in.ensure(i + 1)) throw FormatError(path + ": empty file (expected a pickle or JSON)");
  const auto first = static_cast<unsigned char>(in.here()[i]);
  if (first == '{' || first == '[') return SnapshotFormat::kJson;
  if (first == 0x80) return SnapshotFormat::kPickle;
  static constexpr char kHex[] = "0123456789abcdef";
  throw FormatError(path + ": byte " + std::to_string(in.offset() + i) +
                    ": neither a pickle (byte 0x80) nor JSON ('{' or '['): got 0x" +
                    kHex[first >> 4] + kHex[first & 0xf]);
}

std::unique_ptr<ValueParser> value_parser(ByteInput& in, const std::string& path,
                                          const ReadLimits& limits, TraceEntrySink* sink) {
  if (detect_value_format(in, path) == SnapshotFormat::kJson) {
    return json_parser(in, path, limits.max_nesting, sink);
  }
  return pickle_parser(in, path, pickle_limits(limits), sink);
}

Value read_value_file(const std::string& path) {
  const ReadLimits limits = ReadLimits::from_environment();
  ByteSource source(path, limits);
  ByteInput in(source, {});
  const std::unique_ptr<ValueParser> parser = value_parser(in, path, limits, nullptr);
  while (parser->step()) {
  }
  return parser->result();
}

std::optional<SnapshotTraceEntry> trace_entry_of(const Value& v) {
  return FromValue(false).entry_only(v);
}

void write_value_file(const std::string& path, const Value& v) {
  write_file(path,
             format_for_path(path) == SnapshotFormat::kJson ? write_json(v) : write_pickle(v));
}

Value to_value(const Snapshot& s) {
  return ToValue().snapshot(s);
}

Snapshot snapshot_from_value(const Value& v, const std::string& name) {
  try {
    return FromValue().run(v);
  } catch (const FormatError& e) {
    throw FormatError(name + ": " + e.what());
  }
}

Snapshot read_snapshot(const std::string& path) {
  return snapshot_from_value(read_value_file(path), path);
}

void write_snapshot(const std::string& path, const Snapshot& s) {
  write_value_file(path, to_value(s));
}

void write_snapshot(const std::string& path, const Snapshot& s, const ContextFrames& frames) {
  if (!frames) {
    write_snapshot(path, s);
    return;
  }
  Snapshot rendered = s;
  render_contexts(rendered, frames);
  write_value_file(path, to_value(rendered));
}

std::vector<TraceRecord> trace_records(const Snapshot& s, int device) {
  std::vector<TraceRecord> out;
  if (device < 0 || static_cast<std::size_t>(device) >= s.device_traces.size()) return out;
  const auto& trace = s.device_traces[static_cast<std::size_t>(device)];
  out.reserve(trace.size());
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const SnapshotTraceEntry& e = trace[i];
    out.push_back({TraceEntry{e.action, e.addr, e.size, e.stream, e.time_us}, i + 1});
  }
  return out;
}

}  // namespace ccalloc::io
