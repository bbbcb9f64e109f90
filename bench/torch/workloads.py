"""The real-model workloads of the PyTorch benchmark: randomly initialised models (no
downloads), seeded data, deterministic settings, so that two runs that differ only in the
allocator must produce identical losses and tokens.

Each workload returns (step_times_s, outputs): one wall time per timed step (CUDA
synchronized) and the step's outputs (loss values, or a hash of generated tokens).
"""

import contextlib
import hashlib
import os
import random
import time

import torch


def deterministic():
    """The settings every bench/torch process runs its workload under (run_one.py, which
    compare.py runs, and record.py, which makes the recordings): seeded, deterministic
    kernels. Call it before the first CUDA operation: cuBLAS reads CUBLAS_WORKSPACE_CONFIG
    when it creates its first handle."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def _timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


# Called, when set, once the warm-up steps are done and before the first timed step: a
# profiler starts here so that it sees steady steps only (not compilation or recording).
on_timed_start = None

# When set, an object whose before(step) is called once a step's inputs are ready, just
# before it runs, and whose after(step, seconds) is called once it has run, both outside the
# timed region: compare.py's --interleave makes each worker wait there for its turn.
step_gate = None


# The CPU time of the process (all its threads) in each timed step of the last run, beside
# the wall times _run_steps returns: a step that waited for the CPU (other load on the
# machine, a virtual CPU descheduled) takes longer in wall time but not in CPU time. The
# final synchronize may spin, so a step that waits for the GPU counts that wait in both.
step_cpu_s = []

# When set, a function called after every step, outside the timed region, whose result is
# kept in step_probes (one per step, warm-up included): scale.py reads the allocator's
# driver-call counters there.
step_probe = None
step_probes = []


def _run_steps(steps, warmup, make_step, output=float):
    """Runs warmup + steps steps. make_step(step) prepares a step's inputs (untimed) and
    returns the step as a function; its result goes through `output` into the outputs.
    Returns (times of the steps after the warm-up, outputs of every step)."""
    times, outputs = [], []
    step_cpu_s.clear()
    step_probes.clear()
    for step in range(warmup + steps):
        if step == warmup and on_timed_start is not None:
            on_timed_start()
        fn = make_step(step)
        if step_gate is not None:
            step_gate.before(step)
        cpu = time.process_time()
        t, out = _timed(fn)
        cpu = time.process_time() - cpu
        if step_gate is not None:
            step_gate.after(step, t)
        if step >= warmup:
            times.append(t)
            step_cpu_s.append(cpu)
        outputs.append(output(out))
        if step_probe is not None:
            step_probes.append(step_probe())
    return times, outputs


def _train_step(opt, loss_fn, dtype=torch.bfloat16, clip=None):
    """One training step as every training workload takes it: the loss from loss_fn() under
    autocast to dtype (none when dtype is None), backward, gradient norms clipped to 1 over
    clip.parameters() when clip is a model, the optimizer's step, gradients set to None.
    Returns the step as a function that returns the detached loss."""

    def step():
        with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = loss_fn()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(clip.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def resnet50(steps=25, warmup=3, batch=64, dtype=torch.bfloat16):
    """torchvision ResNet-50 training, bf16 autocast (dtype=None: fp32), SGD; fixed shapes."""
    import torchvision

    model = torchvision.models.resnet50(weights=None).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator(device="cuda").manual_seed(1)

    def make_step(step):
        x = torch.randn(batch, 3, 224, 224, device="cuda", generator=gen)
        y = torch.randint(0, 1000, (batch,), device="cuda", generator=gen)

        return _train_step(opt, lambda: torch.nn.functional.cross_entropy(model(x), y),
                           dtype=dtype)

    return _run_steps(steps, warmup, make_step)


def gpt2_varlen(steps=30, warmup=3):
    """transformers GPT-2 small trained with batch 4-8 and sequence length 128-1024 varying
    per step, AdamW."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(2)
    gen = torch.Generator(device="cuda").manual_seed(2)

    def make_step(step):
        batch, seq = rng.randint(4, 8), rng.randint(128, 1024)
        ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=gen)

        return _train_step(opt, lambda: model(input_ids=ids, labels=ids).loss, dtype=None)

    return _run_steps(steps, warmup, make_step)


def _llama_config(layers=8):
    """The Llama-style decoder's shape, shared by the inference workloads, the training ones
    (llama_train_ckpt; llama_train_dyn with 24 layers) and run_dist.py's (6 layers): 1024
    wide, 32000 tokens, 8 layers unless told."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                       max_position_embeddings=2048)


def _llama_decoder(dtype=torch.bfloat16):
    """The Llama-style decoder of the inference workloads: bf16 (or dtype), eager attention,
    randomly initialised, in eval mode. Returns (config, model)."""
    from transformers import AutoModelForCausalLM

    config = _llama_config()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(
        "cuda", dtype)
    model.eval()
    return config, model


def llama_generate(steps=12, warmup=2, new_tokens=48, batches=(1, 2, 4, 8), prompt=(32, 512),
                   dtype=torch.bfloat16):
    """A Llama-style decoder (8 layers, 1024 wide, bf16) generating greedily with batch (one
    of `batches`) and prompt length (within `prompt`) varying per call."""
    config, model = _llama_decoder(dtype)
    rng = random.Random(3)
    gen = torch.Generator(device="cuda").manual_seed(3)

    def make_step(step):
        batch, length = rng.choice(list(batches)), rng.randint(*prompt)
        ids = torch.randint(3, config.vocab_size, (batch, length), device="cuda", generator=gen)

        def generate():
            with torch.no_grad():
                return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=0)

        return generate

    return _run_steps(steps, warmup, make_step,
                      lambda tokens: hashlib.sha256(tokens.cpu().numpy().tobytes()).hexdigest()[:16])


def llama_serve(steps=6, warmup=1, ticks=20, max_active=8):
    """An inference server on the Llama-style decoder of llama_generate, batching continuously
    without paging: requests (1, 2 or 4 sequences, prompts of 16-384 tokens, 8-64 new
    tokens) arrive at random ticks, up to max_active at once; each is prefilled when it
    arrives and then decodes one token per tick with its own growing key-value cache
    (transformers' DynamicCache, which concatenates: each layer's cache is reallocated one
    token longer every tick), which is dropped when the request finishes. A step is `ticks`
    ticks; its output is a hash of the tokens of the requests that finished in it."""
    from transformers import DynamicCache

    config, model = _llama_decoder()
    rng = random.Random(7)
    gen = torch.Generator(device="cuda").manual_seed(7)
    active = []

    def forward(request, ids):
        out = model(input_ids=ids, past_key_values=request["cache"], use_cache=True)
        request["cache"] = out.past_key_values
        token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        request["tokens"].append(token)
        request["left"] -= 1
        return token

    def tick(finished):
        if len(active) < max_active and rng.random() < 0.35:
            batch, prompt = rng.choice([1, 2, 4]), rng.randint(16, 384)
            ids = torch.randint(3, config.vocab_size, (batch, prompt), device="cuda", generator=gen)
            request = {"cache": DynamicCache(), "tokens": [], "left": rng.randint(8, 64)}
            forward(request, ids)
            active.append(request)
            return
        for request in list(active):
            forward(request, request["tokens"][-1])
            if request["left"] <= 0:
                finished.append(torch.cat(request["tokens"], dim=1))
                active.remove(request)

    def make_step(step):
        def serve():
            finished = []
            with torch.no_grad():
                for _ in range(ticks):
                    tick(finished)
            return finished

        return serve

    def digest(finished):
        h = hashlib.sha256()
        for tokens in finished:
            h.update(tokens.cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    return _run_steps(steps, warmup, make_step, digest)


def finetune_bf16(steps=40, warmup=5, layers=12, batch=(8, 32), seq=(32, 512),
                  dtype=torch.bfloat16):
    """Fine-tuning a BERT-base-sized encoder (`layers` layers) for classification under bf16
    autocast (dtype=None: fp32): batch 8-32 and sequence length 32-512 (the ranges `batch`
    and `seq`) vary per step, rows padded to different lengths, AdamW with gradient
    clipping. Many small, differently sized allocations per step."""
    from transformers import AutoModelForSequenceClassification, BertConfig

    config = BertConfig(num_labels=4, num_hidden_layers=layers)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    rng = random.Random(4)
    gen = torch.Generator(device="cuda").manual_seed(4)

    def make_step(step):
        rows, length = rng.randint(*batch), rng.randint(*seq)
        ids = torch.randint(1000, config.vocab_size, (rows, length), device="cuda", generator=gen)
        lengths = torch.randint(length // 2, length + 1, (rows, 1), device="cuda", generator=gen)
        mask = (torch.arange(length, device="cuda")[None, :] < lengths).long()
        labels = torch.randint(0, 4, (rows,), device="cuda", generator=gen)

        return _train_step(
            opt, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss,
            dtype=dtype, clip=model)

    return _run_steps(steps, warmup, make_step)


def _reduce_overhead(model, make_input, steps, warmup, dtype):
    import torch._inductor.config as inductor

    inductor.fallback_random = True
    inductor.triton.autotune_pointwise = False
    compiled = torch.compile(model, mode="reduce-overhead")

    def make_step(step):
        x = make_input(step)

        def infer():
            out = compiled(x)
            # The graph's output buffer is overwritten by the next replay: reduce it now.
            return float(out.float().sum())

        return infer

    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        return _run_steps(steps, warmup, make_step)


def compiled_gpt2(steps=60, warmup=9):
    """GPT-2 small inference under torch.compile(mode="reduce-overhead") (CUDA graphs through
    the allocator's private pools), bf16 autocast, batch 4, sequence length cycling through
    128, 256 and 512: one recorded graph per shape, replayed."""
    import models

    torch.manual_seed(5)
    model = models.GPT().cuda().eval()
    gen = torch.Generator(device="cuda").manual_seed(5)
    inputs = [torch.randint(0, 50257, (4, t), device="cuda", generator=gen) for t in (128, 256, 512)]
    return _reduce_overhead(model, lambda step: inputs[step % 3], steps, warmup, torch.bfloat16)


def compiled_mlp(steps=200, warmup=12):
    """A 6-layer MLP (1024 wide) under torch.compile(mode="reduce-overhead"), batch sizes
    cycling through 64, 256 and 1024."""
    import models

    torch.manual_seed(6)
    model = models.mlp().cuda().eval()
    gen = torch.Generator(device="cuda").manual_seed(6)
    inputs = [torch.randn(b, 1024, device="cuda", generator=gen) for b in (64, 256, 1024)]
    return _reduce_overhead(model, lambda step: inputs[step % 3], steps, warmup, None)


def t5_beam(steps=8, warmup=1, beams=4, new_tokens=32):
    """An encoder-decoder (transformers T5, 6 + 6 layers, 512 wide, bf16, randomly initialised)
    translating with beam search: batch 1-8 and input length 32-384 vary per call, 4 beams
    whose key-value caches are reordered every token."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                      num_heads=8, vocab_size=32128, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=1)
    model = T5ForConditionalGeneration(config).to("cuda", torch.bfloat16).eval()
    rng = random.Random(8)
    gen = torch.Generator(device="cuda").manual_seed(8)

    def make_step(step):
        batch, length = rng.choice([1, 2, 4, 8]), rng.randint(32, 384)
        ids = torch.randint(3, config.vocab_size, (batch, length), device="cuda", generator=gen)

        def translate():
            with torch.no_grad():
                return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      num_beams=beams, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False)

        return translate

    return _run_steps(steps, warmup, make_step,
                      lambda tokens: hashlib.sha256(tokens.cpu().numpy().tobytes()).hexdigest()[:16])


def llama_train_ckpt(steps=12, warmup=2):
    """Training the Llama-style decoder of the inference workloads (fp32 weights, bf16
    autocast, AdamW) with activation checkpointing: batch 2-8 and sequence length 128-1024
    vary per step, so the recomputed activations change size every step."""
    from transformers import AutoModelForCausalLM

    config = _llama_config()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(9)
    gen = torch.Generator(device="cuda").manual_seed(9)

    def make_step(step):
        batch, seq = rng.randint(2, 8), rng.randint(128, 1024)
        ids = torch.randint(3, config.vocab_size, (batch, seq), device="cuda", generator=gen)

        return _train_step(opt, lambda: model(input_ids=ids, labels=ids).loss)

    return _run_steps(steps, warmup, make_step)


def efficientnet_varres(steps=16, warmup=2, batch=48):
    """torchvision EfficientNet-B0 training, bf16 autocast, channels-last, SGD with momentum,
    the image resolution changing every step (160-320 in steps of 32), as multi-scale
    training does."""
    import torchvision

    torch.manual_seed(10)
    model = torchvision.models.efficientnet_b0(num_classes=1000).cuda()
    model = model.to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = random.Random(10)
    gen = torch.Generator(device="cuda").manual_seed(10)

    def make_step(step):
        res = rng.choice(range(160, 321, 32))
        x = torch.randn(batch, 3, res, res, device="cuda", generator=gen)
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device="cuda", generator=gen)

        return _train_step(opt, lambda: torch.nn.functional.cross_entropy(model(x), y))

    return _run_steps(steps, warmup, make_step)


def llama_train_dyn(steps=12, warmup=2, layers=24, batch=(1, 8), seq=(128, 1024),
                    dtype=torch.bfloat16):
    """Training a Llama-style decoder of about 350 M parameters (24 layers, 1024 wide, built
    from a transformers LlamaConfig; fp32 weights, bf16 autocast, AdamW, eager attention)
    without activation checkpointing, batch 1-8 and sequence length 128-1024 (the ranges
    `batch` and `seq`) varying per step: the largest steps hold well over 10 GB of
    activations. `layers` makes it smaller; dtype=None trains without autocast."""
    from transformers import AutoModelForCausalLM

    config = _llama_config(layers=layers)
    torch.manual_seed(12)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(12)
    gen = torch.Generator(device="cuda").manual_seed(12)

    def make_step(step):
        rows, length = rng.randint(*batch), rng.randint(*seq)
        ids = torch.randint(3, config.vocab_size, (rows, length), device="cuda", generator=gen)

        return _train_step(opt, lambda: model(input_ids=ids, labels=ids).loss, dtype=dtype)

    return _run_steps(steps, warmup, make_step)


def gpt2_sidestreams(steps=20, warmup=3):
    """GPT-2 small training (batch 4-8, sequence 128-1024 varying per step, AdamW) with two
    side streams used as input pipelines and metric code use them: the next step's batch
    is copied from pinned host memory on a prefetch stream while the current step runs, and
    used on the main stream (record_stream); the step's accuracy and log-partition are
    computed from the logits on a metrics stream (record_stream on the logits and the
    batch), whose temporaries and results are allocated there."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    torch.manual_seed(13)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(13)
    host_gen = torch.Generator().manual_seed(13)
    main = torch.cuda.current_stream()
    prefetch, metrics = torch.cuda.Stream(), torch.cuda.Stream()
    state = {}

    def load():
        batch, seq = rng.randint(4, 8), rng.randint(128, 1024)
        host = torch.randint(0, config.vocab_size, (batch, seq), generator=host_gen).pin_memory()
        with torch.cuda.stream(prefetch):
            ids = host.to("cuda", non_blocking=True)
        return ids, prefetch.record_event()

    state["next"] = load()

    def make_step(step):
        def run():
            ids, ready = state["next"]
            main.wait_event(ready)
            ids.record_stream(main)
            state["next"] = load()  # overlaps this step
            out = model(input_ids=ids, labels=ids)
            done = main.record_event()
            with torch.cuda.stream(metrics):
                metrics.wait_event(done)
                out.logits.record_stream(metrics)
                ids.record_stream(metrics)
                logits = out.logits.detach()
                accuracy = (logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean()
                partition = torch.logsumexp(logits, dim=-1).mean()
                state["metrics"] = torch.stack([accuracy, partition])
            loss = out.loss
            del out, logits
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return run

    return _run_steps(steps, warmup, make_step)


WORKLOADS = {"resnet50": resnet50, "gpt2_varlen": gpt2_varlen, "llama_generate": llama_generate,
             "llama_serve": llama_serve,
             "finetune_bf16": finetune_bf16, "t5_beam": t5_beam,
             "llama_train_ckpt": llama_train_ckpt, "efficientnet_varres": efficientnet_varres,
             "compiled_gpt2": compiled_gpt2, "compiled_mlp": compiled_mlp,
             "llama_train_dyn": llama_train_dyn, "gpt2_sidestreams": gpt2_sidestreams}
