#!/usr/bin/env python3
"""bench/torch/scale.py's gated distributed rounds (run_gated_dist), without torch or a GPU:
fake jobs stand in for torchrun with run_dist.py --gate, two ranks each, using run_dist's own
FileGate, and log when each rank works. The test checks the order of the turns, that no job
works while another's step is timed, the results, and that a job that dies is reported
without holding up the others."""

import json
import os
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "bench", "torch")
sys.path.insert(0, BENCH)
import scale  # noqa: E402

# A job of run_dist.py's protocol: two ranks (threads), each through FileGate; rank 0
# prints RESULT. FAKE_DIE names an allocator whose job exits at step 2.
FAKE = textwrap.dedent("""
    import json, os, sys, threading, time
    sys.path.insert(0, {bench!r})
    from run_dist import FileGate
    args = sys.argv[1:]
    alloc = os.environ["FAKE_ALLOC"]
    gate_dir = args[args.index("--gate") + 1]
    steps = int(args[args.index("--steps") + 1]) + int(os.environ["FAKE_WARMUP"])
    log = os.environ["FAKE_LOG"]
    ranks = [dict(rank=r, step_times_s=[], outputs=[], step_probes=[],
                  peak_reserved_bytes=100 + r, peak_requested_bytes=90) for r in range(2)]
    def note(what, step, rank):
        with open(log, "a") as f:
            f.write(json.dumps([alloc, what, step, rank, time.monotonic()]) + "\\n")
    def rank_main(r):
        gate = FileGate(gate_dir, r)
        for step in range(steps):
            gate.before(step)
            if alloc == os.environ.get("FAKE_DIE") and step == 2:
                os._exit(5)
            note("start", step, r)
            time.sleep(0.004)
            note("end", step, r)
            ranks[r]["step_times_s"].append(0.004)
            ranks[r]["outputs"].append(1.0)
            gate.after(step, 0.004)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    print("RESULT " + json.dumps(dict(ranks=ranks)), flush=True)
""").format(bench=BENCH)


class GatedDistTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.fake = os.path.join(self.tmp.name, "fake_job.py")
        with open(self.fake, "w") as f:
            f.write(FAKE)
        self.log = os.path.join(self.tmp.name, "log.jsonl")
        self.saved = (scale.command, scale.environment, dict(scale.CASES), dict(scale.WARMUP))
        scale.CASES["fake"] = {"kind": "dist", "workload": "fake", "steps": 4}
        scale.WARMUP["fake"] = 1

        def command(name, allocator, gpus, record_dir=None):
            return [sys.executable, self.fake, "--steps", str(scale.CASES[name]["steps"])]

        def environment(allocator, case):
            env = dict(os.environ, FAKE_ALLOC=allocator, FAKE_LOG=self.log, FAKE_WARMUP="1")
            env.update(self.extra)
            return env

        self.extra = {}
        scale.command, scale.environment = command, environment

    def tearDown(self):
        scale.command, scale.environment = self.saved[0], self.saved[1]
        scale.CASES.clear()
        scale.CASES.update(self.saved[2])
        scale.WARMUP.clear()
        scale.WARMUP.update(self.saved[3])
        self.tmp.cleanup()

    def entries(self):
        with open(self.log) as f:
            return [json.loads(line) for line in f]

    def test_jobs_take_turns_step_by_step_in_alternating_order(self):
        allocators = ["native", "ccalloc", "expandable"]
        results = scale.run_gated_dist("fake", allocators, 2, None, 60, flip=False)
        for a in allocators:
            self.assertNotIn("error", results[a], results[a])
            self.assertEqual([len(r["step_times_s"]) for r in results[a]["ranks"]], [5, 5])
        log = self.entries()
        # Each (job, step) is one stretch of work by both ranks; no stretch overlaps another
        # job's.
        spans = {}
        for alloc, what, step, rank, t in log:
            lo, hi = spans.get((alloc, step), (float("inf"), 0.0))
            spans[(alloc, step)] = (min(lo, t), max(hi, t))
        ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
        for (key_a, (_, end_a)), (key_b, (start_b, _)) in zip(ordered, ordered[1:]):
            self.assertLessEqual(end_a, start_b, (key_a, key_b))
        # Turns: step 0 in the given order, step 1 reversed, and so on.
        for step in range(5):
            turn = [key[0] for key, _ in ordered if key[1] == step]
            want = allocators if step % 2 == 0 else list(reversed(allocators))
            self.assertEqual(turn, want, step)

    def test_a_flipped_round_starts_with_the_last_allocator(self):
        results = scale.run_gated_dist("fake", ["native", "ccalloc"], 2, None, 60, flip=True)
        self.assertTrue(all("error" not in r for r in results.values()), results)
        first = [e for e in self.entries() if e[1] == "start" and e[2] == 0]
        self.assertEqual(first[0][0], "ccalloc")

    def test_a_job_that_dies_is_reported_and_the_others_finish(self):
        self.extra = {"FAKE_DIE": "ccalloc"}
        results = scale.run_gated_dist("fake", ["native", "ccalloc"], 2, None, 60, flip=False)
        self.assertIn("error", results["ccalloc"])
        self.assertIn("exited", results["ccalloc"]["error"])
        self.assertNotIn("error", results["native"], results["native"])
        self.assertEqual(len(results["native"]["ranks"][0]["step_times_s"]), 5)


class LayoutsTest(unittest.TestCase):
    """run_dist.py's meshes and stages, and scale.py's comparison of outputs."""

    def test_tp_mesh_is_two_wide_where_the_ranks_are_even(self):
        from run_dist import tp_mesh_shape
        self.assertEqual(tp_mesh_shape(4), (2, 2))
        self.assertEqual(tp_mesh_shape(8), (4, 2))
        self.assertEqual(tp_mesh_shape(2), (1, 2))
        self.assertEqual(tp_mesh_shape(3), (3, 1))
        self.assertEqual(tp_mesh_shape(1), (1, 1))

    def test_pipeline_stages_cover_every_layer_once_in_order(self):
        from run_dist import PP_LAYERS, pp_layers
        self.assertEqual([pp_layers(r, 4) for r in range(4)], [(0, 2), (2, 4), (4, 6), (6, 8)])
        self.assertEqual([pp_layers(r, 3) for r in range(3)], [(0, 2), (2, 5), (5, 8)])
        for world in range(1, PP_LAYERS + 1):
            spans = [pp_layers(r, world) for r in range(world)]
            self.assertEqual(spans[0][0], 0)
            self.assertEqual(spans[-1][1], PP_LAYERS)
            for (_, hi), (lo, _) in zip(spans, spans[1:]):
                self.assertEqual(hi, lo)
            self.assertTrue(all(hi > lo for lo, hi in spans))

    def test_outputs_that_differ_report_the_largest_relative_difference(self):
        saved = (dict(scale.CASES), dict(scale.WARMUP))
        try:
            scale.CASES["fake"] = {"kind": "dist", "workload": "fake", "steps": 2}
            scale.WARMUP["fake"] = 1

            def result(outputs_per_rank):
                return {"ranks": [dict(rank=r, step_times_s=[0.1, 0.1], outputs=o,
                                       step_probes=[], peak_reserved_bytes=100,
                                       peak_requested_bytes=90)
                                  for r, o in enumerate(outputs_per_rank)]}

            runs = {"native": [result([[10.0, 8.0, 4.0], [0.0, 0.0, 0.0]])],
                    "same": [result([[10.0, 8.0, 4.0], [0.0, 0.0, 0.0]])],
                    "other": [result([[10.0, 8.002, 4.0], [0.0, 0.0, 0.0]])]}
            rows = scale.summarize("fake", runs, ["native", "same", "other"])
            self.assertTrue(rows["same"]["outputs_equal_first"])
            self.assertEqual(rows["same"]["outputs_max_rel_diff"], 0.0)
            self.assertFalse(rows["other"]["outputs_equal_first"])
            self.assertAlmostEqual(rows["other"]["outputs_max_rel_diff"], 0.002 / 8.0, places=12)
            text = scale.table({"fake": rows}, ["native", "same", "other"])
            self.assertIn("equal", text.splitlines()[-2])
            self.assertIn("DIFFER (<= 2.5e-04)", text.splitlines()[-1])
        finally:
            scale.CASES.clear()
            scale.CASES.update(saved[0])
            scale.WARMUP.clear()
            scale.WARMUP.update(saved[1])


if __name__ == "__main__":
    unittest.main()
