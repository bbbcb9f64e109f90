#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "ccalloc/cuda.hpp"
#include "ccalloc/process.hpp"

namespace ccalloc {

ProcessAllocator& ProcessAllocator::instance() {
  // Deliberately never destroyed: allocations may be freed by other static destructors,
  // and CUDA may already be torn down at exit.
  static ProcessAllocator* const process = [] {
    // No CUDA call and no variable is read here: both wait for the first call that
    // needs them (a process may fork, or set its variables, after taking the instance).
    Devices devices;
    devices.count = [] { return cuda::device_count(); };
    devices.make_driver = [](int device) { return std::make_unique<cuda::CudaDriver>(device); };
    devices.current_device = [] { return cuda::current_device(); };
    return new ProcessAllocator(std::move(devices), [] { return Config::from_environment(); });
  }();
  return *process;
}

ProcessAllocator::ProcessAllocator(Devices devices, Config config)
    : devices_(std::move(devices)), config_(std::move(config)) {}

ProcessAllocator::ProcessAllocator(Devices devices, std::function<Config()> source)
    : devices_(std::move(devices)), source_(std::move(source)) {}

ProcessAllocator::~ProcessAllocator() = default;

int ProcessAllocator::device_count() const {
  const int known = count_.load(std::memory_order_acquire);
  if (known >= 0) return known;
  std::call_once(counted_, [this] {
    count_.store(devices_.count ? std::max(devices_.count(), 0) : 0, std::memory_order_release);
  });
  return count_.load(std::memory_order_acquire);
}

int ProcessAllocator::resolve(int device) const {
  const int count = device_count();
  // With one device visible it is the current one: no runtime call (cudaGetDevice costs
  // about a third of a cached malloc and free through this API).
  if (device == -1) device = count == 1 ? 0 : devices_.current_device();
  if (device < 0 || device >= count || device >= kMaxDevices) {
    throw DriverError("ccalloc: device " + std::to_string(device) + " does not exist (" +
                      std::to_string(count) + " visible)");
  }
  return device;
}

const Config& ProcessAllocator::config_locked() const {
  if (!config_) {
    // A malformed variable throws here and is read again at the next call.
    config_ = source_ ? source_() : Config{};
  }
  return *config_;
}

bool ProcessAllocator::config_resolved() const {
  std::lock_guard lock(create_mutex_);
  return config_.has_value();
}

Allocator* ProcessAllocator::existing(int device) const {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return allocators_[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
}

Config ProcessAllocator::config() const {
  std::lock_guard lock(create_mutex_);
  return config_locked();
}

void ProcessAllocator::set_config(const Config& config) {
  std::lock_guard lock(create_mutex_);
  config_ = config;
}

Allocator& ProcessAllocator::allocator(int device) {
  device = resolve(device);
  if (Allocator* a = existing(device)) return *a;
  std::lock_guard lock(create_mutex_);
  if (Allocator* a = existing(device)) return *a;
  Slot& slot = slots_[static_cast<std::size_t>(device)];
  slot.driver = devices_.make_driver(device);
  slot.allocator = std::make_unique<Allocator>(*slot.driver, config_locked());
  if (history_) slot.allocator->record_history(*history_);
  allocators_[static_cast<std::size_t>(device)].store(slot.allocator.get(),
                                                      std::memory_order_release);
  sole_device_.store(sole_device_.load() == -1 ? device : -2, std::memory_order_release);
  if (device_count() == 1) only_.store(slot.allocator.get(), std::memory_order_release);
  return *slot.allocator;
}

int ProcessAllocator::device_of(DevicePtr ptr) {
  if (ptr == 0) return -1;
  const int n = std::min(device_count(), kMaxDevices);
  // The current device is the likely owner; try it first.
  int current = -1;
  try {
    current = devices_.current_device();
  } catch (const Error&) {
  }
  if (current >= 0 && current < n) {
    if (Allocator* a = existing(current); a != nullptr && a->allocation_size(ptr) != 0) {
      return current;
    }
  }
  for (int d = 0; d < n; ++d) {
    if (d == current) continue;
    if (Allocator* a = existing(d); a != nullptr && a->allocation_size(ptr) != 0) return d;
  }
  return -1;
}

DevicePtr ProcessAllocator::malloc_routed(std::size_t size, StreamId stream, int device) {
  return allocator(device).malloc(size, stream);
}

void ProcessAllocator::free_routed(DevicePtr ptr) {
  if (ptr == 0) return;
  if (const int sole = sole_device_.load(std::memory_order_acquire); sole >= 0) {
    existing(sole)->free(ptr);  // throws InvalidPointerError for a pointer it does not hold
    return;
  }
  const int device = device_of(ptr);
  if (device < 0) {
    char buf[200];
    std::snprintf(buf, sizeof buf,
                  "ccalloc: free of pointer 0x%" PRIxPTR
                  ", which is not a live allocation on any device: it was never returned by "
                  "malloc, or it was already freed",
                  ptr);
    throw InvalidPointerError(buf, ptr);
  }
  existing(device)->free(ptr);
}

void ProcessAllocator::record_stream(DevicePtr ptr, StreamId stream) {
  const int device = device_of(ptr);
  if (device < 0) {
    char buf[200];
    std::snprintf(buf, sizeof buf,
                  "ccalloc: record_stream of pointer 0x%" PRIxPTR
                  ", which is not a live allocation on any device",
                  ptr);
    throw InvalidPointerError(buf, ptr);
  }
  existing(device)->record_stream(ptr, stream);
}

void ProcessAllocator::empty_cache(int device) {
  if (device != kAllDevices) {
    allocator(device).empty_cache();
    return;
  }
  for (int d = 0; d < std::min(device_count(), kMaxDevices); ++d) {
    if (Allocator* a = existing(d)) a->empty_cache();
  }
}

DeviceStats ProcessAllocator::stats(int device) {
  return allocator(device).stats();
}

std::string ProcessAllocator::memory_summary(int device, bool abbreviated) {
  return allocator(device).memory_summary(abbreviated);
}

void ProcessAllocator::reset_peak_stats(int device) {
  allocator(device).reset_peak_stats();
}

void ProcessAllocator::reset_accumulated_stats(int device) {
  allocator(device).reset_accumulated_stats();
}

void ProcessAllocator::set_memory_fraction(double fraction, int device) {
  allocator(device).set_memory_fraction(fraction);
}

MemInfo ProcessAllocator::mem_get_info(int device) {
  return allocator(device).mem_get_info();
}

void ProcessAllocator::record_history(const HistoryOptions& options) {
  std::lock_guard lock(create_mutex_);
  history_ = options;
  for (int d = 0; d < std::min(device_count(), kMaxDevices); ++d) {
    if (Allocator* a = existing(d)) a->record_history(options);
  }
}

Snapshot ProcessAllocator::snapshot() {
  Snapshot all;
  for (int d = 0; d < std::min(device_count(), kMaxDevices); ++d) {
    Allocator* a = existing(d);
    if (a == nullptr) continue;
    Snapshot one = a->snapshot();
    for (auto& seg : one.segments)
      all.segments.push_back(std::move(seg));
    if (all.device_traces.size() < one.device_traces.size()) {
      all.device_traces.resize(one.device_traces.size());
    }
    all.device_traces[static_cast<std::size_t>(d)] =
        std::move(one.device_traces[static_cast<std::size_t>(d)]);
    for (auto& a2 : one.external_annotations)
      all.external_annotations.push_back(std::move(a2));
    for (auto& p : one.physical)
      all.physical.push_back(std::move(p));
    all.allocator_settings = std::move(one.allocator_settings);
  }
  if (all.device_traces.empty()) all.device_traces.resize(1);
  return all;
}

void ProcessAllocator::create_sleepable_pool(PoolId id, int device) {
  allocator(device).create_sleepable_pool(id);
}

void ProcessAllocator::sleep_pool(PoolId id, SleepMode mode, int device) {
  allocator(device).sleep_pool(id, mode);
}

void ProcessAllocator::wake_pool(PoolId id, int device) {
  allocator(device).wake_pool(id);
}

bool ProcessAllocator::pool_asleep(PoolId id, int device) {
  return allocator(device).pool_asleep(id);
}

}  // namespace ccalloc
