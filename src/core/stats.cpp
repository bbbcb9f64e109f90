// Statistics: PyTorch's memory_stats() keys, and their combination across arenas.
#include "ccalloc/stats.hpp"

#include <algorithm>
#include <array>
#include <functional>
#include <string_view>
#include <utility>
#include <vector>

#include "core/peak_ledger.hpp"

namespace ccalloc {
namespace {

// Visits every StatArray with its memory_stats() name.
template <typename Stats, typename Fn>
void for_each_array(Stats& s, Fn&& fn) {
  fn("active", s.active);
  fn("active_bytes", s.active_bytes);
  fn("allocated_bytes", s.allocated_bytes);
  fn("allocation", s.allocation);
  fn("inactive_split", s.inactive_split);
  fn("inactive_split_bytes", s.inactive_split_bytes);
  fn("requested_bytes", s.requested_bytes);
  fn("reserved_bytes", s.reserved_bytes);
  fn("segment", s.segment);
}

template <typename Stats, typename Fn>
void for_each_single(Stats& s, Fn&& fn) {
  fn("oversize_allocations", s.oversize_allocations);
  fn("oversize_segments", s.oversize_segments);
}

template <typename Stats, typename Fn>
void for_each_counter(Stats& s, Fn&& fn) {
  fn("num_alloc_retries", s.num_alloc_retries);
  fn("num_device_alloc", s.num_device_alloc);
  fn("num_device_free", s.num_device_free);
  fn("num_ooms", s.num_ooms);
  fn("num_sync_all_streams", s.num_sync_all_streams);
}

constexpr std::string_view kPoolNames[3] = {"all", "small_pool", "large_pool"};

template <typename StatT, typename Fn>
void for_each_field(StatT& stat, Fn&& fn) {
  fn("allocated", stat.allocated);
  fn("current", stat.current);
  fn("freed", stat.freed);
  fn("peak", stat.peak);
}

}  // namespace

Stat& Stat::operator+=(const Stat& o) {
  current += o.current;
  peak += o.peak;
  allocated += o.allocated;
  freed += o.freed;
  return *this;
}

void DeviceStats::reset_accumulated() {
  for_each_array(*this, [](std::string_view, StatArray& a) {
    for (Stat& s : a)
      s.reset_accumulated();
  });
  for_each_single(*this, [](std::string_view, Stat& s) { s.reset_accumulated(); });
  for_each_counter(*this, [](std::string_view, std::int64_t& c) { c = 0; });
}

void DeviceStats::reset_peak() {
  for_each_array(*this, [](std::string_view, StatArray& a) {
    for (Stat& s : a)
      s.reset_peak();
  });
  for_each_single(*this, [](std::string_view, Stat& s) { s.reset_peak(); });
}

std::map<std::string, std::int64_t> DeviceStats::to_map() const {
  std::map<std::string, std::int64_t> m;
  for_each_array(*this, [&](std::string_view name, const StatArray& a) {
    for (int pool = 0; pool < 3; ++pool) {
      for_each_field(a[pool], [&](std::string_view field, std::int64_t v) {
        m[std::string(name) + "." + std::string(kPoolNames[pool]) + "." + std::string(field)] = v;
      });
    }
  });
  for_each_single(*this, [&](std::string_view name, const Stat& s) {
    for_each_field(s, [&](std::string_view field, std::int64_t v) {
      m[std::string(name) + "." + std::string(field)] = v;
    });
  });
  for_each_counter(*this, [&](std::string_view name, std::int64_t v) { m[std::string(name)] = v; });
  m["max_split_size"] = max_split_size;
  return m;
}

DeviceStats DeviceStats::from_map(const std::map<std::string, std::int64_t>& m) {
  const auto get = [&m](const std::string& key) {
    const auto it = m.find(key);
    return it == m.end() ? std::int64_t{0} : it->second;
  };
  DeviceStats s;
  for_each_array(s, [&](std::string_view name, StatArray& a) {
    for (int pool = 0; pool < 3; ++pool) {
      for_each_field(a[pool], [&](std::string_view field, std::int64_t& v) {
        v = get(std::string(name) + "." + std::string(kPoolNames[pool]) + "." + std::string(field));
      });
    }
  });
  for_each_single(s, [&](std::string_view name, Stat& st) {
    for_each_field(st, [&](std::string_view field, std::int64_t& v) {
      v = get(std::string(name) + "." + std::string(field));
    });
  });
  for_each_counter(s, [&](std::string_view name, std::int64_t& v) { v = get(std::string(name)); });
  s.max_split_size = m.count("max_split_size") ? get("max_split_size") : -1;
  return s;
}

namespace core {

void add_block_stats(DeviceStats& total, PeakBaselines& peaks, const DeviceStats& arena,
                     const PeakBaselines& debts) {
  for (int pool = 0; pool < 3; ++pool) {
    total.allocation[pool] += arena.allocation[pool];
    total.active[pool] += arena.active[pool];
    total.inactive_split[pool] += arena.inactive_split[pool];
    total.allocated_bytes[pool] += arena.allocated_bytes[pool];
    total.active_bytes[pool] += arena.active_bytes[pool];
    total.inactive_split_bytes[pool] += arena.inactive_split_bytes[pool];
    total.requested_bytes[pool] += arena.requested_bytes[pool];
  }
  total.oversize_allocations += arena.oversize_allocations;
  for_each_tracked(peaks, debts, [](std::int64_t& sum, const std::int64_t& debt) {
    sum -= debt;  // 0 once settled
  });
  for_each_tracked(arena, peaks, [](const Stat& s, std::int64_t& sum) { sum += s.peak; });
}

void set_tracked_peaks(DeviceStats& total, const PeakBaselines& peaks) {
  for_each_tracked(total, peaks, [](Stat& s, const std::int64_t& peak) { s.peak = peak; });
}

std::string tracked_counter_name(std::size_t j) {
  static constexpr const char* kNames[7] = {"allocation",   "active",
                                            "inactive_split", "allocated_bytes",
                                            "active_bytes", "inactive_split_bytes",
                                            "requested_bytes"};
  static constexpr const char* kPools[3] = {"all", "small_pool", "large_pool"};
  if (j == kTrackedCounters - 1) return "oversize_allocations";
  return std::string(kNames[j % 7]) + "." + kPools[j / 7];
}

// Per counter: D, the debt of the arenas above their baseline, and R, the room of those
// below. D > R: a new device-wide peak, every baseline becomes its arena's current. Else the
// debtors' baselines rise to their currents and D comes out of the others' room, largest
// first, so the sum of the baselines (the peak) is unchanged and arenas keep what room they
// can: handing all of it to the settling arena would make every other arena settle on its
// next increase, and streams taking turns would settle on every operation.
void settle_peak_debts(const std::vector<LedgerShare>& arenas) {
  bool any = false;
  for (const LedgerShare& arena : arenas) any = any || *arena.in_debt;
  if (!any) return;

  // Each counter's baseline, taken out of its Stat::peak (less the debt) and put back.
  struct Entry {
    std::int64_t current;
    std::int64_t* baseline;
  };
  std::vector<std::array<Entry, kTrackedCounters>> rows(arenas.size());
  for (std::size_t i = 0; i < arenas.size(); ++i) {
    const LedgerShare& arena = arenas[i];
    std::size_t j = 0;
    for_each_tracked(*arena.stats, *arena.debts, [&](Stat& s, std::int64_t& debt) {
      s.peak -= debt;
      debt = 0;
      rows[i][j++] = Entry{s.current, &s.peak};
    });
    *arena.in_debt = false;
  }
  std::vector<std::pair<std::int64_t, std::size_t>> room;  // (room, arena index)
  for (std::size_t j = 0; j < kTrackedCounters; ++j) {
    std::int64_t debt = 0;
    std::int64_t total_room = 0;
    room.clear();
    for (std::size_t i = 0; i < rows.size(); ++i) {
      Entry& e = rows[i][j];
      const std::int64_t d = e.current - *e.baseline;
      if (d > 0) {
        debt += d;
        *e.baseline = e.current;
      } else if (d < 0) {
        total_room -= d;
        room.emplace_back(-d, i);
      }
    }
    if (debt == 0) continue;
    if (debt >= total_room) {  // a new peak (or the old one reached again)
      for (const auto& [r, i] : room)
        *rows[i][j].baseline = rows[i][j].current;
      continue;
    }
    std::sort(room.begin(), room.end(), std::greater<>());
    for (const auto& [r, i] : room) {
      const std::int64_t take = std::min(r, debt);
      *rows[i][j].baseline -= take;
      debt -= take;
      if (debt == 0) break;
    }
  }
}

}  // namespace core
}  // namespace ccalloc
