// The ccalloc command-line tool.
//
//   ccalloc replay FILE [--conf STRING]... [--capacity SIZE] [--address-oracle]
//                       [--emit-trace FILE] [--snapshot-out FILE] [--oom-snapshot FILE]
//                       [--json] [--max-entries N]
//                       [--device N] [--gpu-lag-us N]
//   ccalloc fit FILE [--conf STRING]... [--json] [--device N]
//   ccalloc summary FILE [--device N]
//   ccalloc stats FILE [--device N]
//   ccalloc convert IN OUT [--device N]
//   ccalloc viz FILE -o OUT.html [--device N] [--conf STRING] [--capacity SIZE]
//   ccalloc info
//
// FILE is a trace CSV, a snapshot (pickle or JSON, PyTorch's or ccalloc's) or an RMM log,
// gzip or plain.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "ccalloc/config.hpp"
#include "ccalloc/cuda.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/stats.hpp"
#include "io/gzip.hpp"
#include "io/rmm_log.hpp"
#include "io/snapshot_io.hpp"
#include "io/trace_csv.hpp"
#include "io/trace_file.hpp"
#include "replay/fit.hpp"
#include "replay/physical_view.hpp"
#include "replay/replay.hpp"
#include "viz.hpp"

namespace {

using ccalloc::replay::Recorded;
using ccalloc::replay::Result;

// 12465471488 -> "12,465,471,488"
std::string grouped(std::int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// "--emit-trace out.csv" with several configs writes out.1.csv, out.2.csv, ...
std::string numbered_path(const std::string& path, std::size_t index, std::size_t count) {
  if (count == 1) return path;
  std::string stem = path;
  std::string ext;
  // The number goes before the whole extension, which the writers read the format from.
  for (const char* e : {".pickle.gz", ".json.gz", ".csv.gz", ".pickle", ".json", ".csv", ".gz"}) {
    const std::string es(e);
    if (stem.size() > es.size() && stem.compare(stem.size() - es.size(), es.size(), es) == 0) {
      ext = es;
      stem.resize(stem.size() - es.size());
      break;
    }
  }
  return stem + "." + std::to_string(index + 1) + ext;
}

void print_table(const std::string& trace_path, std::size_t rows, std::size_t capacity,
                 const Recorded& recorded, const std::vector<Result>& results) {
  // Long config strings become lettered columns with a legend underneath.
  bool use_letters = false;
  for (const Result& r : results)
    use_letters = use_letters || r.conf.size() > 24;
  std::vector<std::string> header{"", "recorded"};
  std::vector<std::string> legend;
  for (std::size_t i = 0; i < results.size(); ++i) {
    const std::string conf = results[i].conf.empty() ? "(default)" : results[i].conf;
    if (use_letters) {
      const std::string label(1, static_cast<char>('A' + i % 26));
      header.push_back(label);
      legend.push_back("  " + label + " = " + conf);
    } else {
      header.push_back(conf);
    }
  }

  std::vector<std::vector<std::string>> table;
  const auto ratio = [](std::int64_t a, std::int64_t b) {
    return b > 0 ? fixed(static_cast<double>(a) / static_cast<double>(b), 3) : std::string("-");
  };
  const auto add = [&](const std::string& name, const std::string& rec, auto&& value) {
    std::vector<std::string> row{name, rec};
    for (const Result& r : results)
      row.push_back(value(r));
    table.push_back(std::move(row));
  };
  add("peak_requested_bytes", grouped(recorded.peak_requested_bytes),
      [](const Result& r) { return grouped(r.peak_requested_bytes); });
  add("peak_allocated_bytes", "-", [](const Result& r) { return grouped(r.peak_allocated_bytes); });
  add("peak_reserved_bytes", grouped(recorded.peak_reserved_bytes),
      [](const Result& r) { return grouped(r.peak_reserved_bytes); });
  add("reserved / requested", ratio(recorded.peak_reserved_bytes, recorded.peak_requested_bytes),
      [&](const Result& r) { return ratio(r.peak_reserved_bytes, r.peak_requested_bytes); });
  add("device_allocs", grouped(recorded.device_allocs),
      [](const Result& r) { return grouped(r.device_allocs); });
  add("device_frees", grouped(recorded.device_frees),
      [](const Result& r) { return grouped(r.device_frees); });
  add("alloc_retries", "-", [](const Result& r) { return grouped(r.alloc_retries); });
  add("ooms", grouped(recorded.ooms), [](const Result& r) { return grouped(r.ooms); });
  add("memory_driver_calls", "-", [](const Result& r) {
    const ccalloc::sim::Counters& c = r.driver_counters;
    return grouped(static_cast<std::int64_t>(c.allocate_calls + c.free_calls + c.reserve_calls +
                                             c.physical_creates + c.physical_releases + c.maps +
                                             c.unmaps));
  });
  add("simulated_driver_ms", "-",
      [](const Result& r) { return fixed(r.simulated_driver_us / 1000.0, 1); });
  // Device-side waits of one stream on another that the allocator inserted (the stitching
  // policy's borrowing between streams).
  add("stream_waits", "-", [](const Result& r) {
    return grouped(static_cast<std::int64_t>(r.driver_counters.stream_waits));
  });

  std::vector<std::size_t> width(header.size(), 0);
  for (std::size_t c = 0; c < header.size(); ++c)
    width[c] = header[c].size();
  for (const auto& row : table) {
    for (std::size_t c = 0; c < row.size(); ++c)
      width[c] = std::max(width[c], row[c].size());
  }
  std::cout << "Trace " << trace_path << ": " << grouped(static_cast<std::int64_t>(rows))
            << " entries, replayed on a simulated GPU of " << ccalloc::format_size(capacity)
            << "\n\n";
  const auto print_row = [&](const std::vector<std::string>& row) {
    std::string line;
    for (std::size_t c = 0; c < row.size(); ++c) {
      const std::string& cell = row[c];
      if (c == 0) {
        line += cell + std::string(width[c] - cell.size(), ' ');
      } else {
        line += "   " + std::string(width[c] - cell.size(), ' ') + cell;
      }
    }
    std::cout << line << "\n";
  };
  print_row(header);
  for (const auto& row : table)
    print_row(row);
  if (!legend.empty()) {
    std::cout << "\n";
    for (const std::string& line : legend)
      std::cout << line << "\n";
  }
  for (std::size_t i = 0; i < results.size(); ++i) {
    if (results[i].ooms == 0) continue;
    std::cout << "\nfirst OOM under " << header[i + 2] << ", at entry "
              << grouped(static_cast<std::int64_t>(results[i].first_oom_record + 1))
              << " of the trace: " << results[i].first_oom_message << "\n";
  }
  std::cout << "\nrecorded: what the recorded allocator did (from the trace's own segment rows).\n";
}

nlohmann::json to_json(const Result& r) {
  nlohmann::json j;
  j["conf"] = r.conf;
  j["peak_requested_bytes"] = r.peak_requested_bytes;
  j["peak_allocated_bytes"] = r.peak_allocated_bytes;
  j["peak_reserved_bytes"] = r.peak_reserved_bytes;
  j["device_allocs"] = r.device_allocs;
  j["device_frees"] = r.device_frees;
  j["alloc_retries"] = r.alloc_retries;
  j["ooms"] = r.ooms;
  if (r.ooms != 0) {
    j["first_oom_message"] = r.first_oom_message;
    j["first_oom_entry"] = r.first_oom_record + 1;  // 1-based, as the table prints it
  }
  j["simulated_driver_us"] = r.simulated_driver_us;
  const ccalloc::sim::Counters& c = r.driver_counters;
  j["driver_calls"] = {
      {"allocate", c.allocate_calls},
      {"free", c.free_calls},
      {"reserve_address_range", c.reserve_calls},
      {"create_physical", c.physical_creates},
      {"release_physical", c.physical_releases},
      {"map", c.maps},
      {"unmap", c.unmaps},
      {"synchronize", c.event_synchronizes + c.stream_synchronizes + c.device_synchronizes},
      {"stream_wait", c.stream_waits}};
  j["oracle_hits"] = r.oracle_hits;
  j["oracle_diverged"] = r.oracle_diverged;
  j["memory_stats"] = r.stats.to_map();
  return j;
}

// The device whose trace a file holds: `device` where it is given (>= 0), else the first
// with entries.
int trace_device(const std::string& path, int device, const ccalloc::io::ReadLimits& limits) {
  return device >= 0 ? device : ccalloc::io::first_device_with_entries(path, limits);
}

// The trace is streamed once per config, so memory follows the allocator's live state,
// not the file's length.
int run_replay(const std::string& trace_path, const std::vector<std::string>& confs,
               const std::string& capacity_text, bool oracle, const std::string& emit_path,
               const std::string& snapshot_path, const std::string& oom_snapshot_path,
               bool json, std::uint64_t max_entries, int device_arg, std::int64_t gpu_lag_us) {
  ccalloc::io::ReadLimits limits = ccalloc::io::ReadLimits::from_environment();
  if (max_entries != 0) limits.max_entries = max_entries;
  const int device = trace_device(trace_path, device_arg, limits);
  ccalloc::replay::Options options;
  options.capacity = ccalloc::replay::parse_size(capacity_text);
  options.address_oracle = oracle;
  options.keep_trace = !emit_path.empty();
  options.keep_snapshot = !snapshot_path.empty();
  options.keep_oom_snapshot = !oom_snapshot_path.empty();

  if (gpu_lag_us >= 0) options.gpu_lag_us = gpu_lag_us;

  std::vector<ccalloc::sim::OracleEntry> segments;
  if (oracle) {
    ccalloc::io::TraceReader reader(trace_path, device, limits);
    ccalloc::io::TraceRecord r;
    while (reader.next(r)) {
      if (r.entry.action == ccalloc::TraceAction::kSegmentAlloc) {
        segments.push_back({r.entry.addr, r.entry.size});
      }
    }
  }
  Recorded recorded;
  std::uint64_t rows = 0;
  std::vector<Result> results;
  const std::vector<std::string> configs = confs.empty() ? std::vector<std::string>{""} : confs;
  for (std::size_t i = 0; i < configs.size(); ++i) {
    options.conf = configs[i];
    try {
      ccalloc::io::TraceReader reader(trace_path, device, limits);
      results.push_back(
          ccalloc::replay::run([&reader](ccalloc::io::TraceRecord& r) { return reader.next(r); },
                               options, segments, i == 0 ? &recorded : nullptr));
      rows = reader.count();
    } catch (const ccalloc::FormatError& e) {
      // The reader's errors name the file already; the replay's name only the line.
      const std::string what = e.what();
      if (what.starts_with(trace_path + ":")) throw;
      throw ccalloc::FormatError(trace_path + ": " + what);
    }
    if (options.keep_trace) {
      ccalloc::io::write_file(numbered_path(emit_path, i, configs.size()),
                              ccalloc::io::format_trace_csv(results.back().emitted));
      results.back().emitted.clear();
    }
    if (options.keep_snapshot) {
      ccalloc::io::write_snapshot(numbered_path(snapshot_path, i, configs.size()),
                                  *results.back().snapshot);
      results.back().snapshot.reset();
    }
    if (options.keep_oom_snapshot) {
      const std::string name = configs[i].empty() ? "the default config" : configs[i];
      if (results.back().oom_snapshot) {
        const std::string path = numbered_path(oom_snapshot_path, i, configs.size());
        ccalloc::io::write_snapshot(path, *results.back().oom_snapshot);
        results.back().oom_snapshot.reset();
        std::cerr << "the snapshot at the first OOM under " << name << ": " << path << "\n";
      } else {
        std::cerr << "no OOM under " << name << ": no OOM snapshot written\n";
      }
    }
  }
  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const Result& r : results)
      out.push_back(to_json(r));
    std::cout << out.dump(2) << "\n";
  } else {
    print_table(trace_path, rows, options.capacity, recorded, results);
  }
  return 0;
}

// Per config, the smallest simulated device (a multiple of 2 MiB) that replays the trace
// with no OOM; each answer is verified by replaying at it and at 2 MiB less.
int run_fit(const std::string& trace_path, const std::vector<std::string>& confs, bool json,
            int device) {
  const auto trace = ccalloc::io::read_any_trace(
      trace_path, trace_device(trace_path, device, ccalloc::io::ReadLimits::from_environment()));
  const bool tty = isatty(STDERR_FILENO) != 0;
  std::vector<ccalloc::replay::FitResult> results;
  const std::vector<std::string> configs = confs.empty() ? std::vector<std::string>{""} : confs;
  for (const std::string& conf : configs) {
    ccalloc::replay::FitOptions options;
    options.conf = conf;
    const std::string name = conf.empty() ? "(default)" : conf;
    if (tty) {
      options.progress = [&name](std::size_t failing, std::size_t passing, std::size_t trying) {
        std::fprintf(stderr, "\r\033[Kfit %s: fails at %s, %s; trying %s", name.c_str(),
                     grouped(static_cast<std::int64_t>(failing)).c_str(),
                     passing == 0
                         ? "no passing capacity yet"
                         : ("passes at " + grouped(static_cast<std::int64_t>(passing))).c_str(),
                     grouped(static_cast<std::int64_t>(trying)).c_str());
      };
    }
    try {
      results.push_back(ccalloc::replay::fit(trace, options));
    } catch (const ccalloc::FormatError& e) {
      throw ccalloc::FormatError(trace_path + ": " + e.what());
    }
    if (tty) std::fprintf(stderr, "\r\033[K");
  }
  bool all_verified = true;
  for (const auto& r : results)
    all_verified = all_verified && r.verified();
  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : results) {
      nlohmann::json j;
      j["conf"] = r.conf;
      j["floor_bytes"] = r.floor_bytes;
      j["capacity_bytes"] = r.capacity;
      j["capacity_gb"] = static_cast<double>(r.capacity) / 1e9;
      j["ratio_to_floor"] = static_cast<double>(r.capacity) / static_cast<double>(r.floor_bytes);
      j["peak_reserved_bytes"] = r.peak_reserved_bytes;
      j["simulated_driver_us"] = r.simulated_driver_us;
      j["replays"] = r.replays;
      j["no_oom_at_capacity"] = r.passes_at_capacity;
      j["oom_at_2MiB_less"] = r.fails_below;
      j["verified"] = r.verified();
      out.push_back(j);
    }
    std::cout << out.dump(2) << "\n";
  } else {
    std::cout << "Trace " << trace_path << ": floor (peak live requested bytes) "
              << grouped(results.front().floor_bytes) << "\n\n";
    for (const auto& r : results) {
      std::cout << (r.conf.empty() ? "(default)" : r.conf) << "\n"
                << "  smallest capacity     " << grouped(static_cast<std::int64_t>(r.capacity))
                << " bytes (" << ccalloc::format_size(r.capacity) << ", "
                << fixed(static_cast<double>(r.capacity) / 1e9, 3) << " GB)\n"
                << "  capacity / floor      "
                << fixed(static_cast<double>(r.capacity) / static_cast<double>(r.floor_bytes), 4)
                << "\n"
                << "  peak reserved there   " << grouped(r.peak_reserved_bytes) << "\n"
                << "  verified              "
                << (r.verified() ? "yes: no OOM at this capacity, at least one at 2 MiB less"
                                 : std::string("NO: ") +
                                       (r.passes_at_capacity ? "" : "OOM at this capacity; ") +
                                       (r.fails_below ? "" : "no OOM at 2 MiB less"))
                << " (" << r.replays << " replays)\n";
    }
    if (results.size() > 1) {
      // The config that needs least, and how far each other one is from it.
      const auto least = std::min_element(
          results.begin(), results.end(),
          [](const auto& x, const auto& y) { return x.capacity < y.capacity; });
      const auto label = [](const ccalloc::replay::FitResult& r) {
        return r.conf.empty() ? std::string("(default)") : r.conf;
      };
      std::cout << "\nLeast memory: " << label(*least) << ", "
                << ccalloc::format_size(least->capacity) << " ("
                << fixed(static_cast<double>(least->capacity) / 1e9, 3) << " GB)\n";
      for (const auto& r : results) {
        if (&r == &*least) continue;
        const auto more = static_cast<std::int64_t>(r.capacity - least->capacity);
        std::cout << "  " << label(r) << ": +" << grouped(more) << " bytes ("
                  << ccalloc::format_size(static_cast<std::uint64_t>(more)) << ", +"
                  << fixed(100.0 * static_cast<double>(more) / static_cast<double>(least->capacity), 2)
                  << " %)\n";
      }
    }
  }
  return all_verified ? 0 : 2;
}

// "12.50 GiB (13421772800 bytes)"
std::string bytes(std::int64_t n) {
  return ccalloc::format_size(static_cast<std::uint64_t>(n < 0 ? 0 : n)) + " (" + grouped(n) +
         " bytes)";
}

// PyTorch's _memory_viz formats sizes as "3.3GiB": the same here, so figures compare.
std::string viz_size(double n) {
  static const char* const kUnits[] = {"", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "Zi"};
  for (const char* unit : kUnits) {
    if (n < 1024.0 && n > -1024.0) {
      char buf[48];
      std::snprintf(buf, sizeof buf, "%3.1f%sB", n, unit);
      return buf;
    }
    n /= 1024.0;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.1fYiB", n);
  return buf;
}

// ccalloc summary: memory_summary() for the snapshot's device, then each segment's
// fragmentation (free bytes against the largest free block) and the totals as PyTorch's
// `python -m torch.cuda._memory_viz stats` reports them.
int run_summary(const std::string& path, int device) {
  const ccalloc::Snapshot s = ccalloc::io::read_snapshot(path);
  std::string method;
  const ccalloc::DeviceStats stats = ccalloc::replay::stats_from_snapshot(s, device, &method);
  std::cout << ccalloc::memory_summary(stats, device);
  std::cout << "(statistics "
            << (method == "replay" ? "reproduced by replaying the snapshot's trace"
                                   : "from the segments' current state: peaks and totals "
                                     "need a trace that covers the whole run")
            << ")\n\n";

  std::cout << "segment             type   stream      size        allocated   free        "
               "largest free  fragmentation\n";
  std::int64_t reserved = 0, allocated = 0, free_external = 0, free_internal = 0;
  std::size_t count = 0;
  for (const ccalloc::SnapshotSegment& seg : s.segments) {
    if (seg.device != device) continue;
    ++count;
    std::int64_t seg_allocated = 0, seg_free = 0, largest = 0;
    for (const ccalloc::SnapshotBlock& b : seg.blocks) {
      if (b.state == ccalloc::BlockState::kActiveAllocated) {
        seg_allocated += static_cast<std::int64_t>(b.requested_size);
        free_internal += static_cast<std::int64_t>(b.size - b.requested_size);
      } else {
        seg_free += static_cast<std::int64_t>(b.size);
        if (b.state == ccalloc::BlockState::kInactive) {
          largest = std::max(largest, static_cast<std::int64_t>(b.size));
        }
      }
    }
    reserved += static_cast<std::int64_t>(seg.total_size);
    allocated += seg_allocated;
    free_external += seg_free;
    const double fragmentation =
        seg_free > 0 ? 100.0 * (1.0 - static_cast<double>(largest) / static_cast<double>(seg_free))
                     : 0.0;
    char line[256];
    std::snprintf(line, sizeof line,
                  "0x%-16llx  %-5s  %-10llu  %-10s  %-10s  %-10s  %-12s  %5.1f %%%s\n",
                  static_cast<unsigned long long>(seg.address), seg.is_small ? "small" : "large",
                  static_cast<unsigned long long>(seg.stream),
                  viz_size(static_cast<double>(seg.total_size)).c_str(),
                  viz_size(static_cast<double>(seg_allocated)).c_str(),
                  viz_size(static_cast<double>(seg_free)).c_str(),
                  viz_size(static_cast<double>(largest)).c_str(), fragmentation,
                  seg.is_expandable ? "  (expandable)" : seg.is_asleep ? "  (asleep)" : "");
    std::cout << line;
  }
  const std::int64_t total_free = free_external + free_internal;
  const double internal =
      total_free > 0 ? 100.0 * static_cast<double>(free_internal) / static_cast<double>(total_free)
                     : 0.0;
  char pct[32];
  std::snprintf(pct, sizeof pct, "%.0f", internal);
  std::cout << "\nsegments: " << count << "\n"
            << "total_reserved: " << viz_size(static_cast<double>(reserved)) << "  "
            << bytes(reserved) << "\n"
            << "total_allocated: " << viz_size(static_cast<double>(allocated)) << "  "
            << bytes(allocated) << " (requested sizes of live blocks)\n"
            << "total_free: " << viz_size(static_cast<double>(total_free)) << " (" << pct
            << "% internal)  " << bytes(total_free) << "\n";
  // The stitching policy: its segments are the live pages of its address ranges; the
  // memory held also counts spare pieces (total_reserved above is PyTorch's sum of
  // segments, which _memory_viz prints too).
  if (const auto physical = ccalloc::replay::physical_view(s, device)) {
    std::cout << "\n" << ccalloc::replay::physical_summary(*physical);
  }
  return 0;
}

// ccalloc stats: memory_stats() as JSON.
int run_stats(const std::string& path, int device) {
  const ccalloc::Snapshot s = ccalloc::io::read_snapshot(path);
  std::string method;
  const ccalloc::DeviceStats stats = ccalloc::replay::stats_from_snapshot(s, device, &method);
  nlohmann::ordered_json j;
  j["device"] = device;
  j["method"] = method;
  j["memory_stats"] = stats.to_map();
  std::cout << j.dump(2) << "\n";
  return 0;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// ccalloc convert: between snapshot formats (lossless), and between snapshots, trace CSVs
// and RMM logs. A trace becomes a snapshot by replaying it with PyTorch's policy and the
// trace's own device addresses.
int run_convert(const std::string& in, const std::string& out, int device) {
  const ccalloc::io::FileKind kind = ccalloc::io::detect_kind(in);
  const bool in_snapshot = kind == ccalloc::io::FileKind::kSnapshotPickle ||
                           kind == ccalloc::io::FileKind::kSnapshotJson;
  std::string base = out;
  if (ends_with(base, ".gz")) base.resize(base.size() - 3);
  const bool out_rmm = ends_with(base, ".rmm.csv") || ends_with(base, ".rmm.log");
  const bool out_csv = !out_rmm && ends_with(base, ".csv");
  const bool out_snapshot =
      ends_with(base, ".pickle") || ends_with(base, ".pkl") || ends_with(base, ".json");
  if (!out_rmm && !out_csv && !out_snapshot) {
    throw ccalloc::Error("convert: cannot tell the output format from '" + out +
                         "': name it *.pickle, *.json (snapshots), *.csv (trace CSV) or *.rmm.csv "
                         "(RMM log), optionally with .gz");
  }
  if (out_snapshot && in_snapshot) {
    ccalloc::io::write_value_file(out, ccalloc::io::read_value_file(in));
    return 0;
  }
  const auto trace = ccalloc::io::read_any_trace(in, device);
  if (out_snapshot) {
    ccalloc::replay::Options options;
    options.conf = "pytorch";
    options.address_oracle = true;
    options.keep_snapshot = true;
    ccalloc::io::write_snapshot(out, *ccalloc::replay::run(trace, options).snapshot);
    return 0;
  }
  std::vector<ccalloc::TraceEntry> entries;
  entries.reserve(trace.size());
  for (const auto& r : trace)
    entries.push_back(r.entry);
  ccalloc::io::write_file(
      out, out_rmm ? ccalloc::io::format_rmm_log(entries) : ccalloc::io::format_trace_csv(entries));
  return 0;
}

// ccalloc info: the version, the config in force, and what CUDA this process sees. Exits 0
// on a machine without a GPU, saying why none is visible.
int run_info() {
  std::cout << "ccalloc " << CCALLOC_VERSION << "\n";
  const char* source = "defaults";
  for (const char* var : {"CCALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
    if (std::getenv(var) != nullptr) {
      source = var;
      break;
    }
  }
  const ccalloc::Config config = ccalloc::Config::from_environment();
  std::cout << "config (" << source << "): " << config.to_string() << "\n";

  const ccalloc::cuda::RuntimeInfo info = ccalloc::cuda::probe();
  if (!info.built_with_cuda) {
    std::cout << "CUDA: not available (" << info.error << ")\n";
    return 0;
  }
  const auto version = [](int v) {
    return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
  };
  std::cout << "CUDA runtime: " << version(info.runtime_version) << " (linked statically)\n";
  if (info.driver_version == 0) {
    std::cout << "CUDA driver: none found\n";
  } else {
    std::cout << "CUDA driver: supports CUDA " << version(info.driver_version) << "\n";
  }
  if (info.device_count == 0) {
    std::cout << "devices: none visible (" << info.error << ")\n";
    return 0;
  }
  std::cout << "devices: " << info.device_count << "\n";
  for (const auto& d : info.devices) {
    std::cout << "  " << d.ordinal << ": " << d.name << ", compute capability "
              << d.compute_capability_major << "." << d.compute_capability_minor << ", "
              << ccalloc::format_size(d.total_bytes) << " total, "
              << ccalloc::format_size(d.free_bytes) << " free\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ccalloc: a CUDA caching allocator, and tools for its traces"};
  app.require_subcommand(1);

  std::string trace_path;
  std::vector<std::string> confs;
  std::string capacity = "141GiB";
  bool oracle = false;
  std::string emit_path;
  bool json = false;
  CLI::App* replay = app.add_subcommand(
      "replay", "Replay a recorded trace on the simulated GPU under one or more configs");
  replay
      ->add_option("trace", trace_path,
                   "Trace CSV, snapshot (pickle or JSON) or RMM log; plain or gzip")
      ->required();
  replay->add_option("--conf", confs,
                     "Config string (CCALLOC_CONF grammar); repeat for side-by-side columns");
  replay->add_option("--capacity", capacity, "Simulated device memory, e.g. 141GiB")
      ->capture_default_str();
  replay->add_flag("--address-oracle", oracle,
                   "Hand out the trace's own segment addresses while the sizes match");
  replay->add_option("--emit-trace", emit_path,
                     "Write the replay's own trace as CSV (numbered per config if several)");
  std::string snapshot_path;
  replay->add_option("--snapshot-out", snapshot_path,
                     "Write the replay's final snapshot with its history (.pickle or .json, "
                     "optionally .gz; numbered per config if several)");
  std::string oom_snapshot_path;
  replay->add_option("--oom-snapshot", oom_snapshot_path,
                     "Write the allocator's snapshot just after its first OOM, with its history "
                     "(.pickle or .json, optionally .gz; numbered per config if several; open "
                     "it with `ccalloc viz` or `ccalloc summary`)");
  replay->add_flag("--json", json, "Print a JSON array, one object per config");
  int replay_device = -1;
  replay->add_option("--device", replay_device,
                     "Device of a snapshot whose trace to replay (default: the first with "
                     "entries)");
  std::int64_t gpu_lag_us = -1;
  replay->add_option("--gpu-lag-us", gpu_lag_us,
                     "How far the simulated GPU runs behind the trace's clock, for the "
                     "allocator's own events (default 4500)");
  std::uint64_t max_entries = 0;
  replay->add_option("--max-entries", max_entries,
                     "Fail on a trace with more entries than this (default: CCALLOC_MAX_ENTRIES "
                     "or 2^32)");

  std::string fit_path;
  std::vector<std::string> fit_confs;
  bool fit_json = false;
  CLI::App* fit = app.add_subcommand(
      "fit",
      "Smallest simulated device (a multiple of 2 MiB) each config replays a trace on "
      "with no OOM, by bisection, verified");
  fit->add_option("trace", fit_path, "Trace CSV, snapshot or RMM log; plain or gzip")->required();
  fit->add_option("--conf", fit_confs, "Config string; repeat for several");
  fit->add_flag("--json", fit_json, "Print a JSON array, one object per config");
  int fit_device = -1;
  fit->add_option("--device", fit_device,
                  "Device of a snapshot whose trace to fit (default: the first with entries)");

  std::string file;
  int device = 0;
  CLI::App* summary =
      app.add_subcommand("summary", "memory_summary() and per-segment fragmentation of a snapshot");
  summary->add_option("file", file, "Snapshot (pickle or JSON, plain or gzip)")->required();
  summary->add_option("--device", device, "Device of the snapshot")->capture_default_str();
  CLI::App* stats = app.add_subcommand("stats", "memory_stats() of a snapshot, as JSON");
  stats->add_option("file", file, "Snapshot (pickle or JSON, plain or gzip)")->required();
  stats->add_option("--device", device, "Device of the snapshot")->capture_default_str();
  std::string out;
  CLI::App* convert = app.add_subcommand(
      "convert", "Convert between snapshots (pickle, JSON), trace CSVs and RMM logs");
  convert->add_option("in", file, "Input: snapshot, trace CSV or RMM log")->required();
  convert->add_option("out", out, "Output: *.pickle, *.json, *.csv or *.rmm.csv, optionally .gz")
      ->required();
  convert->add_option("--device", device, "Device whose trace to convert")->capture_default_str();

  ccalloc::cli::VizArgs viz_args;
  CLI::App* viz = ccalloc::cli::add_viz_command(app, viz_args);

  CLI::App* info = app.add_subcommand(
      "info", "Show the version, the config in force and the CUDA devices this process sees");

  CLI11_PARSE(app, argc, argv);
  try {
    if (replay->parsed()) {
      return run_replay(trace_path, confs, capacity, oracle, emit_path, snapshot_path,
                        oom_snapshot_path, json,
                        max_entries, replay_device, gpu_lag_us);
    }
    if (fit->parsed()) return run_fit(fit_path, fit_confs, fit_json, fit_device);
    if (summary->parsed()) return run_summary(file, device);
    if (stats->parsed()) return run_stats(file, device);
    if (convert->parsed()) return run_convert(file, out, device);
    if (viz->parsed()) return ccalloc::cli::run_viz(viz_args);
    if (info->parsed()) return run_info();
  } catch (const std::exception& e) {
    std::cerr << "ccalloc: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
