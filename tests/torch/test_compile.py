"""torch.compile(mode="reduce-overhead") on GPT-2 small inference: cudagraph trees record
into the allocator's private pools, check their live allocations and restore checkpoints.
The same script on PyTorch's allocator and on ccalloc must give the same logits, under
PyTorch's native policy and with expandable_segments:True."""

import os

import pytest

from torch_compare import REPO, both, skip_without_gpu

skip_without_gpu()

GPT2 = f"""
import sys
sys.path.insert(0, {os.path.join(REPO, "bench", "torch")!r})
import models
import torch._inductor.config as inductor
inductor.fallback_random = True
inductor.triton.autotune_pointwise = False
torch.manual_seed(0)
model = models.GPT().cuda().eval()
gen = torch.Generator(device="cuda").manual_seed(1)
inputs = [torch.randint(0, 50257, (2, t), device="cuda", generator=gen) for t in (64, 128)]
with torch.no_grad():
    eager = [model(x)[:, -1].float().cpu() for x in inputs]
compiled = torch.compile(model, mode="reduce-overhead")
rounds = []
with torch.no_grad():
    for _ in range(4):  # warm-up, recording, then replays of each shape's graph
        rounds.append([compiled(x)[:, -1].float().cpu() for x in inputs])
last = rounds[-1]
emit(replays_agree=all(torch.equal(a, b) for r in rounds[2:] for a, b in zip(r, last)),
     close_to_eager=all(torch.allclose(o, e, atol=2e-3, rtol=2e-3) for o, e in zip(last, eager)),
     logits=[o[0, :16].tolist() for o in last],
     graphs_reserved=torch.cuda.memory_reserved() > 0)
"""


@pytest.mark.parametrize("conf", [None, "expandable_segments:True"])
def test_gpt2_small_reduce_overhead_matches_pytorchs_allocator(conf):
    pytorch, ccalloc = both(GPT2, conf=conf, timeout=1200)
    for name, run in (("pytorch", pytorch), ("ccalloc", ccalloc)):
        assert run["replays_agree"], f"{name}: replays of one graph gave different logits"
        assert run["close_to_eager"], f"{name}: compiled logits differ from eager ones"
        assert run["graphs_reserved"], name
    # Same kernels on the same inputs: the logits agree to float rounding of the
    # compiled kernels chosen in each process.
    worst = max(abs(a - b) for ra, rb in zip(pytorch["logits"], ccalloc["logits"])
                for a, b in zip(ra, rb))
    assert worst <= 1e-5, f"logits differ between allocators by up to {worst}"
