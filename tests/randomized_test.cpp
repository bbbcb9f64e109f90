// Seeded randomized test of the allocator on a small simulated GPU, so that the OOM ladder
// runs often. Every operation is followed by the full invariant checker
// (set_check_invariants) and by checks against the test's own shadow model:
//   - returned pointers are 512-byte aligned, allocation_size() >= the request, and the
//     rounded ranges of live allocations are pairwise disjoint;
//   - a block freed after record_stream() is not handed out again while an event on a
//     stream that used it has not completed (the test is the only one completing events);
//   - allocation / allocated_bytes / active / active_bytes / requested_bytes current values
//     equal the shadow sums, reserved bytes equal the device's used bytes, and
//     segments() lists exactly the shadow's live and pending blocks;
//   - an OutOfMemoryError is raised only when a new segment could not fit under the limit.
// At the end everything is freed and empty_cache() returns every byte to the device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"
#include "ccalloc/stats.hpp"
#include "core/rounding.hpp"
#include "test_support.hpp"

namespace {

using ccalloc::Allocator;
using ccalloc::BlockState;
using ccalloc::Config;
using ccalloc::DevicePtr;
using ccalloc::DeviceStats;
using ccalloc::kAggregate;
using ccalloc::StreamId;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kCapacity = 512 * kMiB;
constexpr std::size_t kMaxRequest = 64 * kMiB;
constexpr std::size_t kMaxLive = 200;
constexpr StreamId kStreams[] = {0, 1, 2, 3};
constexpr std::size_t kNumStreams = std::size(kStreams);
// Every this many operations (and after every OOM / empty_cache) the shadow model is
// compared block by block with segments(), and allocation_size() of every live pointer.
constexpr std::uint64_t kDeepCheckEvery = 8;
constexpr std::uint64_t kPhaseOps = 1000;

struct RunSpec {
  const char* conf;
  bool vary_fraction;  // set_memory_fraction now and then
  std::size_t capacity = kCapacity;
  std::size_t max_request = kMaxRequest;  // sizes are log-uniform up to it
  // Alternate phases of kPhaseOps operations: the full range of sizes, then requests of
  // 64 KiB to 1 MiB only, with frees more likely than mallocs (live memory falls and the small
  // pool grows beside the large ranges' free tails), and now and then one small size
  // malloc'd and freed in a loop (do_loop).
  bool phases = false;
};

constexpr RunSpec kRuns[] = {
    {"pytorch", false},
    {"pytorch,max_split_size_mb:40", false},
    {"pytorch,roundup_power2_divisions:4", false},
    {"pytorch,garbage_collection_threshold:0.6", false},
    {"pytorch,per_process_memory_fraction:0.8,garbage_collection_threshold:0.5", true},
    // The `ccalloc` policy (stitching on virtual memory), at the same coverage.
    {"ccalloc,stitch_segments:True", false},
    {"ccalloc,stitch_segments:True,roundup_power2_divisions:4", false},
    {"ccalloc,stitch_segments:True,garbage_collection_threshold:0.6", false},
    {"ccalloc,stitch_segments:True,per_process_memory_fraction:0.8,garbage_collection_threshold:0.5", true},
    // Requests of at most 8 MiB on a 64 MiB device: the streams settle with free tails
    // longer than their largest blocks, which small growth takes as islands (rule 2).
    {"ccalloc,stitch_segments:True", false, 64 * kMiB, 8 * kMiB, true},
};
constexpr std::uint64_t kSeeds[] = {1, 2, 3};
constexpr std::uint64_t kOpsPerRun = 70'000;
static_assert(std::size(kRuns) * std::size(kSeeds) * kOpsPerRun >= 1'000'000,
              "the randomized test must total at least 1e6 operations");

// Sanitizer builds run a share of the operations (CCALLOC_TEST_SCALE, e.g. 0.1 from
// scripts/test); the plain build always runs all of them.
std::uint64_t ops_per_run() {
  const double f = ccalloc_test::test_scale();
  return f < 1.0 ? static_cast<std::uint64_t>(static_cast<double>(kOpsPerRun) * f) : kOpsPerRun;
}

struct Live {
  DevicePtr ptr = 0;
  std::size_t requested = 0;
  std::size_t rounded = 0;
  StreamId stream = 0;
  std::vector<StreamId> uses;  // other streams recorded with record_stream
};

// A block freed after record_stream(): pending until the work of every stream in `waiting`
// queued before the free has completed, then back in its pool at the next malloc (or sync
// of all streams). The test's own event, recorded on each of those streams just after the
// free (after the allocator's), completes when the allocator's does: completing one stream
// may complete another's work, up to what it waited for.
struct Awaiting {
  std::size_t rounded = 0;
  std::size_t requested = 0;
  struct Use {
    StreamId stream;
    ccalloc::EventId after_free;
  };
  std::vector<Use> waiting;  // uses whose work before the free has not completed yet
};

struct Counts {
  std::uint64_t ops = 0;
  std::uint64_t mallocs = 0;
  std::uint64_t ooms = 0;
  std::uint64_t frees = 0;
  std::uint64_t pending_frees = 0;
  std::uint64_t record_streams = 0;
  std::uint64_t completions = 0;
  std::uint64_t empty_caches = 0;
  std::uint64_t fraction_changes = 0;
  std::uint64_t bad_pointer_ops = 0;
  std::uint64_t deep_checks = 0;
  std::uint64_t loops = 0;         // small malloc/free loops (phases only)
  std::uint64_t kept_islands = 0;  // loop rounds that left a wholly free island (kept)
};

class Harness {
 public:
  Harness(const RunSpec& spec, std::uint64_t seed)
      : spec_(spec),
        gpu_(sim_options(spec.capacity)),
        alloc_(gpu_, Config::parse(spec.conf)),
        rng_(seed) {
    alloc_.set_check_invariants(true);
  }

  const Counts& counts() const { return counts_; }

  void run(std::uint64_t ops) {
    for (std::uint64_t i = 0; i < ops; ++i) {
      step();
      if (::testing::Test::HasFatalFailure()) return;
    }
  }

  // Frees everything, completes all work, empties the cache: nothing may stay reserved.
  void drain() {
    while (!live_.empty()) {
      free_at(live_.size() - 1);
      check_cheap();
      if (::testing::Test::HasFatalFailure()) return;
    }
    gpu_.complete_all();
    note_completions();
    alloc_.empty_cache();
    forget_awaiting();
    sync_count_ = alloc_.stats().num_sync_all_streams;
    deep_check("after drain");
    alloc_.check_invariants();
    const DeviceStats s = alloc_.stats();
    EXPECT_EQ(s.reserved_bytes[kAggregate].current, 0);
    EXPECT_EQ(s.segment[kAggregate].current, 0);
    EXPECT_EQ(s.allocation[kAggregate].current, 0);
    EXPECT_EQ(s.active[kAggregate].current, 0);
    EXPECT_EQ(s.allocated_bytes[kAggregate].current, 0);
    EXPECT_EQ(s.active_bytes[kAggregate].current, 0);
    EXPECT_EQ(s.requested_bytes[kAggregate].current, 0);
    EXPECT_EQ(s.inactive_split[kAggregate].current, 0);
    EXPECT_EQ(s.inactive_split_bytes[kAggregate].current, 0);
    EXPECT_EQ(gpu_.used_bytes(), 0u);
    EXPECT_TRUE(alloc_.segments().empty());
  }

 private:
  static ccalloc::sim::Options sim_options(std::size_t capacity) {
    ccalloc::sim::Options o;
    o.capacity = capacity;
    o.events_complete_immediately = false;
    return o;
  }

  std::string where() const {
    return std::string(spec_.conf) + " op " + std::to_string(counts_.ops);
  }

  std::uint64_t uniform(std::uint64_t n) {  // [0, n)
    return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng_);
  }

  bool small_phase() const { return spec_.phases && (counts_.ops / kPhaseOps) % 2 == 1; }

  std::size_t log_uniform_size() {
    const bool small = small_phase();
    const std::size_t max = small ? kMiB : spec_.max_request;
    const double x = std::uniform_real_distribution<double>(
        small ? std::log(64.0 * 1024) : 0.0, std::log(static_cast<double>(max)))(rng_);
    const auto s = static_cast<std::size_t>(std::exp(x));
    return std::clamp<std::size_t>(s, 1, max);
  }

  StreamId random_stream() { return kStreams[uniform(kNumStreams)]; }

  void step() {
    ++counts_.ops;
    const std::uint64_t r = uniform(1000);
    if (r < (small_phase() ? 320 : 420)) {
      if (live_.size() >= kMaxLive) {
        free_at(uniform(live_.size()));
      } else {
        do_malloc();
      }
    } else if (r < 760) {
      if (live_.empty()) {
        do_malloc();
      } else {
        free_at(uniform(live_.size()));
      }
    } else if (r < 860) {
      do_record_stream();
    } else if (r < 970) {
      do_complete_stream();
    } else if (r < 975) {
      do_complete_all();
    } else if (r < 978) {
      do_empty_cache();
    } else if (r < 983 && spec_.vary_fraction) {
      do_set_fraction();
    } else if (r < 990) {
      do_bad_pointer();
    } else if (r < 994 && small_phase()) {
      do_loop();
    } else {
      do_malloc();
    }
    if (::testing::Test::HasFatalFailure()) return;
    check_cheap();
    if (counts_.ops % kDeepCheckEvery == 0) deep_check("periodic");
  }

  // --- operations -----------------------------------------------------------------------

  void do_malloc() {
    const std::size_t size = uniform(500) == 0 ? 0 : log_uniform_size();
    do_malloc(size, random_stream());
  }

  // One small size malloc'd and freed eight times on one stream: where nothing else of the
  // small pool is free, its page bounces between the pools until the small pool keeps it
  // (the stitching policy's rule 2), and the next large request takes it back.
  void do_loop() {
    ++counts_.loops;
    const std::size_t size = 512 * (1 + uniform(ccalloc::core::kStitchSmallSize / 512));
    const StreamId stream = random_stream();
    for (int i = 0; i < 8; ++i) {
      const std::size_t before = live_.size();
      do_malloc(size, stream);
      if (::testing::Test::HasFatalFailure() || live_.size() == before) return;  // OOM
      free_at(live_.size() - 1);
      if (::testing::Test::HasFatalFailure()) return;
      check_cheap();
    }
    if (!alloc_.config().stitch_segments) return;
    for (const auto& seg : alloc_.snapshot().segments) {
      for (const auto& b : seg.blocks)
        counts_.kept_islands += b.island && b.state == BlockState::kInactive;
    }
  }

  void do_malloc(std::size_t size, StreamId stream) {
    ++counts_.mallocs;
    DevicePtr ptr = 0;
    try {
      ptr = alloc_.malloc(size, stream);
    } catch (const ccalloc::OutOfMemoryError& e) {
      ++counts_.ooms;
      ASSERT_EQ(e.requested_bytes(), size) << where();
      ASSERT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << where();
      after_malloc_call(size);
      check_oom_was_necessary(size);
      deep_check("after OOM");
      return;
    }
    if (size == 0) {
      ASSERT_EQ(ptr, 0u) << where();
      return;  // returns before touching any state, events included
    }
    after_malloc_call(size);
    ASSERT_NE(ptr, 0u) << where();
    ASSERT_EQ(ptr % 512, 0u) << where() << ": pointer not 512-byte aligned";
    const std::size_t rounded = alloc_.allocation_size(ptr);
    ASSERT_GE(rounded, size) << where();
    // The whole block: the rounded request, or more when the rest was not worth a split.
    ASSERT_GE(rounded, ccalloc::core::round_size(size, alloc_.config())) << where();
    // Disjoint from every live allocation ...
    auto next = occupied_.lower_bound(ptr);
    if (next != occupied_.end()) {
      ASSERT_GE(next->first, ptr + rounded)
          << where() << ": new allocation overlaps the live allocation at " << next->first;
    }
    if (next != occupied_.begin()) {
      const auto prev = std::prev(next);
      ASSERT_LE(prev->first + prev->second, ptr)
          << where() << ": new allocation overlaps the live allocation at " << prev->first;
    }
    // ... and from every block whose cross-stream use has not completed.
    for (const auto& [p, a] : awaiting_) {
      if (a.waiting.empty()) continue;
      ASSERT_TRUE(p + a.rounded <= ptr || ptr + rounded <= p)
          << where() << ": block at " << p << " reused before the event on its use stream "
          << a.waiting.front().stream << " completed";
    }
    occupied_.emplace(ptr, rounded);
    live_.push_back(Live{ptr, size, rounded, stream, {}});
    allocated_ += static_cast<std::int64_t>(rounded);
    requested_live_ += static_cast<std::int64_t>(size);
  }

  // Every malloc call of a positive size first returns completed cross-stream frees to
  // their pools; a sync of all streams (OOM ladder) completes every pending one.
  void after_malloc_call(std::size_t size) {
    if (size == 0) return;
    note_sync();
    std::erase_if(awaiting_, [](const auto& kv) { return kv.second.waiting.empty(); });
  }

  void note_sync() {
    const std::int64_t syncs = alloc_.stats().num_sync_all_streams;
    if (syncs != sync_count_) {
      sync_count_ = syncs;
      forget_awaiting();
    }
  }

  void free_at(std::size_t index) {
    ++counts_.frees;
    Live l = live_[index];
    live_[index] = live_.back();
    live_.pop_back();
    ASSERT_EQ(alloc_.allocation_size(l.ptr), l.rounded) << where();
    alloc_.free(l.ptr);
    EXPECT_EQ(alloc_.allocation_size(l.ptr), 0u) << where();
    occupied_.erase(l.ptr);
    allocated_ -= static_cast<std::int64_t>(l.rounded);
    requested_live_ -= static_cast<std::int64_t>(l.requested);
    if (!l.uses.empty()) {
      ++counts_.pending_frees;
      ASSERT_EQ(awaiting_.count(l.ptr), 0u) << where();
      Awaiting a{l.rounded, l.requested, {}};
      for (StreamId u : l.uses) {
        const ccalloc::EventId e = gpu_.create_event();
        gpu_.record_event(e, u);
        a.waiting.push_back({u, e});
      }
      awaiting_.emplace(l.ptr, std::move(a));
    }
    recently_freed_[uniform(std::size(recently_freed_))] = l.ptr;
  }

  void do_record_stream() {
    if (live_.empty()) return;
    ++counts_.record_streams;
    Live& l = live_[uniform(live_.size())];
    // Mostly another stream; now and then the allocating stream (a no-op use).
    const StreamId s = uniform(8) == 0 ? l.stream : random_stream();
    alloc_.record_stream(l.ptr, s);
    if (s != l.stream && std::find(l.uses.begin(), l.uses.end(), s) == l.uses.end()) {
      l.uses.push_back(s);
    }
  }

  // A sync of all streams completed every pending free.
  void forget_awaiting() {
    for (auto& [ptr, a] : awaiting_) {
      for (const Awaiting::Use& u : a.waiting)
        gpu_.destroy_event(u.after_free);
    }
    awaiting_.clear();
  }

  // Drops the uses whose work before the free has completed.
  void note_completions() {
    for (auto& [ptr, a] : awaiting_) {
      std::erase_if(a.waiting, [this](const Awaiting::Use& u) {
        if (!gpu_.query_event(u.after_free)) return false;
        gpu_.destroy_event(u.after_free);
        return true;
      });
    }
  }

  void do_complete_stream() {
    ++counts_.completions;
    gpu_.complete_stream(random_stream());
    note_completions();
  }

  void do_complete_all() {
    ++counts_.completions;
    gpu_.complete_all();
    note_completions();
  }

  void do_empty_cache() {
    ++counts_.empty_caches;
    alloc_.empty_cache();
    note_sync();
    EXPECT_TRUE(awaiting_.empty()) << where() << ": empty_cache did not sync pending frees";
    forget_awaiting();
    deep_check("after empty_cache");
    // Every wholly free segment went back to the device. (Under the stitching policy a
    // free run can share a mapping with live pages, which keeps it; its stitch tests
    // check what empty_cache returns.)
    if (alloc_.config().stitch_segments) return;
    for (const ccalloc::SegmentInfo& seg : alloc_.segments()) {
      ASSERT_FALSE(seg.blocks.size() == 1 && seg.blocks[0].state == BlockState::kInactive)
          << where() << ": empty_cache kept the free segment at " << seg.address;
    }
  }

  void do_set_fraction() {
    ++counts_.fraction_changes;
    // Often below what is already reserved: legal (PyTorch only refuses later growth), and
    // then every malloc that needs a new segment must fail until enough is released.
    double f = std::uniform_real_distribution<double>(0.2, 1.0)(rng_);
    if (uniform(4) == 0) f = 1.0;
    alloc_.set_memory_fraction(f);
    ASSERT_EQ(alloc_.memory_fraction(), f) << where();
  }

  // Frees / record_stream of pointers the allocator does not hold: an error naming the
  // pointer, and no change of state.
  void do_bad_pointer() {
    ++counts_.bad_pointer_ops;
    DevicePtr bad = 0;
    if (!live_.empty() && uniform(2) == 0) {
      const Live& l = live_[uniform(live_.size())];
      if (l.rounded <= 512) return;
      bad = l.ptr + 512;  // interior pointer
    } else {
      bad = recently_freed_[uniform(std::size(recently_freed_))];
      if (bad == 0 || occupied_.count(bad) != 0) return;  // reused since: live again
    }
    const DeviceStats before = alloc_.stats();
    try {
      if (uniform(2) == 0) {
        alloc_.free(bad);
      } else {
        alloc_.record_stream(bad, random_stream());
      }
      ADD_FAILURE() << where() << ": no InvalidPointerError for " << bad;
    } catch (const ccalloc::InvalidPointerError& e) {
      EXPECT_EQ(e.ptr(), bad) << where();
    }
    const DeviceStats after = alloc_.stats();
    EXPECT_EQ(before, after) << where() << ": a rejected pointer changed the statistics";
  }

  // --- checks ---------------------------------------------------------------------------

  // After an OOM (single thread: nothing changed since the ladder gave up), a new segment
  // for the request cannot fit under the limit or on the device.
  void check_oom_was_necessary(std::size_t size) {
    const Config& c = alloc_.config();
    const std::size_t rounded = ccalloc::core::round_size(size, c);
    // The stitching policy grows by whole pages of the granularity (2 MiB here).
    const std::size_t segment = c.stitch_segments
                                    ? (rounded + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB)
                                    : ccalloc::core::segment_size_for(rounded, c);
    const double fraction = alloc_.memory_fraction();
    const std::size_t limit =
        fraction < 1.0 ? static_cast<std::size_t>(fraction * static_cast<double>(spec_.capacity))
                       : spec_.capacity;
    const auto reserved =
        static_cast<std::size_t>(alloc_.stats().reserved_bytes[kAggregate].current);
    ASSERT_GT(reserved + segment, std::min(limit, spec_.capacity))
        << where() << ": OOM for " << size << " bytes although a " << segment
        << "-byte segment fits (reserved " << reserved << ", limit " << limit << ")";
    // The ladder released every wholly free segment before giving up. (The stitching
    // policy reports runs of live pages as segments; a free run may share a mapping with
    // live pages elsewhere, which keeps it.)
    if (c.stitch_segments) return;
    for (const ccalloc::SegmentInfo& seg : alloc_.segments()) {
      ASSERT_FALSE(seg.blocks.size() == 1 && seg.blocks[0].state == BlockState::kInactive)
          << where() << ": OOM with the free segment at " << seg.address << " still cached";
    }
  }

  void check_cheap() {
    const DeviceStats s = alloc_.stats();
    std::int64_t awaiting_rounded = 0;
    std::int64_t awaiting_requested = 0;
    for (const auto& [ptr, a] : awaiting_) {
      awaiting_rounded += static_cast<std::int64_t>(a.rounded);
      awaiting_requested += static_cast<std::int64_t>(a.requested);
    }
    const auto n_live = static_cast<std::int64_t>(live_.size());
    const auto n_awaiting = static_cast<std::int64_t>(awaiting_.size());
    ASSERT_EQ(s.allocation[kAggregate].current, n_live) << where();
    ASSERT_EQ(s.allocated_bytes[kAggregate].current, allocated_) << where();
    ASSERT_EQ(s.active[kAggregate].current, n_live + n_awaiting) << where();
    ASSERT_EQ(s.active_bytes[kAggregate].current, allocated_ + awaiting_rounded) << where();
    ASSERT_EQ(s.requested_bytes[kAggregate].current, requested_live_ + awaiting_requested)
        << where();
    ASSERT_EQ(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(gpu_.used_bytes()))
        << where();
    ASSERT_LE(s.reserved_bytes[kAggregate].current, static_cast<std::int64_t>(spec_.capacity))
        << where();
    ASSERT_GE(s.reserved_bytes[kAggregate].current, s.active_bytes[kAggregate].current) << where();
    for (const auto* arr : {&s.allocation, &s.allocated_bytes, &s.active, &s.active_bytes,
                            &s.requested_bytes, &s.reserved_bytes, &s.segment}) {
      for (const ccalloc::Stat& st : *arr) {
        ASSERT_GE(st.current, 0) << where();
        ASSERT_GE(st.peak, st.current) << where();
        ASSERT_EQ(st.allocated - st.freed, st.current) << where();
      }
    }
    max_allocated_ = std::max(max_allocated_, allocated_);
    // The device-wide peak is the maximum over every state so far, whatever the streams
    // (operations here never overlap; see RandomizedStats.PeakIsDeviceWideWithSeveralStreams).
    ASSERT_EQ(s.allocated_bytes[kAggregate].peak, max_allocated_) << where();
  }

  // segments() lists exactly the shadow's live blocks (allocated) and pending frees.
  void deep_check(const char* when) {
    ++counts_.deep_checks;
    std::size_t n_allocated = 0;
    std::size_t n_pending = 0;
    std::int64_t requested = 0;
    std::int64_t reserved = 0;
    for (const ccalloc::SegmentInfo& seg : alloc_.segments()) {
      reserved += static_cast<std::int64_t>(seg.total_size);
      std::size_t seg_requested = 0;
      for (const ccalloc::BlockInfo& b : seg.blocks) {
        switch (b.state) {
          case BlockState::kActiveAllocated: {
            ++n_allocated;
            const auto it = occupied_.find(b.address);
            ASSERT_TRUE(it != occupied_.end()) << where() << " (" << when << "): allocated block "
                                               << b.address << " is not live on the test's side";
            ASSERT_EQ(it->second, b.size) << where() << " (" << when << ")";
            seg_requested += b.requested_size;
            break;
          }
          case BlockState::kActivePendingFree: {
            ++n_pending;
            const auto it = awaiting_.find(b.address);
            ASSERT_TRUE(it != awaiting_.end())
                << where() << " (" << when << "): pending block " << b.address
                << " is not awaiting its events on the test's side";
            ASSERT_EQ(it->second.rounded, b.size) << where() << " (" << when << ")";
            ASSERT_EQ(it->second.requested, b.requested_size) << where() << " (" << when << ")";
            seg_requested += b.requested_size;
            break;
          }
          case BlockState::kInactive:
            break;
        }
      }
      ASSERT_EQ(seg.requested_size, seg_requested) << where() << " (" << when << ")";
      requested += static_cast<std::int64_t>(seg_requested);
    }
    ASSERT_EQ(n_allocated, live_.size()) << where() << " (" << when << ")";
    ASSERT_EQ(n_pending, awaiting_.size()) << where() << " (" << when << ")";
    const DeviceStats s = alloc_.stats();
    ASSERT_EQ(s.requested_bytes[kAggregate].current, requested) << where() << " (" << when << ")";
    if (alloc_.config().stitch_segments) {
      // Segments are the runs of live pages; spare pieces are reserved too.
      ASSERT_LE(reserved, s.reserved_bytes[kAggregate].current) << where() << " (" << when << ")";
    } else {
      ASSERT_EQ(s.reserved_bytes[kAggregate].current, reserved) << where() << " (" << when << ")";
    }
    std::int64_t allocated = 0;
    for (const Live& l : live_) {
      const std::size_t size = alloc_.allocation_size(l.ptr);
      ASSERT_GE(size, l.requested) << where();
      allocated += static_cast<std::int64_t>(size);
    }
    ASSERT_EQ(s.allocated_bytes[kAggregate].current, allocated) << where();
  }

  const RunSpec spec_;
  ccalloc::sim::SimDriver gpu_;
  Allocator alloc_;
  std::mt19937_64 rng_;
  std::vector<Live> live_;
  std::map<DevicePtr, std::size_t> occupied_;  // live ranges: ptr -> rounded size
  std::map<DevicePtr, Awaiting> awaiting_;
  DevicePtr recently_freed_[16] = {};
  std::int64_t allocated_ = 0;
  std::int64_t requested_live_ = 0;
  std::int64_t max_allocated_ = 0;
  std::int64_t sync_count_ = 0;
  Counts counts_;
};

struct Param {
  RunSpec spec;
  std::uint64_t seed;
};

// CCALLOC_RANDOM_SEEDS=N runs seeds 1 to N instead (a longer soak; at least the default's).
std::vector<std::uint64_t> seeds() {
  std::vector<std::uint64_t> out(std::begin(kSeeds), std::end(kSeeds));
  if (const char* n = std::getenv("CCALLOC_RANDOM_SEEDS"); n != nullptr) {
    const std::uint64_t count = std::strtoull(n, nullptr, 10);
    for (std::uint64_t seed = std::size(kSeeds) + 1; seed <= count; ++seed)
      out.push_back(seed);
  }
  return out;
}

std::vector<Param> all_params() {
  std::vector<Param> out;
  for (const RunSpec& r : kRuns) {
    for (std::uint64_t seed : seeds())
      out.push_back({r, seed});
  }
  return out;
}

// The device and request sizes when they are not the defaults, e.g. "_64MiB_max8MiB".
std::string shape(const RunSpec& spec) {
  if (spec.capacity == kCapacity && spec.max_request == kMaxRequest && !spec.phases) return "";
  return "_" + std::to_string(spec.capacity / kMiB) + "MiB_max" +
         std::to_string(spec.max_request / kMiB) + "MiB" + (spec.phases ? "_phases" : "");
}

void PrintTo(const Param& p, std::ostream* os) {
  *os << p.spec.conf << shape(p.spec) << " seed " << p.seed;
}

class Randomized : public ::testing::TestWithParam<Param> {};

TEST_P(Randomized, ShadowModelAndInvariantsHoldAfterEveryOperation) {
  const Param& p = GetParam();
  SCOPED_TRACE(std::string("conf=") + p.spec.conf + shape(p.spec) +
               " seed=" + std::to_string(p.seed));
  const auto start = std::chrono::steady_clock::now();
  Harness h(p.spec, p.seed);
  const std::uint64_t ops = ops_per_run();
  h.run(ops);
  if (HasFatalFailure()) return;
  h.drain();
  const Counts& c = h.counts();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(c.ops, ops);
  // The small device must make the OOM ladder and the cross-stream paths run regularly.
  EXPECT_GT(c.ooms, ops / 1000);
  EXPECT_GT(c.pending_frees, ops / 100);
  std::printf(
      "[ conf=%s%s seed=%llu ] %llu ops in %.2f s: %llu mallocs (%llu OOM), %llu frees (%llu "
      "cross-stream), %llu record_stream, %llu completions, %llu empty_cache, %llu fraction, "
      "%llu bad pointers, %llu deep checks, %llu loops (%llu kept islands)\n",
      p.spec.conf, shape(p.spec).c_str(), static_cast<unsigned long long>(p.seed),
      static_cast<unsigned long long>(c.ops), secs, static_cast<unsigned long long>(c.mallocs),
      static_cast<unsigned long long>(c.ooms), static_cast<unsigned long long>(c.frees),
      static_cast<unsigned long long>(c.pending_frees),
      static_cast<unsigned long long>(c.record_streams),
      static_cast<unsigned long long>(c.completions),
      static_cast<unsigned long long>(c.empty_caches),
      static_cast<unsigned long long>(c.fraction_changes),
      static_cast<unsigned long long>(c.bad_pointer_ops),
      static_cast<unsigned long long>(c.deep_checks), static_cast<unsigned long long>(c.loops),
      static_cast<unsigned long long>(c.kept_islands));
  // The phases exercise islands the small pool keeps (rule 2) in every full run.
  if (p.spec.phases && ops == kOpsPerRun) {
    EXPECT_GT(c.kept_islands, 0u);
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  std::string name;
  for (const char* c = info.param.spec.conf; *c != '\0'; ++c) {
    name += std::isalnum(static_cast<unsigned char>(*c)) ? *c : '_';
  }
  return name + shape(info.param.spec) + "_seed" + std::to_string(info.param.seed);
}

INSTANTIATE_TEST_SUITE_P(ConfigsAndSeeds, Randomized, ::testing::ValuesIn(all_params()),
                         param_name);

// ---------------------------------------------------------------------------------------
// Focused cases the random walk relies on, or steps around.

// PyTorch's peak statistics are device-wide high-water marks. Each stream keeps its own
// counters here; the peak of their sum is not the sum of their peaks (README, "Statistics
// across streams").
TEST(RandomizedStats, PeakIsDeviceWideWithSeveralStreams) {
  ccalloc::sim::Options o;
  o.capacity = kCapacity;
  ccalloc::sim::SimDriver gpu(o);
  Allocator alloc(gpu, Config::parse("pytorch"));
  alloc.set_check_invariants(true);
  alloc.free(alloc.malloc(4 * kMiB, /*stream=*/1));
  alloc.free(alloc.malloc(4 * kMiB, /*stream=*/1));
  DeviceStats s = alloc.stats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(s.allocation[kAggregate].peak, 1);

  alloc.free(alloc.malloc(4 * kMiB, /*stream=*/2));
  s = alloc.stats();
  // Never more than 4 MiB at once, though streams 1 and 2 each peaked at 4 MiB.
  EXPECT_EQ(s.allocated_bytes[kAggregate].peak, static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(s.allocation[kAggregate].peak, 1);
  EXPECT_EQ(s.active_bytes[kAggregate].peak, static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(s.requested_bytes[kAggregate].peak, static_cast<std::int64_t>(4 * kMiB));
  // Reserved memory is device-wide: its peak is exact (one 20 MiB segment per stream).
  EXPECT_EQ(s.reserved_bytes[kAggregate].peak, static_cast<std::int64_t>(40 * kMiB));

  alloc.reset_peak_stats();
  EXPECT_EQ(alloc.stats().allocated_bytes[kAggregate].peak, 0);
}

// Lowering the memory fraction below what is already reserved is legal: PyTorch refuses
// only later growth. The state stays valid and new segments are refused until enough is
// released.
TEST(RandomizedFraction, LoweringTheFractionBelowReservedKeepsTheStateValid) {
  ccalloc::sim::Options o;
  o.capacity = kCapacity;
  ccalloc::sim::SimDriver gpu(o);
  Allocator alloc(gpu, Config::parse("pytorch"));
  alloc.set_check_invariants(true);
  const DevicePtr a = alloc.malloc(200 * kMiB, 0);   // reserves 200 MiB
  EXPECT_NO_THROW(alloc.set_memory_fraction(0.25));  // limit 128 MiB < reserved
  EXPECT_NO_THROW(alloc.check_invariants());
  EXPECT_THROW(alloc.malloc(20 * kMiB, 0), ccalloc::OutOfMemoryError);
  EXPECT_NO_THROW(alloc.free(a));
  EXPECT_NO_THROW(alloc.empty_cache());
  EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, 0);
  DevicePtr b = 0;
  EXPECT_NO_THROW(b = alloc.malloc(20 * kMiB, 0));
  EXPECT_NE(b, 0u);
  if (b != 0) {
    EXPECT_NO_THROW(alloc.free(b));
  }
}

// A block used on another stream is not reused before that stream's work completes, even
// when the pool has nothing else, and comes back at the first malloc after completion.
TEST(RandomizedStreams, PendingBlockIsReusedOnlyAfterItsEventCompletes) {
  ccalloc::sim::Options o;
  o.capacity = kCapacity;
  ccalloc::sim::SimDriver gpu(o);
  Allocator alloc(gpu, Config::parse("pytorch"));
  alloc.set_check_invariants(true);
  const DevicePtr a = alloc.malloc(1000, 0);
  alloc.record_stream(a, 1);
  alloc.free(a);
  const DevicePtr b = alloc.malloc(1000, 0);
  EXPECT_NE(b, a);
  EXPECT_EQ(alloc.stats().active[kAggregate].current, 2);  // b and the pending a
  gpu.complete_stream(2);                                  // not the stream that used it
  const DevicePtr c = alloc.malloc(1000, 0);
  EXPECT_NE(c, a);
  gpu.complete_stream(1);
  alloc.free(c);
  const DevicePtr d = alloc.malloc(1000, 0);
  EXPECT_EQ(d, a);  // best fit, lowest address: the block a came back first
  alloc.free(b);
  alloc.free(d);
  alloc.empty_cache();
  EXPECT_EQ(gpu.used_bytes(), 0u);
}

}  // namespace
