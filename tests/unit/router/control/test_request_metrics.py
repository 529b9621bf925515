"""``/metrics`` from the router's own state: first-token phases as Prometheus histograms
(router.control.phase_times, ``pdcluster_request_phase_seconds``) and each worker's KV usage
ratio (``pdcluster_kv_usage_ratio``)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.contract import BackendStats
from router.control.phase_times import BUCKETS, KEEP_TIMINGS, PHASES, PhaseTimes
from router.control.request_state import RequestTiming
from router.frontdoor.metrics import _StatsCollector


def test_each_record_lands_in_its_bucket_per_phase():
    pt = PhaseTimes()
    pt.record("a", RequestTiming(0.001, 0.3, 0.004, 1), 0.02)
    pt.record("b", RequestTiming(0.5, 0.3, -1e-6, 2), 45.0)  # a clock rounding, an outlier
    snap = pt.snapshot()
    assert set(snap) == set(PHASES)
    q = snap["prefill_queue"]
    assert q.count == 2 and q.sum == pytest.approx(0.501)
    assert q.counts[BUCKETS.index(0.001)] == 1 and q.counts[BUCKETS.index(0.5)] == 1
    assert snap["kv_transfer_tail"].counts[0] == 1  # -1e-6 counted as no time
    assert snap["decode_commit"].counts[-1] == 1  # above the last bound: +Inf only
    cum = snap["decode_commit"].cumulative()
    assert cum[-1] == ("+Inf", 2) and cum[BUCKETS.index(0.025)] == ("0.025", 1)
    assert pt.timings["b"].attempts == 2


def test_only_the_newest_timings_are_kept():
    pt = PhaseTimes()
    for i in range(KEEP_TIMINGS + 5):
        pt.record(f"r{i}", RequestTiming(), 0.0)
    assert len(pt.timings) == KEEP_TIMINGS and "r0" not in pt.timings
    assert pt.snapshot()["prefill_queue"].count == KEEP_TIMINGS + 5  # the histograms keep all


def test_the_collector_exposes_one_histogram_labelled_by_phase():
    pt = PhaseTimes()
    pt.record("a", RequestTiming(0.002, 0.2, 0.003, 1), 0.04)
    collector = _StatsCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    assert "pdcluster_request_phase_seconds" not in generate_latest(registry).decode()
    collector.snapshot = BackendStats(phase_seconds=pt.snapshot())
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    fam = fams["pdcluster_request_phase_seconds"]
    assert fam.type == "histogram"
    counts = {s.labels["phase"]: s.value for s in fam.samples if s.name.endswith("_count")}
    assert counts == dict.fromkeys(PHASES, 1.0)
    inf = [s for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"]
    assert len(inf) == len(PHASES)


def test_kv_usage_ratio_per_worker():
    from worker_protocol import WorkerLoad

    collector = _StatsCollector()
    collector.snapshot = BackendStats([WorkerLoad("d0", "decode", 30, 120, 1, 0),
                                       WorkerLoad("p0", "prefill", 0, 0, 0, 0)])
    registry = CollectorRegistry()
    registry.register(collector)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    got = {s.labels["worker"]: s.value for s in fams["pdcluster_kv_usage_ratio"].samples}
    assert got == {"d0": 0.25, "p0": 0.0}  # an empty pool: 0, not a division by zero


def test_kv_transfers_are_timed_by_role_pair():
    """``pdcluster_kv_transfer_seconds{pair}``: each pair its own histogram, +Inf = count."""
    from router.control.phase_times import PhaseTimes

    p = PhaseTimes()
    assert p.transfer_snapshot() == {}
    p.transfer("prefill->decode", 0.004)
    p.transfer("prefill->decode", 0.2)
    p.transfer("decode->prefill", -1.0)  # two clocks: clamped, never negative
    snap = p.transfer_snapshot()
    assert list(snap) == ["decode->prefill", "prefill->decode"]
    pd = snap["prefill->decode"]
    assert (pd.count, round(pd.sum, 6)) == (2, 0.204)
    assert pd.cumulative()[-1] == ("+Inf", 2)
    assert dict(pd.cumulative())["0.005"] == 1
    assert snap["decode->prefill"].sum == 0.0


def test_engine_step_histogram_snapshot_round_trips_to_prometheus_buckets():
    from engine.core.step_times import STEP_BUCKETS, StepHistogram, step_histogram

    h = StepHistogram()
    for s in (0.001, 0.03, 0.03, 7.0):
        h.record(s)
    snap = h.snapshot()
    assert len(snap) == len(STEP_BUCKETS) + 2
    buckets, total = step_histogram(list(snap))  # as it comes back through JSON
    assert buckets[0] == ("0.005", 1) and buckets[-1] == ("+Inf", 4)
    assert dict(buckets)["0.05"] == 3 and dict(buckets)["5.0"] == 3
    assert round(total, 6) == 7.061
    assert step_histogram(()) is None  # a report from a worker without it
