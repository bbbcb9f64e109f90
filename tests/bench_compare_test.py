#!/usr/bin/env python3
"""bench/torch/compare.py's interleaved runs (--interleave), without torch or a GPU: fake
workers stand in for run_one.py --gated and log when each step runs, so the test checks the
order of the turns, that no worker runs while another's step is timed, the pairing of the
figures, and the errors a broken worker gets."""

import contextlib
import io
import json
import os
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench", "torch"))
import compare  # noqa: E402

# A worker of run_one.py's protocol: steps 0..STEPS-1, the first WARMUP untimed; each
# step's "time" is fixed by the allocator (pytorch 10, ccalloc 11 or FAKE_CC, others 12), and the worker
# logs (start, end) of every stretch where it works: between its turns it must idle.
FAKE = textwrap.dedent("""
    import json, os, sys, time
    args = sys.argv[1:]
    alloc = args[args.index("--allocator") + 1]
    assert "--gated" in args
    steps, warmup = int(os.environ["FAKE_STEPS"]), 1
    crash = os.environ.get("FAKE_CRASH", "")
    log = os.environ["FAKE_LOG"]
    cost = {"pytorch": 10.0, "ccalloc": float(os.environ.get("FAKE_CC", "11"))}.get(alloc, 12.0)
    times = []
    def note(what, step):
        with open(log, "a") as f:
            f.write(json.dumps([alloc, what, step, time.monotonic()]) + "\\n")
    for step in range(steps + (1 if crash == "extra-" + alloc else 0)):
        print("some output of the workload", flush=True)
        print(f"WAIT {step}", flush=True)
        if not sys.stdin.readline():
            sys.exit(3)
        if crash == f"{alloc}-{step}":
            sys.stderr.write(f"{alloc} fails at step {step}\\n")
            sys.exit(5)
        note("start", step)
        time.sleep(0.002)
        note("end", step)
        t = cost * (1 + step / 100)
        print(f"DONE {step} {t!r}", flush=True)
        if step >= warmup:
            times.append(t)
    print("RESULT " + json.dumps({"step_times_s": times, "step_cpu_s": [t / 2 for t in times],
                                  "median_step_s": sorted(times)[len(times) // 2],
                                  "outputs": ["x"], "peak_reserved_bytes": 1,
                                  "num_device_alloc": 1, "installed": "fake"}), flush=True)
""")


class InterleaveTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        with open(os.path.join(self.dir.name, "run_one.py"), "w") as f:
            f.write(FAKE)
        self.log = os.path.join(self.dir.name, "log")
        self.saved_here, compare.HERE = compare.HERE, self.dir.name
        self.saved_env = dict(os.environ)
        os.environ.update(FAKE_STEPS="5", FAKE_LOG=self.log)

    def tearDown(self):
        compare.HERE = self.saved_here
        os.environ.clear()
        os.environ.update(self.saved_env)
        self.dir.cleanup()

    def events(self):
        with open(self.log) as f:
            return [json.loads(line) for line in f]

    def test_turns_alternate_and_never_overlap(self):
        results = compare.run_interleaved("w", ("pytorch", "ccalloc"), "native")
        events = self.events()
        starts = [(a, step) for a, what, step, _ in events if what == "start"]
        # Step by step, the order alternating: p c, c p, p c, ...
        expected = []
        for step in range(5):
            pair = [("pytorch", step), ("ccalloc", step)]
            expected += pair if step % 2 == 0 else pair[::-1]
        self.assertEqual(starts, expected)
        # Each step ends before the next one (of either worker) starts.
        for (a, what, step, t), nxt in zip(events, events[1:]):
            self.assertEqual(what, "start" if nxt[1] == "end" else "end")
            self.assertLessEqual(t, nxt[3])
        self.assertEqual(results["pytorch"]["step_times_s"], [10.0 * (1 + s / 100) for s in range(1, 5)])
        self.assertEqual(results["ccalloc"]["step_times_s"], [11.0 * (1 + s / 100) for s in range(1, 5)])

    def test_flip_starts_with_the_other(self):
        compare.run_interleaved("w", ("pytorch", "ccalloc"), "native", flip=True)
        starts = [(a, step) for a, what, step, _ in self.events() if what == "start"]
        self.assertEqual(starts[:4], [("ccalloc", 0), ("pytorch", 0), ("pytorch", 1), ("ccalloc", 1)])

    def test_three_allocators_take_turns(self):
        os.environ["FAKE_STEPS"] = "2"
        results = compare.run_interleaved("w", ("pytorch", "ccalloc", "pytorch-loaded"), "native")
        starts = [a for a, what, step, _ in self.events() if what == "start"]
        order = ["pytorch", "ccalloc", "pytorch-loaded"]
        self.assertEqual(starts, order + order[::-1])
        self.assertEqual(results["pytorch-loaded"]["step_times_s"], [12.0 * 1.01])

    def test_delta_pairs_neighbouring_steps(self):
        pt = [{"step_times_s": [10.0, 20.0, 40.0]}, {"step_times_s": [10.0, 10.0, 10.0]}]
        cc = [{"step_times_s": [11.0, 19.0, 44.0]}, {"step_times_s": [10.5, 10.0, 9.0]}]
        median, total = compare.interleaved_delta(pt, cc)
        # Ratios 1.1, 0.95, 1.1, 1.05, 1.0, 0.9: the median of six is (1.0 + 1.05) / 2.
        self.assertAlmostEqual(median, 0.025)
        self.assertAlmostEqual(total, (11 + 19 + 44 + 10.5 + 10 + 9) / 100.0 - 1.0)
        # The CPU times pair the same way, under their own key.
        for run in pt + cc:
            run["step_cpu_s"] = [t / 2 for t in run["step_times_s"]]
        pt[0]["step_cpu_s"][0] = 10.0  # 5.5 / 10: now the smallest ratio, the median moves down
        median, total = compare.interleaved_delta(pt, cc, key="step_cpu_s")
        self.assertAlmostEqual(median, -0.025)  # (0.95 + 1.0) / 2
        self.assertAlmostEqual(total, 51.75 / 55.0 - 1.0)

    def test_median_interval_brackets_the_median_and_is_seeded(self):
        values = [1.0 + 0.01 * ((i * 37) % 41 - 20) for i in range(41)]  # 0.80 .. 1.20
        lo, hi = compare.median_interval(values)
        self.assertLess(lo, 1.0)
        self.assertGreater(hi, 1.0)
        self.assertGreater(lo, 0.85)
        self.assertLess(hi, 1.15)
        self.assertEqual((lo, hi), compare.median_interval(values))
        self.assertEqual(compare.median_interval([1.25] * 9), (1.25, 1.25))

    def test_step_verdict_reads_the_interval_against_the_bound(self):
        self.assertEqual(compare.step_verdict(-0.07, -0.03), "within")
        self.assertEqual(compare.step_verdict(-0.01, 0.02), "within")
        self.assertEqual(compare.step_verdict(-0.12, 0.043), "undecided")
        self.assertEqual(compare.step_verdict(0.02, 0.05), "undecided")
        self.assertEqual(compare.step_verdict(0.021, 0.05), "slower")

    def run_main(self, *args):
        out = os.path.join(self.dir.name, "rows.json")
        saved = sys.argv
        sys.argv = ["compare.py", "--interleave", "--workloads", "w", "--modes", "native",
                    "--json", out, *args]
        try:
            with contextlib.redirect_stdout(io.StringIO()) as text:
                with self.assertRaises(SystemExit) as end:
                    compare.main()
        finally:
            sys.argv = saved
        with open(out) as f:
            return end.exception.code, json.load(f), text.getvalue()

    def test_main_fails_a_run_whose_interval_is_above_two_percent(self):
        code, rows, text = self.run_main("--repeats", "2")  # ccalloc 10 % slower, every step
        self.assertEqual(code, 1)
        self.assertEqual(rows[0]["step_verdict"], "slower")
        self.assertAlmostEqual(rows[0]["paired_step_delta"], 0.1)
        self.assertAlmostEqual(rows[0]["paired_cpu_delta"], 0.1)
        self.assertEqual(len(rows[0]["per_process_step_s"]["ccalloc"]), 2)
        self.assertIn("slower", text)

    def test_main_passes_a_run_within_two_percent(self):
        os.environ["FAKE_CC"] = "10.1"
        code, rows, text = self.run_main("--repeats", "1")
        self.assertEqual(code, 0)
        self.assertEqual(rows[0]["step_verdict"], "within")
        self.assertAlmostEqual(rows[0]["paired_interval"][1], 0.01)

    def test_a_worker_that_fails_is_named_with_its_exit_status(self):
        os.environ["FAKE_CRASH"] = "ccalloc-2"
        with self.assertRaisesRegex(RuntimeError, r"w on ccalloc \(native\): .*exit 5"):
            compare.run_interleaved("w", ("pytorch", "ccalloc"), "native")

    def test_workers_out_of_step_are_an_error(self):
        os.environ["FAKE_CRASH"] = "extra-ccalloc"  # one step more than the other
        with self.assertRaisesRegex(RuntimeError, "out of step"):
            compare.run_interleaved("w", ("pytorch", "ccalloc"), "native")


if __name__ == "__main__":
    unittest.main()
