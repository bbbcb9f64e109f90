// The process-wide entry point: one Allocator per device, created on first use.
//
// One per process: libccalloc.so holds it, and the C API, C++ programs linking the shared
// library and the PyTorch adapter (libccalloc_torch.so, which links libccalloc.so) all reach
// the same instance, so memory allocated through one route is seen by every other.
//
//   auto& cc = ccalloc::ProcessAllocator::instance();   // real GPUs, CCALLOC_CONF
//   void* p = reinterpret_cast<void*>(cc.malloc(bytes, stream));
//   cc.free(reinterpret_cast<ccalloc::DevicePtr>(p));    // any thread, any current device
//
// A pointer freed from any thread, whatever device is current, goes back to the allocator
// of the device that allocated it. All methods are thread safe. `device` -1 means the
// calling thread's current device.
//
// Nothing happens at construction: the device count and the configuration are read at the
// first call that needs them (as PyTorch reads its own at its lazy CUDA initialization), so
// a process may take the instance, set its variables and fork before any CUDA call.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "ccalloc/allocator.hpp"
#include "ccalloc/snapshot.hpp"

namespace ccalloc {

class ProcessAllocator {
 public:
  // Where devices come from: real CUDA devices for instance(); a simulated machine in tests.
  // `count` is asked once, at the first call that needs it.
  struct Devices {
    std::function<int()> count;
    std::function<std::unique_ptr<Driver>(int device)> make_driver;
    std::function<int()> current_device;
  };
  static constexpr int kMaxDevices = 64;

  // The process's allocator over CUDA devices, with Config::from_environment() read at
  // the first call that needs a config. Throws ConfigError for a malformed environment
  // config (on that call). Taking the instance makes no CUDA call.
  static ProcessAllocator& instance();

  ProcessAllocator(Devices devices, Config config);
  // The config is `source()`, called once, at the first call that needs it.
  ProcessAllocator(Devices devices, std::function<Config()> source);
  ~ProcessAllocator();
  ProcessAllocator(const ProcessAllocator&) = delete;
  ProcessAllocator& operator=(const ProcessAllocator&) = delete;

  // Inline where one device is visible (the allocator's own call is all that remains).
  DevicePtr malloc(std::size_t size, StreamId stream = 0, int device = -1) {
    if (Allocator* a = only_.load(std::memory_order_acquire);
        a != nullptr && (device == -1 || device == 0)) [[likely]] {
      return a->malloc(size, stream);
    }
    return malloc_routed(size, stream, device);
  }
  void free(DevicePtr ptr) {
    if (Allocator* a = only_.load(std::memory_order_acquire)) [[likely]] {
      a->free(ptr);  // throws InvalidPointerError for a pointer it does not hold
      return;
    }
    free_routed(ptr);
  }
  void record_stream(DevicePtr ptr, StreamId stream);
  // Empties the cache of one device, or of every device created so far (-2).
  void empty_cache(int device = kAllDevices);
  DeviceStats stats(int device = -1);
  std::string memory_summary(int device = -1, bool abbreviated = false);
  void reset_peak_stats(int device = -1);
  void reset_accumulated_stats(int device = -1);
  void set_memory_fraction(double fraction, int device = -1);
  MemInfo mem_get_info(int device = -1);

  // Records history on every device, including ones first used later.
  void record_history(const HistoryOptions& options);
  // Every device's segments and history in one snapshot (device_traces[d] for device d).
  Snapshot snapshot();

  // Sleepable pools (Allocator::create_sleepable_pool and the rest, docs/sleep-wake.md) on
  // `device` (-1: current).
  void create_sleepable_pool(PoolId id, int device = -1);
  void sleep_pool(PoolId id, SleepMode mode, int device = -1);
  void wake_pool(PoolId id, int device = -1);
  bool pool_asleep(PoolId id, int device = -1);

  // The allocator of `device` (-1: current), created on first use. Throws DriverError for
  // a device that does not exist.
  Allocator& allocator(int device = -1);
  // The device whose allocator holds `ptr` live, or -1.
  int device_of(DevicePtr ptr);
  // The allocator of `device` if it was created, else nullptr (never creates one).
  Allocator* existing(int device) const;
  // The visible devices (asked once, on the first call that needs them).
  int device_count() const;
  // Whether the config has been read (a call needed it, or set_config set it).
  bool config_resolved() const;
  // The config that devices first used from now on get (read now if it was not yet).
  Config config() const;
  // Sets the config of devices first used from now on (live allocators keep theirs; the
  // PyTorch adapter reconfigures those itself when PyTorch's settings change).
  void set_config(const Config& config);

  static constexpr int kAllDevices = -2;

 private:
  struct Slot {
    std::unique_ptr<Driver> driver;
    std::unique_ptr<Allocator> allocator;
  };
  int resolve(int device) const;
  // malloc and free where more than one device is visible, or before the first allocator.
  DevicePtr malloc_routed(std::size_t size, StreamId stream, int device);
  void free_routed(DevicePtr ptr);
  const Config& config_locked() const;  // create_mutex_ held

  const Devices devices_;
  mutable std::once_flag counted_;
  mutable std::atomic<int> count_{-1};  // -1 until asked (once, under counted_)
  mutable std::mutex create_mutex_;
  const std::function<Config()> source_;  // where config_ comes from, when it is not given
  mutable std::optional<Config> config_;   // guarded by create_mutex_
  std::optional<HistoryOptions> history_;  // guarded by create_mutex_
  std::array<Slot, kMaxDevices> slots_;
  std::array<std::atomic<Allocator*>, kMaxDevices> allocators_{};
  // The one device with an allocator while there is exactly one (the common case: frees
  // need no search); -1 before the first, -2 once there are several.
  std::atomic<int> sole_device_{-1};
  // The allocator of the only visible device, once made: a malloc for the current device
  // (or device 0) and every free go straight to it, with no count, range or table read.
  std::atomic<Allocator*> only_{nullptr};
};

}  // namespace ccalloc
