// pool_bridge.hpp's sharing of expandable segments between processes, in PyTorch's handle
// format (type 'e', c10/cuda/CUDACachingAllocator.cpp ExpandableSegment::share and
// fromShared), so that tensors cross between a process on ccalloc and one on PyTorch's
// allocator in both directions (docs/ipc.md).
//
// The payload after the type byte: PyTorch's ShareHeader as its bytes in memory, 24 bytes
// on Linux x86-64 and aarch64 ({pid_t pid; 4 zero bytes of padding; size_t segment_size;
// size_t num_handles}), then one handle per page covering the block: an int file
// descriptor of the exporting process (the importer copies it with pidfd_getfd), or a
// 64-byte CUmemFabricHandle when c10's expandable_segments_handle_type is FABRIC_HANDLE.
// PyTorch picks the kind from that process-wide setting on both sides; it stays
// UNSPECIFIED (POSIX descriptors) in a process where ccalloc serves every allocation, and
// becomes FABRIC_HANDLE in a PyTorch process only where fabric memory can be created (an
// NVLink fabric with IMEX). ccalloc writes by the setting, as PyTorch, but reads by the
// handles' size, so it also opens what a PyTorch process on a fabric sends.
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ccalloc/cuda.hpp"
#include "ccalloc/ipc.hpp"
#include "pool_bridge.hpp"

namespace ccalloc::torch_bridge {
namespace {

namespace c10a = c10::cuda::CUDACachingAllocator;

// PyTorch's ShareHeader, zero-filled before it is set so that the padding is zeros (its
// handles are compared as strings).
struct ShareHeader {
  pid_t pid;
  std::size_t segment_size;
  std::size_t num_handles;
};
static_assert(sizeof(ShareHeader) == 24, "PyTorch's ShareHeader is 24 bytes on 64-bit Linux");

ShareKind torch_share_kind() {
  return c10a::CUDAAllocatorConfig::expandable_segments_handle_type() ==
                 c10a::Expandable_Segments_Handle_Type::FABRIC_HANDLE
             ? ShareKind::kFabric
             : ShareKind::kPosixFd;
}

const char* kind_text(ShareKind kind) {
  return kind == ShareKind::kFabric ? "fabric handles" : "POSIX file descriptors";
}

// The driver that maps memory of other processes on `device`: one per device, for the life
// of the process (the mappings it makes may outlive any allocator).
Driver& importer(int device) {
  static std::mutex mutex;
  static std::array<cuda::CudaDriver*, 64> drivers{};
  TORCH_CHECK(device >= 0 && device < static_cast<int>(drivers.size()), "ccalloc: device ", device,
              " out of range for IPC");
  std::lock_guard lock(mutex);
  if (drivers[device] == nullptr) drivers[device] = new cuda::CudaDriver(device);  // never freed
  return *drivers[device];
}

// The start of the opened region, as PyTorch holds it: the last owner's release closes it.
std::shared_ptr<void> hold_region(ipc::OpenedMemory memory) {
  auto opened = std::make_shared<ipc::OpenedMemory>(std::move(memory));
  void* ptr = reinterpret_cast<void*>(opened->region_base());
  return std::shared_ptr<void>(ptr, [opened](void*) {
    try {
      opened->close();
    } catch (const Error& e) {
      TORCH_WARN("ccalloc: closing memory shared by another process: ", e.what());
    }
  });
}

}  // namespace

SharedRange share_expandable(Allocator& allocator, DevicePtr ptr, std::size_t size) {
  const ipc::SharedRegion region = ipc::shared_region(allocator, ptr);
  if (region.kind == ipc::RegionKind::kSegment) {
    throw Error("ccalloc: the allocation at " + std::to_string(ptr) +
                " is not in an expandable segment");
  }
  const bool uniform =
      region.kind == ipc::RegionKind::kPages ||
      std::all_of(region.page_sizes.begin(), region.page_sizes.end(),
                  [&](std::size_t n) { return n == region.page_sizes.front(); });
  if (size > region.allocation_size) {
    throw Error("ccalloc: sharing " + std::to_string(size) + " bytes of an allocation of " +
                std::to_string(region.allocation_size));
  }
  const ShareKind kind = torch_share_kind();
  Driver& driver = allocator.driver();
  if ((driver.exportable_kinds() & share_kind_bit(kind)) == 0) {
    throw NotSupported(std::string("PyTorch's expandable segments handle type asks for ") +
                       kind_text(kind) + ", and ccalloc creates the pages of expandable "
                       "segments exportable as " +
                       (driver.exportable_kinds() == 0 ? "nothing (TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0)"
                                                       : "POSIX file descriptors only"));
  }
  SharedRange out;
  out.start = region.base;
  if (!uniform) {
    out.type = 'h';
    out.payload = ipc::export_handle(allocator, ptr, kind);
    return out;
  }
  ShareHeader header;
  std::memset(&header, 0, sizeof header);
  header.pid = ::getpid();
  header.segment_size =
      region.kind == ipc::RegionKind::kPages ? region.page_size : region.page_sizes.front();
  header.num_handles = region.pages.size();
  out.payload.assign(reinterpret_cast<const char*>(&header), sizeof header);
  for (const PhysicalHandle page : region.pages)
    out.payload += driver.export_physical(page, kind);
  return out;
}

std::shared_ptr<void> open_expandable(int device, std::string_view payload) {
  if (payload.size() < sizeof(ShareHeader)) {
    throw FormatError("ccalloc: PyTorch expandable-segment handle truncated at byte " +
                      std::to_string(payload.size()) + " of its payload: the header needs 24");
  }
  ShareHeader header;
  std::memcpy(&header, payload.data(), sizeof header);
  // The handles' size says their kind: PyTorch reads them by its own process's setting,
  // which can differ from the exporter's; the length cannot.
  const std::size_t handle_bytes = payload.size() - sizeof header;
  const std::size_t each = header.num_handles == 0 ? 0 : handle_bytes / header.num_handles;
  if (header.num_handles == 0 || handle_bytes % header.num_handles != 0 ||
      (each != share_kind_bytes(ShareKind::kPosixFd) &&
       each != share_kind_bytes(ShareKind::kFabric))) {
    throw FormatError("ccalloc: PyTorch expandable-segment handle of process " +
                      std::to_string(header.pid) + " has " + std::to_string(handle_bytes) +
                      " bytes of handles for " + std::to_string(header.num_handles) +
                      " pages: expected 4 per page (POSIX file descriptors) or 64 (fabric "
                      "handles)");
  }
  const ShareKind kind =
      each == share_kind_bytes(ShareKind::kPosixFd) ? ShareKind::kPosixFd : ShareKind::kFabric;
  std::vector<std::string> handles;
  for (std::size_t i = 0; i < header.num_handles; ++i)
    handles.emplace_back(payload.substr(sizeof header + i * each, each));
  return hold_region(ipc::open_pages(importer(device), kind, static_cast<int>(header.pid),
                                     header.segment_size, handles));
}

std::shared_ptr<void> open_handles(int device, std::string_view payload) {
  return hold_region(ipc::open_handle(importer(device), payload));
}

}  // namespace ccalloc::torch_bridge
