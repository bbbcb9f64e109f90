// What CUDA's virtual-memory calls cost on this GPU: the figures behind the simulated GPU's cost
// model (docs/simulated-gpu.md) and the ccalloc policy's choice of when to map, stitch or create.
//
// For each call it times many single calls with a host clock and prints the median, the 10th and
// 90th percentiles in microseconds, one line per measurement, then the same as JSON with --json
// FILE. Each physical allocation is touched by nothing but the calls measured: these are the
// driver's costs, not the first-touch cost of the memory. Sizes: 2 MiB (the granularity on
// H100/H200) and 20 MiB (the large segment PyTorch's expandable segments map per step).
//
//   bench_vmm_cost [--device N] [--reps N] [--json FILE]
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  cuGetErrorName(r, &name);
  std::fprintf(stderr, "bench_vmm_cost: %s failed: %s\n", what, name ? name : "?");
  std::exit(1);
}

struct Result {
  std::string name;
  double p10 = 0, median = 0, p90 = 0;
  int reps = 0;
};

using Clock = std::chrono::steady_clock;

// Times `reps` calls of `timed`, each preceded by `setup` and followed by `teardown` (untimed).
Result measure(const std::string& name, int reps, const std::function<void(int)>& setup,
               const std::function<void(int)>& timed, const std::function<void(int)>& teardown) {
  std::vector<double> us;
  us.reserve(reps);
  for (int i = 0; i < reps; ++i) {
    setup(i);
    const auto t0 = Clock::now();
    timed(i);
    const auto t1 = Clock::now();
    teardown(i);
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(us.begin(), us.end());
  Result r;
  r.name = name;
  r.reps = reps;
  r.p10 = us[us.size() / 10];
  r.median = us[us.size() / 2];
  r.p90 = us[us.size() * 9 / 10];
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int device = 0, reps = 200;
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--device") && i + 1 < argc) device = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_vmm_cost [--device N] [--reps N] [--json FILE]\n");
      return 2;
    }
  }
  if (reps < 10) reps = 10;
  // The runtime creates the primary context the driver calls below use.
  if (cudaSetDevice(device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
    std::fprintf(stderr, "bench_vmm_cost: no usable CUDA device %d\n", device);
    return 1;
  }
  check(cuInit(0), "cuInit");

  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  std::size_t granularity = 0;
  check(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

  const std::size_t small = granularity;       // one page
  const std::size_t large = 10 * granularity;  // 20 MiB on H100/H200
  const std::size_t span = 64 * large;         // address space for the mapping tests
  CUdeviceptr va = 0;
  check(cuMemAddressReserve(&va, span, 0, 0, 0), "cuMemAddressReserve");
  std::vector<CUmemGenericAllocationHandle> handles(reps);
  std::vector<Result> results;

  auto create = [&](std::size_t bytes) {
    return [&, bytes](int i) { check(cuMemCreate(&handles[i], bytes, &prop, 0), "cuMemCreate"); };
  };
  auto release = [&](int i) { check(cuMemRelease(handles[i]), "cuMemRelease"); };
  auto nothing = [](int) {};

  for (std::size_t bytes : {small, large}) {
    const std::string mib = std::to_string(bytes >> 20) + " MiB";
    results.push_back(measure("cuMemCreate " + mib, reps, nothing, create(bytes), release));
    results.push_back(measure("cuMemRelease " + mib, reps, create(bytes), release, nothing));
    results.push_back(measure(
        "cuMemMap " + mib, reps, create(bytes),
        [&, bytes](int i) { check(cuMemMap(va, bytes, 0, handles[i], 0), "cuMemMap"); },
        [&, bytes](int i) {
          check(cuMemUnmap(va, bytes), "cuMemUnmap");
          release(i);
        }));
    results.push_back(measure(
        "cuMemSetAccess " + mib, reps,
        [&, bytes](int i) {
          create(bytes)(i);
          check(cuMemMap(va, bytes, 0, handles[i], 0), "cuMemMap");
        },
        [&, bytes](int) { check(cuMemSetAccess(va, bytes, &access, 1), "cuMemSetAccess"); },
        [&, bytes](int i) {
          check(cuMemUnmap(va, bytes), "cuMemUnmap");
          release(i);
        }));
    results.push_back(measure(
        "cuMemUnmap " + mib, reps,
        [&, bytes](int i) {
          create(bytes)(i);
          check(cuMemMap(va, bytes, 0, handles[i], 0), "cuMemMap");
          check(cuMemSetAccess(va, bytes, &access, 1), "cuMemSetAccess");
        },
        [&, bytes](int) { check(cuMemUnmap(va, bytes), "cuMemUnmap"); }, release));
  }

  // Stitching: a 2 MiB handle that stays mapped at one address mapped again at a second one,
  // then made accessible there. (cuMemMap takes no offset into a handle: CUDA answers
  // CUDA_ERROR_NOT_SUPPORTED for a non-zero one, so a piece that can be stitched is a handle.)
  CUmemGenericAllocationHandle page = 0;
  check(cuMemCreate(&page, small, &prop, 0), "cuMemCreate");
  check(cuMemMap(va, small, 0, page, 0), "cuMemMap");
  check(cuMemSetAccess(va, small, &access, 1), "cuMemSetAccess");
  const CUdeviceptr second = va + 2 * large;
  results.push_back(measure(
      "cuMemMap 2 MiB, second mapping", reps, nothing,
      [&](int) { check(cuMemMap(second, small, 0, page, 0), "cuMemMap (second)"); },
      [&](int) { check(cuMemUnmap(second, small), "cuMemUnmap"); }));
  results.push_back(measure(
      "cuMemMap+SetAccess 2 MiB, second mapping", reps, nothing,
      [&](int) {
        check(cuMemMap(second, small, 0, page, 0), "cuMemMap (second)");
        check(cuMemSetAccess(second, small, &access, 1), "cuMemSetAccess");
      },
      [&](int) { check(cuMemUnmap(second, small), "cuMemUnmap"); }));
  // Ten 2 MiB handles mapped side by side, made accessible with one call over the 20 MiB.
  std::vector<CUmemGenericAllocationHandle> ten(10);
  for (auto& h : ten) check(cuMemCreate(&h, small, &prop, 0), "cuMemCreate");
  results.push_back(measure(
      "10 x cuMemMap 2 MiB + one SetAccess 20 MiB", reps, nothing,
      [&](int) {
        for (std::size_t k = 0; k < ten.size(); ++k)
          check(cuMemMap(second + k * small, small, 0, ten[k], 0), "cuMemMap");
        check(cuMemSetAccess(second, large, &access, 1), "cuMemSetAccess");
      },
      [&](int) { check(cuMemUnmap(second, large), "cuMemUnmap"); }));
  for (auto h : ten) check(cuMemRelease(h), "cuMemRelease");
  check(cuMemUnmap(va, small), "cuMemUnmap");
  check(cuMemRelease(page), "cuMemRelease");

  results.push_back(measure(
      "cuMemAddressReserve 1 TiB", std::min(reps, 50), nothing,
      [&](int i) {
        CUdeviceptr p = 0;
        check(cuMemAddressReserve(&p, std::size_t{1} << 40, 0, 0, 0), "cuMemAddressReserve");
        handles[i] = static_cast<CUmemGenericAllocationHandle>(p);
      },
      [&](int i) {
        check(cuMemAddressFree(static_cast<CUdeviceptr>(handles[i]), std::size_t{1} << 40),
              "cuMemAddressFree");
      }));
  check(cuMemAddressFree(va, span), "cuMemAddressFree");

  std::vector<void*> ptrs(reps);
  for (std::size_t bytes : {small, large}) {
    const std::string mib = std::to_string(bytes >> 20) + " MiB";
    results.push_back(measure(
        "cudaMalloc " + mib, reps, nothing,
        [&, bytes](int i) {
          if (cudaMalloc(&ptrs[i], bytes) != cudaSuccess) std::exit(1);
        },
        [&](int i) { cudaFree(ptrs[i]); }));
    results.push_back(measure(
        "cudaFree " + mib, reps,
        [&, bytes](int i) {
          if (cudaMalloc(&ptrs[i], bytes) != cudaSuccess) std::exit(1);
        },
        [&](int i) { cudaFree(ptrs[i]); }, nothing));
  }

  std::printf("== bench_vmm_cost: device %d, granularity %zu bytes, median of %d calls (us)\n",
              device, granularity, reps);
  std::printf("%-44s %10s %10s %10s\n", "call", "p10", "median", "p90");
  for (const Result& r : results)
    std::printf("%-44s %10.2f %10.2f %10.2f\n", r.name.c_str(), r.p10, r.median, r.p90);
  if (json) {
    FILE* f = std::fopen(json, "w");
    if (!f) {
      std::fprintf(stderr, "bench_vmm_cost: cannot write %s\n", json);
      return 1;
    }
    std::fprintf(f, "{\"device\": %d, \"granularity\": %zu, \"calls\": [\n", device, granularity);
    for (std::size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(f, "  {\"call\": \"%s\", \"reps\": %d, \"p10_us\": %.3f, \"median_us\": %.3f, "
                      "\"p90_us\": %.3f}%s\n",
                   r.name.c_str(), r.reps, r.p10, r.median, r.p90,
                   i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
