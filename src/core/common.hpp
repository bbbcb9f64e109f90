// Pieces both backends (the native engine and the stream-ordered pool) share.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "ccalloc/config.hpp"
#include "ccalloc/driver.hpp"
#include "ccalloc/snapshot.hpp"

namespace ccalloc::core {

// The message of an InvalidPointerError: `what` ("free", "record_stream") of a pointer
// that is not a live allocation of `device`.
std::string pointer_error(const char* what, DevicePtr ptr, int device);

// record_stream's rule for a live block of stream `own`: `stream` joins its uses unless it
// is `own` (a stream orders its own work) or already there.
inline void add_stream_use(std::vector<StreamId>& uses, StreamId own, StreamId stream) {
  for (const StreamId s : uses) {
    if (s == stream) return;
  }
  if (stream != own) uses.push_back(stream);
}

// The memory limit of a per-process fraction of `capacity`: nullopt for 1 (no limit).
// Throws ConfigError outside [0, 1].
std::optional<std::size_t> fraction_limit(double fraction, std::size_t capacity, int device);

// What PyTorch's out-of-memory message states, which every OutOfMemoryError of a malloc
// states first in PyTorch's words (its test suite, and tools that read the message, match
// them); each engine's explanation follows.
struct PytorchOomFigures {
  std::size_t requested = 0;  // the request (PyTorch names the segment it would create)
  int device = 0;
  std::size_t capacity = 0;
  std::size_t device_free = 0;
  std::vector<Driver::ProcessMemory> processes;  // Driver::processes_on_device()
  std::optional<std::size_t> limit;              // of a per-process memory fraction
  std::size_t allocated = 0;      // bytes of live allocations
  std::size_t private_pools = 0;  // free bytes cached in private pools
  std::size_t reserved = 0;
};
// "CUDA out of memory. Tried to allocate X. GPU d has a total capacity of T of which F is
// free. [Process p has X memory in use. ...][Including non-PyTorch memory, this process has X
// memory in use. ][L allowed; ]Of the allocated memory A is allocated by PyTorch, [with P
// allocated in private pools (e.g., CUDA Graphs), ]and U is reserved by PyTorch but
// unallocated. If reserved but unallocated memory is large try setting ...", to its
// documentation link.
std::string pytorch_oom_text(const PytorchOomFigures& f);

// allocator_settings as a snapshot reports them.
AllocatorSettings settings_of(const Config& c);

}  // namespace ccalloc::core
