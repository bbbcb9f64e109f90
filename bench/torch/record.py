#!/usr/bin/env python3
"""Runs one bench/torch workload on PyTorch's allocator and prints its peaks as one JSON
line; with --record, also records its allocation history from the first allocation and
writes it, frames removed, as a gzip'd snapshot pickle that `ccalloc replay` and
`ccalloc fit` read (how data/traces/device/ was made).

    python3 bench/torch/record.py llama_serve --record --out DIR
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/torch/record.py llama_serve

Keyword arguments of the workload go after --args as JSON, e.g. --args '{"steps": 6}'."""

import argparse
import gzip
import json
import os
import pickle
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("workload")
    parser.add_argument("--record", action="store_true", help="record the allocation history")
    parser.add_argument("--out", default=".", help="folder of the recording (WORKLOAD.pickle.gz)")
    parser.add_argument("--name", help="file stem of the recording (default: the workload)")
    parser.add_argument("--args", default="{}", help="the workload's keyword arguments as JSON")
    args = parser.parse_args()

    import torch
    import workloads

    workloads.deterministic()
    if args.record:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python",
                                                 context=None)
    _, outputs = workloads.WORKLOADS[args.workload](**json.loads(args.args))
    result = {"workload": args.workload, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
              "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
              "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
              "peak_requested_bytes": torch.cuda.memory_stats()["requested_bytes.all.peak"],
              "num_device_alloc": torch.cuda.memory_stats()["num_device_alloc"],
              "outputs": outputs}
    if args.record:
        snap = torch.cuda.memory._snapshot()
        for trace in snap["device_traces"]:
            for entry in trace:
                entry.pop("frames", None)
        path = os.path.join(args.out, (args.name or args.workload) + ".pickle.gz")
        with gzip.open(path, "wb") as f:
            pickle.dump(snap, f)
        result["recording"] = path
        result["entries"] = sum(len(t) for t in snap["device_traces"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
