// PyTorch's order of streams (core/stream_table.hpp): the slots of its hash table of streams,
// worked out by hand for small cases (home slot = (key * 11400714819323198485) >> (64 - k)
// for 2^k slots: keys 1, 2, 5, 102 have homes 2, 0, 0, 0 among 4 slots and 4, 1, 0, 0 among
// 8), and the native engine returning blocks in that order when events of several streams
// complete at one malloc.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/config.hpp"
#include "ccalloc/sim.hpp"
#include "ccalloc/snapshot.hpp"
#include "core/stream_table.hpp"

namespace ccalloc {
namespace {

using core::StreamTable;
using Keys = std::vector<std::uint64_t>;

TEST(StreamTable, IteratesBySlotNotByInsertion) {
  EXPECT_EQ(StreamTable::order_of({}), Keys{});
  EXPECT_EQ(StreamTable::order_of({1}), Keys{1});
  EXPECT_EQ(StreamTable::order_of({1, 2}), (Keys{2, 1}));  // homes 2 and 0 of 4 slots
  // A key whose home is taken goes to the next slot: insertion order decides.
  EXPECT_EQ(StreamTable::order_of({5, 2}), (Keys{5, 2}));
  EXPECT_EQ(StreamTable::order_of({2, 5}), (Keys{2, 5}));
}

TEST(StreamTable, GrowsBeforeTheThirdKeyAndReinsertsInSlotOrder) {
  // 4 slots hold 2 keys; the third doubles the table: 2 goes to slot 1, 1 to slot 4, 3 to 6.
  EXPECT_EQ(StreamTable::order_of({1, 2, 3}), (Keys{2, 1, 3}));
  StreamTable t;
  t.insert(1);
  t.insert(2);
  t.insert(2);  // present: nothing changes
  EXPECT_EQ(t.size(), 2u);
  EXPECT_TRUE(t.contains(1));
  EXPECT_FALSE(t.contains(3));
}

TEST(StreamTable, RobinHoodDisplacesAKeyAtItsHome) {
  // 2, 5, 1 make 8 slots: 5 at 0, 2 at 1, 1 at 4. 102 (home 0) finds 2 at its own home,
  // nearer home than 102 would be, and takes its slot; 2 moves to slot 2.
  StreamTable t;
  for (const std::uint64_t k : {2, 5, 1, 102})
    t.insert(k);
  EXPECT_EQ(t.keys(), (Keys{5, 102, 2, 1}));
  // Erasing slot 0 shifts the keys away from home back by one; the walk goes on at slot 0.
  const std::size_t next = t.erase(t.begin());
  EXPECT_EQ(next, 0u);
  EXPECT_EQ(t.key(next), 102u);
  EXPECT_EQ(t.keys(), (Keys{102, 2, 1}));
  // Erasing a key whose slot stays empty continues at the next occupied slot.
  const std::size_t at_one = t.next(t.next(t.begin()));  // key 1, at slot 4
  EXPECT_EQ(t.key(at_one), 1u);
  EXPECT_EQ(t.erase(at_one), t.end());
  EXPECT_EQ(t.keys(), (Keys{102, 2}));
  t.clear();
  EXPECT_EQ(t.keys(), Keys{});
  EXPECT_EQ(t.size(), 0u);
  t.insert(1);  // the slots stayed 8: home 4
  t.insert(2);  // home 1
  EXPECT_EQ(t.keys(), (Keys{2, 1}));
}

// Blocks a and b of stream 1, neighbours, used on streams 2 and 3 and freed; their events
// complete together and the next malloc returns them. The free_completed entries say in
// which order.
std::vector<DevicePtr> completed_order(bool keys) {
  sim::SimDriver driver;
  Allocator alloc(driver, Config::parse("pytorch"));
  alloc.set_check_invariants(true);
  HistoryOptions h;
  h.stacks = HistoryOptions::Stacks::kNone;
  alloc.record_history(h);
  if (keys) {
    alloc.set_stream_order_key(2, 1);  // home 2 of 4 slots
    alloc.set_stream_order_key(3, 2);  // home 0: PyTorch visits stream 3 first
  }
  const DevicePtr a = alloc.malloc(4096, 1);
  const DevicePtr b = alloc.malloc(4096, 1);
  alloc.record_stream(a, 2);
  alloc.record_stream(b, 3);
  alloc.free(a);
  alloc.free(b);
  driver.complete_stream(2);
  driver.complete_stream(3);
  const DevicePtr c = alloc.malloc(4096, 1);  // polls: both events have completed
  std::vector<DevicePtr> order;
  const Snapshot snap = alloc.snapshot();
  for (const SnapshotTraceEntry& e : snap.device_traces.at(0)) {
    if (e.action == TraceAction::kFreeCompleted) order.push_back(e.addr);
  }
  EXPECT_EQ(order.size(), 2u);
  EXPECT_EQ(c, a);  // both merged back: the first block of the segment again
  alloc.free(c);
  return order;
}

TEST(StreamTable, TheNativeEngineReturnsBlocksInPytorchsOrderOfStreams) {
  const std::vector<DevicePtr> by_stream = completed_order(false);
  const std::vector<DevicePtr> by_key = completed_order(true);
  ASSERT_EQ(by_stream.size(), 2u);
  ASSERT_EQ(by_key.size(), 2u);
  EXPECT_LT(by_stream[0], by_stream[1]);  // stream 2's block (a) first
  EXPECT_GT(by_key[0], by_key[1]);        // stream 3's block (b) first
}

}  // namespace
}  // namespace ccalloc
