#!/usr/bin/env python3
"""Where a workload's allocator time goes, on PyTorch's allocator and on ccalloc: each
allocator runs the workload in a fresh process under torch.profiler (CPU), and, where `perf`
is installed, under `perf record` too.

    python3 bench/torch/profile_alloc.py [--workload finetune_bf16] [--steps 10]
        [--modes torch,cuda,python] [--json out.json]

torch.profiler gives, per allocating operator (aten::empty, aten::empty_strided, ...), its
call count and its mean self CPU time: the allocator's malloc runs inside that self time, so
the difference between the allocators is what ccalloc costs more or less per
allocation. ccalloc runs twice: installed natively (libccalloc_torch.so) and through torch's
CUDAPluggableAllocator (the fallback route), whose own bookkeeping the comparison shows. perf gives the share of all CPU samples spent in each allocator's own library
(libccalloc_torch.so or libc10_cuda.so) and its hottest functions.

Two more modes look past the allocating operators, for a workload whose step time differs
between the allocators: `cuda` (GPU time and CPU self time per operator per step, the largest
differences first) and `python` (cProfile: own time and calls per Python function per step)."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BINDINGS = os.path.join(HERE, "..", "..", "bindings", "torch")
ALLOCATORS = ("pytorch", "ccalloc", "ccalloc-pluggable")
ALLOC_OPS = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty_strided",
             "aten::zeros", "aten::zeros_like", "aten::ones_like", "aten::full")

WORKER = r"""
import json, sys
sys.path.insert(0, sys.argv[3]); sys.path.insert(0, sys.argv[4])
allocator, workload, steps, profile = sys.argv[1], sys.argv[2], int(sys.argv[5]), sys.argv[6]
if allocator == "ccalloc":
    import ccalloc_torch
    assert ccalloc_torch.install() == "native"
elif allocator == "ccalloc-pluggable":
    import ccalloc_torch
    assert ccalloc_torch.install(native=False) in ("hooks", "pluggable")
import torch, workloads
torch.manual_seed(0)
fn = workloads.WORKLOADS[workload]
# Each profiler starts after the workload's own warm-up steps (compilation, graph recording,
# first-call costs) through workloads.on_timed_start, and stops after the timed steps.
if profile == "torch":
    from torch.profiler import profile as prof, ProfilerActivity
    p = prof(activities=[ProfilerActivity.CPU])
    workloads.on_timed_start = p.start
    times, _ = fn(steps=steps)
    p.stop()
    ops = {}
    for e in p.key_averages():
        if e.key in json.loads(sys.argv[7]):
            ops[e.key] = {"count": e.count, "self_cpu_us": e.self_cpu_time_total / e.count}
    print("PROFILE " + json.dumps({"ops": ops, "step_s": sorted(times)[len(times) // 2]}), flush=True)
elif profile == "cuda":
    # GPU time per step (kernels and copies), and CPU self time per operator per step.
    from torch.profiler import profile as prof, ProfilerActivity
    p = prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    workloads.on_timed_start = p.start
    times, _ = fn(steps=steps)
    p.stop()
    gpu, cpu = {}, {}
    for e in p.key_averages():
        if e.self_device_time_total > 0:
            gpu[e.key] = e.self_device_time_total / steps
        if e.self_cpu_time_total > 0:
            cpu[e.key] = e.self_cpu_time_total / steps
    print("PROFILE " + json.dumps({"gpu_us_per_step": gpu, "cpu_us_per_step": cpu,
                                   "step_s": sorted(times)[len(times) // 2]}), flush=True)
elif profile == "python":
    # Python-level time per function per step (cProfile): what the framework's Python code
    # (CUDA-graph trees, dynamo guards) and the C calls it makes cost on each allocator.
    import cProfile, pstats
    pr = cProfile.Profile()
    workloads.on_timed_start = pr.enable
    times, _ = fn(steps=steps)
    pr.disable()
    funcs = {}
    for (file, line, name), (cc, nc, tt, ct, callers) in pstats.Stats(pr).stats.items():
        funcs[f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({name})"] = {
            "calls": nc / steps, "tottime_us": tt * 1e6 / steps}
    print("PROFILE " + json.dumps({"functions": funcs, "step_s": sorted(times)[len(times) // 2]}),
          flush=True)
else:
    times, _ = fn(steps=steps)
    print("PROFILE " + json.dumps({"step_s": sorted(times)[len(times) // 2]}), flush=True)
"""


def worker(allocator, workload, steps, profile, prefix=()):
    env = dict(os.environ)
    env.setdefault("CCALLOC_CONF", "pytorch")
    cmd = [*prefix, sys.executable, "-c", WORKER, allocator, workload, BINDINGS, HERE, str(steps),
           profile, json.dumps(ALLOC_OPS)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("PROFILE "):
            return json.loads(line[len("PROFILE "):])
    sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
    raise RuntimeError(f"{allocator} worker failed ({proc.returncode})")


def perf_report(allocator, workload, steps):
    """Share of CPU samples per shared object, and the allocator library's top symbols."""
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        worker(allocator, workload, steps, "none", ("perf", "record", "-q", "-F", "2999", "-o", data, "--"))
        out = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym",
                              "--stdio", "--percent-limit", "0.3"], capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].endswith("%"):
            rows.append({"percent": float(parts[0][:-1]), "dso": parts[1], "symbol": " ".join(parts[3:])})
    by_dso = {}
    for r in rows:
        by_dso[r["dso"]] = by_dso.get(r["dso"], 0.0) + r["percent"]
    mine = {"ccalloc": "libccalloc_torch.so", "ccalloc-pluggable": "libccalloc.so"}.get(allocator, "libc10_cuda.so")
    return {"dso_percent": by_dso, "allocator_library": mine,
            "allocator_percent": by_dso.get(mine, 0.0),
            "top": [r for r in rows if r["dso"] == mine][:12]}


def top_differences(per_allocator, n=15):
    """The n keys whose per-step value differs most between PyTorch's allocator and ccalloc,
    as (key, pytorch value, ccalloc value)."""
    pt, cc = per_allocator["pytorch"], per_allocator["ccalloc"]
    keys = set(pt) | set(cc)
    rows = [(k, pt.get(k, 0.0), cc.get(k, 0.0)) for k in keys]
    rows.sort(key=lambda r: abs(r[2] - r[1]), reverse=True)
    return rows[:n]


def print_differences(title, rows, unit):
    print(title)
    print(f"  {'PyTorch':>10s} {'ccalloc':>10s} {'diff':>9s}  ({unit} per step)")
    for key, a, b in rows:
        print(f"  {a:10.1f} {b:10.1f} {b - a:+9.1f}  {key[:110]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="finetune_bf16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--modes", default="torch",
                        help="comma-separated: torch (allocating operators' CPU time, three routes), "
                             "cuda (GPU and CPU time per operator per step), python (cProfile)")
    parser.add_argument("--json")
    args = parser.parse_args()
    modes = args.modes.split(",")
    result = {}
    if "torch" in modes:
        for allocator in ALLOCATORS:
            result[allocator] = {"torch_profiler": worker(allocator, args.workload, args.steps, "torch")}
            if shutil.which("perf"):
                try:
                    result[allocator]["perf"] = perf_report(allocator, args.workload, args.steps)
                except RuntimeError as e:
                    result[allocator]["perf_error"] = str(e)
        print(f"== {args.workload}: allocating operators, mean self CPU time per call (torch.profiler)")
        print(f"{'operator':26s} {'calls':>8s} {'PyTorch us':>11s} {'ccalloc us':>11s} {'pluggable us':>13s}")
        pt, cc, pl = (result[a]["torch_profiler"]["ops"] for a in ALLOCATORS)
        for op in ALLOC_OPS:
            if op in pt and op in cc and op in pl:
                print(f"{op:26s} {cc[op]['count']:8d} {pt[op]['self_cpu_us']:11.2f} {cc[op]['self_cpu_us']:11.2f} "
                      f"{pl[op]['self_cpu_us']:13.2f}")
        print("median step: " + ", ".join(f"{a} {result[a]['torch_profiler']['step_s'] * 1e3:.1f} ms"
                                          for a in ALLOCATORS))
        for allocator in ALLOCATORS:
            p = result[allocator].get("perf")
            if p:
                print(f"perf, {allocator}: {p['allocator_percent']:.2f}% of CPU samples in {p['allocator_library']}")
                for r in p["top"][:6]:
                    print(f"    {r['percent']:5.2f}%  {r['symbol'][:100]}")
            elif "perf_error" in result[allocator]:
                print(f"perf, {allocator}: {result[allocator]['perf_error']}")
        if not shutil.which("perf"):
            print("perf: not installed on this machine (torch.profiler figures only)")
    if "cuda" in modes:
        runs = {a: worker(a, args.workload, args.steps, "cuda") for a in ("pytorch", "ccalloc")}
        result["cuda"] = runs
        print(f"== {args.workload}: GPU and CPU time per step (torch.profiler, CPU+CUDA)")
        for a, r in runs.items():
            print(f"  {a:8s}: median step {r['step_s'] * 1e3:.2f} ms, GPU busy "
                  f"{sum(r['gpu_us_per_step'].values()):.1f} us/step, CPU self "
                  f"{sum(r['cpu_us_per_step'].values()):.1f} us/step")
        print_differences("GPU time, largest differences:",
                          top_differences({a: r["gpu_us_per_step"] for a, r in runs.items()}), "us")
        print_differences("CPU self time, largest differences:",
                          top_differences({a: r["cpu_us_per_step"] for a, r in runs.items()}), "us")
    if "python" in modes:
        runs = {a: worker(a, args.workload, args.steps, "python") for a in ("pytorch", "ccalloc")}
        result["python"] = runs
        print(f"== {args.workload}: Python functions, own time per step (cProfile)")
        for a, r in runs.items():
            print(f"  {a:8s}: median step {r['step_s'] * 1e3:.2f} ms (under cProfile)")
        print_differences("own time, largest differences:",
                          top_differences({a: {k: v["tottime_us"] for k, v in r["functions"].items()}
                                           for a, r in runs.items()}, 25), "us")
        calls = top_differences({a: {k: v["calls"] for k, v in r["functions"].items()}
                                 for a, r in runs.items()}, 10)
        print_differences("calls per step, largest differences:", calls, "calls")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
