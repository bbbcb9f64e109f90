// The pickle reader and writer, the JSON reader and writer, and the Value they share: exact
// values, every error naming its offset, the limits that bound hostile input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "ccalloc/errors.hpp"
#include "io/json.hpp"
#include "io/pickle.hpp"
#include "pickle_walker.hpp"
#include "test_support.hpp"

namespace ccalloc::io {
namespace {

using ccalloc_test::message_of;
using ccalloc_test::WalkResult;
using ccalloc_test::walk_pickle;
using namespace std::string_literals;

#define EXPECT_CONTAINS(haystack, needle)                          \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "expected to find \"" << (needle) << "\" in \"" << (haystack) << "\""

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

}  // namespace
}  // namespace ccalloc::io
