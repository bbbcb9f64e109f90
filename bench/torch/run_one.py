#!/usr/bin/env python3
"""Runs one workload on one allocator in this (fresh) process and prints one JSON object:
step times, outputs, peak reserved memory and device allocations.

    python3 bench/torch/run_one.py gpt2_varlen --allocator ccalloc

With --gated, each step waits for a line on stdin (compare.py --interleave).

The allocator's config comes from the environment: PYTORCH_CUDA_ALLOC_CONF for PyTorch's,
CCALLOC_CONF for ccalloc (compare.py sets both)."""

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "torch"))
sys.path.insert(0, HERE)


class StdinGate:
    """Runs each step when the parent says so: the parent alternates the steps of processes
    on different allocators, so that step i runs on one right after it ran on the other."""

    def before(self, step):
        print(f"WAIT {step}", flush=True)
        if not sys.stdin.readline():
            sys.exit("run_one.py: the parent closed stdin before step %d" % step)

    def after(self, step, seconds):
        print(f"DONE {step} {seconds!r}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("workload")
    # "pytorch-loaded": PyTorch's allocator, with ccalloc's libraries loaded but not
    # installed; a control that separates what loading them costs from what ccalloc does.
    parser.add_argument("--allocator", choices=["pytorch", "ccalloc", "pytorch-loaded"], required=True)
    parser.add_argument("--gated", action="store_true",
                        help="before each step print 'WAIT <step>' and wait for a line on stdin; "
                             "after it print 'DONE <step> <seconds>' (compare.py --interleave)")
    parser.add_argument("--steps", type=int, help="timed steps (default: the workload's own)")
    args = parser.parse_args()

    if args.allocator == "ccalloc":
        import ccalloc_torch
        how = ccalloc_torch.install()
    elif args.allocator == "pytorch-loaded":
        import ccalloc_torch
        assert ccalloc_torch._native_library() is not None, "libccalloc_torch.so was not built"
    import torch
    import probes
    import workloads

    workloads.deterministic()
    workloads.step_probe = probes.driver_calls(
        "ccalloc" if args.allocator == "ccalloc" else "pytorch")
    if args.gated:
        workloads.step_gate = StdinGate()

    kwargs = {"steps": args.steps} if args.steps else {}
    times, outputs = workloads.WORKLOADS[args.workload](**kwargs)
    if args.allocator == "ccalloc":
        stats = ccalloc_torch.stats()
    else:
        stats = torch.cuda.memory_stats()
    result = {
        "workload": args.workload,
        "allocator": args.allocator,
        "installed": how if args.allocator == "ccalloc" else "PyTorch's",
        "conf": os.environ.get("CCALLOC_CONF" if args.allocator == "ccalloc"
                               else "PYTORCH_CUDA_ALLOC_CONF", ""),
        "median_step_s": statistics.median(times),
        "step_times_s": times,
        "step_cpu_s": list(workloads.step_cpu_s),
        "step_probes": list(workloads.step_probes),
        "peak_requested_bytes": stats["requested_bytes.all.peak"],
        "outputs": outputs,
        "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
        "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
        "num_device_alloc": stats["num_device_alloc"],
        "num_alloc_retries": stats["num_alloc_retries"],
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
