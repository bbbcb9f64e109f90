"""ccalloc as CuPy's allocator beside PyTorch (ccalloc_torch/cupy.py), on a GPU with CuPy, each
case in fresh processes:
- CuPy's kernels give on ccalloc's memory what they give on CuPy's own pool;
- memory freed on one stream is not overwritten by another stream while the first stream's
  queued work still reads it, with and without record_stream;
- arrays cross to torch and back through DLPack with no copy and live while either side
  holds them; CuPy's memory counts in torch.cuda.memory_stats() and torch.cuda.empty_cache()
  releases what CuPy freed;
- a job whose CuPy part fills and frees 60 % of the GPU and whose torch part then asks for
  60 % runs out of memory with two caches and runs with one;
- CCALLOC_ENABLE=1 covers CuPy with no code."""

import os
import textwrap

import pytest

from torch_compare import BINDINGS, run_fresh, skip_without_gpu

skip_without_gpu()
pytest.importorskip("cupy")


def run_python(code, ccalloc=True, env_extra=None, timeout=300):
    """Runs `code` in a fresh interpreter; with `ccalloc`, ccalloc is torch's allocator
    (native) and CuPy's before the code runs. Returns (returncode, stdout, stderr)."""
    prelude = f"import sys; sys.path.insert(0, {BINDINGS!r})\n"
    if ccalloc:
        prelude += ("import ccalloc_torch, ccalloc_torch.cupy\n"
                    "assert ccalloc_torch.install() == 'native'\n"
                    "assert ccalloc_torch.cupy.install() == 'cupy'\n")
    return run_fresh(prelude, code, env_extra, timeout)


KERNELS = """
    import cupy, hashlib
    cupy.random.seed(0)
    a = cupy.random.standard_normal((513, 257), dtype=cupy.float32)
    b = cupy.random.standard_normal((257, 129), dtype=cupy.float32)
    square = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x * x", "square")
    outs = [a, b, a @ b, cupy.sort(a, axis=1), a.sum(axis=0), square(a), cupy.cumsum(a.ravel()),
            cupy.fft.rfft(a, axis=1).real.astype(cupy.float32)]
    print(" ".join(hashlib.sha256(cupy.asnumpy(o).tobytes()).hexdigest()[:16] for o in outs))
"""
OUTPUTS = ["a", "b", "a @ b", "sort", "sum", "square", "cumsum", "rfft"]


def test_kernels_give_what_they_give_on_cupys_pool():
    # torch first in both runs: the ccalloc run imports it before CuPy (install()), and
    # torch's wheels bring CUDA libraries (cuBLAS, cuFFT) of their own, which CuPy then
    # finds loaded; their kernels may round otherwise than the ones CuPy loads alone.
    rc, pool, err = run_python("\n    import torch" + KERNELS, ccalloc=False)
    assert rc == 0, err
    rc, out, err = run_python(KERNELS + """
    import ccalloc_torch, torch
    # The arrays came from ccalloc: its statistics count them, once torch has initialized
    # CUDA (before that, torch.cuda.memory_stats() answers {} without asking the allocator).
    torch.cuda.init()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] >= 8
""")
    assert rc == 0, err
    differ = [name for name, x, y in zip(OUTPUTS, out.split(), pool.split()) if x != y]
    assert len(out.split()) == len(pool.split()) == len(OUTPUTS), (out, pool)
    assert not differ, ("differ: %s" % differ, out, pool)


# A kernel that spins for `cycles` clock cycles, then copies src to dst: the stream it runs on
# is still reading src long after the host has moved on.
SPIN = """
    import cupy, ccalloc_torch.cupy as cc
    spin_copy = cupy.RawKernel(r'''
    extern "C" __global__ void spin_copy(const float* src, float* dst, int n, long long cycles) {
      long long start = clock64();
      while (clock64() - start < cycles) {}
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) dst[i] = src[i];
    }''', "spin_copy")
    n = 1 << 22
    cycles = 200_000_000  # about 0.1 s
    def spin(src, dst, stream):
        with stream:
            spin_copy(((n + 255) // 256,), (256,), (src, dst, cupy.int32(n), cupy.int64(cycles)))
"""


def test_a_block_freed_on_a_stream_is_not_overwritten_while_that_stream_reads_it():
    rc, out, err = run_python(SPIN + """
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s1:
        x = cupy.full(n, 1.0, dtype=cupy.float32)
        out = cupy.zeros(n, dtype=cupy.float32)
    spin(x, out, s1)
    address = x.data.ptr
    del x  # freed on s1 while s1's kernel still reads it
    with s2:
        y = cupy.empty(n, dtype=cupy.float32)
        y.fill(7.0)
    s1.synchronize(); s2.synchronize()
    print(float(out.min()), float(out.max()), y.data.ptr == address)
""")
    assert rc == 0, err
    low, high, _ = out.split()
    assert (low, high) == ("1.0", "1.0"), out


def test_record_stream_keeps_a_block_from_its_own_stream_until_the_other_is_done():
    rc, out, err = run_python(SPIN + """
    s1 = cupy.cuda.Stream(non_blocking=True)
    x = cupy.full(n, 1.0, dtype=cupy.float32)  # on the null stream
    out = cupy.zeros(n, dtype=cupy.float32)
    cupy.cuda.Stream.null.synchronize()
    spin(x, out, s1)
    cc.record_stream(x, s1)
    del x
    y = cupy.empty(n, dtype=cupy.float32)  # the null stream again
    y.fill(7.0)
    s1.synchronize(); cupy.cuda.Stream.null.synchronize()
    print(float(out.min()), float(out.max()))
""")
    assert rc == 0, err
    assert out == "1.0 1.0", out


def test_dlpack_crosses_without_copy_and_one_cache_serves_both():
    rc, out, err = run_python("""
    import cupy, torch
    a = cupy.arange(1 << 20, dtype=cupy.float32)
    t = torch.from_dlpack(a)
    assert t.data_ptr() == a.data.ptr
    allocated = torch.cuda.memory_stats()["allocated_bytes.all.current"]
    assert allocated >= 4 << 20, allocated
    del a  # torch holds it
    assert float(t[-1]) == (1 << 20) - 1
    b = cupy.from_dlpack(t)
    assert b.data.ptr == t.data_ptr()
    del t
    assert float(b[-1]) == (1 << 20) - 1
    del b
    # Freed by both: back in the cache, which torch's empty_cache gives back.
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] < allocated
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < reserved, (torch.cuda.memory_reserved(), reserved)
    print("ok")
""")
    assert rc == 0, err
    assert out == "ok", out


def test_out_of_memory_is_cupys_error_and_the_allocator_serves_on():
    rc, out, err = run_python("""
    import cupy, ccalloc_torch.cupy as cc
    print(cc.route())  # the C route, where this CuPy raises what a failed C malloc sets
    try:
        cupy.empty(1 << 50, dtype=cupy.uint8)
    except cupy.cuda.memory.OutOfMemoryError as e:
        print("oom", str(e).startswith("ccalloc_torch.cupy: 1125899906842624 bytes"))
    a = cupy.arange(1000)
    print(int(a.sum()))
""")
    assert rc == 0, err
    assert out.split() == ["c", "oom", "True", "499500"], (out, err)


TWO_FRAMEWORKS = """
    import cupy, torch
    free, total = torch.cuda.mem_get_info()
    n = int(total * 0.6)
    x = cupy.empty(n, dtype=cupy.uint8)
    x.fill(1)
    del x  # CuPy frees it
    try:
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        t.fill_(2)
        torch.cuda.synchronize()
        print("ran")
    except torch.OutOfMemoryError:
        print("oom")
"""


@pytest.mark.whole_device
def test_cupy_then_torch_at_sixty_percent_each_needs_one_cache():
    rc, out, err = run_python(TWO_FRAMEWORKS, ccalloc=False)
    assert rc == 0, err
    assert out == "oom", out  # CuPy's pool keeps what CuPy freed
    rc, out, err = run_python(TWO_FRAMEWORKS)
    assert rc == 0, err
    assert out == "ran", out


def test_ccalloc_enable_covers_cupy():
    code = """
    import cupy, ccalloc_torch.cupy as cc, torch
    print(cc.installed(), __import__("ccalloc_torch").installed())
    """
    env = {"CCALLOC_ENABLE": "1",
           "PYTHONPATH": BINDINGS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # The .pth hook is not in this interpreter's site-packages unless the package is
    # installed: run its one line the way site.py would.
    hook = open(os.path.join(BINDINGS, "ccalloc_torch.pth")).read()
    rc, out, err = run_python(hook + textwrap.dedent(code), ccalloc=False, env_extra=env)
    assert rc == 0, err
    assert out == "True native", (out, err)
