// Islands (rule 2): the small pool grows into whole free pages of the large pool in
// place, gives them back when they are wholly free, and keeps one that bounces; and the
// small pool takes back, revived, a piece it lent (stitch/engine.hpp).
#include <algorithm>

#include "stitch/engine.hpp"
#include "stitch/tunables.hpp"

namespace ccalloc::core {

bool StitchEngine::whole_free_island(const Block* b) {
  const auto same_pool = [b](const Block* n) { return n != nullptr && n->small == b->small; };
  return b->in_island() && !same_pool(b->prev) && !same_pool(b->next);
}

StitchEngine::Block* StitchEngine::end_island_if_free(Arena& arena, Block* b) {
  if (!whole_free_island(b)) return b;
  // The small pool keeps it instead while the stream bounces one page between the pools
  // (frees it whole, then takes it back as an island, again and again: a small block freed
  // and allocated in a loop while nothing else of the small pool is free). A bounce costs
  // no memory and no driver call, but several tree operations on each side; kept, the
  // loop hits the cache. It stays the large pool's at the next large request.
  if (arena.island_bounces >= kIslandBounces && arena.pool(true).size() == 1) {
    arena.keeps_island = true;
    return b;
  }
  arena.last_returned_island = b->ptr;
  return island_to_large_pool(arena, b);
}

StitchEngine::Block* StitchEngine::island_to_large_pool(Arena& arena, Block* b) {
  arena.pool(true).erase(b);
  b->small = b->space->small;
  return pool_free(arena, b);  // merged with the large free blocks around it
}

bool StitchEngine::kept_island_stays(Arena& arena, Pool::iterator pos, std::size_t rounded) {
  Pool& large = arena.pool(false);
  Pool& small = arena.pool(true);
  if (pos == large.end() || small.size() != 1) return false;
  const Block* kept = *small.begin();
  if (!whole_free_island(kept)) return false;
  const auto free_large = [](Block* n) {
    return n != nullptr && n->kind == Block::Kind::kFree && !n->small ? n : nullptr;
  };
  const Block* prev = free_large(kept->prev);
  const Block* next = free_large(kept->next);
  // Returned, the island would merge with its free neighbours into one block at `start`.
  const std::size_t merged = kept->size + (prev ? prev->size : 0) + (next ? next->size : 0);
  const DevicePtr start = prev != nullptr ? prev->ptr : kept->ptr;
  auto other = pos;  // the best fit among the blocks the return leaves as they are
  while (other != large.end() && (*other == prev || *other == next))
    ++other;
  const bool merged_wins =
      merged >= rounded &&
      (other == large.end() || BySizeThenAddress{}(BySizeThenAddress::Key{merged, start}, *other));
  if (!merged_wins) return other == pos;
  // The merged block's front is the free neighbour below's: the request lands there when
  // that neighbour is the best fit, and its block is as long when the rest splits off.
  const std::size_t rest = (*pos)->size - rounded;
  return *pos == prev && (rest == 0 || rest >= kMinBlockSize);
}

void StitchEngine::return_kept_islands(Arena& arena) {
  if (!arena.keeps_island) return;
  arena.keeps_island = false;
  arena.island_bounces = 0;
  Pool& small = arena.pool(true);
  for (auto it = small.begin(); it != small.end();) {
    Block* b = *it;
    ++it;
    if (whole_free_island(b)) island_to_large_pool(arena, b);
  }
}

StitchEngine::Block* StitchEngine::revive_small_piece(Arena& arena) {
  // The candidates as growth would lend them: smallest large free block first, then by
  // address; the large space's last block included (it is not the growing space's tail).
  for (Block* b : arena.pool(false)) {
    Handle* h = nullptr;
    DevicePtr from = 0, at = 0;
    Space* small_space = nullptr;
    find_whole_handle(*b, [&](DevicePtr va, Handle* candidate) {
      arena.mutex.assert_held();  // the analysis does not carry the caller's locks into a lambda
      device_mutex_.assert_held();
      if (!candidate->small || candidate->live_at.size() != 1 || candidate->mappings[0] < 2) {
        return false;
      }
      // The small page that still maps it, dead there.
      for (const auto& space : arena.spaces[1]) {
        for (const auto& [first, m] : space->mappings) {
          if (m.handle != candidate) continue;
          h = candidate;
          from = va;
          at = page_va(*space, first);
          small_space = space.get();
          return true;
        }
      }
      return false;
    });
    if (h == nullptr) continue;
    const std::uint64_t stamp = stamp_of(*b->space, from, 1);  // its latest uses are there
    make_void(arena, *b->space, b, from, from + page_);  // b may be split or absorbed
    Block* v = small_space->first;
    while (v->end() <= at)
      v = v->next;
    // v is the void block holding the page: split the page out and free it.
    if (v->ptr < at) split_off_front(arena, v, at - v->ptr);
    if (v->end() > at + page_) v = split_off_front(arena, v, page_);
    v->kind = Block::Kind::kFree;
    h->live_at[0] = at;
    Page& revived = small_space->pages[(at - small_space->base) / page_];
    revived.freed = std::max(revived.freed, stamp);
    move_handle_stats(*h, true);
    return pool_free(arena, v);
  }
  return nullptr;
}

// Islands: the small pool grows into a whole free page of the large pool's free blocks in
// place, with no driver call (see grow()).
StitchEngine::Block* StitchEngine::take_island(Arena& arena) {
  // The smallest large free block first (as lending goes); its first whole page. A space's
  // free tail, which the next large growth extends, only once the stream has settled and
  // the tail would still hold the largest block its large pool has handed out.
  Pool& large = arena.pool(false);
  for (Block* b : large) {
    if (b->next == nullptr && (b->size < arena.largest_large + page_ || !settled(arena))) {
      continue;
    }
    const DevicePtr lo = align_up(b->ptr, page_);
    if (lo + page_ > b->end()) continue;
    large.erase(b);  // returns before the loop goes on
    Block* island = b;
    if (lo > b->ptr) large.insert(split_off_front(arena, b, lo - b->ptr));
    if (island->size > page_) {
      Block* page = split_off_front(arena, island, page_);
      large.insert(island);
      island = page;
    }
    island->small = true;
    if (island->ptr == arena.last_returned_island) {
      ++arena.island_bounces;
    } else {
      arena.island_bounces = 0;
    }
    // Merged with the free end of an island just below; handed out at once.
    return pool_free(arena, island, /*keep_island=*/true);
  }
  return nullptr;
}

}  // namespace ccalloc::core
