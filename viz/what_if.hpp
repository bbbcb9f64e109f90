// "Which config would have avoided this OOM?", answered by replaying the trace.
//
// The trace of a run that hit out-of-memory is replayed on a simulated GPU of the memory
// the allocator could have had (the replay's own capacity, or reserved + device free at
// the first OOM), under the config it ran with and under alternatives. A failed request
// left no alloc in the trace, only its `oom` entry: the replay turns each into an alloc of
// the rounded request that is freed at once, so a config that serves it counts no OOM
// there. The same configs on an unlimited device give the memory each one needs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ccalloc/snapshot.hpp"
#include "io/trace_csv.hpp"
#include "replay/replay.hpp"
#include "viz/model.hpp"

namespace ccalloc::viz {

struct WhatIfRun {
  std::string label;  // e.g. "as recorded", "expandable_segments:True"
  std::string conf;   // the full config string replayed
  std::size_t capacity = 0;
  bool unlimited = false;  // the capacity stands for "as much as it needs"
  std::int64_t ooms = 0;
  std::int64_t peak_reserved_bytes = 0;
  std::string error;  // the replay failed (an inconsistent or partial trace)
};

struct WhatIfReport {
  std::size_t capacity = 0;               // device memory the limited replays have
  std::string capacity_source;            // how it was found, for the page
  std::int64_t peak_requested_bytes = 0;  // live requested bytes at their peak: the floor
  std::vector<WhatIfRun> runs;
};

// Replays a trace and returns the final snapshot with the replay's whole trace as its
// history. The replay's own history ring is sized for the input trace, and a replay that
// runs out of memory writes more entries than that (the cache releases and the oom
// entries), so the ring would lose the first ones: the trace comes from a trace observer
// instead. `result` receives the replay's figures when given.
Snapshot replay_with_history(const std::vector<io::TraceRecord>& trace, replay::Options options,
                             replay::Result* result = nullptr);

// Replays the device's trace of `s` under `conf` and alternatives (see above). `capacity`
// is the device memory when known (a replay's); otherwise it is estimated at the first
// OOM from `model`. Returns an empty report when the trace has no OOM.
WhatIfReport oom_what_if(const Snapshot& s, const Model& model, const std::string& conf,
                         std::optional<std::size_t> capacity);

}  // namespace ccalloc::viz
