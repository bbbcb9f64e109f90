// Growth (rule 3): spare handles, then the stream's own free pages, then other streams'
// (share.cpp), then new memory, mapped whole at the frontier (stitch/engine.hpp).
#include <algorithm>

#include "stitch/engine.hpp"
#include "stitch/tunables.hpp"

namespace ccalloc::core {

// ---------------------------------------------------------------------------------------
// Growth: spare pieces, then lent pages, then new memory

bool StitchEngine::settled(const Arena& arena) const {
  std::size_t frontier = 0;  // bytes of the stream's large spaces below their frontiers
  for (const auto& space : arena.spaces[0])
    frontier += space->pages.size() * page_;
  return arena.large_served > frontier;
}

// A handle moves and is released only whole: a live block anywhere in it keeps all its
// pieces where they are, neither lendable nor releasable. Large handles keep creations and
// mappings few while the device has room; near the limit the pieces they strand are what
// runs it out of memory. So a growth's handles are at most 1/kHandleRoomDivisor of the room
// left under the limit: 64 MiB while 128 GiB or more are free, 16 MiB with 32 GiB free, and
// single 2 MiB pieces, each lendable and releasable alone, in the last 8 GiB. A size set
// in the configuration (stitch_handle_mb) takes precedence.
std::size_t StitchEngine::handle_cap() const {
  if (config_.stitch_handle_size != 0)
    return std::max<std::size_t>(1, config_.stitch_handle_size / page_);
  const std::size_t room = limit() > held() ? limit() - held() : 0;
  return std::clamp<std::size_t>(room / kHandleRoomDivisor / page_, 1, kMaxHandlePieces);
}

std::size_t StitchEngine::least_large_growth(const Arena& arena) const {
  if (!settled(arena)) return chunk_pieces_;
  const std::size_t reserved = reserved_;
  return std::clamp<std::size_t>(reserved / kSettledExtraDivisor / page_, 1, chunk_pieces_);
}

StitchEngine::Space& StitchEngine::new_space(Arena& arena, bool small) {
  auto s = std::make_unique<Space>();
  s->arena = &arena;
  s->small = small;
  s->reserved_pages = space_pages_;
  s->base = driver_.reserve_address_range(space_pages_ * page_);
  owners_.assign(s->base, space_pages_ * page_, arena.owner);  // free finds the arena here
  arena.spaces[small ? 1 : 0].push_back(std::move(s));
  return *arena.spaces[small ? 1 : 0].back();
}

StitchEngine::Grow StitchEngine::grow(Arena& arena, bool small, std::size_t size, bool gc_allowed,
                                      Block** out, bool try_island, const AllArenasLock* all) {
  if (!small && arena.keeps_island) {
    return_kept_islands(arena);
    if (Block* b = find_free(arena, false, size)) {
      *out = b;
      return Grow::kDone;
    }
  }
  if (small) {
    if (Block* island = try_island ? take_island(arena) : nullptr) {
      *out = island;
      return Grow::kDone;
    }
    if (Block* revived = revive_small_piece(arena)) {
      *out = revived;
      return Grow::kDone;
    }
  }
  auto& spaces = arena.spaces[small ? 1 : 0];
  Space* s = spaces.empty() ? nullptr : spaces.back().get();
  Block* tail = s != nullptr && s->last != nullptr && s->last->kind == Block::Kind::kFree &&
                        s->last->small == small
                    ? s->last
                    : nullptr;
  bool fresh = s == nullptr;
  std::size_t pages = 0;

  // Plan without changing anything, so that running out of memory leaves all as it was.
  // CUDA maps a handle only whole, so the frontier receives whole handles: spare ones, then
  // lent ones, then new ones. Whole handles may pass what the request lacks; the rest
  // extends the new free block.
  std::vector<Handle*> from_spare;
  std::vector<Lend> lends;
  std::size_t have = 0;  // pages of the spare and lent handles
  const auto pieces_of = [](const Handle* h) { return h->live_at.size(); };
  const auto plan = [&] {
    arena.mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
    device_mutex_.assert_held();
    from_spare.clear();
    lends.clear();
    have = 0;
    for (auto it = spare_.begin(); it != spare_.end() && have < pages; ++it) {
      if (it->second != 0) continue;  // a handle is spare whole: name it once
      Handle* h = handles_.at(it->first).get();
      from_spare.push_back(h);
      have += pieces_of(h);
    }
    if (have >= pages) return;
    // Handles live wholly inside the whole pages of one free block of the stream: any
    // handle of the pool's own free blocks; from the other pool, the large pool takes any
    // (a small page freed whole joins a large range) and the small pool only the one-piece
    // handles that its own growth created (they come back; a large handle of up to 64 MiB
    // would sit in a small space behind blocks of at most 256 KiB).
    std::vector<Lend> candidates;
    for (const Pool& pool : arena.pools) {
      const bool other = &pool != &arena.pool(small);
      for (Block* b : pool) {
        if (b == tail || b->in_island()) continue;
        find_whole_handle(*b, [&](DevicePtr va, Handle* h) {
          if (!other || !small || (h->small && pieces_of(h) == 1)) {
            candidates.push_back(Lend{h, b, va});
          }
          return false;
        });
      }
    }
    // The smallest free blocks are the least useful to keep whole.
    std::sort(candidates.begin(), candidates.end(), [](const Lend& x, const Lend& y) {
      if (x.block != y.block) return BySizeThenAddress{}(x.block, y.block);
      return x.lo < y.lo;
    });
    for (const Lend& l : candidates) {
      if (have >= pages) break;
      lends.push_back(l);
      have += pieces_of(l.handle);
    }
  };
  // Other streams' arenas whose free pages this growth may take (plan_borrow), locked until
  // it returns.
  std::vector<std::unique_lock<ArenaMutex>> donors;
  std::size_t lacking = 0, created = 0;
  for (;;) {
    if (fresh) tail = nullptr;
    pages = align_up(size - (tail != nullptr ? tail->size : 0), page_) / page_;
    if (fresh && pages > space_pages_) return Grow::kOutOfMemory;  // more than twice the device
    if (!fresh && s->pages.size() + pages > s->reserved_pages) {
      fresh = true;
      continue;
    }
    plan();
    lacking = have < pages ? pages - have : 0;
    // A move between the pools is made only where the moves spare creating memory
    // altogether: when memory is created anyway, the other pool's pages stay where they are
    // (each move costs a map, and the pool that gave them would create them again).
    if (lacking > 0) {
      std::erase_if(lends, [&](const Lend& l) {
        if (l.block->space->small == small) return false;
        have -= pieces_of(l.handle);
        return true;
      });
      lacking = pages - have;
    }
    // Then other streams' free pages whose uses are all done, where they spare creating.
    if (lacking > 0) {
      const std::size_t least = small ? 0 : least_large_growth(arena);
      have += plan_borrow(arena, small, lacking, least, all, donors, lends);
      lacking = have < pages ? pages - have : 0;
    }
    created = 0;
    if (lacking > 0) {
      // Large growth creates at least a chunk (large_segment_size), so that creations and
      // mappings stay as few as expandable segments' (one per 20 MiB page); the small pool
      // and a chunk that would not fit the limit create exactly what is lacking. A stream
      // that has handed out its large range's bytes again since the pool's last creation
      // has settled: growth is rare from then on and each one may set the peak, so what
      // it creates beyond its need is also held to 1/64 of the reserved bytes (which on
      // a device's worth of memory is more than the chunk and changes nothing).
      const std::size_t chunk =
          small ? lacking : std::max(lacking, least_large_growth(arena));
      for (const std::size_t tried : {chunk, lacking}) {
        if (tried * page_ > limit() || held() > limit() - tried * page_) continue;
        created = tried;
        break;
      }
    }
    const std::size_t room = fresh ? space_pages_ : s->reserved_pages - s->pages.size();
    if (have + std::max(created, lacking) <= room || fresh) break;
    fresh = true;  // the whole handles would pass the reservation: start a new space
  }
  if (lacking > 0) {
    const std::size_t bytes = lacking * page_;
    if (gc_allowed && config_.garbage_collection_threshold > 0.0 &&
        static_cast<double>(held() + bytes) >
            config_.garbage_collection_threshold * static_cast<double>(limit())) {
      return Grow::kNeedsGc;
    }
    if (created == 0) return Grow::kOutOfMemory;
  }
  if (have + created > (fresh ? space_pages_ : s->reserved_pages - s->pages.size())) {
    return Grow::kOutOfMemory;
  }
  // New memory in handles of at most handle_cap() pieces: large enough that creating and
  // mapping stay cheap, small enough that the free pages of a large freed block hold whole
  // handles that can be lent, and that a handle partly in use strands little of the limit.
  const std::size_t cap = handle_cap();
  std::vector<std::size_t> sizes;
  std::vector<PhysicalHandle> ids;
  const auto create_all = [&](std::size_t n) {
    sizes.clear();
    ids.clear();
    for (std::size_t left = n; left > 0;) {
      const std::size_t k = std::min(left, cap);
      const PhysicalHandle id = driver_.create_physical(k * page_);
      if (id == 0) {
        for (std::size_t j = 0; j < ids.size(); ++j)
          driver_.release_physical(ids[j], sizes[j] * page_);
        sizes.clear();
        ids.clear();
        return false;
      }
      sizes.push_back(k);
      ids.push_back(id);
      left -= k;
    }
    return true;
  };
  if (created > 0 && !create_all(created)) {
    if (created == lacking || !create_all(lacking)) return Grow::kOutOfMemory;
    created = lacking;
  }

  // Commit.
  if (fresh) s = &new_space(arena, small);
  std::vector<Handle*> order;  // as mapped at the frontier
  // The stamp each one's pages take there (Arena::epoch): a handle moved within the
  // stream keeps its pages' latest; one with its uses done (spare, new, another stream's
  // behind a completed fence) comes with none. Another stream's handle taken behind a wait
  // (plan_borrow) takes this stream's epoch: its uses there are done only once this
  // stream has passed the wait, so a third stream may take it only behind this stream's
  // next fence.
  std::vector<std::uint64_t> stamps;
  for (Handle* h : from_spare) {
    for (std::uint32_t i = 0; i < pieces_of(h); ++i)
      spare_.erase({h->id, i});
    order.push_back(h);
    stamps.push_back(0);
  }
  // In address order, so that each lend's block still starts at or below its range:
  // make_void keeps the block object for the free part above the voided range.
  std::sort(lends.begin(), lends.end(), [](const Lend& x, const Lend& y) { return x.lo < y.lo; });
  for (const Lend& l : lends) {
    Arena& owner = *l.block->space->arena;
    owner.mutex.assert_held();  // this arena's, or a donor's (plan_borrow)
    const std::size_t n = pieces_of(l.handle);
    const std::uint64_t stamp = stamp_of(*l.block->space, l.lo, n);
    if (&owner == &arena) {
      stamps.push_back(stamp);
    } else if (stamp > owner.safe_epoch) {
      stamps.push_back(arena.epoch);
      arena.unfenced = true;
    } else {
      stamps.push_back(0);
    }
    if (&owner != &arena) {
      ++borrowed_handles_;
      borrowed_pieces_ += n;
    }
    make_void(owner, *l.block->space, l.block, l.lo, l.lo + n * page_);
    order.push_back(l.handle);
  }
  for (std::size_t j = 0; j < ids.size(); ++j) {
    auto h = std::make_unique<Handle>();
    h->id = ids[j];
    h->small = small;
    h->counted_small = small;
    h->live_at.assign(sizes[j], 0);
    h->mappings.assign(sizes[j], 0);
    order.push_back(h.get());
    stamps.push_back(0);
    handles_.emplace(ids[j], std::move(h));
  }
  if (created > 0) {
    if (!small) arena.large_served = 0;
    add_reserved(small, static_cast<std::int64_t>(created * page_));
    stats_.num_device_alloc += ids.size();
    add_segments(small, static_cast<std::int64_t>(ids.size()));
  }
  // One map_range per handle, each whole.
  const std::size_t start = s->pages.size();
  const std::size_t mapped = have + created;
  s->pages.resize(start + mapped);
  std::size_t k = 0;
  for (std::size_t j = 0; j < order.size(); ++j) {
    Handle* h = order[j];
    const std::size_t len = pieces_of(h);
    const DevicePtr va = page_va(*s, start + k);
    driver_.map_range(va, len * page_, h->id, 0);
    s->mappings.emplace(start + k, Mapping{len, h, 0, OperationContext::current()});
    move_handle_stats(*h, small);
    for (std::uint32_t i = 0; i < len; ++i) {
      h->live_at[i] = va + i * page_;
      ++h->mappings[i];
      s->pages[start + k + i] = Page{h, i, stamps[j]};
    }
    record_trace(TraceAction::kSegmentMap, va, len * page_, arena.stream,
                 OperationContext::current());
    k += len;
  }
  Pool& pool = arena.pool(small);
  if (tail != nullptr) {
    pool.erase(tail);
    tail->size += mapped * page_;
    pool.insert(tail);
    *out = tail;
  } else {
    Block* b = new_block(arena);
    b->ptr = page_va(*s, start);
    b->size = mapped * page_;
    b->space = s;
    b->small = small;
    b->prev = s->last;
    if (s->last != nullptr) {
      s->last->next = b;
    } else {
      s->first = b;
    }
    s->last = b;
    pool.insert(b);
    *out = b;
  }
  return Grow::kDone;
}

void StitchEngine::add_reserved(bool small, std::int64_t bytes) {
  reserved_ = static_cast<std::size_t>(static_cast<std::int64_t>(reserved_) + bytes);
  add_pool_stat(stats_.reserved_bytes, small, bytes);
  if (device_reserved_ != nullptr) device_reserved_->add(small, bytes);
}

void StitchEngine::move_handle_stats(Handle& h, bool to_small) {
  if (h.counted_small == to_small) return;
  h.counted_small = to_small;
  const auto bytes = static_cast<std::int64_t>(h.live_at.size() * page_);
  move_pool_stat(stats_.reserved_bytes, to_small, bytes);
  move_pool_stat(stats_.segment, to_small, 1);
  if (device_reserved_ != nullptr) device_reserved_->move(to_small, bytes, 1);
}

void StitchEngine::add_segments(bool small, std::int64_t n) {
  add_pool_stat(stats_.segment, small, n);
  if (device_reserved_ != nullptr) device_reserved_->add_segments(small, n);
}

}  // namespace ccalloc::core
