"""`bench autoscale` without a cluster: the load's shape and seeded arrivals, worker-seconds
from a timeline, and a run's summary (lost requests, SLO attainment, goodput per
worker-second)."""

from __future__ import annotations

import argparse

import pytest

from bench.cli import add_bench_subcommands
from bench.cluster import autoscale as ba


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "autoscale", *flags])


def test_the_load_ramps_holds_and_drops_and_its_arrivals_follow_it():
    load = ba.Load(low_rate=1.0, peak_rate=5.0, ramp_s=100, hold_s=200, drop_s=200)
    assert [load.rate(t) for t in (0, 50, 100, 299, 300, 499)] == [1, 3, 5, 5, 1, 1]
    arrivals = load.arrivals(seed=1)
    assert arrivals == load.arrivals(seed=1) != load.arrivals(seed=2)
    assert arrivals == sorted(arrivals) and arrivals[0] > 0 and arrivals[-1] < 500

    def count(a, b):
        return sum(a <= t < b for t in arrivals)
    # Expected 1000 at the peak and 200 in the drop (Poisson: within 4 sigma).
    assert abs(count(100, 300) - 1000) < 4 * 1000 ** 0.5
    assert abs(count(300, 500) - 200) < 4 * 200 ** 0.5
    assert abs(count(0, 100) - 300) < 4 * 300 ** 0.5  # the ramp's mean rate is 3


def test_summary_counts_lost_requests_slo_and_goodput_per_worker_second():
    args = _args("--slo-ttft", "1.0", "--slo-tpot", "0.1")
    run = ba.Run("autoscale", (1, 1))
    run.outcomes = [ba.Outcome(0.0, 0.5, 0.05), ba.Outcome(1.0, 2.0, 0.05),  # TTFT over
                    ba.Outcome(2.0, 0.5, 0.2), ba.Outcome(3.0, error="lost"),  # TPOT over
                    ba.Outcome(4.0, 0.9, 0.1)]
    run.timeline = [(0.0, 1, 1), (10.0, 1, 2), (20.0, 1, 1), (30.0, 1, 1)]
    run.wall_s = 30.0
    run.decisions = {"decode/up/load": 1, "decode/down/load": 1}
    s = ba._summary(run, args)
    assert (s["sent"], s["completed"], s["lost"]) == (5, 4, 1)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["worker_seconds"] == pytest.approx(10 * 2 + 10 * 3 + 10 * 2)
    assert s["goodput_per_worker_s"] == pytest.approx(2 / 70)
    assert s["goodput_rps"] == pytest.approx(2 / 30)
    assert s["peak_workers"] == {"prefill": 1, "decode": 2}
    assert s["errors"] == ["lost"]


def test_defaults_and_quick_sizes():
    args = _args()
    assert (args.low_rate, args.max_workers, args.max_num_seqs) == (0.3, 2, 8)
    assert (args.slo_ttft, args.slo_tpot) == (2.0, 0.25)
    assert _args("--quick").quick
