// The smallest simulated device on which a trace replays without running out of memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/trace_csv.hpp"
#include "replay/replay.hpp"

namespace ccalloc::replay {

struct FitOptions {
  std::string conf;
  // Capacities are multiples of this (the device's allocation granularity).
  std::size_t step = 2 * 1024 * 1024;
  sim::CostModel cost;
  // Called before each replay with the bracket [failing, passing] in bytes and the
  // capacity about to be tried.
  std::function<void(std::size_t failing, std::size_t passing, std::size_t trying)> progress;
};

struct FitResult {
  std::string conf;
  std::int64_t floor_bytes = 0;          // peak live requested bytes of the trace
  std::size_t capacity = 0;              // smallest passing capacity found
  std::int64_t peak_reserved_bytes = 0;  // of the replay at `capacity`
  double simulated_driver_us = 0.0;      // of the replay at `capacity`
  std::size_t replays = 0;
  // Verification, by two replays made after the search: no OOM at `capacity`, and at least
  // one at `capacity - step` (vacuously true when that is 0).
  bool passes_at_capacity = false;
  bool fails_below = false;
  bool verified() const { return passes_at_capacity && fails_below; }
};

// Bisection between a capacity that fails (one step below the floor, the trace's peak live
// requested bytes; halved while it passes, since a policy may reuse a block's memory before
// its free_completed entry) and one that passes (the peak reserved of a replay on the
// default 141 GiB device, doubled until it passes).
// OOMs need not be monotonic in the capacity; the answer is a capacity that passes while
// one step less fails. Throws Error for a trace with no allocation or one that fails even
// on a device of `limit` bytes.
FitResult fit(const std::vector<io::TraceRecord>& trace, const FitOptions& options,
              std::size_t limit = std::size_t{1} << 50);

}  // namespace ccalloc::replay
