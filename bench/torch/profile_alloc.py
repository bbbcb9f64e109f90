#!/usr/bin/env python3
"""Where a workload's allocator time goes, on PyTorch's allocator and on ccalloc: each
allocator runs the workload in a fresh process under torch.profiler (CPU), and, where `perf`
is installed, under `perf record` too.

    python3 bench/torch/profile_alloc.py [--workload finetune_bf16] [--steps 10] [--json out.json]

torch.profiler gives, per allocating operator (aten::empty, aten::empty_strided, ...), its
call count and its mean self CPU time: the allocator's malloc runs inside that self time, so
the difference between the allocators is what ccalloc costs more or less per
allocation. ccalloc runs twice: installed natively (libccalloc_torch.so) and through torch's
CUDAPluggableAllocator (the fallback route), whose own bookkeeping the comparison shows. perf gives the share of all CPU samples spent in each allocator's own library
(libccalloc_torch.so or libc10_cuda.so) and its hottest functions."""

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
fn(steps=2, warmup=1)  # caches warm, lazy initialisation done
if profile == "torch":
    from torch.profiler import profile as prof, ProfilerActivity
    with prof(activities=[ProfilerActivity.CPU]) as p:
        times, _ = fn(steps=steps, warmup=0)
    ops = {}
    for e in p.key_averages():
        if e.key in json.loads(sys.argv[7]):
            ops[e.key] = {"count": e.count, "self_cpu_us": e.self_cpu_time_total / e.count}
    print("PROFILE " + json.dumps({"ops": ops, "step_s": sorted(times)[len(times) // 2]}), flush=True)
else:
    times, _ = fn(steps=steps, warmup=0)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="finetune_bf16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = {}
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
