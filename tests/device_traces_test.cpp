// The `ccalloc` preset on the workloads recorded on an H100 with bench/torch's models
// (data/traces/device/: ResNet-50 at batch 64 and 128, ViT-B/16, a BERT-sized fine-tune,
// GPT-2 with varying lengths, Llama-style generation, bench/torch's own default runs of the
// last two and of a Llama-style inference server, two runs recorded after the policy's
// settled tail to test it: the server with 16 requests at once and generation of 96 tokens,
// and four held-out runs recorded later, none of which played a part in choosing a rule:
// T5 beam search, Llama-style training with activation checkpointing, EfficientNet-B0 at
// changing resolutions, the fine-tune as the smallest-memory benchmark runs it),
// replayed on the simulated GPU, against
// PyTorch's peaks measured on the device for the same runs (measured.json: native,
// expandable segments, cudaMallocAsync) and against PyTorch's policies replayed:
//  - every trace: peak reserved no higher than any of those;
//  - every trace but the known gaps below: peak within 3% of the floor (peak live requested
//    bytes), no more simulated driver time than expandable segments, no OOM on a device of
//    1.03 x the floor and `fit` within it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/trace_file.hpp"
#include "replay/fit.hpp"
#include "replay/replay.hpp"
#include "test_support.hpp"
#include "trace_test_support.hpp"

#ifndef CCALLOC_TRACES_DIR
#error "CCALLOC_TRACES_DIR must name data/traces (set by the build)"
#endif

namespace {

constexpr const char* kPolicy = "ccalloc";
constexpr double kBound = 1.03;

const std::filesystem::path kDir = std::filesystem::path(CCALLOC_TRACES_DIR) / "device";

// Where the policy misses a bound on these recordings (docs/ccalloc-policy.md, "Limits").
// All peak no higher than expandable segments, which the first test still enforces.
struct Gap {
  bool peak = false;    // peak reserved above 1.03 x the floor
  bool driver = false;  // more simulated driver time than expandable segments
  bool fit = false;     // needs more than 1.03 x the floor
  const char* why = "";
};
const std::map<std::string, Gap>& known_gaps() {
  static const std::map<std::string, Gap> gaps = {
      // Recorded on two H200s (bench/torch/scale.py); docs/ccalloc-policy.md, "Sharing
      // between streams".
      {"ddp_lm.rank0",
       {true, false, false,
        "1.0368 x the floor (expandable segments 1.0766): one stream allocates; above "
        "the 1.03 target, within the 1.05 asked of data-parallel training"}},
      {"ddp_lm.rank1",
       {true, false, false, "1.0321 x the floor (expandable segments 1.0773); as rank 0"}},
      {"fsdp2_lm.rank0",
       {true, true, false,
        "1.0543 x the floor (expandable segments 1.2238): three streams (compute, "
        "all-gather, reduce-scatter) reach their highs at different times; growths take "
        "each other's free pages, behind a device-side wait where the donor's work may "
        "still run (stream_borrow_wait), but a block's pages inside a handle that live "
        "blocks also occupy cannot move. The pages that move between the streams every "
        "step cost maps: 12.5 ms of simulated driver time against expandable segments' "
        "10.5 (about 0.1 ms a step). Its fit is within"}},
      {"fsdp2_lm.rank1",
       {true, true, false,
        "1.0503 x the floor (expandable segments 1.2264), 11.4 ms of driver time against "
        "10.3; as rank 0"}},
      {"fsdp2_lm_avoid_rs.rank0",
       {true, true, false,
        "1.0515 x the floor, 12.8 ms of driver time against 10.5; as fsdp2_lm.rank0 "
        "(FSDP2 calls no record_stream either way)"}},
      {"fsdp2_lm_avoid_rs.rank1",
       {true, true, false,
        "1.0434 x the floor, 11.1 ms of driver time against 10.3; as fsdp2_lm.rank1"}},
      {"gpt2_sidestreams",
       {false, false, true,
        "1.0145 x the floor (expandable segments 1.0756): the metrics stream's "
        "temporaries, as large as the logits, take the main stream's free pages behind a "
        "wait. Its fit is not verified: on a small device the OOM ladder waits for the "
        "side streams' uses, which the recorded run saw complete later, so the replay "
        "runs at the floor and below it"}},
      {"llama_serve",
       {true, false, false,
        "1.0372 x the floor (expandable segments 1.0790; its fit, 1.0220, is within): "
        "key-value caches reallocated one token longer every tick leave free memory in "
        "pieces of pages between live blocks, which no remapping can gather"}},
      {"llama_serve16",
       {true, false, false,
        "1.0457 x the floor (expandable segments 1.0923; its fit, 1.0278, is within): the "
        "same server with up to 16 requests at once, whose key-value caches leave more of "
        "the range in pieces of pages between live blocks"}},
      {"llama_train_ckpt",
       {true, false, false,
        "1.0763 x the floor (expandable segments 1.1576, cudaMallocAsync 1.1288): when the "
        "800 MiB fp32 logits come back, much of the free memory lies inside 64 MiB handles "
        "that live activations also occupy, so it can be neither lent nor released (its "
        "fit, 1.0092, is within: near the limit of a device that small, handles are "
        "single pages)"}},
      {"t5_beam",
       {true, false, false,
        "1.0498 x the floor (expandable segments 1.0700; its fit, 1.0296, is within); see "
        "docs/ccalloc-policy.md, Limits"}},
  };
  return gaps;
}

std::vector<std::string> device_traces() {
  std::vector<std::string> stems;
  for (const auto& e : std::filesystem::directory_iterator(kDir)) {
    const std::string name = e.path().filename().string();
    const std::string suffix = ".pickle.gz";
    if (name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      stems.push_back(name.substr(0, name.size() - suffix.size()));
    }
  }
  std::sort(stems.begin(), stems.end());
  return stems;
}

const nlohmann::json& measured() {
  static const nlohmann::json j = [] {
    std::ifstream in(kDir / "measured.json");
    return nlohmann::json::parse(in);
  }();
  return j.at("peak_reserved_bytes");
}

using ccalloc_test::replay_trace;

class DeviceTrace : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    // Sanitizer builds leave out bench/torch's own default runs (the same workloads as
    // gpt2_varlen20 and llama_generate, longer: llama_generate14 alone is 4.5 MB), the
    // runs of about a million entries each (the serving runs, llama_generate96) and
    // t5_beam (455,000).
    if (ccalloc_test::test_scale() < 1.0 &&
        (GetParam() == "gpt2_varlen33" || GetParam() == "llama_generate14" ||
         GetParam() == "llama_serve" || GetParam() == "llama_serve16" ||
         GetParam() == "llama_generate96" || GetParam() == "t5_beam")) {
      GTEST_SKIP() << "CCALLOC_TEST_SCALE=" << ccalloc_test::test_scale();
    }
    const std::string path = (kDir / (GetParam() + ".pickle.gz")).string();
    trace_ = ccalloc::io::read_any_trace(path, ccalloc::io::first_device_with_entries(path));
    ASSERT_FALSE(trace_.empty()) << GetParam() << " holds no trace";
    floor_ = ccalloc::replay::recorded_figures(trace_).peak_requested_bytes;
    ASSERT_GT(floor_, 0) << GetParam() << " allocates nothing";
    const auto it = known_gaps().find(GetParam());
    if (it != known_gaps().end()) gap_ = it->second;
  }
  double ratio(std::int64_t bytes) const {
    return static_cast<double>(bytes) / static_cast<double>(floor_);
  }
  // The replay of this recording under `conf` on the default device: replayed once and kept
  // for the other tests of the recording (a replay is deterministic).
  const ccalloc::replay::Result& replayed(const char* conf) {
    static std::map<std::pair<std::string, std::string>, ccalloc::replay::Result> done;
    const auto key = std::make_pair(GetParam(), std::string(conf));
    auto it = done.find(key);
    if (it == done.end()) it = done.emplace(key, replay_trace(trace_, conf)).first;
    return it->second;
  }
  std::vector<ccalloc::io::TraceRecord> trace_;
  std::int64_t floor_ = 0;
  Gap gap_;
};

TEST(DeviceTraceFiles, EveryTraceHasPytorchsMeasuredPeaks) {
  const auto stems = device_traces();
  EXPECT_GE(stems.size(), 11u);
  for (const auto& stem : stems) {
    ASSERT_TRUE(measured().contains(stem)) << stem;
    EXPECT_TRUE(measured()[stem].at("expandable_segments").is_number_integer()) << stem;
  }
  for (const auto& [stem, gap] : known_gaps())
    EXPECT_NE(std::find(stems.begin(), stems.end(), stem), stems.end()) << stem;
}

TEST_P(DeviceTrace, PeakNoHigherThanAnyPytorchSettingMeasuredOrReplayed) {
  const auto& ours = replayed(kPolicy);
  const auto& native = replayed("pytorch");
  const auto& expandable = replayed("pytorch,expandable_segments:True");
  std::int64_t best = std::min(native.peak_reserved_bytes, expandable.peak_reserved_bytes);
  std::string figures;
  for (const auto& [setting, bytes] : measured().at(GetParam()).items()) {
    if (bytes.is_null()) continue;  // not measured
    best = std::min(best, bytes.get<std::int64_t>());
    figures += " " + setting + " " + std::to_string(ratio(bytes.get<std::int64_t>()));
  }
  std::printf("[ %s ] peak/floor: ccalloc %.4f; replayed pytorch %.4f, expandable %.4f; "
              "measured%s; driver ms: ccalloc %.1f, expandable %.1f\n",
              GetParam().c_str(), ratio(ours.peak_reserved_bytes),
              ratio(native.peak_reserved_bytes), ratio(expandable.peak_reserved_bytes),
              figures.c_str(), ours.simulated_driver_us / 1000.0,
              expandable.simulated_driver_us / 1000.0);
  EXPECT_EQ(ours.ooms, 0);
  EXPECT_LE(ours.peak_reserved_bytes, best)
      << "ccalloc " << ratio(ours.peak_reserved_bytes) << " x the floor, best " << ratio(best);
}

TEST_P(DeviceTrace, WithinThreePercentOfTheFloorAndNoMoreDriverTimeThanExpandable) {
  const auto& ours = replayed(kPolicy);
  const auto& expandable = replayed("pytorch,expandable_segments:True");
  if (!gap_.peak) {
    EXPECT_LE(ratio(ours.peak_reserved_bytes), kBound);
  }
  if (!gap_.driver) {
    EXPECT_LE(ours.simulated_driver_us, expandable.simulated_driver_us);
  }
  if (gap_.peak || gap_.driver) GTEST_SKIP() << "known gap: " << gap_.why;
}

TEST_P(DeviceTrace, RunsOnADeviceOfThreePercentAboveTheFloorAndFitsWithin) {
  if (gap_.fit) GTEST_SKIP() << "known gap: " << gap_.why;
  const auto capacity = static_cast<std::size_t>(static_cast<double>(floor_) * kBound);
  const auto r = replay_trace(trace_, kPolicy, capacity);
  EXPECT_EQ(r.ooms, 0);
  // The bisection replays the same paths a dozen times more: the sanitizer builds
  // (CCALLOC_TEST_SCALE below 1) stop at the replay above, the plain build fits.
  if (ccalloc_test::test_scale() < 1.0) return;
  ccalloc::replay::FitOptions options;
  options.conf = kPolicy;
  const auto fit = ccalloc::replay::fit(trace_, options);
  std::printf("[ %s ] fit: %zu bytes, %.4f x the floor\n", GetParam().c_str(), fit.capacity,
              ratio(static_cast<std::int64_t>(fit.capacity)));
  EXPECT_TRUE(fit.verified());
  EXPECT_LE(fit.capacity, capacity);
}

// The policy's invariants (docs/ccalloc-policy.md) after every one of llama_generate's
// 466,318 operations, on a device as large as the floor: pieces move between the pools and
// back (revived at the small pages that still map them), the OOM ladder releases the cache
// and unmaps, and the requests it cannot serve fail with the allocator still usable.
// Ten seconds in a plain build: the sanitizer builds (CCALLOC_TEST_SCALE below 1) skip it;
// stitch_views_test takes them through each of those paths.
TEST(DeviceTraceFiles, InvariantsHoldThroughEveryOperationOnADeviceAsLargeAsTheFloor) {
  if (ccalloc_test::test_scale() < 1.0) {
    GTEST_SKIP() << "CCALLOC_TEST_SCALE=" << ccalloc_test::test_scale();
  }
  const auto trace = ccalloc::io::read_any_trace((kDir / "llama_generate.pickle.gz").string());
  ccalloc::replay::Options o;
  o.conf = kPolicy;
  o.capacity = static_cast<std::size_t>(ccalloc::replay::recorded_figures(trace).peak_requested_bytes);
  o.check_invariants = true;
  const auto r = ccalloc::replay::run(trace, o);
  EXPECT_GT(r.ooms, 0);  // it needs 1.0142 x the floor
  EXPECT_GT(r.alloc_retries, 0);
  EXPECT_GT(r.driver_counters.unmaps, 0u);
  EXPECT_LE(r.peak_reserved_bytes, static_cast<std::int64_t>(o.capacity));
}

INSTANTIATE_TEST_SUITE_P(RecordedOnTheDevice, DeviceTrace, ::testing::ValuesIn(device_traces()),
                         ccalloc_test::trace_param_name);

}  // namespace
