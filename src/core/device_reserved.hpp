// The reserved bytes and segment counts of two engines that share one device
// (stitch/backend.hpp), with exact device-wide peaks: each engine reports every change
// of its reserved-bytes and segment statistics here, under its own device lock, and this
// ledger keeps the sums and their peaks under a lock of its own (a leaf: taken last, never
// held while taking another). Both change only when an engine creates, maps, unmaps or
// releases device memory, never on a cache hit, so the hot path does not come here.
#pragma once

#include <cstdint>

#include "ccalloc/stats.hpp"
#include "sync/thread_annotations.hpp"

namespace ccalloc::core {

// The entry of a statistic kept per pool that belongs to the small or the large pool.
inline StatType pool_stat(bool small) {
  return small ? kSmallPool : kLargePool;
}

// Calls f(t) for a statistic's aggregate entry, then for the small or large pool's: two
// calls, where a loop over an initializer list costs a hot path a dozen instructions a pass.
template <typename F>
void for_pool_stats(bool small, F&& f) {
  f(kAggregate);
  f(pool_stat(small));
}

// `n` more (or, negative, fewer) of a statistic kept per pool: its aggregate entry and the
// small or large pool's. The engines' reserved-bytes and segment statistics and this ledger's.
inline void add_pool_stat(StatArray& stat, bool small, std::int64_t n) {
  for_pool_stats(small, [&](StatType t) {
    if (n >= 0) {
      stat[t].increase(n);
    } else {
      stat[t].decrease(-n);
    }
  });
}

// `n` of a statistic kept per pool pass from one pool to the other (memory that serves the
// other pool now): the pools' entries change, the aggregate's does not.
inline void move_pool_stat(StatArray& stat, bool to_small, std::int64_t n) {
  stat[pool_stat(!to_small)].decrease(n);
  stat[pool_stat(to_small)].increase(n);
}

class DeviceReserved {
 public:
  // `bytes` more (or, negative, fewer) reserved in the small or large pool.
  void add(bool small, std::int64_t bytes) EXCLUDES(mutex_) {
    Lock lock(mutex_);
    add_pool_stat(reserved_, small, bytes);
  }
  // `bytes` reserved and `segments` segments pass to the small or large pool from the other.
  void move(bool to_small, std::int64_t bytes, std::int64_t segments) EXCLUDES(mutex_) {
    Lock lock(mutex_);
    move_pool_stat(reserved_, to_small, bytes);
    move_pool_stat(segments_, to_small, segments);
  }
  // `n` more (or, negative, fewer) segments in the small or large pool.
  void add_segments(bool small, std::int64_t n) EXCLUDES(mutex_) {
    Lock lock(mutex_);
    add_pool_stat(segments_, small, n);
  }
  StatArray reserved() const EXCLUDES(mutex_) {
    Lock lock(mutex_);
    return reserved_;
  }
  StatArray segments() const EXCLUDES(mutex_) {
    Lock lock(mutex_);
    return segments_;
  }
  void reset_peaks() EXCLUDES(mutex_) {
    Lock lock(mutex_);
    for (StatArray* a : {&reserved_, &segments_}) {
      for (Stat& s : *a)
        s.peak = s.current;
    }
  }

 private:
  mutable Mutex mutex_;
  StatArray reserved_ GUARDED_BY(mutex_);
  StatArray segments_ GUARDED_BY(mutex_);
};

}  // namespace ccalloc::core
