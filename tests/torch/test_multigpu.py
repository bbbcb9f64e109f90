"""Two devices in one process, as PyTorch's multi-GPU suite observes its allocator: statistics
kept per device while both devices allocate in lockstep and interleaved (every statistic
rebuilt from that device's segments of the snapshot after every step), allocations counted on
their own device only, the driver's free memory per device, stream-ordered reuse on the
second device, and empty_cache and snapshots over both devices. Each script runs on
PyTorch's allocator and on ccalloc in fresh processes; PyTorch must observe the same on both.
Skipped with fewer than two GPUs."""

import pytest

from torch_compare import STAT_CONSISTENCY, assert_same, both, run, skip_without_gpu

skip_without_gpu()


def _device_count():
    import torch
    return torch.cuda.device_count()


pytestmark = pytest.mark.skipif(_device_count() < 2, reason="needs two CUDA devices")

# PyTorch's statistics generator, one Python generator per device: each step allocates or
# frees on that device only and checks, on that device, the direction of memory_allocated,
# the peaks, and every statistic rebuilt from the device's segments of the snapshot; the
# other device's statistics must not move.
PER_DEVICE = STAT_CONSISTENCY + """
import gc, random
problems = []
def generator(device):
    other = 1 - device
    last = torch.cuda.memory_allocated(device)
    def alloc(*size):
        # The device per allocation, as PyTorch's suite does: the generators interleave.
        with torch.cuda.device(device):
            return torch.cuda.FloatTensor(*size)
    def check(step, change):
        nonlocal last
        allocated = torch.cuda.memory_allocated(device)
        name = "cuda:%d %s" % (device, step)
        if change == "up" and not allocated > last: problems.append(name + ": did not rise")
        if change == "down" and not allocated < last: problems.append(name + ": did not fall")
        if change == "same" and allocated != last: problems.append(name + ": changed")
        if allocated > torch.cuda.max_memory_allocated(device): problems.append(name + ": above peak")
        if torch.cuda.memory_reserved(device) > torch.cuda.max_memory_reserved(device):
            problems.append(name + ": reserved above peak")
        problems.extend(name + ": " + m for m in stat_mismatches(device))
        last = allocated
    keep = []
    for i in range(1, 12):
        before_other = torch.cuda.memory_allocated(other)
        keep.append(alloc(i, 4 * i)); check("small %d" % i, "up")
        if torch.cuda.memory_allocated(other) != before_other:
            problems.append("cuda:%d small %d moved cuda:%d" % (device, i, other))
        yield
    for i in range(5, 16):
        keep.append(alloc(i, 7 * i, 9 * i, 11 * i)); check("large %d" % i, "up")
        yield
    keep.append(alloc(0, 0, 0)); check("no elements", "same")
    yield
    keep = keep[: len(keep) // 2]; check("free half", "down")
    yield
    more = [alloc(i, 3 * i, 8 * i) for i in range(2, 20)]
    check("again", "up")
    yield
    more = None; keep = None; check("free all", "down")
    yield

gc.collect()
torch.cuda.empty_cache()
# In lockstep, then interleaved at random (seeded), as PyTorch's suite runs them.
for steps in zip(generator(0), generator(1)):
    pass
gens = [generator(0), generator(1)]
rng = random.Random(5)
while gens:
    g = rng.choice(gens)
    try:
        next(g)
    except StopIteration:
        gens.remove(g)
torch.cuda.empty_cache()
emit(problems=problems,
     reserved_after_empty=[torch.cuda.memory_reserved(0), torch.cuda.memory_reserved(1)],
     allocated=[torch.cuda.memory_allocated(0), torch.cuda.memory_allocated(1)])
"""


@pytest.mark.parametrize("preset", ["pytorch", "ccalloc"])
def test_statistics_are_per_device_in_lockstep_and_interleaved(preset):
    pytorch, ccalloc = both(PER_DEVICE, preset=preset)
    assert pytorch["problems"] == [], pytorch["problems"]
    assert ccalloc["problems"] == [], ccalloc["problems"]
    assert_same(pytorch, ccalloc, "per-device statistics")


# A tensor counts on its own device only, queried by index and by device context; the driver's
# free memory falls on the device that allocated (PyTorch's test_mem_get_info and
# test_cuda_device_memory_allocated).
COUNTED_ON_ITS_DEVICE = """
got = {}
for device in (0, 1):
    before = [torch.cuda.memory_allocated(d) for d in (0, 1)]
    t = torch.ones(10, device="cuda:%d" % device)
    after = [torch.cuda.memory_allocated(d) for d in (0, 1)]
    by_context = [torch.cuda.memory_allocated(torch.cuda.device(d)) for d in (0, 1)]
    got["cuda:%d" % device] = [a - b for a, b in zip(after, before)]
    got["by context %d" % device] = by_context == after
    del t
for device in (0, 1):
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    free0, total0 = torch.cuda.mem_get_info(device)
    t = torch.randn(8 * 1024 * 1024, device="cuda:%d" % device)
    torch.cuda.synchronize(device)
    free1, total1 = torch.cuda.mem_get_info(device)
    got["mem_get_info %d" % device] = [free1 < free0, total1 == total0]
    del t
emit(got=got)
"""


@pytest.mark.whole_device
@pytest.mark.parametrize("preset", ["pytorch", "ccalloc"])
def test_allocations_count_on_their_device_only(preset):
    pytorch, ccalloc = both(COUNTED_ON_ITS_DEVICE, preset=preset)
    assert pytorch["got"]["cuda:0"][1] == 0 and pytorch["got"]["cuda:1"][0] == 0, pytorch["got"]
    assert_same(pytorch["got"], ccalloc["got"], "allocations per device")


# Stream-ordered reuse on the second device: a block used on a side stream of cuda:1 and freed
# is not handed out again on cuda:1's current stream until the side stream's work is done.
SECOND_DEVICE_STREAMS = """
got = {}
with torch.cuda.device(1):
    # Load the kernels first: a kernel's first launch loads its module (lazy loading), which
    # waits for the device, and would let the side stream finish early.
    warm = torch.ones(4, device="cuda:1")
    warm.add_(1)
    torch.cuda._sleep(1)
    torch.cuda.synchronize(1)
    del warm
    side = torch.cuda.Stream()
    x = torch.empty(1 << 20, device="cuda:1")
    p = x.data_ptr()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(200e6))  # keeps the side stream busy
        x.add_(1)
    x.record_stream(side)
    del x
    y = torch.empty(1 << 20, device="cuda:1")
    got["reused while busy"] = y.data_ptr() == p
    side.synchronize()
    del y
    z = torch.empty(1 << 20, device="cuda:1")
    got["on cuda:1"] = z.device.index == 1
    got["reused after"] = z.data_ptr() == p
    got["cuda:0 untouched"] = torch.cuda.memory_allocated(0) == 0
emit(got=got)
"""


def test_record_stream_on_the_second_device():
    pytorch, ccalloc = both(SECOND_DEVICE_STREAMS)
    assert pytorch["got"]["reused while busy"] is False, pytorch["got"]
    assert_same(pytorch["got"], ccalloc["got"], "record_stream on cuda:1")


def test_record_stream_on_the_second_device_default_preset():
    got = run("ccalloc", SECOND_DEVICE_STREAMS, preset="ccalloc")["got"]
    assert got["reused while busy"] is False, got
    assert got["on cuda:1"] and got["cuda:0 untouched"], got


# empty_cache() empties every device's cache; the snapshot names each segment's device;
# per-device resets touch their device only.
BOTH_DEVICES = """
a = torch.empty(3 << 20, device="cuda:0")
b = torch.empty(5 << 20, device="cuda:1")
c = torch.empty(100, device="cuda:1")
snapshot = torch.cuda.memory_snapshot()
devices = sorted({s["device"] for s in snapshot})
found = {}
for s in snapshot:
    for blk in s["blocks"]:
        if blk["state"] == "active_allocated":
            found.setdefault(s["device"], []).append(blk["requested_size"])
peaks = [torch.cuda.max_memory_allocated(0), torch.cuda.max_memory_allocated(1)]
del a
torch.cuda.reset_peak_memory_stats(0)
after_reset = [torch.cuda.max_memory_allocated(0), torch.cuda.max_memory_allocated(1)]
del b, c
torch.cuda.empty_cache()
emit(devices=devices, found={str(k): sorted(v) for k, v in found.items()},
     peak_reset_is_per_device=[after_reset[0] == torch.cuda.memory_allocated(0) == 0,
                               after_reset[1] == peaks[1]],
     reserved=[torch.cuda.memory_reserved(0), torch.cuda.memory_reserved(1)])
"""


@pytest.mark.parametrize("preset", ["pytorch", "ccalloc"])
def test_empty_cache_and_snapshots_cover_both_devices(preset):
    pytorch, ccalloc = both(BOTH_DEVICES, preset=preset)
    assert pytorch["devices"] == [0, 1], pytorch
    assert pytorch["reserved"] == [0, 0], pytorch
    assert_same(pytorch, ccalloc, "both devices")


# Copies between the devices: torch enables peer access through the allocator
# (enablePeerAccess) and copies through its memcpyAsync, from and to native and
# expandable memory, whole tensors and views at an offset.
CROSS_DEVICE = """
got = {}
for src, dst in [(0, 1), (1, 0)]:
    x = torch.arange(5 << 20, dtype=torch.float32, device=f"cuda:{src}")
    y = x.to(f"cuda:{dst}")
    z = torch.empty(1000, dtype=torch.float32, device=f"cuda:{dst}")
    z.copy_(x[12345:13345], non_blocking=True)
    back = y.to(f"cuda:{src}")
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    got[f"{src}->{dst}"] = [y.device.index, bool(torch.equal(back, x)), z.sum().item(),
                            float(y[-1].item())]
got["peer"] = [torch.cuda.can_device_access_peer(0, 1), torch.cuda.can_device_access_peer(1, 0)]
emit(got=got)
"""


@pytest.mark.parametrize("conf", [None, "expandable_segments:True"])
@pytest.mark.parametrize("preset", ["pytorch", "ccalloc"])
def test_copies_between_the_devices(preset, conf):
    pytorch, ccalloc = both(CROSS_DEVICE, conf=conf, preset=preset)
    expected_view = float(sum(range(12345, 13345)))
    assert pytorch["got"]["0->1"] == [1, True, expected_view, float((5 << 20) - 1)], pytorch
    assert pytorch["got"]["1->0"] == [0, True, expected_view, float((5 << 20) - 1)], pytorch
    assert_same(pytorch, ccalloc, "copies between the devices")


# A tensor on the second device shared over torch.multiprocessing with a process on the
# other allocator, both ways, native and expandable (test_ipc.py's exchange, on cuda:1).
@pytest.mark.parametrize("conf", [None, "expandable_segments:True"], ids=["native", "expandable"])
@pytest.mark.parametrize("parent,child", [("ccalloc", "pytorch"), ("pytorch", "ccalloc")])
def test_tensors_on_the_second_device_cross_between_processes(parent, child, conf):
    from test_ipc import check, exchange
    check(exchange(parent, child, conf, device=1), child, conf, device=1)
