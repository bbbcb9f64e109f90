// Cache-hit malloc+free pairs on the simulated GPU: the allocator's own CPU cost, with no
// device call on the measured path (the first malloc creates the segment outside the loop).
//
//   build/bin/bench_hot_path --benchmark_repetitions=5 --benchmark_report_aggregates_only
#include <benchmark/benchmark.h>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"

namespace {

void BM_CacheHitPair(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  static ccalloc::sim::SimDriver gpu;
  static ccalloc::Allocator allocator(gpu, ccalloc::Config::parse(""));
  const ccalloc::StreamId stream = 7 + static_cast<ccalloc::StreamId>(state.thread_index());
  allocator.free(allocator.malloc(size, stream));  // warm: the segment exists from here on
  for (auto _ : state) {
    ccalloc::DevicePtr p = allocator.malloc(size, stream);
    benchmark::DoNotOptimize(p);
    allocator.free(p);
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["ns_per_pair"] = benchmark::Counter(
      static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

}  // namespace

BENCHMARK(BM_CacheHitPair)->Arg(512)->Arg(1 << 20)->UseRealTime();
// Each thread on its own stream: the per-stream arenas should let throughput scale.
BENCHMARK(BM_CacheHitPair)->Arg(512)->ThreadRange(1, 8)->UseRealTime();

BENCHMARK_MAIN();
