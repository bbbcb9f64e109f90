#!/usr/bin/env python3
"""Data-parallel and sharded training of a transformer LM, one process per GPU (NCCL),
on one allocator; started by torchrun:

    torchrun --standalone --nproc_per_node=2 bench/torch/run_dist.py fsdp2_lm --allocator ccalloc
    torchrun --standalone --nproc_per_node=2 bench/torch/run_dist.py ddp_lm --allocator pytorch \\
        --record --out DIR

The model is a Llama-style decoder (6 layers, 1024 wide, 32000 tokens) built from a
transformers LlamaConfig, trained with AdamW on batch 4 and a sequence length of 128-1024
that varies per step and per rank:
  fsdp2_lm  every decoder layer and the root sharded with FSDP2 (fully_shard), bf16
            parameters and fp32 gradient reduction (MixedPrecisionPolicy);
  ddp_lm    DistributedDataParallel, fp32 weights under bf16 autocast.
Whether c10d calls record_stream on the collectives' tensors is
TORCH_NCCL_AVOID_RECORD_STREAMS, which the caller sets (scale.py runs FSDP2 both ways).

With --gate DIR every rank runs each step only when the parent says so, through files in DIR
(scale.py --gated runs the allocators' jobs side by side, taking turns step by step): before
step i it writes ready.i.RANK and waits for go.i; after it, done.i.RANK.

Rank 0 prints one line `RESULT {json}` with every rank's step times, losses, peaks and
per-step driver-call counters (see run_one.py and scale.py). With --record every rank
records its allocation history from the first allocation and writes it, frames removed, as
DIR/NAME.rankR.pickle.gz (the format of data/traces)."""

import argparse
import gzip
import json
import os
import pickle
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "torch"))
sys.path.insert(0, HERE)


class FileGate:
    """The ranks' side of scale.py's turns (--gate DIR): no rank of this job works while
    another job's step is timed."""

    def __init__(self, directory, rank):
        self.dir, self.rank = directory, rank

    def _touch(self, name):
        with open(os.path.join(self.dir, name), "w"):
            pass

    def before(self, step):
        self._touch(f"ready.{step}.{self.rank}")
        go = os.path.join(self.dir, f"go.{step}")
        deadline = time.monotonic() + 600
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                sys.exit(f"run_dist.py: no go for step {step} in 600 s")
            time.sleep(0.0002)

    def after(self, step, seconds):
        self._touch(f"done.{step}.{self.rank}")


def build(kind, local_rank):
    import torch
    import workloads
    from transformers import AutoModelForCausalLM

    config = workloads._llama_config(layers=6)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda()
    model.train()
    if kind == "fsdp2_lm":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        autocast = None
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
        autocast = torch.bfloat16
    return config, model, autocast


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=["fsdp2_lm", "ddp_lm"])
    parser.add_argument("--allocator", choices=["pytorch", "ccalloc"], required=True)
    parser.add_argument("--steps", type=int, default=16, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--out", default=".")
    parser.add_argument("--name", help="file stem of the recordings (default: the workload)")
    parser.add_argument("--gate", metavar="DIR", help="take turns with other jobs (scale.py --gated)")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.allocator == "ccalloc":
        import ccalloc_torch
        ccalloc_torch.install()
    import torch
    import torch.distributed as dist
    import workloads
    import probes

    workloads.deterministic()
    torch.cuda.set_device(local_rank)
    if args.record:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python",
                                                 context=None)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    config, model, autocast = build(args.workload, local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(20 + rank)
    gen = torch.Generator(device="cuda").manual_seed(20 + rank)
    workloads.step_probe = probes.driver_calls(args.allocator)
    if args.gate:
        workloads.step_gate = FileGate(args.gate, rank)

    def make_step(step):
        seq = rng.randint(128, 1024)
        ids = torch.randint(3, config.vocab_size, (4, seq), device="cuda", generator=gen)
        dist.barrier()  # the ranks start each timed step together
        return workloads._train_step(opt, lambda: model(input_ids=ids, labels=ids).loss,
                                     dtype=autocast)

    times, losses = workloads._run_steps(args.steps, args.warmup, make_step)
    mine = {"rank": rank, "step_times_s": times, "outputs": losses,
            "step_probes": list(workloads.step_probes), **probes.peaks(args.allocator)}
    if args.record:
        snap = torch.cuda.memory._snapshot()
        for trace in snap["device_traces"]:
            for entry in trace:
                entry.pop("frames", None)
        stem = (args.name or args.workload) + f".rank{rank}.pickle.gz"
        with gzip.open(os.path.join(args.out, stem), "wb") as f:
            pickle.dump(snap, f)
        mine["recording"] = stem
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        print("RESULT " + json.dumps({
            "workload": args.workload, "allocator": args.allocator,
            "avoid_record_streams": os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS", ""),
            "ranks": everyone}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
