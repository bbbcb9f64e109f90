#!/usr/bin/env python3
"""Memory of a CUDA graph whose capture frees blocks that a side stream still reads, with and
without graph_capture_record_stream_reuse, on PyTorch's allocator and on ccalloc.

    python3 bench/torch/capture_reuse.py [--layers 32] [--mib 16] [--join-every 4] [--json out.json]

The captured step is a chain of layers, each making a new activation from the last on the
capture stream while a side stream reduces the last one (a stand-in for a collective or an
offload that overlaps compute): the activation is recorded on the side stream and dropped.
The capture stream waits for the side stream every few layers. Without the setting every
dropped activation stays taken until the capture ends; with it, one becomes free again once
the capture stream has waited for the side stream's reduction of it.

Each configuration runs in a fresh process: PyTorch's allocator, ccalloc's `pytorch` preset
and ccalloc's default preset, each with the setting off and on. Printed per run: the graph
pool's reserved and allocated peaks during the capture, and whether three replays produce
the same reductions as the eager step (they must, everywhere)."""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BINDINGS = os.path.join(HERE, "..", "..", "bindings", "torch")

WORKER = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
if sys.argv[1] == "ccalloc":
    import ccalloc_torch
    how = ccalloc_torch.install()
    assert how == "native", how
import torch
layers, numel, join_every = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def step(x, side):
    cur = torch.cuda.current_stream()
    sums = []
    for i in range(layers):
        y = x * 1.0001 + 1.0
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            sums.append(x.sum())
        x.record_stream(side)
        sums[-1].record_stream(cur)  # stacked on the capture stream below
        del x
        x = y
        if (i + 1) % join_every == 0:
            cur.wait_stream(side)
    cur.wait_stream(side)
    return torch.stack(sums), x

side = torch.cuda.Stream()
static_in = torch.full((numel,), 0.5, device="cuda")
eager, _ = step(static_in.clone(), side)  # also loads every kernel before the capture
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_stats()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out, last = step(static_in, side)
stats = torch.cuda.memory_stats()
torch.cuda.synchronize()
same = True
for _ in range(3):
    g.replay()
    torch.cuda.synchronize()
    same = same and bool(torch.equal(out, eager))
print(json.dumps({
    "reserved_peak": stats["reserved_bytes.all.peak"] - before["reserved_bytes.all.current"],
    "allocated_peak": stats["allocated_bytes.all.peak"] - before["allocated_bytes.all.current"],
    "replays_match": same,
    "backend": torch.cuda.get_allocator_backend(),
}), flush=True)
"""

RUNS = [  # label, allocator, ccalloc preset
    ("PyTorch", "pytorch", None),
    ("ccalloc, pytorch preset", "ccalloc", "pytorch"),
    ("ccalloc, default preset", "ccalloc", "ccalloc"),
]


def run(allocator, preset, reuse, args):
    env = dict(os.environ)
    for key in ("CCALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(key, None)
    setting = "graph_capture_record_stream_reuse:" + ("True" if reuse else "False")
    if allocator == "pytorch":
        env["PYTORCH_CUDA_ALLOC_CONF"] = setting
    else:
        env["CCALLOC_CONF"] = preset + "," + setting
    numel = args.mib * (1 << 20) // 4
    proc = subprocess.run([sys.executable, "-c", WORKER, allocator, BINDINGS, str(args.layers),
                           str(numel), str(args.join_every)],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{allocator} ({setting}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--mib", type=int, default=16, help="MiB of one activation")
    parser.add_argument("--join-every", type=int, default=4)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    results = []
    failed = False
    print(f"{args.layers} layers of {args.mib} MiB activations, the capture stream waits for "
          f"the side stream every {args.join_every} layers")
    print(f"{'allocator':26} {'reuse':6} {'reserved peak MiB':>18} {'allocated peak MiB':>19} "
          f"{'replays match':>14}")
    for label, allocator, preset in RUNS:
        for reuse in (False, True):
            r = run(allocator, preset, reuse, args)
            r.update(allocator=label, reuse=reuse)
            results.append(r)
            failed = failed or not r["replays_match"]
            print(f"{label:26} {str(reuse):6} {r['reserved_peak'] / 2**20:18.0f} "
                  f"{r['allocated_peak'] / 2**20:19.0f} {str(r['replays_match']):>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
