#include "io/trace_csv.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "ccalloc/errors.hpp"
#include "ccalloc/trace.hpp"
#include "io/csv_text.hpp"
#include "io/gzip.hpp"
#include "io/trace_file.hpp"
#include "test_support.hpp"

#ifndef CCALLOC_TRACES_DIR
#error "CCALLOC_TRACES_DIR must name data/traces (set by the build)"
#endif

namespace ccalloc::io {
namespace {

namespace fs = std::filesystem;

const std::string kTraces = CCALLOC_TRACES_DIR;
const std::string kResnet = kTraces + "/resnet50_train.csv.gz";

// The bytes of a file exactly as stored, bypassing read_file's decompression.
std::string raw_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_raw(const std::string& path, std::string_view data) {
  std::ofstream out(path, std::ios::binary);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  ASSERT_TRUE(out) << path;
}

using ccalloc_test::TempDir;

// gzip bytes of `text`, made by write_file so the test needs no zlib of its own.
std::string gzip_of(const TempDir& dir, std::string_view text) {
  const std::string path = dir.file("member.gz");
  write_file(path, text);
  return raw_bytes(path);
}

// Trace-like text; the exhaustive cut and flip tests use a short one to stay fast.
std::string sample_text(int lines = 2000) {
  std::string text;
  for (int i = 0; i < lines; ++i)
    text += "alloc," + std::to_string(i * 7919) + ",512,0,0\n";
  return text;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const FormatError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no FormatError thrown";
  return {};
}

std::string csv_error(std::string_view text) {
  return message_of([&] { parse_trace_csv(text, "t.csv"); });
}

std::vector<TraceEntry> entries_of(const std::vector<TraceRecord>& records) {
  std::vector<TraceEntry> out;
  out.reserve(records.size());
  for (const TraceRecord& r : records)
    out.push_back(r.entry);
  return out;
}

void expect_entry(const TraceEntry& e, TraceAction action, DevicePtr addr, std::size_t size,
                  StreamId stream, std::int64_t time_us) {
  EXPECT_EQ(e.action, action);
  EXPECT_EQ(e.addr, addr);
  EXPECT_EQ(e.size, size);
  EXPECT_EQ(e.stream, stream);
  EXPECT_EQ(e.time_us, time_us);
}

// ---- actions ----

TEST(TraceAction, NamesArePyTorchs) {
  const std::array<std::pair<TraceAction, std::string_view>, 9> expected = {{
      {TraceAction::kAlloc, "alloc"},
      {TraceAction::kFreeRequested, "free_requested"},
      {TraceAction::kFreeCompleted, "free_completed"},
      {TraceAction::kSegmentAlloc, "segment_alloc"},
      {TraceAction::kSegmentFree, "segment_free"},
      {TraceAction::kSegmentMap, "segment_map"},
      {TraceAction::kSegmentUnmap, "segment_unmap"},
      {TraceAction::kSnapshot, "snapshot"},
      {TraceAction::kOom, "oom"},
  }};
  for (const auto& [action, name] : expected) {
    EXPECT_EQ(to_string(action), name);
    EXPECT_EQ(parse_trace_action(name), action) << name;
  }
}

TEST(TraceAction, UnknownNameIsNullopt) {
  EXPECT_EQ(parse_trace_action(""), std::nullopt);
  EXPECT_EQ(parse_trace_action("Alloc"), std::nullopt);
  EXPECT_EQ(parse_trace_action("alloc "), std::nullopt);
  EXPECT_EQ(parse_trace_action("free"), std::nullopt);
}

// ---- the shared traces ----

TEST(SharedTraces, Resnet50CountsPerAction) {
  const std::vector<TraceRecord> records = read_trace_csv(kResnet);
  std::map<TraceAction, std::size_t> counts;
  for (const TraceRecord& r : records)
    ++counts[r.entry.action];
  EXPECT_EQ(records.size(), 96313u);
  EXPECT_EQ(counts[TraceAction::kAlloc], 32067u);
  EXPECT_EQ(counts[TraceAction::kFreeRequested], 32064u);
  EXPECT_EQ(counts[TraceAction::kFreeCompleted], 32064u);
  EXPECT_EQ(counts[TraceAction::kSegmentAlloc], 118u);
  EXPECT_EQ(counts.size(), 4u);
}

TEST(SharedTraces, Resnet50FirstRowAndLineNumbers) {
  const std::vector<TraceRecord> records = read_trace_csv(kResnet);
  ASSERT_GE(records.size(), 2u);
  expect_entry(records[0].entry, TraceAction::kSegmentAlloc, 140350033231872u, 2097152u, 0,
               1795311884650060);
  EXPECT_EQ(records[0].line, 2u);
  EXPECT_EQ(records[1].line, 3u);
  EXPECT_EQ(records.back().line, 96314u);
}

TEST(SharedTraces, Resnet50RoundTripsByteForByte) {
  const std::string original = read_file(kResnet);
  EXPECT_EQ(format_trace_csv(entries_of(parse_trace_csv(original, kResnet))), original);
}

TEST(SharedTraces, AllCsvTracesParseWithTheReadmeCounts) {
  struct Expected {
    std::string stem;
    std::size_t allocs;
    std::size_t entries;
  };
  const std::vector<Expected> expected = {
      {"resnet50_train", 32067, 96313},
      {"gpt2_train_varlen", 57143, 171597},
      {"moe_train", 62272, 187187},
  };
  for (const Expected& x : expected) {
    const std::vector<TraceRecord> records = read_trace_csv(kTraces + "/" + x.stem + ".csv.gz");
    std::size_t allocs = 0;
    for (const TraceRecord& r : records)
      allocs += r.entry.action == TraceAction::kAlloc;
    EXPECT_EQ(records.size(), x.entries) << x.stem;
    EXPECT_EQ(allocs, x.allocs) << x.stem;
  }
}

// ---- gzip ----

TEST(Gzip, WriteReadRoundTripCompressed) {
  TempDir dir;
  const std::string path = dir.file("t.csv.gz");
  const std::string text = sample_text();
  write_file(path, text);
  const std::string stored = raw_bytes(path);
  ASSERT_GE(stored.size(), 2u);
  EXPECT_EQ(static_cast<unsigned char>(stored[0]), 0x1f);
  EXPECT_EQ(static_cast<unsigned char>(stored[1]), 0x8b);
  EXPECT_LT(stored.size(), text.size());
  EXPECT_EQ(read_file(path), text);
}

TEST(Gzip, WriteReadRoundTripPlain) {
  TempDir dir;
  const std::string path = dir.file("t.csv");
  const std::string text = sample_text();
  write_file(path, text);
  EXPECT_EQ(raw_bytes(path), text);
  EXPECT_EQ(read_file(path), text);
}

TEST(Gzip, EmptyDataRoundTrips) {
  TempDir dir;
  write_file(dir.file("e.gz"), "");
  write_file(dir.file("e.txt"), "");
  EXPECT_EQ(read_file(dir.file("e.gz")), "");
  EXPECT_EQ(read_file(dir.file("e.txt")), "");
}

TEST(Gzip, DetectsGzipByContentNotName) {
  TempDir dir;
  const std::string path = dir.file("no_suffix.csv");
  write_raw(path, gzip_of(dir, "hello"));
  EXPECT_EQ(read_file(path), "hello");
}

TEST(Gzip, ConcatenatedMembers) {
  TempDir dir;
  const std::string a = gzip_of(dir, "hello ");
  const std::string b = gzip_of(dir, "world");
  const std::string c = gzip_of(dir, "");
  EXPECT_EQ(gunzip(a + b, "m.gz"), "hello world");
  EXPECT_EQ(gunzip(a + c + b + a, "m.gz"), "hello worldhello ");
  const std::string path = dir.file("cat.gz");
  write_raw(path, a + b);
  EXPECT_EQ(read_file(path), "hello world");
}

TEST(Gzip, TruncatedStreamThrowsFormatErrorAtEveryCut) {
  TempDir dir;
  const std::string full = gzip_of(dir, sample_text(300));
  for (std::size_t cut = 0; cut < full.size(); ++cut) {
    EXPECT_THROW(gunzip(std::string_view(full).substr(0, cut), "cut.gz"), FormatError) << cut;
  }
}

TEST(Gzip, TruncatedRealTraceNamesFileAndOffset) {
  TempDir dir;
  const std::string full = raw_bytes(kResnet);
  for (const std::size_t cut :
       {std::size_t{2}, std::size_t{10}, full.size() / 2, full.size() - 8, full.size() - 1}) {
    const std::string path = dir.file("cut.csv.gz");
    write_raw(path, std::string_view(full).substr(0, cut));
    const std::string msg = message_of([&] { read_file(path); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("truncated gzip stream"), std::string::npos) << msg;
    EXPECT_NE(msg.find("byte " + std::to_string(cut)), std::string::npos) << msg;
  }
}

TEST(Gzip, CorruptByteThrowsFormatErrorWithOffset) {
  TempDir dir;
  std::string data = gzip_of(dir, sample_text());
  // Byte 3 is FLG: setting reserved bits must be rejected by the header check.
  data[3] = static_cast<char>(0xe0);
  const std::string msg = message_of([&] { gunzip(data, "bad.gz"); });
  EXPECT_NE(msg.find("bad.gz: corrupt gzip stream at compressed byte offset "), std::string::npos)
      << msg;
}

TEST(Gzip, CorruptCrcThrowsFormatError) {
  TempDir dir;
  std::string data = gzip_of(dir, sample_text());
  // The trailer is CRC32 then ISIZE; a changed CRC fails the data check.
  data[data.size() - 8] = static_cast<char>(data[data.size() - 8] ^ 0x01);
  const std::string msg = message_of([&] { gunzip(data, "crc.gz"); });
  EXPECT_NE(msg.find("crc.gz: corrupt gzip stream"), std::string::npos) << msg;
}

TEST(Gzip, EveryFlippedByteFailsCleanlyOrDecodesTheSameText) {
  TempDir dir;
  const std::string text = sample_text(300);
  const std::string good = gzip_of(dir, text);
  for (std::size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    try {
      // Some header bytes (MTIME, XFL, OS) do not affect the data.
      EXPECT_EQ(gunzip(bad, "flip.gz"), text) << i;
    } catch (const FormatError&) {
    }
  }
}

TEST(Gzip, TrailingGarbageAfterMemberThrows) {
  TempDir dir;
  EXPECT_THROW(gunzip(gzip_of(dir, "x") + "garbage", "g.gz"), FormatError);
  EXPECT_THROW(gunzip(gzip_of(dir, "x") + std::string(8, '\0'), "g.gz"), FormatError);
}

TEST(Gzip, NotGzipDataThrowsFromGunzip) {
  EXPECT_THROW(gunzip("", "x.gz"), FormatError);
  EXPECT_THROW(gunzip("\x1f", "x.gz"), FormatError);
  EXPECT_THROW(gunzip("plain text", "x.gz"), FormatError);
}

TEST(Gzip, MaxBytesLimitOnDecompressedOutput) {
  TempDir dir;
  const std::string text = sample_text();
  const std::string data = gzip_of(dir, text);
  EXPECT_EQ(gunzip(data, "lim.gz", text.size()), text);
  const std::string msg = message_of([&] { gunzip(data, "lim.gz", text.size() - 1); });
  EXPECT_NE(msg.find("lim.gz: "), std::string::npos) << msg;
  EXPECT_NE(msg.find("exceeds the limit of " + std::to_string(text.size() - 1) + " bytes"),
            std::string::npos)
      << msg;
}

// Every chunk in order: the whole decompressed data.
std::string drain(ByteSource& source) {
  std::string out;
  for (std::string_view c = source.next(); !c.empty(); c = source.next())
    out.append(c);
  return out;
}

TEST(ByteSource, ChunksOfAGzipFileAddUpToItsData) {
  ByteSource source(kResnet, ReadLimits{});
  EXPECT_TRUE(source.compressed());
  const std::string data = drain(source);
  EXPECT_EQ(data, read_file(kResnet));
  EXPECT_EQ(source.offset(), data.size());
}

TEST(ByteSource, ConcatenatedMembersReadAsOne) {
  TempDir dir;
  const std::string path = dir.file("two.gz");
  write_raw(path, gzip_of(dir, "abc\n") + gzip_of(dir, "def\n"));
  ByteSource source(path, ReadLimits{});
  EXPECT_EQ(drain(source), "abc\ndef\n");
}

TEST(ByteSource, TruncatedStreamNamesTheCompressedSize) {
  TempDir dir;
  const std::string path = dir.file("cut.gz");
  const std::string gz = gzip_of(dir, sample_text());
  write_raw(path, gz.substr(0, gz.size() / 2));
  ByteSource source(path, ReadLimits{});
  EXPECT_EQ(message_of([&] { drain(source); }),
            path + ": truncated gzip stream: the compressed data ends at byte " +
                std::to_string(gz.size() / 2) + " before the end of the stream");
}

TEST(ByteSource, DataLimitNamesTheVariable) {
  TempDir dir;
  const std::string path = dir.file("big.csv.gz");
  write_file(path, sample_text());
  ReadLimits limits;
  limits.max_data_bytes = 1000;
  ByteSource source(path, limits);
  EXPECT_EQ(message_of([&] { drain(source); }),
            path +
                ": data exceeds the limit of 1000 bytes at byte offset 1000 (limit "
                "max_data_bytes = 1000; raise it with the environment variable "
                "CCALLOC_MAX_DATA_BYTES)");
}

TEST(ByteSource, FileLimitNamesTheVariable) {
  TempDir dir;
  const std::string path = dir.file("plain.csv");
  write_file(path, sample_text());
  ReadLimits limits;
  limits.max_file_bytes = 100;
  EXPECT_EQ(message_of([&] { ByteSource source(path, limits); }),
            path +
                ": the file is larger than 100 bytes (limit max_file_bytes = 100; raise it "
                "with the environment variable CCALLOC_MAX_FILE_BYTES)");
}

// Zeros compress about 1000 to 1: past the grace amount such a ratio fails before the
// output grows further.
TEST(ByteSource, AbsurdCompressionRatioFailsEarly) {
  TempDir dir;
  const std::string path = dir.file("zeros.gz");
  write_file(path, std::string(kRatioGraceBytes + (std::uint64_t{8} << 20), '\0'));
  ByteSource source(path, ReadLimits{});
  const std::string msg = message_of([&] {
    while (!source.next().empty()) {
    }
  });
  EXPECT_NE(msg.find(path + ": decompresses more than 500 times over"), std::string::npos) << msg;
  EXPECT_NE(msg.find("raise it with the environment variable CCALLOC_MAX_GZIP_RATIO"),
            std::string::npos)
      << msg;
  EXPECT_LE(source.offset(), kRatioGraceBytes + (std::uint64_t{64} << 10));
}

TEST(LineReaderLimit, LongLineFailsWithItsNumberAndOffset) {
  const std::string text = "ab\ncd\n" + std::string(50, 'x') + "\n";
  LineReader lines(text, "t.csv", 49);
  std::string_view line;
  ASSERT_TRUE(lines.next(line));
  ASSERT_TRUE(lines.next(line));
  EXPECT_EQ(lines.line_offset(), 3u);
  EXPECT_EQ(message_of([&] { lines.next(line); }),
            "t.csv:3: the line starting at byte offset 6 is longer than 49 bytes (rows of traces "
            "and RMM logs are far shorter: is this the right file?) (limit max_line_bytes = 49; "
            "raise it with the environment variable CCALLOC_MAX_LINE_BYTES)");
}

// Lines that cross chunk boundaries come out whole and in order from a streamed file.
TEST(LineReaderLimit, StreamedLinesEqualTheLinesInMemory) {
  const std::string text = read_file(kResnet);
  ByteSource source(kResnet, ReadLimits{});
  LineReader streamed(source, source.next(), 128);
  LineReader whole(text, kResnet);
  std::string_view a;
  std::string_view b;
  std::size_t n = 0;
  while (whole.next(a)) {
    ASSERT_TRUE(streamed.next(b)) << n;
    ASSERT_EQ(a, b) << n;
    ASSERT_EQ(streamed.line_offset(), whole.line_offset()) << n;
    ++n;
  }
  EXPECT_FALSE(streamed.next(b));
  EXPECT_GT(n, 1000u);
}

TEST(TraceReaderStream, YieldsTheRecordsOfTheWholeFileParse) {
  const std::vector<TraceRecord> expected = parse_trace_csv(read_file(kResnet), kResnet);
  TraceReader reader(kResnet);
  EXPECT_EQ(reader.kind(), FileKind::kTraceCsv);
  TraceRecord r;
  std::size_t i = 0;
  while (reader.next(r)) {
    ASSERT_LT(i, expected.size());
    ASSERT_EQ(r.line, expected[i].line);
    ASSERT_EQ(r.entry.addr, expected[i].entry.addr);
    ASSERT_EQ(r.entry.size, expected[i].entry.size);
    ASSERT_EQ(r.entry.action, expected[i].entry.action);
    ++i;
  }
  EXPECT_EQ(i, expected.size());
}

TEST(TraceReaderStream, FileOfZerosFailsAtDetection) {
  TempDir dir;
  const std::string path = dir.file("zeros.gz");
  write_file(path, std::string(std::size_t{4} << 20, '\0'));
  EXPECT_EQ(message_of([&] { TraceReader reader(path); }),
            path +
                ": not a snapshot (pickle or JSON), a trace CSV (header "
                "action,addr,size,stream,time_us) or an RMM log (header "
                "Thread,Time,Action,Pointer,Size,Stream)");
}

TEST(Gzip, MaxBytesLimitOnPlainFile) {
  TempDir dir;
  const std::string path = dir.file("plain.csv");
  write_file(path, "0123456789");
  EXPECT_EQ(read_file(path, 10), "0123456789");
  const std::string msg = message_of([&] { read_file(path, 9); });
  EXPECT_NE(msg.find("exceeds the limit of 9 bytes"), std::string::npos) << msg;
}

TEST(Gzip, MaxBytesLimitOnGzipFile) {
  TempDir dir;
  const std::string path = dir.file("z.gz");
  write_file(path, std::string(1 << 20, 'a'));
  EXPECT_THROW(read_file(path, 1000), FormatError);
  EXPECT_EQ(read_file(path, 1 << 20).size(), std::size_t{1} << 20);
}

TEST(Gzip, MissingFileThrowsErrorWithPathAndReason) {
  const std::string path = "/nonexistent/ccalloc/trace.csv.gz";
  try {
    read_file(path);
    FAIL() << "no exception";
  } catch (const FormatError& e) {
    FAIL() << "a missing file is not a format error: " << e.what();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
  }
}

TEST(Gzip, WriteIntoMissingDirectoryThrowsError) {
  EXPECT_THROW(write_file("/nonexistent/ccalloc/out.csv.gz", "x"), Error);
  EXPECT_THROW(write_file("/nonexistent/ccalloc/out.csv", "x"), Error);
}

// ---- CSV parsing ----

TEST(TraceCsv, ParsesEveryFieldAndLineNumber) {
  const auto records = parse_trace_csv(
      "action,addr,size,stream,time_us\n"
      "segment_alloc,4096,2097152,7,100\n"
      "oom,123456,2097152,0,-5\n",
      "t.csv");
  ASSERT_EQ(records.size(), 2u);
  expect_entry(records[0].entry, TraceAction::kSegmentAlloc, 4096, 2097152, 7, 100);
  expect_entry(records[1].entry, TraceAction::kOom, 123456, 2097152, 0, -5);
  EXPECT_EQ(records[0].line, 2u);
  EXPECT_EQ(records[1].line, 3u);
}

TEST(TraceCsv, CrlfLineEndings) {
  const auto records = parse_trace_csv(
      "action,addr,size,stream,time_us\r\nalloc,1,2,3,4\r\nfree_requested,1,2,3,5\r\n", "t.csv");
  ASSERT_EQ(records.size(), 2u);
  expect_entry(records[0].entry, TraceAction::kAlloc, 1, 2, 3, 4);
  expect_entry(records[1].entry, TraceAction::kFreeRequested, 1, 2, 3, 5);
}

TEST(TraceCsv, FinalLineWithoutNewline) {
  const auto records = parse_trace_csv("action,addr,size,stream,time_us\nalloc,1,2,3,4", "t.csv");
  ASSERT_EQ(records.size(), 1u);
  expect_entry(records[0].entry, TraceAction::kAlloc, 1, 2, 3, 4);
}

TEST(TraceCsv, EmptyLinesSkippedButCounted) {
  const auto records = parse_trace_csv(
      "\naction,addr,size,stream,time_us\n\nalloc,1,2,3,4\r\n\r\n\nalloc,5,6,7,8\n\n", "t.csv");
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].line, 4u);
  EXPECT_EQ(records[1].line, 7u);
  expect_entry(records[1].entry, TraceAction::kAlloc, 5, 6, 7, 8);
}

TEST(TraceCsv, HeaderOnlyGivesNoRecords) {
  EXPECT_TRUE(parse_trace_csv("action,addr,size,stream,time_us\n", "t.csv").empty());
}

TEST(TraceCsv, ColumnsInAnyOrder) {
  const auto records =
      parse_trace_csv("time_us,size,stream,addr,action\n9,8,7,6,free_completed\n", "t.csv");
  ASSERT_EQ(records.size(), 1u);
  expect_entry(records[0].entry, TraceAction::kFreeCompleted, 6, 8, 7, 9);
}

TEST(TraceCsv, MissingOptionalColumnsReadAsZero) {
  const auto records = parse_trace_csv("size,action,addr\n64,alloc,4096\n", "t.csv");
  ASSERT_EQ(records.size(), 1u);
  expect_entry(records[0].entry, TraceAction::kAlloc, 4096, 64, 0, 0);
}

TEST(TraceCsv, UnknownColumnsIgnored) {
  const auto records = parse_trace_csv(
      "note,action,addr,size,frames,stream,time_us\nhi,alloc,1,2,x;y,3,4\n", "t.csv");
  ASSERT_EQ(records.size(), 1u);
  expect_entry(records[0].entry, TraceAction::kAlloc, 1, 2, 3, 4);
}

TEST(TraceCsv, ExtremeValues) {
  const auto records = parse_trace_csv(
      "action,addr,size,stream,time_us\n"
      "alloc,18446744073709551615,18446744073709551615,18446744073709551615,"
      "-9223372036854775808\n"
      "alloc,0,0,0,9223372036854775807\n"
      "alloc,007,010,0,-0\n",
      "t.csv");
  ASSERT_EQ(records.size(), 3u);
  expect_entry(records[0].entry, TraceAction::kAlloc, UINT64_MAX, SIZE_MAX, UINT64_MAX, INT64_MIN);
  expect_entry(records[1].entry, TraceAction::kAlloc, 0, 0, 0, INT64_MAX);
  expect_entry(records[2].entry, TraceAction::kAlloc, 7, 10, 0, 0);
}

// ---- CSV errors ----

constexpr std::string_view kHead = "action,addr,size,stream,time_us\n";

TEST(TraceCsvErrors, InvalidSizeNamesFileLineColumnAndText) {
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1,2,0,0\nalloc,1,12x,0,0\n"),
            "t.csv:3: invalid size '12x' (expected an unsigned integer)");
}

TEST(TraceCsvErrors, NegativeAddr) {
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,-1,2,0,0\n"),
            "t.csv:2: invalid addr '-1' (expected an unsigned integer)");
}

TEST(TraceCsvErrors, PlusSignAndBlanksRejected) {
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,+1,2,0,0\n"),
            "t.csv:2: invalid addr '+1' (expected an unsigned integer)");
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1, 2,0,0\n"),
            "t.csv:2: invalid size ' 2' (expected an unsigned integer)");
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1,2,0 ,0\n"),
            "t.csv:2: invalid stream '0 ' (expected an unsigned integer)");
}

TEST(TraceCsvErrors, HexAndFractionsRejected) {
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,0x10,2,0,0\n"),
            "t.csv:2: invalid addr '0x10' (expected an unsigned integer)");
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1,2,0,1.5\n"),
            "t.csv:2: invalid time_us '1.5' (expected an integer)");
}

TEST(TraceCsvErrors, EmptyField) {
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1,,0,0\n"),
            "t.csv:2: invalid size '' (expected an unsigned integer)");
}

TEST(TraceCsvErrors, UnsignedOverflow) {
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1,2,18446744073709551616,0\n"),
            "t.csv:2: invalid stream '18446744073709551616' (out of range: the largest "
            "accepted value is 18446744073709551615)");
}

TEST(TraceCsvErrors, SignedOverflow) {
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1,2,0,9223372036854775808\n"),
            "t.csv:2: invalid time_us '9223372036854775808' (out of range of a 64-bit signed "
            "integer)");
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1,2,0,-9223372036854775809\n"),
            "t.csv:2: invalid time_us '-9223372036854775809' (out of range of a 64-bit "
            "signed integer)");
}

TEST(TraceCsvErrors, TooFewFields) {
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1,2,0,0\nalloc,1,2,0\n"),
            "t.csv:3: expected 5 fields (as in the header), got 4");
}

TEST(TraceCsvErrors, TooManyFields) {
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1,2,0,0,9\n"),
            "t.csv:2: expected 5 fields (as in the header), got 6");
}

TEST(TraceCsvErrors, UnknownActionListsTheValidOnes) {
  EXPECT_EQ(csv_error(std::string(kHead) + "\nallocate,1,2,0,0\n"),
            "t.csv:3: unknown action 'allocate' (expected one of: alloc, free_requested, "
            "free_completed, segment_alloc, segment_free, segment_map, segment_unmap, "
            "snapshot, oom)");
}

TEST(TraceCsvErrors, LineNumberCountsCrlfAndBlankLines) {
  const std::string msg = csv_error("action,addr,size\r\n\r\nalloc,1,2\r\nalloc,1,z\r\n");
  EXPECT_EQ(msg, "t.csv:4: invalid size 'z' (expected an unsigned integer)");
}

TEST(TraceCsvErrors, UnprintableTextEscapedAndLongTextShortened) {
  EXPECT_EQ(csv_error(std::string(kHead) + "alloc,1,2\x01\xff,0,0\n"),
            "t.csv:2: invalid size '2\\x01\\xff' (expected an unsigned integer)");
  const std::string msg =
      csv_error(std::string(kHead) + "alloc,1," + std::string(1000, '9') + ",0,0\n");
  EXPECT_EQ(msg, "t.csv:2: invalid size '" + std::string(64, '9') +
                     "...' (out of range: the largest accepted value is 18446744073709551615)");
}

TEST(TraceCsvErrors, EmptyFile) {
  EXPECT_EQ(csv_error(""),
            "t.csv: empty trace CSV (expected the header line 'action,addr,size,stream,time_us')");
  EXPECT_EQ(csv_error("\n\r\n\n"),
            "t.csv: empty trace CSV (expected the header line 'action,addr,size,stream,time_us')");
}

TEST(TraceCsvErrors, MissingHeader) {
  EXPECT_EQ(csv_error("alloc,1,2,0,0\n"),
            "t.csv:1: the header has no 'action' column (got 'alloc,1,2,0,0', expected a "
            "header such as 'action,addr,size,stream,time_us')");
}

TEST(TraceCsvErrors, MissingRequiredColumn) {
  EXPECT_EQ(csv_error("action,addr,stream\nalloc,1,0\n"),
            "t.csv:1: the header has no 'size' column (got 'action,addr,stream', expected a "
            "header such as 'action,addr,size,stream,time_us')");
}

TEST(TraceCsvErrors, DuplicateColumn) {
  EXPECT_EQ(csv_error("action,addr,size,addr\n"), "t.csv:1: duplicate column 'addr' in the header");
}

TEST(TraceCsvErrors, ReadTraceCsvNamesThePath) {
  TempDir dir;
  const std::string path = dir.file("bad.csv.gz");
  write_file(path, std::string(kHead) + "alloc,1,2,0,0\nalloc,1,2,0,0\nalloc,1,12x,0,0\n");
  EXPECT_EQ(message_of([&] { read_trace_csv(path); }),
            path + ":4: invalid size '12x' (expected an unsigned integer)");
}

TEST(TraceCsvErrors, GarbageNeverCrashes) {
  // Every prefix of a mixed valid/invalid text: each either parses or throws FormatError.
  const std::string text = std::string(kHead) +
                           "alloc,1,2,0,0\r\n\nfree_requested,1,2,0,-3\nsegment_map,,\n,\r" +
                           std::string(1, '\0') + "\n";
  for (std::size_t n = 0; n <= text.size(); ++n) {
    try {
      parse_trace_csv(std::string_view(text).substr(0, n), "t.csv");
    } catch (const FormatError&) {
    }
  }
}

// ---- writing ----

TEST(TraceCsvWrite, HeaderAndRowExactText) {
  std::ostringstream out;
  write_trace_csv_header(out);
  write_trace_csv_row(out,
                      {TraceAction::kSegmentAlloc, 140350033231872u, 2097152, 0, 1795311884650060});
  write_trace_csv_row(out, {TraceAction::kOom, 5, 6, UINT64_MAX, -7});
  EXPECT_EQ(out.str(),
            "action,addr,size,stream,time_us\n"
            "segment_alloc,140350033231872,2097152,0,1795311884650060\n"
            "oom,5,6,18446744073709551615,-7\n");
}

TEST(TraceCsvWrite, FormatMatchesStreamedRows) {
  const std::vector<TraceEntry> entries = {
      {TraceAction::kAlloc, 1, 2, 3, 4},
      {TraceAction::kSegmentUnmap, UINT64_MAX, SIZE_MAX, UINT64_MAX, INT64_MIN},
      {TraceAction::kSnapshot, 0, 0, 0, 0},
  };
  std::ostringstream out;
  write_trace_csv_header(out);
  for (const TraceEntry& e : entries)
    write_trace_csv_row(out, e);
  EXPECT_EQ(format_trace_csv(entries), out.str());
  EXPECT_EQ(format_trace_csv({}), "action,addr,size,stream,time_us\n");
}

TEST(TraceCsvWrite, ParseOfFormatIsIdentity) {
  const std::vector<TraceEntry> entries = {
      {TraceAction::kFreeRequested, 10, 20, 30, -40},
      {TraceAction::kSegmentFree, UINT64_MAX, SIZE_MAX, UINT64_MAX, INT64_MAX},
  };
  const auto records = parse_trace_csv(format_trace_csv(entries), "rt.csv");
  ASSERT_EQ(records.size(), 2u);
  expect_entry(records[0].entry, TraceAction::kFreeRequested, 10, 20, 30, -40);
  expect_entry(records[1].entry, TraceAction::kSegmentFree, UINT64_MAX, SIZE_MAX, UINT64_MAX,
               INT64_MAX);
}

}  // namespace
}  // namespace ccalloc::io
