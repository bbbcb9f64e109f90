// What snapshots, `ccalloc summary` and the viewer report of the stitching policy's
// physical memory (src/core/stitch_engine.hpp, include/ccalloc/snapshot.hpp
// PhysicalMemory, src/replay/physical_view.hpp): which pieces back each segment, the dead
// pages and spare pieces, totals equal to the reserved bytes, per-range fragmentation, and
// the pickle and JSON files carrying all of it. Hand-made scenarios on the simulated GPU,
// whose handles are numbered from 1 in creation order, so every piece is known.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "core/stitch_engine.hpp"
#include "io/snapshot_io.hpp"
#include "replay/physical_view.hpp"
#include "replay/replay.hpp"
#include "test_support.hpp"

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

struct Fixture {
  explicit Fixture(std::size_t capacity)
      : gpu(options(capacity)), engine(gpu, Config::parse("ccalloc,stitch_segments:True")) {
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

// One piece of handle h (each handle is one piece here).
PieceRun one(ccalloc::PhysicalHandle h) {
  return PieceRun{h, 0, 1};
}
std::vector<PieceRun> ones(std::initializer_list<ccalloc::PhysicalHandle> handles) {
  std::vector<PieceRun> out;
  for (const auto h : handles)
    out.push_back(one(h));
  return out;
}

// The snapshot's accounting against the engine's own: the segments' pieces, spare pieces
// and dead pages equal piece_counts(), and segments + spare == reserved == handles' pieces.
void expect_accounts_for_reserved(const Fixture& f, const Snapshot& s) {
  ASSERT_EQ(s.physical.size(), 1u);
  const PhysicalMemory& p = s.physical[0];
  const StitchEngine::PieceCounts counts = f.engine.piece_counts();
  std::size_t live = 0, segment_bytes = 0, dead = 0, spare = 0, held = 0;
  for (const auto& seg : s.segments) {
    segment_bytes += seg.total_size;
    for (const PieceRun& r : seg.pieces)
      live += r.count;
  }
  for (const PieceRun& r : p.spare)
    spare += r.count;
  for (const AddressRange& r : p.ranges) {
    for (const DeadPages& d : r.dead)
      dead += d.pieces.count;
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

// a | b | c, 4 MiB each, on an 18 MiB device (new memory is exactly what a request lacks);
// a freed; d = 4 MiB + 512 fits no free block: a's two pages (handles 1 and 2) are lent to
// the frontier and one piece (handle 7) is created. b, c: handles 3-6.
struct Stitched : Fixture {
  Stitched() : Fixture(18 * kMiB) {
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
  const Snapshot s = f.engine.snapshot();
  ASSERT_EQ(s.segments.size(), 1u);
  const auto& seg = s.segments[0];
  EXPECT_EQ(seg.address, kVa + 4 * kMiB);
  EXPECT_EQ(seg.total_size, 14 * kMiB);
  // b's and c's own pieces, then a's two lent pieces and the new one behind d.
  EXPECT_EQ(seg.pieces, ones({3, 4, 5, 6, 1, 2, 7}));
  // segments() says the same.
  const auto infos = f.engine.segments();
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(infos[0].pieces, seg.pieces);

  ASSERT_EQ(s.physical.size(), 1u);
  const PhysicalMemory& p = s.physical[0];
  EXPECT_EQ(p.device, 0);
  EXPECT_EQ(p.piece_size, kPiece);
  std::vector<PhysicalHandleInfo> handles;
  for (ccalloc::PhysicalHandle h = 1; h <= 7; ++h)
    handles.push_back(PhysicalHandleInfo{h, 1, false});
  EXPECT_EQ(p.handles, handles);
  EXPECT_TRUE(p.spare.empty());
  ASSERT_EQ(p.ranges.size(), 1u);
  const AddressRange& r = p.ranges[0];
  EXPECT_EQ(r.address, kVa);
  EXPECT_EQ(r.size, 2 * (18 * kMiB / kPiece + 1) * kPiece);  // twice the device, in pages
  EXPECT_EQ(r.frontier, 18 * kMiB);                          // nine pages
  EXPECT_EQ(r.stream, 0u);
  EXPECT_FALSE(r.is_small);
  // a's old pages still map its pieces, now live behind d.
  EXPECT_EQ(r.dead, (std::vector<DeadPages>{{kVa, one(1)}, {kVa + kPiece, one(2)}}));
  expect_accounts_for_reserved(f, s);
  EXPECT_EQ(f.reserved(), 14 * kMiB);
}

TEST(StitchViews, SparePiecesAndLentPagesAddUpToTheReservedBytes) {
  // A 1 GiB device: large growth creates a chunk of ten pieces, the rest spare.
  Fixture f(1 * kGiB);
  const DevicePtr a = f.engine.malloc(4 * kMiB, 0);  // creates 1-10; a: 1, 2
  f.engine.malloc(4 * kMiB, 0);                      // b: spare 3, 4
  f.engine.malloc(4 * kMiB, 0);                      // c: spare 5, 6
  f.engine.malloc(8 * kMiB, 0);                      // e: spare 7-10
  f.engine.free(a);
  // No spare piece left: a's pages are lent and the last page is a new chunk's first piece
  // (handles 11-20, 12-20 spare).
  f.engine.malloc(4 * kMiB + 512, 0);
  Snapshot s = f.engine.snapshot();
  ASSERT_EQ(s.segments.size(), 1u);
  EXPECT_EQ(s.segments[0].address, kVa + 4 * kMiB);
  EXPECT_EQ(s.segments[0].total_size, 22 * kMiB);
  EXPECT_EQ(s.segments[0].pieces, ones({3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 11}));
  const PhysicalMemory& p = s.physical.at(0);
  EXPECT_EQ(p.spare, ones({12, 13, 14, 15, 16, 17, 18, 19, 20}));
  EXPECT_EQ(p.spare_bytes(), 18 * kMiB);
  EXPECT_EQ(p.handles.size(), 20u);
  EXPECT_EQ(p.ranges.at(0).frontier, 26 * kMiB);
  EXPECT_EQ(p.ranges.at(0).dead, (std::vector<DeadPages>{{kVa, one(1)}, {kVa + kPiece, one(2)}}));
  EXPECT_EQ(f.reserved(), 40 * kMiB);  // 22 MiB live + 18 MiB spare
  expect_accounts_for_reserved(f, s);

  // A small request on another stream maps a spare piece of the large pool's chunk: its
  // range is the small pool's, the memory stays counted where it was created.
  const DevicePtr small = f.engine.malloc(512 * 1024, 7);
  s = f.engine.snapshot();
  ASSERT_EQ(s.segments.size(), 2u);
  const auto& sseg = s.segments[0].address == small ? s.segments[0] : s.segments[1];
  EXPECT_EQ(sseg.address, small);
  EXPECT_TRUE(sseg.is_small);
  EXPECT_EQ(sseg.stream, 7u);
  EXPECT_EQ(sseg.pieces, ones({12}));
  ASSERT_EQ(s.physical.at(0).ranges.size(), 2u);
  EXPECT_EQ(s.physical[0].spare, ones({13, 14, 15, 16, 17, 18, 19, 20}));
  expect_accounts_for_reserved(f, s);
  EXPECT_EQ(f.reserved(kSmallPool), 0u);
  // Statistics recovered from the snapshot count the handles, per pool as the engine does.
  const ccalloc::DeviceStats st = ccalloc::replay::stats_from_snapshot(s, 0);
  for (const ccalloc::StatType t : {kAggregate, kLargePool, kSmallPool}) {
    EXPECT_EQ(st.reserved_bytes[t].current, f.engine.stats().reserved_bytes[t].current) << t;
    EXPECT_EQ(st.segment[t].current, f.engine.stats().segment[t].current) << t;
  }
  EXPECT_EQ(st.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(40 * kMiB));
}

TEST(StitchViews, TheViewReportsPagesFreeBytesAndFragmentationPerRange) {
  Stitched f;
  f.engine.free(f.b);  // 4 MiB free next to a's dead pages; d's tail 2 MiB - 512 free
  const auto v = ccalloc::replay::physical_view(f.engine.snapshot(), 0);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->problems, std::vector<std::string>{});
  EXPECT_EQ(v->handles, 7u);
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
            "physical memory (stitching policy): 7 handles of 2.0MiB pieces hold 14.0MiB = "
            "14.0MiB in segments + 0.0B spare\n"
            "range               type   stream      mapped      live pages  dead pages  "
            "unmapped    free        largest free  fragmentation\n"
            "0x600000000000      large  0           18.0MiB     7           2           0     "
            "      6.0MiB      4.0MiB         33.3 %\n"
            "spare pieces: 0 (0.0B)\n"
            "dead pages: 2\n");

  // empty_cache unmaps the dead and free pages: b's pages become unmapped, below c.
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
  EXPECT_EQ(s.segments[0].pieces, ones({5, 6, 1, 2, 7}));
  EXPECT_EQ(s.physical[0].handles.size(), 5u);  // b's pieces were released
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
  Fixture f(1 * kGiB);
  const DevicePtr a = f.engine.malloc(4 * kMiB, 0);
  f.engine.malloc(16 * kMiB, 0);
  f.engine.free(a);
  f.engine.malloc(6 * kMiB, 0);  // lends a's pages, then one of a new chunk
  f.engine.malloc(100, 3);
  const Snapshot s = f.engine.snapshot();
  ASSERT_FALSE(s.physical.at(0).spare.empty());
  ASSERT_FALSE(s.physical.at(0).ranges.at(0).dead.empty());

  const ccalloc::io::Value v = ccalloc::io::to_value(s);
  const auto& piece = v.at("segments").as_list()[0].at("pieces").as_list()[0];
  EXPECT_TRUE(piece == ccalloc::io::Value::dict({{"handle", 3}, {"piece", 0}, {"count", 1}}));
  const auto& phys = v.at("physical_memory").as_list()[0];
  EXPECT_EQ(phys.at("piece_size").as_int(), static_cast<std::int64_t>(kPiece));
  EXPECT_EQ(phys.at("ranges").as_list()[0].at("dead").as_list()[0].at("address").as_int(),
            static_cast<std::int64_t>(kVa));

  ccalloc_test::TempDir dir;
  for (const char* name : {"s.pickle", "s.json", "s.pickle.gz", "s.json.gz"}) {
    const std::string path = dir.file(name);
    ccalloc::io::write_snapshot(path, s);
    const Snapshot back = ccalloc::io::read_snapshot(path);
    EXPECT_EQ(back.physical, s.physical) << name;
    ASSERT_EQ(back.segments.size(), s.segments.size()) << name;
    for (std::size_t i = 0; i < s.segments.size(); ++i)
      EXPECT_EQ(back.segments[i].pieces, s.segments[i].pieces) << name << " segment " << i;
    EXPECT_EQ(ccalloc::replay::physical_view(back, 0)->problems, std::vector<std::string>{});
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
  // Handle 3's piece, live behind b's first page, also listed as spare.
  s.physical[0].spare.push_back(one(3));
  auto v = ccalloc::replay::physical_view(s, 0);
  EXPECT_EQ(v->problems,
            (std::vector<std::string>{
                "piece 0 of handle 3 is both spare and behind the page at 0x600000400000",
                "the segments (14680064 bytes) and spare pieces (2097152) do not add up to the "
                "14680064 bytes of the handles"}));
  s = f.engine.snapshot();
  s.segments[0].pieces.pop_back();
  s.segments[0].pieces.push_back(PieceRun{9, 0, 1});
  v = ccalloc::replay::physical_view(s, 0);
  EXPECT_EQ(v->problems, std::vector<std::string>{"piece 0 of handle 9 belongs to no handle held"});
}

}  // namespace
