// Caller contexts in allocation history (HistoryOptions::capture_context): which operations
// take one, where the allocator keeps it, and that every handle is released exactly once,
// whichever way the allocator lets go of it.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"
#include "ccalloc/snapshot_io.hpp"

namespace {

using ccalloc::Allocator;
using ccalloc::BlockState;
using ccalloc::Config;
using ccalloc::ContextHandle;
using ccalloc::DevicePtr;
using ccalloc::HistoryOptions;
using ccalloc::Snapshot;
using ccalloc::TraceAction;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Hands out handles numbered 1, 2, ... and counts how many are still held anywhere.
struct Contexts {
  std::atomic<int> taken{0};
  std::atomic<int> released{0};
  int live() const { return taken.load() - released.load(); }
  ContextHandle make() {
    const int id = ++taken;
    return ContextHandle(new int(id), [this](const void* p) {
      delete static_cast<const int*>(p);
      ++released;
    });
  }
  std::function<ContextHandle()> callback() {
    return [this] { return make(); };
  }
};

int id_of(const ContextHandle& h) {
  return h ? *static_cast<const int*>(h.get()) : 0;
}

HistoryOptions options(Contexts& c, const char* enabled, const char* context,
                       std::size_t max_entries = 1000) {
  HistoryOptions o;
  o.enabled = HistoryOptions::parse_enabled(enabled);
  o.context = HistoryOptions::parse_context(context);
  o.stacks = HistoryOptions::Stacks::kNone;
  o.max_entries = max_entries;
  o.capture_context = c.callback();
  return o;
}

struct Fixture {
  explicit Fixture(const char* config = "pytorch") : alloc(gpu, Config::parse(config)) {
    alloc.set_check_invariants(true);
  }
  ccalloc::sim::SimDriver gpu;
  Allocator alloc;
};

TEST(HistoryContext, NoHandleIsTakenWhileHistoryIsOffOrContextIsNone) {
  Contexts c;
  {
    Fixture f;
    f.alloc.record_history(options(c, "none", "all"));
    f.alloc.free(f.alloc.malloc(1000));
    f.alloc.empty_cache();
    f.alloc.record_history(options(c, "all", "none"));
    f.alloc.free(f.alloc.malloc(1000));
    f.alloc.empty_cache();
    const Snapshot s = f.alloc.snapshot();
    for (const auto& e : s.device_traces[0])
      EXPECT_FALSE(e.context);
  }
  EXPECT_EQ(c.taken, 0);
}

TEST(HistoryContext, StateKeepsTheMallocContextOnTheBlockAndItsSegment) {
  Contexts c;
  Fixture f;
  f.alloc.record_history(options(c, "state", "state"));
  const DevicePtr p = f.alloc.malloc(1000);
  EXPECT_EQ(c.taken, 1);
  auto segs = f.alloc.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(id_of(segs[0].context), 1);
  EXPECT_EQ(id_of(segs[0].blocks[0].context), 1);
  EXPECT_FALSE(segs[0].blocks[1].context) << "the free remainder has none";
  segs.clear();
  f.alloc.free(p);  // state: frees take no context
  EXPECT_EQ(c.taken, 1);
  EXPECT_EQ(c.live(), 1) << "the segment still holds it";
  f.alloc.empty_cache();
  EXPECT_EQ(c.live(), 0);
}

TEST(HistoryContext, AllPutsContextsOnEntriesBlocksAndSegments) {
  Contexts c;
  Fixture f;
  f.alloc.record_history(options(c, "all", "all"));
  const DevicePtr a = f.alloc.malloc(1000);        // 1: segment_alloc, alloc
  const DevicePtr b = f.alloc.malloc(3 * kMiB);    // 2: segment_alloc, alloc (large pool)
  f.alloc.free(a);                                  // 3: free_requested, free_completed
  f.alloc.empty_cache();                            // 4: segment_free of a's segment
  const Snapshot s = f.alloc.snapshot();
  const auto& t = s.device_traces[0];
  ASSERT_EQ(t.size(), 8u);
  const TraceAction actions[] = {TraceAction::kSegmentAlloc,  TraceAction::kAlloc,
                                 TraceAction::kSegmentAlloc,  TraceAction::kAlloc,
                                 TraceAction::kFreeRequested, TraceAction::kFreeCompleted,
                                 TraceAction::kSegmentFree,   TraceAction::kSnapshot};
  const int ids[] = {1, 1, 2, 2, 3, 3, 4, 0};
  for (std::size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t[i].action, actions[i]) << i;
    EXPECT_EQ(id_of(t[i].context), ids[i]) << i;
    EXPECT_FALSE(t[i].frames) << "stacks none: no C++ frames";
  }
  ASSERT_EQ(s.segments.size(), 1u);
  EXPECT_EQ(id_of(s.segments[0].context), 2);
  EXPECT_EQ(id_of(s.segments[0].blocks[0].context), 2);
  EXPECT_EQ(c.taken, 4);
  EXPECT_EQ(c.live(), 4) << "all still on history entries";
  f.alloc.free(b);
}

TEST(HistoryContext, AllocLevelFreesReuseTheAllocationsContext) {
  Contexts c;
  Fixture f;
  f.alloc.record_history(options(c, "all", "alloc"));
  f.alloc.free(f.alloc.malloc(1000));
  const Snapshot s = f.alloc.snapshot();
  const auto& t = s.device_traces[0];
  ASSERT_EQ(t.size(), 5u);  // segment_alloc, alloc, free_requested, free_completed, snapshot
  EXPECT_EQ(c.taken, 1);
  for (std::size_t i = 0; i < 4; ++i)
    EXPECT_EQ(id_of(t[i].context), 1) << i;
  EXPECT_FALSE(s.segments[0].blocks[0].context) << "a free block keeps no context";
}

TEST(HistoryContext, EntriesAgingOutOfTheRingReleaseTheirHandles) {
  Contexts c;
  Fixture f;
  f.alloc.record_history(options(c, "all", "all", 3));
  constexpr int kPairs = 50;
  for (int i = 0; i < kPairs; ++i)
    f.alloc.free(f.alloc.malloc(1000));
  EXPECT_EQ(c.taken, 2 * kPairs);
  // Kept: the segment's context (the first malloc's), and the ring's last three entries
  // (the last alloc and its two free entries).
  EXPECT_EQ(c.live(), 3);
  const Snapshot s = f.alloc.snapshot();  // its entry pushes out the last alloc
  const auto& t = s.device_traces[0];
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(id_of(t[0].context), 2 * kPairs);
  EXPECT_EQ(id_of(t[1].context), 2 * kPairs);
  EXPECT_FALSE(t[2].context);
  EXPECT_EQ(id_of(s.segments[0].context), 1);
  EXPECT_EQ(c.live(), 2);
}

TEST(HistoryContext, StoppingDropsEntriesBlocksKeepTheirsUntilFreed) {
  Contexts c;
  Fixture f;
  f.alloc.record_history(options(c, "all", "all"));
  const DevicePtr p = f.alloc.malloc(1000);  // 1
  const DevicePtr q = f.alloc.malloc(1000);  // 2 (same segment)
  f.alloc.free(f.alloc.malloc(1000));        // 3, 4
  EXPECT_EQ(c.live(), 4);
  HistoryOptions off = options(c, "none", "none");
  f.alloc.record_history(off);
  EXPECT_EQ(c.live(), 2) << "blocks p, q (and the segment, holding 1) keep theirs";
  f.alloc.free(f.alloc.malloc(1000));
  EXPECT_EQ(c.taken, 4) << "nothing taken while off";
  auto segs = f.alloc.segments();
  EXPECT_EQ(id_of(segs[0].context), 1);
  EXPECT_EQ(id_of(segs[0].blocks[0].context), 1);
  EXPECT_EQ(id_of(segs[0].blocks[1].context), 2);
  f.alloc.free(q);
  EXPECT_EQ(c.live(), 2) << "segments() result still holds 2";
  f.alloc.free(p);
  f.alloc.empty_cache();
  EXPECT_EQ(c.live(), 2);
  segs.clear();
  EXPECT_EQ(c.live(), 0);
}

TEST(HistoryContext, ClearDropsRecordedEntries) {
  Contexts c;
  Fixture f;
  f.alloc.record_history(options(c, "all", "all"));
  f.alloc.free(f.alloc.malloc(1000));  // 1, 2
  HistoryOptions again = options(c, "all", "all");
  again.clear = true;
  f.alloc.record_history(again);
  EXPECT_EQ(c.live(), 1) << "only the segment's";
  f.alloc.empty_cache();  // 3: taken for the segment_free entry, kept there
  EXPECT_EQ(c.live(), 1);
  EXPECT_EQ(c.taken, 3);
}

TEST(HistoryContext, DestroyingTheAllocatorReleasesEverything) {
  Contexts c;
  {
    Fixture f;
    f.alloc.record_history(options(c, "all", "all"));
    for (int i = 0; i < 10; ++i)
      f.alloc.malloc(1000 + 1000 * kMiB / 100 * static_cast<std::size_t>(i));
    f.alloc.free(f.alloc.malloc(5 * kMiB));
    EXPECT_EQ(c.taken, 12);
    EXPECT_EQ(c.live(), 12);
  }
  EXPECT_EQ(c.taken, 12);
  EXPECT_EQ(c.released, 12);
}

TEST(HistoryContext, SnapshotsHoldTheirHandlesAfterTheAllocatorLetsGo) {
  Contexts c;
  Snapshot s;
  {
    Fixture f;
    f.alloc.record_history(options(c, "all", "all"));
    const DevicePtr p = f.alloc.malloc(1000);
    s = f.alloc.snapshot();
    f.alloc.free(p);
    f.alloc.record_history(options(c, "none", "none"));
    f.alloc.empty_cache();
    EXPECT_EQ(c.live(), 1) << "only the snapshot holds handle 1";
  }
  EXPECT_EQ(c.taken, 2);
  EXPECT_EQ(id_of(s.segments[0].blocks[0].context), 1);
  s = Snapshot{};
  EXPECT_EQ(c.live(), 0);
}

TEST(HistoryContext, NullHandlesRecordNoContext) {
  Fixture f;
  HistoryOptions o;
  o.stacks = HistoryOptions::Stacks::kNone;
  int calls = 0;
  o.capture_context = [&calls] {
    ++calls;
    return ContextHandle();
  };
  f.alloc.record_history(o);
  const DevicePtr p = f.alloc.malloc(1000);
  const Snapshot s = f.alloc.snapshot();
  EXPECT_EQ(calls, 1);
  for (const auto& e : s.device_traces[0])
    EXPECT_FALSE(e.context);
  EXPECT_FALSE(s.segments[0].blocks[0].context);
  f.alloc.free(p);
}

TEST(HistoryContext, ANewCallbackReplacesTheOld) {
  Contexts first, second;
  Fixture f;
  f.alloc.record_history(options(first, "all", "all"));
  const DevicePtr p = f.alloc.malloc(1000);
  f.alloc.record_history(options(second, "all", "all"));
  f.alloc.free(p);
  EXPECT_EQ(first.taken, 1);
  EXPECT_EQ(second.taken, 1);
}

TEST(HistoryContext, TraceObserversSeeTheEntrysContext) {
  Contexts c;
  Fixture f;
  std::vector<int> seen;
  f.alloc.add_trace_observer([&seen](const ccalloc::TraceEntry& e) {
    seen.push_back(e.context != nullptr ? id_of(*e.context) : 0);
  });
  f.alloc.record_history(options(c, "all", "alloc"));
  f.alloc.free(f.alloc.malloc(1000));
  EXPECT_EQ(seen, (std::vector<int>{1, 1, 1, 1}));
  f.alloc.record_history(options(c, "all", "state"));
  f.alloc.free(f.alloc.malloc(1000));
  EXPECT_EQ(seen, (std::vector<int>{1, 1, 1, 1, 0, 0, 0})) << "state: entries carry none";
}

TEST(HistoryContext, ExpandableSegmentsReleaseEveryHandle) {
  Contexts c;
  {
    Fixture f("pytorch,expandable_segments:True");
    f.alloc.record_history(options(c, "all", "all", 4));
    std::vector<DevicePtr> ptrs;
    for (int i = 0; i < 8; ++i)
      ptrs.push_back(f.alloc.malloc((static_cast<std::size_t>(i) + 1) * 3 * kMiB));
    for (DevicePtr p : ptrs)
      f.alloc.free(p);
    f.alloc.empty_cache();
    EXPECT_TRUE(f.alloc.snapshot().segments.empty());
    f.alloc.record_history(options(c, "none", "none"));
    EXPECT_EQ(c.live(), 0) << "unmapped segments keep nothing";
  }
  EXPECT_EQ(c.released, c.taken);
}

TEST(HistoryContext, OtherBackendsKeepContextsOnEntriesAndRelease) {
  for (const char* config : {"backend:cudaMallocAsync", "pytorch,stitch_segments:True"}) {
    SCOPED_TRACE(config);
    Contexts c;
    {
      Fixture f(config);
      f.alloc.record_history(options(c, "all", "all", 100));
      const DevicePtr p = f.alloc.malloc(1000);  // 1
      const DevicePtr q = f.alloc.malloc(1000);  // 2
      f.alloc.free(p);                           // 3
      const Snapshot s = f.alloc.snapshot();
      std::vector<int> alloc_ids, free_ids;
      for (const auto& e : s.device_traces[0]) {
        if (e.action == TraceAction::kAlloc) alloc_ids.push_back(id_of(e.context));
        if (e.action == TraceAction::kFreeRequested) free_ids.push_back(id_of(e.context));
      }
      EXPECT_EQ(alloc_ids, (std::vector<int>{1, 2}));
      EXPECT_EQ(free_ids, (std::vector<int>{3}));
      for (const auto& seg : s.segments) {
        for (const auto& b : seg.blocks) {
          if (b.address == q) {
            EXPECT_EQ(id_of(b.context), 2);
          }
          if (b.state == BlockState::kInactive) {
            EXPECT_FALSE(b.context);
          }
        }
      }
      f.alloc.free(q);
    }
    EXPECT_EQ(c.taken, 4);
    EXPECT_EQ(c.released, 4);
  }
}

std::vector<ccalloc::Frame> frames_of(const ContextHandle& h) {
  return {ccalloc::Frame{"script.py", id_of(h), "python_function_" + std::to_string(id_of(h))},
          ccalloc::Frame{"script.py", 1, "<module>"}};
}

TEST(HistoryContext, RenderedContextsFollowTheCppStack) {
  Contexts c;
  Fixture f;
  HistoryOptions o = options(c, "all", "all");
  o.stacks = HistoryOptions::Stacks::kCpp;
  f.alloc.record_history(o);
  const DevicePtr p = f.alloc.malloc(1000);
  Snapshot s = f.alloc.snapshot();
  ASSERT_TRUE(s.segments[0].blocks[0].frames);
  const std::size_t cpp = s.segments[0].blocks[0].frames->size();
  ccalloc::render_contexts(s, frames_of);
  const auto& block = *s.segments[0].blocks[0].frames;
  ASSERT_EQ(block.size(), cpp + 2);
  EXPECT_EQ(block[cpp].name, "python_function_1");
  EXPECT_EQ(block[cpp + 1].name, "<module>");
  const auto& t = s.device_traces[0];
  EXPECT_EQ(t[0].frames, t[1].frames) << "same stack and handle: one list";
  EXPECT_EQ(t[1].frames, s.segments[0].blocks[0].frames);
  EXPECT_FALSE(t[2].frames) << "the snapshot entry has neither";
  f.alloc.free(p);
}

TEST(HistoryContext, SnapshotFilesCarryTheRenderedFrames) {
  Contexts c;
  Fixture f;
  f.alloc.record_history(options(c, "all", "all"));
  const DevicePtr p = f.alloc.malloc(1000);
  const Snapshot s = f.alloc.snapshot();
  const auto dir = std::filesystem::temp_directory_path();
  for (const char* name : {"ccalloc_context_test.pickle", "ccalloc_context_test.json"}) {
    const std::string path = (dir / name).string();
    ccalloc::io::write_snapshot(path, s, frames_of);
    const Snapshot back = ccalloc::io::read_snapshot(path);
    std::filesystem::remove(path);
    ASSERT_TRUE(back.segments[0].blocks[0].frames) << name;
    const auto& frames = *back.segments[0].blocks[0].frames;
    ASSERT_EQ(frames.size(), 2u) << name;
    EXPECT_EQ(frames[0], (ccalloc::Frame{"script.py", 1, "python_function_1"})) << name;
    ASSERT_TRUE(back.device_traces[0][1].frames) << name;
    EXPECT_EQ((*back.device_traces[0][1].frames)[0].name, "python_function_1") << name;
    // Without a formatter, the caller's contexts are not written.
    ccalloc::io::write_snapshot(path, s);
    EXPECT_FALSE(ccalloc::io::read_snapshot(path).segments[0].blocks[0].frames) << name;
    std::filesystem::remove(path);
  }
  f.alloc.free(p);
}

}  // namespace

// Under the stitching policy empty_cache() unmaps pages rather than freeing segments; with
// contexts of every action ("all") those unmaps carry the empty_cache() caller's context, and
// with "alloc" that of the malloc that mapped the pages, as PyTorch's segment frees and unmaps
// do (the caller's, else the segment's).
TEST(HistoryContext, StitchingPolicyUnmapsCarryTheEmptyCacheContextUnderAll) {
  for (const char* level : {"all", "alloc"}) {
    Contexts c;
    Fixture f("ccalloc");
    f.alloc.record_history(options(c, "all", level));
    f.alloc.free(f.alloc.malloc(1000));  // 1 (and 2 under "all": the free)
    const int before = c.taken.load();
    f.alloc.empty_cache();  // "all": a new handle
    const Snapshot s = f.alloc.snapshot();
    std::vector<int> unmap_ids;
    for (const auto& e : s.device_traces[0]) {
      if (e.action == TraceAction::kSegmentUnmap) unmap_ids.push_back(id_of(e.context));
    }
    ASSERT_FALSE(unmap_ids.empty()) << level;
    const bool all = std::string(level) == "all";
    for (const int id : unmap_ids) {
      if (all) {
        EXPECT_EQ(id, before + 1) << "the context taken by empty_cache()";
      } else {
        EXPECT_EQ(id, 1) << "the context taken by the malloc that mapped the page";
      }
    }
    // One context per call, though two engines (the policy's and the private pools') release.
    EXPECT_EQ(c.taken.load(), before + (all ? 1 : 0)) << level;
  }
}
