// The random allocation workload of bench_gpu and bench_hot_path: the same seeded sequence
// of mallocs (log-uniform sizes, 512 B to 64 MiB) and frees (a uniformly chosen live block),
// with at most kRandomMaxLive blocks live.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace ccalloc_bench {

inline constexpr std::size_t kRandomMaxLive = 256;
inline constexpr std::uint64_t kRandomSeed = 0xCCA110C;

// One step: allocate `value` bytes, or free live[value] (the last live block moves into its
// slot).
struct Op {
  std::uint64_t value;
  bool is_alloc;
};

inline std::vector<Op> make_random_ops(std::size_t steps, std::uint64_t seed = kRandomSeed) {
  constexpr std::uint64_t kMin = 512, kMax = std::uint64_t{64} << 20;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(std::log(static_cast<double>(kMin)),
                                                  std::log(static_cast<double>(kMax)));
  std::bernoulli_distribution coin(0.5);
  std::vector<Op> ops;
  ops.reserve(steps);
  std::size_t live = 0;
  for (std::size_t i = 0; i < steps; ++i) {
    if (live < kRandomMaxLive && (live == 0 || coin(rng))) {
      const auto size = static_cast<std::uint64_t>(std::exp(log_size(rng)));
      ops.push_back({std::clamp<std::uint64_t>(size, kMin, kMax), true});
      ++live;
    } else {
      std::uniform_int_distribution<std::uint64_t> pick(0, live - 1);
      ops.push_back({pick(rng), false});
      --live;
    }
  }
  return ops;
}

// Runs ops[0, n): alloc(bytes) for a malloc, release(ptr) for a free, the live blocks in
// `live` (what is left live stays there for the caller).
template <typename Ptr, typename Alloc, typename Release>
void run_random_ops(const std::vector<Op>& ops, std::size_t n, std::vector<Ptr>& live,
                    Alloc&& alloc, Release&& release) {
  for (std::size_t i = 0; i < n; ++i) {
    const Op op = ops[i];
    if (op.is_alloc) {
      live.push_back(alloc(op.value));
    } else {
      const Ptr p = live[op.value];
      live[op.value] = live.back();
      live.pop_back();
      release(p);
    }
  }
}

}  // namespace ccalloc_bench
