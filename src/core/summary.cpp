// memory_summary() in the exact layout of PyTorch's torch.cuda.memory_summary(), so that
// tools and eyes used to that table read ccalloc's the same way.
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "ccalloc/stats.hpp"

namespace ccalloc {
namespace {

constexpr int kWidth = 75;

// Size column: divides by 1024 while the reference value (the "all" row's) is at least
// 768 KiB, so the three rows of a metric share one unit.
std::string format_size_cell(std::int64_t value, std::int64_t reference) {
  static constexpr const char* kUnits[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
  std::int64_t v = value;
  double ref = static_cast<double>(reference);
  int unit = 0;
  while (unit + 1 < 6 && ref >= 768.0 * 1024.0) {
    ++unit;
    v = v >= 0 ? v / 1024 : -((-v + 1023) / 1024);  // floor division, as Python's //
    ref /= 1024.0;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%6lld %s", static_cast<long long>(v), kUnits[unit]);
  return buf;
}

// Count column: divides by 1000 while the reference value is at least 750,000.
std::string format_count_cell(std::int64_t value, std::int64_t reference) {
  static constexpr const char* kUnits[] = {" ", "K", "M"};
  std::int64_t v = value;
  double ref = static_cast<double>(reference);
  int unit = 0;
  while (unit + 1 < 3 && ref >= 750.0 * 1000.0) {
    ++unit;
    v = v >= 0 ? v / 1000 : -((-v + 999) / 1000);
    ref /= 1000.0;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%7lld %s ", static_cast<long long>(v), kUnits[unit]);
  return buf;
}

using CellFormatter = std::string (*)(std::int64_t, std::int64_t);

std::string metric_row(std::string_view label, const Stat& s, const Stat& reference,
                       CellFormatter fmt) {
  std::string row = " ";
  row.append(label).append(label.size() < 21 ? 21 - label.size() : 0, ' ');
  for (const auto& [value, ref] :
       {std::pair{s.current, reference.current}, std::pair{s.peak, reference.peak},
        std::pair{s.allocated, reference.allocated}, std::pair{s.freed, reference.freed}}) {
    row.append(" | ").append(fmt(value, ref));
  }
  row.append(" ");
  return row;
}

}  // namespace

std::string memory_summary(const DeviceStats& stats, int device, bool abbreviated) {
  std::vector<std::string> lines;
  const std::string rule_eq(kWidth, '=');
  const std::string rule_dash(kWidth, '-');
  char buf[160];

  lines.push_back(rule_eq);
  std::snprintf(buf, sizeof buf, " %16s PyTorch CUDA memory summary, device ID %-17d ", "", device);
  lines.emplace_back(buf);
  lines.push_back(rule_dash);
  std::snprintf(buf, sizeof buf, "  %9s CUDA OOMs: %-12lld | %6s cudaMalloc retries: %-8lld  ", "",
                static_cast<long long>(stats.num_ooms), "",
                static_cast<long long>(stats.num_alloc_retries));
  lines.emplace_back(buf);
  lines.push_back(rule_eq);
  lines.emplace_back("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ");

  struct Metric {
    const StatArray* stat;
    const char* label;
    CellFormatter fmt;
  };
  const Metric metrics[] = {
      {&stats.allocated_bytes, "Allocated memory", format_size_cell},
      {&stats.active_bytes, "Active memory", format_size_cell},
      {&stats.requested_bytes, "Requested memory", format_size_cell},
      {&stats.reserved_bytes, "GPU reserved memory", format_size_cell},
      {&stats.inactive_split_bytes, "Non-releasable memory", format_size_cell},
      {&stats.allocation, "Allocations", format_count_cell},
      {&stats.active, "Active allocs", format_count_cell},
      {&stats.segment, "GPU reserved segments", format_count_cell},
      {&stats.inactive_split, "Non-releasable allocs", format_count_cell},
  };
  for (const Metric& m : metrics) {
    const StatArray& a = *m.stat;
    lines.push_back(rule_dash);
    lines.push_back(metric_row(m.label, a[kAggregate], a[kAggregate], m.fmt));
    if (!abbreviated) {
      lines.push_back(metric_row("      from large pool", a[kLargePool], a[kAggregate], m.fmt));
      lines.push_back(metric_row("      from small pool", a[kSmallPool], a[kAggregate], m.fmt));
    }
  }
  for (const auto& [stat, label] : {std::pair{&stats.oversize_allocations, "Oversize allocations"},
                                    std::pair{&stats.oversize_segments, "Oversize GPU segments"}}) {
    lines.push_back(rule_dash);
    lines.push_back(metric_row(label, *stat, *stat, format_count_cell));
  }
  lines.push_back(rule_eq);

  std::string out;
  for (const std::string& line : lines)
    out.append("|").append(line).append("|\n");
  return out;
}

std::string format_size(std::uint64_t bytes) {
  char buf[64];
  if (bytes <= 1024) {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(bytes));
  } else if (bytes <= 1048576) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", static_cast<double>(bytes) / 1024.0);
  } else if (bytes <= 1073741824ULL) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  }
  return buf;
}

}  // namespace ccalloc
