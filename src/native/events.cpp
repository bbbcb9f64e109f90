// Cross-stream frees. A block used on other streams (record_stream) records one event on
// each of them when freed; it returns to its pool once all of them have completed. Events
// are polled at the start of every malloc and waited for on the OOM path and by
// empty_cache().
#include <algorithm>

#include "native/engine.hpp"

namespace ccalloc::core {

void Engine::insert_events(Arena& arena, Block* block) {
  std::vector<StreamId> uses;
  uses.swap(block->stream_uses);
  if (ordered_events()) [[unlikely]] {
    // PyTorch records them in the order of the block's set of streams, and each stream
    // joins its table of streams with pending events on first use.
    Lock lock(order_mutex_);
    std::vector<std::uint64_t> keys;
    keys.reserve(uses.size());
    for (const StreamId s : uses)
      keys.push_back(order_key(s));
    const std::vector<std::uint64_t> order = StreamTable::order_of(keys);
    std::vector<StreamId> sorted;
    sorted.reserve(uses.size());
    for (const std::uint64_t k : order) {
      for (std::size_t i = 0; i < uses.size(); ++i) {
        if (keys[i] == k) sorted.push_back(uses[i]);
      }
    }
    uses.swap(sorted);
    for (const StreamId s : uses)
      event_streams_.insert(order_key(s));
  }
  for (const StreamId s : uses) {
    const EventId event = event_pool_.get();
    driver_.record_event(event, s);
    ++block->event_count;
    auto queue = std::find_if(arena.pending.begin(), arena.pending.end(),
                              [s](const auto& q) { return q.first == s; });
    if (queue == arena.pending.end()) {
      arena.pending.emplace_back(s, std::deque<PendingFree>{});
      queue = std::prev(arena.pending.end());
    }
    queue->second.push_back(
        PendingFree{event, block, event_seq_.fetch_add(1, std::memory_order_relaxed)});
  }
  const auto n = static_cast<std::int64_t>(uses.size());
  arena.pending_events.fetch_add(n, std::memory_order_relaxed);
  pending_events_.fetch_add(n, std::memory_order_relaxed);
  uses.clear();
  block->stream_uses.swap(uses);  // keep the capacity, leave it empty
}

void Engine::insert_deferred_events(Arena& arena) {
  for (const DeferredFree& d : arena.deferred)
    insert_events(arena, d.block);
  forget_deferred(arena);
}

void Engine::forget_deferred(Arena& arena) {
  if (arena.reach.capture != 0) arena.reach = CaptureReach{};  // the capture is over
  if (arena.deferred.empty()) return;
  const auto n = static_cast<std::int64_t>(arena.deferred.size());
  arena.deferred.clear();
  arena.deferred_marked = 0;
  arena.deferred_count.fetch_sub(n, std::memory_order_relaxed);
  deferred_frees_.fetch_sub(n, std::memory_order_relaxed);
}

// Inside a capture no event may be recorded or queried, but the capture graph orders the
// work: a block's uses are over for its stream's later work once the nodes that ended them
// (the terminals of each using stream when the block was freed) are ancestors of the
// stream's current terminals, since whatever the stream captures next depends on those
// (docs/graph-capture-reuse.md).
std::vector<GraphNode> Engine::free_markers(Arena& arena, const Block* block,
                                            std::uint64_t& capture) {
  std::vector<GraphNode> markers;
  CaptureInfo& info = arena.reach.info;
  capture = 0;
  bool first = true;
  // The block's own stream first, then every stream that used it.
  for (std::size_t i = 0; i <= block->stream_uses.size(); ++i) {
    const StreamId s = i == 0 ? arena.stream : block->stream_uses[i - 1];
    try {
      if (!driver_.capture_info(s, info)) return {};
    } catch (const DriverError&) {
      // A stream the driver cannot answer for (the legacy stream during a capture): the
      // graph cannot order its uses, so the block waits for the capture's end.
      return {};
    }
    if (!first && info.id != capture) return {};  // two captures: wait for the ends
    first = false;
    capture = info.id;
    markers.insert(markers.end(), info.terminals.begin(), info.terminals.end());
  }
  std::sort(markers.begin(), markers.end());
  markers.erase(std::unique(markers.begin(), markers.end()), markers.end());
  // Empty: nothing was captured on any of the streams yet, so the uses were queued before
  // the capture began and the graph cannot order them; the block waits for the end.
  return markers;
}

void Engine::reuse_in_capture(Arena& arena) {
  CaptureReach& reach = arena.reach;
  try {
    if (!driver_.capture_info(arena.stream, reach.info) || reach.info.terminals.empty()) return;
    if (reach.capture != reach.info.id) {
      reach.ancestors.clear();
      reach.capture = reach.info.id;
    }
    // Reverse depth-first search from the terminals, stopping at nodes already reached.
    reach.stack.assign(reach.info.terminals.begin(), reach.info.terminals.end());
    while (!reach.stack.empty()) {
      const GraphNode n = reach.stack.back();
      reach.stack.pop_back();
      if (reach.ancestors.contains(n)) continue;
      driver_.node_dependencies(n, reach.parents);
      reach.ancestors.insert(n);
      for (GraphNode p : reach.parents) {
        if (!reach.ancestors.contains(p)) reach.stack.push_back(p);
      }
    }
  } catch (const DriverError&) {
    // The driver cannot answer for this stream now: nothing is reused, and a walk cut short
    // is forgotten (a node in the set must have all its ancestors there). The deferred
    // frees wait, at worst for the capture's end, as without the setting.
    reach.ancestors.clear();
    reach.capture = 0;
    return;
  }
  std::size_t kept = 0;
  for (std::size_t j = 0; j < arena.deferred.size(); ++j) {
    DeferredFree& d = arena.deferred[j];
    // Node handles of another capture may name nodes of this one: compare only within it.
    bool reusable = !d.markers.empty() && d.capture == reach.capture;
    for (std::size_t i = 0; reusable && i < d.markers.size(); ++i)
      reusable = reach.ancestors.contains(d.markers[i]);
    if (!reusable) {
      if (kept != j) arena.deferred[kept] = std::move(d);  // never onto itself
      ++kept;
      continue;
    }
    // The graph orders every use before the stream's later work: no event is needed.
    d.block->stream_uses.clear();
    free_block(arena, d.block);
  }
  const auto freed = static_cast<std::int64_t>(arena.deferred.size() - kept);
  if (freed == 0) return;
  arena.deferred.resize(kept);
  arena.deferred_marked -= static_cast<std::size_t>(freed);
  arena.deferred_count.fetch_sub(freed, std::memory_order_relaxed);
  deferred_frees_.fetch_sub(freed, std::memory_order_relaxed);
}

bool Engine::process_events(Arena& arena) {
  // A capture may have begun since the caller looked: the count is stable under the lock
  // (begin_allocate_to_pool changes it under every arena lock).
  if (capturing()) return false;
  insert_deferred_events(arena);
  if (arena.pending_events.load(std::memory_order_relaxed) == 0) return false;
  std::int64_t completed = 0;
  bool debt = false;
  for (auto& [stream, queue] : arena.pending) {
    // Events on one stream complete in order: stop at the first that has not.
    while (!debt && !queue.empty() && driver_.query_event(queue.front().event)) {
      const PendingFree done = queue.front();
      queue.pop_front();
      event_pool_.put(done.event);
      ++completed;
      if (--done.block->event_count == 0) {
        free_block(arena, done.block);
        debt = arena.in_debt;
      }
    }
    if (debt) break;
  }
  std::erase_if(arena.pending, [](const auto& q) { return q.second.empty(); });
  arena.pending_events.fetch_sub(completed, std::memory_order_relaxed);
  pending_events_.fetch_sub(completed, std::memory_order_relaxed);
  return debt;
}

void Engine::process_events_everywhere() {
  if (ordered_events()) {
    process_events_in_pytorch_order();
    return;
  }
  for (Arena* arena : arena_list()) {
    if (arena->pending_events.load(std::memory_order_relaxed) == 0 &&
        arena->deferred_count.load(std::memory_order_relaxed) == 0) {
      continue;
    }
    // Each free that leaves a peak debt is settled before the next, as if each were its own
    // operation: a later merge may lower the counter again.
    for (;;) {
      bool debt;
      {
        Lock lock(arena->mutex);
        debt = process_events(*arena);
      }
      if (!debt) break;
      settle_peak_debts();
    }
  }
}

void Engine::synchronize_and_free_events(const AllArenasLock& all, const PrivatePool* pool,
                                         bool counted) {
  if (counted) {
    Lock lock(device_mutex_);
    ++device_stats_.num_sync_all_streams;
  }
  if (pool == nullptr && ordered_events()) {
    synchronize_in_pytorch_order(all);
    return;
  }
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    if (pool != nullptr && arena->pool != pool) continue;
    insert_deferred_events(*arena);
    std::int64_t completed = 0;
    for (auto& [stream, queue] : arena->pending) {
      for (const PendingFree& f : queue) {
        driver_.synchronize_event(f.event);
        event_pool_.put(f.event);
        ++completed;
        if (--f.block->event_count == 0) {
          free_block(*arena, f.block);
          if (arena->in_debt) settle_peak_debts(all);  // as in process_events_everywhere()
        }
      }
    }
    arena->pending.clear();
    arena->pending_events.fetch_sub(completed, std::memory_order_relaxed);
    pending_events_.fetch_sub(completed, std::memory_order_relaxed);
  }
}

// ---------------------------------------------------------------------------------------
// PyTorch's order of streams (docs/pytorch-behaviour.md §2.10). PyTorch keeps one queue of
// (event, block) per stream, in a hash table of streams; each malloc walks the table in
// slot order, pops each stream's completed events in the order they were recorded, frees
// a block when its last event is popped, and erases a stream whose queue emptied (the walk
// then continues at that slot). Here each arena keeps its own queue per stream: a stream's
// queue is the merge of the arenas' queues by PendingFree::seq.

void Engine::set_stream_order_key(StreamId stream, std::uint64_t key) {
  Lock lock(order_mutex_);
  order_keys_[stream] = key;
  order_streams_[key] = stream;
  ordered_events_.store(true, std::memory_order_release);
}

std::uint64_t Engine::order_key(StreamId stream) const {
  const auto it = order_keys_.find(stream);
  return it != order_keys_.end() ? it->second : static_cast<std::uint64_t>(stream);
}

namespace {

// The arena queue holding the oldest pending free of `stream`, or none.
struct Oldest {
  Arena* arena = nullptr;
  std::deque<PendingFree>* queue = nullptr;
};

Oldest oldest_pending(const std::vector<Arena*>& arenas, StreamId stream)
    NO_THREAD_SAFETY_ANALYSIS {  // every arena lock held by the caller
  Oldest best;
  for (Arena* arena : arenas) {
    for (auto& [s, queue] : arena->pending) {
      if (s != stream || queue.empty()) continue;
      if (best.queue == nullptr || queue.front().seq < best.queue->front().seq) {
        best = Oldest{arena, &queue};
      }
    }
  }
  return best;
}

}  // namespace

void Engine::insert_all_deferred_events(const AllArenasLock& all) {
  struct Deferred {
    std::uint64_t seq;
    Arena* arena;
    Block* block;
  };
  std::vector<Deferred> order;
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    for (const DeferredFree& d : arena->deferred)
      order.push_back(Deferred{d.seq, arena, d.block});
  }
  std::sort(order.begin(), order.end(),
            [](const Deferred& x, const Deferred& y) { return x.seq < y.seq; });
  for (const Deferred& d : order) {
    all.held(*d.arena);
    insert_events(*d.arena, d.block);
  }
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    forget_deferred(*arena);
  }
}

bool Engine::retire_oldest(const AllArenasLock& all, StreamId stream, bool wait) {
  const Oldest o = oldest_pending(all.by_stream(), stream);
  if (o.queue == nullptr) return false;
  all.held(*o.arena);
  const PendingFree f = o.queue->front();
  if (wait) {
    driver_.synchronize_event(f.event);
  } else if (!driver_.query_event(f.event)) {
    return false;
  }
  o.queue->pop_front();
  event_pool_.put(f.event);
  o.arena->pending_events.fetch_sub(1, std::memory_order_relaxed);
  pending_events_.fetch_sub(1, std::memory_order_relaxed);
  if (--f.block->event_count == 0) {
    free_block(*o.arena, f.block);
    if (o.arena->in_debt) settle_peak_debts(all);  // each free as its own operation
  }
  return true;
}

StreamId Engine::stream_of_key(std::uint64_t key) const {
  const auto it = order_streams_.find(key);
  return it != order_streams_.end() ? it->second : static_cast<StreamId>(key);
}

void Engine::retire_unkeyed(const AllArenasLock& all, bool wait) {
  // Frees whose events were recorded before any key was known: stream by stream.
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    std::vector<StreamId> streams;
    for (const auto& [stream, queue] : arena->pending)
      streams.push_back(stream);
    for (const StreamId stream : streams) {
      while (retire_oldest(all, stream, wait)) {
      }
    }
  }
  for (Arena* arena : all.by_stream()) {
    all.held(*arena);
    std::erase_if(arena->pending, [](const auto& q) { return q.second.empty(); });
  }
}

void Engine::process_events_in_pytorch_order() {
  const AllArenasLock all(*this);
  if (capturing()) return;
  insert_all_deferred_events(all);
  {
    Lock lock(order_mutex_);
    for (std::size_t slot = event_streams_.begin(); slot != event_streams_.end();) {
      const StreamId stream = stream_of_key(event_streams_.key(slot));
      while (retire_oldest(all, stream, /*wait=*/false)) {
      }
      slot = oldest_pending(all.by_stream(), stream).queue == nullptr
                 ? event_streams_.erase(slot)
                 : event_streams_.next(slot);
    }
  }
  retire_unkeyed(all, /*wait=*/false);
}

void Engine::synchronize_in_pytorch_order(const AllArenasLock& all) {
  insert_all_deferred_events(all);
  {
    Lock lock(order_mutex_);
    for (std::size_t slot = event_streams_.begin(); slot != event_streams_.end();
         slot = event_streams_.next(slot)) {
      const StreamId stream = stream_of_key(event_streams_.key(slot));
      while (retire_oldest(all, stream, /*wait=*/true)) {
      }
    }
    event_streams_.clear();
  }
  retire_unkeyed(all, /*wait=*/true);
}

}  // namespace ccalloc::core
