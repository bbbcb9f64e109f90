// Helpers the test programs share.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <system_error>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ccalloc/driver.hpp"

namespace ccalloc_test {

// The message of the `E` that `f` throws; a test failure (and "") if it throws nothing or
// another exception.
template <typename E, typename F>
std::string message_of(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected another exception type, got: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected an exception, nothing was thrown";
  return {};
}

// The share of their work that the heavy tests do: CCALLOC_TEST_SCALE, which scripts/test sets
// to 0.1 in the sanitizer builds; 1 (everything) when it is unset or not between 0 and 1.
inline double test_scale() {
  const char* scale = std::getenv("CCALLOC_TEST_SCALE");
  const double f = scale == nullptr ? 1.0 : std::strtod(scale, nullptr);
  return f > 0.0 && f < 1.0 ? f : 1.0;
}

// A fresh directory per test, named after the test and removed afterwards.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("ccalloc_" + std::string(info->test_suite_name()) + "_" + std::string(info->name()) +
             "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// --- Reuse inside a capture (graph_capture_record_stream_reuse) ---

// A block allocated during a capture, with the graph nodes that used it.
struct CapturedBlock {
  ccalloc::DevicePtr ptr = 0;
  std::size_t size = 0;
  ccalloc::StreamId stream = 0;
  std::vector<ccalloc::GraphNode> uses;
  bool cross = false;  // used on another stream (record_stream)
};

// Every node from which one of `stream`'s terminals can be reached, the terminals included:
// a reference walk of the capture graph, independent of the engine's.
inline std::unordered_set<ccalloc::GraphNode> capture_ancestors(ccalloc::Driver& d,
                                                                ccalloc::StreamId stream) {
  ccalloc::CaptureInfo info;
  std::unordered_set<ccalloc::GraphNode> seen;
  if (!d.capture_info(stream, info)) return seen;
  std::vector<ccalloc::GraphNode> stack = info.terminals;
  std::vector<ccalloc::GraphNode> parents;
  while (!stack.empty()) {
    const ccalloc::GraphNode n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    d.node_dependencies(n, parents);
    stack.insert(stack.end(), parents.begin(), parents.end());
  }
  return seen;
}

struct ReuseCheck {
  std::size_t cross = 0;     // overlapped blocks that other streams had used
  std::size_t failures = 0;  // each reported with ADD_FAILURE
};

// Checks an allocation [p, p + size) made on `stream` during a capture against the blocks
// the capture freed: every one it overlaps must be the stream's own, and every node that
// used it an ancestor of the stream's terminals (the graph orders the old uses before the
// new one). The blocks it overlaps leave `freed`.
inline ReuseCheck check_reuse_in_capture(ccalloc::Driver& d, ccalloc::StreamId stream,
                                         ccalloc::DevicePtr p, std::size_t size,
                                         std::vector<CapturedBlock>& freed) {
  ReuseCheck r;
  const std::unordered_set<ccalloc::GraphNode> before = capture_ancestors(d, stream);
  for (auto it = freed.begin(); it != freed.end();) {
    if (!(p < it->ptr + it->size && it->ptr < p + size)) {
      ++it;
      continue;
    }
    if (it->stream != stream) {
      ++r.failures;
      ADD_FAILURE() << "0x" << std::hex << p << " on stream " << std::dec << stream
                    << " reuses memory of stream " << it->stream << " during the capture";
    }
    for (ccalloc::GraphNode n : it->uses) {
      if (!before.contains(n)) {
        ++r.failures;
        ADD_FAILURE() << "0x" << std::hex << p << " reuses memory whose use at node " << std::dec
                      << n << " the graph does not order before stream " << stream
                      << "'s next work";
      }
    }
    if (it->cross) ++r.cross;
    it = freed.erase(it);
  }
  return r;
}

}  // namespace ccalloc_test
