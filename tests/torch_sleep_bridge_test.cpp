// The torch-free half of sleepable torch.cuda.MemPool pools (docs/sleep-wake.md, "PyTorch"),
// on the simulated GPU: the per-thread request that makes the next pool the adapter creates
// sleepable (bindings/torch/pool_bridge.cpp), and the C entry points of libccalloc_torch.so
// that ccalloc_torch calls through ctypes (bindings/torch/sleep_api.cpp): statuses, messages,
// the sleep info, contents kept across a sleep. Here the engine behind the entry points is a
// simulated allocator standing in for the installed adapter's (native_allocator); the GPU
// test through torch is tests/torch/test_sleep.py.
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/sim.hpp"
#include "pool_bridge.hpp"
#include "sleep_api.h"
#include "test_support.hpp"

namespace ccalloc::torch_bridge {

// The adapter's engine as sleep_api.cpp sees it: nullptr is "ccalloc not installed".
Allocator* g_native = nullptr;

Allocator& native_allocator(int device) {
  if (g_native == nullptr) throw Error("ccalloc is not PyTorch's CUDA allocator (test: none set)");
  if (device != -1 && device != 0) {
    throw Error("ccalloc: no CUDA device " + std::to_string(device) + " (this process sees 1)");
  }
  return *g_native;
}

}  // namespace ccalloc::torch_bridge

namespace ccalloc {
namespace {

namespace bridge = torch_bridge;
using ccalloc_test::message_of;

struct Fixture {
  explicit Fixture(std::size_t capacity = 1024 * kMiB)
      : driver(options(capacity)), alloc(driver, Config{}) {
    alloc.set_check_invariants(true);
    bridge::g_native = &alloc;
  }
  ~Fixture() { bridge::g_native = nullptr; }
  static sim::Options options(std::size_t capacity) {
    sim::Options o;
    o.capacity = capacity;
    return o;
  }
  // As torch.cuda.MemPool() does: createOrIncrefPool of a new id.
  void mem_pool(bridge::PoolId id) { bridge::create_or_incref_pool(alloc, id, std::nullopt); }
  std::vector<DevicePtr> allocate_in(bridge::PoolId id, const std::vector<std::size_t>& sizes) {
    bridge::begin_allocate_to_pool(alloc, id, [](StreamId) { return true; });
    std::vector<DevicePtr> out;
    for (const std::size_t n : sizes)
      out.push_back(alloc.malloc(n, 0));
    bridge::end_allocate_to_pool(alloc, id);
    return out;
  }
  std::vector<unsigned char> read(DevicePtr p, std::size_t n) const {
    std::vector<unsigned char> out(n);
    driver.read(p, out.data(), n);
    return out;
  }

  sim::SimDriver driver;
  Allocator alloc;
};

// One entry point's status and message.
struct Call {
  int status = -1;
  std::string message;
};

Call sleep(bridge::PoolId id, bool save, int device = -1) {
  char error[512] = "unchanged";
  Call c;
  c.status =
      ccalloc_torch_pool_sleep(device, id.first, id.second, save ? 1 : 0, error, sizeof error);
  c.message = error;
  return c;
}

Call wake(bridge::PoolId id) {
  char error[512] = "unchanged";
  Call c;
  c.status = ccalloc_torch_pool_wake(-1, id.first, id.second, error, sizeof error);
  c.message = error;
  return c;
}

ccalloc_torch_sleep_info info_of(bridge::PoolId id) {
  ccalloc_torch_sleep_info info{};
  char error[512] = "";
  EXPECT_EQ(ccalloc_torch_pool_sleep_info(0, id.first, id.second, &info, error, sizeof error), 0)
      << error;
  return info;
}

int asleep(bridge::PoolId id) {
  int value = -1;
  char error[512] = "";
  EXPECT_EQ(ccalloc_torch_pool_is_asleep(0, id.first, id.second, &value, error, sizeof error), 0)
      << error;
  return value;
}

void expect_contains(const std::string& message, const std::vector<std::string>& parts) {
  for (const std::string& part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "\"" << part << "\" not in: " << message;
}

constexpr bridge::PoolId kPool{0, 7};
constexpr bridge::PoolId kPlain{0, 8};

TEST(TorchSleepBridge, ARequestMakesTheNextCreatedPoolSleepableOnce) {
  Fixture f;
  EXPECT_EQ(ccalloc_torch_request_sleepable_pool(1), 0);
  f.mem_pool(kPool);
  EXPECT_EQ(ccalloc_torch_request_sleepable_pool(0), 0);  // consumed by that pool
  f.mem_pool(kPlain);
  EXPECT_EQ(bridge::pool_use_count(f.alloc, kPool), 1);
  EXPECT_EQ(bridge::pool_use_count(f.alloc, kPlain), 1);
  EXPECT_EQ(asleep(kPool), 0);
  EXPECT_EQ(asleep(kPlain), 0);
  const Call plain = sleep(kPlain, true);
  EXPECT_EQ(plain.status, 1);
  expect_contains(plain.message, {"pool (0, 8)", "not sleepable"});
  EXPECT_EQ(sleep(kPool, true).status, 0);
  EXPECT_EQ(asleep(kPool), 1);
  EXPECT_EQ(wake(kPool).status, 0);
  // A second use of the sleepable pool (use_mem_pool, a graph capture into it) keeps it so.
  f.mem_pool(kPool);
  EXPECT_EQ(bridge::pool_use_count(f.alloc, kPool), 2);
  EXPECT_EQ(sleep(kPool, false).status, 0);
  EXPECT_EQ(wake(kPool).status, 0);
}

TEST(TorchSleepBridge, AnUnusedRequestIsReportedAndOnlyItsOwnThreadSeesIt) {
  Fixture f;
  EXPECT_EQ(ccalloc_torch_request_sleepable_pool(1), 0);
  EXPECT_EQ(ccalloc_torch_request_sleepable_pool(1), 1);
  EXPECT_EQ(ccalloc_torch_request_sleepable_pool(0), 1);  // no pool was created meanwhile
  EXPECT_EQ(ccalloc_torch_request_sleepable_pool(0), 0);
  // A request on another thread does not reach pools created on this one.
  std::thread([] { EXPECT_EQ(ccalloc_torch_request_sleepable_pool(1), 0); }).join();
  f.mem_pool(kPlain);
  const Call c = sleep(kPlain, true);
  EXPECT_EQ(c.status, 1);
  expect_contains(c.message, {"not sleepable"});
}

TEST(TorchSleepBridge, ARequestForAPoolWithAnotherAllocatorsSegmentsIsRefused) {
  Fixture f;
  int segments_allocated = 0;
  bridge::SegmentSource source{[&](std::size_t) -> DevicePtr {
                                 ++segments_allocated;
                                 return 0;
                               },
                               [](DevicePtr) {}};
  EXPECT_EQ(ccalloc_torch_request_sleepable_pool(1), 0);
  const std::string message =
      message_of<Error>([&] { bridge::create_or_incref_pool(f.alloc, kPool, std::move(source)); });
  expect_contains(message, {"pool (0, 7)", "MemPool(allocator=...)", "sleepable"});
  EXPECT_EQ(ccalloc_torch_request_sleepable_pool(0), 0);  // consumed
  EXPECT_EQ(segments_allocated, 0);
  // No pool was created: creating it now makes its first use.
  f.mem_pool(kPool);
  EXPECT_EQ(bridge::pool_use_count(f.alloc, kPool), 1);
}

TEST(TorchSleepBridge, SavedContentsAndTheSleepInfoThroughTheEntryPoints) {
  Fixture f;
  ccalloc_torch_request_sleepable_pool(1);
  f.mem_pool(kPool);
  const std::vector<std::size_t> sizes = {300 * 1024, 5 * kMiB + 512, 64 * kMiB};
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, sizes);
  std::vector<std::vector<unsigned char>> written;
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    std::vector<unsigned char> bytes(sizes[i]);
    for (std::size_t j = 0; j < bytes.size(); ++j)
      bytes[j] = static_cast<unsigned char>((j * 31 + i * 7) & 0xff);
    f.driver.write(ptrs[i], bytes.data(), bytes.size());
    written.push_back(std::move(bytes));
  }
  const PoolSleepInfo engine = f.alloc.pool_sleep_info({kPool.first, kPool.second});
  const ccalloc_torch_sleep_info awake = info_of(kPool);
  EXPECT_EQ(awake.asleep, 0);
  EXPECT_EQ(awake.segment_bytes, engine.segment_bytes);
  EXPECT_EQ(awake.physical_bytes, engine.segment_bytes);
  EXPECT_EQ(awake.saved_bytes, 0u);
  EXPECT_EQ(awake.live_bytes, engine.live_bytes);
  EXPECT_GE(awake.live_bytes, 300 * 1024 + 5 * kMiB + 512 + 64 * kMiB);
  const std::size_t free_awake = f.driver.mem_info().free_bytes;

  EXPECT_EQ(sleep(kPool, true).status, 0);
  const ccalloc_torch_sleep_info slept = info_of(kPool);
  EXPECT_EQ(slept.asleep, 1);
  EXPECT_EQ(slept.segment_bytes, awake.segment_bytes);
  EXPECT_EQ(slept.physical_bytes, 0u);
  EXPECT_EQ(slept.saved_bytes, awake.live_bytes);
  EXPECT_EQ(slept.live_bytes, awake.live_bytes);
  EXPECT_GE(f.driver.mem_info().free_bytes, free_awake + awake.segment_bytes);
  // Allocating into the sleeping pool (use_mem_pool) is refused, naming the pool.
  const std::string refused = message_of<Error>(
      [&] { bridge::begin_allocate_to_pool(f.alloc, kPool, [](StreamId) { return true; }); });
  expect_contains(refused, {"pool (0, 7)", "asleep"});
  // Other work uses the memory meanwhile.
  const DevicePtr other = f.alloc.malloc(900 * kMiB, 0);
  std::vector<unsigned char> ones(4 * kMiB, 0xff);
  f.driver.write(other, ones.data(), ones.size());
  f.alloc.free(other);
  f.alloc.empty_cache();

  EXPECT_EQ(wake(kPool).status, 0);
  const ccalloc_torch_sleep_info woken = info_of(kPool);
  EXPECT_EQ(woken.asleep, 0);
  EXPECT_EQ(woken.physical_bytes, awake.segment_bytes);
  EXPECT_EQ(woken.saved_bytes, 0u);
  for (std::size_t i = 0; i < ptrs.size(); ++i)
    EXPECT_EQ(f.read(ptrs[i], sizes[i]), written[i]) << "allocation " << i;

  // Discarded: nothing saved, fresh memory after the wake.
  EXPECT_EQ(sleep(kPool, false).status, 0);
  EXPECT_EQ(info_of(kPool).saved_bytes, 0u);
  EXPECT_EQ(wake(kPool).status, 0);
  EXPECT_EQ(f.read(ptrs[0], sizes[0]), std::vector<unsigned char>(sizes[0], 0));
  for (const DevicePtr p : ptrs)
    f.alloc.free(p);
}

TEST(TorchSleepBridge, MisuseIsStatusOneWithCcallocsMessage) {
  Fixture f;
  ccalloc_torch_request_sleepable_pool(1);
  f.mem_pool(kPool);
  EXPECT_EQ(sleep(kPool, true).status, 0);
  Call c = sleep(kPool, true);
  EXPECT_EQ(c.status, 1);
  expect_contains(c.message, {"pool (0, 7)", "already asleep"});
  EXPECT_EQ(wake(kPool).status, 0);
  c = wake(kPool);
  EXPECT_EQ(c.status, 1);
  expect_contains(c.message, {"pool (0, 7)", "not asleep"});
  c = sleep({0, 0}, true);
  EXPECT_EQ(c.status, 1);
  expect_contains(c.message, {"default pool"});
  c = sleep({0, 99}, true);
  EXPECT_EQ(c.status, 1);
  expect_contains(c.message, {"(0, 99)"});
  c = sleep(kPool, true, /*device=*/3);
  EXPECT_EQ(c.status, 1);
  expect_contains(c.message, {"no CUDA device 3"});
  // While a capture (use_mem_pool) is underway: refused, naming the pool.
  bridge::begin_allocate_to_pool(f.alloc, kPool, [](StreamId) { return true; });
  c = sleep(kPool, true);
  EXPECT_EQ(c.status, 1);
  expect_contains(c.message, {"pool (0, 7)", "being allocated to"});
  bridge::end_allocate_to_pool(f.alloc, kPool);
  bridge::release_pool(f.alloc, kPool);

  char error[64] = "unchanged";
  EXPECT_EQ(ccalloc_torch_pool_is_asleep(0, 0, 7, nullptr, error, sizeof error), 1);
  expect_contains(error, {"asleep is NULL"});
  EXPECT_EQ(ccalloc_torch_pool_sleep_info(0, 0, 7, nullptr, error, sizeof error), 1);
  expect_contains(error, {"info is NULL"});
  // A short buffer gets the message's start, terminated; none at all is allowed.
  char shortbuf[8];
  std::memset(shortbuf, 'x', sizeof shortbuf);
  EXPECT_EQ(ccalloc_torch_pool_wake(0, 0, 7, shortbuf, sizeof shortbuf), 1);
  EXPECT_EQ(std::strlen(shortbuf), sizeof shortbuf - 1);
  EXPECT_EQ(std::string(shortbuf), "ccalloc");
  EXPECT_EQ(ccalloc_torch_pool_wake(0, 0, 7, nullptr, 0), 1);
  EXPECT_EQ(asleep(kPool), 0);
  EXPECT_EQ(bridge::pool_use_count(f.alloc, kPool), 1);
}

TEST(TorchSleepBridge, WithoutTheNativeInstallEveryCallFails) {
  ASSERT_EQ(bridge::g_native, nullptr);
  char error[256] = "";
  EXPECT_EQ(ccalloc_torch_pool_sleep(0, 0, 7, 1, error, sizeof error), 1);
  expect_contains(error, {"not PyTorch's CUDA allocator"});
  int value = -1;
  EXPECT_EQ(ccalloc_torch_pool_is_asleep(0, 0, 7, &value, error, sizeof error), 1);
  EXPECT_EQ(value, -1);
}

TEST(TorchSleepBridge, AWakeTheDeviceCannotServeIsStatusTwoAndLeavesThePoolAsleep) {
  Fixture f(256 * kMiB);
  ccalloc_torch_request_sleepable_pool(1);
  f.mem_pool(kPool);
  const std::vector<DevicePtr> ptrs = f.allocate_in(kPool, {64 * kMiB});
  EXPECT_EQ(sleep(kPool, true).status, 0);
  const DevicePtr other = f.alloc.malloc(220 * kMiB, 0);  // live: no cache can give way
  Call c = wake(kPool);
  EXPECT_EQ(c.status, 2);
  expect_contains(c.message, {"out of memory", "pool (0, 7)"});
  EXPECT_EQ(asleep(kPool), 1);
  EXPECT_EQ(info_of(kPool).saved_bytes, info_of(kPool).live_bytes);
  f.alloc.free(other);  // cached in the default pool: the wake empties that cache
  c = wake(kPool);
  EXPECT_EQ(c.status, 0) << c.message;
  EXPECT_EQ(asleep(kPool), 0);
  f.alloc.free(ptrs[0]);
}

}  // namespace
}  // namespace ccalloc
