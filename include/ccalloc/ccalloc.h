/* ccalloc C API: the process-wide caching allocator over CUDA devices.
 *
 * Every function returns a status; on failure ccalloc_last_error() gives a readable
 * message for the calling thread. No C++ exception crosses this boundary. Streams are
 * cudaStream_t values passed as void* (NULL is the legacy default stream). `device` -1 is
 * the calling thread's current device. Thread safe.
 */
#ifndef CCALLOC_CCALLOC_H_
#define CCALLOC_CCALLOC_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  CCALLOC_SUCCESS = 0,
  CCALLOC_ERROR_OUT_OF_MEMORY = 1,
  CCALLOC_ERROR_INVALID_POINTER = 2,
  CCALLOC_ERROR_INVALID_VALUE = 3,
  CCALLOC_ERROR_CONFIG = 4,
  CCALLOC_ERROR_DRIVER = 5,
  CCALLOC_ERROR_INTERNAL = 6
} ccalloc_status;

/* The message of the calling thread's last failure ("" if none). Valid until the thread's
 * next ccalloc call. */
const char* ccalloc_last_error(void);
const char* ccalloc_version(void);

ccalloc_status ccalloc_malloc(void** ptr, size_t size, int device, void* stream);
ccalloc_status ccalloc_free(void* ptr);
ccalloc_status ccalloc_record_stream(void* ptr, void* stream);
/* device -2: every device. */
ccalloc_status ccalloc_empty_cache(int device);
/* One memory_stats() value by its PyTorch key, e.g. "allocated_bytes.all.peak". */
ccalloc_status ccalloc_get_stat(int device, const char* key, int64_t* value);
/* memory_stats() as a JSON object. Writes at most `capacity` bytes including the final NUL;
 * `*length` receives the full length without the NUL (call with capacity 0 to size). */
ccalloc_status ccalloc_memory_stats_json(int device, char* buffer, size_t capacity,
                                         size_t* length);
/* memory_summary() text; same buffer convention. */
ccalloc_status ccalloc_memory_summary(int device, int abbreviated, char* buffer,
                                      size_t capacity, size_t* length);
ccalloc_status ccalloc_reset_peak_stats(int device);
ccalloc_status ccalloc_reset_accumulated_stats(int device);
ccalloc_status ccalloc_set_memory_fraction(double fraction, int device);
ccalloc_status ccalloc_mem_get_info(int device, size_t* free_bytes, size_t* total_bytes);

/* Allocation history on every device: enabled "none" | "state" | "all", context
 * "none" | "state" | "alloc" | "all", stacks "cpp" | "none" (C++ stacks, symbolized when a
 * snapshot is written). max_entries bounds the history kept per device. */
ccalloc_status ccalloc_record_history(const char* enabled, const char* context,
                                      const char* stacks, size_t max_entries);
/* Writes a snapshot of every device (segments, history, settings) in PyTorch's schema:
 * a pickle, or JSON if the path ends in .json; gzip if it ends in .gz. */
ccalloc_status ccalloc_dump_snapshot(const char* path);
/* Marks the start (start != 0) or end of a named region in the history of `device`. */
ccalloc_status ccalloc_annotate(int device, const char* name, int start);

/* Private memory pools (CUDA graph capture, MemPools), as ccalloc::Allocator's create_pool
 * and the rest: a pool's segments serve only allocations made to it. Pool ids are PyTorch's
 * MempoolId_t; {0, 0} (the default pool) is an invalid value here. */
typedef struct {
  uint64_t first;
  uint64_t second;
} ccalloc_pool_id;
/* Creates the pool with use count 1, or adds one use. */
ccalloc_status ccalloc_pool_create(int device, ccalloc_pool_id pool);
/* Drops one use; at 0 the pool's cached segments go back at the next empty cache. */
ccalloc_status ccalloc_pool_release(int device, ccalloc_pool_id pool);
ccalloc_status ccalloc_pool_use_count(int device, ccalloc_pool_id pool, int* count);
/* Returns nonzero when an allocation on `stream` should come from the pool. */
typedef int (*ccalloc_stream_filter)(void* stream, void* user_data);
/* Until ccalloc_pool_end_allocate, allocations on the streams `filter` accepts come from the
 * pool (created or given a use). filter NULL: the streams being captured into a CUDA graph
 * (cudaStreamIsCapturing). Call it before cudaStreamBeginCapture: while allocating to a
 * pool the allocator records and queries no events and frees no device memory. */
ccalloc_status ccalloc_pool_begin_allocate(int device, ccalloc_pool_id pool,
                                           ccalloc_stream_filter filter, void* user_data);
ccalloc_status ccalloc_pool_end_allocate(int device, ccalloc_pool_id pool);
/* Returns the pool's cached, wholly free segments if its use count is 0. */
ccalloc_status ccalloc_pool_empty_cache(int device, ccalloc_pool_id pool);

/* The entry points torch.cuda.memory.CUDAPluggableAllocator calls:
 *   CUDAPluggableAllocator("libccalloc.so", "ccalloc_torch_alloc", "ccalloc_torch_free")
 * ccalloc_torch_alloc returns NULL on failure (the reason in ccalloc_last_error()). */
void* ccalloc_torch_alloc(size_t size, int device, void* stream);
void ccalloc_torch_free(void* ptr, size_t size, int device, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* CCALLOC_CCALLOC_H_ */
