// Trace entries: one record per allocator action, with PyTorch's action names and
// addr/size semantics (snapshot `device_traces`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>

#include "ccalloc/driver.hpp"

namespace ccalloc {

enum class TraceAction : std::uint8_t {
  kAlloc,           // addr = block, size = requested (unrounded) size
  kFreeRequested,   // the program freed it; size = requested size
  kFreeCompleted,   // the block is back in its pool (later than the request after record_stream)
  kSegmentAlloc,    // a device allocation: addr, size of the segment
  kSegmentFree,     // a device free
  kSegmentMap,      // expandable segments: pages mapped
  kSegmentUnmap,    // expandable segments: pages unmapped
  kSnapshot,        // a snapshot was taken; size = active bytes
  kOom,             // an out-of-memory error; size = rounded request, device_free = free memory
};

std::string_view to_string(TraceAction action);
// Parses PyTorch's action name; nullopt for an unknown name.
std::optional<TraceAction> parse_trace_action(std::string_view name);

// A caller's context for an allocator operation (HistoryOptions::capture_context in
// snapshot.hpp): opaque to ccalloc and reference counted. The allocator holds references
// on history entries, live blocks and segments, and drops each when that entry leaves the
// history, the block is freed or the segment released; the handle's deleter runs when the
// last reference goes, whoever holds it.
using ContextHandle = std::shared_ptr<const void>;

struct TraceEntry {
  TraceAction action = TraceAction::kAlloc;
  DevicePtr addr = 0;  // for kOom: the device's free bytes (PyTorch's `device_free`)
  std::size_t size = 0;
  StreamId stream = 0;
  std::int64_t time_us = 0;
  // For trace observers: the caller context the history gives this entry (null if none),
  // valid for the duration of the call; copy the handle to keep it.
  const ContextHandle* context = nullptr;
};

// Called for every trace entry, in order, with the allocator's lock held: it must not call
// back into the allocator.
using TraceObserver = std::function<void(const TraceEntry&)>;

}  // namespace ccalloc
