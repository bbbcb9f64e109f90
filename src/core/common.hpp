// Pieces both backends (the native engine and the stream-ordered pool) share.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "ccalloc/config.hpp"
#include "ccalloc/driver.hpp"
#include "ccalloc/snapshot.hpp"

namespace ccalloc::core {

// The message of an InvalidPointerError: `what` ("free", "record_stream") of a pointer
// that is not a live allocation of `device`.
std::string pointer_error(const char* what, DevicePtr ptr, int device);

// The memory limit of a per-process fraction of `capacity`: nullopt for 1 (no limit).
// Throws ConfigError outside [0, 1].
std::optional<std::size_t> fraction_limit(double fraction, std::size_t capacity, int device);

// The opening of every OutOfMemoryError message of a malloc: PyTorch's first two sentences
// word for word ("CUDA out of memory. Tried to allocate X. GPU d has a total capacity of T
// of which F is free. "), which its test suite and tools that read the message match; each
// engine's details follow. `requested` is the request's size, not the segment's.
std::string oom_opening(std::size_t requested, int device, std::size_t capacity,
                        std::size_t free_bytes);

// allocator_settings as a snapshot reports them.
AllocatorSettings settings_of(const Config& c);

}  // namespace ccalloc::core
