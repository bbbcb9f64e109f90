// Allocation history: the trace ring, context levels, C++ stacks and snapshots.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"
#include "history/stacks.hpp"

namespace history_test {

// noipa: no inlining and no specialised clones (GCC's constprop clones are local symbols,
// invisible to dladdr); the names must stay in the stacks.
#if defined(__clang__)
#define CCALLOC_TEST_KEEP_FRAME [[clang::noinline]]
#else
#define CCALLOC_TEST_KEEP_FRAME [[gnu::noipa]]
#endif

// Two distinct, non-inlined call sites, so their stacks can be told apart by name. External
// linkage: exported from the test program, dladdr names them even without libdw.
CCALLOC_TEST_KEEP_FRAME ccalloc::DevicePtr AllocateFromKnownFunction(ccalloc::Allocator& a, std::size_t size) {
  const ccalloc::DevicePtr p = a.malloc(size);
  asm volatile("" ::: "memory");  // keep the call from becoming a tail call
  return p;
}
CCALLOC_TEST_KEEP_FRAME void FreeFromKnownFunction(ccalloc::Allocator& a, ccalloc::DevicePtr p) {
  a.free(p);
  asm volatile("" ::: "memory");
}
CCALLOC_TEST_KEEP_FRAME void EmptyCacheFromKnownFunction(ccalloc::Allocator& a) {
  a.empty_cache();
  asm volatile("" ::: "memory");
}

}  // namespace history_test

namespace {

using ccalloc::Allocator;
using ccalloc::BlockState;
using ccalloc::Config;
using ccalloc::DevicePtr;
using ccalloc::HistoryOptions;
using ccalloc::Snapshot;
using ccalloc::TraceAction;
using history_test::AllocateFromKnownFunction;
using history_test::EmptyCacheFromKnownFunction;
using history_test::FreeFromKnownFunction;

constexpr std::size_t kMiB = std::size_t{1} << 20;

HistoryOptions options(const char* enabled, const char* context, const char* stacks,
                       std::size_t max_entries = 1000) {
  HistoryOptions o;
  o.enabled = HistoryOptions::parse_enabled(enabled);
  o.context = HistoryOptions::parse_context(context);
  o.stacks = HistoryOptions::parse_stacks(stacks);
  o.max_entries = max_entries;
  return o;
}

struct Fixture {
  ccalloc::sim::SimDriver gpu;
  Allocator alloc{gpu, Config::parse("pytorch")};
  Fixture() { alloc.set_check_invariants(true); }
};

bool has_frame(const ccalloc::Frames& frames, const std::string& function) {
  if (!frames) return false;
  return std::any_of(frames->begin(), frames->end(), [&](const ccalloc::Frame& f) {
    return f.name.find(function) != std::string::npos;
  });
}

TEST(History, RecordsEveryActionWithPyTorchSemantics) {
  Fixture f;
  f.alloc.record_history(options("all", "none", "none"));
  f.gpu.set_time_us(1000);
  const DevicePtr p = f.alloc.malloc(1000);
  f.gpu.set_time_us(2000);
  f.alloc.free(p);
  f.alloc.empty_cache();
  const Snapshot s = f.alloc.snapshot();
  ASSERT_EQ(s.device_traces.size(), 1u);
  const auto& t = s.device_traces[0];
  ASSERT_EQ(t.size(), 6u);
  const TraceAction want[] = {TraceAction::kSegmentAlloc,  TraceAction::kAlloc,
                              TraceAction::kFreeRequested, TraceAction::kFreeCompleted,
                              TraceAction::kSegmentFree,   TraceAction::kSnapshot};
  for (std::size_t i = 0; i < 6; ++i)
    EXPECT_EQ(t[i].action, want[i]) << i;
  EXPECT_EQ(t[0].size, 2 * kMiB);
  EXPECT_EQ(t[1].addr, p);
  EXPECT_EQ(t[1].size, 1000u);  // the requested size, not the rounded one
  EXPECT_EQ(t[1].time_us, 1000);
  EXPECT_EQ(t[2].time_us, 2000);
  EXPECT_EQ(t[2].size, 1000u);
  EXPECT_EQ(t[5].addr, 0u);
  EXPECT_EQ(t[5].size, 0u);  // nothing active at the snapshot
  for (const auto& e : t)
    EXPECT_FALSE(e.frames) << "context none records no frames";
}

TEST(History, RingKeepsTheNewestEntriesInOrderAndReportsOverflow) {
  Fixture f;
  f.alloc.record_history(options("all", "none", "none", /*max_entries=*/5));
  for (int i = 0; i < 4; ++i)
    f.alloc.free(f.alloc.malloc(512 * (i + 1)));
  const Snapshot s = f.alloc.snapshot();
  const auto& t = s.device_traces[0];
  // With the snapshot's own entry, 14 were recorded: the last five are the third pair's
  // free_completed, the fourth pair, and the snapshot.
  ASSERT_EQ(t.size(), 5u);
  EXPECT_EQ(t[0].action, TraceAction::kFreeCompleted);
  EXPECT_EQ(t[0].size, 1536u);
  EXPECT_EQ(t[1].action, TraceAction::kAlloc);
  EXPECT_EQ(t[1].size, 2048u);
  EXPECT_EQ(t[2].action, TraceAction::kFreeRequested);
  EXPECT_EQ(t[3].action, TraceAction::kFreeCompleted);
  EXPECT_EQ(t[4].action, TraceAction::kSnapshot);  // the snapshot's own entry is the newest
  EXPECT_TRUE(s.allocator_settings.trace_alloc_overflowed);
  EXPECT_EQ(s.allocator_settings.trace_alloc_max_entries, 5);
}

TEST(History, StoppingClearsTheHistory) {
  Fixture f;
  f.alloc.record_history(options("all", "none", "none"));
  f.alloc.free(f.alloc.malloc(512));
  f.alloc.record_history(options("none", "none", "none"));
  f.alloc.free(f.alloc.malloc(512));
  EXPECT_TRUE(f.alloc.snapshot().device_traces[0].empty());
}

TEST(History, SymbolizationNamesTheAllocatingFunction) {
  Fixture f;
  f.alloc.record_history(options("all", "state", "cpp"));
  const DevicePtr p = AllocateFromKnownFunction(f.alloc, 4096);
  const Snapshot s = f.alloc.snapshot();
  ASSERT_EQ(s.segments.size(), 1u);
  const auto& block = s.segments[0].blocks[0];
  ASSERT_EQ(block.address, p);
  EXPECT_TRUE(has_frame(block.frames, "AllocateFromKnownFunction"));
  EXPECT_TRUE(has_frame(s.segments[0].frames, "AllocateFromKnownFunction"));
  // The allocator's own frames are not part of the stack.
  EXPECT_FALSE(has_frame(block.frames, "Engine::malloc"));
  // Context "state": stacks on live blocks, none on trace entries.
  for (const auto& e : s.device_traces[0])
    EXPECT_FALSE(e.frames);
  f.alloc.free(p);
}

TEST(History, FramesCarryFileAndLineFromDebugInfo) {
  const std::uintptr_t here = reinterpret_cast<std::uintptr_t>(&AllocateFromKnownFunction) + 1;
  const ccalloc::Frame frame = ccalloc::core::symbolize_address(here);
  EXPECT_NE(frame.name.find("AllocateFromKnownFunction"), std::string::npos) << frame.name;
#if CCALLOC_TEST_HAVE_LIBDW && CCALLOC_TEST_HAVE_DEBUG_INFO
  EXPECT_NE(frame.filename.find("history_test.cpp"), std::string::npos) << frame.filename;
  EXPECT_GT(frame.line, 0);
#endif
}

TEST(History, StackCaptureLeavesTheProgramsExceptionUnwinderAlone) {
  Fixture f;
  f.alloc.record_history(options("state", "state", "cpp"));
  const DevicePtr p = AllocateFromKnownFunction(f.alloc, 4096);
  f.alloc.free(p);
#if CCALLOC_TEST_HAVE_LIBUNWIND
  EXPECT_STREQ(ccalloc::core::stack_unwinder(), "libunwind");
#else
  EXPECT_STREQ(ccalloc::core::stack_unwinder(), "backtrace");
#endif
  // libunwind defines _Unwind_RaiseException too; the program's C++ exceptions must still
  // go through the toolchain's unwinder, whichever one the stacks use.
  void* raise = ::dlsym(RTLD_DEFAULT, "_Unwind_RaiseException");
  ASSERT_NE(raise, nullptr);
  Dl_info info{};
  ASSERT_NE(::dladdr(raise, &info), 0);
  EXPECT_EQ(std::string(info.dli_fname).find("libunwind"), std::string::npos) << info.dli_fname;
  EXPECT_THROW(f.alloc.free(p), ccalloc::InvalidPointerError);
}

TEST(History, ContextAllocPutsTheAllocationStackOnFreeEntries) {
  Fixture f;
  f.alloc.record_history(options("all", "alloc", "cpp"));
  const DevicePtr p = AllocateFromKnownFunction(f.alloc, 4096);
  FreeFromKnownFunction(f.alloc, p);
  const Snapshot s = f.alloc.snapshot();
  const auto& t = s.device_traces[0];
  ASSERT_EQ(t.size(), 5u);  // segment_alloc, alloc, free_requested, free_completed, snapshot
  EXPECT_TRUE(has_frame(t[0].frames, "AllocateFromKnownFunction"));
  EXPECT_TRUE(has_frame(t[1].frames, "AllocateFromKnownFunction"));
  EXPECT_TRUE(has_frame(t[2].frames, "AllocateFromKnownFunction"));
  EXPECT_FALSE(has_frame(t[2].frames, "FreeFromKnownFunction"));
  EXPECT_TRUE(has_frame(t[3].frames, "AllocateFromKnownFunction"));
  EXPECT_FALSE(t[4].frames);
  EXPECT_EQ(t[1].frames, t[2].frames) << "identical stacks share one frame list";
}

TEST(History, ContextAllPutsTheFreeingStackOnFreeEntries) {
  Fixture f;
  f.alloc.record_history(options("all", "all", "cpp"));
  const DevicePtr p = AllocateFromKnownFunction(f.alloc, 4096);
  FreeFromKnownFunction(f.alloc, p);
  const Snapshot s = f.alloc.snapshot();
  const auto& t = s.device_traces[0];
  EXPECT_TRUE(has_frame(t[2].frames, "FreeFromKnownFunction"));
  EXPECT_TRUE(has_frame(t[3].frames, "FreeFromKnownFunction"));
  EXPECT_FALSE(has_frame(t[2].frames, "AllocateFromKnownFunction"));
}

TEST(History, StacksNoneRecordsNoFrames) {
  Fixture f;
  f.alloc.record_history(options("all", "all", "none"));
  const DevicePtr p = AllocateFromKnownFunction(f.alloc, 4096);
  const Snapshot s = f.alloc.snapshot();
  EXPECT_FALSE(s.segments[0].blocks[0].frames);
  for (const auto& e : s.device_traces[0])
    EXPECT_FALSE(e.frames);
  f.alloc.free(p);
}

TEST(History, FreedBlocksDropTheirAllocationStack) {
  Fixture f;
  f.alloc.record_history(options("all", "state", "cpp"));
  const DevicePtr a = AllocateFromKnownFunction(f.alloc, 4096);
  const DevicePtr b = AllocateFromKnownFunction(f.alloc, 4096);
  f.alloc.free(a);
  const Snapshot s = f.alloc.snapshot();
  const auto& blocks = s.segments[0].blocks;
  ASSERT_EQ(blocks.size(), 3u);  // freed a, live b, the rest of the segment
  EXPECT_EQ(blocks[0].state, BlockState::kInactive);
  EXPECT_FALSE(blocks[0].frames);
  EXPECT_EQ(blocks[1].address, b);
  EXPECT_TRUE(has_frame(blocks[1].frames, "AllocateFromKnownFunction"));
  // The segment's stack stays with the segment's first block as blocks merge and split.
  EXPECT_TRUE(has_frame(s.segments[0].frames, "AllocateFromKnownFunction"));
  f.alloc.free(b);
  const Snapshot after = f.alloc.snapshot();
  EXPECT_TRUE(has_frame(after.segments[0].frames, "AllocateFromKnownFunction"));
}

TEST(Snapshot, BlocksTileSegmentsAndSumsMatchTheStats) {
  Fixture f;
  f.alloc.record_history(options("all", "none", "none"));
  const DevicePtr a = f.alloc.malloc(1000);
  const DevicePtr b = f.alloc.malloc(3 * kMiB);
  const DevicePtr c = f.alloc.malloc(700);
  f.alloc.record_stream(c, 9);
  f.alloc.free(c);  // pending on stream 9
  const Snapshot s = f.alloc.snapshot();
  std::size_t total = 0, allocated = 0, active = 0, requested = 0;
  for (const auto& seg : s.segments) {
    DevicePtr at = seg.address;
    std::size_t seg_allocated = 0, seg_active = 0, seg_requested = 0;
    for (const auto& blk : seg.blocks) {
      EXPECT_EQ(blk.address, at) << "blocks tile the segment";
      at += blk.size;
      if (blk.state == BlockState::kActiveAllocated) seg_allocated += blk.size;
      if (blk.state != BlockState::kInactive) {
        seg_active += blk.size;
        seg_requested += blk.requested_size;
      }
    }
    EXPECT_EQ(at, seg.address + seg.total_size);
    EXPECT_EQ(seg.allocated_size, seg_allocated);
    EXPECT_EQ(seg.active_size, seg_active);
    EXPECT_EQ(seg.requested_size, seg_requested);
    total += seg.total_size;
    allocated += seg_allocated;
    active += seg_active;
    requested += seg_requested;
  }
  const auto stats = f.alloc.stats();
  EXPECT_EQ(static_cast<std::int64_t>(total), stats.reserved_bytes[ccalloc::kAggregate].current);
  EXPECT_EQ(static_cast<std::int64_t>(allocated),
            stats.allocated_bytes[ccalloc::kAggregate].current);
  EXPECT_EQ(static_cast<std::int64_t>(active), stats.active_bytes[ccalloc::kAggregate].current);
  EXPECT_EQ(static_cast<std::int64_t>(requested),
            stats.requested_bytes[ccalloc::kAggregate].current);
  ASSERT_EQ(s.segments.size(), 2u);
  EXPECT_TRUE(s.segments[0].is_small != s.segments[1].is_small);
  const auto& small = s.segments[0].is_small ? s.segments[0] : s.segments[1];
  EXPECT_EQ(small.blocks[1].state, BlockState::kActivePendingFree);
  EXPECT_EQ(small.blocks[1].requested_size, 700u);
  // The snapshot entry carries the active bytes.
  EXPECT_EQ(s.device_traces[0].back().action, TraceAction::kSnapshot);
  EXPECT_EQ(s.device_traces[0].back().size, active);
  f.alloc.free(a);
  f.alloc.free(b);
}

TEST(Snapshot, SettingsAndAnnotationsAndMetadata) {
  ccalloc::sim::SimDriver gpu;
  Allocator alloc(gpu, Config::parse("pytorch,max_split_size_mb:64,roundup_power2_divisions:4"));
  alloc.record_history(options("all", "none", "none"));
  gpu.set_time_us(77);
  alloc.annotate("step 1", true);
  Allocator::set_user_metadata("phase=forward");
  alloc.free(alloc.malloc(512));
  Allocator::set_user_metadata("");
  alloc.annotate("step 1", false);
  const Snapshot s = alloc.snapshot();
  EXPECT_EQ(s.allocator_settings.conf, "pytorch,max_split_size_mb:64,roundup_power2_divisions:4");
  EXPECT_EQ(s.allocator_settings.max_split_size, 64 * 1048576);
  ASSERT_EQ(s.allocator_settings.roundup_power2_divisions.size(), 16u);
  EXPECT_EQ(s.allocator_settings.roundup_power2_divisions[5], 4);
  ASSERT_EQ(s.external_annotations.size(), 2u);
  EXPECT_EQ(s.external_annotations[0].name, "step 1");
  EXPECT_EQ(s.external_annotations[0].stage, "START");
  EXPECT_EQ(s.external_annotations[0].time_us, 77);
  EXPECT_EQ(s.external_annotations[1].stage, "END");
  const auto& t = s.device_traces[0];
  EXPECT_EQ(t[1].user_metadata, "phase=forward");
  EXPECT_EQ(t.back().user_metadata, "");
}

// PyTorch's context levels under every backend: live blocks keep their allocation's stack,
// and segments that of the malloc that allocated or first mapped them, from "state" on
// (with history enabled "state" or "all"); entries carry stacks from "alloc" on (device
// allocations and mappings that of the malloc that made them; frees at "alloc" that of the
// allocation, at "all" their own; segment frees and unmaps at "alloc" that of the segment,
// at "all" that of the empty_cache); one snapshot entry per snapshot.
class HistoryLevels : public ::testing::TestWithParam<const char*> {};

TEST_P(HistoryLevels, EveryBackendPutsStacksWherePyTorchDoes) {
  using Context = HistoryOptions::Context;
  const std::string preset = GetParam();
  const bool async = preset.find("cudaMallocAsync") != std::string::npos;
  for (const char* enabled : {"state", "all"}) {
    for (const char* context : {"none", "state", "alloc", "all"}) {
      SCOPED_TRACE(std::string("enabled=") + enabled + " context=" + context);
      ccalloc::sim::SimDriver gpu;
      Allocator alloc(gpu, Config::parse(preset));
      alloc.record_history(options(enabled, context, "cpp"));
      const Context level = HistoryOptions::parse_context(context);
      const DevicePtr keep = AllocateFromKnownFunction(alloc, 4096);
      FreeFromKnownFunction(alloc, AllocateFromKnownFunction(alloc, 4096));
      // A large request, which a device allocation or a mapping serves.
      FreeFromKnownFunction(alloc, AllocateFromKnownFunction(alloc, 24 * kMiB));
      const Snapshot s = alloc.snapshot();
      if (!async) {
        int live = 0;
        for (const auto& seg : s.segments) {
          for (const auto& b : seg.blocks) {
            if (b.state != BlockState::kActiveAllocated) continue;
            ++live;
            EXPECT_EQ(b.address, keep);
            EXPECT_EQ(has_frame(b.frames, "AllocateFromKnownFunction"), level >= Context::kState);
          }
        }
        EXPECT_EQ(live, 1);
        EXPECT_EQ(s.segments.size(), 2u);  // a small and a large one
        for (const auto& seg : s.segments) {
          EXPECT_EQ(has_frame(seg.frames, "AllocateFromKnownFunction"), level >= Context::kState)
              << "segment at " << seg.address;
        }
      }
      const auto& t =
          s.device_traces.empty() ? std::vector<ccalloc::SnapshotTraceEntry>{} : s.device_traces[0];
      if (std::string(enabled) == "state") {
        EXPECT_TRUE(t.empty());
        continue;
      }
      int snapshots = 0, maps = 0, frees = 0;
      for (const auto& e : t) {
        SCOPED_TRACE(std::string(ccalloc::to_string(e.action)));
        const bool by_alloc = has_frame(e.frames, "AllocateFromKnownFunction");
        const bool by_free = has_frame(e.frames, "FreeFromKnownFunction");
        switch (e.action) {
          case TraceAction::kSnapshot:
            ++snapshots;
            EXPECT_FALSE(e.frames);
            break;
          case TraceAction::kSegmentAlloc:
          case TraceAction::kSegmentMap:
            ++maps;
            [[fallthrough]];
          case TraceAction::kAlloc:
            EXPECT_EQ(by_alloc, level >= Context::kAlloc);
            break;
          case TraceAction::kFreeRequested:
          case TraceAction::kFreeCompleted:
            ++frees;
            EXPECT_EQ(by_alloc, level == Context::kAlloc);
            EXPECT_EQ(by_free, level == Context::kAll);
            break;
          default:
            ADD_FAILURE() << "unexpected entry";
        }
      }
      EXPECT_EQ(snapshots, 1);
      EXPECT_EQ(frees, 4);
      if (!async) {
        EXPECT_GE(maps, 2);
      }
      alloc.free(keep);
      if (async) continue;
      // Every segment goes back to the device.
      EmptyCacheFromKnownFunction(alloc);
      const Snapshot after = alloc.snapshot();
      EXPECT_TRUE(after.segments.empty());
      int releases = 0;
      for (const auto& e : after.device_traces[0]) {
        if (e.action != TraceAction::kSegmentFree && e.action != TraceAction::kSegmentUnmap) {
          continue;
        }
        SCOPED_TRACE(std::string(ccalloc::to_string(e.action)) + " at " + std::to_string(e.addr));
        ++releases;
        EXPECT_EQ(has_frame(e.frames, "AllocateFromKnownFunction"), level == Context::kAlloc);
        EXPECT_EQ(has_frame(e.frames, "EmptyCacheFromKnownFunction"), level == Context::kAll);
      }
      EXPECT_GE(releases, 2);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, HistoryLevels,
                         ::testing::Values("pytorch", "pytorch,expandable_segments:True", "ccalloc",
                                           "backend:cudaMallocAsync"));

TEST(History, OptionValuesAreValidated) {
  EXPECT_THROW(HistoryOptions::parse_enabled("yes"), ccalloc::ConfigError);
  EXPECT_THROW(HistoryOptions::parse_context("python"), ccalloc::ConfigError);
  EXPECT_THROW(HistoryOptions::parse_stacks("python"), ccalloc::ConfigError);
  EXPECT_EQ(HistoryOptions::parse_stacks("all"), HistoryOptions::Stacks::kCpp);
}

}  // namespace
