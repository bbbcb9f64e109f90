// Lock annotations for clang's -Wthread-safety (CMake option CCALLOC_THREAD_SAFETY_ANALYSIS).
// They state which lock guards which member and which functions need a lock held, so the
// compiler checks the lock discipline the engine header describes. No-ops elsewhere.
#pragma once

#include <mutex>

#if defined(__clang__)
#define CCALLOC_TSA(x) __attribute__((x))
#else
#define CCALLOC_TSA(x)
#endif

#define CAPABILITY(x) CCALLOC_TSA(capability(x))
#define SCOPED_CAPABILITY CCALLOC_TSA(scoped_lockable)
#define GUARDED_BY(x) CCALLOC_TSA(guarded_by(x))
#define PT_GUARDED_BY(x) CCALLOC_TSA(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) CCALLOC_TSA(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) CCALLOC_TSA(acquired_after(__VA_ARGS__))
#define REQUIRES(...) CCALLOC_TSA(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) CCALLOC_TSA(acquire_capability(__VA_ARGS__))
#define RELEASE(...) CCALLOC_TSA(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) CCALLOC_TSA(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) CCALLOC_TSA(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) CCALLOC_TSA(assert_capability(x))
#define RETURN_CAPABILITY(x) CCALLOC_TSA(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS CCALLOC_TSA(no_thread_safety_analysis)

namespace ccalloc::core {

// std::mutex as a capability the analysis tracks.
class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { m_.lock(); }
  void unlock() RELEASE() { m_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return m_.try_lock(); }
  // Tells the analysis the caller holds it (taken in a way it cannot follow).
  void assert_held() const ASSERT_CAPABILITY(this) {}

 private:
  std::mutex m_;
};

// Holds a lock for a scope (std::lock_guard / std::unique_lock, annotated). Works for any
// capability type with lock() and unlock(): Mutex and ArenaMutex.
template <typename M>
class SCOPED_CAPABILITY Lock {
 public:
  explicit Lock(M& m) ACQUIRE(m) : m_(&m) { m_->lock(); }
  ~Lock() RELEASE() {
    if (held_) m_->unlock();
  }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;
  // Early release, for code that must drop the lock before leaving the scope.
  void unlock() RELEASE() {
    m_->unlock();
    held_ = false;
  }
  // Takes it again after unlock().
  void lock() ACQUIRE() {
    m_->lock();
    held_ = true;
  }

 private:
  M* m_;
  bool held_ = true;
};

}  // namespace ccalloc::core
