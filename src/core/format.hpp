// Text shared by the error messages of the engine, the drivers and the replay tools.
#pragma once

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <string>

namespace ccalloc {

// An address as every message prints it: "0x" and lowercase hexadecimal digits.
inline std::string hex_address(std::uint64_t p) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%" PRIx64, p);
  return buf;
}

}  // namespace ccalloc
