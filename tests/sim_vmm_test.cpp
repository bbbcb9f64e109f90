// Specification of the simulated GPU's virtual memory and stream-ordered pool
// (include/ccalloc/sim.hpp, docs/simulated-gpu.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "test_support.hpp"

namespace ccalloc::sim {
namespace {

using ccalloc_test::message_of;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr DevicePtr kVm = DevicePtr{0x600000000000};    // first reservation
constexpr DevicePtr kPool = DevicePtr{0x400000000000};  // first pool address
constexpr DevicePtr kDevice = DevicePtr{0x7f0000000000};

Options with_capacity(std::size_t capacity) {
  Options o;
  o.capacity = capacity;
  return o;
}

#define EXPECT_DRIVER_ERROR(stmt, text)                                  \
  do {                                                                   \
    const std::string message_ = message_of<DriverError>([&] { stmt; }); \
    EXPECT_NE(message_.find(text), std::string::npos) << message_;       \
  } while (0)

// ---------------------------------------------------------------------------------------
// Options

TEST(SimVmm, GranularityIsTwoMiBAndConfigurable) {
  SimDriver d;
  EXPECT_EQ(d.vm_granularity(), 2 * kMiB);
  Options o;
  o.vm_granularity = 4 * kMiB;
  EXPECT_EQ(SimDriver(o).vm_granularity(), 4 * kMiB);
}

TEST(SimVmm, RejectsGranularityThatIsNotAPowerOfTwoOfAtLeastOneMiB) {
  for (std::size_t g : {std::size_t{0}, 3 * kMiB, kMiB / 2}) {
    Options o;
    o.vm_granularity = g;
    EXPECT_THROW(SimDriver{o}, DriverError) << g;
  }
  Options o;
  o.vm_granularity = kMiB;
  EXPECT_NO_THROW(SimDriver{o});
}

TEST(SimVmm, RejectsZeroBaseAddresses) {
  Options a;
  a.vm_base_address = 0;
  EXPECT_THROW(SimDriver{a}, DriverError);
  Options b;
  b.pool_base_address = 0;
  EXPECT_THROW(SimDriver{b}, DriverError);
}

// ---------------------------------------------------------------------------------------
// Reservations

TEST(SimVmm, ReservesLowestFreeAddressFromVmBase) {
  SimDriver d;
  EXPECT_EQ(d.reserve_address_range(4 * kMiB), kVm);
  EXPECT_EQ(d.reserve_address_range(2 * kMiB), kVm + 4 * kMiB);
  d.free_address_range(kVm, 4 * kMiB);
  EXPECT_EQ(d.reserve_address_range(2 * kMiB), kVm);             // lowest gap first
  EXPECT_EQ(d.reserve_address_range(4 * kMiB), kVm + 6 * kMiB);  // the 2 MiB gap is too small
  EXPECT_EQ(d.reserve_address_range(2 * kMiB), kVm + 2 * kMiB);
  EXPECT_EQ(d.counters().reserve_calls, 5u);
  EXPECT_EQ(d.counters().address_frees, 1u);
}

TEST(SimVmm, ReservationsDoNotCountAgainstCapacity) {
  SimDriver d(with_capacity(8 * kMiB));
  EXPECT_EQ(d.reserve_address_range(64 * kGiB), kVm);
  EXPECT_EQ(d.mem_info().free_bytes, 8 * kMiB);
  EXPECT_EQ(d.used_bytes(), 0u);
  EXPECT_NE(d.allocate(8 * kMiB), 0u);
}

TEST(SimVmm, ReserveRejectsSizesThatAreNotPositiveMultiplesOfTheGranularity) {
  SimDriver d;
  EXPECT_DRIVER_ERROR(d.reserve_address_range(0), "2097152 bytes");
  EXPECT_DRIVER_ERROR(d.reserve_address_range(kMiB), "reserve_address_range of 1048576 bytes");
  EXPECT_DRIVER_ERROR(d.reserve_address_range(3 * kMiB), "multiple of the granularity");
  EXPECT_EQ(d.counters().reserve_calls, 0u);  // rejected calls are not counted
}

TEST(SimVmm, ReservationsAndDeviceAllocationsNeverOverlap) {
  Options o;
  o.base_address = kVm;  // both start at the same address
  SimDriver d(o);
  EXPECT_EQ(d.allocate(4 * kMiB), kVm);
  EXPECT_EQ(d.reserve_address_range(2 * kMiB), kVm + 4 * kMiB);
  EXPECT_EQ(d.allocate(1), kVm + 6 * kMiB);
  d.free(kVm, 4 * kMiB);
  EXPECT_EQ(d.reserve_address_range(4 * kMiB), kVm);
}

TEST(SimVmm, OracleAddressOverlappingAReservationDivergesTheOracle) {
  SimDriver d;
  const DevicePtr r = d.reserve_address_range(4 * kMiB);
  d.set_address_oracle({{r + 2 * kMiB, kMiB}});
  EXPECT_EQ(d.allocate(kMiB), kDevice);
  EXPECT_TRUE(d.oracle_diverged());
}

TEST(SimVmm, FreeAddressRangeNeedsTheExactReservationWithNothingMapped) {
  SimDriver d;
  const DevicePtr r = d.reserve_address_range(8 * kMiB);
  EXPECT_DRIVER_ERROR(d.free_address_range(r + 2 * kMiB, 6 * kMiB),
                      "no reservation starts at 0x600000200000");
  EXPECT_DRIVER_ERROR(d.free_address_range(r, 4 * kMiB),
                      "the reservation at 0x600000000000 has 8388608 bytes");
  const PhysicalHandle h = d.create_physical(2 * kMiB);
  d.map(r + 4 * kMiB, 2 * kMiB, h);
  EXPECT_DRIVER_ERROR(d.free_address_range(r, 8 * kMiB),
                      "[0x600000400000, 0x600000600000) (2097152 bytes) is still mapped");
  d.unmap(r + 4 * kMiB, 2 * kMiB);
  d.free_address_range(r, 8 * kMiB);
  EXPECT_DRIVER_ERROR(d.free_address_range(r, 8 * kMiB), "no reservation starts at");
  EXPECT_EQ(d.counters().address_frees, 1u);
}

// ---------------------------------------------------------------------------------------
// Physical memory

TEST(SimVmm, PhysicalMemoryCountsAgainstCapacity) {
  SimDriver d(with_capacity(8 * kMiB));
  EXPECT_EQ(d.create_physical(4 * kMiB), 1u);
  EXPECT_EQ(d.create_physical(2 * kMiB), 2u);
  EXPECT_EQ(d.mem_info().free_bytes, 2 * kMiB);
  EXPECT_EQ(d.used_bytes(), 6 * kMiB);
  EXPECT_EQ(d.create_physical(4 * kMiB), 0u);  // OOM is a value
  EXPECT_EQ(d.allocate(4 * kMiB), 0u);         // device allocations share the capacity
  EXPECT_EQ(d.create_physical(2 * kMiB), 3u);
  d.release_physical(1, 4 * kMiB);
  EXPECT_EQ(d.mem_info().free_bytes, 4 * kMiB);
  EXPECT_EQ(d.create_physical(4 * kMiB), 4u);  // handles are never reused
  const Counters c = d.counters();
  EXPECT_EQ(c.physical_creates, 5u);
  EXPECT_EQ(c.physical_create_ooms, 1u);
  EXPECT_EQ(c.physical_releases, 1u);
  EXPECT_EQ(c.allocate_ooms, 1u);
}

TEST(SimVmm, CreatePhysicalRejectsSizesThatAreNotMultiplesOfTheGranularity) {
  SimDriver d;
  EXPECT_DRIVER_ERROR(d.create_physical(0), "create_physical of 0 bytes");
  EXPECT_DRIVER_ERROR(d.create_physical(3 * kMiB), "multiple of the granularity (2097152 bytes)");
  EXPECT_EQ(d.counters().physical_creates, 0u);
}

TEST(SimVmm, ReleasePhysicalNeedsAnUnmappedHandleOfItsSize) {
  SimDriver d;
  const DevicePtr r = d.reserve_address_range(2 * kMiB);
  const PhysicalHandle h = d.create_physical(2 * kMiB);
  EXPECT_DRIVER_ERROR(d.release_physical(99, 2 * kMiB), "handle 99 (2097152 bytes): no such");
  EXPECT_DRIVER_ERROR(d.release_physical(h, 4 * kMiB), "it was created with 2097152 bytes");
  d.map(r, 2 * kMiB, h);
  EXPECT_DRIVER_ERROR(d.release_physical(h, 2 * kMiB), "still mapped at 0x600000000000");
  d.unmap(r, 2 * kMiB);
  d.release_physical(h, 2 * kMiB);
  EXPECT_DRIVER_ERROR(d.release_physical(h, 2 * kMiB), "already released");
  EXPECT_EQ(d.used_bytes(), 0u);
}

// ---------------------------------------------------------------------------------------
// Mappings

TEST(SimVmm, MapsOneHandlePerPageAndUnmapsContiguousMappingsTogether) {
  SimDriver d;
  const DevicePtr r = d.reserve_address_range(8 * kMiB);
  const PhysicalHandle h1 = d.create_physical(2 * kMiB);
  const PhysicalHandle h2 = d.create_physical(2 * kMiB);
  const PhysicalHandle h3 = d.create_physical(4 * kMiB);
  d.map(r, 2 * kMiB, h1);
  d.map(r + 2 * kMiB, 2 * kMiB, h2);
  d.map(r + 4 * kMiB, 4 * kMiB, h3);
  d.unmap(r, 4 * kMiB);  // two mappings at once
  d.unmap(r + 4 * kMiB, 4 * kMiB);
  d.map(r + 6 * kMiB, 2 * kMiB, h1);  // unmapped handles map again, anywhere
  d.unmap(r + 6 * kMiB, 2 * kMiB);
  const Counters c = d.counters();
  EXPECT_EQ(c.maps, 4u);
  EXPECT_EQ(c.unmaps, 3u);
  EXPECT_EQ(d.used_bytes(), 8 * kMiB);  // mapping does not change what physical memory holds
}

TEST(SimVmm, MapRejectsUnalignedAddressesAndSizes) {
  SimDriver d;
  const DevicePtr r = d.reserve_address_range(8 * kMiB);
  const PhysicalHandle h = d.create_physical(2 * kMiB);
  EXPECT_DRIVER_ERROR(d.map(r + kMiB, 2 * kMiB, h),
                      "map of handle 1 at [0x600000100000, 0x600000300000) (2097152 bytes): the "
                      "address and size must be multiples of the granularity");
  EXPECT_DRIVER_ERROR(d.map(r, kMiB, h), "multiples of the granularity");
  EXPECT_DRIVER_ERROR(d.map(r, 0, h), "multiples of the granularity");
  EXPECT_EQ(d.counters().maps, 0u);
}

TEST(SimVmm, MapRejectsRangesOutsideOneReservation) {
  SimDriver d;
  const DevicePtr a = d.reserve_address_range(2 * kMiB);
  const DevicePtr b = d.reserve_address_range(2 * kMiB);
  ASSERT_EQ(b, a + 2 * kMiB);
  const PhysicalHandle h = d.create_physical(4 * kMiB);
  const PhysicalHandle small = d.create_physical(2 * kMiB);
  EXPECT_DRIVER_ERROR(d.map(a, 4 * kMiB, h), "not inside one reserved address range");  // spans two
  EXPECT_DRIVER_ERROR(d.map(a - 2 * kMiB, 2 * kMiB, small), "not inside one reserved");
  EXPECT_DRIVER_ERROR(d.map(b + 2 * kMiB, 2 * kMiB, small), "not inside one reserved");
  EXPECT_DRIVER_ERROR(d.map(kDevice, 2 * kMiB, small), "not inside one reserved");
}

TEST(SimVmm, MapRejectsOverlapWithAnExistingMapping) {
  SimDriver d;
  const DevicePtr r = d.reserve_address_range(8 * kMiB);
  const PhysicalHandle big = d.create_physical(4 * kMiB);
  const PhysicalHandle other = d.create_physical(4 * kMiB);
  const PhysicalHandle page = d.create_physical(2 * kMiB);
  d.map(r + 2 * kMiB, 4 * kMiB, big);
  EXPECT_DRIVER_ERROR(d.map(r + 4 * kMiB, 2 * kMiB, page),
                      "overlaps the mapping [0x600000200000, 0x600000600000) (4194304 bytes) of "
                      "handle 1");
  EXPECT_DRIVER_ERROR(d.map(r, 4 * kMiB, other), "overlaps the mapping [0x600000200000");
  d.map(r, 2 * kMiB, page);  // the gap below is free
}

TEST(SimVmm, MapRejectsUnknownMappedOrMismatchedHandles) {
  SimDriver d;
  const DevicePtr r = d.reserve_address_range(8 * kMiB);
  const PhysicalHandle h = d.create_physical(2 * kMiB);
  EXPECT_DRIVER_ERROR(d.map(r, 2 * kMiB, 42), "no such physical allocation");
  EXPECT_DRIVER_ERROR(d.map(r, 4 * kMiB, h),
                      "the handle has 2097152 bytes, and a mapping covers a whole physical");
  d.map(r, 2 * kMiB, h);
  EXPECT_DRIVER_ERROR(d.map(r + 2 * kMiB, 2 * kMiB, h), "already mapped at 0x600000000000");
  d.unmap(r, 2 * kMiB);
  d.release_physical(h, 2 * kMiB);
  EXPECT_DRIVER_ERROR(d.map(r, 2 * kMiB, h), "already released");
}

TEST(SimVmm, UnmapMustCoverWholeContiguousMappings) {
  SimDriver d;
  const DevicePtr r = d.reserve_address_range(16 * kMiB);
  const PhysicalHandle a = d.create_physical(4 * kMiB);
  const PhysicalHandle b = d.create_physical(2 * kMiB);
  d.map(r, 4 * kMiB, a);
  d.map(r + 8 * kMiB, 2 * kMiB, b);  // a gap of 4 MiB between them
  EXPECT_DRIVER_ERROR(d.unmap(r, 2 * kMiB),
                      "unmap of [0x600000000000, 0x600000200000) (2097152 bytes): it ends inside "
                      "the mapping [0x600000000000, 0x600000400000)");
  EXPECT_DRIVER_ERROR(d.unmap(r + 2 * kMiB, 2 * kMiB), "it starts inside the mapping");
  EXPECT_DRIVER_ERROR(d.unmap(r + 4 * kMiB, 2 * kMiB), "nothing is mapped at 0x600000400000");
  EXPECT_DRIVER_ERROR(d.unmap(r, 10 * kMiB), "0x600000400000 is not mapped");  // the gap
  EXPECT_DRIVER_ERROR(d.unmap(r, 0), "the size must be positive");
  EXPECT_EQ(d.counters().unmaps, 0u);
  // A rejected unmap changed nothing.
  d.unmap(r, 4 * kMiB);
  d.unmap(r + 8 * kMiB, 2 * kMiB);
  EXPECT_DRIVER_ERROR(d.unmap(r, 4 * kMiB), "nothing is mapped");
}

TEST(SimVmm, CostModelChargesEachVirtualMemoryCall) {
  SimDriver d(with_capacity(2 * kMiB));
  const DevicePtr r = d.reserve_address_range(2 * kMiB);  // 1.71
  const PhysicalHandle h = d.create_physical(2 * kMiB);   // 8.02
  EXPECT_EQ(d.create_physical(2 * kMiB), 0u);             // 8.02: an OOM is still a call
  d.map(r, 2 * kMiB, h);                                  // 0.65 + 34.60
  d.unmap(r, 2 * kMiB);                                   // 26.58
  d.release_physical(h, 2 * kMiB);                        // 10.07
  d.free_address_range(r, 2 * kMiB);                      // 0
  EXPECT_DOUBLE_EQ(d.simulated_driver_us(), 1.71 + 8.02 + 8.02 + 0.65 + 34.60 + 26.58 + 10.07);
  Counters want;
  want.reserve_calls = 1;
  want.address_frees = 1;
  want.physical_creates = 2;
  want.physical_create_ooms = 1;
  want.physical_releases = 1;
  want.maps = 1;
  want.unmaps = 1;
  EXPECT_EQ(d.counters(), want);
}

// ---------------------------------------------------------------------------------------
// The stream-ordered pool: placement and rounding

constexpr StreamId kS1 = 1;
constexpr StreamId kS2 = 2;
constexpr StreamId kS3 = 3;

TEST(SimPool, SmallRequestsRoundTo512BytesAndShareAPage) {
  SimDriver d;
  EXPECT_EQ(d.allocate_async(1, kS1), kPool);
  EXPECT_EQ(d.allocate_async(513, kS1), kPool + 512);
  EXPECT_EQ(d.allocate_async(kMiB - 512, kS1), kPool + 1536);
  const PoolUsage u = d.pool_usage();
  EXPECT_EQ(u.used_current, 1 + 513 + kMiB - 512);  // requested bytes, as CUDA counts them
  EXPECT_EQ(u.reserved_current, 2 * kMiB);
  EXPECT_EQ(d.counters().pool_pages_grown, 1u);
  EXPECT_EQ(d.used_bytes(), 2 * kMiB);  // the pool's reserve counts, not its use
}

TEST(SimPool, RequestsOfOneMiBAndMoreTakeWholePages) {
  SimDriver d;
  EXPECT_EQ(d.allocate_async(kMiB, kS1), kPool);
  EXPECT_EQ(d.allocate_async(3 * kMiB, kS1), kPool + 2 * kMiB);
  EXPECT_EQ(d.allocate_async(1, kS1), kPool + 6 * kMiB);  // small pages get their own range
  const PoolUsage u = d.pool_usage();
  EXPECT_EQ(u.reserved_current, 8 * kMiB);
  EXPECT_EQ(u.used_current, kMiB + 3 * kMiB + 1);
  EXPECT_EQ(u.reserved_high, 8 * kMiB);
  EXPECT_EQ(u.used_high, u.used_current);
}

TEST(SimPool, PoolAddressesAvoidDeviceAllocationsAndReservations) {
  Options o;
  o.pool_base_address = kDevice;
  o.vm_base_address = kDevice;
  SimDriver d(o);
  EXPECT_EQ(d.allocate(2 * kMiB), kDevice);
  EXPECT_EQ(d.reserve_address_range(2 * kMiB), kDevice + 2 * kMiB);
  EXPECT_EQ(d.allocate_async(2 * kMiB, kS1), kDevice + 4 * kMiB);
  EXPECT_EQ(d.allocate(2 * kMiB), kDevice + 6 * kMiB);
}

TEST(SimPool, SmallRequestsAreBestFit) {
  SimDriver d;
  const DevicePtr a = d.allocate_async(1024, kS1);
  const DevicePtr b = d.allocate_async(512, kS1);
  const DevicePtr c = d.allocate_async(4096, kS1);
  const DevicePtr e = d.allocate_async(512, kS1);
  ASSERT_EQ(e, kPool + 5632);
  d.free_async(a, 1024, kS1);
  d.free_async(c, 4096, kS1);
  // Holes: 1024 at a, 4096 at c, and the page's tail after e.
  EXPECT_EQ(d.allocate_async(3000, kS1), c);         // 3072: the 4096 hole is the tightest
  EXPECT_EQ(d.allocate_async(1000, kS1), a);         // 1024: exact
  EXPECT_EQ(d.allocate_async(1024, kS1), c + 3072);  // the 1024 left of the 4096 hole
  EXPECT_EQ(d.allocate_async(512, kS1), e + 512);    // the tail
  (void)b;
}

TEST(SimPool, FreedNeighboursMerge) {
  SimDriver d;
  const DevicePtr a = d.allocate_async(4096, kS1);
  const DevicePtr b = d.allocate_async(4096, kS1);
  const DevicePtr c = d.allocate_async(4096, kS1);
  d.allocate_async(512, kS1);  // keeps the tail apart
  d.free_async(a, 4096, kS1);
  d.free_async(c, 4096, kS1);
  d.free_async(b, 4096, kS1);
  EXPECT_EQ(d.allocate_async(12288, kS1), a);
}

TEST(SimPool, AWhollyFreeSmallPageServesLargeRequests) {
  SimDriver d;
  const DevicePtr p = d.allocate_async(1000, kS1);
  d.free_async(p, 1000, kS1);
  EXPECT_EQ(d.allocate_async(2 * kMiB, kS1), kPool);
  EXPECT_EQ(d.pool_usage().reserved_current, 2 * kMiB);
  EXPECT_EQ(d.counters().pool_pages_grown, 1u);
}

// ---------------------------------------------------------------------------------------
// The stream-ordered pool: reuse across streams

TEST(SimPool, TheFreeingStreamReusesMemoryAtOnce) {
  SimDriver d;
  const DevicePtr p = d.allocate_async(4 * kMiB, kS1);
  d.free_async(p, 4 * kMiB, kS1);  // not complete: nothing completes by itself
  EXPECT_EQ(d.allocate_async(4 * kMiB, kS1), p);
  EXPECT_EQ(d.pool_usage().reserved_current, 4 * kMiB);
}

TEST(SimPool, OtherStreamsReuseMemoryOnlyOnceTheFreeCompleted) {
  SimDriver d;
  const DevicePtr p = d.allocate_async(4 * kMiB, kS1);
  d.free_async(p, 4 * kMiB, kS1);
  // Neither the pages nor the addresses: work queued on kS1 may still use them.
  const DevicePtr q = d.allocate_async(4 * kMiB, kS2);
  EXPECT_EQ(q, p + 4 * kMiB);
  EXPECT_EQ(d.pool_usage().reserved_current, 8 * kMiB);
  d.complete_stream(kS1);
  EXPECT_EQ(d.allocate_async(4 * kMiB, kS3), p);
  EXPECT_EQ(d.pool_usage().reserved_current, 8 * kMiB);
}

TEST(SimPool, CompletingAnEventRecordedAfterTheFreeCompletesIt) {
  SimDriver d;
  const DevicePtr p = d.allocate_async(1000, kS1);
  d.allocate_async(1000, kS1);  // keeps the page small
  d.free_async(p, 1000, kS1);
  const EventId e = d.create_event();
  d.record_event(e, kS1);
  EXPECT_NE(d.allocate_async(1000, kS2), p);
  d.complete_event(e);
  EXPECT_EQ(d.allocate_async(1000, kS2), p);
}

TEST(SimPool, AStreamThatWaitedOnAnEventAfterTheFreeReusesAtOnce) {
  SimDriver d;
  const DevicePtr p = d.allocate_async(4 * kMiB, kS1);
  const EventId before = d.create_event();
  d.record_event(before, kS1);
  d.free_async(p, 4 * kMiB, kS1);
  d.stream_wait_event(kS2, before);  // recorded before the free: not enough
  EXPECT_EQ(d.allocate_async(2 * kMiB, kS2), p + 4 * kMiB);
  const EventId after = d.create_event();
  d.record_event(after, kS1);
  d.stream_wait_event(kS2, after);
  EXPECT_EQ(d.allocate_async(4 * kMiB, kS2), p);
  EXPECT_EQ(d.pool_usage().reserved_current, 6 * kMiB);
  EXPECT_EQ(d.counters().stream_waits, 2u);
  EXPECT_EQ(d.counters().event_records, 2u);  // pool frees are not event records
}

TEST(SimPool, WaitingOnAnUnrecordedEventIsANoOp) {
  SimDriver d;
  const DevicePtr p = d.allocate_async(2 * kMiB, kS1);
  d.free_async(p, 2 * kMiB, kS1);
  d.stream_wait_event(kS2, d.create_event());
  EXPECT_NE(d.allocate_async(2 * kMiB, kS2), p);
  EXPECT_DRIVER_ERROR(d.stream_wait_event(kS2, 77), "unknown event 77");
}

TEST(SimPool, SmallBlocksFreedOnAnotherStreamAreSkipped) {
  SimDriver d;
  const DevicePtr a = d.allocate_async(1024, kS1);
  const DevicePtr b = d.allocate_async(1024, kS1);
  d.free_async(a, 1024, kS1);
  // kS2 may not use a's hole yet; it takes the untouched tail of the same page.
  EXPECT_EQ(d.allocate_async(1024, kS2), b + 1024);
  EXPECT_EQ(d.allocate_async(1024, kS1), a);
}

TEST(SimPool, MergedFreeBlocksWaitForTheFreesOfBothParts) {
  SimDriver d;
  const DevicePtr a = d.allocate_async(4096, kS1);
  const DevicePtr b = d.allocate_async(4096, kS1);
  const DevicePtr c = d.allocate_async(512, kS1);
  d.free_async(a, 4096, kS1);
  d.free_async(b, 4096, kS2);  // merges with a: the block now waits for kS1 and kS2
  EXPECT_EQ(d.allocate_async(4096, kS1), c + 512);
  d.complete_stream(kS2);
  EXPECT_EQ(d.allocate_async(4096, kS1), a);
}

TEST(SimPool, WithEventsCompletingImmediatelyEveryStreamReusesAtOnce) {
  Options o;
  o.events_complete_immediately = true;
  SimDriver d(o);
  const DevicePtr p = d.allocate_async(4 * kMiB, kS1);
  d.free_async(p, 4 * kMiB, kS1);
  EXPECT_EQ(d.allocate_async(4 * kMiB, kS2), p);
  EXPECT_EQ(d.pool_usage().reserved_current, 4 * kMiB);
}

TEST(SimPool, SynchronizeDeviceCompletesEveryFree) {
  SimDriver d;
  const DevicePtr p = d.allocate_async(4 * kMiB, kS1);
  d.free_async(p, 4 * kMiB, kS1);
  d.synchronize_device();
  EXPECT_EQ(d.allocate_async(4 * kMiB, kS2), p);
  EXPECT_EQ(d.counters().device_synchronizes, 1u);
  EXPECT_DOUBLE_EQ(d.simulated_driver_us(), 2 * 1.19 + 43.27 + 10.0);  // one growth
}

// ---------------------------------------------------------------------------------------
// The stream-ordered pool: growth and out of memory

TEST(SimPool, LargeRequestsUseAnyFreePagesSoNeverFragment) {
  SimDriver d;
  const DevicePtr a = d.allocate_async(2 * kMiB, kS1);
  const DevicePtr b = d.allocate_async(2 * kMiB, kS1);
  const DevicePtr c = d.allocate_async(2 * kMiB, kS1);
  d.allocate_async(2 * kMiB, kS1);
  d.free_async(a, 2 * kMiB, kS1);
  d.free_async(c, 2 * kMiB, kS1);
  // Two separate free pages make one 4 MiB allocation; its addresses are new, because
  // neither 2 MiB hole fits 4 MiB of contiguous address space.
  EXPECT_EQ(d.allocate_async(4 * kMiB, kS1), kPool + 8 * kMiB);
  EXPECT_EQ(d.pool_usage().reserved_current, 8 * kMiB);
  EXPECT_EQ(d.counters().pool_pages_grown, 4u);
  (void)b;
}

TEST(SimPool, GrowsOnlyByThePagesFreeMemoryLacks) {
  SimDriver d;
  const DevicePtr a = d.allocate_async(2 * kMiB, kS1);
  d.free_async(a, 2 * kMiB, kS1);
  d.allocate_async(6 * kMiB, kS1);
  EXPECT_EQ(d.pool_usage().reserved_current, 6 * kMiB);
  EXPECT_EQ(d.counters().pool_pages_grown, 3u);
  EXPECT_EQ(d.counters().pool_grows, 2u);
  EXPECT_DOUBLE_EQ(d.simulated_driver_us(), 2 * 1.19 + 2 * 43.27);  // per growth, not per page
}

TEST(SimPool, ReturnsZeroWhenGrowingWouldExceedCapacity) {
  SimDriver d(with_capacity(8 * kMiB));
  EXPECT_EQ(d.allocate_async(6 * kMiB, kS1), kPool);
  EXPECT_EQ(d.allocate_async(4 * kMiB, kS1), 0u);
  EXPECT_EQ(d.allocate_async(9 * kMiB, kS1), 0u);
  EXPECT_EQ(d.allocate_async(SIZE_MAX, kS1), 0u);
  EXPECT_EQ(d.pool_usage().reserved_current, 6 * kMiB);  // a failed request takes nothing
  EXPECT_EQ(d.pool_usage().used_current, 6 * kMiB);
  EXPECT_EQ(d.allocate_async(2 * kMiB, kS1), kPool + 6 * kMiB);
  const Counters c = d.counters();
  EXPECT_EQ(c.async_allocates, 5u);
  EXPECT_EQ(c.async_allocate_ooms, 3u);
  EXPECT_EQ(d.mem_info().free_bytes, 0u);
}

TEST(SimPool, PendingFreesOnOtherStreamsDoNotSaveARequestFromOom) {
  SimDriver d(with_capacity(4 * kMiB));
  const DevicePtr p = d.allocate_async(4 * kMiB, kS1);
  d.free_async(p, 4 * kMiB, kS1);
  EXPECT_EQ(d.allocate_async(4 * kMiB, kS2), 0u);
  d.complete_stream(kS1);
  EXPECT_EQ(d.allocate_async(4 * kMiB, kS2), p);
}

TEST(SimPool, ThePoolSharesCapacityWithDeviceAndPhysicalMemory) {
  SimDriver d(with_capacity(8 * kMiB));
  d.allocate(4 * kMiB);
  d.create_physical(2 * kMiB);
  EXPECT_EQ(d.allocate_async(4 * kMiB, kS1), 0u);
  EXPECT_EQ(d.allocate_async(2 * kMiB, kS1), kPool);
  EXPECT_EQ(d.mem_info().free_bytes, 0u);
  EXPECT_EQ(d.used_bytes(), 8 * kMiB);
  EXPECT_EQ(d.allocate(1), 0u);
}

// ---------------------------------------------------------------------------------------
// The stream-ordered pool: trimming and usage

TEST(SimPool, TrimReleasesCompletedFreePagesButKeepsAtLeastTheBytesAsked) {
  SimDriver d;
  DevicePtr p[3];
  for (DevicePtr& x : p)
    x = d.allocate_async(2 * kMiB, kS1);
  for (DevicePtr x : p)
    d.free_async(x, 2 * kMiB, kS1);
  d.pool_trim(0);  // the frees have not completed: nothing can go
  EXPECT_EQ(d.pool_usage().reserved_current, 6 * kMiB);
  d.complete_all();
  d.pool_trim(3 * kMiB);  // whole pages, never below 3 MiB
  EXPECT_EQ(d.pool_usage().reserved_current, 4 * kMiB);
  d.pool_trim(0);
  EXPECT_EQ(d.pool_usage().reserved_current, 0u);
  EXPECT_EQ(d.pool_usage().reserved_high, 6 * kMiB);
  EXPECT_EQ(d.used_bytes(), 0u);
  const Counters c = d.counters();
  EXPECT_EQ(c.pool_trims, 3u);
  EXPECT_EQ(c.pool_pages_trimmed, 3u);
  // Charged per growth and per trim that released something.
  EXPECT_DOUBLE_EQ(d.simulated_driver_us(), 3 * 1.19 + 3 * 43.27 + 2 * 36.65);
}

TEST(SimPool, TrimKeepsPagesInUse) {
  SimDriver d;
  d.allocate_async(2 * kMiB, kS1);
  const DevicePtr small = d.allocate_async(512, kS1);
  d.allocate_async(512, kS1);
  d.free_async(small, 512, kS1);
  d.synchronize_device();
  d.pool_trim(0);
  EXPECT_EQ(d.pool_usage().reserved_current, 4 * kMiB);  // a large page and a partly used one
  EXPECT_EQ(d.counters().pool_pages_trimmed, 0u);
}

TEST(SimPool, UsageTracksHighWaterMarksUntilReset) {
  SimDriver d;
  const DevicePtr p = d.allocate_async(4 * kMiB, kS1);
  const DevicePtr q = d.allocate_async(1000, kS1);
  d.free_async(p, 4 * kMiB, kS1);
  PoolUsage u = d.pool_usage();
  EXPECT_EQ(u.used_current, 1000u);
  EXPECT_EQ(u.used_high, 4 * kMiB + 1000);
  EXPECT_EQ(u.reserved_current, 6 * kMiB);
  EXPECT_EQ(u.reserved_high, 6 * kMiB);
  d.synchronize_device();
  d.pool_trim(0);
  d.pool_reset_peaks();
  u = d.pool_usage();
  EXPECT_EQ(u.reserved_current, 2 * kMiB);
  EXPECT_EQ(u.reserved_high, 2 * kMiB);  // reset to the current level
  EXPECT_EQ(u.used_high, 1000u);
  d.free_async(q, 1000, kS1);
  EXPECT_EQ(d.pool_usage().used_current, 0u);
  const Counters c = d.counters();
  EXPECT_EQ(c.pool_usage_queries, 3u);
  EXPECT_EQ(c.pool_peak_resets, 1u);
  EXPECT_EQ(c.async_frees, 2u);
}

TEST(SimPool, FreeAsyncRejectsUnknownPointersAndWrongSizes) {
  SimDriver d;
  const DevicePtr p = d.allocate_async(1000, kS1);
  EXPECT_DRIVER_ERROR(d.free_async(p + 512, 1000, kS1),
                      "free_async of pointer 0x400000000200 (1000 bytes) on stream 1: it is not a "
                      "live stream-ordered allocation");
  EXPECT_DRIVER_ERROR(d.free_async(p, 1024, kS1), "it was allocated with 1000 bytes");
  const DevicePtr dev = d.allocate(2 * kMiB);
  EXPECT_DRIVER_ERROR(d.free_async(dev, 2 * kMiB, kS1), "not a live stream-ordered allocation");
  d.free_async(p, 1000, kS1);
  EXPECT_DRIVER_ERROR(d.free_async(p, 1000, kS1), "not a live stream-ordered allocation");
  EXPECT_DRIVER_ERROR(d.allocate_async(0, kS1), "allocate_async of 0 bytes");
  EXPECT_EQ(d.counters().async_frees, 1u);
  EXPECT_EQ(d.counters().async_allocates, 1u);
}

TEST(SimPool, FreeCanBeOnAnotherStreamThanTheAllocation) {
  SimDriver d;
  const DevicePtr p = d.allocate_async(2 * kMiB, kS1);
  d.free_async(p, 2 * kMiB, kS2);
  EXPECT_EQ(d.allocate_async(2 * kMiB, kS2), p);  // kS2's own free
  const DevicePtr q = d.allocate_async(2 * kMiB, kS1);
  EXPECT_EQ(q, p + 2 * kMiB);
}

TEST(SimPool, ManyMixedOperationsKeepAccountingExact) {
  // A deterministic mixed workload on three streams: used and reserved stay consistent
  // and everything is trimmable once it is all freed and complete.
  SimDriver d(with_capacity(256 * kMiB));
  std::vector<std::pair<DevicePtr, std::size_t>> live;
  std::uint64_t x = 12345;
  std::size_t used = 0;
  for (int i = 0; i < 4000; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const StreamId s = 1 + (x >> 60) % 3;
    if (live.empty() || ((x >> 40) & 3) != 0) {
      const std::size_t size =
          ((x >> 33) & 1) ? 1 + (x >> 20) % (512 * 1024) : kMiB + (x >> 20) % (6 * kMiB);
      const DevicePtr p = d.allocate_async(size, s);
      if (p != 0) {
        live.emplace_back(p, size);
        used += size;
      }
    } else {
      const std::size_t k = (x >> 8) % live.size();
      d.free_async(live[k].first, live[k].second, s);
      used -= live[k].second;
      live[k] = live.back();
      live.pop_back();
    }
    if (i % 97 == 0) d.complete_stream(1 + i % 3);
    ASSERT_EQ(d.pool_usage().used_current, used);
    ASSERT_LE(d.pool_usage().used_current, d.pool_usage().reserved_current);
  }
  std::sort(live.begin(), live.end());
  for (std::size_t i = 1; i < live.size(); ++i) {
    ASSERT_LE(live[i - 1].first + live[i - 1].second, live[i].first);
  }
  for (const auto& [p, size] : live)
    d.free_async(p, size, kS1);
  d.synchronize_device();
  d.pool_trim(0);
  EXPECT_EQ(d.pool_usage().used_current, 0u);
  EXPECT_EQ(d.pool_usage().reserved_current, 0u);
  EXPECT_EQ(d.used_bytes(), 0u);
}

}  // namespace
}  // namespace ccalloc::sim
