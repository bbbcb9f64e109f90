// Replay of traces on the simulated GPU (src/replay) and the `ccalloc replay` command line:
// cross-stream frees, inconsistent traces, OOM during replay, the recorded figures, size
// parsing, and the CLI end to end (errors, --json, --emit-trace).
#include "replay/replay.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ccalloc/errors.hpp"
#include "ccalloc/trace.hpp"
#include "io/byte_input.hpp"
#include "io/gzip.hpp"
#include "io/snapshot_io.hpp"
#include "io/trace_csv.hpp"
#include "io/trace_file.hpp"
#include "test_support.hpp"

#ifndef CCALLOC_TRACES_DIR
#error "CCALLOC_TRACES_DIR must name data/traces (set by the build)"
#endif

namespace {

namespace fs = std::filesystem;
using ccalloc::DevicePtr;
using ccalloc::TraceAction;
using ccalloc::TraceEntry;
using ccalloc::io::TraceRecord;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr DevicePtr kSeg = DevicePtr{0x7f1200000000};  // 2 MiB aligned
const std::string kResnet = std::string(CCALLOC_TRACES_DIR) + "/resnet50_train.csv.gz";
const std::string kCli = std::string(CCALLOC_BINARY_DIR) + "/bin/ccalloc";

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::vector<TraceRecord> parse(const std::string& csv) {
  return ccalloc::io::parse_trace_csv(csv, "test.csv");
}

// The FormatError message run() throws for `trace`, or "" (with a failure) if none.
std::string replay_error(const std::vector<TraceRecord>& trace) {
  try {
    ccalloc::replay::run(trace, {});
  } catch (const ccalloc::FormatError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a FormatError";
  return {};
}

std::string line_of(std::string_view action, DevicePtr addr, std::size_t size,
                    std::int64_t time_us) {
  return std::string(action) + "," + std::to_string(addr) + "," + std::to_string(size) + ",0," +
         std::to_string(time_us) + "\n";
}

// ---------------------------------------------------------------------------------------
// Cross-stream frees

// A free_completed that does not follow its free_requested: the block stays pending (not
// reusable) until the free_completed row, and returns to its pool at the next malloc after
// it, where the replay emits its own free_completed right before that alloc.
TEST(ReplayCrossStream, BlockReturnsOnlyAtTheRecordedFreeCompleted) {
  std::string csv = "action,addr,size,stream,time_us\n";
  csv += line_of("segment_alloc", kSeg, 2 * kMiB, 10);      // line 2
  csv += line_of("alloc", kSeg, 1000, 20);                  // line 3: A
  csv += line_of("alloc", kSeg + 1024, 1000, 30);           // line 4: B
  csv += line_of("free_requested", kSeg, 1000, 40);         // line 5: A freed, in use elsewhere
  csv += line_of("alloc", kSeg + 2048, 1000, 50);           // line 6: C cannot take A's block
  csv += line_of("free_requested", kSeg + 1024, 1000, 60);  // line 7: B, plain free
  csv += line_of("free_completed", kSeg + 1024, 1000, 60);  // line 8
  csv += line_of("alloc", kSeg + 1024, 1000, 70);           // line 9: D reuses B, not A
  csv += line_of("free_completed", kSeg, 1000, 80);         // line 10: A is back
  csv += line_of("alloc", kSeg, 1000, 90);                  // line 11: E reuses A
  const auto trace = parse(csv);

  ccalloc::replay::Options options;
  options.conf = "pytorch";
  options.address_oracle = true;
  options.keep_trace = true;
  const auto result = ccalloc::replay::run(trace, options);

  struct Row {
    TraceAction action;
    DevicePtr addr;
    std::int64_t time_us;
  };
  std::vector<Row> got;
  for (const TraceEntry& e : result.emitted)
    got.push_back({e.action, e.addr, e.time_us});
  const std::vector<Row> want = {
      {TraceAction::kSegmentAlloc, kSeg, 20},
      {TraceAction::kAlloc, kSeg, 20},
      {TraceAction::kAlloc, kSeg + 1024, 30},
      {TraceAction::kFreeRequested, kSeg, 40},  // no free_completed yet
      {TraceAction::kAlloc, kSeg + 2048, 50},
      {TraceAction::kFreeRequested, kSeg + 1024, 60},
      {TraceAction::kFreeCompleted, kSeg + 1024, 60},  // plain free: completes at once
      {TraceAction::kAlloc, kSeg + 1024, 70},
      // The recorded free_completed (time 80) is applied; the block returns at the next
      // malloc, so the replay's own entry comes right before that alloc, at its time.
      {TraceAction::kFreeCompleted, kSeg, 90},
      {TraceAction::kAlloc, kSeg, 90},
  };
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(to_string(got[i].action), to_string(want[i].action)) << "entry " << i;
    EXPECT_EQ(got[i].addr, want[i].addr) << "entry " << i;
    EXPECT_EQ(got[i].time_us, want[i].time_us) << "entry " << i;
  }
  EXPECT_EQ(result.ooms, 0);
  EXPECT_EQ(result.device_allocs, 1);
  EXPECT_FALSE(result.oracle_diverged);
  // At the end A's successor E, B's successor D and C are live: 3 x 1024 bytes.
  EXPECT_EQ(result.stats.allocation[ccalloc::kAggregate].current, 3);
  EXPECT_EQ(result.stats.allocated_bytes[ccalloc::kAggregate].current, 3 * 1024);
}

// Without a later malloc the pending block stays pending: it is counted active but not
// allocated, and nothing was emitted for it.
TEST(ReplayCrossStream, PendingBlockWithoutLaterMallocStaysActive) {
  std::string csv = "action,addr,size,stream,time_us\n";
  csv += line_of("alloc", kSeg, 4096, 1);
  csv += line_of("free_requested", kSeg, 4096, 2);
  csv += line_of("alloc", kSeg + 4096, 4096, 3);
  csv += line_of("free_completed", kSeg, 4096, 4);
  ccalloc::replay::Options options;
  options.keep_trace = true;
  const auto result = ccalloc::replay::run(parse(csv), options);
  int completed = 0;
  for (const TraceEntry& e : result.emitted)
    completed += e.action == TraceAction::kFreeCompleted;
  EXPECT_EQ(completed, 0);
  EXPECT_EQ(result.stats.allocation[ccalloc::kAggregate].current, 1);
  EXPECT_EQ(result.stats.active[ccalloc::kAggregate].current, 2);
}

// ---------------------------------------------------------------------------------------
// Inconsistent traces

TEST(ReplayErrors, FreeOfUnknownAddressNamesTheLine) {
  std::string csv = "action,addr,size,stream,time_us\n";  // line 1
  csv += line_of("alloc", kSeg, 512, 1);                  // line 2
  csv += "\n";                                            // line 3: blank, still counted
  csv += line_of("free_requested", kSeg, 512, 2);         // line 4
  csv += line_of("free_completed", kSeg, 512, 2);         // line 5
  csv += line_of("free_requested", kSeg + 512, 512, 3);   // line 6: never allocated
  const auto trace = parse(csv);
  ASSERT_EQ(trace.back().line, 6u);
  const std::string message = replay_error(trace);
  EXPECT_TRUE(contains(message, "line 6")) << message;
  EXPECT_FALSE(contains(message, "line 5")) << message;
  char hex[32];
  std::snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(kSeg + 512));
  EXPECT_TRUE(contains(message, hex)) << message;
}

TEST(ReplayErrors, DoubleFreeInTheTraceNamesTheSecondFree) {
  std::string csv = "action,addr,size,stream,time_us\n";
  csv += line_of("alloc", kSeg, 512, 1);           // 2
  csv += line_of("free_requested", kSeg, 512, 2);  // 3
  csv += line_of("free_completed", kSeg, 512, 2);  // 4
  csv += line_of("alloc", kSeg + 512, 512, 3);     // 5
  csv += line_of("free_requested", kSeg, 512, 4);  // 6: already freed
  const std::string message = replay_error(parse(csv));
  EXPECT_TRUE(contains(message, "line 6")) << message;
}

TEST(ReplayErrors, FreeCompletedWithoutFreeRequestedNamesTheLine) {
  std::string csv = "action,addr,size,stream,time_us\n";
  csv += line_of("alloc", kSeg, 512, 1);           // 2
  csv += line_of("free_completed", kSeg, 512, 2);  // 3
  const std::string message = replay_error(parse(csv));
  EXPECT_TRUE(contains(message, "line 3")) << message;
}

TEST(ReplayErrors, AllocAtALiveAddressNamesTheLine) {
  std::string csv = "action,addr,size,stream,time_us\n";
  csv += line_of("alloc", kSeg, 512, 1);        // 2
  csv += line_of("alloc", kSeg + 512, 512, 2);  // 3
  csv += line_of("alloc", kSeg, 1024, 3);       // 4: kSeg is live
  const std::string message = replay_error(parse(csv));
  EXPECT_TRUE(contains(message, "line 4")) << message;
  EXPECT_TRUE(contains(message, "live")) << message;
}

// Records built in memory carry line 0 unless set: the line given is the one reported.
TEST(ReplayErrors, LineComesFromTheRecord) {
  std::vector<TraceRecord> trace(1);
  trace[0].entry.action = TraceAction::kFreeRequested;
  trace[0].entry.addr = kSeg;
  trace[0].entry.size = 512;
  trace[0].line = 4242;
  const std::string message = replay_error(trace);
  EXPECT_TRUE(contains(message, "line 4242")) << message;
}

TEST(ReplayErrors, BadConfigIsAConfigError) {
  std::string csv = "action,addr,size,stream,time_us\n";
  csv += line_of("alloc", kSeg, 512, 1);
  ccalloc::replay::Options options;
  options.conf = "no_such_key:1";
  EXPECT_THROW(ccalloc::replay::run(parse(csv), options), ccalloc::ConfigError);
}

// ---------------------------------------------------------------------------------------
// OOM during replay

TEST(ReplayOom, FailedAllocIsCountedAndItsFreesAreSkipped) {
  std::string csv = "action,addr,size,stream,time_us\n";
  const DevicePtr a = kSeg;
  const DevicePtr b = kSeg + 256 * kMiB;
  const DevicePtr c = kSeg + 512 * kMiB;
  csv += line_of("alloc", a, 100 * kMiB, 1);           // OOM on a 64 MiB device
  csv += line_of("alloc", b, 1000, 2);                 // fits
  csv += line_of("free_requested", a, 100 * kMiB, 3);  // skipped
  csv += line_of("alloc", c, 1000, 4);
  csv += line_of("free_completed", a, 100 * kMiB, 5);  // skipped (cross-stream form)
  csv += line_of("free_requested", b, 1000, 6);
  csv += line_of("free_completed", b, 1000, 6);
  csv += line_of("alloc", a, 40 * kMiB, 7);  // the address again: fits this time
  csv += line_of("free_requested", a, 40 * kMiB, 8);
  csv += line_of("free_completed", a, 40 * kMiB, 8);
  csv += line_of("alloc", b, 100 * kMiB, 9);            // OOM again ...
  csv += line_of("free_requested", b, 100 * kMiB, 10);  // ... and its plain free is skipped
  csv += line_of("free_completed", b, 100 * kMiB, 10);
  const auto trace = parse(csv);
  ccalloc::replay::Options options;
  options.conf = "pytorch";
  options.capacity = 64 * kMiB;
  ccalloc::replay::Result result;
  ASSERT_NO_THROW(result = ccalloc::replay::run(trace, options));
  EXPECT_EQ(result.ooms, 2);
  EXPECT_EQ(result.stats.num_ooms, 2);
  EXPECT_EQ(result.stats.allocation[ccalloc::kAggregate].current, 1);    // c
  EXPECT_EQ(result.stats.allocation[ccalloc::kAggregate].allocated, 3);  // b, c, a (40 MiB)
  EXPECT_LE(result.peak_reserved_bytes, static_cast<std::int64_t>(64 * kMiB));
  EXPECT_EQ(ccalloc::replay::recorded_figures(trace).ooms, 0);
}

// Three 30 MiB requests on a 64 MiB device under PyTorch's policy: the third fails. The
// snapshot kept at that OOM holds the two live blocks (and nothing freed later), its
// history ends with the oom entry for the request, and the replay goes on.
std::string three_thirty_mib_csv() {
  std::string csv = "action,addr,size,stream,time_us\n";
  csv += line_of("alloc", kSeg, 30 * kMiB, 1);
  csv += line_of("alloc", kSeg + 256 * kMiB, 30 * kMiB, 2);
  csv += line_of("alloc", kSeg + 512 * kMiB, 30 * kMiB, 3);  // OOM: 4 MiB left
  csv += line_of("free_requested", kSeg, 30 * kMiB, 4);
  csv += line_of("free_completed", kSeg, 30 * kMiB, 4);
  return csv;
}

std::size_t active_bytes(const ccalloc::Snapshot& s) {
  std::size_t n = 0;
  for (const auto& seg : s.segments) {
    for (const auto& b : seg.blocks)
      n += b.state == ccalloc::BlockState::kActiveAllocated ? b.size : 0;
  }
  return n;
}

// That trace under PyTorch's policy on a device of `capacity`, keeping the OOM snapshot.
ccalloc::replay::Result replay_three_thirty_mib(std::size_t capacity) {
  ccalloc::replay::Options options;
  options.conf = "pytorch";
  options.capacity = capacity;
  options.keep_oom_snapshot = true;
  return ccalloc::replay::run(parse(three_thirty_mib_csv()), options);
}

TEST(ReplayOom, SnapshotAtTheFirstOomHoldsTheMemoryAsItFailed) {
  const auto r = replay_three_thirty_mib(64 * kMiB);
  EXPECT_EQ(r.ooms, 1);
  EXPECT_EQ(r.first_oom_record, 2u);
  ASSERT_TRUE(r.oom_snapshot.has_value());
  EXPECT_EQ(active_bytes(*r.oom_snapshot), 60 * kMiB);
  ASSERT_EQ(r.oom_snapshot->device_traces.size(), 1u);
  // The history ends with the failed request's oom entry, then the snapshot's own entry
  // (its size: the active bytes).
  const auto& history = r.oom_snapshot->device_traces[0];
  ASSERT_GE(history.size(), 2u);
  EXPECT_EQ(history.back().action, TraceAction::kSnapshot);
  EXPECT_EQ(history.back().size, 60 * kMiB);
  const auto& oom = history[history.size() - 2];
  EXPECT_EQ(oom.action, TraceAction::kOom);
  EXPECT_EQ(oom.size, 30 * kMiB);
  EXPECT_EQ(oom.addr, 4 * kMiB);  // the device's free bytes
  // The replay went on: the first block was freed after the OOM.
  EXPECT_EQ(r.stats.allocated_bytes[ccalloc::kAggregate].current,
            static_cast<std::int64_t>(30 * kMiB));
}

TEST(ReplayOom, NoOomKeepsNoOomSnapshot) {
  const auto r = replay_three_thirty_mib(128 * kMiB);
  EXPECT_EQ(r.ooms, 0);
  EXPECT_FALSE(r.oom_snapshot.has_value());
}

// A request PyTorch refuses before its OOM ladder (more than 1 EB) replays as an OOM with
// PyTorch's message, and its frees are skipped like those of any failed alloc.
TEST(ReplayOom, AllocAboveOneExabyteIsAnOomWithPyTorchsMessage) {
  std::string csv = "action,addr,size,stream,time_us\n";
  csv += line_of("alloc", kSeg, std::numeric_limits<std::size_t>::max(), 1);
  csv += line_of("free_requested", kSeg, std::numeric_limits<std::size_t>::max(), 2);
  csv += line_of("free_completed", kSeg, std::numeric_limits<std::size_t>::max(), 2);
  csv += line_of("alloc", kSeg + 2 * kMiB, std::size_t{1} << 60, 3);  // exactly 1 EiB
  const ccalloc::replay::Result result = ccalloc::replay::run(parse(csv), {});
  EXPECT_EQ(result.ooms, 2);
  EXPECT_EQ(result.first_oom_message,
            "CUDA out of memory. Tried to allocate more than 1EB memory.");
  EXPECT_EQ(result.stats.allocation[ccalloc::kAggregate].allocated, 0);
}

// A trace pulled one record at a time replays exactly as the same trace held in memory,
// and the recorded figures gathered on the way equal recorded_figures().
TEST(ReplayStream, PulledTraceMatchesTheTraceInMemory) {
  const auto trace = ccalloc::io::read_trace_csv(kResnet);
  ccalloc::replay::Options options;
  options.conf = "pytorch";
  options.address_oracle = true;
  const ccalloc::replay::Result whole = ccalloc::replay::run(trace, options);

  ccalloc::io::TraceReader reader(kResnet);
  std::vector<ccalloc::sim::OracleEntry> oracle;
  for (const TraceRecord& r : trace) {
    if (r.entry.action == TraceAction::kSegmentAlloc)
      oracle.push_back({r.entry.addr, r.entry.size});
  }
  ccalloc::replay::Recorded recorded;
  const ccalloc::replay::Result pulled = ccalloc::replay::run(
      [&reader](TraceRecord& r) { return reader.next(r); }, options, oracle, &recorded);
  EXPECT_EQ(reader.count(), trace.size());
  EXPECT_EQ(pulled.peak_reserved_bytes, whole.peak_reserved_bytes);
  EXPECT_EQ(pulled.peak_allocated_bytes, whole.peak_allocated_bytes);
  EXPECT_EQ(pulled.device_allocs, whole.device_allocs);
  EXPECT_EQ(pulled.oracle_hits, whole.oracle_hits);
  EXPECT_EQ(pulled.stats.to_map(), whole.stats.to_map());
  const ccalloc::replay::Recorded expected = ccalloc::replay::recorded_figures(trace);
  EXPECT_EQ(recorded.peak_reserved_bytes, expected.peak_reserved_bytes);
  EXPECT_EQ(recorded.peak_requested_bytes, expected.peak_requested_bytes);
  EXPECT_EQ(recorded.device_allocs, expected.device_allocs);
}

// A free of an address whose alloc failed, once that address is freed for good, is an
// error again: the skip applies to the failed alloc's own frees only.
TEST(ReplayOom, SkipEndsWithTheFailedAllocsFreeCompleted) {
  std::string csv = "action,addr,size,stream,time_us\n";
  csv += line_of("alloc", kSeg, 100 * kMiB, 1);           // 2: OOM
  csv += line_of("free_requested", kSeg, 100 * kMiB, 2);  // 3: skipped
  csv += line_of("free_completed", kSeg, 100 * kMiB, 2);  // 4: skipped
  csv += line_of("free_completed", kSeg, 100 * kMiB, 3);  // 5: nothing pending any more
  ccalloc::replay::Options options;
  options.capacity = 64 * kMiB;
  try {
    ccalloc::replay::run(parse(csv), options);
    ADD_FAILURE() << "expected a FormatError";
  } catch (const ccalloc::FormatError& e) {
    EXPECT_TRUE(contains(e.what(), "line 5")) << e.what();
  }
}

// ---------------------------------------------------------------------------------------
// Recorded figures

TEST(ReplayRecordedFigures, HandMadeTrace) {
  std::string csv = "action,addr,size,stream,time_us\n";
  const DevicePtr s1 = kSeg;
  const DevicePtr s2 = kSeg + 64 * kMiB;
  const DevicePtr s3 = kSeg + 128 * kMiB;
  csv += line_of("segment_alloc", s1, 20 * kMiB, 1);  // reserved 20
  csv += line_of("alloc", s1, 5 * kMiB, 2);           // requested 5 MiB
  csv += line_of("segment_alloc", s2, 2 * kMiB, 3);   // reserved 22
  csv += line_of("alloc", s2, 1000, 4);               // 5 MiB + 1000
  csv += line_of("free_requested", s1, 5 * kMiB, 5);  // still live until completed
  csv += line_of("alloc", s2 + 1024, 300, 6);         // 5 MiB + 1300: the peak
  csv += line_of("free_completed", s1, 5 * kMiB, 7);  // 1300
  csv += line_of("segment_free", s1, 20 * kMiB, 8);   // reserved 2
  csv += line_of("segment_alloc", s3, 30 * kMiB, 9);  // reserved 32
  csv += "oom,123456,40000000,0,10\n";                // addr: device free bytes
  csv += line_of("segment_map", s1, 2 * kMiB, 11);    // reserved 34: the peak
  csv += line_of("segment_unmap", s1, 2 * kMiB, 12);  // 32
  csv += line_of("alloc", s3, 4 * kMiB, 13);          // 4 MiB + 1300: below the peak
  csv += line_of("free_requested", s3, 4 * kMiB, 14);
  csv += line_of("free_completed", s3, 4 * kMiB, 14);
  const auto figures = ccalloc::replay::recorded_figures(parse(csv));
  EXPECT_EQ(figures.peak_reserved_bytes, static_cast<std::int64_t>(34 * kMiB));
  EXPECT_EQ(figures.device_allocs, 4);  // 3 segment_alloc + 1 segment_map
  EXPECT_EQ(figures.device_frees, 2);   // segment_free + segment_unmap
  EXPECT_EQ(figures.ooms, 1);
  // The first block counts until its free_completed: 5 MiB + 1000 + 300.
  EXPECT_EQ(figures.peak_requested_bytes, static_cast<std::int64_t>(5 * kMiB + 1300));
}

TEST(ReplayRecordedFigures, RequestedFallsOnlyAtFreeCompleted) {
  std::string csv = "action,addr,size,stream,time_us\n";
  csv += line_of("alloc", kSeg, 3000, 1);
  csv += line_of("free_requested", kSeg, 3000, 2);
  csv += line_of("alloc", kSeg + 4096, 5000, 3);  // 8000 live: A still counts
  csv += line_of("free_completed", kSeg, 3000, 4);
  csv += line_of("alloc", kSeg + 8192, 2000, 5);  // 7000
  const auto figures = ccalloc::replay::recorded_figures(parse(csv));
  EXPECT_EQ(figures.peak_requested_bytes, 8000);
  EXPECT_EQ(figures.peak_reserved_bytes, 0);
  EXPECT_EQ(figures.device_allocs, 0);
}

TEST(ReplayRecordedFigures, EmptyTrace) {
  const auto figures = ccalloc::replay::recorded_figures({});
  EXPECT_EQ(figures.peak_reserved_bytes, 0);
  EXPECT_EQ(figures.peak_requested_bytes, 0);
  EXPECT_EQ(figures.device_allocs, 0);
  EXPECT_EQ(figures.device_frees, 0);
  EXPECT_EQ(figures.ooms, 0);
}

// ---------------------------------------------------------------------------------------
// parse_size

TEST(ReplayParseSize, UnitsAndPlainBytes) {
  using ccalloc::replay::parse_size;
  EXPECT_EQ(parse_size("141GiB"), std::size_t{141} << 30);
  EXPECT_EQ(parse_size("80GB"), std::size_t{80'000'000'000});
  EXPECT_EQ(parse_size("512MiB"), std::size_t{512} << 20);
  EXPECT_EQ(parse_size("1.5TiB"), std::size_t{3} << 39);
  EXPECT_EQ(parse_size("4096"), std::size_t{4096});
  EXPECT_EQ(parse_size("4096B"), std::size_t{4096});
  EXPECT_EQ(parse_size("2KiB"), std::size_t{2048});
  EXPECT_EQ(parse_size("2KB"), std::size_t{2000});
  EXPECT_EQ(parse_size("1TB"), std::size_t{1'000'000'000'000});
  EXPECT_EQ(parse_size("512mib"), std::size_t{512} << 20);  // case-insensitive
  EXPECT_EQ(parse_size("80gb"), std::size_t{80'000'000'000});
  EXPECT_EQ(parse_size("0.5GiB"), std::size_t{512} << 20);
}

TEST(ReplayParseSize, BadInputThrowsErrorNamingTheText) {
  for (const std::string bad : {"", "GiB", "abc", "12XB", "-5GiB", "1.2.3GiB", "5 GiB", " 5GiB",
                                "5GiBs", "0", "0GiB", "0.0001B", "99999999999TiB", "1e3", "0x10"}) {
    try {
      const std::size_t v = ccalloc::replay::parse_size(bad);
      ADD_FAILURE() << "'" << bad << "' parsed as " << v;
    } catch (const ccalloc::Error& e) {
      EXPECT_TRUE(contains(e.what(), "'" + bad + "'")) << e.what();
    }
  }
}

// ---------------------------------------------------------------------------------------
// The command line

using ccalloc_test::TempDir;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out) << path;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct CliResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
  std::string all() const { return out + err; }
};

// Runs the ccalloc binary with `args` (already shell-quoted).
CliResult run_cli(const std::string& args, const TempDir& dir) {
  CliResult r;
  const std::string err_path = dir.file("stderr.txt");
  const std::string command = "'" + kCli + "' " + args + " 2>'" + err_path + "'";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "popen failed: " << command;
    return r;
  }
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0)
    r.out.append(buf, n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = read_text(err_path);
  return r;
}

class ReplayCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(kCli)) << kCli << " is missing: build the ccalloc tool (target "
                                  << "ccalloc_cli) before running this test";
  }
  TempDir dir_;
};

TEST_F(ReplayCli, MalformedCsvFailsNamingTheLine) {
  const std::string path = dir_.file("bad.csv");
  write_text(path,
             "action,addr,size,stream,time_us\n"
             "alloc,4096,512,0,1\n"
             "alloc,8192,oops,0,2\n"
             "free_requested,4096,512,0,3\n");
  const CliResult r = run_cli("replay '" + path + "'", dir_);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.all(), ":3:") || contains(r.all(), "line 3")) << r.all();
  EXPECT_TRUE(contains(r.all(), "oops")) << r.all();
  EXPECT_TRUE(contains(r.all(), path)) << r.all();
}

TEST_F(ReplayCli, InconsistentTraceFailsNamingFileAndLine) {
  const std::string path = dir_.file("inconsistent.csv");
  write_text(path,
             "action,addr,size,stream,time_us\n"
             "alloc,4096,512,0,1\n"
             "free_requested,4096,512,0,2\n"
             "free_completed,4096,512,0,2\n"
             "free_requested,4096,512,0,3\n");
  const CliResult r = run_cli("replay '" + path + "'", dir_);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.all(), "line 5")) << r.all();
  EXPECT_TRUE(contains(r.all(), path)) << r.all();
}

TEST_F(ReplayCli, ImpossibleRequestCountsInTheOomColumn) {
  const std::string path = dir_.file("huge.csv");
  write_text(path, "action,addr,size,stream,time_us\nalloc,4096,18446744073709551615,0,1\n");
  const CliResult r = run_cli("replay '" + path + "' --json", dir_);
  ASSERT_EQ(r.exit_code, 0) << r.all();
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j[0]["ooms"], 1);
  EXPECT_EQ(j[0]["first_oom_message"],
            "CUDA out of memory. Tried to allocate more than 1EB memory.");
}

TEST_F(ReplayCli, MaxEntriesFailsNamingTheLimitAndTheLine) {
  const std::string path = dir_.file("three.csv");
  write_text(path,
             "action,addr,size,stream,time_us\n"
             "alloc,4096,512,0,1\nfree_requested,4096,512,0,2\nfree_completed,4096,512,0,2\n");
  const CliResult r = run_cli("replay '" + path + "' --max-entries 2", dir_);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.err, "ccalloc: error: " + path +
                       ":4: more than 2 trace entries (limit max_entries = 2; raise it with the "
                       "environment variable CCALLOC_MAX_ENTRIES or `ccalloc replay "
                       "--max-entries`)\n");
}

TEST_F(ReplayCli, FileWithoutLineEndsFailsAtTheLineLimit) {
  // A header, then 2 MiB of zeros: the row fails once it passes the line limit.
  const std::string path = dir_.file("zeros.csv.gz");
  ccalloc::io::write_file(path, "action,addr,size,stream,time_us\n" + std::string(2 * kMiB, '\0'));
  const CliResult r = run_cli("replay '" + path + "'", dir_);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.err, "ccalloc: error: " + path +
                       ":2: the line starting at byte offset 32 is longer than 65536 bytes (rows "
                       "of traces and RMM logs are far shorter: is this the right file?) (limit "
                       "max_line_bytes = 65536; raise it with the environment variable "
                       "CCALLOC_MAX_LINE_BYTES)\n");
}

TEST_F(ReplayCli, MissingFileFails) {
  const std::string path = dir_.file("does_not_exist.csv");
  const CliResult r = run_cli("replay '" + path + "'", dir_);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.all(), path)) << r.all();
}

TEST_F(ReplayCli, BadConfFailsNamingTheKey) {
  const std::string path = dir_.file("ok.csv");
  write_text(path, "action,addr,size,stream,time_us\nalloc,4096,512,0,1\n");
  {
    const CliResult r = run_cli("replay '" + path + "' --conf 'bogus_key:1'", dir_);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_TRUE(contains(r.all(), "bogus_key")) << r.all();
  }
  {
    const CliResult r = run_cli("replay '" + path + "' --conf 'max_split_size_mb:abc'", dir_);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_TRUE(contains(r.all(), "max_split_size_mb")) << r.all();
    EXPECT_TRUE(contains(r.all(), "abc")) << r.all();
  }
}

TEST_F(ReplayCli, BadCapacityFailsNamingTheText) {
  const std::string path = dir_.file("ok.csv");
  write_text(path, "action,addr,size,stream,time_us\nalloc,4096,512,0,1\n");
  const CliResult r = run_cli("replay '" + path + "' --capacity 12XB", dir_);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.all(), "12XB")) << r.all();
}

TEST_F(ReplayCli, JsonForTwoConfigsOnResnet) {
  const CliResult r = run_cli("replay '" + kResnet +
                                  "' --conf pytorch --conf 'pytorch,max_split_size_mb:40' "
                                  "--address-oracle --json",
                              dir_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(r.out)) << r.out.substr(0, 500);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 2u);
  for (const auto& obj : j) {
    ASSERT_TRUE(obj.is_object());
    for (const char* key :
         {"conf", "peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
          "device_allocs", "device_frees", "alloc_retries", "ooms", "simulated_driver_us"}) {
      EXPECT_TRUE(obj.contains(key)) << key;
    }
    EXPECT_TRUE(obj["simulated_driver_us"].is_number());
    EXPECT_EQ(obj["ooms"].get<std::int64_t>(), 0);
    EXPECT_GE(obj["peak_reserved_bytes"].get<std::int64_t>(),
              obj["peak_allocated_bytes"].get<std::int64_t>());
    EXPECT_GE(obj["peak_allocated_bytes"].get<std::int64_t>(),
              obj["peak_requested_bytes"].get<std::int64_t>());
  }
  const auto& native = j[0];
  EXPECT_EQ(native["conf"].get<std::string>(), "pytorch");
  EXPECT_EQ(native["peak_reserved_bytes"].get<std::int64_t>(), 3594518528);
  EXPECT_EQ(native["device_allocs"].get<std::int64_t>(), 118);
  EXPECT_EQ(native["device_frees"].get<std::int64_t>(), 0);
  EXPECT_EQ(native["alloc_retries"].get<std::int64_t>(), 0);
  EXPECT_EQ(native["peak_requested_bytes"].get<std::int64_t>(), 3192592912);
  EXPECT_EQ(native["peak_allocated_bytes"].get<std::int64_t>(), 3218915840);
  EXPECT_GT(native["simulated_driver_us"].get<double>(), 0.0);
  EXPECT_EQ(j[1]["conf"].get<std::string>(), "pytorch,max_split_size_mb:40");
}

// A recording with three streams: the device-side waits the stitching policy inserts are
// reported (text row and JSON), and switching them off shows their effect. The device
// measured 20,642,267,136 bytes for the same workload under the handles of the time, each
// at most 1/512 of the limit (docs/ccalloc-policy-log.md); handles sized by the room left
// replay it 2 MiB lower.
TEST_F(ReplayCli, ReportsTheStreamWaitsOfBorrowingOnAMultiStreamRecording) {
  const std::string trace =
      std::string(CCALLOC_TRACES_DIR) + "/device/gpt2_sidestreams.pickle.gz";
  const std::string confs = " --conf ccalloc --conf ccalloc,stream_borrow_wait:False";
  const CliResult r = run_cli("replay '" + trace + "'" + confs + " --json", dir_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["peak_requested_bytes"].get<std::int64_t>(), 20346751484);
  EXPECT_EQ(j[0]["peak_reserved_bytes"].get<std::int64_t>(), 20640169984);
  EXPECT_EQ(j[0]["driver_calls"]["stream_wait"].get<std::int64_t>(), 9);
  EXPECT_EQ(j[1]["peak_reserved_bytes"].get<std::int64_t>(), 21885878272);
  EXPECT_EQ(j[1]["driver_calls"]["stream_wait"].get<std::int64_t>(), 0);
  const CliResult text = run_cli("replay '" + trace + "'" + confs, dir_);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("stream_waits"), std::string::npos) << text.out;
}

TEST_F(ReplayCli, EmitTraceWritesTheRecordedSegmentAllocs) {
  const std::string out = dir_.file("emitted.csv");
  const CliResult r = run_cli(
      "replay '" + kResnet + "' --conf pytorch --address-oracle --emit-trace '" + out + "'", dir_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(fs::exists(out));
  const auto emitted = ccalloc::io::read_trace_csv(out);
  const auto recorded = ccalloc::io::read_trace_csv(kResnet);
  const auto segment_allocs = [](const std::vector<TraceRecord>& rows) {
    std::vector<std::pair<DevicePtr, std::size_t>> out_rows;
    for (const TraceRecord& rec : rows) {
      if (rec.entry.action == TraceAction::kSegmentAlloc) {
        out_rows.emplace_back(rec.entry.addr, rec.entry.size);
      }
    }
    return out_rows;
  };
  const auto want = segment_allocs(recorded);
  const auto got = segment_allocs(emitted);
  ASSERT_EQ(want.size(), 118u);
  EXPECT_EQ(got, want);
  // The whole emitted trace replays again to the same figures.
  const auto figures = ccalloc::replay::recorded_figures(emitted);
  EXPECT_EQ(figures.peak_reserved_bytes, 3594518528);
  EXPECT_EQ(figures.device_allocs, 118);
}

TEST_F(ReplayCli, EmitTraceWithTwoConfigsWritesNumberedFiles) {
  const std::string csv = dir_.file("small.csv");
  write_text(csv,
             "action,addr,size,stream,time_us\n"
             "alloc,4096,512,0,1\n"
             "free_requested,4096,512,0,2\n"
             "free_completed,4096,512,0,2\n");
  const CliResult r = run_cli("replay '" + csv + "' --conf pytorch --conf " +
                                  "'pytorch,roundup_power2_divisions:4' --emit-trace '" +
                                  dir_.file("out.csv.gz") + "'",
                              dir_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* name : {"out.1.csv.gz", "out.2.csv.gz"}) {
    ASSERT_TRUE(fs::exists(dir_.file(name))) << name;
    const auto rows = ccalloc::io::read_trace_csv(dir_.file(name));
    ASSERT_EQ(rows.size(), 4u) << name;  // segment_alloc, alloc, free_requested, free_completed
    EXPECT_EQ(rows[0].entry.action, TraceAction::kSegmentAlloc);
    EXPECT_EQ(rows[1].entry.action, TraceAction::kAlloc);
    EXPECT_EQ(rows[1].entry.size, 512u);
  }
  EXPECT_FALSE(fs::exists(dir_.file("out.csv.gz")));
}

// --oom-snapshot with two configs, each of which runs out of memory at the third request:
// each writes its numbered snapshot (the two live blocks) and the table names the failing
// entry.
TEST_F(ReplayCli, OomSnapshotIsWrittenPerConfigThatRunsOutOfMemory) {
  const std::string csv = dir_.file("three.csv");
  write_text(csv, three_thirty_mib_csv());
  const CliResult r =
      run_cli("replay '" + csv + "' --capacity 64MiB --conf pytorch --conf " +
                  "'pytorch,expandable_segments:True' --oom-snapshot '" + dir_.file("oom.json") +
                  "' --snapshot-out '" + dir_.file("end.pickle.gz") + "'",
              dir_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Numbered before the whole extension, which names the format; the final snapshots hold
  // only the second block (the first was freed after the OOM).
  for (const char* name : {"end.1.pickle.gz", "end.2.pickle.gz"}) {
    ASSERT_TRUE(fs::exists(dir_.file(name))) << name;
    EXPECT_EQ(active_bytes(ccalloc::io::read_snapshot(dir_.file(name))), 30 * kMiB) << name;
  }
  EXPECT_EQ(read_text(dir_.file("oom.1.json")).substr(0, 1), "{");  // JSON, as named
  for (const char* name : {"oom.1.json", "oom.2.json"}) {
    ASSERT_TRUE(fs::exists(dir_.file(name))) << name;
    EXPECT_EQ(active_bytes(ccalloc::io::read_snapshot(dir_.file(name))), 60 * kMiB) << name;
  }
  EXPECT_TRUE(contains(r.out, "first OOM under A, at entry 3 of the trace: ")) << r.out;
  EXPECT_TRUE(contains(r.out, "first OOM under B, at entry 3 of the trace: ")) << r.out;
  EXPECT_TRUE(contains(r.err, "the snapshot at the first OOM under pytorch: " +
                                  dir_.file("oom.1.json")))
      << r.err;
  EXPECT_FALSE(fs::exists(dir_.file("oom.json")));
}

TEST_F(ReplayCli, OomSnapshotWithoutAnOomWritesNothingAndSaysSo) {
  const std::string csv = dir_.file("three.csv");
  write_text(csv, three_thirty_mib_csv());
  const CliResult r = run_cli("replay '" + csv + "' --capacity 1GiB --conf pytorch --oom-snapshot '" +
                                  dir_.file("oom.pickle") + "'",
                              dir_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(dir_.file("oom.pickle")));
  EXPECT_TRUE(contains(r.err, "no OOM under pytorch: no OOM snapshot written")) << r.err;
}

// fit on a synthetic trace (3 MiB and 3 MiB, the first freed, then 5 MiB): the ccalloc
// policy needs exactly 10 MiB (tests/stitch_policy_test.cpp derives it), PyTorch's one
// 20 MiB segment; both answers verified, stderr silent when it is not a terminal.
TEST_F(ReplayCli, FitPrintsTheSmallestCapacityPerConfigVerified) {
  const std::string csv = dir_.file("fit.csv");
  write_text(csv,
             "action,addr,size,stream,time_us\n"
             "alloc,16777216,3145728,0,1\n"
             "alloc,33554432,3145728,0,2\n"
             "free_requested,16777216,3145728,0,3\n"
             "free_completed,16777216,3145728,0,3\n"
             "alloc,50331648,5242880,0,4\n");
  const CliResult r = run_cli("fit '" + csv + "' --conf ccalloc,stitch_segments:True --conf pytorch --json", dir_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(r.out)) << r.out;
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["conf"], "ccalloc,stitch_segments:True");
  EXPECT_EQ(j[0]["floor_bytes"], 8 * 1024 * 1024);
  EXPECT_EQ(j[0]["capacity_bytes"], 10 * 1024 * 1024);
  EXPECT_EQ(j[0]["ratio_to_floor"], 1.25);
  EXPECT_EQ(j[0]["peak_reserved_bytes"], 10 * 1024 * 1024);
  EXPECT_EQ(j[0]["verified"], true);
  EXPECT_EQ(j[1]["capacity_bytes"], 20 * 1024 * 1024);
  EXPECT_EQ(j[1]["verified"], true);
  EXPECT_EQ(j[0]["capacity_gb"], 0.01048576);
  const CliResult text =
      run_cli("fit '" + csv + "' --conf ccalloc,stitch_segments:True --conf pytorch", dir_);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("smallest capacity     10,485,760 bytes (10.00 MiB, 0.010 GB)"),
            std::string::npos)
      << text.out;
  // The config that needs least, and how far the other is from it.
  EXPECT_NE(text.out.find("Least memory: ccalloc,stitch_segments:True, 10.00 MiB (0.010 GB)\n"
                          "  pytorch: +10,485,760 bytes (10.00 MiB, +100.00 %)"),
            std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("verified              yes: no OOM at this capacity, at least one "
                          "at 2 MiB less"),
            std::string::npos)
      << text.out;
}

// A snapshot streamed as a trace replays exactly as the CSV of the same trace.
TEST(ReplayStream, SnapshotTraceMatchesTheCsvOfTheSameTrace) {
  const std::string pickle = std::string(CCALLOC_TRACES_DIR) + "/resnet50_train.pickle.gz";
  ccalloc::replay::Options options;
  options.conf = "pytorch";
  const ccalloc::replay::Result from_csv =
      ccalloc::replay::run(ccalloc::io::read_trace_csv(kResnet), options);
  ccalloc::io::TraceReader reader(pickle);
  const ccalloc::replay::Result from_snapshot = ccalloc::replay::run(
      [&reader](TraceRecord& r) { return reader.next(r); }, options, {}, nullptr);
  EXPECT_EQ(reader.kind(), ccalloc::io::FileKind::kSnapshotPickle);
  EXPECT_EQ(reader.count(), ccalloc::io::read_trace_csv(kResnet).size());
  EXPECT_EQ(from_snapshot.peak_reserved_bytes, from_csv.peak_reserved_bytes);
  EXPECT_EQ(from_snapshot.peak_allocated_bytes, from_csv.peak_allocated_bytes);
  EXPECT_EQ(from_snapshot.device_allocs, from_csv.device_allocs);
  EXPECT_EQ(from_snapshot.stats.to_map(), from_csv.stats.to_map());
}

// The same through a JSON snapshot, read in 7-byte chunks.
TEST(ReplayStream, JsonSnapshotTraceInTinyChunksMatchesTheCsv) {
  TempDir dir;
  const std::string json = dir.file("r.json.gz");
  ccalloc::io::write_snapshot(json, ccalloc::io::read_snapshot(std::string(CCALLOC_TRACES_DIR) +
                                                               "/resnet50_train.pickle.gz"));
  const auto csv = ccalloc::io::read_trace_csv(kResnet);
  ccalloc::io::detail::test_chunk_cap = 7;
  std::vector<TraceRecord> streamed;
  try {
    streamed = ccalloc::io::read_any_trace(json);
  } catch (...) {
    ccalloc::io::detail::test_chunk_cap = 0;
    throw;
  }
  ccalloc::io::detail::test_chunk_cap = 0;
  ASSERT_EQ(streamed.size(), csv.size());
  for (std::size_t i = 0; i < csv.size(); ++i) {
    ASSERT_EQ(streamed[i].entry.action, csv[i].entry.action) << i;
    ASSERT_EQ(streamed[i].entry.addr, csv[i].entry.addr) << i;
    ASSERT_EQ(streamed[i].entry.size, csv[i].entry.size) << i;
    ASSERT_EQ(streamed[i].entry.stream, csv[i].entry.stream) << i;
  }
}

}  // namespace
