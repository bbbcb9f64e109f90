// Events of cross-stream frees, captures, and the release of cached memory (the OOM
// ladder's last steps and empty_cache; rule 5, rule 8).
#include <algorithm>

#include "stitch/engine.hpp"
#include "stitch/tunables.hpp"

namespace ccalloc::core {

// ---------------------------------------------------------------------------------------
// Events, releasing the cache

// A pending block is in its own arena's list: completing it needs only that arena's lock.
void StitchEngine::process_events(Arena& arena) {
  if (capturing()) return;  // as insert_deferred_events
  std::vector<PendingEvent>& pending = arena.pending;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending.size(); ++i) {
    const PendingEvent p = pending[i];
    if (!driver_.query_event(p.event)) {
      pending[kept++] = p;
      continue;
    }
    event_pool_.put(p.event);
    if (--p.block->event_count == 0) free_block(arena, p.block);
  }
  const auto completed = static_cast<std::int64_t>(pending.size() - kept);
  pending.resize(kept);
  arena.pending_events.fetch_sub(completed, std::memory_order_relaxed);
  pending_events_.fetch_sub(completed, std::memory_order_relaxed);
}

void StitchEngine::insert_deferred_events(Arena& arena) {
  // A capture may have begun since the caller looked; under the arena's lock it cannot.
  if (arena.deferred.empty() || capturing()) return;
  const auto n = static_cast<std::int64_t>(arena.deferred.size());
  for (Block* b : arena.deferred)
    record_events(arena, b);
  arena.deferred.clear();
  deferred_frees_.fetch_sub(n, std::memory_order_relaxed);
}

void StitchEngine::begin_capture() {
  const AllArenasLock all(*this);
  captures_underway_.fetch_add(1, std::memory_order_acq_rel);
}

void StitchEngine::end_capture() {
  {
    const AllArenasLock all(*this);
    captures_underway_.fetch_sub(1, std::memory_order_acq_rel);
  }
  // Frees deferred during the capture get their events at the next malloc or empty_cache.
  after_operation();
}

void StitchEngine::catch_up_events() {
  if (deferred_frees_.load(std::memory_order_relaxed) != 0) {
    for (Arena* arena : arena_list()) {
      Lock lock(arena->mutex);
      insert_deferred_events(*arena);
    }
  }
  if (pending_events_.load(std::memory_order_relaxed) > 0) process_events_everywhere();
}

void StitchEngine::process_events_everywhere() {
  for (Arena* arena : arena_list()) {
    if (arena->pending_events.load(std::memory_order_relaxed) == 0) continue;
    Lock lock(arena->mutex);
    process_events(*arena);
  }
}

void StitchEngine::synchronize_events(const AllArenasLock& all) {
  ++stats_.num_sync_all_streams;
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    insert_deferred_events(*arena);
    for (const PendingEvent& p : arena->pending) {
      driver_.synchronize_event(p.event);
      event_pool_.put(p.event);
      if (--p.block->event_count == 0) free_block(*arena, p.block);
    }
    const auto n = static_cast<std::int64_t>(arena->pending.size());
    arena->pending.clear();
    arena->pending_events.fetch_sub(n, std::memory_order_relaxed);
    pending_events_.fetch_sub(n, std::memory_order_relaxed);
  }
}

// Unmaps every mapping whose pages are all dead or free, then releases the handles left
// with no live piece and no mapping. Waits for every stream whose pages it unmaps.
void StitchEngine::release_cache(const AllArenasLock& all) {
  synchronize_events(all);
  for (Arena* arena : all.arenas()) {
    all.held(*arena);
    return_kept_islands(*arena);
    bool synchronized = false;
    for (auto& spaces : arena->spaces) {
      for (auto it = spaces.begin(); it != spaces.end();) {
        Space& s = **it;
        // Pages touched by an allocated block cannot be unmapped.
        std::vector<bool> busy(s.pages.size(), false);
        for (const Block* b = s.first; b != nullptr; b = b->next) {
          if (b->kind != Block::Kind::kAllocated && b->kind != Block::Kind::kPending) continue;
          for (std::size_t p = (b->ptr - s.base) / page_;
               p < (b->end() - s.base + page_ - 1) / page_; ++p) {
            busy[p] = true;
          }
        }
        for (auto m = s.mappings.begin(); m != s.mappings.end();) {
          const std::size_t first = m->first;
          const std::size_t n = m->second.pages;
          if (std::any_of(busy.begin() + static_cast<std::ptrdiff_t>(first),
                          busy.begin() + static_cast<std::ptrdiff_t>(first + n),
                          [](bool x) { return x; })) {
            ++m;
            continue;
          }
          if (!synchronized) {
            driver_.synchronize_stream(arena->stream);
            synchronized = true;
          }
          const DevicePtr va = page_va(s, first);
          driver_.unmap(va, n * page_);
          const Origin& unmapping = OperationContext::current();
          record_trace(TraceAction::kSegmentUnmap, va, n * page_, arena->stream,
                       unmapping ? unmapping : m->second.stack);
          for (std::size_t i = 0; i < n; ++i) {
            Page& page = s.pages[first + i];
            Handle* h = page.handle;
            --h->mappings[page.piece];
            if (h->live_at[page.piece] == va + i * page_) {
              h->live_at[page.piece] = 0;
              spare_.emplace(h->id, page.piece);
            }
            page = Page{};
          }
          m = s.mappings.erase(m);
        }
        // Free pages now unmapped become void.
        for (Block* b = s.first; b != nullptr;) {
          if (b->kind != Block::Kind::kFree) {
            b = b->next;
            continue;
          }
          const DevicePtr lo = align_up(b->ptr, page_);
          const DevicePtr hi = align_down(b->end(), page_);
          DevicePtr run = 0;
          DevicePtr cut_lo = 0, cut_hi = 0;
          for (DevicePtr va = lo; va < hi; va += page_) {
            const bool unmapped = s.pages[(va - s.base) / page_].handle == nullptr;
            if (unmapped && run == 0) run = va;
            if (run != 0 && (!unmapped || va + page_ == hi)) {
              cut_lo = run;
              cut_hi = unmapped ? va + page_ : va;
              break;
            }
          }
          if (cut_hi == 0) {
            b = b->next;
            continue;
          }
          make_void(*arena, s, b, cut_lo, cut_hi);
          // Rescan from the block after the new void one.
          Block* v = s.first;
          while (v != nullptr && !(v->ptr <= cut_lo && cut_lo < v->end()))
            v = v->next;
          b = v != nullptr ? v->next : nullptr;
        }
        // Give back address space: unmapped void pages at the end, then an empty space.
        while (s.last != nullptr && s.last->kind == Block::Kind::kVoid) {
          Block* v = s.last;
          const std::size_t first = (v->ptr - s.base) / page_;
          bool all_unmapped = true;
          for (std::size_t p = first; p < s.pages.size(); ++p)
            all_unmapped = all_unmapped && s.pages[p].handle == nullptr;
          if (!all_unmapped) break;
          s.pages.resize(first);
          s.last = v->prev;
          if (s.last != nullptr) {
            s.last->next = nullptr;
          } else {
            s.first = nullptr;
          }
          delete_block(*arena, v);
        }
        if (s.first == nullptr) {
          owners_.clear(s.base, s.reserved_pages * page_);
          driver_.free_address_range(s.base, s.reserved_pages * page_);
          it = spaces.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  release_spare_handles();
}

void StitchEngine::release_spare_handles() {
  for (auto it = handles_.begin(); it != handles_.end();) {
    Handle& h = *it->second;
    const bool unused =
        std::all_of(h.live_at.begin(), h.live_at.end(), [](DevicePtr v) { return v == 0; }) &&
        std::all_of(h.mappings.begin(), h.mappings.end(), [](std::uint32_t n) { return n == 0; });
    if (!unused) {
      ++it;
      continue;
    }
    const std::size_t n = h.live_at.size();
    driver_.release_physical(h.id, n * page_);
    for (std::uint32_t i = 0; i < n; ++i)
      spare_.erase({h.id, i});
    add_reserved(h.counted_small, -static_cast<std::int64_t>(n * page_));
    ++stats_.num_device_free;
    add_segments(h.counted_small, -1);
    it = handles_.erase(it);
  }
}

std::optional<OperationContext> StitchEngine::empty_cache_context() {
  if (OperationContext::active()) return std::nullopt;
  return std::optional<OperationContext>(
      std::in_place, recorder_.capture_on_free.load(std::memory_order_relaxed) ? capture() : Origin{});
}

void StitchEngine::empty_cache() {
  // With history of every action ("all"), the unmaps carry the caller's stack, as
  // PyTorch's segment frees and unmaps do.
  const std::optional<OperationContext> context = empty_cache_context();
  if (!capturing()) {  // nothing goes back to the device during a capture
    const AllArenasLock all(*this);
    Lock device(device_mutex_);
    if (!capturing()) release_cache(all);
  }
  after_operation();
}

}  // namespace ccalloc::core
