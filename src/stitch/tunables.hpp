// The stitching policy's rules in numbers, each with the measurement that chose it
// (docs/ccalloc-policy.md), and the page arithmetic its files share. Internal to src/stitch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/rounding.hpp"

namespace ccalloc::core {

// See stitch/share.cpp: a stream records at most one fence this often, and a free polls its
// fences at most this often. A fence costs an event record (about 2 us of CPU on an H100);
// the frees of the last interval before a stream goes quiet wait for the next poll's fence.
inline constexpr std::int64_t kFenceIntervalUs = 1000;

inline std::size_t align_up(std::size_t v, std::size_t a) {
  return (v + a - 1) / a * a;
}

inline std::size_t align_down(std::size_t v, std::size_t a) {
  return v / a * a;
}

// See handle_cap(): new memory is created in handles of at most this many pieces (64 MiB of
// 2 MiB), and of at most 1/kHandleRoomDivisor of the room left under the memory limit (one
// piece at the least).
inline constexpr std::size_t kMaxHandlePieces = 32;
inline constexpr std::size_t kHandleRoomDivisor = 2048;

// See grow(): once a stream has handed out its large range's bytes again since the large
// pool last created memory, a growth creates beyond what it lacks at most this fraction of
// the reserved bytes (1/64, under 1.6 %), when that is less than the chunk.
inline constexpr std::size_t kSettledExtraDivisor = 64;

// Rounded requests of at most this many bytes go to the small pool, the rest to the large
// pool (PyTorch splits its pools at 1 MiB). The small pool grows a page (one piece) at a
// time, each growth a creation and a mapping, and the two pools reach their peaks at
// different times; a block in a large range costs neither and is packed as expandable
// segments pack it, but keeps the large handle under it from being lent. The measurements
// behind 256 KiB are in docs/ccalloc-policy.md (rule 1); the viewer reads the same rule.
inline constexpr std::size_t kSmallPoolMax = kStitchSmallSize;

// Bounces of one page between the pools (end_island_if_free) after which the small pool
// keeps it. On the seventeen recordings and 240 generated workloads, keeping it from the
// third on changes no peak; from the first, one generated server's.
inline constexpr std::size_t kIslandBounces = 3;

}  // namespace ccalloc::core
