// The size rules of src/core/rounding.hpp against docs/pytorch-behaviour.md: request rounding
// (round_size, §2.3, and the roundup table of §1.4), segment sizes (§2.4), the split rule
// (§2.8) and the oversize rules of get_free_block (§2.6). Every expected value is computed by
// hand from the pseudocode there; the comments show the arithmetic.
#include "core/rounding.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "ccalloc/config.hpp"

namespace ccalloc::core {
namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kGiB = 1024 * kMiB;

Config PyTorch() {
  return Config::parse("pytorch");
}
Config Divisions(const char* value) {
  return Config::parse(std::string("pytorch,roundup_power2_divisions:") + value);
}

// ---------------------------------------------------------------------------------------
// round_size: the table of §2.3

TEST(RoundSize, TinyRequestsRoundUpToTheMinimumBlockOf512) {
  const Config d0 = PyTorch();
  const Config d4 = Divisions("4");
  for (const Config& c : {d0, d4}) {
    EXPECT_EQ(round_size(0, c), 512u);
    EXPECT_EQ(round_size(1, c), 512u);
    EXPECT_EQ(round_size(511, c), 512u);
    EXPECT_EQ(round_size(512, c), 512u);
  }
}

TEST(RoundSize, WithoutDivisionsSizesRoundUpTo512Multiples) {
  const Config c = PyTorch();
  EXPECT_EQ(round_size(513, c), 1024u);
  EXPECT_EQ(round_size(1024, c), 1024u);
  EXPECT_EQ(round_size(1200, c), 1536u);
  EXPECT_EQ(round_size(4000, c), 4096u);
  EXPECT_EQ(round_size(1 * kMiB + 1, c), 1'049'088u);         // 1 MiB + 512
  EXPECT_EQ(round_size(10 * kMiB + 1, c), 10'486'272u);       // 10 MiB + 512
  EXPECT_EQ(round_size(1200 * kMiB + 7, c), 1'258'291'712u);  // 1200 MiB + 512
  EXPECT_EQ(round_size(1200 * kMiB, c), 1'258'291'200u);      // already a multiple
}

TEST(RoundSize, FourDivisionsRoundToQuarterStepsBetweenPowersOfTwo) {
  const Config c = Divisions("4");
  // 1200 <= 4 x 512: plain 512 B rounding.
  EXPECT_EQ(round_size(1200, c), 1536u);
  // 4000 > 2048: floor2 = 2048, step 512, 3584 + 512.
  EXPECT_EQ(round_size(4000, c), 4096u);
  // floor2 = 1 MiB, step 256 KiB: 1 MiB + 256 KiB.
  EXPECT_EQ(round_size(1 * kMiB + 1, c), 1'310'720u);
  // floor2 = 8 MiB, step 2 MiB: 10 MiB + 2 MiB.
  EXPECT_EQ(round_size(10 * kMiB + 1, c), 12'582'912u);
  // floor2 = 1 GiB, step 256 MiB: 1280 MiB (1.25 GiB).
  EXPECT_EQ(round_size(1200 * kMiB + 7, c), 1'342'177'280u);
  // A size on a step boundary is unchanged: 1 MiB + 3 x 256 KiB.
  EXPECT_EQ(round_size(1 * kMiB + 768 * kKiB, c), 1 * kMiB + 768 * kKiB);
}

TEST(RoundSize, PowersOfTwoAreUnchangedUnderAnyDivisions) {
  for (const char* d : {"2", "4", "8", "16"}) {
    const Config c = Divisions(d);
    for (const std::size_t p : {std::size_t{4096}, 64 * kKiB, 1 * kMiB, 2 * kMiB, 16 * kMiB,
                                1 * kGiB, 4 * kGiB, 64 * kGiB}) {
      EXPECT_EQ(round_size(p, c), p) << "divisions " << d << ", size " << p;
    }
  }
}

TEST(RoundSize, DivisionsApplyOnlyAbove512TimesTheDivisions) {
  const Config c = Divisions("16");
  // 4097 <= 16 x 512 = 8192: plain 512 B rounding gives 4608 (a 1/16 step would give 4352).
  EXPECT_EQ(round_size(4097, c), 4608u);
  // 8193 > 8192: floor2 = 8192, step 512 -> 8704.
  EXPECT_EQ(round_size(8193, c), 8704u);
  // 65 KiB + 1 > 8192: floor2 = 64 KiB, step 4 KiB -> 68 KiB.
  EXPECT_EQ(round_size(65 * kKiB + 1, c), 68 * kKiB);
}

TEST(RoundSize, OneDivisionBehavesLikeNone) {
  const Config none = PyTorch();
  const Config one = Divisions("1");
  for (const std::size_t size : {std::size_t{1}, std::size_t{1200}, std::size_t{4000}, 1 * kMiB + 1,
                                 10 * kMiB + 1, 1200 * kMiB + 7, 3 * kGiB + 1}) {
    EXPECT_EQ(round_size(size, one), round_size(size, none)) << "size " << size;
  }
  EXPECT_EQ(round_size(1 * kMiB + 1, one), 1'049'088u);
  EXPECT_EQ(round_size(10 * kMiB + 1, one), 10'486'272u);
  EXPECT_EQ(round_size(3 * kGiB + 1, one), 3 * kGiB + 512);
}

// `[256:1,512:2,1024:4,>:8]`: K names the interval [K MB, 2K MB) and the first entry also
// fills the intervals below it, so <512 MiB -> 1, [512 MiB, 1 GiB) -> 2, [1 GiB, 2 GiB) ->
// 4, >= 2 GiB -> 8 (§1.4, one interval off from PyTorch's documentation).
class BracketDivisions : public testing::Test {
 protected:
  const Config c = Divisions("[256:1,512:2,1024:4,>:8]");
};

TEST_F(BracketDivisions, BelowTheFirstIntervalUsesTheFirstEntry) {
  // d = 1: plain 512 B rounding.
  EXPECT_EQ(round_size(1 * kMiB + 1, c), 1 * kMiB + 512);
  EXPECT_EQ(round_size(100 * kMiB + 1, c), 100 * kMiB + 512);
}

TEST_F(BracketDivisions, The256MiBEntryCoversOnly256To512MiB) {
  // d = 1 from 256 MiB up to 512 MiB: plain 512 B rounding.
  EXPECT_EQ(round_size(300 * kMiB + 1, c), 314'573'312u);  // 300 MiB + 512
  EXPECT_EQ(round_size(512 * kMiB - 1, c), 512 * kMiB);
}

TEST_F(BracketDivisions, The512MiBEntryRoundsToHalves) {
  // d = 2: floor2 = 512 MiB, step 256 MiB.
  EXPECT_EQ(round_size(512 * kMiB + 1, c), 768 * kMiB);
  EXPECT_EQ(round_size(600 * kMiB + 1, c), 805'306'368u);  // 768 MiB
  EXPECT_EQ(round_size(768 * kMiB + 1, c), 1 * kGiB);
  EXPECT_EQ(round_size(768 * kMiB, c), 768 * kMiB);
}

TEST_F(BracketDivisions, The1024MiBEntryRoundsToQuarters) {
  // d = 4: floor2 = 1 GiB, step 256 MiB.
  EXPECT_EQ(round_size(1 * kGiB + 1, c), 1280 * kMiB);
  EXPECT_EQ(round_size(1200 * kMiB + 7, c), 1'342'177'280u);  // 1280 MiB
  EXPECT_EQ(round_size(2 * kGiB - 1, c), 2 * kGiB);
}

TEST_F(BracketDivisions, TheGreaterThanEntryRoundsToEighthsFrom2GiBUp) {
  // d = 8: floor2 = 2 GiB, step 256 MiB.
  EXPECT_EQ(round_size(2 * kGiB + 1, c), 2304 * kMiB);
  EXPECT_EQ(round_size(2560 * kMiB + 1, c), 2'952'790'016u);  // 2816 MiB
  // floor2 = 32 GiB (last table entry), step 4 GiB.
  EXPECT_EQ(round_size(40 * kGiB + 1, c), 44 * kGiB);
  // floor2 = 64 GiB, still the last entry: step 8 GiB.
  EXPECT_EQ(round_size(65 * kGiB, c), 72 * kGiB);
}

// ---------------------------------------------------------------------------------------
// segment_size_for: §2.4 get_allocation_size

TEST(SegmentSize, SmallRequestsGetATwoMiBSegment) {
  const Config c = PyTorch();
  EXPECT_EQ(segment_size_for(512, c), 2 * kMiB);
  EXPECT_EQ(segment_size_for(4096, c), 2 * kMiB);
  EXPECT_EQ(segment_size_for(1 * kMiB, c), 2 * kMiB);  // exactly 1 MiB is still small
}

TEST(SegmentSize, RequestsBetweenOneAndTenMiBGetTwentyMiB) {
  const Config c = PyTorch();
  EXPECT_EQ(segment_size_for(1 * kMiB + 512, c), 20 * kMiB);
  EXPECT_EQ(segment_size_for(5 * kMiB, c), 20 * kMiB);
  EXPECT_EQ(segment_size_for(10 * kMiB - 512, c), 20 * kMiB);
}

TEST(SegmentSize, TenMiBAndAboveRoundToTwoMiBMultiples) {
  const Config c = PyTorch();
  EXPECT_EQ(segment_size_for(10 * kMiB, c), 10 * kMiB);
  EXPECT_EQ(segment_size_for(10 * kMiB + 512, c), 12 * kMiB);
  EXPECT_EQ(segment_size_for(12 * kMiB, c), 12 * kMiB);
  EXPECT_EQ(segment_size_for(19 * kMiB, c), 20 * kMiB);
  EXPECT_EQ(segment_size_for(1'258'291'712, c), 1'260'388'352u);  // 601 x 2 MiB
}

TEST(SegmentSize, LargeSegmentSizeReplacesTwentyMiBForMidSizedRequests) {
  const Config c = Config::parse("pytorch,large_segment_size_mb:64");
  EXPECT_EQ(segment_size_for(1 * kMiB, c), 2 * kMiB);
  EXPECT_EQ(segment_size_for(1 * kMiB + 512, c), 64 * kMiB);
  EXPECT_EQ(segment_size_for(10 * kMiB - 512, c), 64 * kMiB);
  EXPECT_EQ(segment_size_for(10 * kMiB, c), 10 * kMiB);
  EXPECT_EQ(segment_size_for(10 * kMiB + 512, c), 12 * kMiB);
}

// ---------------------------------------------------------------------------------------
// should_split: §2.8

TEST(ShouldSplit, SmallPoolSplitsARemainderOf512) {
  const Config c = PyTorch();
  EXPECT_TRUE(should_split(2 * kMiB, 2 * kMiB - 512, /*small_pool=*/true, c));
  EXPECT_TRUE(should_split(1024, 512, true, c));
  EXPECT_TRUE(should_split(2 * kMiB, 512, true, c));
}

TEST(ShouldSplit, SmallPoolKeepsAnExactFitWhole) {
  const Config c = PyTorch();
  EXPECT_FALSE(should_split(2 * kMiB, 2 * kMiB, true, c));
  EXPECT_FALSE(should_split(512, 512, true, c));
}

TEST(ShouldSplit, LargePoolKeepsARemainderOfExactlyOneMiB) {
  const Config c = PyTorch();
  EXPECT_FALSE(should_split(20 * kMiB, 19 * kMiB, /*small_pool=*/false, c));
  EXPECT_FALSE(should_split(20 * kMiB, 20 * kMiB - 512, false, c));  // remainder 512
  EXPECT_FALSE(should_split(20 * kMiB, 20 * kMiB, false, c));
}

TEST(ShouldSplit, LargePoolSplitsARemainderAboveOneMiB) {
  const Config c = PyTorch();
  EXPECT_TRUE(should_split(20 * kMiB, 19 * kMiB - 512, false, c));  // remainder 1 MiB + 512
  EXPECT_TRUE(should_split(20 * kMiB, 1 * kMiB + 512, false, c));
}

TEST(ShouldSplit, OversizeRequestsNeverSplit) {
  const Config c = Config::parse("pytorch,max_split_size_mb:64");
  EXPECT_FALSE(should_split(200 * kMiB, 64 * kMiB, false, c));
  EXPECT_FALSE(should_split(200 * kMiB, 100 * kMiB, false, c));
  // Just below max_split_size the usual large-pool rule applies, even in an oversize block.
  EXPECT_TRUE(should_split(200 * kMiB, 64 * kMiB - 512, false, c));
  // The small pool ignores max_split_size.
  EXPECT_TRUE(should_split(2 * kMiB, 512, true, c));
}

// ---------------------------------------------------------------------------------------
// oversize_allows: §2.6, max_split_size_mb:64, max_non_split_rounding_mb:20

TEST(OversizeAllows, WithoutMaxSplitSizeEveryBlockMayServeEveryRequest) {
  const Config c = PyTorch();
  EXPECT_TRUE(oversize_allows(1 * kGiB, 2 * kMiB, c));
  EXPECT_TRUE(oversize_allows(100 * kGiB, 1 * kGiB, c));
}

class OversizeRules : public testing::Test {
 protected:
  const Config c = Config::parse("pytorch,max_split_size_mb:64,max_non_split_rounding_mb:20");
};

TEST_F(OversizeRules, NormalRequestsNeverTakeAnOversizeBlock) {
  EXPECT_FALSE(oversize_allows(64 * kMiB, 64 * kMiB - 512, c));
  EXPECT_FALSE(oversize_allows(64 * kMiB, 2 * kMiB, c));
  EXPECT_FALSE(oversize_allows(1 * kGiB, 63 * kMiB, c));
}

TEST_F(OversizeRules, NormalRequestsTakeBlocksJustBelowMaxSplitSize) {
  EXPECT_TRUE(oversize_allows(64 * kMiB - 512, 64 * kMiB - 512, c));
  EXPECT_TRUE(oversize_allows(64 * kMiB - 512, 2 * kMiB, c));
}

TEST_F(OversizeRules, OversizeRequestsTakeBlocksWithinTheNonSplitRounding) {
  // request 64 MiB: block < 64 + 20 MiB.
  EXPECT_TRUE(oversize_allows(64 * kMiB, 64 * kMiB, c));
  EXPECT_TRUE(oversize_allows(84 * kMiB - 512, 64 * kMiB, c));
  // request 100 MiB: block < 120 MiB.
  EXPECT_TRUE(oversize_allows(120 * kMiB - 512, 100 * kMiB, c));
}

TEST_F(OversizeRules, OversizeRequestsRefuseBlocksAtOrAboveTheNonSplitRounding) {
  EXPECT_FALSE(oversize_allows(84 * kMiB, 64 * kMiB, c));
  EXPECT_FALSE(oversize_allows(120 * kMiB, 100 * kMiB, c));
  EXPECT_FALSE(oversize_allows(1 * kGiB, 100 * kMiB, c));
}

}  // namespace
}  // namespace ccalloc::core
