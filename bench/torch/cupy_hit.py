"""CuPy's cache hit on ccalloc against CuPy's own memory pool, in one process: the time of
one `cupy.cuda.alloc(size)` and the drop of its pointer (a malloc that finds a cached block
and the free that returns it), through CuPy's allocator interface as array creation calls
it. Interleaved rounds, the allocators taking turns; the median of the rounds' ns per pair.

    python3 bench/torch/cupy_hit.py [--sizes 512,1048576] [--pairs 200000] [--rounds 11]
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bindings", "torch"))


def pairs_ns(alloc, size, pairs):
    start = time.perf_counter_ns()
    for _ in range(pairs):
        alloc(size)  # the pointer is dropped at once: the free
    return (time.perf_counter_ns() - start) / pairs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="512,1048576")
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--json")
    args = ap.parse_args()
    import cupy
    import ccalloc_torch.cupy as cc
    pool = cupy.get_default_memory_pool()
    cc.install()
    ccalloc_alloc = cupy.cuda.get_allocator()
    source = cc._c_module.stream_source() if cc.route() == "c" else "cupy.cuda.get_current_stream"
    print("ccalloc's route: %s (CuPy's stream from %s); CuPy %s" % (cc.route(), source,
                                                                  cupy.__version__))
    routes = {"cupy pool": pool.malloc, "ccalloc": ccalloc_alloc}
    if cc.route() == "c":  # the Python route too, for comparison
        routes["ccalloc py"] = cupy.cuda.memory.PythonFunctionAllocator(
            cc._malloc, cc._bind()[1]).malloc
    results = {}
    for size in (int(s) for s in args.sizes.split(",")):
        for alloc in routes.values():  # warm: the block is cached on both
            pairs_ns(alloc, size, 1000)
        rounds = {name: [] for name in routes}
        for r in range(args.rounds):
            order = list(routes.items()) if r % 2 == 0 else list(reversed(routes.items()))
            for name, alloc in order:
                rounds[name].append(pairs_ns(alloc, size, args.pairs))
        results[size] = {name: {"median_ns": statistics.median(v), "min_ns": min(v),
                                "max_ns": max(v)} for name, v in rounds.items()}
    print("%10s %-10s %10s %10s %10s" % ("bytes", "route", "median ns", "min", "max"))
    for size, by_route in results.items():
        for name, r in by_route.items():
            print("%10d %-10s %10.0f %10.0f %10.0f" % (size, name, r["median_ns"], r["min_ns"],
                                                       r["max_ns"]))
        for name in by_route:
            if name != "cupy pool":
                print("%10d %s / cupy pool: %.2f" % (
                    size, name, by_route[name]["median_ns"] / by_route["cupy pool"]["median_ns"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pairs": args.pairs, "rounds": args.rounds, "route": cc.route(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
