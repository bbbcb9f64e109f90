// A fixed number of cache-hit malloc+free pairs on the simulated GPU, for instruction counts
// that repeat exactly from run to run (valgrind --tool=callgrind counts instructions, not
// time; docs/hot-path.md):
//
//   valgrind --tool=callgrind build/release/bin/bench_hit_loop ccalloc 512 100000
//
// Arguments: the configuration (CCALLOC_CONF grammar), the request in bytes, the pairs, and
// optionally how many streams have allocated before (default 1: only the loop's; more
// turn on what a process of several streams runs, such as the stitching policy's sharing
// of memory between streams). The first pair, which creates the memory, is made before the
// loop; the loop's share of the count is the total less a run of 0 pairs. A fifth argument
// `wall` runs the simulated GPU's clock in real time (sim::Options::wall_clock), as a real
// device's: a stream that shares then gates its frees' fence polls as on a device. The
// loop's wall time per pair goes to stderr ("ns_per_pair N"), for timing two builds side by
// side (scripts/hit-ab).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"

int main(int argc, char** argv) {
  if (argc < 4 || argc > 6 || (argc == 6 && std::string(argv[5]) != "wall")) {
    std::fprintf(stderr, "usage: %s CONF BYTES PAIRS [STREAMS [wall]]\n", argv[0]);
    return 2;
  }
  const std::size_t bytes = std::strtoull(argv[2], nullptr, 10);
  const long pairs = std::strtol(argv[3], nullptr, 10);
  const long streams = argc >= 5 ? std::strtol(argv[4], nullptr, 10) : 1;
  ccalloc::sim::Options options;
  options.wall_clock = argc == 6;
  ccalloc::sim::SimDriver gpu(options);
  ccalloc::Allocator allocator(gpu, ccalloc::Config::parse(argv[1]));
  for (long s = 1; s < streams; ++s)
    allocator.free(allocator.malloc(bytes, static_cast<ccalloc::StreamId>(7 + s)));
  allocator.free(allocator.malloc(bytes, 7));
  ccalloc::DevicePtr sum = 0;
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < pairs; ++i) {
    const ccalloc::DevicePtr p = allocator.malloc(bytes, 7);
    sum ^= p;
    allocator.free(p);
  }
  const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
  if (pairs > 0)
    std::fprintf(stderr, "ns_per_pair %.2f\n", took.count() / static_cast<double>(pairs));
  std::printf("%llu\n", static_cast<unsigned long long>(sum));
  return 0;
}
