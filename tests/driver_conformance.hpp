// The Driver contract (include/ccalloc/driver.hpp) as one typed test suite. Every driver
// instantiates it with a factory type:
//
//   struct MyFactory {
//     static std::unique_ptr<ccalloc::Driver> make();  // nullptr: skip (no device here)
//   };
//   INSTANTIATE_TYPED_TEST_SUITE_P(Mine, DriverConformance, ::testing::Types<MyFactory>);
//
// The expectations hold for the simulated GPU and for a real CUDA device alike: no exact
// addresses, only stream 0 (the one stream every CUDA context has), and memory figures
// compared with a tolerance of the driver's own granularity where a real device rounds.
// Behaviour only the simulated GPU has (pending events until completed, exact placement)
// is tested in sim_driver_test.cpp and sim_vmm_test.cpp.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "ccalloc/driver.hpp"
#include "ccalloc/errors.hpp"

namespace ccalloc::conformance {

template <typename Factory>
class DriverConformance : public ::testing::Test {
 protected:
  void SetUp() override {
    driver_ = Factory::make();
    if (driver_ == nullptr) GTEST_SKIP() << "no device for this driver here";
  }
  Driver& d() { return *driver_; }
  std::size_t g() { return driver_->vm_granularity(); }

  std::unique_ptr<Driver> driver_;
};

TYPED_TEST_SUITE_P(DriverConformance);

constexpr std::size_t kMiB = std::size_t{1} << 20;

TYPED_TEST_P(DriverConformance, AllocationsAreNonZeroAndDisjoint) {
  const std::size_t bytes = 4 * kMiB;
  const DevicePtr a = this->d().allocate(bytes);
  const DevicePtr b = this->d().allocate(bytes);
  ASSERT_NE(a, 0u);
  ASSERT_NE(b, 0u);
  EXPECT_TRUE(a + bytes <= b || b + bytes <= a) << std::hex << a << " " << b;
  this->d().free(a, bytes);
  this->d().free(b, bytes);
}

TYPED_TEST_P(DriverConformance, AllocateAndFreeMoveFreeMemory) {
  const std::size_t bytes = 64 * kMiB;
  const MemInfo before = this->d().mem_info();
  ASSERT_LE(before.free_bytes, before.total_bytes);
  const DevicePtr p = this->d().allocate(bytes);
  ASSERT_NE(p, 0u);
  const MemInfo during = this->d().mem_info();
  EXPECT_EQ(during.total_bytes, before.total_bytes);
  EXPECT_LE(during.free_bytes + bytes, before.free_bytes);
  this->d().free(p, bytes);
  const MemInfo after = this->d().mem_info();
  EXPECT_GE(after.free_bytes, during.free_bytes + bytes);
}

TYPED_TEST_P(DriverConformance, AllocationBeyondTheDeviceIsNullNotAnError) {
  const MemInfo info = this->d().mem_info();
  EXPECT_EQ(this->d().allocate(info.total_bytes + this->g()), 0u);
  // The failed allocation leaves no error behind: the next one succeeds.
  const DevicePtr p = this->d().allocate(kMiB);
  ASSERT_NE(p, 0u);
  this->d().free(p, kMiB);
}

TYPED_TEST_P(DriverConformance, SynchronizedEventQueriesComplete) {
  const EventId e = this->d().create_event();
  this->d().record_event(e, 0);
  this->d().synchronize_event(e);
  EXPECT_TRUE(this->d().query_event(e));
  EXPECT_TRUE(this->d().query_event(e));  // completion is permanent until re-recorded
  this->d().destroy_event(e);
}

TYPED_TEST_P(DriverConformance, StreamSynchronizeCompletesItsEvents) {
  const EventId first = this->d().create_event();
  const EventId second = this->d().create_event();
  this->d().record_event(first, 0);
  this->d().record_event(second, 0);
  this->d().synchronize_stream(0);
  EXPECT_TRUE(this->d().query_event(first));
  EXPECT_TRUE(this->d().query_event(second));
  this->d().destroy_event(first);
  this->d().destroy_event(second);
}

TYPED_TEST_P(DriverConformance, DeviceSynchronizeCompletesEveryEvent) {
  const EventId e = this->d().create_event();
  this->d().record_event(e, 0);
  this->d().synchronize_device();
  EXPECT_TRUE(this->d().query_event(e));
  this->d().destroy_event(e);
}

TYPED_TEST_P(DriverConformance, EventsAreDistinct) {
  const EventId a = this->d().create_event();
  const EventId b = this->d().create_event();
  EXPECT_NE(a, b);
  this->d().destroy_event(a);
  this->d().destroy_event(b);
}

TYPED_TEST_P(DriverConformance, GranularityIsAPowerOfTwo) {
  const std::size_t g = this->g();
  ASSERT_GT(g, 0u);
  EXPECT_EQ(g & (g - 1), 0u) << g;
}

TYPED_TEST_P(DriverConformance, ReservationIsGranularityAligned) {
  const std::size_t g = this->g();
  const DevicePtr base = this->d().reserve_address_range(4 * g);
  ASSERT_NE(base, 0u);
  EXPECT_EQ(base % g, 0u) << std::hex << base;
  this->d().free_address_range(base, 4 * g);
}

TYPED_TEST_P(DriverConformance, PhysicalMemoryCountsAsUsed) {
  const std::size_t bytes = 16 * this->g();
  const MemInfo before = this->d().mem_info();
  const PhysicalHandle h = this->d().create_physical(bytes);
  ASSERT_NE(h, 0u);
  EXPECT_LE(this->d().mem_info().free_bytes + bytes, before.free_bytes);
  this->d().release_physical(h, bytes);
  EXPECT_GE(this->d().mem_info().free_bytes + this->g(), before.free_bytes);
}

TYPED_TEST_P(DriverConformance, PhysicalBeyondTheDeviceIsNullNotAnError) {
  const std::size_t g = this->g();
  const std::size_t bytes = (this->d().mem_info().total_bytes / g + 1) * g;
  EXPECT_EQ(this->d().create_physical(bytes), 0u);
  const PhysicalHandle h = this->d().create_physical(g);
  ASSERT_NE(h, 0u);
  this->d().release_physical(h, g);
}

// Maps two physical allocations side by side, unmaps both with one call (a range may cover
// several whole mappings), and maps the range again: unmapping frees the addresses.
TYPED_TEST_P(DriverConformance, MapUnmapRoundTrip) {
  const std::size_t g = this->g();
  const DevicePtr base = this->d().reserve_address_range(2 * g);
  const PhysicalHandle a = this->d().create_physical(g);
  const PhysicalHandle b = this->d().create_physical(g);
  ASSERT_NE(a, 0u);
  ASSERT_NE(b, 0u);
  this->d().map(base, g, a);
  this->d().map(base + g, g, b);
  this->d().unmap(base, 2 * g);
  this->d().map(base, g, b);
  this->d().unmap(base, g);
  this->d().release_physical(a, g);
  this->d().release_physical(b, g);
  this->d().free_address_range(base, 2 * g);
}

TYPED_TEST_P(DriverConformance, MapAtAMisalignedAddressThrows) {
  const std::size_t g = this->g();
  const DevicePtr base = this->d().reserve_address_range(2 * g);
  const PhysicalHandle h = this->d().create_physical(g);
  ASSERT_NE(h, 0u);
  EXPECT_THROW(this->d().map(base + g / 2, g, h), DriverError);
  this->d().release_physical(h, g);
  this->d().free_address_range(base, 2 * g);
}

TYPED_TEST_P(DriverConformance, MapOverAMappingThrows) {
  const std::size_t g = this->g();
  const DevicePtr base = this->d().reserve_address_range(g);
  const PhysicalHandle a = this->d().create_physical(g);
  const PhysicalHandle b = this->d().create_physical(g);
  this->d().map(base, g, a);
  EXPECT_THROW(this->d().map(base, g, b), DriverError);
  this->d().unmap(base, g);
  this->d().release_physical(a, g);
  this->d().release_physical(b, g);
  this->d().free_address_range(base, g);
}

TYPED_TEST_P(DriverConformance, StreamOrderedAllocationsAreUsedPoolMemory) {
  const std::size_t bytes = 8 * kMiB;
  const PoolUsage before = this->d().pool_usage();
  const DevicePtr p = this->d().allocate_async(bytes, 0);
  ASSERT_NE(p, 0u);
  const PoolUsage during = this->d().pool_usage();
  EXPECT_GE(during.used_current, before.used_current + bytes);
  EXPECT_GE(during.reserved_current, during.used_current);
  EXPECT_GE(during.used_high, during.used_current);
  this->d().free_async(p, bytes, 0);
  this->d().synchronize_stream(0);
  EXPECT_EQ(this->d().pool_usage().used_current, before.used_current);
}

TYPED_TEST_P(DriverConformance, PoolKeepsFreedMemoryUntilTrimmed) {
  const std::size_t bytes = 8 * kMiB;
  const DevicePtr p = this->d().allocate_async(bytes, 0);
  ASSERT_NE(p, 0u);
  this->d().free_async(p, bytes, 0);
  this->d().synchronize_stream(0);
  EXPECT_GE(this->d().pool_usage().reserved_current, bytes);  // release threshold: unlimited
  this->d().pool_trim(0);
  EXPECT_EQ(this->d().pool_usage().reserved_current, 0u);
}

TYPED_TEST_P(DriverConformance, PoolResetPeaksLowersHighsToCurrent) {
  const std::size_t bytes = 8 * kMiB;
  const DevicePtr p = this->d().allocate_async(bytes, 0);
  ASSERT_NE(p, 0u);
  this->d().free_async(p, bytes, 0);
  this->d().synchronize_stream(0);
  this->d().pool_trim(0);
  this->d().pool_reset_peaks();
  const PoolUsage u = this->d().pool_usage();
  EXPECT_EQ(u.used_high, u.used_current);
  EXPECT_EQ(u.reserved_high, u.reserved_current);
}

TYPED_TEST_P(DriverConformance, StreamOrderedAllocationBeyondTheDeviceIsNull) {
  const MemInfo info = this->d().mem_info();
  EXPECT_EQ(this->d().allocate_async(info.total_bytes + this->g(), 0), 0u);
  const DevicePtr p = this->d().allocate_async(kMiB, 0);
  ASSERT_NE(p, 0u);
  this->d().free_async(p, kMiB, 0);
  this->d().synchronize_stream(0);
}

TYPED_TEST_P(DriverConformance, StreamWaitingOnACompletedEventProceeds) {
  const EventId e = this->d().create_event();
  this->d().record_event(e, 0);
  this->d().synchronize_event(e);
  this->d().stream_wait_event(0, e);
  const EventId after = this->d().create_event();
  this->d().record_event(after, 0);
  this->d().synchronize_stream(0);
  EXPECT_TRUE(this->d().query_event(after));
  this->d().destroy_event(e);
  this->d().destroy_event(after);
}

TYPED_TEST_P(DriverConformance, ClockNeverRunsBackwards) {
  const std::int64_t a = this->d().now_us();
  const std::int64_t b = this->d().now_us();
  EXPECT_GE(a, 0);
  EXPECT_GE(b, a);
}

TYPED_TEST_P(DriverConformance, NameIsNotEmpty) { EXPECT_FALSE(this->d().name().empty()); }

// Nothing captures here, so no stream (the legacy default stream included) is capturing.
TYPED_TEST_P(DriverConformance, StreamsAreNotCapturingOutsideCapture) {
  EXPECT_FALSE(this->d().is_capturing(0));
  CaptureInfo info;
  info.capturing = true;
  info.id = 5;
  info.terminals = {1, 2};
  EXPECT_FALSE(this->d().capture_info(0, info));
  EXPECT_FALSE(info.capturing);
  EXPECT_EQ(info.id, 0u);
  EXPECT_TRUE(info.terminals.empty());
}

// Sharing (docs/ipc.md). Both drivers create physical memory exportable as POSIX file
// descriptors by default; a descriptor exported twice is the same one; this process can
// import its own export and map it at a second address.
TYPED_TEST_P(DriverConformance, PhysicalMemoryExportsAsADescriptorAndImportsAgain) {
  const std::size_t g = this->g();
  EXPECT_NE(this->d().exportable_kinds() & share_kind_bit(ShareKind::kPosixFd), 0u);
  const PhysicalHandle h = this->d().create_physical(g);
  ASSERT_NE(h, 0u);
  const std::string fd = this->d().export_physical(h, ShareKind::kPosixFd);
  EXPECT_EQ(fd.size(), share_kind_bytes(ShareKind::kPosixFd));
  EXPECT_EQ(this->d().export_physical(h, ShareKind::kPosixFd), fd);
  const PhysicalHandle imported =
      this->d().import_physical(fd, ShareKind::kPosixFd, static_cast<int>(getpid()), g);
  ASSERT_NE(imported, 0u);
  const DevicePtr base = this->d().reserve_address_range(2 * g);
  this->d().map(base, g, h);
  this->d().map(base + g, g, imported);
  this->d().unmap(base, 2 * g);
  this->d().release_physical(imported, g);
  this->d().release_physical(h, g);
  this->d().free_address_range(base, 2 * g);
}

TYPED_TEST_P(DriverConformance, ImportOfAnUnknownDescriptorThrows) {
  const std::string fd("\xff\xff\xff\x7f", 4);  // descriptor 2147483647: never open
  EXPECT_THROW(this->d().import_physical(fd, ShareKind::kPosixFd, static_cast<int>(getpid()),
                                         this->g()),
               DriverError);
  EXPECT_THROW(this->d().import_physical("abc", ShareKind::kPosixFd, static_cast<int>(getpid()),
                                         this->g()),
               DriverError);
}

TYPED_TEST_P(DriverConformance, DeviceAllocationExportsSixtyFourBytes) {
  const DevicePtr p = this->d().allocate(4 * kMiB);
  ASSERT_NE(p, 0u);
  EXPECT_EQ(this->d().export_allocation(p).size(), kAllocationHandleBytes);
  this->d().free(p, 4 * kMiB);
}

// Host memory and copies (sleeping pools): bytes copied into mapped physical memory come
// back out, for device allocations too.
TYPED_TEST_P(DriverConformance, HostCopiesRoundTripThroughMappedMemory) {
  const std::size_t bytes = this->g();
  auto* host = static_cast<unsigned char*>(this->d().allocate_host(2 * bytes));
  ASSERT_NE(host, nullptr);
  for (std::size_t i = 0; i < 2 * bytes; ++i)
    host[i] = static_cast<unsigned char>(i * 7 + 3);
  const DevicePtr va = this->d().reserve_address_range(bytes);
  const PhysicalHandle h = this->d().create_physical(bytes);
  ASSERT_NE(h, 0u);
  this->d().map(va, bytes, h);
  this->d().copy_to_device(va, host, bytes);
  const DevicePtr plain = this->d().allocate(bytes);
  ASSERT_NE(plain, 0u);
  this->d().copy_to_device(plain, host + bytes, bytes);
  std::vector<unsigned char> back(bytes);
  this->d().copy_to_host(back.data(), va, bytes);
  EXPECT_TRUE(std::equal(back.begin(), back.end(), host));
  this->d().copy_to_host(back.data(), plain, bytes);
  EXPECT_TRUE(std::equal(back.begin(), back.end(), host + bytes));
  this->d().free(plain, bytes);
  this->d().unmap(va, bytes);
  this->d().release_physical(h, bytes);
  this->d().free_address_range(va, bytes);
  this->d().free_host(host, 2 * bytes);
}

REGISTER_TYPED_TEST_SUITE_P(DriverConformance, AllocationsAreNonZeroAndDisjoint,
                            AllocateAndFreeMoveFreeMemory, AllocationBeyondTheDeviceIsNullNotAnError,
                            SynchronizedEventQueriesComplete, StreamSynchronizeCompletesItsEvents,
                            DeviceSynchronizeCompletesEveryEvent, EventsAreDistinct,
                            GranularityIsAPowerOfTwo, ReservationIsGranularityAligned,
                            PhysicalMemoryCountsAsUsed, PhysicalBeyondTheDeviceIsNullNotAnError,
                            MapUnmapRoundTrip, MapAtAMisalignedAddressThrows,
                            MapOverAMappingThrows, StreamOrderedAllocationsAreUsedPoolMemory,
                            PoolKeepsFreedMemoryUntilTrimmed, PoolResetPeaksLowersHighsToCurrent,
                            StreamOrderedAllocationBeyondTheDeviceIsNull,
                            StreamWaitingOnACompletedEventProceeds, ClockNeverRunsBackwards,
                            NameIsNotEmpty, StreamsAreNotCapturingOutsideCapture,
                            PhysicalMemoryExportsAsADescriptorAndImportsAgain,
                            ImportOfAnUnknownDescriptorThrows, DeviceAllocationExportsSixtyFourBytes,
                            HostCopiesRoundTripThroughMappedMemory);

}  // namespace ccalloc::conformance
