// Cache-hit malloc+free pairs on the simulated GPU: the allocator's own CPU cost, with no
// device call on the measured path (the first malloc creates the memory outside the loop).
// Each policy is measured in the same run: the native engine (`pytorch` preset) and the
// `ccalloc` preset (the stitching policy with its private pools beside it).
//
//   build/bin/bench_hot_path --benchmark_repetitions=5 --benchmark_report_aggregates_only
#include <benchmark/benchmark.h>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"

namespace {

// One allocator per preset, shared by the threads of a benchmark (each on its own stream).
template <const char* kPreset>
ccalloc::Allocator& allocator_for() {
  static ccalloc::sim::SimDriver gpu;
  static ccalloc::Allocator allocator(gpu, ccalloc::Config::parse(kPreset));
  return allocator;
}

template <const char* kPreset>
void BM_CacheHitPair(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  ccalloc::Allocator& allocator = allocator_for<kPreset>();
  const ccalloc::StreamId stream = 7 + static_cast<ccalloc::StreamId>(state.thread_index());
  allocator.free(allocator.malloc(size, stream));  // warm: the memory exists from here on
  for (auto _ : state) {
    ccalloc::DevicePtr p = allocator.malloc(size, stream);
    benchmark::DoNotOptimize(p);
    allocator.free(p);
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["ns_per_pair"] =
      benchmark::Counter(static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

constexpr char kNative[] = "pytorch";
constexpr char kStitch[] = "ccalloc";

}  // namespace

// One thread (names end in real_time: scripts/gpu-check pins these to one CPU), then 2 to 8
// threads, each on its own stream: per-stream arenas should let throughput scale.
BENCHMARK(BM_CacheHitPair<kNative>)->Name("native")->Arg(512)->Arg(1 << 20)->UseRealTime();
BENCHMARK(BM_CacheHitPair<kStitch>)->Name("stitch")->Arg(512)->Arg(1 << 20)->UseRealTime();
BENCHMARK(BM_CacheHitPair<kNative>)
    ->Name("native")
    ->Arg(512)
    ->Arg(1 << 20)
    ->ThreadRange(2, 8)
    ->UseRealTime();
BENCHMARK(BM_CacheHitPair<kStitch>)
    ->Name("stitch")
    ->Arg(512)
    ->Arg(1 << 20)
    ->ThreadRange(2, 8)
    ->UseRealTime();

BENCHMARK_MAIN();
