#include "viz/what_if.hpp"

#include <algorithm>

#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "io/snapshot_io.hpp"
#include "replay/replay.hpp"

namespace ccalloc::viz {
namespace {

// Stand-in addresses for the requests that failed: above any device address (48 bits).
constexpr DevicePtr kFailedRequestBase = DevicePtr{0xfff0} << 48;

// The trace with each oom entry replaced by an alloc of the rounded request, freed at once.
std::vector<io::TraceRecord> with_failed_requests(const Snapshot& s, int device) {
  std::vector<io::TraceRecord> out;
  DevicePtr next = kFailedRequestBase;
  for (io::TraceRecord r : io::trace_records(s, device)) {
    if (r.entry.action != TraceAction::kOom) {
      out.push_back(r);
      continue;
    }
    r.entry.addr = next;
    next += 512;
    for (TraceAction a :
         {TraceAction::kAlloc, TraceAction::kFreeRequested, TraceAction::kFreeCompleted}) {
      r.entry.action = a;
      out.push_back(r);
    }
  }
  return out;
}

// Reserved bytes after event e: the spans held then.
std::uint64_t reserved_at(const Model& m, std::int32_t e) {
  std::uint64_t reserved = 0;
  for (const SegmentSpan& s : m.spans) {
    if (s.start <= e && e < s.end) reserved += s.size;
  }
  return reserved;
}

}  // namespace

Snapshot replay_with_history(const std::vector<io::TraceRecord>& trace, replay::Options options,
                             replay::Result* result) {
  options.keep_snapshot = true;
  options.keep_trace = true;
  replay::Result r = replay::run(trace, options);
  Snapshot s = std::move(*r.snapshot);
  r.snapshot.reset();
  std::vector<SnapshotTraceEntry> history;
  history.reserve(r.emitted.size());
  for (const TraceEntry& e : r.emitted) {
    SnapshotTraceEntry h;
    h.action = e.action;
    h.addr = e.addr;
    h.size = e.size;
    h.stream = e.stream;
    h.time_us = e.time_us;
    history.push_back(h);
  }
  r.emitted.clear();
  s.device_traces.assign(1, std::move(history));
  s.allocator_settings.trace_alloc_overflowed = false;
  if (result != nullptr) *result = std::move(r);
  return s;
}

WhatIfReport oom_what_if(const Snapshot& s, const Model& model, const std::string& conf,
                         std::optional<std::size_t> capacity) {
  WhatIfReport report;
  const auto first_oom = std::find(model.kind.begin(), model.kind.end(), EventKind::kOom);
  if (first_oom == model.kind.end()) return report;
  const auto oom_event = static_cast<std::int32_t>(first_oom - model.kind.begin());

  if (capacity) {
    report.capacity = *capacity;
    report.capacity_source = "the simulated device's capacity";
  } else {
    // The allocator could have had what it held plus what the device still had free.
    report.capacity =
        reserved_at(model, oom_event) + model.addr[static_cast<std::size_t>(oom_event)];
    report.capacity_source =
        "reserved + device free at the first OOM (event " + std::to_string(oom_event) + ")";
  }
  const std::vector<io::TraceRecord> trace = with_failed_requests(s, model.device);
  report.peak_requested_bytes = replay::recorded_figures(trace).peak_requested_bytes;

  const bool expandable = conf.find("expandable_segments:True") != std::string::npos;
  std::vector<std::pair<std::string, std::string>> configs{{"as recorded", conf}};
  if (!expandable) {
    configs.emplace_back("expandable_segments:True", conf + ",expandable_segments:True");
  }
  const std::size_t unlimited = std::max<std::size_t>(report.capacity * 8, 141 * sim::kGiB);
  for (const bool limited : {true, false}) {
    for (const auto& [label, c] : configs) {
      WhatIfRun run;
      run.label = label;
      run.conf = c;
      run.capacity = limited ? report.capacity : unlimited;
      run.unlimited = !limited;
      replay::Options options;
      options.conf = c;
      options.capacity = run.capacity;
      options.address_oracle = true;
      try {
        const replay::Result r = replay::run(trace, options);
        run.ooms = r.ooms;
        run.peak_reserved_bytes = r.peak_reserved_bytes;
      } catch (const Error& e) {
        run.error = e.what();
      }
      report.runs.push_back(std::move(run));
    }
  }
  return report;
}

}  // namespace ccalloc::viz
