// Completed driver events kept for reuse (event_pool.cpp); shared by the native engine and the
// stitching policy. Its lock is a leaf: taken under any engine lock, and nothing under it.
#pragma once

#include <vector>

#include "ccalloc/driver.hpp"
#include "sync/thread_annotations.hpp"

namespace ccalloc::core {

// Driver events are costly to create: keep completed ones for reuse.
class EventPool {
 public:
  explicit EventPool(Driver& d) : driver_(d) {}
  ~EventPool();
  EventId get();
  void put(EventId e);

 private:
  Driver& driver_;
  Mutex mutex_;
  std::vector<EventId> free_ GUARDED_BY(mutex_);
};

}  // namespace ccalloc::core
