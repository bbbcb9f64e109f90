// The engine side of pool_bridge.hpp as far as the engine goes today: it has one pool per
// device (the default pool), so every segment belongs to it, and everything that needs a
// private pool or a checkpoint throws NotSupported naming what is missing. Live
// reconfiguration is served by the native engine (src/core/reconfigure.cpp) and the
// cudaMallocAsync backend; sharing expandable segments is in ipc_bridge.cpp.
#include "pool_bridge.hpp"

#include "core/backend_access.hpp"

namespace ccalloc::torch_bridge {
namespace {

[[noreturn]] void missing(const char* feature) {
  throw NotSupported(std::string("the ccalloc engine has no ") + feature + " yet");
}

}  // namespace

void create_or_incref_pool(Allocator&, PoolId, std::optional<SegmentSource>) {
  missing("private memory pools");
}
void release_pool(Allocator&, PoolId) {
  missing("private memory pools");
}
int pool_use_count(Allocator&, PoolId) {
  missing("private memory pools");
}
void set_use_on_oom(Allocator&, PoolId, bool) {
  missing("private memory pools");
}
void set_no_split(Allocator&, PoolId) {
  missing("private memory pools");
}
void begin_allocate_to_pool(Allocator&, PoolId, std::function<bool(StreamId)>) {
  missing("private memory pools (CUDA graph capture allocates to one)");
}
void end_allocate_to_pool(Allocator&, PoolId) {
  missing("private memory pools (CUDA graph capture allocates to one)");
}
void empty_pool_cache(Allocator&, PoolId) {
  missing("private memory pools");
}
bool pool_live_allocations_are(Allocator&, PoolId, const std::vector<DevicePtr>&) {
  missing("private memory pools");
}
std::vector<SegmentInfo> pool_segments(Allocator&, PoolId) {
  missing("private memory pools");
}
PoolId segment_pool(Allocator&, DevicePtr) {
  return kDefaultPool;
}
std::shared_ptr<PoolCheckpoint> checkpoint_pool(Allocator&, PoolId) {
  missing("pool checkpoints");
}
PoolRestore restore_pool(Allocator&, const PoolCheckpoint&) {
  missing("pool checkpoints");
}
void reconfigure(Allocator& allocator, const Config& config) {
  if (!core::reconfigure(allocator, config)) {
    missing("live reconfiguration of the stitching policy (stitch_segments:True)");
  }
}

}  // namespace ccalloc::torch_bridge
