// Specification of the simulated GPU (include/ccalloc/sim.hpp, docs/simulated-gpu.md).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "test_support.hpp"

namespace ccalloc::sim {
namespace {

using ccalloc_test::message_of;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr DevicePtr kBase = DevicePtr{0x7f0000000000};

Options with_capacity(std::size_t capacity) {
  Options o;
  o.capacity = capacity;
  return o;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// ---------------------------------------------------------------------------------------
// Construction and identity

TEST(SimDriver, NameShowsDeviceAndCapacityInGiB) {
  EXPECT_EQ(SimDriver().name(), "simulated GPU 0 (141.00 GiB)");
  Options o;
  o.device = 3;
  o.capacity = 80 * kGiB + 512 * kMiB;
  EXPECT_EQ(SimDriver(o).name(), "simulated GPU 3 (80.50 GiB)");
}

TEST(SimDriver, DeviceAndCapacityComeFromOptions) {
  Options o;
  o.device = 5;
  o.capacity = 3 * kGiB;
  SimDriver d(o);
  EXPECT_EQ(d.device(), 5);
  EXPECT_EQ(d.capacity(), 3 * kGiB);
  EXPECT_EQ(d.options().capacity, 3 * kGiB);
}

TEST(SimDriver, RejectsAlignmentThatIsNotAPowerOfTwo) {
  Options o;
  o.alignment = 3 * kMiB;
  EXPECT_THROW(SimDriver{o}, DriverError);
  o.alignment = 0;
  EXPECT_THROW(SimDriver{o}, DriverError);
}

TEST(SimDriver, RejectsBaseAddressZeroBecauseZeroMeansOom) {
  Options o;
  o.base_address = 0;
  EXPECT_THROW(SimDriver{o}, DriverError);
}

// A GPU behind the host: events on the lagged streams complete, in order, once the clock
// has passed their recording by the lag; other streams' only when the caller completes them.
TEST(SimDriver, EventsOnLaggedStreamsCompleteTheLagAfterTheirRecording) {
  sim::Options o;
  o.gpu_lag_us = 1000;
  o.lagged_streams_end = 100;
  sim::SimDriver gpu(o);
  const EventId first = gpu.create_event();
  const EventId second = gpu.create_event();
  const EventId other = gpu.create_event();
  gpu.set_time_us(500);
  gpu.record_event(first, 1);
  gpu.set_time_us(800);
  gpu.record_event(second, 1);
  gpu.record_event(other, 200);
  gpu.set_time_us(1499);
  EXPECT_FALSE(gpu.query_event(first));
  gpu.set_time_us(1500);
  EXPECT_TRUE(gpu.query_event(first));
  EXPECT_FALSE(gpu.query_event(second));
  gpu.set_time_us(1800);
  EXPECT_TRUE(gpu.query_event(second));
  gpu.set_time_us(100000);
  EXPECT_FALSE(gpu.query_event(other));
  gpu.complete_stream(200);
  EXPECT_TRUE(gpu.query_event(other));
}

TEST(SimDriver, WaitedForFollowsStreamWaits) {
  sim::SimDriver gpu;
  const EventId e = gpu.create_event();
  const EventId later = gpu.create_event();
  gpu.record_event(e, 1);
  EXPECT_FALSE(gpu.waited_for(2, e));
  EXPECT_TRUE(gpu.waited_for(1, e));  // its own stream is ordered
  gpu.record_event(later, 1);
  gpu.stream_wait_event(2, later);  // a later position covers e too
  EXPECT_TRUE(gpu.waited_for(2, e));
  gpu.record_event(e, 1);  // re-recorded past what stream 2 waited for
  EXPECT_FALSE(gpu.waited_for(2, e));
}

// Waits chain: a stream that waited on another's event after that stream had itself waited
// on a third is ordered after the third's work up to there, not after what the third queued
// later; and a stream's work cannot complete past a wait before what it waits for.
TEST(SimDriver, WaitsAreTransitiveAndCompletionRunsWhatAWaitNeeds) {
  SimDriver gpu;
  const EventId on3 = gpu.create_event();
  const EventId later3 = gpu.create_event();
  const EventId on2 = gpu.create_event();
  const EventId before_wait2 = gpu.create_event();
  gpu.record_event(on3, 3);
  gpu.record_event(before_wait2, 2);
  gpu.stream_wait_event(2, on3);  // stream 2's work from here runs after on3
  gpu.record_event(on2, 2);
  gpu.record_event(later3, 3);
  gpu.stream_wait_event(1, on2);
  EXPECT_TRUE(gpu.waited_for(1, on2));
  EXPECT_TRUE(gpu.waited_for(1, on3));       // through stream 2's wait
  EXPECT_FALSE(gpu.waited_for(1, later3));   // queued on stream 3 after what 2 waited for
  EXPECT_TRUE(gpu.waited_for(1, before_wait2));
  // Stream 2 completing past its wait means stream 3 ran up to on3, not further.
  gpu.complete_stream(2);
  EXPECT_TRUE(gpu.query_event(on2));
  EXPECT_TRUE(gpu.query_event(on3));
  EXPECT_FALSE(gpu.query_event(later3));
  // Completing stream 1 (whose wait on on2 is done) completes nothing more.
  gpu.complete_stream(1);
  EXPECT_FALSE(gpu.query_event(later3));
}

// Completing a stream only up to an event before its wait does not run the stream waited on.
TEST(SimDriver, CompletingBeforeAWaitLeavesTheStreamWaitedOnAlone) {
  SimDriver gpu;
  const EventId first = gpu.create_event();
  const EventId after = gpu.create_event();
  const EventId other = gpu.create_event();
  gpu.record_event(other, 2);
  gpu.record_event(first, 1);
  gpu.stream_wait_event(1, other);
  gpu.record_event(after, 1);
  gpu.complete_event(first);
  EXPECT_FALSE(gpu.query_event(other));
  EXPECT_FALSE(gpu.query_event(after));
  gpu.complete_event(after);
  EXPECT_TRUE(gpu.query_event(other));
}

TEST(SimDriver, VirtualClockStartsAtZeroAndFollowsSetTime) {
  SimDriver d;
  EXPECT_EQ(d.now_us(), 0);
  d.set_time_us(1'700'000'000'000'000);
  EXPECT_EQ(d.now_us(), 1'700'000'000'000'000);
}

// ---------------------------------------------------------------------------------------
// Deterministic addresses

TEST(SimDriver, FirstAllocationIsAtBaseAddress) {
  SimDriver d;
  EXPECT_EQ(d.allocate(2 * kMiB), kBase);
}

TEST(SimDriver, NextAllocationStartsAtNextAlignedAddress) {
  SimDriver d;
  EXPECT_EQ(d.allocate(2 * kMiB), kBase);
  EXPECT_EQ(d.allocate(1 * kMiB), kBase + 2 * kMiB);
  EXPECT_EQ(d.allocate(3 * kMiB), kBase + 4 * kMiB);
  EXPECT_EQ(d.allocate(512), kBase + 8 * kMiB);
}

TEST(SimDriver, OddSizeOccupiesWholeAlignmentUnitsInPlacement) {
  SimDriver d;
  EXPECT_EQ(d.allocate(2 * kMiB + 1), kBase);
  EXPECT_EQ(d.allocate(1), kBase + 4 * kMiB);
  EXPECT_EQ(d.allocate(1), kBase + 6 * kMiB);
}

TEST(SimDriver, UsedBytesCountsRequestedBytesNotPlacementPadding) {
  SimDriver d;
  d.allocate(2 * kMiB + 1);
  d.allocate(1);
  EXPECT_EQ(d.used_bytes(), 2 * kMiB + 2);
}

TEST(SimDriver, FreedGapIsReusedLowestFirst) {
  SimDriver d;
  const DevicePtr a = d.allocate(2 * kMiB);
  d.allocate(2 * kMiB);
  const DevicePtr c = d.allocate(2 * kMiB);
  d.allocate(2 * kMiB);
  d.free(c, 2 * kMiB);
  d.free(a, 2 * kMiB);
  EXPECT_EQ(d.allocate(2 * kMiB), kBase);
  EXPECT_EQ(d.allocate(2 * kMiB), kBase + 4 * kMiB);
  EXPECT_EQ(d.allocate(2 * kMiB), kBase + 8 * kMiB);
}

TEST(SimDriver, GapTooSmallIsSkippedButFilledLater) {
  SimDriver d;
  d.allocate(2 * kMiB);
  const DevicePtr b = d.allocate(2 * kMiB);
  d.allocate(2 * kMiB);
  d.free(b, 2 * kMiB);
  EXPECT_EQ(d.allocate(4 * kMiB), kBase + 6 * kMiB);
  EXPECT_EQ(d.allocate(2 * kMiB), kBase + 2 * kMiB);
}

TEST(SimDriver, UnalignedBaseAddressIsRoundedUpToAlignment) {
  Options o;
  o.base_address = kBase + 1;
  SimDriver d(o);
  EXPECT_EQ(d.allocate(1), kBase + 2 * kMiB);
}

TEST(SimDriver, CustomAlignmentSetsThePlacementGranule) {
  Options o;
  o.alignment = 4096;
  SimDriver d(o);
  EXPECT_EQ(d.allocate(100), kBase);
  EXPECT_EQ(d.allocate(4097), kBase + 4096);
  EXPECT_EQ(d.allocate(1), kBase + 3 * 4096);
}

TEST(SimDriver, ZeroByteAllocationThrowsAndIsNotCounted) {
  SimDriver d;
  const std::string message = message_of<DriverError>([&] { d.allocate(0); });
  EXPECT_TRUE(contains(message, "0 bytes")) << message;
  EXPECT_EQ(d.counters().allocate_calls, 0u);
  EXPECT_EQ(d.simulated_driver_us(), 0.0);
}

TEST(SimDriver, RangePastTheTopOfTheAddressSpaceThrowsInsteadOfWrapping) {
  Options o;
  o.base_address = ~DevicePtr{0} - 2 * kMiB + 1;  // the last 2 MiB-aligned address
  SimDriver d(o);
  EXPECT_EQ(d.allocate(1), o.base_address);
  EXPECT_THROW(d.allocate(1), DriverError);
}

TEST(SimDriver, AllocationOfExactlyCapacitySucceeds) {
  SimDriver d(with_capacity(8 * kMiB));
  EXPECT_EQ(d.allocate(8 * kMiB), kBase);
  EXPECT_EQ(d.used_bytes(), 8 * kMiB);
}

TEST(SimDriver, OneByteBeyondCapacityIsOomAsValue) {
  SimDriver d(with_capacity(8 * kMiB));
  d.allocate(8 * kMiB);
  EXPECT_EQ(d.allocate(1), 0u);
  EXPECT_EQ(d.used_bytes(), 8 * kMiB);
}

TEST(SimDriver, RequestLargerThanCapacityIsOomOnEmptyDevice) {
  SimDriver d(with_capacity(8 * kMiB));
  EXPECT_EQ(d.allocate(8 * kMiB + 1), 0u);
  EXPECT_EQ(d.used_bytes(), 0u);
}

TEST(SimDriver, OomCountsTheCallAndTheOom) {
  SimDriver d(with_capacity(8 * kMiB));
  d.allocate(6 * kMiB);
  d.allocate(2 * kMiB + 1);
  d.allocate(2 * kMiB);
  const Counters c = d.counters();
  EXPECT_EQ(c.allocate_calls, 3u);
  EXPECT_EQ(c.allocate_ooms, 1u);
}

TEST(SimDriver, FreeingMakesRoomAfterOom) {
  SimDriver d(with_capacity(8 * kMiB));
  const DevicePtr p = d.allocate(8 * kMiB);
  ASSERT_EQ(d.allocate(1), 0u);
  d.free(p, 8 * kMiB);
  EXPECT_EQ(d.allocate(1), kBase);
}

TEST(SimDriver, OomDoesNotOverflowNearSizeMax) {
  SimDriver d(with_capacity(8 * kMiB));
  d.allocate(1);
  EXPECT_EQ(d.allocate(SIZE_MAX), 0u);
}

// ---------------------------------------------------------------------------------------
// mem_info

TEST(SimDriver, MemInfoReportsFreeAndTotalAndIsCounted) {
  SimDriver d(with_capacity(10 * kMiB));
  const DevicePtr p = d.allocate(3 * kMiB + 5);
  MemInfo info = d.mem_info();
  EXPECT_EQ(info.free_bytes, 7 * kMiB - 5);
  EXPECT_EQ(info.total_bytes, 10 * kMiB);
  d.free(p, 3 * kMiB + 5);
  info = d.mem_info();
  EXPECT_EQ(info.free_bytes, 10 * kMiB);
  EXPECT_EQ(d.counters().mem_info_calls, 2u);
}

// ---------------------------------------------------------------------------------------
// free

TEST(SimDriver, FreeOfUnknownPointerThrowsNamingIt) {
  SimDriver d;
  d.allocate(2 * kMiB);
  const std::string message = message_of<DriverError>([&] { d.free(kBase + 4 * kMiB, 2 * kMiB); });
  EXPECT_TRUE(contains(message, "0x7f0000400000")) << message;
  EXPECT_TRUE(contains(message, "2097152 bytes")) << message;
}

TEST(SimDriver, FreeWithWrongSizeThrowsNamingPointerAndBothSizes) {
  SimDriver d;
  const DevicePtr p = d.allocate(2 * kMiB);
  const std::string message = message_of<DriverError>([&] { d.free(p, 1 * kMiB); });
  EXPECT_TRUE(contains(message, "0x7f0000000000")) << message;
  EXPECT_TRUE(contains(message, "1048576 bytes")) << message;
  EXPECT_TRUE(contains(message, "2097152 bytes")) << message;
}

TEST(SimDriver, FreeOfInteriorPointerThrows) {
  SimDriver d;
  const DevicePtr p = d.allocate(4 * kMiB);
  EXPECT_THROW(d.free(p + 2 * kMiB, 2 * kMiB), DriverError);
}

TEST(SimDriver, DoubleFreeThrows) {
  SimDriver d;
  const DevicePtr p = d.allocate(2 * kMiB);
  d.free(p, 2 * kMiB);
  EXPECT_THROW(d.free(p, 2 * kMiB), DriverError);
}

TEST(SimDriver, RejectedFreeChangesNothing) {
  SimDriver d;
  const DevicePtr p = d.allocate(2 * kMiB);
  EXPECT_THROW(d.free(p, 1), DriverError);
  EXPECT_EQ(d.used_bytes(), 2 * kMiB);
  EXPECT_EQ(d.counters().free_calls, 0u);
  d.free(p, 2 * kMiB);
  EXPECT_EQ(d.used_bytes(), 0u);
  EXPECT_EQ(d.counters().free_calls, 1u);
}

// ---------------------------------------------------------------------------------------
// Address oracle

TEST(SimDriver, OracleAddressesAreUsedWhileSizesMatch) {
  SimDriver d;
  d.set_address_oracle({{0x7f1000000000, 4 * kMiB}, {0x7f2000000000, 2 * kMiB}});
  EXPECT_EQ(d.allocate(4 * kMiB), 0x7f1000000000u);
  EXPECT_EQ(d.allocate(2 * kMiB), 0x7f2000000000u);
  EXPECT_EQ(d.oracle_hits(), 2u);
  EXPECT_FALSE(d.oracle_diverged());
}

TEST(SimDriver, OracleDivergesForGoodOnFirstSizeMismatch) {
  SimDriver d;
  d.set_address_oracle(
      {{0x7f1000000000, 4 * kMiB}, {0x7f2000000000, 2 * kMiB}, {0x7f3000000000, 2 * kMiB}});
  EXPECT_EQ(d.allocate(4 * kMiB), 0x7f1000000000u);
  EXPECT_EQ(d.allocate(1 * kMiB), kBase);
  EXPECT_TRUE(d.oracle_diverged());
  // The next size would match an entry, but a diverged oracle stays abandoned.
  EXPECT_EQ(d.allocate(2 * kMiB), kBase + 2 * kMiB);
  EXPECT_EQ(d.oracle_hits(), 1u);
}

TEST(SimDriver, FallbackNeverCollidesWithLiveOracleAddresses) {
  SimDriver d;
  d.set_address_oracle(
      {{kBase, 4 * kMiB}, {kBase + 8 * kMiB, 2 * kMiB}, {kBase + 12 * kMiB, 2 * kMiB}});
  EXPECT_EQ(d.allocate(4 * kMiB), kBase);
  EXPECT_EQ(d.allocate(2 * kMiB), kBase + 8 * kMiB);
  ASSERT_EQ(d.allocate(1 * kMiB), kBase + 4 * kMiB);
  ASSERT_TRUE(d.oracle_diverged());
  EXPECT_EQ(d.allocate(2 * kMiB), kBase + 6 * kMiB);
  EXPECT_EQ(d.allocate(2 * kMiB), kBase + 10 * kMiB);
}

TEST(SimDriver, FallbackSkipsUnalignedOracleRange) {
  SimDriver d;
  d.set_address_oracle({{kBase + 1 * kMiB, 2 * kMiB}});
  EXPECT_EQ(d.allocate(2 * kMiB), kBase + 1 * kMiB);
  // [base, base + 2 MiB) and [base + 2 MiB, base + 4 MiB) both overlap the oracle's range.
  EXPECT_EQ(d.allocate(2 * kMiB), kBase + 4 * kMiB);
}

TEST(SimDriver, OracleEntryOverlappingLiveRangeDiverges) {
  SimDriver d;
  d.set_address_oracle({{kBase, 2 * kMiB}, {kBase + 1 * kMiB, 2 * kMiB}});
  EXPECT_EQ(d.allocate(2 * kMiB), kBase);
  EXPECT_EQ(d.allocate(2 * kMiB), kBase + 2 * kMiB);
  EXPECT_TRUE(d.oracle_diverged());
  EXPECT_EQ(d.oracle_hits(), 1u);
}

TEST(SimDriver, OracleMayRepeatAnAddressAfterItWasFreed) {
  SimDriver d;
  d.set_address_oracle({{0x7f1000000000, 2 * kMiB}, {0x7f1000000000, 2 * kMiB}});
  const DevicePtr p = d.allocate(2 * kMiB);
  d.free(p, 2 * kMiB);
  EXPECT_EQ(d.allocate(2 * kMiB), 0x7f1000000000u);
  EXPECT_EQ(d.oracle_hits(), 2u);
}

TEST(SimDriver, ExhaustedOracleFallsBackWithoutDiverging) {
  SimDriver d;
  d.set_address_oracle({{0x7f1000000000, 2 * kMiB}});
  EXPECT_EQ(d.allocate(2 * kMiB), 0x7f1000000000u);
  EXPECT_EQ(d.allocate(2 * kMiB), kBase);
  EXPECT_EQ(d.oracle_hits(), 1u);
  EXPECT_FALSE(d.oracle_diverged());
}

TEST(SimDriver, OomDoesNotConsumeAnOracleEntry) {
  SimDriver d(with_capacity(4 * kMiB));
  d.set_address_oracle({{0x7f1000000000, 2 * kMiB}});
  EXPECT_EQ(d.allocate(8 * kMiB), 0u);
  EXPECT_FALSE(d.oracle_diverged());
  EXPECT_EQ(d.allocate(2 * kMiB), 0x7f1000000000u);
}

TEST(SimDriver, SettingAnOracleRestartsHitsAndDivergence) {
  SimDriver d;
  d.set_address_oracle({{0x7f1000000000, 2 * kMiB}});
  d.allocate(1 * kMiB);
  ASSERT_TRUE(d.oracle_diverged());
  d.set_address_oracle({{0x7f2000000000, 1 * kMiB}});
  EXPECT_FALSE(d.oracle_diverged());
  EXPECT_EQ(d.oracle_hits(), 0u);
  EXPECT_EQ(d.allocate(1 * kMiB), 0x7f2000000000u);
  EXPECT_EQ(d.oracle_hits(), 1u);
}

// ---------------------------------------------------------------------------------------
// Events and streams

TEST(SimDriver, EventIdsAreFreshFromOneAndNeverReused) {
  SimDriver d;
  EXPECT_EQ(d.create_event(), 1u);
  EXPECT_EQ(d.create_event(), 2u);
  d.destroy_event(2);
  EXPECT_EQ(d.create_event(), 3u);
}

TEST(SimDriver, NeverRecordedEventIsComplete) {
  SimDriver d;
  EXPECT_TRUE(d.query_event(d.create_event()));
}

TEST(SimDriver, RecordedEventIsPendingUntilCompleted) {
  SimDriver d;
  const EventId e = d.create_event();
  d.record_event(e, 7);
  EXPECT_FALSE(d.query_event(e));
  d.complete_event(e);
  EXPECT_TRUE(d.query_event(e));
}

TEST(SimDriver, CompletingAnEventCompletesEarlierOnesOnItsStreamButNotLaterOnes) {
  SimDriver d;
  const EventId e1 = d.create_event();
  const EventId e2 = d.create_event();
  const EventId e3 = d.create_event();
  d.record_event(e1, 7);
  d.record_event(e2, 7);
  d.record_event(e3, 7);
  d.complete_event(e2);
  EXPECT_TRUE(d.query_event(e1));
  EXPECT_TRUE(d.query_event(e2));
  EXPECT_FALSE(d.query_event(e3));
}

TEST(SimDriver, CompletingAnEarlierEventDoesNotUncompleteLaterOnes) {
  SimDriver d;
  const EventId e1 = d.create_event();
  const EventId e2 = d.create_event();
  d.record_event(e1, 7);
  d.record_event(e2, 7);
  d.complete_event(e2);
  d.complete_event(e1);
  EXPECT_TRUE(d.query_event(e2));
}

TEST(SimDriver, CompletingAnEventLeavesOtherStreamsPending) {
  SimDriver d;
  const EventId a = d.create_event();
  const EventId b = d.create_event();
  d.record_event(a, 1);
  d.record_event(b, 2);
  d.complete_event(a);
  EXPECT_FALSE(d.query_event(b));
}

TEST(SimDriver, CompleteStreamCompletesEverythingRecordedOnIt) {
  SimDriver d;
  const EventId a1 = d.create_event();
  const EventId a2 = d.create_event();
  const EventId b = d.create_event();
  d.record_event(a1, 1);
  d.record_event(a2, 1);
  d.record_event(b, 2);
  d.complete_stream(1);
  EXPECT_TRUE(d.query_event(a1));
  EXPECT_TRUE(d.query_event(a2));
  EXPECT_FALSE(d.query_event(b));
}

TEST(SimDriver, CompleteStreamDoesNotCompleteLaterRecords) {
  SimDriver d;
  const EventId e = d.create_event();
  d.complete_stream(1);
  d.record_event(e, 1);
  EXPECT_FALSE(d.query_event(e));
}

TEST(SimDriver, CompleteAllCompletesEveryStream) {
  SimDriver d;
  const EventId a = d.create_event();
  const EventId b = d.create_event();
  d.record_event(a, 0);
  d.record_event(b, 0xdeadbeef);
  d.complete_all();
  EXPECT_TRUE(d.query_event(a));
  EXPECT_TRUE(d.query_event(b));
}

TEST(SimDriver, ReRecordedEventWaitsForNewWork) {
  SimDriver d;
  const EventId e = d.create_event();
  d.record_event(e, 1);
  d.complete_stream(1);
  ASSERT_TRUE(d.query_event(e));
  d.record_event(e, 1);
  EXPECT_FALSE(d.query_event(e));
}

TEST(SimDriver, EventsCompleteImmediatelyWhenConfigured) {
  Options o;
  o.events_complete_immediately = true;
  SimDriver d(o);
  const EventId e = d.create_event();
  d.record_event(e, 3);
  EXPECT_TRUE(d.query_event(e));
}

TEST(SimDriver, SynchronizeEventCompletesItAndEarlierOnesAndIsCounted) {
  SimDriver d;
  const EventId e1 = d.create_event();
  const EventId e2 = d.create_event();
  const EventId e3 = d.create_event();
  d.record_event(e1, 4);
  d.record_event(e2, 4);
  d.record_event(e3, 4);
  d.synchronize_event(e2);
  EXPECT_TRUE(d.query_event(e1));
  EXPECT_TRUE(d.query_event(e2));
  EXPECT_FALSE(d.query_event(e3));
  EXPECT_EQ(d.counters().event_synchronizes, 1u);
  EXPECT_EQ(d.counters().stream_synchronizes, 0u);
}

TEST(SimDriver, SynchronizeStreamCompletesItAndIsCounted) {
  SimDriver d;
  const EventId a = d.create_event();
  const EventId b = d.create_event();
  d.record_event(a, 4);
  d.record_event(b, 5);
  d.synchronize_stream(4);
  d.synchronize_stream(99);  // a stream with no work returns at once, and still counts
  EXPECT_TRUE(d.query_event(a));
  EXPECT_FALSE(d.query_event(b));
  EXPECT_EQ(d.counters().stream_synchronizes, 2u);
  EXPECT_EQ(d.counters().event_synchronizes, 0u);
}

TEST(SimDriver, UnknownEventIdThrowsInEveryCall) {
  SimDriver d;
  const EventId gone = d.create_event();
  d.destroy_event(gone);
  for (const EventId e : {EventId{0}, gone, EventId{42}}) {
    EXPECT_THROW(d.destroy_event(e), DriverError);
    EXPECT_THROW(d.record_event(e, 0), DriverError);
    EXPECT_THROW(d.query_event(e), DriverError);
    EXPECT_THROW(d.complete_event(e), DriverError);
    EXPECT_THROW(d.synchronize_event(e), DriverError);
  }
  const std::string message = message_of<DriverError>([&] { d.query_event(42); });
  EXPECT_TRUE(contains(message, "event 42")) << message;
}

TEST(SimDriver, EventCallsAreCounted) {
  SimDriver d;
  const EventId e = d.create_event();
  const EventId f = d.create_event();
  d.record_event(e, 1);
  d.record_event(e, 1);
  d.query_event(e);
  d.query_event(f);
  d.query_event(f);
  d.destroy_event(f);
  Counters expected;
  expected.event_creates = 2;
  expected.event_destroys = 1;
  expected.event_records = 2;
  expected.event_queries = 3;
  EXPECT_EQ(d.counters(), expected);
}

// ---------------------------------------------------------------------------------------
// Cost model

TEST(SimDriver, DefaultCostModelChargesMallocAndFreeFromTheReferenceProfile) {
  SimDriver d;
  const DevicePtr p = d.allocate(2 * kMiB);
  d.free(p, 2 * kMiB);
  EXPECT_EQ(d.simulated_driver_us(), 0.0 + 59.2 + 46.0);
}

TEST(SimDriver, CustomCostsAccumulatePerCall) {
  Options o = with_capacity(4 * kMiB);
  o.cost = CostModel{.allocate_us = 1.5,
                     .free_us = 0.25,
                     .synchronize_us = 2.0,
                     .event_record_us = 0.125,
                     .event_query_us = 0.5};
  SimDriver d(o);
  const DevicePtr p = d.allocate(2 * kMiB);  // 1.5
  d.free(p, 2 * kMiB);                       // 0.25
  const EventId e = d.create_event();        // free of charge
  d.record_event(e, 1);                      // 0.125
  d.query_event(e);                          // 0.5
  d.synchronize_event(e);                    // 2.0
  d.synchronize_stream(1);                   // 2.0
  d.mem_info();                              // free of charge
  d.complete_all();                          // the caller's action, not a driver call
  EXPECT_EQ(d.simulated_driver_us(), 6.375);
}

TEST(SimDriver, OomAllocationIsChargedLikeAnyOther) {
  Options o = with_capacity(4 * kMiB);
  o.cost.allocate_us = 1.5;
  SimDriver d(o);
  EXPECT_EQ(d.allocate(8 * kMiB), 0u);
  EXPECT_EQ(d.simulated_driver_us(), 1.5);
}

TEST(SimDriver, RejectedCallsAreNotCharged) {
  SimDriver d;
  EXPECT_THROW(d.free(kBase, 2 * kMiB), DriverError);
  EXPECT_THROW(d.synchronize_event(42), DriverError);
  EXPECT_THROW(d.allocate(0), DriverError);
  EXPECT_EQ(d.simulated_driver_us(), 0.0);
  EXPECT_EQ(d.counters(), Counters{});
}

// ---------------------------------------------------------------------------------------
// Concurrency

TEST(SimDriver, ConcurrentAllocateAndFreeKeepLiveRangesDisjointAndCountersConsistent) {
  constexpr int kThreads = 4;
  constexpr int kIterations = 2000;
  constexpr std::size_t kHeld = 4;
  // Four consecutive sizes of one thread can reach 8 + 7 + 6 + 5 MiB, more than the
  // capacity, so OOMs occur however the threads interleave.
  constexpr std::size_t kCapacity = 24 * kMiB;
  SimDriver d(with_capacity(kCapacity));

  std::mutex registry_mutex;
  std::map<DevicePtr, std::size_t> registry;  // every range that is live right now
  int overlaps = 0;
  std::vector<std::uint64_t> successes(kThreads, 0);

  auto worker = [&](int t) {
    std::vector<std::pair<DevicePtr, std::size_t>> held;
    for (int i = 0; i < kIterations; ++i) {
      const std::size_t bytes = (static_cast<std::size_t>(i * 7 + t * 13) % 8 + 1) * kMiB - 3;
      const DevicePtr p = d.allocate(bytes);
      if (p != 0) {
        ++successes[t];
        std::lock_guard lock(registry_mutex);
        const auto next = registry.lower_bound(p);
        if (next != registry.end() && next->first < p + bytes) ++overlaps;
        if (next != registry.begin() && std::prev(next)->first + std::prev(next)->second > p) {
          ++overlaps;
        }
        registry.emplace(p, bytes);
        held.emplace_back(p, bytes);
      }
      if (held.size() == kHeld || (p == 0 && !held.empty())) {
        const auto [q, q_bytes] = held.front();
        held.erase(held.begin());
        {
          std::lock_guard lock(registry_mutex);
          registry.erase(q);
        }
        d.free(q, q_bytes);
      }
      const EventId e = d.create_event();
      d.record_event(e, static_cast<StreamId>(t));
      d.query_event(e);
      d.destroy_event(e);
    }
    for (const auto& [q, q_bytes] : held) {
      {
        std::lock_guard lock(registry_mutex);
        registry.erase(q);
      }
      d.free(q, q_bytes);
    }
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back(worker, t);
  for (auto& th : threads)
    th.join();

  std::uint64_t total_successes = 0;
  for (const std::uint64_t s : successes)
    total_successes += s;
  const Counters c = d.counters();
  EXPECT_EQ(overlaps, 0);
  EXPECT_EQ(d.used_bytes(), 0u);
  EXPECT_EQ(c.allocate_calls, std::uint64_t{kThreads} * kIterations);
  EXPECT_EQ(c.allocate_calls, total_successes + c.allocate_ooms);
  EXPECT_GT(c.allocate_ooms, 0u);
  EXPECT_EQ(c.free_calls, total_successes);
  EXPECT_EQ(c.event_creates, std::uint64_t{kThreads} * kIterations);
  EXPECT_EQ(c.event_destroys, c.event_creates);
  EXPECT_EQ(c.event_records, c.event_creates);
  EXPECT_EQ(c.event_queries, c.event_creates);
  EXPECT_EQ(d.mem_info().free_bytes, kCapacity);
}

// ---------------------------------------------------------------------------------------
// Capture graphs

std::vector<GraphNode> terminals_of(SimDriver& d, StreamId s) {
  CaptureInfo info;
  d.capture_info(s, info);
  return info.terminals;
}

std::vector<GraphNode> deps_of(SimDriver& d, GraphNode n) {
  std::vector<GraphNode> out;
  d.node_dependencies(n, out);
  return out;
}

TEST(SimDriver, CapturedWorkChainsOnItsStreamAndJoinsMergeTerminals) {
  SimDriver d;
  d.begin_capture(1);
  CaptureInfo info;
  ASSERT_TRUE(d.capture_info(1, info));
  const std::uint64_t id = info.id;
  EXPECT_NE(id, 0u);
  EXPECT_TRUE(info.terminals.empty());
  const GraphNode a = d.capture_work(1);
  const GraphNode b = d.capture_work(1);
  EXPECT_EQ(deps_of(d, a), std::vector<GraphNode>{});
  EXPECT_EQ(deps_of(d, b), std::vector<GraphNode>{a});
  EXPECT_EQ(terminals_of(d, 1), std::vector<GraphNode>{b});
  // Stream 2 forks from 1: it joins the capture with 1's terminals.
  EXPECT_FALSE(d.is_capturing(2));
  d.capture_join(2, 1);
  ASSERT_TRUE(d.capture_info(2, info));
  EXPECT_EQ(info.id, id);
  EXPECT_EQ(info.terminals, std::vector<GraphNode>{b});
  const GraphNode c = d.capture_work(2);
  const GraphNode e = d.capture_work(1);
  EXPECT_EQ(deps_of(d, c), std::vector<GraphNode>{b});
  // Stream 1 joins 2 back: its next work depends on both branches.
  d.capture_join(1, 2);
  d.capture_join(1, 2);  // twice: no duplicate terminal
  EXPECT_EQ(terminals_of(d, 1), (std::vector<GraphNode>{e, c}));
  const GraphNode f = d.capture_work(1);
  EXPECT_EQ(deps_of(d, f), (std::vector<GraphNode>{e, c}));
  // Ending a stream that joined leaves the capture going; ending the origin ends it all.
  d.end_capture(2);
  EXPECT_FALSE(d.is_capturing(2));
  EXPECT_TRUE(d.is_capturing(1));
  d.capture_join(2, 1);
  d.end_capture(1);
  EXPECT_FALSE(d.is_capturing(1));
  EXPECT_FALSE(d.is_capturing(2));
  EXPECT_TRUE(
      contains(message_of<DriverError>([&] { deps_of(d, f); }), "no node of a capture underway"));
  // A new capture has a new id.
  d.begin_capture(1);
  ASSERT_TRUE(d.capture_info(1, info));
  EXPECT_NE(info.id, id);
  d.end_capture(1);
}

TEST(SimDriver, CaptureGraphMisuseIsReportedByName) {
  SimDriver d;
  EXPECT_TRUE(contains(message_of<DriverError>([&] { d.capture_work(3); }),
                       "stream 3, which is not capturing"));
  EXPECT_TRUE(contains(message_of<DriverError>([&] { d.capture_join(4, 3); }),
                       "to stream 3, which is not capturing"));
  d.begin_capture(1);
  d.begin_capture(2);  // a capture of its own
  EXPECT_TRUE(contains(message_of<DriverError>([&] { d.capture_join(2, 1); }),
                       "streams of two captures cannot wait on each other"));
  EXPECT_TRUE(contains(message_of<DriverError>([&] { d.begin_capture(1); }), "already capturing"));
  EXPECT_TRUE(contains(message_of<DriverError>([&] { d.record_event(d.create_event(), 5); }),
                       "illegal during capture"));
  d.end_capture(1);
  d.end_capture(2);
  EXPECT_TRUE(
      contains(message_of<DriverError>([&] { d.end_capture(2); }), "which is not capturing"));
}

}  // namespace
}  // namespace ccalloc::sim
