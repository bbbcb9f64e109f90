// Acceptance: replaying PyTorch's own recorded traces (data/traces) with the `pytorch`
// preset reproduces PyTorch's decisions exactly. With the address oracle, every
// segment_alloc and every alloc gets the same address and size, in the same order; without
// it, peak reserved memory stays within 2 % of the recorded peak.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "io/trace_csv.hpp"
#include "replay/replay.hpp"

namespace {

using ccalloc::TraceAction;
using ccalloc::TraceEntry;
using ccalloc::io::TraceRecord;

std::vector<TraceRecord> load(const std::string& stem) {
  return ccalloc::io::read_trace_csv(std::string(CCALLOC_TRACES_DIR) + "/" + stem + ".csv.gz");
}

struct Row {
  TraceAction action;
  ccalloc::DevicePtr addr;
  std::size_t size;
  bool operator==(const Row&) const = default;
};

std::vector<Row> segment_and_alloc_rows(const std::vector<TraceEntry>& entries) {
  std::vector<Row> rows;
  for (const TraceEntry& e : entries) {
    if (e.action == TraceAction::kAlloc || e.action == TraceAction::kSegmentAlloc) {
      rows.push_back({e.action, e.addr, e.size});
    }
  }
  return rows;
}

class RecordedTrace : public testing::TestWithParam<std::string> {};

TEST_P(RecordedTrace, OracleReplayReproducesEverySegmentAndAllocAddress) {
  const auto trace = load(GetParam());
  std::vector<TraceEntry> recorded;
  for (const TraceRecord& r : trace) recorded.push_back(r.entry);

  ccalloc::replay::Options options;
  options.conf = "pytorch";
  options.address_oracle = true;
  options.keep_trace = true;
  const auto result = ccalloc::replay::run(trace, options);

  const auto want = segment_and_alloc_rows(recorded);
  const auto got = segment_and_alloc_rows(result.emitted);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "first difference at segment/alloc row " << i << ": recorded "
                               << ccalloc::to_string(want[i].action) << " " << want[i].addr
                               << " " << want[i].size << ", replayed "
                               << ccalloc::to_string(got[i].action) << " " << got[i].addr << " "
                               << got[i].size;
  }
  EXPECT_FALSE(result.oracle_diverged);
  const auto recorded_figures = ccalloc::replay::recorded_figures(trace);
  EXPECT_EQ(result.peak_reserved_bytes, recorded_figures.peak_reserved_bytes);
  EXPECT_EQ(result.device_allocs, recorded_figures.device_allocs);
  EXPECT_EQ(result.peak_requested_bytes, recorded_figures.peak_requested_bytes);
  EXPECT_EQ(result.ooms, 0);
}

TEST_P(RecordedTrace, ReplayWithoutOracleStaysWithinTwoPercentOfRecordedPeak) {
  const auto trace = load(GetParam());
  ccalloc::replay::Options options;
  options.conf = "pytorch";
  const auto result = ccalloc::replay::run(trace, options);
  const double recorded =
      static_cast<double>(ccalloc::replay::recorded_figures(trace).peak_reserved_bytes);
  EXPECT_NEAR(static_cast<double>(result.peak_reserved_bytes), recorded, 0.02 * recorded);
}

INSTANTIATE_TEST_SUITE_P(SharedTraces, RecordedTrace,
                         testing::Values("resnet50_train", "gpt2_train_varlen", "moe_train"));

// PyTorch's published max_memory_allocated() for these runs (data/traces/README.md).
TEST(RecordedTrace, OracleReplayMatchesPyTorchMaxMemoryAllocated) {
  const std::pair<const char*, std::int64_t> expected[] = {
      {"resnet50_train", 3'218'915'840},
      {"gpt2_train_varlen", 10'687'096'320},
      {"moe_train", 7'887'699'968},
  };
  for (const auto& [stem, allocated] : expected) {
    ccalloc::replay::Options options;
    options.conf = "pytorch";
    options.address_oracle = true;
    EXPECT_EQ(ccalloc::replay::run(load(stem), options).peak_allocated_bytes, allocated) << stem;
  }
}

}  // namespace
