#!/usr/bin/env python3
"""The at-scale benchmark: sharded and data-parallel training on several GPUs, dynamic-shape
LLM training, a training run with side streams and serving, each on PyTorch's native
allocator, PyTorch with expandable_segments:True and ccalloc's default preset.

    python3 bench/torch/scale.py [--cases fsdp2,fsdp2_avoid_rs,ddp,fsdp2_tp,pp,llama_train,gpt2_side,serve]
        [--allocators native,expandable,ccalloc] [--rounds 4] [--cpus 0-7] [--json out.json]
    python3 bench/torch/scale.py --record DIR --allocators native   # recordings, as data/traces

Every run is a fresh process (torchrun with one process per GPU for the distributed
cases). Round k runs the allocators in the given order when k is even and in the reverse
order when k is odd (A B C, C B A, A B C, ...), so that drift of the machine reaches every
allocator alike; all processes are pinned to the same CPUs. With --gated, a round runs the
allocators' processes side by side instead (for a distributed case, one torchrun job each on
the same GPUs), taking turns step by step in alternating order (A B C on one step, C B A on
the next), so that each step's times compare on the machine as it is at that moment. For each case and allocator
the table gives:
  - peak reserved and peak requested bytes, per rank (the largest rank's) and their ratio;
  - the step time: the median over rounds of each round's median step (the slowest rank's
    time per step for the distributed cases);
  - against native: the median over rounds of (this allocator's round median / native's
    round median), with the smallest and largest round ratio (the spread);
  - driver calls per step after the warm-up (PyTorch: cudaMalloc + cudaFree, or maps +
    unmaps of expandable segments; ccalloc: every creation, map, access grant, unmap and
    release, and the time spent in them), the largest rank's; for ccalloc, its sharing
    between streams over the whole run (fences, handles taken, waits);
  - whether the outputs (losses, token hashes) equal native's, rank by rank.
With --record DIR each case first runs once on --record-on (native) with its allocation
history recorded (not timed): DIR/CASE.pickle.gz, or DIR/CASE.rankR.pickle.gz per rank, and
DIR/measured.json with every run's peaks."""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# kind "dist": run_dist.py under torchrun on `gpus` GPUs; kind "one": run_one.py.
CASES = {
    "fsdp2": {"kind": "dist", "workload": "fsdp2_lm", "steps": 16,
              "env": {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}},
    "fsdp2_avoid_rs": {"kind": "dist", "workload": "fsdp2_lm", "steps": 16,
                       "env": {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}},
    "ddp": {"kind": "dist", "workload": "ddp_lm", "steps": 16,
            "env": {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}},
    # Four GPUs' layouts (any rank count: tp = 2 where it is even; one stage per rank).
    "fsdp2_tp": {"kind": "dist", "workload": "fsdp2_tp_lm", "steps": 16,
                 "env": {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}},
    "pp": {"kind": "dist", "workload": "pp_lm", "steps": 16,
           "env": {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}},
    "llama_train": {"kind": "one", "workload": "llama_train_dyn", "steps": 12},
    "gpt2_side": {"kind": "one", "workload": "gpt2_sidestreams", "steps": 20},
    "serve": {"kind": "one", "workload": "llama_generate", "steps": 12},
}
WARMUP = {"fsdp2_lm": 3, "ddp_lm": 3, "fsdp2_tp_lm": 3, "pp_lm": 4, "llama_train_dyn": 2, "gpt2_sidestreams": 3,
          "llama_generate": 2}
ALLOCATORS = {
    "native": ("pytorch", {}),
    "expandable": ("pytorch", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "ccalloc": ("ccalloc", {"CCALLOC_CONF": "ccalloc"}),
    # The default policy without waits on a busy stream's fences (rule 9's trade, off).
    "ccalloc_nowait": ("ccalloc", {"CCALLOC_CONF": "ccalloc,stream_borrow_wait:False"}),
}
# A driver-call probe's keys (probes.py): memory calls counted, the time in them, and the
# stitching policy's sharing between streams (cumulative, reported for the whole run).
CALL_KEYS = ("device_alloc", "device_free", "malloc", "free", "create", "release", "map",
             "set_access", "unmap")
TIME_KEY = "call_ns"
SHARING_KEYS = ("fences", "borrowed_handles", "borrowed_pieces", "borrow_waits",
                "fence_latency_us", "busy_borrow_waits")


def parse_cpus(text):
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def environment(allocator, case):
    env = dict(os.environ)
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "CCALLOC_CONF", "TORCH_NCCL_AVOID_RECORD_STREAMS"):
        env.pop(key, None)
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(ALLOCATORS[allocator][1])
    env.update(case.get("env", {}))
    return env


def command(name, allocator, gpus, record_dir=None):
    case = CASES[name]
    which = ALLOCATORS[allocator][0]
    if case["kind"] == "dist":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={gpus}", os.path.join(HERE, "run_dist.py"), case["workload"],
               "--allocator", which, "--steps", str(case["steps"])]
        if record_dir:
            cmd += ["--record", "--out", record_dir, "--name", name]
        return cmd
    if record_dir:
        return [sys.executable, os.path.join(HERE, "record.py"), case["workload"], "--record",
                "--out", record_dir, "--name", name, "--args", json.dumps({"steps": case["steps"]})]
    return [sys.executable, os.path.join(HERE, "run_one.py"), case["workload"], "--allocator",
            which, "--steps", str(case["steps"])]


def run(name, allocator, gpus, cpus, timeout, record_dir=None):
    """One process (or torchrun) of case `name` on `allocator`: its result with every rank
    under "ranks" (one rank for a single-GPU case), or {"error": ...}."""
    cmd = command(name, allocator, gpus, record_dir)
    try:
        proc = subprocess.run(cmd, env=environment(allocator, CASES[name]), capture_output=True,
                              text=True, timeout=timeout,
                              preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout} s", "tail": str(e.stdout)[-2000:]}
    text = proc.stdout
    for line in text.splitlines():
        # record.py prints its JSON as the last line; the others prefix it with RESULT.
        body = line[len("RESULT "):] if line.startswith("RESULT ") else line
        if not body.startswith("{"):
            continue
        try:
            result = json.loads(body)
        except json.JSONDecodeError:
            continue
        if "ranks" not in result:
            result = {"ranks": [dict(result, rank=0)]}
        return result
    return {"error": f"exit {proc.returncode}", "tail": (text[-2000:] + proc.stderr[-4000:])}


def run_gated(name, allocators, cpus, timeout, flip):
    """One process per allocator of a single-GPU case, all up at once, taking turns step by
    step (run_one.py --gated): each step runs on every allocator back to back, in the given
    order on even steps and the reverse on odd ones (reversed again by `flip`), and no
    process works while another's step is timed. Returns {allocator: result}."""
    case = CASES[name]
    workers = {}
    results = {}
    try:
        for a in allocators:
            cmd = command(name, a, 1) + ["--gated"]
            workers[a] = subprocess.Popen(
                cmd, env=environment(a, case), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True, bufsize=1,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)

        def advance(a):
            for line in workers[a].stdout:
                if line.startswith("WAIT "):
                    return "WAIT"
                if line.startswith("RESULT "):
                    results[a] = {"ranks": [dict(json.loads(line[len("RESULT "):]), rank=0)]}
                    return "RESULT"
            results[a] = {"error": f"exit {workers[a].wait()} before its result"}
            return "END"

        state = {a: advance(a) for a in allocators}
        order = list(reversed(allocators)) if flip else list(allocators)
        while all(v == "WAIT" for v in state.values()):
            for a in order:
                workers[a].stdin.write("go\n")
                workers[a].stdin.flush()
                line = workers[a].stdout.readline()
                if not line.startswith("DONE "):
                    results[a] = {"error": f"expected DONE, read {line[:200]!r}"}
                    return results
                state[a] = advance(a)
            order.reverse()
        for a in allocators:
            results.setdefault(a, {"error": f"stopped with the others at {state}"})
        return results
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                try:
                    proc.stdin.close()
                    proc.wait(timeout=timeout)
                except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                    proc.kill()
                    proc.wait()


def run_gated_dist(name, allocators, gpus, cpus, timeout, flip):
    """The distributed form of run_gated: one torchrun job per allocator, all up at once on
    the same GPUs, taking turns step by step through files (run_dist.py --gate): each step
    runs on every job back to back, in alternating order, and a job starts its step only once
    the job before it has finished its own and reached its next gate (or exited, after the
    last step). Returns {allocator: result}."""
    case = CASES[name]
    total = WARMUP[case["workload"]] + case["steps"]
    jobs, results = {}, {}
    root = tempfile.mkdtemp(prefix="scale_gate_")

    def wait_for(a, prefix, what):
        deadline = time.monotonic() + timeout
        want = [os.path.join(root, a, f"{prefix}.{r}") for r in range(gpus)]
        while not all(os.path.exists(f) for f in want):
            if jobs[a][0].poll() is not None:
                return f"exited ({jobs[a][0].returncode}) before {what}"
            if time.monotonic() > deadline:
                return f"timed out before {what}"
            time.sleep(0.0002)
        return None

    try:
        for a in allocators:
            os.makedirs(os.path.join(root, a))
            out = open(os.path.join(root, a + ".out"), "w+")
            cmd = command(name, a, gpus) + ["--gate", os.path.join(root, a)]
            jobs[a] = (subprocess.Popen(
                cmd, env=environment(a, case), stdout=out, stderr=subprocess.STDOUT, text=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None), out)
        order = list(reversed(allocators)) if flip else list(allocators)
        failed = {}
        for step in range(total):
            for a in order:
                if a in failed:
                    continue
                error = wait_for(a, f"ready.{step}", f"step {step}")
                if error is None:
                    with open(os.path.join(root, a, f"go.{step}"), "w"):
                        pass
                    error = wait_for(a, f"done.{step}", f"the end of step {step}")
                if error is None and step == total - 1:
                    try:  # its end (gather, teardown) before the next job's last step
                        jobs[a][0].wait(timeout=timeout)
                    except subprocess.TimeoutExpired:
                        error = "did not exit after its last step"
                if error is not None:
                    failed[a] = error
            order.reverse()
        for a in allocators:
            proc, out = jobs[a]
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out.seek(0)
            text = out.read()
            for line in text.splitlines():
                if line.startswith("RESULT "):
                    results[a] = json.loads(line[len("RESULT "):])
            if a not in results:
                results[a] = {"error": failed.get(a, f"exit {proc.returncode} without a result"),
                              "tail": text[-3000:]}
        return results
    finally:
        for proc, out in jobs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
        shutil.rmtree(root, ignore_errors=True)


def steps_of(result, warmup):
    """Per timed step, the slowest rank's time; per rank, calls per step after the warm-up."""
    ranks = result["ranks"]
    n = min(len(r["step_times_s"]) for r in ranks)
    times = [max(r["step_times_s"][i] for r in ranks) for i in range(n)]
    calls = []
    for r in ranks:
        probes = r.get("step_probes") or []
        if len(probes) <= warmup:
            continue
        first, last = probes[warmup - 1], probes[-1]
        steps = len(probes) - warmup
        calls.append({k: (last[k] - first[k]) / steps for k in last if k not in SHARING_KEYS})
    return times, calls


def summarize(name, runs, allocators):
    """runs: {allocator: [result per round]} -> one row of figures per allocator."""
    warmup = WARMUP[CASES[name]["workload"]]
    rows = {}
    base = runs.get(allocators[0], [])
    for a in allocators:
        ok = [r for r in runs[a] if "error" not in r]
        if not ok:
            rows[a] = {"error": runs[a][0]["error"] if runs[a] else "not run"}
            continue
        medians = [statistics.median(steps_of(r, warmup)[0]) for r in ok]
        first = ok[0]["ranks"]
        reserved = max(r["peak_reserved_bytes"] for r in first)
        requested = max(r.get("peak_requested_bytes", 0) for r in first)
        calls = steps_of(ok[0], warmup)[1]
        per_step = {}
        for c in calls:
            for k, v in c.items():
                per_step[k] = max(per_step.get(k, 0.0), v)
        same_memory = all(max(x["peak_reserved_bytes"] for x in r["ranks"]) == reserved for r in ok)
        sharing = [{k: (r.get("step_probes") or [{}])[-1].get(k) for k in SHARING_KEYS}
                   for r in first]
        row = {"rounds": len(ok), "peak_reserved_bytes": reserved, "sharing": sharing,
               "peak_requested_bytes": requested,
               "per_rank_reserved": [r["peak_reserved_bytes"] for r in first],
               "per_rank_requested": [r.get("peak_requested_bytes", 0) for r in first],
               "reserved_over_requested": reserved / requested if requested else None,
               "peaks_repeat": same_memory,
               "round_medians_s": medians, "median_step_s": statistics.median(medians),
               "driver_calls_per_step": per_step}
        if base and a != allocators[0]:
            pairs = [(r, b) for r, b in zip(runs[a], base) if "error" not in r and "error" not in b]
            ratios = [statistics.median(steps_of(r, warmup)[0]) /
                      statistics.median(steps_of(b, warmup)[0]) for r, b in pairs]
            if ratios:
                row.update(ratio_vs_first=statistics.median(ratios),
                           ratio_spread=[min(ratios), max(ratios)], round_ratios=ratios)
            if pairs:
                row["outputs_equal_first"] = all(
                    [x["outputs"] for x in r["ranks"]] == [x["outputs"] for x in b["ranks"]]
                    for r, b in pairs)
                # How far apart, where they differ: the largest relative difference of any
                # rank's step output (reduction orders that depend on an address's alignment
                # or on timing move losses by a few units in the fifth digit).
                row["outputs_max_rel_diff"] = max(
                    (abs(u - v) / max(abs(v), 1e-30)
                     for r, b in pairs for x, y in zip(r["ranks"], b["ranks"])
                     for u, v in zip(x["outputs"], y["outputs"])
                     if isinstance(u, (int, float)) and isinstance(v, (int, float))),
                    default=0.0)
        rows[a] = row
    return rows


def table(summary, allocators):
    lines = ["", "== at scale: peak reserved / requested per rank, step time against "
             f"{allocators[0]} (median over rounds [spread]), driver calls per step"]
    head = (f"{'case':15s} {'allocator':11s} {'reserved MB':>12s} {'requested MB':>13s} "
            f"{'ratio':>6s} {'step ms':>9s} {'vs ' + allocators[0]:>22s} {'calls/step':>11s} "
            f"{'us/step':>8s} outputs")
    lines.append(head)
    for name, rows in summary.items():
        for a in allocators:
            r = rows.get(a)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"{name:15s} {a:11s} FAILED: {r['error']}")
                continue
            calls = r["driver_calls_per_step"]
            count = sum(v for k, v in calls.items() if k in CALL_KEYS)
            us = calls.get(TIME_KEY, 0.0) / 1e3
            vs = ""
            if "ratio_vs_first" in r:
                lo, hi = r["ratio_spread"]
                vs = f"{r['ratio_vs_first']:.3f} [{lo:.3f},{hi:.3f}]"
            same = r.get("outputs_equal_first")
            apart = "" if same in (None, True) else f" (<= {r['outputs_max_rel_diff']:.1e})"
            lines.append(
                f"{name:15s} {a:11s} {r['peak_reserved_bytes'] / 1e6:12.1f} "
                f"{r['peak_requested_bytes'] / 1e6:13.1f} "
                f"{(r['reserved_over_requested'] or 0):6.3f} {r['median_step_s'] * 1e3:9.2f} "
                f"{vs:>22s} {count:11.2f} {us:8.1f} "
                f"{'' if same is None else ('equal' if same else 'DIFFER')}{apart}")
    for name, rows in summary.items():
        for a in allocators:
            r = rows.get(a) or {}
            for rank, sh in enumerate(r.get("sharing") or []):
                if sh.get("fences") is not None:
                    lines.append(f"  {name} {a} rank {rank}: {sh['fences']} fences (recent latency "
                                 f"{sh['fence_latency_us']} us), {sh['borrowed_handles']} handles "
                                 f"({sh['borrowed_pieces']} pieces) taken from other streams, "
                                 f"{sh['borrow_waits']} behind a wait "
                                 f"({sh.get('busy_borrow_waits')} on a busy stream)")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--allocators", default="native,expandable,ccalloc")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the distributed cases")
    parser.add_argument("--cpus", help="pin every process to these CPUs, e.g. 0-15")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per process")
    parser.add_argument("--record", metavar="DIR", help="first record each case once")
    parser.add_argument("--record-on", default="native", choices=list(ALLOCATORS),
                        help="the allocator of the recordings (default: native)")
    parser.add_argument("--gated", action="store_true",
                        help="each round runs the allocators' processes (torchrun jobs for the "
                             "distributed cases) side by side, taking turns step by step (their "
                             "memory is on the GPUs at once)")
    parser.add_argument("--steps", type=int, help="timed steps of every case (default: its own)")
    parser.add_argument("--json")
    args = parser.parse_args()
    cases = args.cases.split(",")
    if args.steps:
        for name in cases:
            CASES[name]["steps"] = args.steps
    allocators = args.allocators.split(",")
    cpus = parse_cpus(args.cpus) if args.cpus else None
    report = {"cases": {}, "recorded": {}}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    if args.record:
        os.makedirs(args.record, exist_ok=True)
        for name in cases:
            r = run(name, args.record_on, args.gpus, cpus, args.timeout, record_dir=args.record)
            report["recorded"][name] = r
            print(f"recorded {name} on {args.record_on}: " +
                  (r["error"] + "\n" + r.get("tail", "") if "error" in r else
                   ", ".join(f"rank {x['rank']} reserved {x['peak_reserved_bytes']:,} "
                             f"requested {x.get('peak_requested_bytes', 0):,}" for x in r["ranks"])),
                  flush=True)
            save()
    for name in cases:
        runs = {a: [] for a in allocators}
        for k in range(args.rounds):
            if args.gated:
                if CASES[name]["kind"] == "one":
                    pair = run_gated(name, allocators, cpus, args.timeout, flip=k % 2 == 1)
                else:
                    pair = run_gated_dist(name, allocators, args.gpus, cpus, args.timeout,
                                          flip=k % 2 == 1)
                for a in allocators:
                    r = pair[a]
                    runs[a].append(r)
                    if "error" in r:
                        print(f"{name} {a} round {k}: {r['error']}\n{r.get('tail', '')}",
                              flush=True)
                    else:
                        t, _ = steps_of(r, WARMUP[CASES[name]["workload"]])
                        print(f"{name} {a} round {k} (gated): median step "
                              f"{statistics.median(t) * 1e3:.2f} ms, reserved "
                              f"{r['ranks'][0]['peak_reserved_bytes']:,}", flush=True)
                report["cases"].setdefault(name, {})["runs"] = runs
                save()
                continue
            for a in (allocators if k % 2 == 0 else list(reversed(allocators))):
                r = run(name, a, args.gpus, cpus, args.timeout)
                runs[a].append(r)
                if "error" in r:
                    print(f"{name} {a} round {k}: {r['error']}\n{r.get('tail', '')}", flush=True)
                else:
                    t, _ = steps_of(r, WARMUP[CASES[name]["workload"]])
                    print(f"{name} {a} round {k}: median step {statistics.median(t) * 1e3:.2f} ms, "
                          f"reserved {max(x['peak_reserved_bytes'] for x in r['ranks']):,}",
                          flush=True)
                report["cases"].setdefault(name, {})["runs"] = runs
                save()
        report["cases"][name]["summary"] = summarize(name, runs, allocators)
        save()
    print(table({n: c["summary"] for n, c in report["cases"].items() if "summary" in c},
                allocators))
    if args.record:
        measured = {}
        for name, r in report["recorded"].items():
            if "error" not in r:
                measured[name] = {"ranks": [{k: x.get(k) for k in
                                             ("peak_reserved_bytes", "peak_requested_bytes",
                                              "peak_allocated_bytes", "num_device_alloc")}
                                            for x in r["ranks"]]}
        for name, c in report["cases"].items():
            for a, row in c.get("summary", {}).items():
                if "error" not in row:
                    measured.setdefault(name, {})[a] = {
                        "per_rank_reserved": row["per_rank_reserved"],
                        "per_rank_requested": row["per_rank_requested"]}
        with open(os.path.join(args.record, "measured.json"), "w") as f:
            json.dump(measured, f, indent=1)


if __name__ == "__main__":
    main()
