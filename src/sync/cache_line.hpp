// Cache-line isolation of what one arena writes on the hot path.
//
// Each stream's arena is used by its own thread nearly always. Objects an arena writes on
// every malloc and free (its blocks, its pools' tree nodes, its live index, its spaces and
// their pages) would share cache lines with another arena's where the heap placed them side
// by side (say, both created by one thread): every write would then take the line from the
// other core. Allocated whole cache lines at a time, they never share one.
#pragma once

#include <cstddef>
#include <new>

namespace ccalloc::core {

inline constexpr std::size_t kCacheLine = 64;

// Rounds `bytes` up to whole cache lines.
constexpr std::size_t cache_lines(std::size_t bytes) {
  return (bytes + kCacheLine - 1) / kCacheLine * kCacheLine;
}

// A standard allocator whose every allocation starts on a cache line and covers whole lines.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT: converting, as std::allocator

  T* allocate(std::size_t n) {
    return static_cast<T*>(
        ::operator new (cache_lines(n * sizeof(T)), std::align_val_t{kCacheLine}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete (p, std::align_val_t{kCacheLine}); }

  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
};

}  // namespace ccalloc::core
