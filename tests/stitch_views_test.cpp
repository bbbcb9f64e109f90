// What snapshots, `ccalloc summary` and the viewer report of the stitching policy's
// physical memory (src/stitch/engine.hpp, include/ccalloc/snapshot.hpp
// PhysicalMemory, src/replay/physical_view.hpp): which pieces back each segment, the dead
// pages and spare pieces, totals equal to the reserved bytes, per-range fragmentation, and
// the pickle and JSON files carrying all of it. Hand-made scenarios on the simulated GPU,
// whose handles are numbered from 1 in creation order, so every piece is known.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "stitch/engine.hpp"
#include "io/snapshot_io.hpp"
#include "replay/physical_view.hpp"
#include "replay/replay.hpp"
#include "test_support.hpp"

// Readable failures: gtest finds these through the types' namespace.
namespace ccalloc {
void PrintTo(const PieceRun& r, std::ostream* os) {
  *os << "{handle " << r.handle << ", piece " << r.first << ", count " << r.count << "}";
}
void PrintTo(const DeadPages& d, std::ostream* os) {
  *os << "{0x" << std::hex << d.address << std::dec << ", ";
  PrintTo(d.pieces, os);
  *os << "}";
}
void PrintTo(const PhysicalHandleInfo& h, std::ostream* os) {
  *os << "{handle " << h.handle << ", " << h.pieces << " pieces, "
      << (h.is_small ? "small" : "large") << "}";
}
}  // namespace ccalloc

namespace {

using ccalloc::AddressRange;
using ccalloc::BlockState;
using ccalloc::Config;
using ccalloc::DeadPages;
using ccalloc::DevicePtr;
using ccalloc::kAggregate;
using ccalloc::kLargePool;
using ccalloc::kSmallPool;
using ccalloc::PhysicalHandleInfo;
using ccalloc::PhysicalMemory;
using ccalloc::PieceRun;
using ccalloc::Snapshot;
using ccalloc::core::StitchEngine;
using ccalloc_test::message_of;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr std::size_t kPiece = 2 * kMiB;
constexpr DevicePtr kVa = 0x600000000000;  // the simulated GPU's first reservation
// Served by the small pool (rounded requests of at most 256 KiB).
constexpr std::size_t kSmallRequest = 128 * 1024;

// The views' layouts are drawn for handles of a set size (stitch_handle_mb), so that they do
// not move with the rule that sizes handles by the room left under the limit.
struct Fixture {
  Fixture(std::size_t capacity, std::size_t handle_mb)
      : gpu(options(capacity)),
        engine(gpu, Config::parse("ccalloc,stitch_segments:True,stitch_handle_mb:" +
                                  std::to_string(handle_mb))) {
    engine.set_check_invariants(true);
  }
  static ccalloc::sim::Options options(std::size_t capacity) {
    ccalloc::sim::Options o;
    o.capacity = capacity;
    return o;
  }
  std::size_t reserved(ccalloc::StatType t = kAggregate) const {
    return static_cast<std::size_t>(engine.stats().reserved_bytes[t].current);
  }
  ccalloc::sim::SimDriver gpu;
  StitchEngine engine;
};

// Handle h whole: pieces 0 to n-1. New memory is created in handles of up to 32 pieces and
// every handle is mapped, lent and unmapped whole, so each run of a segment's pieces and of
// a range's dead pages is one whole handle.
PieceRun whole(ccalloc::PhysicalHandle h, std::uint32_t n) {
  return PieceRun{h, 0, n};
}

// The snapshot's accounting against the engine's own: the segments' pieces, spare pieces
// and dead pages equal piece_counts(), segments + spare == reserved == handles' pieces, and
// every run of live and dead pages is a whole handle.
void expect_accounts_for_reserved(const Fixture& f, const Snapshot& s) {
  ASSERT_EQ(s.physical.size(), 1u);
  const PhysicalMemory& p = s.physical[0];
  const StitchEngine::PieceCounts counts = f.engine.piece_counts();
  std::map<ccalloc::PhysicalHandle, std::uint32_t> pieces_of;
  for (const PhysicalHandleInfo& h : p.handles)
    pieces_of[h.handle] = h.pieces;
  const auto expect_whole = [&](const PieceRun& r) {
    EXPECT_EQ(r.first, 0u) << "handle " << r.handle;
    EXPECT_EQ(r.count, pieces_of.at(r.handle)) << "handle " << r.handle;
  };
  std::size_t live = 0, segment_bytes = 0, dead = 0, spare = 0, held = 0;
  for (const auto& seg : s.segments) {
    segment_bytes += seg.total_size;
    for (const PieceRun& r : seg.pieces) {
      live += r.count;
      expect_whole(r);
    }
  }
  for (const PieceRun& r : p.spare)
    spare += r.count;
  for (const AddressRange& r : p.ranges) {
    for (const DeadPages& d : r.dead) {
      dead += d.pieces.count;
      expect_whole(d.pieces);
    }
  }
  for (const PhysicalHandleInfo& h : p.handles)
    held += h.pieces;
  EXPECT_EQ(live * kPiece, segment_bytes);
  EXPECT_EQ(spare, counts.spare);
  EXPECT_EQ(dead, counts.dead_pages);
  EXPECT_EQ(held, counts.total);
  EXPECT_EQ(live + spare, counts.total);
  EXPECT_EQ(segment_bytes + p.spare_bytes(), f.reserved());
  EXPECT_EQ(p.held_bytes(), f.reserved());
  const auto view = ccalloc::replay::physical_view(s, 0);
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(view->problems, std::vector<std::string>{});
  f.engine.check_invariants();
}

// Statistics recovered from the snapshot count the handles, per pool as the engine does.
void expect_stats_recovered(const Fixture& f, const Snapshot& s) {
  const ccalloc::DeviceStats st = ccalloc::replay::stats_from_snapshot(s, 0);
  const ccalloc::DeviceStats live = f.engine.stats();
  for (const ccalloc::StatType t : {kAggregate, kLargePool, kSmallPool}) {
    EXPECT_EQ(st.reserved_bytes[t].current, live.reserved_bytes[t].current) << t;
    EXPECT_EQ(st.segment[t].current, live.segment[t].current) << t;
    EXPECT_EQ(st.allocation[t].current, live.allocation[t].current) << t;
    EXPECT_EQ(st.allocated_bytes[t].current, live.allocated_bytes[t].current) << t;
    EXPECT_EQ(st.active_bytes[t].current, live.active_bytes[t].current) << t;
    EXPECT_EQ(st.requested_bytes[t].current, live.requested_bytes[t].current) << t;
  }
}

// An 18 MiB device: a 20 MiB chunk does not fit, so new memory is exactly what a request
// lacks, in one handle per growth.
//   a = 4 MiB: handle 1 (2 pieces), pages 0-1     b = 4 MiB: handle 2 (2 pieces), pages 2-3
//   c = 4 MiB: handle 3 (2 pieces), pages 4-5     a freed: pages 0-1 free, handle 1 whole
//   d = 4 MiB + 512 fits no free block and lacks 3 pages at the frontier (c ends it): handle
//     1, wholly inside a's free block, is lent (pages 6-7) and the one piece still lacking
//     is created (handle 4, page 8). a's pages 0-1 become dead; 14 MiB held, not 18.
struct Stitched : Fixture {
  Stitched() : Fixture(18 * kMiB, 4) {
    a = engine.malloc(4 * kMiB, 0);
    b = engine.malloc(4 * kMiB, 0);
    c = engine.malloc(4 * kMiB, 0);
    engine.free(a);
    d = engine.malloc(4 * kMiB + 512, 0);
  }
  DevicePtr a = 0, b = 0, c = 0, d = 0;
};

TEST(StitchViews, ASegmentNamesThePiecesBehindItsPages) {
  Stitched f;
  EXPECT_EQ(f.d, kVa + 12 * kMiB);
  const Snapshot s = f.engine.snapshot();
  ASSERT_EQ(s.segments.size(), 1u);
  const auto& seg = s.segments[0];
  EXPECT_EQ(seg.address, kVa + 4 * kMiB);
  EXPECT_EQ(seg.total_size, 14 * kMiB);
  // b's and c's own handles, then a's handle lent whole and the new one behind d's end.
  EXPECT_EQ(seg.pieces,
            (std::vector<PieceRun>{whole(2, 2), whole(3, 2), whole(1, 2), whole(4, 1)}));
  // segments() says the same.
  const auto infos = f.engine.segments();
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(infos[0].pieces, seg.pieces);

  ASSERT_EQ(s.physical.size(), 1u);
  const PhysicalMemory& p = s.physical[0];
  EXPECT_EQ(p.device, 0);
  EXPECT_EQ(p.piece_size, kPiece);
  EXPECT_EQ(p.handles, (std::vector<PhysicalHandleInfo>{
                           {1, 2, false}, {2, 2, false}, {3, 2, false}, {4, 1, false}}));
  EXPECT_TRUE(p.spare.empty());
  ASSERT_EQ(p.ranges.size(), 1u);
  const AddressRange& r = p.ranges[0];
  EXPECT_EQ(r.address, kVa);
  EXPECT_EQ(r.size, 2 * (18 * kMiB / kPiece + 1) * kPiece);  // twice the device, in pages
  EXPECT_EQ(r.frontier, 18 * kMiB);                          // nine pages
  EXPECT_EQ(r.stream, 0u);
  EXPECT_FALSE(r.is_small);
  // a's old pages still map its handle, now live behind d: one run, the whole handle.
  EXPECT_EQ(r.dead, (std::vector<DeadPages>{{kVa, whole(1, 2)}}));
  expect_accounts_for_reserved(f, s);
  EXPECT_EQ(f.reserved(), 14 * kMiB);
  // One mapping per handle: a's, b's, c's, a's handle again at d, the new one.
  EXPECT_EQ(f.gpu.counters().physical_creates, 4u);
  EXPECT_EQ(f.gpu.counters().maps, 5u);
}

TEST(StitchViews, WholeChunksLentAndTheirDeadPagesAddUpToTheReservedBytes) {
  // A 32 GiB device (handles of up to 64 MiB): large growth creates a chunk of ten pieces
  // (20 MiB) in one handle, mapped whole; what the request does not take extends the free
  // block.
  Fixture f(32 * kGiB, 64);
  const DevicePtr x = f.engine.malloc(20 * kMiB, 0);  // handle 1, pages 0-9
  f.engine.malloc(20 * kMiB, 0);                      // y: handle 2, pages 10-19
  const DevicePtr z = f.engine.malloc(4 * kMiB, 0);   // handle 3, pages 20-29: z + 16 MiB free
  EXPECT_EQ(z, kVa + 40 * kMiB);
  f.engine.free(x);  // 20 MiB free, handle 1 whole inside it
  // 24 MiB fits neither x's 20 MiB nor the free tail's 16 MiB; it lacks 4 pages beyond the
  // tail. Handle 1 is lent whole (ten pieces, not four; the rest stays free in the tail),
  // so nothing is created: the tail grows to 36 MiB, w takes 24 and 12 MiB stay free.
  const DevicePtr w = f.engine.malloc(24 * kMiB, 0);
  EXPECT_EQ(w, kVa + 44 * kMiB);
  EXPECT_EQ(f.gpu.counters().physical_creates, 3u);
  EXPECT_EQ(f.gpu.counters().maps, 4u);
  using M = ccalloc::sim::SimDriver::MappingInfo;
  EXPECT_EQ(f.gpu.mappings_in(kVa + 60 * kMiB, 20 * kMiB),
            (std::vector<M>{{kVa + 60 * kMiB, 20 * kMiB, 1, 0}}));

  Snapshot s = f.engine.snapshot();
  ASSERT_EQ(s.segments.size(), 1u);
  EXPECT_EQ(s.segments[0].address, kVa + 20 * kMiB);
  EXPECT_EQ(s.segments[0].total_size, 60 * kMiB);
  EXPECT_EQ(s.segments[0].pieces,
            (std::vector<PieceRun>{whole(2, 10), whole(3, 10), whole(1, 10)}));
  const PhysicalMemory& p = s.physical.at(0);
  EXPECT_EQ(p.handles,
            (std::vector<PhysicalHandleInfo>{{1, 10, false}, {2, 10, false}, {3, 10, false}}));
  EXPECT_TRUE(p.spare.empty());
  EXPECT_EQ(p.ranges.at(0).frontier, 80 * kMiB);
  EXPECT_EQ(p.ranges.at(0).dead, (std::vector<DeadPages>{{kVa, whole(1, 10)}}));
  EXPECT_EQ(f.engine.piece_counts().dead_pages, 10u);
  EXPECT_EQ(f.reserved(), 60 * kMiB);  // three handles; the dead pages are address space
  expect_accounts_for_reserved(f, s);
  const auto v = ccalloc::replay::physical_view(s, 0);
  ASSERT_EQ(v->ranges.size(), 1u);
  EXPECT_EQ(v->ranges[0].live_pages, 30u);
  EXPECT_EQ(v->ranges[0].dead_pages, 10u);
  EXPECT_EQ(v->ranges[0].free_bytes, 12 * kMiB);

  // A small request on another stream: its own range, and a handle of just the one piece
  // it lacks (the small pool creates no chunk), counted in the small pool.
  const DevicePtr small = f.engine.malloc(kSmallRequest, 7);
  s = f.engine.snapshot();
  ASSERT_EQ(s.segments.size(), 2u);
  const auto& sseg = s.segments[1];
  EXPECT_EQ(sseg.address, small);
  EXPECT_TRUE(sseg.is_small);
  EXPECT_EQ(sseg.stream, 7u);
  EXPECT_EQ(sseg.pieces, (std::vector<PieceRun>{whole(4, 1)}));
  EXPECT_EQ(s.physical.at(0).handles.back(), (PhysicalHandleInfo{4, 1, true}));
  ASSERT_EQ(s.physical.at(0).ranges.size(), 2u);
  EXPECT_EQ(s.physical[0].ranges[1].address, small);
  EXPECT_EQ(s.physical[0].ranges[1].frontier, kPiece);
  expect_accounts_for_reserved(f, s);
  EXPECT_EQ(f.reserved(kSmallPool), 2 * kMiB);
  EXPECT_EQ(f.reserved(), 62 * kMiB);
  expect_stats_recovered(f, s);
}

TEST(StitchViews, AHandleLentToTheLargePoolCountsThereFromThen) {
  // 18 MiB device (exact growth). s0 = 128 KiB: handle 1 (1 piece, small pool); freed, its
  // page holds handle 1 whole. a = 2 MiB: the one page it lacks is that page, so the large
  // pool takes handle 1 and creates nothing.
  Fixture f(18 * kMiB, 4);
  const DevicePtr s0 = f.engine.malloc(kSmallRequest, 0);
  f.engine.free(s0);
  const DevicePtr a = f.engine.malloc(2 * kMiB, 0);
  EXPECT_EQ(f.gpu.counters().physical_creates, 1u);
  const Snapshot s = f.engine.snapshot();
  ASSERT_EQ(s.segments.size(), 1u);  // the small range has no live page left
  EXPECT_EQ(s.segments[0].address, a);
  EXPECT_FALSE(s.segments[0].is_small);
  EXPECT_EQ(s.segments[0].pieces, (std::vector<PieceRun>{whole(1, 1)}));
  const PhysicalMemory& p = s.physical.at(0);
  // Handle 1 was created by the small pool but backs a large-pool page now: it counts in
  // the large pool, where PyTorch's tools find it (the large segment).
  EXPECT_EQ(p.handles, (std::vector<PhysicalHandleInfo>{{1, 1, false}}));
  ASSERT_EQ(p.ranges.size(), 2u);
  const auto& small_range = p.ranges[0].is_small ? p.ranges[0] : p.ranges[1];
  const auto& large_range = p.ranges[0].is_small ? p.ranges[1] : p.ranges[0];
  EXPECT_EQ(small_range.dead, (std::vector<DeadPages>{{s0, whole(1, 1)}}));
  EXPECT_EQ(small_range.frontier, 2 * kMiB);
  EXPECT_EQ(large_range.address, a);
  EXPECT_TRUE(large_range.dead.empty());
  EXPECT_EQ(large_range.frontier, 2 * kMiB);
  expect_accounts_for_reserved(f, s);
  EXPECT_EQ(f.reserved(kSmallPool), 0u);
  EXPECT_EQ(f.reserved(kLargePool), 2 * kMiB);
  expect_stats_recovered(f, s);
}

TEST(StitchViews, TheSmallPoolTakesALargeFreePageInPlaceAndMapsNothing) {
  // As above but the other way round: b's freed page holds a large-pool handle whole. A
  // small request neither creates a piece nor maps that handle into the small space: b's
  // page becomes an island of the small pool where it is.
  Fixture f(18 * kMiB, 4);
  f.engine.malloc(4 * kMiB, 0);
  const DevicePtr b = f.engine.malloc(2 * kMiB, 0);
  f.engine.malloc(4 * kMiB, 0);
  f.engine.free(b);
  const auto maps = f.gpu.counters().maps;
  EXPECT_EQ(f.engine.malloc(kSmallRequest, 0), b);
  EXPECT_EQ(f.gpu.counters().physical_creates, 3u);
  EXPECT_EQ(f.gpu.counters().maps, maps);
  EXPECT_EQ(f.reserved(kSmallPool), 0u);
  EXPECT_EQ(f.reserved(kLargePool), 10 * kMiB);
  const Snapshot s = f.engine.snapshot();
  for (const auto& range : s.physical.at(0).ranges)
    EXPECT_TRUE(range.dead.empty());
  ASSERT_EQ(s.segments.size(), 1u);  // the large range, the island's blocks inside it
  EXPECT_EQ(s.segments[0].total_size, 10 * kMiB);
  EXPECT_FALSE(s.segments[0].is_small);
  // 4 MiB, the island's 128 KiB block and its free rest, 4 MiB: the island's blocks say so.
  std::vector<bool> islands;
  for (const auto& block : s.segments[0].blocks)
    islands.push_back(block.island);
  EXPECT_EQ(islands, (std::vector<bool>{false, true, true, false}));
  expect_accounts_for_reserved(f, s);
  expect_stats_recovered(f, s);
  // The files carry the mark (the key "island", on those blocks only), and the statistics
  // recovered from them count the island's block in the small pool.
  const ccalloc::io::Value v = ccalloc::io::to_value(s);
  const auto& blocks = v.at("segments").as_list()[0].at("blocks").as_list();
  EXPECT_EQ(blocks[0].find("island"), nullptr);
  ASSERT_NE(blocks[1].find("island"), nullptr);
  EXPECT_TRUE(blocks[1].at("island").as_bool());
  ccalloc_test::TempDir dir;
  for (const char* name : {"s.pickle", "s.json.gz"}) {
    const std::string path = dir.file(name);
    ccalloc::io::write_snapshot(path, s);
    const Snapshot back = ccalloc::io::read_snapshot(path);
    ASSERT_EQ(back.segments.size(), 1u) << name;
    for (std::size_t i = 0; i < s.segments[0].blocks.size(); ++i)
      EXPECT_EQ(back.segments[0].blocks[i].island, islands[i]) << name << " block " << i;
    expect_stats_recovered(f, back);
  }
}

// The small pool takes back a piece of its own creation that the large pool borrowed, once
// that piece lies whole in the large range's free tail (elsewhere an island is taken in
// place first, the test above; the tail never becomes one), instead of creating one. The
// piece is still mapped, dead, at its old small page: it comes back there, with no driver
// call.
TEST(StitchViews, TheSmallPoolRevivesItsOwnPieceFromTheLargeFreeTail) {
  // 18 MiB device (exact growth). s0 = 128 KiB: handle 1 (small pool), freed. a = 2 MiB:
  // handle 1, lent. a freed: the large range's free tail holds handle 1 whole. s1 = 128
  // KiB: handle 1 is live at s0's page again, and dead at a.
  Fixture f(18 * kMiB, 4);
  const DevicePtr s0 = f.engine.malloc(kSmallRequest, 0);
  f.engine.free(s0);
  const DevicePtr a = f.engine.malloc(2 * kMiB, 0);
  f.engine.free(a);
  const auto before = f.gpu.counters();
  EXPECT_EQ(before.physical_creates, 1u);
  const DevicePtr s1 = f.engine.malloc(kSmallRequest, 0);
  EXPECT_EQ(s1, s0);
  const auto after = f.gpu.counters();
  EXPECT_EQ(after.physical_creates, 1u);
  EXPECT_EQ(after.maps, before.maps);  // revived: mapped there all along
  const Snapshot s = f.engine.snapshot();
  ASSERT_EQ(s.segments.size(), 1u);  // a's page is dead: no large segment
  EXPECT_TRUE(s.segments[0].is_small);
  EXPECT_EQ(s.segments[0].address, s0);
  EXPECT_EQ(s.segments[0].pieces, (std::vector<PieceRun>{whole(1, 1)}));
  for (const auto& range : s.physical.at(0).ranges) {
    EXPECT_EQ(range.frontier, 2 * kMiB);
    if (range.is_small) {
      EXPECT_TRUE(range.dead.empty());
    } else {
      EXPECT_EQ(range.dead, (std::vector<DeadPages>{{a, whole(1, 1)}}));
    }
  }
  EXPECT_EQ(f.reserved(kSmallPool), 2 * kMiB);
  EXPECT_EQ(f.reserved(kLargePool), 0u);
  expect_accounts_for_reserved(f, s);
  expect_stats_recovered(f, s);
  // Back and forth: freed again, the page serves the large pool's next 2 MiB request.
  f.engine.free(s1);
  const DevicePtr c = f.engine.malloc(2 * kMiB, 0);
  EXPECT_EQ(f.gpu.counters().physical_creates, 1u);
  EXPECT_EQ(f.gpu.counters().maps, after.maps + 1);
  EXPECT_EQ(c, a + 2 * kMiB);
  EXPECT_EQ(f.engine.allocation_size(c), 2 * kMiB);
  expect_accounts_for_reserved(f, f.engine.snapshot());
}

// The large pool takes the small pool's free pages only where they spare creating memory
// altogether: when a chunk (20 MiB) is created anyway, they stay in the small pool.
TEST(StitchViews, TheLargePoolTakesSmallPagesOnlyWhereTheySpareACreation) {
  Fixture f(std::size_t{1} << 34, 32);
  // One free small page (handle 1); a 4 MiB request lacks 2 pages: the page would cover one,
  // and the chunk is created anyway, so the page stays and the next small request reuses it.
  const DevicePtr s0 = f.engine.malloc(kSmallRequest, 0);
  f.engine.free(s0);
  const DevicePtr a = f.engine.malloc(4 * kMiB, 0);
  EXPECT_EQ(f.gpu.counters().physical_creates, 2u);
  EXPECT_EQ(f.engine.malloc(kSmallRequest, 0), s0);
  EXPECT_EQ(f.gpu.counters().physical_creates, 2u);
  Snapshot s = f.engine.snapshot();
  for (const auto& range : s.physical.at(0).ranges)
    EXPECT_TRUE(range.dead.empty());
  for (const auto& seg : s.segments) {
    if (!seg.is_small) {
      EXPECT_EQ(seg.address, a);
      EXPECT_EQ(seg.pieces, (std::vector<PieceRun>{whole(2, 10)}));
    }
  }
  expect_accounts_for_reserved(f, s);

  // Two free small pages (handles 1 and 2, under twelve 256 KiB blocks) on a fresh engine: a
  // 4 MiB request lacks exactly two pages, which they cover, so it takes them and creates
  // nothing.
  Fixture g(std::size_t{1} << 34, 32);
  std::vector<DevicePtr> t;
  for (int i = 0; i < 12; ++i)
    t.push_back(g.engine.malloc(2 * kSmallRequest, 0));
  EXPECT_EQ(g.gpu.counters().physical_creates, 2u);
  for (const DevicePtr p : t)
    g.engine.free(p);
  g.engine.malloc(4 * kMiB, 0);
  EXPECT_EQ(g.gpu.counters().physical_creates, 2u);
  // Both pages serve the large pool now, and count there.
  EXPECT_EQ(g.reserved(kSmallPool), 0u);
  EXPECT_EQ(g.reserved(kLargePool), 4 * kMiB);
  s = g.engine.snapshot();
  ASSERT_EQ(s.segments.size(), 1u);
  EXPECT_FALSE(s.segments[0].is_small);
  EXPECT_EQ(s.segments[0].pieces, (std::vector<PieceRun>{whole(1, 1), whole(2, 1)}));
  expect_accounts_for_reserved(g, s);
}

// The engine holds no spare piece between operations: a handle becomes spare only while the
// cache is released (unmapped where it was live), and the same release unmaps its dead
// mappings (void pages are never in use) and then releases every handle mapped nowhere.
// A snapshot may still list spare pieces (another version, a hand-edited file), so one is
// added here, consistently: a handle of three pieces, held and live nowhere.
TEST(StitchViews, SparePiecesCountInTheTotalsAndTheSummary) {
  Stitched f;
  Snapshot s = f.engine.snapshot();
  s.physical[0].handles.push_back(PhysicalHandleInfo{5, 3, false});
  s.physical[0].spare.push_back(whole(5, 3));
  const auto v = ccalloc::replay::physical_view(s, 0);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->problems, std::vector<std::string>{});
  EXPECT_EQ(v->handles, 5u);
  EXPECT_EQ(v->held_bytes, 20 * kMiB);
  EXPECT_EQ(v->segment_bytes, 14 * kMiB);
  EXPECT_EQ(v->spare_pieces, 3u);
  EXPECT_EQ(v->spare_bytes, 6 * kMiB);
  EXPECT_EQ(ccalloc::replay::physical_summary(*v),
            "physical memory (stitching policy): 5 handles of 2.0MiB pieces hold 20.0MiB = "
            "14.0MiB in segments + 6.0MiB spare\n"
            "range               type   stream      mapped      live pages  dead pages  "
            "unmapped    free        largest free  fragmentation\n"
            "0x600000000000      large  0           18.0MiB     7           2           0     "
            "      2.0MiB      2.0MiB          0.0 %\n"
            "spare pieces: 3 (6.0MiB)\n"
            "dead pages: 2\n");
  // Reserved bytes recovered from the snapshot count the spare handle too.
  const ccalloc::DeviceStats st = ccalloc::replay::stats_from_snapshot(s, 0);
  EXPECT_EQ(st.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(20 * kMiB));
  EXPECT_EQ(st.segment[kAggregate].current, 5);
}

TEST(StitchViews, TheViewReportsPagesFreeBytesAndFragmentationPerRange) {
  Stitched f;
  f.engine.free(f.b);  // 4 MiB free next to a's dead pages; d's tail 2 MiB - 512 free
  const auto v = ccalloc::replay::physical_view(f.engine.snapshot(), 0);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->problems, std::vector<std::string>{});
  EXPECT_EQ(v->handles, 4u);
  EXPECT_EQ(v->held_bytes, 14 * kMiB);
  EXPECT_EQ(v->segment_bytes, 14 * kMiB);
  EXPECT_EQ(v->spare_pieces, 0u);
  EXPECT_EQ(v->dead_pages, 2u);
  ASSERT_EQ(v->ranges.size(), 1u);
  const auto& r = v->ranges[0];
  EXPECT_EQ(r.segments, 1u);
  EXPECT_EQ(r.live_pages, 7u);
  EXPECT_EQ(r.dead_pages, 2u);
  EXPECT_EQ(r.unmapped_pages, 0u);
  EXPECT_EQ(r.mapped_bytes, 18 * kMiB);
  EXPECT_EQ(r.physical_bytes, 14 * kMiB);
  EXPECT_EQ(r.free_bytes, 6 * kMiB - 512);
  EXPECT_EQ(r.largest_free, 4 * kMiB);
  EXPECT_EQ(r.allocated_bytes, 8 * kMiB + 512);
  EXPECT_DOUBLE_EQ(r.fragmentation, 1.0 - 4.0 * kMiB / (6.0 * kMiB - 512));
  EXPECT_EQ(ccalloc::replay::physical_summary(*v),
            "physical memory (stitching policy): 4 handles of 2.0MiB pieces hold 14.0MiB = "
            "14.0MiB in segments + 0.0B spare\n"
            "range               type   stream      mapped      live pages  dead pages  "
            "unmapped    free        largest free  fragmentation\n"
            "0x600000000000      large  0           18.0MiB     7           2           0     "
            "      6.0MiB      4.0MiB         33.3 %\n"
            "spare pieces: 0 (0.0B)\n"
            "dead pages: 2\n");

  // empty_cache unmaps every mapping with no allocated byte: handle 1's dead one at a's
  // pages and handle 2's at b's (then released: mapped nowhere). c's handle 3, handle 1
  // behind d and handle 4 (d's end and its free tail) stay: b's pages become unmapped.
  f.engine.empty_cache();
  const Snapshot s = f.engine.snapshot();
  const auto after = ccalloc::replay::physical_view(s, 0);
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->problems, std::vector<std::string>{});
  ASSERT_EQ(after->ranges.size(), 1u);
  EXPECT_EQ(after->ranges[0].dead_pages, 0u);
  EXPECT_EQ(after->ranges[0].unmapped_pages, 4u);  // a's and b's
  EXPECT_EQ(after->ranges[0].live_pages, 5u);      // c's and d's
  ASSERT_EQ(s.segments.size(), 1u);
  EXPECT_EQ(s.segments[0].address, kVa + 8 * kMiB);
  EXPECT_EQ(s.segments[0].pieces, (std::vector<PieceRun>{whole(3, 2), whole(1, 2), whole(4, 1)}));
  EXPECT_EQ(s.physical[0].handles,
            (std::vector<PhysicalHandleInfo>{{1, 2, false}, {3, 2, false}, {4, 1, false}}));
  EXPECT_EQ(f.reserved(), 10 * kMiB);
  EXPECT_EQ(ccalloc::replay::physical_summary(*after),
            "physical memory (stitching policy): 3 handles of 2.0MiB pieces hold 10.0MiB = "
            "10.0MiB in segments + 0.0B spare\n"
            "range               type   stream      mapped      live pages  dead pages  "
            "unmapped    free        largest free  fragmentation\n"
            "0x600000000000      large  0           10.0MiB     5           0           4     "
            "      2.0MiB      2.0MiB          0.0 %\n"
            "spare pieces: 0 (0.0B)\n"
            "dead pages: 0\n");
  expect_accounts_for_reserved(f, s);
}

TEST(StitchViews, OtherPoliciesHaveNoPhysicalMemory) {
  ccalloc::sim::SimDriver gpu(Fixture::options(1 * kGiB));
  ccalloc::Allocator alloc(gpu, Config::parse("pytorch,expandable_segments:True"));
  alloc.malloc(4 * kMiB, 0);
  const Snapshot s = alloc.snapshot();
  EXPECT_TRUE(s.physical.empty());
  ASSERT_EQ(s.segments.size(), 1u);
  EXPECT_TRUE(s.segments[0].pieces.empty());
  EXPECT_TRUE(alloc.segments().at(0).pieces.empty());
  EXPECT_FALSE(ccalloc::replay::physical_view(s, 0).has_value());
  const ccalloc::io::Value v = ccalloc::io::to_value(s);
  EXPECT_EQ(v.find("physical_memory"), nullptr);
  EXPECT_EQ(v.at("segments").as_list()[0].find("pieces"), nullptr);
}

TEST(StitchViews, PickleAndJsonCarryThePiecesBothWays) {
  Fixture f(32 * kGiB, 64);  // handles of up to 64 MiB
  const DevicePtr x = f.engine.malloc(20 * kMiB, 0);  // handle 1 (10 pieces)
  f.engine.malloc(4 * kMiB, 0);                       // handle 2 (10): 16 MiB free tail
  f.engine.free(x);
  f.engine.malloc(24 * kMiB, 0);   // lends handle 1 whole: x's ten pages dead
  f.engine.malloc(100, 3);         // stream 3's small pool: handle 3 (1 piece)
  f.engine.malloc(100 * kMiB, 5);  // 50 pieces: handles 4 (32, the cap) and 5 (18)
  Snapshot s = f.engine.snapshot();
  expect_accounts_for_reserved(f, s);
  // The engine leaves no spare piece (see SparePiecesCountInTheTotalsAndTheSummary): one
  // spare handle is added by hand so that the files carry spare pieces too.
  s.physical.at(0).handles.push_back(PhysicalHandleInfo{6, 2, true});
  s.physical.at(0).spare.push_back(whole(6, 2));
  ASSERT_EQ(s.segments.size(), 3u);
  EXPECT_EQ(s.segments[2].pieces, (std::vector<PieceRun>{whole(4, 32), whole(5, 18)}));
  ASSERT_EQ(s.physical.at(0).ranges.at(0).dead, (std::vector<DeadPages>{{kVa, whole(1, 10)}}));

  const ccalloc::io::Value v = ccalloc::io::to_value(s);
  const auto& pieces = v.at("segments").as_list()[0].at("pieces").as_list();
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_TRUE(pieces[0] == ccalloc::io::Value::dict({{"handle", 2}, {"piece", 0}, {"count", 10}}));
  EXPECT_TRUE(pieces[1] == ccalloc::io::Value::dict({{"handle", 1}, {"piece", 0}, {"count", 10}}));
  const auto& phys = v.at("physical_memory").as_list()[0];
  EXPECT_EQ(phys.at("piece_size").as_int(), static_cast<std::int64_t>(kPiece));
  const auto& dead = phys.at("ranges").as_list()[0].at("dead").as_list()[0];
  EXPECT_EQ(dead.at("address").as_int(), static_cast<std::int64_t>(kVa));
  EXPECT_EQ(dead.at("count").as_int(), 10);
  EXPECT_TRUE(phys.at("spare").as_list()[0] ==
              ccalloc::io::Value::dict({{"handle", 6}, {"piece", 0}, {"count", 2}}));

  ccalloc_test::TempDir dir;
  for (const char* name : {"s.pickle", "s.json", "s.pickle.gz", "s.json.gz"}) {
    const std::string path = dir.file(name);
    ccalloc::io::write_snapshot(path, s);
    const Snapshot back = ccalloc::io::read_snapshot(path);
    EXPECT_EQ(back.physical, s.physical) << name;
    ASSERT_EQ(back.segments.size(), s.segments.size()) << name;
    for (std::size_t i = 0; i < s.segments.size(); ++i)
      EXPECT_EQ(back.segments[i].pieces, s.segments[i].pieces) << name << " segment " << i;
    const auto view = ccalloc::replay::physical_view(back, 0);
    EXPECT_EQ(view->problems, std::vector<std::string>{}) << name;
    EXPECT_EQ(view->spare_pieces, 2u) << name;
    EXPECT_EQ(view->held_bytes, f.reserved() + 2 * kPiece) << name;
  }
}

TEST(StitchViews, MalformedPhysicalMemoryIsAFormatErrorNamingTheKey) {
  using ccalloc::io::Value;
  const auto err = [](const Value& v) {
    return message_of<ccalloc::FormatError>([&] { ccalloc::io::snapshot_from_value(v, "f"); });
  };
  const auto with_physical = [](Value p) {
    return Value::dict({{"segments", Value::list()}, {"physical_memory", Value::list({p})}});
  };
  const Value run = Value::dict({{"handle", 1}, {"piece", 0}, {"count", 0}});
  EXPECT_EQ(err(with_physical(Value::dict({{"piece_size", 2}, {"spare", Value::list({run})}}))),
            "f: physical_memory[0]: spare[0]: 'count' is 0, expected at least 1");
  EXPECT_EQ(err(with_physical(Value::dict({{"handles", Value::list()}}))),
            "f: physical_memory[0]: missing key 'piece_size'");
  EXPECT_EQ(err(with_physical(Value::dict(
                {{"piece_size", 2},
                 {"handles", Value::list({Value::dict({{"handle", 1}, {"pieces", 1}})})}}))),
            "f: physical_memory[0]: handles[0]: 'segment_type' is '', expected 'small' or 'large'");
  EXPECT_EQ(
      err(with_physical(Value::dict(
          {{"piece_size", 2},
           {"ranges",
            Value::list({Value::dict(
                {{"address", 0}, {"size", 2}, {"frontier", 4}, {"segment_type", "large"}})})}}))),
      "f: physical_memory[0]: ranges[0]: 'frontier' 4 passes 'size' 2");
  EXPECT_EQ(
      err(with_physical(Value::dict(
          {{"piece_size", 2},
           {"spare", Value::list({Value::dict(
                         {{"handle", 1}, {"piece", std::int64_t{1} << 32}, {"count", 1}})})}}))),
      "f: physical_memory[0]: spare[0]: 'piece' is 4294967296, more than 4294967295");
  EXPECT_EQ(
      err(Value::list({Value::dict({{"address", 0},
                                    {"total_size", 2},
                                    {"pieces", Value::list({Value::dict({{"piece", 0}})})}})})),
      "f: segments[0]: pieces[0]: missing key 'handle'");
}

TEST(StitchViews, TheViewNamesPiecesThatDoNotAccountForTheMemory) {
  Stitched f;
  Snapshot s = f.engine.snapshot();
  // Handle 3's pieces, live behind c's pages, also listed as spare.
  s.physical[0].spare.push_back(whole(3, 2));
  auto v = ccalloc::replay::physical_view(s, 0);
  EXPECT_EQ(v->problems,
            (std::vector<std::string>{
                "piece 0 of handle 3 is both spare and behind the page at 0x600000800000",
                "the segments (14680064 bytes) and spare pieces (4194304) do not add up to the "
                "14680064 bytes of the handles"}));
  // Within a handle: piece 1 of handle 1 (live behind d's second page) spare as well, and
  // pieces 0 and 1 of handle 2 named behind a second page each. Each is checked against
  // the whole run that already holds it, and named with the page behind it.
  s = f.engine.snapshot();
  s.physical[0].spare.push_back(PieceRun{1, 1, 1});
  s.segments[0].pieces.push_back(PieceRun{2, 0, 1});  // behind page 0x600001200000
  s.segments[0].pieces.push_back(PieceRun{2, 1, 1});  // behind page 0x600001400000
  v = ccalloc::replay::physical_view(s, 0);
  EXPECT_EQ(
      v->problems,
      (std::vector<std::string>{
          "the segment at 0x600000400000 has 9 pieces for 14680064 bytes",
          "piece 1 of handle 1 is both behind the page at 0x600000e00000 and spare",
          "piece 0 of handle 2 is both behind the page at 0x600000400000 and behind the page at "
          "0x600001200000",
          "piece 1 of handle 2 is both behind the page at 0x600000600000 and behind the page at "
          "0x600001400000",
          "the segments (14680064 bytes) and spare pieces (2097152) do not add up to the "
          "14680064 bytes of the handles"}));
  // A piece of a handle not held, and one past its handle's pieces.
  s = f.engine.snapshot();
  s.segments[0].pieces.back() = PieceRun{9, 0, 1};
  v = ccalloc::replay::physical_view(s, 0);
  EXPECT_EQ(v->problems, std::vector<std::string>{"piece 0 of handle 9 belongs to no handle held"});
  s = f.engine.snapshot();
  s.segments[0].pieces.back() = PieceRun{4, 1, 1};
  v = ccalloc::replay::physical_view(s, 0);
  EXPECT_EQ(v->problems,
            std::vector<std::string>{"piece 1 of handle 4 is past the handle's 1 pieces"});
}

}  // namespace

// What PyTorch's tools rebuild from a snapshot's segments, per pool (segment_type), is what
// the statistics say, whatever the policy has done: islands, handles lent between the pools
// and revived, releases. A random mix of small and large requests on two streams, on a
// device small enough that growth lends and takes pages back, checked after every step.
TEST(StitchViews, PerPoolStatisticsAreWhatTheSegmentsAddUpTo) {
  Fixture f(64 * kMiB, 4);
  std::mt19937_64 rng(7);
  std::vector<std::pair<DevicePtr, ccalloc::StreamId>> live;
  const auto check = [&](int step) {
    std::array<std::int64_t, 3> reserved{}, allocated{}, active{}, requested{}, blocks{};
    for (const auto& seg : f.engine.segments()) {
      for (const ccalloc::StatType t : {kAggregate, seg.is_small ? kSmallPool : kLargePool}) {
        reserved[t] += static_cast<std::int64_t>(seg.total_size);
        allocated[t] += static_cast<std::int64_t>(seg.allocated_size);
        active[t] += static_cast<std::int64_t>(seg.active_size);
        requested[t] += static_cast<std::int64_t>(seg.requested_size);
        for (const auto& b : seg.blocks)
          blocks[t] += b.state == BlockState::kActiveAllocated ? 1 : 0;
      }
    }
    const ccalloc::DeviceStats st = f.engine.stats();
    for (const ccalloc::StatType t : {kAggregate, kSmallPool, kLargePool}) {
      ASSERT_EQ(st.reserved_bytes[t].current, reserved[t]) << "step " << step << " pool " << t;
      ASSERT_EQ(st.allocated_bytes[t].current, allocated[t]) << "step " << step << " pool " << t;
      ASSERT_EQ(st.active_bytes[t].current, active[t]) << "step " << step << " pool " << t;
      ASSERT_EQ(st.requested_bytes[t].current, requested[t]) << "step " << step << " pool " << t;
      ASSERT_EQ(st.allocation[t].current, blocks[t]) << "step " << step << " pool " << t;
    }
  };
  std::size_t islands_seen = 0;
  for (int step = 0; step < 3000; ++step) {
    const bool alloc = live.size() < 6 || (live.size() < 40 && rng() % 2 == 0);
    if (alloc) {
      const ccalloc::StreamId stream = rng() % 4 == 0 ? 1 : 0;
      const std::size_t size =
          rng() % 2 == 0 ? 512 + rng() % kMiB : kMiB + 512 + rng() % (6 * kMiB);
      try {
        live.emplace_back(f.engine.malloc(size, stream), stream);
      } catch (const ccalloc::OutOfMemoryError&) {
        // the device is small on purpose: the ladder ran, the state stays consistent
      }
    } else {
      const std::size_t i = rng() % live.size();
      f.engine.free(live[i].first);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if (step % 500 == 499) f.engine.empty_cache();
    check(step);
    if (::testing::Test::HasFatalFailure()) return;
    if (step % 10 == 0) {
      for (const auto& seg : f.engine.snapshot().segments) {
        for (const auto& b : seg.blocks)
          islands_seen += b.island ? 1 : 0;
      }
    }
  }
  // Every handle is mapped once where it is created; the maps beyond are lends.
  const std::size_t lends = f.gpu.counters().maps - f.gpu.counters().physical_creates;
  EXPECT_GT(islands_seen, 0u) << "the mix must exercise islands";
  EXPECT_GT(lends, 0u) << "and lends of handles created earlier";
  for (const auto& [p, stream] : live)
    f.engine.free(p);
  f.engine.empty_cache();
  check(-1);
}
