// The native engine's history: its switches, annotations and snapshots (the ring, the
// recorder and the snapshot schema they fill: core's history files).
#include <algorithm>
#include <map>
#include <unordered_map>

#include "native/engine.hpp"
#include "core/common.hpp"
#include "core/rounding.hpp"

namespace ccalloc {
namespace core {

void Engine::record_history(const HistoryOptions& options) {
  using O = HistoryOptions;
  const HistorySwitches sw = history_switches(options);
  const bool on = options.enabled != O::Enabled::kNone;
  unsigned flags = trace_flags_.load() & kTraceObservers;
  if (sw.history) flags |= kTraceHistory;
  if (sw.stacks_on_blocks) flags |= kCaptureOnMalloc | kStacksOnBlocks;
  if (sw.stacks_on_blocks && sw.cpp) flags |= kCppStacks;
  if (sw.stacks_on_blocks && sw.caller) flags |= kCallerContexts;
  if (sw.stacks_on_entries) flags |= kStacksOnEntries;
  if (sw.capture_on_free) flags |= kCaptureOnFree;
  // PyTorch keeps one entry unless everything is recorded; stopping clears the history.
  // The callback is in place before any operation can see the flags that ask for it.
  contexts_.set(options.capture_context);
  history_.configure(options.enabled == O::Enabled::kAll ? options.max_entries : 1,
                     options.clear || !on);
  if (!on || options.clear) {
    Lock lock(annotations_mutex_);
    annotations_.clear();
  }
  trace_flags_.store(flags, std::memory_order_release);
}

void Engine::annotate(std::string_view name, bool start) {
  if ((trace_flags_.load(std::memory_order_relaxed) & kTraceHistory) == 0) return;
  Annotation a{std::string(name), start ? "START" : "END", device(), driver_.now_us()};
  Lock lock(annotations_mutex_);
  annotations_.push_back(std::move(a));
}

Snapshot Engine::snapshot() {
  return snapshot(/*trace_entry=*/true, 0);
}

Snapshot Engine::snapshot(bool trace_entry, std::int64_t other_active_bytes) {
  Snapshot s;
  std::vector<StackTable::Id> ids;
  std::vector<std::pair<SnapshotBlock*, Origin>> block_stacks;
  std::vector<std::pair<SnapshotSegment*, Origin>> segment_stacks;
  std::vector<HistoryEntry> entries;
  {
    AllArenasLock all(*this);
    std::int64_t active_bytes = 0;
    for (Arena* arena : all.by_stream()) {
      all.held(*arena);
      active_bytes += pools_current(arena->stats.active_bytes);
    }
    if (trace_entry) {
      record_trace(TraceAction::kSnapshot, 0,
                   static_cast<std::size_t>(active_bytes + other_active_bytes), 0, nullptr);
    }

    std::vector<std::pair<SnapshotSegment, std::vector<Origin>>> built;
    for (Arena* arena : all.by_stream()) {
      all.held(*arena);
      for (const auto& blocks : reported_segments(*arena)) {
        SnapshotSegment seg;
        describe_segment(seg, *arena, blocks);
        if (arena->pool != nullptr) {
          seg.pool_id = {static_cast<std::int64_t>(arena->pool->id.first),
                         static_cast<std::int64_t>(arena->pool->id.second)};
        }
        std::vector<Origin> stacks{blocks.front()->segment_stack};
        for (const Block* b : blocks) {
          SnapshotBlock sb;
          sb.address = b->ptr;
          sb.size = b->size;
          sb.requested_size = b->requested_size;
          sb.state = state_of(b);
          seg.blocks.push_back(std::move(sb));
          stacks.push_back(b->allocated || b->event_count > 0 ? b->stack : Origin{});
        }
        built.emplace_back(std::move(seg), std::move(stacks));
      }
    }
    std::sort(built.begin(), built.end(),
              [](const auto& a, const auto& b) { return a.first.address < b.first.address; });
    s.segments.reserve(built.size());
    std::vector<std::vector<Origin>> stack_lists;
    for (auto& [seg, stacks] : built) {
      s.segments.push_back(std::move(seg));
      stack_lists.push_back(std::move(stacks));
    }
    for (std::size_t i = 0; i < s.segments.size(); ++i) {
      SnapshotSegment& seg = s.segments[i];
      segment_stacks.emplace_back(&seg, std::move(stack_lists[i][0]));
      for (std::size_t j = 0; j < seg.blocks.size(); ++j) {
        block_stacks.emplace_back(&seg.blocks[j], std::move(stack_lists[i][j + 1]));
      }
    }
    entries = history_.entries();
  }

  for (const auto& [seg, origin] : segment_stacks)
    ids.push_back(origin.cpp);
  for (const auto& [block, origin] : block_stacks)
    ids.push_back(origin.cpp);
  for (const HistoryEntry& e : entries)
    ids.push_back(e.stack.cpp);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const auto frames = stack_table().symbolize(ids);
  for (const auto& [seg, origin] : segment_stacks) {
    seg->frames = StackTable::frames_of(frames, origin.cpp);
    seg->context = origin.context;
  }
  for (const auto& [block, origin] : block_stacks) {
    block->frames = StackTable::frames_of(frames, origin.cpp);
    block->context = origin.context;
  }

  s.device_traces.resize(static_cast<std::size_t>(device()) + 1);
  s.device_traces[static_cast<std::size_t>(device())] = snapshot_trace(entries, frames);

  AllocatorSettings& st = s.allocator_settings;
  {
    Lock lock(device_mutex_);  // reconfigure() may change the config meanwhile
    st = settings_of(config_);
  }
  st.trace_alloc_overflowed = history_.overflowed();
  st.trace_alloc_max_entries = static_cast<std::int64_t>(history_.capacity());
  {
    Lock lock(annotations_mutex_);
    s.external_annotations = annotations_;
  }
  return s;
}

}  // namespace core
}  // namespace ccalloc
