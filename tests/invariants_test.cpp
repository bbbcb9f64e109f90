// The invariant checker: each named check of the engine header's list fires, by name, on a
// state corrupted in exactly the way it guards against, and the checks before it in
// check_invariants() pass. Every test restores the state afterwards and checks that the
// whole checker passes again, so the corruption was the only fault.
#include <gtest/gtest.h>

#include <iterator>
#include <optional>
#include <string>
#include <utility>

#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "native/engine.hpp"
#include "core/format.hpp"
#include "stitch/engine.hpp"

namespace ccalloc::core {

// The test hook engine.hpp befriends.
struct EngineTestAccess {
  static Arena& arena(Engine& e, StreamId stream) { return e.arena_for(stream); }
  static std::size_t& capacity(Engine& e) { return e.capacity_; }
  static PrivatePool& pool(Engine& e, ccalloc::PoolId id) NO_THREAD_SAFETY_ANALYSIS {
    return *e.pools_.at(id);
  }
};

// The test hook stitch/engine.hpp befriends.
struct StitchEngineTestAccess {
  // Swaps the places in the pool of the two smallest free blocks of `stream`'s small pool;
  // returns the address of the smallest.
  static DevicePtr swap_small_pool_places(StitchEngine& e,
                                          StreamId stream) NO_THREAD_SAFETY_ANALYSIS {
    { const StitchEngine::AllArenasLock all(e); }  // a parked block pooled
    StitchEngine::Pool& pool = e.arena_for(stream).pool(/*small=*/true);
    StitchEngine::Block* first = *pool.begin();
    StitchEngine::Block* second = *std::next(pool.begin());
    std::swap(first->pool_pos, second->pool_pos);
    return first->ptr;
  }
  // The stream's parked block's address (0: none).
  static DevicePtr parked(StitchEngine& e, StreamId stream) NO_THREAD_SAFETY_ANALYSIS {
    const StitchEngine::Block* b = e.arena_for(stream).parked;
    return b == nullptr ? 0 : b->ptr;
  }
  // Makes the stream's parked block the one at `ptr` in the live index (0: none), whatever
  // it is; returns the address of the one before.
  static DevicePtr set_parked(StitchEngine& e, StreamId stream,
                              DevicePtr ptr) NO_THREAD_SAFETY_ANALYSIS {
    StitchEngine::Arena& arena = e.arena_for(stream);
    const DevicePtr before = arena.parked == nullptr ? 0 : arena.parked->ptr;
    arena.parked = ptr == 0 ? nullptr : arena.live.find(ptr);
    return before;
  }
};

}  // namespace ccalloc::core

namespace {

using ccalloc::Config;
using ccalloc::DevicePtr;
using ccalloc::hex_address;
using ccalloc::InvariantError;
using ccalloc::core::Arena;
using ccalloc::core::Block;
using ccalloc::core::Engine;
using ccalloc::core::EngineTestAccess;

constexpr std::size_t kGiB = std::size_t{1} << 30;

// The message of the first invariant check of `engine` that fails, "" if all pass.
std::string failure_of(const ccalloc::core::Backend& engine) {
  try {
    engine.check_invariants();
    return "";
  } catch (const InvariantError& e) {
    return e.what();
  }
}

struct Rig {
  explicit Rig(const char* conf = "pytorch") : gpu(options()), engine(gpu, Config::parse(conf)) {}
  static ccalloc::sim::Options options() {
    ccalloc::sim::Options o;
    o.capacity = 8 * kGiB;
    return o;
  }
  Arena& arena() { return EngineTestAccess::arena(engine, 0); }
  Block* block(DevicePtr p) { return arena().live.find(p); }
  std::string failure() { return failure_of(engine); }

  ccalloc::sim::SimDriver gpu;
  Engine engine;
};

bool names(const std::string& message, const std::string& check) {
  return message.rfind("ccalloc invariant " + check + " violated: ", 0) == 0;
}

TEST(Invariants, HealthyStatePassesEveryCheck) {
  Rig rig;
  const DevicePtr a = rig.engine.malloc(512, 0);
  rig.engine.malloc(3 << 20, 0);
  rig.engine.free(a);
  EXPECT_EQ(rig.failure(), "");
}

TEST(Invariants, PoolSegmentCountThatDisagreesBreaksPrivatePoolBlocks) {
  Rig rig;
  const ccalloc::PoolId id{0, 1};
  rig.engine.create_pool(id, std::nullopt);
  rig.engine.begin_allocate_to_pool(id, [](ccalloc::StreamId) { return true; });
  const DevicePtr a = rig.engine.malloc(512, 0);
  rig.engine.end_allocate_to_pool(id);
  EXPECT_EQ(rig.failure(), "");
  ccalloc::core::PrivatePool& pool = EngineTestAccess::pool(rig.engine, id);
  pool.segments += 1;
  const std::string message = rig.failure();
  EXPECT_EQ(message,
            "ccalloc invariant private_pool_blocks violated: pool (0, 1) counts 2 segments but "
            "its arenas hold 1");
  pool.segments -= 1;
  EXPECT_EQ(rig.failure(), "");
  rig.engine.free(a);
}

TEST(Invariants, SleepStateThatDisagreesWithTheMemoryBreaksSleepablePools) {
  Rig rig;
  const ccalloc::PoolId id{0, 1};
  rig.engine.create_sleepable_pool(id);
  rig.engine.begin_allocate_to_pool(id, [](ccalloc::StreamId) { return true; });
  const DevicePtr a = rig.engine.malloc(4 << 20, 0);
  rig.engine.end_allocate_to_pool(id);
  EXPECT_EQ(rig.failure(), "");
  ccalloc::core::PrivatePool& pool = EngineTestAccess::pool(rig.engine, id);
  // Marked asleep while its memory is still mapped.
  pool.asleep = true;
  std::string message = rig.failure();
  EXPECT_TRUE(names(message, "sleepable_pools")) << message;
  EXPECT_NE(message.find("of pool (0, 1) has physical memory while the pool sleeps"),
            std::string::npos)
      << message;
  pool.asleep = false;
  EXPECT_EQ(rig.failure(), "");
  // Saved contents kept by an awake pool.
  pool.sleepable->saved().ranges[a] = {0, 4 << 20};
  message = rig.failure();
  EXPECT_TRUE(names(message, "sleepable_pools")) << message;
  EXPECT_NE(message.find("pool (0, 1) is awake but holds saved contents"), std::string::npos)
      << message;
  pool.sleepable->saved().ranges.clear();
  EXPECT_EQ(rig.failure(), "");
  // Asleep for real: consistent.
  rig.engine.sleep_pool(id, ccalloc::SleepMode::kDiscard);
  EXPECT_EQ(rig.failure(), "");
  rig.engine.wake_pool(id);
  rig.engine.free(a);
}

TEST(Invariants, BlockThatOverrunsItsNeighbourBreaksTiling) {
  Rig rig;
  const DevicePtr a = rig.engine.malloc(512, 0);
  const DevicePtr b = rig.engine.malloc(512, 0);
  Block* block = rig.block(a);
  block->size += 512;
  const std::string message = rig.failure();
  EXPECT_TRUE(names(message, "blocks_tile_segments")) << message;
  EXPECT_NE(message.find(hex_address(b)), std::string::npos) << message;
  block->size -= 512;
  EXPECT_EQ(rig.failure(), "");
}

TEST(Invariants, AdjacentFreeBlocksBreakMerging) {
  Rig rig;
  const DevicePtr a = rig.engine.malloc(512, 0);
  const DevicePtr b = rig.engine.malloc(512, 0);
  rig.engine.free(a);
  // b becomes free next to free a without going through free().
  Arena& arena = rig.arena();
  Block* block = arena.live.erase(b);
  block->allocated = false;
  arena.small_pool.blocks.insert(block);
  const std::string message = rig.failure();
  EXPECT_TRUE(names(message, "free_blocks_merged")) << message;
  EXPECT_NE(message.find(hex_address(a)), std::string::npos) << message;
  arena.small_pool.blocks.erase(block);
  block->allocated = true;
  arena.live.insert(b, block);
  EXPECT_EQ(rig.failure(), "");
}

TEST(Invariants, AllocatedBlockInAPoolBreaksPoolMembership) {
  Rig rig;
  const DevicePtr a = rig.engine.malloc(512, 0);
  Arena& arena = rig.arena();
  Block* block = rig.block(a);
  arena.small_pool.blocks.insert(block);
  const std::string message = rig.failure();
  EXPECT_TRUE(names(message, "pool_membership")) << message;
  EXPECT_NE(message.find(hex_address(a)), std::string::npos) << message;
  arena.small_pool.blocks.erase(block);
  EXPECT_EQ(rig.failure(), "");
}

// Free blocks keep their places in their pools (the set's iterator), and the engine finds
// and removes known blocks by them: a block that points at another block's node is named.
TEST(Invariants, FreeBlockWithAnotherBlocksPlaceBreaksPoolMembership) {
  Rig rig;
  const DevicePtr a = rig.engine.malloc(512, 0);
  const DevicePtr b = rig.engine.malloc(512, 0);
  rig.engine.free(a);  // the small pool: a's 512 B and the rest of the segment after b
  ASSERT_EQ(rig.failure(), "");
  auto& pool = rig.arena().small_pool.blocks;
  ASSERT_EQ(pool.size(), 2U);
  Block* first = *pool.begin();
  Block* second = *std::next(pool.begin());
  ASSERT_EQ(first->ptr, a);
  std::swap(first->pool_pos, second->pool_pos);
  const std::string message = rig.failure();
  EXPECT_TRUE(names(message, "pool_membership")) << message;
  EXPECT_NE(message.find("free block " + hex_address(a) + " has lost its place in its pool"),
            std::string::npos)
      << message;
  std::swap(first->pool_pos, second->pool_pos);
  EXPECT_EQ(rig.failure(), "");
  // With the places right, freeing b merges all three into one block, which is reused.
  rig.engine.free(b);
  EXPECT_EQ(pool.size(), 1U);
  EXPECT_EQ(rig.engine.malloc(512, 0), a);
  EXPECT_EQ(rig.failure(), "");
}

TEST(Invariants, UnmappedListEntryOutsideASegmentBreaksExpandableSegments) {
  Rig rig("pytorch,expandable_segments:True");
  rig.engine.malloc(512, 0);
  Arena& arena = rig.arena();
  ASSERT_FALSE(arena.small_pool.unmapped.empty());
  Block* tail = *arena.small_pool.unmapped.begin();
  auto* const segment = tail->segment;
  tail->segment = nullptr;
  const std::string message = rig.failure();
  EXPECT_TRUE(names(message, "expandable_segments")) << message;
  EXPECT_NE(message.find(hex_address(tail->ptr)), std::string::npos) << message;
  tail->segment = segment;
  EXPECT_EQ(rig.failure(), "");
}

TEST(Invariants, MiscountedBytesBreakStats) {
  Rig rig;
  rig.engine.malloc(512, 0);
  // The hot path keeps the pool's entry; the aggregate is derived from it when checked.
  auto& allocated = rig.arena().stats.allocated_bytes[ccalloc::kSmallPool];
  allocated.current += 512;
  const std::string message = rig.failure();
  EXPECT_TRUE(names(message, "stats_match_blocks")) << message;
  EXPECT_NE(message.find("allocated_bytes[0] is 1024 but the blocks add up to 512"),
            std::string::npos)
      << message;
  allocated.current -= 512;
  EXPECT_EQ(rig.failure(), "");
}

TEST(Invariants, UnmarkedPeakDebtBreaksPeaks) {
  Rig rig;
  rig.engine.malloc(512, 0);
  // A debt of 512 puts the baseline (peak less debt) at 0, below the current 512.
  std::int64_t& debt = rig.arena().debts.allocated_bytes[ccalloc::kSmallPool];
  debt = 512;
  const std::string message = rig.failure();
  EXPECT_TRUE(names(message, "peaks_cover_current")) << message;
  EXPECT_NE(message.find("allocated_bytes.small_pool is 512, baseline 0, debt 512, arena not "
                         "marked in debt"),
            std::string::npos)
      << message;
  // An arena marked in debt has a settlement under way: its own excess is allowed.
  rig.arena().in_debt = true;
  EXPECT_EQ(rig.failure(), "");
  rig.arena().in_debt = false;
  debt = 0;
  EXPECT_EQ(rig.failure(), "");
}

TEST(Invariants, ReservedBeyondCapacityBreaksTheCapacityCheck) {
  Rig rig;
  rig.engine.malloc(512, 0);
  std::size_t& capacity = EngineTestAccess::capacity(rig.engine);
  const std::size_t real = capacity;
  capacity = 1 << 20;  // less than the 2 MiB segment
  const std::string message = rig.failure();
  EXPECT_TRUE(names(message, "reserved_within_capacity")) << message;
  EXPECT_NE(message.find("reserved 2097152 bytes exceeds the device capacity of 1048576 bytes"),
            std::string::npos)
      << message;
  capacity = real;
  EXPECT_EQ(rig.failure(), "");
}

// The stitching engine's free blocks keep their places in their pools (the set's iterator):
// one that points at another block's node breaks the check that finds blocks by it.
TEST(Invariants, StitchedFreeBlockWithAnotherBlocksPlaceBreaksPoolPlaces) {
  ccalloc::sim::SimDriver gpu(Rig::options());
  ccalloc::core::StitchEngine engine(gpu, Config::parse("ccalloc"));
  const auto failure = [&engine] { return failure_of(engine); };
  const DevicePtr a = engine.malloc(512, 0);
  const DevicePtr b = engine.malloc(512, 0);
  engine.free(a);  // the small pool: a's 512 B and the rest of the page after b
  ASSERT_EQ(failure(), "");
  const DevicePtr smallest =
      ccalloc::core::StitchEngineTestAccess::swap_small_pool_places(engine, 0);
  EXPECT_EQ(smallest, a);
  const std::string message = failure();
  EXPECT_NE(message.find("the free block " + hex_address(a) + " has lost its place in its pool"),
            std::string::npos)
      << message;
  ccalloc::core::StitchEngineTestAccess::swap_small_pool_places(engine, 0);
  EXPECT_EQ(failure(), "");
  // And with the places right, freeing and reusing the blocks works as before.
  engine.free(b);
  EXPECT_EQ(engine.malloc(512, 0), a);
  EXPECT_EQ(failure(), "");
}

TEST(Invariants, ALiveBlockInThePlaceOfTheParkedOneBreaksParking) {
  using Access = ccalloc::core::StitchEngineTestAccess;
  ccalloc::sim::SimDriver gpu(Rig::options());
  ccalloc::core::StitchEngine engine(gpu, Config::parse("ccalloc"));
  const DevicePtr a = engine.malloc(512, 0);
  const DevicePtr b = engine.malloc(512, 0);
  engine.free(a);  // parked: nothing free before it
  ASSERT_EQ(Access::parked(engine, 0), a);
  EXPECT_EQ(failure_of(engine), "");
  EXPECT_EQ(Access::set_parked(engine, 0, b), a);
  const std::string message = failure_of(engine);
  EXPECT_NE(message.find("the parked block " + hex_address(b) +
                         " of stream 0 is not a parked block of the stream"),
            std::string::npos)
      << message;
  Access::set_parked(engine, 0, a);
  EXPECT_EQ(failure_of(engine), "");
  engine.free(b);  // next to the parked block: both pooled, merged
  EXPECT_EQ(Access::parked(engine, 0), 0u);
  EXPECT_EQ(failure_of(engine), "");
}

}  // namespace
