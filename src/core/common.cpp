#include "core/common.hpp"

#include <cinttypes>
#include <cstdint>
#include <cstdio>

#include "ccalloc/errors.hpp"
#include "ccalloc/stats.hpp"

namespace ccalloc::core {

std::string pointer_error(const char* what, DevicePtr ptr, int device) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "ccalloc: %s of pointer 0x%" PRIxPTR
                " on device %d, which is not a live allocation: it was never returned by "
                "malloc, or it was already freed",
                what, ptr, device);
  return buf;
}

std::string oom_opening(std::size_t requested, int device, std::size_t capacity,
                        std::size_t free_bytes) {
  return "CUDA out of memory. Tried to allocate " + format_size(requested) + ". GPU " +
         std::to_string(device) + " has a total capacity of " + format_size(capacity) +
         " of which " + format_size(free_bytes) + " is free. ";
}

std::optional<std::size_t> fraction_limit(double fraction, std::size_t capacity, int device) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "ccalloc: invalid memory fraction %g for device %d: set it within [0, 1]",
                  fraction, device);
    throw ConfigError(buf);
  }
  if (fraction >= 1.0) return std::nullopt;
  return static_cast<std::size_t>(fraction * static_cast<double>(capacity));
}

AllocatorSettings settings_of(const Config& c) {
  AllocatorSettings st;
  st.conf = c.source;
  st.max_split_size =
      c.max_split_size == SIZE_MAX ? -1 : static_cast<std::int64_t>(c.max_split_size);
  st.garbage_collection_threshold = c.garbage_collection_threshold;
  st.expandable_segments = c.expandable_segments;
  st.pinned_num_register_threads = static_cast<std::int64_t>(c.pinned_num_register_threads);
  st.release_lock_on_cudamalloc = c.release_lock_on_cudamalloc;
  st.pinned_use_cuda_host_register = c.pinned_use_cuda_host_register;
  for (const std::size_t d : c.roundup_power2_divisions) {
    st.roundup_power2_divisions.push_back(static_cast<std::int64_t>(d));
  }
  st.graph_capture_record_stream_reuse = c.graph_capture_record_stream_reuse;
  return st;
}

}  // namespace ccalloc::core
