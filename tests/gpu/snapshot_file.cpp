#include "snapshot_file.hpp"

#include "io/snapshot_io.hpp"

namespace ccalloc_gpu_test {

void write_snapshot_file(const std::string& path, const ccalloc::Snapshot& snapshot) {
  ccalloc::io::write_snapshot(path, snapshot);
}

ccalloc::Snapshot read_snapshot_file(const std::string& path) {
  return ccalloc::io::read_snapshot(path);
}

}  // namespace ccalloc_gpu_test
