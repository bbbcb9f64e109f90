// Per-thread cache of the arenas a thread used last, so that finding a stream's arena on
// the hot path takes no lock: most threads use one or two streams. Entries are keyed by an
// engine's uid (never reused, unlike its address), so an engine that is gone is never
// found; the arena type keeps each engine kind's cache apart.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "ccalloc/driver.hpp"

namespace ccalloc::core {

// A uid for a new engine: never 0, never reused.
inline std::uint64_t next_engine_uid() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

template <typename A>
class ThreadArenaCache {
 public:
  static A* find(std::uint64_t engine_uid, StreamId stream) {
    for (const Entry& e : entries_) {
      if (e.engine_uid == engine_uid && e.stream == stream) return e.arena;
    }
    return nullptr;
  }
  static void put(std::uint64_t engine_uid, StreamId stream, A* arena) {
    entries_[next_++ % kSize] = Entry{engine_uid, stream, arena};
  }

 private:
  struct Entry {
    std::uint64_t engine_uid = 0;
    StreamId stream = 0;
    A* arena = nullptr;
  };
  static constexpr std::size_t kSize = 4;
  static inline thread_local std::array<Entry, kSize> entries_{};
  static inline thread_local std::size_t next_ = 0;
};

}  // namespace ccalloc::core
