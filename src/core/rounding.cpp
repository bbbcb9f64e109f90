#include "core/rounding.hpp"

#include <bit>

namespace ccalloc::core {

std::size_t round_to_power2_division(std::size_t size, std::size_t divisions) {
  if (std::has_single_bit(size)) return size;
  const std::size_t floor2 = std::bit_floor(size);
  const std::size_t step = floor2 >> std::countr_zero(std::bit_floor(divisions));
  if (step == 0) return floor2 << 1;
  const std::size_t down = size & ~(step - 1);
  return down == size ? size : down + step;
}

}  // namespace ccalloc::core
