#include "ccalloc/trace.hpp"

#include <array>

#include "ccalloc/allocator.hpp"

namespace ccalloc {
namespace {

// Indexed by the enum's value; the names are PyTorch's, so snapshots and CSV traces from
// PyTorch read without translation.
constexpr std::array<std::string_view, 9> kActionNames = {
    "alloc",       "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap",  "snapshot",       "oom",
};
static_assert(kActionNames.size() == static_cast<std::size_t>(TraceAction::kOom) + 1);

}  // namespace

std::string_view to_string(TraceAction action) {
  const auto index = static_cast<std::size_t>(action);
  // An out-of-range value can only come from a cast; give it a name rather than read past
  // the table.
  return index < kActionNames.size() ? kActionNames[index] : std::string_view("unknown");
}

std::optional<TraceAction> parse_trace_action(std::string_view name) {
  for (std::size_t i = 0; i < kActionNames.size(); ++i) {
    if (kActionNames[i] == name) return static_cast<TraceAction>(i);
  }
  return std::nullopt;
}

std::string_view to_string(BlockState state) {
  switch (state) {
    case BlockState::kActiveAllocated:
      return "active_allocated";
    case BlockState::kActivePendingFree:
      return "active_pending_free";
    case BlockState::kInactive:
      return "inactive";
  }
  return "inactive";
}

}  // namespace ccalloc
