// Captures begin and end on one thread while other threads allocate, free and use blocks
// across streams: no worker may query or record an event or free device memory while the
// capture is underway (the simulated GPU throws if one does), captured allocations land in
// the pool and the workers' never do, and the state is consistent afterwards.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "test_support.hpp"

namespace ccalloc {
namespace {

using ccalloc_test::CapturedBlock;
using ccalloc_test::check_reuse_in_capture;

TEST(PrivatePoolsConcurrency, CapturesBesideBusyStreamsStayApartAndSafe) {
  // PyTorch's policy on native and on expandable segments; the stitching policy (the
  // `ccalloc` preset) with its private pools on expandable and on native segments.
  for (const std::string conf : {"pytorch", "pytorch,expandable_segments:True", "ccalloc",
                                 "ccalloc,expandable_segments:False"}) {
    SCOPED_TRACE(conf);
    sim::Options o;
    o.capacity = std::size_t{4} << 30;
    sim::SimDriver driver(o);
    Allocator alloc(driver, Config::parse(conf));
    constexpr StreamId kCaptured = 100;
    std::atomic<bool> stop{false};
    std::atomic<int> failures{0};
    std::atomic<long> operations{0};
    const PoolId pool{0, 1};
    constexpr int kRounds = 500;
    // The pool's segments exist before the workers start, so captures never need the
    // device (which busy workers may exhaust while frees wait for captures to end).
    alloc.create_pool(pool);
    alloc.begin_allocate_to_pool(pool, [](StreamId s) { return s == kCaptured; });
    alloc.free(alloc.malloc(4096, kCaptured));
    alloc.free(alloc.malloc(5 << 20, kCaptured));
    alloc.end_allocate_to_pool(pool);
    std::vector<std::thread> workers;
    for (int w = 0; w < 3; ++w) {
      workers.emplace_back([&, w] {
        std::mt19937_64 rng(static_cast<std::uint64_t>(w));
        std::vector<DevicePtr> live;
        const StreamId stream = static_cast<StreamId>(w + 1);
        try {
          while (!stop.load()) {
            if (live.size() < 16 && rng() % 2 == 0) {
              DevicePtr p = 0;
              try {
                p = alloc.malloc(1 + rng() % (3 << 20), stream);
              } catch (const OutOfMemoryError&) {
                // Cross-stream frees wait while captures are underway and nothing cached
                // goes back to the device then: a busy capturer can exhaust the device.
                continue;
              }
              if (alloc.segment_pool(p) != PoolId{}) ++failures;
              if (rng() % 3 == 0) alloc.record_stream(p, stream + 10);
              live.push_back(p);
            } else if (!live.empty()) {
              const std::size_t i = rng() % live.size();
              alloc.free(live[i]);
              live[i] = live.back();
              live.pop_back();
            }
            if (rng() % 64 == 0) alloc.empty_cache();
            ++operations;
          }
          for (const DevicePtr p : live)
            alloc.free(p);
        } catch (const std::exception& e) {
          ADD_FAILURE() << "worker " << w << ": " << e.what();
        }
      });
    }
    try {
      for (int round = 0; round < kRounds; ++round) {
        alloc.begin_allocate_to_pool(pool, [](StreamId s) { return s == kCaptured; });
        driver.begin_capture(kCaptured);
        const DevicePtr a = alloc.malloc(4096, kCaptured);
        const DevicePtr b = alloc.malloc(5 << 20, kCaptured);
        EXPECT_EQ(alloc.segment_pool(a), pool);
        EXPECT_EQ(alloc.segment_pool(b), pool);
        alloc.free(a);
        alloc.free(b);
        // The capture ends on the device before the engine may touch events again.
        driver.end_capture(kCaptured);
        alloc.end_allocate_to_pool(pool);
        driver.complete_all();
        std::this_thread::sleep_for(std::chrono::microseconds(50));  // time outside capture
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << "capturing thread: " << e.what();
    }
    stop.store(true);
    for (std::thread& t : workers)
      t.join();
    EXPECT_EQ(failures.load(), 0);
    EXPECT_EQ(alloc.pool_use_count(pool), kRounds + 2);
    EXPECT_GT(operations.load(), 100);
    alloc.check_invariants();
    EXPECT_EQ(alloc.stats().allocation[kAggregate].current, 0);
  }
}

// graph_capture_record_stream_reuse from several threads of one capture
// (docs/graph-capture-reuse.md): three threads, each on its own stream of the capture,
// allocate, free, queue work that uses their blocks on the other streams (record_stream) and
// make their stream wait for another. Whenever a thread's allocation overlaps memory one of
// its earlier allocations had, every node that used the earlier one must be an ancestor of
// its stream's terminals; blocks must have been reused so; the state is consistent after.
TEST(PrivatePoolsConcurrency, GraphReuseFromSeveralThreadsOfOneCapture) {
  for (const std::string conf : {"pytorch,graph_capture_record_stream_reuse:True",
                                 "ccalloc,graph_capture_record_stream_reuse:True"}) {
    SCOPED_TRACE(conf);
    sim::Options o;
    o.capacity = std::size_t{4} << 30;
    sim::SimDriver driver(o);
    Allocator alloc(driver, Config::parse(conf));
    const PoolId pool{0, 2};
    driver.begin_capture(1);
    driver.capture_join(2, 1);
    driver.capture_join(3, 1);
    alloc.begin_allocate_to_pool(pool, [&driver](StreamId s) { return driver.is_capturing(s); });
    std::atomic<long> reuses{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t) {
      threads.emplace_back([&, t] {
        const StreamId own = static_cast<StreamId>(t + 1);
        std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 11);
        std::vector<CapturedBlock> live;
        std::vector<CapturedBlock> freed;
        try {
          for (int step = 0; step < 1500; ++step) {
            const int op = static_cast<int>(rng() % 100);
            if (op < 30 || live.empty()) {
              const std::size_t size = 512 * (1 + rng() % 512);
              const DevicePtr p = alloc.malloc(size, own);
              reuses +=
                  static_cast<long>(check_reuse_in_capture(driver, own, p, size, freed).cross);
              live.push_back(CapturedBlock{p, size, own, {}, false});
            } else if (op < 55) {
              CapturedBlock& h = live[rng() % live.size()];
              const StreamId on = static_cast<StreamId>(1 + rng() % 3);
              if (on != own) {
                alloc.record_stream(h.ptr, on);
                h.cross = true;
              }
              h.uses.push_back(driver.capture_work(on));
            } else if (op < 80) {
              const std::size_t i = rng() % live.size();
              alloc.free(live[i].ptr);
              freed.push_back(std::move(live[i]));
              live[i] = std::move(live.back());
              live.pop_back();
            } else {
              const StreamId other = static_cast<StreamId>(1 + rng() % 3);
              if (other != own) driver.capture_join(own, other);
            }
            // Old frees are unlikely to be overlapped again: keep the list short.
            if (freed.size() > 64) freed.erase(freed.begin(), freed.begin() + 32);
          }
          for (const CapturedBlock& h : live)
            alloc.free(h.ptr);
        } catch (const std::exception& e) {
          ADD_FAILURE() << "thread " << t << ": " << e.what();
        }
      });
    }
    for (std::thread& th : threads)
      th.join();
    alloc.end_allocate_to_pool(pool);
    driver.end_capture(1);
    EXPECT_GT(reuses.load(), 10);
    alloc.check_invariants();
    alloc.empty_cache();
    alloc.check_invariants();
    EXPECT_EQ(alloc.stats().allocation[kAggregate].current, 0);
    EXPECT_EQ(alloc.stats().active[kAggregate].current, 0);
  }
}

}  // namespace
}  // namespace ccalloc
