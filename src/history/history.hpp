// Allocation history: a ring buffer of trace entries per device, the stack context of the
// operation in progress on each thread, and the process-wide table of captured stacks.
//
// An operation's context (Origin) is the C++ stack ccalloc captured, an interned id, and
// the caller's context handle (HistoryOptions::capture_context), reference counted. Entries
// and blocks hold Origins by value: copying one takes a reference on the handle, and
// overwriting or destroying one drops it, so each handle is released exactly when the last
// entry, block or snapshot holding it goes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ccalloc/snapshot.hpp"
#include "ccalloc/trace.hpp"
#include "history/stacks.hpp"

namespace ccalloc::core {

// The process-wide stack table: ids are valid across devices.
StackTable& stack_table();

// One recorded trace entry; stacks and metadata are interned ids (0: none).
struct HistoryEntry {
  TraceAction action = TraceAction::kAlloc;
  DevicePtr addr = 0;
  std::size_t size = 0;
  StreamId stream = 0;
  std::int64_t time_us = 0;
  Origin stack;
  std::uint32_t metadata = 0;
  std::uint64_t seq = 0;  // set by HistoryRing::push
};

// The order in which entries were recorded, over every ring of the process: the two engines
// of one device (stitch/backend.hpp) merge their histories by it.
inline std::atomic<std::uint64_t> g_history_sequence{0};

// The caller's context callback as the hot path reads it: one atomic load, no lock and no
// reference count. Each callback set stays alive until the owner is destroyed, since an
// operation may still be running the previous one when record_history replaces it.
class ContextSource {
 public:
  // Installs `fn` (if set) as the callback capture() runs.
  void set(std::function<ContextHandle()> fn);
  // The caller's context for the operation starting now (null without a callback).
  ContextHandle capture() const {
    const auto* fn = current_.load(std::memory_order_acquire);
    return fn != nullptr ? (*fn)() : nullptr;
  }

 private:
  std::atomic<const std::function<ContextHandle()>*> current_{nullptr};
  std::mutex mutex_;  // guards kept_
  std::vector<std::unique_ptr<const std::function<ContextHandle()>>> kept_;
};

// The last `capacity` entries, oldest first on read. Pushes take a short spin lock: the
// hot path records up to three entries per malloc+free pair.
class HistoryRing {
 public:
  void push(HistoryEntry e) {
    lock();
    e.seq = g_history_sequence.fetch_add(1, std::memory_order_relaxed);
    if (entries_.size() < capacity_) {
      entries_.push_back(std::move(e));
    } else {
      // The overwritten entry's context is dropped after the lock (in e's destructor).
      std::swap(entries_[next_], e);
      next_ = next_ + 1 == capacity_ ? 0 : next_ + 1;
      overflowed_ = true;
    }
    unlock();
  }
  // Sets the capacity (at least 1); clear drops the entries kept so far.
  void configure(std::size_t capacity, bool clear);
  std::vector<HistoryEntry> entries() const;  // chronological
  bool overflowed() const;
  std::size_t capacity() const;

 private:
  void lock() const {
    while (locked_.exchange(true, std::memory_order_acquire)) {
      while (locked_.load(std::memory_order_relaxed))
        __builtin_ia32_pause();
    }
  }
  void unlock() const { locked_.store(false, std::memory_order_release); }

  mutable std::atomic<bool> locked_{false};
  std::vector<HistoryEntry> entries_;
  std::size_t capacity_ = 1;
  std::size_t next_ = 0;  // the oldest entry once full
  bool overflowed_ = false;
};

// What recording at a HistoryOptions' levels asks of a backend, as PyTorch's
// _record_memory_history defines the levels; every backend applies the same.
struct HistorySwitches {
  bool history = false;            // entries go to the history ring (enabled "all")
  bool cpp = false;                // stacks are C++ stacks
  bool caller = false;             // stacks take the caller's context
  bool stacks_on_blocks = false;   // each malloc captures its stack, which its block keeps
                                   // while live (context "state" on; enabled "state" or "all")
  bool stacks_on_entries = false;  // entries carry stacks (context "alloc" on): an entry with
                                   // no operation stack of its own takes its block's
  bool capture_on_free = false;    // frees and empty_cache capture their own (context "all")
};
HistorySwitches history_switches(const HistoryOptions& options);

// The origin of the allocator operation starting in the caller (malloc, free, ...): its C++
// stack without the allocator's frames if `cpp`, and the caller's context from `caller` if
// not null. Not inlined, so the frames it skips are exactly itself and the operation.
[[gnu::noinline]] Origin capture_origin(bool cpp, const ContextSource* caller);

// The context of the allocator operation running on this thread: set for the duration of
// a malloc, free or empty_cache while history is recorded, restored after (operations can
// nest through free-memory callbacks).
class OperationContext {
 public:
  explicit OperationContext(Origin origin) : origin_(std::move(origin)), saved_(current_) {
    current_ = &origin_;
  }
  ~OperationContext() { current_ = saved_; }
  OperationContext(const OperationContext&) = delete;
  OperationContext& operator=(const OperationContext&) = delete;
  // The running operation's origin (empty outside one).
  static const Origin& current() { return current_ != nullptr ? *current_ : kNone; }
  // An empty origin.
  static const Origin& none() { return kNone; }
  // Whether an operation is running on this thread: one nested in it (the private pools'
  // empty_cache within the device's, a free-memory callback's call within a malloc) takes
  // the running operation's origin rather than capturing its own.
  static bool active() { return current_ != nullptr; }

 private:
  static const Origin kNone;
  Origin origin_;
  const Origin* saved_;
  static thread_local const Origin* current_;
};

// Per-thread user metadata strings (set_user_metadata), interned process-wide.
std::uint32_t intern_metadata(const std::string& s);
std::string metadata_string(std::uint32_t id);
std::uint32_t current_metadata();
void set_current_metadata(std::uint32_t id);

// History recorded beside a backend's operations, for the backends that keep it in fields
// (StitchEngine, AsyncBackend; the native engine packs the same switches into one word of
// trace flags): record_history's switches, the ring, the annotations and the capture of an
// operation's origin, so that each backend applies PyTorch's levels alike. The owner's
// trace lock guards history_on, stacks_on_entries and annotations; the capture switches are
// read without it, and the ring locks itself.
struct HistoryRecorder {
  bool history_on = false;         // entries go to the ring (enabled "all")
  bool stacks_on_entries = false;  // entries carry stacks (context "alloc" on)
  std::atomic<bool> capture_on_malloc{false};
  std::atomic<bool> capture_on_free{false};
  std::atomic<bool> capture_cpp{false};     // a capture takes the C++ stack
  std::atomic<bool> capture_caller{false};  // and the caller's context
  ContextSource contexts;
  HistoryRing ring;
  std::vector<Annotation> annotations;

  // The origin of the operation starting now; inlined, so capture_origin skips its frame.
  [[gnu::always_inline]] Origin capture() const {
    return capture_origin(capture_cpp.load(std::memory_order_relaxed),
                          capture_caller.load(std::memory_order_relaxed) ? &contexts : nullptr);
  }
  // Applies record_history's options. A malloc captures its stack when its block keeps it
  // (`blocks_keep_stacks`: context "state" on) or, for a backend whose blocks keep none,
  // when entries carry it. The owner's trace lock held.
  void configure(const HistoryOptions& options, bool blocks_keep_stacks);
  // Keeps an annotation while history is recorded. The owner's trace lock held.
  void annotate(std::string_view name, bool start, int device, std::int64_t now_us);
  // Records an entry of `stack`'s operation in the ring when history is on, and returns it
  // as trace observers see it (its context points into `stack`, or to none). The owner's
  // trace lock held.
  TraceEntry record(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream,
                    std::int64_t now_us, const Origin& stack);
  // The ring's entries and settings, and the annotations, into a snapshot. The owner's
  // trace lock held.
  void fill(Snapshot& s, std::vector<HistoryEntry>& entries) const;
};

// A snapshot's device trace from recorded entries (chronological): each entry's frames
// come from `frames` (StackTable::symbolize of its stack ids), its metadata id becomes the
// user metadata string.
std::vector<SnapshotTraceEntry> snapshot_trace(
    const std::vector<HistoryEntry>& entries,
    const std::unordered_map<StackTable::Id, Frames>& frames);

}  // namespace ccalloc::core
