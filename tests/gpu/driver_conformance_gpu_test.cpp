// The Driver contract suite (tests/driver_conformance.hpp) on CUDA device 0. Every test
// skips itself when no device is visible.
#include "driver_conformance.hpp"

#include "ccalloc/cuda.hpp"

namespace {

struct CudaFactory {
  static std::unique_ptr<ccalloc::Driver> make() {
    if (ccalloc::cuda::device_count() == 0) return nullptr;
    return std::make_unique<ccalloc::cuda::CudaDriver>(0);
  }
};

}  // namespace

namespace ccalloc::conformance {
INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, DriverConformance, ::testing::Types<CudaFactory>);
}  // namespace ccalloc::conformance
