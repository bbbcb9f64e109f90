// The Driver contract suite (driver_conformance.hpp) on the simulated GPU. The CUDA driver
// runs the same suite in tests/gpu/driver_conformance_gpu_test.cpp.
#include "driver_conformance.hpp"

#include "ccalloc/sim.hpp"

namespace {

struct SimFactory {
  static std::unique_ptr<ccalloc::Driver> make() {
    ccalloc::sim::Options options;
    options.capacity = std::size_t{4} << 30;  // small enough that "beyond the device" is cheap
    return std::make_unique<ccalloc::sim::SimDriver>(options);
  }
};

}  // namespace

namespace ccalloc::conformance {
INSTANTIATE_TYPED_TEST_SUITE_P(Sim, DriverConformance, ::testing::Types<SimFactory>);
}  // namespace ccalloc::conformance
