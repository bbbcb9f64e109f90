// Config::parse, from_environment, roundup_divisions_for and to_string: the grammar and the
// option table of docs/pytorch-behaviour.md §1.
#include "ccalloc/config.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ccalloc/errors.hpp"

namespace ccalloc {
namespace {

constexpr std::size_t kGiB = 1024 * kMiB;

using Table = std::array<std::size_t, Config::kRoundupIntervals>;

// The message of the ConfigError that parse(text) throws; fails the test if none is thrown.
std::string ParseError(std::string_view text) {
  try {
    Config::parse(text);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "parse(\"" << text << "\") did not throw ConfigError";
  return "";
}

// Whether `message` contains every one of `parts` (gmock's HasSubstr is not linked).
testing::AssertionResult ContainsAll(const std::string& message,
                                     std::initializer_list<std::string_view> parts) {
  for (std::string_view part : parts) {
    if (message.find(part) == std::string::npos) {
      return testing::AssertionFailure() << "'" << message << "' lacks '" << part << "'";
    }
  }
  return testing::AssertionSuccess();
}

// `c` with `source` cleared, to compare configs that were spelled differently.
Config WithoutSource(Config c) {
  c.source.clear();
  return c;
}

// ---------------------------------------------------------------------------------------
// Defaults

// ccalloc's defaults: PyTorch's native defaults but for expandable segments, which are on.
TEST(ConfigDefaults, MemberInitialisersArePyTorchNativeDefaultsWithExpandableSegments) {
  const Config c;
  EXPECT_EQ(c.preset, "ccalloc");
  EXPECT_EQ(c.backend, BackendKind::kNative);
  EXPECT_EQ(c.max_split_size, SIZE_MAX);
  EXPECT_EQ(c.max_non_split_rounding_size, 20 * kMiB);
  EXPECT_EQ(c.large_segment_size, 20 * kMiB);
  EXPECT_EQ(c.roundup_power2_divisions, Table{});
  EXPECT_EQ(c.garbage_collection_threshold, 0.0);
  EXPECT_TRUE(c.expandable_segments);
  EXPECT_FALSE(c.release_lock_on_cudamalloc);
  EXPECT_EQ(c.per_process_memory_fraction, 1.0);
  EXPECT_FALSE(c.graph_capture_record_stream_reuse);
  EXPECT_FALSE(c.pinned_use_cuda_host_register);
  EXPECT_EQ(c.pinned_num_register_threads, 1u);
  EXPECT_FALSE(c.pinned_use_background_threads);
  EXPECT_EQ(c.pinned_reserve_segment_size_mb, 0u);
  EXPECT_FALSE(c.uncached);
  EXPECT_EQ(c.source, "");
}

TEST(ConfigDefaults, EmptyStringGivesDefaults) {
  EXPECT_EQ(Config::parse(""), Config{});
}

TEST(ConfigDefaults, WhitespaceOnlyStringGivesDefaultsAndKeepsSource) {
  const Config c = Config::parse(" \t\n ");
  EXPECT_EQ(WithoutSource(c), Config{});
  EXPECT_EQ(c.source, " \t\n ");
}

// ---------------------------------------------------------------------------------------
// Each key

TEST(ConfigKeys, SourceHoldsTheRawText) {
  EXPECT_EQ(Config::parse(" expandable_segments : True ").source, " expandable_segments : True ");
}

TEST(ConfigKeys, BackendCudaMallocAsync) {
  EXPECT_EQ(Config::parse("backend:cudaMallocAsync").backend, BackendKind::kCudaMallocAsync);
}

TEST(ConfigKeys, BackendNative) {
  EXPECT_EQ(Config::parse("backend:native").backend, BackendKind::kNative);
}

TEST(ConfigKeys, MaxSplitSizeMbIsStoredInBytes) {
  EXPECT_EQ(Config::parse("max_split_size_mb:64").max_split_size, 64 * kMiB);
}

TEST(ConfigKeys, MaxSplitSizeMbAcceptsExactlyTheLargeSegmentSize) {
  EXPECT_EQ(Config::parse("max_split_size_mb:20").max_split_size, 20 * kMiB);
}

TEST(ConfigKeys, MaxSplitSizeMbIsClampedSoBytesDoNotOverflow) {
  EXPECT_EQ(Config::parse("max_split_size_mb:18446744073709551615").max_split_size,
            SIZE_MAX / kMiB * kMiB);
}

TEST(ConfigKeys, MaxNonSplitRoundingMbIsStoredInBytes) {
  EXPECT_EQ(Config::parse("max_non_split_rounding_mb:64").max_non_split_rounding_size, 64 * kMiB);
}

TEST(ConfigKeys, LargeSegmentSizeMbIsStoredInBytesAndIsTheMaxNonSplitRoundingDefault) {
  const Config c = Config::parse("large_segment_size_mb:40");
  EXPECT_EQ(c.large_segment_size, 40 * kMiB);
  EXPECT_EQ(c.max_non_split_rounding_size, 40 * kMiB);
}

TEST(ConfigKeys, ExplicitMaxNonSplitRoundingIsKeptWhenLargeSegmentSizeComesLater) {
  const Config c = Config::parse("max_non_split_rounding_mb:50,large_segment_size_mb:40");
  EXPECT_EQ(c.max_non_split_rounding_size, 50 * kMiB);
  EXPECT_EQ(c.large_segment_size, 40 * kMiB);
}

TEST(ConfigKeys, GarbageCollectionThresholdIsStored) {
  EXPECT_EQ(Config::parse("garbage_collection_threshold:0.6").garbage_collection_threshold, 0.6);
}

TEST(ConfigKeys, PerProcessMemoryFractionAcceptsBothBounds) {
  EXPECT_EQ(Config::parse("per_process_memory_fraction:0").per_process_memory_fraction, 0.0);
  EXPECT_EQ(Config::parse("per_process_memory_fraction:1").per_process_memory_fraction, 1.0);
  EXPECT_EQ(Config::parse("per_process_memory_fraction:0.25").per_process_memory_fraction, 0.25);
}

TEST(ConfigKeys, PinnedNumRegisterThreadsAcceptsPowersOfTwoUpTo128) {
  EXPECT_EQ(Config::parse("pinned_num_register_threads:1").pinned_num_register_threads, 1u);
  EXPECT_EQ(Config::parse("pinned_num_register_threads:8").pinned_num_register_threads, 8u);
  EXPECT_EQ(Config::parse("pinned_num_register_threads:128").pinned_num_register_threads, 128u);
}

TEST(ConfigKeys, PinnedReserveSegmentSizeMbIsStoredInMb) {
  EXPECT_EQ(Config::parse("pinned_reserve_segment_size_mb:64").pinned_reserve_segment_size_mb, 64u);
}

TEST(ConfigKeys, ReleaseLockOnHipmallocIsAnAlias) {
  EXPECT_TRUE(Config::parse("release_lock_on_hipmalloc:True").release_lock_on_cudamalloc);
}

TEST(ConfigKeys, PinnedUseHipHostRegisterIsAnAlias) {
  EXPECT_TRUE(Config::parse("pinned_use_hip_host_register:True").pinned_use_cuda_host_register);
}

TEST(ConfigKeys, LaterOccurrenceOfAKeyWins) {
  EXPECT_EQ(Config::parse("max_split_size_mb:64,max_split_size_mb:128").max_split_size, 128 * kMiB);
}

TEST(ConfigKeys, OneTrailingCommaIsAcceptedAsInPyTorch) {
  EXPECT_TRUE(Config::parse("expandable_segments:True,").expandable_segments);
}

TEST(ConfigKeys, SeveralKeysAreAllApplied) {
  const Config c = Config::parse(
      "backend:native,max_split_size_mb:256,expandable_segments:True,"
      "garbage_collection_threshold:0.8,per_process_memory_fraction:0.5");
  EXPECT_EQ(c.max_split_size, 256 * kMiB);
  EXPECT_TRUE(c.expandable_segments);
  EXPECT_EQ(c.garbage_collection_threshold, 0.8);
  EXPECT_EQ(c.per_process_memory_fraction, 0.5);
}

// Every boolean key, read through its member.
struct BoolKey {
  const char* key;
  bool Config::*member;
};

class ConfigBoolKeyTest : public testing::TestWithParam<BoolKey> {};

TEST_P(ConfigBoolKeyTest, AcceptsExactlyTrueAndFalse) {
  const BoolKey& k = GetParam();
  EXPECT_TRUE(Config::parse(std::string(k.key) + ":True").*k.member);
  EXPECT_FALSE(Config::parse(std::string(k.key) + ":False").*k.member);
}

TEST_P(ConfigBoolKeyTest, RejectsLowercaseTrue) {
  const std::string key = GetParam().key;
  EXPECT_TRUE(ContainsAll(ParseError(key + ":true"),
                          {"'" + key + "'", "'true'", "offset " + std::to_string(key.size() + 1),
                           "expected True or False"}));
}

INSTANTIATE_TEST_SUITE_P(
    AllBoolKeys, ConfigBoolKeyTest,
    testing::Values(
        BoolKey{"expandable_segments", &Config::expandable_segments},
        BoolKey{"release_lock_on_cudamalloc", &Config::release_lock_on_cudamalloc},
        BoolKey{"graph_capture_record_stream_reuse", &Config::graph_capture_record_stream_reuse},
        BoolKey{"pinned_use_cuda_host_register", &Config::pinned_use_cuda_host_register},
        BoolKey{"pinned_use_background_threads", &Config::pinned_use_background_threads},
        BoolKey{"uncached", &Config::uncached},
        BoolKey{"stitch_segments", &Config::stitch_segments},
        BoolKey{"stream_borrow_wait", &Config::stream_borrow_wait}),
    [](const testing::TestParamInfo<BoolKey>& param) { return std::string(param.param.key); });

// ---------------------------------------------------------------------------------------
// Whitespace

TEST(ConfigWhitespace, IsDroppedEverywhereIncludingInsideTokens) {
  const Config c = Config::parse(
      " expandable_segments : True ,\n max_split_size_mb:\t1 28 ,"
      " roundup_power2_divisions : [ 256 : 1 , > : 8 ] ");
  EXPECT_TRUE(c.expandable_segments);
  EXPECT_EQ(c.max_split_size, 128 * kMiB);
  EXPECT_EQ(c.roundup_power2_divisions, (Table{1, 1, 1, 1, 1, 1, 1, 1, 1, 8, 8, 8, 8, 8, 8, 8}));
}

// ---------------------------------------------------------------------------------------
// Presets

TEST(ConfigPreset, PytorchPresetThenKeyOverridesThatKeyOnly) {
  const Config c = Config::parse("pytorch,max_split_size_mb:64");
  EXPECT_EQ(c.preset, "pytorch");
  EXPECT_EQ(c.max_split_size, 64 * kMiB);
  EXPECT_EQ(c.large_segment_size, 20 * kMiB);
  EXPECT_FALSE(c.expandable_segments);
}

TEST(ConfigPreset, PytorchPresetHasPyTorchNativeDefaults) {
  const Config c = Config::parse("pytorch");
  EXPECT_EQ(c.preset, "pytorch");
  EXPECT_EQ(c.backend, BackendKind::kNative);
  EXPECT_EQ(c.max_split_size, SIZE_MAX);
  EXPECT_EQ(c.max_non_split_rounding_size, 20 * kMiB);
  EXPECT_EQ(c.large_segment_size, 20 * kMiB);
  EXPECT_EQ(c.roundup_power2_divisions, Table{});
  EXPECT_EQ(c.garbage_collection_threshold, 0.0);
  EXPECT_FALSE(c.expandable_segments);
  EXPECT_FALSE(c.release_lock_on_cudamalloc);
  EXPECT_EQ(c.per_process_memory_fraction, 1.0);
  EXPECT_FALSE(c.graph_capture_record_stream_reuse);
  EXPECT_FALSE(c.pinned_use_cuda_host_register);
  EXPECT_EQ(c.pinned_num_register_threads, 1u);
  EXPECT_FALSE(c.pinned_use_background_threads);
  EXPECT_EQ(c.pinned_reserve_segment_size_mb, 0u);
  EXPECT_FALSE(c.uncached);
}

TEST(ConfigPreset, CcallocPresetGivesTheDefaultConfig) {
  EXPECT_EQ(WithoutSource(Config::parse("ccalloc")), Config{});
}

TEST(ConfigPreset, PresetNameAfterTheFirstElementIsAnError) {
  EXPECT_TRUE(ContainsAll(ParseError("max_split_size_mb:64,pytorch"),
                          {"preset 'pytorch'", "offset 21", "first"}));
}

TEST(ConfigPreset, UnknownPresetIsAnError) {
  EXPECT_TRUE(ContainsAll(ParseError("tensorflow,max_split_size_mb:64"),
                          {"unknown preset 'tensorflow'", "offset 0", "pytorch or ccalloc"}));
}

// ---------------------------------------------------------------------------------------
// roundup_power2_divisions

TEST(ConfigRoundup, SingleNFillsEveryInterval) {
  Table expected;
  expected.fill(4);
  EXPECT_EQ(Config::parse("roundup_power2_divisions:4").roundup_power2_divisions, expected);
}

TEST(ConfigRoundup, SingleZeroIsAcceptedAsOff) {
  EXPECT_EQ(Config::parse("roundup_power2_divisions:0").roundup_power2_divisions, Table{});
}

TEST(ConfigRoundup, BracketWorkedExampleFromReference) {
  EXPECT_EQ(
      Config::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions,
      (Table{1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8}));
}

TEST(ConfigRoundup, BracketIntervalsNotNamedAfterTheFirstStayOff) {
  EXPECT_EQ(Config::parse("roundup_power2_divisions:[2:2,64:4]").roundup_power2_divisions,
            (Table{2, 2, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
}

TEST(ConfigRoundup, BracketIntervalAbove32GiBClampsToTheLastEntry) {
  EXPECT_EQ(Config::parse("roundup_power2_divisions:[1:2,65536:4]").roundup_power2_divisions,
            (Table{2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4}));
}

TEST(ConfigRoundup, BracketGreaterThanAloneFillsFromTheSecondInterval) {
  EXPECT_EQ(Config::parse("roundup_power2_divisions:[>:8]").roundup_power2_divisions,
            (Table{0, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8}));
}

TEST(ConfigRoundup, BracketAcceptsZeroDivisions) {
  EXPECT_EQ(Config::parse("roundup_power2_divisions:[1:4,2:0,>:8]").roundup_power2_divisions,
            (Table{4, 0, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8}));
}

TEST(ConfigRoundup, LookupIndexIsFloorLog2MinusTwentyClamped) {
  Config c;
  for (std::size_t i = 0; i < c.roundup_power2_divisions.size(); ++i) {
    c.roundup_power2_divisions[i] = 100 + i;
  }
  EXPECT_EQ(c.roundup_divisions_for(0), 100u);
  EXPECT_EQ(c.roundup_divisions_for(1), 100u);
  EXPECT_EQ(c.roundup_divisions_for(kMiB - 1), 100u);
  EXPECT_EQ(c.roundup_divisions_for(kMiB), 100u);
  EXPECT_EQ(c.roundup_divisions_for(2 * kMiB - 1), 100u);
  EXPECT_EQ(c.roundup_divisions_for(2 * kMiB), 101u);
  EXPECT_EQ(c.roundup_divisions_for(512 * kMiB - 1), 108u);
  EXPECT_EQ(c.roundup_divisions_for(512 * kMiB), 109u);
  EXPECT_EQ(c.roundup_divisions_for(kGiB - 1), 109u);
  EXPECT_EQ(c.roundup_divisions_for(kGiB), 110u);
  EXPECT_EQ(c.roundup_divisions_for(32 * kGiB - 1), 114u);
  EXPECT_EQ(c.roundup_divisions_for(32 * kGiB), 115u);
  EXPECT_EQ(c.roundup_divisions_for(SIZE_MAX), 115u);
}

TEST(ConfigRoundup, LookupOfWorkedExampleIsOneIntervalOffFromPyTorchDocs) {
  const Config c = Config::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
  EXPECT_EQ(c.roundup_divisions_for(256 * kMiB), 1u);
  EXPECT_EQ(c.roundup_divisions_for(512 * kMiB - 1), 1u);
  EXPECT_EQ(c.roundup_divisions_for(512 * kMiB), 2u);
  EXPECT_EQ(c.roundup_divisions_for(kGiB - 1), 2u);
  EXPECT_EQ(c.roundup_divisions_for(kGiB), 4u);
  EXPECT_EQ(c.roundup_divisions_for(2 * kGiB - 1), 4u);
  EXPECT_EQ(c.roundup_divisions_for(2 * kGiB), 8u);
  EXPECT_EQ(c.roundup_divisions_for(SIZE_MAX), 8u);
}

// ---------------------------------------------------------------------------------------
// large_segment_size_mb is read first

TEST(ConfigFirstPass, LargeSegmentSizeGivenLaterRaisesTheMaxSplitSizeMinimum) {
  EXPECT_TRUE(ContainsAll(ParseError("max_split_size_mb:30,large_segment_size_mb:40"),
                          {"'max_split_size_mb'", "'30'", "offset 18", "must be >= 40"}));
}

TEST(ConfigFirstPass, LargeSegmentSizeGivenLaterLowersTheMaxSplitSizeMinimum) {
  EXPECT_EQ(Config::parse("max_split_size_mb:15,large_segment_size_mb:12").max_split_size,
            15 * kMiB);
}

TEST(ConfigFirstPass, LargeSegmentSizeGivenLaterRaisesTheMaxNonSplitRoundingMinimum) {
  EXPECT_TRUE(ContainsAll(ParseError("max_non_split_rounding_mb:25,large_segment_size_mb:30"),
                          {"'max_non_split_rounding_mb'", "'25'", "offset 26", "must be >= 30"}));
}

// ---------------------------------------------------------------------------------------
// Value errors: each names the key, the value, the offset and the accepted form

TEST(ConfigErrors, BooleanMessageIsExact) {
  EXPECT_EQ(ParseError("expandable_segments:yes"),
            "ccalloc config: invalid value 'yes' for key 'expandable_segments' at offset 20: "
            "expected True or False");
}

TEST(ConfigErrors, OffsetCountsFromTheStartOfTheWholeString) {
  EXPECT_TRUE(ContainsAll(ParseError("uncached:False, expandable_segments:yes"),
                          {"'expandable_segments'", "'yes'", "offset 36"}));
}

TEST(ConfigErrors, UnknownBackend) {
  EXPECT_TRUE(ContainsAll(ParseError("backend:cuda"), {"'backend'", "'cuda'", "offset 8",
                                                       "options are native and cudaMallocAsync"}));
}

TEST(ConfigErrors, MaxSplitSizeBelowLargeSegmentSize) {
  EXPECT_TRUE(ContainsAll(ParseError("max_split_size_mb:19"),
                          {"'max_split_size_mb'", "'19'", "offset 18", "must be >= 20"}));
}

TEST(ConfigErrors, MaxNonSplitRoundingBelowLargeSegmentSize) {
  EXPECT_TRUE(ContainsAll(ParseError("max_non_split_rounding_mb:10"),
                          {"'max_non_split_rounding_mb'", "'10'", "offset 26", "must be >= 20"}));
}

TEST(ConfigErrors, LargeSegmentSizeOfTenOrLess) {
  EXPECT_TRUE(ContainsAll(ParseError("large_segment_size_mb:10"),
                          {"'large_segment_size_mb'", "'10'", "offset 22", "must be > 10"}));
}

TEST(ConfigErrors, IntegersMustBePlainDecimalDigitsThatFit) {
  for (const char* value : {"-1", "1.5", "12abc", "0x40", "+64", "18446744073709551616"}) {
    EXPECT_TRUE(ContainsAll(ParseError(std::string("max_split_size_mb:") + value),
                            {"'max_split_size_mb'", "'" + std::string(value) + "'", "offset 18",
                             "whole number of MB"}));
  }
}

TEST(ConfigErrors, BracketValueForAScalarKey) {
  EXPECT_TRUE(ContainsAll(ParseError("max_split_size_mb:[1:2]"),
                          {"'max_split_size_mb'", "'[1:2]'", "offset 18"}));
}

TEST(ConfigErrors, RoundupSingleNNotAPowerOfTwo) {
  EXPECT_TRUE(ContainsAll(ParseError("roundup_power2_divisions:3"),
                          {"'roundup_power2_divisions'", "'3'", "offset 25", "power of 2"}));
}

TEST(ConfigErrors, RoundupBracketIntervalNotAPowerOfTwo) {
  EXPECT_TRUE(ContainsAll(
      ParseError("roundup_power2_divisions:[256:1,300:2]"),
      {"'roundup_power2_divisions'", "'300'", "offset 32", "the intervals have to be power of 2"}));
}

TEST(ConfigErrors, RoundupBracketIntervalZeroOrNotANumber) {
  EXPECT_TRUE(ContainsAll(ParseError("roundup_power2_divisions:[0:2]"),
                          {"'roundup_power2_divisions'", "'0'", "offset 26", "intervals"}));
  EXPECT_TRUE(ContainsAll(ParseError("roundup_power2_divisions:[abc:2]"),
                          {"'roundup_power2_divisions'", "'abc'", "offset 26", "intervals"}));
}

TEST(ConfigErrors, RoundupBracketDivisionsNotAPowerOfTwo) {
  EXPECT_TRUE(ContainsAll(ParseError("roundup_power2_divisions:[256:3]"),
                          {"'roundup_power2_divisions'", "'3'", "offset 30",
                           "the divisions has to be power of 2 or 0"}));
}

TEST(ConfigErrors, GarbageCollectionThresholdOutsideOpenUnitInterval) {
  for (const char* value : {"0", "1", "1.0", "-0.5", "abc", "0.5x", "nan", "inf"}) {
    EXPECT_TRUE(ContainsAll(ParseError(std::string("garbage_collection_threshold:") + value),
                            {"'garbage_collection_threshold'", "'" + std::string(value) + "'",
                             "offset 29", "set it in (0.0, 1.0)"}));
  }
}

TEST(ConfigErrors, PerProcessMemoryFractionOutsideClosedUnitInterval) {
  for (const char* value : {"1.5", "-0.1", "abc", "nan"}) {
    EXPECT_TRUE(ContainsAll(ParseError(std::string("per_process_memory_fraction:") + value),
                            {"'per_process_memory_fraction'", "'" + std::string(value) + "'",
                             "offset 28", "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"}));
  }
}

TEST(ConfigErrors, PinnedNumRegisterThreadsNotAPowerOfTwoOrAbove128) {
  for (const char* value : {"0", "3", "256"}) {
    EXPECT_TRUE(ContainsAll(ParseError(std::string("pinned_num_register_threads:") + value),
                            {"'pinned_num_register_threads'", "'" + std::string(value) + "'",
                             "offset 28", "power of 2 <= 128"}));
  }
}

TEST(ConfigErrors, PinnedReserveSegmentSizeOfZero) {
  EXPECT_TRUE(
      ContainsAll(ParseError("pinned_reserve_segment_size_mb:0"),
                  {"'pinned_reserve_segment_size_mb'", "'0'", "offset 31", "greater than 0"}));
}

TEST(ConfigErrors, UnknownKeyListsTheKnownKeys) {
  EXPECT_TRUE(ContainsAll(ParseError("uncached:False,max_split_size:64"),
                          {"unrecognized key 'max_split_size'", "offset 15", "max_split_size_mb"}));
}

// ---------------------------------------------------------------------------------------
// Structural errors: each names the offset and what was expected

TEST(ConfigStructure, KeyWithoutColon) {
  EXPECT_TRUE(ContainsAll(
      ParseError("uncached:False,expandable_segments"),
      {"expected ':' after key 'expandable_segments'", "offset 34", "end of the string"}));
}

TEST(ConfigStructure, MissingCommaBetweenPairs) {
  EXPECT_TRUE(ContainsAll(ParseError("expandable_segments:True:False"),
                          {"expected ','", "offset 24", "got ':'"}));
}

TEST(ConfigStructure, MissingValue) {
  EXPECT_TRUE(
      ContainsAll(ParseError("expandable_segments:,uncached:True"),
                  {"expected a value for key 'expandable_segments'", "offset 20", "got ','"}));
}

TEST(ConfigStructure, LeadingComma) {
  EXPECT_TRUE(ContainsAll(ParseError(",uncached:True"), {"expected a key", "offset 0"}));
}

TEST(ConfigStructure, UnterminatedBracket) {
  EXPECT_TRUE(
      ContainsAll(ParseError("roundup_power2_divisions:[256:1,512:2"),
                  {"unterminated '['", "'roundup_power2_divisions'", "offset 25", "expected ']'"}));
}

TEST(ConfigStructure, MissingCommaInsideBracket) {
  EXPECT_TRUE(ContainsAll(ParseError("roundup_power2_divisions:[256:1:2]"),
                          {"expected ',' or ']'", "'roundup_power2_divisions'", "offset 31"}));
}

TEST(ConfigParse, TheAsyncBackendChecksOnlyTheKeysItUses) {
  // PyTorch's cudaMallocAsync backend never parses the other keys: a value the native
  // backend refuses passes (unused); the backend and the memory fraction are still checked.
  const Config c = Config::parse(
      "max_split_size_mb:20,backend:cudaMallocAsync,release_lock_on_cudamalloc:none,"
      "per_process_memory_fraction:0.5");
  EXPECT_EQ(c.backend, ccalloc::BackendKind::kCudaMallocAsync);
  EXPECT_EQ(c.per_process_memory_fraction, 0.5);
  EXPECT_EQ(c.max_split_size, 20 * kMiB);
  EXPECT_FALSE(c.release_lock_on_cudamalloc);
  EXPECT_TRUE(ContainsAll(ParseError("backend:cudaMallocAsync,per_process_memory_fraction:2"),
                          {"'per_process_memory_fraction'", "'2'"}));
  EXPECT_TRUE(ContainsAll(ParseError("release_lock_on_cudamalloc:none"),
                          {"'release_lock_on_cudamalloc'", "'none'"}));
  // Keys still have to be keys.
  EXPECT_TRUE(ContainsAll(ParseError("backend:cudaMallocAsync,no_such_key:1"), {"no_such_key"}));
}

// ---------------------------------------------------------------------------------------
// Environment

// Unsets the variables that from_environment() reads, and restores them on destruction.
class ScopedEnvironment {
 public:
  ScopedEnvironment() {
    for (const char* name : kNames) {
      const char* value = std::getenv(name);
      saved_.emplace_back(name, value ? std::optional<std::string>(value) : std::nullopt);
      unsetenv(name);
    }
  }
  ~ScopedEnvironment() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        setenv(name, value->c_str(), 1);
      } else {
        unsetenv(name);
      }
    }
  }
  ScopedEnvironment(const ScopedEnvironment&) = delete;
  ScopedEnvironment& operator=(const ScopedEnvironment&) = delete;

  void Set(const char* name, const char* value) { setenv(name, value, 1); }

 private:
  static constexpr const char* kNames[] = {"CCALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                                           "PYTORCH_ALLOC_CONF", "CCALLOC_NO_CACHING",
                                           "PYTORCH_NO_CUDA_MEMORY_CACHING"};
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

class ConfigEnvironmentTest : public testing::Test {
 protected:
  ScopedEnvironment env_;
};

TEST_F(ConfigEnvironmentTest, NoVariablesGiveDefaults) {
  EXPECT_EQ(Config::from_environment(), Config{});
}

TEST_F(ConfigEnvironmentTest, PytorchKeysApplyOnTopOfTheCcallocConfPreset) {
  env_.Set("CCALLOC_CONF", "pytorch,max_split_size_mb:64,garbage_collection_threshold:0.5");
  env_.Set("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.5,max_split_size_mb:128");
  env_.Set("PYTORCH_ALLOC_CONF", "max_split_size_mb:256");  // not read: the CUDA name is set
  const Config c = Config::from_environment();
  EXPECT_EQ(c.preset, "pytorch");
  EXPECT_FALSE(c.stitch_segments);
  EXPECT_EQ(c.per_process_memory_fraction, 0.5);
  EXPECT_EQ(c.max_split_size, 128 * kMiB);  // set in both: PyTorch's variable wins
  EXPECT_EQ(c.garbage_collection_threshold, 0.5);
  EXPECT_EQ(c.source,
            "pytorch,max_split_size_mb:64,garbage_collection_threshold:0.5,"
            "per_process_memory_fraction:0.5,max_split_size_mb:128");
}

TEST_F(ConfigEnvironmentTest, CcallocConfAloneOrPytorchVariableAlone) {
  env_.Set("CCALLOC_CONF", "max_split_size_mb:64");
  EXPECT_EQ(Config::from_environment().max_split_size, 64 * kMiB);
  EXPECT_EQ(Config::from_environment().source, "max_split_size_mb:64");
  unsetenv("CCALLOC_CONF");
  env_.Set("PYTORCH_ALLOC_CONF", "max_split_size_mb:256");
  EXPECT_EQ(Config::from_environment().max_split_size, 256 * kMiB);
  EXPECT_EQ(Config::from_environment().preset, "ccalloc");
}

TEST_F(ConfigEnvironmentTest, OnlyCcallocConfMayNameAPresetWhenBothAreSet) {
  env_.Set("CCALLOC_CONF", "ccalloc");
  env_.Set("PYTORCH_CUDA_ALLOC_CONF", "pytorch,max_split_size_mb:64");
  try {
    Config::from_environment();
    FAIL() << "from_environment() did not throw ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(ContainsAll(e.what(), {"PYTORCH_CUDA_ALLOC_CONF=\"pytorch,max_split_size_mb:64\"",
                                       "CCALLOC_CONF=\"ccalloc\"", "name the preset"}))
        << e.what();
  }
  // Alone, PyTorch's variable may name one.
  unsetenv("CCALLOC_CONF");
  EXPECT_EQ(Config::from_environment().preset, "pytorch");
}

TEST_F(ConfigEnvironmentTest, PytorchCudaAllocConfWinsOverPytorchAllocConf) {
  env_.Set("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128");
  env_.Set("PYTORCH_ALLOC_CONF", "max_split_size_mb:256");
  EXPECT_EQ(Config::from_environment().max_split_size, 128 * kMiB);
}

TEST_F(ConfigEnvironmentTest, PytorchAllocConfIsReadLast) {
  env_.Set("PYTORCH_ALLOC_CONF", "max_split_size_mb:256");
  EXPECT_EQ(Config::from_environment().max_split_size, 256 * kMiB);
}

TEST_F(ConfigEnvironmentTest, EmptyCcallocConfLeavesPytorchKeysOnTheDefaults) {
  env_.Set("CCALLOC_CONF", "");
  EXPECT_EQ(Config::from_environment(), Config{});
  env_.Set("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64");
  Config expected = Config::parse("max_split_size_mb:64");
  EXPECT_EQ(Config::from_environment(), expected);
}

TEST_F(ConfigEnvironmentTest, CcallocNoCachingOneSetsUncached) {
  env_.Set("CCALLOC_NO_CACHING", "1");
  EXPECT_TRUE(Config::from_environment().uncached);
}

TEST_F(ConfigEnvironmentTest, PytorchNoCudaMemoryCachingOneSetsUncached) {
  env_.Set("PYTORCH_NO_CUDA_MEMORY_CACHING", "1");
  env_.Set("CCALLOC_CONF", "max_split_size_mb:64");
  const Config c = Config::from_environment();
  EXPECT_TRUE(c.uncached);
  EXPECT_EQ(c.max_split_size, 64 * kMiB);
}

TEST_F(ConfigEnvironmentTest, NoCachingValuesOtherThanOneAreIgnored) {
  for (const char* value : {"0", "true", "True", "", "11"}) {
    env_.Set("CCALLOC_NO_CACHING", value);
    env_.Set("PYTORCH_NO_CUDA_MEMORY_CACHING", value);
    EXPECT_FALSE(Config::from_environment().uncached) << "value '" << value << "'";
  }
}

TEST_F(ConfigEnvironmentTest, ErrorNamesTheVariableTheStringCameFrom) {
  env_.Set("CCALLOC_CONF", "pytorch,max_split_size_mb:-1");
  try {
    Config::from_environment();
    FAIL() << "from_environment() did not throw ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(ContainsAll(e.what(), {"CCALLOC_CONF", "'max_split_size_mb'", "offset 26"}))
        << e.what();
  }
  env_.Set("CCALLOC_CONF", "pytorch");
  env_.Set("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:yes");
  try {
    Config::from_environment();
    FAIL() << "from_environment() did not throw ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(ContainsAll(
        e.what(), {"PYTORCH_CUDA_ALLOC_CONF", "'expandable_segments'", "'yes'", "offset 20"}));
  }
}

// ---------------------------------------------------------------------------------------
// to_string

TEST(ConfigToString, DefaultsAreWrittenInFull) {
  EXPECT_EQ(Config{}.to_string(),
            "ccalloc,backend:native,max_non_split_rounding_mb:20,large_segment_size_mb:20,"
            "roundup_power2_divisions:0,expandable_segments:True,"
            "release_lock_on_cudamalloc:False,per_process_memory_fraction:1,"
            "graph_capture_record_stream_reuse:False,pinned_use_cuda_host_register:False,"
            "pinned_num_register_threads:1,pinned_use_background_threads:False,uncached:False,"
            "stitch_segments:True,stream_borrow_wait:True");
}

TEST(ConfigPreset, CcallocPresetDiffersFromPytorchInStitchingAndExpandableSegmentsOnly) {
  Config ccalloc = WithoutSource(Config::parse("ccalloc"));
  Config pytorch = WithoutSource(Config::parse("pytorch"));
  EXPECT_TRUE(ccalloc.stitch_segments);
  EXPECT_TRUE(ccalloc.expandable_segments);
  EXPECT_FALSE(pytorch.stitch_segments);
  EXPECT_FALSE(pytorch.expandable_segments);
  ccalloc.stitch_segments = false;
  ccalloc.expandable_segments = false;
  ccalloc.preset = pytorch.preset;
  EXPECT_EQ(ccalloc, pytorch);
  // Either can be set explicitly in either preset.
  EXPECT_FALSE(Config::parse("ccalloc,expandable_segments:False").expandable_segments);
  EXPECT_TRUE(Config::parse("pytorch,expandable_segments:True").expandable_segments);
  EXPECT_FALSE(Config::parse("ccalloc,stitch_segments:False").stitch_segments);
  EXPECT_TRUE(Config::parse("pytorch,stitch_segments:True").stitch_segments);
  // stream_borrow_wait is on in both: it is read only under stitch_segments, and the
  // pytorch preset's written form leaves it out.
  EXPECT_TRUE(ccalloc.stream_borrow_wait);
  EXPECT_TRUE(pytorch.stream_borrow_wait);
  EXPECT_EQ(pytorch.to_string().find("stream_borrow_wait"), std::string::npos);
  EXPECT_FALSE(Config::parse("ccalloc,stream_borrow_wait:False").stream_borrow_wait);
  const Config off = Config::parse("stream_borrow_wait:False");
  EXPECT_EQ(WithoutSource(Config::parse(off.to_string())), WithoutSource(off));
}

// stitch_handle_mb: 0 (sized by the room left) by default and left out of the written form;
// a size is written and reads back; anything but a whole number of MB names the key.
TEST(ConfigPresets, StitchHandleSizeDefaultsToTheRoomRuleAndRoundTrips) {
  EXPECT_EQ(Config::parse("ccalloc").stitch_handle_size, 0u);
  EXPECT_EQ(Config::parse("ccalloc").to_string().find("stitch_handle_mb"), std::string::npos);
  const Config set = Config::parse("ccalloc,stitch_handle_mb:6");
  EXPECT_EQ(set.stitch_handle_size, 6 * kMiB);
  EXPECT_NE(set.to_string().find("stitch_handle_mb:6"), std::string::npos) << set.to_string();
  EXPECT_EQ(WithoutSource(Config::parse(set.to_string())), WithoutSource(set));
  EXPECT_EQ(ParseError("stitch_handle_mb:-2"),
            "ccalloc config: invalid value '-2' for key 'stitch_handle_mb' at offset 17: "
            "expected a whole number of MB (0: sized by the room left)");
}

TEST(ConfigToString, NonUniformRoundupTableIsWrittenInBracketForm) {
  const Config c = Config::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
  EXPECT_NE(c.to_string().find("roundup_power2_divisions:[1:1,2:1,4:1,8:1,16:1,32:1,64:1,128:1,"
                               "256:1,512:2,1024:4,2048:8,4096:8,8192:8,16384:8,32768:8]"),
            std::string::npos)
      << c.to_string();
}

TEST(ConfigToString, SizesAreWrittenInMbAndFloatsShortest) {
  const std::string s = Config::parse(
                            "pytorch,max_split_size_mb:64,garbage_collection_threshold:0.1,"
                            "pinned_reserve_segment_size_mb:32")
                            .to_string();
  EXPECT_EQ(s.rfind("pytorch,", 0), 0u) << s;
  EXPECT_TRUE(ContainsAll(s, {",max_split_size_mb:64,", ",garbage_collection_threshold:0.1,",
                              ",pinned_reserve_segment_size_mb:32,"}));
}

class ConfigRoundTripTest : public testing::TestWithParam<const char*> {};

TEST_P(ConfigRoundTripTest, ParseOfToStringGivesTheSameConfig) {
  const Config c = Config::parse(GetParam());
  EXPECT_EQ(WithoutSource(Config::parse(c.to_string())), WithoutSource(c)) << c.to_string();
}

INSTANTIATE_TEST_SUITE_P(
    SeveralConfigs, ConfigRoundTripTest,
    testing::Values("", "pytorch", "pytorch,max_split_size_mb:64", "ccalloc,uncached:True",
                    "backend:cudaMallocAsync,per_process_memory_fraction:0",
                    "max_split_size_mb:18446744073709551615",
                    "large_segment_size_mb:12,max_split_size_mb:15",
                    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
                    "roundup_power2_divisions:16,garbage_collection_threshold:0.30000000000000004",
                    "large_segment_size_mb:32,max_non_split_rounding_mb:64,max_split_size_mb:512,"
                    "roundup_power2_divisions:[1:2,64:4],garbage_collection_threshold:0.6,"
                    "expandable_segments:True,release_lock_on_cudamalloc:True,"
                    "per_process_memory_fraction:0.1,graph_capture_record_stream_reuse:True,"
                    "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,"
                    "pinned_use_background_threads:True,pinned_reserve_segment_size_mb:1024,"
                    "uncached:True"));

TEST(ConfigToString, RoundTripsAFractionWithNoShortDecimal) {
  Config c;
  c.garbage_collection_threshold = 1.0 / 3.0;
  c.per_process_memory_fraction = 2.0 / 3.0;
  EXPECT_EQ(WithoutSource(Config::parse(c.to_string())), c) << c.to_string();
}

}  // namespace
}  // namespace ccalloc
