// The C API: ProcessAllocator behind status codes. Every entry point catches everything;
// the message of the last failure is kept per thread.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <typeinfo>

#include "ccalloc/ccalloc.h"
#include "ccalloc/process.hpp"
#include "ccalloc/snapshot.hpp"
#include "io/snapshot_io.hpp"

namespace {

thread_local std::string t_last_error;

ccalloc_status fail(ccalloc_status status, const char* message) {
  t_last_error = message;
  return status;
}

// Runs `fn`, mapping each exception type to its status.
template <typename Fn>
ccalloc_status guarded(Fn&& fn) noexcept {
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

}  // namespace

extern "C" {

const char* ccalloc_last_error(void) {
  return t_last_error.c_str();
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
  return guarded([&] {
    ccalloc::HistoryOptions o;
    o.enabled = ccalloc::HistoryOptions::parse_enabled(enabled ? enabled : "none");
    o.context = ccalloc::HistoryOptions::parse_context(context ? context : "none");
    o.stacks = ccalloc::HistoryOptions::parse_stacks(stacks ? stacks : "none");
    o.max_entries = max_entries;
    process().record_history(o);
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

void* ccalloc_torch_alloc(size_t size, int device, void* stream) {
  void* ptr = nullptr;
  (void)ccalloc_malloc(&ptr, size, device, stream);
  return ptr;
}

void ccalloc_torch_free(void* ptr, size_t /*size*/, int /*device*/, void* /*stream*/) {
  // PyTorch's free hook has no way to report an error: say it rather than hide it.
  if (ccalloc_free(ptr) != CCALLOC_SUCCESS) std::fprintf(stderr, "%s\n", ccalloc_last_error());
}

}  // extern "C"
