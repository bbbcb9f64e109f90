// Sleep and wake of sleepable pools (docs/sleep-wake.md) on the simulated GPU: contents
// saved and restored byte for byte at unchanged addresses while other work used the freed
// memory, discarded contents, what memory_stats, segments and snapshots show while a pool
// sleeps, the device's free memory, frees while asleep, every refused call leaving the
// allocator as it was, out-of-memory on wake, and the backends without pools.
//
// Invariants are checked after every operation (the checker verifies that a sleeping
// pool's segments have no physical memory and count neither as reserved nor as segments).
// The simulated GPU keeps the bytes written to each physical allocation; a fresh physical
// allocation reads as zeros.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/ipc.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"
#include "ccalloc/snapshot_io.hpp"
#include "ccalloc/stats.hpp"
#include "test_support.hpp"

namespace ccalloc {
namespace {

using ccalloc_test::message_of;

constexpr std::size_t kGiB = 1024 * kMiB;
constexpr PoolId kPool{0, 5};
constexpr PoolId kOther{0, 6};

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = static_cast<unsigned char>((i * 131 + seed * 7 + (i >> 12)) & 0xff);
  return out;
}

struct Fixture {
  explicit Fixture(std::size_t capacity = kGiB, const std::string& conf = "pytorch")
      : driver(options(capacity)), alloc(driver, Config::parse(conf)) {
    alloc.set_check_invariants(true);
  }
  static sim::Options options(std::size_t capacity) {
    sim::Options o;
    o.capacity = capacity;
    return o;
  }
  // Allocates `sizes` in `pool` on `stream`, as code inside torch.cuda.use_mem_pool does.
  std::vector<DevicePtr> allocate_in(PoolId pool, const std::vector<std::size_t>& sizes,
                                     StreamId stream = 0) {
    alloc.begin_allocate_to_pool(pool, [stream](StreamId s) { return s == stream; });
    std::vector<DevicePtr> out;
    for (const std::size_t n : sizes)
      out.push_back(alloc.malloc(n, stream));
    alloc.end_allocate_to_pool(pool);
    return out;
  }
  void fill(DevicePtr p, std::size_t n, unsigned seed) {
    const auto bytes = pattern(n, seed);
    driver.write(p, bytes.data(), n);
  }
  std::vector<unsigned char> read(DevicePtr p, std::size_t n) const {
    std::vector<unsigned char> out(n);
    driver.read(p, out.data(), n);
    return out;
  }
  std::int64_t stat(const std::string& key) const { return alloc.memory_stats().at(key); }

  sim::SimDriver driver;
  Allocator alloc;
};

// Sizes of one small (2 MiB segment), two large (20 MiB segment, split) and one huge
// (its own 64 MiB segment) allocation.
const std::vector<std::size_t> kSizes = {300 * 1024, 3 * kMiB, 5 * kMiB + 512, 64 * kMiB};

TEST(SleepWake, SavedContentsComeBackAtTheSameAddressesAfterOtherWorkUsedTheMemory) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, kSizes);
  for (std::size_t i = 0; i < ptrs.size(); ++i)
    f.fill(ptrs[i], kSizes[i], static_cast<unsigned>(i + 1));
  // Segments: 2 MiB (small) + 20 MiB + 64 MiB (large).
  const std::size_t pool_bytes = 86 * kMiB;
  const PoolSleepInfo awake = f.alloc.pool_sleep_info(kPool);
  EXPECT_FALSE(awake.asleep);
  EXPECT_EQ(awake.segment_bytes, pool_bytes);
  EXPECT_EQ(awake.physical_bytes, pool_bytes);
  EXPECT_EQ(awake.live_bytes, 300 * 1024 + 3 * kMiB + 5 * kMiB + 512 + 64 * kMiB);
  const std::int64_t allocated = f.stat("allocated_bytes.all.current");
  const std::int64_t active = f.stat("active_bytes.all.current");
  EXPECT_EQ(f.stat("reserved_bytes.all.current"), static_cast<std::int64_t>(pool_bytes));
  EXPECT_EQ(f.stat("segment.all.current"), 3);
  const std::size_t free_before = f.driver.mem_info().free_bytes;
  const std::vector<SegmentInfo> segments_before = f.alloc.pool_segments(kPool);

  f.alloc.sleep_pool(kPool, SleepMode::kSave);
  EXPECT_TRUE(f.alloc.pool_asleep(kPool));
  // The physical memory went back to the device; the addresses stay reserved.
  EXPECT_GE(f.driver.mem_info().free_bytes, free_before + pool_bytes);
  EXPECT_EQ(f.driver.used_bytes(), 0u);
  for (const SegmentInfo& s : segments_before) {
    EXPECT_TRUE(f.driver.mappings_in(s.address, s.total_size).empty());
  }
  const PoolSleepInfo asleep = f.alloc.pool_sleep_info(kPool);
  EXPECT_TRUE(asleep.asleep);
  EXPECT_EQ(asleep.segment_bytes, pool_bytes);
  EXPECT_EQ(asleep.physical_bytes, 0u);
  EXPECT_EQ(asleep.saved_bytes, awake.live_bytes);
  EXPECT_EQ(f.driver.host_bytes(), awake.live_bytes);
  // Reserved memory is what is physically held; the allocations are still live.
  EXPECT_EQ(f.stat("reserved_bytes.all.current"), 0);
  EXPECT_EQ(f.stat("segment.all.current"), 0);
  EXPECT_EQ(f.stat("allocated_bytes.all.current"), allocated);
  EXPECT_EQ(f.stat("active_bytes.all.current"), active);
  EXPECT_EQ(f.alloc.pool_live_allocations(kPool), ptrs);
  const std::vector<SegmentInfo> sleeping = f.alloc.pool_segments(kPool);
  ASSERT_EQ(sleeping.size(), 3u);
  for (std::size_t i = 0; i < sleeping.size(); ++i) {
    EXPECT_TRUE(sleeping[i].is_asleep);
    EXPECT_EQ(sleeping[i].address, segments_before[i].address);
    EXPECT_EQ(sleeping[i].total_size, segments_before[i].total_size);
  }

  // Other work fills the device: 1 GiB is only free because the pool sleeps.
  const DevicePtr other = f.alloc.malloc(kGiB - 2 * kMiB, 3);
  f.fill(other, 4096, 99);
  EXPECT_EQ(f.read(other, 4096), std::vector<unsigned char>(pattern(4096, 99)));
  f.alloc.free(other);
  f.alloc.empty_cache();

  f.alloc.wake_pool(kPool);
  EXPECT_FALSE(f.alloc.pool_asleep(kPool));
  EXPECT_EQ(f.driver.host_bytes(), 0u);
  EXPECT_EQ(f.alloc.pool_live_allocations(kPool), ptrs);
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    EXPECT_EQ(f.read(ptrs[i], kSizes[i]), pattern(kSizes[i], static_cast<unsigned>(i + 1)))
        << "allocation " << i;
  }
  const std::vector<SegmentInfo> woken = f.alloc.pool_segments(kPool);
  ASSERT_EQ(woken.size(), segments_before.size());
  for (std::size_t i = 0; i < woken.size(); ++i) {
    EXPECT_FALSE(woken[i].is_asleep);
    EXPECT_EQ(woken[i].address, segments_before[i].address);
    EXPECT_EQ(f.driver.mappings_in(woken[i].address, woken[i].total_size).size(), 1u);
  }
  EXPECT_EQ(f.stat("reserved_bytes.all.current"), static_cast<std::int64_t>(pool_bytes));
  EXPECT_EQ(f.stat("segment.all.current"), 3);
  EXPECT_EQ(f.stat("allocated_bytes.all.current"), allocated);
  // The copies: one per live allocation each way, exactly their bytes.
  const sim::Counters c = f.driver.counters();
  EXPECT_EQ(c.copies_to_host, 4u);
  EXPECT_EQ(c.copies_to_device, 4u);
  EXPECT_EQ(c.bytes_to_host, awake.live_bytes);
  EXPECT_EQ(c.bytes_to_device, awake.live_bytes);
  EXPECT_EQ(c.host_allocates, 1u);
  EXPECT_EQ(c.host_frees, 1u);

  // The pool serves allocations again, from its cached free blocks.
  const std::vector<DevicePtr> more = f.allocate_in(kPool, {2 * kMiB});
  EXPECT_EQ(f.alloc.segment_pool(more[0]), kPool);
  EXPECT_EQ(f.stat("segment.all.current"), 3);  // the 20 MiB segment's free rest
  for (const DevicePtr p : ptrs)
    f.alloc.free(p);
  f.alloc.free(more[0]);
}

TEST(SleepWake, DiscardedContentsAreNotCopiedAndReadAsFreshMemory) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {4 * kMiB, 100 * 1024});
  f.fill(ptrs[0], 4 * kMiB, 1);
  f.fill(ptrs[1], 100 * 1024, 2);
  f.alloc.sleep_pool(kPool, SleepMode::kDiscard);
  EXPECT_EQ(f.alloc.pool_sleep_info(kPool).saved_bytes, 0u);
  EXPECT_EQ(f.driver.host_bytes(), 0u);
  EXPECT_EQ(f.driver.used_bytes(), 0u);
  f.alloc.wake_pool(kPool);
  EXPECT_EQ(f.read(ptrs[0], 4 * kMiB), std::vector<unsigned char>(4 * kMiB, 0));
  EXPECT_EQ(f.read(ptrs[1], 100 * 1024), std::vector<unsigned char>(100 * 1024, 0));
  const sim::Counters c = f.driver.counters();
  EXPECT_EQ(c.copies_to_host + c.copies_to_device + c.host_allocates, 0u);
  EXPECT_EQ(f.alloc.pool_live_allocations(kPool), ptrs);
  f.alloc.free(ptrs[0]);
  f.alloc.free(ptrs[1]);
}

TEST(SleepWake, WhollyFreeCachedSegmentsGoBackEntirelyAtSleep) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {4 * kMiB, 30 * kMiB, 1024});
  f.alloc.free(ptrs[1]);  // its 30 MiB segment is now wholly free, cached in the pool
  EXPECT_EQ(f.alloc.pool_segments(kPool).size(), 3u);
  const std::uint64_t reservations = f.driver.counters().reserve_calls;
  f.alloc.sleep_pool(kPool, SleepMode::kSave);
  const std::vector<SegmentInfo> left = f.alloc.pool_segments(kPool);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].total_size + left[1].total_size, 22 * kMiB);
  EXPECT_EQ(f.alloc.pool_sleep_info(kPool).segment_bytes, 22 * kMiB);
  EXPECT_EQ(f.driver.counters().address_frees, 1u);  // the free segment's reservation
  EXPECT_EQ(f.driver.counters().reserve_calls, reservations);
  f.alloc.wake_pool(kPool);
  f.alloc.free(ptrs[0]);
  f.alloc.free(ptrs[2]);
}

TEST(SleepWake, FreesWhileAsleepAreBookkeepingAndTheirContentsAreDropped) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  // a and b share a 20 MiB segment; c has its own.
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {4 * kMiB, 4 * kMiB, 40 * kMiB});
  for (std::size_t i = 0; i < ptrs.size(); ++i)
    f.fill(ptrs[i], 4 * kMiB, static_cast<unsigned>(i + 10));
  f.alloc.sleep_pool(kPool, SleepMode::kSave);
  const sim::Counters before = f.driver.counters();
  f.alloc.free(ptrs[1]);
  f.alloc.free(ptrs[2]);  // its segment is wholly free now, still asleep
  const sim::Counters after = f.driver.counters();
  EXPECT_EQ(after.unmaps, before.unmaps);  // no driver call touched memory
  EXPECT_EQ(after.free_calls, before.free_calls);
  EXPECT_EQ(after.copies_to_device, before.copies_to_device);
  EXPECT_EQ(f.alloc.pool_live_allocations(kPool), std::vector<DevicePtr>{ptrs[0]});
  EXPECT_EQ(f.stat("allocated_bytes.all.current"), static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(f.stat("reserved_bytes.all.current"), 0);
  EXPECT_THROW(f.alloc.free(ptrs[1]), InvalidPointerError);  // freed already

  f.alloc.wake_pool(kPool);
  // The wholly free segment did not get memory again: its reservation went back.
  const std::vector<SegmentInfo> segs = f.alloc.pool_segments(kPool);
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].total_size, 20 * kMiB);
  EXPECT_EQ(f.stat("reserved_bytes.all.current"), static_cast<std::int64_t>(20 * kMiB));
  EXPECT_EQ(f.driver.counters().copies_to_device, 1u);  // only the live allocation
  EXPECT_EQ(f.read(ptrs[0], 4 * kMiB), pattern(4 * kMiB, 10));
  // b's bytes were not restored: its range is fresh memory.
  EXPECT_EQ(f.read(ptrs[1], 4 * kMiB), std::vector<unsigned char>(4 * kMiB, 0));
  f.alloc.free(ptrs[0]);
}

TEST(SleepWake, EmptyCacheAndReleasePoolWhileAsleep) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {4 * kMiB, 40 * kMiB});
  f.alloc.sleep_pool(kPool, SleepMode::kSave);
  f.alloc.free(ptrs[1]);
  // In use: empty_cache leaves the pool alone, as for any pool in use.
  f.alloc.empty_cache();
  f.alloc.empty_cache(kPool);
  EXPECT_EQ(f.alloc.pool_segments(kPool).size(), 2u);
  // Released (create_sleepable_pool's use and begin_allocate_to_pool's): its wholly free
  // segments go, reservation and all; the rest waits.
  f.alloc.release_pool(kPool);
  f.alloc.release_pool(kPool);
  f.alloc.empty_cache(kPool);
  EXPECT_EQ(f.alloc.pool_segments(kPool).size(), 1u);
  EXPECT_EQ(f.stat("reserved_bytes.all.current"), 0);
  EXPECT_TRUE(f.alloc.pool_asleep(kPool));
  // Its last allocation freed, the released pool disappears with its last segment, and
  // its saved contents with it.
  f.alloc.free(ptrs[0]);
  EXPECT_GT(f.driver.host_bytes(), 0u);
  f.alloc.empty_cache();
  EXPECT_EQ(f.driver.host_bytes(), 0u);
  EXPECT_NE(message_of<Error>([&] { f.alloc.pool_asleep(kPool); }).find("no private pool (0, 5)"),
            std::string::npos);
  EXPECT_EQ(f.driver.counters().reserve_calls, f.driver.counters().address_frees);
}

TEST(SleepWake, RefusedCallsChangeNothing) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  f.alloc.create_pool(kOther);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {4 * kMiB});
  const DevicePtr plain = f.alloc.malloc(kMiB);
  const auto state = [&] {
    return std::make_tuple(f.alloc.memory_stats(), f.driver.used_bytes(),
                           f.alloc.pool_live_allocations(kPool));
  };
  const auto expect_error = [&](auto&& call, const std::string& words) {
    const auto before = state();
    const std::string m = message_of<Error>(call);
    EXPECT_NE(m.find(words), std::string::npos) << m;
    EXPECT_EQ(state(), before) << m;
    f.alloc.check_invariants();
  };
  expect_error([&] { f.alloc.wake_pool(kPool); }, "pool (0, 5) is not asleep");
  expect_error([&] { f.alloc.sleep_pool(PoolId{}, SleepMode::kSave); }, "default pool");
  expect_error([&] { f.alloc.wake_pool(PoolId{}); }, "default pool");
  expect_error([&] { f.alloc.pool_asleep(PoolId{}); }, "default pool");
  expect_error(
      [&] {
        f.alloc.sleep_pool(PoolId{0, 77}, SleepMode::kSave);
      },
      "no private pool (0, 77)");
  expect_error([&] { f.alloc.sleep_pool(kOther, SleepMode::kDiscard); },
               "pool (0, 6) is not sleepable");
  expect_error([&] { f.alloc.create_sleepable_pool(kOther); },
               "pool (0, 6) already exists and is not sleepable");
  expect_error([&] { f.alloc.create_sleepable_pool(PoolId{}); }, "default pool");
  EXPECT_FALSE(f.alloc.pool_asleep(kOther));

  // Capturing into the pool, or into another pool: the device cannot be synchronized.
  f.alloc.begin_allocate_to_pool(kPool, [](StreamId s) { return s == 1; });
  expect_error([&] { f.alloc.sleep_pool(kPool, SleepMode::kSave); },
               "pool (0, 5) is being allocated to");
  f.alloc.end_allocate_to_pool(kPool);
  f.alloc.begin_allocate_to_pool(kOther, [](StreamId s) { return s == 1; });
  expect_error([&] { f.alloc.sleep_pool(kPool, SleepMode::kSave); },
               "a capture into pool (0, 6) is underway");
  f.alloc.end_allocate_to_pool(kOther);

  f.alloc.sleep_pool(kPool, SleepMode::kSave);
  expect_error([&] { f.alloc.sleep_pool(kPool, SleepMode::kSave); },
               "pool (0, 5) is already asleep");
  // Allocating to a sleeping pool.
  const int uses = f.alloc.pool_use_count(kPool);
  expect_error([&] { f.alloc.begin_allocate_to_pool(kPool, [](StreamId) { return true; }); },
               "pool (0, 5) is asleep");
  EXPECT_EQ(f.alloc.pool_use_count(kPool), uses);
  f.alloc.begin_allocate_to_pool(kOther, [](StreamId s) { return s == 1; });
  expect_error([&] { f.alloc.wake_pool(kPool); }, "a capture into pool (0, 6) is underway");
  f.alloc.end_allocate_to_pool(kOther);
  f.alloc.wake_pool(kPool);
  EXPECT_EQ(f.allocate_in(kPool, {kMiB}).size(), 1u);
  f.alloc.free(plain);
}

TEST(SleepWake, WakeWithoutDeviceMemoryLeavesThePoolAsleepAndTheAllocatorUsable) {
  Fixture f(256 * kMiB);
  f.alloc.create_sleepable_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {100 * kMiB});
  f.fill(ptrs[0], 100 * kMiB, 3);
  f.alloc.sleep_pool(kPool, SleepMode::kSave);
  const DevicePtr big = f.alloc.malloc(160 * kMiB, 0);
  std::vector<std::size_t> observed;  // what OOM observers were told was asked for
  f.alloc.add_oom_observer([&observed](int, std::size_t requested, std::size_t, std::size_t) {
    observed.push_back(requested);
  });
  const auto stats = f.alloc.memory_stats();
  const std::string m = message_of<OutOfMemoryError>([&] { f.alloc.wake_pool(kPool); });
  EXPECT_NE(m.find("wake_pool of pool (0, 5) needs 100.00 MiB"), std::string::npos) << m;
  EXPECT_NE(m.find("The pool stays asleep"), std::string::npos) << m;
  EXPECT_TRUE(f.alloc.pool_asleep(kPool));
  EXPECT_EQ(f.alloc.pool_sleep_info(kPool).physical_bytes, 0u);
  EXPECT_EQ(f.driver.used_bytes(), 160 * kMiB);
  EXPECT_EQ(f.stat("reserved_bytes.all.current"), stats.at("reserved_bytes.all.current"));
  EXPECT_EQ(f.stat("num_ooms"), 1);
  EXPECT_EQ(observed, std::vector<std::size_t>{100 * kMiB});
  // Usable: other allocations come and go.
  const DevicePtr small = f.alloc.malloc(kMiB, 0);
  f.alloc.free(small);
  // Freed but cached: the wake empties the default pool's cache before giving up.
  f.alloc.free(big);
  f.alloc.wake_pool(kPool);
  EXPECT_EQ(f.stat("num_alloc_retries"), 2);
  EXPECT_EQ(f.read(ptrs[0], 100 * kMiB), pattern(100 * kMiB, 3));
  EXPECT_EQ(f.driver.used_bytes(), 100 * kMiB);
  f.alloc.free(ptrs[0]);
}

TEST(SleepWake, WakeBeyondTheMemoryFractionIsOutOfMemory) {
  Fixture f(kGiB);
  f.alloc.create_sleepable_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {200 * kMiB});
  f.alloc.sleep_pool(kPool, SleepMode::kDiscard);
  f.alloc.set_memory_fraction(0.1);
  const std::string m = message_of<OutOfMemoryError>([&] { f.alloc.wake_pool(kPool); });
  EXPECT_NE(m.find("per-process limit"), std::string::npos) << m;
  EXPECT_TRUE(f.alloc.pool_asleep(kPool));
  EXPECT_EQ(f.driver.counters().physical_creates, 1u);  // the first mapping only
  f.alloc.set_memory_fraction(1.0);
  f.alloc.wake_pool(kPool);
  f.alloc.free(ptrs[0]);
}

TEST(SleepWake, NoPinnedHostMemoryMeansNoSleep) {
  sim::Options o;
  o.capacity = kGiB;
  o.host_capacity = 3 * kMiB;
  sim::SimDriver driver(o);
  Allocator alloc(driver, Config::parse("pytorch"));
  alloc.set_check_invariants(true);
  alloc.create_sleepable_pool(kPool);
  alloc.begin_allocate_to_pool(kPool, [](StreamId) { return true; });
  const DevicePtr p = alloc.malloc(4 * kMiB);
  alloc.end_allocate_to_pool(kPool);
  const std::size_t used = driver.used_bytes();
  const std::string m =
      message_of<OutOfMemoryError>([&] { alloc.sleep_pool(kPool, SleepMode::kSave); });
  EXPECT_NE(m.find("pinned host memory"), std::string::npos) << m;
  EXPECT_NE(m.find("pool (0, 5); the pool is unchanged"), std::string::npos) << m;
  EXPECT_FALSE(alloc.pool_asleep(kPool));
  EXPECT_EQ(driver.used_bytes(), used);
  alloc.sleep_pool(kPool, SleepMode::kDiscard);  // needs no host memory
  alloc.wake_pool(kPool);
  alloc.free(p);
}

TEST(SleepWake, SleepWaitsForFreesPendingOnOtherStreams) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {4 * kMiB, 4 * kMiB}, 1);
  f.alloc.record_stream(ptrs[1], 2);
  f.alloc.free(ptrs[1]);  // waits for an event on stream 2
  EXPECT_EQ(f.stat("active_bytes.all.current"), static_cast<std::int64_t>(8 * kMiB));
  f.alloc.sleep_pool(kPool, SleepMode::kSave);
  // The free completed before the contents were saved: only a is saved.
  EXPECT_EQ(f.stat("active_bytes.all.current"), static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(f.alloc.pool_sleep_info(kPool).saved_bytes, 4 * kMiB);
  EXPECT_EQ(f.driver.counters().device_synchronizes, 1u);
  f.alloc.wake_pool(kPool);
  f.alloc.free(ptrs[0]);
}

TEST(SleepWake, ASleepingUseOnOomPoolLendsNothing) {
  Fixture f(kGiB);
  f.alloc.create_sleepable_pool(kPool);
  f.alloc.set_pool_use_on_oom(kPool, true);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {2 * kMiB}, 0);  // 20 MiB segment
  f.alloc.sleep_pool(kPool, SleepMode::kDiscard);
  const DevicePtr fill = f.alloc.malloc(kGiB - 2 * kMiB, 0);
  // 4 MiB fits the pool's free block, but its memory sleeps: out of memory instead. The
  // message counts neither the sleeping allocation nor its free blocks as reserved memory.
  const std::string m = message_of<OutOfMemoryError>([&] { f.alloc.malloc(4 * kMiB, 0); });
  EXPECT_NE(m.find("out of memory"), std::string::npos) << m;
  EXPECT_NE(m.find("Of the allocated memory 1022.00 MiB is allocated by PyTorch, and 0 bytes "
                   "is reserved by PyTorch but unallocated"),
            std::string::npos)
      << m;
  f.alloc.free(fill);
  f.alloc.empty_cache();
  f.alloc.wake_pool(kPool);
  const DevicePtr later = f.alloc.malloc(4 * kMiB, 0);
  f.alloc.free(later);
  f.alloc.free(ptrs[0]);
}

TEST(SleepWake, ExpandableSegmentsConfigStillGivesTheSleepablePoolWholeSegments) {
  Fixture f(kGiB, "expandable_segments:True");
  f.alloc.create_sleepable_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {3 * kMiB, 50 * kMiB});
  f.fill(ptrs[1], 50 * kMiB, 4);
  const DevicePtr plain = f.alloc.malloc(3 * kMiB, 0);  // an expandable segment
  for (const SegmentInfo& s : f.alloc.pool_segments(kPool))
    EXPECT_FALSE(s.is_expandable);
  const std::int64_t reserved = f.stat("reserved_bytes.all.current");
  f.alloc.sleep_pool(kPool, SleepMode::kSave);
  EXPECT_EQ(f.stat("reserved_bytes.all.current"), reserved - static_cast<std::int64_t>(70 * kMiB));
  f.alloc.wake_pool(kPool);
  EXPECT_EQ(f.read(ptrs[1], 50 * kMiB), pattern(50 * kMiB, 4));
  f.alloc.free(plain);
  f.alloc.free(ptrs[0]);
  f.alloc.free(ptrs[1]);
}

TEST(SleepWake, SnapshotsMarkSleepingSegmentsAndTheirFilesKeepTheMark) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {4 * kMiB});
  const DevicePtr plain = f.alloc.malloc(kMiB, 0);
  f.alloc.sleep_pool(kPool, SleepMode::kDiscard);
  const Snapshot snap = f.alloc.snapshot();
  ASSERT_EQ(snap.segments.size(), 2u);
  // Sorted by address: the reservation (0x6000...) before the default pool's segment.
  EXPECT_TRUE(snap.segments[0].is_asleep);
  EXPECT_EQ(snap.segments[0].pool_id, (std::pair<std::int64_t, std::int64_t>{0, 5}));
  EXPECT_FALSE(snap.segments[1].is_asleep);
  for (const char* name : {"s.json", "s.pickle"}) {
    ccalloc_test::TempDir dir;
    const std::string path = dir.file(name);
    io::write_snapshot(path, snap);
    const Snapshot back = io::read_snapshot(path);
    ASSERT_EQ(back.segments.size(), 2u);
    EXPECT_TRUE(back.segments[0].is_asleep) << name;
    EXPECT_FALSE(back.segments[1].is_asleep) << name;
  }
  f.alloc.wake_pool(kPool);
  EXPECT_FALSE(f.alloc.snapshot().segments[0].is_asleep);
  f.alloc.free(ptrs[0]);
  f.alloc.free(plain);
}

TEST(SleepWake, ASleepablePoolIsAPoolLikeAnyOther) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  f.alloc.create_sleepable_pool(kPool);  // a second use
  EXPECT_EQ(f.alloc.pool_use_count(kPool), 2);
  f.alloc.create_pool(kPool);  // create_pool adds a use to any existing pool
  EXPECT_EQ(f.alloc.pool_use_count(kPool), 3);
  // Its segments never serve the default pool, and its allocations are its own.
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {4 * kMiB});
  EXPECT_EQ(f.alloc.segment_pool(ptrs[0]), kPool);
  f.alloc.free(ptrs[0]);
  const DevicePtr d = f.alloc.malloc(4 * kMiB, 0);
  EXPECT_EQ(f.alloc.segment_pool(d), PoolId{});
  f.alloc.free(d);
  // Sleeping and waking a pool with no allocations.
  f.alloc.sleep_pool(kPool, SleepMode::kSave);
  EXPECT_TRUE(f.alloc.pool_segments(kPool).empty());
  f.alloc.wake_pool(kPool);
  for (int i = 0; i < 4; ++i)  // three creates and one begin_allocate_to_pool
    f.alloc.release_pool(kPool);
  f.alloc.empty_cache();
  EXPECT_EQ(f.driver.used_bytes(), 0u);
}

TEST(SleepWake, RepeatedCyclesKeepContentsAndReturnEverything) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {512, 2 * kMiB, 21 * kMiB});
  const std::vector<std::size_t> sizes = {512, 2 * kMiB, 21 * kMiB};
  for (unsigned cycle = 0; cycle < 4; ++cycle) {
    for (std::size_t i = 0; i < ptrs.size(); ++i)
      f.fill(ptrs[i], sizes[i], cycle * 10 + static_cast<unsigned>(i));
    f.alloc.sleep_pool(kPool, SleepMode::kSave);
    const DevicePtr other = f.alloc.malloc(512 * kMiB, 0);
    f.alloc.free(other);
    f.alloc.empty_cache();
    f.alloc.wake_pool(kPool);
    for (std::size_t i = 0; i < ptrs.size(); ++i) {
      EXPECT_EQ(f.read(ptrs[i], sizes[i]),
                pattern(sizes[i], cycle * 10 + static_cast<unsigned>(i)));
    }
  }
  for (const DevicePtr p : ptrs)
    f.alloc.free(p);
  f.alloc.release_pool(kPool);  // create_sleepable_pool's use
  f.alloc.release_pool(kPool);  // begin_allocate_to_pool's
  f.alloc.empty_cache();
  EXPECT_EQ(f.driver.used_bytes(), 0u);
  EXPECT_EQ(f.driver.host_bytes(), 0u);
  const sim::Counters c = f.driver.counters();
  EXPECT_EQ(c.physical_creates, c.physical_releases);
  EXPECT_EQ(c.reserve_calls, c.address_frees);
  EXPECT_EQ(c.host_allocates, c.host_frees);
}

TEST(SleepWake, DestroyingTheAllocatorReturnsSleepingMemoryAndSavedContents) {
  sim::SimDriver driver;
  {
    Allocator alloc(driver, Config::parse("pytorch"));
    alloc.create_sleepable_pool(kPool);
    alloc.begin_allocate_to_pool(kPool, [](StreamId) { return true; });
    alloc.malloc(4 * kMiB);
    alloc.malloc(30 * kMiB);
    alloc.end_allocate_to_pool(kPool);
    alloc.sleep_pool(kPool, SleepMode::kSave);
  }
  const sim::Counters c = driver.counters();
  EXPECT_EQ(c.reserve_calls, c.address_frees);
  EXPECT_EQ(c.physical_creates, c.physical_releases);
  EXPECT_EQ(driver.host_bytes(), 0u);
  EXPECT_EQ(driver.used_bytes(), 0u);
}

TEST(SleepWake, AllocationsOfSleepablePoolsCannotBeShared) {
  Fixture f;
  f.alloc.create_sleepable_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {4 * kMiB});
  const std::string m = message_of<Error>([&] { ipc::export_handle(f.alloc, ptrs[0]); });
  EXPECT_NE(m.find("sleepable pool (0, 5)"), std::string::npos) << m;
  f.alloc.free(ptrs[0]);
}

TEST(SleepWake, BackendsWithoutPoolsRefuseNamingThemselves) {
  sim::SimDriver driver;
  Allocator async(driver, Config::parse("backend:cudaMallocAsync"));
  EXPECT_NE(
      message_of<Error>([&] { async.create_sleepable_pool(kPool); }).find("create_sleepable_pool"),
      std::string::npos);
  Allocator uncached(driver, Config::parse("uncached:True"));
  EXPECT_NE(message_of<Error>([&] { uncached.create_sleepable_pool(kPool); }).find("uncached"),
            std::string::npos);
}

}  // namespace
}  // namespace ccalloc
