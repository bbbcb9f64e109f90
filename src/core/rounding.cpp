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

std::size_t segment_size_for(std::size_t rounded, const Config& config) {
  if (is_small_size(rounded)) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return config.large_segment_size;
  return round_up_large(rounded);
}

bool should_split(std::size_t block_size, std::size_t rounded, bool fine, const Config& config) {
  const std::size_t remaining = block_size - rounded;
  if (fine) return remaining >= kMinBlockSize;
  return rounded < config.max_split_size && remaining > kSmallSize;
}

bool oversize_allows(std::size_t block_size, std::size_t rounded, const Config& config) {
  if (rounded < config.max_split_size && block_size >= config.max_split_size) return false;
  if (rounded >= config.max_split_size &&
      block_size >= rounded + config.max_non_split_rounding_size) {
    return false;
  }
  return true;
}

}  // namespace ccalloc::core
