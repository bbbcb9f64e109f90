// A byte count kept under its owner's lock that other threads may read without that lock:
// the reserved bytes of one engine, which the engine beside it on the same device counts
// against the memory limit (stitch/backend.hpp).
#pragma once

#include <atomic>
#include <cstddef>

namespace ccalloc::core {

class PublishedSize {
 public:
  operator std::size_t() const { return value_; }  // NOLINT: reads as the count it is
  PublishedSize& operator=(std::size_t v) {
    set(v);
    return *this;
  }
  PublishedSize& operator+=(std::size_t n) {
    set(value_ + n);
    return *this;
  }
  PublishedSize& operator-=(std::size_t n) {
    set(value_ - n);
    return *this;
  }
  // The value as last written, for readers that do not hold the owner's lock.
  const std::atomic<std::size_t>& published() const { return published_; }

 private:
  void set(std::size_t v) {
    value_ = v;
    published_.store(v, std::memory_order_relaxed);
  }
  std::size_t value_ = 0;
  std::atomic<std::size_t> published_{0};
};

// Where an engine reads the reserved bytes of the engine beside it (none by default).
class PeerReserved {
 public:
  void set(const std::atomic<std::size_t>* peer) { peer_.store(peer, std::memory_order_release); }
  std::size_t bytes() const {
    const std::atomic<std::size_t>* p = peer_.load(std::memory_order_acquire);
    return p == nullptr ? 0 : p->load(std::memory_order_relaxed);
  }

 private:
  std::atomic<const std::atomic<std::size_t>*> peer_{nullptr};
};

}  // namespace ccalloc::core
