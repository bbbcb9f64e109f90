// The memory viewer's model of one device's history: what the HTML page draws, computed
// once in C++ so the page only lays it out.
//
// From a snapshot (its segments and blocks now, and the trace that led there) it derives:
//   - events: the trace entries, with each free_requested that is directly followed by its
//     free_completed collapsed into one `free` (as PyTorch's viewer does);
//   - allocations: each alloc paired with its frees, so an allocation is live over the
//     event interval [start, end) (end = its free_completed), allocated until
//     free_requested and pending-free after it. Blocks live before the trace began (freed
//     without an alloc in the trace, or still active in the snapshot without one) start
//     at -1;
//   - segment spans: device memory held over an event interval. A segment_alloc opens a
//     span and its segment_free closes it; with expandable segments each segment_map opens
//     one and a segment_unmap closes every span it touches, re-opening what stays mapped.
//     The page merges address-adjacent spans of one stream into the segments PyTorch's
//     snapshot reports (one per run of mapped pages);
//   - a stack table: frames and stacks deduplicated, referenced by index.
//
// Intervals are in event indices; `kNever` (= the event count) marks "not before the end".
// The state after event e holds every allocation with start <= e < end and every span
// with start <= e < end: the page rebuilds any moment in O(allocations) without replaying.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ccalloc/snapshot.hpp"

namespace ccalloc::viz {

// Event kinds as the page numbers them (viz/js/common.js EVENT_NAMES follows this order).
enum class EventKind : std::uint8_t {
  kAlloc,
  kFreeRequested,  // the program freed it; the block waits for other streams' events
  kFreeCompleted,  // the block went back to its pool (after a separate free_requested)
  kFree,           // free_requested and free_completed in one step (the usual case)
  kSegmentAlloc,
  kSegmentFree,
  kSegmentMap,
  kSegmentUnmap,
  kSnapshot,
  kOom,  // addr holds the device's free bytes, size the rounded request
};

struct Allocation {
  std::int32_t start = -1;           // its alloc event; -1: live before the trace began
  std::int32_t free_requested = -1;  // its free_requested / free event; kNever if none
  std::int32_t end = -1;             // its free_completed / free event; kNever if none
  std::uint64_t addr = 0;
  std::uint64_t size = 0;        // requested bytes (the trace's alloc size)
  std::uint64_t block_size = 0;  // rounded size; exact when the snapshot still holds it
  // Bytes past block_size that still belong to the block when they are not followed by a
  // free block: the split rule leaves a remainder this small inside the block (511 B in
  // the small pool and in expandable segments, 1 MiB in the large pool, and up to
  // max_non_split_rounding for oversize blocks).
  std::uint64_t slack = 0;
  std::int32_t stack = -1;  // stack of the alloc, else of the free; -1 if none recorded
  std::uint16_t stream = 0;
  std::uint8_t flags = 0;  // kBeforeTrace | kStackFromFree

  static constexpr std::uint8_t kBeforeTrace = 1;
  static constexpr std::uint8_t kStackFromFree = 2;
};

struct SegmentSpan {
  std::int32_t start = -1;  // -1: held before the trace began
  std::int32_t end = -1;    // kNever: still held at the end
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  std::int32_t stack = -1;  // stack of the segment_alloc / segment_map
  std::uint16_t stream = 0;
  std::uint8_t flags = 0;  // kSmall | kExpandable | kTypeKnown

  static constexpr std::uint8_t kSmall = 1;
  static constexpr std::uint8_t kExpandable = 2;
  static constexpr std::uint8_t kTypeKnown = 4;  // kSmall is known (from a block or the snapshot)
};

struct StackTable {
  struct FrameRef {
    std::int32_t filename = 0;  // index into strings
    std::int64_t line = 0;
    std::int32_t name = 0;
  };
  std::vector<std::string> strings;
  std::vector<FrameRef> frames;
  std::vector<std::vector<std::int32_t>> stacks;  // frame indices, innermost first
};

struct Model {
  int device = 0;
  std::int64_t time0 = 0;  // time_us of the first event; event times are relative to it

  // Events, one column per field (the page reads them as typed arrays).
  std::vector<EventKind> kind;
  std::vector<std::uint64_t> addr;  // kOom: device free bytes
  std::vector<std::uint64_t> size;
  std::vector<std::uint16_t> stream;  // index into streams
  std::vector<std::int64_t> time_us;  // relative to time0
  std::vector<std::int32_t> stack;    // -1: none recorded
  std::vector<std::int32_t> alloc;    // the allocation an alloc/free event belongs to, or -1
  std::vector<std::int32_t> entry;    // index of the trace entry the event came from

  // In stack order: those live before the trace first (by address), then by alloc event.
  std::vector<Allocation> allocations;
  std::vector<SegmentSpan> spans;
  std::vector<std::string> streams;  // stream ids as decimal text, by first appearance
  StackTable stacks;
  // Inconsistencies met while pairing (an alloc at a live address...), for the page.
  std::vector<std::string> warnings;

  std::int32_t never() const { return static_cast<std::int32_t>(kind.size()); }
};

// Builds the model of `device` from a snapshot. Never throws on inconsistent histories:
// it pairs what it can and reports the rest in `warnings`.
Model build_model(const Snapshot& s, int device);

// The device a viewer should show when none is asked for: the one with the longest trace,
// else the first with a segment, else 0.
int default_device(const Snapshot& s);

// The allocator config a snapshot was recorded under, in ccalloc's grammar with the
// `pytorch` preset (its settings string, plus expandable segments when reported).
std::string recorded_config(const Snapshot& s);

}  // namespace ccalloc::viz
