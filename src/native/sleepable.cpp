#include "native/sleepable.hpp"

#include <utility>

namespace ccalloc::core {

SleepableSegments::~SleepableSegments() {
  Lock lock(mutex_);
  for (const auto& [base, seg] : segments_) {
    if (seg.handle != 0) {
      driver_.unmap(base, seg.bytes);
      driver_.release_physical(seg.handle, seg.bytes);
    }
    driver_.free_address_range(base, seg.bytes);
  }
  segments_.clear();
  lock.unlock();
  drop_saved();
}

std::size_t SleepableSegments::rounded(std::size_t bytes) {
  std::size_t g = 0;
  {
    Lock lock(mutex_);
    g = granularity_;
  }
  if (g == 0) {
    g = driver_.vm_granularity();
    Lock lock(mutex_);
    granularity_ = g;
  }
  return (bytes + g - 1) / g * g;
}

DevicePtr SleepableSegments::allocate(std::size_t bytes) {
  const std::size_t size = rounded(bytes);
  const DevicePtr base = driver_.reserve_address_range(size);
  const PhysicalHandle handle = driver_.create_physical(size);
  if (handle == 0) {
    driver_.free_address_range(base, size);
    return 0;
  }
  try {
    driver_.map(base, size, handle);
  } catch (...) {
    driver_.release_physical(handle, size);
    driver_.free_address_range(base, size);
    throw;
  }
  Lock lock(mutex_);
  segments_[base] = Segment{bytes, size, handle};
  return base;
}

void SleepableSegments::free(DevicePtr base, std::size_t /*bytes*/) {
  Segment seg;
  {
    Lock lock(mutex_);
    const auto it = segments_.find(base);
    if (it == segments_.end()) return;
    seg = it->second;
    segments_.erase(it);
  }
  if (seg.handle != 0) {
    // Unmapping does not wait for the work that used the range (cudaFree would): the
    // segment's stream is not known here, so the whole device is waited for.
    driver_.synchronize_device();
    driver_.unmap(base, seg.bytes);
    driver_.release_physical(seg.handle, seg.bytes);
  }
  driver_.free_address_range(base, seg.bytes);
}

void SleepableSegments::unback(DevicePtr base) {
  Segment seg;
  {
    Lock lock(mutex_);
    const auto it = segments_.find(base);
    if (it == segments_.end() || it->second.handle == 0) return;
    seg = it->second;
  }
  driver_.unmap(base, seg.bytes);
  driver_.release_physical(seg.handle, seg.bytes);
  Lock lock(mutex_);
  segments_[base].handle = 0;
}

bool SleepableSegments::back(DevicePtr base) {
  std::size_t bytes = 0;
  {
    Lock lock(mutex_);
    const auto it = segments_.find(base);
    if (it == segments_.end() || it->second.handle != 0) return true;
    bytes = it->second.bytes;
  }
  const PhysicalHandle handle = driver_.create_physical(bytes);
  if (handle == 0) return false;
  try {
    driver_.map(base, bytes, handle);
  } catch (...) {
    driver_.release_physical(handle, bytes);
    throw;
  }
  Lock lock(mutex_);
  segments_[base].handle = handle;
  return true;
}

bool SleepableSegments::backed(DevicePtr base) const {
  Lock lock(mutex_);
  const auto it = segments_.find(base);
  return it != segments_.end() && it->second.handle != 0;
}

bool SleepableSegments::holds(DevicePtr base, std::size_t bytes) const {
  Lock lock(mutex_);
  const auto it = segments_.find(base);
  return it != segments_.end() && it->second.requested == bytes;
}

std::size_t SleepableSegments::segment_bytes() const {
  Lock lock(mutex_);
  std::size_t n = 0;
  for (const auto& [base, seg] : segments_)
    n += seg.bytes;
  return n;
}

std::size_t SleepableSegments::physical_bytes() const {
  Lock lock(mutex_);
  std::size_t n = 0;
  for (const auto& [base, seg] : segments_)
    n += seg.handle != 0 ? seg.bytes : 0;
  return n;
}

std::size_t SleepableSegments::segment_count() const {
  Lock lock(mutex_);
  return segments_.size();
}

void SleepableSegments::drop_saved() {
  if (saved_.host != nullptr) driver_.free_host(saved_.host, saved_.bytes);
  saved_ = Saved{};
}

}  // namespace ccalloc::core
