#!/usr/bin/env python3
"""bench/torch/smallest.py end to end without torch or a GPU: its processes run against a fake
torch (a device whose allocator reserves a fixed factor over what the workload requests, per
allocator, and raises OutOfMemoryError above the memory fraction) and fake workloads, put in
place by a sitecustomize on PYTHONPATH; a fake `ccalloc fit` prints fixed capacities. The test
checks what the parent makes of its processes: the limits found, the least allocator, the
recording and the comparison with the fits, and a process that fails."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "bench", "torch", "smallest.py")
GiB = 1 << 30
TOTAL = 80 * GiB
NEED = 5 * GiB + 12345  # the fake finetune_bf16's requested peak
# Reserved over requested, per allocator, which the smallest limit must show.
OVER = {"native": 1.2, "expandable": 1.05, "ccalloc": 1.02}
FIT = {"ccalloc": 5502926848, "pytorch,expandable_segments:True": 5637144576,
       "pytorch": 6442450944}

TORCH = {
    "torch/__init__.py": """
        from . import cuda
        bfloat16, float32 = "bf16", "fp32"
        class OutOfMemoryError(RuntimeError):
            pass
        cuda.OutOfMemoryError = OutOfMemoryError
    """,
    "torch/cuda/__init__.py": f"""
        from . import memory
        TOTAL = {TOTAL}
        state = {{"fraction": 1.0, "reserved": 0, "peak_reserved": 0, "peak_requested": 0,
                  "live": 0, "ooms": 0}}
        def mem_get_info(): return (TOTAL // 2, TOTAL)
        def set_per_process_memory_fraction(f, device=None):
            assert 0 <= f <= 1, f
            state["fraction"] = f
        def reset_peak_memory_stats():
            state["peak_reserved"], state["peak_requested"] = state["reserved"], state["live"]
        def memory_stats():
            return {{"requested_bytes.all.peak": state["peak_requested"],
                    "allocated_bytes.all.peak": state["peak_requested"] + 512,
                    "reserved_bytes.all.peak": state["peak_reserved"], "num_ooms": state["ooms"],
                    "num_device_alloc": 0, "num_device_free": 0, "num_alloc_retries": 0}}
        def synchronize(): pass
        def empty_cache(): state["reserved"] = state["live"]
        def memory_allocated(): return state["live"]
        def get_device_name(): return "fake"
    """,
    "torch/cuda/memory.py": """
        def _record_memory_history(enabled="all", **kw): pass
        def _snapshot():
            return {"segments": [], "device_traces": [[{"action": "alloc", "frames": []}] * 3]}
    """,
    "sitecustomize.py": f"""
        import os, sys, types
        import torch
        cuda = torch.cuda
        alloc = ("ccalloc" if os.environ.get("CCALLOC_CONF") else "expandable"
                 if "expandable" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") else "native")
        over = {OVER!r}[alloc]

        def finetune_bf16(steps=1, warmup=0, **kw):
            if os.environ.get("FAKE_CRASH") and cuda.state["fraction"] < 1:
                raise ValueError("not an OOM")
            cuda.state["peak_requested"] = {NEED}
            if int({NEED} * over) > int(cuda.state["fraction"] * cuda.TOTAL):
                cuda.state["ooms"] += 1
                raise torch.OutOfMemoryError("CUDA out of memory.\\nmore")
            cuda.state["reserved"] = int({NEED} * over)
            cuda.state["peak_reserved"] = max(cuda.state["peak_reserved"], cuda.state["reserved"])
            cuda.state["reserved"] = 0
            return [0.0] * steps, [1.5] * steps

        workloads = types.ModuleType("workloads")
        workloads.deterministic = lambda: None
        workloads.WORKLOADS = {{"finetune_bf16": finetune_bf16}}
        sys.modules["workloads"] = workloads
        ccalloc_torch = types.ModuleType("ccalloc_torch")
        ccalloc_torch.install = lambda: "native"
        ccalloc_torch.stats = lambda device=None: cuda.memory_stats()
        sys.modules["ccalloc_torch"] = ccalloc_torch
    """,
    "fit.py": f"""
        import json, sys
        confs = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--conf"]
        assert sys.argv[1] == "fit" and "--json" in sys.argv and sys.argv[2].endswith(".pickle.gz")
        print(json.dumps([{{"conf": c, "floor_bytes": {NEED}, "capacity_bytes": {FIT!r}[c],
                           "ratio_to_floor": {FIT!r}[c] / {NEED}, "verified": True}}
                          for c in confs]))
    """,
}


class SmallestBenchTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        root = self.dir.name
        for path, text in TORCH.items():
            os.makedirs(os.path.dirname(os.path.join(root, "fake", path)), exist_ok=True)
            with open(os.path.join(root, "fake", path), "w") as f:
                f.write(textwrap.dedent(text))
        self.fit = os.path.join(root, "fit")
        with open(self.fit, "w") as f:
            f.write(f"#!/bin/sh\nexec {sys.executable} {root}/fake/fit.py \"$@\"\n")
        os.chmod(self.fit, 0o755)

    def tearDown(self):
        self.dir.cleanup()

    def run_bench(self, *args, **env):
        out = os.path.join(self.dir.name, "out.json")
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--workloads", "finetune_bf16", "--json", out, *args],
            env=dict(os.environ, PYTHONPATH=os.path.join(self.dir.name, "fake"), **env),
            capture_output=True, text=True, timeout=120)
        with open(out) as f:
            return proc, json.load(f)

    def test_each_allocator_gets_its_smallest_limit_and_the_fits_are_set_beside_them(self):
        traces = os.path.join(self.dir.name, "traces")
        proc, report = self.run_bench("--record", traces, "--fit", self.fit)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        runs = report["runs"]["finetune_bf16"]
        for a, over in OVER.items():
            r = runs[a]
            need = int(NEED * over)
            self.assertGreaterEqual(r["smallest_bytes"], need, a)
            self.assertLess(r["largest_failing_bytes"], need, a)
            self.assertLessEqual(r["smallest_bytes"] - r["largest_failing_bytes"],
                                 r["tolerance_bytes"])
            self.assertTrue(r["converged"] and r["confirmed"] and r["monotonic"], a)
            self.assertEqual(r["unconstrained"]["peak_requested_bytes"], NEED)
            self.assertAlmostEqual(r["smallest_fraction"], r["smallest_bytes"] / TOTAL)
            self.assertEqual(r["probes"], len(r["attempts"]))
        self.assertEqual(report["summary"]["finetune_bf16"]["least"], "ccalloc")
        self.assertAlmostEqual(report["summary"]["finetune_bf16"]["over_least"]["native"],
                               runs["native"]["smallest_bytes"] / runs["ccalloc"]["smallest_bytes"] - 1)
        # Only the native process records; the fit of its recording serves every allocator.
        self.assertEqual(os.listdir(traces), ["finetune_bf16.pickle.gz"])
        self.assertNotIn("recording", runs["ccalloc"]["unconstrained"])
        rows = report["fit"]["finetune_bf16"]["rows"]
        for a, conf in (("ccalloc", "ccalloc"), ("expandable", "pytorch,expandable_segments:True"),
                        ("native", "pytorch")):
            self.assertEqual(rows[a]["fit_capacity_bytes"], FIT[conf])
            self.assertAlmostEqual(rows[a]["relative_difference"],
                                   runs[a]["smallest_bytes"] / FIT[conf] - 1)
        self.assertIn("ccalloc needs least", proc.stdout)
        self.assertIn("within 1 % of the fit", proc.stdout)

    def test_a_process_that_fails_is_reported_with_what_it_measured(self):
        proc, report = self.run_bench("--allocators", "native", FAKE_CRASH="1")
        self.assertEqual(proc.returncode, 1)
        r = report["runs"]["finetune_bf16"]["native"]
        self.assertIn("without a result", r["error"])
        self.assertIn("not an OOM", r["tail"])
        self.assertEqual(r["unconstrained"]["peak_requested_bytes"], NEED)
        self.assertIn("FAILED", proc.stdout)


if __name__ == "__main__":
    unittest.main()
