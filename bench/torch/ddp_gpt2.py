#!/usr/bin/env python3
"""GPT-2 small trained with DistributedDataParallel (NCCL), one process per GPU, on
ccalloc or PyTorch's allocator:

    torchrun --nproc_per_node=2 bench/torch/ddp_gpt2.py --allocator ccalloc

Each rank prints its losses and its peak reserved memory."""

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "torch"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--allocator", choices=["pytorch", "ccalloc"], default="ccalloc")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.allocator == "ccalloc":
        import ccalloc_torch
        ccalloc_torch.install()
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").cuda()
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(10 + rank)
    gen = torch.Generator(device="cuda").manual_seed(10 + rank)
    losses = []
    for _ in range(args.steps):
        batch, seq = rng.randint(4, 8), rng.randint(128, 1024)
        ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    torch.cuda.synchronize()
    stats = ccalloc_torch.stats() if args.allocator == "ccalloc" else torch.cuda.memory_stats()
    print("RANK " + json.dumps({"rank": rank, "allocator": args.allocator, "losses": losses,
                                "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
                                "num_device_alloc": stats["num_device_alloc"]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
