// Concurrency stress of one allocator (label "concurrency": run under ThreadSanitizer in
// CI). Worker threads malloc and free on their own streams and on a shared one, hand
// allocations to each other through a queue so that frees happen on other threads, and
// record uses across streams; an inspector thread concurrently empties the cache, reads
// statistics, the summary and the segments and runs the invariant checker; a completer
// thread completes events. The device is small, so the OOM ladder (which takes every arena
// lock) runs concurrently with the hot paths. The work is bounded by operation counts, not
// time: the inspector and the completer pace themselves on the workers' progress.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/stats.hpp"
#include "test_support.hpp"

namespace {

using ccalloc::Allocator;
using ccalloc::Config;
using ccalloc::DevicePtr;
using ccalloc::DeviceStats;
using ccalloc::kAggregate;
using ccalloc::StreamId;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr int kWorkers = 6;  // + inspector + completer = 8 threads
constexpr std::uint64_t kOpsPerWorker = 100000;
// The operations each worker makes: all of them, or the test scale's share but at least
// 30,000 under the sanitizers (scripts/test), where ThreadSanitizer runs them some twenty
// times slower; every contended path is still reached thousands of times.
std::uint64_t ops_per_worker() {
  return std::max<std::uint64_t>(
      30000, static_cast<std::uint64_t>(static_cast<double>(kOpsPerWorker) *
                                        ccalloc_test::test_scale()));
}
constexpr std::size_t kMaxLivePerWorker = 24;
constexpr std::size_t kMaxRequest = 16 * kMiB;
constexpr StreamId kSharedStream = 100;
constexpr int kInspections = 1200;
constexpr int kCompletions = 20000;

StreamId own_stream(int worker) {
  return static_cast<StreamId>(1 + worker);
}

ccalloc::sim::Options small_device(std::size_t capacity) {
  ccalloc::sim::Options o;
  o.capacity = capacity;
  o.events_complete_immediately = false;
  return o;
}

// Failures seen on threads other than the test's, reported once joined.
class Failures {
 public:
  void add(std::string what) {
    std::lock_guard lock(mutex_);
    if (messages_.size() < 20) messages_.push_back(std::move(what));
    ++count_;
  }
  void report() const {
    std::lock_guard lock(mutex_);
    for (const std::string& m : messages_)
      ADD_FAILURE() << m;
    EXPECT_EQ(count_, 0u) << "failures on worker threads";
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> messages_;
  std::size_t count_ = 0;
};

struct Shared {
  Shared(const char* conf, std::size_t capacity, bool keys = false)
      : gpu(small_device(capacity)), alloc(gpu, Config::parse(conf)), ordered(keys) {}

  ccalloc::sim::SimDriver gpu;
  Allocator alloc;
  // Streams get PyTorch's order keys as they are recorded (as the PyTorch adapter gives
  // them), so that polls and waits walk the streams in PyTorch's order under every lock.
  const bool ordered;
  Failures failures;

  std::mutex handoff_mutex;
  std::deque<DevicePtr> handoff;  // allocations any thread may free

  std::atomic<std::uint64_t> ops_done{0};
  std::atomic<int> workers_done{0};
  std::atomic<std::uint64_t> mallocs{0};
  std::atomic<std::uint64_t> ooms{0};
  std::atomic<std::uint64_t> foreign_frees{0};
  std::atomic<std::uint64_t> record_streams{0};

  bool workers_finished() const { return workers_done.load() == kWorkers; }
  // Waits (yielding) until the workers have done `ops` operations in all, or finished.
  void pace(std::uint64_t ops) const {
    while (ops_done.load() < ops && !workers_finished())
      std::this_thread::yield();
  }
};

struct Owned {
  DevicePtr ptr = 0;
  std::size_t size = 0;
};

void worker(Shared& sh, int index) {
  std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(index));
  const auto uniform = [&rng](std::uint64_t n) {
    return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng);
  };
  const auto log_uniform_size = [&rng] {
    const double x = std::uniform_real_distribution<double>(
        0.0, std::log(static_cast<double>(kMaxRequest)))(rng);
    return std::clamp<std::size_t>(static_cast<std::size_t>(std::exp(x)), 1, kMaxRequest);
  };
  const StreamId mine = own_stream(index);
  std::vector<Owned> live;
  std::map<DevicePtr, std::size_t> ranges;  // this thread's live ranges

  const auto take_own = [&](std::size_t i) {
    const Owned o = live[i];
    live[i] = live.back();
    live.pop_back();
    ranges.erase(o.ptr);
    return o;
  };
  const auto do_malloc = [&](StreamId stream) {
    const std::size_t size = log_uniform_size();
    sh.mallocs.fetch_add(1, std::memory_order_relaxed);
    DevicePtr p = 0;
    try {
      p = sh.alloc.malloc(size, stream);
    } catch (const ccalloc::OutOfMemoryError& e) {
      sh.ooms.fetch_add(1, std::memory_order_relaxed);
      if (e.requested_bytes() != size) sh.failures.add("OOM error names the wrong size");
      return;
    }
    if (p == 0 || p % 512 != 0) {
      sh.failures.add("malloc returned a null or misaligned pointer " + std::to_string(p));
      return;
    }
    const std::size_t got = sh.alloc.allocation_size(p);
    if (got < size) {
      sh.failures.add("allocation_size " + std::to_string(got) + " < request " +
                      std::to_string(size));
    }
    const auto next = ranges.lower_bound(p);
    if ((next != ranges.end() && next->first < p + got) ||
        (next != ranges.begin() && std::prev(next)->first + std::prev(next)->second > p)) {
      sh.failures.add("malloc returned " + std::to_string(p) +
                      ", overlapping a live allocation of the same thread");
    }
    ranges.emplace(p, got);
    live.push_back({p, size});
  };

  try {
    for (std::uint64_t op = 0, ops = ops_per_worker(); op < ops; ++op) {
      const std::uint64_t r = uniform(100);
      if (r < 48) {
        if (live.size() >= kMaxLivePerWorker) {
          sh.alloc.free(take_own(uniform(live.size())).ptr);
        } else {
          do_malloc(uniform(6) == 0 ? kSharedStream : mine);
        }
      } else if (r < 72) {
        if (!live.empty()) sh.alloc.free(take_own(uniform(live.size())).ptr);
      } else if (r < 80) {
        if (!live.empty()) {  // give one away: another thread may free it
          const Owned o = take_own(uniform(live.size()));
          std::lock_guard lock(sh.handoff_mutex);
          sh.handoff.push_back(o.ptr);
        }
      } else if (r < 88) {
        DevicePtr p = 0;
        {
          std::lock_guard lock(sh.handoff_mutex);
          if (!sh.handoff.empty()) {
            p = sh.handoff.front();
            sh.handoff.pop_front();
          }
        }
        if (p != 0) {
          sh.alloc.free(p);
          sh.foreign_frees.fetch_add(1, std::memory_order_relaxed);
        }
      } else if (r < 97) {
        if (!live.empty()) {
          const int other = static_cast<int>(uniform(kWorkers + 1));
          const StreamId s = other == kWorkers ? kSharedStream : own_stream(other);
          if (sh.ordered) sh.alloc.set_stream_order_key(s, (std::uint64_t{1} << 56) | (s * 7));
          sh.alloc.record_stream(live[uniform(live.size())].ptr, s);
          sh.record_streams.fetch_add(1, std::memory_order_relaxed);
        }
      } else {
        if (!live.empty()) {
          const Owned& o = live[uniform(live.size())];
          if (sh.alloc.allocation_size(o.ptr) < o.size) {
            sh.failures.add("allocation_size of a live pointer shrank");
          }
        }
      }
      sh.ops_done.fetch_add(1, std::memory_order_relaxed);
    }
    for (const Owned& o : live)
      sh.alloc.free(o.ptr);
  } catch (const std::exception& e) {
    sh.failures.add(std::string("worker ") + std::to_string(index) + ": " + e.what());
  }
  sh.workers_done.fetch_add(1);
}

void inspector(Shared& sh) {
  const std::uint64_t total = kWorkers * ops_per_worker();
  try {
    for (int i = 0; i < kInspections; ++i) {
      sh.pace(total * static_cast<std::uint64_t>(i) / kInspections);
      switch (i % 6) {
        case 0:
          sh.alloc.empty_cache();
          break;
        case 1: {
          const DeviceStats s = sh.alloc.stats();
          for (const auto* arr : {&s.allocation, &s.allocated_bytes, &s.active, &s.active_bytes,
                                  &s.requested_bytes, &s.reserved_bytes, &s.segment}) {
            for (const ccalloc::Stat& st : *arr) {
              if (st.current < 0) sh.failures.add("negative current statistic");
            }
          }
          if (s.reserved_bytes[kAggregate].current > static_cast<std::int64_t>(sh.gpu.capacity())) {
            sh.failures.add("reserved exceeds the device capacity");
          }
          break;
        }
        case 2:
          if (sh.alloc.memory_summary().empty()) sh.failures.add("empty memory_summary");
          break;
        case 3:
          for (const ccalloc::SegmentInfo& seg : sh.alloc.segments()) {
            std::size_t sum = 0;
            DevicePtr at = seg.address;
            for (const ccalloc::BlockInfo& b : seg.blocks) {
              if (b.address != at) sh.failures.add("segments(): blocks do not tile a segment");
              at += b.size;
              sum += b.size;
            }
            if (sum != seg.total_size) sh.failures.add("segments(): sizes do not add up");
          }
          break;
        case 4:
          sh.alloc.check_invariants();
          break;
        case 5:
          (void)sh.alloc.memory_stats();
          (void)sh.alloc.mem_get_info();
          sh.alloc.reset_peak_stats();
          break;
      }
    }
  } catch (const std::exception& e) {
    sh.failures.add(std::string("inspector: ") + e.what());
  }
}

void completer(Shared& sh) {
  const std::uint64_t total = kWorkers * ops_per_worker();
  std::mt19937_64 rng(7);
  for (int i = 0; i < kCompletions; ++i) {
    sh.pace(total * static_cast<std::uint64_t>(i) / kCompletions);
    if (i % 32 == 31) {
      sh.gpu.complete_all();
    } else {
      const auto k = std::uniform_int_distribution<int>(0, kWorkers)(rng);
      sh.gpu.complete_stream(k == kWorkers ? kSharedStream : own_stream(k));
    }
  }
}

class Stress : public ::testing::TestWithParam<const char*> {};

void stress(const char* conf, bool ordered) {
  Shared sh(conf, 192 * kMiB, ordered);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i)
    threads.emplace_back(worker, std::ref(sh), i);
  threads.emplace_back(inspector, std::ref(sh));
  threads.emplace_back(completer, std::ref(sh));
  ASSERT_EQ(threads.size(), 8u);
  for (std::thread& t : threads)
    t.join();
  sh.failures.report();

  for (DevicePtr p : sh.handoff)
    sh.alloc.free(p);  // given away, never taken
  sh.handoff.clear();
  EXPECT_NO_THROW(sh.alloc.check_invariants());
  sh.gpu.complete_all();
  sh.alloc.empty_cache();
  EXPECT_NO_THROW(sh.alloc.check_invariants());

  const DeviceStats s = sh.alloc.stats();
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(s.allocation[t].current, 0) << t;
    EXPECT_EQ(s.active[t].current, 0) << t;
    EXPECT_EQ(s.allocated_bytes[t].current, 0) << t;
    EXPECT_EQ(s.active_bytes[t].current, 0) << t;
    EXPECT_EQ(s.requested_bytes[t].current, 0) << t;
    EXPECT_EQ(s.reserved_bytes[t].current, 0) << t;
    EXPECT_EQ(s.segment[t].current, 0) << t;
  }
  EXPECT_EQ(sh.gpu.used_bytes(), 0u);
  EXPECT_TRUE(sh.alloc.segments().empty());
  // The run must actually have exercised the contended paths.
  EXPECT_EQ(sh.ops_done.load(), kWorkers * ops_per_worker());
  EXPECT_GT(sh.ooms.load(), 0u) << "the device is too large to reach the OOM ladder";
  EXPECT_GT(sh.foreign_frees.load(), 100u);
  EXPECT_GT(sh.record_streams.load(), 100u);
  EXPECT_GT(s.num_sync_all_streams, 0);
  std::printf(
      "[ %s%s ] %llu mallocs, %llu OOM, %llu frees of other threads' blocks, %llu "
      "record_stream, %lld syncs of all streams, %lld device allocs\n",
      conf, ordered ? ", PyTorch's order of streams" : "",
      static_cast<unsigned long long>(sh.mallocs.load()),
      static_cast<unsigned long long>(sh.ooms.load()),
      static_cast<unsigned long long>(sh.foreign_frees.load()),
      static_cast<unsigned long long>(sh.record_streams.load()),
      static_cast<long long>(s.num_sync_all_streams), static_cast<long long>(s.num_device_alloc));
}

TEST_P(Stress, ConcurrentMallocFreeRecordStreamWithOomLadderAndInspection) {
  stress(GetParam(), /*ordered=*/false);
}

TEST_P(Stress, TheSameInPytorchsOrderOfStreams) {
  stress(GetParam(), /*ordered=*/true);
}

std::string config_name(const ::testing::TestParamInfo<const char*>& param) {
  constexpr const char* kNames[] = {"pytorch", "gc_and_max_split", "ccalloc", "ccalloc_gc"};
  return kNames[param.index];
}

INSTANTIATE_TEST_SUITE_P(
    Configs, Stress,
    ::testing::Values("pytorch", "pytorch,garbage_collection_threshold:0.6,max_split_size_mb:40",
                      "ccalloc,stitch_segments:True", "ccalloc,stitch_segments:True,garbage_collection_threshold:0.6"),
    config_name);

// Eight threads free (and record_stream) the same already-freed pointer over and over while
// other streams allocate: every call is an InvalidPointerError naming the pointer, nothing
// crashes and the state stays valid. The pointer's segment stays split by a live neighbour,
// so its address cannot be handed out again meanwhile.
TEST(StressDoubleFree, ThreadsHammeringAFreedPointerAllGetInvalidPointerError) {
  ccalloc::sim::SimDriver gpu(small_device(256 * kMiB));
  Allocator alloc(gpu, Config::parse("pytorch"));
  const DevicePtr freed = alloc.malloc(4096, 1);
  const DevicePtr neighbour = alloc.malloc(4096, 1);
  alloc.free(freed);

  constexpr int kThreads = 8;
  constexpr int kTries = 400;
  std::atomic<int> errors{0};
  Failures failures;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const StreamId other = static_cast<StreamId>(10 + t);
      for (int i = 0; i < kTries; ++i) {
        try {
          if (i % 4 == 3) {
            alloc.record_stream(freed, other);
          } else {
            alloc.free(freed);
          }
          failures.add("no error for a freed pointer");
        } catch (const ccalloc::InvalidPointerError& e) {
          if (e.ptr() != freed) failures.add("InvalidPointerError names the wrong pointer");
          errors.fetch_add(1);
        } catch (const std::exception& e) {
          failures.add(std::string("unexpected error: ") + e.what());
        }
        if (i % 8 == 0) {  // other streams keep allocating meanwhile
          try {
            alloc.free(alloc.malloc(static_cast<std::size_t>(1 + i) * 1024, other));
          } catch (const std::exception& e) {
            failures.add(std::string("malloc/free on another stream: ") + e.what());
          }
        }
      }
    });
  }
  for (std::thread& th : threads)
    th.join();
  failures.report();
  EXPECT_EQ(errors.load(), kThreads * kTries);
  EXPECT_NO_THROW(alloc.check_invariants());
  EXPECT_EQ(alloc.allocation_size(freed), 0u);
  EXPECT_EQ(alloc.allocation_size(neighbour), 4096u);
  const DeviceStats s = alloc.stats();
  EXPECT_EQ(s.allocation[kAggregate].current, 1);
  EXPECT_EQ(s.allocated_bytes[kAggregate].current, 4096);
  alloc.free(neighbour);
  alloc.empty_cache();
  EXPECT_NO_THROW(alloc.check_invariants());
  EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, 0);
  EXPECT_EQ(gpu.used_bytes(), 0u);
}

// Eight threads race to free the same live pointer: exactly one succeeds, the others get
// InvalidPointerError, and the statistics count one free.
TEST(StressDoubleFree, RacingFreesOfOneLivePointerSucceedExactlyOnce) {
  ccalloc::sim::SimDriver gpu(small_device(256 * kMiB));
  Allocator alloc(gpu, Config::parse("pytorch"));
  constexpr int kThreads = 8;
  constexpr int kRounds = 150;
  std::atomic<DevicePtr> target{0};
  std::atomic<int> successes{0};
  std::atomic<int> errors{0};
  Failures failures;
  std::barrier sync(kThreads + 1);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int round = 0; round < kRounds; ++round) {
        sync.arrive_and_wait();  // the target is set
        try {
          alloc.free(target.load());
          successes.fetch_add(1);
        } catch (const ccalloc::InvalidPointerError&) {
          errors.fetch_add(1);
        } catch (const std::exception& e) {
          failures.add(std::string("unexpected error: ") + e.what());
        }
        sync.arrive_and_wait();  // every thread tried
      }
    });
  }
  for (int round = 0; round < kRounds; ++round) {
    const auto size = static_cast<std::size_t>(round % 3 == 0 ? 3 * kMiB : 1000 + round);
    target.store(alloc.malloc(size, static_cast<StreamId>(round % 4)));
    sync.arrive_and_wait();
    sync.arrive_and_wait();
    if (successes.load() != round + 1) {
      failures.add("round " + std::to_string(round) + ": " + std::to_string(successes.load()) +
                   " successful frees in all, expected " + std::to_string(round + 1));
    }
  }
  for (std::thread& th : threads)
    th.join();
  failures.report();
  EXPECT_EQ(successes.load(), kRounds);
  EXPECT_EQ(errors.load(), kRounds * (kThreads - 1));
  EXPECT_NO_THROW(alloc.check_invariants());
  const DeviceStats s = alloc.stats();
  EXPECT_EQ(s.allocation[kAggregate].current, 0);
  EXPECT_EQ(s.allocation[kAggregate].allocated, kRounds);
  EXPECT_EQ(s.allocation[kAggregate].freed, kRounds);
  alloc.empty_cache();
  EXPECT_EQ(gpu.used_bytes(), 0u);
}

}  // namespace
