"""What torch.cuda's and torch.accelerator's memory functions report is the same on ccalloc as
on PyTorch's allocator after the same deterministic sequence of allocations."""

import pytest

from torch_compare import assert_same, both, skip_without_gpu

skip_without_gpu()

# Small (<= 1 MiB), large (1-10 MiB) and huge (> 10 MiB) requests, frees that split and
# merge blocks, a tensor used on a second stream with record_stream, and allocations on that
# stream. Every cross-stream free is waited for before the next allocation looks at it, so
# both allocators see completed events at the same points.
SEQUENCE = """
def sequence():
    MiB = 1 << 20
    keep = []
    t = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in
         (512, 1000, 4096, 300_000, MiB, MiB + 1, 3 * MiB, 9 * MiB, 12 * MiB, 25 * MiB + 7)]
    keep += t[::2]
    del t
    side = torch.cuda.Stream()
    shared = torch.ones(2 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        on_side = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (700, 5 * MiB)]
        shared.mul_(3)
    shared.record_stream(side)
    del shared
    torch.cuda.synchronize()
    again = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")  # after the side stream's work
    with torch.cuda.stream(side):
        del on_side[0]
        more = torch.empty(600, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    for n in (64, 128 * 1024, 8 * MiB):
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        del x
    return keep, again, on_side, more
"""


def test_memory_stats_are_equal_key_by_key_after_two_streams_with_record_stream():
    pytorch, ccalloc = both(SEQUENCE + """
held = sequence()
torch.cuda.synchronize()
emit(stats=dict(torch.cuda.memory_stats()))
""")
    assert pytorch["stats"]["allocation.all.allocated"] > 0
    assert_same(pytorch["stats"], ccalloc["stats"], "torch.cuda.memory_stats()")


def test_memory_stats_are_equal_after_empty_cache():
    pytorch, ccalloc = both(SEQUENCE + """
held = sequence()
del held
torch.cuda.synchronize()
torch.cuda.empty_cache()
emit(stats=dict(torch.cuda.memory_stats()))
""")
    assert pytorch["stats"]["reserved_bytes.all.current"] == 0
    assert_same(pytorch["stats"], ccalloc["stats"], "torch.cuda.memory_stats() after empty_cache()")


def test_allocated_reserved_and_peaks_follow_reset_peak_memory_stats():
    pytorch, ccalloc = both(SEQUENCE + """
held = sequence()
before = dict(allocated=torch.cuda.memory_allocated(), max_allocated=torch.cuda.max_memory_allocated(),
              reserved=torch.cuda.memory_reserved(), max_reserved=torch.cuda.max_memory_reserved())
del held
torch.cuda.reset_peak_memory_stats()
after = dict(allocated=torch.cuda.memory_allocated(), max_allocated=torch.cuda.max_memory_allocated(),
             reserved=torch.cuda.memory_reserved(), max_reserved=torch.cuda.max_memory_reserved())
torch.cuda.reset_accumulated_memory_stats()
emit(before=before, after=after, accumulated=torch.cuda.memory_stats()["allocation.all.allocated"])
""")
    assert pytorch["before"]["max_allocated"] > pytorch["after"]["max_allocated"]
    assert pytorch["after"]["max_allocated"] == pytorch["after"]["allocated"]
    assert_same(pytorch, ccalloc, "memory_allocated/max_memory_allocated/memory_reserved")


def test_memory_summary_is_identical():
    pytorch, ccalloc = both(SEQUENCE + """
held = sequence()
emit(summary=torch.cuda.memory_summary(), abbreviated=torch.cuda.memory_summary(abbreviated=True))
""")
    assert "Allocated memory" in pytorch["summary"]
    assert_same(pytorch["summary"], ccalloc["summary"], "memory_summary()")
    assert_same(pytorch["abbreviated"], ccalloc["abbreviated"], "memory_summary(abbreviated=True)")


def test_torch_accelerator_memory_functions_reach_the_installed_allocator():
    pytorch, ccalloc = both(SEQUENCE + """
held = sequence()
acc = torch.accelerator
values = dict(allocated=acc.memory_allocated(), max_allocated=acc.max_memory_allocated(),
              reserved=acc.memory_reserved(), max_reserved=acc.max_memory_reserved(),
              stats=dict(acc.memory_stats()))
cuda_allocated = torch.cuda.memory_allocated()
del held
torch.cuda.synchronize()
acc.empty_cache()
acc.reset_peak_memory_stats()
emit(values=values, cuda_allocated=cuda_allocated, reserved_after_empty=torch.cuda.memory_reserved(),
     max_allocated_after_reset=acc.max_memory_allocated())
""")
    # On ccalloc, torch.accelerator must see ccalloc's numbers, not an idle native allocator's.
    assert ccalloc["values"]["allocated"] == ccalloc["cuda_allocated"] > 0
    assert ccalloc["reserved_after_empty"] == pytorch["reserved_after_empty"]
    assert_same(pytorch["values"]["stats"], ccalloc["values"]["stats"], "torch.accelerator.memory_stats()")
    del pytorch["values"]["stats"], ccalloc["values"]["stats"]
    assert_same(pytorch, ccalloc, "torch.accelerator memory functions")


def test_caching_allocator_alloc_and_delete_are_served_by_the_allocator():
    pytorch, ccalloc = both("""
stream = torch.cuda.Stream()
p = torch.cuda.caching_allocator_alloc(3 << 20)
q = torch.cuda.caching_allocator_alloc(1000, device=0, stream=stream)
during = dict(torch.cuda.memory_stats())
torch.cuda.caching_allocator_delete(p)
torch.cuda.caching_allocator_delete(q)
emit(during=during, after=dict(torch.cuda.memory_stats()))
""")
    assert pytorch["during"]["allocation.all.current"] == 2
    assert pytorch["after"]["allocation.all.current"] == 0
    assert_same(pytorch["during"], ccalloc["during"], "memory_stats() while held")
    assert_same(pytorch["after"], ccalloc["after"], "memory_stats() after caching_allocator_delete")


def test_per_process_memory_fraction_is_set_read_back_and_enforced():
    pytorch, ccalloc = both("""
total = torch.cuda.get_device_properties(0).total_memory
default = torch.cuda.get_per_process_memory_fraction()
torch.cuda.set_per_process_memory_fraction(0.25)
fraction = torch.cuda.get_per_process_memory_fraction()
small = torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
try:
    big = torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
    refused = None
except torch.OutOfMemoryError as e:
    refused = type(e).__name__
emit(default=default, fraction=fraction, refused=refused)
""")
    assert pytorch == {"default": 1.0, "fraction": 0.25, "refused": "OutOfMemoryError"}
    assert_same(pytorch, ccalloc, "memory fraction")


def test_out_of_memory_raises_torch_out_of_memory_error_and_calls_observers():
    pytorch, ccalloc = both("""
seen = []
torch._C._cuda_attach_out_of_memory_observer(
    lambda device, alloc, device_total, device_free: seen.append([device, alloc]))
torch.empty(1, device="cuda")
request = 1 << 50  # 1 PiB: more than any device
try:
    torch.empty(request, dtype=torch.uint8, device="cuda")
    error = None
except torch.OutOfMemoryError as e:
    error = dict(type=type(e).__name__, is_runtime_error=isinstance(e, RuntimeError), message=str(e))
emit(error=error, seen=seen, num_ooms=torch.cuda.memory_stats()["num_ooms"])
""")
    for run in (pytorch, ccalloc):
        assert run["error"]["type"] == "OutOfMemoryError"
        assert run["error"]["is_runtime_error"]
        assert run["error"]["message"].startswith("CUDA out of memory")
        assert "Tried to allocate 1048576.00 GiB" in run["error"]["message"], run["error"]["message"]
        assert run["num_ooms"] == 1
    assert_same(pytorch["seen"], ccalloc["seen"], "OOM observer calls (device, bytes)")


def test_allocator_settings_changed_while_the_allocator_is_live_apply_to_new_segments():
    # vLLM's pattern: expandable_segments toggled with tensors of both kinds alive.
    pytorch, ccalloc = both("""
x = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.memory._set_allocator_settings("expandable_segments:True")
y = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.memory._set_allocator_settings("expandable_segments:False,max_split_size_mb:64")
z = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
segments = torch.cuda.memory._snapshot()["segments"]
def kind(t):
    p = t.data_ptr()
    return next(s["is_expandable"] for s in segments if s["address"] <= p < s["address"] + s["total_size"])
emit(kinds=[kind(x), kind(y), kind(z)], stats=dict(torch.cuda.memory_stats()))
""")
    assert pytorch["kinds"] == [False, True, False], pytorch["kinds"]
    assert_same(pytorch["kinds"], ccalloc["kinds"], "is_expandable of x, y, z")
    assert_same(pytorch["stats"], ccalloc["stats"], "memory_stats() after live setting changes")


def test_allocator_settings_set_at_run_time_reach_the_allocator():
    pytorch, ccalloc = both("""
torch.cuda.memory._set_allocator_settings("expandable_segments:True")
x = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
y = torch.empty(300, dtype=torch.uint8, device="cuda")
segments = torch.cuda.memory._snapshot()["segments"]
emit(expandable=sorted(s["is_expandable"] for s in segments),
     settings=torch.cuda.memory._snapshot()["allocator_settings"]["expandable_segments"],
     stats=dict(torch.cuda.memory_stats()))
""")
    assert pytorch["expandable"] and all(pytorch["expandable"])
    assert_same(pytorch["expandable"], ccalloc["expandable"], "is_expandable of the segments")
    assert_same(pytorch["settings"], ccalloc["settings"], "allocator_settings.expandable_segments")
    assert_same(pytorch["stats"], ccalloc["stats"], "memory_stats() with expandable segments")


def test_max_split_size_reports_the_value_the_allocator_was_created_with():
    # PyTorch creates its device allocators when CUDA initialises and memory_stats() keeps the
    # max_split_size of that moment; a value set at run time applies (oversize blocks) but is
    # not reported, before the first allocation or after it.
    pytorch, ccalloc = both("""
torch.cuda.init()
before = torch.cuda.memory_stats().get("max_split_size")
torch.cuda.memory._set_allocator_settings("max_split_size_mb:40")
first = torch.cuda.memory_stats().get("max_split_size")
x = torch.empty(50 << 20, dtype=torch.uint8, device="cuda")
del x
y = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")  # may not split the 50 MiB block
emit(before=before, first=first, after=torch.cuda.memory_stats()["max_split_size"],
     stats=dict(torch.cuda.memory_stats()))
""")
    assert pytorch["before"] == pytorch["first"] == pytorch["after"] == -1, pytorch
    assert_same(pytorch, ccalloc, "max_split_size and memory_stats() after a run-time change")


# Three streams, small and large tensors, record_stream onto the other streams, frees in
# batches: several blocks whose events complete together are returned by one malloc's
# event processing, whose order decides intermediate peaks (inactive_split among them).
# Each batch of frees is followed by a synchronize, so both allocators find the same events
# completed at the same malloc.
THREE_STREAMS = """
import random
def three_streams(seed, batched=True):
    rng = random.Random(seed)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()]
    live = []
    for step in range(400):
        if rng.random() < 0.55 or not live:
            s = rng.randrange(3)
            kind = rng.random()
            n = (rng.randrange(1, 8192) if kind < 0.45 else rng.randrange(8192, 1 << 20)
                 if kind < 0.8 else rng.randrange(1 << 20, 12 << 20))
            with torch.cuda.stream(streams[s]):
                t = torch.empty(n, dtype=torch.uint8, device="cuda")
            for other in range(3):
                if other != s and rng.random() < 0.25:
                    with torch.cuda.stream(streams[other]):
                        t.fill_(other)
                    t.record_stream(streams[other])
            live.append(t)
        else:
            for _ in range(rng.randrange(1, 5)):
                if live:
                    live.pop(rng.randrange(len(live)))
                    if not batched:
                        torch.cuda.synchronize()
                        # A malloc returns the block before the next free (PyTorch polls
                        # events at every malloc).
                        torch.empty(1, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
    return live
"""


@pytest.mark.parametrize("batched", [False, True], ids=["one-free-at-a-time", "batched-frees"])
def test_memory_stats_are_equal_after_three_streams_with_record_stream(batched):
    pytorch, ccalloc = both(f"BATCHED = {batched!r}\n" + THREE_STREAMS + """
out = {}
for seed in range(4):
    held = three_streams(seed, BATCHED)
    torch.cuda.synchronize()
    out[seed] = dict(torch.cuda.memory_stats())
    del held
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
emit(stats=out)
""")
    # With several cross-stream frees completing at one malloc, the blocks return in the
    # order of PyTorch's hash table of streams, which ccalloc reproduces from the streams'
    # keys (docs/pytorch-behaviour.md, section 2.10): the merges of neighbouring blocks, and
    # inactive_split's counts with them, are PyTorch's.
    for seed in pytorch["stats"]:
        p, c = pytorch["stats"][seed], ccalloc["stats"][seed]
        assert p["allocation.all.allocated"] > 0
        assert_same(p, c, f"torch.cuda.memory_stats() after three streams, seed {seed}")
