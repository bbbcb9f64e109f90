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
/* Sleepable pools (docs/sleep-wake.md): a private pool whose segments live in CUDA virtual
 * memory, so that its physical memory can be released while its addresses stay reserved
 * (pointers and CUDA graphs that captured them stay valid) and mapped again later.
 * ccalloc_pool_create_sleepable creates the pool with use count 1 or adds a use to an
 * existing sleepable pool; it is then used as any pool (ccalloc_pool_begin_allocate, ...).
 * ccalloc_pool_sleep waits for the device, saves the contents of the pool's live
 * allocations to pinned host memory if save_contents != 0 (else they are discarded), and
 * releases the pool's physical memory; allocating to the pool fails until
 * ccalloc_pool_wake maps memory at the same addresses again and restores the contents.
 * Freeing a sleeping pool's allocations is allowed. Misuse (the pool is unknown, not
 * sleepable, already asleep or awake, being allocated to) is CCALLOC_ERROR_INVALID_VALUE;
 * a wake the device cannot serve is CCALLOC_ERROR_OUT_OF_MEMORY and leaves the pool
 * asleep (as is a sleep that cannot have the pinned host memory to save into, which leaves
 * the pool awake). */
ccalloc_status ccalloc_pool_create_sleepable(int device, ccalloc_pool_id pool);
ccalloc_status ccalloc_pool_sleep(int device, ccalloc_pool_id pool, int save_contents);
ccalloc_status ccalloc_pool_wake(int device, ccalloc_pool_id pool);
/* *asleep receives 1 while the pool sleeps, else 0. */
ccalloc_status ccalloc_pool_is_asleep(int device, ccalloc_pool_id pool, int* asleep);
/* Caller contexts: an opaque handle per allocator operation (a request id, an interpreter's
 * frames, ...) kept in the history beside the C++ stack. `capture` is called where a stack
 * would be captured (context "state" and "alloc": malloc; "all": also free and
 * empty_cache), from any thread, possibly concurrently, with no ccalloc lock held; a NULL
 * result records no context. ccalloc keeps each handle on history entries (context "alloc"
 * and up), on live blocks and on segments, and calls `release` exactly once for every
 * non-NULL handle `capture` returned, as soon as no entry, block, segment or snapshot holds
 * it (so no retain function is needed). `release` may run while ccalloc holds its locks:
 * it must not call ccalloc. `user_data` is passed to both. Otherwise as
 * ccalloc_record_history; `stacks` "none" records the caller's contexts only. */
typedef void* (*ccalloc_context_capture_fn)(void* user_data);
typedef void (*ccalloc_context_release_fn)(void* context, void* user_data);
ccalloc_status ccalloc_record_history_context(const char* enabled, const char* context,
                                              const char* stacks, size_t max_entries,
                                              ccalloc_context_capture_fn capture,
                                              ccalloc_context_release_fn release,
                                              void* user_data);

/* A snapshot of every device, held by the caller: the contexts it reports stay valid (not
 * released) until ccalloc_snapshot_free. */
typedef struct ccalloc_snapshot ccalloc_snapshot;
ccalloc_status ccalloc_snapshot_take(ccalloc_snapshot** snapshot);
void ccalloc_snapshot_free(ccalloc_snapshot* snapshot);

/* Trace actions and block states, in PyTorch's terms. */
typedef enum {
  CCALLOC_TRACE_ALLOC = 0,
  CCALLOC_TRACE_FREE_REQUESTED = 1,
  CCALLOC_TRACE_FREE_COMPLETED = 2,
  CCALLOC_TRACE_SEGMENT_ALLOC = 3,
  CCALLOC_TRACE_SEGMENT_FREE = 4,
  CCALLOC_TRACE_SEGMENT_MAP = 5,
  CCALLOC_TRACE_SEGMENT_UNMAP = 6,
  CCALLOC_TRACE_SNAPSHOT = 7,
  CCALLOC_TRACE_OOM = 8
} ccalloc_trace_action;
typedef enum {
  CCALLOC_BLOCK_ACTIVE_ALLOCATED = 0,
  CCALLOC_BLOCK_ACTIVE_PENDING_FREE = 1,
  CCALLOC_BLOCK_INACTIVE = 2
} ccalloc_block_state;

typedef struct {
  ccalloc_trace_action action;
  uintptr_t addr; /* for OOM: the device's free bytes */
  size_t size;
  void* stream;
  int64_t time_us;
  void* context; /* the caller's context recorded with it, or NULL */
} ccalloc_trace_entry;

typedef struct {
  int device;
  uintptr_t address;
  size_t total_size;
  size_t allocated_size;
  size_t active_size;
  size_t requested_size;
  void* stream;
  int is_small;
  int is_expandable;
  size_t block_count;
  void* context; /* of the device allocation, or NULL */
} ccalloc_segment_info;

typedef struct {
  uintptr_t address;
  size_t size;
  size_t requested_size;
  ccalloc_block_state state;
  void* context; /* of its allocation while active, or NULL */
} ccalloc_block_info;

/* Entry `index` (oldest first) of the history of `device`; *length receives the count. */
ccalloc_status ccalloc_snapshot_trace_length(const ccalloc_snapshot* snapshot, int device,
                                             size_t* length);
ccalloc_status ccalloc_snapshot_trace_entry(const ccalloc_snapshot* snapshot, int device,
                                            size_t index, ccalloc_trace_entry* entry);
/* Segments of every device by address, and the blocks of segment `segment`. */
ccalloc_status ccalloc_snapshot_segment_count(const ccalloc_snapshot* snapshot, size_t* count);
ccalloc_status ccalloc_snapshot_segment(const ccalloc_snapshot* snapshot, size_t index,
                                        ccalloc_segment_info* segment);
ccalloc_status ccalloc_snapshot_block(const ccalloc_snapshot* snapshot, size_t segment,
                                      size_t index, ccalloc_block_info* block);

/* Renders a caller context as frames for snapshot files: calls emit(sink, ...) once per
 * frame, innermost first (the strings are copied). */
typedef void (*ccalloc_frame_emit_fn)(void* sink, const char* filename, int64_t line,
                                      const char* name);
typedef void (*ccalloc_context_frames_fn)(void* context, ccalloc_frame_emit_fn emit, void* sink,
                                          void* user_data);
/* Writes `snapshot` as ccalloc_dump_snapshot does; with `frames` (may be NULL), each
 * entry's, block's and segment's frames are its C++ stack followed by its context's frames,
 * so PyTorch's viewer and ccalloc's tools show them. */
ccalloc_status ccalloc_snapshot_write(const ccalloc_snapshot* snapshot, const char* path,
                                      ccalloc_context_frames_fn frames, void* user_data);

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

/* Entry points for a framework's hook that has no status to return (CuPy's
 * cupy.cuda.memory.PythonFunctionAllocator calls malloc(size, device) and free(ptr, device)):
 * ccalloc_hook_malloc returns NULL on failure, with the status in ccalloc_last_status() and
 * the reason in ccalloc_last_error(); ccalloc_hook_free writes a failure's reason to stderr,
 * since its caller cannot see it. `device` of the free is the allocation's device (the
 * pointer names it; the argument is not used). */
void* ccalloc_hook_malloc(size_t size, int device, void* stream);
void ccalloc_hook_free(void* ptr, int device);
/* The status of the calling thread's last failure (CCALLOC_SUCCESS if none). */
ccalloc_status ccalloc_last_status(void);

#ifdef __cplusplus
}
#endif

#endif /* CCALLOC_CCALLOC_H_ */
