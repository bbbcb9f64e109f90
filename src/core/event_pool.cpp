// Completed driver events kept for reuse (core/event_pool.hpp).
#include "core/event_pool.hpp"

namespace ccalloc::core {

EventPool::~EventPool() {
  for (EventId e : free_)
    driver_.destroy_event(e);
}

EventId EventPool::get() {
  {
    Lock lock(mutex_);
    if (!free_.empty()) {
      const EventId e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  return driver_.create_event();
}

void EventPool::put(EventId e) {
  Lock lock(mutex_);
  free_.push_back(e);
}

}  // namespace ccalloc::core
