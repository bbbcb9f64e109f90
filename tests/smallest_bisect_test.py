#!/usr/bin/env python3
"""bench/torch/smallest.py's search for the smallest passing memory limit
(smallest_passing), without torch or a GPU: fake runs that pass above a threshold, some of
them noisy near it, stand in for a workload run under a memory fraction."""

import os
import random
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench", "torch"))
import smallest  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
TOTAL = 80 * GiB


class Threshold:
    """Passes at and above `threshold`; below it, fails, except within `band` of it, where a
    seeded coin decides each run anew."""

    def __init__(self, threshold, band=0, seed=0):
        self.threshold, self.band = threshold, band
        self.rng = random.Random(seed)
        self.calls = []

    def __call__(self, limit):
        self.calls.append(limit)
        if limit >= self.threshold:
            return True
        if limit >= self.threshold - self.band:
            return self.rng.random() < 0.5
        return False


def search(runs, lo, hi, tolerance=8 * MiB, **kw):
    return smallest.smallest_passing(runs, lo, hi, tolerance, ceiling=TOTAL, **kw)


class SmallestPassingTest(unittest.TestCase):
    def assertBracket(self, r, threshold, tolerance=8 * MiB):
        self.assertTrue(r["converged"], r)
        self.assertGreaterEqual(r["smallest"], threshold)
        self.assertLess(r["largest_failing"], threshold)
        self.assertLessEqual(r["smallest"] - r["largest_failing"], tolerance)
        self.assertEqual(r["smallest"] % smallest.GRANULE, 0)
        self.assertEqual(r["largest_failing"] % smallest.GRANULE, 0)

    def test_a_monotonic_run_is_bracketed_within_the_tolerance_and_confirmed(self):
        threshold = 5 * GiB + 123_456_789
        runs = Threshold(threshold)
        r = search(runs, lo=4 * GiB, hi=7 * GiB)
        self.assertBracket(r, threshold)
        self.assertTrue(r["confirmed"])
        self.assertTrue(r["monotonic"])
        # hi, lo, log2(3 GiB / 8 MiB) ~ 9 halvings, one confirmation.
        self.assertLessEqual(len(runs.calls), 12)
        self.assertEqual(runs.calls[:2], [7 * GiB, 4 * GiB])
        self.assertEqual(runs.calls[-1], r["smallest"])
        self.assertEqual([t["limit"] for t in r["trials"]], runs.calls)

    def test_a_threshold_on_a_granule_is_found_exactly_at_the_finest_tolerance(self):
        threshold = 3 * GiB + 10 * MiB
        r = search(Threshold(threshold), lo=2 * GiB, hi=4 * GiB, tolerance=2 * MiB)
        self.assertEqual(r["smallest"], threshold)
        self.assertEqual(r["largest_failing"], threshold - 2 * MiB)

    def test_a_high_end_that_fails_is_raised_until_it_passes(self):
        threshold = 9 * GiB + 5 * MiB
        runs = Threshold(threshold)
        r = search(runs, lo=4 * GiB, hi=5 * GiB)
        self.assertBracket(r, threshold)
        self.assertFalse(runs(runs.calls[0]))  # the first probe was hi, and it failed
        self.assertTrue(all(b > a for a, b in zip(runs.calls[:3], runs.calls[1:3])))

    def test_a_low_end_that_passes_is_lowered_until_it_fails(self):
        threshold = 1 * GiB + 77 * MiB
        runs = Threshold(threshold)
        r = search(runs, lo=2 * GiB, hi=3 * GiB)
        self.assertBracket(r, threshold)
        self.assertTrue(r["monotonic"])

    def test_noise_near_the_threshold_leaves_an_answer_that_passed_twice(self):
        threshold, band = 6 * GiB, 64 * MiB
        for seed in range(200):
            runs = Threshold(threshold, band=band, seed=seed)
            r = search(runs, lo=5 * GiB, hi=7 * GiB)
            with self.subTest(seed=seed):
                self.assertIsNotNone(r["smallest"])
                # Below the band every run fails; at or above the threshold every one passes.
                self.assertGreaterEqual(r["smallest"], threshold - band)
                self.assertLess(r["smallest"], threshold + 8 * MiB)
                self.assertLess(r["largest_failing"], r["smallest"])
                if r["confirmed"]:
                    passes = [t for t in r["trials"] if t["limit"] == r["smallest"]]
                    self.assertGreaterEqual(len(passes), 2)
                    self.assertTrue(passes[-1]["ok"])
                self.assertLessEqual(len(r["trials"]), 40)

    def test_an_answer_that_fails_its_second_run_moves_up_to_one_that_passes_again(self):
        threshold = 4 * GiB + 6 * MiB
        flaky = 4 * GiB  # the first halving's limit; passes on its first run only
        seen = []

        def runs(limit):
            seen.append(limit)
            if limit == flaky:
                return seen.count(limit) == 1
            return limit >= threshold

        r = search(runs, lo=3 * GiB, hi=5 * GiB, tolerance=2 * MiB)
        self.assertEqual(r["smallest"], threshold)
        self.assertTrue(r["confirmed"])
        self.assertFalse(r["monotonic"])
        self.assertEqual(seen.count(flaky), 2)

    def test_nothing_passing_up_to_the_ceiling_gives_no_answer(self):
        runs = Threshold(TOTAL + GiB)
        r = search(runs, lo=60 * GiB, hi=70 * GiB)
        self.assertIsNone(r["smallest"])
        self.assertFalse(r["converged"])
        self.assertEqual(max(runs.calls), TOTAL)

    def test_out_of_time_stops_with_the_bracket_so_far(self):
        threshold = 5 * GiB + 3 * MiB
        runs = Threshold(threshold)
        r = search(runs, lo=1 * GiB, hi=9 * GiB, out_of_time=lambda: len(runs.calls) >= 4)
        self.assertEqual(len(runs.calls), 4)
        self.assertFalse(r["converged"])
        self.assertFalse(r["confirmed"])
        self.assertGreaterEqual(r["smallest"], threshold)
        self.assertLess(r["largest_failing"], threshold)

    def test_max_probes_bounds_the_runs(self):
        runs = Threshold(5 * GiB + 3 * MiB, band=32 * MiB, seed=1)
        r = search(runs, lo=1 * GiB, hi=9 * GiB, max_probes=6)
        self.assertEqual(len(runs.calls), 6)
        self.assertFalse(r["converged"])

    def test_a_low_end_that_keeps_passing_stops_at_zero(self):
        runs = Threshold(1 * MiB)
        r = search(runs, lo=100 * MiB, hi=200 * MiB, tolerance=2 * MiB)
        self.assertEqual(r["smallest"], 2 * MiB)
        self.assertEqual(r["largest_failing"], 0)
        self.assertNotIn(0, runs.calls)  # a limit of 0 is taken as failing, never run

    def test_auto_tolerance_is_a_whole_number_of_granules_within_2_and_8_MiB(self):
        self.assertEqual(smallest.auto_tolerance(100 * MiB), 2 * MiB)
        self.assertEqual(smallest.auto_tolerance(2 * GiB), 4 * MiB)
        self.assertEqual(smallest.auto_tolerance(3 * GiB), 6 * MiB)
        self.assertEqual(smallest.auto_tolerance(40 * GiB), 8 * MiB)


class SummaryTest(unittest.TestCase):
    def test_the_least_allocator_and_how_far_the_others_are_above_it(self):
        runs = {"w": {"native": {"smallest_bytes": 110}, "expandable": {"smallest_bytes": 105},
                      "ccalloc": {"smallest_bytes": 100}, "broken": {"error": "exit 1"}}}
        s = smallest.summarize(runs)["w"]
        self.assertEqual(s["least"], "ccalloc")
        self.assertAlmostEqual(s["over_least"]["native"], 0.10)
        self.assertAlmostEqual(s["over_least"]["expandable"], 0.05)
        self.assertNotIn("broken", s["over_least"])


if __name__ == "__main__":
    unittest.main()
