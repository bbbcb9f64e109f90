#!/usr/bin/env python3
"""The cost of one CUDA tensor allocation and free through PyTorch, on PyTorch's allocator
and on ccalloc (installed natively), in nanoseconds.

    python3 bench/torch/alloc_micro.py [--rounds 30] [--iters 20000] [--json out.json]

One worker process per allocator stays up for the whole run; the parent asks them for
samples in turn (ABAB..., the order flipped every round) so that drift of the machine
(clocks, other load) reaches both alike. A sample is the mean time of `iters` iterations of
`torch.empty(n, device="cuda")` followed by dropping the tensor, after the cache is warm;
the result is the median of the samples, with their spread."""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BINDINGS = os.path.join(HERE, "..", "..", "bindings", "torch")
SIZES = {"512B": 512, "64KiB": 64 << 10, "1MiB": 1 << 20, "8MiB": 8 << 20, "64MiB": 64 << 20}

WORKER = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
if sys.argv[1] == "ccalloc":
    import ccalloc_torch
    how = ccalloc_torch.install()
    assert how == "native", how
import torch
torch.empty(1, device="cuda")
print("ready " + torch.cuda.get_allocator_backend(), flush=True)
for line in sys.stdin:
    size, iters = (int(v) for v in line.split())
    empty = torch.empty
    for _ in range(1000):  # warm: the block is cached
        empty(size, dtype=torch.uint8, device="cuda")
    start = time.perf_counter_ns()
    for _ in range(iters):
        empty(size, dtype=torch.uint8, device="cuda")
    elapsed = time.perf_counter_ns() - start
    print(elapsed / iters, flush=True)
"""


def start(allocator):
    env = dict(os.environ)
    if allocator == "ccalloc":
        env.setdefault("CCALLOC_CONF", "pytorch")
    proc = subprocess.Popen([sys.executable, "-c", WORKER, allocator, BINDINGS], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        raise RuntimeError(f"the {allocator} worker did not start (it said {line!r})")
    return proc, line.split()[1]


def sample(proc, size, iters):
    proc.stdin.write(f"{size} {iters}\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    workers = {name: start(name) for name in ("pytorch", "ccalloc")}
    results = {}
    try:
        for size in SIZES.values():  # untimed: first-call costs of each size and code path
            for proc, _ in workers.values():
                sample(proc, size, args.iters)
        for label, size in SIZES.items():
            samples = {name: [] for name in workers}
            for r in range(args.rounds):
                order = list(workers) if r % 2 == 0 else list(reversed(workers))
                for name in order:
                    samples[name].append(sample(workers[name][0], size, args.iters))
            results[label] = {name: {"median_ns": statistics.median(s), "min_ns": min(s),
                                     "max_ns": max(s)} for name, s in samples.items()}
            p, c = (results[label][n]["median_ns"] for n in ("pytorch", "ccalloc"))
            print(f"{label:>6}: pytorch {p:8.1f} ns   ccalloc {c:8.1f} ns   ccalloc/pytorch {c / p:5.2f}",
                  flush=True)
    finally:
        for proc, _ in workers.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    backends = {name: backend for name, (_, backend) in workers.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backends": backends, "rounds": args.rounds, "iters": args.iters,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
