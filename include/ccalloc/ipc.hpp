// Sharing allocations between processes (docs/ipc.md).
//
//   // process A
//   std::string handle = ccalloc::ipc::export_handle(allocator, ptr);   // send the bytes
//   // process B
//   ccalloc::ipc::OpenedMemory m = ccalloc::ipc::open_handle(driver, handle);
//   use(m.ptr(), m.size());   // the same memory; valid until m is closed or destroyed
//
// A handle is a self-describing byte string: a magic, a format version, the device, the
// exporter's pid, the allocation's offset and size in the shared region, then the region's
// handles. Memory of a native segment (cudaMalloc) is shared as the whole segment
// (cudaIpcMemHandle, Driver::export_allocation); memory of an expandable segment as the
// physical pages that cover the allocation (Driver::export_physical: POSIX file
// descriptors, which the importer copies through pidfd_getfd, or fabric handles); memory
// of the stitching policy as the physical allocations mapped over the allocation, whole,
// each of its own size. The exporter must keep the allocation live while another process
// uses it, as with CUDA IPC.
//
// Errors: InvalidPointerError for a pointer that is not a live allocation; FormatError for
// a malformed handle (it names the byte where it is truncated, the version, the device);
// DriverError when the driver cannot export or import.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/driver.hpp"

namespace ccalloc::ipc {

// The handle format this build writes and reads.
inline constexpr std::uint8_t kHandleVersion = 1;

enum class RegionKind : std::uint8_t {
  kSegment = 1,  // a native segment, shared whole (cudaIpcMemHandle)
  kPages = 2,    // pages of an expandable segment (one shareable handle each)
  kHandles = 3,  // physical allocations of the stitching policy, each of its own size
};

// The memory behind a live allocation that another process maps to see it.
struct SharedRegion {
  RegionKind kind = RegionKind::kSegment;
  DevicePtr allocation = 0;  // the live allocation
  std::size_t allocation_size = 0;
  DevicePtr base = 0;     // kSegment: the segment; else the first page covering it
  std::size_t size = 0;   // bytes from base: the segment, or the pages' bytes
  std::size_t page_size = 0;          // kPages only
  std::vector<PhysicalHandle> pages;  // kPages, kHandles: the handles of [base, base + size)
  std::vector<std::size_t> page_sizes;  // kHandles only: the bytes of each handle
};
// The region of the live allocation `ptr` (its start, as malloc returned it). The pages
// stay mapped while the allocation is live. Throws InvalidPointerError if `ptr` is not
// live; Error for a backend that cannot share (the stream-ordered pool).
SharedRegion shared_region(Allocator& allocator, DevicePtr ptr);

// What a handle says, read without opening it.
struct HandleInfo {
  std::uint8_t version = 0;
  RegionKind kind = RegionKind::kSegment;
  ShareKind share_kind = ShareKind::kPosixFd;  // kPages only
  int device = 0;
  int pid = 0;                 // the exporting process
  std::size_t offset = 0;      // of the allocation from the region's start
  std::size_t size = 0;        // of the allocation
  std::size_t region_size = 0;
  std::size_t page_size = 0;   // kPages only
  std::vector<std::size_t> page_sizes;  // kHandles only: bytes of each handle
  std::vector<std::string> handles;  // one for kSegment, one per page otherwise
};

// The handle of the live allocation `ptr` of `allocator`. Pages are exported as `kind`.
std::string export_handle(Allocator& allocator, DevicePtr ptr,
                          ShareKind kind = ShareKind::kPosixFd);
// Parses and checks a handle. Throws FormatError naming the problem: not a ccalloc handle,
// truncated at byte N, a version this build does not read, inconsistent sizes.
HandleInfo parse_handle(std::string_view handle);

// Memory of another process mapped into this one. Move-only; closes on destruction.
class OpenedMemory {
 public:
  OpenedMemory() = default;
  ~OpenedMemory();
  OpenedMemory(OpenedMemory&& other) noexcept;
  OpenedMemory& operator=(OpenedMemory&& other) noexcept;
  OpenedMemory(const OpenedMemory&) = delete;
  OpenedMemory& operator=(const OpenedMemory&) = delete;

  // The shared allocation's address here, and its size.
  DevicePtr ptr() const { return ptr_; }
  std::size_t size() const { return size_; }
  // Where the shared region starts here (ptr() - offset) and its size.
  DevicePtr region_base() const { return base_; }
  std::size_t region_size() const { return region_size_; }
  bool is_open() const { return driver_ != nullptr; }
  // Unmaps the memory (pages: after synchronizing the device, since unmapping does not wait
  // for work that uses them); ptr() is invalid afterwards. Throws DriverError; closing a
  // closed one does nothing.
  void close();

 private:
  friend OpenedMemory open_handle(Driver& driver, std::string_view handle);
  friend OpenedMemory open_pages(Driver& driver, ShareKind kind, int pid, std::size_t page_size,
                                 const std::vector<std::string>& handles);
  friend OpenedMemory open_pages(Driver& driver, ShareKind kind, int pid,
                                 const std::vector<std::size_t>& sizes,
                                 const std::vector<std::string>& handles);
  Driver* driver_ = nullptr;
  RegionKind kind_ = RegionKind::kSegment;
  DevicePtr ptr_ = 0;
  std::size_t size_ = 0;
  DevicePtr base_ = 0;
  std::size_t region_size_ = 0;
  std::size_t page_size_ = 0;
  std::vector<PhysicalHandle> pages_;  // imported, mapped from base_
  std::vector<std::size_t> page_sizes_;  // bytes of each of pages_
};

// Opens a handle from export_handle on `driver`'s device. Throws FormatError for a
// malformed handle or one exported on another device; DriverError when importing fails
// (nothing stays mapped then).
OpenedMemory open_handle(Driver& driver, std::string_view handle);
// Maps pages exported by process `pid` (one handle each, in address order) at one new
// address range: the building block of open_handle, for adapters that read another
// format (PyTorch's). The result's ptr() is the first page and size() the whole range.
OpenedMemory open_pages(Driver& driver, ShareKind kind, int pid, std::size_t page_size,
                        const std::vector<std::string>& handles);
// The same for pages of different sizes: handles[i] holds sizes[i] bytes.
OpenedMemory open_pages(Driver& driver, ShareKind kind, int pid,
                        const std::vector<std::size_t>& sizes,
                        const std::vector<std::string>& handles);

}  // namespace ccalloc::ipc
