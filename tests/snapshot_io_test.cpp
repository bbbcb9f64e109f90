// Snapshot files: the typed snapshot schema against PyTorch's own snapshots in data/traces,
// the file formats detected from their content, a large snapshot written quickly, the RMM
// log format, and entries streamed from traces (the readers themselves: pickle_json_test).
#include "io/snapshot_io.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "ccalloc/errors.hpp"
#include "io/gzip.hpp"
#include "io/json.hpp"
#include "io/pickle.hpp"
#include "io/rmm_log.hpp"
#include "io/trace_csv.hpp"
#include "pickle_walker.hpp"
#include "test_support.hpp"

#ifndef CCALLOC_TRACES_DIR
#error "CCALLOC_TRACES_DIR must name data/traces (set by the build)"
#endif

namespace ccalloc::io {
namespace {

using ccalloc_test::message_of;

namespace fs = std::filesystem;
using namespace std::string_literals;

const std::string kTraces = CCALLOC_TRACES_DIR;

using ccalloc_test::TempDir;

std::vector<std::string> shared_pickles() {
  std::vector<std::string> out;
  if (!fs::is_directory(kTraces)) return out;
  for (const auto& e : fs::directory_iterator(kTraces)) {
    const std::string name = e.path().filename().string();
    if (name.ends_with(".pickle.gz")) out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The files the tests that read every shared pickle whole (several times each) go through.
// Sanitizer builds (CCALLOC_TEST_SCALE below 1, scripts/test) take resnet50's three: a full
// recording, its expandable-segments twin and the one with stack frames hold every structure
// the other workloads' files do, and the fuzzers take the readers further.
std::vector<std::string> pickles_to_read_whole() {
  std::vector<std::string> out = shared_pickles();
  if (ccalloc_test::test_scale() < 1.0) {
    std::erase_if(out, [](const std::string& path) {
      return fs::path(path).filename().string().find("resnet50") == std::string::npos;
    });
  }
  return out;
}

#define REQUIRE_TRACES()                                                \
  do {                                                                  \
    if (shared_pickles().empty()) FAIL() << "no traces in " << kTraces; \
  } while (0)

#define EXPECT_CONTAINS(haystack, needle)                          \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "expected to find \"" << (needle) << "\" in \"" << (haystack) << "\""

// Equal, with tuples and lists interchangeable (JSON has only arrays).
bool same_data(const Value& a, const Value& b) {
  const bool a_seq = a.is_list() || a.is_tuple();
  const bool b_seq = b.is_list() || b.is_tuple();
  if (a_seq || b_seq) {
    if (!a_seq || !b_seq) return false;
    const List& x = a.as_list();
    const List& y = b.as_list();
    if (x.size() != y.size()) return false;
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (!same_data(x[i], y[i])) return false;
    }
    return true;
  }
  if (a.is_dict() && b.is_dict()) {
    const Dict& x = a.as_dict();
    const Dict& y = b.as_dict();
    if (x.size() != y.size()) return false;
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (!same_data(x[i].first, y[i].first) || !same_data(x[i].second, y[i].second)) {
        return false;
      }
    }
    return true;
  }
  return a == b;
}

using ccalloc_test::WalkResult;
using ccalloc_test::walk_pickle;

// ---- typed equality ----------------------------------------------------------------------

bool same_frames(const Frames& a, const Frames& b, bool null_is_empty) {
  const bool a_empty = !a || a->empty();
  const bool b_empty = !b || b->empty();
  if (!null_is_empty && (static_cast<bool>(a) != static_cast<bool>(b))) return false;
  if (a_empty || b_empty) return a_empty == b_empty;
  return *a == *b;
}

void expect_same_snapshot(const Snapshot& a, const Snapshot& b) {
  ASSERT_EQ(a.segments.size(), b.segments.size());
  for (std::size_t i = 0; i < a.segments.size(); ++i) {
    const SnapshotSegment& x = a.segments[i];
    const SnapshotSegment& y = b.segments[i];
    EXPECT_EQ(x.device, y.device);
    EXPECT_EQ(x.address, y.address);
    EXPECT_EQ(x.total_size, y.total_size);
    EXPECT_EQ(x.allocated_size, y.allocated_size);
    EXPECT_EQ(x.active_size, y.active_size);
    EXPECT_EQ(x.requested_size, y.requested_size);
    EXPECT_EQ(x.stream, y.stream);
    EXPECT_EQ(x.is_small, y.is_small);
    EXPECT_EQ(x.pool_id, y.pool_id);
    EXPECT_EQ(x.is_expandable, y.is_expandable);
    EXPECT_TRUE(same_frames(x.frames, y.frames, true));
    EXPECT_EQ(x.pieces, y.pieces);
    ASSERT_EQ(x.blocks.size(), y.blocks.size());
    for (std::size_t j = 0; j < x.blocks.size(); ++j) {
      EXPECT_EQ(x.blocks[j].address, y.blocks[j].address);
      EXPECT_EQ(x.blocks[j].size, y.blocks[j].size);
      EXPECT_EQ(x.blocks[j].requested_size, y.blocks[j].requested_size);
      EXPECT_EQ(x.blocks[j].state, y.blocks[j].state);
      EXPECT_TRUE(same_frames(x.blocks[j].frames, y.blocks[j].frames, true));
    }
  }
  ASSERT_EQ(a.device_traces.size(), b.device_traces.size());
  for (std::size_t d = 0; d < a.device_traces.size(); ++d) {
    ASSERT_EQ(a.device_traces[d].size(), b.device_traces[d].size());
    for (std::size_t i = 0; i < a.device_traces[d].size(); ++i) {
      const SnapshotTraceEntry& x = a.device_traces[d][i];
      const SnapshotTraceEntry& y = b.device_traces[d][i];
      ASSERT_TRUE(x.action == y.action && x.addr == y.addr && x.size == y.size &&
                  x.stream == y.stream && x.time_us == y.time_us &&
                  x.user_metadata == y.user_metadata && same_frames(x.frames, y.frames, false))
          << "device " << d << " entry " << i;
    }
  }
  const AllocatorSettings& x = a.allocator_settings;
  const AllocatorSettings& y = b.allocator_settings;
  EXPECT_EQ(x.conf, y.conf);
  EXPECT_EQ(x.max_split_size, y.max_split_size);
  EXPECT_EQ(x.garbage_collection_threshold, y.garbage_collection_threshold);
  EXPECT_EQ(x.expandable_segments, y.expandable_segments);
  EXPECT_EQ(x.pinned_num_register_threads, y.pinned_num_register_threads);
  EXPECT_EQ(x.release_lock_on_cudamalloc, y.release_lock_on_cudamalloc);
  EXPECT_EQ(x.pinned_use_cuda_host_register, y.pinned_use_cuda_host_register);
  EXPECT_EQ(x.roundup_power2_divisions, y.roundup_power2_divisions);
  EXPECT_EQ(x.graph_capture_record_stream_reuse, y.graph_capture_record_stream_reuse);
  EXPECT_EQ(x.trace_alloc_overflowed, y.trace_alloc_overflowed);
  EXPECT_EQ(x.trace_alloc_max_entries, y.trace_alloc_max_entries);
  EXPECT_EQ(a.physical, b.physical);
  ASSERT_EQ(a.external_annotations.size(), b.external_annotations.size());
  for (std::size_t i = 0; i < a.external_annotations.size(); ++i) {
    EXPECT_EQ(a.external_annotations[i].name, b.external_annotations[i].name);
    EXPECT_EQ(a.external_annotations[i].stage, b.external_annotations[i].stage);
    EXPECT_EQ(a.external_annotations[i].device, b.external_annotations[i].device);
    EXPECT_EQ(a.external_annotations[i].time_us, b.external_annotations[i].time_us);
  }
}

// ---- the shared PyTorch snapshots ----------------------------------------------------------

TEST(SharedSnapshots, EveryPickleParsesAndRoundTrips) {
  REQUIRE_TRACES();
  for (const std::string& path : pickles_to_read_whole()) {
    SCOPED_TRACE(path);
    const std::string data = read_file(path);
    const Value v = parse_pickle(data, path);
    ASSERT_TRUE(v.is_dict());
    EXPECT_NE(v.find("segments"), nullptr);
    EXPECT_NE(v.find("device_traces"), nullptr);
    // Pickle: exactly the same data.
    const std::string again = write_pickle(v);
    const WalkResult walk = walk_pickle(again);
    EXPECT_TRUE(walk.ok) << walk.problem;
    EXPECT_TRUE(parse_pickle(again, path + " (rewritten)") == v);
    // JSON: the same data, with tuples as lists.
    const Value from_json = parse_json(write_json(v), path + " (as JSON)");
    EXPECT_TRUE(same_data(from_json, v));
    EXPECT_FALSE(from_json == v);  // segment_pool_id was a tuple
  }
}

TEST(SharedSnapshots, TracesMatchTheCsvFiles) {
  REQUIRE_TRACES();
  for (const std::string stem :
       {"resnet50_train", "gpt2_train_varlen", "moe_train", "resnet50_train.expandable",
        "gpt2_train_varlen.expandable", "moe_train.expandable"}) {
    // The sanitizer builds take resnet50's pair only, as pickles_to_read_whole() does.
    if (ccalloc_test::test_scale() < 1.0 && !stem.starts_with("resnet50")) continue;
    SCOPED_TRACE(stem);
    const std::string pickle = kTraces + "/" + stem + ".pickle.gz";
    const std::string csv = kTraces + "/" + stem + ".csv.gz";
    if (!fs::exists(pickle) || !fs::exists(csv)) continue;
    const Snapshot s = read_snapshot(pickle);
    const std::vector<TraceRecord> from_snapshot = trace_records(s, 0);
    const std::vector<TraceRecord> from_csv = read_trace_csv(csv);
    ASSERT_EQ(from_snapshot.size(), from_csv.size());
    std::int64_t reserved = 0;
    for (std::size_t i = 0; i < from_csv.size(); ++i) {
      const TraceEntry& a = from_snapshot[i].entry;
      const TraceEntry& b = from_csv[i].entry;
      ASSERT_TRUE(a.action == b.action && a.addr == b.addr && a.size == b.size &&
                  a.stream == b.stream && a.time_us == b.time_us)
          << "entry " << i;
      EXPECT_EQ(from_snapshot[i].line, i + 1);
      if (b.action == TraceAction::kSegmentAlloc || b.action == TraceAction::kSegmentMap) {
        reserved += static_cast<std::int64_t>(b.size);
      }
      if (b.action == TraceAction::kSegmentFree || b.action == TraceAction::kSegmentUnmap) {
        reserved -= static_cast<std::int64_t>(b.size);
      }
    }
    std::int64_t total = 0;
    for (const SnapshotSegment& seg : s.segments) {
      total += static_cast<std::int64_t>(seg.total_size);
      // Blocks tile their segment, as PyTorch's viewer requires.
      std::size_t sum = 0;
      for (const SnapshotBlock& b : seg.blocks) {
        EXPECT_EQ(b.address, seg.address + sum);
        sum += b.size;
      }
      EXPECT_EQ(sum, seg.total_size);
    }
    EXPECT_EQ(total, reserved);
    EXPECT_EQ(s.allocator_settings.roundup_power2_divisions.size(), 16u);
    EXPECT_EQ(s.allocator_settings.expandable_segments,
              std::string(stem).find("expandable") != std::string::npos);
    EXPECT_FALSE(s.external_annotations.empty());
    EXPECT_TRUE(trace_records(s, 1).empty());
  }
}

TEST(SharedSnapshots, FramesAreReadAndShared) {
  REQUIRE_TRACES();
  const std::string path = kTraces + "/resnet50_train.frames.pickle.gz";
  if (!fs::exists(path)) GTEST_SKIP() << path;
  const Snapshot s = read_snapshot(path);
  ASSERT_EQ(s.device_traces.size(), 1u);
  const auto& trace = s.device_traces[0];
  std::set<const void*> distinct;
  std::size_t with_frames = 0;
  for (const SnapshotTraceEntry& e : trace) {
    ASSERT_TRUE(e.frames);  // every entry has the key; some lists are empty
    with_frames += e.frames->empty() ? 0 : 1;
    distinct.insert(e.frames.get());
  }
  EXPECT_EQ(with_frames, 7721u);
  const Frame& f = trace[1].frames->front();
  EXPECT_EQ(f.filename, "site-packages/torch/nn/modules/module.py");
  EXPECT_EQ(f.line, 1370);
  EXPECT_EQ(f.name, "convert");
  EXPECT_EQ(trace[1].frames->back().name, "<module>");
  // Python shares its frame lists only in part (13,683 list objects): equal stacks become
  // one Frames (64 distinct).
  EXPECT_LT(distinct.size(), 200u);
  std::size_t segments_with_frames = 0;
  for (const SnapshotSegment& seg : s.segments)
    segments_with_frames += seg.frames ? 1 : 0;
  EXPECT_GT(segments_with_frames, 0u);
  // Written back, each stack is one list in the memo: much smaller than PyTorch's file.
  const std::string ours = write_pickle(to_value(s));
  EXPECT_LT(ours.size(), read_file(path).size());
  const Snapshot again = snapshot_from_value(parse_pickle(ours, "ours"), "ours");
  expect_same_snapshot(s, again);
}

TEST(SharedSnapshots, TypedRoundTrip) {
  REQUIRE_TRACES();
  TempDir dir;
  for (const std::string& path : pickles_to_read_whole()) {
    SCOPED_TRACE(path);
    const Value v = read_value_file(path);
    const Snapshot s = snapshot_from_value(v, path);
    const Value written = to_value(s);
    const Snapshot again = snapshot_from_value(written, "to_value");
    expect_same_snapshot(s, again);
    // The Value keeps every segment and block key PyTorch wrote, with the same values.
    const Value& seg0 = v.at("segments").as_list()[0];
    const Value& out0 = written.at("segments").as_list()[0];
    for (const auto& [key, value] : seg0.as_dict()) {
      const Value* mine = out0.find(key.as_string());
      ASSERT_NE(mine, nullptr) << key.as_string();
      if (key.as_string() != "blocks" && key.as_string() != "frames") {
        EXPECT_TRUE(*mine == value) << key.as_string();
      }
    }
    EXPECT_TRUE(v.at("allocator_settings").at("roundup_power2_divisions") ==
                written.at("allocator_settings").at("roundup_power2_divisions"));
  }
  // Through files, both formats, plain and gzip.
  const Snapshot s = read_snapshot(kTraces + "/resnet50_train.pickle.gz");
  for (const std::string name : {"s.pickle", "s.pickle.gz", "s.json", "s.json.gz"}) {
    const std::string file = dir.file(name);
    write_snapshot(file, s);
    expect_same_snapshot(s, read_snapshot(file));
  }
  EXPECT_EQ(read_file(dir.file("s.json")).front(), '{');
  EXPECT_EQ(static_cast<unsigned char>(read_file(dir.file("s.pickle")).front()), 0x80);
}

// ---- schema conversion ---------------------------------------------------------------------

TEST(SnapshotSchema, ToValueWritesPyTorchKeys) {
  Snapshot s;
  auto frames = std::make_shared<const std::vector<Frame>>(
      std::vector<Frame>{{"train.py", 12, "step"}, {"main.py", 3, "<module>"}});
  SnapshotSegment seg;
  seg.address = 0x7f0000000000;
  seg.total_size = 2 << 20;
  seg.allocated_size = 512;
  seg.active_size = 512;
  seg.requested_size = 500;
  seg.stream = 0xffffffffffffffffULL;  // cudaStream_t bits, as PyTorch casts them
  seg.is_small = true;
  seg.pool_id = {1, 2};
  seg.frames = frames;
  seg.blocks.push_back({seg.address, 512, 500, BlockState::kActiveAllocated, frames});
  seg.blocks.push_back({seg.address + 512, (2 << 20) - 512, 0, BlockState::kInactive, nullptr});
  seg.pieces = {{5, 1, 1}};  // the stitching policy's: piece 1 of handle 5
  s.segments.push_back(seg);
  PhysicalMemory& phys = s.physical.emplace_back();
  phys.device = 1;
  phys.piece_size = 2 << 20;
  phys.handles = {{5, 3, true}};
  phys.spare = {{5, 2, 1}};
  phys.ranges.push_back({seg.address - (2 << 20), 64 << 20, 4 << 20, seg.stream, true,
                         {{seg.address - (2 << 20), {5, 0, 1}}}});
  s.device_traces.resize(2);
  s.device_traces[1].push_back({TraceAction::kAlloc, seg.address, 500, 0, 1000, frames, "meta"});
  s.device_traces[1].push_back({TraceAction::kOom, 12345, 1 << 30, 0, 1001, nullptr, ""});
  s.allocator_settings.roundup_power2_divisions.assign(16, 0);
  s.allocator_settings.roundup_power2_divisions[15] = 8;
  s.external_annotations.push_back({"fwd", "START", 1, 999});

  const Value v = to_value(s);
  const Value& sv = v.at("segments").as_list()[0];
  EXPECT_EQ(sv.at("segment_type").as_string(), "small");
  EXPECT_TRUE(sv.at("segment_pool_id") == Value::tuple({1, 2}));
  EXPECT_EQ(sv.at("stream").as_int(), -1);
  EXPECT_EQ(sv.at("blocks").as_list()[0].at("state").as_string(), "active_allocated");
  EXPECT_TRUE(sv.at("blocks").as_list()[1].at("frames") == Value::list());
  const List& trace = v.at("device_traces").as_list()[1].as_list();
  EXPECT_EQ(trace[0].at("user_metadata").as_string(), "meta");
  EXPECT_EQ(trace[0].at("frames").identity(), sv.at("frames").identity());
  EXPECT_EQ(trace[1].at("device_free").as_int(), 12345);
  EXPECT_EQ(trace[1].find("addr"), nullptr);
  EXPECT_EQ(trace[1].find("frames"), nullptr);
  EXPECT_EQ(trace[1].find("user_metadata"), nullptr);
  EXPECT_EQ(v.at("allocator_settings").at("roundup_power2_divisions").at("32768").as_int(), 8);
  EXPECT_TRUE(v.at("external_annotations").as_list()[0] ==
              Value::dict({{"stage", "START"}, {"name", "fwd"}, {"device", 1}, {"time_us", 999}}));
  EXPECT_TRUE(sv.at("pieces") ==
              Value::list({Value::dict({{"handle", 5}, {"piece", 1}, {"count", 1}})}));
  const Value& pv = v.at("physical_memory").as_list()[0];
  EXPECT_EQ(pv.at("device").as_int(), 1);
  EXPECT_TRUE(pv.at("handles") ==
              Value::list({Value::dict({{"handle", 5}, {"pieces", 3}, {"segment_type", "small"}})}));
  EXPECT_EQ(pv.at("ranges").as_list()[0].at("stream").as_int(), -1);
  const Snapshot back = snapshot_from_value(parse_pickle(write_pickle(v), "x"), "x");
  expect_same_snapshot(s, back);
  EXPECT_EQ(back.device_traces[1][0].frames.get(), back.segments[0].frames.get());
  EXPECT_EQ(back.segments[0].stream, seg.stream);
}

TEST(SnapshotSchema, FromValueIsTolerantAndPrecise) {
  // A bare list of segments, with optional keys left out: block addresses and segment
  // sums follow from the blocks.
  const Value bare = Value::list({Value::dict({
      {"address", 4096},
      {"total_size", 300},
      {"stream", Value()},
      {"blocks",
       Value::list(
           {Value::dict({{"size", 100}, {"state", "active_allocated"}}),
            Value::dict({{"size", 50}, {"requested_size", 40}, {"state", "active_awaiting_free"}}),
            Value::dict({{"size", 150}, {"state", "inactive"}})})},
  })});
  const Snapshot s = snapshot_from_value(bare, "bare");
  ASSERT_EQ(s.segments.size(), 1u);
  const SnapshotSegment& seg = s.segments[0];
  EXPECT_EQ(seg.blocks[1].address, 4196u);
  EXPECT_EQ(seg.blocks[2].address, 4246u);
  EXPECT_EQ(seg.blocks[1].state, BlockState::kActivePendingFree);
  EXPECT_EQ(seg.allocated_size, 100u);
  EXPECT_EQ(seg.active_size, 150u);
  EXPECT_EQ(seg.requested_size, 140u);
  EXPECT_FALSE(seg.is_small);
  EXPECT_TRUE(s.device_traces.empty());

  const auto err = [](const Value& v) {
    return message_of<FormatError>([&] { snapshot_from_value(v, "f"); });
  };
  EXPECT_EQ(err(Value(3)), "f: a snapshot is a dict (or a list of segments), got a int");
  EXPECT_EQ(err(Value::dict({{"x", 1}})),
            "f: not a memory snapshot: it has neither 'segments' nor 'device_traces'");
  EXPECT_EQ(err(Value::list({Value::dict({{"address", 1}})})),
            "f: segments[0]: missing key 'total_size'");
  EXPECT_EQ(err(Value::list({Value::dict({{"address", -1}, {"total_size", 1}})})),
            "f: segments[0]: 'address' is negative (-1)");
  EXPECT_EQ(err(Value::list(
                {Value::dict({{"address", 1}, {"total_size", 1}, {"segment_type", "huge"}})})),
            "f: segments[0]: 'segment_type' is 'huge', expected 'small' or 'large'");
  EXPECT_EQ(err(Value::list({Value::dict(
                {{"address", 1},
                 {"total_size", 1},
                 {"blocks", Value::list({Value::dict({{"size", 1}, {"state", "gone"}})})}})})),
            "f: segments[0]: blocks[0]: 'state' is 'gone', expected 'active_allocated', "
            "'active_pending_free' or 'inactive'");
  const auto trace = [](Value entry) {
    return Value::dict({{"device_traces", Value::list({Value::list({std::move(entry)})})}});
  };
  EXPECT_EQ(err(trace(Value::dict({{"action", "explode"}}))),
            "f: device_traces[0][0]: unknown action 'explode'");
  EXPECT_EQ(err(trace(Value::dict({{"action", "alloc"}, {"addr", "0x10"}, {"size", 1}}))),
            "f: device_traces[0][0]: 'addr' is a str, expected an int");
  EXPECT_EQ(err(trace(Value::dict(
                {{"action", "alloc"}, {"addr", 1}, {"size", 1}, {"frames", Value::list({3})}}))),
            "f: device_traces[0][0]: frames[0]: a frame is a int, expected a dict");
  // Optional keys of trace entries; `annotate` entries are not allocator events.
  const Snapshot t = snapshot_from_value(
      Value::dict(
          {{"device_traces",
            Value::list({Value::list(
                {Value::dict({{"action", "annotate"}}),
                 Value::dict(
                     {{"action", "snapshot"}, {"addr", 0}, {"size", 5}, {"stream", Value()}}),
                 Value::dict({{"action", "oom"},
                              {"device_free", 7},
                              {"size", 9},
                              {"frames", Value::list()}})})})}}),
      "t");
  ASSERT_EQ(t.device_traces[0].size(), 2u);
  EXPECT_EQ(t.device_traces[0][0].action, TraceAction::kSnapshot);
  EXPECT_FALSE(t.device_traces[0][0].frames);
  EXPECT_EQ(t.device_traces[0][1].addr, 7u);
  ASSERT_TRUE(t.device_traces[0][1].frames);  // present but empty: kept
  EXPECT_TRUE(t.device_traces[0][1].frames->empty());
}

TEST(SnapshotFiles, DetectsTheFormatFromTheContent) {
  TempDir dir;
  const Value v = Value::dict({{"segments", Value::list()}, {"device_traces", Value::list()}});
  write_file(dir.file("a.bin"), "\n  " + write_json(v));
  write_file(dir.file("b.dat.gz"), write_pickle(v));
  EXPECT_TRUE(read_value_file(dir.file("a.bin")) == v);
  EXPECT_TRUE(read_value_file(dir.file("b.dat.gz")) == v);
  write_file(dir.file("c.txt"), "hello");
  EXPECT_EQ(
      message_of<FormatError>([&] { read_value_file(dir.file("c.txt")); }),
      dir.file("c.txt") + ": byte 0: neither a pickle (byte 0x80) nor JSON ('{' or '['): got 0x68");
  write_file(dir.file("d.txt"), "  ");
  EXPECT_CONTAINS(message_of<FormatError>([&] { read_value_file(dir.file("d.txt")); }),
                  "empty file");
  write_file(dir.file("e.pickle"), "\x80\x02]");
  EXPECT_EQ(
      message_of<FormatError>([&] { read_value_file(dir.file("e.pickle")); }),
      dir.file("e.pickle") + ": byte 3: the data ends without a STOP opcode (truncated pickle?)");
  EXPECT_EQ(format_for_path("x.json.gz"), SnapshotFormat::kJson);
  EXPECT_EQ(format_for_path("x.json"), SnapshotFormat::kJson);
  EXPECT_EQ(format_for_path("x.pickle"), SnapshotFormat::kPickle);
  EXPECT_EQ(format_for_path("x.json.bak"), SnapshotFormat::kPickle);
}

// ---- writing a large snapshot --------------------------------------------------------------

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CCALLOC_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define CCALLOC_TEST_SANITIZED 1
#endif
#endif
#ifndef CCALLOC_TEST_SANITIZED
#define CCALLOC_TEST_SANITIZED 0
#endif

double thread_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

TEST(SnapshotFiles, WritesAMillionEntriesQuickly) {
  // The sanitizer builds (CCALLOC_TEST_SCALE below 1), which check no budget, write a tenth.
  const int count = ccalloc_test::test_scale() < 1.0 ? 100000 : 1000000;
  const Value frames =
      Value::list({Value::dict({{"filename", "train.py"}, {"line", 42}, {"name", "step"}}),
                   Value::dict({{"filename", "main.py"}, {"line", 7}, {"name", "<module>"}})});
  const char* actions[] = {"alloc", "free_requested", "free_completed"};
  List entries;
  entries.reserve(count);
  for (int i = 0; i < count; ++i) {
    entries.push_back(Value::dict({
        {"action", actions[i % 3]},
        {"addr", std::int64_t{140344700174336} + (i / 3) * 512},
        {"size", 512 + (i % 977) * 1024},
        {"stream", 0},
        {"time_us", std::int64_t{1795311884650060} + i * 3},
        {"frames", frames},
    }));
  }
  const Value v = Value::dict({{"segments", Value::list()},
                               {"device_traces", Value::list({Value::list(std::move(entries))})}});
  TempDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = thread_cpu_seconds();
  const std::string bytes = write_pickle(v);
  const auto t1 = std::chrono::steady_clock::now();
  write_file(dir.file("big.pickle.gz"), bytes);
  const auto t2 = std::chrono::steady_clock::now();
  const double cpu_s = thread_cpu_seconds() - c0;
  const double pickle_s = std::chrono::duration<double>(t1 - t0).count();
  const double gzip_s = std::chrono::duration<double>(t2 - t1).count();
  std::printf(
      "write_pickle of %d entries: %.3f s (%.1f MB); gzip + write: %.3f s (%.1f MB); total "
      "%.3f s wall, %.3f s CPU\n",
      count, pickle_s, static_cast<double>(bytes.size()) / 1e6, gzip_s,
      static_cast<double>(fs::file_size(dir.file("big.pickle.gz"))) / 1e6, pickle_s + gzip_s,
      cpu_s);
  RecordProperty("write_pickle_s", std::to_string(pickle_s));
  RecordProperty("gzip_write_s", std::to_string(gzip_s));
  EXPECT_EQ(bytes.find("train.py"), bytes.rfind("train.py"));  // the shared stack once
  // The budget is 2 s. Measured in CPU time, so a loaded machine (ctest -j) does not make
  // it flaky; sanitizer and unoptimized builds are exempt.
#if defined(NDEBUG) && !CCALLOC_TEST_SANITIZED
  EXPECT_LT(cpu_s, 2.0);
#endif
  const Value back = parse_pickle(bytes, "big");
  EXPECT_EQ(back.at("device_traces").as_list()[0].as_list().size(),
            static_cast<std::size_t>(count));
}

// ---- RMM logs ------------------------------------------------------------------------------

constexpr std::int64_t kUs = 1000000;

TEST(RmmLog, ParsesRmmOutput) {
  const std::string log =
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "140234,11:02:03.123456,allocate,0x7f5a40000000,1024,0x0\n"
      "140234,11:02:03.1235,allocate,0x7f5a40000400,2048,0x5591a0\r\n"
      "\n"
      "140235,11:02:03.200000,free,0x7f5a40000000,1024,0x0\n"
      "140235,11:02:04.000001,allocate failure,0x0,1099511627776,0x0\n"
      "140235,23:59:59.999999,allocate,4096,1,7\n"
      "140235,00:00:00.000001,deallocate,4096,1,7\n";
  const std::vector<TraceRecord> r = parse_rmm_log(log, "rmm.csv");
  ASSERT_EQ(r.size(), 8u);
  const std::int64_t t = (11 * 3600 + 2 * 60 + 3) * kUs;
  const auto check = [&](std::size_t i, TraceAction a, DevicePtr addr, std::size_t size,
                         StreamId stream, std::int64_t time, std::size_t line) {
    SCOPED_TRACE(i);
    EXPECT_EQ(r[i].entry.action, a);
    EXPECT_EQ(r[i].entry.addr, addr);
    EXPECT_EQ(r[i].entry.size, size);
    EXPECT_EQ(r[i].entry.stream, stream);
    EXPECT_EQ(r[i].entry.time_us, time);
    EXPECT_EQ(r[i].line, line);
  };
  check(0, TraceAction::kAlloc, 0x7f5a40000000, 1024, 0, t + 123456, 2);
  check(1, TraceAction::kAlloc, 0x7f5a40000400, 2048, 0x5591a0, t + 123500, 3);
  check(2, TraceAction::kFreeRequested, 0x7f5a40000000, 1024, 0, t + 200000, 5);
  check(3, TraceAction::kFreeCompleted, 0x7f5a40000000, 1024, 0, t + 200000, 5);
  check(4, TraceAction::kOom, 0, 1099511627776, 0, t + kUs + 1, 6);
  check(5, TraceAction::kAlloc, 4096, 1, 7, 86400 * kUs - 1, 7);
  // Past midnight, the clock keeps counting up.
  check(6, TraceAction::kFreeRequested, 4096, 1, 7, 86400 * kUs + 1, 8);
  // Seconds (as RMM's docs show) and a header in another order, with an extra column.
  const std::vector<TraceRecord> s =
      parse_rmm_log("Action,Size,Pointer,Extra,Time\nallocate,5,0x10,x,1634567890.5\n", "b");
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].entry.time_us, 1634567890 * kUs + 500000);
  EXPECT_EQ(s[0].entry.addr, 0x10u);
  EXPECT_EQ(s[0].entry.stream, 0u);
}

TEST(RmmLog, RoundTrip) {
  const std::vector<TraceEntry> entries = {
      {TraceAction::kSegmentAlloc, 0x1000, 1 << 20, 0, 5000},  // not in the RMM format
      {TraceAction::kAlloc, 0x1000, 512, 0, 5000},
      {TraceAction::kAlloc, 0x1200, 100, 3, 5001},
      {TraceAction::kFreeRequested, 0x1000, 512, 0, 5002},
      {TraceAction::kFreeCompleted, 0x1000, 512, 0, 5002},
      {TraceAction::kOom, 777, 1 << 30, 3, 6003},
      {TraceAction::kAlloc, 0x1200, 100, 3, 1000},  // an earlier clock reading
  };
  // The extremes of a 64-bit microsecond count read back.
  const std::vector<TraceEntry> extremes = {
      {TraceAction::kAlloc, 1, 1, 0, 0},
      {TraceAction::kAlloc, 2, 1, 0, std::numeric_limits<std::int64_t>::min()},
      {TraceAction::kAlloc, 3, 1, 0, std::numeric_limits<std::int64_t>::max()},
  };
  const std::vector<TraceRecord> ext = parse_rmm_log(format_rmm_log(extremes), "ext");
  ASSERT_EQ(ext.size(), 3u);
  EXPECT_EQ(ext[1].entry.time_us, std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(ext[2].entry.time_us, std::numeric_limits<std::int64_t>::max());
  const std::string text = format_rmm_log(entries);
  EXPECT_EQ(text,
            "Thread,Time,Action,Pointer,Size,Stream\n"
            "0,0.000000,allocate,0x1000,512,0x0\n"
            "0,0.000001,allocate,0x1200,100,0x3\n"
            "0,0.000002,free,0x1000,512,0x0\n"
            "0,0.001003,allocate failure,0x0,1073741824,0x3\n"
            "0,-0.004000,allocate,0x1200,100,0x3\n");
  const std::vector<TraceRecord> back = parse_rmm_log(text, "rt");
  const std::vector<TraceEntry> expected = {
      {TraceAction::kAlloc, 0x1000, 512, 0, 0},
      {TraceAction::kAlloc, 0x1200, 100, 3, 1},
      {TraceAction::kFreeRequested, 0x1000, 512, 0, 2},
      {TraceAction::kFreeCompleted, 0x1000, 512, 0, 2},
      {TraceAction::kOom, 0, 1 << 30, 3, 1003},
      {TraceAction::kAlloc, 0x1200, 100, 3, -4000},
  };
  ASSERT_EQ(back.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const TraceEntry& a = back[i].entry;
    const TraceEntry& b = expected[i];
    EXPECT_TRUE(a.action == b.action && a.addr == b.addr && a.size == b.size &&
                a.stream == b.stream && a.time_us == b.time_us)
        << "entry " << i;
  }
  TempDir dir;
  write_file(dir.file("log.csv.gz"), text);
  EXPECT_EQ(read_rmm_log(dir.file("log.csv.gz")).size(), expected.size());
}

TEST(RmmLog, ErrorsNameTheLine) {
  const std::string header = "Thread,Time,Action,Pointer,Size,Stream\n";
  const auto err = [](const std::string& text) {
    return message_of<FormatError>([&] { parse_rmm_log(text, "rmm.csv"); });
  };
  EXPECT_EQ(err(header + "1,00:00:01.0,allocate,0x10,1,0x0\n1,00:00:01.0,reallocate,0x10,1,0x0\n"),
            "rmm.csv:3: unknown action 'reallocate' (expected 'allocate', 'free' or 'allocate "
            "failure')");
  EXPECT_EQ(err("Thread,Time,Action,Stream\n"),
            "rmm.csv:1: the header has no 'Pointer', 'Size' column (got "
            "'Thread,Time,Action,Stream', expected RMM's header "
            "'Thread,Time,Action,Pointer,Size,Stream')");
  EXPECT_EQ(err(header + "1,00:00:01.0,allocate,0xZZ,1,0x0\n"),
            "rmm.csv:2: invalid Pointer '0xZZ' (expected a hex (0x...) or decimal integer)");
  EXPECT_EQ(err(header + "1,00:00:01.0,allocate,0x10,-1,0x0\n"),
            "rmm.csv:2: invalid Size '-1' (expected an unsigned integer)");
  EXPECT_EQ(err(header + "1,00:00:01.0,allocate,0x10,1\n"),
            "rmm.csv:2: expected 6 fields (as in the header), got 5");
  EXPECT_EQ(err(header + "1,25:61:01.0,allocate,0x10,1,0\n"),
            "rmm.csv:2: invalid Time '25:61:01.0' (expected HH:MM:SS.ffffff)");
  EXPECT_EQ(err(header + "1,noon,allocate,0x10,1,0\n"),
            "rmm.csv:2: invalid Time 'noon' (expected HH:MM:SS.ffffff or seconds)");
  EXPECT_EQ(err(header + "1,1.0,allocate,0x10,1,0x10000000000000000\n"),
            "rmm.csv:2: invalid Stream '0x10000000000000000' (out of 64-bit range)");
  EXPECT_EQ(err("\n\n"),
            "rmm.csv: empty RMM log (expected the header line "
            "'Thread,Time,Action,Pointer,Size,Stream')");
  EXPECT_EQ(err("Action,Action,Pointer,Size\n"),
            "rmm.csv:1: duplicate column 'Action' in the header");
}

// ---- streamed parsing ---------------------------------------------------------------------

// Makes every ByteInput hand out at most `cap` bytes per chunk while in scope.
class ChunkCap {
 public:
  explicit ChunkCap(std::size_t cap) { detail::test_chunk_cap = cap; }
  ~ChunkCap() { detail::test_chunk_cap = 0; }
  ChunkCap(const ChunkCap&) = delete;
  ChunkCap& operator=(const ChunkCap&) = delete;
};

TEST(StreamedParse, EverySharedPickleInTinyChunksEqualsTheWholeBufferParse) {
  REQUIRE_TRACES();
  for (const std::string& path : pickles_to_read_whole()) {
    SCOPED_TRACE(path);
    const Value whole = parse_pickle(read_file(path), path);
    for (const std::size_t cap : {std::size_t{7}, std::size_t{1}}) {
      ChunkCap tiny(cap);
      EXPECT_TRUE(read_value_file(path) == whole) << "chunks of " << cap;
    }
  }
}

TEST(StreamedParse, WrittenJsonInTinyChunksEqualsTheWholeBufferParse) {
  REQUIRE_TRACES();
  TempDir dir;
  const std::string path = dir.file("s.json.gz");
  write_snapshot(path, read_snapshot(shared_pickles().front()));
  const Value whole = parse_json(read_file(path), path);
  for (const std::size_t cap : {std::size_t{7}, std::size_t{1}}) {
    ChunkCap tiny(cap);
    EXPECT_TRUE(read_value_file(path) == whole) << "chunks of " << cap;
  }
}

TEST(StreamedParse, ErrorOffsetsAreAbsoluteInTinyChunks) {
  TempDir dir;
  write_file(dir.file("bad.json"), "{\"a\": [1, 2, tru]}");
  write_file(dir.file("bad.pickle"),
             "\x80\x02]q\x00(K\x01K\x02\xff"
             "e."s);
  ChunkCap tiny(1);
  EXPECT_EQ(message_of<FormatError>([&] { read_value_file(dir.file("bad.json")); }),
            dir.file("bad.json") + ": byte 13: invalid literal (expected 'true')");
  EXPECT_EQ(message_of<FormatError>([&] { read_value_file(dir.file("bad.pickle")); }),
            dir.file("bad.pickle") + ": byte 10: unknown pickle opcode 0xff");
}

TEST(StreamedParse, TruncatedStringNamesOffsetWhenStreamed) {
  TempDir dir;
  write_file(dir.file("short.pickle"),
             "\x80\x02X\x05\x00\x00\x00"
             "ab"s);
  ChunkCap tiny(1);
  EXPECT_EQ(message_of<FormatError>([&] { read_value_file(dir.file("short.pickle")); }),
            dir.file("short.pickle") +
                ": byte 2: BINUNICODE announces 5 bytes, but only 2 remain (truncated or "
                "corrupt pickle)");
}

TEST(StreamedParse, NestingLimitNamesOffsetAndVariable) {
  TempDir dir;
  write_file(dir.file("deep.json"), std::string(300, '[') + std::string(300, ']'));
  ChunkCap tiny(7);
  EXPECT_EQ(message_of<FormatError>([&] { read_value_file(dir.file("deep.json")); }),
            dir.file("deep.json") +
                ": byte 256: arrays and objects nested deeper than 256 levels (limit); raise "
                "it with the environment variable CCALLOC_MAX_NESTING");
}

// Collects what a streaming parse hands out, per device.
class CollectingSink final : public TraceEntrySink {
 public:
  void entry(std::size_t device, std::size_t index, Value v) override {
    if (devices.size() <= device) devices.resize(device + 1);
    EXPECT_EQ(index, devices[device].size());
    devices[device].push_back(std::move(v));
  }
  std::vector<List> devices;
};

// Streams `path` through a sink; returns the parse's result.
Value stream_file(const std::string& path, CollectingSink& sink) {
  const ReadLimits limits;
  ByteSource source(path, limits);
  ByteInput in(source, {});
  const std::unique_ptr<ValueParser> parser = value_parser(in, path, limits, &sink);
  while (parser->step()) {
  }
  return parser->result();
}

// The entries reach the sink exactly as the whole parse holds them, and the streamed
// result is the whole parse with each device's list empty.
void expect_streams_like_whole_parse(const std::string& path) {
  const Value whole = read_value_file(path);
  CollectingSink sink;
  const Value streamed = stream_file(path, sink);
  const List& devices = whole.find("device_traces")->as_list();
  ASSERT_EQ(sink.devices.size(), devices.size());
  Value expected = Value::dict();
  for (const auto& [key, value] : whole.as_dict()) {
    if (key.as_string() != "device_traces") {
      expected.mutable_dict().emplace_back(key, value);
      continue;
    }
    List empty;
    for (std::size_t d = 0; d < devices.size(); ++d) {
      EXPECT_TRUE(Value::list(List(sink.devices[d])) == devices[d]) << "device " << d;
      empty.push_back(Value::list());
    }
    expected.mutable_dict().emplace_back(key, Value::list(std::move(empty)));
  }
  EXPECT_TRUE(streamed == expected);
}

TEST(StreamedTraces, EverySharedPickleStreamsItsEntriesExactly) {
  REQUIRE_TRACES();
  for (const std::string& path : pickles_to_read_whole()) {
    SCOPED_TRACE(path);
    expect_streams_like_whole_parse(path);
  }
}

TEST(StreamedTraces, WrittenJsonAndPickleWithTwoDevicesStreamExactly) {
  REQUIRE_TRACES();
  Snapshot s = read_snapshot(shared_pickles().front());
  s.device_traces.resize(3);
  s.device_traces[2] = s.device_traces[0];
  s.device_traces[2].resize(5);
  TempDir dir;
  for (const char* name : {"two.json", "two.pickle"}) {
    SCOPED_TRACE(name);
    write_snapshot(dir.file(name), s);
    ChunkCap tiny(7);
    expect_streams_like_whole_parse(dir.file(name));
  }
}

TEST(StreamedTraces, AReferenceToAStreamedEntryIsAnError) {
  // {"device_traces": [[{}]], "x": <memo 3>}: memo 3 is the streamed entry.
  const std::string data =
      "\x80\x02}q\x00(X\x0d\x00\x00\x00"
      "device_tracesq\x01]q\x02]q\x03}q\x04"
      "a"
      "aX\x01\x00\x00\x00"
      "xh\x04u."s;
  const Value whole = parse_pickle(data, "p");
  EXPECT_EQ(whole.find("x")->as_dict().size(), 0u);
  ByteInput in(data);
  CollectingSink sink;
  const std::unique_ptr<ValueParser> parser = pickle_parser(in, "p", PickleLimits{}, &sink);
  EXPECT_EQ(message_of<FormatError>([&] {
              while (parser->step()) {
              }
            }),
            "p: byte 43: BINGET of memo index 4, an entry of device_traces: entries are "
            "streamed and not kept, so they cannot be referenced again");
}

}  // namespace
}  // namespace ccalloc::io
