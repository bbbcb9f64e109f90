// Sleep and wake of torch.cuda.MemPool pools (docs/sleep-wake.md, "PyTorch"): the C entry
// points of libccalloc_torch.so that ccalloc_torch.SleepablePool calls through ctypes.
//
// A pool is named as PyTorch names it, MemPool.id = (first, second), on the device it was
// created on (-1: the current device). Each function returns 0 on success; else it writes
// ccalloc's message into `error` (NUL-terminated, at most `capacity` bytes) and returns 1,
// or 2 for an out-of-memory (a wake the device cannot serve, a save without pinned host
// memory), which Python raises as torch.OutOfMemoryError.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>

#include "ccalloc/allocator.hpp"
#include "ccalloc/errors.hpp"
#include "pool_bridge.hpp"

namespace {

namespace bridge = ccalloc::torch_bridge;

constexpr int kOk = 0;
constexpr int kError = 1;
constexpr int kOutOfMemory = 2;

void copy_message(const char* message, char* error, std::size_t capacity) {
  if (error != nullptr && capacity > 0) {
    std::strncpy(error, message, capacity - 1);
    error[capacity - 1] = '\0';
  }
}

// Runs `fn` against the engine of `device`, turning every exception into a status and a
// message (nothing may unwind into ctypes).
template <typename Fn>
int guarded(int device, char* error, std::size_t capacity, Fn&& fn) noexcept {
  try {
    fn(bridge::native_allocator(device));
    return kOk;
  } catch (const ccalloc::OutOfMemoryError& e) {
    copy_message(e.what(), error, capacity);
    return kOutOfMemory;
  } catch (const std::exception& e) {  // ccalloc::Error, and c10::Error from the device checks
    copy_message(e.what(), error, capacity);
  } catch (...) {
    copy_message("ccalloc: unknown exception", error, capacity);
  }
  return kError;
}

}  // namespace

extern "C" {

// What ccalloc_torch_pool_sleep_info reports (ccalloc::PoolSleepInfo).
struct ccalloc_torch_sleep_info {
  int asleep;
  std::size_t segment_bytes;   // the pool's segments (reserved address ranges)
  std::size_t physical_bytes;  // of which backed by physical memory now (0 while asleep)
  std::size_t saved_bytes;     // pinned host memory holding saved contents (while asleep)
  std::size_t live_bytes;      // the pool's live allocations (block sizes)
};

// With enable != 0: the next pool PyTorch creates on the calling thread (the constructor of
// torch.cuda.MemPool(), through createOrIncrefPool) is created sleepable. With enable == 0:
// clears the request. Returns 1 when a request was still pending before the call (no pool
// was created since it was made), else 0.
__attribute__((visibility("default"))) int ccalloc_torch_request_sleepable_pool(int enable) {
  return bridge::request_sleepable_pool(enable != 0) ? 1 : 0;
}

// Releases the physical memory of sleepable pool (first, second); with save_contents != 0
// the bytes of its live allocations are kept in pinned host memory until the wake.
__attribute__((visibility("default"))) int ccalloc_torch_pool_sleep(int device, std::uint64_t first,
                                                                    std::uint64_t second,
                                                                    int save_contents, char* error,
                                                                    std::size_t capacity) {
  return guarded(device, error, capacity, [&](ccalloc::Allocator& a) {
    bridge::sleep_pool(a, {first, second}, save_contents != 0);
  });
}

// Maps memory at the sleeping pool's addresses again and restores the saved bytes.
__attribute__((visibility("default"))) int ccalloc_torch_pool_wake(int device, std::uint64_t first,
                                                                   std::uint64_t second,
                                                                   char* error,
                                                                   std::size_t capacity) {
  return guarded(device, error, capacity, [&](ccalloc::Allocator& a) {
    bridge::wake_pool(a, {first, second});
  });
}

// *asleep receives 1 while the pool sleeps, else 0.
__attribute__((visibility("default"))) int ccalloc_torch_pool_is_asleep(int device,
                                                                        std::uint64_t first,
                                                                        std::uint64_t second,
                                                                        int* asleep, char* error,
                                                                        std::size_t capacity) {
  if (asleep == nullptr) {
    copy_message("ccalloc_torch_pool_is_asleep: asleep is NULL", error, capacity);
    return kError;
  }
  return guarded(device, error, capacity, [&](ccalloc::Allocator& a) {
    *asleep = bridge::pool_asleep(a, {first, second}) ? 1 : 0;
  });
}

__attribute__((visibility("default"))) int ccalloc_torch_pool_sleep_info(
    int device, std::uint64_t first, std::uint64_t second, ccalloc_torch_sleep_info* info,
    char* error, std::size_t capacity) {
  if (info == nullptr) {
    copy_message("ccalloc_torch_pool_sleep_info: info is NULL", error, capacity);
    return kError;
  }
  return guarded(device, error, capacity, [&](ccalloc::Allocator& a) {
    const ccalloc::PoolSleepInfo i = bridge::pool_sleep_info(a, {first, second});
    info->asleep = i.asleep ? 1 : 0;
    info->segment_bytes = i.segment_bytes;
    info->physical_bytes = i.physical_bytes;
    info->saved_bytes = i.saved_bytes;
    info->live_bytes = i.live_bytes;
  });
}

}  // extern "C"
