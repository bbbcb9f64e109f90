// The implementation behind an Allocator (the engine or the stream-ordered pool): internal,
// for tests that check which one a configuration selects, and for the PyTorch bindings'
// entry points that go beyond the public API.
#pragma once

#include "ccalloc/allocator.hpp"
#include "core/backend.hpp"

namespace ccalloc::core {

struct BackendAccess {
  static Backend& of(const Allocator& alloc) { return *alloc.impl_; }
};

// Live reconfiguration (Backend::reconfigure): false where the backend cannot change its
// settings live. The PyTorch bindings call it for torch.cuda.memory._set_allocator_settings.
inline bool reconfigure(Allocator& alloc, const Config& config) {
  return BackendAccess::of(alloc).reconfigure(config);
}

}  // namespace ccalloc::core
