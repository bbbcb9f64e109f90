// Live reconfiguration under concurrency (label "concurrency": run under ThreadSanitizer).
// Worker threads malloc and free on their own streams while another thread cycles the
// allocator through settings that change rounding, splitting, garbage collection and the
// kind of new segments, under the `pytorch` preset and the `ccalloc` preset (the stitching
// policy, whose settings reach both of its engines). Every operation sees one config or the
// next, never a mixture: the invariant checker, run concurrently and at the end, holds,
// every allocation is at least its request and 512-byte aligned, and everything returns to
// the device at the end.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"
#include "core/backend_access.hpp"

namespace ccalloc {
namespace {

class ReconfigureMt : public ::testing::TestWithParam<std::string> {};

TEST_P(ReconfigureMt, SettingsChangeWhileThreadsAllocate) {
  sim::Options o;
  o.capacity = std::size_t{16} << 30;  // never out of memory
  sim::SimDriver gpu(o);
  const std::string preset = GetParam();
  Allocator alloc(gpu, Config::parse(preset));
  const std::vector<Config> configs = {
      Config::parse(preset + ",max_split_size_mb:20,roundup_power2_divisions:4"),
      Config::parse(preset + (preset == "pytorch" ? ",expandable_segments:True"
                                                  : ",expandable_segments:False")),
      Config::parse(preset + ",garbage_collection_threshold:0.5,max_split_size_mb:64"),
      Config::parse(preset),
  };
  constexpr int kWorkers = 4;
  constexpr int kOps = 1000;      // per worker, at least
  constexpr int kChanges = 60;    // reconfigurations while the workers run
  std::atomic<int> changes{0};
  std::atomic<int> bad{0};

  std::vector<std::thread> threads;
  for (int t = 0; t < kWorkers; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<std::uint32_t>(7 + t));
      const StreamId stream = static_cast<StreamId>(30 + t);
      std::vector<DevicePtr> live;
      for (int i = 0; i < kOps || changes.load() < kChanges; ++i) {
        if (live.size() < 24 && rng() % 3 != 0) {
          const std::size_t size = rng() % 4 == 0 ? 1 + rng() % (40u << 20) : 1 + rng() % (1u << 20);
          const DevicePtr p = alloc.malloc(size, stream);
          if (p % 512 != 0 || alloc.allocation_size(p) < size) bad.fetch_add(1);
          live.push_back(p);
        } else if (!live.empty()) {
          const std::size_t k = rng() % live.size();
          alloc.free(live[k]);
          live[k] = live.back();
          live.pop_back();
        }
      }
      for (const DevicePtr p : live)
        alloc.free(p);
    });
  }
  std::thread changer([&] {
    for (int i = 0; i < kChanges; ++i) {
      EXPECT_TRUE(core::reconfigure(alloc, configs[static_cast<std::size_t>(i) % configs.size()]));
      alloc.check_invariants();
      changes.fetch_add(1);
      std::this_thread::yield();
    }
  });
  for (auto& th : threads)
    th.join();
  changer.join();

  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(alloc.config(), configs.back());
  alloc.check_invariants();
  const DeviceStats s = alloc.stats();
  EXPECT_EQ(s.allocation[kAggregate].current, 0);
  EXPECT_EQ(s.oversize_allocations.current, 0);
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes[kAggregate].current, 0);
  EXPECT_EQ(gpu.used_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Presets, ReconfigureMt, ::testing::Values("pytorch", "ccalloc"));

}  // namespace
}  // namespace ccalloc
