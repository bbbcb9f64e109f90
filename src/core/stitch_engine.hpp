// The `ccalloc` preset's policy: caching on CUDA virtual memory with stitching.
//
// Model. Physical memory is held in pieces of the device's mapping granularity G (2 MiB on
// H100/H200), created in handles of one or more pieces. Each (stream, pool) has spaces:
// large reservations of address space in which pages of G bytes are mapped at a frontier
// that only moves up, and blocks tile the space from its base to the frontier, packed as
// expandable segments pack them (small requests keep PyTorch's small pool of their own).
// A block is
//   allocated  -> handed out (in live_)
//   pending    -> freed, waiting for events recorded on the other streams that used it
//   free       -> in its arena's pool for its kind (best fit by size, then address)
//   void       -> page-aligned pages that are dead or unmapped: in no pool, never merged
//                 with free blocks, never handed out
// A mapped page is live when its piece's live address is that page, else dead: its piece
// was lent to a later page and the old mapping stays until empty_cache or the OOM ladder
// unmaps it (unmapping needs the stream idle, which malloc and free never wait for).
//
// malloc takes the best-fitting free block of its stream and pool. When none fits, the
// space grows at its frontier by the pages the request lacks beyond a free tail block, and
// those pages are backed by whole handles (CUDA maps a handle only whole, from its start),
// in order of preference,
//   1. spare handles: created but live nowhere (returned by an unmapping);
//   2. lent handles: handles live wholly inside the whole pages of one of the stream's free
//      blocks, smallest block first (stream order makes their reuse safe without waiting);
//      their old pages become void;
//   3. new memory of max(lacking pieces, chunk) pieces (chunk: large_segment_size; the small
//      pool creates just what it lacks), or exactly the lacking pieces when the chunk does
//      not fit the device or the memory fraction, in handles of at most 32 pieces (64 MiB).
// Each handle is mapped with one call; whole handles may pass what the request lacks, and
// the rest extends the new free block. Free memory is thus stitched into the range that
// needs it instead of new memory being created, at one mapping per handle.
//
// OOM ladder (the only place besides empty_cache that synchronizes or unmaps): free-memory
// callbacks; waiting for every pending event; releasing the cache (synchronize the streams,
// unmap every mapping whose pages are all dead or free, release every handle with no live
// piece and no mapping); then the OutOfMemoryError. The garbage-collection threshold
// releases the cache before creating memory that would pass threshold x limit.
//
// Reserved bytes are physical bytes held: pieces x G (address space is not counted).
//
// Locking: one mutex guards everything, driver calls included. Trace observers are called
// with it held; OOM observers and free-memory callbacks without it.
//
// Invariants (check_invariants()): blocks tile each space from base to frontier with no two
// free neighbours; void blocks are page-aligned and cover only dead or unmapped pages,
// other blocks only live pages; pools hold exactly the free blocks, live_ exactly the
// allocated ones; each piece is live at most at one page, which maps it, and the spare set
// holds exactly the pieces live nowhere; each piece's mapping count equals the pages that
// map it; the driver's mappings in each space are exactly the model's (simulated GPU);
// reserved == pieces x G; no two live blocks share a physical byte; the stats
// equal a recount.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/snapshot.hpp"
#include "core/backend.hpp"
#include "core/history.hpp"

namespace ccalloc::core {

class StitchEngine final : public Backend {
 public:
  StitchEngine(Driver& driver, Config config);
  // Unmaps everything, releases every handle and reservation.
  ~StitchEngine() override;
  StitchEngine(const StitchEngine&) = delete;
  StitchEngine& operator=(const StitchEngine&) = delete;

  DevicePtr malloc(std::size_t size, StreamId stream) override;
  void free(DevicePtr ptr) override;
  void record_stream(DevicePtr ptr, StreamId stream) override;
  void empty_cache() override;
  DeviceStats stats() const override;
  void reset_peak_stats() override;
  void reset_accumulated_stats() override;
  void set_memory_fraction(double fraction) override;
  double memory_fraction() const override;
  std::vector<SegmentInfo> segments() const override;
  std::size_t allocation_size(DevicePtr ptr) const override;
  void add_oom_observer(Allocator::OomObserver observer) override;
  void add_free_memory_callback(Allocator::FreeMemoryCallback callback) override;
  void add_trace_observer(TraceObserver observer) override;
  void record_history(const HistoryOptions& options) override;
  Snapshot snapshot() override;
  void annotate(std::string_view name, bool start) override;
  void check_invariants() const override;
  void set_check_invariants(bool on) override { check_invariants_.store(on); }
  const Config& config() const override { return config_; }
  const char* policy_name() const override { return "the stitching policy (stitch_segments)"; }
  Driver& driver() const override { return driver_; }

  // Physical pieces held: spare ones (live nowhere) and all; pages mapped dead.
  struct PieceCounts {
    std::size_t total = 0;
    std::size_t spare = 0;
    std::size_t dead_pages = 0;
  };
  PieceCounts piece_counts() const;

 private:
  struct Space;
  struct Arena;
  struct Handle {
    PhysicalHandle id = 0;
    bool small = false;                   // the pool whose growth created it (for stats)
    std::vector<DevicePtr> live_at;       // per piece: the page it backs live; 0: spare
    std::vector<std::uint32_t> mappings;  // per piece: pages mapping it, live or dead
  };
  struct PieceRef {
    Handle* handle = nullptr;
    std::uint32_t index = 0;
  };
  struct Block {
    enum class Kind : std::uint8_t { kFree, kAllocated, kPending, kVoid };
    DevicePtr ptr = 0;
    std::size_t size = 0;
    std::size_t requested = 0;
    Block* prev = nullptr;
    Block* next = nullptr;
    Space* space = nullptr;
    Kind kind = Kind::kFree;
    int event_count = 0;
    std::vector<StreamId> stream_uses;
    Origin stack;  // of its allocation, while active
    DevicePtr end() const { return ptr + size; }
  };
  struct BySizeThenAddress {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };
  using Pool = std::set<Block*, BySizeThenAddress>;
  struct Page {
    Handle* handle = nullptr;  // nullptr: unmapped
    std::uint32_t piece = 0;
  };
  struct Mapping {
    std::size_t pages = 0;
    Handle* handle = nullptr;
    std::uint32_t first_piece = 0;
  };
  struct Space {
    Arena* arena = nullptr;
    bool small = false;
    DevicePtr base = 0;
    std::size_t reserved_pages = 0;           // the reservation, in pages
    std::vector<Page> pages;                  // up to the frontier
    std::map<std::size_t, Mapping> mappings;  // by first page
    Block* first = nullptr;
    Block* last = nullptr;
  };
  struct Arena {
    StreamId stream = 0;
    Pool pools[2];  // [0] large, [1] small
    std::vector<std::unique_ptr<Space>> spaces[2];
    Pool& pool(bool small) { return pools[small ? 1 : 0]; }
  };
  struct PendingEvent {
    EventId event = 0;
    Block* block = nullptr;
  };
  enum class Grow { kDone, kOutOfMemory, kNeedsGc };

  // All below require mutex_.
  Arena& arena_for(StreamId stream);
  Block* find_free(Arena& arena, bool small, std::size_t size);
  Grow grow(Arena& arena, bool small, std::size_t size, bool gc_allowed, Block** out);
  Space& new_space(Arena& arena, bool small);
  DevicePtr page_va(const Space& s, std::size_t page) const { return s.base + page * page_; }
  DevicePtr hand_out(Arena& arena, Block* block, std::size_t size, std::size_t requested,
                     const Origin& stack);
  void free_block(Block* block);
  void make_void(Space& s, Block* from, DevicePtr lo, DevicePtr hi);
  Block* split_off_front(Block* b, std::size_t size);
  void merge_void_around(Space& s, Block* b);
  void process_events();
  void synchronize_events();
  void release_cache();
  void release_spare_handles();
  std::size_t limit() const { return limit_ ? *limit_ : capacity_; }
  Block* new_block();
  void delete_block(Block* b);
  void add_reserved(bool small, std::int64_t bytes);
  void record_trace(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream,
                    const Origin& stack);
  [[noreturn]] void raise_oom(std::unique_lock<std::mutex>& lock, Arena& arena,
                              std::size_t requested, std::size_t rounded, bool small,
                              const Origin& stack);
  void after_operation() const {
    if (check_invariants_.load(std::memory_order_relaxed)) check_invariants();
  }
  void check_locked() const;

  Driver& driver_;
  const Config config_;
  std::atomic<bool> check_invariants_{false};
  std::atomic<bool> capture_on_malloc_{false};
  std::atomic<bool> capture_on_free_{false};
  std::atomic<bool> capture_cpp_{false};     // a capture takes the C++ stack
  std::atomic<bool> capture_caller_{false};  // and the caller's context
  ContextSource contexts_;
  // The origin of the operation starting now; inlined, so capture_origin skips its frame.
  [[gnu::always_inline]] Origin capture() const {
    return capture_origin(capture_cpp_.load(std::memory_order_relaxed),
                          capture_caller_.load(std::memory_order_relaxed) ? &contexts_ : nullptr);
  }

  mutable std::mutex mutex_;
  std::size_t page_ = 0;          // the driver's granularity
  std::size_t space_pages_ = 0;   // pages reserved per space
  std::size_t chunk_pieces_ = 0;  // pieces per created handle, at least
  std::size_t capacity_ = 0;
  std::optional<std::size_t> limit_;
  double fraction_ = 1.0;
  std::size_t reserved_ = 0;  // pieces held x page_
  std::vector<std::unique_ptr<Arena>> arenas_;
  std::unordered_map<StreamId, Arena*> arena_by_stream_;
  std::map<PhysicalHandle, std::unique_ptr<Handle>> handles_;
  std::set<std::pair<PhysicalHandle, std::uint32_t>> spare_;  // pieces live nowhere
  std::unordered_map<DevicePtr, Block*> live_;
  std::vector<PendingEvent> pending_;
  std::vector<EventId> spare_events_;
  DeviceStats stats_;
  std::vector<TraceObserver> trace_observers_;
  std::vector<Allocator::OomObserver> oom_observers_;
  std::vector<Allocator::FreeMemoryCallback> free_memory_callbacks_;
  bool history_on_ = false;
  HistoryRing history_;
  std::vector<Annotation> annotations_;
};

}  // namespace ccalloc::core
