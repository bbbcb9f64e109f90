// Installs ccalloc as PyTorch's CUDA allocator (CUDAPluggableAllocator) with every hook it
// offers: allocations that fail raise torch.OutOfMemoryError with ccalloc's message,
// Tensor.record_stream reaches ccalloc, and torch.cuda.empty_cache() and
// set_per_process_memory_fraction() act on it. Everything goes through libccalloc.so's C
// API, so the process has one ccalloc, shared with ctypes users of that library.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "ccalloc/ccalloc.h"

namespace {

namespace pluggable = torch::cuda::CUDAPluggableAllocator;

void* allocate(size_t size, int device, cudaStream_t stream) {
  void* ptr = nullptr;
  const ccalloc_status status = ccalloc_malloc(&ptr, size, device, stream);
  TORCH_CHECK_WITH(OutOfMemoryError, status != CCALLOC_ERROR_OUT_OF_MEMORY, ccalloc_last_error());
  TORCH_CHECK(status == CCALLOC_SUCCESS, ccalloc_last_error());
  return ptr;
}

// Called from tensor deleters, which must not throw.
void release(void* ptr, size_t /*size*/, int /*device*/, cudaStream_t /*stream*/) {
  if (ccalloc_free(ptr) != CCALLOC_SUCCESS) std::fprintf(stderr, "%s\n", ccalloc_last_error());
}

}  // namespace

extern "C" {

// Returns 0 on success; else writes the reason into `error` (NUL-terminated, at most
// `capacity` bytes) and returns 1. Must run before PyTorch's first CUDA allocation.
int ccalloc_torch_install(char* error, size_t capacity) {
  try {
    auto allocator = pluggable::createCustomAllocator(
        [](size_t size, auto device, cudaStream_t stream) {
          return allocate(size, static_cast<int>(device), stream);
        },
        [](void* ptr, size_t size, auto device, cudaStream_t stream) {
          release(ptr, size, static_cast<int>(device), stream);
        });
    auto* hooks = dynamic_cast<pluggable::CUDAPluggableAllocator*>(allocator.get());
    TORCH_CHECK(hooks != nullptr, "ccalloc: torch's custom allocator is not a CUDAPluggableAllocator");
    hooks->set_record_stream_fn([](void* ptr, cudaStream_t stream) {
      if (ccalloc_record_stream(ptr, stream) != CCALLOC_SUCCESS) {
        std::fprintf(stderr, "%s\n", ccalloc_last_error());
      }
    });
    hooks->set_reset_fn([] { (void)ccalloc_empty_cache(-2); });
    hooks->set_memory_fraction_fn([](double fraction, auto device) {
      TORCH_CHECK(ccalloc_set_memory_fraction(fraction, static_cast<int>(device)) == CCALLOC_SUCCESS,
                  ccalloc_last_error());
    });
    pluggable::changeCurrentAllocator(allocator);
    return 0;
  } catch (const std::exception& e) {
    if (capacity > 0) {
      std::strncpy(error, e.what(), capacity - 1);
      error[capacity - 1] = '\0';
    }
    return 1;
  }
}

}  // extern "C"
