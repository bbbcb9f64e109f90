// Snapshot files for the GPU tests: io::write_snapshot / io::read_snapshot behind a plain
// interface, compiled by the host compiler (snapshot_file.cpp) so that nvcc never parses
// the io library's headers.
#pragma once

#include <string>

#include "ccalloc/snapshot.hpp"

namespace ccalloc_gpu_test {

// A pickle, or JSON if the path ends in .json; gzip if it ends in .gz (io::write_snapshot).
void write_snapshot_file(const std::string& path, const ccalloc::Snapshot& snapshot);
ccalloc::Snapshot read_snapshot_file(const std::string& path);

}  // namespace ccalloc_gpu_test
