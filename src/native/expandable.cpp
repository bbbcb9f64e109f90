#include "native/expandable.hpp"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "native/engine.hpp"
#include "native/arena.hpp"
#include "core/arena_engine.hpp"
#include "core/rounding.hpp"

namespace ccalloc::core {

namespace {

// Joins b's previous neighbour, already out of its pool, into b: b starts where it started
// and keeps its segment stack (the stack of the mapping that began the range).
void absorb_prev(Arena& arena, Block* b) REQUIRES(arena.mutex) {
  Block* p = b->prev;
  b->ptr = p->ptr;
  b->size += p->size;
  b->prev = p->prev;
  if (b->prev != nullptr) b->prev->next = b;
  if (p->segment_stack) b->segment_stack = std::move(p->segment_stack);
  arena.blocks.recycle(p);
}

// Joins b's next neighbour, already out of its pool, into b.
void absorb_next(Arena& arena, Block* b) REQUIRES(arena.mutex) {
  Block* n = b->next;
  b->size += n->size;
  b->next = n->next;
  if (b->next != nullptr) b->next->prev = b;
  arena.blocks.recycle(n);
}

// Links the new block `f` into the segment's list right after b.
void link_after(Block* b, Block* f) {
  f->prev = b;
  f->next = b->next;
  if (f->next != nullptr) f->next->prev = f;
  b->next = f;
}

}  // namespace

ExpandableSegment::ExpandableSegment(Driver& driver, Arena* arena, bool small, std::size_t page,
                                     std::size_t reserve)
    : driver_(driver), arena_(arena), small_(small), page_(page) {
  const std::size_t pages = (reserve + page - 1) / page;
  base_ = driver_.reserve_address_range(pages * page);
  pages_.assign(pages, 0);
}

ExpandableSegment::~ExpandableSegment() {
  for (std::size_t i = 0; i < pages_.size(); ++i) {
    if (pages_[i] != 0) {
      driver_.unmap(base_ + i * page_, page_);
      driver_.release_physical(pages_[i], page_);
    }
  }
  driver_.free_address_range(base_, size());
}

Range ExpandableSegment::map(Range r) {
  const std::size_t begin = (r.ptr - base_) / page_;
  const std::size_t end = (r.ptr + r.size - base_ + page_ - 1) / page_;
  std::vector<PhysicalHandle> created;
  for (std::size_t i = begin; i < end; ++i) {
    const PhysicalHandle h = driver_.create_physical(page_);
    if (h == 0) {
      for (const PhysicalHandle c : created)
        driver_.release_physical(c, page_);
      return Range{r.ptr, 0};
    }
    created.push_back(h);
  }
  for (std::size_t i = begin; i < end; ++i) {
    pages_[i] = created[i - begin];
    driver_.map(base_ + i * page_, page_, pages_[i]);
  }
  mapped_bytes_ += (end - begin) * page_;
  return Range{base_ + begin * page_, (end - begin) * page_};
}

Range ExpandableSegment::unmap(Range r) {
  const std::size_t begin = (r.ptr - base_ + page_ - 1) / page_;
  const std::size_t end = (r.ptr + r.size - base_) / page_;
  if (begin >= end) return Range{r.ptr, 0};
  driver_.synchronize_stream(arena_->stream);
  for (std::size_t i = begin; i < end; ++i) {
    driver_.unmap(base_ + i * page_, page_);
    driver_.release_physical(pages_[i], page_);
    pages_[i] = 0;
  }
  mapped_bytes_ -= (end - begin) * page_;
  return Range{base_ + begin * page_, (end - begin) * page_};
}

DevicePtr ExpandableSegment::pages_covering(Range r, std::vector<PhysicalHandle>& handles) const {
  const std::size_t begin = (r.ptr - base_) / page_;
  const std::size_t end = (r.ptr + r.size - base_ + page_ - 1) / page_;
  handles.assign(pages_.begin() + static_cast<std::ptrdiff_t>(begin),
                 pages_.begin() + static_cast<std::ptrdiff_t>(end));
  return base_ + begin * page_;
}

// ---------------------------------------------------------------------------------------
// The engine's side: finding room in a segment, mapping and unmapping blocks.

std::size_t Engine::expandable_reserve_bytes() const {
  // PyTorch reserves 9/8 of device memory per segment; a smaller reserve is configurable.
  const std::size_t full = capacity_ + capacity_ / 8;
  const std::size_t asked =
      config_.expandable_segments_reserve_bytes != 0
          ? config_.expandable_segments_reserve_bytes
          : static_cast<std::size_t>(config_.expandable_segments_reserve_fraction *
                                     static_cast<double>(capacity_));
  return asked == 0 ? full : std::min(asked, full);
}

// The block at which `size` bytes can start: the lowest unmapped range (or the free block
// just before it) followed by enough free or unmapped space; else a new segment's range.
Block* Engine::find_expandable_block(Arena& arena, FreePool& pool, std::size_t size) {
  const auto allocatable = [](const Block* b) {
    return b != nullptr && !b->allocated && b->event_count == 0 && b->stream_uses.empty();
  };
  for (Block* c : pool.unmapped) {
    if (allocatable(c->prev)) c = c->prev;
    std::size_t room = 0;
    for (const Block* b = c; room < size && allocatable(b); b = b->next)
      room += b->size;
    if (room >= size) return c;
  }
  const std::size_t page = pool.is_small             ? kSmallBuffer
                           : expandable_large_page_ != 0 ? expandable_large_page_
                                                         : config_.large_segment_size;
  arena.expandable.push_back(std::make_unique<ExpandableSegment>(driver_, &arena, pool.is_small,
                                                                 page, expandable_reserve_bytes()));
  const ExpandableSegment& seg = *arena.expandable.back();
  if (arena.pool != nullptr) arena.pool->segments.fetch_add(1, std::memory_order_relaxed);
  Block* b = arena.blocks.make();
  b->ptr = seg.base();
  b->size = seg.size();
  b->pool = &pool;
  b->segment = arena.expandable.back().get();
  b->mapped = false;
  pool.unmapped.insert(b);
  return b;
}

// Maps the pages under the first `size` bytes of the unmapped `b`, merges the mapped part
// with free neighbours and puts it in the pool. False when the device is out of memory.
bool Engine::map_block(Arena& arena, Block* b, std::size_t size) {
  FreePool& pool = *b->pool;
  const Range r = b->segment->map(Range{b->ptr, size});
  if (r.size == 0) return false;
  pool.unmapped.erase(b);
  b->mapped = true;
  if (r.size < b->size) {  // the rest stays unmapped: b -> remaining -> b->next
    Block* remaining = arena.blocks.make();
    remaining->ptr = b->ptr + r.size;
    remaining->size = b->size - r.size;
    remaining->pool = &pool;
    remaining->segment = b->segment;
    remaining->mapped = false;
    link_after(b, remaining);
    b->size = r.size;
    pool.unmapped.insert(remaining);
  }
  {
    Lock lock(device_mutex_);
    reserved_ += r.size;
    add_reserved_bytes(pool.is_small, static_cast<std::int64_t>(r.size));
    ++device_stats_.num_device_alloc;
    owners_.assign(r.ptr, r.size, arena.owner);
  }
  merge_mapped_neighbours(arena, b);
  if (b->prev == nullptr && !b->segment_stack &&
      (trace_flags_.load(std::memory_order_relaxed) & kStacksOnBlocks)) {
    b->segment_stack = OperationContext::current();
  }
  record_trace(TraceAction::kSegmentMap, r.ptr, r.size, arena.stream, b);
  insert_into_pool(pool, b);
  return true;
}

// Merges the free mapped block `b` (in no pool) with its free mapped neighbours, which
// leave the pool.
void Engine::merge_mapped_neighbours(Arena& arena, Block* b) {
  const auto free_mapped = [](const Block* n) {
    return n != nullptr && n->mapped && !n->allocated && n->event_count == 0 &&
           n->stream_uses.empty();  // a deferred free still has its stream uses
  };
  if (free_mapped(b->prev)) {
    b->prev->pool->blocks.erase(b->prev);
    absorb_prev(arena, b);
  }
  if (free_mapped(b->next)) {
    b->next->pool->blocks.erase(b->next);
    absorb_next(arena, b);
  }
}

// try_allocate_expandable_block: room for req.size bytes, mapped, out of the pool; nullptr
// when the device cannot back it.
Block* Engine::allocate_expandable(Arena& arena, const Request& req) {
  FreePool& pool = arena.pool_for(req.small);
  Block* c = find_expandable_block(arena, pool, req.size);
  if (!c->mapped && !map_block(arena, c, std::min(c->size, req.size))) return nullptr;
  // Now: free -> unmapped -> ...: map the unmapped part until the free block is big enough.
  while (c->size < req.size) {
    Block* next = c->next;
    if (!map_block(arena, next, std::min(req.size - c->size, next->size))) return nullptr;
    c = next;  // map_block merged c into `next`
  }
  pool.blocks.erase(c);
  return c;
}

// Unmaps the whole pages inside the free mapped block `b`; the partial pages at its edges
// stay mapped as free blocks. Returns the block now covering the unmapped range, or
// nullptr if nothing was unmapped.
Block* Engine::unmap_block(Arena& arena, Block* b) {
  if (capturing()) {
    throw Error("ccalloc internal error: pages would be unmapped while a capture is underway");
  }
  FreePool& pool = *b->pool;
  const Range r = b->segment->unmap(Range{b->ptr, b->size});
  if (r.size == 0) return nullptr;
  pool.blocks.erase(b);
  const std::size_t before = r.ptr - b->ptr;
  if (before > 0) {  // prev -> before_free -> b
    Block* f = arena.blocks.make();
    f->ptr = b->ptr;
    f->size = before;
    f->pool = &pool;
    f->segment = b->segment;
    f->prev = b->prev;
    f->next = b;
    if (f->prev != nullptr) f->prev->next = f;
    b->prev = f;
    f->segment_stack = std::exchange(b->segment_stack, {});
    insert_into_pool(pool, f);
  }
  const std::size_t after = b->size - before - r.size;
  if (after > 0) {  // b -> after_free -> next
    Block* f = arena.blocks.make();
    f->ptr = r.ptr + r.size;
    f->size = after;
    f->pool = &pool;
    f->segment = b->segment;
    link_after(b, f);
    insert_into_pool(pool, f);
  }
  b->ptr = r.ptr;
  b->size = r.size;
  b->mapped = false;
  {
    Lock lock(device_mutex_);
    reserved_ -= r.size;
    add_reserved_bytes(pool.is_small, -static_cast<std::int64_t>(r.size));
    ++device_stats_.num_device_free;
    owners_.clear(r.ptr, r.size);
  }
  record_trace(TraceAction::kSegmentUnmap, r.ptr, r.size, arena.stream, b);
  // An unmapped range holds no memory and reports no segment: it keeps no context either
  // (a later mapping at the head takes the mapping operation's).
  b->segment_stack = {};
  // Merge with unmapped neighbours.
  if (b->prev != nullptr && !b->prev->mapped) {
    pool.unmapped.erase(b->prev);
    absorb_prev(arena, b);
  }
  if (b->next != nullptr && !b->next->mapped) {
    pool.unmapped.erase(b->next);
    absorb_next(arena, b);
  }
  pool.unmapped.insert(b);
  return b;
}

// Frees a segment whose whole range is unmapped (`b`, its only block).
void Engine::release_expandable_segment(Arena& arena, Block* b) {
  b->pool->unmapped.erase(b);
  const ExpandableSegment* seg = b->segment;
  arena.blocks.recycle(b);
  std::erase_if(arena.expandable, [seg](const auto& s) { return s.get() == seg; });
  if (arena.pool != nullptr) arena.pool->segments.fetch_sub(1, std::memory_order_relaxed);
}

// A native segment is shared whole (cudaIpcGetMemHandle takes the start of a cudaMalloc
// range); an expandable one as the pages under the block, which stay mapped while the block
// is live (a page is unmapped only when wholly free).
ipc::SharedRegion Engine::shared_region(DevicePtr ptr) const {
  // Under the arena's lock.
  const auto region_of = [&](const Arena* arena, const Block* b) {
    arena->mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
    if (arena->pool != nullptr && arena->pool->sleepable) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(ptr));
      throw Error(std::string("ccalloc: sharing ") + buf + ": it lies in sleepable pool " +
                  to_string(arena->pool->id) +
                  ", whose memory may be released while another process maps it; allocations "
                  "of sleepable pools cannot be shared");
    }
    ipc::SharedRegion region;
    region.allocation = b->ptr;
    region.allocation_size = b->size;
    if (b->segment == nullptr) {
      const Block* head = b;
      while (head->prev != nullptr) head = head->prev;
      region.kind = ipc::RegionKind::kSegment;
      region.base = head->ptr;
      for (const Block* x = head; x != nullptr; x = x->next)
        region.size += x->size;
      return region;
    }
    region.kind = ipc::RegionKind::kPages;
    region.page_size = b->segment->page();
    region.base = b->segment->pages_covering(Range{b->ptr, b->size}, region.pages);
    region.size = region.pages.size() * region.page_size;
    return region;
  };
  return ArenaEngine::with_live_block(*this, ptr, "sharing", region_of);
}

}  // namespace ccalloc::core
