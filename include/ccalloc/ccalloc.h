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

/* Sharing an allocation with another process (docs/ipc.md). ccalloc_ipc_export writes the
 * handle of the live allocation `ptr` (as ccalloc_malloc returned it): at most `capacity`
 * bytes into `handle`, its full length into `*length` (call with capacity 0 to size it; a
 * handle is a few hundred bytes at most for a few pages). The exporter keeps the
 * allocation live while others use it. ccalloc_ipc_open maps a handle from another process
 * on `device` (-1: current) and gives its address here, valid until ccalloc_ipc_close.
 * A malformed handle (truncated, another version, another device) is
 * CCALLOC_ERROR_INVALID_VALUE with the reason in ccalloc_last_error(). */
ccalloc_status ccalloc_ipc_export(void* ptr, void* handle, size_t capacity, size_t* length);
ccalloc_status ccalloc_ipc_open(const void* handle, size_t length, int device, void** ptr);
ccalloc_status ccalloc_ipc_close(void* ptr);

/* The entry points torch.cuda.memory.CUDAPluggableAllocator calls:
 *   CUDAPluggableAllocator("libccalloc.so", "ccalloc_torch_alloc", "ccalloc_torch_free")
 * ccalloc_torch_alloc returns NULL on failure (the reason in ccalloc_last_error()). */
void* ccalloc_torch_alloc(size_t size, int device, void* stream);
void ccalloc_torch_free(void* ptr, size_t size, int device, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* CCALLOC_CCALLOC_H_ */
