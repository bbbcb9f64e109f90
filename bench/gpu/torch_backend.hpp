// PyTorch's CUDA caching allocator behind a plain interface, so that the benchmark proper
// never includes PyTorch's headers: torch_backend.cpp is compiled on its own, in the C++
// standard and with the libstdc++ ABI that the installed torch was built with. Only
// built-in types cross this boundary.
#pragma once

#include <cstddef>

namespace bench_torch {

// Initialises c10::cuda::CUDACachingAllocator for `device_count` devices.
void init(int device_count);
// raw_alloc_with_stream(size, stream); `stream` is a cudaStream_t.
void* alloc(std::size_t size, void* stream);
// raw_delete(ptr).
void free(void* ptr);
// Returns cached memory to the device (emptyCache).
void empty_cache();
// The allocator's name() (e.g. "native"), valid until the next call.
const char* name();

}  // namespace bench_torch
