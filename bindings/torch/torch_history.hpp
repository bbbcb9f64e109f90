// The history PyTorch's memory functions report, kept by the adapter (torch_allocator.cpp):
// the ring of PyTorch's TraceEntry per device (compile context, user metadata, skipped
// actions), annotations, the trace trackers (NCCL's segment registration), and PyTorch's
// rules for which segment keeps its context. The engine's trace observer feeds it
// (History::on_entry); the caller contexts are PyTorch's own GatheredContext objects.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/trace.hpp"

namespace ccalloc::torch_bridge {

namespace c10a = c10::cuda::CUDACachingAllocator;
using c10::MempoolId_t;
using c10::CachingDeviceAllocator::AnnotationEntry;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::TraceEntry;

// The devices the adapter serves.
inline constexpr int kMaxDevices = 64;

inline std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A fixed-capacity ring of trace entries, oldest first (PyTorch's RingBuffer).
class TraceRing {
 public:
  // Keeps the newest `n` entries.
  void set_max_entries(std::size_t n) {
    n = std::max<std::size_t>(n, 1);
    std::vector<TraceEntry> kept = entries();
    if (kept.size() > n) kept.erase(kept.begin(), kept.end() - static_cast<std::ptrdiff_t>(n));
    entries_ = std::move(kept);
    next_ = 0;
    max_ = n;
  }
  void clear() {
    entries_.clear();
    next_ = 0;
  }
  void push(const TraceEntry& e) {
    if (entries_.size() < max_) {
      entries_.push_back(e);
    } else {
      entries_[next_] = e;
      next_ = (next_ + 1) % max_;
    }
  }
  std::vector<TraceEntry> entries() const {
    std::vector<TraceEntry> out;
    out.reserve(entries_.size());
    for (std::size_t i = 0; i < entries_.size(); ++i)
      out.push_back(entries_[(next_ + i) % entries_.size()]);
    return out;
  }

 private:
  std::size_t max_ = 1;
  std::size_t next_ = 0;  // the oldest entry once full
  std::vector<TraceEntry> entries_;
};

inline TraceEntry::Action to_c10(ccalloc::TraceAction a) {
  using A = ccalloc::TraceAction;
  switch (a) {
    case A::kAlloc:
      return TraceEntry::ALLOC;
    case A::kFreeRequested:
      return TraceEntry::FREE_REQUESTED;
    case A::kFreeCompleted:
      return TraceEntry::FREE_COMPLETED;
    case A::kSegmentAlloc:
      return TraceEntry::SEGMENT_ALLOC;
    case A::kSegmentFree:
      return TraceEntry::SEGMENT_FREE;
    case A::kSegmentMap:
      return TraceEntry::SEGMENT_MAP;
    case A::kSegmentUnmap:
      return TraceEntry::SEGMENT_UNMAP;
    case A::kSnapshot:
      return TraceEntry::SNAPSHOT;
    case A::kOom:
      return TraceEntry::OOM;
  }
  return TraceEntry::ALLOC;
}

// Recorded history, plus the trace trackers (NCCL's segment registration), which see every
// entry whether or not history is recorded.
class History {
 public:
  bool observed() const { return recording_.load(std::memory_order_acquire) || has_trackers_; }
  bool recording() const { return recording_.load(std::memory_order_acquire); }

  void record_history(bool enabled, c10a::CreateContextFn recorder, std::size_t max_entries,
                      RecordContext when, bool clear,
                      const std::vector<std::string>& skip_actions) {
    std::unordered_set<int> skip;
    for (const std::string& name : skip_actions)
      skip.insert(static_cast<int>(c10::CachingDeviceAllocator::parseTraceEntryAction(name)));
    std::lock_guard lock(mutex_);
    engine_options_ = engine_options(enabled, recorder, when);
    skip_ = std::move(skip);
    max_entries_ = max_entries;
    for (TraceRing& ring : rings_) {
      ring.set_max_entries(max_entries);
      if (!enabled || clear) ring.clear();
    }
    if (!enabled || clear) annotations_.clear();
    recording_.store(enabled, std::memory_order_release);
  }

  // What the engines record (every allocator, including ones created later). The engine
  // gathers the context where PyTorch does: on malloc from STATE up, on free at ALL, each
  // before any allocator lock is taken (the recorder may take the GIL). Its own ring keeps
  // one entry: the adapter's ring is the history.
  ccalloc::HistoryOptions engine_history() {
    std::lock_guard lock(mutex_);
    return engine_options_;
  }

  void attach_tracker(c10a::AllocatorTraceTracker tracker) {
    std::lock_guard lock(mutex_);
    auto next = std::make_shared<std::vector<c10a::AllocatorTraceTracker>>(
        trackers_ ? *trackers_ : std::vector<c10a::AllocatorTraceTracker>{});
    next->push_back(std::move(tracker));
    trackers_ = std::move(next);
    has_trackers_ = true;
  }

  // Called by the engine for each trace entry of `device`, under its lock. Trackers are
  // called after this table's lock is released (still under the engine's, as PyTorch's).
  void on_entry(int device, const ccalloc::TraceEntry& e) {
    const bool recording = recording_.load(std::memory_order_acquire);
    if (!recording && !has_trackers_) return;
    std::shared_ptr<std::vector<c10a::AllocatorTraceTracker>> trackers;
    const TraceEntry te = record(device, e, recording, trackers);
    if (trackers) {
      for (const auto& tracker : *trackers)
        tracker(te);
    }
  }

  // Keeps the history; returns the entry in PyTorch's form and the trackers to call. The
  // engine has chosen the entry's context by PyTorch's rules (the operation's own, else the
  // block's or segment's allocation context; none below ALLOC).
  TraceEntry record(int device, const ccalloc::TraceEntry& e, bool recording,
                    std::shared_ptr<std::vector<c10a::AllocatorTraceTracker>>& trackers) {
    std::shared_ptr<c10::GatheredContext> context =
        e.context != nullptr ? gathered(*e.context) : nullptr;
    std::lock_guard lock(mutex_);
    trackers = trackers_;
    if (context && loses_segment_context(e)) context = nullptr;
    track_segment_heads(e);
    TraceEntry te(to_c10(e.action), static_cast<c10::DeviceIndex>(device), e.addr, e.size,
                  reinterpret_cast<void*>(e.stream), MempoolId_t{0, 0}, 0,
                  std::move(context),
                  compile_context_locked(device), user_metadata_[index(device)]);
    te.time_.t_ = static_cast<time_t>(e.time_us);
    if (recording && skip_.count(static_cast<int>(te.action_)) == 0) ring(device).push(te);
    return te;
  }

  // PyTorch's snapshot entry: recorded when a snapshot is taken, with the active bytes.
  void record_snapshot(int device, std::size_t active_bytes) {
    if (!recording()) return;
    std::lock_guard lock(mutex_);
    // With the region and metadata in force, as every entry (TraceEntry's own default is
    // an empty region, which tools that skip "N/A" would take for a compiled region).
    TraceEntry te(TraceEntry::SNAPSHOT, static_cast<c10::DeviceIndex>(device), 0, active_bytes,
                  nullptr, MempoolId_t{0, 0}, 0, nullptr, compile_context_locked(device),
                  user_metadata_[index(device)]);
    te.time_.t_ = static_cast<time_t>(now_us());
    if (skip_.count(static_cast<int>(te.action_)) == 0) ring(device).push(te);
  }

  std::vector<TraceEntry> trace(int device) {
    std::lock_guard lock(mutex_);
    return ring(device).entries();
  }

  // Whether a snapshot reports the context of the segment at `addr` (see
  // track_segment_heads).
  bool segment_keeps_context(ccalloc::DevicePtr addr) {
    std::lock_guard lock(mutex_);
    return unsplit_heads_.count(addr) != 0;
  }

  // The GatheredContext behind a handle the engine kept: every handle comes from
  // engine_options()'s callback, which wraps the recorder's shared_ptr.
  static std::shared_ptr<c10::GatheredContext> gathered(const ccalloc::ContextHandle& h) {
    return std::static_pointer_cast<c10::GatheredContext>(std::const_pointer_cast<void>(h));
  }

  void annotate(const std::vector<std::pair<std::string, std::string>>& md) {
    if (!recording()) return;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    AnnotationEntry ae(device, 0);
    ae.time_.t_ = static_cast<time_t>(now_us());
    for (const auto& [name, value] : md)
      ae.recordUserMetadata(name, value);
    std::lock_guard lock(mutex_);
    annotations_.push_back(std::move(ae));
    if (annotations_.size() > std::max<std::size_t>(max_entries_, 1))
      annotations_.erase(annotations_.begin());
  }
  std::vector<AnnotationEntry> annotations() {
    std::lock_guard lock(mutex_);
    return annotations_;
  }

  // The compiled region in force and the user's metadata are the device's, as PyTorch
  // keeps them (one stack and one string per device allocator, whatever thread pushes):
  // each trace entry of the device takes the innermost region ("N/A" outside any) and the
  // metadata set last.
  void push_compile_context(int device, const std::string& md) {
    std::lock_guard lock(mutex_);
    compile_contexts_[index(device)].push_back(md);
  }
  void pop_compile_context(int device) {
    std::lock_guard lock(mutex_);
    std::vector<std::string>& stack = compile_contexts_[index(device)];
    if (!stack.empty()) stack.pop_back();
  }
  void set_user_metadata(int device, const std::string& md) {
    std::lock_guard lock(mutex_);
    user_metadata_[index(device)] = md;
  }
  std::string user_metadata(int device) {
    std::lock_guard lock(mutex_);
    return user_metadata_[index(device)];
  }

 private:
  // PyTorch keeps a segment's context on the segment's original block, which moves off the
  // head when an allocation at the head splits it: from then on the segment reports no
  // context (the engine keeps it on the head). The split is PyTorch's rule for 512-byte
  // rounding.
  // The same holds for the segment's release: a segment free or unmap that carries the
  // segment's context (no context of its own, below ALL) carries none once the head has
  // been split. ccalloc's own snapshots and traces keep it.
  void track_segment_heads(const ccalloc::TraceEntry& e) {
    using A = ccalloc::TraceAction;
    const void* context = e.context != nullptr ? e.context->get() : nullptr;
    switch (e.action) {
      case A::kSegmentAlloc:
        unsplit_heads_[e.addr] = e.size;
        segment_contexts_[e.addr] = context;
        break;
      case A::kSegmentMap:  // the range's first mapping is the segment's
        unsplit_heads_.emplace(e.addr, e.size);
        segment_contexts_.emplace(e.addr, context);
        break;
      case A::kSegmentUnmap:
        segment_contexts_.erase(e.addr);
        break;
      case A::kAlloc: {
        const auto it = unsplit_heads_.find(e.addr);
        if (it != unsplit_heads_.end() && splits(e.size, it->second)) unsplit_heads_.erase(it);
        break;
      }
      case A::kSegmentFree:
        unsplit_heads_.erase(e.addr);
        segment_contexts_.erase(e.addr);
        break;
      default:
        break;
    }
  }

  // Whether `e`, a segment's release carrying the context the segment was allocated (or
  // first mapped) with, loses it as on PyTorch: the segment's head has been split.
  bool loses_segment_context(const ccalloc::TraceEntry& e) const {
    using A = ccalloc::TraceAction;
    if (e.action != A::kSegmentFree && e.action != A::kSegmentUnmap) return false;
    const auto it = segment_contexts_.find(e.addr);
    return it != segment_contexts_.end() && it->second != nullptr && e.context != nullptr &&
           it->second == e.context->get() && unsplit_heads_.count(e.addr) == 0;
  }

  // Whether PyTorch splits a free block of `block` bytes for a request of `requested`
  // bytes: small requests (<= 1 MiB) leave at least 512 bytes, large ones more than 1 MiB.
  static bool splits(std::size_t requested, std::size_t block) {
    constexpr std::size_t kSmall = 1 << 20;
    const std::size_t rounded = requested < 512 ? 512 : (requested + 511) / 512 * 512;
    if (rounded >= block) return false;
    const std::size_t remaining = block - rounded;
    return requested <= kSmall ? remaining >= 512 : remaining > kSmall;
  }

  static ccalloc::HistoryOptions engine_options(bool enabled, c10a::CreateContextFn recorder,
                                                RecordContext when) {
    using O = ccalloc::HistoryOptions;
    O o;
    o.enabled = enabled ? O::Enabled::kAll : O::Enabled::kNone;
    o.context = !enabled || recorder == nullptr ? O::Context::kNone
                : when == RecordContext::ALL    ? O::Context::kAll
                : when == RecordContext::ALLOC  ? O::Context::kAlloc
                : when == RecordContext::STATE  ? O::Context::kState
                                                : O::Context::kNone;
    o.stacks = O::Stacks::kNone;  // the recorder gathers C++ frames itself (stacks="all")
    o.max_entries = 1;
    o.clear = true;
    if (o.context != O::Context::kNone) {
      o.capture_context = [recorder]() -> ccalloc::ContextHandle { return recorder(); };
    }
    return o;
  }

  TraceRing& ring(int device) {
    TraceRing& r = rings_[static_cast<std::size_t>(device)];
    return r;
  }
  static std::size_t index(int device) {
    return static_cast<std::size_t>(std::clamp(device, 0, kMaxDevices - 1));
  }
  // mutex_ held.
  std::string compile_context_locked(int device) const {
    const std::vector<std::string>& stack = compile_contexts_[index(device)];
    return stack.empty() ? "N/A" : stack.back();
  }

  std::atomic<bool> recording_{false};
  std::atomic<bool> has_trackers_{false};
  std::mutex mutex_;  // guards everything below; a leaf lock (taken under engine locks)
  std::unordered_set<int> skip_;
  std::size_t max_entries_ = 1;
  std::array<TraceRing, kMaxDevices> rings_;
  std::array<std::vector<std::string>, kMaxDevices> compile_contexts_;
  std::array<std::string, kMaxDevices> user_metadata_;
  std::vector<AnnotationEntry> annotations_;
  std::shared_ptr<std::vector<c10a::AllocatorTraceTracker>> trackers_;
  ccalloc::HistoryOptions engine_options_ = engine_options(false, nullptr, RecordContext::NEVER);
  // Segment addresses whose head PyTorch has not split since the segment was allocated.
  std::unordered_map<ccalloc::DevicePtr, std::size_t> unsplit_heads_;
  // The context each segment (or mapped range) was recorded with when allocated or first
  // mapped, by address, for identity only: the engine keeps it alive while the segment is.
  std::unordered_map<ccalloc::DevicePtr, const void*> segment_contexts_;
};

}  // namespace ccalloc::torch_bridge
