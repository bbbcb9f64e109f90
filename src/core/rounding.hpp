// The size rules, each in exactly one place: request rounding, pool choice, segment size,
// the split rule and the oversize rules. Shared by the native policy, expandable segments
// and the simulator.
#pragma once

#include <cstddef>

#include "ccalloc/config.hpp"

namespace ccalloc::core {

inline constexpr std::size_t kMinBlockSize = 512;         // every size is a multiple
inline constexpr std::size_t kSmallSize = 1 * kMiB;       // largest small-pool request
inline constexpr std::size_t kSmallBuffer = 2 * kMiB;     // small-pool segment size
inline constexpr std::size_t kMinLargeAlloc = 10 * kMiB;  // below: a large_segment_size segment
inline constexpr std::size_t kRoundLarge = 2 * kMiB;      // above: rounded to this
inline constexpr std::size_t kOneExabyte = std::size_t{1} << 60;

// The next multiple of floor_pow2(size) / divisions at or above size (rounding.cpp).
std::size_t round_to_power2_division(std::size_t size, std::size_t divisions);

// The size a request of `size` bytes occupies: 512 B multiples, or the next 1/N step
// between powers of two when roundup_power2_divisions gives N > 1 for that size. Inline:
// every malloc rounds, and the usual request (no divisions) costs a table read and a mask.
inline std::size_t round_size(std::size_t size, const Config& config) {
  if (size < kMinBlockSize) return kMinBlockSize;
  const std::size_t divisions = config.roundup_divisions_for(size);
  if (divisions > 1 && size > kMinBlockSize * divisions) [[unlikely]] {
    return round_to_power2_division(size, divisions);
  }
  return (size + kMinBlockSize - 1) & ~(kMinBlockSize - 1);
}

// Rounded sizes up to 1 MiB are served from the small pool.
inline bool is_small_size(std::size_t rounded) {
  return rounded <= kSmallSize;
}

// The stitching policy (the `ccalloc` preset's default pool; docs/ccalloc-policy.md, rule 1)
// splits its pools lower: rounded requests up to 256 KiB are small there.
inline constexpr std::size_t kStitchSmallSize = kMiB / 4;

// Whether a configuration's default pool runs the stitching policy (make_backend's choice).
inline bool stitches(const Config& config) {
  return config.stitch_segments && !config.uncached &&
         config.backend != BackendKind::kCudaMallocAsync;
}

// The largest rounded request of the default pool's small pool under `config`.
inline std::size_t small_pool_max(const Config& config) {
  return stitches(config) ? kStitchSmallSize : kSmallSize;
}

// `rounded` up to a multiple of kRoundLarge: a large request's own segment, and what the
// stitching policy grows by at a limit.
inline std::size_t round_up_large(std::size_t rounded) {
  return kRoundLarge * ((rounded + kRoundLarge - 1) / kRoundLarge);
}

// Size of the segment to allocate from the device for a rounded request.
inline std::size_t segment_size_for(std::size_t rounded, const Config& config) {
  if (is_small_size(rounded)) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return config.large_segment_size;
  return round_up_large(rounded);
}

// Whether taking `rounded` bytes from a free block of `block_size` leaves a remainder worth
// its own block: >= 512 B in the small pool and in expandable segments (`fine`); > 1 MiB
// in the large pool, and never for oversize requests.
inline bool should_split(std::size_t block_size, std::size_t rounded, bool fine,
                         const Config& config) {
  const std::size_t remaining = block_size - rounded;
  if (fine) return remaining >= kMinBlockSize;
  return rounded < config.max_split_size && remaining > kSmallSize;
}

// Whether a cached free block of `block_size` may serve a request of `rounded` bytes under
// the oversize rules (max_split_size, max_non_split_rounding_size).
inline bool oversize_allows(std::size_t block_size, std::size_t rounded, const Config& config) {
  if (rounded < config.max_split_size && block_size >= config.max_split_size) return false;
  if (rounded >= config.max_split_size &&
      block_size >= rounded + config.max_non_split_rounding_size) {
    return false;
  }
  return true;
}

inline bool is_oversize(std::size_t size, const Config& config) {
  return size >= config.max_split_size;
}

}  // namespace ccalloc::core
