// Blocks of the stitching policy outside the hit: the best-fit search of the slow paths,
// turning free pages void, the arena's spare blocks at its end (stitch/engine.hpp).
// Splitting, handing out, freeing into the pools with their merges: hot_path.hpp.
#include <algorithm>

#include "core/rounding.hpp"
#include "stitch/engine.hpp"

namespace ccalloc::core {

StitchEngine::Arena::~Arena() {
  while (spare_blocks != nullptr) {
    Block* b = spare_blocks;
    spare_blocks = b->next;
    b->~Block();
    block_nodes.give_back(b, sizeof(Block), alignof(Block));
  }
}

void StitchEngine::unpark(Arena& arena) {
  Block* const b = arena.parked;
  arena.parked = nullptr;
  arena.live.erase(b->ptr);
  const StatType t = pool_stat(b->small);  // the release its park left uncounted
  count_release(arena, *b, t);
  count_inactive(arena, *b, t);
  b->kind = Block::Kind::kFree;  // its pages were stamped when it was parked
  pool_free(arena, b);
}

StitchEngine::Block* StitchEngine::find_free(Arena& arena, bool small, std::size_t size) {
  Pool& pool = arena.pool(small);
  const auto it = pool.lower_bound(BySizeThenAddress::Key{size, 0});
  return it == pool.end() ? nullptr : *it;
}

// Turns the page-aligned [lo, hi), covered by free and void blocks starting with `from`
// (which contains lo), into one void block; the free parts outside it stay in the pool.
void StitchEngine::make_void(Arena& arena, Space& s, Block* from, DevicePtr lo, DevicePtr hi) {
  Block* first_void = nullptr;
  for (Block* b = from; b != nullptr && b->ptr < hi;) {
    Block* next = b->next;
    if (b->kind == Block::Kind::kFree) {
      Pool& pool = arena.pool(b->small);
      pool.erase(b);
      if (b->ptr < lo) pool.insert(split_off_front(arena, b, lo - b->ptr));
      if (b->end() > hi) {
        Block* mid = split_off_front(arena, b, hi - b->ptr);
        pool.insert(b);
        b = mid;
      }
      b->kind = Block::Kind::kVoid;
      b->small = s.small;
    }
    if (first_void == nullptr) first_void = b;
    b = next;
  }
  if (first_void != nullptr) merge_void_around(arena, s, first_void);
}

void StitchEngine::merge_void_around(Arena& arena, Space& s, Block* b) {
  while (b->prev != nullptr && b->prev->kind == Block::Kind::kVoid) {
    Block* p = b->prev;
    b->ptr = p->ptr;
    b->size += p->size;
    b->prev = p->prev;
    if (b->prev != nullptr) {
      b->prev->next = b;
    } else {
      s.first = b;
    }
    delete_block(arena, p);
  }
  while (b->next != nullptr && b->next->kind == Block::Kind::kVoid) {
    Block* n = b->next;
    b->size += n->size;
    b->next = n->next;
    if (b->next != nullptr) {
      b->next->prev = b;
    } else {
      s.last = b;
    }
    delete_block(arena, n);
  }
}

}  // namespace ccalloc::core
