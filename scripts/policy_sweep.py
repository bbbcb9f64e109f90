#!/usr/bin/env python3
"""Judges an allocator configuration on many workloads at once: the bundled recordings and
generated ones, each replayed on the simulated GPU under PyTorch's native policy, PyTorch's
expandable segments and every configuration under test.

    python3 scripts/policy_sweep.py [--conf C]... [--synthetic N] [--first-seed S]
                                    [--scales 0.25,0.5,1,2] [--no-recordings] [--fit]
                                    [--ccalloc BINARY] [--json FILE] [--keep DIR]
    python3 scripts/policy_sweep.py --self-test [--ccalloc BINARY]

Each row is a workload: the floor (peak live requested bytes), peak reserved / floor under
each of PyTorch's settings (PYTORCH_SETTINGS: native, expandable segments,
garbage_collection_threshold, roundup_power2_divisions, max_split_size_mb; --pytorch
replaces them) and, per configuration under test, peak reserved / floor and the simulated
driver time. A configuration's cell is flagged
  *  peak above the best of PyTorch's settings,
  !  more simulated driver time than expandable segments,
  >  peak above 1.03 x the floor.
The summary gives, per configuration, how many workloads carry each flag, the median and
the worst of (peak ratio - the best PyTorch setting's), and how many are more than 1 %
worse or better than it. A policy change is judged on the whole set: changes to how memory
grows move individual workloads in either direction, and a change that fixes one recording
often breaks another.

Generated workloads (--synthetic N: N seeds of each kind, each at four scales, 0.25x to 2x;
0 for none) are deterministic functions of (kind, seed, scale), written as trace CSVs:
  train  a training loop: persistent parameters, one gradient per parameter, then twelve
         steps of a varying length (0.5x to 2x), each layer allocating a temporary and an
         activation that lives until the backward pass, plus small tensors;
  serve  an inference server: persistent weights, up to sixteen requests at a time, each
         growing its own cache blocks until it finishes, and per-step temporaries whose size
         follows the number of cached blocks.
They are models of those workloads' allocation patterns, not recordings; a configuration
that does well on them has not been shown to do well on real ones, and the reverse.
--first-seed S starts the seeds at S (seeds S to S+N-1), to judge on workloads that played
no part in choosing a rule; --scales keeps only the given scales.

--fit judges memory under a device limit instead: each cell is `ccalloc fit`'s smallest
capacity / floor (verified) and the driver time of the replay at it, flagged
  *  above the best fit of PyTorch's settings,
  >  above 1.03 x the floor
(no `!`: under a limit both spend more driver time, and the figures are not comparable at
different capacities). It takes some ten times as long as a replay.

The binary defaults to build/release/bin/ccalloc, built as scripts/run-main builds it.
--self-test checks the generators (deterministic, well formed) and the flags and summary on
fixed figures; with a binary, also one generated workload end to end (the replay's floor
equals the workload's own peak of live requested bytes).
"""

import argparse
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
SCALES = (0.25, 0.5, 1.0, 2.0)
NATIVE = "pytorch"
EXPANDABLE = "pytorch,expandable_segments:True"
# PyTorch's settings a configuration is judged against, native and expandable segments first
# (the tables name them by the short names). The garbage-collection threshold acts against
# the device's capacity (or the limit under --fit), as PyTorch's acts against the memory
# fraction.
PYTORCH_SETTINGS = [
    ("native", NATIVE),
    ("expand", EXPANDABLE),
    ("gc0.8", "pytorch,garbage_collection_threshold:0.8"),
    ("rup4", "pytorch,roundup_power2_divisions:4"),
    ("split128", "pytorch,max_split_size_mb:128"),
]


class Workload:
    """Collects trace rows; addresses are unique keys (the replay assigns its own)."""

    def __init__(self):
        self.rows = []
        self.time = 0
        self.next_addr = 1 << 40
        self.live = {}

    def alloc(self, size, stream=0):
        size = max(1, int(size))
        addr = self.next_addr
        self.next_addr += (size + 511) // 512 * 512 + 4096
        self.time += 1
        self.rows.append(("alloc", addr, size, stream, self.time))
        self.live[addr] = (size, stream)
        return addr

    def free(self, addr):
        size, stream = self.live.pop(addr)
        self.time += 1
        self.rows.append(("free_requested", addr, size, stream, self.time))
        self.rows.append(("free_completed", addr, size, stream, self.time))

    def csv(self):
        lines = ["action,addr,size,stream,time_us"]
        lines += ["%s,%d,%d,%d,%d" % r for r in self.rows]
        return "\n".join(lines) + "\n"


def train(seed, scale):
    r = random.Random(seed)
    w = Workload()
    params = [w.alloc(r.choice([1, 2, 4, 9, 16, 36]) * MiB * scale)
              for _ in range(r.randint(20, 60))]
    grads = None
    for _ in range(12):
        length = r.choice([0.5, 0.75, 1.0, 1.25, 1.6, 2.0])
        saved = []
        for _ in range(r.randint(12, 24)):
            tmp = w.alloc(r.uniform(4, 40) * MiB * scale * length)
            saved.append(w.alloc(r.uniform(2, 30) * MiB * scale * length))
            small = [w.alloc(r.randint(1, 2048) * 256) for _ in range(r.randint(0, 6))]
            w.free(tmp)
            for s in small[: len(small) // 2]:
                w.free(s)
            saved += small[len(small) // 2:]
        if grads is None:
            grads = [w.alloc(w.live[p][0]) for p in params]
        for a in reversed(saved):
            g = w.alloc(w.live[a][0] * r.uniform(0.5, 1.5))
            w.free(a)
            w.free(g)
    return w


def serve(seed, scale):
    r = random.Random(seed)
    w = Workload()
    for _ in range(r.randint(10, 40)):
        w.alloc(r.choice([2, 8, 32, 64]) * MiB * scale)
    active = []
    for _ in range(3000):
        if len(active) < 16 and r.random() < 0.3:
            active.append({"blocks": [], "left": r.randint(10, 400)})
        for q in list(active):
            if r.random() < 0.2:
                q["blocks"].append(w.alloc(r.choice([1, 2, 4]) * MiB * scale // 4))
            q["left"] -= 1
            if q["left"] <= 0:
                for b in q["blocks"]:
                    w.free(b)
                active.remove(q)
        cached = sum(len(q["blocks"]) for q in active)
        tmp = [w.alloc(r.uniform(0.1, 3) * MiB * scale * (1 + cached / 50))
               for _ in range(r.randint(1, 4))]
        small = [w.alloc(r.randint(1, 4000) * 128) for _ in range(r.randint(0, 5))]
        for x in tmp + small:
            w.free(x)
    return w


KINDS = {"train": train, "serve": serve}


def synthetic(n, first_seed=1, scales=SCALES):
    """(name, generator) for n seeds of each kind (from first_seed) at each scale."""
    out = []
    for kind, gen in KINDS.items():
        for seed in range(first_seed, first_seed + n):
            for scale in scales:
                out.append(("%s-%d-%g" % (kind, seed, scale), lambda g=gen, s=seed, c=scale: g(s, c)))
    return out


def recordings():
    base = os.path.join(ROOT, "data", "traces")
    names = ["resnet50_train", "gpt2_train_varlen", "moe_train"]
    files = [os.path.join(base, n + ".pickle.gz") for n in names]
    device = os.path.join(base, "device")
    files += sorted(os.path.join(device, f) for f in os.listdir(device) if f.endswith(".pickle.gz"))
    return [(os.path.basename(f).split(".")[0], f) for f in files if os.path.exists(f)]


def run_ccalloc(binary, command, path, confs):
    """The JSON rows of `ccalloc COMMAND PATH --json --conf C...`, one per config."""
    cmd = [binary, command, path, "--json"]
    for c in confs:
        cmd += ["--conf", c]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("%s failed on %s: %s" % (binary, path, r.stderr.strip()[:500]))
    return json.loads(r.stdout)


def replay(binary, path, confs):
    rows = run_ccalloc(binary, "replay", path, confs)
    floor = rows[0]["peak_requested_bytes"]
    return floor, [(x["peak_reserved_bytes"] / floor, x["simulated_driver_us"] / 1000.0) for x in rows]


def fit(binary, path, confs):
    """`ccalloc fit` of each config: (floor, [(capacity / floor, driver ms at it)])."""
    rows = run_ccalloc(binary, "fit", path, confs)
    for x in rows:
        if not x["verified"]:
            raise RuntimeError("fit of %s under %s is not verified" % (path, x["conf"]))
    return rows[0]["floor_bytes"], [(x["ratio_to_floor"], x["simulated_driver_us"] / 1000.0)
                                    for x in rows]


def judge(references, cell):
    """The flags of one configuration's (ratio, ms) against PyTorch's settings' cells, the
    first native's and the second expandable segments'."""
    ratio, ms = cell
    best = min(r[0] for r in references)
    return {"above_pytorch": ratio > best + 1e-9, "slower": ms > references[1][1] + 1e-9,
            "above_bound": ratio > 1.03 + 1e-9, "delta": ratio - best}


def summarize(results, confs):
    out = {}
    for i, conf in enumerate(confs):
        flags = [judge(r["pytorch"], r["confs"][i]) for r in results]
        deltas = [f["delta"] for f in flags]
        out[conf] = {
            "workloads": len(flags),
            "above_pytorch": sum(f["above_pytorch"] for f in flags),
            "slower_than_expandable": sum(f["slower"] for f in flags),
            "above_1.03": sum(f["above_bound"] for f in flags),
            "median_delta": statistics.median(deltas) if deltas else 0.0,
            "worst_delta": max(deltas) if deltas else 0.0,
            "worse_by_1pct": sum(d > 0.01 for d in deltas),
            "better_by_1pct": sum(d < -0.01 for d in deltas),
        }
    return out


def self_test(binary=None):
    a = train(3, 0.5).csv()
    assert a == train(3, 0.5).csv(), "generation is not deterministic"
    assert a != train(4, 0.5).csv(), "seeds do not differ"
    for gen in (train, serve):
        w = gen(1, 0.25)
        live = set()
        for action, addr, size, _, _ in w.rows:
            assert size > 0
            if action == "alloc":
                assert addr not in live, "address reused while live"
                live.add(addr)
            elif action == "free_completed":
                live.remove(addr)
        assert live == set(w.live), "the workload's live set disagrees with its rows"
    refs = [(1.10, 5.0), (1.02, 4.0)]
    f = judge(refs, (1.025, 4.5))
    assert f == {"above_pytorch": True, "slower": True, "above_bound": False,
                 "delta": f["delta"]} and abs(f["delta"] - 0.005) < 1e-12, f
    f = judge(refs, (1.01, 3.0))
    assert not f["above_pytorch"] and not f["slower"] and abs(f["delta"] + 0.01) < 1e-12, f
    # The best of all the settings counts, not only native's and expandable segments'; the
    # driver time is expandable segments' whichever setting is best.
    f = judge(refs + [(1.015, 1.0)], (1.018, 4.5))
    assert f["above_pytorch"] and f["slower"] and abs(f["delta"] - 0.003) < 1e-12, f
    s = summarize([{"pytorch": refs, "confs": [(1.04, 4.0)]},
                   {"pytorch": refs, "confs": [(1.00, 4.1)]}], ["x"])
    assert s["x"]["above_pytorch"] == 1 and s["x"]["slower_than_expandable"] == 1, s
    assert s["x"]["above_1.03"] == 1 and s["x"]["worse_by_1pct"] == 1, s
    assert s["x"]["better_by_1pct"] == 1 and abs(s["x"]["median_delta"] - 0.0) < 1e-12, s
    f = judge_fit([(1.06, 1.0), (1.02, 9.0)], (1.025, 1.0))
    assert f["above_pytorch"] and not f["above_bound"] and abs(f["delta"] - 0.005) < 1e-12, f
    f = judge_fit([(1.06, 1.0), (1.05, 9.0)], (1.04, 1.0))
    assert not f["above_pytorch"] and f["above_bound"], f
    f = judge_fit([(1.06, 1.0), (1.05, 9.0), (1.035, 2.0)], (1.04, 1.0))
    assert f["above_pytorch"] and abs(f["delta"] - 0.005) < 1e-12, f
    s = summarize_fits([{"pytorch": [(1.03, 1.0), (1.02, 9.0)], "confs": [(1.031, 2.0)]},
                        {"pytorch": [(1.03, 1.0), (1.02, 9.0)], "confs": [(1.01, 4.0)]}], ["x"])
    assert s["x"]["above_pytorch"] == 1 and s["x"]["above_1.03"] == 1, s
    assert abs(s["x"]["median_ms"] - 3.0) < 1e-12 and abs(s["x"]["worst_delta"] - 0.011) < 1e-12, s
    names = [n for n, _ in synthetic(2, 11, (1.0,))]
    assert names == ["train-11-1", "train-12-1", "serve-11-1", "serve-12-1"], names
    if binary is not None:
        # End to end: the replay's floor is the workload's own peak of live requested bytes,
        # and a configuration equal to expandable segments gets expandable segments' cells.
        w = serve(2, 0.25)
        live = peak = 0
        sizes = {}
        for action, addr, size, _, _ in w.rows:
            if action == "alloc":
                sizes[addr] = size
                live += size
                peak = max(peak, live)
            elif action == "free_completed":
                live -= sizes.pop(addr)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "serve.csv.gz")
            with gzip.open(path, "wt") as f:
                f.write(w.csv())
            floor, cells = replay(binary, path, [NATIVE, EXPANDABLE, EXPANDABLE])
            fit_floor, fits = fit(binary, path, [EXPANDABLE, EXPANDABLE])
        assert floor == peak, (floor, peak)
        assert cells[1] == cells[2], cells
        assert not judge(cells[:2], cells[2])["slower"], cells
        # The fit sees the same floor, needs at least it and at most the unlimited peak.
        assert fit_floor == peak, (fit_floor, peak)
        assert fits[0] == fits[1], fits
        assert 1.0 <= fits[0][0] <= cells[1][0] + 1e-9, (fits, cells)
    print("policy_sweep self-test passed")


def judge_fit(references, cell):
    """The flags of one configuration's fit (ratio, ms) against the best of PyTorch's
    settings' fits."""
    best = min(r[0] for r in references)
    return {"above_pytorch": cell[0] > best + 1e-9,
            "above_bound": cell[0] > 1.03 + 1e-9, "delta": cell[0] - best}


def summarize_fits(results, confs):
    out = {}
    for i, conf in enumerate(confs):
        flags = [judge_fit(r["pytorch"], r["confs"][i]) for r in results]
        deltas = [f["delta"] for f in flags]
        out[conf] = {
            "workloads": len(flags),
            "above_pytorch": sum(f["above_pytorch"] for f in flags),
            "above_1.03": sum(f["above_bound"] for f in flags),
            "median_delta": statistics.median(deltas) if deltas else 0.0,
            "worst_delta": max(deltas) if deltas else 0.0,
            "median_ms": statistics.median(r["confs"][i][1] for r in results) if results else 0.0,
        }
    return out


def reference_settings(args):
    """(short name, config) of PyTorch's settings to judge against: --pytorch's, else all."""
    if not args.pytorch:
        return PYTORCH_SETTINGS
    known = dict(PYTORCH_SETTINGS)
    out = []
    for name in args.pytorch.split(","):
        if name not in known:
            raise SystemExit("--pytorch: unknown setting %r (known: %s)" % (name, ", ".join(known)))
        out.append((name, known[name]))
    if [n for n, _ in out[:2]] != ["native", "expand"]:
        raise SystemExit("--pytorch: the list starts with native,expand")
    return out


def sweep_fits(args, traces, confs):
    refs = reference_settings(args)
    all_confs = [c for _, c in refs] + confs
    print("%-20s %9s" % ("workload", "floor MiB") + "".join(" %8s" % n for n, _ in refs) +
          "".join(" | %-17s" % c[:17] for c in confs))
    results = []
    for name, path in traces:
        floor, cells = fit(args.ccalloc, path, all_confs)
        results.append({"workload": name, "floor_bytes": floor, "pytorch": cells[:len(refs)],
                        "confs": cells[len(refs):]})
        line = "%-20s %9.0f" % (name[:20], floor / MiB)
        line += "".join(" %8.4f" % c[0] for c in cells[:len(refs)])
        for cell in cells[len(refs):]:
            f = judge_fit(cells[:len(refs)], cell)
            mark = ("*" if f["above_pytorch"] else " ") + (">" if f["above_bound"] else " ")
            line += " | %.4f%s %7.1f" % (cell[0], mark, cell[1])
        print(line, flush=True)
    summary = summarize_fits(results, confs)
    expandable_ms = statistics.median(r["pytorch"][1][1] for r in results) if results else 0.0
    print("\n%-16s %9s %10s %7s %9s %9s %10s" % (
        "config", "workloads", "*above pt", ">1.03", "median d", "worst d", "median ms"))
    for conf, s in summary.items():
        print("%-16s %9d %10d %7d %+9.4f %+9.4f %10.1f" % (
            conf[:16], s["workloads"], s["above_pytorch"], s["above_1.03"],
            s["median_delta"], s["worst_delta"], s["median_ms"]))
    print("(d: fit minus the best fit of PyTorch's settings (%s); expandable segments' median "
          "driver time at their fits: %.1f ms)" % (", ".join(n for n, _ in refs), expandable_ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"confs": confs, "pytorch": refs, "fit": True, "results": results,
                       "summary": summary}, f, indent=1)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conf", action="append", help="configuration under test (repeatable; default ccalloc)")
    ap.add_argument("--synthetic", type=int, default=10, help="seeds per kind (each at four scales)")
    ap.add_argument("--first-seed", type=int, default=1, help="the first generated seed")
    ap.add_argument("--scales", default=",".join("%g" % c for c in SCALES),
                    help="generated scales, e.g. 1 or 0.5,2")
    ap.add_argument("--fit", action="store_true",
                    help="judge `ccalloc fit` under a limit instead of the peak without one")
    ap.add_argument("--pytorch", help="PyTorch's settings to judge against, by short name "
                    "(native,expand first; default all: %s)" % ",".join(n for n, _ in PYTORCH_SETTINGS))
    ap.add_argument("--no-recordings", action="store_true")
    ap.add_argument("--ccalloc", default=os.path.join(ROOT, "build", "release", "bin", "ccalloc"))
    ap.add_argument("--json")
    ap.add_argument("--keep", help="write the generated traces here instead of a temporary folder")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        self_test(args.ccalloc if os.path.exists(args.ccalloc) else None)
        return 0
    confs = args.conf or ["ccalloc"]
    if not os.path.exists(args.ccalloc):
        subprocess.run(["cmake", "-S", ROOT, "-B", os.path.join(ROOT, "build", "release"),
                        "-DCMAKE_BUILD_TYPE=Release", "-DCCALLOC_BUILD_TESTS=OFF"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", os.path.join(ROOT, "build", "release"),
                        "-j%d" % os.cpu_count(), "--target", "ccalloc_cli"],
                       check=True, stdout=subprocess.DEVNULL)
    work = args.keep or tempfile.mkdtemp(prefix="policy-sweep-")
    os.makedirs(work, exist_ok=True)
    traces = [] if args.no_recordings else recordings()
    scales = tuple(float(x) for x in args.scales.split(","))
    for name, gen in synthetic(args.synthetic, args.first_seed, scales):
        path = os.path.join(work, name + ".csv.gz")
        with gzip.open(path, "wt") as f:
            f.write(gen().csv())
        traces.append((name, path))
    if args.fit:
        return sweep_fits(args, traces, confs)
    refs = reference_settings(args)
    all_confs = [c for _, c in refs] + confs
    header = "%-20s %9s" % ("workload", "floor MiB") + "".join(" %8s" % n for n, _ in refs)
    header += "".join(" | %-16s" % c[:16] for c in confs)
    print(header)
    results = []
    for name, path in traces:
        floor, cells = replay(args.ccalloc, path, all_confs)
        r = {"workload": name, "floor_bytes": floor, "pytorch": cells[:len(refs)],
             "confs": cells[len(refs):]}
        results.append(r)
        line = "%-20s %9.0f" % (name[:20], floor / MiB)
        line += "".join(" %8.4f" % c[0] for c in cells[:len(refs)])
        for cell in cells[len(refs):]:
            f = judge(cells[:len(refs)], cell)
            mark = ("*" if f["above_pytorch"] else " ") + ("!" if f["slower"] else " ") + \
                   (">" if f["above_bound"] else " ")
            line += " | %.4f%s %6.2f" % (cell[0], mark, cell[1])
        print(line, flush=True)
    summary = summarize(results, confs)
    print("\n%-16s %9s %8s %8s %7s %9s %9s %8s %8s" % (
        "config", "workloads", "*above", "!slower", ">1.03", "median d", "worst d", "d>+1%", "d<-1%"))
    for conf, s in summary.items():
        print("%-16s %9d %8d %8d %7d %+9.4f %+9.4f %8d %8d" % (
            conf[:16], s["workloads"], s["above_pytorch"], s["slower_than_expandable"],
            s["above_1.03"], s["median_delta"], s["worst_delta"], s["worse_by_1pct"],
            s["better_by_1pct"]))
    print("(d: peak ratio minus the best of PyTorch's settings: %s)" % ", ".join(n for n, _ in refs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"confs": confs, "pytorch": refs, "results": results, "summary": summary},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
