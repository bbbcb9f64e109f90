// The sleep and wake entry points of libccalloc_torch.so (sleep_api.h): they reach the
// engine behind the installed adapter (native_allocator, torch_allocator.cpp) through
// pool_bridge.hpp, and turn every exception into a status and ccalloc's message.
#include "sleep_api.h"

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

#define CCALLOC_TORCH_EXPORT __attribute__((visibility("default")))

extern "C" {

CCALLOC_TORCH_EXPORT int ccalloc_torch_request_sleepable_pool(int enable) {
  return bridge::request_sleepable_pool(enable != 0) ? 1 : 0;
}

CCALLOC_TORCH_EXPORT int ccalloc_torch_pool_sleep(int device, std::uint64_t first,
                                                  std::uint64_t second, int save_contents,
                                                  char* error, std::size_t capacity) {
  return guarded(device, error, capacity, [&](ccalloc::Allocator& a) {
    bridge::sleep_pool(a, {first, second}, save_contents != 0);
  });
}

CCALLOC_TORCH_EXPORT int ccalloc_torch_pool_wake(int device, std::uint64_t first,
                                                 std::uint64_t second, char* error,
                                                 std::size_t capacity) {
  return guarded(device, error, capacity, [&](ccalloc::Allocator& a) {
    bridge::wake_pool(a, {first, second});
  });
}

CCALLOC_TORCH_EXPORT int ccalloc_torch_pool_is_asleep(int device, std::uint64_t first,
                                                      std::uint64_t second, int* asleep,
                                                      char* error, std::size_t capacity) {
  if (asleep == nullptr) {
    copy_message("ccalloc_torch_pool_is_asleep: asleep is NULL", error, capacity);
    return kError;
  }
  return guarded(device, error, capacity, [&](ccalloc::Allocator& a) {
    *asleep = bridge::pool_asleep(a, {first, second}) ? 1 : 0;
  });
}

CCALLOC_TORCH_EXPORT int ccalloc_torch_pool_sleep_info(int device, std::uint64_t first,
                                                       std::uint64_t second,
                                                       ccalloc_torch_sleep_info* info, char* error,
                                                       std::size_t capacity) {
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
