// The memory viewer page: one self-contained HTML file (viewer.html, viewer.css and the
// scripts of js/ embedded at build time) holding one device's model as its payload.
//
// Payload (read by js/data.js `loadPayload`):
//   <script id="ccalloc-meta" type="application/json">  small JSON: titles, the column
//       table, streams, the stack table, memory_summary, statistics, settings, OOM facts
//       and what-if replays. Every '<' is written as \u003c so no text can end the script.
//   <script id="ccalloc-data" type="application/octet-stream">  base64 of a gzip stream of
//       little-endian columns, each 8-byte aligned; the column table gives each one's type
//       and byte offset: "u8", "u16", "i32" as typed arrays, and 64-bit integers ("u64",
//       "i64") as two u32 columns (low words, then high words), which compress far better
//       than doubles and become exact JS numbers below 2^53.
// Columns: ev_* per event (kind, addr, size, stream, time_us, stack, alloc, entry), al_* per
// allocation (start, free_requested, end, addr, size, block_size, slack, stack, stream,
// flags) and sp_* per segment span (start, end, addr, size, stack, stream, flags); see
// model.hpp for their meaning. For the stitching policy only (meta "physical", else null):
// pg_* per page below each address range's frontier, ranges in address order (state: 0
// unmapped, 1 live, 2 dead; handle, piece: the piece it maps, -1 none; free: the live page's
// share in free blocks, 0-255; lent: where a dead page's piece is live now, 0 none).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "ccalloc/snapshot.hpp"
#include "ccalloc/stats.hpp"

namespace ccalloc::viz {

struct PageOptions {
  std::string title;   // shown in the header and the tab: usually the input's file name
  std::string source;  // one line on where the history came from
  int device = -1;     // -1: default_device()
  // The config the history was recorded or replayed under; empty: from the snapshot.
  std::string conf;
  std::optional<std::size_t> capacity;  // device memory, when known (a replay's)
  std::optional<DeviceStats> stats;     // exact statistics, when known (a replay's)
  bool what_if = true;                  // replay the trace under other configs on OOM
};

// The whole page for one device of `s`.
std::string render_page(const Snapshot& s, const PageOptions& options);

// The viewer's sources as embedded at build time (generated from viz/viewer.*).
std::string_view viewer_html();
std::string_view viewer_css();
std::string_view viewer_js();

}  // namespace ccalloc::viz
