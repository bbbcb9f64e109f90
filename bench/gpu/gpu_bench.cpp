// The GPU benchmark: ccalloc against cudaMalloc/cudaFree, cudaMallocAsync on the device's
// default pool, and PyTorch's CUDA caching allocator (when built with torch), in one
// process on device 0. ccalloc runs as the process-wide allocator ("ccalloc", the
// environment's config), as a direct Allocator with that config ("ccalloc (direct)"), with
// expandable segments ("ccalloc expandable": pytorch,expandable_segments:True) and with the
// cudaMallocAsync backend ("ccalloc async": backend:cudaMallocAsync, on the same default
// pool as the cudaMallocAsync column); "CPU control", a thread-private best-fit cache on the
// CPU alone, gives the host's own ceiling for the thread workloads (CpuControl).
//
//   bench_gpu [--reps N] [--json FILE] [--target-ms MS] [--random-steps N] [--no-pin]
//             [--pairs-only]
//
// Workloads, each the median (and min) of N >= 5 repetitions (default 11) after warm-up:
//   pair      malloc+free of one size (512 B, 1 MiB, 64 MiB), one thread, default stream;
//   random    log-uniform sizes 512 B - 64 MiB, up to 256 live, the same seeded sequence
//             for every allocator (cudaMalloc runs a shorter prefix of it);
//   threads   1, 4 and 8 threads, each on its own stream, 512 B cache-hit pairs; aggregate
//             pairs per second from a common start (barrier) to the last thread's end.
// --pairs-only runs the pair workloads alone (a second run under another CCALLOC_CONF,
// for the process API's column under that config).
// Repetitions run in interleaved rounds: for each workload, round r runs one repetition of
// every allocator, starting with allocator r mod k. On a shared VM the speed of the whole
// machine drifts in phases lasting seconds; back-to-back repetitions put a slow phase on one
// allocator only, interleaved ones spread it over all of them. The summary also compares the
// `ccalloc` preset with the `pytorch` preset round by round (the median over rounds of their
// speed ratio in the same round): thread workloads come out bimodal on a shared VM, and the
// two columns' own medians can differ by which of their rounds fell in a slow phase.
// The single-thread workloads run pinned to one CPU, thread t of the thread workloads to the
// t-th of eight CPUs on distinct physical cores where the machine has them (plan_pinning):
// an unpinned thread that the scheduler moves between cores gave bimodal repetitions.
// The CUDA context, each allocator's first segments and the pool are warmed before timing.
#include <cuda_runtime_api.h>
#include <sched.h>

#include <algorithm>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/cuda.hpp"
#include "ccalloc/process.hpp"
#include "ccalloc/stats.hpp"
#include "core/backend_access.hpp"
#include "random_ops.hpp"
#include "stitch/backend.hpp"
#if CCALLOC_BENCH_WITH_TORCH
#include "torch_backend.hpp"
#endif

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * kKiB;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
  }
}

double ns_since(Clock::time_point start) {
  return std::chrono::duration<double, std::nano>(Clock::now() - start).count();
}

// Keeps the compiler from dropping an allocation whose pointer is otherwise unused.
inline void keep(void* p) {
  asm volatile("" : : "r"(p) : "memory");
}

ccalloc::StreamId stream_id(cudaStream_t s) {
  return reinterpret_cast<std::uintptr_t>(s);
}

// ---------------------------------------------------------------------------------------
// CPU pinning. sched_setaffinity(0, ...) acts on the calling thread only; threads a pinned
// thread creates inherit its mask, so the main thread is pinned only while it runs the
// single-thread workloads, after the CUDA context, PyTorch and the pool made their threads.

// The CPUs this process may run on, ascending; empty if sched_getaffinity fails.
std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

bool pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
}

// Pins the calling thread to `cpu` (nothing when cpu < 0) and gives it back its previous
// affinity at the end of the scope.
class ScopedPin {
 public:
  explicit ScopedPin(int cpu) {
    CPU_ZERO(&saved_);
    if (cpu < 0) return;
    if (sched_getaffinity(0, sizeof saved_, &saved_) != 0 || !pin_to(cpu)) {
      error_ = std::strerror(errno);
      return;
    }
    pinned_ = true;
  }
  ~ScopedPin() {
    if (pinned_) (void)sched_setaffinity(0, sizeof saved_, &saved_);
  }
  ScopedPin(const ScopedPin&) = delete;
  ScopedPin& operator=(const ScopedPin&) = delete;

  bool pinned() const { return pinned_; }
  const std::string& error() const { return error_; }

 private:
  cpu_set_t saved_;
  bool pinned_ = false;
  std::string error_;
};

// "0-3,8,10-11"
std::string cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1)
      ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += (j == i + 1 ? "," : "-") + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

constexpr int kMaxThreads = 8;

struct Pinning {
  std::vector<int> allowed;
  int single = -1;           // CPU of the single-thread workloads; -1: not pinned
  std::vector<int> threads;  // CPU of thread t of the thread workloads; empty: not pinned
  std::string off;           // why pinning is off, when it is
  std::size_t cores = 0;     // physical cores among the allowed CPUs (0: not looked at)

  std::string describe() const {
    if (single < 0) return "off (" + off + "); allowed CPUs " + cpu_list(allowed);
    std::string distinct;
    std::vector<int> sorted = threads;
    std::sort(sorted.begin(), sorted.end());
    if (std::unique(sorted.begin(), sorted.end()) != sorted.end()) {
      distinct = " (shared: fewer than " + std::to_string(kMaxThreads + 1) + " CPUs allowed)";
    }
    if (distinct.empty() && cores < threads.size()) {
      distinct = " (" + std::to_string(cores) + " physical cores: some threads share one)";
    }
    return "single-thread workloads on CPU " + std::to_string(single) +
           "; thread t of the thread workloads on the t-th of CPUs " + cpu_list(threads) +
           distinct + "; allowed CPUs " + cpu_list(allowed) + " on " + std::to_string(cores) +
           " physical cores";
  }
};

// The physical core of a CPU as the kernel reports it ("package:core"), or the CPU's own
// number where the topology is not readable.
std::string core_of(int cpu) {
  const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
  std::string package, core;
  std::ifstream(dir + "physical_package_id") >> package;
  std::ifstream(dir + "core_id") >> core;
  if (package.empty() || core.empty()) return "cpu" + std::to_string(cpu);
  return package + ":" + core;
}

// The allowed CPUs in the order the workloads take them: one CPU of each physical core
// first (hyperthreads of one core share its execution units, so two threads on siblings
// run at well under twice one thread's speed), the core of the first allowed CPU last (it
// tends to take more of the system's interrupts and housekeeping), siblings after that.
std::vector<int> cpus_by_core(const std::vector<int>& allowed, std::size_t* cores) {
  std::vector<std::string> seen;
  std::vector<int> first, rest;
  for (const int cpu : allowed) {
    const std::string core = core_of(cpu);
    if (std::find(seen.begin(), seen.end(), core) == seen.end()) {
      seen.push_back(core);
      first.push_back(cpu);
    } else {
      rest.push_back(cpu);
    }
  }
  *cores = seen.size();
  if (first.size() > 1) std::rotate(first.begin(), first.begin() + 1, first.end());
  first.insert(first.end(), rest.begin(), rest.end());
  return first;
}

// The single-thread workloads on the first CPU of cpus_by_core's order, thread t of the
// thread workloads on its t-th: eight threads on eight cores where there are as many.
Pinning plan_pinning(bool enabled) {
  Pinning p;
  p.allowed = allowed_cpus();
  if (!enabled) {
    p.off = "--no-pin";
    return p;
  }
  if (p.allowed.empty()) {
    p.off = std::string("sched_getaffinity: ") + std::strerror(errno);
    return p;
  }
  const std::vector<int> order = cpus_by_core(p.allowed, &p.cores);
  const int single = order.front();
  {
    const ScopedPin probe(single);  // the kernel (or a container) may refuse
    if (!probe.pinned()) {
      p.off = "sched_setaffinity: " + probe.error();
      return p;
    }
  }
  p.single = single;
  for (std::size_t t = 0; t < kMaxThreads; ++t)
    p.threads.push_back(order[t % order.size()]);
  return p;
}

// ---------------------------------------------------------------------------------------
// Allocators under test: alloc/free on a stream, finish (wait for stream-ordered work the
// allocator queued), release (return cached memory between allocators).

struct CcallocProcess {
  ccalloc::ProcessAllocator& pa;
  void* alloc(std::size_t n, cudaStream_t s) {
    return reinterpret_cast<void*>(pa.malloc(n, stream_id(s)));
  }
  void free(void* p, cudaStream_t) { pa.free(reinterpret_cast<ccalloc::DevicePtr>(p)); }
  void finish(cudaStream_t) {}
  void release() { pa.empty_cache(); }
};

struct CcallocDirect {
  ccalloc::Allocator& a;
  void* alloc(std::size_t n, cudaStream_t s) {
    return reinterpret_cast<void*>(a.malloc(n, stream_id(s)));
  }
  void free(void* p, cudaStream_t) { a.free(reinterpret_cast<ccalloc::DevicePtr>(p)); }
  void finish(cudaStream_t) {}
  void release() { a.empty_cache(); }
};

// ccalloc's cudaMallocAsync backend: frees are stream-ordered (cudaFreeAsync), so a
// repetition ends by waiting for its stream, as the cudaMallocAsync column's does.
struct CcallocAsync {
  ccalloc::Allocator& a;
  void* alloc(std::size_t n, cudaStream_t s) {
    return reinterpret_cast<void*>(a.malloc(n, stream_id(s)));
  }
  void free(void* p, cudaStream_t) { a.free(reinterpret_cast<ccalloc::DevicePtr>(p)); }
  void finish(cudaStream_t s) { check(cudaStreamSynchronize(s), "cudaStreamSynchronize"); }
  void release() { a.empty_cache(); }  // synchronizes the device, trims the pool
};

#if CCALLOC_BENCH_WITH_TORCH
struct Torch {
  void* alloc(std::size_t n, cudaStream_t s) {
    void* p = bench_torch::alloc(n, s);
    if (p == nullptr) throw std::runtime_error("PyTorch's raw_alloc_with_stream returned NULL");
    return p;
  }
  void free(void* p, cudaStream_t) { bench_torch::free(p); }
  void finish(cudaStream_t) {}
  void release() { bench_torch::empty_cache(); }
};
#endif

struct MallocAsync {
  cudaMemPool_t pool = nullptr;
  void* alloc(std::size_t n, cudaStream_t s) {
    void* p = nullptr;
    check(cudaMallocAsync(&p, n, s), "cudaMallocAsync");
    return p;
  }
  void free(void* p, cudaStream_t s) { check(cudaFreeAsync(p, s), "cudaFreeAsync"); }
  void finish(cudaStream_t s) { check(cudaStreamSynchronize(s), "cudaStreamSynchronize"); }
  void release() {
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    check(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
  }
};

// The CPU control: a best-fit cache private to each thread (a size-ordered tree of free
// blocks and a hash index of live ones, the shape of a caching allocator's hit) on the CPU
// alone: no GPU, no lock, nothing shared between threads, addresses made up. Its 8 threads
// / 1 thread is the host's own ceiling for the thread workloads (turbo headroom, cores
// shared with other guests); an allocator's ratio read against it says what the
// allocator's shared state costs.
struct CpuControl {
  struct Cache {
    std::multimap<std::size_t, std::uintptr_t> free;
    std::unordered_map<std::uintptr_t, std::size_t> live;
    std::uintptr_t next = 4096;
  };
  static Cache& cache() {
    thread_local Cache c;
    return c;
  }
  void* alloc(std::size_t n, cudaStream_t) {
    Cache& c = cache();
    std::size_t size = (n + 511) / 512 * 512;
    std::uintptr_t p;
    if (auto it = c.free.lower_bound(size); it != c.free.end()) {
      size = it->first;
      p = it->second;
      c.free.erase(it);
    } else {
      p = c.next;
      c.next += size;
    }
    c.live.emplace(p, size);
    return reinterpret_cast<void*>(p);
  }
  void free(void* p, cudaStream_t) {
    Cache& c = cache();
    const auto it = c.live.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == c.live.end()) throw std::runtime_error("CPU control: free of an unknown pointer");
    c.free.emplace(it->second, it->first);
    c.live.erase(it);
  }
  void finish(cudaStream_t) {}
  void release() {}
};

struct Malloc {
  void* alloc(std::size_t n, cudaStream_t) {
    void* p = nullptr;
    check(cudaMalloc(&p, n), "cudaMalloc");
    return p;
  }
  void free(void* p, cudaStream_t) { check(cudaFree(p), "cudaFree"); }
  void finish(cudaStream_t) {}
  void release() {}
};

using ccalloc_bench::kRandomMaxLive;
using ccalloc_bench::make_random_ops;
using ccalloc_bench::Op;

// The workloads over any allocator; virtual only per repetition, never per operation.
class Runner {
 public:
  virtual ~Runner() = default;
  // ns per malloc+free pair of `size` bytes on the default stream.
  virtual double pairs(std::size_t size, long iterations) = 0;
  // ns per operation over ops[0, n).
  virtual double random(const std::vector<Op>& ops, std::size_t n) = 0;
  // Aggregate pairs per second of `count` threads, thread i on streams[i] and pinned to
  // cpus[i] (unpinned when cpus is empty).
  virtual double threads(int count, long iterations, const std::vector<cudaStream_t>& streams,
                         const std::vector<int>& cpus) = 0;
  virtual void release() = 0;
};

template <class A>
class RunnerOf final : public Runner {
 public:
  explicit RunnerOf(A a) : a_(std::move(a)) {}

  double pairs(std::size_t size, long iterations) override {
    cudaStream_t s = nullptr;
    const auto t0 = Clock::now();
    for (long i = 0; i < iterations; ++i) {
      void* p = a_.alloc(size, s);
      keep(p);
      a_.free(p, s);
    }
    a_.finish(s);
    return ns_since(t0) / static_cast<double>(iterations);
  }

  double random(const std::vector<Op>& ops, std::size_t n) override {
    cudaStream_t s = nullptr;
    std::vector<void*> live;
    live.reserve(kRandomMaxLive);
    const auto t0 = Clock::now();
    ccalloc_bench::run_random_ops(
        ops, n, live, [&](std::size_t bytes) { return a_.alloc(bytes, s); },
        [&](void* p) { a_.free(p, s); });
    a_.finish(s);
    const double ns = ns_since(t0);
    for (void* p : live)
      a_.free(p, s);
    a_.finish(s);
    return ns / static_cast<double>(n);
  }

  double threads(int count, long iterations, const std::vector<cudaStream_t>& streams,
                 const std::vector<int>& cpus) override {
    Clock::time_point start, end;
    auto on_start = [&start]() noexcept { start = Clock::now(); };
    auto on_end = [&end]() noexcept { end = Clock::now(); };
    std::barrier start_line(count, on_start);
    std::barrier finish_line(count, on_end);
    std::mutex error_mutex;
    std::string error;
    auto record = [&](const char* what) {
      std::lock_guard lock(error_mutex);
      if (error.empty()) error = what;
    };
    std::vector<std::thread> pool;
    for (int t = 0; t < count; ++t) {
      pool.emplace_back([&, t] {
        cudaStream_t s = streams[static_cast<std::size_t>(t)];
        try {
          // First, so that the warm-up below heats the caches of the CPU that is timed.
          if (!cpus.empty() && !pin_to(cpus[static_cast<std::size_t>(t) % cpus.size()])) {
            throw std::runtime_error(std::string("sched_setaffinity: ") + std::strerror(errno));
          }
          check(cudaSetDevice(0), "cudaSetDevice");
          for (int w = 0; w < 64; ++w)
            a_.free(a_.alloc(512, s), s);  // warm: arena, segment
          a_.finish(s);
        } catch (const std::exception& e) {
          record(e.what());
        }
        start_line.arrive_and_wait();
        try {
          for (long i = 0; i < iterations; ++i) {
            void* p = a_.alloc(512, s);
            keep(p);
            a_.free(p, s);
          }
          a_.finish(s);
        } catch (const std::exception& e) {
          record(e.what());
        }
        finish_line.arrive_and_wait();
      });
    }
    for (auto& t : pool)
      t.join();
    if (!error.empty()) throw std::runtime_error(error);
    const double seconds = std::chrono::duration<double>(end - start).count();
    return static_cast<double>(count) * static_cast<double>(iterations) / seconds;
  }

  void release() override { a_.release(); }

 private:
  A a_;
};

// ---------------------------------------------------------------------------------------
// Results

struct Sample {
  double median = 0;  // in `unit`
  double min = 0;
  double max = 0;
  std::vector<double> values;  // in round order
  long iterations = 0;         // per repetition (per thread for the thread workloads)
  std::string unit;            // "ns_per_pair", "ns_per_op" or "pairs_per_s"
  std::string note;
};

Sample summarise(std::vector<double> values, long iterations, std::string unit) {
  Sample s;
  s.values = values;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  s.median = n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
  s.min = values.front();
  s.max = values.back();
  s.iterations = iterations;
  s.unit = std::move(unit);
  return s;
}

// Per second of the sample's unit: pairs/s or operations/s.
double per_second(const Sample& s) {
  return s.unit == "pairs_per_s" ? s.median : 1e9 / s.median;
}

struct Options {
  int reps = 11;
  // Per timed repetition of the pair and thread workloads: 11 rounds x 7 allocators x 6
  // such workloads are ~23 s timed; with calibration, the random workload (a fixed
  // sequence) and the contended thread runs, bench_gpu takes about a minute and a half.
  double target_ms = 50;
  std::size_t random_steps = 200'000;
  std::string json;
  bool pin = true;
  bool pairs_only = false;  // the pair workloads alone
};

struct Column {
  std::string name;
  std::unique_ptr<Runner> runner;
  long max_pair_iterations = 2'000'000;
  long max_large_pair_iterations = 200'000;  // 64 MiB pairs
  long max_thread_iterations = 500'000;
  bool limit_random = false;  // run a ~1 s prefix of the random sequence (cudaMalloc)
  bool failed = false;        // set by its first error: left out of the later workloads
};

// What one column runs per repetition of a workload.
struct Plan {
  long iterations = 0;  // pairs (per thread), or steps of the random sequence
  std::string note;
};

struct Ratio {
  std::string key;
  std::string label;
  double value;
};

// How much faster `a` ran than `b`, round by round: the median over rounds of b's time / a's
// (or a's rate / b's), > 1 when `a` is faster. Both ran in every round, so a slow phase of
// the machine that falls on one round falls on both; the medians of the two columns taken
// apart can differ by a phase that fell on more of one column's rounds (thread workloads
// on a shared VM come out bimodal, rounds at one speed or about half of it).
double paired_speedup(const Sample& a, const Sample& b) {
  std::vector<double> r;
  for (std::size_t i = 0; i < std::min(a.values.size(), b.values.size()); ++i) {
    if (a.values[i] > 0 && b.values[i] > 0) {
      r.push_back(a.unit == "pairs_per_s" ? a.values[i] / b.values[i] : b.values[i] / a.values[i]);
    }
  }
  if (r.empty()) return 0;
  std::sort(r.begin(), r.end());
  const std::size_t n = r.size();
  return n % 2 == 1 ? r[n / 2] : (r[n / 2 - 1] + r[n / 2]) / 2;
}

constexpr const char* kWorkloads[] = {"pair_512B", "pair_1MiB", "pair_64MiB", "random",
                                      "threads_1", "threads_4", "threads_8"};

class Bench {
 public:
  Bench(Options options, std::vector<cudaStream_t> streams, Pinning pinning)
      : opt_(std::move(options)),
        streams_(std::move(streams)),
        pinning_(std::move(pinning)),
        ops_(make_random_ops(opt_.random_steps)) {}

  void add(Column column) { columns_.push_back(std::move(column)); }

  // Runs every workload over every column, in interleaved rounds; returns false if any failed.
  bool run() {
    const std::size_t sizes[] = {512, 1 * kMiB, 64 * kMiB};
    {
      const ScopedPin pin(pinning_.single);
      for (std::size_t i = 0; i < std::size(sizes); ++i) {
        const std::size_t size = sizes[i];
        interleave(
            kWorkloads[i], "ns_per_pair",
            [&](Column& c) {
              Runner& r = *c.runner;
              const long cap =
                  size >= 64 * kMiB ? c.max_large_pair_iterations : c.max_pair_iterations;
              r.pairs(size, 16);  // warm: the first segment of this size
              auto seconds = [&](long n) {
                return r.pairs(size, n) * static_cast<double>(n) / 1e9;
              };
              return Plan{calibrate(seconds, 16, 16, cap), ""};
            },
            [size](Column& c, long n) { return c.runner->pairs(size, n); });
      }
      if (opt_.pairs_only) return errors_.empty();
      interleave(
          "random", "ns_per_op",
          [&](Column& c) {
            Plan plan = random_plan(c, sizes);
            // warm: the cache holds this workload's segments from here on
            c.runner->random(ops_, static_cast<std::size_t>(plan.iterations));
            return plan;
          },
          [this](Column& c, long n) {
            return c.runner->random(ops_, static_cast<std::size_t>(n));
          });
    }

    const int counts[] = {1, 4, 8};
    for (std::size_t i = 0; i < std::size(counts); ++i) {
      const int count = counts[i];
      interleave(
          kWorkloads[4 + i], "pairs_per_s",
          [&](Column& c) {
            // The calibration runs warm each thread's arena and segment.
            auto seconds = [&](long n) {
              return count * static_cast<double>(n) /
                     c.runner->threads(count, n, streams_, pinning_.threads);
            };
            return Plan{calibrate(seconds, 100, 200, c.max_thread_iterations), ""};
          },
          [&](Column& c, long n) {
            return c.runner->threads(count, n, streams_, pinning_.threads);
          });
    }
    return errors_.empty();
  }

  void print_table() const {
    std::printf(
        "\n== bench_gpu summary (median of %d interleaved rounds, pairs: median (min); device "
        "0)\n",
        opt_.reps);
    std::printf("%-22s", "workload");
    for (const auto& c : columns_)
      std::printf(" %18s", c.name.c_str());
    std::printf("\n");
    static const char* const labels[] = {"pair 512 B   ns/pair",  "pair 1 MiB   ns/pair",
                                         "pair 64 MiB  ns/pair",  "random       ns/op",
                                         "1 thread     Mpairs/s", "4 threads    Mpairs/s",
                                         "8 threads    Mpairs/s"};
    auto ns = [](double v) {
      char text[32];
      std::snprintf(text, sizeof text, v < 100 ? "%.1f" : "%.0f", v);
      return std::string(text);
    };
    for (std::size_t w = 0; w < std::size(kWorkloads); ++w) {
      std::printf("%-22s", labels[w]);
      for (const auto& c : columns_) {
        const Sample* s = find(kWorkloads[w], c.name);
        std::string cell;
        if (s == nullptr) {
          cell = "n/a";
        } else if (s->unit == "pairs_per_s") {
          char text[32];
          std::snprintf(text, sizeof text, "%.2f", s->median / 1e6);
          cell = text;
        } else if (s->unit == "ns_per_pair") {
          cell = ns(s->median) + " (" + ns(s->min) + ")";
        } else {
          cell = ns(s->median) + (s->note.empty() ? "" : "*");
        }
        std::printf(" %18s", cell.c_str());
      }
      std::printf("\n");
    }
    for (const auto& c : columns_) {
      if (const Sample* s = find("random", c.name); s != nullptr && !s->note.empty()) {
        std::printf("* %s: %s\n", c.name.c_str(), s->note.c_str());
      }
    }
    std::printf(
        "threads: each thread on a stream of its own, not the default stream (the `ccalloc`"
        " preset stamps its frees for sharing between streams there)\n");
    for (const auto& [name, error] : errors_) {
      std::printf("! %s failed: %s\n", name.c_str(), error.c_str());
    }
    for (const Ratio& r : ratios())
      std::printf("%s: %.3f\n", r.label.c_str(), r.value);
  }

  void write_json(const std::string& path, const std::string& device, const std::string& config,
                  const std::string& torch_version) const {
    std::ofstream out(path);
    if (!out) throw std::runtime_error("cannot write " + path);
    out << "{\n  \"device\": " << quote(device) << ",\n  \"ccalloc_config\": " << quote(config)
        << ",\n  \"torch_version\": " << (torch_version.empty() ? "null" : quote(torch_version))
        << ",\n  \"repetitions\": " << opt_.reps
        << ",\n  \"interleaved\": true,\n  \"target_ms\": " << number(opt_.target_ms)
        << ",\n  \"random_steps\": " << opt_.random_steps
        << ",\n  \"cpu_pinning\": {\"allowed\": " << ints(pinning_.allowed)
        << ", \"single_thread_cpu\": "
        << (pinning_.single < 0 ? std::string("null") : std::to_string(pinning_.single))
        << ", \"thread_cpus\": " << ints(pinning_.threads)
        << ", \"physical_cores\": " << pinning_.cores
        << ", \"off\": " << (pinning_.off.empty() ? "null" : quote(pinning_.off))
        << "},\n  \"results\": [";
    bool first = true;
    for (const auto& c : columns_) {
      for (const char* w : kWorkloads) {
        const Sample* s = find(w, c.name);
        if (s == nullptr) continue;
        out << (first ? "\n" : ",\n") << "    {\"workload\": " << quote(w)
            << ", \"allocator\": " << quote(c.name) << ", \"unit\": " << quote(s->unit)
            << ", \"median\": " << number(s->median) << ", \"min\": " << number(s->min)
            << ", \"max\": " << number(s->max) << ", \"per_second\": " << number(per_second(*s))
            << ", \"iterations\": " << s->iterations << ", \"samples\": [";
        for (std::size_t i = 0; i < s->values.size(); ++i) {
          out << (i == 0 ? "" : ", ") << number(s->values[i]);
        }
        out << "], \"note\": " << quote(s->note) << "}";
        first = false;
      }
    }
    out << "\n  ],\n  \"errors\": {";
    first = true;
    for (const auto& [name, error] : errors_) {
      out << (first ? "" : ", ") << quote(name) << ": " << quote(error);
      first = false;
    }
    out << "},\n  \"ratios\": {";
    first = true;
    for (const Ratio& r : ratios()) {
      out << (first ? "" : ", ") << quote(r.key) << ": " << number(r.value);
      first = false;
    }
    out << "}\n}\n";
  }

 private:
  // One workload over every column still running: prepare(c) warms column c and returns its
  // plan, then opt_.reps rounds each run one repetition of every column, round r starting
  // with column r mod k, so that a slow phase of the machine, and the place in a round
  // (after which allocator, with whose data in the CPU's caches), fall on every column alike.
  // Samples are kept in round order. Afterwards each column gives its cached memory back:
  // every workload starts from empty caches, and the device holds only one workload's.
  template <class Prepare, class Repeat>
  void interleave(const char* workload, const char* unit, Prepare prepare, Repeat repeat) {
    std::printf("\n== %s (%d rounds)\n", workload, opt_.reps);
    std::fflush(stdout);
    std::vector<std::size_t> racing;
    std::vector<Plan> plans(columns_.size());
    std::vector<std::vector<double>> values(columns_.size());
    for (std::size_t i = 0; i < columns_.size(); ++i) {
      Column& c = columns_[i];
      if (c.failed) continue;
      racing.push_back(i);
      try {
        plans[i] = prepare(c);
      } catch (const std::exception& e) {
        fail(c, workload, e);
      }
    }
    const std::size_t k = racing.size();
    for (int round = 1; round <= opt_.reps; ++round) {
      for (std::size_t j = 0; j < k; ++j) {
        const std::size_t i = racing[(static_cast<std::size_t>(round) + j) % k];
        Column& c = columns_[i];
        if (c.failed) continue;
        try {
          values[i].push_back(repeat(c, plans[i].iterations));
        } catch (const std::exception& e) {
          fail(c, workload, e);
        }
      }
    }
    for (std::size_t i : racing) {
      Column& c = columns_[i];
      if (!c.failed) {
        Sample s = summarise(values[i], plans[i].iterations, unit);
        s.note = plans[i].note;
        put(workload, c, std::move(s));
      }
      try {
        c.runner->release();
      } catch (const std::exception& e) {
        std::printf("  %-18s release failed: %s\n", c.name.c_str(), e.what());
      }
    }
  }

  // The iteration count for a repetition of ~target_ms: grows n fourfold from `start` until
  // one run lasts 20 ms (or n reaches `cap`), then scales; seconds(n) runs n iterations.
  template <class Seconds>
  long calibrate(Seconds seconds, long start, long lo, long cap) const {
    long n = std::min(start, cap);
    double s = seconds(n);
    while (s < 20e-3 && n < cap) {
      n = std::min(n * 4, cap);
      s = seconds(n);
    }
    const double scaled = opt_.target_ms * 1e-3 * static_cast<double>(n) / std::max(s, 1e-9);
    return std::clamp(static_cast<long>(std::min(scaled, 1e15)), std::min(lo, cap), cap);
  }

  // The random workload: the whole sequence, or for cudaMalloc a prefix of ~1 s, estimated
  // from its pair times.
  Plan random_plan(const Column& c, const std::size_t (&sizes)[3]) const {
    Plan plan{static_cast<long>(ops_.size()), ""};
    if (!c.limit_random) return plan;
    double ns_per_op = 0;
    for (std::size_t i = 0; i < std::size(sizes); ++i) {
      const Sample* pair = find(kWorkloads[i], c.name);
      if (pair == nullptr) throw std::runtime_error("no pair times to size the random prefix");
      ns_per_op += pair->median / 2 / std::size(sizes);
    }
    const std::size_t steps =
        std::clamp<std::size_t>(static_cast<std::size_t>(1e9 / ns_per_op), 2000, ops_.size());
    plan.iterations = static_cast<long>(steps);
    if (steps < ops_.size()) {
      plan.note = "the first " + std::to_string(steps) + " of " + std::to_string(ops_.size()) +
                  " steps (the same sequence, shortened: each call costs microseconds)";
    }
    return plan;
  }

  void fail(Column& c, const char* workload, const std::exception& e) {
    std::printf("  %-18s FAILED in %s: %s\n", c.name.c_str(), workload, e.what());
    std::fflush(stdout);
    errors_[c.name] = std::string(workload) + ": " + e.what();
    c.failed = true;
  }

  void put(const std::string& workload, const Column& c, Sample s) {
    if (s.unit == "pairs_per_s") {
      std::printf(
          "  %-18s %9.3f M pairs/s aggregate (%.1f ns/pair; min %.3f, max %.3f; %ld "
          "pairs/thread)\n",
          c.name.c_str(), s.median / 1e6, 1e9 / s.median, s.min / 1e6, s.max / 1e6, s.iterations);
    } else {
      std::printf("  %-18s %10.1f %s  %10.0f /s  (min %.1f, max %.1f; %ld per rep)%s%s\n",
                  c.name.c_str(), s.median, s.unit == "ns_per_op" ? "ns/op  " : "ns/pair",
                  per_second(s), s.min, s.max, s.iterations, s.note.empty() ? "" : "  ",
                  s.note.c_str());
    }
    std::fflush(stdout);
    results_[workload + "|" + c.name] = std::move(s);
  }

  const Sample* find(const std::string& workload, const std::string& column) const {
    const auto it = results_.find(workload + "|" + column);
    return it == results_.end() ? nullptr : &it->second;
  }

  std::vector<Ratio> ratios() const {
    std::vector<Ratio> out;
    const Sample* torch = find("pair_512B", "PyTorch");
    const Sample* cc = find("pair_512B", "ccalloc");
    if (cc != nullptr && torch != nullptr) {
      out.push_back({"pytorch_over_ccalloc_pair_512B",
                     "PyTorch / ccalloc, 512 B pair time, medians (> 1: ccalloc faster)",
                     torch->median / cc->median});
    }
    const Sample* direct = find("pair_512B", "ccalloc (direct)");
    if (direct != nullptr && torch != nullptr) {
      out.push_back({"pytorch_over_ccalloc_direct_pair_512B",
                     "PyTorch / ccalloc (direct), 512 B pair time, medians (> 1: ccalloc faster)",
                     torch->median / direct->median});
    }
    const Sample* pytorch_preset = find("pair_512B", "ccalloc pytorch preset");
    if (pytorch_preset != nullptr && torch != nullptr) {
      out.push_back({"pytorch_over_ccalloc_pytorch_preset_pair_512B",
                     "PyTorch / ccalloc pytorch preset (direct), 512 B pair time, medians (> 1: "
                     "ccalloc faster)",
                     torch->median / pytorch_preset->median});
    }
    // The `ccalloc` preset against the `pytorch` preset, the same engine code otherwise.
    for (const char* w : kWorkloads) {
      const Sample* preset = find(w, "ccalloc (direct)");
      const Sample* pytorch = find(w, "ccalloc pytorch preset");
      if (preset == nullptr || pytorch == nullptr) continue;
      out.push_back({std::string("paired_ccalloc_preset_over_pytorch_preset_") + w,
                     std::string("ccalloc (direct) vs ccalloc pytorch preset, ") + w +
                         ", median of per-round speed ratios (> 1: ccalloc preset faster)",
                     paired_speedup(*preset, *pytorch)});
    }
    // A column's 8 threads / 1 thread (0 where it did not run both).
    const auto scaling = [this](const char* column) {
      const Sample* one = find("threads_1", column);
      const Sample* eight = find("threads_8", column);
      return one != nullptr && eight != nullptr ? eight->median / one->median : 0.0;
    };
    const double ccalloc = scaling("ccalloc"), control = scaling("CPU control");
    if (ccalloc > 0) {
      out.push_back({"ccalloc_threads_8_over_1", "ccalloc 8 threads / 1 thread, aggregate pairs/s",
                     ccalloc});
    }
    if (control > 0) {
      out.push_back({"control_threads_8_over_1",
                     "CPU control 8 threads / 1 thread, aggregate pairs/s (the host's ceiling)",
                     control});
    }
    if (ccalloc > 0 && control > 0) {
      out.push_back(
          {"ccalloc_threads_8_over_1_of_control",
           "ccalloc's 8 threads / 1 thread over the CPU control's (1: scales as the host does)",
           ccalloc / control});
    }
    if (const double torch_scaling = scaling("PyTorch"); torch_scaling > 0) {
      out.push_back({"pytorch_threads_8_over_1", "PyTorch 8 threads / 1 thread, aggregate pairs/s",
                     torch_scaling});
    }
    return out;
  }

  static std::string quote(const std::string& s) {
    std::string out = "\"";
    for (const char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      if (c == '"' || c == '\\') {
        out += '\\';
        out += ch;
      } else if (c < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        out += buf;
      } else {
        out += ch;
      }
    }
    return out + "\"";
  }

  static std::string number(double v) {
    if (!std::isfinite(v)) return "null";
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    return buf;
  }

  static std::string ints(const std::vector<int>& v) {
    std::string out = "[";
    for (std::size_t i = 0; i < v.size(); ++i)
      out += (i == 0 ? "" : ", ") + std::to_string(v[i]);
    return out + "]";
  }

  Options opt_;
  std::vector<cudaStream_t> streams_;
  Pinning pinning_;
  std::vector<Op> ops_;
  std::vector<Column> columns_;
  std::map<std::string, Sample> results_;
  std::map<std::string, std::string> errors_;
};

void usage() {
  std::printf(
      "usage: bench_gpu [--reps N] [--json FILE] [--target-ms MS] [--random-steps N] "
      "[--no-pin] [--pairs-only]\n"
      "  --reps N          interleaved rounds per workload (default 11, at least 5)\n"
      "  --json FILE       also write the results as JSON\n"
      "  --target-ms MS    time per repetition of the pair and thread workloads (default 50)\n"
      "  --random-steps N  length of the random workload (default 200000)\n"
      "  --no-pin          leave the threads' CPU affinity alone\n"
      "  --pairs-only      run the pair workloads alone\n");
}

int run(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--reps") {
      opt.reps = std::max(5, std::stoi(value()));
    } else if (arg == "--json") {
      opt.json = value();
    } else if (arg == "--target-ms") {
      opt.target_ms = std::max(1.0, std::stod(value()));
    } else if (arg == "--random-steps") {
      opt.random_steps = std::max<std::size_t>(1000, std::stoul(value()));
    } else if (arg == "--no-pin") {
      opt.pin = false;
    } else if (arg == "--pairs-only") {
      opt.pairs_only = true;
    } else if (arg == "-h" || arg == "--help") {
      usage();
      return 0;
    } else {
      usage();
      throw std::runtime_error("unknown argument " + arg);
    }
  }

  const ccalloc::cuda::RuntimeInfo info = ccalloc::cuda::probe();
  if (info.device_count == 0) {
    std::fprintf(stderr, "bench_gpu: no CUDA device: %s\n", info.error.c_str());
    return 2;
  }
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "cudaFree(0)");  // the context exists before anything is timed
  const ccalloc::cuda::DeviceInfo& dev = info.devices.front();
  const std::string device = dev.name + ", " + ccalloc::format_size(dev.total_bytes) + ", sm_" +
                             std::to_string(dev.compute_capability_major) +
                             std::to_string(dev.compute_capability_minor) + ", driver " +
                             std::to_string(info.driver_version) + ", runtime " +
                             std::to_string(info.runtime_version);

  std::vector<cudaStream_t> streams(kMaxThreads);
  for (auto& s : streams)
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");

  auto& pa = ccalloc::ProcessAllocator::instance();
  ccalloc::cuda::CudaDriver direct_driver(0);
  ccalloc::Allocator direct(direct_driver, pa.config());
  const ccalloc::Config expandable_config =
      ccalloc::Config::parse("pytorch,expandable_segments:True");
  ccalloc::cuda::CudaDriver expandable_driver(0);
  ccalloc::Allocator expandable(expandable_driver, expandable_config);
  // PyTorch's policy in ccalloc, beside the process's config (the `ccalloc` preset unless
  // CCALLOC_CONF says otherwise): the preset's own cost on the same run.
  const ccalloc::Config pytorch_config = ccalloc::Config::parse("pytorch");
  ccalloc::cuda::CudaDriver pytorch_driver(0);
  ccalloc::Allocator pytorch_preset(pytorch_driver, pytorch_config);
  const ccalloc::Config async_config = ccalloc::Config::parse("backend:cudaMallocAsync");
  ccalloc::cuda::CudaDriver async_driver(0);
  ccalloc::Allocator async_backend(async_driver, async_config);
  std::string torch_version;
#if CCALLOC_BENCH_WITH_TORCH
  bench_torch::init(info.device_count);
  torch_version = CCALLOC_TORCH_VERSION;
#endif
  MallocAsync async;
  check(cudaDeviceGetDefaultMemPool(&async.pool, 0), "cudaDeviceGetDefaultMemPool");
  std::uint64_t threshold = UINT64_MAX;
  check(cudaMemPoolSetAttribute(async.pool, cudaMemPoolAttrReleaseThreshold, &threshold),
        "cudaMemPoolSetAttribute(ReleaseThreshold)");
  {  // warm the pool: it keeps what it grew to (threshold UINT64_MAX)
    std::vector<void*> warm;
    for (std::size_t size : {std::size_t{512}, 1 * kMiB, 64 * kMiB}) {
      for (int i = 0; i < 16; ++i)
        warm.push_back(async.alloc(size, nullptr));
    }
    for (void* p : warm)
      async.free(p, nullptr);
    async.finish(nullptr);
  }
  // After the context, PyTorch and the pool exist: threads they start later inherit the
  // affinity of the thread that starts them.
  const Pinning pinning = plan_pinning(opt.pin);

  std::printf("bench_gpu: %s\nccalloc config: %s\n", device.c_str(),
              pa.config().to_string().c_str());
#if CCALLOC_BENCH_WITH_TORCH
  std::printf("PyTorch %s, allocator %s\n", torch_version.c_str(), bench_torch::name());
#else
  std::printf("PyTorch: not built in (torch was not found when CMake ran)\n");
#endif
  std::printf("cudaMallocAsync: default pool, release threshold UINT64_MAX\n");
  std::printf("ccalloc expandable: %s\nccalloc async: %s (the same default pool)\n",
              expandable_config.to_string().c_str(), async_config.to_string().c_str());
  std::printf(
      "repetitions: %d interleaved rounds per workload, each one repetition of every allocator "
      "(round r starts with allocator r mod k); ~%.0f ms per pair/thread repetition\n",
      opt.reps, opt.target_ms);
  std::printf("CPU pinning: %s\n", pinning.describe().c_str());

  Bench bench(opt, streams, pinning);
  bench.add({"ccalloc", std::make_unique<RunnerOf<CcallocProcess>>(CcallocProcess{pa})});
  bench.add({"ccalloc (direct)", std::make_unique<RunnerOf<CcallocDirect>>(CcallocDirect{direct})});
  bench.add({"ccalloc pytorch preset",
             std::make_unique<RunnerOf<CcallocDirect>>(CcallocDirect{pytorch_preset})});
  bench.add(
      {"ccalloc expandable", std::make_unique<RunnerOf<CcallocDirect>>(CcallocDirect{expandable})});
  bench.add(
      {"ccalloc async", std::make_unique<RunnerOf<CcallocAsync>>(CcallocAsync{async_backend})});
#if CCALLOC_BENCH_WITH_TORCH
  bench.add({"PyTorch", std::make_unique<RunnerOf<Torch>>(Torch{})});
#endif
  bench.add({"cudaMallocAsync", std::make_unique<RunnerOf<MallocAsync>>(async)});
  bench.add({"cudaMalloc", std::make_unique<RunnerOf<Malloc>>(Malloc{}), 2000, 200, 5000, true});
  bench.add({"CPU control", std::make_unique<RunnerOf<CpuControl>>(CpuControl{})});

  const bool ok = bench.run();
  if (!opt.json.empty()) {
    bench.write_json(opt.json, device, pa.config().to_string(), torch_version);
    std::printf("\nresults written to %s\n", opt.json.c_str());
  }
  bench.print_table();
  // The `ccalloc` preset's gate of the frees' clock reads (sync/cycle_gate.hpp): a gate shut
  // during a run makes every free on a side stream read the clock from then on.
  for (const auto& [name, alloc] :
       {std::pair<const char*, ccalloc::Allocator*>{"ccalloc", &pa.allocator(0)},
        std::pair<const char*, ccalloc::Allocator*>{"ccalloc (direct)", &direct}}) {
    if (const auto* stitch = dynamic_cast<const ccalloc::core::StitchBackend*>(
            &ccalloc::core::BackendAccess::of(*alloc))) {
      const auto c = stitch->stitch_engine().piece_counts();
      std::printf("%s: clock gate %s; %zu fences recorded\n", name,
                  c.clock_gate_shut ? "shut" : (c.clock_gate_open ? "open" : "not calibrated"),
                  c.fences);
    }
  }
  for (auto s : streams)
    (void)cudaStreamDestroy(s);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu: %s\n", e.what());
    return 1;
  }
}
