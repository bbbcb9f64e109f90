// Private to the simulated GPU (src/drivers/sim/*.cpp): the address arithmetic, range
// search and message text that its device, virtual memory and pool models share. The
// models themselves are SimDriver's members (include/ccalloc/sim.hpp), one file each.
#pragma once

#include <cinttypes>
#include <cstddef>
#include <cstdio>
#include <iterator>
#include <limits>
#include <string>

#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "core/format.hpp"

namespace ccalloc::sim {

inline constexpr DevicePtr kMaxPtr = std::numeric_limits<DevicePtr>::max();
// The stream-ordered pool rounds requests to this, and serves rounded sizes below
// kPoolSmallLimit from shared pages.
inline constexpr std::size_t kPoolRounding = 512;
inline constexpr std::size_t kPoolSmallLimit = std::size_t{1} << 20;

inline std::string device_label(int device) {
  return "simulated GPU " + std::to_string(device);
}

inline std::string bytes_str(std::size_t n) {
  return std::to_string(n) + " bytes";
}

// [addr, addr + bytes) as text.
inline std::string range_str(DevicePtr addr, std::size_t bytes) {
  return "[" + hex_address(addr) + ", " + hex_address(addr + bytes) + ") (" + bytes_str(bytes) +
         ")";
}

// Both helpers throw rather than wrap: a wrapped address would alias a low range and make
// the simulator hand out overlapping memory silently.
inline DevicePtr align_up(DevicePtr addr, std::size_t alignment, int device) {
  const DevicePtr mask = alignment - 1;
  if (addr > kMaxPtr - mask) {
    throw DriverError("ccalloc: " + device_label(device) + " ran out of virtual address space");
  }
  return (addr + mask) & ~mask;
}

inline DevicePtr range_end(DevicePtr addr, std::size_t bytes, int device) {
  if (bytes > kMaxPtr - addr) {
    throw DriverError("ccalloc: " + device_label(device) + " ran out of virtual address space");
  }
  return addr + bytes;
}

// The end of one range of `ranges` that overlaps [addr, end), or 0 if none does. Skipping
// to that end is safe for a first-fit search: no start in [addr, end of the range) avoids
// it.
template <typename Map, typename SizeOf>
DevicePtr overlap_end(const Map& ranges, DevicePtr addr, DevicePtr end, SizeOf size_of) {
  auto next = ranges.lower_bound(addr);
  if (next != ranges.begin()) {
    const auto prev = std::prev(next);
    const DevicePtr prev_end = prev->first + size_of(prev->second);
    if (prev_end > addr) return prev_end;
  }
  if (next != ranges.end() && next->first < end) return next->first + size_of(next->second);
  return 0;
}

inline std::size_t plain_size(std::size_t s) {
  return s;
}

}  // namespace ccalloc::sim
