"""CUDA tensors shared through torch.multiprocessing (spawn) between a process on ccalloc and
a process on PyTorch's allocator, in both directions: each side opens the other's memory
through its own allocator (PyTorch's shareable-handle format), sees its values and its
in-place writes. Both with native segments (handle type 'c': the segment's
cudaIpcMemHandle) and with expandable_segments:True on both sides (type 'e': the pages'
POSIX file descriptors, copied with pidfd_getfd). In the expandable runs each side first
allocates 18 MiB, so that the shared tensor straddles two 20 MiB pages at a non-zero offset."""

import pytest

from torch_compare import run, skip_without_gpu

skip_without_gpu()

PARENT = """
import torch.multiprocessing as mp
import ipc_worker
torch.cuda.set_device(DEVICE)
ctx = mp.get_context("spawn")
to_child, to_parent = ctx.Queue(), ctx.Queue()
process = ctx.Process(target=ipc_worker.child, args=(CHILD, to_child, to_parent, DEVICE))
process.start()
ALLOCATE
view = base[1000:2000]  # an offset inside the allocation, which is inside a segment
torch.cuda.synchronize()
segments = torch.cuda.memory_snapshot()
base_is_expandable = any(s["is_expandable"] for s in segments
                         if s["address"] <= base.data_ptr() < s["address"] + s["total_size"])
to_child.put(view)
reply = to_parent.get(timeout=180)
if "error" in reply:
    raise RuntimeError("child: " + reply["error"])
received = reply["tensor"]
child_backend, child_sum, child_exact = reply["backend"], reply["sum"], reply["exact"]
reply_device = reply["device"]
values = received.cpu().tolist()
del received, reply
to_child.put("done")
finished = to_parent.get(timeout=180)
if "error" in finished:
    raise RuntimeError("child: " + finished["error"])
process.join(timeout=180)
torch.cuda.synchronize()
expected = torch.arange(base.numel(), dtype=torch.float32, device="cuda")
expected[1000:2000] += 1
emit(child_backend=child_backend, child_sum=child_sum, child_exact=child_exact,
     child_device=reply_device, base_device=base.device.index,
     parent_sees_child_write=bool(torch.equal(base, expected)),
     parent_reads_child_tensor=values == [float(v) for v in range(1000, 1000 + (1 << 19))],
     base_is_expandable=base_is_expandable,
     exitcode=process.exitcode)
"""


SEGMENTS = [pytest.param(None, id="native"), pytest.param("expandable_segments:True", id="expandable")]


def parent_script(child, allocate, device=0):
    """PARENT for a child on `child`, with `allocate` (source) defining `base`, the tensor
    whose view is shared, on `device`."""
    return (f"CHILD = {child!r}\nDEVICE = {device!r}\n" +
            PARENT.replace("ALLOCATE\n", allocate + "\n"))


# In the expandable runs, 18 MiB first: the shared tensor then straddles two 20 MiB pages.
ALLOCATE = """
pad = torch.empty(18 << 20, dtype=torch.uint8, device="cuda") if EXPANDABLE else None
base = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
"""


def exchange(parent, child, conf, device=0):
    script = f"EXPANDABLE = {conf is not None!r}\n" + parent_script(child, ALLOCATE, device)
    return run(parent, script, conf=conf, timeout=600)


def check(result, child, conf, device=0):
    assert result["exitcode"] == 0
    assert result["base_device"] == device and result["child_device"] == device, result
    assert result["child_backend"] == ("ccalloc" if child == "ccalloc" else "native")
    assert result["base_is_expandable"] == (conf is not None), "the parent's tensor is in the wrong kind of segment"
    assert result["child_sum"] == sum(range(1000, 2000)), "the child read wrong values"
    assert result["child_exact"], "the child read wrong values"
    assert result["parent_sees_child_write"], "the child's in-place add did not reach the parent's tensor (or touched more)"
    assert result["parent_reads_child_tensor"], "the parent read wrong values from the child's tensor"


@pytest.mark.parametrize("conf", SEGMENTS)
@pytest.mark.parametrize("parent,child", [("ccalloc", "pytorch"), ("pytorch", "ccalloc")])
def test_cuda_tensors_cross_between_ccalloc_and_pytorch_processes(parent, child, conf):
    check(exchange(parent, child, conf), child, conf)


@pytest.mark.parametrize("conf", SEGMENTS)
def test_cuda_tensors_cross_between_two_ccalloc_processes(conf):
    check(exchange("ccalloc", "ccalloc", conf), "ccalloc", conf)


@pytest.mark.parametrize("conf", SEGMENTS)
def test_cuda_tensors_cross_between_two_pytorch_processes(conf):
    """The reference: what the tests above require of ccalloc holds for PyTorch alone."""
    check(exchange("pytorch", "pytorch", conf), "pytorch", conf)
