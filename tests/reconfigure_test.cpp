// Live reconfiguration (src/native/reconfigure.cpp): the settings PyTorch's
// torch.cuda.memory._set_allocator_settings may change take effect for every later decision,
// the keys that pick the implementation are refused by name, and the engine stays
// consistent (the invariant checker runs after every operation) across a toggle of
// expandable_segments with live blocks of both kinds.
//
// Sizes (pytorch preset): a request of 10 MiB or more takes a segment of its size rounded to
// 2 MiB; a smaller large request a 20 MiB segment.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "core/backend_access.hpp"
#include "test_support.hpp"

namespace ccalloc {
namespace {

constexpr std::size_t M = kMiB;
constexpr StreamId kS = 0;

struct Rig {
  explicit Rig(const char* conf = "pytorch") : alloc(gpu, Config::parse(conf)) {
    alloc.set_check_invariants(true);
  }
  bool reconfigure(const char* conf) { return core::reconfigure(alloc, Config::parse(conf)); }
  std::uint64_t device_allocs() const { return static_cast<std::uint64_t>(alloc.stats().num_device_alloc); }
  // The segment holding `p`.
  SegmentInfo segment_of(DevicePtr p) const {
    for (const SegmentInfo& s : alloc.segments()) {
      if (p >= s.address && p < s.address + s.total_size) return s;
    }
    ADD_FAILURE() << "no segment holds " << p;
    return {};
  }
  sim::SimDriver gpu;
  Allocator alloc;
};

TEST(Reconfigure, MaxSplitSizeAppliesToLaterRequestsAndRecountsOversize) {
  Rig rig;
  const DevicePtr a = rig.alloc.malloc(30 * M, kS);  // a 30 MiB segment, one block
  rig.alloc.free(a);
  // Unlimited: an 8 MiB request splits the cached 30 MiB block.
  const DevicePtr b = rig.alloc.malloc(8 * M, kS);
  EXPECT_EQ(b, a);
  rig.alloc.free(b);
  EXPECT_EQ(rig.device_allocs(), 1u);

  ASSERT_TRUE(rig.reconfigure("pytorch,max_split_size_mb:20"));
  EXPECT_EQ(rig.alloc.config().max_split_size, 20 * M);
  DeviceStats s = rig.alloc.stats();
  // As in PyTorch, the reported value is the one the allocator was created with.
  EXPECT_EQ(s.max_split_size, -1);
  EXPECT_EQ(s.oversize_segments.current, 1);  // the cached 30 MiB segment is oversize now
  // The 30 MiB block is oversize: an 8 MiB request may not take it, a new segment it is.
  const DevicePtr c = rig.alloc.malloc(8 * M, kS);
  EXPECT_NE(c, a);
  EXPECT_EQ(rig.device_allocs(), 2u);
  // 25 MiB may (30 < 25 + 20) and does not split it.
  const DevicePtr d = rig.alloc.malloc(25 * M, kS);
  EXPECT_EQ(d, a);
  EXPECT_EQ(rig.alloc.allocation_size(d), 30 * M);
  s = rig.alloc.stats();
  EXPECT_EQ(s.oversize_allocations.current, 1);
  EXPECT_EQ(s.oversize_allocations.peak, 1);

  // Back to unlimited while d is live: the counters follow the new threshold, and d's free
  // (no longer oversize) leaves them consistent.
  ASSERT_TRUE(rig.reconfigure("pytorch"));
  s = rig.alloc.stats();
  EXPECT_EQ(s.max_split_size, -1);
  EXPECT_EQ(s.oversize_allocations.current, 0);
  EXPECT_EQ(s.oversize_segments.current, 0);
  rig.alloc.free(d);
  rig.alloc.free(c);
  EXPECT_EQ(rig.alloc.stats().oversize_allocations.current, 0);
}

TEST(Reconfigure, RoundupPower2DivisionsChangeTheRounding) {
  Rig rig;
  constexpr std::size_t kRequest = 1153434;  // 1.1 MiB
  const DevicePtr a = rig.alloc.malloc(kRequest, kS);
  EXPECT_EQ(rig.alloc.allocation_size(a), 1153536u);  // the next multiple of 512
  ASSERT_TRUE(rig.reconfigure("pytorch,roundup_power2_divisions:4"));
  const DevicePtr b = rig.alloc.malloc(kRequest, kS);
  EXPECT_EQ(rig.alloc.allocation_size(b), 1310720u);  // 1 MiB + 256 KiB steps: 1.25 MiB
  ASSERT_TRUE(rig.reconfigure("pytorch"));
  const DevicePtr c = rig.alloc.malloc(kRequest, kS);
  EXPECT_EQ(rig.alloc.allocation_size(c), 1153536u);
  for (const DevicePtr p : {a, b, c})
    rig.alloc.free(p);
}

TEST(Reconfigure, ExpandableSegmentsToggleWithLiveBlocksOfBothKinds) {
  Rig rig;
  const DevicePtr a = rig.alloc.malloc(15 * M, kS);  // a 16 MiB device segment
  EXPECT_FALSE(rig.segment_of(a).is_expandable);

  ASSERT_TRUE(rig.reconfigure("pytorch,expandable_segments:True"));
  const DevicePtr b = rig.alloc.malloc(8 * M, kS);  // does not fit a's segment
  EXPECT_TRUE(rig.segment_of(b).is_expandable);
  EXPECT_FALSE(rig.segment_of(a).is_expandable);  // existing segments keep their kind
  const DevicePtr c = rig.alloc.malloc(4 * M, kS);
  EXPECT_TRUE(rig.segment_of(c).is_expandable);   // the mapped 20 MiB page has room
  rig.alloc.check_invariants();

  ASSERT_TRUE(rig.reconfigure("pytorch"));
  const DevicePtr d = rig.alloc.malloc(12 * M, kS);  // no free block fits: a new segment
  EXPECT_FALSE(rig.segment_of(d).is_expandable);
  EXPECT_EQ(rig.segment_of(d).total_size, 12 * M);
  int expandable = 0, device = 0;
  for (const SegmentInfo& s : rig.alloc.segments())
    (s.is_expandable ? expandable : device) += 1;
  EXPECT_EQ(expandable, 1);
  EXPECT_EQ(device, 2);

  // Freeing and emptying the cache returns both kinds.
  rig.alloc.free(b);
  ASSERT_TRUE(rig.reconfigure("pytorch,expandable_segments:True"));
  rig.alloc.free(a);
  rig.alloc.free(c);
  rig.alloc.free(d);
  rig.alloc.empty_cache();
  EXPECT_TRUE(rig.alloc.segments().empty());
  EXPECT_EQ(rig.alloc.stats().reserved_bytes[kAggregate].current, 0);
  EXPECT_EQ(rig.gpu.used_bytes(), 0u);
}

TEST(Reconfigure, KeysThatPickTheImplementationAreRefusedByName) {
  Rig rig;
  const Config before = rig.alloc.config();
  const std::string backend = ccalloc_test::message_of<ConfigError>(
      [&] { rig.reconfigure("pytorch,backend:cudaMallocAsync,max_split_size_mb:20"); });
  EXPECT_NE(backend.find("'backend' cannot change while the allocator is live"), std::string::npos)
      << backend;
  EXPECT_NE(backend.find("cudaMallocAsync"), std::string::npos) << backend;
  const std::string stitch = ccalloc_test::message_of<ConfigError>(
      [&] { rig.reconfigure("pytorch,stitch_segments:True"); });
  EXPECT_NE(stitch.find("'stitch_segments'"), std::string::npos) << stitch;
  Config uncached = Config::parse("pytorch");
  uncached.uncached = true;
  const std::string unc = ccalloc_test::message_of<ConfigError>(
      [&] { core::reconfigure(rig.alloc, uncached); });
  EXPECT_NE(unc.find("'uncached'"), std::string::npos) << unc;
  // Nothing changed, not even the keys that could have.
  EXPECT_EQ(rig.alloc.config(), before);
}

TEST(Reconfigure, MemoryFractionAppliesOnlyWhenItsKeyChanges) {
  Rig rig;
  ASSERT_TRUE(rig.reconfigure("pytorch,per_process_memory_fraction:0.5"));
  EXPECT_EQ(rig.alloc.memory_fraction(), 0.5);
  rig.alloc.set_memory_fraction(0.25);
  ASSERT_TRUE(rig.reconfigure("pytorch,per_process_memory_fraction:0.5,max_split_size_mb:40"));
  EXPECT_EQ(rig.alloc.memory_fraction(), 0.25);
  EXPECT_EQ(rig.alloc.config().max_split_size, 40 * M);
}

TEST(Reconfigure, CompatibilityAndPinnedKeysAreRecordedWithoutEffect) {
  Rig rig;
  const DevicePtr a = rig.alloc.malloc(3 * M, kS);
  ASSERT_TRUE(rig.reconfigure(
      "pytorch,release_lock_on_cudamalloc:True,pinned_num_register_threads:4,"
      "pinned_use_background_threads:True"));
  EXPECT_TRUE(rig.alloc.config().release_lock_on_cudamalloc);
  EXPECT_EQ(rig.alloc.config().pinned_num_register_threads, 4u);
  const DevicePtr b = rig.alloc.malloc(3 * M, kS);
  EXPECT_EQ(b, a + 3 * M);  // the same segment, right after a
  EXPECT_EQ(rig.device_allocs(), 1u);
  rig.alloc.free(a);
  rig.alloc.free(b);
}

// The `ccalloc` preset: the stitching engine takes the request rounding, the fraction, the GC
// threshold and the chunk; the private pools' engine everything a native engine takes (here
// expandable_segments, for new private segments).
TEST(Reconfigure, TheCcallocPresetAppliesSettingsToBothEngines) {
  sim::Options o;
  o.capacity = 1024 * M;
  sim::SimDriver gpu(o);
  Allocator alloc(gpu, Config::parse("ccalloc"));
  alloc.set_check_invariants(true);
  const std::size_t odd = 5 * M + 1;
  const DevicePtr a = alloc.malloc(odd, kS);
  EXPECT_EQ(alloc.allocation_size(a), 5 * M + 512);

  const Config next = Config::parse(
      "ccalloc,roundup_power2_divisions:4,per_process_memory_fraction:0.5,"
      "expandable_segments:False,garbage_collection_threshold:0.9");
  ASSERT_TRUE(core::reconfigure(alloc, next));
  EXPECT_EQ(alloc.config(), next);
  EXPECT_EQ(alloc.memory_fraction(), 0.5);
  const DevicePtr b = alloc.malloc(odd, kS);
  EXPECT_EQ(alloc.allocation_size(b), 6 * M);  // 4-8 MiB in quarters
  // Half of the 1 GiB device, for both engines together.
  EXPECT_THROW(alloc.malloc(600 * M, kS), OutOfMemoryError);

  // A private pool's new segment follows the new expandable_segments.
  const PoolId pool{0, 7};
  alloc.create_pool(pool);
  alloc.begin_allocate_to_pool(pool, [](StreamId s) { return s == kS; });
  const DevicePtr c = alloc.malloc(3 * M, kS);
  alloc.end_allocate_to_pool(pool);
  EXPECT_EQ(alloc.segment_pool(c), pool);
  bool found = false;
  for (const SegmentInfo& seg : alloc.segments()) {
    if (c < seg.address || c >= seg.address + seg.total_size) continue;
    found = true;
    EXPECT_FALSE(seg.is_expandable);
    EXPECT_EQ(seg.pool, pool);
  }
  EXPECT_TRUE(found);

  // Keys that pick the implementation: refused by name, nothing changed.
  const std::string stitch = ccalloc_test::message_of<ConfigError>(
      [&] { core::reconfigure(alloc, Config::parse("ccalloc,stitch_segments:False,roundup_power2_divisions:8")); });
  EXPECT_NE(stitch.find("'stitch_segments' cannot change while the allocator is live"),
            std::string::npos)
      << stitch;
  EXPECT_EQ(alloc.config(), next);
  const DevicePtr d = alloc.malloc(odd, kS);
  EXPECT_EQ(alloc.allocation_size(d), 6 * M);
  for (const DevicePtr p : {a, b, c, d})
    alloc.free(p);
  for (int n = alloc.pool_use_count(pool); n > 0; --n)
    alloc.release_pool(pool);
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, 0);
}

TEST(Reconfigure, TheAsyncBackendTakesEveryKeyButBackend) {
  sim::SimDriver gpu;
  Allocator alloc(gpu, Config::parse("backend:cudaMallocAsync"));
  const Config next =
      Config::parse("backend:cudaMallocAsync,expandable_segments:True,per_process_memory_fraction:0.5");
  EXPECT_TRUE(core::reconfigure(alloc, next));
  EXPECT_EQ(alloc.config(), next);
  EXPECT_EQ(alloc.memory_fraction(), 0.5);
  const std::string message = ccalloc_test::message_of<ConfigError>(
      [&] { core::reconfigure(alloc, Config::parse("pytorch")); });
  EXPECT_NE(message.find("'backend' cannot change while the allocator is live"), std::string::npos)
      << message;
  EXPECT_EQ(alloc.config(), next);
}

}  // namespace
}  // namespace ccalloc
