// See torch_backend.hpp. Compiled only when CMake finds an importable torch.
#include "torch_backend.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

#include <string>

namespace bench_torch {

namespace cca = c10::cuda::CUDACachingAllocator;

void init(int device_count) {
  cca::init(device_count);
}

void* alloc(std::size_t size, void* stream) {
  return cca::raw_alloc_with_stream(size, static_cast<cudaStream_t>(stream));
}

void free(void* ptr) {
  cca::raw_delete(ptr);
}

void empty_cache() {
  cca::emptyCache();
}

const char* name() {
  static thread_local std::string text;
  text = cca::get()->name();
  return text.c_str();
}

}  // namespace bench_torch
