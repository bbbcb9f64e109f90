// What the tests of the engines' parked block share (native_park_test.cpp,
// stitch_park_test.cpp): two engines of one kind, parking on (`parked`) and off (`pooled`),
// each over a simulated GPU of its own, driven by the same calls and compared; and random
// work over such a pair.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "ccalloc/config.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/stats.hpp"

namespace ccalloc::test {

// E: the engine; Access: its test access, with set_parking(E&, bool) and
// parked(E&, StreamId) (the stream's parked block's address, 0 for none).
template <typename E, typename Access>
struct ParkPair {
  // `large_above`: requests and frees above it count as large ones.
  ParkPair(std::size_t capacity, const char* config, std::size_t large_above)
      : gpu_a(device(capacity)), gpu_b(device(capacity)),
        parked(gpu_a, Config::parse(config)), pooled(gpu_b, Config::parse(config)),
        large_above_(large_above) {
    Access::set_parking(pooled, false);
  }

  // malloc on both: the same address, or the same OOM; counts the take-backs.
  DevicePtr malloc(std::size_t size, StreamId stream) {
    const auto attempt = [&](E& e, bool& oom) -> DevicePtr {
      try {
        return e.malloc(size, stream);
      } catch (const OutOfMemoryError&) {
        oom = true;
        return 0;
      }
    };
    bool oom_a = false, oom_b = false;
    const DevicePtr was_parked = Access::parked(parked, stream);
    const DevicePtr a = attempt(parked, oom_a);
    if (a != 0 && a == was_parked) {
      ++takes;
      if (size > large_above_) ++large_takes;
    }
    const DevicePtr b = attempt(pooled, oom_b);
    EXPECT_EQ(oom_a, oom_b) << size << " B on stream " << stream;
    EXPECT_EQ(a, b) << size << " B on stream " << stream;
    return a;
  }
  // free on both; counts the frees that parked (`stream`: the allocation's).
  void free(DevicePtr p, StreamId stream = 0, std::size_t size = 0) {
    parked.free(p);
    pooled.free(p);
    if (Access::parked(parked, stream) == p) {
      ++parks;
      if (size > large_above_) ++large_parks;
    }
  }
  void record_stream(DevicePtr p, StreamId stream) {
    parked.record_stream(p, stream);
    pooled.record_stream(p, stream);
  }
  void complete_stream(StreamId stream) {
    gpu_a.complete_stream(stream);
    gpu_b.complete_stream(stream);
  }

  // Everything a caller can see, equal (the views pool the parked blocks first): the
  // statistics, the segments and their blocks, the driver's calls. `more(a, b)` compares
  // what else an engine's segments carry.
  template <typename More>
  void expect_same_views(More&& more) {
    EXPECT_EQ(parked.stats(), pooled.stats());
    const auto sa = parked.segments(), sb = pooled.segments();
    ASSERT_EQ(sa.size(), sb.size());
    for (std::size_t i = 0; i < sa.size(); ++i) {
      EXPECT_EQ(sa[i].address, sb[i].address);
      EXPECT_EQ(sa[i].total_size, sb[i].total_size);
      EXPECT_EQ(sa[i].allocated_size, sb[i].allocated_size);
      EXPECT_EQ(sa[i].active_size, sb[i].active_size);
      ASSERT_EQ(sa[i].blocks.size(), sb[i].blocks.size()) << "segment " << i;
      for (std::size_t j = 0; j < sa[i].blocks.size(); ++j) {
        EXPECT_EQ(sa[i].blocks[j].address, sb[i].blocks[j].address);
        EXPECT_EQ(sa[i].blocks[j].size, sb[i].blocks[j].size);
        EXPECT_EQ(sa[i].blocks[j].state, sb[i].blocks[j].state);
      }
      more(sa[i], sb[i]);
    }
    EXPECT_EQ(gpu_a.counters(), gpu_b.counters());
  }

  // A request of the parked block's rounded size may ask for more bytes than it did (500
  // B freed, 512 B asked): the take must raise the requested bytes' peak to 512.
  void expect_take_raises_requested_peak() {
    const DevicePtr a = malloc(500, 0);
    free(a);
    EXPECT_EQ(Access::parked(parked, 0), a);
    EXPECT_EQ(malloc(512, 0), a);
    EXPECT_EQ(takes, 1);
    EXPECT_EQ(parked.stats().requested_bytes[kAggregate].peak, 512);
  }

  sim::SimDriver gpu_a, gpu_b;
  E parked, pooled;
  int parks = 0, large_parks = 0, takes = 0, large_takes = 0;

 private:
  static sim::Options device(std::size_t capacity) {
    sim::Options o;
    o.capacity = capacity;
    return o;
  }
  const std::size_t large_above_;
};

// Random work on three streams, `ops` operations: mallocs (mostly on stream 0; a third of
// any size up to 256 KiB, else one of `sizes`), frees biased to the most recent allocation
// so that parking is frequent (one in eight used on another stream first), completions of
// a stream's work and, rarely, empty_cache; the clock advances by up to 0.5 ms an
// operation. `after(i)` runs after operation i (the caller's comparisons); the work stops
// at the first failure.
template <typename Pair, typename After>
void random_park_work(Pair& p, unsigned seed, std::span<const std::size_t> sizes, int ops,
                      After&& after) {
  std::mt19937 rng(seed);
  struct Live {
    DevicePtr ptr;
    StreamId stream;
    std::size_t size;
  };
  std::vector<Live> live;
  std::int64_t now = 0;
  for (int i = 0; i < ops; ++i) {
    now += static_cast<std::int64_t>(rng() % 500);
    p.gpu_a.set_time_us(now);
    p.gpu_b.set_time_us(now);
    const unsigned op = rng() % 100;
    if (op < 48 || live.empty()) {
      const StreamId s = rng() % 4 == 0 ? 1 + rng() % 2 : 0;
      const std::size_t size =
          rng() % 3 == 0 ? 1 + rng() % 262144 : sizes[rng() % sizes.size()];
      const DevicePtr ptr = p.malloc(size, s);
      if (ptr != 0) live.push_back(Live{ptr, s, size});
    } else if (op < 96) {
      const std::size_t k = rng() % 3 != 0 ? live.size() - 1 : rng() % live.size();
      const Live l = live[k];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      if (rng() % 8 == 0) p.record_stream(l.ptr, (l.stream + 1) % 3);
      p.free(l.ptr, l.stream, l.size);
    } else if (op < 99) {
      p.complete_stream(rng() % 3);
    } else {
      p.parked.empty_cache();
      p.pooled.empty_cache();
    }
    after(i);
    if (testing::Test::HasFailure()) return;
  }
}

}  // namespace ccalloc::test
