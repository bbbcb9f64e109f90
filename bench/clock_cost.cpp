// What a look at the time costs on this machine: the processor's cycle counter (rdtsc, what
// the stitching policy's side-stream free reads to skip its fence poll), the steady clock
// and clock_gettime (what a poll reads), in ns per read, three rounds:
//
//   build/release/bin/bench_clock_cost
#include <time.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

#include "sync/cycle_gate.hpp"

namespace {

template <class Read>
double ns_per_read(Read read, long n) {
  const auto start = std::chrono::steady_clock::now();
  std::uint64_t sum = 0;
  for (long i = 0; i < n; ++i)
    sum += read();
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  if (sum == 42) std::puts("");  // keeps the reads
  return ns / static_cast<double>(n);
}

}  // namespace

int main() {
  if (ccalloc::core::cycle_count() == 0) std::puts("no cycle counter on this processor");
  for (int round = 0; round < 3; ++round) {
    const double counter = ns_per_read([] { return ccalloc::core::cycle_count(); }, 10'000'000);
    const double steady = ns_per_read(
        [] {
          return static_cast<std::uint64_t>(
              std::chrono::steady_clock::now().time_since_epoch().count());
        },
        3'000'000);
    const double gettime = ns_per_read(
        [] {
          timespec t{};
          clock_gettime(CLOCK_MONOTONIC, &t);
          return static_cast<std::uint64_t>(t.tv_nsec);
        },
        3'000'000);
    std::printf("cycle counter %.1f ns  steady_clock %.1f ns  clock_gettime %.1f ns\n", counter,
                steady, gettime);
  }
  return 0;
}
