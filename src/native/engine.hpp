// The engine behind ccalloc::Allocator (one per device).
//
// Model. Device memory is obtained in segments (Driver::allocate) and cut into blocks
// that tile each segment. Each stream has an Arena with two free pools (small: rounded
// requests <= 1 MiB in 2 MiB segments; large: the rest) ordered by (size, address) for best
// fit. malloc takes the best-fitting free block of its stream and splits off the rest;
// free returns the block and merges it with free neighbours. A block used on other
// streams waits for events recorded on them before it returns to its pool.
//
// Locks, in the order they may nest:
//   registry_mutex_  ->  Arena::mutex (several only via lock_all(), by creation order)
//   ->  order_mutex_ (PyTorch's order of streams)  ->  device_mutex_  ->  trace_mutex_ /
//   EventPool
// Members name the lock that guards them and private methods the lock they need
// (sync/thread_annotations.hpp); clang's -Wthread-safety checks that (scripts/test tsa).
// Code that relies on an arena lock taken through lock_all() says so with
// AllArenasLock::held().
// The hot path takes one arena lock: free finds the arena of a pointer in the SegmentMap,
// which readers consult without a lock, then the block in the arena's own index. The rare
// paths that act on every
// stream (GC, releasing the whole cache, the last steps of the OOM ladder, snapshots,
// the invariant checker) take every arena lock through lock_all().
// Block statistics live in the arenas; their device-wide peaks are the sums of per-arena
// baselines (the ledger described in arena.hpp). An operation that raises a counter above
// its arena's baseline settles under lock_all() after releasing the arena's lock and before
// returning; others touch nothing shared. Peaks are exact when operations do not overlap in
// time (every single-threaded program), else the peak of one order of the overlapping ones.
//
// Invariants, checked by check_invariants() in this order, one named check each (the
// error message names the check):
//   blocks_tile_segments       the blocks of a segment are linked both ways, each a positive
//                              multiple of 512 bytes, of one pool, and cover the segment
//                              without gaps; segments never overlap.
//   free_blocks_merged         no two adjacent free blocks (of the same mapped state).
//   pool_membership            every free block is in exactly one pool and no allocated or
//                              pending block is; every block is held in exactly one place
//                              (live index, pool, pending-event queue); every pooled block
//                              keeps its own place in its pool (Block::pool_pos).
//   expandable_segments        an expandable segment's blocks span its reservation and its
//                              mapped blocks add up to its mapped bytes; the unmapped lists
//                              hold only unmapped ranges.
//   stats_match_blocks         statistics and reserved bytes equal a recount from the blocks.
//   peaks_cover_current        every tracked block statistic of an arena not in peak debt is
//                              at most its baseline; with no arena in debt, the device's peak
//                              (sum of baselines) is at least its current value (arena.hpp).
//   reserved_within_capacity   reserved <= the device's capacity. (Not the per-process limit:
//                              set_memory_fraction may lower it below what is reserved.)
//   live_allocations_disjoint  live allocations never overlap.
//   private_pool_blocks        every arena of a private pool is listed by that pool (and
//                              the default pool's arenas by no pool); a block lies in a
//                              segment its own arena owns, so a private pool's blocks are
//                              only in its arenas; a pool's segment count equals its
//                              arenas' segments (plain segments plus expandable
//                              reservations); a free deferred during capture is in its
//                              arena's deferred list only, still has its stream uses, and
//                              the per-arena and device-wide deferred counts match.
//   sleepable_pools            a sleepable pool's segments are those its SleepableSegments
//                              hold, all with physical memory while it is awake and none
//                              while it sleeps (sleeping segments count neither as reserved
//                              nor as segments in stats_match_blocks); saved contents
//                              exist only while it sleeps and fit their host buffer.
//
// Private pools (docs/design.md#private-pools): an arena per (pool, stream). The default
// pool's arenas are found as before; only while a capture is underway
// (captures_underway_ != 0, one relaxed load on the hot path) does malloc consult the
// captures' stream filters under registry_mutex_.
#pragma once

#include <array>
#include <map>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "native/arena.hpp"
#include "sync/arena_cache.hpp"
#include "core/arena_engine.hpp"
#include "core/backend.hpp"
#include "core/block.hpp"
#include "core/device_reserved.hpp"
#include "core/event_pool.hpp"
#include "history/history.hpp"
#include "core/published_size.hpp"
#include "core/segment_map.hpp"
#include "core/stream_table.hpp"
#include "native/sleepable.hpp"
#include "sync/thread_annotations.hpp"

namespace ccalloc::core {

// A malloc request after rounding.
struct Request {
  std::size_t requested = 0;     // bytes the program asked for
  std::size_t size = 0;          // rounded size of the block
  std::size_t segment_size = 0;  // size of a new segment for it
  bool small = false;            // small pool
  StreamId stream = 0;
  bool exact = false;  // split off any remainder (restoring a checkpoint's block sizes)
};

class Engine final : public Backend {
 public:
  using OomObserver = Allocator::OomObserver;
  using FreeMemoryCallback = Allocator::FreeMemoryCallback;

  Engine(Driver& driver, Config config);
  ~Engine() override;

  DevicePtr malloc(std::size_t size, StreamId stream) override;
  void free(DevicePtr ptr) override;
  void record_stream(DevicePtr ptr, StreamId stream) override;
  void set_stream_order_key(StreamId stream, std::uint64_t key) override;
  void empty_cache() override;
  DeviceStats stats() const override;
  void reset_peak_stats() override;
  void reset_accumulated_stats() override;
  void set_memory_fraction(double fraction) override;
  double memory_fraction() const override;
  std::vector<SegmentInfo> segments() const override;
  std::size_t allocation_size(DevicePtr ptr) const override;
  ipc::SharedRegion shared_region(DevicePtr ptr) const override;  // expandable.cpp
  void add_oom_observer(OomObserver observer) override;
  void add_free_memory_callback(FreeMemoryCallback callback) override;
  void add_trace_observer(TraceObserver observer) override;
  void check_invariants() const override;
  void set_check_invariants(bool on) override { check_invariants_.store(on); }

  // Beside the stitching policy (stitch/backend.hpp), which serves the default pools:
  // the reserved bytes of that engine, counted against this one's memory limit; this
  // engine's reserved bytes, read without its locks; and a use_on_oom pool's free block for
  // a default-pool request the other engine could not serve (its address, or 0).
  void set_peer_reserved(const std::atomic<std::size_t>* peer) { peer_reserved_.set(peer); }
  // Beside the stitching policy (core::StitchBackend), whose empty_cache() synchronizes and
  // counts once for the device: this engine's empty_cache() then synchronizes uncounted, so
  // num_sync_all_streams rises by one per empty_cache(), as on PyTorch.
  void set_empty_cache_sync_counted_elsewhere() { empty_cache_sync_counted_ = false; }
  // The page of the large pool's expandable segments: large_segment_size (20 MiB, as
  // PyTorch) unless set here before the engine is used. Beside the stitching policy the
  // private pools take 2 MiB pages, so that a graph pool's segment ends at most 2 MiB past
  // its blocks instead of up to 20 MiB (the policy's own pages are 2 MiB as well).
  void set_expandable_large_page(std::size_t bytes) { expandable_large_page_ = bytes; }
  // What this engine's malloc does first, and a backend whose other mallocs go elsewhere
  // (core::StitchBackend) calls too: unless a capture is underway, records the events of
  // frees deferred during a capture and returns the frees whose events have completed, so
  // that they wait no longer than on PyTorch, whose every malloc processes every event. Two
  // relaxed loads when nothing waits.
  void poll_events() EXCLUDES(registry_mutex_, device_mutex_) {
    if ((pending_events_.load(std::memory_order_relaxed) > 0 ||
         deferred_frees_.load(std::memory_order_relaxed) > 0) &&
        !capturing()) {
      process_events_everywhere();
    }
  }
  // Where every change of this engine's reserved bytes is also reported, for device-wide
  // peaks over both engines (core/device_reserved.hpp); set before the engine is used.
  void set_device_reserved(DeviceReserved* ledger) { device_reserved_ = ledger; }
  // Settles this engine's peak debts together with the other engine's (core/peak_ledger.hpp,
  // JointSettlement): from then on an operation that leaves an arena in debt marks `joint`
  // and the owner settles; set before the engine is used.
  void set_joint_settlement(JointSettlement* joint) { joint_ = joint; }
  // Calls f with every arena's ledger share, under every arena lock (none held by the
  // caller; the owner nests the other engine's call inside f).
  void with_ledger_shares(const std::function<void(std::vector<LedgerShare>&)>& f) const
      EXCLUDES(registry_mutex_, device_mutex_) {
    ArenaEngine::with_ledger_shares(*this, f);
  }
  // The published copy is an atomic of its own: no lock (the analysis cannot see past the
  // guarded member that holds it).
  const std::atomic<std::size_t>& published_reserved() const NO_THREAD_SAFETY_ANALYSIS {
    return reserved_.published();
  }
  DevicePtr malloc_on_oom(std::size_t size, StreamId stream);

  // Private pools (pools.cpp).
  void create_pool(PoolId id, std::optional<SegmentSource> source) override;
  void release_pool(PoolId id) override;
  int pool_use_count(PoolId id) const override;
  void set_pool_use_on_oom(PoolId id, bool use_on_oom) override;
  void set_pool_no_split(PoolId id) override;
  void begin_allocate_to_pool(PoolId id, Allocator::StreamFilter filter) override;
  void end_allocate_to_pool(PoolId id) override;
  void empty_cache(PoolId id) override;
  std::vector<DevicePtr> pool_live_allocations(PoolId id) const override;
  std::vector<SegmentInfo> pool_segments(PoolId id) const override;
  PoolId segment_pool(DevicePtr address) const override;
  std::shared_ptr<const PoolCheckpoint> checkpoint_pool(PoolId id) override;
  PoolRestore restore_pool(const PoolCheckpoint& checkpoint) override;
  // Sleepable pools (sleep.cpp, docs/sleep-wake.md).
  void create_sleepable_pool(PoolId id) override;
  void sleep_pool(PoolId id, SleepMode mode) override;
  void wake_pool(PoolId id) override;
  bool pool_asleep(PoolId id) const override;
  PoolSleepInfo pool_sleep_info(PoolId id) const override;
  const char* policy_name() const override { return "the native engine"; }

  // The live config. reconfigure() changes it in place: reading it on another thread while
  // a reconfiguration runs is a data race (the fields that cannot change excepted).
  const Config& config() const override { return config_; }
  // Applies `config` live (reconfigure.cpp says which keys may change). Throws ConfigError
  // naming a key that cannot change while the allocator is live; then nothing changed.
  bool reconfigure(const Config& config) override EXCLUDES(registry_mutex_, device_mutex_);
  Driver& driver() const override { return driver_; }
  void after_operation() const {
    if (check_invariants_.load(std::memory_order_relaxed)) check_invariants();
  }
  std::size_t capacity() const { return capacity_; }

  Driver& driver_;
  // Written only by reconfigure(), under every arena lock and device_mutex_; read under an
  // arena lock or device_mutex_, except backend, stitch_segments and uncached (never written).
  Config config_;
  std::atomic<bool> check_invariants_{false};

  // Observers; guarded by observers_mutex_ (copied out before calls without locks).
  Mutex observers_mutex_;
  std::vector<OomObserver> oom_observers_ GUARDED_BY(observers_mutex_);
  std::vector<FreeMemoryCallback> free_memory_callbacks_ GUARDED_BY(observers_mutex_);
  std::atomic<bool> has_free_memory_callbacks_{false};
  Mutex trace_mutex_;
  std::vector<TraceObserver> trace_observers_ GUARDED_BY(trace_mutex_);

  // What record_trace() and the hot path do, read once per operation.
  enum TraceFlags : unsigned {
    kTraceObservers = 1,    // trace observers are attached
    kTraceHistory = 2,      // entries go to the history ring
    kCaptureOnMalloc = 4,   // malloc captures its stack
    kCaptureOnFree = 8,     // free and empty_cache capture theirs
    kStacksOnEntries = 16,  // entries carry the operation's stack
    kStacksOnBlocks = 32,   // blocks and segments keep their allocation's stack
    kCppStacks = 64,        // a capture takes the C++ stack
    kCallerContexts = 128,  // a capture takes the caller's context (HistoryOptions)
  };
  std::atomic<unsigned> trace_flags_{0};
  ContextSource contexts_;  // HistoryOptions::capture_context
  // The origin of the operation starting now (malloc, free, empty_cache), as `flags` ask.
  // Inlined into the operation, so capture_origin skips the operation's frame.
  [[gnu::always_inline]] Origin capture(unsigned flags) const {
    return capture_origin(flags & kCppStacks, flags & kCallerContexts ? &contexts_ : nullptr);
  }

  void record_history(const HistoryOptions& options) override;
  void annotate(std::string_view name, bool start) override;
  Snapshot snapshot() override;
  // The snapshot, with or without its trace entry; the entry counts `other_active_bytes`
  // beside this engine's active bytes (a backend that runs engines side by side records
  // one entry for the device: stitch/backend.cpp).
  Snapshot snapshot(bool trace_entry, std::int64_t other_active_bytes);

 private:
  // Holds every arena lock (and the registry, so no arena appears meanwhile), and pools
  // every parked block first: views, statistics and the ladder see free memory pooled.
  class AllArenasLock {
   public:
    // The analysis cannot follow a lock per element of a vector: users tell it which arena
    // they rely on through held().
    explicit AllArenasLock(const Engine& engine) NO_THREAD_SAFETY_ANALYSIS;
    ~AllArenasLock() NO_THREAD_SAFETY_ANALYSIS;
    // `arena` (one of the engine's) is locked while this object lives.
    void held(const Arena& arena) const ASSERT_CAPABILITY(arena.mutex) { arena.mutex.assert_held(); }
    AllArenasLock(const AllArenasLock&) = delete;
    AllArenasLock& operator=(const AllArenasLock&) = delete;
    // Arenas sorted by stream: PyTorch's pool order (stream, size, address).
    const std::vector<Arena*>& by_stream() const { return by_stream_; }

   private:
    const Engine& engine_;
    std::unique_lock<Mutex> registry_;
    std::vector<Arena*> by_stream_;
  };

  // `all` holds the registry lock too: tells the analysis.
  void registry_held(const AllArenasLock& all) const ASSERT_CAPABILITY(registry_mutex_) {
    (void)all;
    registry_mutex_.assert_held();
  }
  // The stream's arena: the thread's cache, else the registry (arena_for_registry).
  Arena& arena_for(StreamId stream) {
    if (Arena* cached = ThreadArenaCache<Arena>::find(uid_, stream)) [[likely]] return *cached;
    return arena_for_registry(stream);
  }
  Arena& arena_for_registry(StreamId stream);
  // The arena of a new malloc while a capture is underway: the capturing pool's arena for
  // `stream` when a capture's filter takes the stream, else the default one.
  Arena& arena_for_capture(StreamId stream) EXCLUDES(registry_mutex_);
  // Creates an arena for `stream` in `pool` (nullptr: the default pool).
  Arena& make_arena(StreamId stream, PrivatePool* pool) REQUIRES(registry_mutex_);
  Arena& pool_arena(PrivatePool& pool, StreamId stream) REQUIRES(registry_mutex_);
  PrivatePool& pool_of(PoolId id) const REQUIRES(registry_mutex_);  // throws for unknown ids
  PrivatePool& create_or_incref_pool(PoolId id, std::optional<SegmentSource> source,
                                     std::shared_ptr<SleepableSegments> sleepable = nullptr)
      REQUIRES(registry_mutex_);
  // --- sleepable pools (sleep.cpp) ---
  // Pool `id` if it is sleepable, else Error naming `what`.
  PrivatePool& sleepable_pool(PoolId id, const char* what) const REQUIRES(registry_mutex_);
  // Error naming `what` while any capture is underway.
  void refuse_during_capture(PoolId id, const char* what) const REQUIRES(registry_mutex_);
  [[noreturn]] static void throw_asleep(const PrivatePool& pool, const char* what);
  // True when the segment of `arena` starting at `base` has no physical memory now (its
  // sleepable pool sleeps): it counts neither as reserved nor as a segment.
  static bool segment_asleep(const Arena& arena, DevicePtr base);
  // Maps memory at every segment of the sleeping pool again, within the memory limit;
  // false, with nothing mapped, when the device or the limit refuses.
  bool back_pool(const AllArenasLock& all, PrivatePool& pool);
  bool capturing() const { return captures_underway_.load(std::memory_order_acquire) != 0; }
  Request make_request(std::size_t size, StreamId stream) const;

  std::vector<Arena*> arena_list() const;
  // malloc and free once any history context is set up.
  DevicePtr malloc_cached(std::size_t size, StreamId stream);
  void free_cached(DevicePtr ptr);
  // Their bodies: inline into malloc and free where no history is recorded (a call frame
  // spared on the hit), out of line through malloc_cached and free_cached where it is (the
  // stack a history entry captures skips a known number of frames).
  DevicePtr malloc_body(std::size_t size, StreamId stream);
  void free_body(DevicePtr ptr);
  // The arena whose segment holds `ptr` (read without a lock), or nullptr. Whether `ptr`
  // is live there is for the arena's index to say, under the arena's lock.
  Arena* arena_of(DevicePtr ptr) const { return arena_by_owner(owners_.owner_of(ptr)); }
  // The block handed out at `ptr` (nullptr: none), under its arena's lock (ArenaEngine):
  // the live index also holds the parked block, which is not allocated.
  static Block* live_block(const Arena& arena, DevicePtr ptr) REQUIRES(arena.mutex) {
    Block* const b = arena.live.find(ptr);
    return b != nullptr && b->allocated ? b : nullptr;
  }
  Arena* arena_by_owner(SegmentMap::Owner owner) const;
  // `what` names the operation: "free of pointer 0x... which is not live".
  [[noreturn]] void throw_not_live(const char* what, DevicePtr ptr) const;

  // --- hot path (arena lock held) ---
  using PoolPos = FreePool::Blocks::iterator;
  // Best fit from the arena's pool, or the pool's end(). advance_gc_clock: this search
  // counts as one tick of the age-based GC's clock (once per malloc, as in PyTorch).
  PoolPos find_free_block(Arena& arena, const Request& req, bool advance_gc_clock) REQUIRES(arena.mutex);
  // Carves the request out of a free block (`pos` in its pool, or a fresh segment's block
  // with `pos` == the pool's end()), indexes and traces it; returns its address.
  DevicePtr hand_out(Arena& arena, Block* block, PoolPos pos, const Request& req) REQUIRES(arena.mutex);
  Block* carve(Arena& arena, Block* block, PoolPos pos, const Request& req) REQUIRES(arena.mutex);
  void release_allocation(Arena& arena, Block* block) REQUIRES(arena.mutex);
  void free_block(Arena& arena, Block* block) REQUIRES(arena.mutex);
  // The statistics of a handed-out block, in pool `t` (its pool's entries; carve).
  void count_handed_out(Arena& arena, Block* block, const Request& req, StatType t)
      REQUIRES(arena.mutex);
  // The statistics of a block no longer allocated (release_allocation, unpark).
  void count_released(Arena& arena, const Block* block) REQUIRES(arena.mutex);
  // The statistics of a free block pooled: `net_split_*` are the change in inactive split
  // blocks and bytes its merges made (free_block): count_inactive_split and
  // count_deactivated.
  void count_pooled(Arena& arena, bool small, std::int64_t net_split_blocks,
                    std::int64_t net_split_bytes, std::int64_t size, std::size_t requested)
      REQUIRES(arena.mutex);
  void count_inactive_split(Arena& arena, StatType t, std::int64_t net_split_blocks,
                            std::int64_t net_split_bytes) REQUIRES(arena.mutex);
  // A block of `size` bytes, `requested` of them asked for, is no longer active.
  void count_deactivated(Arena& arena, StatType t, std::int64_t size, std::size_t requested)
      REQUIRES(arena.mutex);
  // Adds what the arena's takes of its parked blocks left to the statistics' cumulative
  // counts (Arena::taken): before anything reads them.
  static void flush_taken(Arena& arena) REQUIRES(arena.mutex);
  // Puts a free block in its pool merged with its free neighbours (the structure only);
  // returns the merged block and adds the inactive split changes to the `net_split_*`.
  Block* merge_into_pool(Arena& arena, Block* block, std::int64_t& net_split_blocks,
                         std::int64_t& net_split_bytes) REQUIRES(arena.mutex);
  // A block counts as free for merging: in no use, no event outstanding.
  static bool is_free(const Block* b) {
    return b != nullptr && b->mapped && !b->allocated && b->event_count == 0 &&
           b->stream_uses.empty();  // a deferred free still has its stream uses
  }
  // --- the parked block (engine.cpp) ---
  // A free that would pool its block at once with nothing before it to merge with, on a
  // default-pool arena with no history, trace, capture or GC, parks the block instead
  // (Arena::parked), counting it as the free would; true when it did.
  bool park(Arena& arena, Block* block) REQUIRES(arena.mutex);
  // A request the pools would serve with the parked block merged with the free block after
  // it takes it as it is (its address; the rest stays pooled as it is); any other pools it
  // first and returns 0.
  DevicePtr take_parked(Arena& arena, const Request& req) REQUIRES(arena.mutex);
  // Pools the arena's parked block as its free would have (its statistics were counted at
  // the park).
  void unpark(Arena& arena) REQUIRES(arena.mutex);
  void insert_into_pool(FreePool& pool, Block* block);
  // Re-sorts a pooled block whose key changed in place, if its order changed: a block that
  // shrank can only have fallen below its predecessor, one that grew risen above its
  // successor.
  enum class Change { kShrank, kGrew };
  void fix_pool_position(FreePool& pool, PoolPos pos, Change change);
  std::uint64_t gc_clock(const FreePool& pool) const {
    return pool_searches_[pool.is_small ? 0 : 1].load(std::memory_order_relaxed);
  }

  // --- events (arena lock held) ---
  void insert_events(Arena& arena, Block* block) REQUIRES(arena.mutex);
  // Returns true when it stopped early at a free that left the arena in peak debt.
  bool process_events(Arena& arena) REQUIRES(arena.mutex);
  void process_events_everywhere() EXCLUDES(registry_mutex_, device_mutex_);  // no lock held
  // Records the events of the arena's deferred frees (no capture may be underway).
  void insert_deferred_events(Arena& arena) REQUIRES(arena.mutex);
  // Empties the arena's deferred frees (their events recorded) and ends its capture reach.
  void forget_deferred(Arena& arena) REQUIRES(arena.mutex);
  // --- reuse inside a capture (graph_capture_record_stream_reuse; events.cpp) ---
  // The free markers of `block`, freed during a capture: the terminal nodes of its stream
  // and of every stream that used it; empty when one of them is not capturing, or in
  // another capture, so that the block waits for the capture's end. Sets `capture` to the
  // capture's id.
  std::vector<GraphNode> free_markers(Arena& arena, const Block* block, std::uint64_t& capture)
      REQUIRES(arena.mutex);
  // Returns to the pool every deferred free of the arena whose markers all reach the
  // stream's terminals in the capture graph.
  void reuse_in_capture(Arena& arena) REQUIRES(arena.mutex);
  // Waits for the pending frees of every arena (only those of `pool`'s arenas if given);
  // counted in num_sync_all_streams unless `counted` is false.
  void synchronize_and_free_events(const AllArenasLock& all, const PrivatePool* pool = nullptr,
                                   bool counted = true);
  // --- PyTorch's order of streams (set_stream_order_key; events.cpp) ---
  // With stream keys, polling and waiting visit the streams' pending frees in the order of
  // PyTorch's table of streams (core/stream_table.hpp), each stream's in the order they
  // were made across arenas, and record deferred frees' events in the order they were made.
  bool ordered_events() const { return ordered_events_.load(std::memory_order_acquire); }
  void process_events_in_pytorch_order() EXCLUDES(registry_mutex_, device_mutex_);
  void synchronize_in_pytorch_order(const AllArenasLock& all);
  void insert_all_deferred_events(const AllArenasLock& all);
  std::uint64_t order_key(StreamId stream) const REQUIRES(order_mutex_);
  // The stream a key names (the key itself for streams given none).
  StreamId stream_of_key(std::uint64_t key) const REQUIRES(order_mutex_);
  // Takes the oldest pending free of `stream` (across arenas) out of its queue once its
  // event has completed (waiting for it if `wait`), returning its block when it was the
  // last; false when there is none or it has not completed.
  bool retire_oldest(const AllArenasLock& all, StreamId stream, bool wait);
  // The same for every stream without a place in the table, stream by stream.
  void retire_unkeyed(const AllArenasLock& all, bool wait);

  // --- device-wide peaks (stats.cpp; the baseline ledger of arena.hpp) ---
  // Every arena's part of the ledger (every arena lock held).
  std::vector<LedgerShare> ledger_shares(const AllArenasLock& all) const {
    return ledger_shares_of(all, all.by_stream());
  }
  // Settles every arena's peak debt (every arena lock held).
  void settle_peak_debts(const AllArenasLock& all) const {
    ArenaEngine::settle_peak_debts(*this, all);
  }
  // The same, taking every arena lock (none held).
  void settle_peak_debts() EXCLUDES(registry_mutex_, device_mutex_) {
    ArenaEngine::settle_peak_debts(*this);
  }

  // --- OOM ladder (oom_ladder.cpp) ---
  // Runs the ladder for a request the arena's pool could not serve; called with the
  // arena's lock, returns with every lock released. Throws OutOfMemoryError.
  DevicePtr malloc_slow(Arena& arena, const Request& req, std::unique_lock<ArenaMutex> lock);
  Block* allocate_segment(Arena& arena, const Request& req, bool is_retry) REQUIRES(arena.mutex);
  void release_segment(Arena& arena, Block* block) REQUIRES(arena.mutex);
  bool release_oversize_blocks(Arena& arena, const Request& req) REQUIRES(arena.mutex);
  // Releases the cached segments of the default pool and of every pool whose use count is
  // 0 (only pool `only`'s if given), then unlists pools left without segments.
  void release_cached_segments(const AllArenasLock& all, const PrivatePool* only = nullptr,
                               bool sync_counted = true);
  void release_arena_cache(const AllArenasLock& all, Arena& arena, bool small);
  // A use_on_oom pool's free block for a default-pool request that found nothing else:
  // its address, or 0.
  DevicePtr malloc_from_oom_pools(const AllArenasLock& all, const Request& req);
  void collect_garbage(const AllArenasLock& all);
  // Recounts the oversize counters after max_split_size changed (reconfigure.cpp).
  void recount_oversize(const AllArenasLock& all) REQUIRES(device_mutex_);
  bool gc_enabled() const { return config_.garbage_collection_threshold > 0.0; }
  std::size_t memory_limit_locked() const REQUIRES(device_mutex_);
  [[noreturn]] void raise_oom(Arena& arena, const Request& req, std::unique_ptr<AllArenasLock> all);
  bool run_free_memory_callbacks();

  // --- expandable segments (expandable.cpp) ---
  bool expandable() const { return config_.expandable_segments; }
  std::size_t expandable_reserve_bytes() const;
  Block* find_expandable_block(Arena& arena, FreePool& pool, std::size_t size) REQUIRES(arena.mutex);
  bool map_block(Arena& arena, Block* b, std::size_t size) REQUIRES(arena.mutex);
  void merge_mapped_neighbours(Arena& arena, Block* b) REQUIRES(arena.mutex);
  Block* allocate_expandable(Arena& arena, const Request& req) REQUIRES(arena.mutex);
  Block* unmap_block(Arena& arena, Block* b) REQUIRES(arena.mutex);
  void release_expandable_segment(Arena& arena, Block* b) REQUIRES(arena.mutex);

  // --- uncached mode ---
  DevicePtr malloc_uncached(std::size_t size);
  void free_uncached(DevicePtr ptr);

  // Sends an entry to the trace observers and the history. `block` is the block the entry
  // is about (its stacks stand in when the operation captured none), or nullptr.
  void record_trace(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream,
                    const Block* block) {
    if (trace_flags_.load(std::memory_order_relaxed) & (kTraceObservers | kTraceHistory)) {
      record_trace_entry(action, addr, size, stream, block);
    }
  }
  void record_trace_entry(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream,
                          const Block* block);
  void add_segment_stats(bool small, std::size_t size, std::int64_t sign) REQUIRES(device_mutex_);
  // The reserved-bytes statistic of the pool and the aggregate, and the ledger beside it.
  void add_reserved_bytes(bool small, std::int64_t bytes) REQUIRES(device_mutex_);
  // Blocks of every segment of `arena`, grouped by segment (every arena lock held).
  std::vector<std::vector<const Block*>> segments_of(const Arena& arena) const REQUIRES(arena.mutex);
  // As segments_of(), with each expandable segment split into its runs of mapped blocks:
  // the segments a snapshot reports.
  std::vector<std::vector<const Block*>> reported_segments(const Arena& arena) const
      REQUIRES(arena.mutex);
  // A block's state as segments() and snapshots report it.
  static BlockState state_of(const Block* b);
  // The header and sizes of a segment made of `blocks` (one of reported_segments()), which
  // SegmentInfo and SnapshotSegment both carry; the caller adds its pool and blocks.
  template <typename Segment>
  void describe_segment(Segment& seg, const Arena& arena,
                        const std::vector<const Block*>& blocks) const REQUIRES(arena.mutex);

  // --- invariants (invariants.cpp): one check per invariant of the header's list, in its
  // order; each throws InvariantError naming itself. Every arena lock is held. ---
  struct InvariantWalk {
    struct ArenaBlocks {
      const Arena* arena;
      std::vector<std::vector<const Block*>> segments;  // segments_of(*arena)
    };
    std::vector<ArenaBlocks> arenas;  // by stream
  };
  InvariantWalk walk_for_invariants(const AllArenasLock& all) const;
  void check_blocks_tile_segments(const InvariantWalk& walk) const;
  void check_free_blocks_merged(const InvariantWalk& walk) const;
  void check_pool_membership(const InvariantWalk& walk) const;
  void check_expandable_segments(const InvariantWalk& walk) const;
  void check_stats_match_blocks(const InvariantWalk& walk) const;
  void check_peaks_cover_current(const InvariantWalk& walk) const;
  void check_reserved_within_capacity() const;
  void check_live_allocations_disjoint(const InvariantWalk& walk) const;
  void check_private_pool_blocks(const InvariantWalk& walk) const;
  void check_sleepable_pools(const InvariantWalk& walk) const;

  // Tests reach the state through it to corrupt it on purpose (invariants_test.cpp) or
  // to turn parking off (native_park_test.cpp).
  friend struct EngineTestAccess;
  bool parking_ = true;  // park(); off only in tests that compare against the pools alone
  // What it does alike with the stitching policy (core/arena_engine.hpp).
  friend struct ArenaEngine;

  const std::uint64_t uid_;  // never reused: keys the per-thread arena cache

  mutable Mutex registry_mutex_ ACQUIRED_BEFORE(device_mutex_, trace_mutex_);
  std::vector<std::unique_ptr<Arena>> arenas_ GUARDED_BY(registry_mutex_);
  std::unordered_map<StreamId, Arena*> arena_by_stream_ GUARDED_BY(registry_mutex_);  // default pool
  // Private pools by id; pools that are gone stay alive in retired_pools_ (their arenas
  // point at them).
  std::map<PoolId, std::unique_ptr<PrivatePool>> pools_ GUARDED_BY(registry_mutex_);
  std::vector<std::unique_ptr<PrivatePool>> retired_pools_ GUARDED_BY(registry_mutex_);
  // Captures underway: the pool each allocates to and its stream filter (PyTorch's
  // captures_underway), and their number, read without the lock.
  std::vector<std::pair<PoolId, Allocator::StreamFilter>> captures_ GUARDED_BY(registry_mutex_);
  std::atomic<int> captures_underway_{0};
  std::atomic<std::int64_t> deferred_frees_{0};  // sum of Arena::deferred_count

  // Arenas by SegmentMap owner (creation index + 1), readable without a lock.
  OwnerTable<Arena> arena_table_;  // written under registry_mutex_
  SegmentMap owners_;                                      // written under device_mutex_
  EventPool event_pool_;
  std::atomic<std::int64_t> pending_events_{0};  // sum of Arena::pending_events
  // Counters that order events and deferred frees across arenas (PendingFree::seq,
  // DeferredFree::seq).
  std::atomic<std::uint64_t> event_seq_{0};
  std::atomic<std::uint64_t> deferred_seq_{0};
  // PyTorch's order of streams (set_stream_order_key): the keys, and the table of streams
  // with pending events as PyTorch's allocator holds it. A leaf lock, taken under arena
  // locks; free_block (device_mutex_, trace_mutex_) may run under it.
  mutable Mutex order_mutex_;
  std::atomic<bool> ordered_events_{false};
  std::unordered_map<StreamId, std::uint64_t> order_keys_ GUARDED_BY(order_mutex_);
  std::unordered_map<std::uint64_t, StreamId> order_streams_ GUARDED_BY(order_mutex_);
  StreamTable event_streams_ GUARDED_BY(order_mutex_);
  // Searches of each pool kind since start: the clock of the age-based GC. Advanced only
  // while GC is enabled. [0] small, [1] large.
  std::array<std::atomic<std::uint64_t>, 2> pool_searches_{};

  // Device-wide state, guarded by device_mutex_.
  mutable Mutex device_mutex_ ACQUIRED_BEFORE(trace_mutex_);
  // segment, reserved_bytes, oversize_segments, counters
  DeviceStats device_stats_ GUARDED_BY(device_mutex_);
  PublishedSize reserved_ GUARDED_BY(device_mutex_);  // bytes held from the device
  PeerReserved peer_reserved_;  // the engine beside this one (stitch/backend.hpp)
  bool empty_cache_sync_counted_ = true;       // set_empty_cache_sync_counted_elsewhere()
  std::size_t expandable_large_page_ = 0;      // 0: large_segment_size
  DeviceReserved* device_reserved_ = nullptr;  // both engines' reserved bytes, or none
  JointSettlement* joint_ = nullptr;            // settled with another engine's arenas, or alone
  std::size_t capacity_ = 0;          // device memory, read once at construction
  // per_process_memory_fraction x capacity
  std::optional<std::size_t> limit_ GUARDED_BY(device_mutex_);
  double fraction_ GUARDED_BY(device_mutex_) = 1.0;

  HistoryRing history_;
  Mutex annotations_mutex_;
  std::vector<Annotation> annotations_ GUARDED_BY(annotations_mutex_);

  Mutex uncached_mutex_;
  std::unordered_map<DevicePtr, std::size_t> uncached_ GUARDED_BY(uncached_mutex_);
};

}  // namespace ccalloc::core
