// Snapshot files: the pickle and JSON readers and writers, the typed snapshot schema
// against PyTorch's own snapshots in data/traces, and the RMM log format.
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

// ---- a pickle walker, independent of the reader ------------------------------------------

struct WalkResult {
  std::set<int> opcodes;
  bool ok = true;
  std::string problem;
  std::size_t puts = 0;
  std::size_t gets = 0;
};

// Scans a pickle written by write_pickle: every opcode must be in PyTorch's viewer's set,
// every memo reference must name an index stored before, and STOP must end the data.
WalkResult walk_pickle(std::string_view d) {
  WalkResult r;
  std::set<std::uint32_t> memo;
  std::size_t i = 0;
  auto fail = [&](const std::string& why) {
    r.ok = false;
    r.problem = why + " at byte " + std::to_string(i);
    return r;
  };
  auto u = [&](std::size_t at, std::size_t n) {
    std::uint32_t v = 0;
    for (std::size_t k = 0; k < n; ++k)
      v |= std::uint32_t{static_cast<unsigned char>(d[at + k])} << (8 * k);
    return v;
  };
  while (i < d.size()) {
    const auto op = static_cast<unsigned char>(d[i]);
    r.opcodes.insert(op);
    std::size_t arg = 0;
    switch (op) {
      case 0x80:  // PROTO
        if (i != 0 || d[1] != 2) return fail("PROTO 2 must come first");
        arg = 1;
        break;
      case '}':
      case '(':
      case 'u':
      case ']':
      case 'e':
      case ')':
      case 0x85:
      case 0x86:
      case 0x87:
      case 't':
      case 0x88:
      case 0x89:
      case 'N':
        break;
      case 'X':
        arg = 4 + u(i + 1, 4);
        break;
      case 'K':
        arg = 1;
        break;
      case 'M':
        arg = 2;
        break;
      case 'J':
        arg = 4;
        break;
      case 0x8a:  // LONG1
        arg = 1 + static_cast<unsigned char>(d[i + 1]);
        break;
      case 'G':
        arg = 8;
        break;
      case 'q':
        memo.insert(u(i + 1, 1));
        ++r.puts;
        arg = 1;
        break;
      case 'r':
        memo.insert(u(i + 1, 4));
        ++r.puts;
        arg = 4;
        break;
      case 'h':
      case 'j': {
        const std::size_t n = op == 'h' ? 1 : 4;
        if (memo.count(u(i + 1, n)) == 0) return fail("memo reference to an unset index");
        ++r.gets;
        arg = n;
        break;
      }
      case '.':
        if (i + 1 != d.size()) return fail("data after STOP");
        return r;
      default:
        return fail("opcode outside the viewer's set");
    }
    i += 1 + arg;
  }
  return fail("no STOP");
}

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

// ---- small pickles -----------------------------------------------------------------------

// Written by Python 3 (pickle.dumps(obj, protocol=4)): FRAME, MEMOIZE, SHORT_BINUNICODE,
// LONG1, a shared list (the `frames` of the segment is also `ft`), a tuple holding a list.
//   shared = [{'filename': 'a.py', 'line': 3, 'name': 'f'}]
//   {'segments': [{'address': 140344700174336, 'total_size': 2097152,
//                  'segment_pool_id': (0, 0), 'is_expandable': False, 'frames': shared}],
//    'ints': [0, 1, 255, 256, 65535, 65536, -1, -129, 2**31-1, 2**31, -2**31, -2**31-1,
//             2**63-1, -2**63],
//    'f': [0.5, -1e300, 1.0], 'n': None, 't': True, 's': 'h\u00e9llo \u2603', 'e': '',
//    'ft': shared, 'tup': (1, 'x', [2], {'k': (3,)})}
const std::string kPython4 =
    "\x80\x04\x95\x55\x01\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x08\x73\x65\x67\x6d\x65\x6e"
    "\x74\x73\x94\x5d\x94\x7d\x94\x28\x8c\x07\x61\x64\x64\x72\x65\x73\x73\x94\x8a\x06\x00\x00"
    "\x00\x8c\xa4\x7f\x8c\x0a\x74\x6f\x74\x61\x6c\x5f\x73\x69\x7a\x65\x94\x4a\x00\x00\x20\x00"
    "\x8c\x0f\x73\x65\x67\x6d\x65\x6e\x74\x5f\x70\x6f\x6f\x6c\x5f\x69\x64\x94\x4b\x00\x4b\x00"
    "\x86\x94\x8c\x0d\x69\x73\x5f\x65\x78\x70\x61\x6e\x64\x61\x62\x6c\x65\x94\x89\x8c\x06\x66"
    "\x72\x61\x6d\x65\x73\x94\x5d\x94\x7d\x94\x28\x8c\x08\x66\x69\x6c\x65\x6e\x61\x6d\x65\x94"
    "\x8c\x04\x61\x2e\x70\x79\x94\x8c\x04\x6c\x69\x6e\x65\x94\x4b\x03\x8c\x04\x6e\x61\x6d\x65"
    "\x94\x8c\x01\x66\x94\x75\x61\x75\x61\x8c\x04\x69\x6e\x74\x73\x94\x5d\x94\x28\x4b\x00\x4b"
    "\x01\x4b\xff\x4d\x00\x01\x4d\xff\xff\x4a\x00\x00\x01\x00\x4a\xff\xff\xff\xff\x4a\x7f\xff"
    "\xff\xff\x4a\xff\xff\xff\x7f\x8a\x05\x00\x00\x00\x80\x00\x4a\x00\x00\x00\x80\x8a\x05\xff"
    "\xff\xff\x7f\xff\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f\x8a\x08\x00\x00\x00\x00\x00\x00"
    "\x00\x80\x65\x68\x10\x5d\x94\x28\x47\x3f\xe0\x00\x00\x00\x00\x00\x00\x47\xfe\x37\xe4\x3c"
    "\x88\x00\x75\x9c\x47\x3f\xf0\x00\x00\x00\x00\x00\x00\x65\x8c\x01\x6e\x94\x4e\x8c\x01\x74"
    "\x94\x88\x8c\x01\x73\x94\x8c\x0a\x68\xc3\xa9\x6c\x6c\x6f\x20\xe2\x98\x83\x94\x8c\x01\x65"
    "\x94\x8c\x00\x94\x8c\x02\x66\x74\x94\x68\x0a\x8c\x03\x74\x75\x70\x94\x28\x4b\x01\x8c\x01"
    "\x78\x94\x5d\x94\x4b\x02\x61\x7d\x94\x8c\x01\x6b\x94\x4b\x03\x85\x94\x73\x74\x94\x75\x2e"s;

Value python_object() {
  const Value shared =
      Value::list({Value::dict({{"filename", "a.py"}, {"line", 3}, {"name", "f"}})});
  const std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
  const std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  return Value::dict({
      {"segments", Value::list({Value::dict({
                       {"address", std::int64_t{140344700174336}},
                       {"total_size", 2097152},
                       {"segment_pool_id", Value::tuple({0, 0})},
                       {"is_expandable", false},
                       {"frames", shared},
                   })})},
      {"ints",
       Value::list({0, 1, 255, 256, 65535, 65536, -1, -129, 2147483647, std::int64_t{2147483648},
                    std::int64_t{-2147483648LL}, std::int64_t{-2147483649LL}, kMax, kMin})},
      {"f", Value::list({0.5, -1e300, 1.0})},
      {"n", Value()},
      {"t", true},
      {"s", "h\xc3\xa9llo \xe2\x98\x83"},
      {"e", ""},
      {"ft", shared},
      {"tup", Value::tuple({1, "x", Value::list({2}), Value::dict({{"k", Value::tuple({3})}})})},
  });
}

Value parse(std::string_view data, PickleLimits limits = {}) {
  return parse_pickle(data, "test.pickle", limits);
}

// ---- Value ---------------------------------------------------------------------------------

TEST(Value, AccessorsNameTheKinds) {
  EXPECT_EQ(Value(3).as_int(), 3);
  EXPECT_EQ(Value(2.5).as_number(), 2.5);
  EXPECT_EQ(Value(4).as_number(), 4.0);
  EXPECT_EQ(Value::tuple({1, 2}).as_list().size(), 2u);
  EXPECT_EQ(message_of<FormatError>([] { (void)Value("x").as_int(); }),
            "expected a int, got a str");
  EXPECT_EQ(message_of<FormatError>([] { (void)Value().as_dict(); }),
            "expected a dict, got a None");
  EXPECT_EQ(message_of<FormatError>([] { (void)Value(true).as_number(); }),
            "expected a number, got a bool");
  EXPECT_EQ(message_of<FormatError>([] { (void)Value::list().as_string(); }),
            "expected a str, got a list");
  EXPECT_EQ(message_of<FormatError>([] { (void)Value(1.5).as_list(); }),
            "expected a list, got a float");
  EXPECT_EQ(message_of<FormatError>([] {
              (void)Value::dict({{"a", 1}}).at("b");
            }),
            "missing key 'b'");
}

TEST(Value, DeepEqualityKeepsKinds) {
  EXPECT_FALSE(Value(1) == Value(1.0));
  EXPECT_FALSE(Value(1) == Value(true));
  EXPECT_FALSE(Value::list({1}) == Value::tuple({1}));
  EXPECT_TRUE(Value::list({1, "a", Value::dict({{"k", 2.5}})}) ==
              Value::list({1, "a", Value::dict({{"k", 2.5}})}));
  EXPECT_FALSE(Value::dict({{"k", 1}}) == Value::dict({{"k", 2}}));
  EXPECT_TRUE(Value(std::nan("")) == Value(std::nan("")));
  EXPECT_EQ(Value().kind_name(), "None");
}

TEST(Value, IdentityAndFind) {
  const Value a = Value::list();
  const Value b = a;
  EXPECT_NE(a.identity(), nullptr);
  EXPECT_EQ(a.identity(), b.identity());
  EXPECT_NE(a.identity(), Value::list().identity());
  EXPECT_EQ(Value(1).identity(), nullptr);
  // A repeated key takes its last value, as Python's dict and JSON.parse do.
  const Value d = Value::dict({{"k", 1}, {"k", 2}});
  ASSERT_NE(d.find("k"), nullptr);
  EXPECT_EQ(d.find("k")->as_int(), 2);
  EXPECT_EQ(d.find("x"), nullptr);
  EXPECT_EQ(Value(1).find("k"), nullptr);
}

// ---- pickle reader -------------------------------------------------------------------------

TEST(Pickle, ReadsPythonProtocol4) {
  const Value v = parse(kPython4);
  EXPECT_TRUE(v == python_object());
  // The memo's sharing survives: one list object, as in Python.
  const Value* segs = v.find("segments");
  ASSERT_NE(segs, nullptr);
  EXPECT_EQ(segs->as_list()[0].at("frames").identity(), v.at("ft").identity());
}

TEST(Pickle, ReadsProtocol5AndTrailingBytes) {
  std::string p5 = kPython4;
  p5[1] = '\x05';
  EXPECT_TRUE(parse(p5) == python_object());
  // Python's unpickler stops at STOP; what follows is not its business.
  EXPECT_TRUE(parse(kPython4 + "garbage") == python_object());
}

TEST(Pickle, ReadsTextAndOptionalOpcodes) {
  // INT, LONG, FLOAT, PUT/POP/GET, SHORT_BINSTRING, BINUNICODE8, LONG4, DUP, LIST, DICT.
  const std::string data =
      "(I42\nI01\nL-7L\nF2.5\np0\n0g0\nU\x02hi"s + "\x8d\x01\x00\x00\x00\x00\x00\x00\x00z"s +
      "\x8b\x02\x00\x00\x00\xff\x7f"s + "2" + "l" + "(K\x01K\x02" + "d" + "\x86" + ".";
  EXPECT_TRUE(parse(data) ==
              Value::tuple({Value::list({42, true, -7, 2.5, "hi", "z", 32767, 32767}),
                            Value::dict({{1, 2}})}));
  EXPECT_TRUE(parse("I00\n.") == Value(false));
}

TEST(Pickle, Long1SignExtensionAndLimits) {
  EXPECT_EQ(parse("\x8a\x00."s).as_int(), 0);
  EXPECT_EQ(parse("\x8a\x01\xff."s).as_int(), -1);
  EXPECT_EQ(parse("\x8a\x02\x00\x80."s).as_int(), -32768);
  // Longer than 8 bytes but only sign extension: still a 64-bit value.
  EXPECT_EQ(parse("\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\xff."s).as_int(), -1);
  EXPECT_EQ(parse("\x8a\x0a\x05\x00\x00\x00\x00\x00\x00\x00\x00\x00."s).as_int(), 5);
  // 2**64 - 1 and 2**63 need 9 bytes and do not fit.
  EXPECT_CONTAINS(message_of<FormatError>(
                      [] { parse("\x80\x02\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\x00."s); }),
                  "byte 2: integer too large");
  EXPECT_CONTAINS(
      message_of<FormatError>([] { parse("\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00."s); }),
      "byte 0: integer too large");
  EXPECT_CONTAINS(message_of<FormatError>(
                      [] { parse("\x8b\x10\x00\x00\x00"s + std::string(15, '\0') + "\x01."); }),
                  "byte 0: integer too large");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("L99999999999999999999L\n."); }),
                  "integer too large");
}

TEST(Pickle, EveryTruncationIsAFormatError) {
  for (std::size_t cut = 0; cut < kPython4.size(); ++cut) {
    const std::string msg =
        message_of<FormatError>([&] { parse(std::string_view(kPython4).substr(0, cut)); });
    EXPECT_CONTAINS(msg, "test.pickle: byte ") << " cut at " << cut;
  }
  const std::string written = write_pickle(python_object());
  for (std::size_t cut = 0; cut < written.size(); ++cut) {
    EXPECT_FALSE(
        message_of<FormatError>([&] { parse(std::string_view(written).substr(0, cut)); }).empty());
  }
  EXPECT_EQ(message_of<FormatError>([] { parse(""); }),
            "test.pickle: byte 0: the data ends without a STOP opcode (truncated pickle?)");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x80\x02N"); }),
                  "byte 3: the data ends without a STOP");
}

TEST(Pickle, RefusesCodeExecution) {
  // The classic: os.system('echo hi') through GLOBAL + REDUCE.
  const std::string msg = message_of<FormatError>([] { parse("cos\nsystem\n(S'echo hi'\ntR."); });
  EXPECT_EQ(msg,
            "test.pickle: byte 0: unsupported pickle opcode 0x63 ('GLOBAL'): only plain data is "
            "accepted (None, bool, int, float, str, list, tuple, dict)");
  // Protocol 4: STACK_GLOBAL.
  EXPECT_CONTAINS(
      message_of<FormatError>([] { parse("\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x93\x94."s); }),
      "byte 16: unsupported pickle opcode 0x93 ('STACK_GLOBAL')");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("N)R."); }),
                  "byte 2: unsupported pickle opcode 0x52 ('REDUCE')");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("}N}b."); }),
                  "byte 3: unsupported pickle opcode 0x62 ('BUILD')");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x80\x02)\x81."s); }), "('NEWOBJ')");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x8f."s); }), "('EMPTY_SET')");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("C\x01x."s); }), "('SHORT_BINBYTES')");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x97."s); }), "('NEXT_BUFFER')");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("Pid\n."s); }), "('PERSID')");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x82\x01."s); }), "('EXT1')");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\xff."s); }),
                  "byte 0: unknown pickle opcode 0xff");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x80\x06N."s); }),
                  "byte 0: unsupported pickle protocol 6");
}

TEST(Pickle, BoundsNesting) {
  // 300 nested lists through APPEND: the 256th APPEND makes the 257th level.
  const std::string lists = "\x80\x02"s + std::string(300, ']') + std::string(299, 'a') + ".";
  EXPECT_CONTAINS(message_of<FormatError>([&] { parse(lists); }),
                  "byte 557: containers nested deeper than 256 levels (limit)");
  const std::string ok = std::string(256, ']') + std::string(255, 'a') + ".";
  EXPECT_NO_THROW(parse(ok));
  // MARKs: the 257th is refused.
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x80\x02"s + std::string(300, '(')); }),
                  "byte 258: more than 256 nested MARKs (limit)");
  // Depth built through the memo with a flat stack: L0 = []; Li = [L(i-1)], each popped
  // after it is memoized. L16 is the 17th level: its APPEND at byte 4 + 7 * 15 + 3 fails.
  std::string chain = "]q\x00"s + "0";
  for (int i = 1; i <= 20; ++i) {
    chain += "]h" + std::string(1, static_cast<char>(i - 1)) + "a";
    chain += "q" + std::string(1, static_cast<char>(i)) + "0";
  }
  chain += "h\x14.";
  PickleLimits small;
  small.max_depth = 16;
  EXPECT_CONTAINS(message_of<FormatError>([&] { parse(chain, small); }),
                  "byte 112: containers nested deeper than 16 levels");
  small.max_depth = 21;
  EXPECT_NO_THROW(parse(chain, small));
}

TEST(Pickle, RefusesCycles) {
  // A list appended to itself, directly and through DUP.
  EXPECT_CONTAINS(message_of<FormatError>([] {
                    parse(
                        "]q\x00h\x00"
                        "a."s);
                  }),
                  "byte 5: APPEND puts a container inside itself");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("]2a."); }),
                  "APPEND puts a container inside itself");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("}q\x00K\x01h\x00s."s); }),
                  "SETITEM puts a container inside itself");
  // L1 = []; L2 = [L1]; L1.append(L2): L1 is already inside L2.
  EXPECT_CONTAINS(message_of<FormatError>([] {
                    parse(
                        "]q\x00]h\x00"
                        "aa."s);
                  }),
                  "byte 7: APPEND changes a container that is already inside another one");
}

TEST(Pickle, BoundsSharedExpansion) {
  // L0 = [], Lk = [L(k-1), L(k-1)]: 2^k values when expanded, from 8 bytes per level.
  std::string data = "]q\x00"s;
  for (int k = 1; k <= 40; ++k) {
    data += "(h" + std::string(1, static_cast<char>(k - 1)) + "h" +
            std::string(1, static_cast<char>(k - 1)) + "l" + "q" +
            std::string(1, static_cast<char>(k));
  }
  data += ".";
  PickleLimits limits;
  limits.max_items = 1 << 20;
  EXPECT_CONTAINS(message_of<FormatError>([&] { parse(data, limits); }),
                  "holds more than 1048576 values, counting each reference to a shared container");
  // Strings copied out of the memo count against the string budget.
  std::string strings = "X\x00\x04\x00\x00"s + std::string(1024, 'a') + "q\x00("s;
  for (int i = 0; i < 2000; ++i)
    strings += "h\x00"s;
  strings += "l.";
  PickleLimits budget;
  budget.max_string_bytes = 1 << 20;
  EXPECT_CONTAINS(message_of<FormatError>([&] { parse(strings, budget); }),
                  "strings total more than 1048576 bytes");
  limits = {};
  limits.max_items = 100;
  EXPECT_NO_THROW(parse("(" + std::string(200, 'N') + "l."));
  EXPECT_CONTAINS(
      message_of<FormatError>([&] { parse("(" + std::string(200, 'N') + "l.", limits); }),
      "byte 101: more than 100 values (limit)");
}

TEST(Pickle, RefusesHugeLengths) {
  EXPECT_EQ(message_of<FormatError>([] { parse("\x80\x02X\xff\xff\xff\xff"s); }),
            "test.pickle: byte 2: BINUNICODE announces 4294967295 bytes, but only 0 remain "
            "(truncated or corrupt pickle)");
  EXPECT_CONTAINS(message_of<FormatError>([] {
                    parse(
                        "\x8d\xff\xff\xff\xff\xff\xff\xff\x7f"
                        "abc."s);
                  }),
                  "byte 0: BINUNICODE8 announces 9223372036854775807 bytes, but only 4 remain");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x8b\xff\xff\xff\x7f."s); }),
                  "byte 0: LONG4 announces");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x8b\xff\xff\xff\xff."s); }),
                  "LONG4 with a negative length");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("T\xff\xff\xff\xff."s); }),
                  "BINSTRING with a negative length");
  EXPECT_CONTAINS(
      message_of<FormatError>([] { parse("\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\xff}."s); }),
      "byte 2: FRAME of 18446744073709551615 bytes");
  EXPECT_CONTAINS(message_of<FormatError>([] {
                    parse(
                        "\x8c\x05"
                        "ab"s);
                  }),
                  "byte 0: SHORT_BINUNICODE announces 5 bytes, but only 2 remain");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("J\x01\x02"s); }),
                  "byte 0: BININT needs 4 byte(s) of argument, but only 2 remain");
}

TEST(Pickle, MemoErrors) {
  EXPECT_EQ(message_of<FormatError>([] { parse("\x80\x02h\x05."s); }),
            "test.pickle: byte 2: BINGET of memo index 5, which was never stored");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("Nj\xff\xff\xff\xff."s); }),
                  "byte 1: LONG_BINGET of memo index 4294967295, which was never stored");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("g7\n."s); }), "byte 0: GET of memo index 7");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x94."s); }),
                  "byte 0: MEMOIZE needs 1 value(s) on the stack");
  PickleLimits limits;
  limits.max_memo = 10;
  EXPECT_CONTAINS(message_of<FormatError>([&] { parse("Nr\x0a\x00\x00\x00."s, limits); }),
                  "byte 1: memo index 10 exceeds the limit of 10 entries");
  // A far index is stored sparsely and still found.
  EXPECT_TRUE(parse("K\x07r\x00\x00\x00\x01"
                    "0j\x00\x00\x00\x01."s) == Value(7));
}

TEST(Pickle, StackErrors) {
  EXPECT_CONTAINS(
      message_of<FormatError>([] { parse("a."); }),
      "byte 0: APPEND needs 2 value(s) on the stack, but there are 0 (stack underflow)");
  EXPECT_CONTAINS(
      message_of<FormatError>([] { parse("N(Na."); }),
      "byte 3: APPEND needs 2 value(s) on the stack above the last MARK, but there are 1");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("Ne."); }),
                  "byte 1: APPENDS without a preceding MARK");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("(Ne."); }),
                  "byte 2: APPENDS has no list below its MARK");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("N(Ne."); }),
                  "byte 3: APPENDS needs a list below its items, got a None");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("}(NNNu."); }),
                  "byte 5: SETITEMS needs key/value pairs, got an odd number of items (3)");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("}]Ns."); }),
                  "byte 3: a list cannot be a dict key (unhashable)");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse(")Na."); }),
                  "byte 2: APPEND needs a list below its items, got a tuple");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("NN."); }),
                  "byte 2: STOP needs exactly one value on the stack, got 2");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("(N."); }),
                  "byte 2: STOP inside an unclosed MARK");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("."); }),
                  "byte 0: STOP needs exactly one value on the stack, got 0");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("0."); }), "byte 0: POP on an empty stack");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("\x86."s); }),
                  "byte 0: TUPLE2 needs 2 value(s)");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("I12x\n."); }),
                  "byte 0: INT has a malformed decimal argument");
  EXPECT_CONTAINS(message_of<FormatError>([] { parse("I12"); }),
                  "byte 0: INT has no terminating newline");
  // POP with nothing above the MARK drops the MARK, as in Python.
  EXPECT_TRUE(parse("N(0.") == Value());
  EXPECT_TRUE(parse("(NN1N.") == Value());
}

// ---- pickle writer -------------------------------------------------------------------------

TEST(PickleWriter, RoundTripsAndUsesOnlyViewerOpcodes) {
  const Value v = python_object();
  const std::string out = write_pickle(v);
  const WalkResult walk = walk_pickle(out);
  EXPECT_TRUE(walk.ok) << walk.problem;
  const std::set<int> allowed = {0x80, '}', '(', 'u', ']', 'e', ')',  0x85, 0x86,
                                 0x87, 't', 'X', 'K', 'M', 'J', 0x8a, 'G',  0x88,
                                 0x89, 'N', 'q', 'r', 'h', 'j', '.'};
  for (const int op : walk.opcodes)
    EXPECT_TRUE(allowed.count(op)) << "opcode " << op;
  const Value back = parse(out);
  EXPECT_TRUE(back == v);
  EXPECT_EQ(back.at("ft").identity(), back.at("segments").as_list()[0].at("frames").identity());
}

TEST(PickleWriter, IntEncodings) {
  const auto bytes = [](std::int64_t i) {
    const std::string s = write_pickle(Value(i));
    return s.substr(2, s.size() - 3);  // without PROTO 2 and STOP
  };
  EXPECT_EQ(bytes(0), "K\x00"s);
  EXPECT_EQ(bytes(255), "K\xff"s);
  EXPECT_EQ(bytes(256), "M\x00\x01"s);
  EXPECT_EQ(bytes(65535), "M\xff\xff"s);
  EXPECT_EQ(bytes(65536), "J\x00\x00\x01\x00"s);
  EXPECT_EQ(bytes(-1), "J\xff\xff\xff\xff"s);
  EXPECT_EQ(bytes(2147483647), "J\xff\xff\xff\x7f"s);
  EXPECT_EQ(bytes(-2147483648LL), "J\x00\x00\x00\x80"s);
  EXPECT_EQ(bytes(2147483648LL), "\x8a\x05\x00\x00\x00\x80\x00"s);  // as Python writes it
  EXPECT_EQ(bytes(-2147483649LL), "\x8a\x05\xff\xff\xff\x7f\xff"s);
  EXPECT_EQ(bytes(140344700174336LL), "\x8a\x06\x00\x00\x00\x8c\xa4\x7f"s);
  EXPECT_EQ(bytes(std::numeric_limits<std::int64_t>::max()),
            "\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f"s);
  EXPECT_EQ(bytes(std::numeric_limits<std::int64_t>::min()),
            "\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80"s);
  for (std::int64_t i :
       {std::int64_t{0}, std::int64_t{-129}, std::int64_t{1} << 40, -(std::int64_t{1} << 40),
        (std::int64_t{1} << 55) - 1, -(std::int64_t{1} << 55), std::int64_t{1} << 55}) {
    EXPECT_EQ(parse(write_pickle(Value(i))).as_int(), i);
  }
  EXPECT_EQ(write_pickle(Value(0.5)), "\x80\x02G\x3f\xe0\x00\x00\x00\x00\x00\x00."s);
}

TEST(PickleWriter, SharedContainersAndStringsAreWrittenOnce) {
  const Value frames =
      Value::list({Value::dict({{"filename", "model.py"}, {"line", 10}, {"name", "forward"}})});
  List entries;
  for (int i = 0; i < 1000; ++i) {
    entries.push_back(Value::dict({{"action", "alloc"}, {"addr", i}, {"frames", frames}}));
  }
  const std::string out = write_pickle(Value::list(std::move(entries)));
  auto count = [&](std::string_view needle) {
    std::size_t n = 0;
    for (std::size_t at = out.find(needle); at != std::string::npos; at = out.find(needle, at + 1))
      ++n;
    return n;
  };
  EXPECT_EQ(count("model.py"), 1u);
  EXPECT_EQ(count("action"), 1u);
  EXPECT_EQ(count("alloc"), 1u);
  EXPECT_LT(out.size(), 1000u * 16);
  const WalkResult walk = walk_pickle(out);
  EXPECT_TRUE(walk.ok) << walk.problem;
  const Value back = parse(out);
  const List& items = back.as_list();
  ASSERT_EQ(items.size(), 1000u);
  EXPECT_EQ(items[0].at("frames").identity(), items[999].at("frames").identity());
  // A value nested past the writer's bound is refused, not a crash.
  Value deep = Value::list();
  for (int i = 0; i < 1500; ++i)
    deep = Value::list({deep});
  EXPECT_THROW(write_pickle(deep), Error);
  EXPECT_THROW(write_json(deep), Error);
}

// ---- JSON ----------------------------------------------------------------------------------

Value json(std::string_view text, std::size_t depth = 256) {
  return parse_json(text, "test.json", depth);
}

TEST(Json, ParsesValues) {
  const Value v = json(R"( {"a": [1, -2, 2.5, 1e3, -0.0, 12345678901234567890, true, false, null],
                           "s": "q\"\\\/\b\f\n\r\t\u00e9\u2603\ud83d\ude00", "e": {}, "l": []} )");
  const List& a = v.at("a").as_list();
  EXPECT_TRUE(a[0] == Value(1));
  EXPECT_TRUE(a[1] == Value(-2));
  EXPECT_TRUE(a[2] == Value(2.5));
  EXPECT_TRUE(a[3] == Value(1000.0));
  EXPECT_TRUE(a[4].is_float());
  EXPECT_TRUE(a[5].is_float());  // beyond 64 bits: a float, as JavaScript reads it
  EXPECT_EQ(a[5].as_number(), 12345678901234567890.0);
  EXPECT_TRUE(a[6] == Value(true));
  EXPECT_TRUE(a[8].is_none());
  EXPECT_EQ(v.at("s").as_string(), "q\"\\/\b\f\n\r\t\xc3\xa9\xe2\x98\x83\xf0\x9f\x98\x80");
  EXPECT_TRUE(v.at("e").as_dict().empty());
  EXPECT_TRUE(json("\xef\xbb\xbf 7 ") == Value(7));
  EXPECT_TRUE(json("-9223372036854775808") == Value(std::numeric_limits<std::int64_t>::min()));
}

TEST(Json, WritesCompactRoundTrippingText) {
  const Value v = Value::dict({{"a", Value::tuple({1, 2.0, 0.1, -0.5, 1e300, 5e-324})},
                               {"s", "tab\there \"q\" \\ \x01 \xc3\xa9"},
                               {"n", Value()},
                               {"b", false},
                               {7, true}});
  const std::string text = write_json(v);
  EXPECT_EQ(text,
            "{\"a\":[1,2.0,0.1,-0.5,1e+300,5e-324],\"s\":\"tab\\there \\\"q\\\" \\\\ \\u0001 "
            "\xc3\xa9\",\"n\":null,\"b\":false,\"7\":true}");
  const Value back = json(text);
  const List& a = back.at("a").as_list();
  EXPECT_TRUE(a[1] == Value(2.0));
  EXPECT_TRUE(a[2] == Value(0.1));
  EXPECT_TRUE(a[5] == Value(5e-324));
  EXPECT_EQ(message_of<FormatError>([] { write_json(Value(std::nan(""))); }),
            "write_json: NaN cannot be written as JSON");
  EXPECT_CONTAINS(message_of<FormatError>([] { write_json(Value::list({HUGE_VAL})); }),
                  "an infinity");
  EXPECT_CONTAINS(message_of<FormatError>([] {
                    write_json(Value::dict({{Value::tuple({1}), 1}}));
                  }),
                  "a tuple cannot be an object key");
}

TEST(Json, Errors) {
  const std::string doc = R"({"a":[1,2.5,"x\u00e9"],"b":{"c":null,"d":true}})";
  ASSERT_NO_THROW(json(doc));
  for (std::size_t cut = 0; cut < doc.size(); ++cut) {
    EXPECT_CONTAINS(message_of<FormatError>([&] { json(std::string_view(doc).substr(0, cut)); }),
                    "test.json: byte ")
        << " cut at " << cut;
  }
  EXPECT_EQ(message_of<FormatError>([] { json(R"(["a\x"])"); }),
            "test.json: byte 4: invalid escape '\\x'");
  EXPECT_EQ(message_of<FormatError>([] { json(R"(["\u12G4"])"); }),
            "test.json: byte 6: invalid \\u escape (expected 4 hex digits)");
  EXPECT_EQ(message_of<FormatError>([] { json(R"(["\udc00"])"); }),
            "test.json: byte 2: unpaired low surrogate escape");
  EXPECT_EQ(message_of<FormatError>([] { json(R"(["\ud800x"])"); }),
            "test.json: byte 2: high surrogate escape not followed by a low surrogate");
  EXPECT_EQ(message_of<FormatError>([] { json(R"(["\ud800\u0041"])"); }),
            "test.json: byte 2: high surrogate escape not followed by a low surrogate");
  EXPECT_EQ(message_of<FormatError>([] { json("[\"a\nb\"]"); }),
            "test.json: byte 3: control character in a string (it must be escaped)");
  EXPECT_EQ(
      message_of<FormatError>([] { json(std::string(100000, '[')); }),
      "test.json: byte 256: arrays and objects nested deeper than 256 levels (limit); raise it "
      "with the environment variable CCALLOC_MAX_NESTING");
  EXPECT_NO_THROW(json(std::string(256, '[') + std::string(256, ']')));
  EXPECT_EQ(message_of<FormatError>([] { json(std::string(300, '{')); }),
            "test.json: byte 1: unexpected character '{' (expected a string key)");
  EXPECT_EQ(message_of<FormatError>([] { json("[1] x"); }),
            "test.json: byte 4: unexpected character 'x' after the JSON value");
  EXPECT_EQ(message_of<FormatError>([] { json("[01]"); }),
            "test.json: byte 1: invalid number (leading zero)");
  EXPECT_EQ(message_of<FormatError>([] { json("[1.]"); }),
            "test.json: byte 3: invalid number (expected a digit after '.')");
  EXPECT_EQ(message_of<FormatError>([] { json("[1e400]"); }),
            "test.json: byte 1: number out of the range of a double");
  EXPECT_EQ(message_of<FormatError>([] { json("[tru]"); }),
            "test.json: byte 1: invalid literal (expected 'true')");
  EXPECT_EQ(message_of<FormatError>([] { json("{\"a\" 1}"); }),
            "test.json: byte 5: unexpected character '1' (expected ':')");
  EXPECT_EQ(message_of<FormatError>([] { json("[1,]"); }),
            "test.json: byte 3: unexpected character ']' (expected a value)");
  EXPECT_EQ(message_of<FormatError>([] { json(""); }),
            "test.json: byte 0: unexpected end of input (expected a value)");
  EXPECT_EQ(message_of<FormatError>([] { json("\"abc"); }),
            "test.json: byte 0: unterminated string");
  EXPECT_EQ(message_of<FormatError>([] { json("[\x01]"); }),
            "test.json: byte 1: unexpected byte 0x01 (expected a value)");
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
  constexpr int kEntries = 1000000;
  const Value frames =
      Value::list({Value::dict({{"filename", "train.py"}, {"line", 42}, {"name", "step"}}),
                   Value::dict({{"filename", "main.py"}, {"line", 7}, {"name", "<module>"}})});
  const char* actions[] = {"alloc", "free_requested", "free_completed"};
  List entries;
  entries.reserve(kEntries);
  for (int i = 0; i < kEntries; ++i) {
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
      kEntries, pickle_s, static_cast<double>(bytes.size()) / 1e6, gzip_s,
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
            static_cast<std::size_t>(kEntries));
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
