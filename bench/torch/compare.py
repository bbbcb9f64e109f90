#!/usr/bin/env python3
"""The real-model benchmark: every workload once on PyTorch's allocator and once on
ccalloc, each in a fresh process, with PyTorch's native policy and with
expandable_segments:True on both sides. Prints a table and writes JSON.

    python3 bench/torch/compare.py [--json results.json] [--workloads a,b] [--modes native,expandable,ccalloc]

Step time is the median over the timed steps of every process of an allocator (pooled).
Where step shapes vary, a step's time depends mostly on its shape, so the pooled median says
little about the allocator; the paired figure compares step i with step i (the same shapes
in every process, the workloads being seeded): for each step the median over an
allocator's processes, then the median over steps of ccalloc's / PyTorch's. The verdict
(exit status) uses the paired figure (at most +3 %). Outputs must match bit for bit.

With --interleave the allocators' processes run side by side instead of one after the
other, taking turns step by step (run_one.py --gated): step i runs on one allocator right
after it ran on the other, the order alternating, so that the machine's drift (clocks,
other load), which moves a CPU-bound step by tens of per cent from one second to the next,
reaches both sides of each pair alike. The paired figure is then the median, over every
pair of neighbouring steps of every repeat, of ccalloc's time / PyTorch's, with a 95 %
bootstrap interval; each row says whether that interval lies within +2 % ('within'), above
it ('slower', which fails the run) or across it ('undecided')."""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = {
    "native": ("", "pytorch"),
    "expandable": ("expandable_segments:True", "pytorch,expandable_segments:True"),
    # ccalloc's default preset (its stitching policy, private pools beside it;
    # docs/ccalloc-policy.md) against PyTorch's native setting and against PyTorch's
    # expandable segments.
    "ccalloc": ("", "ccalloc"),
    "ccalloc-vs-expandable": ("expandable_segments:True", "ccalloc"),
    "stitch": ("", "ccalloc,stitch_segments:True"),  # the same as "ccalloc", by its key
}


def environment(allocator, mode):
    torch_conf, ccalloc_conf = MODES[mode]
    env = dict(os.environ)
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("CCALLOC_CONF", None)
    if allocator == "pytorch" and torch_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = torch_conf
    if allocator == "ccalloc":
        env["CCALLOC_CONF"] = ccalloc_conf
    return env


def pinning(cpus):
    # The same CPUs for every process: where the scheduler places a process (and how far its
    # cores are from the GPU) otherwise moves a CPU-bound step time by several per cent.
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def step_args(steps):
    return ["--steps", str(steps)] if steps else []


def run(workload, allocator, mode, cpus=None, steps=None):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "run_one.py"), workload,
                           "--allocator", allocator, *step_args(steps)],
                          env=environment(allocator, mode),
                          capture_output=True, text=True, preexec_fn=pinning(cpus))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
    raise RuntimeError(f"{workload} on {allocator} ({mode}) failed with exit {proc.returncode}")


def run_interleaved(workload, allocators, mode, cpus=None, flip=False, steps=None):
    """One process per allocator, all up at once, taking turns step by step: step i runs on
    one allocator right after (or right before) it ran on the other, the order alternating
    from step to step (and reversed by `flip`), and no process works while another's step
    is timed. Machine drift slower than a step reaches both sides of a pair alike.
    Returns {allocator: run_one.py's result}."""
    workers = {}
    try:
        for a in allocators:
            err = tempfile.TemporaryFile(mode="w+")
            proc = subprocess.Popen([sys.executable, os.path.join(HERE, "run_one.py"), workload,
                                     "--allocator", a, "--gated", *step_args(steps)],
                                    env=environment(a, mode),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                    text=True, bufsize=1, preexec_fn=pinning(cpus))
            workers[a] = (proc, err)

        def fail(a, why):
            proc, err = workers[a]
            try:
                proc.wait(timeout=5)  # its exit status, where it is ending
            except subprocess.TimeoutExpired:
                pass
            err.seek(0)
            sys.stderr.write(err.read()[-6000:])
            raise RuntimeError(f"{workload} on {a} ({mode}): {why} (exit {proc.poll()})")

        def advance(a):
            """Reads a's output up to its next turn ('WAIT', step) or its end ('RESULT', dict)."""
            proc = workers[a][0]
            for line in proc.stdout:
                if line.startswith("WAIT "):
                    return "WAIT", int(line.split()[1])
                if line.startswith("RESULT "):
                    return "RESULT", json.loads(line[len("RESULT "):])
            fail(a, "ended without a result")

        state = {a: advance(a) for a in allocators}
        order = list(reversed(allocators)) if flip else list(allocators)
        while any(kind == "WAIT" for kind, _ in state.values()):
            if any(turn != state[order[0]] for turn in state.values()):
                fail(order[0], f"processes out of step: {state}")
            for a in order:
                proc = workers[a][0]
                proc.stdin.write("go\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line.startswith("DONE "):
                    fail(a, f"expected DONE, read {line[:200]!r}")
                state[a] = advance(a)  # a idles at its next turn before the next one runs
            order.reverse()
        results = {a: value for a, (kind, value) in state.items()}
        for proc, _ in workers.values():
            proc.stdin.close()
            proc.wait()
        return results
    finally:
        for proc, err in workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()


def pool(results):
    """One result from repeated runs: step times pooled (median of all steps); outputs and
    memory must agree between the repeats (they are deterministic)."""
    first = dict(results[0])
    times = [t for r in results for t in r["step_times_s"]]
    first["step_times_s"] = times
    first["step_cpu_s"] = [t for r in results for t in r.get("step_cpu_s", [])]
    first["median_step_s"] = statistics.median(times)
    first["repeats_agree"] = all(r["outputs"] == first["outputs"] and
                                 r["peak_reserved_bytes"] == first["peak_reserved_bytes"]
                                 for r in results)
    return first


def paired_delta(pt_runs, cc_runs):
    """Median over steps of (ccalloc's step time / PyTorch's) - 1, each step's time the
    median over that allocator's processes; and the same for the sum of the steps."""
    def per_step(runs):
        return [statistics.median(r["step_times_s"][i] for r in runs)
                for i in range(min(len(r["step_times_s"]) for r in runs))]
    pt, cc = per_step(pt_runs), per_step(cc_runs)
    n = min(len(pt), len(cc))
    ratios = [cc[i] / pt[i] for i in range(n)]
    return statistics.median(ratios) - 1.0, sum(cc[:n]) / sum(pt[:n]) - 1.0


def pair_ratios(pt_runs, cc_runs, key="step_times_s"):
    """For runs made by run_interleaved (pt_runs[k] beside cc_runs[k]): ccalloc's step time /
    PyTorch's for every pair (k, step) of neighbouring steps."""
    return [b / a for pt, cc in zip(pt_runs, cc_runs) for a, b in zip(pt[key], cc[key])]


def interleaved_delta(pt_runs, cc_runs, key="step_times_s"):
    """The median over every pair (k, step) of pair_ratios, - 1; and the ratio of the sums,
    - 1. key="step_cpu_s" gives the same for the steps' CPU times."""
    ratios = pair_ratios(pt_runs, cc_runs, key)
    pt_sum = cc_sum = 0.0
    for pt, cc in zip(pt_runs, cc_runs):
        n = min(len(pt[key]), len(cc[key]))
        pt_sum, cc_sum = pt_sum + sum(pt[key][:n]), cc_sum + sum(cc[key][:n])
    return statistics.median(ratios) - 1.0, cc_sum / pt_sum - 1.0


def median_interval(values, resamples=2000, seed=0):
    """A 95 % bootstrap interval of the median of `values` (percentiles 2.5 and 97.5 of the
    medians of `resamples` resamples, seeded: the same values give the same interval)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def step_verdict(lo, hi, bound=0.02):
    """What a paired interval [lo, hi] (ccalloc's step time over PyTorch's, - 1) says of the
    bound: 'within' (all of it at or below +bound), 'slower' (all of it above), else
    'undecided'."""
    if hi <= bound:
        return "within"
    return "slower" if lo > bound else "undecided"


def gib(n):
    return f"{n / 2**30:.2f} GiB"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--workloads", default="resnet50,gpt2_varlen,llama_generate,llama_serve,finetune_bf16,compiled_gpt2,compiled_mlp")
    parser.add_argument("--modes", default="native,expandable,ccalloc")
    parser.add_argument("--repeats", type=int, default=2,
                        help="processes per allocator, interleaved; step times are pooled")
    parser.add_argument("--cpus", help="run every process on these CPUs, e.g. 0-7 or 0,2,4")
    parser.add_argument("--interleave", action="store_true",
                        help="run the allocators' processes side by side, taking turns step by "
                             "step, and pair each step with its neighbour in time (their memory "
                             "is on the GPU at once: the workloads must fit together)")
    parser.add_argument("--steps", type=int,
                        help="timed steps per process (default: each workload's own)")
    parser.add_argument("--control", action="store_true",
                        help="also run PyTorch's allocator with ccalloc's libraries loaded")
    args = parser.parse_args()
    cpus = None
    if args.cpus:
        cpus = set()
        for part in args.cpus.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    allocators = ("pytorch", "ccalloc") + (("pytorch-loaded",) if args.control else ())

    rows, failures = [], 0
    for mode in args.modes.split(","):
        for workload in args.workloads.split(","):
            # Interleaved processes per allocator: a slow phase of the machine hits both.
            runs = {a: [] for a in allocators}
            for k in range(args.repeats):
                if args.interleave:
                    pair = run_interleaved(workload, allocators, mode, cpus, flip=k % 2 == 1,
                                           steps=args.steps)
                    for allocator in allocators:
                        runs[allocator].append(pair[allocator])
                    continue
                for allocator in allocators:
                    runs[allocator].append(run(workload, allocator, mode, cpus, args.steps))
            pt, cc = (pool(runs["pytorch"]), pool(runs["ccalloc"]))
            per_process = {a: [round(r["median_step_s"] * 1e3, 3) for r in rs] for a, rs in runs.items()}
            identical = pt["outputs"] == cc["outputs"]
            delta = cc["median_step_s"] / pt["median_step_s"] - 1.0
            paired, total = (interleaved_delta if args.interleave else paired_delta)(
                runs["pytorch"], runs["ccalloc"])
            rows.append({"mode": mode, "workload": workload, "pytorch": pt, "ccalloc": cc,
                         "outputs_identical": identical, "step_time_delta": delta,
                         "paired_step_delta": paired, "total_time_delta": total,
                         "per_process_median_ms": per_process,
                         "per_process_step_s": {a: [r["step_times_s"] for r in rs]
                                                for a, rs in runs.items()}})
            cpu_note = ""
            if args.interleave:
                cpu_paired, cpu_total = interleaved_delta(runs["pytorch"], runs["ccalloc"],
                                                          key="step_cpu_s")
                rows[-1].update(paired_cpu_delta=cpu_paired, total_cpu_delta=cpu_total)
                lo, hi = median_interval(pair_ratios(runs["pytorch"], runs["ccalloc"]))
                verdict = step_verdict(lo - 1.0, hi - 1.0)
                rows[-1].update(paired_interval=[lo - 1.0, hi - 1.0], step_verdict=verdict)
                cpu_note = (f"; 95% interval {lo - 1.0:+.1%}..{hi - 1.0:+.1%}; CPU time paired "
                            f"{cpu_paired:+.1%}, total {cpu_total:+.1%}; {verdict}")
            if args.control:
                rows[-1]["pytorch-loaded"] = pool(runs["pytorch-loaded"])
            # Interleaved, the interval decides: slower only where all of it is above +2 %.
            fast_enough = rows[-1]["step_verdict"] != "slower" if args.interleave else paired <= 0.03
            ok = identical and fast_enough and cc["peak_reserved_bytes"] <= pt["peak_reserved_bytes"]
            failures += 0 if ok else 1
            print(f"{mode:10s} {workload:15s} step {pt['median_step_s']*1e3:8.2f} ms -> "
                  f"{cc['median_step_s']*1e3:8.2f} ms ({delta:+.1%}; paired {paired:+.1%}, "
                  f"total {total:+.1%}{cpu_note})  peak reserved "
                  f"{pt['peak_reserved_bytes']:,} -> {cc['peak_reserved_bytes']:,} B  "
                  f"device allocs {pt['num_device_alloc']} -> {cc['num_device_alloc']}  "
                  f"outputs {'identical' if identical else 'DIFFER'}  [{cc['installed']}]",
                  flush=True)
            print("    per process (ms): " + "; ".join(f"{a} {v}" for a, v in per_process.items()),
                  flush=True)
            # After every row, so that a run stopped by a time limit keeps what it measured.
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print("\n== real models: PyTorch's allocator vs ccalloc (median step time; peak reserved)")
    print(f"{'mode':10s} {'workload':15s} {'step PyTorch':>13s} {'step ccalloc':>13s} {'delta':>7s} {'paired':>7s} "
          f"{'reserved PyTorch':>17s} {'reserved ccalloc':>17s} {'allocs':>11s} outputs")
    for r in rows:
        pt, cc = r["pytorch"], r["ccalloc"]
        print(f"{r['mode']:10s} {r['workload']:15s} {pt['median_step_s']*1e3:10.2f} ms "
              f"{cc['median_step_s']*1e3:10.2f} ms {r['step_time_delta']:+7.1%} {r['paired_step_delta']:+7.1%} "
              f"{gib(pt['peak_reserved_bytes']):>17s} {gib(cc['peak_reserved_bytes']):>17s} "
              f"{pt['num_device_alloc']:>5d}/{cc['num_device_alloc']:<5d} "
              f"{'identical' if r['outputs_identical'] else 'DIFFER'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
