// The memory viewer's model and payload: pairing of trace entries into allocations, segment
// spans (expandable segments included), what was live before the trace began, the page's
// embedded payload, and the OOM what-if replays.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ccalloc/snapshot.hpp"
#include "io/gzip.hpp"
#include "io/snapshot_io.hpp"
#include "io/trace_csv.hpp"
#include "replay/replay.hpp"
#include "viz/model.hpp"
#include "viz/page.hpp"
#include "viz/what_if.hpp"

#ifndef CCALLOC_TRACES_DIR
#error "CCALLOC_TRACES_DIR must name data/traces (set by the build)"
#endif

namespace {

using ccalloc::BlockState;
using ccalloc::Snapshot;
using ccalloc::SnapshotTraceEntry;
using ccalloc::TraceAction;
using ccalloc::viz::Allocation;
using ccalloc::viz::EventKind;
using ccalloc::viz::Model;
using ccalloc::viz::SegmentSpan;

constexpr std::uint64_t kMiB = 1 << 20;
constexpr std::uint64_t kBase = 0x7f0000000000;

SnapshotTraceEntry entry(TraceAction a, std::uint64_t addr, std::uint64_t size,
                         std::int64_t time = 0) {
  SnapshotTraceEntry e;
  e.action = a;
  e.addr = addr;
  e.size = size;
  e.time_us = time;
  return e;
}

Snapshot with_trace(std::vector<SnapshotTraceEntry> trace) {
  Snapshot s;
  s.allocator_settings.conf = "";
  s.device_traces.push_back(std::move(trace));
  return s;
}

// Segments after event e as the page shows them: live spans, touching expandable spans of
// one stream merged (viz/js/state_view.js stateAt does the same).
std::size_t segments_after(const Model& m, std::int32_t e) {
  std::vector<const SegmentSpan*> live;
  for (const SegmentSpan& s : m.spans) {
    if (s.start <= e && e < s.end) live.push_back(&s);
  }
  std::sort(live.begin(), live.end(), [](auto* a, auto* b) { return a->addr < b->addr; });
  std::size_t count = 0;
  const SegmentSpan* last = nullptr;
  std::uint64_t last_end = 0;
  for (const SegmentSpan* s : live) {
    const bool exp = (s->flags & SegmentSpan::kExpandable) != 0;
    if (last != nullptr && exp && (last->flags & SegmentSpan::kExpandable) != 0 &&
        last->stream == s->stream && last_end == s->addr) {
      last_end += s->size;
      continue;
    }
    ++count;
    last = s;
    last_end = s->addr + s->size;
  }
  return count;
}

TEST(VizModel, CollapsesAdjacentFreeRequestedAndCompletedIntoOneFree) {
  const Snapshot s = with_trace({
      entry(TraceAction::kSegmentAlloc, kBase, 20 * kMiB),
      entry(TraceAction::kAlloc, kBase, 4 * kMiB),
      entry(TraceAction::kFreeRequested, kBase, 4 * kMiB),
      entry(TraceAction::kFreeCompleted, kBase, 4 * kMiB),
  });
  const Model m = ccalloc::viz::build_model(s, 0);
  ASSERT_EQ(m.kind.size(), 3u);
  EXPECT_EQ(m.kind[2], EventKind::kFree);
  EXPECT_EQ(m.entry[2], 2) << "the free keeps the index of its free_requested entry";
  ASSERT_EQ(m.allocations.size(), 1u);
  EXPECT_EQ(m.allocations[0].start, 1);
  EXPECT_EQ(m.allocations[0].free_requested, 2);
  EXPECT_EQ(m.allocations[0].end, 2);
  EXPECT_EQ(m.alloc[1], 0);
  EXPECT_EQ(m.alloc[2], 0);
}

TEST(VizModel, BlockFreedOnAnotherStreamIsPendingUntilFreeCompleted) {
  const Snapshot s = with_trace({
      entry(TraceAction::kSegmentAlloc, kBase, 20 * kMiB),
      entry(TraceAction::kAlloc, kBase, 4 * kMiB),
      entry(TraceAction::kFreeRequested, kBase, 4 * kMiB),
      entry(TraceAction::kAlloc, kBase + 4 * kMiB, 2 * kMiB),
      entry(TraceAction::kFreeCompleted, kBase, 4 * kMiB),
  });
  const Model m = ccalloc::viz::build_model(s, 0);
  ASSERT_EQ(m.kind.size(), 5u);
  EXPECT_EQ(m.kind[2], EventKind::kFreeRequested);
  EXPECT_EQ(m.kind[4], EventKind::kFreeCompleted);
  const Allocation& a = m.allocations[0];
  EXPECT_EQ(a.free_requested, 2);
  EXPECT_EQ(a.end, 4);
  EXPECT_EQ(m.allocations[1].end, m.never()) << "still live at the end";
}

TEST(VizModel, RoundsBlocksAndGivesLargeBlocksTheirUnsplitRemainder) {
  const Snapshot s = with_trace({
      entry(TraceAction::kSegmentAlloc, kBase, 2 * kMiB),
      entry(TraceAction::kAlloc, kBase, 1000),
      entry(TraceAction::kSegmentAlloc, kBase + 2 * kMiB, 20 * kMiB),
      entry(TraceAction::kAlloc, kBase + 2 * kMiB, 3 * kMiB + 1),
      entry(TraceAction::kFreeRequested, kBase, 1000),
      entry(TraceAction::kFreeCompleted, kBase, 1000),
  });
  const Model m = ccalloc::viz::build_model(s, 0);
  ASSERT_EQ(m.allocations.size(), 2u);
  EXPECT_EQ(m.allocations[0].block_size, 1024u);
  EXPECT_EQ(m.allocations[0].slack, 511u) << "small pool: remainders of 512 B are split off";
  EXPECT_EQ(m.allocations[1].block_size, 3 * kMiB + 512);
  EXPECT_EQ(m.allocations[1].slack, kMiB) << "large pool: a remainder up to 1 MiB stays";
  // The first block placed in each segment tells its pool.
  ASSERT_EQ(m.spans.size(), 2u);
  EXPECT_NE(m.spans[0].flags & SegmentSpan::kSmall, 0);
  EXPECT_EQ(m.spans[1].flags & SegmentSpan::kSmall, 0);
}

TEST(VizModel, BlocksLiveBeforeTheTraceBeganStartAtMinusOne) {
  Snapshot s = with_trace({
      entry(TraceAction::kFreeRequested, kBase + 512, 512),
      entry(TraceAction::kFreeCompleted, kBase + 512, 512),
      entry(TraceAction::kSegmentFree, kBase + 4 * kMiB, 2 * kMiB),
  });
  // The snapshot still holds a segment with a block the trace never mentions.
  ccalloc::SnapshotSegment seg;
  seg.address = kBase;
  seg.total_size = 2 * kMiB;
  seg.is_small = true;
  ccalloc::SnapshotBlock live{kBase, 1024, 1000, BlockState::kActiveAllocated, nullptr};
  ccalloc::SnapshotBlock free_block{kBase + 1024, 2 * kMiB - 1024, 0, BlockState::kInactive,
                                    nullptr};
  seg.blocks = {live, free_block};
  s.segments.push_back(seg);

  const Model m = ccalloc::viz::build_model(s, 0);
  ASSERT_EQ(m.allocations.size(), 2u);
  // Both before the trace: ordered by address at the bottom of the stack.
  EXPECT_EQ(m.allocations[0].addr, kBase);
  EXPECT_EQ(m.allocations[0].start, -1);
  EXPECT_EQ(m.allocations[0].end, m.never());
  EXPECT_EQ(m.allocations[0].block_size, 1024u) << "exact, from the snapshot";
  EXPECT_EQ(m.allocations[1].addr, kBase + 512);
  EXPECT_EQ(m.allocations[1].start, -1);
  EXPECT_EQ(m.allocations[1].end, 0) << "its free_requested and free_completed are one free";
  EXPECT_NE(m.allocations[1].flags & Allocation::kStackFromFree, 0);
  // The freed segment was held from before the trace; the snapshot's since before it too.
  ASSERT_EQ(m.spans.size(), 2u);
  EXPECT_EQ(m.spans[0].start, -1);
  EXPECT_EQ(m.spans[0].end, 1);
  EXPECT_EQ(m.spans[1].start, -1);
  EXPECT_EQ(m.spans[1].end, m.never());
  EXPECT_EQ(segments_after(m, -1), 2u);
  EXPECT_EQ(segments_after(m, 1), 1u);
}

TEST(VizModel, UnmappingTheMiddleOfAnExpandableSegmentLeavesTwoSegments) {
  Snapshot s = with_trace({
      entry(TraceAction::kSegmentMap, kBase, 20 * kMiB),
      entry(TraceAction::kSegmentMap, kBase + 20 * kMiB, 40 * kMiB),
      entry(TraceAction::kSegmentUnmap, kBase + 20 * kMiB, 20 * kMiB),
  });
  s.allocator_settings.expandable_segments = true;
  const Model m = ccalloc::viz::build_model(s, 0);
  EXPECT_EQ(segments_after(m, 0), 1u);
  EXPECT_EQ(segments_after(m, 1), 1u) << "touching mapped ranges are one segment";
  EXPECT_EQ(segments_after(m, 2), 2u);
  std::uint64_t mapped = 0;
  for (const SegmentSpan& sp : m.spans) {
    if (sp.start <= 2 && 2 < sp.end) mapped += sp.size;
  }
  EXPECT_EQ(mapped, 40 * kMiB);
}

TEST(VizModel, RealTraceEndsWithTheSnapshotsSegments) {
  for (const char* stem : {"gpt2_train_varlen", "gpt2_train_varlen.expandable"}) {
    SCOPED_TRACE(stem);
    const Snapshot s =
        ccalloc::io::read_snapshot(std::string(CCALLOC_TRACES_DIR) + "/" + stem + ".pickle.gz");
    const Model m = ccalloc::viz::build_model(s, 0);
    EXPECT_TRUE(m.warnings.empty()) << m.warnings.front();
    EXPECT_EQ(segments_after(m, m.never() - 1), s.segments.size());
    std::size_t allocs = 0;
    for (const auto& e : s.device_traces[0])
      allocs += e.action == TraceAction::kAlloc;
    EXPECT_EQ(m.allocations.size(), allocs);
    // Every allocation still live at the end has its exact block size from the snapshot.
    std::map<std::uint64_t, std::uint64_t> blocks;
    for (const auto& seg : s.segments) {
      for (const auto& b : seg.blocks) {
        if (b.state != BlockState::kInactive) blocks[b.address] = b.size;
      }
    }
    for (const Allocation& a : m.allocations) {
      if (a.end == m.never()) {
        EXPECT_EQ(a.block_size, blocks.at(a.addr));
      }
    }
  }
}

// A page's payload: its meta JSON and its columns (base64 + gzip decoded).
std::pair<nlohmann::json, std::string> decode_page(const std::string& html) {
  const auto body = [&](const std::string& id) {
    const std::string open = "id=\"" + id + "\"";
    const std::size_t at = html.find('>', html.find(open)) + 1;
    return html.substr(at, html.find("</script>", at) - at);
  };
  const std::string meta_text = body("ccalloc-meta");
  EXPECT_EQ(meta_text.find('<'), std::string::npos) << "no '<' may end the script early";
  const auto meta = nlohmann::json::parse(meta_text);

  // Base64 decode.
  const std::string b64 = body("ccalloc-data");
  std::string gz;
  std::uint32_t acc = 0;
  int bits = 0;
  for (const char c : b64) {
    int v;
    if (c >= 'A' && c <= 'Z')
      v = c - 'A';
    else if (c >= 'a' && c <= 'z')
      v = c - 'a' + 26;
    else if (c >= '0' && c <= '9')
      v = c - '0' + 52;
    else if (c == '+')
      v = 62;
    else if (c == '/')
      v = 63;
    else
      continue;
    acc = acc << 6 | static_cast<std::uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      gz += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return {meta, ccalloc::io::gunzip(gz, "payload")};
}

// The page's payload decodes back to the model: meta JSON, then base64 + gzip columns.
TEST(VizPage, EmbedsAPayloadThatDecodesToTheModel) {
  const Snapshot s = with_trace({
      entry(TraceAction::kSegmentAlloc, kBase, 20 * kMiB, 100),
      entry(TraceAction::kAlloc, kBase, 4 * kMiB, 150),
      entry(TraceAction::kFreeRequested, kBase, 4 * kMiB, 200),
      entry(TraceAction::kFreeCompleted, kBase, 4 * kMiB, 200),
  });
  ccalloc::viz::PageOptions options;
  options.title = "t</script><b>.pickle";
  const std::string html = ccalloc::viz::render_page(s, options);
  EXPECT_EQ(html.find("http://"), std::string::npos);
  EXPECT_EQ(html.find("https://"), std::string::npos);
  EXPECT_NE(html.find("t&lt;/script&gt;&lt;b&gt;.pickle"), std::string::npos);

  const auto [meta, raw] = decode_page(html);
  EXPECT_EQ(meta["title"], "t</script><b>.pickle");
  EXPECT_EQ(meta["counts"]["events"], 3);

  const auto col = [&](const std::string& name) { return meta["columns"][name]; };
  const auto kinds = col("ev_kind");
  ASSERT_EQ(kinds[0], "u8");
  const std::size_t offset = kinds[1];
  ASSERT_EQ(kinds[2], 3);
  EXPECT_EQ(raw[offset + 0], static_cast<char>(EventKind::kSegmentAlloc));
  EXPECT_EQ(raw[offset + 1], static_cast<char>(EventKind::kAlloc));
  EXPECT_EQ(raw[offset + 2], static_cast<char>(EventKind::kFree));
  // 64-bit columns: low words then high words.
  const auto addr = col("ev_addr");
  ASSERT_EQ(addr[0], "u64");
  std::uint32_t lo = 0, hi = 0;
  std::memcpy(&lo, raw.data() + static_cast<std::size_t>(addr[1]), 4);
  std::memcpy(&hi, raw.data() + static_cast<std::size_t>(addr[3]), 4);
  EXPECT_EQ((std::uint64_t{hi} << 32) | lo, kBase);
  // Times are relative to the first event.
  const auto time = col("ev_time");
  std::memcpy(&lo, raw.data() + static_cast<std::size_t>(time[1]) + 4, 4);
  EXPECT_EQ(lo, 50u);
  EXPECT_EQ(meta["time0_us"], 100);
}

// The OOM explainer's facts follow the pools of the config the trace ran under: PyTorch's
// policy keeps requests of up to 1 MiB small and grows by a segment (a 2 MiB small buffer,
// a 20 MiB large one); the stitching policy's small pool ends at 256 KiB and, at a limit,
// grows by exactly the pages a request lacks.
TEST(VizPage, OomFactsFollowTheRecordedPolicysPools) {
  const Snapshot s = with_trace({
      entry(TraceAction::kOom, 0, 512 * 1024, 100),
      entry(TraceAction::kOom, 0, 200 * 1024, 110),
      entry(TraceAction::kOom, 0, 3 * kMiB + 1, 120),
  });
  ccalloc::viz::PageOptions options;
  options.what_if = false;
  const auto facts = [&](const std::string& conf) {
    options.conf = conf;
    return decode_page(ccalloc::viz::render_page(s, options)).first["ooms"];
  };
  const auto pytorch = facts("pytorch");
  ASSERT_EQ(pytorch.size(), 3u);
  EXPECT_EQ(pytorch[0]["small"], true);
  EXPECT_EQ(pytorch[0]["segment_size"], 2 * kMiB);
  EXPECT_EQ(pytorch[1]["small"], true);
  EXPECT_EQ(pytorch[2]["small"], false);
  EXPECT_EQ(pytorch[2]["segment_size"], 20 * kMiB);
  EXPECT_EQ(pytorch[2]["rounded"], 3 * kMiB + 512);

  const auto stitching = facts("ccalloc");
  ASSERT_EQ(stitching.size(), 3u);
  EXPECT_EQ(stitching[0]["small"], false);
  EXPECT_EQ(stitching[0]["segment_size"], 2 * kMiB);
  EXPECT_EQ(stitching[1]["small"], true);
  EXPECT_EQ(stitching[1]["segment_size"], 2 * kMiB);
  EXPECT_EQ(stitching[2]["small"], false);
  EXPECT_EQ(stitching[2]["segment_size"], 4 * kMiB);

  // The preset without stitching is PyTorch's policy on expandable segments: 1 MiB again.
  EXPECT_EQ(facts("ccalloc,stitch_segments:False")[0]["small"], true);
}

// The stitching policy's pieces, per page of its ranges: a range of four 2 MiB pages whose
// first page is dead (its piece, handle 1's, lent to the third), the second unmapped and
// the last two live behind handles 1 and 2, with 1 MiB free in the last; handle 3 spare.
TEST(VizPage, CarriesTheStitchingPolicysPiecesPerPage) {
  constexpr std::size_t g = 2 * kMiB;
  Snapshot s;
  ccalloc::SnapshotSegment seg;
  seg.address = kBase + 2 * g;
  seg.total_size = 2 * g;
  seg.is_expandable = true;
  seg.blocks.push_back({seg.address, 3 * kMiB, 3 * kMiB, BlockState::kActiveAllocated, nullptr});
  seg.blocks.push_back({seg.address + 3 * kMiB, kMiB, 0, BlockState::kInactive, nullptr});
  seg.pieces = {{1, 0, 1}, {2, 0, 1}};
  s.segments.push_back(seg);
  ccalloc::PhysicalMemory& p = s.physical.emplace_back();
  p.piece_size = g;
  p.handles = {{1, 1, false}, {2, 1, false}, {3, 1, false}};
  p.spare = {{3, 0, 1}};
  ccalloc::AddressRange r;
  r.address = kBase;
  r.size = 64 * g;
  r.frontier = 4 * g;
  r.dead = {{kBase, {1, 0, 1}}};
  p.ranges.push_back(r);

  const auto [meta, raw] = decode_page(ccalloc::viz::render_page(s, {}));
  const auto& phys = meta["physical"];
  EXPECT_EQ(phys["held"], 3 * g);
  EXPECT_EQ(phys["segment_bytes"], 2 * g);
  EXPECT_EQ(phys["spare_bytes"], g);
  EXPECT_EQ(phys["spare"], nlohmann::json::parse("[[3, 0, 1]]"));
  EXPECT_EQ(phys["problems"], nlohmann::json::array());
  ASSERT_EQ(phys["ranges"].size(), 1u);
  const auto& range = phys["ranges"][0];
  EXPECT_EQ(range["live_pages"], 2);
  EXPECT_EQ(range["dead_pages"], 1);
  EXPECT_EQ(range["unmapped_pages"], 1);
  EXPECT_EQ(range["mapped"], 3 * g);
  EXPECT_EQ(range["free"], kMiB);
  EXPECT_EQ(range["fragmentation"], 0.0);
  EXPECT_EQ(range["first_page"], 0);
  EXPECT_EQ(range["pages"], 4);
  const auto column = [&, &meta = meta, &raw = raw](const std::string& name, std::size_t bytes) {
    const auto c = meta["columns"][name];
    std::vector<std::uint64_t> out;
    for (std::size_t i = 0; i < c[2]; ++i) {
      std::uint64_t v = 0;
      std::memcpy(&v, raw.data() + static_cast<std::size_t>(c[1]) + i * bytes, bytes);
      if (c[0] == "u64") {
        std::uint32_t hi = 0;
        std::memcpy(&hi, raw.data() + static_cast<std::size_t>(c[3]) + i * 4, 4);
        v |= std::uint64_t{hi} << 32;
      }
      out.push_back(v);
    }
    return out;
  };
  using V = std::vector<std::uint64_t>;
  EXPECT_EQ(column("pg_state", 1), (V{2, 0, 1, 1}));
  EXPECT_EQ(column("pg_handle", 4), (V{1, 0, 1, 2}));
  EXPECT_EQ(column("pg_piece", 4), (V{0, 0xffffffff, 0, 0}));  // -1: no piece
  EXPECT_EQ(column("pg_free", 1), (V{0, 0, 0, 128}));          // half of the last page
  EXPECT_EQ(column("pg_lent", 4), (V{kBase + 2 * g, 0, 0, 0}));

  // Other policies' snapshots have no pieces.
  const auto [plain, plain_raw] = decode_page(ccalloc::viz::render_page(Snapshot{}, {}));
  EXPECT_TRUE(plain["physical"].is_null());
  EXPECT_FALSE(plain["columns"].contains("pg_state"));
}

// gpt2 on a device too small for PyTorch's native policy (10.2 GiB: it fragments and OOMs
// even after releasing its cache), where expandable segments fit: the what-if replays say so.
TEST(VizWhatIf, ExpandableSegmentsAvoidGpt2sOomsOnTenGiB) {
  const auto trace =
      ccalloc::io::read_trace_csv(std::string(CCALLOC_TRACES_DIR) + "/gpt2_train_varlen.csv.gz");
  ccalloc::replay::Options options;
  options.conf = "pytorch";
  options.capacity = ccalloc::replay::parse_size("10.2GiB");
  options.address_oracle = true;
  ccalloc::replay::Result result;
  const Snapshot s = ccalloc::viz::replay_with_history(trace, options, &result);
  ASSERT_GT(result.ooms, 0);
  std::size_t oom_entries = 0;
  for (const auto& e : s.device_traces[0])
    oom_entries += e.action == TraceAction::kOom;
  EXPECT_EQ(oom_entries, static_cast<std::size_t>(result.ooms));
  EXPECT_GT(s.device_traces[0].size(), trace.size()) << "the OOM path adds entries";
  const Model m = ccalloc::viz::build_model(s, 0);
  EXPECT_TRUE(m.warnings.empty()) << m.warnings.front();
  const auto report = ccalloc::viz::oom_what_if(s, m, "pytorch", options.capacity);
  EXPECT_EQ(report.capacity, options.capacity);
  ASSERT_EQ(report.runs.size(), 4u);
  EXPECT_EQ(report.runs[0].label, "as recorded");
  EXPECT_TRUE(report.runs[0].error.empty()) << report.runs[0].error;
  EXPECT_EQ(report.runs[0].ooms, result.ooms) << "the replay reproduces the OOMs";
  EXPECT_EQ(report.runs[1].label, "expandable_segments:True");
  EXPECT_TRUE(report.runs[1].error.empty()) << report.runs[1].error;
  EXPECT_EQ(report.runs[1].ooms, 0);
  EXPECT_TRUE(report.runs[2].unlimited);
  EXPECT_EQ(report.runs[2].ooms, 0);
  EXPECT_GT(report.runs[2].peak_reserved_bytes, static_cast<std::int64_t>(options.capacity));

  // Read from a snapshot file, the capacity is not known: what the allocator held plus
  // what the device had free at the first OOM is the simulated device's capacity.
  const auto estimated = ccalloc::viz::oom_what_if(s, m, "pytorch", std::nullopt);
  EXPECT_EQ(estimated.capacity, options.capacity) << estimated.capacity_source;
}

}  // namespace
