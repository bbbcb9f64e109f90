#include "viz/page.hpp"

#include <zlib.h>

#include <bit>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "core/rounding.hpp"
#include "replay/physical_view.hpp"
#include "replay/replay.hpp"
#include "viz/model.hpp"
#include "viz/what_if.hpp"

namespace ccalloc::viz {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the payload's columns are written in memory order and read as little-endian");

using Json = nlohmann::ordered_json;

// Little-endian columns in one buffer, each 8-byte aligned, and the table that finds them.
class Columns {
 public:
  template <class T>
  void add(const std::string& name, const char* type, const std::vector<T>& v) {
    const std::size_t offset = append(v.data(), v.size() * sizeof(T));
    table_[name] = Json::array({type, offset, v.size()});
  }
  // 64-bit integers as low and high 32-bit words (see page.hpp).
  void add64(const std::string& name, const char* type, const std::vector<std::uint64_t>& v) {
    std::vector<std::uint32_t> lo(v.size()), hi(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      lo[i] = static_cast<std::uint32_t>(v[i]);
      hi[i] = static_cast<std::uint32_t>(v[i] >> 32);
    }
    const std::size_t lo_offset = append(lo.data(), lo.size() * 4);
    const std::size_t hi_offset = append(hi.data(), hi.size() * 4);
    table_[name] = Json::array({type, lo_offset, v.size(), hi_offset});
  }
  const std::string& bytes() const { return data_; }
  const Json& table() const { return table_; }

 private:
  std::size_t append(const void* p, std::size_t n) {
    data_.resize((data_.size() + 7) / 8 * 8, '\0');
    const std::size_t offset = data_.size();
    data_.append(static_cast<const char*>(p), n);
    return offset;
  }
  std::string data_;
  Json table_ = Json::object();
};

// One column of a struct field across a vector of structs.
template <class T, class S, class F>
std::vector<T> column(const std::vector<S>& rows, F field) {
  std::vector<T> out;
  out.reserve(rows.size());
  for (const S& r : rows)
    out.push_back(static_cast<T>(field(r)));
  return out;
}

std::string gzip(const std::string& in) {
  if (in.size() > 0xffffffffu) throw Error("viz: payload too large to compress in one call");
  z_stream zs{};
  // Level 6: the page's decompression costs the same at any level, and 6 is within a few
  // per cent of 9's size at a fraction of its time.
  if (deflateInit2(&zs, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    throw Error("viz: zlib deflateInit2 failed");
  }
  std::string out(deflateBound(&zs, static_cast<uLong>(in.size())), '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  if (rc != Z_STREAM_END) throw Error("viz: zlib deflate failed");
  return out;
}

std::string base64(const std::string& in) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  const auto byte = [&](std::size_t k) {
    return static_cast<std::uint32_t>(static_cast<unsigned char>(in[k]));
  };
  for (; i + 2 < in.size(); i += 3) {
    const std::uint32_t v = byte(i) << 16 | byte(i + 1) << 8 | byte(i + 2);
    out += kAlphabet[v >> 18 & 63];
    out += kAlphabet[v >> 12 & 63];
    out += kAlphabet[v >> 6 & 63];
    out += kAlphabet[v & 63];
  }
  if (i + 1 == in.size()) {
    const std::uint32_t v = byte(i) << 16;
    out += kAlphabet[v >> 18 & 63];
    out += kAlphabet[v >> 12 & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    const std::uint32_t v = byte(i) << 16 | byte(i + 1) << 8;
    out += kAlphabet[v >> 18 & 63];
    out += kAlphabet[v >> 12 & 63];
    out += kAlphabet[v >> 6 & 63];
    out += '=';
  }
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// JSON that can sit inside a <script> element: no '<' at all, so neither "</script" nor
// "<!--" can appear. Invalid UTF-8 (frame names come from binaries) becomes U+FFFD.
std::string script_json(const Json& j) {
  const std::string text = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '<') {
      out += "\\u003c";
    } else {
      out += c;
    }
  }
  return out;
}

Columns encode(const Model& m) {
  Columns c;
  c.add("ev_kind", "u8", column<std::uint8_t>(m.kind, [](EventKind k) { return k; }));
  c.add64("ev_addr", "u64", m.addr);
  c.add64("ev_size", "u64", m.size);
  c.add("ev_stream", "u16", m.stream);
  c.add64("ev_time", "i64", column<std::uint64_t>(m.time_us, [](std::int64_t t) { return t; }));
  c.add("ev_stack", "i32", m.stack);
  c.add("ev_alloc", "i32", m.alloc);
  c.add("ev_entry", "i32", m.entry);

  const auto& a = m.allocations;
  c.add("al_start", "i32", column<std::int32_t>(a, [](const Allocation& x) { return x.start; }));
  c.add("al_free_requested", "i32",
        column<std::int32_t>(a, [](const Allocation& x) { return x.free_requested; }));
  c.add("al_end", "i32", column<std::int32_t>(a, [](const Allocation& x) { return x.end; }));
  c.add64("al_addr", "u64", column<std::uint64_t>(a, [](const Allocation& x) { return x.addr; }));
  c.add64("al_size", "u64", column<std::uint64_t>(a, [](const Allocation& x) { return x.size; }));
  c.add64("al_block_size", "u64",
          column<std::uint64_t>(a, [](const Allocation& x) { return x.block_size; }));
  c.add64("al_slack", "u64", column<std::uint64_t>(a, [](const Allocation& x) { return x.slack; }));
  c.add("al_stack", "i32", column<std::int32_t>(a, [](const Allocation& x) { return x.stack; }));
  c.add("al_stream", "u16", column<std::uint16_t>(a, [](const Allocation& x) { return x.stream; }));
  c.add("al_flags", "u8", column<std::uint8_t>(a, [](const Allocation& x) { return x.flags; }));

  const auto& s = m.spans;
  c.add("sp_start", "i32", column<std::int32_t>(s, [](const SegmentSpan& x) { return x.start; }));
  c.add("sp_end", "i32", column<std::int32_t>(s, [](const SegmentSpan& x) { return x.end; }));
  c.add64("sp_addr", "u64", column<std::uint64_t>(s, [](const SegmentSpan& x) { return x.addr; }));
  c.add64("sp_size", "u64", column<std::uint64_t>(s, [](const SegmentSpan& x) { return x.size; }));
  c.add("sp_stack", "i32", column<std::int32_t>(s, [](const SegmentSpan& x) { return x.stack; }));
  c.add("sp_stream", "u16",
        column<std::uint16_t>(s, [](const SegmentSpan& x) { return x.stream; }));
  c.add("sp_flags", "u8", column<std::uint8_t>(s, [](const SegmentSpan& x) { return x.flags; }));
  return c;
}

Json settings_json(const AllocatorSettings& s) {
  Json j;
  j["PYTORCH_CUDA_ALLOC_CONF"] = s.conf;
  j["max_split_size"] = s.max_split_size;
  j["garbage_collection_threshold"] = s.garbage_collection_threshold;
  j["expandable_segments"] = s.expandable_segments;
  j["release_lock_on_cudamalloc"] = s.release_lock_on_cudamalloc;
  Json roundup = Json::object();
  for (std::size_t i = 0; i < s.roundup_power2_divisions.size(); ++i) {
    roundup[std::to_string(std::size_t{1} << i)] = s.roundup_power2_divisions[i];
  }
  j["roundup_power2_divisions"] = roundup;
  j["trace_alloc_overflowed"] = s.trace_alloc_overflowed;
  j["trace_alloc_max_entries"] = s.trace_alloc_max_entries;
  return j;
}

Json stack_table_json(const StackTable& t) {
  Json frames = Json::array();
  for (const auto& f : t.frames)
    frames.push_back(Json::array({f.filename, f.line, f.name}));
  Json stacks = Json::array();
  for (const auto& s : t.stacks)
    stacks.push_back(s);
  return Json{{"strings", t.strings}, {"frames", frames}, {"stacks", stacks}};
}

// What the page needs to explain each OOM that the trace alone does not say: the pool
// the request needed and the segment a new device allocation would have been.
Json oom_events_json(const Model& m, const std::string& conf) {
  Config config;
  try {
    config = Config::parse(conf);
  } catch (const Error&) {
    config = Config::parse("pytorch");
  }
  Json out = Json::array();
  for (std::size_t e = 0; e < m.kind.size(); ++e) {
    if (m.kind[e] != EventKind::kOom) continue;
    const std::size_t rounded = core::round_size(m.size[e], config);
    const bool small = rounded <= core::small_pool_max(config);
    // The stitching policy, at a limit, grows by exactly the pages a request lacks (a page
    // for the small pool) instead of a segment.
    const std::size_t segment = !core::stitches(config) ? core::segment_size_for(rounded, config)
                                : small                 ? core::kSmallBuffer
                                                        : core::round_up_large(rounded);
    out.push_back(
        {{"event", e}, {"rounded", rounded}, {"segment_size", segment}, {"small", small}});
  }
  return out;
}

Json what_if_json(const WhatIfReport& r) {
  Json runs = Json::array();
  for (const WhatIfRun& run : r.runs) {
    runs.push_back({{"label", run.label},
                    {"conf", run.conf},
                    {"capacity", run.capacity},
                    {"unlimited", run.unlimited},
                    {"ooms", run.ooms},
                    {"peak_reserved", run.peak_reserved_bytes},
                    {"error", run.error}});
  }
  return {{"capacity", r.capacity},
          {"capacity_source", r.capacity_source},
          {"peak_requested", r.peak_requested_bytes},
          {"runs", runs}};
}

// The stitching policy's physical memory (replay/physical_view.hpp): per range its
// figures in the meta, and per page below each range's frontier, in columns: pg_state
// (0 unmapped, 1 live, 2 dead), pg_handle and pg_piece (the piece it maps), pg_free (the
// share of a live page inside free blocks, 0-255) and pg_lent (for a dead page: the page
// its piece backs now, 0 if none). Null when the snapshot has none.
constexpr std::size_t kMaxPiecePages = std::size_t{1} << 22;  // 8 TiB of 2 MiB pages

Json physical_json(const Snapshot& s, int device, Columns& c) {
  const auto view = replay::physical_view(s, device);
  if (!view) return nullptr;
  const PhysicalMemory& p = *s.physical_of(device);
  const std::size_t g = view->piece_size;
  Json ranges = Json::array();
  std::size_t total_pages = 0;
  for (const replay::RangeView& r : view->ranges)
    total_pages += g > 0 ? r.frontier / g : 0;
  const bool with_pages = g > 0 && total_pages <= kMaxPiecePages;
  std::vector<std::uint8_t> state, free_share;
  std::vector<std::uint64_t> handle, lent;
  std::vector<std::int32_t> piece;
  if (with_pages) {
    state.assign(total_pages, 0);
    free_share.assign(total_pages, 0);
    handle.assign(total_pages, 0);
    lent.assign(total_pages, 0);
    piece.assign(total_pages, -1);
  }
  // Where each piece is live, for the dead pages' "lent to".
  std::map<std::pair<PhysicalHandle, std::uint32_t>, DevicePtr> live_at;
  std::size_t first_page = 0;
  for (const replay::RangeView& r : view->ranges) {
    const std::size_t pages = g > 0 ? r.frontier / g : 0;
    ranges.push_back({{"address", r.address},
                      {"size", r.size},
                      {"frontier", r.frontier},
                      {"stream", std::to_string(r.stream)},
                      {"small", r.is_small},
                      {"segments", r.segments},
                      {"live_pages", r.live_pages},
                      {"dead_pages", r.dead_pages},
                      {"unmapped_pages", r.unmapped_pages},
                      {"mapped", r.mapped_bytes},
                      {"physical", r.physical_bytes},
                      {"allocated", r.allocated_bytes},
                      {"free", r.free_bytes},
                      {"largest_free", r.largest_free},
                      {"fragmentation", r.fragmentation},
                      {"first_page", first_page},
                      {"pages", with_pages ? pages : 0}});
    if (with_pages) {
      const auto page_of = [&](DevicePtr va) -> std::size_t {
        return va >= r.address && va < r.address + pages * g ? first_page + (va - r.address) / g
                                                             : total_pages;
      };
      for (const SnapshotSegment& seg : s.segments) {
        if (seg.device != device || seg.address < r.address ||
            seg.address + seg.total_size > r.address + pages * g) {
          continue;
        }
        DevicePtr va = seg.address;
        for (const PieceRun& run : seg.pieces) {
          for (std::uint32_t i = 0; i < run.count; ++i, va += g) {
            const std::size_t k = page_of(va);
            if (k == total_pages) break;
            state[k] = 1;
            handle[k] = run.handle;
            piece[k] = static_cast<std::int32_t>(run.first + i);
            live_at[{run.handle, run.first + i}] = va;
          }
        }
        for (const SnapshotBlock& b : seg.blocks) {
          if (b.state != BlockState::kInactive) continue;
          for (DevicePtr lo = b.address; lo < b.address + b.size;) {
            const std::size_t k = page_of(lo);
            if (k == total_pages) break;
            const DevicePtr page_end = (lo - r.address) / g * g + r.address + g;
            const DevicePtr hi = std::min<DevicePtr>(page_end, b.address + b.size);
            free_share[k] = static_cast<std::uint8_t>(
                std::min<std::size_t>(255, free_share[k] + ((hi - lo) * 255 + g / 2) / g));
            lo = hi;
          }
        }
      }
    }
    first_page += with_pages ? pages : 0;
  }
  if (with_pages) {
    // The view's ranges are sorted by address and their pages laid out in that order.
    std::size_t base = 0;
    for (const replay::RangeView& rv : view->ranges) {
      const std::size_t pages = rv.frontier / g;
      for (const AddressRange& r : p.ranges) {
        if (r.address != rv.address) continue;
        for (const DeadPages& d : r.dead) {
          if (d.address < rv.address) continue;
          const std::size_t at = (d.address - rv.address) / g;
          for (std::size_t i = 0; i < d.pieces.count && at + i < pages; ++i) {
            const std::size_t k = base + at + i;
            const auto id =
                std::make_pair(d.pieces.handle, d.pieces.first + static_cast<std::uint32_t>(i));
            state[k] = 2;
            handle[k] = id.first;
            piece[k] = static_cast<std::int32_t>(id.second);
            const auto live = live_at.find(id);
            lent[k] = live != live_at.end() ? live->second : 0;
          }
        }
      }
      base += pages;
    }
    c.add("pg_state", "u8", state);
    c.add("pg_free", "u8", free_share);
    c.add64("pg_handle", "u64", handle);
    c.add64("pg_lent", "u64", lent);
    c.add("pg_piece", "i32", piece);
  }
  Json spare = Json::array();
  for (const PieceRun& r : p.spare)
    spare.push_back(Json::array({r.handle, r.first, r.count}));
  return {{"piece_size", g},
          {"handles", view->handles},
          {"held", view->held_bytes},
          {"segment_bytes", view->segment_bytes},
          {"spare_pieces", view->spare_pieces},
          {"spare_bytes", view->spare_bytes},
          {"dead_pages", view->dead_pages},
          {"spare", spare},
          {"ranges", ranges},
          {"pages_shown", with_pages},
          {"problems", view->problems}};
}

// Splices `parts` into the template at its {{NAME}} markers, each found once.
std::string fill_template(std::string_view tpl,
                          const std::vector<std::pair<std::string, const std::string*>>& parts) {
  std::string out;
  std::size_t size = tpl.size();
  for (const auto& p : parts)
    size += p.second->size();
  out.reserve(size);
  std::size_t at = 0;
  for (const auto& [name, text] : parts) {
    const std::string marker = "{{" + name + "}}";
    const std::size_t pos = tpl.find(marker, at);
    if (pos == std::string_view::npos) {
      throw Error("viz: viewer.html lacks the marker " + marker + " (or it is out of order)");
    }
    out.append(tpl.substr(at, pos - at));
    out.append(*text);
    at = pos + marker.size();
  }
  out.append(tpl.substr(at));
  return out;
}

}  // namespace

std::string render_page(const Snapshot& s, const PageOptions& options) {
  const int device = options.device >= 0 ? options.device : default_device(s);
  const std::string conf = options.conf.empty() ? recorded_config(s) : options.conf;
  const Model model = build_model(s, device);

  std::string method = "replay";
  const DeviceStats stats =
      options.stats ? *options.stats : replay::stats_from_snapshot(s, device, &method);

  Json meta;
  meta["format"] = 1;
  meta["title"] = options.title;
  meta["source"] = options.source;
  meta["device"] = device;
  meta["conf"] = conf;
  meta["capacity"] = options.capacity ? Json(*options.capacity) : Json(nullptr);
  meta["time0_us"] = model.time0;
  meta["counts"] = {{"events", model.kind.size()},
                    {"allocations", model.allocations.size()},
                    {"spans", model.spans.size()},
                    {"trace_entries", device < static_cast<int>(s.device_traces.size())
                                          ? s.device_traces[static_cast<std::size_t>(device)].size()
                                          : 0}};
  meta["streams"] = model.streams;
  meta["stacks"] = stack_table_json(model.stacks);
  meta["summary"] = {{"text", memory_summary(stats, device)}, {"method", method}};
  meta["stats"] = stats.to_map();
  meta["settings"] = settings_json(s.allocator_settings);
  Json annotations = Json::array();
  for (const Annotation& a : s.external_annotations) {
    if (a.device != device) continue;
    annotations.push_back(
        {{"name", a.name}, {"stage", a.stage}, {"time_us", a.time_us - model.time0}});
  }
  meta["annotations"] = annotations;
  meta["warnings"] = model.warnings;
  meta["ooms"] = oom_events_json(model, conf);
  if (options.what_if && !meta["ooms"].empty()) {
    meta["what_if"] = what_if_json(oom_what_if(s, model, conf, options.capacity));
  }

  Columns columns = encode(model);
  meta["physical"] = physical_json(s, device, columns);
  meta["columns"] = columns.table();
  const std::string meta_text = script_json(meta);
  const std::string data = base64(gzip(columns.bytes()));
  const std::string title = html_escape(options.title);
  const std::string css(viewer_css());
  const std::string js(viewer_js());
  return fill_template(
      viewer_html(),
      {{"TITLE", &title}, {"CSS", &css}, {"META", &meta_text}, {"DATA", &data}, {"JS", &js}});
}

}  // namespace ccalloc::viz
