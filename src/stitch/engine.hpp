// The `ccalloc` preset's policy: caching on CUDA virtual memory with stitching.
//
// Model. Physical memory is held in pieces of the device's mapping granularity G (2 MiB on
// H100/H200), created in handles of one or more pieces. Each (stream, pool) has spaces:
// large reservations of address space in which pages of G bytes are mapped at a frontier
// that only moves up, and blocks tile the space from its base to the frontier, packed as
// expandable segments pack them (requests of at most 256 KiB keep a small pool of their own).
// A block is
//   allocated  -> handed out (in live_)
//   pending    -> freed, waiting for events recorded on the other streams that used it
//   free       -> in its arena's pool (best fit by size, then address)
//   void       -> page-aligned pages that are dead or unmapped: in no pool, never merged
//                 with free blocks, never handed out
//   parked     -> the stream's last freed block (not an island's), in no pool (in live_), kept whole for a next
//                 request that best fit would serve with it (Arena::parked, hot_path.hpp):
//                 free memory in every count and view, pooled by any other operation
// A mapped page is live when its piece's live address is that page, else dead: its piece
// was lent to a later page and the old mapping stays until empty_cache or the OOM ladder
// unmaps it (unmapping needs the stream idle, which malloc and free never wait for).
//
// malloc takes the best-fitting free block of its stream and pool. When no small block
// fits, the small pool first takes a whole free page of the stream's smallest large free
// block in place (a frontier's free tail only once the stream has settled and only while
// the rest of the tail holds the largest block handed out): an island, whose blocks are the
// small pool's (Block::small) and merge only with each other, and which goes back to the
// large pool once wholly free; no driver call, no new memory. When none fits, the
// space grows at its frontier by the pages the request lacks beyond a free tail block, and
// those pages are backed by whole handles (CUDA maps a handle only whole, from its start),
// in order of preference,
//   1. spare handles: created but live nowhere (returned by an unmapping);
//   2. lent handles: handles live wholly inside the whole pages of one of the stream's free
//      blocks, smallest block first (stream order makes their reuse safe without waiting);
//      their old pages become void;
//   2b. other streams' handles, likewise, once their uses are done: a fence recorded on
//      that stream after their frees has completed, or, where all of its fences have, behind
//      a device-side wait on one recorded then (stitch/share.cpp);
//   3. new memory of max(lacking pieces, chunk) pieces (chunk: large_segment_size, or 1/64
//      of the reserved bytes when less once the stream has handed out its large range's
//      bytes again since the pool last created memory; the small pool creates just what it
//      lacks), or exactly the lacking pieces when the chunk does not fit the device or the
//      memory fraction, in handles of at most 32 pieces (64 MiB) and at most 1/512 of the
//      limit (two pieces at least).
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
// Locking. Each (stream) arena has its own lock (ArenaMutex) over its pools, spaces, blocks,
// live index, pending events and its share of the block statistics; the device lock
// (device_mutex_) guards what every stream shares: handles and their pieces, the spare
// set, reserved bytes, the limit and the device-wide statistics. Locks, in the order they
// may nest:
//   registry_mutex_ -> Arena::mutex (several only via AllArenasLock, by creation order)
//   -> device_mutex_ -> trace_mutex_ / EventPool / HistoryRing
// (observers_mutex_, EventPool and HistoryRing are leaves: nothing is taken under them).
// The hot path takes one arena lock: malloc that finds a free block in its arena, free of a
// block with no other stream's uses (one with them also records events, taking the
// EventPool's lock), record_stream and allocation_size; the
// arena of a stream comes from a per-thread cache (ThreadArenaCache), that of a pointer
// from the SegmentMap of the spaces' reservations (no lock). Growth holds the arena's lock
// and the device lock: lending takes the stream's own free pages, spare pieces and new
// handles are the device's, and other streams' free pages are taken under their locks,
// try_lock only (plan_borrow). Polling events locks each arena with pending frees in turn.
// GC, releasing the cache, the rest of the OOM ladder, empty_cache, stats, snapshots and the
// invariant checker take every arena lock (AllArenasLock) and the device lock. Block
// statistics live in the arenas; their device-wide peaks are kept exact by the baseline
// ledger (core/peak_ledger.hpp): a malloc that raises a counter above its arena's baseline
// settles under AllArenasLock after releasing the arena's lock, before returning. Trace
// observers are called under trace_mutex_ (and whatever locks the operation holds); OOM
// observers and free-memory callbacks with no lock held.
//
// Invariants (check_invariants()): blocks tile each space from base to frontier with no two
// free neighbours; void blocks are page-aligned and cover only dead or unmapped pages,
// other blocks only live pages; pools hold exactly the free blocks, each at the place it
// keeps (Block::pool_pos), live_ exactly the allocated ones; each piece is live at most at
// one page, which maps it, and the spare set holds exactly the pieces live nowhere; each
// piece's mapping count equals the pages that map it; the driver's mappings in each space
// are exactly the model's (simulated GPU); reserved == pieces x G; no two live blocks share
// a physical byte; the stats equal a recount; each arena's block statistics not in peak
// debt are within its baselines and the device's peaks cover its currents
// (peaks_cover_current, as the native engine's).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/snapshot.hpp"
#include "sync/arena_cache.hpp"
#include "core/arena_engine.hpp"
#include "sync/arena_mutex.hpp"
#include "core/backend.hpp"
#include "core/block.hpp"
#include "sync/cycle_gate.hpp"
#include "core/device_reserved.hpp"
#include "core/event_pool.hpp"
#include "history/history.hpp"
#include "core/peak_ledger.hpp"
#include "sync/ptr_map.hpp"
#include "core/published_size.hpp"
#include "core/segment_map.hpp"
#include "sync/thread_annotations.hpp"

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
  // The context empty_cache() runs in (none when an operation is already running on this
  // thread): StitchBackend takes it once for both engines.
  std::optional<OperationContext> empty_cache_context();
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
  // The last steps of malloc's OOM ladder, for a backend that runs another engine beside
  // this one (stitch/backend.cpp): `release_cache` gives that engine's cached memory
  // back to the device (true if any went back; not called during a capture), then `serve`
  // may hand out a block of its own (0: none). Each is called with no lock of this engine
  // held. Set once, before the engine is used.
  struct OomFallbacks {
    std::function<bool()> release_cache;
    std::function<DevicePtr(std::size_t size, StreamId stream)> serve;
  };
  void set_oom_fallbacks(OomFallbacks fallbacks) { oom_fallbacks_ = std::move(fallbacks); }
  // The snapshot; its trace entry counts `other_active_bytes` beside this engine's active
  // bytes (the private pools' engine beside it: stitch/backend.cpp).
  Snapshot snapshot(std::int64_t other_active_bytes);
  void annotate(std::string_view name, bool start) override;
  void check_invariants() const override;
  void set_check_invariants(bool on) override { check_invariants_.store(on); }
  // The live config. reconfigure() changes it in place: reading it on another thread while
  // a reconfiguration runs is a data race (the fields that cannot change excepted).
  const Config& config() const override { return config_; }
  // Applies `config` live: the memory fraction, the request rounding
  // (roundup_power2_divisions, max_non_split_rounding_size), the GC threshold and the chunk
  // (large_segment_size) and stream_borrow_wait take effect; the other keys are recorded
  // (they have no effect on this policy). Throws ConfigError, changing nothing, for backend,
  // stitch_segments or uncached.
  bool reconfigure(const Config& config) override EXCLUDES(registry_mutex_, device_mutex_);
  const char* policy_name() const override { return "the stitching policy (stitch_segments)"; }
  Driver& driver() const override { return driver_; }
  // The handles mapped over the live allocation `ptr`, whole (ipc::RegionKind::kHandles).
  ipc::SharedRegion shared_region(DevicePtr ptr) const override;

  // Beside the private pools (stitch/backend.hpp). While a capture (an allocation to a
  // private pool) is underway, events are neither recorded nor queried: a free with other
  // streams' uses waits in its arena's deferred list, pending, until every capture has
  // ended, and nothing is synchronized, unmapped or released (the OOM ladder skips waiting
  // and releasing, the GC threshold releases nothing, empty_cache does nothing).
  // Both take every arena lock, so an operation holding one sees the count unchanged.
  void begin_capture() EXCLUDES(registry_mutex_, device_mutex_);
  void end_capture() EXCLUDES(registry_mutex_, device_mutex_);
  bool capturing() const { return captures_underway_.load(std::memory_order_acquire) != 0; }
  // Whether `ptr` lies in one of this engine's spaces (no lock).
  bool owns(DevicePtr ptr) const { return arena_of(ptr) != nullptr; }
  // free() for a pointer in this engine's address ranges, with one lookup: false, doing
  // nothing, where none holds `ptr`; InvalidPointerError where one does but no live block
  // starts at it.
  bool free_owned(DevicePtr ptr);
  // The reserved bytes of the engine beside this one, counted against the memory limit and
  // the device's capacity; this engine's reserved bytes, read without its locks.
  void set_peer_reserved(const std::atomic<std::size_t>* peer) { peer_reserved_.set(peer); }
  // As Engine::set_device_reserved, set_joint_settlement and with_ledger_shares.
  void set_device_reserved(DeviceReserved* ledger) { device_reserved_ = ledger; }
  void set_joint_settlement(JointSettlement* joint) { joint_ = joint; }
  void with_ledger_shares(const std::function<void(std::vector<LedgerShare>&)>& f) const
      EXCLUDES(registry_mutex_, device_mutex_) {
    ArenaEngine::with_ledger_shares(*this, f);
  }
  // The published copy is an atomic of its own: no lock (the analysis cannot see past the
  // guarded member that holds it).
  const std::atomic<std::size_t>& published_reserved() const NO_THREAD_SAFETY_ANALYSIS {
    return reserved_.published();
  }

  // Physical pieces held: spare ones (live nowhere) and all; pages mapped dead.
  struct PieceCounts {
    std::size_t total = 0;
    std::size_t spare = 0;
    std::size_t dead_pages = 0;
    // Sharing between streams (stitch/share.cpp): fences recorded, and the handles (and
    // their pieces) that a stream's growth took from another stream's free pages.
    std::size_t fences = 0;
    std::size_t borrow_waits = 0;  // growths that waited on the device for a donor's fence
    // Of those, the waits on a donor with fences in flight: its work before the fence may
    // still run, and the growing stream's next work waits for it (stream_borrow_wait).
    std::size_t busy_borrow_waits = 0;
    std::size_t borrowed_handles = 0;
    std::size_t borrowed_pieces = 0;
    std::int64_t fence_latency_us = 0;  // recent average; 0 before the first sample
    std::size_t fence_latency_samples = 0;
    // The cycle gate of the frees' clock reads (sync/cycle_gate.hpp): calibrated and open,
    // or shut for good (a counter found slower than calibrated).
    bool clock_gate_open = false;
    bool clock_gate_shut = false;
  };
  PieceCounts piece_counts() const EXCLUDES(registry_mutex_, device_mutex_);

 private:
  friend struct StitchEngineTestAccess;  // tests/invariants_test.cpp
  friend struct ArenaEngine;             // core/arena_engine.hpp
  struct Space;
  struct Arena;
  // Guarded by device_mutex_: a piece may be live in one stream's space and mapped dead in
  // another's.
  struct Handle {
    PhysicalHandle id = 0;
    bool small = false;  // the pool whose growth created it (rule 3.2: what may be taken back)
    // The pool whose reserved bytes and segments count it: that of the space where it is
    // live, or, spare, where it was last live (move_handle_stats).
    bool counted_small = false;
    std::vector<DevicePtr> live_at;       // per piece: the page it backs live; 0: spare
    std::vector<std::uint32_t> mappings;  // per piece: pages mapping it, live or dead
  };
  struct PieceRef {
    Handle* handle = nullptr;
    std::uint32_t index = 0;
  };
  struct Block;
  using BySizeThenAddress = SizeThenAddress<Block>;  // best fit (core/block.hpp)
  // Blocks, spaces and their pages are guarded by their arena's lock.
  struct Block {
    enum class Kind : std::uint8_t { kFree, kAllocated, kPending, kVoid, kParked };
    DevicePtr ptr = 0;
    std::size_t size = 0;
    std::size_t requested = 0;
    Block* prev = nullptr;
    Block* next = nullptr;
    Space* space = nullptr;
    Kind kind = Kind::kFree;
    bool small = false;  // its pool: its space's, or small in an island of a large space
    int event_count = 0;
    std::vector<StreamId> stream_uses;
    Origin stack;  // of its allocation, while active
    // Its place in its pool, while free (Pool::insert sets it).
    BestFitSet<Block>::iterator pool_pos{};
    DevicePtr end() const { return ptr + size; }
    // A small-pool block in a large space (see take_island).
    bool in_island() const { return small != space->small; }
  };
  using Pool = BestFitPool<Block>;  // a free pool (core/block.hpp)
  struct Page {
    Handle* handle = nullptr;  // nullptr: unmapped
    std::uint32_t piece = 0;
    // Its arena's epoch when a block on its piece was last freed there (0: none since the
    // piece came to the arena with its uses done); see Arena::epoch.
    std::uint64_t freed = 0;
  };
  struct Mapping {
    std::size_t pages = 0;
    Handle* handle = nullptr;
    std::uint32_t first_piece = 0;
    // The operation that mapped it, with history on (a segment starting here reports it, and
    // its unmap carries it when the unmapping operation has none, as PyTorch's segments).
    Origin stack;
  };
  // Whole cache lines, as its pages (sync/cache_line.hpp): a split and a merge at its start
  // write `first`, and a free on a stream that shares stamps its pages.
  struct alignas(kCacheLine) Space {
    Arena* arena = nullptr;
    bool small = false;
    DevicePtr base = 0;
    std::size_t reserved_pages = 0;                     // the reservation, in pages
    std::vector<Page, CacheLineAllocator<Page>> pages;  // up to the frontier
    std::map<std::size_t, Mapping> mappings;            // by first page
    Block* first = nullptr;
    Block* last = nullptr;
    // The mapping that holds `page`, or mappings.end().
    std::map<std::size_t, Mapping>::const_iterator mapping_at(std::size_t page) const {
      auto it = mappings.upper_bound(page);
      if (it == mappings.begin()) return mappings.end();
      --it;
      return page < it->first + it->second.pages ? it : mappings.end();
    }
  };
  struct PendingEvent {
    EventId event = 0;
    Block* block = nullptr;
  };
  // An event recorded on an arena's stream once pages had been freed there: when it has
  // completed, the uses of every page stamped at or below `epoch` are done (stitch/share.cpp).
  struct Fence {
    EventId event = 0;
    std::uint64_t epoch = 0;
    std::int64_t at_us = 0;  // Driver::now_us() when recorded
  };
  // Everything of one stream; see the header comment for what its lock covers.
  struct alignas(64) Arena {
    Arena(StreamId s, std::size_t index)
        : stream(s), owner(static_cast<SegmentMap::Owner>(index + 1)) {}
    // The spare blocks stay constructed until the arena goes (blocks.cpp, hot_path.hpp).
    ~Arena();
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;
    Pool& pool(bool small) REQUIRES(mutex) { return pools[small ? 1 : 0]; }

    ArenaMutex mutex;
    const StreamId stream;
    const SegmentMap::Owner owner;  // its spaces' owner in the engine's SegmentMap
    // Nodes of the pools' sets and Block objects, recycled (declared before their users:
    // destroyed after them).
    NodeRecycler pool_nodes GUARDED_BY(mutex);
    NodeRecycler block_nodes GUARDED_BY(mutex);
    // Blocks deleted by merges, kept constructed (linked by `next`, each with no stream
    // uses and no stack) for the next split: new_block() resets a few fields instead of
    // constructing one.
    Block* spare_blocks GUARDED_BY(mutex) = nullptr;
    // [0] large, [1] small
    Pool pools[2] GUARDED_BY(mutex){Pool(&pool_nodes), Pool(&pool_nodes)};
    std::vector<std::unique_ptr<Space>> spaces[2] GUARDED_BY(mutex);
    PtrMap<Block*> live GUARDED_BY(mutex);  // allocated blocks and the parked one, by address
    // The parked block (hot_path.hpp, park()), if any. The statistics count it allocated
    // until it is pooled; its takes' cumulative counts wait in `taken` until read.
    Block* parked GUARDED_BY(mutex) = nullptr;
    TakenPairs taken GUARDED_BY(mutex);
    std::vector<PendingEvent> pending GUARDED_BY(mutex);
    // Frees with other streams' uses made while a capture was underway: pending, with no
    // events yet (insert_deferred_events records them once no capture is underway).
    std::vector<Block*> deferred GUARDED_BY(mutex);
    // Statistics of this arena's blocks (allocation, active and the byte counts); for
    // them Stat::peak less `debts` is the arena's baseline (core/peak_ledger.hpp).
    DeviceStats stats GUARDED_BY(mutex);
    PeakBaselines debts GUARDED_BY(mutex);
    bool in_debt GUARDED_BY(mutex) = false;
    // Bytes of large blocks handed out since the large pool last created memory for this
    // stream (see least_large_growth).
    std::size_t large_served GUARDED_BY(mutex) = 0;
    // The largest block the large pool has handed out on this stream (see take_island).
    std::size_t largest_large GUARDED_BY(mutex) = 0;
    // Whether the small pool has kept an island left wholly free (end_island_if_free) since
    // the large pool last took its islands back (return_kept_islands): at most one is
    // wholly free at a time.
    bool keeps_island GUARDED_BY(mutex) = false;
    // The last island returned to the large pool, and how many times in a row take_island
    // has taken that same page back.
    DevicePtr last_returned_island GUARDED_BY(mutex) = 0;
    std::size_t island_bounces GUARDED_BY(mutex) = 0;
    std::atomic<std::int64_t> pending_events{0};  // pending.size(), read without the lock
    // Sharing with other streams (stitch/share.cpp), once more than one stream allocates: a
    // block freed now stamps its pages with `epoch`; a fence recorded on the stream takes
    // the epoch and the next one begins. Once a fence has completed, `safe_epoch` is its
    // epoch: a page stamped at or below it has no use left in flight on any stream (its own
    // stream's are before the fence, other streams' were waited for before the free), so
    // another stream may take its handle without waiting.
    std::uint64_t epoch GUARDED_BY(mutex) = 1;
    std::uint64_t safe_epoch GUARDED_BY(mutex) = 0;
    bool unfenced GUARDED_BY(mutex) = false;  // a page stamped `epoch`: no fence covers it
    // The last refresh_fences by a free (none yet: far in the past).
    std::int64_t fences_polled_us GUARDED_BY(mutex) = std::numeric_limits<std::int64_t>::min() / 2;
    // A free's last read of the clock for its poll, by the clock and by the cycle counter,
    // and how many counter ticks from then certainly pass before the next poll is due (0:
    // none known; fence_gate_): a free within them skips the read.
    std::int64_t fence_clock_us GUARDED_BY(mutex) = 0;
    std::uint64_t fence_clock_cycles GUARDED_BY(mutex) = 0;
    std::uint64_t fence_clock_span GUARDED_BY(mutex) = 0;
    // Frees that skip even the counter read (the read costs 10-20 ns on the virtual
    // machines measured): granted at a read that found the poll not due, as many as fit in
    // half the ticks left at the rate of frees since the previous read, at most
    // kMaxFenceSkips. `fence_read_cycles` is that previous read, `fence_skips_granted` what
    // it granted and `fence_skips` what is left of it.
    std::uint64_t fence_read_cycles GUARDED_BY(mutex) = 0;
    std::uint32_t fence_skips_granted GUARDED_BY(mutex) = 0;
    std::uint32_t fence_skips GUARDED_BY(mutex) = 0;
    std::deque<Fence> fences GUARDED_BY(mutex);  // in flight, oldest first
    std::int64_t fences_queried_us GUARDED_BY(mutex) = std::numeric_limits<std::int64_t>::min() / 2;
  };
  enum class Grow { kDone, kOutOfMemory, kNeedsGc };

  // Holds registry_mutex_ and every arena lock, taken in creation order, and pools every
  // arena's parked block (unpark) unless told to keep them (the invariant checker).
  class AllArenasLock {
   public:
    enum class Parked { kPool, kKeep };
    explicit AllArenasLock(const StitchEngine& engine, Parked parked = Parked::kPool)
        NO_THREAD_SAFETY_ANALYSIS;
    ~AllArenasLock() NO_THREAD_SAFETY_ANALYSIS;
    AllArenasLock(const AllArenasLock&) = delete;
    AllArenasLock& operator=(const AllArenasLock&) = delete;
    // `arena` (one of the engine's) is locked while this object lives.
    void held(const Arena& arena) const ASSERT_CAPABILITY(arena.mutex) {
      arena.mutex.assert_held();
    }
    const std::vector<Arena*>& arenas() const { return arenas_; }  // by creation

   private:
    const StitchEngine& engine_;
    std::vector<Arena*> arenas_;
  };

  // The stream's arena: the thread's cache, else the registry (arena_for_registry).
  Arena& arena_for(StreamId stream) EXCLUDES(registry_mutex_) {
    if (Arena* cached = ThreadArenaCache<Arena>::find(uid_, stream)) [[likely]]
      return *cached;
    return arena_for_registry(stream);
  }
  Arena& arena_for_registry(StreamId stream) EXCLUDES(registry_mutex_);
  Arena* arena_of(DevicePtr ptr) const { return arena_table_.get(owners_.owner_of(ptr)); }
  // The block handed out at `ptr` (nullptr: none): the live index holds the parked block
  // too, which is free.
  static Block* live_block(const Arena& arena, DevicePtr ptr) REQUIRES(arena.mutex) {
    Block* const b = arena.live.find(ptr);
    return b != nullptr && b->kind != Block::Kind::kParked ? b : nullptr;
  }
  std::vector<Arena*> arena_list() const EXCLUDES(registry_mutex_);
  // The rest of malloc once the arena's pool had no block: growth under the device lock,
  // then the GC and OOM ladder under every lock. Returns with every lock released.
  DevicePtr malloc_slow(Arena& arena, std::unique_lock<ArenaMutex> lock, std::size_t size,
                        std::size_t rounded, bool small, const Origin& stack);
  Block* find_free(Arena& arena, bool small, std::size_t size) REQUIRES(arena.mutex);
  // `all`: every arena lock is held (the OOM ladder's retries); else only the arena's.
  Grow grow(Arena& arena, bool small, std::size_t size, bool gc_allowed, Block** out,
            bool try_island = true, const AllArenasLock* all = nullptr)
      REQUIRES(arena.mutex, device_mutex_);
  // The least pieces a growth of the stream's large pool creates: the chunk, or 1/64 of the
  // reserved bytes when less, once the stream has settled (see grow()).
  std::size_t least_large_growth(const Arena& arena) const REQUIRES(arena.mutex, device_mutex_);
  // Whether the stream has handed out more large-block bytes since its large pool last
  // created memory than its large spaces hold below their frontiers.
  bool settled(const Arena& arena) const REQUIRES(arena.mutex);
  Space& new_space(Arena& arena, bool small) REQUIRES(arena.mutex, device_mutex_);
  DevicePtr page_va(const Space& s, std::size_t page) const { return s.base + page * page_; }
  // The page holding byte `offset` of a space (a shift where the granularity is a power of
  // two, as CUDA's and the simulated GPU's are: a free of a sharing stream takes two).
  std::size_t page_index(std::size_t offset) const {
    return page_shift_ != 0 ? offset >> page_shift_ : offset / page_;
  }
  // Hands out the pooled block at `pos` (split to `size` when the rest is worth a block).
  DevicePtr hand_out(Arena& arena, Pool::iterator pos, std::size_t size, std::size_t requested,
                     const Origin& stack) REQUIRES(arena.mutex);
  void free_block(Arena& arena, Block* block) REQUIRES(arena.mutex);
  // Puts the free block `b` (in its space's list, not in the pool) into its pool, merged with
  // free neighbours; returns the block that holds it then.
  // Small blocks may lie in an island of a large space (whole pages of the large pool lent
  // in place to the small pool, see take_island): free blocks merge only within their pool,
  // and an island left wholly free goes back to the large pool, merged with its free
  // neighbours, unless `keep_island` (the island just taken, about to be handed out).
  Block* pool_free(Arena& arena, Block* b, bool keep_island = false) REQUIRES(arena.mutex);
  // `b` (free, pooled), or, where it is a whole island, the large free block it joins.
  Block* end_island_if_free(Arena& arena, Block* b) REQUIRES(arena.mutex);
  // Whether free block b is an island with no free neighbour of its pool: a whole island.
  static bool whole_free_island(const Block* b);
  // Returns whole free island b to the large pool; the large free block it joins.
  Block* island_to_large_pool(Arena& arena, Block* b) REQUIRES(arena.mutex);
  void return_kept_islands(Arena& arena) REQUIRES(arena.mutex);
  // Whether the island the small pool keeps may stay its own across a large request of
  // `rounded` bytes whose best fit is `pos`: the request lands at the same address as it
  // would were the island returned (merged with its free neighbours), and the island is
  // the small pool's only free block.
  bool kept_island_stays(Arena& arena, Pool::iterator pos, std::size_t rounded)
      REQUIRES(arena.mutex);
  // Small-pool growth without a driver call: a one-piece handle that the small pool created
  // and lent to the large pool, now wholly inside a large free block, goes back to the
  // small page that still maps it (dead there since the lend). Returns the free block that
  // holds the revived page, or nullptr where there is none.
  Block* revive_small_piece(Arena& arena) REQUIRES(arena.mutex, device_mutex_);
  // Small-pool growth without a driver call or new memory: the first whole page of the
  // smallest large free block of the stream becomes an island of the small pool, in place;
  // a space's free tail qualifies once the stream has settled and while the tail less the
  // page holds the largest block the large pool has handed out. Returns the small free
  // block holding it, or nullptr where no such page is free.
  Block* take_island(Arena& arena) REQUIRES(arena.mutex);
  // Sharing between streams (stitch/share.cpp). Stamps the pages of the block `b`, just
  // freed, with its arena's epoch and keeps fences in flight.
  void note_free(Arena& arena, const Block& b) REQUIRES(arena.mutex);
  // note_free's poll of the fences once no skip is left (share.cpp).
  void note_free_poll(Arena& arena) REQUIRES(arena.mutex);
  // Stamps the pages of `b` with `epoch` (its arena's when `b` was freed), as note_free
  // does with the current one, keeping a page's later stamp; no fence poll.
  void stamp_freed(Arena& arena, const Block& b, std::uint64_t epoch) REQUIRES(arena.mutex);
  // Moves the arena's safe epoch past its completed fences, and records a fence where pages
  // were freed since the last one and that one is kFenceIntervalUs old. `polled`: only when
  // the last poll by a free is that old too (the free path's rate limit).
  void refresh_fences(Arena& arena, bool polled) REQUIRES(arena.mutex);
  // Moves the safe epoch past the fences that have completed, oldest first.
  void complete_fences(Arena& arena) REQUIRES(arena.mutex);
  // Records a fence now, closing the arena's epoch; returns its event.
  EventId record_fence(Arena& arena) REQUIRES(arena.mutex);
  // The first stream beside the first: from now on frees stamp their pages, and the first
  // stream's free pages so far count as freed now. Under registry_mutex_.
  void begin_sharing() REQUIRES(registry_mutex_);
  // The greatest stamp of the `n` pages from `va` in space `s`.
  std::uint64_t stamp_of(const Space& s, DevicePtr va, std::size_t n) const;
  // Where a growth of `arena` lacks `lacking` pieces that it would create, the handles of
  // other streams' free blocks of the same pool whose pages' uses are all done (their
  // fences completed), smallest block first, as many as spare creating memory: enough to
  // cover the lack, or, where the growth would create more than `least` anyway, up to the
  // lack less `least`. Each one's arena is locked in `held` (try_lock: one that is busy is
  // skipped), unless `all` holds every arena already. Appends to `out`; returns the pieces.
  // A handle that growth takes from a free block (the stream's own, or another's), whose
  // whole pages from `lo` it backs.
  struct Lend {
    Handle* handle;
    Block* block;
    DevicePtr lo;
  };
  std::size_t plan_borrow(Arena& arena, bool small, std::size_t lacking, std::size_t least,
                          const AllArenasLock* all, std::vector<std::unique_lock<ArenaMutex>>& held,
                          std::vector<Lend>& out) REQUIRES(arena.mutex, device_mutex_);
  // The handles live wholly inside the whole pages of the free block `b`, in address order:
  // f(address, handle) for each, until f returns true (then returns true).
  template <typename F>
  bool find_whole_handle(const Block& b, F&& f) const;
  void make_void(Arena& arena, Space& s, Block* from, DevicePtr lo, DevicePtr hi)
      REQUIRES(arena.mutex);
  Block* split_off_front(Arena& arena, Block* b, std::size_t size) REQUIRES(arena.mutex);
  void merge_void_around(Arena& arena, Space& s, Block* b) REQUIRES(arena.mutex);
  Block* new_block(Arena& arena) REQUIRES(arena.mutex);
  void delete_block(Arena& arena, Block* b) REQUIRES(arena.mutex);
  // Returns the block's pool to its arena's free pool, or records events for its uses.
  void release(Arena& arena, Block* b, const Origin& stack) REQUIRES(arena.mutex);
  // The one-block cache in front of the pools (hot_path.hpp): a free of a block (not an
  // island's) with no other stream's use, no history and no free block before it parks it
  // whole instead of pooling and merging it (true); a request that best fit would serve at
  // its address takes it back as it is, any other request pools it first (0).
  bool park(Arena& arena, Block* b, const Origin& stack) REQUIRES(arena.mutex);
  DevicePtr take_parked(Arena& arena, std::size_t rounded, bool small, std::size_t requested,
                        const Origin& stack) REQUIRES(arena.mutex);
  // Pools the arena's parked block, merged with its free neighbours, as its free would have.
  void unpark(Arena& arena) REQUIRES(arena.mutex);
  // A large block handed out, in the counts growth and islands decide by (hand_out,
  // take_parked).
  void count_large(Arena& arena, const Block& block) REQUIRES(arena.mutex);
  // Marks `block` allocated with its statistics and trace (hand_out); its address.
  DevicePtr mark_handed_out(Arena& arena, Block& block, std::size_t requested,
                            const Origin& stack) REQUIRES(arena.mutex);
  // A free's statistics in pool `t` (the block's segment's): at the free (count_release),
  // and once no use is outstanding (count_inactive); release, free_block, unpark (a park
  // leaves them uncounted: core/peak_ledger.hpp, TakenPairs).
  void count_release(Arena& arena, const Block& b, StatType t) REQUIRES(arena.mutex);
  void count_inactive(Arena& arena, const Block& b, StatType t) REQUIRES(arena.mutex);
  void process_events(Arena& arena) REQUIRES(arena.mutex);
  // Records the events of a pending block's other streams' uses.
  void record_events(Arena& arena, Block* b) REQUIRES(arena.mutex);
  void insert_deferred_events(Arena& arena) REQUIRES(arena.mutex);
  // Deferred events recorded, completed events' blocks freed, on every stream (no capture).
  void catch_up_events() EXCLUDES(registry_mutex_, device_mutex_);
  void process_events_everywhere() EXCLUDES(registry_mutex_, device_mutex_);
  void synchronize_events(const AllArenasLock& all) REQUIRES(device_mutex_);
  void release_cache(const AllArenasLock& all) REQUIRES(device_mutex_);
  void release_spare_handles() REQUIRES(device_mutex_);
  std::size_t limit() const REQUIRES(device_mutex_) { return limit_ ? *limit_ : capacity_; }
  // The most pieces a handle that growth creates may hold (see grow()).
  std::size_t handle_cap() const REQUIRES(device_mutex_);
  // Reserved bytes on this device that count against limit(): this engine's and its peer's.
  std::size_t held() const REQUIRES(device_mutex_) { return reserved_ + peer_reserved_.bytes(); }
  void add_reserved(bool small, std::int64_t bytes) REQUIRES(device_mutex_);
  // `n` more (or, negative, fewer) handles in the segment statistics and the ledger.
  void add_segments(bool small, std::int64_t n) REQUIRES(device_mutex_);
  // A handle mapped live in a space of the other pool now counts in that pool's reserved
  // bytes and segments (what PyTorch's tools rebuild from a snapshot's segments).
  void move_handle_stats(Handle& h, bool to_small) REQUIRES(device_mutex_);
  // As Engine's (core/arena_engine.hpp), the arenas in creation order.
  std::vector<LedgerShare> ledger_shares(const AllArenasLock& all) const {
    return ledger_shares_of(all, all.arenas());
  }
  void settle_peak_debts(const AllArenasLock& all) const {
    ArenaEngine::settle_peak_debts(*this, all);
  }
  void settle_peak_debts() const EXCLUDES(registry_mutex_, device_mutex_) {
    ArenaEngine::settle_peak_debts(*this);
  }
  // Device-wide statistics: the device's own plus every arena's blocks (peaks settled).
  DeviceStats stats_locked(const AllArenasLock& all) const REQUIRES(device_mutex_);
  void record_trace(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream,
                    const Origin& stack) {
    if (tracing_.load(std::memory_order_relaxed)) {
      record_trace_entry(action, addr, size, stream, stack);
    }
  }
  void record_trace_entry(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream,
                          const Origin& stack) EXCLUDES(trace_mutex_);
  // An OutOfMemoryError: built with every lock held, raised (after the OOM observers are
  // told) with none.
  struct OomReport {
    std::string message;
    std::size_t requested = 0;
    std::size_t limit = 0;
    std::size_t free_bytes = 0;
  };
  OomReport prepare_oom(const AllArenasLock& all, Arena& arena, std::size_t requested,
                        std::size_t rounded, bool small, const Origin& stack)
      REQUIRES(device_mutex_, arena.mutex);
  [[noreturn]] void raise_oom(const OomReport& report) EXCLUDES(device_mutex_);
  [[noreturn]] void throw_not_live(const char* what, DevicePtr ptr) const;
  void after_operation() const {
    if (check_invariants_.load(std::memory_order_relaxed)) check_invariants();
  }
  void check_locked(const AllArenasLock& all) const REQUIRES(device_mutex_);

  Driver& driver_;
  // Written only by reconfigure(), under every arena lock and device_mutex_; read under an
  // arena lock or device_mutex_, except backend, stitch_segments and uncached (never written).
  Config config_;
  const std::uint64_t uid_;  // never reused: keys the per-thread arena cache
  std::atomic<bool> check_invariants_{false};
  bool parking_ = true;  // park(); off only in tests that compare against the pools alone
  // History (record_history): its switches, ring and annotations; the owner's trace lock is
  // trace_mutex_.
  HistoryRecorder recorder_;
  // The origin of the operation starting now; inlined, so capture_origin skips its frame.
  [[gnu::always_inline]] Origin capture() const { return recorder_.capture(); }

  // Set at construction, then read-only.
  std::size_t page_ = 0;         // the driver's granularity
  unsigned page_shift_ = 0;      // log2(page_) where a power of two above 1, else 0
  std::size_t space_pages_ = 0;  // pages reserved per space
  std::size_t capacity_ = 0;

  mutable Mutex registry_mutex_ ACQUIRED_BEFORE(device_mutex_, trace_mutex_);
  std::vector<std::unique_ptr<Arena>> arenas_ GUARDED_BY(registry_mutex_);
  std::unordered_map<StreamId, Arena*> arena_by_stream_ GUARDED_BY(registry_mutex_);
  OwnerTable<Arena> arena_table_;            // written under registry_mutex_
  std::atomic<std::size_t> arena_count_{0};  // arenas in arena_table_ (owners 1 .. count)
  std::atomic<bool> sharing_{false};         // more than one stream allocates: begin_sharing()
  std::atomic<std::size_t> fences_recorded_{0};
  std::atomic<std::size_t> borrow_waits_{0};       // growths that waited for a donor's fence
  std::atomic<std::size_t> busy_borrow_waits_{0};  // of those, on a donor with fences in flight
  // How long fences take to complete: an average of recent samples (complete_fences).
  std::atomic<std::int64_t> fence_latency_us_{0};
  std::atomic<std::size_t> fence_latency_samples_{0};
  // A free skips its poll's clock read while the cycle counter shows that the poll cannot
  // be due, with a 10 % margin (stitch/share.cpp, sync/cycle_gate.hpp).
  CycleGate fence_gate_;
  SegmentMap owners_;  // spaces' reservations; written under device_mutex_
  EventPool event_pool_;
  std::atomic<std::int64_t> pending_events_{0};  // sum of Arena::pending_events
  std::atomic<std::int64_t> deferred_frees_{0};  // sum of Arena::deferred sizes
  std::atomic<int> captures_underway_{0};
  PeerReserved peer_reserved_;
  DeviceReserved* device_reserved_ = nullptr;  // both engines' reserved bytes, or none
  JointSettlement* joint_ = nullptr;           // settled with another engine's arenas, or alone

  mutable Mutex device_mutex_ ACQUIRED_BEFORE(trace_mutex_);
  std::optional<std::size_t> limit_ GUARDED_BY(device_mutex_);
  double fraction_ GUARDED_BY(device_mutex_) = 1.0;
  PublishedSize reserved_ GUARDED_BY(device_mutex_);        // pieces held x page_
  std::size_t chunk_pieces_ GUARDED_BY(device_mutex_) = 0;  // least pieces large growth creates
  std::map<PhysicalHandle, std::unique_ptr<Handle>> handles_ GUARDED_BY(device_mutex_);
  // pieces live nowhere
  std::set<std::pair<PhysicalHandle, std::uint32_t>> spare_ GUARDED_BY(device_mutex_);
  std::size_t borrowed_handles_ GUARDED_BY(device_mutex_) = 0;
  std::size_t borrowed_pieces_ GUARDED_BY(device_mutex_) = 0;
  // segment, reserved_bytes and the counters; the block statistics are the arenas'
  DeviceStats stats_ GUARDED_BY(device_mutex_);

  Mutex observers_mutex_;
  std::vector<Allocator::OomObserver> oom_observers_ GUARDED_BY(observers_mutex_);
  std::vector<Allocator::FreeMemoryCallback> free_memory_callbacks_ GUARDED_BY(observers_mutex_);
  std::atomic<bool> has_free_memory_callbacks_{false};

  mutable Mutex trace_mutex_;
  std::vector<TraceObserver> trace_observers_ GUARDED_BY(trace_mutex_);
  OomFallbacks oom_fallbacks_;        // set before use, then read-only
  std::atomic<bool> tracing_{false};  // history recorded or observers attached
};

template <typename F>
bool StitchEngine::find_whole_handle(const Block& b, F&& f) const {
  const DevicePtr hi = b.end() / page_ * page_;
  const Space& bs = *b.space;
  for (DevicePtr va = (b.ptr + page_ - 1) / page_ * page_; va < hi;) {
    const Page& p = bs.pages[(va - bs.base) / page_];
    const std::size_t n = p.handle->live_at.size();
    if (p.piece == 0 && va + n * page_ <= hi) {
      if (f(va, p.handle)) return true;
      va += n * page_;
    } else {
      va += page_;
    }
  }
  return false;
}

}  // namespace ccalloc::core

// The hit path's block operations, inline (hot_path.hpp).
#include "stitch/hot_path.hpp"  // IWYU pragma: export
