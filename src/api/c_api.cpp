// The C API: ProcessAllocator behind status codes. Every entry point catches everything;
// the message of the last failure is kept per thread.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <typeinfo>

#include "api/c_context.hpp"
#include "ccalloc/ccalloc.h"
#include "ccalloc/ipc.hpp"
#include "ccalloc/process.hpp"
#include "ccalloc/snapshot.hpp"
#include "core/format.hpp"
#include "io/snapshot_io.hpp"

namespace {

thread_local std::string t_last_error;
thread_local ccalloc_status t_last_status = CCALLOC_SUCCESS;

ccalloc_status fail(ccalloc_status status, const char* message) {
  t_last_error = message;
  t_last_status = status;
  return status;
}

// Runs `fn`, mapping each exception type to its status. Inline into each entry point, so
// that malloc and free (and the hooks through them) call the allocator without a frame of
// their own between.
template <typename Fn>
[[gnu::always_inline]] inline ccalloc_status guarded(Fn&& fn) noexcept {
  try {
    fn();
    return CCALLOC_SUCCESS;
  } catch (const ccalloc::OutOfMemoryError& e) {
    return fail(CCALLOC_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const ccalloc::InvalidPointerError& e) {
    return fail(CCALLOC_ERROR_INVALID_POINTER, e.what());
  } catch (const ccalloc::ConfigError& e) {
    return fail(CCALLOC_ERROR_CONFIG, e.what());
  } catch (const ccalloc::DriverError& e) {
    return fail(CCALLOC_ERROR_DRIVER, e.what());
  } catch (const ccalloc::FormatError& e) {
    return fail(CCALLOC_ERROR_INVALID_VALUE, e.what());
  } catch (const std::bad_alloc&) {
    return fail(CCALLOC_ERROR_INTERNAL, "ccalloc: out of host memory");
  } catch (const std::exception& e) {
    return fail(CCALLOC_ERROR_INTERNAL, e.what());
  } catch (...) {
    return fail(CCALLOC_ERROR_INTERNAL, "ccalloc: unknown internal error");
  }
}

ccalloc::ProcessAllocator& process() {
  return ccalloc::ProcessAllocator::instance();
}

ccalloc::StreamId stream_id(void* stream) {
  return reinterpret_cast<ccalloc::StreamId>(stream);
}

// Copies `text` into a caller's buffer: at most capacity-1 bytes and a NUL.
ccalloc_status copy_out(const std::string& text, char* buffer, size_t capacity, size_t* length) {
  if (length != nullptr) *length = text.size();
  if (capacity > 0) {
    if (buffer == nullptr) return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc: buffer is NULL");
    const size_t n = std::min(text.size(), capacity - 1);
    std::memcpy(buffer, text.data(), n);
    buffer[n] = '\0';
  }
  return CCALLOC_SUCCESS;
}

// Pool misuse (an unknown pool, a use count already 0, ...) is a plain ccalloc::Error: an
// invalid value here, not an internal error.
template <typename Fn>
ccalloc_status pool_call(const char* name, ccalloc_pool_id pool, Fn&& fn) noexcept {
  if (pool.first == 0 && pool.second == 0) {
    return fail(
        CCALLOC_ERROR_INVALID_VALUE,
        (std::string(name) + ": pool id {0, 0} is the default pool, not a private pool").c_str());
  }
  ccalloc_status misuse = CCALLOC_SUCCESS;
  const ccalloc_status s = guarded([&] {
    try {
      fn(ccalloc::PoolId{pool.first, pool.second});
    } catch (const ccalloc::Error& e) {
      if (typeid(e) != typeid(ccalloc::Error)) throw;
      misuse = fail(CCALLOC_ERROR_INVALID_VALUE, e.what());
    }
  });
  return s != CCALLOC_SUCCESS ? s : misuse;
}

// Memory of other processes opened by ccalloc_ipc_open, by the address handed out. A
// multimap: CUDA may hand out one address for two opens of one segment.
struct OpenedTable {
  std::mutex mutex;
  std::multimap<ccalloc::DevicePtr, ccalloc::ipc::OpenedMemory> entries;
};
OpenedTable& opened() {
  static auto* table = new OpenedTable;  // never destroyed: closes may come from exit handlers
  return *table;
}

std::string pointer_text(const void* p) {
  return ccalloc::hex_address(reinterpret_cast<std::uintptr_t>(p));
}

}  // namespace

extern "C" {

const char* ccalloc_last_error(void) {
  return t_last_error.c_str();
}

ccalloc_status ccalloc_last_status(void) {
  return t_last_status;
}

const char* ccalloc_version(void) {
  return CCALLOC_VERSION;
}

ccalloc_status ccalloc_malloc(void** ptr, size_t size, int device, void* stream) {
  if (ptr == nullptr) return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_malloc: ptr is NULL");
  *ptr = nullptr;
  return guarded(
      [&] { *ptr = reinterpret_cast<void*>(process().malloc(size, stream_id(stream), device)); });
}

ccalloc_status ccalloc_free(void* ptr) {
  return guarded([&] { process().free(reinterpret_cast<ccalloc::DevicePtr>(ptr)); });
}

ccalloc_status ccalloc_record_stream(void* ptr, void* stream) {
  return guarded([&] {
    process().record_stream(reinterpret_cast<ccalloc::DevicePtr>(ptr), stream_id(stream));
  });
}

ccalloc_status ccalloc_empty_cache(int device) {
  return guarded([&] { process().empty_cache(device); });
}

ccalloc_status ccalloc_pool_create(int device, ccalloc_pool_id pool) {
  return pool_call("ccalloc_pool_create", pool,
                   [&](ccalloc::PoolId id) { process().allocator(device).create_pool(id); });
}

ccalloc_status ccalloc_pool_release(int device, ccalloc_pool_id pool) {
  return pool_call("ccalloc_pool_release", pool,
                   [&](ccalloc::PoolId id) { process().allocator(device).release_pool(id); });
}

ccalloc_status ccalloc_pool_use_count(int device, ccalloc_pool_id pool, int* count) {
  if (count == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_pool_use_count: count is NULL");
  }
  return pool_call("ccalloc_pool_use_count", pool, [&](ccalloc::PoolId id) {
    *count = process().allocator(device).pool_use_count(id);
  });
}

ccalloc_status ccalloc_pool_create_sleepable(int device, ccalloc_pool_id pool) {
  return pool_call("ccalloc_pool_create_sleepable", pool,
                   [&](ccalloc::PoolId id) { process().create_sleepable_pool(id, device); });
}

ccalloc_status ccalloc_pool_sleep(int device, ccalloc_pool_id pool, int save_contents) {
  return pool_call("ccalloc_pool_sleep", pool, [&](ccalloc::PoolId id) {
    process().sleep_pool(
        id, save_contents != 0 ? ccalloc::SleepMode::kSave : ccalloc::SleepMode::kDiscard, device);
  });
}

ccalloc_status ccalloc_pool_wake(int device, ccalloc_pool_id pool) {
  return pool_call("ccalloc_pool_wake", pool,
                   [&](ccalloc::PoolId id) { process().wake_pool(id, device); });
}

ccalloc_status ccalloc_pool_is_asleep(int device, ccalloc_pool_id pool, int* asleep) {
  if (asleep == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_pool_is_asleep: asleep is NULL");
  }
  return pool_call("ccalloc_pool_is_asleep", pool, [&](ccalloc::PoolId id) {
    *asleep = process().pool_asleep(id, device) ? 1 : 0;
  });
}

ccalloc_status ccalloc_pool_begin_allocate(int device, ccalloc_pool_id pool,
                                           ccalloc_stream_filter filter, void* user_data) {
  return pool_call("ccalloc_pool_begin_allocate", pool, [&](ccalloc::PoolId id) {
    ccalloc::Allocator& a = process().allocator(device);
    ccalloc::Allocator::StreamFilter f;
    if (filter != nullptr) {
      f = [filter, user_data](ccalloc::StreamId s) {
        return filter(reinterpret_cast<void*>(s), user_data) != 0;
      };
    } else {
      f = [&driver = a.driver()](ccalloc::StreamId s) { return driver.is_capturing(s); };
    }
    a.begin_allocate_to_pool(id, std::move(f));
  });
}

ccalloc_status ccalloc_pool_end_allocate(int device, ccalloc_pool_id pool) {
  return pool_call("ccalloc_pool_end_allocate", pool, [&](ccalloc::PoolId id) {
    process().allocator(device).end_allocate_to_pool(id);
  });
}

ccalloc_status ccalloc_pool_empty_cache(int device, ccalloc_pool_id pool) {
  return pool_call("ccalloc_pool_empty_cache", pool,
                   [&](ccalloc::PoolId id) { process().allocator(device).empty_cache(id); });
}

ccalloc_status ccalloc_get_stat(int device, const char* key, int64_t* value) {
  if (key == nullptr || value == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_get_stat: key and value must not be NULL");
  }
  ccalloc_status status = CCALLOC_SUCCESS;
  const ccalloc_status s = guarded([&] {
    const auto stats = process().stats(device).to_map();
    const auto it = stats.find(key);
    if (it == stats.end()) {
      status = fail(CCALLOC_ERROR_INVALID_VALUE,
                    ("ccalloc_get_stat: unknown key '" + std::string(key) +
                     "' (expected a memory_stats() key such as allocated_bytes.all.peak)")
                        .c_str());
      return;
    }
    *value = it->second;
  });
  return s != CCALLOC_SUCCESS ? s : status;
}

ccalloc_status ccalloc_memory_stats_json(int device, char* buffer, size_t capacity,
                                         size_t* length) {
  std::string json;
  const ccalloc_status s = guarded([&] {
    json = "{";
    bool first = true;
    for (const auto& [key, value] : process().stats(device).to_map()) {
      json += (first ? "\"" : ",\"") + key + "\":" + std::to_string(value);
      first = false;
    }
    json += "}";
  });
  return s != CCALLOC_SUCCESS ? s : copy_out(json, buffer, capacity, length);
}

ccalloc_status ccalloc_memory_summary(int device, int abbreviated, char* buffer, size_t capacity,
                                      size_t* length) {
  std::string text;
  const ccalloc_status s =
      guarded([&] { text = process().memory_summary(device, abbreviated != 0); });
  return s != CCALLOC_SUCCESS ? s : copy_out(text, buffer, capacity, length);
}

ccalloc_status ccalloc_reset_peak_stats(int device) {
  return guarded([&] { process().reset_peak_stats(device); });
}

ccalloc_status ccalloc_reset_accumulated_stats(int device) {
  return guarded([&] { process().reset_accumulated_stats(device); });
}

ccalloc_status ccalloc_set_memory_fraction(double fraction, int device) {
  return guarded([&] { process().set_memory_fraction(fraction, device); });
}

ccalloc_status ccalloc_mem_get_info(int device, size_t* free_bytes, size_t* total_bytes) {
  if (free_bytes == nullptr || total_bytes == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_mem_get_info: outputs must not be NULL");
  }
  return guarded([&] {
    const ccalloc::MemInfo info = process().mem_get_info(device);
    *free_bytes = info.free_bytes;
    *total_bytes = info.total_bytes;
  });
}

ccalloc_status ccalloc_record_history(const char* enabled, const char* context, const char* stacks,
                                      size_t max_entries) {
  return ccalloc_record_history_context(enabled, context, stacks, max_entries, nullptr, nullptr,
                                        nullptr);
}

ccalloc_status ccalloc_record_history_context(const char* enabled, const char* context,
                                              const char* stacks, size_t max_entries,
                                              ccalloc_context_capture_fn capture,
                                              ccalloc_context_release_fn release,
                                              void* user_data) {
  if (capture != nullptr && release == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                "ccalloc_record_history_context: release is NULL but capture is not (every "
                "captured context must be released)");
  }
  return guarded([&] {
    process().record_history(ccalloc::capi::history_options(enabled, context, stacks, max_entries,
                                                             capture, release, user_data));
  });
}

ccalloc_status ccalloc_snapshot_take(ccalloc_snapshot** snapshot) {
  if (snapshot == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_snapshot_take: snapshot is NULL");
  }
  *snapshot = nullptr;
  return guarded([&] { *snapshot = new ccalloc_snapshot{process().snapshot()}; });
}

void ccalloc_snapshot_free(ccalloc_snapshot* snapshot) {
  delete snapshot;
}

ccalloc_status ccalloc_snapshot_trace_length(const ccalloc_snapshot* snapshot, int device,
                                             size_t* length) {
  if (snapshot == nullptr || length == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                "ccalloc_snapshot_trace_length: snapshot and length must not be NULL");
  }
  const auto& traces = snapshot->snapshot.device_traces;
  *length = device >= 0 && static_cast<size_t>(device) < traces.size()
                ? traces[static_cast<size_t>(device)].size()
                : 0;
  return CCALLOC_SUCCESS;
}

ccalloc_status ccalloc_snapshot_trace_entry(const ccalloc_snapshot* snapshot, int device,
                                            size_t index, ccalloc_trace_entry* entry) {
  if (snapshot == nullptr || entry == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                "ccalloc_snapshot_trace_entry: snapshot and entry must not be NULL");
  }
  const auto& traces = snapshot->snapshot.device_traces;
  if (device < 0 || static_cast<size_t>(device) >= traces.size() ||
      index >= traces[static_cast<size_t>(device)].size()) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                ("ccalloc_snapshot_trace_entry: no entry " + std::to_string(index) +
                 " in the history of device " + std::to_string(device))
                    .c_str());
  }
  *entry = ccalloc::capi::trace_entry(traces[static_cast<size_t>(device)][index]);
  return CCALLOC_SUCCESS;
}

ccalloc_status ccalloc_snapshot_segment_count(const ccalloc_snapshot* snapshot, size_t* count) {
  if (snapshot == nullptr || count == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                "ccalloc_snapshot_segment_count: snapshot and count must not be NULL");
  }
  *count = snapshot->snapshot.segments.size();
  return CCALLOC_SUCCESS;
}

ccalloc_status ccalloc_snapshot_segment(const ccalloc_snapshot* snapshot, size_t index,
                                        ccalloc_segment_info* segment) {
  if (snapshot == nullptr || segment == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                "ccalloc_snapshot_segment: snapshot and segment must not be NULL");
  }
  if (index >= snapshot->snapshot.segments.size()) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                ("ccalloc_snapshot_segment: no segment " + std::to_string(index) + " (" +
                 std::to_string(snapshot->snapshot.segments.size()) + " in the snapshot)")
                    .c_str());
  }
  *segment = ccalloc::capi::segment_info(snapshot->snapshot.segments[index]);
  return CCALLOC_SUCCESS;
}

ccalloc_status ccalloc_snapshot_block(const ccalloc_snapshot* snapshot, size_t segment,
                                      size_t index, ccalloc_block_info* block) {
  if (snapshot == nullptr || block == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                "ccalloc_snapshot_block: snapshot and block must not be NULL");
  }
  const auto& segments = snapshot->snapshot.segments;
  if (segment >= segments.size() || index >= segments[segment].blocks.size()) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                ("ccalloc_snapshot_block: no block " + std::to_string(index) + " in segment " +
                 std::to_string(segment))
                    .c_str());
  }
  *block = ccalloc::capi::block_info(segments[segment].blocks[index]);
  return CCALLOC_SUCCESS;
}

ccalloc_status ccalloc_snapshot_write(const ccalloc_snapshot* snapshot, const char* path,
                                      ccalloc_context_frames_fn frames, void* user_data) {
  if (snapshot == nullptr || path == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                "ccalloc_snapshot_write: snapshot and path must not be NULL");
  }
  return guarded([&] {
    ccalloc::io::write_snapshot(path, snapshot->snapshot,
                                ccalloc::capi::context_frames(frames, user_data));
  });
}

ccalloc_status ccalloc_dump_snapshot(const char* path) {
  if (path == nullptr)
    return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_dump_snapshot: path is NULL");
  return guarded([&] { ccalloc::io::write_snapshot(path, process().snapshot()); });
}

ccalloc_status ccalloc_annotate(int device, const char* name, int start) {
  if (name == nullptr) return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_annotate: name is NULL");
  return guarded([&] { process().allocator(device).annotate(name, start != 0); });
}

ccalloc_status ccalloc_ipc_export(void* ptr, void* handle, size_t capacity, size_t* length) {
  if (length == nullptr) return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_ipc_export: length is NULL");
  if (capacity > 0 && handle == nullptr) {
    return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_ipc_export: handle is NULL");
  }
  std::string bytes;
  const ccalloc_status s = guarded([&] {
    const auto p = reinterpret_cast<ccalloc::DevicePtr>(ptr);
    const int device = process().device_of(p);
    if (device < 0) {
      throw ccalloc::InvalidPointerError("ccalloc_ipc_export: pointer " + pointer_text(ptr) +
                                             " is not a live allocation of any device",
                                         p);
    }
    bytes = ccalloc::ipc::export_handle(process().allocator(device), p);
  });
  if (s != CCALLOC_SUCCESS) return s;
  *length = bytes.size();
  if (capacity == 0) return CCALLOC_SUCCESS;
  if (capacity < bytes.size()) {
    return fail(CCALLOC_ERROR_INVALID_VALUE,
                ("ccalloc_ipc_export: the handle has " + std::to_string(bytes.size()) +
                 " bytes, the buffer " + std::to_string(capacity))
                    .c_str());
  }
  std::memcpy(handle, bytes.data(), bytes.size());
  return CCALLOC_SUCCESS;
}

ccalloc_status ccalloc_ipc_open(const void* handle, size_t length, int device, void** ptr) {
  if (ptr == nullptr) return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_ipc_open: ptr is NULL");
  *ptr = nullptr;
  if (handle == nullptr && length > 0) {
    return fail(CCALLOC_ERROR_INVALID_VALUE, "ccalloc_ipc_open: handle is NULL");
  }
  return guarded([&] {
    const std::string_view bytes(static_cast<const char*>(handle), length);
    ccalloc::ipc::OpenedMemory m =
        ccalloc::ipc::open_handle(process().allocator(device).driver(), bytes);
    const ccalloc::DevicePtr p = m.ptr();
    OpenedTable& t = opened();
    std::lock_guard lock(t.mutex);
    t.entries.emplace(p, std::move(m));
    *ptr = reinterpret_cast<void*>(p);
  });
}

ccalloc_status ccalloc_ipc_close(void* ptr) {
  return guarded([&] {
    ccalloc::ipc::OpenedMemory m;
    {
      OpenedTable& t = opened();
      std::lock_guard lock(t.mutex);
      const auto it = t.entries.find(reinterpret_cast<ccalloc::DevicePtr>(ptr));
      if (it == t.entries.end()) {
        throw ccalloc::InvalidPointerError("ccalloc_ipc_close: pointer " + pointer_text(ptr) +
                                               " was not opened by ccalloc_ipc_open (or is closed)",
                                           reinterpret_cast<ccalloc::DevicePtr>(ptr));
      }
      m = std::move(it->second);
      t.entries.erase(it);
    }
    m.close();
  });
}

// Called by ccalloc itself when PyTorch made these entry points a MemPool's allocator while
// ccalloc is also PyTorch's allocator (ccalloc::in_segment_source()): the pool's segment
// comes straight from the device, since the pool's own allocator is the caller.
void* ccalloc_torch_alloc(size_t size, int device, void* stream) {
  void* ptr = nullptr;
  if (ccalloc::in_segment_source()) {
    (void)guarded([&] {
      ptr = reinterpret_cast<void*>(process().allocator(device).driver().allocate(size));
    });
    return ptr;
  }
  return ccalloc_hook_malloc(size, device, stream);
}

void ccalloc_torch_free(void* ptr, size_t size, int device, void* /*stream*/) {
  if (ccalloc::in_segment_source()) {
    const ccalloc_status s = guarded([&] {
      process().allocator(device).driver().free(reinterpret_cast<ccalloc::DevicePtr>(ptr), size);
    });
    if (s != CCALLOC_SUCCESS) std::fprintf(stderr, "%s\n", ccalloc_last_error());
    return;
  }
  // PyTorch's free hook has no way to report an error: say it rather than hide it.
  ccalloc_hook_free(ptr, device);
}

void* ccalloc_hook_malloc(size_t size, int device, void* stream) {
  void* ptr = nullptr;
  (void)ccalloc_malloc(&ptr, size, device, stream);
  return ptr;
}

void ccalloc_hook_free(void* ptr, int /*device*/) {
  if (ccalloc_free(ptr) != CCALLOC_SUCCESS) std::fprintf(stderr, "%s\n", ccalloc_last_error());
}

}  // extern "C"
