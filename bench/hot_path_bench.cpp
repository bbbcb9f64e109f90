// Cache-hit malloc+free pairs on the simulated GPU: the allocator's own CPU cost, with no
// device call on the measured path (the first malloc creates the memory outside the loop).
// And bench_gpu's random workload (random_ops.hpp), whose mallocs split and whose frees
// merge blocks among up to 256 live ones: the free pools' cost, again with the memory
// created before the timed passes. And a loop of a large and a small request on one stream.
// And, as a control for thread scaling, the pair with an allocator per thread (`_private`).
// Each policy is measured in the same run: the native engine (`pytorch` preset) and the
// `ccalloc` preset (the stitching policy with its private pools beside it).
//
//   build/bin/bench_hot_path --benchmark_repetitions=5 --benchmark_report_aggregates_only
#include <benchmark/benchmark.h>

#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"
#include "random_ops.hpp"

namespace {

// One allocator per preset, shared by the threads of a benchmark (each on its own stream).
template <const char* kPreset>
ccalloc::Allocator& allocator_for() {
  static ccalloc::sim::SimDriver gpu;
  static ccalloc::Allocator allocator(gpu, ccalloc::Config::parse(kPreset));
  return allocator;
}

// Cache-hit pairs of state.range(0) bytes on the thread's own stream of `allocator`.
void hit_pairs(benchmark::State& state, ccalloc::Allocator& allocator) {
  const auto size = static_cast<std::size_t>(state.range(0));
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

template <const char* kPreset>
void BM_CacheHitPair(benchmark::State& state) {
  hit_pairs(state, allocator_for<kPreset>());
}

// The control for thread scaling: each thread with an allocator (and simulated GPU) of its
// own, so that nothing at all is shared between the threads. Where this scales no better
// than BM_CacheHitPair's threads, the machine, not the allocator's shared state, sets the
// limit (a shared VM's cores do not each run at one lone thread's speed).
template <const char* kPreset>
void BM_CacheHitPairPrivate(benchmark::State& state) {
  ccalloc::sim::SimDriver gpu;
  ccalloc::Allocator allocator(gpu, ccalloc::Config::parse(kPreset));
  hit_pairs(state, allocator);
}

// One pass over the random sequence per iteration (the frees of what it leaves live untimed),
// on an allocator of its own; the first pass (untimed) creates the memory the later ones reuse.
template <const char* kPreset>
void BM_RandomMix(benchmark::State& state) {
  static const std::vector<ccalloc_bench::Op> ops = ccalloc_bench::make_random_ops(200'000);
  ccalloc::sim::SimDriver gpu;
  ccalloc::Allocator allocator(gpu, ccalloc::Config::parse(kPreset));
  std::vector<ccalloc::DevicePtr> live;
  live.reserve(ccalloc_bench::kRandomMaxLive);
  const auto pass = [&] {
    ccalloc_bench::run_random_ops(
        ops, ops.size(), live, [&](std::size_t bytes) { return allocator.malloc(bytes, 7); },
        [&](ccalloc::DevicePtr p) { allocator.free(p); });
  };
  const auto free_rest = [&] {
    for (const ccalloc::DevicePtr p : live)
      allocator.free(p);
    live.clear();
  };
  pass();
  free_rest();
  for (auto _ : state) {
    pass();
    state.PauseTiming();
    free_rest();
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(ops.size()));
  state.counters["ns_per_op"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * static_cast<double>(ops.size()),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// A large and a small request allocated and freed in a loop on one stream that has served
// large requests alone until then (settled; its small pool has no memory of its own): the
// small request's page may pass between the pools at each iteration (docs/ccalloc-policy.md,
// rule 2). The first iterations (untimed) create what the loop reuses.
template <const char* kPreset>
void BM_LargeAndSmallLoop(benchmark::State& state) {
  ccalloc::sim::SimDriver gpu;
  ccalloc::Allocator allocator(gpu, ccalloc::Config::parse(kPreset));
  constexpr std::size_t kLarge = 1 << 20, kSmall = 512;
  constexpr ccalloc::StreamId kStream = 7;
  for (int i = 0; i < 64; ++i)
    allocator.free(allocator.malloc(kLarge, kStream));
  const auto iteration = [&] {
    const ccalloc::DevicePtr large = allocator.malloc(kLarge, kStream);
    ccalloc::DevicePtr small = allocator.malloc(kSmall, kStream);  // DoNotOptimize: not const
    benchmark::DoNotOptimize(small);
    allocator.free(large);
    allocator.free(small);
  };
  for (int i = 0; i < 16; ++i)
    iteration();
  for (auto _ : state)
    iteration();
  state.SetItemsProcessed(state.iterations());
  state.counters["ns_per_iteration"] =
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
BENCHMARK(BM_RandomMix<kNative>)->Name("native_random")->UseRealTime();
BENCHMARK(BM_RandomMix<kStitch>)->Name("stitch_random")->UseRealTime();
BENCHMARK(BM_LargeAndSmallLoop<kNative>)->Name("native_large_and_small")->UseRealTime();
BENCHMARK(BM_LargeAndSmallLoop<kStitch>)->Name("stitch_large_and_small")->UseRealTime();
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

BENCHMARK(BM_CacheHitPairPrivate<kNative>)->Name("native_private")->Arg(512)->UseRealTime();
BENCHMARK(BM_CacheHitPairPrivate<kStitch>)->Name("stitch_private")->Arg(512)->UseRealTime();
BENCHMARK(BM_CacheHitPairPrivate<kNative>)
    ->Name("native_private")
    ->Arg(512)
    ->ThreadRange(2, 8)
    ->UseRealTime();
BENCHMARK(BM_CacheHitPairPrivate<kStitch>)
    ->Name("stitch_private")
    ->Arg(512)
    ->ThreadRange(2, 8)
    ->UseRealTime();

BENCHMARK_MAIN();
