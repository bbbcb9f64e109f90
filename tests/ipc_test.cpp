// Sharing allocations between processes (include/ccalloc/ipc.hpp) on the simulated GPU: two
// SimDrivers of one process stand for two processes on one device (their registry of
// exported handles is shared; docs/simulated-gpu.md). Contents written on one side are read
// on the other, both ways, for native and expandable segments; every malformed handle is a
// FormatError naming its problem; a handle whose memory is gone is a DriverError naming it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/ccalloc.h"
#include "ccalloc/errors.hpp"
#include "ccalloc/ipc.hpp"
#include "ccalloc/sim.hpp"

namespace {

using ccalloc::Allocator;
using ccalloc::Config;
using ccalloc::DevicePtr;
using ccalloc::DriverError;
using ccalloc::FormatError;
using ccalloc::InvalidPointerError;
using ccalloc::ShareKind;
using ccalloc::ipc::OpenedMemory;
using ccalloc::ipc::RegionKind;
using ccalloc::sim::SimDriver;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

ccalloc::sim::Options gpu_options(int device = 0, std::size_t capacity = 8 * kGiB) {
  ccalloc::sim::Options o;
  o.capacity = capacity;
  o.device = device;
  return o;
}

// A distinct byte pattern: byte i of a region seeded `seed`.
std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<unsigned char>((i * 131 + seed * 7 + i / 251) & 0xff);
  return v;
}

std::vector<unsigned char> read(const SimDriver& d, DevicePtr p, std::size_t n) {
  std::vector<unsigned char> v(n);
  d.read(p, v.data(), n);
  return v;
}

// The message of the exception `fn` throws as E ("" if it throws none).
template <typename E, typename Fn>
std::string message_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

struct Processes {
  explicit Processes(const char* conf, std::size_t capacity = 8 * kGiB)
      : exporter_gpu(gpu_options(0, capacity)), importer_gpu(gpu_options(0, capacity)),
        exporter(exporter_gpu, Config::parse(conf)) {
    exporter.set_check_invariants(true);
  }
  SimDriver exporter_gpu;
  SimDriver importer_gpu;
  Allocator exporter;
};

// Writes a pattern on the exporter's side, opens the handle on the importer's, checks both
// see the other's writes, then closes.
void check_round_trip(Processes& p, DevicePtr ptr, std::size_t size, const std::string& handle) {
  const std::vector<unsigned char> mine = pattern(size, 1);
  p.exporter_gpu.write(ptr, mine.data(), size);
  OpenedMemory m = ccalloc::ipc::open_handle(p.importer_gpu, handle);
  ASSERT_TRUE(m.is_open());
  EXPECT_EQ(m.size(), size);
  EXPECT_EQ(read(p.importer_gpu, m.ptr(), size), mine);
  const std::vector<unsigned char> theirs = pattern(size, 2);
  p.importer_gpu.write(m.ptr(), theirs.data(), size);
  EXPECT_EQ(read(p.exporter_gpu, ptr, size), theirs);
  const DevicePtr opened_at = m.ptr();
  m.close();
  EXPECT_FALSE(m.is_open());
  EXPECT_NE(message_of<DriverError>([&] { read(p.importer_gpu, opened_at, 1); }).find("not device memory"),
            std::string::npos);
}

TEST(Ipc, NativeSegmentIsSharedWholeWithTheAllocationsOffset) {
  Processes p("pytorch");
  const DevicePtr first = p.exporter.malloc(3 * kMiB);
  const DevicePtr second = p.exporter.malloc(5 * kMiB);  // same 20 MiB segment, after `first`
  const ccalloc::ipc::SharedRegion r = ccalloc::ipc::shared_region(p.exporter, second);
  EXPECT_EQ(r.kind, RegionKind::kSegment);
  EXPECT_EQ(r.base, first);
  EXPECT_EQ(r.size, 20 * kMiB);
  EXPECT_EQ(r.allocation, second);
  EXPECT_EQ(r.allocation_size, 5 * kMiB);
  EXPECT_TRUE(r.pages.empty());

  const std::string handle = ccalloc::ipc::export_handle(p.exporter, second);
  const ccalloc::ipc::HandleInfo info = ccalloc::ipc::parse_handle(handle);
  EXPECT_EQ(info.version, 1);
  EXPECT_EQ(info.kind, RegionKind::kSegment);
  EXPECT_EQ(info.device, 0);
  EXPECT_EQ(info.pid, static_cast<int>(getpid()));
  EXPECT_EQ(info.offset, second - first);
  EXPECT_EQ(info.size, 5 * kMiB);
  EXPECT_EQ(info.region_size, 20 * kMiB);
  ASSERT_EQ(info.handles.size(), 1u);
  EXPECT_EQ(info.handles[0].size(), ccalloc::kAllocationHandleBytes);
  EXPECT_EQ(handle.size(), 56 + ccalloc::kAllocationHandleBytes);

  check_round_trip(p, second, 5 * kMiB, handle);
  // The opened segment starts `offset` before the allocation.
  OpenedMemory m = ccalloc::ipc::open_handle(p.importer_gpu, handle);
  EXPECT_EQ(m.ptr() - m.region_base(), second - first);
  EXPECT_EQ(m.region_size(), 20 * kMiB);
  p.exporter.free(first);
  p.exporter.free(second);
}

TEST(Ipc, ExpandableAllocationIsSharedAsThePagesCoveringIt) {
  Processes p("pytorch,expandable_segments:True");
  const DevicePtr first = p.exporter.malloc(30 * kMiB);  // pages 0 and 1 (20 MiB each)
  const DevicePtr second = p.exporter.malloc(12 * kMiB);  // [30, 42) MiB: pages 1 and 2
  ASSERT_EQ(second, first + 30 * kMiB);
  const ccalloc::ipc::SharedRegion r = ccalloc::ipc::shared_region(p.exporter, second);
  EXPECT_EQ(r.kind, RegionKind::kPages);
  EXPECT_EQ(r.page_size, 20 * kMiB);
  EXPECT_EQ(r.base, first + 20 * kMiB);
  EXPECT_EQ(r.size, 40 * kMiB);
  ASSERT_EQ(r.pages.size(), 2u);
  const auto mapped = p.exporter_gpu.mappings_in(r.base, r.size);
  ASSERT_EQ(mapped.size(), 2u);
  EXPECT_EQ(mapped[0].handle, r.pages[0]);
  EXPECT_EQ(mapped[1].handle, r.pages[1]);

  const std::string handle = ccalloc::ipc::export_handle(p.exporter, second);
  const ccalloc::ipc::HandleInfo info = ccalloc::ipc::parse_handle(handle);
  EXPECT_EQ(info.kind, RegionKind::kPages);
  EXPECT_EQ(info.share_kind, ShareKind::kPosixFd);
  EXPECT_EQ(info.offset, 10 * kMiB);
  EXPECT_EQ(info.size, 12 * kMiB);
  EXPECT_EQ(info.region_size, 40 * kMiB);
  EXPECT_EQ(info.page_size, 20 * kMiB);
  ASSERT_EQ(info.handles.size(), 2u);
  EXPECT_EQ(info.handles[0].size(), 4u);
  EXPECT_NE(info.handles[0], info.handles[1]);
  // Exporting again gives the same descriptors (one per page, kept until it is released).
  EXPECT_EQ(ccalloc::ipc::export_handle(p.exporter, second), handle);

  check_round_trip(p, second, 12 * kMiB, handle);
  EXPECT_EQ(p.importer_gpu.imported_handles(), 0u);
  {
    OpenedMemory m = ccalloc::ipc::open_handle(p.importer_gpu, handle);
    EXPECT_EQ(p.importer_gpu.imported_handles(), 2u);
    EXPECT_EQ(m.region_size(), 40 * kMiB);
    EXPECT_EQ(m.ptr(), m.region_base() + 10 * kMiB);
    // The first allocation's tail on the shared page 1 is visible too, at the same offset.
    const std::vector<unsigned char> tail = pattern(kMiB, 3);
    p.exporter_gpu.write(first + 29 * kMiB, tail.data(), kMiB);
    EXPECT_EQ(read(p.importer_gpu, m.region_base() + 9 * kMiB, kMiB), tail);
  }  // closed by the destructor: unmapped, released, reservation freed
  EXPECT_EQ(p.importer_gpu.imported_handles(), 0u);
  const ccalloc::sim::Counters c = p.importer_gpu.counters();
  EXPECT_EQ(c.reserve_calls, c.address_frees);
  EXPECT_EQ(c.maps, c.unmaps * 2);  // one unmap call per opened region of two pages
  p.exporter.free(first);
  p.exporter.free(second);
}

TEST(Ipc, FabricHandlesAreSixtyFourBytesEach) {
  Processes p("pytorch,expandable_segments:True");
  const DevicePtr ptr = p.exporter.malloc(4 * kMiB);
  const std::string handle = ccalloc::ipc::export_handle(p.exporter, ptr, ShareKind::kFabric);
  const ccalloc::ipc::HandleInfo info = ccalloc::ipc::parse_handle(handle);
  EXPECT_EQ(info.share_kind, ShareKind::kFabric);
  ASSERT_EQ(info.handles.size(), 1u);
  EXPECT_EQ(info.handles[0].size(), 64u);
  check_round_trip(p, ptr, 4 * kMiB, handle);
  p.exporter.free(ptr);
}

// The stitching policy (the ccalloc preset): the handles mapped over the allocation, whole,
// each of its own size; a lent handle is shared where it is live now.
TEST(Ipc, StitchedAllocationIsSharedAsTheWholeHandlesMappedOverIt) {
  Processes p("ccalloc,stitch_handle_mb:64", 32 * kGiB);  // handles of up to 64 MiB
  const DevicePtr a = p.exporter.malloc(30 * kMiB);  // a handle of 30 MiB
  const DevicePtr b = p.exporter.malloc(12 * kMiB);  // a 20 MiB chunk: 8 MiB left at its end
  const DevicePtr c = p.exporter.malloc(40 * kMiB);  // those 8 MiB and a new 32 MiB handle
  ASSERT_EQ(b, a + 30 * kMiB);
  ASSERT_EQ(c, b + 12 * kMiB);
  const ccalloc::ipc::SharedRegion r = ccalloc::ipc::shared_region(p.exporter, c);
  EXPECT_EQ(r.kind, RegionKind::kHandles);
  EXPECT_EQ(r.base, b);
  EXPECT_EQ(r.size, 52 * kMiB);
  EXPECT_EQ(r.allocation, c);
  EXPECT_EQ(r.allocation_size, 40 * kMiB);
  EXPECT_EQ(r.page_sizes, (std::vector<std::size_t>{20 * kMiB, 32 * kMiB}));
  const auto mapped = p.exporter_gpu.mappings_in(r.base, r.size);
  ASSERT_EQ(mapped.size(), 2u);
  EXPECT_EQ(mapped[0].handle, r.pages[0]);
  EXPECT_EQ(mapped[1].handle, r.pages[1]);

  const std::string handle = ccalloc::ipc::export_handle(p.exporter, c);
  const ccalloc::ipc::HandleInfo info = ccalloc::ipc::parse_handle(handle);
  EXPECT_EQ(info.kind, RegionKind::kHandles);
  EXPECT_EQ(info.offset, 12 * kMiB);
  EXPECT_EQ(info.size, 40 * kMiB);
  EXPECT_EQ(info.region_size, 52 * kMiB);
  EXPECT_EQ(info.page_size, 0u);
  EXPECT_EQ(info.page_sizes, r.page_sizes);
  EXPECT_EQ(handle.size(), 56 + 2 * 8 + 2 * 4);
  check_round_trip(p, c, 40 * kMiB, handle);
  {
    OpenedMemory m = ccalloc::ipc::open_handle(p.importer_gpu, handle);
    EXPECT_EQ(p.importer_gpu.imported_handles(), 2u);
    EXPECT_EQ(m.region_size(), 52 * kMiB);
    EXPECT_EQ(m.ptr(), m.region_base() + 12 * kMiB);
  }
  EXPECT_EQ(p.importer_gpu.imported_handles(), 0u);
  const ccalloc::ipc::SharedRegion ra = ccalloc::ipc::shared_region(p.exporter, a);
  EXPECT_EQ(ra.page_sizes, std::vector<std::size_t>{30 * kMiB});
  check_round_trip(p, a, 30 * kMiB, ccalloc::ipc::export_handle(p.exporter, a));

  // Lending: freed, `a`'s handle lies wholly in a free block; a request no free block fits
  // takes it to the frontier instead of new memory.
  const DevicePtr e = p.exporter.malloc(2 * kMiB);  // a 20 MiB chunk: 18 MiB free after it
  ASSERT_EQ(e, c + 40 * kMiB);
  p.exporter.free(a);
  const ccalloc::sim::Counters before = p.exporter_gpu.counters();
  const DevicePtr d = p.exporter.malloc(40 * kMiB);  // the 18 MiB tail + a's handle
  EXPECT_EQ(p.exporter_gpu.counters().physical_creates, before.physical_creates);
  EXPECT_EQ(d, e + 2 * kMiB);
  const ccalloc::ipc::SharedRegion rd = ccalloc::ipc::shared_region(p.exporter, d);
  EXPECT_EQ(rd.page_sizes, (std::vector<std::size_t>{20 * kMiB, 30 * kMiB}));
  EXPECT_EQ(rd.pages[1], ra.pages[0]);  // the same physical memory, mapped anew
  EXPECT_EQ(rd.base, e);
  check_round_trip(p, d, 40 * kMiB, ccalloc::ipc::export_handle(p.exporter, d));
  for (const DevicePtr x : {b, c, d, e})
    p.exporter.free(x);
  EXPECT_NE(message_of<InvalidPointerError>([&] { ccalloc::ipc::shared_region(p.exporter, d); })
                .find("not"),
            std::string::npos);
}

TEST(Ipc, HandlesOfTheirOwnSizesThatDoNotAddUpAreFormatErrors) {
  Processes p("ccalloc");
  const DevicePtr a = p.exporter.malloc(30 * kMiB);
  std::string h = ccalloc::ipc::export_handle(p.exporter, a);
  h[56] = static_cast<char>(h[56] + 2);  // the first handle's size, 2 bytes more
  const std::string m =
      message_of<FormatError>([&] { ccalloc::ipc::open_handle(p.importer_gpu, h); });
  EXPECT_NE(m.find("region of 31457280"), std::string::npos) << m;
  EXPECT_EQ(p.importer_gpu.imported_handles(), 0u);
  p.exporter.free(a);
}

TEST(Ipc, SmallPoolPagesAreTwoMiB) {
  Processes p("pytorch,expandable_segments:True");
  const DevicePtr a = p.exporter.malloc(512 * 1024);
  const DevicePtr b = p.exporter.malloc(512 * 1024);
  const ccalloc::ipc::HandleInfo info =
      ccalloc::ipc::parse_handle(ccalloc::ipc::export_handle(p.exporter, b));
  EXPECT_EQ(info.page_size, 2 * kMiB);
  EXPECT_EQ(info.handles.size(), 1u);
  EXPECT_EQ(info.offset, b - a);
  check_round_trip(p, b, 512 * 1024, ccalloc::ipc::export_handle(p.exporter, b));
  p.exporter.free(a);
  p.exporter.free(b);
}

TEST(Ipc, MemoryOpenedStaysAfterTheExporterReleasesIt) {
  Processes p("pytorch,expandable_segments:True");
  const DevicePtr ptr = p.exporter.malloc(2 * kMiB);
  const std::vector<unsigned char> mine = pattern(2 * kMiB, 5);
  p.exporter_gpu.write(ptr, mine.data(), mine.size());
  OpenedMemory m = ccalloc::ipc::open_handle(p.importer_gpu, ccalloc::ipc::export_handle(p.exporter, ptr));
  p.exporter.free(ptr);
  p.exporter.empty_cache();  // the page is unmapped and released on the exporter's side
  EXPECT_TRUE(p.exporter_gpu.mappings_in(0, ~DevicePtr{0}).empty());
  EXPECT_EQ(read(p.importer_gpu, m.ptr(), mine.size()), mine);
}

TEST(Ipc, ExportOfAPointerThatIsNotLiveNamesIt) {
  Processes p("pytorch");
  const DevicePtr ptr = p.exporter.malloc(kMiB);
  const std::string interior = message_of<InvalidPointerError>(
      [&] { ccalloc::ipc::export_handle(p.exporter, ptr + 512); });
  EXPECT_NE(interior.find("sharing of pointer 0x"), std::string::npos) << interior;
  EXPECT_NE(interior.find("not a live allocation"), std::string::npos) << interior;
  p.exporter.free(ptr);
  EXPECT_FALSE(message_of<InvalidPointerError>([&] { ccalloc::ipc::export_handle(p.exporter, ptr); }).empty());
  EXPECT_FALSE(message_of<InvalidPointerError>([&] { ccalloc::ipc::export_handle(p.exporter, 0x1234); }).empty());
}

TEST(Ipc, MalformedHandlesAreFormatErrorsNamingTheProblem) {
  Processes p("pytorch,expandable_segments:True");
  const DevicePtr ptr = p.exporter.malloc(30 * kMiB);
  const std::string handle = ccalloc::ipc::export_handle(p.exporter, ptr);
  ASSERT_EQ(handle.size(), 56u + 2 * 4);
  const auto open_error = [&](const std::string& h) {
    return message_of<FormatError>([&] { ccalloc::ipc::open_handle(p.importer_gpu, h); });
  };
  EXPECT_NE(open_error(handle.substr(0, 30)).find("truncated at byte 30: the allocation size needs bytes [24, 32)"),
            std::string::npos)
      << open_error(handle.substr(0, 30));
  EXPECT_NE(open_error(handle.substr(0, 60)).find("truncated at byte 60: handle 1 needs bytes [60, 64)"),
            std::string::npos);
  EXPECT_NE(open_error("").find("truncated at byte 0: the magic"), std::string::npos);
  EXPECT_NE(open_error("hello, world, this is not a handle").find("not a ccalloc IPC handle"),
            std::string::npos);
  std::string v2 = handle;
  v2[4] = 2;
  EXPECT_NE(open_error(v2).find("IPC handle of version 2: this build reads version 1"), std::string::npos);
  std::string kind = handle;
  kind[5] = 7;
  EXPECT_NE(open_error(kind).find("region kind 7"), std::string::npos);
  std::string longer = handle + "x";
  EXPECT_NE(open_error(longer).find("1 bytes follow the last handle at byte 64"), std::string::npos);
  std::string offset = handle;
  offset[16 + 3] = 0x10;  // offset 256 MiB: past the 40 MiB region
  EXPECT_NE(open_error(offset).find("does not lie in the region of 41943040 bytes"), std::string::npos);
  // Nothing was imported by any of them.
  EXPECT_EQ(p.importer_gpu.imported_handles(), 0u);
  EXPECT_EQ(p.importer_gpu.counters().reserve_calls, 0u);
  p.exporter.free(ptr);
}

TEST(Ipc, OpeningOnAnotherDeviceNamesBoth) {
  Processes p("pytorch");
  const DevicePtr ptr = p.exporter.malloc(kMiB);
  SimDriver gpu1(gpu_options(1));
  const std::string e = message_of<FormatError>(
      [&] { ccalloc::ipc::open_handle(gpu1, ccalloc::ipc::export_handle(p.exporter, ptr)); });
  EXPECT_NE(e.find("memory on device 0 opened on device 1"), std::string::npos) << e;
  p.exporter.free(ptr);
}

TEST(Ipc, HandleOfReleasedPagesIsADriverErrorNamingTheDescriptor) {
  Processes p("pytorch,expandable_segments:True");
  const DevicePtr ptr = p.exporter.malloc(4 * kMiB);
  const std::string handle = ccalloc::ipc::export_handle(p.exporter, ptr);
  const ccalloc::ipc::HandleInfo info = ccalloc::ipc::parse_handle(handle);
  std::int32_t fd = 0;
  std::memcpy(&fd, info.handles[0].data(), sizeof fd);
  p.exporter.free(ptr);
  p.exporter.empty_cache();  // releases the page: its descriptor is closed
  const std::string e =
      message_of<DriverError>([&] { ccalloc::ipc::open_handle(p.importer_gpu, handle); });
  EXPECT_NE(e.find("import_physical of POSIX file descriptor " + std::to_string(fd) + " of process " +
                   std::to_string(getpid())),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("no such exported handle"), std::string::npos) << e;
  // The failed open left nothing behind.
  const ccalloc::sim::Counters c = p.importer_gpu.counters();
  EXPECT_EQ(c.reserve_calls, 1u);
  EXPECT_EQ(c.address_frees, 1u);
  EXPECT_EQ(p.importer_gpu.imported_handles(), 0u);
}

TEST(Ipc, FailureOnALaterPageUndoesTheEarlierOnes) {
  Processes p("pytorch,expandable_segments:True");
  const DevicePtr ptr = p.exporter.malloc(30 * kMiB);
  const ccalloc::ipc::HandleInfo info =
      ccalloc::ipc::parse_handle(ccalloc::ipc::export_handle(p.exporter, ptr));
  std::vector<std::string> handles = info.handles;
  handles[1] = std::string("\xff\xff\xff\x7f", 4);  // no such descriptor
  const std::string e = message_of<DriverError>([&] {
    ccalloc::ipc::open_pages(p.importer_gpu, ShareKind::kPosixFd, info.pid, info.page_size, handles);
  });
  EXPECT_NE(e.find("POSIX file descriptor 2147483647"), std::string::npos) << e;
  const ccalloc::sim::Counters c = p.importer_gpu.counters();
  EXPECT_EQ(c.maps, 1u);
  EXPECT_EQ(c.unmaps, 1u);
  EXPECT_EQ(c.address_frees, 1u);
  EXPECT_EQ(p.importer_gpu.imported_handles(), 0u);
  p.exporter.free(ptr);
}

TEST(Ipc, DescriptorOfAnotherProcessIsRefused) {
  Processes p("pytorch,expandable_segments:True");
  const DevicePtr ptr = p.exporter.malloc(4 * kMiB);
  const ccalloc::ipc::HandleInfo info =
      ccalloc::ipc::parse_handle(ccalloc::ipc::export_handle(p.exporter, ptr));
  const int other = info.pid + 1;
  const std::string e = message_of<DriverError>([&] {
    p.importer_gpu.import_physical(info.handles[0], ShareKind::kPosixFd, other, info.page_size);
  });
  EXPECT_NE(e.find("it was exported by process " + std::to_string(info.pid)), std::string::npos) << e;
  const std::string size = message_of<DriverError>([&] {
    p.importer_gpu.import_physical(info.handles[0], ShareKind::kPosixFd, info.pid, 2 * kMiB);
  });
  EXPECT_NE(size.find("the exported allocation has 20971520 bytes"), std::string::npos) << size;
  p.exporter.free(ptr);
}

TEST(Ipc, FreedNativeSegmentCannotBeOpened) {
  Processes p("pytorch");
  const DevicePtr ptr = p.exporter.malloc(kMiB);
  const std::string handle = ccalloc::ipc::export_handle(p.exporter, ptr);
  p.exporter.free(ptr);
  p.exporter.empty_cache();
  const std::string e =
      message_of<DriverError>([&] { ccalloc::ipc::open_handle(p.importer_gpu, handle); });
  EXPECT_NE(e.find("no such exported allocation"), std::string::npos) << e;
}

TEST(Ipc, PagesCreatedUnexportableCannotBeShared) {
  Processes p("pytorch,expandable_segments:True");
  p.exporter_gpu.set_exportable_kinds(ccalloc::share_kind_bit(ShareKind::kPosixFd));
  const DevicePtr ptr = p.exporter.malloc(4 * kMiB);
  const std::string e = message_of<DriverError>(
      [&] { ccalloc::ipc::export_handle(p.exporter, ptr, ShareKind::kFabric); });
  EXPECT_NE(e.find("not created exportable as that kind"), std::string::npos) << e;
  EXPECT_EQ(ccalloc::ipc::parse_handle(ccalloc::ipc::export_handle(p.exporter, ptr)).handles.size(), 1u);
  p.exporter.free(ptr);
}

TEST(Ipc, StreamOrderedPoolBackendCannotShare) {
  Processes p("backend:cudaMallocAsync");
  const DevicePtr ptr = p.exporter.malloc(kMiB);
  const std::string e =
      message_of<ccalloc::Error>([&] { ccalloc::ipc::export_handle(p.exporter, ptr); });
  EXPECT_NE(e.find("backend:cudaMallocAsync has no segments to share"), std::string::npos) << e;
  p.exporter.free(ptr);
}

TEST(Ipc, OpenedMemoryMovesOwnership) {
  Processes p("pytorch");
  const DevicePtr ptr = p.exporter.malloc(kMiB);
  OpenedMemory a = ccalloc::ipc::open_handle(p.importer_gpu, ccalloc::ipc::export_handle(p.exporter, ptr));
  const DevicePtr at = a.ptr();
  OpenedMemory b = std::move(a);
  EXPECT_FALSE(a.is_open());  // NOLINT(bugprone-use-after-move): moved-from state is specified
  EXPECT_EQ(b.ptr(), at);
  a.close();  // closing a closed one does nothing
  b.close();
  EXPECT_NE(message_of<DriverError>([&] { p.importer_gpu.close_allocation(at); }).find("no allocation of another process is open"),
            std::string::npos);
  p.exporter.free(ptr);
}

// The C API's checks that need no device (the round trip through it runs on a GPU, in
// tests/gpu/ipc_gpu_test.cpp).
TEST(IpcCApi, ArgumentsAndUnknownPointersAreNamed) {
  std::size_t length = 0;
  EXPECT_EQ(ccalloc_ipc_export(reinterpret_cast<void*>(0x1000), nullptr, 0, nullptr),
            CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc_ipc_export: length is NULL");
  EXPECT_EQ(ccalloc_ipc_export(reinterpret_cast<void*>(0x1000), nullptr, 16, &length),
            CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc_ipc_export: handle is NULL");
  EXPECT_EQ(ccalloc_ipc_open("ccIP", 4, 0, nullptr), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc_ipc_open: ptr is NULL");
  void* out = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(ccalloc_ipc_open(nullptr, 8, 0, &out), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_EQ(out, nullptr);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc_ipc_open: handle is NULL");
  EXPECT_EQ(ccalloc_ipc_close(reinterpret_cast<void*>(0x1000)), CCALLOC_ERROR_INVALID_POINTER);
  EXPECT_STREQ(ccalloc_last_error(),
               "ccalloc_ipc_close: pointer 0x1000 was not opened by ccalloc_ipc_open (or is closed)");
}

}  // namespace
