#!/usr/bin/env python3
"""Data-parallel and sharded training of a transformer LM, one process per GPU (NCCL),
on one allocator; started by torchrun:

    torchrun --standalone --nproc_per_node=2 bench/torch/run_dist.py fsdp2_lm --allocator ccalloc
    torchrun --standalone --nproc_per_node=2 bench/torch/run_dist.py ddp_lm --allocator pytorch \\
        --record --out DIR
    torchrun --standalone --nproc_per_node=4 bench/torch/run_dist.py fsdp2_tp_lm --allocator ccalloc

The model is a Llama-style decoder (6 layers, 1024 wide, 32000 tokens) built from a
transformers LlamaConfig, trained with AdamW on batch 4 and a sequence length of 128-1024
that varies per step and per rank:
  fsdp2_lm  every decoder layer and the root sharded with FSDP2 (fully_shard), bf16
            parameters and fp32 gradient reduction (MixedPrecisionPolicy);
  ddp_lm    DistributedDataParallel, fp32 weights under bf16 autocast;
  fsdp2_tp_lm  FSDP2 over tensor parallelism on a 2-D mesh (dp x tp, tp = 2 where the ranks
            are even, else 1; 2 x 2 on four GPUs): each decoder layer's attention and MLP
            split by parallelize_module (q, k, v, gate and up column-wise, o and down
            row-wise), then every layer and the root sharded over dp as fsdp2_lm; the two
            ranks of a tp group take the same batch;
  pp_lm     pipeline parallelism over the ranks (torch.distributed.pipelining, 1F1B, four
            microbatches of 2 sequences): 8 decoder layers split evenly, the embedding on
            the first stage, the norm, head and loss on the last; fp32 weights under bf16
            autocast. A stage's buffers are shaped by its first step, so the sequence length
            varies per step over 256, 512, 768 and 1024 (one stage and schedule each), the
            same on every rank.
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


def tp_mesh_shape(world):
    """(dp, tp) of fsdp2_tp_lm's mesh: tp = 2 where the ranks are even, else 1."""
    tp = 2 if world % 2 == 0 else 1
    return world // tp, tp


def build_fsdp2_tp(world):
    """fsdp2_tp_lm's model on its (dp, tp) mesh; returns (config, model)."""
    import torch
    import workloads
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from transformers import AutoModelForCausalLM

    config = workloads._llama_config(layers=6)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda()
    model.train()
    mesh = init_device_mesh("cuda", tp_mesh_shape(world), mesh_dim_names=("dp", "tp"))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    return config, model


PP_LAYERS = 8
PP_LENGTHS = (256, 512, 768, 1024)
PP_MICROBATCHES = 4


def pp_layers(rank, world):
    """The decoder layers [lo, hi) of pp_lm's stage on `rank`: PP_LAYERS split evenly, in
    order, every layer on exactly one stage."""
    return rank * PP_LAYERS // world, (rank + 1) * PP_LAYERS // world


def build_pp(rank, world, device):
    """pp_lm's stage of this rank: (config, stage module)."""
    import torch
    import workloads
    from transformers import AutoModelForCausalLM

    config = workloads._llama_config(layers=PP_LAYERS)
    torch.manual_seed(0)  # the whole model on the CPU, the same on every rank
    full = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    lo, hi = pp_layers(rank, world)

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            first, last = rank == 0, rank == world - 1
            self.embed = full.model.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(full.model.layers[lo:hi])
            self.rotary = full.model.rotary_emb
            self.norm = full.model.norm if last else None
            self.head = full.lm_head if last else None

        def forward(self, x):
            h = self.embed(x) if self.embed is not None else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            rope = self.rotary(h, pos)
            for layer in self.layers:  # causal attention where no mask is given (sdpa)
                out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope)
                h = out[0] if isinstance(out, tuple) else out
            return self.head(self.norm(h)) if self.head is not None else h

    module = Stage().to(device)
    module.train()
    return config, module


def pp_step_factory(module, rank, world, device, config, rng, gen):
    """make_step for pp_lm: a 1F1B schedule per sequence length (a stage's buffers are shaped
    by its first step)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    schedules = {}

    def loss_fn(logits, target):
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def make_step(step):
        seq = rng.choice(PP_LENGTHS)  # the same on every rank (one seed)
        ids = torch.randint(3, config.vocab_size, (2 * PP_MICROBATCHES, seq), device=device,
                            generator=gen)
        target = torch.roll(ids, -1, 1)
        if seq not in schedules:
            stage = PipelineStage(module, rank, world, device)
            schedules[seq] = Schedule1F1B(stage, n_microbatches=PP_MICROBATCHES, loss_fn=loss_fn)
        schedule = schedules[seq]

        def run():
            losses = []
            args = (ids,) if rank == 0 else ()
            kwargs = {"target": target, "losses": losses} if rank == world - 1 else {}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                schedule.step(*args, **kwargs)
            opt.step()
            opt.zero_grad(set_to_none=True)
            # Only the last stage has a loss; the others report 0.
            return torch.stack(losses).mean().detach() if losses else torch.zeros((), device=device)

        torch.distributed.barrier()
        return run

    return make_step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=["fsdp2_lm", "ddp_lm", "fsdp2_tp_lm", "pp_lm"])
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
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    # The data's seed: one per rank, one per tp group (fsdp2_tp_lm), one for all (pp_lm).
    seed = 20 + {"fsdp2_tp_lm": rank // tp_mesh_shape(world)[1], "pp_lm": 0}.get(args.workload, rank)
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    workloads.step_probe = probes.driver_calls(args.allocator)
    if args.gate:
        workloads.step_gate = FileGate(args.gate, rank)

    if args.workload == "pp_lm":
        config, module = build_pp(rank, world, device)
        make_step = pp_step_factory(module, rank, world, device, config, rng, gen)
    else:
        if args.workload == "fsdp2_tp_lm":
            config, model = build_fsdp2_tp(world)
            autocast = None
        else:
            config, model, autocast = build(args.workload, local_rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

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
