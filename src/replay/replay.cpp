#include "replay/replay.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <unordered_map>

#include "ccalloc/allocator.hpp"
#include "ccalloc/snapshot.hpp"
#include "core/format.hpp"

namespace ccalloc::replay {
namespace {

// Side streams that stand for the recorded run's other streams; far from any real id.
constexpr StreamId kSideStreamBase = StreamId{1} << 62;

[[noreturn]] void bad_row(const io::TraceRecord& r, const std::string& what) {
  throw FormatError("line " + std::to_string(r.line) + ": " + what);
}

}  // namespace

void RecordedCounter::add(const TraceEntry& e) {
  // Sizes beyond int64 (an impossible request) count at the largest figure.
  const auto size = static_cast<std::int64_t>(
      std::min<std::uint64_t>(e.size, std::numeric_limits<std::int64_t>::max() / 4));
  switch (e.action) {
    case TraceAction::kSegmentAlloc:
    case TraceAction::kSegmentMap:
      reserved_ += size;
      ++r_.device_allocs;
      r_.peak_reserved_bytes = std::max(r_.peak_reserved_bytes, reserved_);
      break;
    case TraceAction::kSegmentFree:
    case TraceAction::kSegmentUnmap:
      reserved_ -= size;
      ++r_.device_frees;
      break;
    case TraceAction::kAlloc:
      live_[e.addr] = size;
      requested_ += size;
      r_.peak_requested_bytes = std::max(r_.peak_requested_bytes, requested_);
      break;
    case TraceAction::kFreeCompleted:
      if (const auto it = live_.find(e.addr); it != live_.end()) {
        requested_ -= it->second;
        live_.erase(it);
      }
      break;
    case TraceAction::kOom:
      ++r_.ooms;
      break;
    default:
      break;
  }
}

Recorded recorded_figures(const std::vector<io::TraceRecord>& trace) {
  RecordedCounter counter;
  for (const io::TraceRecord& rec : trace)
    counter.add(rec.entry);
  return counter.figures();
}

Result run(const std::vector<io::TraceRecord>& trace, const Options& options) {
  std::vector<sim::OracleEntry> oracle;
  if (options.address_oracle) {
    for (const io::TraceRecord& rec : trace) {
      if (rec.entry.action == TraceAction::kSegmentAlloc) {
        oracle.push_back({rec.entry.addr, rec.entry.size});
      }
    }
  }
  std::size_t i = 0;
  return run(
      [&](io::TraceRecord& out) {
        if (i == trace.size()) return false;
        out = trace[i++];
        return true;
      },
      options, std::move(oracle));
}

Result run(const TraceSource& source, const Options& options, std::vector<sim::OracleEntry> oracle,
           Recorded* recorded) {
  sim::Options sim_options;
  sim_options.capacity = options.capacity;
  sim_options.cost = options.cost;
  sim_options.gpu_lag_us = options.gpu_lag_us.value_or(kDefaultGpuLagUs);
  sim_options.lagged_streams_end = kSideStreamBase;
  sim::SimDriver gpu(sim_options);
  if (options.address_oracle) gpu.set_address_oracle(std::move(oracle));

  Result result;
  result.conf = options.conf;
  Allocator allocator(gpu, Config::parse(options.conf));
  if (options.check_invariants) allocator.set_check_invariants(true);
  if (options.keep_trace) {
    allocator.add_trace_observer([&result](const TraceEntry& e) { result.emitted.push_back(e); });
  }
  if (options.keep_snapshot || options.keep_oom_snapshot) {
    HistoryOptions history;
    history.context = HistoryOptions::Context::kNone;
    history.stacks = HistoryOptions::Stacks::kNone;
    // Unbounded: an OOM path may add many entries (segment frees, the oom) to one row.
    history.max_entries = std::numeric_limits<std::size_t>::max();
    allocator.record_history(history);
  }

  std::unordered_map<DevicePtr, DevicePtr> live;      // recorded address -> ours
  std::unordered_map<DevicePtr, StreamId> pending;    // recorded address -> side stream
  std::unordered_map<DevicePtr, std::size_t> failed;  // allocs that hit OOM here
  StreamId next_side_stream = kSideStreamBase;
  // The address whose free_completed row is already consumed (freed with its request).
  bool completed_pending = false;
  DevicePtr completed_with_request = 0;

  RecordedCounter counter;
  // One record of lookahead: a free_requested directly followed by its free_completed frees
  // at once.
  io::TraceRecord rec;
  io::TraceRecord ahead;
  bool have_ahead = source(ahead);
  std::uint64_t record = 0;  // the index of `rec` among the trace's records
  for (; have_ahead; ++record) {
    rec = ahead;
    have_ahead = source(ahead);
    const TraceEntry& e = rec.entry;
    if (recorded != nullptr) counter.add(e);
    gpu.set_time_us(e.time_us);
    switch (e.action) {
      case TraceAction::kAlloc: {
        if (live.count(e.addr) != 0)
          bad_row(rec, "alloc at " + hex_address(e.addr) + ", which is live");
        try {
          live.emplace(e.addr, allocator.malloc(e.size, e.stream));
          failed.erase(e.addr);
        } catch (const OutOfMemoryError& oom) {
          // Refused as the recorded run's allocator would refuse it: counted as an OOM, and
          // its frees are skipped.
          if (result.ooms++ == 0) {
            result.first_oom_message = oom.what();
            result.first_oom_record = record;
            if (options.keep_oom_snapshot) result.oom_snapshot = allocator.snapshot();
          }
          ++failed[e.addr];
        }
        break;
      }
      case TraceAction::kFreeRequested: {
        const auto it = live.find(e.addr);
        if (it == live.end()) {
          if (failed.count(e.addr) != 0) break;
          bad_row(rec, "free_requested of " + hex_address(e.addr) + ", which is not live");
        }
        const DevicePtr ours = it->second;
        live.erase(it);
        const bool completes_now = have_ahead &&
                                   ahead.entry.action == TraceAction::kFreeCompleted &&
                                   ahead.entry.addr == e.addr;
        if (completes_now) {
          allocator.free(ours);
          completed_with_request = e.addr;
          completed_pending = true;
        } else {
          const StreamId side = next_side_stream++;
          allocator.record_stream(ours, side);
          allocator.free(ours);
          pending[e.addr] = side;
        }
        break;
      }
      case TraceAction::kFreeCompleted: {
        if (completed_pending && completed_with_request == e.addr) {
          completed_pending = false;
          break;
        }
        const auto it = pending.find(e.addr);
        if (it == pending.end()) {
          if (failed.erase(e.addr) != 0) break;
          bad_row(rec,
                  "free_completed of " + hex_address(e.addr) + " without a pending free_requested");
        }
        gpu.complete_stream(it->second);
        pending.erase(it);
        break;
      }
      default:
        break;  // the recorded allocator's decisions: not replayed
    }
  }

  if (recorded != nullptr) *recorded = counter.figures();
  result.stats = allocator.stats();
  if (options.keep_snapshot) result.snapshot = allocator.snapshot();
  const DeviceStats& s = result.stats;
  // The stream-ordered pool backend knows only the bytes in use, which are the requested
  // bytes there (PyTorch's cudaMallocAsync backend leaves requested_bytes at 0).
  result.peak_requested_bytes = allocator.config().backend == BackendKind::kCudaMallocAsync
                                    ? s.allocated_bytes[kAggregate].peak
                                    : s.requested_bytes[kAggregate].peak;
  result.peak_allocated_bytes = s.allocated_bytes[kAggregate].peak;
  result.peak_reserved_bytes = s.reserved_bytes[kAggregate].peak;
  result.device_allocs = s.num_device_alloc;
  result.device_frees = s.num_device_free;
  result.alloc_retries = s.num_alloc_retries;
  result.oracle_hits = gpu.oracle_hits();
  result.oracle_diverged = gpu.oracle_diverged();
  // Destroying the allocator returns its segments; that is not part of the workload.
  result.simulated_driver_us = gpu.simulated_driver_us();
  result.driver_counters = gpu.counters();
  return result;
}

std::size_t parse_size(const std::string& text) {
  std::size_t pos = 0;
  while (pos < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[pos])) || text[pos] == '.')) {
    ++pos;
  }
  const std::string number = text.substr(0, pos);
  std::string unit = text.substr(pos);
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  char* end = nullptr;
  const double value = number.empty() ? -1.0 : std::strtod(number.c_str(), &end);
  struct Unit {
    const char* name;
    double factor;
  };
  static constexpr Unit kUnits[] = {
      {"", 1.0},       {"b", 1.0},    {"kib", 0x1p10}, {"mib", 0x1p20}, {"gib", 0x1p30},
      {"tib", 0x1p40}, {"kb", 1e3},   {"mb", 1e6},     {"gb", 1e9},     {"tb", 1e12},
      {"k", 0x1p10},   {"m", 0x1p20}, {"g", 0x1p30},   {"t", 0x1p40},
  };
  const Unit* unit_found = nullptr;
  for (const Unit& u : kUnits) {
    if (unit == u.name) unit_found = &u;
  }
  if (value < 0 || end == nullptr || *end != '\0' || unit_found == nullptr) {
    throw Error("invalid size '" + text +
                "': expected a number with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, "
                "TB), e.g. 141GiB");
  }
  const double bytes = std::round(value * unit_found->factor);
  if (!(bytes >= 1.0) || bytes > 0x1p62) {
    throw Error("invalid size '" + text + "': must be between 1 byte and 4 EiB");
  }
  return static_cast<std::size_t>(bytes);
}

}  // namespace ccalloc::replay
