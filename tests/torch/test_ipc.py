"""CUDA tensors shared through torch.multiprocessing (spawn) between a process on ccalloc and
a process on PyTorch's allocator, in both directions: each side opens the other's memory
through its own allocator (PyTorch's shareable-handle format), sees its values and its
in-place writes."""

import pytest

from torch_compare import run, skip_without_gpu

skip_without_gpu()

PARENT = """
import torch.multiprocessing as mp
import ipc_worker
ctx = mp.get_context("spawn")
to_child, to_parent = ctx.Queue(), ctx.Queue()
process = ctx.Process(target=ipc_worker.child, args=(CHILD, to_child, to_parent))
process.start()
base = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
view = base[1000:2000]  # an offset inside the allocation, which is inside a segment
torch.cuda.synchronize()
to_child.put(view)
reply = to_parent.get(timeout=180)
if "error" in reply:
    raise RuntimeError("child: " + reply["error"])
received = reply["tensor"]
child_backend, child_sum = reply["backend"], reply["sum"]
values = received.cpu().tolist()
del received, reply
to_child.put("done")
finished = to_parent.get(timeout=180)
if "error" in finished:
    raise RuntimeError("child: " + finished["error"])
process.join(timeout=180)
torch.cuda.synchronize()
emit(child_backend=child_backend, child_sum=child_sum, parent_sees_child_write=bool(
         torch.equal(base[1000:2000], torch.arange(1000, 2000, dtype=torch.float32, device="cuda") + 1)),
     parent_reads_child_tensor=values == [float(v) for v in range(1000, 1010)],
     exitcode=process.exitcode)
"""


@pytest.mark.parametrize("parent,child", [("ccalloc", "pytorch"), ("pytorch", "ccalloc")])
def test_cuda_tensors_cross_between_ccalloc_and_pytorch_processes(parent, child):
    result = run(parent, f"CHILD = {child!r}\n" + PARENT, timeout=600)
    assert result["exitcode"] == 0
    assert result["child_backend"] == ("ccalloc" if child == "ccalloc" else "native")
    assert result["child_sum"] == sum(range(1000, 2000)), "the child read wrong values"
    assert result["parent_sees_child_write"], "the child's in-place add did not reach the parent's tensor"
    assert result["parent_reads_child_tensor"], "the parent read wrong values from the child's tensor"


@pytest.mark.parametrize("parent,child", [("ccalloc", "ccalloc")])
def test_cuda_tensors_cross_between_two_ccalloc_processes(parent, child):
    result = run(parent, f"CHILD = {child!r}\n" + PARENT, timeout=600)
    assert result["exitcode"] == 0
    assert result["child_backend"] == "ccalloc"
    assert result["child_sum"] == sum(range(1000, 2000))
    assert result["parent_sees_child_write"] and result["parent_reads_child_tensor"]
