/* The sleep and wake entry points of libccalloc_torch.so (sleep_api.cpp; docs/sleep-wake.md,
 * "PyTorch"), which ccalloc_torch.SleepablePool calls through ctypes.
 *
 * A pool is named as PyTorch names it, MemPool.id = (first, second), on the device it was
 * created on (-1: the current device). Each function but the first returns 0 on success;
 * else it writes ccalloc's message into `error` (NUL-terminated, at most `capacity` bytes)
 * and returns 1, or 2 for an out-of-memory (a wake the device cannot serve, a save without
 * pinned host memory). Every one fails while ccalloc is not installed natively. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What ccalloc_torch_pool_sleep_info reports (ccalloc::PoolSleepInfo). */
struct ccalloc_torch_sleep_info {
  int asleep;
  size_t segment_bytes;  /* the pool's segments (reserved address ranges) */
  size_t physical_bytes; /* of which backed by physical memory now (0 while asleep) */
  size_t saved_bytes;    /* pinned host memory holding saved contents (while asleep) */
  size_t live_bytes;     /* the pool's live allocations (block sizes) */
};

/* With enable != 0: the next pool PyTorch creates on the calling thread (the constructor of
 * torch.cuda.MemPool(), through createOrIncrefPool) is created sleepable. With enable == 0:
 * clears the request. Returns 1 when a request was still pending before the call (no pool
 * was created since it was made), else 0. */
int ccalloc_torch_request_sleepable_pool(int enable);
/* Releases the physical memory of sleepable pool (first, second); with save_contents != 0
 * the bytes of its live allocations are kept in pinned host memory until the wake. */
int ccalloc_torch_pool_sleep(int device, uint64_t first, uint64_t second, int save_contents,
                             char* error, size_t capacity);
/* Maps memory at the sleeping pool's addresses again and restores the saved bytes. */
int ccalloc_torch_pool_wake(int device, uint64_t first, uint64_t second, char* error,
                            size_t capacity);
/* *asleep receives 1 while the pool sleeps, else 0 (also for a pool that is not sleepable). */
int ccalloc_torch_pool_is_asleep(int device, uint64_t first, uint64_t second, int* asleep,
                                 char* error, size_t capacity);
int ccalloc_torch_pool_sleep_info(int device, uint64_t first, uint64_t second,
                                  struct ccalloc_torch_sleep_info* info, char* error,
                                  size_t capacity);

#ifdef __cplusplus
}
#endif
