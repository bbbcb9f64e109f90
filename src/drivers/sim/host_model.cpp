// Pinned host memory and synchronous copies between host and device, for sleeping pools
// (docs/simulated-gpu.md, "Host memory and copies").
#include <cstdlib>
#include <string>

#include "drivers/sim/sim_common.hpp"

namespace ccalloc::sim {

void* SimDriver::allocate_host(std::size_t bytes) {
  {
    std::lock_guard lock(mutex_);
    ++counters_.host_allocates;
    driver_us_ += options_.cost.host_allocate_us;
    if (bytes > options_.host_capacity - host_bytes_) {
      ++counters_.host_allocate_failures;
      return nullptr;
    }
    host_bytes_ += bytes;
  }
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  std::lock_guard lock(mutex_);
  if (p == nullptr) {
    host_bytes_ -= bytes;
    ++counters_.host_allocate_failures;
    return nullptr;
  }
  host_[p] = bytes;
  return p;
}

void SimDriver::free_host(void* ptr, std::size_t bytes) {
  {
    std::lock_guard lock(mutex_);
    const auto it = host_.find(ptr);
    if (it == host_.end()) {
      fail("free_host of " + hex_address(reinterpret_cast<DevicePtr>(ptr)) +
           ": not host memory from allocate_host");
    }
    if (it->second != bytes) {
      fail("free_host of " + hex_address(reinterpret_cast<DevicePtr>(ptr)) + " with " +
           bytes_str(bytes) + ": it has " + bytes_str(it->second));
    }
    host_bytes_ -= bytes;
    host_.erase(it);
    ++counters_.host_frees;
    driver_us_ += options_.cost.host_free_us;
  }
  std::free(ptr);
}

std::size_t SimDriver::host_bytes() const {
  std::lock_guard lock(mutex_);
  return host_bytes_;
}

void SimDriver::charge_copy(const char* what, std::size_t bytes, std::uint64_t& copies,
                            std::uint64_t& copied) {
  forbid_during_capture(what);
  ++copies;
  copied += bytes;
  driver_us_ +=
      options_.cost.copy_latency_us + static_cast<double>(bytes) / options_.cost.copy_bytes_per_us;
}

void SimDriver::copy_to_host(void* dst, DevicePtr src, std::size_t bytes) {
  {
    std::lock_guard lock(mutex_);
    charge_copy("copy_to_host", bytes, counters_.copies_to_host, counters_.bytes_to_host);
  }
  read(src, dst, bytes);
}

void SimDriver::copy_to_device(DevicePtr dst, const void* src, std::size_t bytes) {
  {
    std::lock_guard lock(mutex_);
    charge_copy("copy_to_device", bytes, counters_.copies_to_device, counters_.bytes_to_device);
  }
  write(dst, src, bytes);
}

}  // namespace ccalloc::sim
