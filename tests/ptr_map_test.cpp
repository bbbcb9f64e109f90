// PtrMap (the active-block index's hash map) against std::unordered_map as a reference.
#include "sync/ptr_map.hpp"

#include <gtest/gtest.h>

#include <random>
#include <unordered_map>
#include <vector>

namespace {

using ccalloc::DevicePtr;
using ccalloc::core::PtrMap;

TEST(PtrMap, FindsWhatWasInsertedAndNothingElse) {
  PtrMap<int> m;
  m.insert(0x7f0000000000, 1);
  m.insert(0x7f0000000200, 2);
  EXPECT_EQ(m.find(0x7f0000000000), 1);
  EXPECT_EQ(m.find(0x7f0000000200), 2);
  EXPECT_EQ(m.find(0x7f0000000400), 0);
  EXPECT_EQ(m.size(), 2u);
}

TEST(PtrMap, InsertOverwritesAnExistingKey) {
  PtrMap<int> m;
  m.insert(0x1000, 1);
  m.insert(0x1000, 5);
  EXPECT_EQ(m.find(0x1000), 5);
  EXPECT_EQ(m.size(), 1u);
}

TEST(PtrMap, EraseReturnsTheValueOnceThenNothing) {
  PtrMap<int> m;
  m.insert(0x1000, 7);
  EXPECT_EQ(m.erase(0x1000), 7);
  EXPECT_EQ(m.erase(0x1000), 0);
  EXPECT_EQ(m.size(), 0u);
}

// Random inserts and erases over a small key space force long probe runs, wrap-around at
// the table's end and growth; every lookup must agree with the reference after each step.
TEST(PtrMap, AgreesWithUnorderedMapUnderRandomOperations) {
  for (const unsigned seed : {1u, 2u, 3u}) {
    std::mt19937_64 rng(seed);
    PtrMap<int> m;
    std::unordered_map<DevicePtr, int> ref;
    std::vector<DevicePtr> keys;
    for (int i = 0; i < 600; ++i)
      keys.push_back(0x7f0000000000 + 512 * static_cast<DevicePtr>(i));
    for (int op = 0; op < 200000; ++op) {
      const DevicePtr k = keys[rng() % keys.size()];
      if (rng() % 3 == 0) {
        const auto it = ref.find(k);
        ASSERT_EQ(m.erase(k), it == ref.end() ? 0 : it->second) << "seed " << seed << " op " << op;
        if (it != ref.end()) ref.erase(it);
      } else {
        const int v = static_cast<int>(rng() % 1000) + 1;
        m.insert(k, v);
        ref[k] = v;
      }
      ASSERT_EQ(m.size(), ref.size());
      if (op % 997 == 0) {
        for (const DevicePtr probe : keys) {
          const auto it = ref.find(probe);
          ASSERT_EQ(m.find(probe), it == ref.end() ? 0 : it->second) << "seed " << seed;
        }
      }
    }
    std::size_t visited = 0;
    m.for_each([&](DevicePtr k, int v) {
      ++visited;
      EXPECT_EQ(ref.at(k), v);
    });
    EXPECT_EQ(visited, ref.size());
  }
}

}  // namespace
