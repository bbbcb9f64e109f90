"""Sleep and wake of a torch.cuda.MemPool on ccalloc (ccalloc_torch.SleepablePool,
docs/sleep-wake.md): weights in a sleepable pool give their GPU memory back while asleep,
other tensors use that memory, and after the wake the weights hold the same bytes at the same
addresses, so a CUDA graph captured before the sleep replays to the same outputs. PyTorch's
own allocator has no sleep mode: each script runs on ccalloc installed natively only (and on
PyTorch's allocator only to check the error there)."""

import os
import sys

import pytest

from torch_compare import BINDINGS, run, skip_without_gpu

skip_without_gpu()


def _skip_without_native_library():
    sys.path.insert(0, BINDINGS)
    try:
        import ccalloc_torch
        directory = ccalloc_torch.library_dir()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"ccalloc_torch unavailable: {e}", allow_module_level=True)
    finally:
        sys.path.remove(BINDINGS)
    if not os.path.exists(os.path.join(directory, "libccalloc_torch.so")):
        pytest.skip(f"no libccalloc_torch.so in {directory}", allow_module_level=True)


_skip_without_native_library()

MiB = 1 << 20

# About 1 GiB of "weights" of several sizes (the uint8 table's size is not a multiple of
# 512 bytes), a CUDA graph computing with all of them into a static output, its reference
# output, and the CPU copies of every weight.
SETUP = """
import ccalloc_torch
MiB = 1 << 20
torch.backends.cuda.matmul.allow_tf32 = False
gen = torch.Generator().manual_seed(0)
shapes = {"w1": (4096, 8192), "b1": (8192,), "w2": (8192, 16384), "b2": (16384,),
          "w3": (16384, 4096), "b3": (4096,)}
cpu = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
cpu["table"] = torch.randint(0, 256, (WEIGHT_TABLE_BYTES,), dtype=torch.uint8, generator=gen)
sp = ccalloc_torch.SleepablePool()
use_count_at_start = sp.use_count()
with sp:
    weights = {name: t.to("cuda") for name, t in cpu.items()}
x = torch.randn(64, 4096, generator=gen).cuda()

def forward():
    h1 = torch.relu(x @ weights["w1"] + weights["b1"])
    h2 = torch.relu(h1 @ weights["w2"] + weights["b2"])
    table = weights["table"][: 64 * 4096].view(64, 4096).float()
    return h2 @ weights["w3"] + weights["b3"] + table

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(2):
        eager = forward()
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = forward()
out.zero_()
graph.replay()
torch.cuda.synchronize()
reference = out.cpu()
eager = eager.cpu()
ptrs = {name: t.data_ptr() for name, t in weights.items()}

def bytes_of(t):
    return t.contiguous().view(torch.uint8)

def replayed_output():
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out.cpu()

def pool_blocks():
    return [b for s in sp.snapshot() for b in s["blocks"] if b["state"] == "active_allocated"]

def in_pool(ptr):
    return any(s["address"] <= ptr < s["address"] + s["total_size"] for s in sp.snapshot())

def pool_segment_bytes():
    return sum(s["total_size"] for s in sp.snapshot())

def reserved():
    return torch.cuda.memory_stats()["reserved_bytes.all.current"]

def allocated():
    return torch.cuda.memory_stats()["allocated_bytes.all.current"]
""".replace("WEIGHT_TABLE_BYTES", str(100 * MiB + 1234))


def test_offloaded_weights_come_back_at_the_same_addresses_and_the_graph_replays():
    r = run("ccalloc", SETUP + """
result = dict(
    graph_matches_eager=torch.allclose(reference, eager, rtol=1e-4, atol=1e-3),
    all_weights_in_pool=all(in_pool(p) for p in ptrs.values()),
    weight_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
    pool_block_bytes=sum(b["size"] for b in pool_blocks()),
    use_count_at_start=use_count_at_start)
torch.cuda.empty_cache()
torch.cuda.synchronize()
awake = sp.info()
result["pool_segment_bytes"] = pool_segment_bytes()
reserved_awake, allocated_awake = reserved(), allocated()
free_awake, _ = torch.cuda.mem_get_info()

sp.sleep(offload=True)
asleep = sp.info()
result.update(asleep_flag=sp.asleep, awake=list(awake), asleep=list(asleep),
              reserved_drop=reserved_awake - reserved(),
              allocated_change=allocated() - allocated_awake)
free_asleep, _ = torch.cuda.mem_get_info()
result["freed_on_device"] = free_asleep - free_awake

# Other tensors take the freed memory (nearly all the device's free memory, so the pages the
# pool gave back are among them), written through, then freed.
fillers, filled = [], 0
while True:
    free, _ = torch.cuda.mem_get_info()
    if free < 320 * MiB:
        break
    n = min(1 << 30, free - 256 * MiB)
    fillers.append(torch.full((n,), 0xA5, dtype=torch.uint8, device="cuda"))
    filled += n
torch.cuda.synchronize()
result["filled_beyond_free_before_sleep"] = filled - free_awake
result["fillers_hold_a5"] = all(bool((f[::4099] == 0xA5).all()) for f in fillers)
del fillers
torch.cuda.synchronize()
torch.cuda.empty_cache()

# Allocating into the sleeping pool is refused, naming the pool, and changes nothing.
try:
    with sp:
        torch.empty(MiB, dtype=torch.uint8, device="cuda")
    result["alloc_error"] = None
except RuntimeError as e:
    result["alloc_error"] = str(e)
result["use_count_after_refusal"] = sp.use_count()

sp.wake()
woken = sp.info()
result.update(woken=list(woken), asleep_after_wake=sp.asleep,
              reserved_after_wake=reserved() - reserved_awake,
              same_addresses=all(weights[n].data_ptr() == p for n, p in ptrs.items()),
              identical={n: torch.equal(bytes_of(weights[n].cpu()), bytes_of(cpu[n]))
                         for n in weights})
again = replayed_output()
result["replay_identical"] = torch.equal(bytes_of(again), bytes_of(reference))
result["replay_nonzero"] = bool((again != 0).any())
emit(pool_id=list(sp.id), **result)
""")
    assert r["graph_matches_eager"], "the captured graph does not compute what eager mode does"
    assert r["all_weights_in_pool"]
    assert r["use_count_at_start"] == 1
    # Every weight is one block of the pool: the live bytes are theirs, rounded up to 512.
    rounded = r["weight_bytes"] - (100 * MiB + 1234) + (100 * MiB + 1536)
    assert r["pool_block_bytes"] >= rounded
    awake = dict(zip(["asleep", "segment", "physical", "saved", "live"], r["awake"]))
    asleep = dict(zip(["asleep", "segment", "physical", "saved", "live"], r["asleep"]))
    woken = dict(zip(["asleep", "segment", "physical", "saved", "live"], r["woken"]))
    assert awake["live"] == r["pool_block_bytes"]
    assert awake == dict(asleep=False, segment=awake["segment"], physical=awake["segment"],
                         saved=0, live=awake["live"])
    assert awake["segment"] >= awake["live"]
    # The pool's segments (2 MiB multiples: the mapping granularity rounds nothing).
    assert awake["segment"] == r["pool_segment_bytes"]
    # Asleep: no physical memory, every live byte saved, the reservations kept.
    assert asleep == dict(asleep=True, segment=awake["segment"], physical=0,
                          saved=awake["live"], live=awake["live"])
    assert r["asleep_flag"] is True
    # Reserved memory drops by exactly the pool's segments; allocations stay live.
    assert r["reserved_drop"] == awake["segment"]
    assert r["allocated_change"] == 0
    # The device sees at least 95 % of the pool's live bytes freed.
    assert r["freed_on_device"] >= 0.95 * awake["live"], (r["freed_on_device"], awake["live"])
    # Other tensors used that memory: more than was free before the sleep.
    assert r["filled_beyond_free_before_sleep"] > 0
    assert r["fillers_hold_a5"]
    pool = "pool ({}, {})".format(*r["pool_id"])
    assert r["alloc_error"] is not None and pool in r["alloc_error"] and "asleep" in r["alloc_error"], \
        r["alloc_error"]
    assert r["use_count_after_refusal"] == 1
    # Awake again: the same memory, the same addresses, the same bytes, the same outputs.
    assert woken == awake
    assert r["asleep_after_wake"] is False
    assert r["reserved_after_wake"] == 0
    assert r["same_addresses"]
    assert r["identical"] == {n: True for n in r["identical"]} and len(r["identical"]) == 7
    assert r["replay_identical"] and r["replay_nonzero"]


def test_discarded_weights_rewritten_after_wake_replay_the_graph():
    r = run("ccalloc", SETUP + """
import gc
torch.cuda.empty_cache()
awake = sp.info()
segments = pool_segment_bytes()
sp.sleep(offload=False)
asleep = sp.info()
sp.wake()
woken = sp.info()
same_addresses = all(weights[n].data_ptr() == p for n, p in ptrs.items())
graph.replay()  # the memory is mapped and readable, its contents undefined
torch.cuda.synchronize()
for name, t in weights.items():
    t.copy_(cpu[name])
again = replayed_output()
result = dict(awake=list(awake), asleep=list(asleep), woken=list(woken), pool_segment_bytes=segments,
              same_addresses=same_addresses,
              replay_identical=torch.equal(bytes_of(again), bytes_of(reference)))
# Dropping the pool, once its tensors and the graph are gone, gives its memory back.
reserved_with_pool = reserved()
del weights, t, graph, out, again
gc.collect()
torch.cuda.empty_cache()
result["reserved_released"] = reserved_with_pool - reserved()
del sp
gc.collect()
torch.cuda.empty_cache()
result["reserved_released_with_pool"] = reserved_with_pool - reserved()
emit(**result)
""")
    keys = ["asleep", "segment", "physical", "saved", "live"]
    awake, asleep, woken = (dict(zip(keys, r[k])) for k in ("awake", "asleep", "woken"))
    assert asleep == dict(asleep=True, segment=awake["segment"], physical=0, saved=0,
                          live=awake["live"])
    assert woken == awake
    assert r["same_addresses"]
    assert r["replay_identical"]
    # The graph's pool went with the graph; the weights' pool, exactly, with its MemPool.
    assert r["reserved_released_with_pool"] - r["reserved_released"] == r["pool_segment_bytes"], r


def test_misuse_raises_with_ccalloc_message_and_leaves_the_pool_usable():
    r = run("ccalloc", """
import ccalloc_torch
MiB = 1 << 20
sp = ccalloc_torch.SleepablePool()
with sp:
    w = torch.arange(MiB, dtype=torch.int32, device="cuda")
errors = {}
def attempt(name, fn):
    try:
        fn()
        errors[name] = None
    except RuntimeError as e:
        errors[name] = str(e)
plain = torch.cuda.MemPool()
attempt("not_sleepable", lambda: ccalloc_torch.sleep_pool(plain))
attempt("unknown_pool", lambda: ccalloc_torch.sleep_pool((0, 987654321)))
attempt("wake_awake", sp.wake)
def sleep_while_allocating():
    with sp:
        sp.sleep()
attempt("sleep_while_allocating", sleep_while_allocating)
sp.sleep()
attempt("sleep_twice", sp.sleep)
attempt("use_mem_pool_asleep", lambda: torch.cuda.use_mem_pool(sp.pool).__enter__())
asleep = sp.asleep
sp.wake()
with sp:
    v = torch.ones(MiB, dtype=torch.int32, device="cuda")
emit(errors=errors, pool_id=list(sp.id), plain_id=list(plain.id),
     plain_asleep=ccalloc_torch.pool_asleep(plain), asleep=asleep, awake=not sp.asleep,
     w_kept=bool(torch.equal(w.cpu(), torch.arange(MiB, dtype=torch.int32))),
     v_in_pool=any(s["address"] <= v.data_ptr() < s["address"] + s["total_size"]
                   for s in sp.snapshot()),
     use_count=sp.use_count())
""")
    e = r["errors"]
    pool = "pool ({}, {})".format(*r["pool_id"])
    plain = "({}, {})".format(*r["plain_id"])
    assert e["not_sleepable"] and plain in e["not_sleepable"] and "not sleepable" in e["not_sleepable"], e
    assert e["unknown_pool"] and "(0, 987654321)" in e["unknown_pool"], e
    assert e["wake_awake"] and pool in e["wake_awake"] and "not asleep" in e["wake_awake"], e
    assert e["sleep_while_allocating"] and pool in e["sleep_while_allocating"], e
    assert e["sleep_twice"] and pool in e["sleep_twice"] and "already asleep" in e["sleep_twice"], e
    assert e["use_mem_pool_asleep"] and pool in e["use_mem_pool_asleep"], e
    assert r["plain_asleep"] is False
    assert r["asleep"] is True and r["awake"] is True
    assert r["w_kept"] and r["v_in_pool"]
    assert r["use_count"] == 1


def test_sleepable_pool_needs_the_native_install():
    r = run("pytorch", """
import ccalloc_torch
try:
    ccalloc_torch.SleepablePool()
    emit(error=None)
except RuntimeError as e:
    emit(error=str(e))
""")
    assert r["error"] and "installed natively" in r["error"], r
