#include "core/common.hpp"

#include <unistd.h>

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

std::string pytorch_oom_text(const PytorchOomFigures& f) {
  std::string m = "CUDA out of memory. Tried to allocate " + format_size(f.requested) + ". GPU " +
                  std::to_string(f.device) + " has a total capacity of " +
                  format_size(f.capacity) + " of which " + format_size(f.device_free) +
                  " is free. ";
  const long self = static_cast<long>(::getpid());
  for (const Driver::ProcessMemory& p : f.processes) {
    m += p.pid == self ? "Including non-PyTorch memory, this process has "
                       : "Process " + std::to_string(p.pid) + " has ";
    m += format_size(p.bytes) + " memory in use. ";
  }
  if (f.limit) m += format_size(*f.limit) + " allowed; ";
  const std::size_t held = f.allocated + f.private_pools;
  m += "Of the allocated memory " + format_size(held) + " is allocated by PyTorch, ";
  if (f.private_pools > 0) {
    m += "with " + format_size(f.private_pools) +
         " allocated in private pools (e.g., CUDA Graphs), ";
  }
  m += "and " + format_size(f.reserved > held ? f.reserved - held : 0) +
       " is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
       "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
       "See documentation for Memory Management  "
       "(https://docs.pytorch.org/docs/stable/notes/cuda.html"
       "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";
  return m;
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
