// Blocks and free pools.
//
// A segment is one device allocation. Its blocks tile it exactly, in address order, linked
// through prev/next; the first block has prev == nullptr and the last next == nullptr. A
// block is in exactly one of three places:
//   allocated            -> in the allocator's active-block index (allocated == true)
//   pending free         -> waiting for events (allocated == false, event_count > 0)
//   free                 -> in its FreePool (allocated == false, event_count == 0)
// and two free neighbours never coexist: they merge when the second one is freed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <set>
#include <vector>

#include "ccalloc/driver.hpp"
#include "sync/cache_line.hpp"
#include "history/stacks.hpp"

namespace ccalloc::core {

struct Arena;
struct FreePool;
class ExpandableSegment;

// A fixed-size node recycler for the standard containers on the hot path: nodes freed by a
// container are kept and handed back to it, so steady-state insert/erase never reach the
// system allocator. Requests for more than one object (hash bucket arrays) pass through.
class NodeRecycler {
 public:
  NodeRecycler() = default;
  NodeRecycler(const NodeRecycler&) = delete;
  NodeRecycler& operator=(const NodeRecycler&) = delete;
  ~NodeRecycler();

  // Inline: a split or merge on the hot path takes or gives back a node.
  void* take(std::size_t bytes, std::size_t align) {
    if (free_ != nullptr && bytes == node_bytes_ && align == node_align_) [[likely]] {
      FreeNode* n = free_;
      free_ = n->next;
      return n;
    }
    return take_new(bytes, align);
  }
  void give_back(void* node, std::size_t bytes, std::size_t align) {
    if (bytes == node_bytes_ && align == node_align_) [[likely]] {
      auto* n = static_cast<FreeNode*>(node);
      n->next = free_;
      free_ = n;
      return;
    }
    give_back_other(node, bytes, align);
  }

 private:
  void* take_new(std::size_t bytes, std::size_t align);
  void give_back_other(void* node, std::size_t bytes, std::size_t align);

  struct FreeNode {
    FreeNode* next;
  };
  // A node as kept here (room for the free list's link), and its storage's alignment: whole
  // cache lines (sync/cache_line.hpp), as nodes are written on every hit and another arena's
  // must not share their lines.
  static std::size_t node_size(std::size_t bytes) { return std::max(bytes, sizeof(FreeNode)); }
  static std::size_t node_alignment(std::size_t align) {
    return std::max(align, alignof(FreeNode));
  }
  static std::align_val_t storage_alignment(std::size_t node_align) {
    return std::align_val_t{std::max(node_align, kCacheLine)};
  }
  FreeNode* free_ = nullptr;
  std::size_t node_bytes_ = 0;  // the one node size this recycler serves
  std::size_t node_align_ = 0;
};

template <typename T>
struct RecyclingAllocator {
  using value_type = T;
  NodeRecycler* recycler;

  explicit RecyclingAllocator(NodeRecycler* r) : recycler(r) {}
  template <typename U>
  RecyclingAllocator(const RecyclingAllocator<U>& o) : recycler(o.recycler) {}  // NOLINT

  T* allocate(std::size_t n) {
    if (n != 1) return std::allocator<T>().allocate(n);
    return static_cast<T*>(recycler->take(sizeof(T), alignof(T)));
  }
  void deallocate(T* p, std::size_t n) {
    if (n != 1) return std::allocator<T>().deallocate(p, n);
    recycler->give_back(p, sizeof(T), alignof(T));
  }
  template <typename U>
  bool operator==(const RecyclingAllocator<U>& o) const {
    return recycler == o.recycler;
  }
};

// Best-fit order: by size, then address. The stream is implicit: each arena (one stream)
// has its own pools, which is PyTorch's (stream, size, address) order split by stream.
// For any block type with `size` and `ptr` (the stitching engine's blocks too).
template <typename B>
struct SizeThenAddress {
  using is_transparent = void;
  struct Key {
    std::size_t size;
    DevicePtr ptr;
  };
  bool operator()(const B* a, const B* b) const {
    return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
  }
  bool operator()(const B* a, const Key& k) const {
    return a->size != k.size ? a->size < k.size : a->ptr < k.ptr;
  }
  bool operator()(const Key& k, const B* b) const {
    return k.size != b->size ? k.size < b->size : k.ptr < b->ptr;
  }
};
// The ordered set a best-fit pool keeps its free blocks in (BestFitPool below).
template <typename B>
using BestFitSet = std::set<B*, SizeThenAddress<B>, RecyclingAllocator<B*>>;

struct Block {
  DevicePtr ptr = 0;
  std::size_t size = 0;            // rounded bytes this block spans
  std::size_t requested_size = 0;  // what the program asked for (stale once freed)
  Block* prev = nullptr;           // neighbours within the segment, address order
  Block* next = nullptr;
  FreePool* pool = nullptr;         // the pool the block returns to (its arena's small or large)
  std::uint64_t gc_count_base = 0;  // pool's search count when the block became free
  int event_count = 0;              // outstanding events before it may be reused
  bool allocated = false;
  std::vector<StreamId> stream_uses;     // streams other than its own that used it
  ExpandableSegment* segment = nullptr;  // the expandable segment it lies in, if any
  bool mapped = true;    // false only for an unmapped range of an expandable segment
  Origin stack;          // history: context of its allocation (while active)
  Origin segment_stack;  // history: context of the device allocation (head only)
  BestFitSet<Block>::iterator pool_pos{};  // its place in its pool while pooled (BestFitPool)

  bool is_split() const { return prev != nullptr || next != nullptr; }
  DevicePtr end() const { return ptr + size; }
};

using BySizeThenAddress = SizeThenAddress<Block>;

// A free pool's blocks by size, then address (best fit: lower_bound). Each block keeps its
// place in the set (`B::pool_pos`, set by insert), so finding or removing a known block
// needs no search; only inserting one does. Both engines' pools are one of these.
template <typename B>
class BestFitPool {
 public:
  using Set = BestFitSet<B>;
  using iterator = typename Set::iterator;
  using Key = typename SizeThenAddress<B>::Key;
  explicit BestFitPool(NodeRecycler* nodes)
      : set_(SizeThenAddress<B>{}, RecyclingAllocator<B*>(nodes)) {}

  iterator insert(B* b) {
    ++version_;
    const iterator it = set_.insert(b).first;
    b->pool_pos = it;
    return it;
  }
  void erase(iterator it) {
    ++version_;
    set_.erase(it);
  }
  // b must be in this pool.
  void erase(B* b) {
    ++version_;
    set_.erase(b->pool_pos);
  }
  // Counts every change of the pool: each insert and erase, and touch(), which a caller
  // that changes a pooled block's size or address in place calls. Equal versions: the
  // same blocks, of the same sizes at the same addresses.
  std::uint64_t version() const { return version_; }
  void touch() { ++version_; }
  // b must be in this pool.
  iterator find(B* b) const { return b->pool_pos; }
  // Where b is in this pool, or end(), by search (for checks of what a caller passes in).
  iterator search(const B* b) const { return set_.find(const_cast<B*>(b)); }
  bool holds(const B* b) const { return search(b) != end(); }
  iterator lower_bound(Key k) const { return set_.lower_bound(k); }
  iterator begin() const { return set_.begin(); }
  iterator end() const { return set_.end(); }
  auto rbegin() const { return set_.rbegin(); }
  bool empty() const { return set_.empty(); }
  std::size_t size() const { return set_.size(); }

 private:
  Set set_;
  std::uint64_t version_ = 0;
};

// The free blocks of one kind (small or large) of one stream.
struct FreePool {
  using Blocks = BestFitPool<Block>;

  FreePool(bool small, Arena* owner) : is_small(small), arena(owner), blocks(&recycler_) {}

  // The smallest free block of at least `size` bytes (lowest address among equals).
  Blocks::iterator lower_bound(std::size_t size) const {
    return blocks.lower_bound(BySizeThenAddress::Key{size, 0});
  }

  const bool is_small;
  Arena* const arena;

 private:
  NodeRecycler recycler_;  // declared before `blocks`: destroyed after it

 public:
  Blocks blocks;  // free, mapped blocks
  struct ByAddress {
    bool operator()(const Block* a, const Block* b) const { return a->ptr < b->ptr; }
  };
  // Unmapped ranges of this stream's expandable segments, lowest address first.
  std::set<Block*, ByAddress> unmapped;
};

// Recycles Block objects so splits and merges on the hot path do not allocate. Only free
// blocks are recycled, and a free block has no events, no stream uses and is not
// allocated, so make() resets just the fields that differ between blocks.
class BlockRecycler {
 public:
  BlockRecycler() = default;
  BlockRecycler(const BlockRecycler&) = delete;
  BlockRecycler& operator=(const BlockRecycler&) = delete;

  // Inline into the split of a hit (docs/hot-path.md); a new block is made out of line.
  [[gnu::always_inline]] Block* make() {
    Block* b = free_;
    if (b == nullptr) [[unlikely]] return make_new();
    free_ = b->next;
    b->next = nullptr;
    b->prev = nullptr;
    b->requested_size = 0;
    b->gc_count_base = 0;
    b->segment = nullptr;
    b->mapped = true;
    return b;
  }
  [[gnu::noinline]] Block* make_new() {
    owned_.push_back(std::make_unique<Padded>());
    return &owned_.back()->block;
  }
  void recycle(Block* b) {
    b->stack.clear();  // contexts are released when the block goes, not when it is reused
    b->segment_stack.clear();
    b->next = free_;  // the free list is threaded through `next`
    free_ = b;
  }

 private:
  // Whole cache lines each (sync/cache_line.hpp): blocks are written on every hit.
  struct alignas(kCacheLine) Padded {
    Block block;
  };
  std::vector<std::unique_ptr<Padded>> owned_;
  Block* free_ = nullptr;
};

}  // namespace ccalloc::core
