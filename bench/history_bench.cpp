// The cost of recording history on the hot path: a cache-hit malloc+free pair on the
// simulated GPU with history off, with entries but no stacks (context none), and with
// C++ stacks of about 20 frames captured at malloc (context state/alloc) or at malloc and
// free (context all).
//
//   build/bin/bench_history --benchmark_repetitions=5 --benchmark_report_aggregates_only
#include <benchmark/benchmark.h>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"

namespace {

enum Mode : int { kOff, kContextNone, kContextState, kContextAlloc, kContextAll };

ccalloc::HistoryOptions options_for(Mode mode) {
  ccalloc::HistoryOptions o;
  o.max_entries = 1 << 16;
  o.stacks = ccalloc::HistoryOptions::Stacks::kCpp;
  switch (mode) {
    case kOff:
      o.enabled = ccalloc::HistoryOptions::Enabled::kNone;
      break;
    case kContextNone:
      o.context = ccalloc::HistoryOptions::Context::kNone;
      o.stacks = ccalloc::HistoryOptions::Stacks::kNone;
      break;
    case kContextState:
      o.context = ccalloc::HistoryOptions::Context::kState;
      break;
    case kContextAlloc:
      o.context = ccalloc::HistoryOptions::Context::kAlloc;
      break;
    case kContextAll:
      o.context = ccalloc::HistoryOptions::Context::kAll;
      break;
  }
  return o;
}

// Runs the measured loop `depth` calls deep, so captured stacks have that many frames.
[[gnu::noinline]] void run_at_depth(int depth, benchmark::State& state, ccalloc::Allocator& alloc) {
  if (depth > 0) {
    run_at_depth(depth - 1, state, alloc);
    benchmark::ClobberMemory();  // not a tail call: keep the frame
    return;
  }
  for (auto _ : state) {
    ccalloc::DevicePtr p = alloc.malloc(512, 0);
    benchmark::DoNotOptimize(p);
    alloc.free(p);
  }
}

void BM_PairWithHistory(benchmark::State& state) {
  const auto mode = static_cast<Mode>(state.range(0));
  ccalloc::sim::SimDriver gpu;
  ccalloc::Allocator alloc(gpu, ccalloc::Config::parse(""));
  alloc.record_history(options_for(mode));
  alloc.free(alloc.malloc(512, 0));
  run_at_depth(17, state, alloc);  // + the benchmark's own frames: about 20
  state.SetItemsProcessed(state.iterations());
}

}  // namespace

BENCHMARK(BM_PairWithHistory)
    ->ArgName("mode")
    ->Arg(kOff)
    ->Arg(kContextNone)
    ->Arg(kContextState)
    ->Arg(kContextAlloc)
    ->Arg(kContextAll);

BENCHMARK_MAIN();
