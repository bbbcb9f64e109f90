#include "replay/fit.hpp"

#include <algorithm>
#include <optional>

#include "ccalloc/errors.hpp"
#include "ccalloc/stats.hpp"

namespace ccalloc::replay {

FitResult fit(const std::vector<io::TraceRecord>& trace, const FitOptions& options,
              std::size_t limit) {
  FitResult out;
  out.conf = options.conf;
  out.floor_bytes = recorded_figures(trace).peak_requested_bytes;
  if (out.floor_bytes <= 0) throw Error("ccalloc fit: the trace allocates nothing; nothing to fit");
  const std::size_t step = options.step;
  const auto floor = static_cast<std::size_t>(out.floor_bytes);

  Options replay_options;
  replay_options.conf = options.conf;
  replay_options.cost = options.cost;
  const auto try_capacity = [&](std::size_t capacity) {
    replay_options.capacity = capacity;
    ++out.replays;
    return run(trace, replay_options);
  };
  // Bracket: `failing` units fail, `passing` pass. The floor counts a block as live until
  // its free_completed entry; a policy that reuses memory sooner (a free's pages taken on
  // the same stream, or behind a device-side wait on the freeing stream) may run below it,
  // so the capacity under the floor is replayed too, and halved while it passes.
  std::size_t failing = (floor - 1) / step;
  std::optional<std::size_t> passed_below_floor;
  Result at_passing;
  while (failing > 0) {
    if (options.progress) options.progress(0, passed_below_floor ? *passed_below_floor * step : 0,
                                           failing * step);
    Result r = try_capacity(failing * step);
    if (r.ooms > 0) break;
    passed_below_floor = failing;
    at_passing = std::move(r);
    failing /= 2;
  }
  std::size_t passing = failing + 1;
  if (passed_below_floor) {
    passing = *passed_below_floor;
  } else {
    const Result unconstrained = try_capacity(std::min(Options{}.capacity, limit));
    passing = std::max<std::size_t>(
        failing + 1,
        (static_cast<std::size_t>(unconstrained.peak_reserved_bytes) + step - 1) / step);
  }
  for (; !passed_below_floor;) {
    if (options.progress) options.progress(failing * step, 0, passing * step);
    at_passing = try_capacity(passing * step);
    if (at_passing.ooms == 0) break;
    failing = passing;
    if (passing * step >= limit) {
      throw Error(
          "ccalloc fit: " + (options.conf.empty() ? std::string("(default)") : options.conf) +
          " runs out of memory even on a device of " + format_size(passing * step));
    }
    passing = std::min(passing * 2, limit / step);
  }
  while (passing - failing > 1) {
    const std::size_t mid = failing + (passing - failing) / 2;
    if (options.progress) options.progress(failing * step, passing * step, mid * step);
    Result r = try_capacity(mid * step);
    if (r.ooms == 0) {
      passing = mid;
      at_passing = std::move(r);
    } else {
      failing = mid;
    }
  }
  out.capacity = passing * step;
  out.peak_reserved_bytes = at_passing.peak_reserved_bytes;
  out.simulated_driver_us = at_passing.simulated_driver_us;
  // Verify both sides by replaying again.
  out.passes_at_capacity = try_capacity(out.capacity).ooms == 0;
  out.fails_below = out.capacity == step || try_capacity(out.capacity - step).ooms > 0;
  return out;
}

}  // namespace ccalloc::replay
