// gunzip on arbitrary bytes, with a small output cap: FormatError (corrupt, truncated or
// too large) is the only acceptable failure.
#include <string>

#include "ccalloc/errors.hpp"
#include "fuzz_common.hpp"
#include "io/gzip.hpp"

using namespace ccalloc;
using namespace ccalloc::io;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  constexpr std::size_t kCap = std::size_t{1} << 22;
  try {
    const std::string out = gunzip(fuzz::as_text(data, size), "fuzz", kCap);
    fuzz::check(out.size() <= kCap, "gunzip exceeded its cap");
  } catch (const FormatError&) {
  }
  return 0;
}
