// The engine side of pool_bridge.hpp. Private pools, CUDA graph capture, pool checkpoints
// and sleepable pools are served by the engine's pool API (ccalloc::Allocator::create_pool,
// create_sleepable_pool and the rest; a backend without pools throws ccalloc::Error naming
// itself). Live reconfiguration
// is served by the native engine (src/native/reconfigure.cpp) and the cudaMallocAsync
// backend; sharing expandable segments is in ipc_bridge.cpp.
#include "pool_bridge.hpp"

#include <algorithm>
#include <string>

#include "core/backend_access.hpp"

namespace ccalloc::torch_bridge {
namespace {

[[noreturn]] void missing(const char* feature) {
  throw NotSupported(std::string("the ccalloc engine has no ") + feature + " yet");
}

}  // namespace

namespace {

ccalloc::PoolId to_engine(PoolId id) {
  return ccalloc::PoolId{id.first, id.second};
}

// The adapter's checkpoint handle around the engine's.
struct BridgeCheckpoint final : PoolCheckpoint {
  explicit BridgeCheckpoint(std::shared_ptr<const ccalloc::PoolCheckpoint> c)
      : engine(std::move(c)) {}
  std::shared_ptr<const ccalloc::PoolCheckpoint> engine;
};

// This thread's pending request_sleepable_pool.
thread_local bool t_sleepable_requested = false;

}  // namespace

bool request_sleepable_pool(bool enable) {
  const bool pending = t_sleepable_requested;
  t_sleepable_requested = enable;
  return pending;
}

void create_or_incref_pool(Allocator& allocator, PoolId id, std::optional<SegmentSource> source) {
  if (t_sleepable_requested) {
    t_sleepable_requested = false;
    if (source) {
      throw Error("ccalloc: pool " + ccalloc::to_string(to_engine(id)) +
                  " was asked to be sleepable but takes its segments from another allocator "
                  "(MemPool(allocator=...)); a sleepable pool's segments are ccalloc's CUDA "
                  "virtual memory");
    }
    allocator.create_sleepable_pool(to_engine(id));
    return;
  }
  std::optional<ccalloc::SegmentSource> engine_source;
  if (source) {
    // PyTorch's raw_delete takes only the pointer.
    engine_source = ccalloc::SegmentSource{
        std::move(source->allocate),
        [free = std::move(source->free)](DevicePtr ptr, std::size_t) { free(ptr); }};
  }
  allocator.create_pool(to_engine(id), std::move(engine_source));
}
void release_pool(Allocator& allocator, PoolId id) {
  allocator.release_pool(to_engine(id));
}
int pool_use_count(Allocator& allocator, PoolId id) {
  return allocator.pool_use_count(to_engine(id));
}
void set_use_on_oom(Allocator& allocator, PoolId id, bool use_on_oom) {
  allocator.set_pool_use_on_oom(to_engine(id), use_on_oom);
}
void set_no_split(Allocator& allocator, PoolId id) {
  allocator.set_pool_no_split(to_engine(id));
}
void begin_allocate_to_pool(Allocator& allocator, PoolId id, std::function<bool(StreamId)> filter) {
  allocator.begin_allocate_to_pool(to_engine(id), std::move(filter));
}
void end_allocate_to_pool(Allocator& allocator, PoolId id) {
  allocator.end_allocate_to_pool(to_engine(id));
}
void empty_pool_cache(Allocator& allocator, PoolId id) {
  allocator.empty_cache(to_engine(id));
}
bool pool_live_allocations_are(Allocator& allocator, PoolId id,
                               const std::vector<DevicePtr>& expected) {
  std::vector<DevicePtr> want = expected;
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  return allocator.pool_live_allocations(to_engine(id)) == want;
}
std::vector<SegmentInfo> pool_segments(Allocator& allocator, PoolId id) {
  return allocator.pool_segments(to_engine(id));
}
PoolId segment_pool(Allocator& allocator, DevicePtr segment_address) {
  const ccalloc::PoolId id = allocator.segment_pool(segment_address);
  return {id.first, id.second};
}
std::shared_ptr<PoolCheckpoint> checkpoint_pool(Allocator& allocator, PoolId id) {
  return std::make_shared<BridgeCheckpoint>(allocator.checkpoint_pool(to_engine(id)));
}
PoolRestore restore_pool(Allocator& allocator, const PoolCheckpoint& checkpoint) {
  const auto* c = dynamic_cast<const BridgeCheckpoint*>(&checkpoint);
  if (c == nullptr || !c->engine) throw Error("ccalloc: restore_pool: not a ccalloc checkpoint");
  ccalloc::PoolRestore r = allocator.restore_pool(*c->engine);
  return PoolRestore{std::move(r.freed), std::move(r.allocated)};
}
void sleep_pool(Allocator& allocator, PoolId id, bool save_contents) {
  allocator.sleep_pool(to_engine(id), save_contents ? SleepMode::kSave : SleepMode::kDiscard);
}
void wake_pool(Allocator& allocator, PoolId id) {
  allocator.wake_pool(to_engine(id));
}
bool pool_asleep(Allocator& allocator, PoolId id) {
  return allocator.pool_asleep(to_engine(id));
}
PoolSleepInfo pool_sleep_info(Allocator& allocator, PoolId id) {
  return allocator.pool_sleep_info(to_engine(id));
}
void reconfigure(Allocator& allocator, const Config& config) {
  if (!core::reconfigure(allocator, config)) {
    missing("live reconfiguration of this device's backend");
  }
}

}  // namespace ccalloc::torch_bridge
