// The segments of a sleepable pool (docs/sleep-wake.md): each one an address reservation
// with one physical allocation mapped into it, so that its physical memory can be released
// (sleep) and created and mapped again at the same addresses (wake). The pool takes its
// segments from here through a SegmentSource, so the engine grows and releases them as it
// does any pool's whole segments.
//
// Thread safety: `mutex_` guards the table of segments; it is a leaf lock (no driver call
// and no other lock is taken while it is held). The saved contents are touched only by
// sleep_pool, wake_pool, pool_sleep_info and pool retirement, which hold every arena lock.
#pragma once

#include <cstddef>
#include <map>
#include <vector>

#include "ccalloc/driver.hpp"
#include "sync/thread_annotations.hpp"

namespace ccalloc::core {

class SleepableSegments {
 public:
  explicit SleepableSegments(Driver& driver) : driver_(driver) {}
  // Releases whatever is left: the engine returns every segment before, so only saved
  // contents normally remain.
  ~SleepableSegments();
  SleepableSegments(const SleepableSegments&) = delete;
  SleepableSegments& operator=(const SleepableSegments&) = delete;

  // --- The pool's SegmentSource ---
  // Reserves `bytes` (rounded up to the mapping granularity), creates physical memory and
  // maps it there. Returns 0, holding nothing, when the device is out of memory.
  DevicePtr allocate(std::size_t bytes);
  // Unmaps and releases the segment's physical memory if it has some, then frees its
  // reservation.
  void free(DevicePtr base, std::size_t bytes);

  // --- Sleep and wake, one segment at a time ---
  // Unmaps and releases the physical memory of the segment at `base` (the caller waited
  // for the device's work on it). Nothing happens to a segment without memory.
  void unback(DevicePtr base);
  // Creates physical memory for the segment at `base` and maps it there; false, changing
  // nothing, when the device is out of memory. Nothing happens to a segment with memory.
  bool back(DevicePtr base);
  // True when physical memory is mapped at the segment that starts at `base`.
  bool backed(DevicePtr base) const;
  // True when `base` starts one of these segments of exactly `bytes` bytes (as the engine
  // sees it: before rounding).
  bool holds(DevicePtr base, std::size_t bytes) const;

  std::size_t segment_bytes() const;   // reserved address space, rounded
  std::size_t physical_bytes() const;  // of which backed now
  std::size_t segment_count() const;

  // --- Saved contents (every arena lock held) ---
  struct SavedRange {
    std::size_t offset = 0;  // into the host buffer
    std::size_t bytes = 0;
  };
  struct Saved {
    void* host = nullptr;  // pinned (Driver::allocate_host)
    std::size_t bytes = 0;
    std::map<DevicePtr, SavedRange> ranges;  // by the live block's address
  };
  Saved& saved() { return saved_; }
  const Saved& saved() const { return saved_; }
  // Frees the host buffer and forgets the ranges.
  void drop_saved();

 private:
  struct Segment {
    std::size_t requested = 0;  // what the engine asked for
    std::size_t bytes = 0;      // reserved and mapped: rounded to the granularity
    PhysicalHandle handle = 0;  // 0: asleep, no physical memory
  };
  std::size_t rounded(std::size_t bytes) EXCLUDES(mutex_);

  Driver& driver_;
  mutable Mutex mutex_;
  std::map<DevicePtr, Segment> segments_ GUARDED_BY(mutex_);
  std::size_t granularity_ GUARDED_BY(mutex_) = 0;  // 0 until first asked
  Saved saved_;
};

}  // namespace ccalloc::core
