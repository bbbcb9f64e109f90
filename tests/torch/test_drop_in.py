"""What PyTorch's own tests and tools expect of whichever allocator is installed, on PyTorch's
allocator and on ccalloc in fresh processes (docs/pytorch-behaviour.md §8.2):
- installing ccalloc makes no CUDA call, so a process can still fork, or hide devices, before
  its first CUDA use;
- the allocator's variables are read when PyTorch initializes CUDA, CCALLOC_CONF picks the
  preset and PyTorch's variable applies its keys on top;
- torch.profiler's memory view hears of every allocation and free;
- trace entries carry the compiled region in force (compile_context=True);
- a tight per-process memory fraction serves on the default preset what it serves on PyTorch;
- a refused request leaves no CUDA error behind, and cuDNN's benchmark runs under
  backend:cudaMallocAsync;
- CCALLOC_ENABLE=1 switches ccalloc on in every Python process, with no import in the
  program (the package's .pth hook)."""

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from torch_compare import BINDINGS, HERE, assert_same, both, run, run_fresh, skip_without_gpu

skip_without_gpu()


def run_plain(code, env_extra=None, install=True, timeout=300):
    """Runs `code` in a fresh interpreter, ccalloc installed first (before `import torch`)
    when `install`; returns (returncode, stdout, stderr)."""
    prelude = ""
    if install:
        prelude = (f"import sys; sys.path.insert(0, {BINDINGS!r}); import ccalloc_torch; "
                   "assert ccalloc_torch.install() == 'native'\n")
    return run_fresh(prelude, code, env_extra, timeout)


# --- Lazy initialization ---------------------------------------------------------------

@pytest.mark.parametrize("install", [False, True], ids=["pytorch", "ccalloc"])
def test_install_makes_no_cuda_call(install):
    # CUDA_ERROR_NOT_INITIALIZED (3): nothing called cuInit.
    code = ("import torch, ctypes; x = ctypes.c_int(-1); "
            "print(ctypes.CDLL('libcuda.so.1').cuDeviceGetCount(ctypes.byref(x)))")
    rc, out, err = run_plain(code, install=install)
    assert rc == 0, err
    assert out == "3", out
    # Devices hidden after the install are hidden from the process.
    rc, out, err = run_plain("import os, torch; os.environ['CUDA_VISIBLE_DEVICES'] = '32'; "
                             "print(torch.cuda.device_count())", install=install)
    assert rc == 0, err
    assert out == "0", out


@pytest.mark.parametrize("install", [False, True], ids=["pytorch", "ccalloc"])
def test_a_process_forked_after_install_uses_cuda(install):
    code = """
    import multiprocessing, torch
    parent, child = multiprocessing.get_context("fork").Pipe()
    def worker(conn):
        try:
            conn.send(torch.ones(10, device="cuda")[0].item())
        except Exception as e:
            conn.send(str(e))
    p = multiprocessing.get_context("fork").Process(target=worker, args=(child,))
    p.start()
    print(parent.recv())
    p.join()
    print(torch.ones(3, device="cuda").sum().item())
    """
    rc, out, err = run_plain(code, install=install)
    assert rc == 0, err
    assert out.splitlines() == ["1.0", "3.0"], out


# --- Settings ---------------------------------------------------------------------------

def test_variables_are_read_when_cuda_initializes():
    # Set after install and after `import torch`, before the first CUDA use (as the
    # upstream test does with ccalloc installed at interpreter start).
    code = """
    import os, torch
    os.environ["PYTORCH_ALLOC_CONF"] = "max_split_size_mb:20,backend:cudaMallocAsync,release_lock_on_cudamalloc:none"
    torch.cuda.init()
    print(torch.cuda.get_allocator_backend())
    x = torch.ones(1 << 20, device="cuda")
    print(torch.cuda.memory_allocated() >= x.numel() * 4)
    """
    rc, out, err = run_plain(code)
    assert rc == 0, err
    assert out.splitlines() == ["cudaMallocAsync", "True"], out


@pytest.mark.parametrize("preset", ["pytorch", "ccalloc"])
def test_pytorch_keys_apply_on_top_of_the_ccalloc_preset(preset):
    script = """
    device = torch._C._cuda_getDevice()
    emit(fraction=torch.cuda.memory.get_per_process_memory_fraction(device))
    """
    pytorch = run("pytorch", script,
                  extra_env={"CCALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.5"})
    ccalloc = run("ccalloc", script,
                  extra_env={"CCALLOC_CONF": preset, "PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.5"})
    assert pytorch["fraction"] == 0.5
    assert_same(pytorch, ccalloc, "the fraction PyTorch's variable sets under CCALLOC_CONF=" + preset)


def test_a_key_in_both_variables_takes_pytorchs_value():
    script = """
    x = torch.empty(11 << 20, dtype=torch.uint8, device="cuda")
    emit(max_split=torch.cuda.memory_stats()["max_split_size"], reserved=torch.cuda.memory_reserved())
    """
    got = run("ccalloc", script, extra_env={"CCALLOC_CONF": "pytorch,max_split_size_mb:64",
                                            "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert got["max_split"] == 128 << 20
    # The preset is CCALLOC_CONF's: PyTorch's policy gives an 11 MiB request a segment of
    # 12 MiB (the default preset would create a 20 MiB chunk of pieces).
    assert got["reserved"] == 12 << 20


# --- The profiler -------------------------------------------------------------------------

PROFILE = """
import json
from torch.cuda._memory_viz import _profile_to_snapshot, profile_plot
def allocate_under_the_profiler():
    x = torch.rand(128, 128, device="cuda")
    y = x * x + x * x
    z = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    del y, z
    return x
with torch.profiler.profile(with_stack=True, profile_memory=True, record_shapes=True) as prof:
    kept = allocate_under_the_profiler()
snapshot = _profile_to_snapshot(prof)
trace = snapshot["device_traces"][torch.cuda.current_device()]
events = [(e["action"], e["size"]) for e in trace]
plot = profile_plot(prof)
frames = json.dumps(snapshot)
memory_events = [(e.name, e.device_memory_usage) for e in prof.events() if e.device_memory_usage]
emit(events=events, names_function="allocate_under_the_profiler" in frames,
     plot_has_category="category" in plot or "category" in frames,
     memory_events=sorted(size for _, size in memory_events))
"""


@pytest.mark.parametrize("preset", ["pytorch", "ccalloc"])
def test_the_profiler_hears_every_allocation_and_free(preset):
    pytorch, ccalloc = both(PROFILE, preset=preset)
    assert pytorch["events"], "PyTorch's own allocator reported nothing to the profiler"
    assert ccalloc["names_function"] and ccalloc["plot_has_category"], ccalloc
    if preset == "pytorch":
        assert_same(pytorch, ccalloc, "what the profiler records")
    else:
        # The default preset rounds requests as PyTorch does: the same events, the same sizes.
        assert_same(pytorch["events"], ccalloc["events"], "the profiler's allocations and frees")


def test_the_profiler_hears_the_async_backend():
    # PyTorch's cudaMallocAsync backend reports nothing to the profiler (its memory view is
    # empty there); ccalloc's reports the allocations and frees the native backend would.
    native = run("pytorch", PROFILE)
    pytorch, ccalloc = both(PROFILE, conf="backend:cudaMallocAsync")
    assert pytorch["memory_events"] == [], pytorch
    assert ccalloc["names_function"], ccalloc
    # The async backend hands out the bytes asked for; the native one rounds to 512 bytes.
    assert [a for a, _ in ccalloc["events"]] == [a for a, _ in native["events"]], ccalloc
    assert sorted(abs(n) for n in ccalloc["memory_events"]) == \
        sorted(abs(n) for n in native["memory_events"]), (ccalloc, native)


def test_export_memory_timeline_sees_the_same_memory():
    script = """
    import json, tempfile, os
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        for _ in range(2):
            loss = model(torch.randn(64, 256, device="cuda")).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    path = os.path.join(tempfile.mkdtemp(), "timeline.json")
    prof.export_memory_timeline(path, device="cuda:0")
    with open(path) as f:
        times, sizes = json.load(f)
    totals = [sum(row) for row in zip(*sizes)] if sizes and isinstance(sizes[0], list) else sizes
    emit(samples=len(times), peak=max(totals) if totals else 0)
    """
    pytorch, ccalloc = both(script)
    assert pytorch["peak"] > 0
    assert_same(pytorch, ccalloc, "export_memory_timeline")


# --- Compile contexts -----------------------------------------------------------------------

COMPILE_REGIONS = """
import torch.nn as nn
class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(10, 10)
        self.linear2 = nn.Linear(10, 10)
    def forward(self, x):
        x = self.linear1(x)
        if x.sum() > 0:
            x = x + 1
        else:
            x = x - 1
        return self.linear2(x)
torch.cuda.memory.empty_cache()
inp = torch.randn(1, 10, device="cuda")
model = MyModel().cuda()
compiled = torch.compile(model)
torch.cuda.memory._record_memory_history(context="all", compile_context=True)
torch.cuda.memory._snapshot()  # its trace entry is in the next snapshot's trace
compiled(inp)
traces = torch.cuda.memory._snapshot()["device_traces"]
trace = next(t for t in traces if t)
sequence = []
for e in trace:
    c = e["compile_context"]
    if c != "N/A" and (not sequence or sequence[-1] != c):
        sequence.append(c)
emit(sequence=sequence, snapshot_entries=[e["compile_context"] for e in trace if e["action"] == "snapshot"])
"""


@pytest.mark.parametrize("preset", ["pytorch", "ccalloc"])
def test_trace_entries_carry_the_compiled_region(preset):
    pytorch, ccalloc = both(COMPILE_REGIONS, preset=preset)
    assert len(pytorch["sequence"]) >= 2, pytorch
    # A snapshot's own entry carries the region in force too ("N/A" outside any), not the
    # empty string: PyTorch's test skips "N/A" only.
    assert all(c == "N/A" for c in pytorch["snapshot_entries"]), pytorch
    assert_same(pytorch, ccalloc, "the compiled regions of the trace")


# --- Tight caps -----------------------------------------------------------------------------

# PyTorch's test_max_split_expandable after a history that leaves pages shared between live
# small tensors and free space (the default preset's pieces cannot all be given back).
TIGHT_CAP = """
mb = 1 << 20
keep = []
for i in range(300):
    t = torch.empty((i % 7 + 1) * 300_000, dtype=torch.uint8, device="cuda")
    if i % 3 == 0:
        keep.append(t)
big = [torch.empty(n * mb, dtype=torch.uint8, device="cuda") for n in (30, 50, 70)]
keep.append(big[1])
del big, t
orig = torch.cuda.get_per_process_memory_fraction()
torch.cuda.memory.empty_cache()
_, all_memory = torch.cuda.memory.mem_get_info()
pre_reserved = torch.cuda.memory_reserved()
total_allowed = 120 * mb + pre_reserved
fraction_allowed = total_allowed / all_memory
torch.cuda.memory.set_per_process_memory_fraction(fraction_allowed)
def alloc(n):
    return torch.ones(n * mb, dtype=torch.int8, device="cuda")
steps = []
torch.cuda.memory._set_allocator_settings("expandable_segments:False,max_split_size_mb:40")
a = alloc(40); steps.append("a")
torch.cuda.memory._set_allocator_settings("expandable_segments:True,max_split_size_mb:40")
b = alloc(40); steps.append("b")
torch.cuda.memory._set_allocator_settings("expandable_segments:False,max_split_size_mb:40")
c = alloc(40); steps.append("c")
try:
    alloc(40)
    steps.append("fourth fitted")
except torch.OutOfMemoryError:
    steps.append("fourth refused")
del a, b, c
d = alloc(120); steps.append("120 after freeing")
del d
torch.cuda.memory.set_per_process_memory_fraction(orig)
emit(steps=steps, ok=int(torch.ones(4, device="cuda").sum().item()))
"""


@pytest.mark.whole_device
def test_a_tight_fraction_serves_the_default_preset_as_pytorch():
    pytorch = run("pytorch", TIGHT_CAP)
    ccalloc = run("ccalloc", TIGHT_CAP, preset="ccalloc")
    assert pytorch["steps"] == ["a", "b", "c", "fourth refused", "120 after freeing"], pytorch
    assert_same(pytorch, ccalloc, "PyTorch's test_max_split_expandable on the default preset")


# --- No CUDA error left behind ------------------------------------------------------------

NO_ERROR_LEFT = """
refused = 0
for n in (1 << 50, 10 * torch.cuda.mem_get_info()[1]):
    try:
        torch.empty(n, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        refused += 1
# A kernel launch checks the CUDA error state: an error left by a refused request raises here.
after = (torch.ones(1000, device="cuda") * 2).sum().item()
torch.cuda.synchronize()
torch.manual_seed(0)
torch.backends.cudnn.benchmark = True
conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
x = torch.randn(8, 16, 64, 64, device="cuda", requires_grad=True)
y = conv(x)
y.float().pow(2).mean().backward()
torch.cuda.synchronize()
emit(refused=refused, after=after, grad_shape=list(x.grad.shape), backend=torch.cuda.get_allocator_backend())
"""


@pytest.mark.parametrize("conf,preset", [(None, "pytorch"), (None, "ccalloc"),
                                         ("backend:cudaMallocAsync", "pytorch")],
                         ids=["pytorch-preset", "default-preset", "async"])
def test_a_refused_request_leaves_no_cuda_error_and_cudnn_benchmarks(conf, preset):
    pytorch = run("pytorch", NO_ERROR_LEFT, conf=conf)
    ccalloc = run("ccalloc", NO_ERROR_LEFT, conf=conf, preset=preset)
    assert pytorch["refused"] == 2
    pytorch.pop("backend"), ccalloc.pop("backend")
    assert_same(pytorch, ccalloc, "requests refused, then a kernel and cuDNN's benchmark")


# --- CCALLOC_ENABLE=1 ----------------------------------------------------------------------

def hooked_environment(base, enable="1", extra=None):
    """A virtual environment whose site-packages holds the package's .pth, as `pip install`
    leaves it, with the repository's ccalloc_torch and this interpreter's torch on its path;
    returns (its interpreter, the environment to run it in)."""
    import sysconfig
    sys.path.insert(0, os.path.dirname(HERE))
    from autoinstall_test import hooked_python
    python = hooked_python(base, [BINDINGS, sysconfig.get_paths()["purelib"]])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in ("CCALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CCALLOC_ENABLE"):
        env.pop(key, None)
    if enable is not None:
        env["CCALLOC_ENABLE"] = enable
    env.update(extra or {})
    return python, env


REPORT = """
import multiprocessing, os, sys, torch
def child(q):
    torch.ones(1, device="cuda")
    q.put(torch.cuda.get_allocator_backend())
if __name__ == "__main__":
    x = torch.ones(1 << 20, device="cuda")
    me = torch.cuda.get_allocator_backend()
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(me, q.get(), int(torch.cuda.memory_allocated() >= (4 << 20)))
    p.join()
"""


def test_the_variable_switches_ccalloc_on_without_an_import():
    with tempfile.TemporaryDirectory() as base:
        script = os.path.join(base, "program.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(REPORT))
        python, env = hooked_environment(base)
        r = subprocess.run([python, script], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["ccalloc", "ccalloc", "1"], (r.stdout, r.stderr)
        # torchrun's ranks inherit it.
        rank = os.path.join(base, "rank.py")
        with open(rank, "w") as f:
            f.write("import os, torch\ntorch.ones(1, device='cuda')\n"
                    "print('rank', os.environ['RANK'], torch.cuda.get_allocator_backend())\n")
        r = subprocess.run([python, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                            "--standalone", rank], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        assert "rank 0 ccalloc" in r.stdout, (r.stdout, r.stderr)
        # Unset: PyTorch's allocator.
        python, env = hooked_environment(base, enable=None)
        r = subprocess.run([python, script], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["native", "native", "1"], (r.stdout, r.stderr)


def test_the_variable_without_the_library_says_why_and_keeps_pytorchs_allocator():
    with tempfile.TemporaryDirectory() as base:
        empty = os.path.join(base, "no-libraries")
        os.makedirs(empty)
        python, env = hooked_environment(base, extra={"CCALLOC_LIBRARY_DIR": empty})
        code = ("import torch\n"
                "print(torch.ones(2, device='cuda').sum().item(), torch.cuda.get_allocator_backend())\n")
        r = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300, cwd=base)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["2.0", "native"], (r.stdout, r.stderr)
        assert "PyTorch's own allocator stays in place" in r.stderr, r.stderr
