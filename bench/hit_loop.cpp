// A fixed number of cache-hit malloc+free pairs on the simulated GPU, for instruction counts
// that repeat exactly from run to run (valgrind --tool=callgrind counts instructions, not
// time; docs/hot-path.md):
//
//   valgrind --tool=callgrind build/release/bin/bench_hit_loop ccalloc 512 100000
//
// Arguments: the configuration (CCALLOC_CONF grammar), the request in bytes, the pairs. The
// first pair, which creates the memory, is made before the loop; the loop's share of the
// count is the total less a run of 0 pairs.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "ccalloc/allocator.hpp"
#include "ccalloc/sim.hpp"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s CONF BYTES PAIRS\n", argv[0]);
    return 2;
  }
  const std::size_t bytes = std::strtoull(argv[2], nullptr, 10);
  const long pairs = std::strtol(argv[3], nullptr, 10);
  ccalloc::sim::SimDriver gpu;
  ccalloc::Allocator allocator(gpu, ccalloc::Config::parse(argv[1]));
  allocator.free(allocator.malloc(bytes, 7));
  ccalloc::DevicePtr sum = 0;
  for (long i = 0; i < pairs; ++i) {
    const ccalloc::DevicePtr p = allocator.malloc(bytes, 7);
    sum ^= p;
    allocator.free(p);
  }
  std::printf("%llu\n", static_cast<unsigned long long>(sum));
  return 0;
}
