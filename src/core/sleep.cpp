// Sleep and wake of private pools (docs/sleep-wake.md): the driver's defaults for host
// memory and copies.
#include <string>

#include "ccalloc/allocator.hpp"
#include "ccalloc/errors.hpp"

namespace ccalloc {
namespace {

[[noreturn]] void cannot_save(const Driver& d, const std::string& what) {
  throw DriverError("ccalloc: " + d.name() + " has no host memory or copies (" + what +
                    "): it cannot save the contents of a sleeping pool");
}

}  // namespace

std::string_view to_string(SleepMode mode) {
  return mode == SleepMode::kSave ? "save" : "discard";
}

void* Driver::allocate_host(std::size_t bytes) {
  cannot_save(*this, "allocate_host of " + std::to_string(bytes) + " bytes");
}
void Driver::free_host(void*, std::size_t) {
  cannot_save(*this, "free_host");
}
void Driver::copy_to_host(void*, DevicePtr, std::size_t bytes) {
  cannot_save(*this, "copy_to_host of " + std::to_string(bytes) + " bytes");
}
void Driver::copy_to_device(DevicePtr, const void*, std::size_t bytes) {
  cannot_save(*this, "copy_to_device of " + std::to_string(bytes) + " bytes");
}

}  // namespace ccalloc
