#!/usr/bin/env python3
"""Reads a ccalloc snapshot with PyTorch's own torch.cuda._memory_viz and compares its totals
with `ccalloc summary`.

    python3 scripts/check_memory_viz.py SNAPSHOT CCALLOC_BINARY [--expect-frame NAME]
    python3 scripts/check_memory_viz.py --self-test

SNAPSHOT is a pickle, a gzipped pickle or JSON (plain or gzipped), as ccalloc writes them.
The snapshot goes through PyTorch's code path:
  * loaded as `python -m torch.cuda._memory_viz` loads it (its `_read`: pickle.load, a bare
    list of segments wrapped as {'segments': ..., 'traces': []}). `_read` lives under the
    module's `if __name__ == "__main__":` and cannot be imported, so it is mirrored here.
    pickle.load reads no gzip, so a gzipped file is gunzipped to a temporary file first; the
    module reads no JSON, so a JSON snapshot is converted to a pickle by `ccalloc convert`
    (and, as a cross-check, also loaded with json.load: its segsum must equal the pickle's);
  * `python3 -m torch.cuda._memory_viz stats FILE` (the CLI, in a subprocess) must print the
    same text as the module's segsum() called here;
  * trace(), and segments() / memory() with a flamegraph formatter that keeps the lines
    (the module's own formatter downloads flamegraph.pl from GitHub);
every one of them must run without an exception. Then `CCALLOC_BINARY summary SNAPSHOT`
runs, and the `segments:` count and the total_reserved / total_allocated / total_free
figures (as the "3.3GiB" text both print) must be equal; the internal-free percentage
(one decimal in PyTorch, none in ccalloc) must agree within rounding.

Prints a short report; exits 0 when everything passed, 1 on any mismatch or exception.
--self-test checks this script's parsing and comparison on fixed texts (no torch needed).
"""

import argparse
import contextlib
import gzip
import importlib
import io
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import traceback

GZIP_MAGIC = b"\x1f\x8b"
TOTAL_KEYS = ("segments", "total_reserved", "total_allocated", "total_free")
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")


# ---------------------------------------------------------------------------------------
# Parsing and comparison (pure functions: --self-test runs them without torch)


def parse_totals(text):
    """The totals of a segsum-style text: PyTorch's `_memory_viz stats` output or the last
    lines of `ccalloc summary`. Returns {'segments': int, 'total_reserved': '3.3GiB',
    'total_allocated': ..., 'total_free': ..., 'internal_pct': float or None}; a key is
    missing when its line is."""
    out = {}
    m = re.search(r"^segments:\s*(\d+)\s*$", text, re.M)
    if m:
        out["segments"] = int(m.group(1))
    for key in ("total_reserved", "total_allocated"):
        m = re.search(r"^%s:\s*(\S+)" % key, text, re.M)
        if m:
            out[key] = m.group(1)
    # PyTorch: "total_free: 212.9MiB (1.4% internal)", no suffix when nothing is free;
    # ccalloc: "total_free: 212.9MiB (1% internal)  212.87 MiB (223,210,053 bytes)".
    m = re.search(r"^total_free:\s*(\S+)(?:\s*\(([0-9.]+)% internal\))?", text, re.M)
    if m:
        out["total_free"] = m.group(1)
        out["internal_pct"] = float(m.group(2)) if m.group(2) is not None else None
    return out


def compare_totals(viz, cc):
    """Mismatches between memory_viz's totals and ccalloc's, as readable lines (empty: equal)."""
    problems = []
    for key in TOTAL_KEYS:
        if key not in viz:
            problems.append("%s: missing from memory_viz's output" % key)
        elif key not in cc:
            problems.append("%s: missing from ccalloc summary's output" % key)
        elif viz[key] != cc[key]:
            problems.append("%s: memory_viz %s, ccalloc %s" % (key, viz[key], cc[key]))
    a, b = viz.get("internal_pct"), cc.get("internal_pct")
    # PyTorch rounds to 0.1 %, ccalloc to 1 %: they may differ by 0.55 at most.
    if a is not None and b is not None and abs(a - b) > 0.55:
        problems.append("total_free internal share: memory_viz %.1f%%, ccalloc %.0f%%" % (a, b))
    return problems


FLAME_LINE = re.compile(r"^(stream_-?\d+)(?:;seg_(\d+))?;(%s);(.*) (-?\d+)$" % "|".join(BLOCK_STATES))


def check_flamegraph(lines_text, with_segments, expected_bytes, expect_frame=None):
    """Checks the text segments()/memory() hand to the flamegraph formatter: every line
    `stream_S[;seg_A];STATE;FRAMES BYTES`, the bytes adding up to the reserved total (each
    block is accounted for by its requested size plus a <gaps> line). A free block keeps the
    requested_size of its last allocation (stale, as in PyTorch), which can exceed its size:
    its <gaps> line is then negative, as PyTorch's own snapshots give; only free blocks may
    have one. Returns (problems, description)."""
    problems = []
    total = 0
    with_frames = 0
    negative = 0
    found_frame = False
    lines = [l for l in lines_text.split("\n") if l]
    for line in lines:
        m = FLAME_LINE.match(line)
        if not m or (m.group(2) is None) == with_segments:
            problems.append("malformed flamegraph line: %r" % line[:200])
            continue
        count = int(m.group(5))
        if count < 0:
            negative += 1
            if m.group(3) == "active_allocated" or m.group(4) != "<gaps>":
                problems.append("negative bytes on a live block's line: %r" % line[:200])
        total += count
        frames = m.group(4)
        if frames not in ("<non-python>", "<gaps>", "<no-context>"):
            with_frames += 1
        if expect_frame and expect_frame in frames:
            found_frame = True
    if total != expected_bytes:
        problems.append("flamegraph bytes add up to %d, the segments hold %d" % (total, expected_bytes))
    if expect_frame and not found_frame:
        problems.append("no flamegraph line has a frame naming %r" % expect_frame)
    desc = "%d lines (%d with frames), %d bytes" % (len(lines), with_frames, total)
    if negative:
        desc += "; %d negative <gaps> of free blocks (stale requested_size)" % negative
    return problems, desc


# ---------------------------------------------------------------------------------------
# The checks


class Report:
    def __init__(self):
        self.failures = []

    def ok(self, what, detail=""):
        print("  ok    %-40s %s" % (what, detail))

    def fail(self, what, detail):
        print("  FAIL  %-40s %s" % (what, detail))
        self.failures.append("%s: %s" % (what, detail))


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def load_like_memory_viz(path):
    """What `python -m torch.cuda._memory_viz` does with its input (its `_read`)."""
    with open(path, "rb") as f:
        data = pickle.load(f)
    if isinstance(data, list):  # segments only
        data = {"segments": data, "traces": []}
    return data


def run(cmd, timeout=600):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)


def call_flamegraph(fn, data):
    """Runs segments()/memory() with a formatter that returns the lines instead of calling
    flamegraph.pl."""
    captured = []

    def keep_lines(flamegraph_lines, flamegraph_script=None):
        captured.append(flamegraph_lines)
        return flamegraph_lines

    try:
        result = fn(data, format_flamegraph=keep_lines)
    except TypeError:  # a version whose parameter is not named format_flamegraph
        captured.clear()
        result = fn(data, keep_lines)
    if not captured:
        raise RuntimeError("%s() never called its flamegraph formatter" % fn.__name__)
    return result


def check(snapshot, ccalloc, expect_frame=None):
    report = Report()
    print("check_memory_viz: %s" % snapshot)
    with tempfile.TemporaryDirectory(prefix="check_memory_viz.") as tmp:
        try:
            check_in(snapshot, ccalloc, expect_frame, tmp, report)
        except Exception as e:  # noqa: BLE001 - any exception is a failure, reported
            report.fail("exception", "%s: %s" % (type(e).__name__, e))
            traceback.print_exc(file=sys.stdout)
    if report.failures:
        print("check_memory_viz: FAIL (%d problem%s) for %s" %
              (len(report.failures), "" if len(report.failures) == 1 else "s", snapshot))
        return 1
    print("check_memory_viz: PASS for %s" % snapshot)
    return 0


def check_in(snapshot, ccalloc, expect_frame, tmp, report):
    raw = read_bytes(snapshot)
    gzipped = raw[:2] == GZIP_MAGIC
    plain = gzip.decompress(raw) if gzipped else raw
    name = snapshot[:-3] if snapshot.endswith(".gz") else snapshot
    is_json = name.endswith(".json") or plain.lstrip()[:1] in (b"{", b"[")

    # The pickle that PyTorch's CLI gets.
    json_data = None
    if is_json:
        pickle_path = os.path.join(tmp, "snapshot.pickle")
        r = run([ccalloc, "convert", snapshot, pickle_path])
        if r.returncode != 0:
            report.fail("ccalloc convert to pickle", (r.stderr or r.stdout).strip()[-500:])
            return
        report.ok("ccalloc convert to pickle", "(the module reads pickles only)")
        json_data = json.loads(plain.decode("utf-8"))
    elif gzipped:
        pickle_path = os.path.join(tmp, "snapshot.pickle")
        with open(pickle_path, "wb") as f:
            f.write(plain)
    else:
        pickle_path = snapshot

    mv = importlib.import_module("torch.cuda._memory_viz")
    # The module's reader where a version has it at module level; else its code, mirrored.
    reader = getattr(mv, "_read", None)
    if callable(reader):
        data, how = reader(pickle_path), "the module's _read"
    else:
        data, how = load_like_memory_viz(pickle_path), "pickle.load, as _read"
    segments = data.get("segments", [])
    traces = data.get("device_traces", [])
    reserved = sum(s["total_size"] for s in segments)
    report.ok("load (%s)" % how,
              "%s%s: %d segments, %s trace entries" %
              ("JSON -> pickle" if is_json else "pickle", ", gunzipped" if gzipped and not is_json else "",
               len(segments), "+".join(str(len(t)) for t in traces) or "no"))

    # stats: the module's segsum, and the CLI printing the same.
    stats = mv.segsum(data)
    report.ok("segsum()", "%d lines" % stats.count("\n"))
    cli = run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", pickle_path])
    if cli.returncode != 0:
        report.fail("python -m torch.cuda._memory_viz stats",
                    "exit %d: %s" % (cli.returncode, cli.stderr.strip()[-800:]))
    elif cli.stdout.rstrip("\n") != stats.rstrip("\n"):
        report.fail("python -m torch.cuda._memory_viz stats", "prints other text than segsum()")
    else:
        report.ok("python -m torch.cuda._memory_viz stats", "same text as segsum()")
    if json_data is not None:
        if isinstance(json_data, list):
            json_data = {"segments": json_data, "traces": []}
        if mv.segsum(json_data) == stats:
            report.ok("segsum() of the JSON (json.load)", "equals the pickle's")
        else:
            report.fail("segsum() of the JSON (json.load)", "differs from the pickle's")

    # trace: the replay text.
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        text = mv.trace(data)
    devices = sum(1 for t in traces if t)
    headers = len(re.findall(r"^Device \d+ -+$", text, re.M))
    if headers != devices or (devices and "TOTAL MEM:" not in text):
        report.fail("trace()", "%d device sections for %d devices with entries" % (headers, devices))
    else:
        first = re.search(r"^(\d+) entries$", text, re.M)
        report.ok("trace()", "%d lines%s" % (text.count("\n") + 1,
                                              ", %s entries on the first device" % first.group(1)
                                              if first else ""))

    # segments / memory: the flamegraph input.
    for fn_name, with_segments in (("segments", True), ("memory", False)):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            lines = call_flamegraph(getattr(mv, fn_name), data)
        problems, desc = check_flamegraph(lines, with_segments, reserved, expect_frame)
        for p in problems:
            report.fail("%s() flamegraph" % fn_name, p)
        if not problems:
            report.ok("%s() flamegraph" % fn_name, desc)

    # ccalloc summary against memory_viz.
    r = run([ccalloc, "summary", snapshot])
    if r.returncode != 0:
        report.fail("ccalloc summary", "exit %d: %s" % (r.returncode, (r.stderr or r.stdout).strip()[-500:]))
        return
    viz, cc = parse_totals(stats), parse_totals(r.stdout)
    problems = compare_totals(viz, cc)
    print("  %-18s %-22s %s" % ("", "memory_viz stats", "ccalloc summary"))
    for key in TOTAL_KEYS:
        v, c = viz.get(key, "-"), cc.get(key, "-")
        if key == "total_free":
            v = "%s (%s%% internal)" % (v, viz.get("internal_pct"))
            c = "%s (%s%% internal)" % (c, cc.get("internal_pct"))
        print("  %-18s %-22s %s" % (key, v, c))
    for p in problems:
        report.fail("totals", p)
    if not problems:
        report.ok("totals", "segments, total_reserved, total_allocated, total_free equal")


# ---------------------------------------------------------------------------------------
# Self-test of the parsing and comparison, on texts as both tools print them.

VIZ_STATS = """Summary of segments >= 20.0MiB in size
[aa   b] 102.0MiB allocated, 71.0MiB (1.4% internal) free stream_11
segments: 10
total_reserved: 398.0MiB
total_allocated: 185.1MiB
total_free: 212.9MiB (1.4% internal)

Legend:
    [a     ] - a segment in the allocator
"""

CC_SUMMARY = """|===========================================================================|
|                  PyTorch CUDA memory summary, device ID 0                 |
segment             type   stream      size        allocated   free        largest free  fragmentation
0x7f0000000000      small  11          2.0MiB      1.1MiB      928.0KiB    512.0KiB       44.8 %

segments: 10
total_reserved: 398.0MiB  398.00 MiB (417,333,248 bytes)
total_allocated: 185.1MiB  185.13 MiB (194,123,195 bytes) (requested sizes of live blocks)
total_free: 212.9MiB (1% internal)  212.87 MiB (223,210,053 bytes)
"""


def self_test():
    viz, cc = parse_totals(VIZ_STATS), parse_totals(CC_SUMMARY)
    expect = {"segments": 10, "total_reserved": "398.0MiB", "total_allocated": "185.1MiB",
              "total_free": "212.9MiB"}
    for key, value in expect.items():
        assert viz[key] == value, (key, viz)
        assert cc[key] == value, (key, cc)
    assert viz["internal_pct"] == 1.4 and cc["internal_pct"] == 1.0, (viz, cc)
    assert compare_totals(viz, cc) == []
    # Nothing free: PyTorch prints no percentage.
    empty = parse_totals("segments: 0\ntotal_reserved: 0.0B\ntotal_allocated: 0.0B\ntotal_free: 0.0B\n")
    assert empty == {"segments": 0, "total_reserved": "0.0B", "total_allocated": "0.0B",
                     "total_free": "0.0B", "internal_pct": None}, empty
    cc_empty = parse_totals("segments: 0\ntotal_reserved: 0.0B  0 bytes\ntotal_allocated: 0.0B  x\n"
                            "total_free: 0.0B (0% internal)  0 bytes\n")
    assert compare_totals(empty, cc_empty) == [], compare_totals(empty, cc_empty)
    # Mismatches are found and named.
    bad = dict(cc, segments=11, total_allocated="185.2MiB", internal_pct=3.0)
    problems = compare_totals(viz, bad)
    assert len(problems) == 3, problems
    assert any("segments: memory_viz 10, ccalloc 11" in p for p in problems), problems
    assert any("total_allocated" in p for p in problems), problems
    missing = compare_totals(viz, {k: v for k, v in cc.items() if k != "total_reserved"})
    assert missing == ["total_reserved: missing from ccalloc summary's output"], missing
    # Rounding: 12.5 % in PyTorch, 12 % (round half to even) in ccalloc.
    assert compare_totals(dict(viz, internal_pct=12.5), dict(cc, internal_pct=12.0)) == []
    # Flamegraph lines.
    lines = ("stream_0;seg_139637976727552;active_allocated;a.cpp:1:f;b.cpp:2:WritesASnapshotOfARealRun_workload 1000\n"
             "stream_0;seg_139637976727552;active_allocated;<gaps> 24\n"
             "stream_0;seg_139637976727552;inactive;<non-python> 1024\n")
    problems, desc = check_flamegraph(lines, True, 2048, "WritesASnapshotOfARealRun")
    assert problems == [], problems
    assert desc == "3 lines (1 with frames), 2048 bytes", desc
    problems, _ = check_flamegraph(lines, True, 4096, "NotThere")
    assert len(problems) == 2, problems
    problems, _ = check_flamegraph(lines, False, 2048)  # memory(): no seg_ level expected
    assert len(problems) == 4, problems  # 3 malformed lines, and the bytes
    mem = "stream_5;inactive;<non-python> 2097152\nstream_5;active_pending_free;<non-python> 0\n"
    assert check_flamegraph(mem, False, 2097152)[0] == []
    # A free block with a stale requested_size larger than itself: a negative <gaps> line.
    stale = "stream_5;inactive;a.cpp:1:f 3000\nstream_5;inactive;<gaps> -1000\n"
    problems, desc = check_flamegraph(stale, False, 2000)
    assert problems == [] and desc.endswith("1 negative <gaps> of free blocks (stale requested_size)"), desc
    live = "stream_5;active_allocated;<gaps> -1000\nstream_5;active_allocated;<non-python> 3000\n"
    assert len(check_flamegraph(live, False, 2000)[0]) == 1
    print("check_memory_viz self-test: PASS")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("snapshot", nargs="?", help="snapshot: .pickle, .pickle.gz, .json, .json.gz")
    parser.add_argument("ccalloc", nargs="?", help="the ccalloc binary")
    parser.add_argument("--expect-frame", metavar="NAME",
                        help="fail unless a block's frames in the flamegraphs contain NAME")
    parser.add_argument("--self-test", action="store_true",
                        help="check the parsing and comparison on fixed texts (no torch needed)")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    if not args.snapshot or not args.ccalloc:
        parser.error("SNAPSHOT and CCALLOC_BINARY are required")
    return check(args.snapshot, args.ccalloc, args.expect_frame)


if __name__ == "__main__":
    sys.exit(main())
