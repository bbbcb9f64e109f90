// Caller contexts under concurrency: handles taken on many threads and streams while
// history is switched between levels, cleared and snapshotted; every handle is released
// exactly once by the time the allocator is gone. Runs under TSan (label "concurrency").
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"

namespace {

using ccalloc::ContextHandle;
using ccalloc::DevicePtr;
using ccalloc::HistoryOptions;

struct Counted {
  std::atomic<int> taken{0};
  std::atomic<int> released{0};
  HistoryOptions options(HistoryOptions::Enabled enabled, HistoryOptions::Context context,
                         bool clear) {
    HistoryOptions o;
    o.enabled = enabled;
    o.context = context;
    o.stacks = HistoryOptions::Stacks::kNone;
    o.max_entries = 64;
    o.clear = clear;
    o.capture_context = [this] {
      const int id = ++taken;
      return ContextHandle(new int(id), [this](const void* p) {
        delete static_cast<const int*>(p);
        ++released;
      });
    };
    return o;
  }
};

void run(const char* config) {
  Counted c;
  {
    ccalloc::sim::SimDriver gpu;
    ccalloc::Allocator alloc(gpu, ccalloc::Config::parse(config));
    alloc.record_history(c.options(HistoryOptions::Enabled::kAll, HistoryOptions::Context::kAll,
                                   false));
    std::atomic<bool> stop{false};
    std::vector<std::thread> workers;
    for (int t = 0; t < 4; ++t) {
      workers.emplace_back([&alloc, t] {
        std::vector<DevicePtr> held;
        const auto stream = static_cast<ccalloc::StreamId>(t % 2);  // two threads per stream
        for (int i = 0; i < 2000; ++i) {
          held.push_back(alloc.malloc(static_cast<std::size_t>(512 + (i * 7919 + t) % 5000000),
                                      stream));
          if (held.size() > 8) {
            alloc.free(held.front());
            held.erase(held.begin());
          }
          if (i % 50 == 0) alloc.empty_cache();
        }
        for (DevicePtr p : held)
          alloc.free(p);
      });
    }
    std::thread toggler([&] {
      using E = HistoryOptions::Enabled;
      using C = HistoryOptions::Context;
      const E enabled[] = {E::kAll, E::kState, E::kNone, E::kAll};
      const C context[] = {C::kAll, C::kAlloc, C::kState, C::kNone};
      for (int i = 0; !stop.load(); ++i) {
        alloc.record_history(c.options(enabled[i % 4], context[(i / 4) % 4], i % 3 == 0));
        const ccalloc::Snapshot s = alloc.snapshot();
        (void)alloc.segments();
        std::this_thread::yield();
      }
    });
    for (auto& w : workers)
      w.join();
    stop = true;
    toggler.join();
    EXPECT_GT(c.taken.load(), 0);
  }
  EXPECT_EQ(c.released.load(), c.taken.load());
}

TEST(HistoryContextMt, EveryHandleIsReleasedOnceNativeEngine) {
  run("pytorch");
}

TEST(HistoryContextMt, EveryHandleIsReleasedOnceExpandableSegments) {
  run("pytorch,expandable_segments:True");
}

TEST(HistoryContextMt, EveryHandleIsReleasedOnceOtherBackends) {
  run("backend:cudaMallocAsync");
  run("pytorch,stitch_segments:True");
}

}  // namespace
