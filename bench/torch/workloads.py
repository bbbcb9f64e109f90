"""The real-model workloads of the PyTorch benchmark: randomly initialised models (no
downloads), seeded data, deterministic settings, so that two runs that differ only in the
allocator must produce identical losses and tokens.

Each workload returns (step_times_s, outputs): one wall time per timed step (CUDA
synchronized) and the step's outputs (loss values, or a hash of generated tokens).
"""

import hashlib
import random
import time

import torch


def _timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def resnet50(steps=25, warmup=3, batch=64):
    """torchvision ResNet-50 training, bf16 autocast, SGD; fixed shapes."""
    import torchvision

    model = torchvision.models.resnet50(weights=None).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator(device="cuda").manual_seed(1)
    times, outputs = [], []
    for step in range(warmup + steps):
        x = torch.randn(batch, 3, 224, 224, device="cuda", generator=gen)
        y = torch.randint(0, 1000, (batch,), device="cuda", generator=gen)

        def train_step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        t, loss = _timed(train_step)
        if step >= warmup:
            times.append(t)
        outputs.append(float(loss))
    return times, outputs


def gpt2_varlen(steps=30, warmup=3):
    """transformers GPT-2 small trained with batch 4-8 and sequence length 128-1024 varying
    per step, AdamW."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(2)
    gen = torch.Generator(device="cuda").manual_seed(2)
    times, outputs = [], []
    for step in range(warmup + steps):
        batch, seq = rng.randint(4, 8), rng.randint(128, 1024)
        ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=gen)

        def train_step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        t, loss = _timed(train_step)
        if step >= warmup:
            times.append(t)
        outputs.append(float(loss))
    return times, outputs


def llama_generate(steps=12, warmup=2, new_tokens=48):
    """A Llama-style decoder (8 layers, 1024 wide, bf16) generating greedily with batch and
    prompt length varying per call."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(
        "cuda", torch.bfloat16)
    model.eval()
    rng = random.Random(3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    times, outputs = [], []
    for step in range(warmup + steps):
        batch, prompt = rng.choice([1, 2, 4, 8]), rng.randint(32, 512)
        ids = torch.randint(3, config.vocab_size, (batch, prompt), device="cuda", generator=gen)

        def generate():
            with torch.no_grad():
                return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=0)

        t, tokens = _timed(generate)
        if step >= warmup:
            times.append(t)
        outputs.append(hashlib.sha256(tokens.cpu().numpy().tobytes()).hexdigest()[:16])
    return times, outputs


WORKLOADS = {"resnet50": resnet50, "gpt2_varlen": gpt2_varlen, "llama_generate": llama_generate}
