// Allocator statistics with PyTorch's names and update points
// (memory_stats() / memory_summary()).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

namespace ccalloc {

// One statistic: a gauge with its high-water mark and accumulated totals.
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // sum of all increases
  std::int64_t freed = 0;      // sum of all decreases

  void increase(std::int64_t n) {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_accumulated() { allocated = freed = 0; }
  void reset_peak() { peak = current; }
  // Adds another stat field by field (used to combine per-stream arenas).
  Stat& operator+=(const Stat& o);
  bool operator==(const Stat&) const = default;
};

// Index into a StatArray.
enum StatType : int { kAggregate = 0, kSmallPool = 1, kLargePool = 2 };
using StatArray = std::array<Stat, 3>;

struct DeviceStats {
  StatArray allocation;            // live allocations (count)
  StatArray segment;               // device allocations (cudaMalloc) held (count)
  StatArray active;                // allocated or pending-free blocks (count)
  StatArray inactive_split;        // free blocks inside split segments (count)
  StatArray allocated_bytes;       // rounded sizes of live allocations
  StatArray reserved_bytes;        // bytes obtained from the device
  StatArray active_bytes;          // allocated or pending-free bytes
  StatArray inactive_split_bytes;  // free bytes inside split segments ("non-releasable")
  StatArray requested_bytes;       // unrounded sizes of active blocks
  std::int64_t num_alloc_retries = 0;
  std::int64_t num_ooms = 0;
  std::int64_t num_sync_all_streams = 0;
  std::int64_t num_device_alloc = 0;
  std::int64_t num_device_free = 0;
  Stat oversize_allocations;
  Stat oversize_segments;
  // max_split_size in force, -1 when unlimited (as PyTorch reports it).
  std::int64_t max_split_size = -1;

  void reset_accumulated();
  void reset_peak();

  // The flat memory_stats() dictionary: PyTorch's 122 keys, sorted by key.
  std::map<std::string, std::int64_t> to_map() const;
  // Inverse of to_map(); keys that are absent read as 0.
  static DeviceStats from_map(const std::map<std::string, std::int64_t>& m);

  bool operator==(const DeviceStats&) const = default;
};

// memory_summary() in PyTorch's exact layout (75 columns).
std::string memory_summary(const DeviceStats& stats, int device, bool abbreviated = false);

// "1.50 GiB": PyTorch's format_size used in error messages.
std::string format_size(std::uint64_t bytes);

}  // namespace ccalloc
