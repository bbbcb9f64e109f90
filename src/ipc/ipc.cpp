// Sharing allocations between processes (include/ccalloc/ipc.hpp, docs/ipc.md): the
// handle format, export through the backend's shared_region and the driver's export
// calls, and opening through the driver's import calls. Also the Driver defaults for
// drivers that cannot share.
//
// Handle format, version 1, integers little-endian:
//   [0, 4)    magic "ccIP"
//   4         version (1)
//   5         region kind: 1 segment, 2 pages, 3 handles of their own sizes
//   6         share kind of pages: 0 for a segment, 1 POSIX file descriptor, 2 fabric
//   7         0
//   [8, 12)   device (int32)
//   [12, 16)  pid of the exporting process (int32)
//   [16, 24)  offset of the allocation from the region's start
//   [24, 32)  size of the allocation
//   [32, 40)  size of the region
//   [40, 48)  page size (0 for a segment and for handles of their own sizes)
//   [48, 52)  number of handles (1 for a segment)
//   [52, 56)  bytes of each handle
//   [56, ...) kind 3 only: the size of each handle's memory (8 bytes each), then
//             the handles
#include "ccalloc/ipc.hpp"

#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <utility>

#include "ccalloc/errors.hpp"
#include "core/backend.hpp"
#include "core/backend_access.hpp"

namespace ccalloc {

// --- Driver defaults: no sharing. ---

namespace {
[[noreturn]] void cannot_share(const Driver& d, const std::string& what) {
  throw DriverError("ccalloc: " + d.name() + " cannot share memory between processes (" + what +
                    ")");
}
}  // namespace

void Driver::set_exportable_kinds(unsigned kinds) {
  if (kinds != 0) cannot_share(*this, "set_exportable_kinds");
}
unsigned Driver::exportable_kinds() const {
  return 0;
}
std::string Driver::export_physical(PhysicalHandle handle, ShareKind) {
  cannot_share(*this, "export_physical of handle " + std::to_string(handle));
}
PhysicalHandle Driver::import_physical(std::string_view, ShareKind, int pid, std::size_t) {
  cannot_share(*this, "import_physical from process " + std::to_string(pid));
}
std::string Driver::export_allocation(DevicePtr) {
  cannot_share(*this, "export_allocation");
}
DevicePtr Driver::open_allocation(std::string_view) {
  cannot_share(*this, "open_allocation");
}
void Driver::close_allocation(DevicePtr) {
  cannot_share(*this, "close_allocation");
}

namespace core {
ipc::SharedRegion Backend::shared_region(DevicePtr ptr) const {
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "ccalloc: cannot share pointer 0x%" PRIxPTR
                " with another process: %s; use the native backend without "
                "stitch_segments",
                ptr, config().backend == BackendKind::kCudaMallocAsync
                         ? "backend:cudaMallocAsync has no segments to share"
                         : "this backend has no memory to share");
  throw Error(buf);
}
}  // namespace core

namespace ipc {
namespace {

constexpr char kMagic[4] = {'c', 'c', 'I', 'P'};
constexpr std::size_t kHeaderBytes = 56;

void put(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Reads fields in order, naming the byte where the handle ends too early.
class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  std::uint64_t get(int bytes, const char* field) {
    need(static_cast<std::size_t>(bytes), field);
    std::uint64_t v = 0;
    for (int i = 0; i < bytes; ++i)
      v |= std::uint64_t{static_cast<unsigned char>(s_[pos_ + i])} << (8 * i);
    pos_ += static_cast<std::size_t>(bytes);
    return v;
  }
  std::string_view take(std::size_t n, const std::string& field) {
    need(n, field.c_str());
    const std::string_view out = s_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  std::size_t pos() const { return pos_; }

 private:
  void need(std::size_t n, const char* field) const {
    if (s_.size() - pos_ < n) {
      throw FormatError("ccalloc: IPC handle truncated at byte " + std::to_string(s_.size()) +
                        ": " + field + " needs bytes [" + std::to_string(pos_) + ", " +
                        std::to_string(pos_ + n) + ")");
    }
  }
  std::string_view s_;
  std::size_t pos_ = 0;
};

}  // namespace

SharedRegion shared_region(Allocator& allocator, DevicePtr ptr) {
  return core::BackendAccess::of(allocator).shared_region(ptr);
}

std::string export_handle(Allocator& allocator, DevicePtr ptr, ShareKind kind) {
  const SharedRegion r = shared_region(allocator, ptr);
  Driver& driver = allocator.driver();
  std::vector<std::string> handles;
  if (r.kind == RegionKind::kSegment) {
    handles.push_back(driver.export_allocation(r.base));
  } else {
    for (const PhysicalHandle h : r.pages)
      handles.push_back(driver.export_physical(h, kind));
  }
  const std::size_t each = handles.front().size();
  std::string out;
  out.reserve(kHeaderBytes + handles.size() * each);
  out.append(kMagic, sizeof kMagic);
  put(out, kHandleVersion, 1);
  put(out, static_cast<std::uint8_t>(r.kind), 1);
  put(out, r.kind != RegionKind::kSegment ? static_cast<std::uint8_t>(kind) : 0, 1);
  put(out, 0, 1);
  put(out, static_cast<std::uint32_t>(driver.device()), 4);
  put(out, static_cast<std::uint32_t>(::getpid()), 4);
  put(out, r.allocation - r.base, 8);
  put(out, r.allocation_size, 8);
  put(out, r.size, 8);
  put(out, r.page_size, 8);
  put(out, handles.size(), 4);
  put(out, each, 4);
  if (r.kind == RegionKind::kHandles) {
    for (const std::size_t bytes : r.page_sizes)
      put(out, bytes, 8);
  }
  for (const std::string& h : handles)
    out += h;
  return out;
}

HandleInfo parse_handle(std::string_view handle) {
  Reader in(handle);
  const std::string_view magic = in.take(sizeof kMagic, "the magic");
  if (std::memcmp(magic.data(), kMagic, sizeof kMagic) != 0) {
    throw FormatError("ccalloc: not a ccalloc IPC handle: it does not start with \"ccIP\"");
  }
  HandleInfo info;
  info.version = static_cast<std::uint8_t>(in.get(1, "the version"));
  if (info.version != kHandleVersion) {
    throw FormatError("ccalloc: IPC handle of version " + std::to_string(info.version) +
                      ": this build reads version " + std::to_string(kHandleVersion) +
                      " only (export and open with the same ccalloc)");
  }
  const auto kind = in.get(1, "the region kind");
  if (kind != 1 && kind != 2 && kind != 3) {
    throw FormatError("ccalloc: IPC handle with region kind " + std::to_string(kind) +
                      " at byte 5: expected 1 (segment), 2 (pages) or 3 (handles)");
  }
  info.kind = static_cast<RegionKind>(kind);
  const auto share = in.get(1, "the share kind");
  in.get(1, "the reserved byte");
  info.device = static_cast<int>(static_cast<std::int32_t>(in.get(4, "the device")));
  info.pid = static_cast<int>(static_cast<std::int32_t>(in.get(4, "the pid")));
  info.offset = in.get(8, "the offset");
  info.size = in.get(8, "the allocation size");
  info.region_size = in.get(8, "the region size");
  info.page_size = in.get(8, "the page size");
  const std::uint64_t count = in.get(4, "the handle count");
  const std::uint64_t each = in.get(4, "the handle size");
  const auto bad = [&](const std::string& why) {
    throw FormatError("ccalloc: inconsistent IPC handle: " + why);
  };
  if (info.kind == RegionKind::kSegment) {
    if (share != 0) bad("a segment's share kind is " + std::to_string(share) + ", expected 0");
    if (count != 1) bad("a segment has " + std::to_string(count) + " handles, expected 1");
    if (each != kAllocationHandleBytes) {
      bad("a segment's handle has " + std::to_string(each) + " bytes, expected " +
          std::to_string(kAllocationHandleBytes));
    }
  } else {
    if (share != 1 && share != 2) {
      bad("share kind " + std::to_string(share) + ", expected 1 (POSIX fd) or 2 (fabric)");
    }
    info.share_kind = static_cast<ShareKind>(share);
    if (each != share_kind_bytes(info.share_kind)) {
      bad("handles of " + std::to_string(each) + " bytes, expected " +
          std::to_string(share_kind_bytes(info.share_kind)) + " for the share kind");
    }
    if (info.kind == RegionKind::kPages &&
        (info.page_size == 0 || count == 0 || info.region_size != count * info.page_size)) {
      bad("region of " + std::to_string(info.region_size) + " bytes is not " +
          std::to_string(count) + " pages of " + std::to_string(info.page_size) + " bytes");
    }
    if (info.kind == RegionKind::kHandles) {
      if (info.page_size != 0 || count == 0 || count > handle.size()) {
        bad("handles of their own sizes with page size " + std::to_string(info.page_size) +
            " and " + std::to_string(count) + " handles");
      }
      std::uint64_t total = 0;
      for (std::uint64_t i = 0; i < count; ++i) {
        const std::uint64_t bytes = in.get(8, ("the size of handle " + std::to_string(i)).c_str());
        if (bytes == 0 || bytes > info.region_size - total) {
          bad("handle " + std::to_string(i) + " of " + std::to_string(bytes) +
              " bytes passes the region of " + std::to_string(info.region_size) + " bytes");
        }
        total += bytes;
        info.page_sizes.push_back(bytes);
      }
      if (total != info.region_size) {
        bad("handles of " + std::to_string(total) + " bytes for a region of " +
            std::to_string(info.region_size));
      }
    }
  }
  if (info.offset > info.region_size || info.size > info.region_size - info.offset) {
    bad("allocation [" + std::to_string(info.offset) + ", +" + std::to_string(info.size) +
        ") does not lie in the region of " + std::to_string(info.region_size) + " bytes");
  }
  for (std::uint64_t i = 0; i < count; ++i)
    info.handles.emplace_back(in.take(each, "handle " + std::to_string(i)));
  if (in.pos() != handle.size()) {
    bad(std::to_string(handle.size() - in.pos()) + " bytes follow the last handle at byte " +
        std::to_string(in.pos()));
  }
  return info;
}

// --- OpenedMemory ---

OpenedMemory::~OpenedMemory() {
  try {
    close();
  } catch (const Error&) {  // NOLINT(bugprone-empty-catch): a destructor cannot report
  }
}

OpenedMemory::OpenedMemory(OpenedMemory&& o) noexcept
    : driver_(std::exchange(o.driver_, nullptr)),
      kind_(o.kind_),
      ptr_(std::exchange(o.ptr_, 0)),
      size_(std::exchange(o.size_, 0)),
      base_(std::exchange(o.base_, 0)),
      region_size_(std::exchange(o.region_size_, 0)),
      page_size_(o.page_size_),
      pages_(std::move(o.pages_)),
      page_sizes_(std::move(o.page_sizes_)) {}

OpenedMemory& OpenedMemory::operator=(OpenedMemory&& o) noexcept {
  if (this != &o) {
    OpenedMemory old(std::move(*this));
    driver_ = std::exchange(o.driver_, nullptr);
    kind_ = o.kind_;
    ptr_ = std::exchange(o.ptr_, 0);
    size_ = std::exchange(o.size_, 0);
    base_ = std::exchange(o.base_, 0);
    region_size_ = std::exchange(o.region_size_, 0);
    page_size_ = o.page_size_;
    pages_ = std::move(o.pages_);
    page_sizes_ = std::move(o.page_sizes_);
  }
  return *this;
}

void OpenedMemory::close() {
  if (driver_ == nullptr) return;
  Driver& d = *std::exchange(driver_, nullptr);
  if (kind_ == RegionKind::kSegment) {
    d.close_allocation(base_);
  } else {
    d.synchronize_device();  // unmapping does not wait for work that uses the pages
    d.unmap(base_, region_size_);
    for (std::size_t i = 0; i < pages_.size(); ++i)
      d.release_physical(pages_[i], page_sizes_[i]);
    d.free_address_range(base_, region_size_);
  }
  pages_.clear();
  page_sizes_.clear();
  ptr_ = base_ = 0;
  size_ = region_size_ = 0;
}

OpenedMemory open_pages(Driver& driver, ShareKind kind, int pid, std::size_t page_size,
                        const std::vector<std::string>& handles) {
  OpenedMemory m =
      open_pages(driver, kind, pid, std::vector<std::size_t>(handles.size(), page_size), handles);
  m.kind_ = RegionKind::kPages;
  m.page_size_ = page_size;
  return m;
}

OpenedMemory open_pages(Driver& driver, ShareKind kind, int pid,
                        const std::vector<std::size_t>& sizes,
                        const std::vector<std::string>& handles) {
  const std::size_t g = driver.vm_granularity();
  std::size_t total = 0;
  bool sizes_ok = !handles.empty() && sizes.size() == handles.size();
  for (const std::size_t n : sizes) {
    sizes_ok = sizes_ok && n > 0 && n % g == 0;
    total += n;
  }
  if (!sizes_ok) {
    std::string list;
    for (const std::size_t n : sizes)
      list += (list.empty() ? "" : ", ") + std::to_string(n);
    throw FormatError("ccalloc: cannot open " + std::to_string(handles.size()) +
                      " pages of [" + list + "] bytes from process " + std::to_string(pid) +
                      " on " + driver.name() + ": each page must be a positive multiple of " +
                      std::to_string(g) + " bytes, one size per handle");
  }
  OpenedMemory m;
  m.kind_ = RegionKind::kHandles;
  m.region_size_ = total;
  const DevicePtr base = driver.reserve_address_range(total);
  std::size_t mapped = 0;
  try {
    for (std::size_t i = 0; i < handles.size(); ++i) {
      m.pages_.push_back(driver.import_physical(handles[i], kind, pid, sizes[i]));
      m.page_sizes_.push_back(sizes[i]);
      driver.map(base + mapped, sizes[i], m.pages_.back());
      mapped += sizes[i];
    }
  } catch (...) {
    if (mapped > 0) driver.unmap(base, mapped);
    for (std::size_t i = 0; i < m.pages_.size(); ++i)
      driver.release_physical(m.pages_[i], m.page_sizes_[i]);
    driver.free_address_range(base, total);
    throw;
  }
  m.driver_ = &driver;
  m.base_ = m.ptr_ = base;
  m.size_ = total;
  return m;
}

OpenedMemory open_handle(Driver& driver, std::string_view handle) {
  const HandleInfo info = parse_handle(handle);
  if (info.device != driver.device()) {
    throw FormatError("ccalloc: IPC handle of memory on device " + std::to_string(info.device) +
                      " opened on device " + std::to_string(driver.device()) + " (" +
                      driver.name() + "): open it with that device's driver");
  }
  OpenedMemory m;
  if (info.kind == RegionKind::kSegment) {
    const DevicePtr base = driver.open_allocation(info.handles.front());
    m.driver_ = &driver;
    m.kind_ = RegionKind::kSegment;
    m.base_ = base;
    m.region_size_ = info.region_size;
  } else if (info.kind == RegionKind::kPages) {
    m = open_pages(driver, info.share_kind, info.pid, info.page_size, info.handles);
  } else {
    m = open_pages(driver, info.share_kind, info.pid, info.page_sizes, info.handles);
  }
  m.ptr_ = m.base_ + info.offset;
  m.size_ = info.size;
  return m;
}

}  // namespace ipc
}  // namespace ccalloc
