// The baseline ledger: exact device-wide peaks of statistics kept per arena, with no
// shared write on the hot path. Used by the native engine (arena.hpp) and the stitching
// policy (stitch/engine.hpp); each keeps, per arena and under the arena's lock, a
// DeviceStats of the arena's blocks, a PeakBaselines of debts and an in-debt flag.
//
// Device-wide peaks of the block statistics. The device's current
// value of a block statistic is the sum of the arenas' currents c_i; its peak P must be the
// maximum of that sum over time, which no arena can see alone. Each arena keeps, under its
// own lock, a baseline b_i per tracked counter with
//     P = sum of b_i,   and   b_i >= c_i  (except while an arena is "in debt", below).
// The baseline lives in the arena's own Stat::peak, less the counter's unsettled debt:
// Stat::increase already compares current with peak, so the hot path pays no extra check.
// A free lowers c_i: the arena gains headroom b_i - c_i at no cost. An increase beyond the
// peak raises the peak as usual and records the excess as debt, leaving the arena in debt;
// once the arena's lock is released (before the operation returns) the engine settles
// under every arena lock: per counter, with debt D (sum of c_i - b_i over arenas above
// their baseline) and room R (sum of b_i - c_i over the others), D > R means the device
// reached a new peak, so every b_i becomes c_i (P = sum of c_i); otherwise the debtors'
// baselines rise to their currents and D is taken from the others' room (largest room
// first), leaving P unchanged. Headroom stays with the arenas that had it, so streams that
// each oscillate within their share of the peak never settle again: the hot path writes no
// shared cache line.
// The peak is exact for any program whose operations do not overlap in time (every
// single-threaded program, whatever its streams); with overlapping operations it is the peak
// of one order of those operations. It is never below a state the device actually reached.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ccalloc/stats.hpp"

namespace ccalloc::core {

// One value per tracked counter: every block statistic of DeviceStats with a peak (each
// StatArray's aggregate, small and large entries) and oversize_allocations. Segment and
// reserved-memory statistics are device-wide (the engine's device mutex).
inline constexpr std::size_t kTrackedCounters = 7 * 3 + 1;
struct PeakBaselines {
  using Array = std::array<std::int64_t, 3>;
  Array allocation{};
  Array active{};
  Array inactive_split{};
  Array allocated_bytes{};
  Array active_bytes{};
  Array inactive_split_bytes{};
  Array requested_bytes{};
  std::int64_t oversize_allocations = 0;
};

// Visits every tracked counter as fn(Stat& stat, std::int64_t& value).
template <typename Stats, typename Baselines, typename Fn>
constexpr void for_each_tracked(Stats& s, Baselines& b, Fn&& fn) {
  for (int t = 0; t < 3; ++t) {
    fn(s.allocation[t], b.allocation[t]);
    fn(s.active[t], b.active[t]);
    fn(s.inactive_split[t], b.inactive_split[t]);
    fn(s.allocated_bytes[t], b.allocated_bytes[t]);
    fn(s.active_bytes[t], b.active_bytes[t]);
    fn(s.inactive_split_bytes[t], b.inactive_split_bytes[t]);
    fn(s.requested_bytes[t], b.requested_bytes[t]);
  }
  fn(s.oversize_allocations, b.oversize_allocations);
}

constexpr std::size_t count_tracked() {
  PeakBaselines b;
  std::size_t n = 0;
  for_each_tracked(b, b, [&n](const std::int64_t&, const std::int64_t&) { ++n; });
  return n;
}
static_assert(count_tracked() == kTrackedCounters);

// Stat::increase for a tracked counter, recording a rise beyond its peak (the arena's
// baseline) as debt for the engine to settle.
inline void ledger_increase(Stat& stat, std::int64_t& debt, bool& in_debt, std::int64_t n) {
  stat.current += n;
  stat.allocated += n;
  if (stat.current > stat.peak) [[unlikely]] {
    debt += stat.current - stat.peak;
    stat.peak = stat.current;
    in_debt = true;
  }
}

// Block statistics kept per pool only (both engines' arenas): a hot-path update
// changes the pool's entry, and the aggregate entry keeps only its peak, checked here
// against the sum of the pools' currents as ledger_increase checks a kept current. Its
// current and cumulative counts are the pools' sums, written by sync_aggregate before
// anything reads the entry (the ledger's shares, reset_peaks, the checkers), or read as
// pools_current().
// The current of a statistic kept per pool (the aggregate entry may be stale).
inline std::int64_t pools_current(const StatArray& stat) {
  return stat[kSmallPool].current + stat[kLargePool].current;
}
inline void ledger_check_aggregate(StatArray& stat, std::int64_t& debt, bool& in_debt) {
  const std::int64_t now = pools_current(stat);
  Stat& agg = stat[kAggregate];
  if (now > agg.peak) [[unlikely]] {
    debt += now - agg.peak;
    agg.peak = now;
    in_debt = true;
  }
}
inline void sync_aggregate(StatArray& stat) {
  stat[kAggregate].current = pools_current(stat);
  stat[kAggregate].allocated = stat[kSmallPool].allocated + stat[kLargePool].allocated;
  stat[kAggregate].freed = stat[kSmallPool].freed + stat[kLargePool].freed;
}
// Every block statistic's aggregate of one arena's DeviceStats, from its pools'.
inline void sync_block_aggregates(DeviceStats& s) {
  for (StatArray* a : {&s.allocation, &s.allocated_bytes, &s.active, &s.active_bytes,
                       &s.inactive_split, &s.inactive_split_bytes, &s.requested_bytes}) {
    sync_aggregate(*a);
  }
}
// The same for every arena, under an engine's lock over all of them (as ledger_shares_of).
template <typename AllLock, typename Arenas>
void sync_block_aggregates_of(const AllLock& all, const Arenas& arenas) {
  for (auto* arena : arenas) {
    all.held(*arena);
    sync_block_aggregates(arena->stats);
  }
}
// An increase of a pool's entry of a statistic kept per pool: ledger_increase for the
// pool's, the aggregate's peak checked against the pools' sum.
[[gnu::always_inline]] inline void ledger_increase_pool(StatArray& stat, std::int64_t& pool_debt,
                                 std::int64_t& aggregate_debt, bool& in_debt, StatType pool,
                                 std::int64_t n) {
  ledger_increase(stat[pool], pool_debt, in_debt, n);
  ledger_check_aggregate(stat, aggregate_debt, in_debt);
}

// The same where `covered` says the increase returns the entry to at most a value it had
// since the peaks were last checked (a take of a parked block raising what its park
// lowered): no peak can rise, and no check is made.
[[gnu::always_inline]] inline void ledger_increase_pool(StatArray& stat, std::int64_t& pool_debt,
                                                        std::int64_t& aggregate_debt,
                                                        bool& in_debt, StatType pool,
                                                        std::int64_t n, bool covered) {
  if (covered) {
    stat[pool].current += n;
    stat[pool].allocated += n;
    return;
  }
  ledger_increase_pool(stat, pool_debt, aggregate_debt, in_debt, pool, n);
}

// The pairs of a parked block's park and take (both engines' hit: a free that keeps its
// block out of the pools and the malloc that takes it back as it is). The park counts no
// release and the take no allocation: the allocation, active and requested statistics
// keep counting the block, their currents exact once it is taken back, and the block's
// release is counted only if it is pooled instead. What each pair adds to their
// cumulative counts (one free and one allocation of the same block and requested size) is
// kept here, per pool entry, and added by flush() before anything reads the statistics.
struct TakenPairs {
  struct Entry {
    std::int64_t pairs = 0;      // allocation and active
    std::int64_t bytes = 0;      // allocated_bytes and active_bytes
    std::int64_t requested = 0;  // requested_bytes
  };
  std::array<Entry, 3> by_pool{};  // indexed by StatType (kSmallPool, kLargePool)

  [[gnu::always_inline]] void add(StatType t, std::int64_t bytes, std::int64_t requested) {
    Entry& e = by_pool[t];
    e.pairs += 1;
    e.bytes += bytes;
    e.requested += requested;
  }
  // A take, in pool entry `t`, of a parked block of `bytes` whose requested size is
  // `block_requested`, for a request of `requested` bytes: the pair's cumulative counts
  // and, where the request asks for other bytes, the requested bytes' change as the park's
  // decrease and the take's increase would make it, peak checked; `block_requested`
  // becomes `requested`.
  [[gnu::always_inline]] void take(DeviceStats& st, PeakBaselines& debts, bool& in_debt,
                                   StatType t, std::int64_t bytes,
                                   std::size_t& block_requested, std::size_t requested) {
    if (requested == block_requested) [[likely]] {
      add(t, bytes, static_cast<std::int64_t>(requested));
      return;
    }
    add(t, bytes, 0);
    st.requested_bytes[t].decrease(static_cast<std::int64_t>(block_requested));
    ledger_increase_pool(st.requested_bytes, debts.requested_bytes[t],
                         debts.requested_bytes[kAggregate], in_debt, t,
                         static_cast<std::int64_t>(requested));
    block_requested = requested;
  }
  void flush(DeviceStats& st) {
    for (const StatType t : {kSmallPool, kLargePool}) {
      Entry& e = by_pool[t];
      for (auto [stat, n] : {std::pair{&st.allocation[t], e.pairs}, {&st.active[t], e.pairs},
                             {&st.allocated_bytes[t], e.bytes}, {&st.active_bytes[t], e.bytes},
                             {&st.requested_bytes[t], e.requested}}) {
        stat->allocated += n;
        stat->freed += n;
      }
      e = {};
    }
  }
};

// One arena's part of the ledger, as the settlement and the device-wide sums see it. The
// caller holds the arena's lock (every arena's, for settle_peak_debts).
struct LedgerShare {
  DeviceStats* stats;
  PeakBaselines* debts;
  bool* in_debt;
};

// Settles every arena's debts (stats.cpp): see the header comment. Every arena lock held.
void settle_peak_debts(const std::vector<LedgerShare>& shares);

// Every arena's part of the ledger, for an engine's lock over all its arenas (`all`, which
// asserts through held() that an arena's lock is held) and its arenas in settlement order.
// The block statistics' aggregates are written from their pools' first
// (sync_block_aggregates): the settlement and the sums read them.
template <typename AllLock, typename Arenas>
std::vector<LedgerShare> ledger_shares_of(const AllLock& all, const Arenas& arenas) {
  std::vector<LedgerShare> shares;
  shares.reserve(arenas.size());
  sync_block_aggregates_of(all, arenas);
  for (auto* arena : arenas) {
    all.held(*arena);
    shares.push_back(LedgerShare{&arena->stats, &arena->debts, &arena->in_debt});
  }
  return shares;
}

// Whether any of the arenas is in debt (every arena lock held).
inline bool in_debt(const std::vector<LedgerShare>& shares) {
  for (const LedgerShare& s : shares) {
    if (*s.in_debt) return true;
  }
  return false;
}

// Two engines that share one device (core::StitchBackend: the stitching policy and the
// private pools beside it) settle their arenas together, so that the device-wide peaks are
// those of the sum of both engines' blocks rather than the sum of each engine's peaks. The
// engines cannot take each other's locks from inside their operations (each has its own lock
// order), so an engine joined to a JointSettlement does not settle itself: when an operation
// leaves an arena in debt it marks the settlement pending, and the owner, which calls the
// engines one at a time and holds no lock of either between calls, settles every arena of
// both under all their locks (first engine's, then second's) before the operation returns.
class JointSettlement {
 public:
  void mark() { pending_.store(true, std::memory_order_release); }
  // True once per mark (a mark made while a settlement runs is seen by the next take).
  bool take() {
    return pending_.load(std::memory_order_acquire) &&
           pending_.exchange(false, std::memory_order_acq_rel);
  }

 private:
  std::atomic<bool> pending_{false};
};

// Adds an arena's tracked block statistics to `total` (currents and totals) and its
// baselines to `peaks`; once every arena is added, set_tracked_peaks() makes the device's
// peaks the sums of the baselines.
void add_block_stats(DeviceStats& total, PeakBaselines& peaks, const DeviceStats& arena,
                     const PeakBaselines& debts);
void set_tracked_peaks(DeviceStats& total, const PeakBaselines& peaks);

// The memory_stats() name of the j-th counter for_each_tracked() visits.
std::string tracked_counter_name(std::size_t j);

}  // namespace ccalloc::core
