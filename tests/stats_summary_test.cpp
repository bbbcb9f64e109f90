// DeviceStats::to_map/from_map (PyTorch's memory_stats() keys, §3.3), memory_summary()
// (PyTorch's exact 75-column layout, §3.4), format_size (§2.14), and the reset functions
// (§3.2) through the allocator, against docs/pytorch-behaviour.md.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/stats.hpp"

namespace ccalloc {
namespace {

constexpr std::int64_t kMiBi = 1024 * 1024;
constexpr std::int64_t kGiBi = 1024 * kMiBi;
constexpr std::int64_t kTiBi = 1024 * kGiBi;
constexpr std::int64_t kPiBi = 1024 * kTiBi;

Stat S(std::int64_t current, std::int64_t peak, std::int64_t allocated, std::int64_t freed) {
  Stat s;
  s.current = current;
  s.peak = peak;
  s.allocated = allocated;
  s.freed = freed;
  return s;
}

// A StatArray from its rows as memory_summary prints them: all, large pool, small pool.
StatArray Rows(Stat all, Stat large, Stat small) {
  StatArray a;
  a[kAggregate] = all;
  a[kLargePool] = large;
  a[kSmallPool] = small;
  return a;
}

// The same rows in MiB.
StatArray RowsMiB(Stat all, Stat large, Stat small) {
  const auto mib = [](Stat s) {
    return S(s.current * kMiBi, s.peak * kMiBi, s.allocated * kMiBi, s.freed * kMiBi);
  };
  return Rows(mib(all), mib(large), mib(small));
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  return lines;
}

// Every memory_stats() key of the reference version (§3.3): 9 StatArrays x 3 pools x 4
// fields, 2 Stats x 4 fields and 6 scalars, in sorted order.
const std::vector<std::string> kAllKeys = {
    "active.all.allocated",
    "active.all.current",
    "active.all.freed",
    "active.all.peak",
    "active.large_pool.allocated",
    "active.large_pool.current",
    "active.large_pool.freed",
    "active.large_pool.peak",
    "active.small_pool.allocated",
    "active.small_pool.current",
    "active.small_pool.freed",
    "active.small_pool.peak",
    "active_bytes.all.allocated",
    "active_bytes.all.current",
    "active_bytes.all.freed",
    "active_bytes.all.peak",
    "active_bytes.large_pool.allocated",
    "active_bytes.large_pool.current",
    "active_bytes.large_pool.freed",
    "active_bytes.large_pool.peak",
    "active_bytes.small_pool.allocated",
    "active_bytes.small_pool.current",
    "active_bytes.small_pool.freed",
    "active_bytes.small_pool.peak",
    "allocated_bytes.all.allocated",
    "allocated_bytes.all.current",
    "allocated_bytes.all.freed",
    "allocated_bytes.all.peak",
    "allocated_bytes.large_pool.allocated",
    "allocated_bytes.large_pool.current",
    "allocated_bytes.large_pool.freed",
    "allocated_bytes.large_pool.peak",
    "allocated_bytes.small_pool.allocated",
    "allocated_bytes.small_pool.current",
    "allocated_bytes.small_pool.freed",
    "allocated_bytes.small_pool.peak",
    "allocation.all.allocated",
    "allocation.all.current",
    "allocation.all.freed",
    "allocation.all.peak",
    "allocation.large_pool.allocated",
    "allocation.large_pool.current",
    "allocation.large_pool.freed",
    "allocation.large_pool.peak",
    "allocation.small_pool.allocated",
    "allocation.small_pool.current",
    "allocation.small_pool.freed",
    "allocation.small_pool.peak",
    "inactive_split.all.allocated",
    "inactive_split.all.current",
    "inactive_split.all.freed",
    "inactive_split.all.peak",
    "inactive_split.large_pool.allocated",
    "inactive_split.large_pool.current",
    "inactive_split.large_pool.freed",
    "inactive_split.large_pool.peak",
    "inactive_split.small_pool.allocated",
    "inactive_split.small_pool.current",
    "inactive_split.small_pool.freed",
    "inactive_split.small_pool.peak",
    "inactive_split_bytes.all.allocated",
    "inactive_split_bytes.all.current",
    "inactive_split_bytes.all.freed",
    "inactive_split_bytes.all.peak",
    "inactive_split_bytes.large_pool.allocated",
    "inactive_split_bytes.large_pool.current",
    "inactive_split_bytes.large_pool.freed",
    "inactive_split_bytes.large_pool.peak",
    "inactive_split_bytes.small_pool.allocated",
    "inactive_split_bytes.small_pool.current",
    "inactive_split_bytes.small_pool.freed",
    "inactive_split_bytes.small_pool.peak",
    "max_split_size",
    "num_alloc_retries",
    "num_device_alloc",
    "num_device_free",
    "num_ooms",
    "num_sync_all_streams",
    "oversize_allocations.allocated",
    "oversize_allocations.current",
    "oversize_allocations.freed",
    "oversize_allocations.peak",
    "oversize_segments.allocated",
    "oversize_segments.current",
    "oversize_segments.freed",
    "oversize_segments.peak",
    "requested_bytes.all.allocated",
    "requested_bytes.all.current",
    "requested_bytes.all.freed",
    "requested_bytes.all.peak",
    "requested_bytes.large_pool.allocated",
    "requested_bytes.large_pool.current",
    "requested_bytes.large_pool.freed",
    "requested_bytes.large_pool.peak",
    "requested_bytes.small_pool.allocated",
    "requested_bytes.small_pool.current",
    "requested_bytes.small_pool.freed",
    "requested_bytes.small_pool.peak",
    "reserved_bytes.all.allocated",
    "reserved_bytes.all.current",
    "reserved_bytes.all.freed",
    "reserved_bytes.all.peak",
    "reserved_bytes.large_pool.allocated",
    "reserved_bytes.large_pool.current",
    "reserved_bytes.large_pool.freed",
    "reserved_bytes.large_pool.peak",
    "reserved_bytes.small_pool.allocated",
    "reserved_bytes.small_pool.current",
    "reserved_bytes.small_pool.freed",
    "reserved_bytes.small_pool.peak",
    "segment.all.allocated",
    "segment.all.current",
    "segment.all.freed",
    "segment.all.peak",
    "segment.large_pool.allocated",
    "segment.large_pool.current",
    "segment.large_pool.freed",
    "segment.large_pool.peak",
    "segment.small_pool.allocated",
    "segment.small_pool.current",
    "segment.small_pool.freed",
    "segment.small_pool.peak",
};

// The sample table of §3.4, copied from docs/pytorch-behaviour.md.
constexpr const char* kSampleSummary =
    "|===========================================================================|\n"
    "|                  PyTorch CUDA memory summary, device ID 0                 |\n"
    "|---------------------------------------------------------------------------|\n"
    "|            CUDA OOMs: 1            |        cudaMalloc retries: 1         |\n"
    "|===========================================================================|\n"
    "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Allocated memory      |   1062 MiB |   4877 MiB |  89299 MiB |  88237 MiB |\n"
    "|       from large pool |   1048 MiB |   4865 MiB |  89263 MiB |  88215 MiB |\n"
    "|       from small pool |     14 MiB |     14 MiB |     35 MiB |     21 MiB |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Active memory         |   1062 MiB |   4877 MiB |  89299 MiB |  88237 MiB |\n"
    "|       from large pool |   1048 MiB |   4865 MiB |  89263 MiB |  88215 MiB |\n"
    "|       from small pool |     14 MiB |     14 MiB |     35 MiB |     21 MiB |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Requested memory      |   1000 MiB |   4800 MiB |  89000 MiB |  88000 MiB |\n"
    "|       from large pool |    990 MiB |   4790 MiB |  88970 MiB |  87980 MiB |\n"
    "|       from small pool |     10 MiB |     10 MiB |     30 MiB |     20 MiB |\n"
    "|---------------------------------------------------------------------------|\n"
    "| GPU reserved memory   |  12420 MiB |  12420 MiB |  16924 MiB |   4504 MiB |\n"
    "|       from large pool |  12404 MiB |  12404 MiB |  16900 MiB |   4496 MiB |\n"
    "|       from small pool |     16 MiB |     16 MiB |     24 MiB |      8 MiB |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Non-releasable memory |   3000 MiB |   3100 MiB |  50000 MiB |  47000 MiB |\n"
    "|       from large pool |   2990 MiB |   3090 MiB |  49900 MiB |  46910 MiB |\n"
    "|       from small pool |     10 MiB |     10 MiB |    100 MiB |     90 MiB |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Allocations           |     200    |     450    |  120000    |  119800    |\n"
    "|       from large pool |      80    |     150    |   40000    |   39920    |\n"
    "|       from small pool |     120    |     300    |   80000    |   79880    |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Active allocs         |     200    |     450    |  120000    |  119800    |\n"
    "|       from large pool |      80    |     150    |   40000    |   39920    |\n"
    "|       from small pool |     120    |     300    |   80000    |   79880    |\n"
    "|---------------------------------------------------------------------------|\n"
    "| GPU reserved segments |      40    |      42    |     300    |     260    |\n"
    "|       from large pool |      32    |      34    |     280    |     248    |\n"
    "|       from small pool |       8    |       8    |      20    |      12    |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Non-releasable allocs |      30    |      35    |    5000    |    4970    |\n"
    "|       from large pool |      25    |      30    |    4000    |    3975    |\n"
    "|       from small pool |       5    |       5    |    1000    |     995    |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Oversize allocations  |       0    |       0    |       0    |       0    |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Oversize GPU segments |       0    |       0    |       0    |       0    |\n"
    "|===========================================================================|\n";

// DeviceStats holding the made-up numbers of the §3.4 sample.
DeviceStats SampleStats() {
  DeviceStats s;
  s.allocated_bytes =
      RowsMiB(S(1062, 4877, 89299, 88237), S(1048, 4865, 89263, 88215), S(14, 14, 35, 21));
  s.active_bytes = s.allocated_bytes;
  s.requested_bytes =
      RowsMiB(S(1000, 4800, 89000, 88000), S(990, 4790, 88970, 87980), S(10, 10, 30, 20));
  s.reserved_bytes =
      RowsMiB(S(12420, 12420, 16924, 4504), S(12404, 12404, 16900, 4496), S(16, 16, 24, 8));
  s.inactive_split_bytes =
      RowsMiB(S(3000, 3100, 50000, 47000), S(2990, 3090, 49900, 46910), S(10, 10, 100, 90));
  s.allocation =
      Rows(S(200, 450, 120000, 119800), S(80, 150, 40000, 39920), S(120, 300, 80000, 79880));
  s.active = s.allocation;
  s.segment = Rows(S(40, 42, 300, 260), S(32, 34, 280, 248), S(8, 8, 20, 12));
  s.inactive_split = Rows(S(30, 35, 5000, 4970), S(25, 30, 4000, 3975), S(5, 5, 1000, 995));
  s.num_ooms = 1;
  s.num_alloc_retries = 1;
  return s;
}

// ---------------------------------------------------------------------------------------
// memory_stats() keys

TEST(StatsMap, HasExactlyPyTorchsKeys) {
  ASSERT_EQ(kAllKeys.size(), 122u);
  const std::map<std::string, std::int64_t> m = DeviceStats{}.to_map();
  std::vector<std::string> keys;
  for (const auto& [key, value] : m)
    keys.push_back(key);
  EXPECT_EQ(keys, kAllKeys);
}

TEST(StatsMap, MaxSplitSizeIsMinusOneWhenUnlimited) {
  EXPECT_EQ(DeviceStats{}.to_map().at("max_split_size"), -1);
  sim::SimDriver gpu;
  Allocator unlimited(gpu, Config::parse("pytorch"));
  EXPECT_EQ(unlimited.memory_stats().at("max_split_size"), -1);
  Allocator limited(gpu, Config::parse("pytorch,max_split_size_mb:64"));
  EXPECT_EQ(limited.memory_stats().at("max_split_size"), 64 * kMiBi);
  EXPECT_EQ(limited.memory_stats().size(), 122u);
}

// Every key reads and writes its own field: distinct values survive a round trip both ways.
TEST(StatsMap, FromMapInvertsToMap) {
  std::map<std::string, std::int64_t> m;
  std::int64_t v = 1000;
  for (const std::string& key : kAllKeys)
    m[key] = v++;
  const DeviceStats s = DeviceStats::from_map(m);
  EXPECT_EQ(s.to_map(), m);
  EXPECT_EQ(DeviceStats::from_map(s.to_map()), s);
  EXPECT_EQ(s.num_ooms, m.at("num_ooms"));
  EXPECT_EQ(s.reserved_bytes[kLargePool].peak, m.at("reserved_bytes.large_pool.peak"));
  EXPECT_EQ(s.oversize_segments.freed, m.at("oversize_segments.freed"));

  const DeviceStats sample = SampleStats();
  EXPECT_EQ(DeviceStats::from_map(sample.to_map()), sample);
}

// ---------------------------------------------------------------------------------------
// memory_summary()

TEST(MemorySummary, ReproducesTheReferenceSampleByteForByte) {
  EXPECT_EQ(memory_summary(SampleStats(), 0), kSampleSummary);
}

TEST(MemorySummary, AbbreviatedKeepsOnlyTheAllRows) {
  const std::string want =
      "|===========================================================================|\n"
      "|                  PyTorch CUDA memory summary, device ID 0                 |\n"
      "|---------------------------------------------------------------------------|\n"
      "|            CUDA OOMs: 1            |        cudaMalloc retries: 1         |\n"
      "|===========================================================================|\n"
      "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n"
      "|---------------------------------------------------------------------------|\n"
      "| Allocated memory      |   1062 MiB |   4877 MiB |  89299 MiB |  88237 MiB |\n"
      "|---------------------------------------------------------------------------|\n"
      "| Active memory         |   1062 MiB |   4877 MiB |  89299 MiB |  88237 MiB |\n"
      "|---------------------------------------------------------------------------|\n"
      "| Requested memory      |   1000 MiB |   4800 MiB |  89000 MiB |  88000 MiB |\n"
      "|---------------------------------------------------------------------------|\n"
      "| GPU reserved memory   |  12420 MiB |  12420 MiB |  16924 MiB |   4504 MiB |\n"
      "|---------------------------------------------------------------------------|\n"
      "| Non-releasable memory |   3000 MiB |   3100 MiB |  50000 MiB |  47000 MiB |\n"
      "|---------------------------------------------------------------------------|\n"
      "| Allocations           |     200    |     450    |  120000    |  119800    |\n"
      "|---------------------------------------------------------------------------|\n"
      "| Active allocs         |     200    |     450    |  120000    |  119800    |\n"
      "|---------------------------------------------------------------------------|\n"
      "| GPU reserved segments |      40    |      42    |     300    |     260    |\n"
      "|---------------------------------------------------------------------------|\n"
      "| Non-releasable allocs |      30    |      35    |    5000    |    4970    |\n"
      "|---------------------------------------------------------------------------|\n"
      "| Oversize allocations  |       0    |       0    |       0    |       0    |\n"
      "|---------------------------------------------------------------------------|\n"
      "| Oversize GPU segments |       0    |       0    |       0    |       0    |\n"
      "|===========================================================================|\n";
  EXPECT_EQ(memory_summary(SampleStats(), 0, /*abbreviated=*/true), want);
}

TEST(MemorySummary, EveryLineIs77CharactersWrappedInBars) {
  for (bool abbreviated : {false, true}) {
    const std::string text = memory_summary(SampleStats(), 3, abbreviated);
    ASSERT_FALSE(text.empty());
    EXPECT_EQ(text.back(), '\n');
    const auto lines = Lines(text);
    EXPECT_EQ(lines.size(), abbreviated ? 29u : 47u);
    for (const std::string& line : lines) {
      EXPECT_EQ(line.size(), 77u) << line;
      EXPECT_EQ(line.front(), '|') << line;
      EXPECT_EQ(line.back(), '|') << line;
    }
  }
}

// Bytes switch to KiB once the "all" row's value reaches 768 KiB, to MiB at 768 MiB; the
// large/small rows of each column use the unit the "all" row chose, whatever their values.
TEST(MemorySummary, SizeUnitSwitchesAt768OfTheAllRow) {
  DeviceStats s;
  s.allocated_bytes =
      Rows(S(786432, 786431, 805306368, 805306367),  // 768 KiB, 768 KiB - 1, 768 MiB, 768 MiB - 1
           S(786000, 786000, 805306368 - kMiBi, 1024), S(432, 431, kMiBi, 805306367 - 1024));
  const auto lines = Lines(memory_summary(s, 0));
  ASSERT_EQ(lines.size(), 47u);
  EXPECT_EQ(lines[7],
            "| Allocated memory      |    768 KiB | 786431 B   |    768 MiB | 786431 KiB |");
  EXPECT_EQ(lines[8],
            "|       from large pool |    767 KiB | 786000 B   |    767 MiB |      1 KiB |");
  EXPECT_EQ(lines[9],
            "|       from small pool |      0 KiB |    431 B   |      1 MiB | 786430 KiB |");
  // An all-zero metric stays in bytes.
  EXPECT_EQ(lines[11],
            "| Active memory         |      0 B   |      0 B   |      0 B   |      0 B   |");
}

TEST(MemorySummary, SizeUnitsReachGiBTiBAndPiB) {
  DeviceStats s;
  s.reserved_bytes = Rows(S(768 * kGiBi, kTiBi, 800 * kTiBi, 768 * kPiBi),
                          S(768 * kGiBi, kTiBi, 800 * kTiBi, 768 * kPiBi), S(0, 0, 0, 0));
  const auto lines = Lines(memory_summary(s, 0));
  ASSERT_EQ(lines.size(), 47u);
  EXPECT_EQ(lines[19],
            "| GPU reserved memory   |    768 GiB |   1024 GiB |    800 TiB |    768 PiB |");
  EXPECT_EQ(lines[20],
            "|       from large pool |    768 GiB |   1024 GiB |    800 TiB |    768 PiB |");
  EXPECT_EQ(lines[21],
            "|       from small pool |      0 GiB |      0 GiB |      0 TiB |      0 PiB |");
}

// Counts switch to K once the "all" row's value reaches 750,000, to M at 750,000,000.
TEST(MemorySummary, CountUnitSwitchesAt750ThousandOfTheAllRow) {
  DeviceStats s;
  s.allocation = Rows(S(749999, 750000, 750000000, 749999999), S(400000, 400000, 1500000, 999),
                      S(349999, 350000, 748500000, 749999000));
  const auto lines = Lines(memory_summary(s, 0));
  ASSERT_EQ(lines.size(), 47u);
  EXPECT_EQ(lines[27],
            "| Allocations           |  749999    |     750 K  |     750 M  |  749999 K  |");
  EXPECT_EQ(lines[28],
            "|       from large pool |  400000    |     400 K  |       1 M  |       0 K  |");
  EXPECT_EQ(lines[29],
            "|       from small pool |  349999    |     350 K  |     748 M  |  749999 K  |");
}

TEST(MemorySummary, OversizeRowsUseTheCountFormatter) {
  DeviceStats s;
  // Each cell is its own reference value; M is the largest unit: 2e9 is 2000 M.
  s.oversize_allocations = S(3, 800000, 2000000000, 12);
  s.oversize_segments = S(1, 2, 3, 4);
  const auto lines = Lines(memory_summary(s, 0));
  ASSERT_EQ(lines.size(), 47u);
  EXPECT_EQ(lines[43],
            "| Oversize allocations  |       3    |     800 K  |    2000 M  |      12    |");
  EXPECT_EQ(lines[45],
            "| Oversize GPU segments |       1    |       2    |       3    |       4    |");
}

TEST(MemorySummary, HeaderAlignsDeviceIdAndCounters) {
  DeviceStats s;
  s.num_ooms = 42;
  s.num_alloc_retries = 7;
  EXPECT_EQ(Lines(memory_summary(s, 0))[1],
            "|                  PyTorch CUDA memory summary, device ID 0                 |");
  EXPECT_EQ(Lines(memory_summary(s, 12))[1],
            "|                  PyTorch CUDA memory summary, device ID 12                |");
  EXPECT_EQ(Lines(memory_summary(s, 1234567))[1],
            "|                  PyTorch CUDA memory summary, device ID 1234567           |");
  EXPECT_EQ(Lines(memory_summary(s, 0))[3],
            "|            CUDA OOMs: 42           |        cudaMalloc retries: 7         |");
}

// The allocator's summary is the free function applied to its stats and device; the rows
// of a live allocator follow the allocation rules: 5 MiB in a 20 MiB segment, 1000 bytes
// rounded to 1024 in a 2 MiB small segment.
TEST(MemorySummary, OfALiveAllocator) {
  sim::Options o;
  o.capacity = 64 * static_cast<std::size_t>(kMiBi);
  o.device = 5;
  sim::SimDriver gpu(o);
  Allocator alloc(gpu, Config::parse("pytorch"));
  alloc.set_check_invariants(true);
  alloc.malloc(5 * kMiBi);
  alloc.malloc(1000);
  EXPECT_EQ(alloc.memory_summary(), memory_summary(alloc.stats(), 5));
  EXPECT_EQ(alloc.memory_summary(true), memory_summary(alloc.stats(), 5, true));
  const auto lines = Lines(alloc.memory_summary());
  ASSERT_EQ(lines.size(), 47u);
  EXPECT_EQ(lines[1],
            "|                  PyTorch CUDA memory summary, device ID 5                 |");
  EXPECT_EQ(lines[7],
            "| Allocated memory      |   5121 KiB |   5121 KiB |   5121 KiB |      0 B   |");
  EXPECT_EQ(lines[8],
            "|       from large pool |   5120 KiB |   5120 KiB |   5120 KiB |      0 B   |");
  EXPECT_EQ(lines[9],
            "|       from small pool |      1 KiB |      1 KiB |      1 KiB |      0 B   |");
  EXPECT_EQ(lines[15],
            "| Requested memory      |   5120 KiB |   5120 KiB |   5120 KiB |      0 B   |");
  EXPECT_EQ(lines[17],
            "|       from small pool |      0 KiB |      0 KiB |      0 KiB |      0 B   |");
  EXPECT_EQ(lines[19],
            "| GPU reserved memory   |  22528 KiB |  22528 KiB |  22528 KiB |      0 B   |");
  // Each segment leaves its remainder as a free block in a split segment:
  // 15 MiB + (2 MiB - 1 KiB) = 15360 + 2047 KiB.
  EXPECT_EQ(lines[23],
            "| Non-releasable memory |  17407 KiB |  17407 KiB |  17407 KiB |      0 B   |");
  EXPECT_EQ(lines[35],
            "| GPU reserved segments |       2    |       2    |       2    |       0    |");
}

// ---------------------------------------------------------------------------------------
// format_size (§2.14): <= 1024 bytes, <= 1 MiB KiB, <= 1 GiB MiB, else GiB; 2 decimals.

TEST(FormatSize, UnitBoundaries) {
  EXPECT_EQ(format_size(0), "0 bytes");
  EXPECT_EQ(format_size(1), "1 bytes");
  EXPECT_EQ(format_size(1024), "1024 bytes");
  EXPECT_EQ(format_size(1025), "1.00 KiB");
  EXPECT_EQ(format_size(1536), "1.50 KiB");
  EXPECT_EQ(format_size(1048576), "1024.00 KiB");
  EXPECT_EQ(format_size(1048577), "1.00 MiB");
  EXPECT_EQ(format_size(20971520), "20.00 MiB");
  EXPECT_EQ(format_size(1073741824), "1024.00 MiB");
  EXPECT_EQ(format_size(1073741825), "1.00 GiB");
  EXPECT_EQ(format_size(3 * static_cast<std::uint64_t>(kGiBi)), "3.00 GiB");
  EXPECT_EQ(format_size(static_cast<std::uint64_t>(kTiBi)), "1024.00 GiB");
}

TEST(FormatSize, RoundsToTwoDecimals) {
  EXPECT_EQ(format_size(1029), "1.00 KiB");             // 1.0049
  EXPECT_EQ(format_size(1030), "1.01 KiB");             // 1.0059
  EXPECT_EQ(format_size(5 * kMiBi - 100), "5.00 MiB");  // 4.99990
  EXPECT_EQ(format_size(1610612736), "1.50 GiB");
  EXPECT_EQ(format_size(141 * static_cast<std::uint64_t>(kGiBi)), "141.00 GiB");
}

// ---------------------------------------------------------------------------------------
// Reset functions through the allocator (§3.2)

class StatsReset : public testing::Test {
 protected:
  StatsReset() : gpu_(Options()), alloc_(gpu_, Config::parse("pytorch")) {
    alloc_.set_check_invariants(true);
    // Activity that moves every kind of counter: segments, a cached small segment, an OOM
    // after releasing the cache (retry, sync, device free), frees and a reuse.
    const DevicePtr f = alloc_.malloc(12 * kMiBi);             // [0, 12)
    const DevicePtr g = alloc_.malloc(20 * kMiBi);             // [12, 32)
    alloc_.free(alloc_.malloc(1000));                          // small segment [32, 34), cached
    EXPECT_THROW(alloc_.malloc(5 * kMiBi), OutOfMemoryError);  // a 20 MiB segment: no room
    alloc_.free(g);
    alloc_.malloc(3 * kMiBi);  // from g's cached segment
    alloc_.free(f);
  }
  static sim::Options Options() {
    sim::Options o;
    o.capacity = 40 * static_cast<std::size_t>(kMiBi);
    return o;
  }
  sim::SimDriver gpu_;
  Allocator alloc_;
};

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string WithSuffix(const std::string& key, const std::string& from, const std::string& to) {
  return key.substr(0, key.size() - from.size()) + to;
}

TEST_F(StatsReset, ActivityIsNonTrivial) {
  const DeviceStats s = alloc_.stats();
  EXPECT_EQ(s.num_ooms, 1);
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_sync_all_streams, 1);
  EXPECT_EQ(s.num_device_alloc, 3);
  EXPECT_EQ(s.num_device_free, 1);
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, 32 * kMiBi + 1024);
  EXPECT_EQ(s.allocated_bytes[kAggregate].current, 3 * kMiBi);
  EXPECT_EQ(s.allocated_bytes[kAggregate].allocated, 35 * kMiBi + 1024);
  EXPECT_EQ(s.allocated_bytes[kAggregate].freed, 32 * kMiBi + 1024);
  EXPECT_EQ(s.reserved_bytes[kAggregate].current, 32 * kMiBi);
  EXPECT_EQ(s.reserved_bytes[kAggregate].peak, 34 * kMiBi);
}

TEST_F(StatsReset, ResetPeakMakesEveryPeakEqualCurrent) {
  const std::map<std::string, std::int64_t> before = alloc_.memory_stats();
  alloc_.reset_peak_stats();
  const std::map<std::string, std::int64_t> after = alloc_.memory_stats();
  ASSERT_EQ(after.size(), 122u);
  int peaks = 0;
  for (const auto& [key, value] : after) {
    if (EndsWith(key, ".peak")) {
      ++peaks;
      EXPECT_EQ(value, after.at(WithSuffix(key, ".peak", ".current"))) << key;
    } else {
      EXPECT_EQ(value, before.at(key)) << key;  // nothing else changes
    }
  }
  EXPECT_EQ(peaks, 29);  // 9 x 3 + 2
}

TEST_F(StatsReset, ResetAccumulatedZeroesTotalsAndCountersOnly) {
  const std::map<std::string, std::int64_t> before = alloc_.memory_stats();
  alloc_.reset_accumulated_stats();
  const std::map<std::string, std::int64_t> after = alloc_.memory_stats();
  ASSERT_EQ(after.size(), 122u);
  for (const auto& [key, value] : after) {
    const bool accumulated = EndsWith(key, ".allocated") || EndsWith(key, ".freed") ||
                             key == "num_alloc_retries" || key == "num_ooms" ||
                             key == "num_sync_all_streams" || key == "num_device_alloc" ||
                             key == "num_device_free";
    if (accumulated) {
      EXPECT_EQ(value, 0) << key;
    } else {
      EXPECT_EQ(value, before.at(key)) << key;  // current, peak, max_split_size
    }
  }
  EXPECT_EQ(after.at("allocated_bytes.all.peak"), 32 * kMiBi + 1024);
  // Totals restart from zero afterwards.
  alloc_.malloc(kMiBi);
  const DeviceStats s = alloc_.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].allocated, kMiBi);
  EXPECT_EQ(s.allocated_bytes[kAggregate].freed, 0);
}

}  // namespace
}  // namespace ccalloc
