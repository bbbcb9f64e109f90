"""CUDA graph capture, torch.compile(mode="reduce-overhead") and torch.cuda.MemPool on ccalloc:
the same outputs as on PyTorch's allocator, and pools that keep their memory apart. These go
through the allocator's private pools (beginAllocateToPool, createOrIncrefPool,
checkPoolLiveAllocations, checkpoints)."""

import pytest

from torch_compare import assert_same, both, skip_without_gpu

skip_without_gpu()

MLP = """
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 10)).cuda()
inputs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)).cuda() for i in range(4)]
with torch.no_grad():
    eager = [model(x).cpu() for x in inputs]
"""

# Warms `model` up on `static_in` on a side stream, as torch.cuda.graph asks, and captures
# `static_out = model(static_in)` into `graph`.
CAPTURE = """
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side), torch.no_grad():
    for _ in range(3):
        model(static_in)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.no_grad(), torch.cuda.graph(graph):
    static_out = model(static_in)
"""


def max_difference(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_cuda_graph_of_a_small_mlp_replays_like_eager():
    pytorch, ccalloc = both(MLP + """
static_in = inputs[0].clone()
""" + CAPTURE + """
replayed = []
for x in inputs:
    static_in.copy_(x)
    graph.replay()
    replayed.append(static_out.cpu())
torch.cuda.synchronize()
emit(equal_to_eager=all(torch.equal(r, e) for r, e in zip(replayed, eager)),
     first=replayed[0][0].tolist(), pool_reserved=torch.cuda.memory_reserved() > 0)
graph.reset()
""")
    assert pytorch["equal_to_eager"] and ccalloc["equal_to_eager"]
    assert max(abs(a - b) for a, b in zip(pytorch["first"], ccalloc["first"])) < 1e-5
    assert_same(pytorch["pool_reserved"], ccalloc["pool_reserved"], "memory reserved with a live graph")


# Shared with test_default_policy.py, which runs them under the `ccalloc` preset.
COMPILE = MLP + """
compiled = torch.compile(model, mode="reduce-overhead")
outs = []
with torch.no_grad():
    for _ in range(3):  # warm-up, recording, replays
        outs = [compiled(x).clone().cpu() for x in inputs]
emit(close_to_eager=all(torch.allclose(o, e, atol=1e-5, rtol=1e-5) for o, e in zip(outs, eager)),
     first=outs[0][0].tolist())
"""

MEMPOOL_ISOLATION = """
MiB = 1 << 20
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    inside = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
outside = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
def in_pool(ptr):
    return any(s["address"] <= ptr < s["address"] + s["total_size"] for s in pool.snapshot())
inside_ptr = inside.data_ptr()
result = dict(inside_in_pool=in_pool(inside_ptr), outside_in_pool=in_pool(outside.data_ptr()),
              use_count=pool.use_count())
del inside
torch.cuda.synchronize()
after = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
result["default_pool_reused_pool_memory"] = after.data_ptr() == inside_ptr
with torch.cuda.use_mem_pool(pool):
    again = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
result["pool_reused_its_block"] = again.data_ptr() == inside_ptr
emit(**result)
"""

# What MEMPOOL_ISOLATION reports on PyTorch's allocator, use_count aside.
MEMPOOL_ISOLATED = {"inside_in_pool": True, "outside_in_pool": False,
                    "default_pool_reused_pool_memory": False, "pool_reused_its_block": True}


def without_use_count(result):
    return {k: v for k, v in result.items() if k != "use_count"}


def test_torch_compile_reduce_overhead_gives_the_same_outputs():
    pytorch, ccalloc = both(COMPILE, timeout=900)
    assert pytorch["close_to_eager"] and ccalloc["close_to_eager"]
    assert max(abs(a - b) for a, b in zip(pytorch["first"], ccalloc["first"])) < 1e-5


def test_mempool_keeps_its_allocations_apart_from_the_default_pool():
    pytorch, ccalloc = both(MEMPOOL_ISOLATION)
    assert without_use_count(pytorch) == MEMPOOL_ISOLATED
    assert_same(pytorch, ccalloc, "MemPool isolation")


def test_graphs_sharing_a_pool_reuse_its_memory_and_give_it_back_after_reset():
    # torch.cuda.graph(g2, pool=g1.pool()): the second capture allocates from the first's
    # private pool (a second use of it), may reuse what the first freed, and the pool's
    # memory returns to the device only after both graphs are reset and the cache emptied.
    pytorch, ccalloc = both("""
MiB = 1 << 20
static = torch.ones(MiB, device="cuda")
torch.cuda.synchronize()
reserved_before = torch.cuda.memory_reserved()
g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
with torch.cuda.graph(g1):
    tmp = static * 2
    tmp_ptr = tmp.data_ptr()
    out1 = tmp + 1
    del tmp
with torch.cuda.graph(g2, pool=g1.pool()):
    out2 = out1 * 3
g1.replay()
g2.replay()
torch.cuda.synchronize()
def pool_of(ptr):
    for s in torch.cuda.memory._snapshot()["segments"]:
        if s["address"] <= ptr < s["address"] + s["total_size"]:
            return list(s.get("segment_pool_id", (0, 0)))
    return None
result = dict(out2=out2[0].item(), out2_reuses_tmp=out2.data_ptr() == tmp_ptr,
              out1_pool_is_g1=pool_of(out1.data_ptr()) == list(g1.pool()),
              out2_pool_is_g1=pool_of(out2.data_ptr()) == list(g1.pool()),
              static_in_default=pool_of(static.data_ptr()) == [0, 0],
              reserved_with_graphs=torch.cuda.memory_reserved() - reserved_before)
del out1, out2
g1.reset()
torch.cuda.empty_cache()
result["reserved_with_one_graph"] = torch.cuda.memory_reserved() - reserved_before
g2.reset()
torch.cuda.empty_cache()
result["reserved_after_reset"] = torch.cuda.memory_reserved() - reserved_before
emit(**result)
""")
    assert pytorch["out2"] == 9.0 and pytorch["out1_pool_is_g1"] and pytorch["out2_pool_is_g1"]
    # What each step keeps reserved is PyTorch's to say (torch 2.11 keeps 2 MiB after both
    # resets): ccalloc must keep the same.
    assert_same(pytorch, ccalloc, "graphs sharing a pool")


def test_mempool_with_an_allocator_takes_its_segments_from_it():
    # MemPool(allocator=...): the pool's segments come from another allocator's raw_alloc /
    # raw_delete; here libccalloc.so's C entry points through CUDAPluggableAllocator.
    import os
    import pytest
    lib_dir = os.environ.get("CCALLOC_LIBRARY_DIR")
    if not lib_dir or not os.path.exists(os.path.join(lib_dir, "libccalloc.so")):
        pytest.skip("CCALLOC_LIBRARY_DIR does not hold libccalloc.so")
    pytorch, ccalloc = both(f"""
import gc
MiB = 1 << 20
lib = os.path.join({lib_dir!r}, "libccalloc.so")
other = torch.cuda.memory.CUDAPluggableAllocator(lib, "ccalloc_torch_alloc", "ccalloc_torch_free")
pool = torch.cuda.MemPool(other.allocator())
with torch.cuda.use_mem_pool(pool):
    x = torch.ones(3 * MiB, dtype=torch.uint8, device="cuda")
segments = pool.snapshot()
emit(total=int(x.sum()), pool_segments=len(segments),
     x_in_pool=any(s["address"] <= x.data_ptr() < s["address"] + s["total_size"] for s in segments),
     use_count=pool.use_count())
del x
del pool
gc.collect()
torch.cuda.empty_cache()
emit(done=True)
""")
    assert pytorch["x_in_pool"] and pytorch["total"] == 3 * (1 << 20)
    assert_same(pytorch, ccalloc, "MemPool with an allocator")


MEMPOOL_OPTIONS = """
import inspect
def mem_pool(**options):
    accepted = inspect.signature(torch.cuda.MemPool.__init__).parameters
    missing = [k for k in options if k not in accepted]
    if missing:
        emit(missing=missing)
        sys.exit(0)
    return torch.cuda.MemPool(**options)
MiB = 1 << 20
def pool_layout(pool):
    return sorted([s["total_size"], [[b["size"], b["state"]] for b in s["blocks"]]]
                  for s in pool.snapshot())
"""


def _skip_if_missing(run):
    if run.get("missing"):
        import pytest
        pytest.skip(f"this torch's MemPool has no {run['missing']}")


@pytest.mark.parametrize("use_on_oom", [False, True])
def test_mempool_use_on_oom_serves_a_default_pool_request_that_would_fail(use_on_oom):
    # MemPool(use_on_oom=True): when a request outside the pool would raise OOM (here capped
    # by the memory fraction), a free block of the pool serves it instead.
    pytorch, ccalloc = both(MEMPOOL_OPTIONS + f"""
pool = mem_pool(use_on_oom={use_on_oom})
with torch.cuda.use_mem_pool(pool):
    p = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
del p
torch.cuda.synchronize()
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 8 * MiB) / total)
try:
    x = torch.empty(60 * MiB, dtype=torch.uint8, device="cuda")
    served, from_pool = True, any(s["address"] <= x.data_ptr() < s["address"] + s["total_size"]
                                  for s in pool.snapshot())
except torch.OutOfMemoryError:
    served, from_pool = False, False
emit(served=served, from_pool=from_pool, pool=pool_layout(pool),
     reserved=torch.cuda.memory_reserved(), num_ooms=torch.cuda.memory_stats()["num_ooms"])
""")
    _skip_if_missing(pytorch)
    if not use_on_oom:
        assert pytorch["served"] is False, pytorch
    assert_same(pytorch, ccalloc, f"MemPool(use_on_oom={use_on_oom}) under a memory cap")


@pytest.mark.parametrize("no_split", [False, True])
def test_mempool_no_split_keeps_blocks_whole(no_split):
    pytorch, ccalloc = both(MEMPOOL_OPTIONS + f"""
pool = mem_pool(no_split={no_split})
with torch.cuda.use_mem_pool(pool):
    big = torch.empty(10 * MiB, dtype=torch.uint8, device="cuda")
    big_ptr = big.data_ptr()
    del big
    torch.cuda.synchronize()
    small = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    tiny = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
emit(small_reuses_big=small.data_ptr() == big_ptr, pool=pool_layout(pool),
     stats={{k: v for k, v in torch.cuda.memory_stats().items() if k.startswith(("segment", "reserved", "active_bytes", "inactive_split"))}})
""")
    _skip_if_missing(pytorch)
    assert pytorch["small_reuses_big"], pytorch
    assert_same(pytorch, ccalloc, f"MemPool(no_split={no_split})")


def test_max_memory_allocated_counts_default_and_mempool_blocks_together():
    # Under the ccalloc preset the default pool and MemPools are two engines; the device's
    # peak of allocated bytes is still that of their blocks together, as PyTorch reports it.
    pytorch, ccalloc = both("""
MiB = 1 << 20
peaks = []
x = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
del x
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    y = torch.empty(60 * MiB, dtype=torch.uint8, device="cuda")
peaks.append(torch.cuda.max_memory_allocated())   # 100 MiB, then 60: never 160
z = torch.empty(50 * MiB, dtype=torch.uint8, device="cuda")
peaks.append(torch.cuda.max_memory_allocated())   # 60 + 50 = 110
del y, z
w = torch.empty(150 * MiB, dtype=torch.uint8, device="cuda")
peaks.append(torch.cuda.max_memory_allocated())   # 150
stats = torch.cuda.memory_stats()
emit(peaks=peaks, blocks=stats["allocation.all.peak"], active=stats["active_bytes.all.peak"])
""", preset="ccalloc")
    MiB = 1 << 20
    assert pytorch["peaks"] == [100 * MiB, 110 * MiB, 150 * MiB]
    assert_same(pytorch, ccalloc, "max_memory_allocated over the default pool and a MemPool")
