"""Runs one script twice, in fresh processes: once on PyTorch's own CUDA allocator and once on
ccalloc installed natively (libccalloc_torch.so), and returns what each run reported, so that
a test can require PyTorch to observe the same thing on both.

A script is Python source run after this prelude:
    ALLOCATOR        "pytorch" or "ccalloc"
    torch            imported; ccalloc is already installed in the ccalloc run
    emit(**values)   reports JSON-serialisable values (the last call wins per key)
Both runs get the same allocator configuration: PyTorch's defaults (CCALLOC_CONF=pytorch for
ccalloc; no PYTORCH_CUDA_ALLOC_CONF for either) unless the test passes `conf`. With
preset="ccalloc" ccalloc runs its own default preset instead (CCALLOC_CONF=ccalloc), against
PyTorch's defaults. CCALLOC_PRESET_OVERRIDE=ccalloc in the environment runs every comparison
under the default preset: a survey, where the figures that depend on the policy (segments,
per-pool statistics, segment trace entries) differ by design and the rest should not.
"""

import json
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
BINDINGS = os.path.join(REPO, "bindings", "torch")

PRELUDE = f"""
import json, os, sys
sys.path.insert(0, {BINDINGS!r})
sys.path.insert(0, {HERE!r})
ALLOCATOR = sys.argv[1]
if ALLOCATOR == "ccalloc":
    import ccalloc_torch
    _how = ccalloc_torch.install()
    assert _how == "native", "ccalloc was installed as " + repr(_how) + ", not natively: build libccalloc_torch.so"
import torch
if ALLOCATOR == "ccalloc":
    # "ccalloc", or the backend PyTorch's own variable names (PyTorch checks the two agree).
    _conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))
    _named = [kv.split(":", 1)[1].strip() for kv in _conf.split(",")
              if ":" in kv and kv.split(":", 1)[0].strip() == "backend"]
    assert torch.cuda.get_allocator_backend() == (_named[-1] if _named else "ccalloc"), \
        torch.cuda.get_allocator_backend()
_results = {{}}
def emit(**values):
    _results.update(values)
    print("CCALLOC_RESULT " + json.dumps(_results), flush=True)
"""

# Script source: stat_mismatches(device=None) rebuilds every block statistic from
# torch.cuda.memory_snapshot() as PyTorch's multi-GPU suite does (the segments of `device`
# only, when given) and returns the keys of torch.cuda.memory_stats(device) that disagree,
# or the first segment whose blocks' requested sizes do not add up to its own.
STAT_CONSISTENCY = """
import collections
def stat_mismatches(device=None):
    expected = collections.Counter()
    for seg in torch.cuda.memory_snapshot():
        if device is not None and seg["device"] != device:
            continue
        pool = seg["segment_type"] + "_pool"
        expandable = seg.get("is_expandable", False)
        if not expandable:
            expected["segment.all.current"] += 1
            expected["segment." + pool + ".current"] += 1
        for key, field in (("allocated_bytes", "allocated_size"), ("reserved_bytes", "total_size"),
                           ("active_bytes", "active_size"), ("requested_bytes", "requested_size")):
            expected[key + ".all.current"] += seg[field]
            expected[key + "." + pool + ".current"] += seg[field]
        requested = 0
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                expected["allocation.all.current"] += 1
                expected["allocation." + pool + ".current"] += 1
            if block["state"].startswith("active_"):
                expected["active.all.current"] += 1
                expected["active." + pool + ".current"] += 1
                requested += block["requested_size"]
            if block["state"] == "inactive" and len(seg["blocks"]) > 1 and not expandable:
                expected["inactive_split.all.current"] += 1
                expected["inactive_split." + pool + ".current"] += 1
                expected["inactive_split_bytes.all.current"] += block["size"]
                expected["inactive_split_bytes." + pool + ".current"] += block["size"]
        if requested != seg["requested_size"]:
            return ["segment at %#x: blocks request %d, segment %d" % (seg["address"], requested,
                                                                       seg["requested_size"])]
    stats = torch.cuda.memory_stats(device)
    return sorted("%s: rebuilt %d, reported %d" % (k, v, stats.get(k, -1))
                  for k, v in expected.items() if stats.get(k, -1) != v)
"""

ALLOCATORS = ("pytorch", "ccalloc")


def skip_without_gpu():
    """Skips the calling test module where torch or a CUDA device is missing."""
    import pytest
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)


def environment(allocator, conf=None, preset="pytorch", extra_env=None):
    env = dict(os.environ)
    for key in ("CCALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(key, None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    # Set for both: PyTorch's allocator ignores it, and a ccalloc process the script starts
    # (test_ipc's children) runs the test's configuration, not ccalloc's default.
    preset = os.environ.get("CCALLOC_PRESET_OVERRIDE", preset)
    env["CCALLOC_CONF"] = preset + ("," + conf if conf else "")
    env["PYTHONUNBUFFERED"] = "1"
    # Set last (None: unset), for the tests of how the variables combine.
    for key, value in (extra_env or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run(allocator, script, conf=None, timeout=600, expect_failure=False, preset="pytorch",
        extra_env=None):
    """Runs `script` on `allocator` in a fresh interpreter; returns its emitted values."""
    source = PRELUDE + "\n" + textwrap.dedent(script)
    proc = subprocess.run([sys.executable, "-c", source, allocator],
                          env=environment(allocator, conf, preset, extra_env),
                          capture_output=True, text=True, timeout=timeout, cwd=HERE)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CCALLOC_RESULT ")]
    if proc.returncode != 0 and not expect_failure:
        raise AssertionError(f"the script failed on {allocator} (exit {proc.returncode}):\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    if not lines:
        raise AssertionError(f"the script reported nothing on {allocator}:\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return json.loads(lines[-1][len("CCALLOC_RESULT "):])


def run_fresh(prelude, code, env_extra=None, timeout=300):
    """Runs `prelude` then `code` (dedented) in a fresh interpreter, with none of the
    allocator's variables set (CCALLOC_CONF, PyTorch's two, CCALLOC_ENABLE) but those of
    `env_extra`; returns (returncode, stdout stripped, stderr)."""
    env = dict(os.environ)
    for key in ("CCALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CCALLOC_ENABLE"):
        env.pop(key, None)
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=HERE)
    return proc.returncode, proc.stdout.strip(), proc.stderr


def both(script, conf=None, timeout=600, preset="pytorch"):
    """Runs `script` on PyTorch's allocator, then on ccalloc; returns (pytorch, ccalloc)."""
    return tuple(run(a, script, conf=conf, timeout=timeout, preset=preset) for a in ALLOCATORS)


def assert_same(pytorch, ccalloc, what):
    """Asserts two reported values are equal, naming each differing key of a dict."""
    if isinstance(pytorch, dict) and isinstance(ccalloc, dict):
        keys = sorted(set(pytorch) | set(ccalloc))
        diffs = [f"  {k}: pytorch {pytorch.get(k, '<missing>')!r}, ccalloc {ccalloc.get(k, '<missing>')!r}"
                 for k in keys if pytorch.get(k, "<missing>") != ccalloc.get(k, "<missing>")]
        assert not diffs, f"{what} differs in {len(diffs)} key(s):\n" + "\n".join(diffs)
    else:
        assert pytorch == ccalloc, f"{what}: pytorch {pytorch!r}, ccalloc {ccalloc!r}"
