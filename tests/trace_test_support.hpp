// Helpers of the tests that replay bundled traces (stitch_trace_test, device_traces_test).
#pragma once

#include <gtest/gtest.h>

#include <cctype>
#include <cstddef>
#include <string>
#include <vector>

#include "io/trace_file.hpp"
#include "replay/replay.hpp"

namespace ccalloc_test {

// A file name as a gtest parameter name: every character but letters and digits becomes '_'.
inline std::string trace_param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  for (char& c : n) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return n;
}

// `trace` replayed under `conf` on the simulated GPU, of `capacity` bytes (0: the default).
inline ccalloc::replay::Result replay_trace(const std::vector<ccalloc::io::TraceRecord>& trace,
                                           const char* conf, std::size_t capacity = 0) {
  ccalloc::replay::Options o;
  o.conf = conf;
  if (capacity != 0) o.capacity = capacity;
  return ccalloc::replay::run(trace, o);
}

}  // namespace ccalloc_test
