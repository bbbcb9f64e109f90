// The native engine's statistics: the device-wide sums over its arenas, and their resets
// (the keys, the sums and the peak ledger's settlement: core/stats.cpp, core/peak_ledger.hpp).
#include "core/arena_engine.hpp"
#include "native/engine.hpp"

namespace ccalloc {
namespace core {

// Device-wide statistics: the segment and reserved-memory statistics and the counters kept
// by the device, plus the block statistics of every arena: their current values and totals
// are sums over the arenas, their peaks the sums of the arenas' baselines (arena.hpp). Every
// arena lock is held, so the baselines are read consistently, and a debt left by an
// operation still under way is settled first: no peak is below its current value.
DeviceStats Engine::stats() const {
  DeviceStats total;
  const AllArenasLock all(*this);
  settle_peak_debts(all);
  {
    Lock lock(device_mutex_);
    total = device_stats_;
  }
  PeakBaselines peaks;
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    add_block_stats(total, peaks, arena->stats, arena->debts);
  }
  set_tracked_peaks(total, peaks);
  return total;
}

void Engine::reset_peak_stats() {
  const AllArenasLock all(*this);
  ArenaEngine::reset_peaks(all, all.by_stream());
  Lock lock(device_mutex_);
  device_stats_.reset_peak();
}

// Under every arena lock: a parked block's release, and what its takes added, are counted
// before the totals are cleared (AllArenasLock pools it), as the pools counted them.
void Engine::reset_accumulated_stats() {
  const AllArenasLock all(*this);
  {
    Lock lock(device_mutex_);
    device_stats_.reset_accumulated();
  }
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    arena->stats.reset_accumulated();
  }
}

}  // namespace core
}  // namespace ccalloc
