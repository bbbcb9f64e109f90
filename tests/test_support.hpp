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
#include <utility>

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

}  // namespace ccalloc_test
