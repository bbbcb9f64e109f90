// The simulated GPU's glue: options, the capacity the three models share, the virtual clock,
// counters and cost, and device-wide synchronization. The models: device_model.cpp
// (addresses, device allocations, streams and events), vmm_model.cpp (virtual memory) and
// pool_model.cpp (the stream-ordered pool). Model and contracts: include/ccalloc/sim.hpp and
// docs/simulated-gpu.md.
//
// Invariants, all under mutex_ (each model's own are in its file):
//   used_ + physical_bytes_ + pool_pages_ * vm_granularity <= capacity: device allocations,
//   physical allocations and the pool's reserved pages all count against it, and each model
//   checks device_used() before it takes memory.
#include <chrono>
#include <string>
#include <utility>

#include "drivers/sim/sim_common.hpp"

namespace ccalloc::sim {
namespace {

bool is_power_of_two(std::size_t n) {
  return n != 0 && (n & (n - 1)) == 0;
}

void check_options(const Options& o) {
  if (o.alignment == 0 || (o.alignment & (o.alignment - 1)) != 0) {
    throw DriverError("ccalloc: " + device_label(o.device) + ": alignment " +
                      std::to_string(o.alignment) + " bytes is not a power of two");
  }
  // 0 means OOM to every caller, so no range may start there.
  if (o.base_address == 0 || o.vm_base_address == 0 || o.pool_base_address == 0) {
    throw DriverError("ccalloc: " + device_label(o.device) +
                      ": base_address, vm_base_address and pool_base_address must be non-zero, "
                      "because 0 is the OOM value");
  }
  // Small pool allocations (< 1 MiB) must fit in one page.
  if (!is_power_of_two(o.vm_granularity) || o.vm_granularity < kPoolSmallLimit) {
    throw DriverError("ccalloc: " + device_label(o.device) + ": vm_granularity " +
                      std::to_string(o.vm_granularity) +
                      " bytes is not a power of two of at least 1 MiB");
  }
  if (!(o.cost.copy_bytes_per_us > 0.0)) {
    throw DriverError("ccalloc: " + device_label(o.device) + ": cost.copy_bytes_per_us " +
                      std::to_string(o.cost.copy_bytes_per_us) + " is not positive");
  }
}

}  // namespace

SimDriver::SimDriver(Options options) : options_(std::move(options)) {
  check_options(options_);
}

SimDriver::~SimDriver() = default;

std::size_t SimDriver::device_used() const {
  return used_ + physical_bytes_ + pool_pages_ * options_.vm_granularity;
}

void SimDriver::fail(const std::string& what) const {
  throw DriverError("ccalloc: " + what + " on " + device_label(options_.device));
}

std::int64_t SimDriver::steady_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void SimDriver::set_time_us(std::int64_t t) {
  time_us_.store(options_.wall_clock ? t - steady_us() : t, std::memory_order_relaxed);
}

std::int64_t SimDriver::clock_us() const {
  const std::int64_t t = time_us_.load(std::memory_order_relaxed);
  return options_.wall_clock ? t + steady_us() : t;
}

// Read without the mutex: trace entries stamp every allocator action with it.
std::int64_t SimDriver::now_us() {
  // Counted for tests of the wall-clock path only: a replay reads it on every free of a
  // stream that shares.
  if (options_.wall_clock) clock_reads_.fetch_add(1, std::memory_order_relaxed);
  return clock_us();
}

Counters SimDriver::counters() const {
  std::lock_guard lock(mutex_);
  return counters_;
}

double SimDriver::simulated_driver_us() const {
  std::lock_guard lock(mutex_);
  return driver_us_;
}

std::size_t SimDriver::used_bytes() const {
  std::lock_guard lock(mutex_);
  return device_used();
}

std::string SimDriver::name() const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%s (%.2f GiB)", device_label(options_.device).c_str(),
                static_cast<double>(options_.capacity) / static_cast<double>(kGiB));
  return buf;
}

void SimDriver::synchronize_device() {
  std::lock_guard lock(mutex_);
  forbid_during_capture("synchronize_device");
  for (auto& [id, s] : streams_)
    s.completed = s.recorded;
  // Every free has completed: freed pool ranges are plain address space again.
  std::erase_if(pool_slots_, [](const auto& entry) { return !entry.second.live; });
  ++counters_.device_synchronizes;
  driver_us_ += options_.cost.synchronize_us;
}

}  // namespace ccalloc::sim
