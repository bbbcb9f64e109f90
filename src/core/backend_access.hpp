// The implementation behind an Allocator (the engine or the stream-ordered pool): internal,
// for tests that check which one a configuration selects.
#pragma once

#include "ccalloc/allocator.hpp"
#include "core/backend.hpp"

namespace ccalloc::core {

struct BackendAccess {
  static Backend& of(const Allocator& alloc) { return *alloc.impl_; }
};

}  // namespace ccalloc::core
