// The stitching policy's sharing of physical memory between streams (docs/ccalloc-policy.md,
// rule 9). Without it a stream's free pages serve only that stream until the OOM ladder
// synchronizes: streams that reach their highs at different times (a training step's
// compute stream, its collectives' streams, side streams) each keep their own high, and the
// device holds their sum.
//
// A page's uses are done on every stream once (a) its own stream has run past its last
// free there and (b) every other stream that used it (record_stream) has run past that
// free, which free() waits for with events before the page is freed at all. So only (a)
// needs tracking: each free stamps its pages with the arena's epoch, and a fence (an event
// recorded on the stream) closes the epoch. Once the fence has completed (queried, never
// waited for), every page stamped at or below its epoch may back another stream's growth
// with no synchronization: the handle is mapped at the borrower's frontier, and its pages
// in the lender's space become void (dead), as a lend within one stream leaves them. Under
// stream_borrow_wait a page whose fence is still in flight may serve too: the borrower's
// stream then waits on the device (cudaStreamWaitEvent) for the oldest fence covering it,
// and the handle takes the borrower's epoch, so that it passes on only behind a fence of
// the borrower's recorded after that wait.
//
// Fences are recorded by frees: a free polls its arena's fences at most once per
// kFenceIntervalUs, and records one where pages were freed since the last fence and that
// fence is that old (on a wall clock, a free skips the clock read while the cycle counter
// shows that its poll cannot be due: fence_gate_). A growth that would create memory polls every
// other stream's fences (under that stream's lock if it can take it at once: a stream whose lock is
// held is skipped) before looking for pages to take.
#include <algorithm>
#include <limits>

#include "stitch/engine.hpp"
#include "stitch/tunables.hpp"

namespace ccalloc::core {
namespace {

// Fences in flight per stream: where the GPU runs further behind than this many intervals,
// the stream records the next one when the oldest completes.
constexpr std::size_t kMaxFences = 16;
// Frees that may skip the cycle-counter read in a row (note_free): at most this many frees
// go by without a look at the time.
#ifndef CCALLOC_MAX_FENCE_SKIPS
#define CCALLOC_MAX_FENCE_SKIPS 16  // 0 for the read at every free (a build for comparison)
#endif
constexpr std::uint32_t kMaxFenceSkips = CCALLOC_MAX_FENCE_SKIPS;
// A fence found complete within this long of the query before it gives a sample of the
// GPU's lag (see complete_fences).
constexpr std::int64_t kLatencyBracketUs = 2 * kFenceIntervalUs;
// Where fences complete within this long on average (after kLatencySamples samples), a
// growth may take a whole handle beyond what it lacks: the donor, should it need the pages
// again, gets them back as quickly. Where the GPU runs further behind, the donor would
// create memory instead, and a growth takes no more than it would create.
constexpr std::int64_t kQuickFenceUs = 5000;
constexpr std::size_t kLatencySamples = 8;

}  // namespace

std::uint64_t StitchEngine::stamp_of(const Space& s, DevicePtr va, std::size_t n) const {
  const std::size_t first = (va - s.base) / page_;
  std::uint64_t stamp = 0;
  for (std::size_t p = first; p < first + n; ++p)
    stamp = std::max(stamp, s.pages[p].freed);
  return stamp;
}

// The free's stamp and a skip granted are note_free's inline part (hot_path.hpp).
void StitchEngine::note_free_poll(Arena& arena) {
  // The poll below returns at once until kFenceIntervalUs after the last: where the cycle
  // counter shows that this is still so, the clock need not be read to know (a counter
  // that went backwards shows a huge span: the clock is read).
  if (arena.fence_clock_span != 0) {
    const std::uint64_t now = cycle_count();
    const std::uint64_t since = now - arena.fence_clock_cycles;
    if (since < arena.fence_clock_span) {
      arena.fence_skips = frees_within(now - arena.fence_read_cycles,
                                       arena.fence_skips_granted + 1,
                                       arena.fence_clock_span - since, kMaxFenceSkips);
      arena.fence_skips_granted = arena.fence_skips;
      arena.fence_read_cycles = now;
      return;
    }
  }
  arena.fence_skips = arena.fence_skips_granted = 0;
  refresh_fences(arena, /*polled=*/true);
  arena.fence_read_cycles = arena.fence_clock_cycles;
}

void StitchEngine::refresh_fences(Arena& arena, bool polled) {
  if (capturing()) return;  // no event may be queried or recorded during a capture
  // The counter is read on both sides of the clock: a thread preempted between two of the
  // reads must neither shut the gate (CycleGate::observe) nor stretch the next skip.
  const std::uint64_t before = polled && fence_gate_.on() ? cycle_count() : 0;
  const std::int64_t now = driver_.now_us();
  if (polled) {
    const bool due =
        !(now >= arena.fences_polled_us && now - arena.fences_polled_us < kFenceIntervalUs);
    if (due) arena.fences_polled_us = now;
    if (fence_gate_.on()) {
      // The counter against the clock since the last read (calibration, then a check),
      // and the ticks before the next poll is due, counted from the read before the clock.
      const std::uint64_t after = cycle_count();
      fence_gate_.observe(after, now, arena.fence_clock_cycles, arena.fence_clock_us);
      arena.fence_clock_us = now;
      arena.fence_clock_cycles = before;
      arena.fence_clock_span =
          fence_gate_.ticks_for(arena.fences_polled_us + kFenceIntervalUs - now);
    }
    if (!due) return;
  }
  complete_fences(arena);
  if (!arena.unfenced || arena.fences.size() >= kMaxFences) return;
  if (!arena.fences.empty() && now >= arena.fences.back().at_us &&
      now - arena.fences.back().at_us < kFenceIntervalUs) {
    return;
  }
  record_fence(arena);
}

void StitchEngine::complete_fences(Arena& arena) {
  if (arena.fences.empty()) return;
  const std::int64_t now = driver_.now_us();
  // A fence found complete soon after a query found it pending completed about now: its
  // age is a sample of how far the GPU runs behind (a fence first queried long after it
  // completed says nothing).
  const bool bracketed =
      now >= arena.fences_queried_us && now - arena.fences_queried_us <= kLatencyBracketUs;
  arena.fences_queried_us = now;
  // A stream completes its work in order: the oldest fences first.
  while (!arena.fences.empty() && driver_.query_event(arena.fences.front().event)) {
    const Fence& f = arena.fences.front();
    if (bracketed && now >= f.at_us) {
      // An average over about the last eight samples; concurrent updates may lose one.
      const std::int64_t old = fence_latency_us_.load(std::memory_order_relaxed);
      const std::int64_t sample = now - f.at_us;
      fence_latency_us_.store(fence_latency_samples_.load(std::memory_order_relaxed) == 0
                                  ? sample
                                  : old + (sample - old) / 8,
                              std::memory_order_relaxed);
      fence_latency_samples_.fetch_add(1, std::memory_order_relaxed);
    }
    arena.safe_epoch = f.epoch;
    event_pool_.put(f.event);
    arena.fences.pop_front();
  }
}

EventId StitchEngine::record_fence(Arena& arena) {
  const EventId e = event_pool_.get();
  driver_.record_event(e, arena.stream);
  arena.fences.push_back(Fence{e, arena.epoch, driver_.now_us()});
  ++arena.epoch;
  arena.unfenced = false;
  fences_recorded_.fetch_add(1, std::memory_order_relaxed);
  return e;
}

void StitchEngine::begin_sharing() {
  // Frees from now on stamp their pages; one that held its arena's lock before sees the flag
  // set, or has freed its block by the time the loop below takes that lock.
  sharing_.store(true, std::memory_order_relaxed);
  for (const auto& a : arenas_) {
    Lock lock(a->mutex);
    for (const auto& spaces : a->spaces) {
      for (const auto& s : spaces) {
        for (const Block* b = s->first; b != nullptr; b = b->next) {
          // A parked block is free memory: pooled later, its pages may be lent.
          if (b->kind != Block::Kind::kFree && b->kind != Block::Kind::kParked) continue;
          note_free(*a, *b);
        }
      }
    }
  }
}

// Donor arenas are locked here and stay locked, in `held`, until the growth returns (or
// are held by the caller's AllArenasLock): the analysis cannot follow locks kept in a vector.
std::size_t StitchEngine::plan_borrow(Arena& arena, bool small, std::size_t lacking,
                                      std::size_t least, const AllArenasLock* all,
                                      std::vector<std::unique_lock<ArenaMutex>>& held,
                                      std::vector<Lend>& out) NO_THREAD_SAFETY_ANALYSIS {
  if (!sharing_.load(std::memory_order_relaxed) || capturing()) return 0;
  const std::size_t first = out.size();
  struct Candidate {
    Lend lend;
    bool waits;  // on a fence in flight, or on one recorded now
  };
  std::vector<Candidate> candidates;
  const std::size_t count = arena_count_.load(std::memory_order_acquire);
  for (std::size_t owner = 1; owner <= count; ++owner) {
    Arena* x = arena_table_.get(static_cast<SegmentMap::Owner>(owner));
    if (x == nullptr || x == &arena) continue;
    const bool mine = all != nullptr || std::any_of(held.begin(), held.end(), [x](const auto& l) {
                        return l.mutex() == &x->mutex;
                      });
    if (!mine) {
      // Never wait for another stream's lock here: this thread holds its own arena's and the
      // device lock, which that stream's growth may be waiting for.
      if (!x->mutex.try_lock()) continue;
      held.emplace_back(x->mutex, std::adopt_lock);
    }
    // Pages whose stamp a completed fence covers serve as they are. A stream whose fences
    // have all completed has run its queue up to its last fence, and little or nothing
    // since: its newer frees serve too, behind a wait (on the device) on a fence recorded
    // now, which costs nothing. Under stream_borrow_wait a busy stream's pages serve as
    // well, behind a wait on the oldest fence that covers them: this stream's work then
    // starts only once that stream's has passed their frees.
    complete_fences(*x);
    if (x->parked != nullptr) unpark(*x);  // its pages may serve too once pooled
    const std::uint64_t usable =
        config_.stream_borrow_wait || x->fences.empty() ? x->epoch : x->safe_epoch;
    const std::uint64_t safe = x->safe_epoch;
    for (Block* b : x->pool(small)) {
      if (b->in_island()) continue;  // the small pool's pages in a large space
      find_whole_handle(*b, [&](DevicePtr va, Handle* h) {
        const std::uint64_t stamp = stamp_of(*b->space, va, h->live_at.size());
        if (stamp <= usable) {
          const bool waits = stamp > safe;  // on a fence in flight or recorded now
          candidates.push_back(Candidate{Lend{h, b, va}, waits});
        }
        return false;
      });
    }
  }
  // Handles whose uses a completed fence covers first (no wait: a wait on a fence recorded
  // now may hold this stream behind all the work its donor has queued since); then the
  // smallest free blocks: the least useful to keep whole (as lending goes).
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.waits != b.waits) return b.waits;
    if (a.lend.block != b.lend.block) return BySizeThenAddress{}(a.lend.block, b.lend.block);
    return a.lend.lo < b.lend.lo;
  });
  // Enough to create nothing, where that fits; else, where the growth creates more than
  // `least` anyway, pieces that each spare creating one, as long as what is still created
  // comes to `least`. Where a donor that needs its pages again could not take them back
  // soon (no stream_borrow_wait, and fences that complete slowly), only enough to create
  // nothing, and never more than the growth would create (`lacking`, at least `least`):
  // the donor would create memory instead.
  const std::size_t would_create = std::max(lacking, least);
  const auto take = [&](std::size_t cap, std::size_t enough) {
    out.resize(first);
    std::size_t taken = 0;
    for (const Candidate& c : candidates) {
      if (taken >= enough) break;
      const std::size_t n = c.lend.handle->live_at.size();
      if (taken + n > cap) continue;
      out.push_back(c.lend);
      taken += n;
    }
    return taken;
  };
  const bool quick = config_.stream_borrow_wait ||
                     (fence_latency_samples_.load(std::memory_order_relaxed) >= kLatencySamples &&
                      fence_latency_us_.load(std::memory_order_relaxed) <= kQuickFenceUs);
  std::size_t taken = take(quick ? SIZE_MAX : would_create, lacking);
  if (taken < lacking)
    taken = quick && lacking > least ? take(lacking - least, lacking - least) : take(0, 0);
  // Pages freed past a stream's completed fences: this stream waits, once per donor, for
  // the oldest fence in flight that covers all it takes from that donor, or for one
  // recorded now where no fence covers them yet.
  std::vector<std::pair<Arena*, std::uint64_t>> needs;  // donor, the newest stamp taken
  for (std::size_t i = first; i < out.size(); ++i) {
    const Lend& l = out[i];
    Arena* x = l.block->space->arena;
    const std::uint64_t stamp = stamp_of(*l.block->space, l.lo, l.handle->live_at.size());
    if (stamp <= x->safe_epoch) continue;
    const auto it =
        std::find_if(needs.begin(), needs.end(), [x](const auto& n) { return n.first == x; });
    if (it == needs.end()) {
      needs.emplace_back(x, stamp);
    } else {
      it->second = std::max(it->second, stamp);
    }
  }
  for (const auto& need : needs) {
    Arena* x = need.first;
    const std::uint64_t stamp = need.second;
    const bool busy = !x->fences.empty();
    const auto covering = std::find_if(x->fences.begin(), x->fences.end(),
                                       [stamp](const Fence& f) { return f.epoch >= stamp; });
    const EventId e = covering != x->fences.end() ? covering->event : record_fence(*x);
    driver_.stream_wait_event(arena.stream, e);
    borrow_waits_.fetch_add(1, std::memory_order_relaxed);
    if (busy) busy_borrow_waits_.fetch_add(1, std::memory_order_relaxed);
  }
  return taken;
}

}  // namespace ccalloc::core
