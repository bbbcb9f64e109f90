// The simulated GPU's virtual memory model (cuMemAddressReserve / cuMemCreate / cuMemMap /
// cuMemUnmap / cuMemRelease / cuMemAddressFree): address reservations, physical handles and
// per-handle mappings, all in units of vm_granularity.
//
// Invariants, all under mutex_:
//   physical_bytes_ == sum of the sizes in physical_ of the allocations not imported from
//   another process (ipc_model.cpp);
//   every mapping lies inside one reservation, mappings are disjoint, and a handle is
//   mapped by map() at most once, exactly where its Physical::mapped_at says, and then by
//   no map_range(); map_range() may map a whole handle at several addresses at once (CUDA
//   allows that; it rejects a non-zero offset into a handle), and Physical::range_mappings
//   counts those mappings;
//   a reservation is freed only with nothing mapped inside it, and a handle released only
//   when it is not mapped.
#include <algorithm>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "drivers/sim/sim_common.hpp"

namespace ccalloc::sim {

std::size_t SimDriver::vm_granularity() {
  return options_.vm_granularity;
}

DevicePtr SimDriver::reserve_address_range(std::size_t bytes) {
  const std::size_t g = options_.vm_granularity;
  std::lock_guard lock(mutex_);
  if (bytes == 0 || bytes % g != 0) {
    fail("reserve_address_range of " + bytes_str(bytes) +
         ": the size must be a positive multiple of the granularity (" + bytes_str(g) + ")");
  }
  const DevicePtr base = first_fit(options_.vm_base_address, bytes, g);
  reservations_.emplace(base, bytes);
  ++counters_.reserve_calls;
  driver_us_ += options_.cost.reserve_us;
  return base;
}

void SimDriver::free_address_range(DevicePtr base, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  forbid_during_capture("free_address_range");
  const auto it = reservations_.find(base);
  if (it == reservations_.end()) {
    fail("free_address_range of " + range_str(base, bytes) + ": no reservation starts at " +
         hex_address(base));
  }
  if (it->second != bytes) {
    fail("free_address_range of " + range_str(base, bytes) + ": the reservation at " +
         hex_address(base) + " has " + bytes_str(it->second));
  }
  const auto m = mappings_.lower_bound(base);
  if (m != mappings_.end() && m->first < base + bytes) {
    fail("free_address_range of " + range_str(base, bytes) + ": " +
         range_str(m->first, m->second.bytes) + " is still mapped inside it");
  }
  reservations_.erase(it);
  ++counters_.address_frees;
  driver_us_ += options_.cost.address_free_us;
}

PhysicalHandle SimDriver::create_physical(std::size_t bytes) {
  const std::size_t g = options_.vm_granularity;
  std::lock_guard lock(mutex_);
  if (bytes == 0 || bytes % g != 0) {
    fail("create_physical of " + bytes_str(bytes) +
         ": the size must be a positive multiple of the granularity (" + bytes_str(g) + ")");
  }
  ++counters_.physical_creates;
  // A failed cuMemCreate is still a driver round trip.
  driver_us_ += options_.cost.physical_create_us;
  if (bytes > options_.capacity - device_used()) {
    ++counters_.physical_create_ooms;
    return 0;
  }
  const PhysicalHandle handle = next_handle_++;
  Physical p;
  p.bytes = bytes;
  p.exportable = exportable_kinds_;
  physical_.emplace(handle, std::move(p));
  physical_bytes_ += bytes;
  return handle;
}

void SimDriver::release_physical(PhysicalHandle handle, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const auto it = physical_.find(handle);
  const std::string what =
      "release_physical of handle " + std::to_string(handle) + " (" + bytes_str(bytes) + ")";
  if (it == physical_.end()) {
    fail(what + ": no such physical allocation (never created, or already released)");
  }
  if (it->second.bytes != bytes) {
    fail(what + ": it was created with " + bytes_str(it->second.bytes));
  }
  // CUDA would defer the release until the mapping goes; the engine always unmaps first,
  // so a release of a mapped handle is treated as the bug it would be there.
  if (it->second.mapped_at != 0) {
    fail(what + ": it is still mapped at " + hex_address(it->second.mapped_at) +
         "; unmap it first");
  }
  if (it->second.range_mappings != 0) {
    fail(what + ": it is still mapped at " + std::to_string(it->second.range_mappings) +
         " addresses; unmap them first");
  }
  if (!it->second.imported) physical_bytes_ -= bytes;
  forget_exports(it->second.exports);
  physical_.erase(it);
  ++counters_.physical_releases;
  driver_us_ += options_.cost.physical_release_us;
}

SimDriver::Physical& SimDriver::mapping_target(const std::string& what, DevicePtr va,
                                               std::size_t bytes, PhysicalHandle handle) {
  const std::size_t g = options_.vm_granularity;
  if (bytes == 0 || bytes % g != 0 || va % g != 0) {
    fail(what + ": the address and size must be multiples of the granularity (" + bytes_str(g) +
         ")");
  }
  if (bytes > kMaxPtr - va) fail(what + ": the range passes the end of the address space");
  const auto r = reservations_.upper_bound(va);
  if (r == reservations_.begin() || std::prev(r)->first + std::prev(r)->second < va + bytes) {
    fail(what + ": the range is not inside one reserved address range");
  }
  auto m = mappings_.lower_bound(va);
  if (m != mappings_.begin() && std::prev(m)->first + std::prev(m)->second.bytes > va) --m;
  if (m != mappings_.end() && m->first < va + bytes) {
    fail(what + ": it overlaps the mapping " + range_str(m->first, m->second.bytes) +
         " of handle " + std::to_string(m->second.handle));
  }
  const auto p = physical_.find(handle);
  if (p == physical_.end()) {
    fail(what + ": no such physical allocation (never created, or already released)");
  }
  if (p->second.bytes != bytes) {
    fail(what + ": the handle has " + bytes_str(p->second.bytes) +
         ", and a mapping covers a whole physical allocation");
  }
  return p->second;
}

void SimDriver::map(DevicePtr va, std::size_t bytes, PhysicalHandle handle) {
  std::lock_guard lock(mutex_);
  const std::string what =
      "map of handle " + std::to_string(handle) + " at " + range_str(va, bytes);
  Physical& p = mapping_target(what, va, bytes, handle);
  if (p.mapped_at != 0)
    fail(what + ": the handle is already mapped at " + hex_address(p.mapped_at));
  if (p.range_mappings != 0) fail(what + ": the handle is already mapped by map_range");
  p.mapped_at = va;
  mappings_.emplace(va, Mapping{bytes, handle});
  ++counters_.maps;
  driver_us_ += options_.cost.map_us + options_.cost.set_access_us;
}

void SimDriver::unmap(DevicePtr va, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  forbid_during_capture("unmap");
  const std::string what = "unmap of " + range_str(va, bytes);
  if (bytes == 0) fail(what + ": the size must be positive");
  if (bytes > kMaxPtr - va) fail(what + ": the range passes the end of the address space");
  // Validate the whole range before changing anything: it must be one or more contiguous
  // mappings, each covered entirely.
  const DevicePtr end = va + bytes;
  auto it = mappings_.find(va);
  if (it == mappings_.end()) {
    const auto next = mappings_.upper_bound(va);
    if (next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second.bytes > va) {
      const auto& [start, m] = *std::prev(next);
      fail(what + ": it starts inside the mapping " + range_str(start, m.bytes) +
           "; unmap whole mappings");
    }
    fail(what + ": nothing is mapped at " + hex_address(va));
  }
  const auto first = it;
  DevicePtr cursor = va;
  while (cursor < end) {
    if (it == mappings_.end() || it->first != cursor) {
      fail(what + ": " + hex_address(cursor) + " is not mapped");
    }
    if (it->first + it->second.bytes > end) {
      fail(what + ": it ends inside the mapping " + range_str(it->first, it->second.bytes) +
           "; unmap whole mappings");
    }
    cursor += it->second.bytes;
    ++it;
  }
  for (auto m = first; m != it; ++m) {
    Physical& p = physical_.at(m->second.handle);
    if (m->second.ranged) {
      --p.range_mappings;
    } else {
      p.mapped_at = 0;
    }
  }
  mappings_.erase(first, it);
  ++counters_.unmaps;
  driver_us_ += options_.cost.unmap_us;
}

void SimDriver::map_range(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                          std::size_t offset) {
  std::lock_guard lock(mutex_);
  const std::string what = "map_range of handle " + std::to_string(handle) + " (offset " +
                           bytes_str(offset) + ") at " + range_str(va, bytes);
  // cuMemMap answers CUDA_ERROR_NOT_SUPPORTED for a non-zero offset (measured on H100 with
  // CUDA 13, bench/gpu/vmm_cost.cpp): a mapping always covers a whole handle from its start.
  if (offset != 0) fail(what + ": CUDA maps a handle from its start only (offset must be 0)");
  Physical& p = mapping_target(what, va, bytes, handle);
  if (p.mapped_at != 0)
    fail(what + ": the handle is mapped by map() at " + hex_address(p.mapped_at));
  ++p.range_mappings;
  mappings_.emplace(va, Mapping{bytes, handle, offset, true});
  ++counters_.maps;
  driver_us_ += options_.cost.map_us + options_.cost.set_access_us;
}

std::vector<SimDriver::MappingInfo> SimDriver::mappings_in(DevicePtr base,
                                                           std::size_t bytes) const {
  std::lock_guard lock(mutex_);
  std::vector<MappingInfo> out;
  for (auto m = mappings_.lower_bound(base); m != mappings_.end() && m->first < base + bytes; ++m)
    out.push_back(MappingInfo{m->first, m->second.bytes, m->second.handle, m->second.offset});
  return out;
}

void SimDriver::add_peer(int peer) {
  std::lock_guard lock(mutex_);
  if (peer < 0 || peer == options_.device) {
    throw DriverError("ccalloc: add_peer(" + std::to_string(peer) + ") on simulated device " +
                      std::to_string(options_.device) + ": a peer is another, existing device");
  }
  if (std::find(peers_.begin(), peers_.end(), peer) == peers_.end()) peers_.push_back(peer);
}

std::vector<int> SimDriver::peers() const {
  std::lock_guard lock(mutex_);
  return peers_;
}

}  // namespace ccalloc::sim
