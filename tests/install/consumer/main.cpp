// Uses only the installed headers and ccalloc::ccalloc: allocates on the simulated GPU,
// writes a snapshot file and reads it back. Exits non-zero, naming the value, on a mismatch.
#include <ccalloc/allocator.hpp>
#include <ccalloc/config.hpp>
#include <ccalloc/sim.hpp>
#include <ccalloc/snapshot.hpp>
#include <ccalloc/snapshot_io.hpp>

#include <cstdint>
#include <iostream>
#include <string>

namespace {

int failures = 0;

void expect(const char* what, std::uint64_t actual, std::uint64_t expected) {
  if (actual != expected) {
    std::cerr << "consumer: " << what << " is " << actual << ", expected " << expected << "\n";
    ++failures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: consumer SNAPSHOT.pickle.gz\n";
    return 2;
  }
  const std::string path = argv[1];
  ccalloc::sim::SimDriver gpu;
  ccalloc::Allocator alloc(gpu, ccalloc::Config::parse("pytorch"));
  alloc.record_history(ccalloc::HistoryOptions{});

  // A small request: rounded up to a multiple of 512 bytes, from a 2 MiB small-pool segment.
  const ccalloc::DevicePtr p = alloc.malloc(1000);
  expect("allocation_size(p)", alloc.allocation_size(p), 1024);
  expect("allocated_bytes.current", alloc.stats().allocated_bytes[ccalloc::kAggregate].current,
         1024);
  expect("reserved_bytes.current", alloc.stats().reserved_bytes[ccalloc::kAggregate].current,
         2u << 20);
  alloc.free(p);
  expect("allocated_bytes.current after free",
         alloc.stats().allocated_bytes[ccalloc::kAggregate].current, 0);

  ccalloc::io::write_snapshot(path, alloc.snapshot());
  const ccalloc::Snapshot back = ccalloc::io::read_snapshot(path);
  expect("segments in the file", back.segments.size(), 1);
  if (back.segments.size() == 1) {
    expect("segment address", back.segments[0].address, p);
    expect("segment total_size", back.segments[0].total_size, 2u << 20);
    expect("segment allocated_size", back.segments[0].allocated_size, 0);
    expect("segment is_small", back.segments[0].is_small, 1);
  }
  expect("devices in the file", back.device_traces.size(), 1);
  if (back.device_traces.size() == 1) {
    // segment_alloc, alloc, free_requested, free_completed, snapshot
    expect("trace entries", back.device_traces[0].size(), 5);
  }
  if (failures == 0) std::cout << "consumer: all values as expected\n";
  return failures == 0 ? 0 : 1;
}
