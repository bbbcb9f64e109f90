// Sharing allocations between two real processes (include/ccalloc/ipc.hpp, docs/ipc.md).
//
// The test program starts a second copy of itself (posix_spawn of /proc/self/exe with
// CCALLOC_IPC_CHILD set), talks to it over its stdin and stdout, and checks contents both
// ways: the exporter fills the allocation with one pattern, the importer checks it and
// writes another, which the exporter then checks. Native segments (whole cudaMalloc
// segments through cudaIpcMemHandle) and expandable segments (pages through POSIX file
// descriptors copied with pidfd_getfd) are both covered, each with the shared allocation
// at a non-zero offset of its region. Every test skips itself without a CUDA device.
//
// pidfd_getfd needs the right to ptrace the exporter: a child importing from its parent
// gets it from the parent's prctl(PR_SET_PTRACER) below where the Yama module restricts
// ptrace to descendants (a parent importing from its child always has it).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/cuda.hpp"
#include "ccalloc/errors.hpp"
#include "ccalloc/ipc.hpp"
#if CCALLOC_GPU_TEST_HAVE_C_API
#include "ccalloc/ccalloc.h"
#endif

extern char** environ;

namespace {

using ccalloc::DevicePtr;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// The shared allocation follows a first one in the same segment, so that it lies at a
// non-zero offset of what is shared: native, 5 MiB after 3 MiB in a 20 MiB segment;
// expandable, 12 MiB after 30 MiB, 10 MiB into the second 20 MiB page.
struct Sizes {
  std::size_t first;
  std::size_t shared;
  std::size_t offset;
};
bool stitching(const std::string& conf) {
  return ccalloc::Config::parse(conf).stitch_segments;
}
Sizes sizes_for(const std::string& conf) {
  // The stitching policy: 12 MiB in a 20 MiB physical allocation, then 40 MiB on its last
  // 8 MiB and a new 32 MiB one: shared as two allocations of different sizes.
  if (stitching(conf)) return {12 * kMiB, 40 * kMiB, 12 * kMiB};
  if (conf.find("expandable_segments:True") != std::string::npos) {
    return {30 * kMiB, 12 * kMiB, 10 * kMiB};
  }
  return {3 * kMiB, 5 * kMiB, 3 * kMiB};
}

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<unsigned char>((i * 131 + seed * 7 + i / 4093) & 0xff);
  return v;
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void fill(DevicePtr p, unsigned seed, std::size_t n) {
  const std::vector<unsigned char> v = pattern(n, seed);
  check_cuda(cudaMemcpy(reinterpret_cast<void*>(p), v.data(), n, cudaMemcpyHostToDevice),
             "cudaMemcpy to the device");
}

// "" when the memory holds the pattern, else where it first differs.
std::string mismatch(DevicePtr p, unsigned seed, std::size_t n) {
  std::vector<unsigned char> got(n);
  check_cuda(cudaMemcpy(got.data(), reinterpret_cast<void*>(p), n, cudaMemcpyDeviceToHost),
             "cudaMemcpy from the device");
  const std::vector<unsigned char> want = pattern(n, seed);
  for (std::size_t i = 0; i < n; ++i) {
    if (got[i] != want[i]) {
      return "byte " + std::to_string(i) + " is " + std::to_string(got[i]) + ", expected " +
             std::to_string(want[i]) + " (pattern " + std::to_string(seed) + ")";
    }
  }
  return "";
}

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (const unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

std::string read_line(std::FILE* f) {
  std::string line;
  for (int c = std::fgetc(f); c != EOF && c != '\n'; c = std::fgetc(f))
    line.push_back(static_cast<char>(c));
  return line;
}

// --- The child's side (main() runs it when CCALLOC_IPC_CHILD is set). ---

// One line to the parent, flushed at once: stdout is a pipe, fully buffered, and the
// verdict must not depend on how the process ends.
void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// import: reads a handle, checks pattern 1, writes pattern 2, closes. import_c does the
// same through the C API. export: allocates under CCALLOC_IPC_CONF, writes pattern 3,
// prints the handle, waits for "checked" and then checks pattern 4.
int child_main(const std::string& mode) {
  try {
    if (mode == "import" || mode == "import_c") {
      const std::string handle = from_hex(read_line(stdin));
      const std::size_t shared = ccalloc::ipc::parse_handle(handle).size;
      DevicePtr p = 0;
#if CCALLOC_GPU_TEST_HAVE_C_API
      void* opened = nullptr;
      if (mode == "import_c") {
        if (ccalloc_ipc_open(handle.data(), handle.size(), 0, &opened) != CCALLOC_SUCCESS) {
          say(std::string("error: ccalloc_ipc_open: ") + ccalloc_last_error());
          return 1;
        }
        p = reinterpret_cast<DevicePtr>(opened);
      }
#endif
      ccalloc::cuda::CudaDriver driver(0);
      ccalloc::ipc::OpenedMemory m;
      if (p == 0) {
        m = ccalloc::ipc::open_handle(driver, handle);
        p = m.ptr();
      }
      if (const std::string bad = mismatch(p, 1, shared); !bad.empty()) {
        say(std::string("error: the importer read ") + bad.c_str());
        return 1;
      }
      fill(p, 2, shared);
      check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#if CCALLOC_GPU_TEST_HAVE_C_API
      if (opened != nullptr && ccalloc_ipc_close(opened) != CCALLOC_SUCCESS) {
        say(std::string("error: ccalloc_ipc_close: ") + ccalloc_last_error());
        return 1;
      }
#endif
      m.close();
      say("ok");
      return 0;
    }
    if (mode == "export") {
      const char* env = std::getenv("CCALLOC_IPC_CONF");
      const std::string conf = env != nullptr ? env : "pytorch";
      const Sizes z = sizes_for(conf);
      ccalloc::cuda::CudaDriver driver(0);
      ccalloc::Allocator alloc(driver, ccalloc::Config::parse(conf));
      const DevicePtr first = alloc.malloc(z.first);
      const DevicePtr p = alloc.malloc(z.shared);
      fill(p, 3, z.shared);
      check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      say(to_hex(ccalloc::ipc::export_handle(alloc, p)));
      if (read_line(stdin) != "checked") {
        say("error: the parent did not answer");
        return 1;
      }
      if (const std::string bad = mismatch(p, 4, z.shared); !bad.empty()) {
        say(std::string("error: the exporter read back ") + bad.c_str());
        return 1;
      }
      alloc.free(p);
      alloc.free(first);
      say("ok");
      return 0;
    }
    say(std::string("error: unknown CCALLOC_IPC_CHILD mode ") + mode.c_str());
  } catch (const std::exception& e) {
    say(std::string("error: ") + e.what());
  }
  return 1;
}

// --- The parent's side. ---

class Child {
 public:
  Child(const std::string& mode, const std::string& conf) {
    int to_child[2];
    int from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) throw std::runtime_error("pipe failed");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    posix_spawn_file_actions_addclose(&actions, to_child[1]);
    posix_spawn_file_actions_addclose(&actions, from_child[0]);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, "CCALLOC_IPC_", 12) != 0) env_strings.emplace_back(*e);
    }
    env_strings.push_back("CCALLOC_IPC_CHILD=" + mode);
    env_strings.push_back("CCALLOC_IPC_CONF=" + conf);
    env_strings.push_back("CCALLOC_CONF=" + conf);
    std::vector<char*> envp;
    for (std::string& s : env_strings)
      envp.push_back(s.data());
    envp.push_back(nullptr);
    char exe[] = "/proc/self/exe";
    char* argv[] = {exe, nullptr};
    const int rc = posix_spawn(&pid_, exe, &actions, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    if (rc != 0) throw std::runtime_error(std::string("posix_spawn: ") + std::strerror(rc));
    // Let the child copy this process's descriptors (pidfd_getfd) under Yama's ptrace scope 1;
    // without Yama the call fails with EINVAL, and nothing restricts it anyway.
    (void)prctl(PR_SET_PTRACER, static_cast<unsigned long>(pid_), 0, 0, 0);
    in_ = fdopen(to_child[1], "w");
    out_ = fdopen(from_child[0], "r");
  }
  ~Child() {
    if (in_ != nullptr) std::fclose(in_);
    if (out_ != nullptr) std::fclose(out_);
    if (pid_ > 0 && !waited_) {
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }
  void send(const std::string& line) {
    std::fprintf(in_, "%s\n", line.c_str());
    std::fflush(in_);
  }
  std::string receive() { return read_line(out_); }
  int wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    waited_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  pid_t pid_ = 0;
  bool waited_ = false;
  std::FILE* in_ = nullptr;
  std::FILE* out_ = nullptr;
};

class IpcGpuTest : public ::testing::TestWithParam<const char*> {};

INSTANTIATE_TEST_SUITE_P(Segments, IpcGpuTest,
                         ::testing::Values("pytorch", "pytorch,expandable_segments:True",
                                           "ccalloc"),
                         [](const auto& param) {
                           return std::string(param.index == 0   ? "Native"
                                              : param.index == 1 ? "Expandable"
                                                                 : "Stitching");
                         });

void parent_exports(const char* conf, const char* child_mode) {
  const Sizes z = sizes_for(conf);
  ccalloc::cuda::CudaDriver driver(0);
  ccalloc::Allocator alloc(driver, ccalloc::Config::parse(conf));
  const DevicePtr first = alloc.malloc(z.first);
  const DevicePtr p = alloc.malloc(z.shared);
  ASSERT_EQ(p, first + z.first);
  fill(p, 1, z.shared);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const std::string handle = ccalloc::ipc::export_handle(alloc, p);
  const ccalloc::ipc::HandleInfo info = ccalloc::ipc::parse_handle(handle);
  EXPECT_EQ(info.pid, static_cast<int>(getpid()));
  EXPECT_EQ(info.size, z.shared);
  const bool expandable = std::string(conf).find("expandable") != std::string::npos;
  EXPECT_EQ(info.kind, stitching(conf) ? ccalloc::ipc::RegionKind::kHandles
                       : expandable  ? ccalloc::ipc::RegionKind::kPages
                                     : ccalloc::ipc::RegionKind::kSegment);
  if (stitching(conf)) {
    EXPECT_EQ(info.page_sizes, (std::vector<std::size_t>{20 * kMiB, 32 * kMiB}));
  }
  EXPECT_EQ(info.offset, z.offset);
  Child child(child_mode, conf);
  child.send(to_hex(handle));
  const std::string reply = child.receive();
  EXPECT_EQ(reply, "ok");
  EXPECT_EQ(child.wait(), 0) << reply;
  EXPECT_EQ(mismatch(p, 2, z.shared), "") << "the importer's writes did not reach the exporter";
  alloc.free(p);
  alloc.free(first);
}

TEST_P(IpcGpuTest, ParentExportsChildOpensAndBothSeeTheOthersWrites) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  parent_exports(GetParam(), "import");
}

TEST_P(IpcGpuTest, ChildOpensThroughTheCApi) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
#if !CCALLOC_GPU_TEST_HAVE_C_API
  GTEST_SKIP() << "built without the C API library";
#endif
  parent_exports(GetParam(), "import_c");
}

TEST_P(IpcGpuTest, ChildExportsParentOpensAndBothSeeTheOthersWrites) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Child child("export", GetParam());
  const std::string line = child.receive();
  ASSERT_FALSE(line.empty());
  ASSERT_NE(line.rfind("error", 0), 0u) << line;
  const std::string handle = from_hex(line);
  {
    ccalloc::cuda::CudaDriver driver(0);
    ccalloc::ipc::OpenedMemory m = ccalloc::ipc::open_handle(driver, handle);
    const Sizes z = sizes_for(GetParam());
    EXPECT_EQ(m.size(), z.shared);
    EXPECT_EQ(ccalloc::ipc::parse_handle(handle).offset, z.offset);
    EXPECT_EQ(mismatch(m.ptr(), 3, z.shared), "") << "the importer read wrong contents";
    fill(m.ptr(), 4, z.shared);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    m.close();
  }
  child.send("checked");
  const std::string reply = child.receive();
  EXPECT_EQ(reply, "ok");
  EXPECT_EQ(child.wait(), 0) << reply;
}

TEST(IpcGpu, ErrorsNameTheProblem) {
  if (ccalloc::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ccalloc::cuda::CudaDriver driver(0);
  ccalloc::Allocator alloc(driver, ccalloc::Config::parse("pytorch,expandable_segments:True"));
  const DevicePtr p = alloc.malloc(kMiB);
  std::string handle = ccalloc::ipc::export_handle(alloc, p);
  try {
    (void)ccalloc::ipc::open_handle(driver, handle.substr(0, 20));
    ADD_FAILURE() << "a truncated handle opened";
  } catch (const ccalloc::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("truncated at byte 20"), std::string::npos) << e.what();
  }
  handle[56] = '\xff';  // the descriptor: 0x...ff, not one this process has open
  handle[57] = '\xff';
  handle[58] = '\xff';
  handle[59] = '\x7f';
  try {
    (void)ccalloc::ipc::open_handle(driver, handle);
    ADD_FAILURE() << "a handle of a descriptor that is not open opened";
  } catch (const ccalloc::DriverError& e) {
    EXPECT_NE(std::string(e.what()).find("pidfd_getfd for descriptor 2147483647"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ccalloc::ipc::export_handle(alloc, p + 512), ccalloc::InvalidPointerError);
  alloc.free(p);
#if CCALLOC_GPU_TEST_HAVE_C_API
  char buf[256];
  std::size_t length = 0;
  EXPECT_EQ(ccalloc_ipc_export(reinterpret_cast<void*>(0x1000), buf, sizeof buf, &length),
            CCALLOC_ERROR_INVALID_POINTER);
  EXPECT_NE(std::string(ccalloc_last_error()).find("is not a live allocation"), std::string::npos);
  void* out = nullptr;
  EXPECT_EQ(ccalloc_ipc_open("ccIP", 4, 0, &out), CCALLOC_ERROR_INVALID_VALUE);
  EXPECT_NE(std::string(ccalloc_last_error()).find("truncated at byte 4"), std::string::npos);
  EXPECT_EQ(ccalloc_ipc_close(reinterpret_cast<void*>(0x1000)), CCALLOC_ERROR_INVALID_POINTER);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* mode = std::getenv("CCALLOC_IPC_CHILD")) return child_main(mode);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
