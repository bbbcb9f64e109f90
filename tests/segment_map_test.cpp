// SegmentMap: which arena owns the segment at an address (lock-free reads).
#include "core/segment_map.hpp"

#include <gtest/gtest.h>

#include "ccalloc/errors.hpp"

namespace {

using ccalloc::DevicePtr;
using ccalloc::core::SegmentMap;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr DevicePtr kBase = 0x7f0000000000;

TEST(SegmentMap, UnknownAddressesHaveNoOwner) {
  SegmentMap m;
  EXPECT_EQ(m.owner_of(kBase), 0u);
  EXPECT_EQ(m.owner_of(0), 0u);
  EXPECT_EQ(m.owner_of(~DevicePtr{0}), 0u);  // beyond the indexed address space
}

TEST(SegmentMap, AlignedSegmentIsOwnedOverItsWholeRangeOnly) {
  SegmentMap m;
  m.assign(kBase, 20 * kMiB, 3);
  EXPECT_EQ(m.owner_of(kBase), 3u);
  EXPECT_EQ(m.owner_of(kBase + 20 * kMiB - 512), 3u);
  EXPECT_EQ(m.owner_of(kBase + 20 * kMiB), 0u);
  EXPECT_EQ(m.owner_of(kBase - 512), 0u);
  m.clear(kBase, 20 * kMiB);
  EXPECT_EQ(m.owner_of(kBase + 4 * kMiB), 0u);
}

// Two unaligned segments meeting inside one 2 MiB granule keep their own owners on each
// side of the boundary, whichever is assigned or cleared first.
TEST(SegmentMap, UnalignedNeighboursShareAGranule) {
  SegmentMap m;
  const DevicePtr a = kBase + 512 * 1024;  // [a, a + 3 MiB): ends 1.5 MiB into granule 1
  const DevicePtr b = a + 3 * kMiB;        // [b, b + 2 MiB): starts there
  m.assign(b, 2 * kMiB, 2);
  m.assign(a, 3 * kMiB, 1);
  EXPECT_EQ(m.owner_of(a), 1u);
  EXPECT_EQ(m.owner_of(b - 512), 1u);
  EXPECT_EQ(m.owner_of(b), 2u);
  EXPECT_EQ(m.owner_of(b + 2 * kMiB - 512), 2u);
  EXPECT_EQ(m.owner_of(b + 2 * kMiB), 0u);
  m.clear(a, 3 * kMiB);
  EXPECT_EQ(m.owner_of(a), 0u);
  EXPECT_EQ(m.owner_of(b - 512), 0u);
  EXPECT_EQ(m.owner_of(b), 2u);
  m.assign(a, 3 * kMiB, 7);
  m.clear(b, 2 * kMiB);
  EXPECT_EQ(m.owner_of(b - 512), 7u);
  EXPECT_EQ(m.owner_of(b), 0u);
}

TEST(SegmentMap, LargestOwnerRoundTrips) {
  SegmentMap m;
  m.assign(kBase, 2 * kMiB, SegmentMap::kMaxOwner);
  EXPECT_EQ(m.owner_of(kBase + kMiB), SegmentMap::kMaxOwner);
}

TEST(SegmentMap, AddressBeyondFiftySevenBitsIsAnError) {
  SegmentMap m;
  EXPECT_THROW(m.assign(DevicePtr{1} << 60, 2 * kMiB, 1), ccalloc::DriverError);
}

}  // namespace
