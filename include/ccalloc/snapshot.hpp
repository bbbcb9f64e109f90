// Memory snapshots: the allocator's segments and blocks at one moment, with the history
// of trace entries that led there. The schema is PyTorch's torch.cuda.memory._snapshot()
// (segments, device_traces, allocator_settings, external_annotations), so its viewer and
// scripts read ccalloc's snapshots and ccalloc's tools read PyTorch's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/trace.hpp"

namespace ccalloc {

// One stack frame: C++ (function, file:line where debug info allows) or Python.
struct Frame {
  std::string filename;
  std::int64_t line = 0;
  std::string name;
  bool operator==(const Frame&) const = default;
};
// A stack, innermost frame first. Identical stacks share one list.
using Frames = std::shared_ptr<const std::vector<Frame>>;

struct SnapshotBlock {
  DevicePtr address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  BlockState state = BlockState::kInactive;
  Frames frames;          // C++ stack of its allocation; null if none was recorded
  ContextHandle context = nullptr;  // caller context of its allocation; null if none
  // A small-pool block in a large segment (the stitching policy's islands: whole pages of
  // the large pool lent in place to the small pool). Written as the key "island" only when
  // true (PyTorch's reader ignores it); statistics count the block in the small pool.
  bool island = false;
};

struct SnapshotSegment {
  int device = 0;
  DevicePtr address = 0;
  std::size_t total_size = 0;
  std::size_t allocated_size = 0;
  std::size_t active_size = 0;
  std::size_t requested_size = 0;
  StreamId stream = 0;
  bool is_small = false;  // segment_type "small" / "large"
  std::pair<std::int64_t, std::int64_t> pool_id{0, 0};
  bool is_expandable = false;
  // Its pool is asleep (docs/sleep-wake.md): no physical memory behind it. Written as the
  // key "is_asleep" only when true (PyTorch's reader ignores it).
  bool is_asleep = false;
  Frames frames;          // C++ stack of the device allocation (or first mapping)
  ContextHandle context = nullptr;  // caller context of the device allocation (or first mapping)
  std::vector<SnapshotBlock> blocks;
  // Stitching policy only (empty for the others; the key "pieces" in files): the physical
  // pieces behind the segment's pages in address order, adding up to total_size.
  std::vector<PieceRun> pieces;
};

struct SnapshotTraceEntry {
  TraceAction action = TraceAction::kAlloc;
  DevicePtr addr = 0;  // for kOom: the device's free bytes (written as `device_free`)
  std::size_t size = 0;
  StreamId stream = 0;
  std::int64_t time_us = 0;
  Frames frames;              // null: no C++ stack was recorded (the key is omitted)
  std::string user_metadata;  // the thread's metadata when the entry was recorded
  ContextHandle context = nullptr;  // the caller context recorded with it, or null
  // The order of recording among all of the process's entries (not written to files; 0 for
  // entries read from one).
  std::uint64_t seq = 0;
};

struct Annotation {
  std::string name;
  std::string stage;  // "START" or "END"
  int device = 0;
  std::int64_t time_us = 0;
};

// allocator_settings as PyTorch reports them.
struct AllocatorSettings {
  std::string conf;  // the config string ("PYTORCH_CUDA_ALLOC_CONF")
  std::int64_t max_split_size = -1;
  double garbage_collection_threshold = 0.0;
  bool expandable_segments = false;
  std::int64_t pinned_num_register_threads = 1;
  bool release_lock_on_cudamalloc = false;
  bool pinned_use_cuda_host_register = false;
  std::vector<std::int64_t> roundup_power2_divisions;  // 16 entries, [1 MiB, 2 MiB) first
  bool graph_capture_record_stream_reuse = false;
  bool trace_alloc_overflowed = false;
  std::int64_t trace_alloc_max_entries = 0;
};

// The physical memory of the stitching policy (stitch_segments) on one device, beside the
// segments (written under the key "physical_memory", which PyTorch's tools ignore).
// Segments are the runs of live pages of the policy's address ranges; a piece held by the
// policy is either live (behind exactly one page of one segment) or spare, so
//   sum of the device's segments' total_size + spare pieces x piece_size
//     == sum of handles' pieces x piece_size == reserved_bytes (physical bytes held);
// address space (ranges' size, dead and unmapped pages) is not counted.
struct PhysicalHandleInfo {
  PhysicalHandle handle = 0;
  std::uint32_t pieces = 0;
  bool is_small = false;  // the pool whose growth created it: its reserved bytes count there
  bool operator==(const PhysicalHandleInfo&) const = default;
};
// Pages [address, address + pieces.count x piece_size) of a range that still map pieces
// lent to a later page (or spare since): they hold no memory of their own.
struct DeadPages {
  DevicePtr address = 0;
  PieceRun pieces;
  bool operator==(const DeadPages&) const = default;
};
// One address range (space) of a stream and pool: pages are mapped from `address` up to
// `frontier`; below it each page is live (in a segment), dead (in `dead`) or unmapped.
struct AddressRange {
  DevicePtr address = 0;
  std::size_t size = 0;      // address space reserved (no memory)
  std::size_t frontier = 0;  // bytes from `address` that have pages
  StreamId stream = 0;
  bool is_small = false;
  std::vector<DeadPages> dead;  // by address
  bool operator==(const AddressRange&) const = default;
};
struct PhysicalMemory {
  int device = 0;
  std::size_t piece_size = 0;
  std::vector<PhysicalHandleInfo> handles;  // every handle held, by id
  std::vector<PieceRun> spare;              // pieces live nowhere, by (handle, piece)
  std::vector<AddressRange> ranges;         // by address
  bool operator==(const PhysicalMemory&) const = default;

  std::size_t held_bytes() const {  // handles' pieces x piece_size
    std::size_t n = 0;
    for (const PhysicalHandleInfo& h : handles)
      n += h.pieces;
    return n * piece_size;
  }
  std::size_t spare_bytes() const {  // spare pieces x piece_size
    std::size_t n = 0;
    for (const PieceRun& r : spare)
      n += r.count;
    return n * piece_size;
  }
};

struct Snapshot {
  std::vector<SnapshotSegment> segments;  // every device, by address within a device
  std::vector<std::vector<SnapshotTraceEntry>> device_traces;  // index = device
  AllocatorSettings allocator_settings;
  std::vector<Annotation> external_annotations;
  std::vector<PhysicalMemory> physical;  // stitching policy only: one per device using it

  // The physical memory of `device`, or null (not the stitching policy).
  const PhysicalMemory* physical_of(int device) const {
    for (const PhysicalMemory& p : physical) {
      if (p.device == device) return &p;
    }
    return nullptr;
  }
};

// What history recording keeps (PyTorch's _record_memory_history arguments).
struct HistoryOptions {
  enum class Enabled { kNone, kState, kAll };
  // none: no stacks; state: stacks of live blocks only; alloc: also on alloc entries;
  // all: also on free entries (and segment frees by empty_cache).
  enum class Context { kNone, kState, kAlloc, kAll };
  enum class Stacks { kNone, kCpp };

  Enabled enabled = Enabled::kAll;
  Context context = Context::kAll;
  Stacks stacks = Stacks::kCpp;
  std::size_t max_entries = std::size_t{1} << 20;  // ring buffer length (forced to 1 unless all)
  bool clear = false;                              // drop the entries recorded so far
  // The caller's own context (Python frames, a request id, ...), taken wherever `context`
  // says a stack is captured: on malloc (state and up), on free and empty_cache (all).
  // Independent of `stacks`: with kNone the caller's context is the only one. Called with
  // no allocator lock held, from any thread, possibly concurrently; a null result records
  // no context. The handle is kept beside the C++ stack on history entries (alloc and up),
  // on live blocks and on segments (the head block's allocation), and returned by
  // snapshot() and segments(). Not called while history is off or `context` is none.
  // The handle's deleter may run with allocator locks held: it must not call the allocator.
  std::function<ContextHandle()> capture_context;

  // Parses "none|state|all" etc.; throws ConfigError naming the argument and value.
  static Enabled parse_enabled(const std::string& s);
  static Context parse_context(const std::string& s);
  static Stacks parse_stacks(const std::string& s);
};

// Renders a caller context as frames (innermost first) for snapshot files and tools; null
// or an empty list when it has none.
using ContextFrames = std::function<std::vector<Frame>(const ContextHandle&)>;

// Sets each trace entry's, block's and segment's `frames` to its C++ stack (if any)
// followed by the frames of its caller context: the C++ stack starts at the allocator call,
// so it is the inner part when both were taken (C++ under Python, say). Each distinct
// handle is rendered once; entries with the same handle and stack share one frame list.
// io::write_snapshot takes the same function to write the caller's frames into files.
void render_contexts(Snapshot& s, const ContextFrames& frames);

}  // namespace ccalloc
