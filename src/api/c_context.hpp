// Caller contexts through the C API: C callbacks as HistoryOptions::capture_context and
// ContextFrames, and the snapshot object the accessors read. Header-only, so that tests can
// drive the same conversions against a simulated ProcessAllocator.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ccalloc/ccalloc.h"
#include "ccalloc/errors.hpp"
#include "ccalloc/snapshot.hpp"

struct ccalloc_snapshot {
  ccalloc::Snapshot snapshot;
};

namespace ccalloc::capi {

// Each non-null handle `capture` returns is owned by one shared_ptr: its deleter, run when
// the last copy goes (entries, blocks, snapshots), calls `release` exactly once.
inline std::function<ContextHandle()> capture_context(ccalloc_context_capture_fn capture,
                                                      ccalloc_context_release_fn release,
                                                      void* user_data) {
  if (capture == nullptr) return nullptr;
  if (release == nullptr) {
    throw ConfigError("ccalloc_record_history_context: release is NULL but capture is not "
                      "(every captured context must be released)");
  }
  return [capture, release, user_data]() -> ContextHandle {
    void* context = capture(user_data);
    if (context == nullptr) return nullptr;
    return ContextHandle(context, [release, user_data](const void* c) {
      release(const_cast<void*>(c), user_data);
    });
  };
}

inline HistoryOptions history_options(const char* enabled, const char* context,
                                      const char* stacks, size_t max_entries,
                                      ccalloc_context_capture_fn capture,
                                      ccalloc_context_release_fn release, void* user_data) {
  HistoryOptions o;
  o.enabled = HistoryOptions::parse_enabled(enabled != nullptr ? enabled : "none");
  o.context = HistoryOptions::parse_context(context != nullptr ? context : "none");
  o.stacks = HistoryOptions::parse_stacks(stacks != nullptr ? stacks : "none");
  o.max_entries = max_entries;
  o.capture_context = capture_context(capture, release, user_data);
  return o;
}

inline void* handle(const ContextHandle& h) {
  return const_cast<void*>(h.get());
}

inline ContextFrames context_frames(ccalloc_context_frames_fn frames, void* user_data) {
  if (frames == nullptr) return nullptr;
  return [frames, user_data](const ContextHandle& h) {
    std::vector<Frame> out;
    const ccalloc_frame_emit_fn emit = [](void* sink, const char* filename, int64_t line,
                                          const char* name) {
      static_cast<std::vector<Frame>*>(sink)->push_back(
          Frame{filename != nullptr ? filename : "", line, name != nullptr ? name : ""});
    };
    frames(handle(h), emit, &out, user_data);
    return out;
  };
}

inline ccalloc_trace_entry trace_entry(const SnapshotTraceEntry& e) {
  ccalloc_trace_entry out{};
  out.action = static_cast<ccalloc_trace_action>(e.action);
  out.addr = static_cast<uintptr_t>(e.addr);
  out.size = e.size;
  out.stream = reinterpret_cast<void*>(e.stream);
  out.time_us = e.time_us;
  out.context = handle(e.context);
  return out;
}

inline ccalloc_segment_info segment_info(const SnapshotSegment& s) {
  ccalloc_segment_info out{};
  out.device = s.device;
  out.address = static_cast<uintptr_t>(s.address);
  out.total_size = s.total_size;
  out.allocated_size = s.allocated_size;
  out.active_size = s.active_size;
  out.requested_size = s.requested_size;
  out.stream = reinterpret_cast<void*>(s.stream);
  out.is_small = s.is_small ? 1 : 0;
  out.is_expandable = s.is_expandable ? 1 : 0;
  out.block_count = s.blocks.size();
  out.context = handle(s.context);
  return out;
}

inline ccalloc_block_info block_info(const SnapshotBlock& b) {
  ccalloc_block_info out{};
  out.address = static_cast<uintptr_t>(b.address);
  out.size = b.size;
  out.requested_size = b.requested_size;
  out.state = static_cast<ccalloc_block_state>(b.state);
  out.context = handle(b.context);
  return out;
}

}  // namespace ccalloc::capi
