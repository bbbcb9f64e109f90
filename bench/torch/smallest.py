#!/usr/bin/env python3
"""The smallest memory a real workload runs in, per allocator: for each workload and each of
PyTorch's native allocator, PyTorch with expandable_segments:True and ccalloc's default
preset, the smallest limit (torch.cuda.set_per_process_memory_fraction x the device's total
memory) under which the workload's steps all run without an OutOfMemoryError.

    python3 bench/torch/smallest.py [--workloads finetune_bf16,llama_train_dyn,llama_generate,resnet50]
        [--allocators native,expandable,ccalloc] [--steps N] [--precision bf16|fp32]
        [--args '{"llama_train_dyn": {"layers": 24}}'] [--record DIR [--fit BIN]] [--json out.json]
    python3 bench/torch/smallest.py --from out.json --fit build/gpu/bin/ccalloc

One process per workload and allocator (expandable segments and ccalloc are chosen when the
process starts). It first runs the workload unconstrained and reads its peaks (requested,
allocated, reserved), then probes limits in the same process: each probe sets the fraction,
builds the workload from nothing (model, optimizer, inputs), runs its steps, and catches
torch.OutOfMemoryError; everything it made is then dropped, collected and given back to the
device (empty_cache) before the next. The search (smallest_passing) starts from a limit that
must pass (the unconstrained reserved peak plus a margin; raised while it fails) and one that
must fail (0.9 x the requested peak; lowered while it passes), bisects to a tolerance (2 MiB
granules, at most 8 MiB), and runs the answer once more: a limit that passed once and fails
on its second run (cuDNN picking another algorithm when its workspace does not fit, say) is
taken as failing and the search goes on above it.

The reported figures per workload and allocator: the smallest limit in bytes and GB, as a
fraction of the device, over the unconstrained requested peak; which allocator needs least
and how far each other one is above it.

With --record DIR the unconstrained run of the --record-on allocator's process (native by
default) records its allocation history from the first allocation (the probes are not
recorded): DIR/WORKLOAD.pickle.gz, the snapshot with frames removed, as record.py writes
them. With --fit BIN (the ccalloc command-line tool) each recording is then fitted
(`ccalloc fit REC --json --conf ccalloc --conf pytorch,expandable_segments:True --conf
pytorch`: the smallest simulated device, a multiple of 2 MiB, that replays the trace with no
OOM) and each allocator's device figure is compared with its config's fitted capacity; both
are byte limits on what the allocator reserves."""

import argparse
import gc
import gzip
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "torch"))
sys.path.insert(0, HERE)

import scale  # noqa: E402  (ALLOCATORS and the environment of each; no torch at import)

MiB = 1 << 20
GRANULE = 2 * MiB  # the device's allocation granularity; ccalloc fit's step

# Each workload of workloads.py at a size whose run takes one to two seconds on an H100 once
# the process is warm (a run of the finetune_bf16 below at 8 steps took 2.2 s, its first in a
# process 6-9 s; llama_train_dyn at 6 steps 2.2-2.5 s, llama_generate at 6 calls of 16 tokens
# 2.5-3.0 s, resnet50 at 4 steps 0.6 s), so that a dozen runs per process fit the
# benchmark's few minutes. "dtype" says how
# --precision fp32 reaches it: "autocast" (dtype=None trains in fp32), "weights" (the
# model's dtype).
CASES = {
    # BERT-base fine-tuning, batch 8-32 and sequence 32-512 varying per step (the seeded
    # draws: 15x187, 11x401, 20x277, 12x78, 10x42, 20x313).
    "finetune_bf16": {"args": {"steps": 6, "warmup": 0}, "dtype": "autocast"},
    # Llama-style decoder training (8 layers, 1024 wide), batch 1-8 and sequence 128-1024
    # (8x403, 6x274, 7x139, 6x622, 5x786).
    "llama_train_dyn": {"args": {"steps": 5, "warmup": 0, "layers": 8}, "dtype": "autocast"},
    # generate() on the Llama-style decoder, batch 1-8 and prompt 32-512 varying per call
    # (2x335, 2x221, 8x352, 1x342, 1x497), 12 new tokens each.
    "llama_generate": {"args": {"steps": 5, "warmup": 0, "new_tokens": 12}, "dtype": "weights"},
    # ResNet-50 training, batch 64, fixed shapes.
    "resnet50": {"args": {"steps": 3, "warmup": 0, "batch": 64}, "dtype": "autocast"},
}
# The `ccalloc fit` config that models each allocator of the device runs.
FIT_CONFS = {"ccalloc": "ccalloc", "expandable": "pytorch,expandable_segments:True",
             "native": "pytorch"}


# --- The search ------------------------------------------------------------------------------

def smallest_passing(runs, lo, hi, tolerance, ceiling, granule=GRANULE, max_probes=40,
                     max_confirmations=3, out_of_time=None):
    """The smallest limit (bytes, a multiple of `granule`) at which runs(limit) is True, found
    by bisection between `lo`, expected to fail, and `hi`, expected to pass.

    runs may be noisy near the threshold: a limit may pass once and fail the next time, or
    pass below one that failed. So each end is probed first: hi is raised (by a quarter, up to
    `ceiling`) until it passes, lo lowered (by a quarter; 0 is taken as failing without a
    run) until it fails. The bracket is then halved until it is at most `tolerance` wide,
    and its passing end is run again: if it fails now, it becomes the failing end, the
    smallest limit above it that has passed becomes the passing end, and the search goes on
    (up to `max_confirmations` such runs). No more than `max_probes` runs in all, and none
    once out_of_time() is True.

    Returns a dict: "smallest" (the passing end, None when nothing up to `ceiling` passed),
    "largest_failing" (the failing end), "converged" (the bracket within `tolerance`),
    "confirmed" (the answer passed its second run), "monotonic" (no limit passed at or below
    one that failed) and "trials" ([{"limit", "ok"}] in order)."""
    def down(x):
        return x // granule * granule

    def up(x):
        return -(-x // granule) * granule

    tolerance = max(granule, up(tolerance))
    ceiling = down(ceiling)
    trials = []

    def stop():
        return len(trials) >= max_probes or (out_of_time is not None and out_of_time())

    def probe(limit):
        ok = bool(runs(limit))
        trials.append({"limit": limit, "ok": ok})
        return ok

    def result(passing, failing, confirmed=False):
        passed = [t["limit"] for t in trials if t["ok"]]
        failed = [t["limit"] for t in trials if not t["ok"]]
        return {"smallest": passing, "largest_failing": failing,
                "converged": passing is not None and passing - failing <= tolerance,
                "confirmed": confirmed,
                "monotonic": not passed or not failed or min(passed) > max(failed),
                "trials": trials}

    def raise_until_pass(limit, failing):
        """The first of limit, limit + a quarter, ... (up to ceiling) that passes, and the
        largest that failed before it; (None, failing) when none did."""
        while True:
            if stop():
                return None, failing
            if probe(limit):
                return limit, failing
            failing = max(failing, limit)
            if limit >= ceiling:
                return None, failing
            limit = min(ceiling, up(limit + max(limit // 4, tolerance)))

    hi = max(granule, min(up(hi), ceiling))
    passing, failing = raise_until_pass(hi, 0)
    if passing is None:
        return result(None, failing)
    if failing == 0:
        lo = min(down(lo), passing - granule)
        while lo > 0 and not stop():
            if not probe(lo):
                failing = lo
                break
            passing = lo
            lo = down(lo - max(lo // 4, tolerance))
    confirmations = 0
    while True:
        while passing - failing > tolerance and not stop():
            mid = down(failing + (passing - failing) // 2)
            if mid <= failing:
                mid = failing + granule
            if probe(mid):
                passing = mid
            else:
                failing = mid
        if passing - failing > tolerance or confirmations >= max_confirmations or stop():
            return result(passing, failing)
        confirmations += 1
        if probe(passing):
            return result(passing, failing, confirmed=True)
        failing = passing
        failed = {t["limit"] for t in trials if not t["ok"]}
        above = [t["limit"] for t in trials
                 if t["ok"] and t["limit"] > failing and t["limit"] not in failed]
        if above:
            passing = min(above)
        else:
            passing, failing = raise_until_pass(
                min(ceiling, up(failing + max(failing // 4, tolerance))), failing)
            if passing is None:
                return result(None, failing)


def auto_tolerance(requested_peak):
    """The bisection's tolerance: 1/512 of the requested peak, within [2 MiB, 8 MiB], in
    whole granules (0.2 % of the peak or better above 4 GiB)."""
    return max(GRANULE, min(8 * MiB, requested_peak // 512 // GRANULE * GRANULE))


# --- One process: one workload on one allocator --------------------------------------------

def worker(args):
    which = scale.ALLOCATORS[args.allocator][0]
    how = "PyTorch's"
    if which == "ccalloc":
        import ccalloc_torch

        how = ccalloc_torch.install()
        if how != "native":
            sys.exit(f"smallest.py: ccalloc installed {how}, not natively: memory fractions "
                     "set through torch would not reach it (build libccalloc_torch.so)")
    import torch

    import probes
    import workloads

    workloads.deterministic()
    oom_types = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)
    case = CASES[args.workload]
    kwargs = dict(case["args"])
    kwargs.update(json.loads(args.case_args))
    if args.precision:
        if args.precision == "fp32":
            kwargs["dtype"] = None if case["dtype"] == "autocast" else torch.float32
        else:
            kwargs["dtype"] = torch.bfloat16
    fn = workloads.WORKLOADS[args.workload]
    total = torch.cuda.mem_get_info()[1]  # the total PyTorch's memory fraction multiplies
    started = time.monotonic()

    def emit(kind, obj):
        print(kind + " " + json.dumps(obj), flush=True)

    def clean():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def attempt(limit, record=None):
        """One run of the workload, built from nothing, under `limit` bytes (None: no limit
        set). Returns its figures; everything it made is gone when it returns."""
        if limit is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, (limit + 0.5) / total))
        torch.cuda.reset_peak_memory_stats()
        ooms = probes._stats(which).get("num_ooms", 0)
        if record:
            torch.cuda.memory._record_memory_history(max_entries=args.max_entries,
                                                     stacks="python", context=None)
        error, outputs = None, None
        start = time.perf_counter()
        try:
            workloads.deterministic()
            _, outputs = fn(**kwargs)
        except oom_types as e:
            error = "OutOfMemoryError: " + (str(e).splitlines() or [""])[0][:300]
        except RuntimeError as e:
            if "out of memory" not in str(e).lower():
                raise
            error = "RuntimeError: " + (str(e).splitlines() or [""])[0][:300]
        seconds = time.perf_counter() - start
        stats = probes._stats(which)
        out = {"limit": limit, "fraction": None if limit is None else min(1.0, (limit + 0.5) / total),
               "ok": error is None, "error": error, "seconds": round(seconds, 3),
               "peak_requested_bytes": stats["requested_bytes.all.peak"],
               "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
               "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
               "ooms": stats.get("num_ooms", 0) - ooms, "outputs": outputs}
        if record:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            for trace in snap["device_traces"]:
                for entry in trace:
                    entry.pop("frames", None)
            with gzip.open(record, "wb") as f:
                pickle.dump(snap, f)
            out["recording"] = os.path.abspath(record)
            out["entries"] = sum(len(t) for t in snap["device_traces"])
            out["recording_truncated"] = out["entries"] >= args.max_entries
            del snap
        if limit is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)
        clean()
        out["live_after_bytes"] = torch.cuda.memory_allocated()
        return out

    record = None
    if args.record:
        os.makedirs(args.record, exist_ok=True)
        record = os.path.join(args.record, args.workload + ".pickle.gz")
    free = attempt(None, record)
    free["total_bytes"] = total
    emit("UNCONSTRAINED", free)
    if not free["ok"]:
        sys.exit(f"smallest.py: {args.workload} fails without a limit: {free['error']}")
    baseline = free["live_after_bytes"]  # what stays between runs: cuBLAS's workspace, say
    tolerance = args.tolerance_mib * MiB if args.tolerance_mib else auto_tolerance(
        free["peak_requested_bytes"])
    hi = free["peak_reserved_bytes"] + free["peak_reserved_bytes"] // 50 + 32 * MiB
    lo = free["peak_requested_bytes"] * 9 // 10
    deadline = time.monotonic() + args.budget
    attempts = []

    def runs(limit):
        a = attempt(limit)
        a["same_outputs"] = a["outputs"] == free["outputs"] if a["ok"] else None
        attempts.append(a)
        emit("PROBE", a)
        return a["ok"]

    search = smallest_passing(runs, lo, hi, tolerance, ceiling=total - GRANULE,
                              max_probes=args.max_probes,
                              out_of_time=lambda: time.monotonic() > deadline)
    smallest = search["smallest"]
    result = {
        "workload": args.workload, "allocator": args.allocator,
        "installed": how if which == "ccalloc" else "PyTorch's",
        "conf": os.environ.get("CCALLOC_CONF" if which == "ccalloc" else "PYTORCH_CUDA_ALLOC_CONF", ""),
        "args": {k: (str(v) if k == "dtype" else v) for k, v in kwargs.items()},
        "device": torch.cuda.get_device_name(), "total_bytes": total,
        "unconstrained": free, "baseline_live_bytes": baseline,
        "leaked_bytes": max(a["live_after_bytes"] for a in attempts + [free]) - baseline,
        "tolerance_bytes": tolerance, "start_bracket": [lo, hi],
        "smallest_bytes": smallest, "largest_failing_bytes": search["largest_failing"],
        "smallest_gb": None if smallest is None else smallest / 1e9,
        "smallest_fraction": None if smallest is None else smallest / total,
        "smallest_over_requested": (None if smallest is None
                                    else smallest / free["peak_requested_bytes"]),
        "converged": search["converged"], "confirmed": search["confirmed"],
        "monotonic": search["monotonic"], "probes": len(attempts),
        "seconds": round(time.monotonic() - started, 1),
    }
    emit("RESULT", result)


# --- The parent: every process, the table, the fit comparison -------------------------------

def run_process(workload, allocator, args, budget):
    """Runs one worker process under a hard timeout; returns its RESULT, or {"error": ...}
    with what it had measured (its unconstrained run and probes) where it ended without."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", workload,
           "--allocator", allocator, "--case-args", json.dumps(args.case_args.get(workload, {})),
           "--budget", str(budget), "--max-probes", str(args.max_probes),
           "--max-entries", str(args.max_entries)]
    if args.tolerance_mib:
        cmd += ["--tolerance-mib", str(args.tolerance_mib)]
    if args.precision:
        cmd += ["--precision", args.precision]
    if args.record and allocator in args.record_on.split(","):
        cmd += ["--record", os.path.join(args.record, allocator) if "," in args.record_on
                else args.record]
    env = scale.environment(allocator, {})
    timeout = budget + args.startup_timeout
    result, free, attempts = None, None, []
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                kind, _, body = line.partition(" ")
                if kind not in ("UNCONSTRAINED", "PROBE", "RESULT"):
                    continue
                obj = json.loads(body)
                if kind == "RESULT":
                    result = obj
                    continue
                if kind == "UNCONSTRAINED":
                    free = obj
                else:
                    attempts.append(obj)
                print(f"  {workload} {allocator}: "
                      + ("unconstrained" if obj["limit"] is None else f"limit {obj['limit'] / 1e9:.3f} GB")
                      + (" ok" if obj["ok"] else " OOM")
                      + f" in {obj['seconds']:.1f} s, peak requested {obj['peak_requested_bytes'] / 1e9:.3f} GB,"
                      f" reserved {obj['peak_reserved_bytes'] / 1e9:.3f} GB", flush=True)
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        tail = err.read()[-4000:]
    if result is not None:
        result["attempts"] = attempts
        return result
    passed = [a["limit"] for a in attempts if a["ok"]]
    return {"workload": workload, "allocator": allocator,
            "error": (f"killed after {timeout} s" if proc.returncode == -9
                      else f"exit {proc.returncode} without a result"),
            "tail": tail, "unconstrained": free, "attempts": attempts,
            "smallest_passed_bytes": min(passed) if passed else None}


def summarize(runs):
    """Per workload: the allocator that needs least, and each one's limit over that least."""
    out = {}
    for workload, by_alloc in runs.items():
        found = {a: r["smallest_bytes"] for a, r in by_alloc.items() if r.get("smallest_bytes")}
        if not found:
            continue
        best = min(found, key=found.get)
        out[workload] = {"least": best, "least_bytes": found[best],
                         "over_least": {a: v / found[best] - 1.0 for a, v in found.items()}}
    return out


def table(report):
    runs, summary = report["runs"], report["summary"]
    total = next((r.get("total_bytes") or (r.get("unconstrained") or {}).get("total_bytes")
                  for by in runs.values() for r in by.values()
                  if r.get("total_bytes") or (r.get("unconstrained") or {}).get("total_bytes")), 0)
    lines = ["", "== the smallest memory limit each allocator runs the workload's steps in "
             f"(per-process memory fraction x {total:,} B, {total / 1e9:.2f} GB); "
             "peaks of the unconstrained run", 
             f"{'workload':16s} {'allocator':11s} {'requested GB':>12s} {'allocated GB':>12s} "
             f"{'reserved GB':>11s} {'smallest B':>15s} {'GB':>7s} {'fraction':>8s} "
             f"{'/requested':>10s} {'vs least':>8s} {'probes':>6s} notes"]
    for workload, by_alloc in runs.items():
        s = summary.get(workload, {})
        for a, r in by_alloc.items():
            free = r.get("unconstrained") or {}
            peaks = (f"{free.get('peak_requested_bytes', 0) / 1e9:12.3f} "
                     f"{free.get('peak_allocated_bytes', 0) / 1e9:12.3f} "
                     f"{free.get('peak_reserved_bytes', 0) / 1e9:11.3f}") if free else " " * 37
            if "error" in r:
                lines.append(f"{workload:16s} {a:11s} {peaks} FAILED: {r['error']}")
                continue
            if r["smallest_bytes"] is None:
                lines.append(f"{workload:16s} {a:11s} {peaks} nothing passed")
                continue
            notes = []
            if not r["converged"]:
                notes.append(f"not converged (fails at {r['largest_failing_bytes']:,})")
            if not r["confirmed"]:
                notes.append("unconfirmed")
            if not r["monotonic"]:
                notes.append("non-monotonic")
            if r.get("leaked_bytes", 0) > MiB:
                notes.append(f"{r['leaked_bytes']:,} B stayed between runs")
            vs = s.get("over_least", {}).get(a)
            vs_text = "least" if s.get("least") == a else ("" if vs is None else f"{vs:+.1%}")
            lines.append(f"{workload:16s} {a:11s} {peaks} {r['smallest_bytes']:15,d} "
                         f"{r['smallest_gb']:7.3f} {r['smallest_fraction']:8.5f} "
                         f"{r['smallest_over_requested']:10.4f} {vs_text:>8s} {r['probes']:6d} "
                         + ", ".join(notes))
    for workload, s in summary.items():
        others = ", ".join(f"{a} {v:+.1%}" for a, v in s["over_least"].items() if a != s["least"])
        lines.append(f"{workload}: {s['least']} needs least ({s['least_bytes']:,} B)"
                     + (f"; {others}" if others else ""))
    return "\n".join(lines)


def fit_recordings(report, ccalloc, timeout):
    """`ccalloc fit` of each workload's recording under the three configs, beside the device's
    smallest limit of the allocator each config models."""
    confs = [FIT_CONFS[a] for a in ("ccalloc", "expandable", "native")]
    out = {}
    for workload, by_alloc in report["runs"].items():
        recording = None
        for r in by_alloc.values():
            rec = (r.get("unconstrained") or {}).get("recording")
            if rec and os.path.exists(rec):
                recording = {"path": rec, "recorded_on": r["allocator"],
                             "truncated": r["unconstrained"].get("recording_truncated")}
                break
        if recording is None:
            continue
        cmd = [ccalloc, "fit", recording["path"], "--json"]
        for c in confs:
            cmd += ["--conf", c]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            out[workload] = {"recording": recording, "error": f"ccalloc fit: timed out after {timeout} s"}
            continue
        if proc.returncode != 0 and not proc.stdout.strip().startswith("["):
            out[workload] = {"recording": recording,
                             "error": f"ccalloc fit: exit {proc.returncode}: {proc.stderr[-2000:]}"}
            continue
        fits = json.loads(proc.stdout)
        rows = {}
        for allocator, conf in FIT_CONFS.items():
            fit = next((f for f in fits if f["conf"] == conf), None)
            r = by_alloc.get(allocator)
            if fit is None or r is None or not r.get("smallest_bytes"):
                continue
            device = r["smallest_bytes"]
            rows[allocator] = {
                "conf": conf, "device_smallest_bytes": device,
                "device_largest_failing_bytes": r["largest_failing_bytes"],
                "fit_capacity_bytes": fit["capacity_bytes"],
                "relative_difference": device / fit["capacity_bytes"] - 1.0,
                # Where the fitted capacity lies within the device's bracket, the two agree to
                # the bisection's tolerance.
                "fit_in_device_bracket": r["largest_failing_bytes"] < fit["capacity_bytes"] <= device,
                "fit_floor_bytes": fit["floor_bytes"], "fit_ratio_to_floor": fit["ratio_to_floor"],
                "device_requested_peak_bytes": r["unconstrained"]["peak_requested_bytes"],
                "device_over_requested": r["smallest_over_requested"],
                "fit_verified": fit["verified"]}
        out[workload] = {"recording": recording, "fits": fits, "rows": rows}
    return out


def fit_table(fits):
    lines = ["", "== device smallest limit against `ccalloc fit` of the recording (smallest "
             "simulated device; floor = the trace's peak live requested bytes)",
             f"{'workload':16s} {'allocator':11s} {'conf':33s} {'device B':>15s} {'fit B':>15s} "
             f"{'device/fit-1':>12s} {'dev/req':>8s} {'fit/floor':>9s} notes"]
    within = []
    for workload, f in fits.items():
        if "error" in f:
            lines.append(f"{workload:16s} {f['error']}")
            continue
        for a, row in f["rows"].items():
            notes = []
            if row["fit_in_device_bracket"]:
                notes.append("in the device's bracket")
            if not row["fit_verified"]:
                notes.append("fit NOT verified")
            if f["recording"].get("truncated"):
                notes.append("recording truncated")
            within.append(abs(row["relative_difference"]) <= 0.01)
            lines.append(f"{workload:16s} {a:11s} {row['conf']:33s} "
                         f"{row['device_smallest_bytes']:15,d} {row['fit_capacity_bytes']:15,d} "
                         f"{row['relative_difference']:+12.2%} {row['device_over_requested']:8.4f} "
                         f"{row['fit_ratio_to_floor']:9.4f} " + ", ".join(notes))
        floor = next((r["fit_floor_bytes"] for r in f["rows"].values()), None)
        req = next((r["device_requested_peak_bytes"] for r in f["rows"].values()), None)
        if floor is not None:
            lines.append(f"  {workload}: fit's floor {floor:,} B, the device's requested peak "
                         f"{req:,} B (recorded on {f['recording']['recorded_on']})")
    if within:
        lines.append(f"{sum(within)} of {len(within)} within 1 % of the fit")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(CASES))
    parser.add_argument("--allocators", default="native,expandable,ccalloc",
                        help="of scale.py's: native, expandable, ccalloc, ccalloc_nowait")
    parser.add_argument("--steps", type=int, help="steps of every workload (default: its own)")
    parser.add_argument("--precision", choices=["bf16", "fp32"],
                        help="bf16 (the workloads' own) or fp32 (training without autocast, "
                             "generation in fp32 weights)")
    parser.add_argument("--args", default="{}",
                        help='more keyword arguments per workload as JSON, e.g. '
                             '\'{"llama_train_dyn": {"layers": 24}}\'')
    parser.add_argument("--tolerance-mib", type=int, default=0,
                        help="width of the final bracket (default: 1/512 of the requested "
                             "peak, 2 to 8 MiB)")
    parser.add_argument("--budget", type=float, default=40.0,
                        help="seconds of probing per process (after its unconstrained run)")
    parser.add_argument("--total-budget", type=float, default=420.0,
                        help="seconds for every process together: each probes for at most what "
                             "is left once every later process has 25 s and its own start 12 s")
    parser.add_argument("--startup-timeout", type=float, default=120.0,
                        help="seconds a process may take beyond its probing before it is killed")
    parser.add_argument("--max-probes", type=int, default=24)
    parser.add_argument("--record", metavar="DIR",
                        help="record the unconstrained run's allocation history into DIR")
    parser.add_argument("--record-on", default="native",
                        help="the allocator(s) whose process records (default: native)")
    parser.add_argument("--max-entries", type=int, default=4_000_000)
    parser.add_argument("--fit", metavar="BIN", help="the ccalloc tool: fit the recordings")
    parser.add_argument("--fit-timeout", type=int, default=600)
    parser.add_argument("--from", dest="from_json", metavar="JSON",
                        help="no runs: the table and the fit comparison of an earlier --json")
    parser.add_argument("--json")
    # One process's part (the parent runs these).
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--allocator", help=argparse.SUPPRESS)
    parser.add_argument("--case-args", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        args.workload = args.worker
        worker(args)
        return

    def save(report):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
    else:
        workloads = args.workloads.split(",")
        allocators = args.allocators.split(",")
        for name in workloads:
            if name not in CASES:
                sys.exit(f"smallest.py: unknown workload {name} (known: {', '.join(CASES)})")
        for a in allocators:
            if a not in scale.ALLOCATORS:
                sys.exit(f"smallest.py: unknown allocator {a} (known: {', '.join(scale.ALLOCATORS)})")
        extra = json.loads(args.args)
        args.case_args = {}
        for name in workloads:
            args.case_args[name] = dict(extra.get(name, {}))
            if args.steps:
                args.case_args[name]["steps"] = args.steps
        report = {"settings": {"workloads": workloads, "allocators": allocators,
                               "args": {n: dict(CASES[n]["args"], **args.case_args[n])
                                        for n in workloads},
                               "precision": args.precision or "bf16"},
                  "runs": {}, "summary": {}}
        deadline = time.monotonic() + args.total_budget
        left = len(workloads) * len(allocators)
        for name in workloads:
            for a in allocators:
                # At most --budget, leaving each process after this one 25 s (its start,
                # its unconstrained run and a few probes: the resnet50 runs need no more).
                spare = deadline - time.monotonic() - 25.0 * (left - 1) - 12.0
                budget = max(10.0, min(args.budget, spare))
                print(f"== {name} on {a} (probing for at most {budget:.0f} s)", flush=True)
                r = run_process(name, a, args, budget)
                left -= 1
                report["runs"].setdefault(name, {})[a] = r
                if "error" in r:
                    print(f"{name} {a}: {r['error']}\n{r.get('tail', '')}", flush=True)
                elif r["smallest_bytes"] is None:
                    print(f"{name} {a}: nothing passed up to the device's memory", flush=True)
                else:
                    print(f"{name} {a}: smallest {r['smallest_bytes']:,} B "
                          f"({r['smallest_over_requested']:.4f} x requested), "
                          f"{r['probes']} probes, {r['seconds']} s", flush=True)
                report["summary"] = summarize(report["runs"])
                save(report)
    report["summary"] = summarize(report["runs"])
    print(table(report), flush=True)
    if args.fit:
        report["fit"] = fit_recordings(report, args.fit, args.fit_timeout)
        print(fit_table(report["fit"]), flush=True)
    save(report)
    failed = [f"{w} {a}" for w, by in report["runs"].items() for a, r in by.items()
              if "error" in r or r.get("smallest_bytes") is None]
    if failed:
        print("failed: " + ", ".join(failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
