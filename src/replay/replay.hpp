// Replaying a recorded allocation trace on the simulated GPU.
//
// `alloc` rows become malloc(requested size, stream); `free_requested` rows become free.
// A `free_completed` row that does not directly follow its `free_requested` marks a block
// that was in use on another stream: the replay records a use of it on a private side
// stream before freeing it, and completes that stream at the `free_completed` row, so the
// block returns to its pool at the next malloc, as it did in the recorded run. Segment and
// OOM rows are the recorded allocator's own decisions: they are not replayed, but give the
// address oracle and the recorded figures to compare against.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"
#include "ccalloc/stats.hpp"
#include "io/trace_csv.hpp"

namespace ccalloc::replay {

struct Options {
  std::string conf;  // config string in CCALLOC_CONF grammar
  std::size_t capacity = 141 * sim::kGiB;
  // Hand out the trace's own segment addresses, in order, while the sizes match.
  bool address_oracle = false;
  // Keep the replay's own trace entries in Result::emitted.
  bool keep_trace = false;
  // Record history (context none) and keep the final snapshot in Result::snapshot.
  bool keep_snapshot = false;
  // Record history (context none) and keep the allocator's snapshot just after its first
  // OOM in Result::oom_snapshot: the memory as it was when the request failed, after the
  // OOM ladder had released what it could.
  bool keep_oom_snapshot = false;
  // Run the allocator's invariant checker after every operation (slow: for tests).
  bool check_invariants = false;
  // How far the GPU runs behind the trace's clock: an event the allocator records on a
  // stream of the trace completes this long after it was recorded (sim::Options::gpu_lag_us;
  // the replay's side streams, which stand for other streams' uses, complete at the trace's
  // free_completed rows as before). Unset: kDefaultGpuLagUs.
  std::optional<std::int64_t> gpu_lag_us;
  sim::CostModel cost;
};

struct Result {
  std::string conf;
  std::int64_t peak_requested_bytes = 0;
  std::int64_t peak_allocated_bytes = 0;
  std::int64_t peak_reserved_bytes = 0;
  std::int64_t device_allocs = 0;
  std::int64_t device_frees = 0;
  std::int64_t alloc_retries = 0;
  // Every request the allocator refused with OutOfMemoryError: the OOM ladder's (num_ooms)
  // and those refused before it, such as PyTorch's guard against more than 1 EB.
  std::int64_t ooms = 0;
  // The allocator's message for the first of them, and the index of its alloc row among
  // the trace's records (0-based).
  std::string first_oom_message;
  std::uint64_t first_oom_record = 0;
  double simulated_driver_us = 0.0;
  sim::Counters driver_counters;  // the simulated GPU's call counts for the workload
  std::size_t oracle_hits = 0;
  bool oracle_diverged = false;
  DeviceStats stats;                 // at the end of the replay
  std::vector<TraceEntry> emitted;   // with keep_trace
  std::optional<Snapshot> snapshot;      // with keep_snapshot
  std::optional<Snapshot> oom_snapshot;  // with keep_oom_snapshot, where an OOM happened
};

// What the recorded allocator did, computed from the trace itself.
struct Recorded {
  std::int64_t peak_requested_bytes = 0;  // live requested bytes (alloc .. free_completed)
  std::int64_t peak_reserved_bytes = 0;   // running sum of segment_alloc/map - free/unmap
  std::int64_t device_allocs = 0;         // segment_alloc + segment_map rows
  std::int64_t device_frees = 0;          // segment_free + segment_unmap rows
  std::int64_t ooms = 0;
};

Recorded recorded_figures(const std::vector<io::TraceRecord>& trace);

// The replay's GPU lag where the caller gives none: the middle of the fence latencies that
// the stitching policy measured on the device (bench/torch/scale.py on two H200s: recent
// averages of 1.2 and 4.5 ms under FSDP2, 6.7 ms for GPT-2 with side streams). A trace's
// own cross-stream frees overstate it: their completion is seen only at a later malloc, and
// they wait for the heaviest kernels (126 ms on the same GPT-2 run).
inline constexpr std::int64_t kDefaultGpuLagUs = 4'500;

// recorded_figures() one record at a time, for a trace that is streamed.
class RecordedCounter {
 public:
  void add(const TraceEntry& e);
  const Recorded& figures() const { return r_; }

 private:
  Recorded r_;
  std::int64_t reserved_ = 0;
  std::int64_t requested_ = 0;
  std::unordered_map<DevicePtr, std::int64_t> live_;  // address -> requested size
};

// Pulls the next record of a trace into its argument; false at the end.
using TraceSource = std::function<bool(io::TraceRecord&)>;

// Replays the records `source` yields, holding only the allocator's live state (and one
// record of lookahead), whatever the trace's length. With options.address_oracle the
// segment addresses come from `oracle` (the trace's segment_alloc rows in order; collect
// them in a first pass). `recorded`, if given, receives the trace's recorded figures.
Result run(const TraceSource& source, const Options& options,
           std::vector<sim::OracleEntry> oracle = {}, Recorded* recorded = nullptr);

// Replays `trace` (rows in order) under `options`. Throws FormatError naming the row's line
// for a trace that is inconsistent (a free of an address that is not live, an alloc at a
// live address), ConfigError for a bad config.
Result run(const std::vector<io::TraceRecord>& trace, const Options& options);

// memory_stats() of the device that recorded a snapshot. When the snapshot's trace covers
// the whole run (no overflowed history, segment events from the first one) it is replayed
// under the snapshot's own allocator settings with its device addresses, which reproduces
// the recording allocator's statistics, peaks and totals included; `method` is then
// "replay". Otherwise the current values come from the segments, peaks equal them and
// totals are 0 ("segments").
DeviceStats stats_from_snapshot(const Snapshot& s, int device, std::string* method = nullptr);

// Parses sizes such as "141GiB", "80GB", "512MiB", "1.5TiB" or plain bytes. Binary (KiB,
// MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units; case-insensitive. Throws Error naming
// the text.
std::size_t parse_size(const std::string& text);

}  // namespace ccalloc::replay
