// Statistics: PyTorch's memory_stats() keys, and their combination across arenas.
#include "ccalloc/stats.hpp"

#include <string_view>

#include "core/engine.hpp"

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

// Device-wide statistics: the segment and reserved-memory statistics and the counters kept
// by the device, plus the block statistics of every arena. With allocations on several
// streams, each arena's peak is exact for its stream and the device's peak is their sum:
// an upper bound of the true simultaneous peak, exact when one stream allocates.
DeviceStats Engine::stats() const {
  DeviceStats total;
  {
    Lock lock(device_mutex_);
    total = device_stats_;
  }
  for (Arena* arena : arena_list()) {
    Lock lock(arena->mutex);
    for (int pool = 0; pool < 3; ++pool) {
      total.allocation[pool] += arena->stats.allocation[pool];
      total.active[pool] += arena->stats.active[pool];
      total.inactive_split[pool] += arena->stats.inactive_split[pool];
      total.allocated_bytes[pool] += arena->stats.allocated_bytes[pool];
      total.active_bytes[pool] += arena->stats.active_bytes[pool];
      total.inactive_split_bytes[pool] += arena->stats.inactive_split_bytes[pool];
      total.requested_bytes[pool] += arena->stats.requested_bytes[pool];
    }
    total.oversize_allocations += arena->stats.oversize_allocations;
  }
  return total;
}

void Engine::reset_peak_stats() {
  {
    Lock lock(device_mutex_);
    device_stats_.reset_peak();
  }
  for (Arena* arena : arena_list()) {
    Lock lock(arena->mutex);
    arena->stats.reset_peak();
  }
}

void Engine::reset_accumulated_stats() {
  {
    Lock lock(device_mutex_);
    device_stats_.reset_accumulated();
  }
  for (Arena* arena : arena_list()) {
    Lock lock(arena->mutex);
    arena->stats.reset_accumulated();
  }
}

}  // namespace core
}  // namespace ccalloc
