// The GPU benchmark: ccalloc against cudaMalloc/cudaFree, cudaMallocAsync on the device's
// default pool, and PyTorch's CUDA caching allocator (when built with torch), in one
// process on device 0.
//
//   bench_gpu [--reps N] [--json FILE] [--target-ms MS] [--random-steps N]
//
// Workloads, each the median of N >= 5 repetitions after warm-up:
//   pair      malloc+free of one size (512 B, 1 MiB, 64 MiB), one thread, default stream;
//   random    log-uniform sizes 512 B - 64 MiB, up to 256 live, the same seeded sequence
//             for every allocator (cudaMalloc runs a shorter prefix of it);
//   threads   1, 4 and 8 threads, each on its own stream, 512 B cache-hit pairs; aggregate
//             pairs per second from a common start (barrier) to the last thread's end.
// The CUDA context, each allocator's first segments and the pool are warmed before timing.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ccalloc/allocator.hpp"
#include "ccalloc/cuda.hpp"
#include "ccalloc/process.hpp"
#include "ccalloc/stats.hpp"
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

// One step of the random workload: allocate `value` bytes, or free live[value].
struct Op {
  std::uint64_t value;
  bool is_alloc;
};

constexpr std::size_t kRandomMaxLive = 256;

std::vector<Op> make_random_ops(std::size_t steps, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(std::log(512.0),
                                                  std::log(static_cast<double>(64 * kMiB)));
  std::bernoulli_distribution coin(0.5);
  std::vector<Op> ops;
  ops.reserve(steps);
  std::size_t live = 0;
  for (std::size_t i = 0; i < steps; ++i) {
    if (live < kRandomMaxLive && (live == 0 || coin(rng))) {
      const auto size = static_cast<std::uint64_t>(std::exp(log_size(rng)));
      ops.push_back({std::clamp<std::uint64_t>(size, 512, 64 * kMiB), true});
      ++live;
    } else {
      std::uniform_int_distribution<std::uint64_t> pick(0, live - 1);
      ops.push_back({pick(rng), false});
      --live;
    }
  }
  return ops;
}

// The workloads over any allocator; virtual only per repetition, never per operation.
class Runner {
 public:
  virtual ~Runner() = default;
  // ns per malloc+free pair of `size` bytes on the default stream.
  virtual double pairs(std::size_t size, long iterations) = 0;
  // ns per operation over ops[0, n).
  virtual double random(const std::vector<Op>& ops, std::size_t n) = 0;
  // Aggregate pairs per second of `count` threads, thread i on streams[i].
  virtual double threads(int count, long iterations, const std::vector<cudaStream_t>& streams) = 0;
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
    for (std::size_t i = 0; i < n; ++i) {
      const Op op = ops[i];
      if (op.is_alloc) {
        live.push_back(a_.alloc(op.value, s));
      } else {
        void* p = live[op.value];
        live[op.value] = live.back();
        live.pop_back();
        a_.free(p, s);
      }
    }
    a_.finish(s);
    const double ns = ns_since(t0);
    for (void* p : live)
      a_.free(p, s);
    a_.finish(s);
    return ns / static_cast<double>(n);
  }

  double threads(int count, long iterations, const std::vector<cudaStream_t>& streams) override {
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
  std::vector<double> values;
  long iterations = 0;  // per repetition (per thread for the thread workloads)
  std::string unit;     // "ns_per_pair", "ns_per_op" or "pairs_per_s"
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
  int reps = 5;
  double target_ms = 100;  // per timed repetition of the single-thread workloads
  std::size_t random_steps = 200'000;
  std::string json;
};

struct Column {
  std::string name;
  std::unique_ptr<Runner> runner;
  long max_pair_iterations = 2'000'000;
  long max_large_pair_iterations = 200'000;  // 64 MiB pairs
  long max_thread_iterations = 500'000;
  bool limit_random = false;  // run a ~1 s prefix of the random sequence (cudaMalloc)
};

struct Ratio {
  const char* key;
  const char* label;
  double value;
};

constexpr const char* kWorkloads[] = {"pair_512B", "pair_1MiB", "pair_64MiB", "random",
                                      "threads_1", "threads_4", "threads_8"};

class Bench {
 public:
  Bench(Options options, std::vector<cudaStream_t> streams)
      : opt_(std::move(options)),
        streams_(std::move(streams)),
        ops_(make_random_ops(opt_.random_steps, 0xCCA110C)) {}

  void add(Column column) { columns_.push_back(std::move(column)); }

  // Runs every workload for every column, column by column; returns false if any failed.
  bool run() {
    bool ok = true;
    for (auto& c : columns_) {
      std::printf("\n== %s\n", c.name.c_str());
      std::fflush(stdout);
      try {
        run_column(c);
      } catch (const std::exception& e) {
        std::printf("  FAILED: %s\n", e.what());
        errors_[c.name] = e.what();
        ok = false;
      }
      try {
        c.runner->release();
      } catch (const std::exception& e) {
        std::printf("  release failed: %s\n", e.what());
      }
    }
    return ok;
  }

  void print_table() const {
    std::printf("\n== bench_gpu summary (median of %d repetitions; device 0)\n", opt_.reps);
    std::printf("%-22s", "workload");
    for (const auto& c : columns_)
      std::printf(" %17s", c.name.c_str());
    std::printf("\n");
    static const char* const labels[] = {"pair 512 B   ns/pair",  "pair 1 MiB   ns/pair",
                                         "pair 64 MiB  ns/pair",  "random       ns/op",
                                         "1 thread     Mpairs/s", "4 threads    Mpairs/s",
                                         "8 threads    Mpairs/s"};
    for (std::size_t w = 0; w < std::size(kWorkloads); ++w) {
      std::printf("%-22s", labels[w]);
      for (const auto& c : columns_) {
        const Sample* s = find(kWorkloads[w], c.name);
        char cell[64];
        if (s == nullptr) {
          std::snprintf(cell, sizeof cell, "n/a");
        } else if (s->unit == "pairs_per_s") {
          std::snprintf(cell, sizeof cell, "%.2f", s->median / 1e6);
        } else {
          std::snprintf(cell, sizeof cell, s->median < 100 ? "%.1f%s" : "%.0f%s", s->median,
                        s->note.empty() ? "" : "*");
        }
        std::printf(" %17s", cell);
      }
      std::printf("\n");
    }
    for (const auto& c : columns_) {
      if (const Sample* s = find("random", c.name); s != nullptr && !s->note.empty()) {
        std::printf("* %s: %s\n", c.name.c_str(), s->note.c_str());
      }
    }
    for (const auto& [name, error] : errors_) {
      std::printf("! %s failed: %s\n", name.c_str(), error.c_str());
    }
    for (const Ratio& r : ratios())
      std::printf("%s: %.2f\n", r.label, r.value);
  }

  void write_json(const std::string& path, const std::string& device, const std::string& config,
                  const std::string& torch_version) const {
    std::ofstream out(path);
    if (!out) throw std::runtime_error("cannot write " + path);
    out << "{\n  \"device\": " << quote(device) << ",\n  \"ccalloc_config\": " << quote(config)
        << ",\n  \"torch_version\": " << (torch_version.empty() ? "null" : quote(torch_version))
        << ",\n  \"repetitions\": " << opt_.reps << ",\n  \"random_steps\": " << opt_.random_steps
        << ",\n  \"results\": [";
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
  void run_column(Column& c) {
    Runner& r = *c.runner;
    // Pairs: calibrate the iteration count to ~target_ms per repetition.
    const std::size_t sizes[] = {512, 1 * kMiB, 64 * kMiB};
    for (std::size_t i = 0; i < std::size(sizes); ++i) {
      const std::size_t size = sizes[i];
      const long max_iterations =
          size >= 64 * kMiB ? c.max_large_pair_iterations : c.max_pair_iterations;
      r.pairs(size, 16);  // warm: the first segment of this size
      long n = 16;
      double ns = r.pairs(size, n);
      while (ns * static_cast<double>(n) < 20e6 && n < max_iterations) {
        n = std::min(n * 4, max_iterations);
        ns = r.pairs(size, n);
      }
      const long iterations =
          std::clamp(static_cast<long>(opt_.target_ms * 1e6 / ns), 16L, max_iterations);
      std::vector<double> values;
      for (int rep = 0; rep < opt_.reps; ++rep)
        values.push_back(r.pairs(size, iterations));
      put(kWorkloads[i], c.name, summarise(values, iterations, "ns_per_pair"));
    }

    // Random: the whole sequence, or for cudaMalloc a prefix of ~1 s.
    std::size_t steps = ops_.size();
    std::string note;
    if (c.limit_random) {
      double ns_per_op = 0;
      for (std::size_t i = 0; i < std::size(sizes); ++i) {
        ns_per_op += find(kWorkloads[i], c.name)->median / 2 / std::size(sizes);
      }
      steps = std::clamp<std::size_t>(static_cast<std::size_t>(1e9 / ns_per_op), 2000, ops_.size());
      if (steps < ops_.size()) {
        note = "the first " + std::to_string(steps) + " of " + std::to_string(ops_.size()) +
               " steps (the same sequence, shortened: each call costs microseconds)";
      }
    }
    r.random(ops_, steps);  // warm: the cache holds this workload's segments from here on
    std::vector<double> values;
    for (int rep = 0; rep < opt_.reps; ++rep)
      values.push_back(r.random(ops_, steps));
    Sample random = summarise(values, static_cast<long>(steps), "ns_per_op");
    random.note = note;
    put("random", c.name, random);

    // Threads: a fixed number of pairs per thread, from the one-thread 512 B pair time.
    const double pair_ns = find("pair_512B", c.name)->median;
    const long iterations =
        std::clamp(static_cast<long>(30e6 / pair_ns), 200L, c.max_thread_iterations);
    const int counts[] = {1, 4, 8};
    for (std::size_t i = 0; i < std::size(counts); ++i) {
      const int threads = counts[i];
      r.threads(threads, std::max(iterations / 10, 100L), streams_);  // warm
      std::vector<double> rates;
      for (int rep = 0; rep < opt_.reps; ++rep) {
        rates.push_back(r.threads(threads, iterations, streams_));
      }
      put(kWorkloads[4 + i], c.name, summarise(rates, iterations, "pairs_per_s"));
    }
  }

  void put(const std::string& workload, const std::string& column, Sample s) {
    if (s.unit == "pairs_per_s") {
      std::printf("  %-11s %10.3f M pairs/s aggregate (%.1f ns/pair; %ld pairs/thread)\n",
                  workload.c_str(), s.median / 1e6, 1e9 / s.median, s.iterations);
    } else {
      std::printf("  %-11s %10.1f %s  %12.0f /s  (min %.1f, max %.1f; %ld per rep)%s%s\n",
                  workload.c_str(), s.median, s.unit == "ns_per_op" ? "ns/op  " : "ns/pair",
                  per_second(s), s.min, s.max, s.iterations, s.note.empty() ? "" : "  ",
                  s.note.c_str());
    }
    std::fflush(stdout);
    results_[workload + "|" + column] = std::move(s);
  }

  const Sample* find(const std::string& workload, const std::string& column) const {
    const auto it = results_.find(workload + "|" + column);
    return it == results_.end() ? nullptr : &it->second;
  }

  std::vector<Ratio> ratios() const {
    std::vector<Ratio> out;
    const Sample* cc = find("pair_512B", "ccalloc");
    const Sample* torch = find("pair_512B", "PyTorch");
    if (cc != nullptr && torch != nullptr) {
      out.push_back({"pytorch_over_ccalloc_pair_512B",
                     "PyTorch / ccalloc, 512 B pair time (> 1: ccalloc faster)",
                     torch->median / cc->median});
    }
    const Sample* one = find("threads_1", "ccalloc");
    const Sample* eight = find("threads_8", "ccalloc");
    if (one != nullptr && eight != nullptr) {
      out.push_back({"ccalloc_threads_8_over_1", "ccalloc 8 threads / 1 thread, aggregate pairs/s",
                     eight->median / one->median});
    }
    const Sample* torch_one = find("threads_1", "PyTorch");
    const Sample* torch_eight = find("threads_8", "PyTorch");
    if (torch_one != nullptr && torch_eight != nullptr) {
      out.push_back({"pytorch_threads_8_over_1", "PyTorch 8 threads / 1 thread, aggregate pairs/s",
                     torch_eight->median / torch_one->median});
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

  Options opt_;
  std::vector<cudaStream_t> streams_;
  std::vector<Op> ops_;
  std::vector<Column> columns_;
  std::map<std::string, Sample> results_;
  std::map<std::string, std::string> errors_;
};

void usage() {
  std::printf(
      "usage: bench_gpu [--reps N] [--json FILE] [--target-ms MS] [--random-steps N]\n"
      "  --reps N          timed repetitions per workload (default 5, at least 5)\n"
      "  --json FILE       also write the results as JSON\n"
      "  --target-ms MS    time per repetition of the pair workloads (default 100)\n"
      "  --random-steps N  length of the random workload (default 200000)\n");
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

  std::vector<cudaStream_t> streams(8);
  for (auto& s : streams)
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");

  auto& pa = ccalloc::ProcessAllocator::instance();
  ccalloc::cuda::CudaDriver direct_driver(0);
  ccalloc::Allocator direct(direct_driver, pa.config());
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

  std::printf("bench_gpu: %s\nccalloc config: %s\n", device.c_str(),
              pa.config().to_string().c_str());
#if CCALLOC_BENCH_WITH_TORCH
  std::printf("PyTorch %s, allocator %s\n", torch_version.c_str(), bench_torch::name());
#else
  std::printf("PyTorch: not built in (torch was not found when CMake ran)\n");
#endif
  std::printf("cudaMallocAsync: default pool, release threshold UINT64_MAX\n");

  Bench bench(opt, streams);
  bench.add({"ccalloc", std::make_unique<RunnerOf<CcallocProcess>>(CcallocProcess{pa})});
  bench.add({"ccalloc (direct)", std::make_unique<RunnerOf<CcallocDirect>>(CcallocDirect{direct})});
#if CCALLOC_BENCH_WITH_TORCH
  bench.add({"PyTorch", std::make_unique<RunnerOf<Torch>>(Torch{})});
#endif
  bench.add({"cudaMallocAsync", std::make_unique<RunnerOf<MallocAsync>>(async)});
  bench.add({"cudaMalloc", std::make_unique<RunnerOf<Malloc>>(Malloc{}), 2000, 200, 5000, true});

  const bool ok = bench.run();
  if (!opt.json.empty()) {
    bench.write_json(opt.json, device, pa.config().to_string(), torch_version);
    std::printf("\nresults written to %s\n", opt.json.c_str());
  }
  bench.print_table();
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
