"""The admission's first-token prediction learns from its own error (router/control/admission.py):
synthetic predictions and first tokens, no clock."""

from __future__ import annotations

import dataclasses

import pytest

from router.contract import GenerationChunk
from router.control.admission import (
    MAX_FACTOR,
    MIN_FACTOR,
    Calibration,
    Outcomes,
    Prediction,
    live_scale,
)
from router.control.request_state import StreamState


def test_scale_applies_to_the_wait_not_the_compute():
    p = Prediction(queue_s=1.0, compute_s=0.5, room_s=0.25, scale=2.0)
    assert p.wait_s == pytest.approx(2.5)
    assert p.first_token_s == pytest.approx(3.0)
    assert Prediction(1.0, 0.5, 0.25).first_token_s == pytest.approx(1.75)


def test_factor_converges_to_how_long_queues_really_took():
    c = Calibration()
    # queues took twice their prediction (the note's 4x run: queue 1.55 s against ~0.8 s)
    for _ in range(40):
        c.observe(Prediction(queue_s=0.8, compute_s=0.3, room_s=0.0), 0.3 + 1.6)
    assert c.factor == pytest.approx(2.0, rel=0.01)
    assert c.observed == 40
    # and back when they ran on time again
    for _ in range(40):
        c.observe(Prediction(queue_s=0.8, compute_s=0.3, room_s=0.0, scale=2.0), 0.3 + 0.8)
    assert c.factor == pytest.approx(1.0, rel=0.01)


def test_the_factor_it_was_made_with_is_divided_out():
    """A calibrated prediction that came out right teaches the factor it was made with."""
    c = Calibration(factor=1.5)
    for _ in range(30):
        p = Prediction(queue_s=1.0, compute_s=0.2, room_s=0.0, scale=c.factor)
        c.observe(p, p.first_token_s)
    assert c.factor == pytest.approx(1.5)


def test_short_waits_teach_nothing():
    c = Calibration()
    c.observe(Prediction(queue_s=0.01, compute_s=0.1, room_s=0.0), 5.0)
    assert (c.factor, c.observed) == (1.0, 0)


def test_one_freak_first_token_is_bounded():
    c = Calibration()
    c.observe(Prediction(queue_s=0.1, compute_s=0.1, room_s=0.0), 60.0)
    assert c.factor <= 1.0 + 0.2 * (MAX_FACTOR - 1.0) + 1e-9
    for _ in range(100):
        c.observe(Prediction(queue_s=0.1, compute_s=0.1, room_s=0.0), 60.0)
    assert c.factor == pytest.approx(MAX_FACTOR)
    for _ in range(100):  # first tokens before the compute alone: the floor
        c.observe(Prediction(queue_s=1.0, compute_s=1.0, room_s=0.0), 0.0)
    assert c.factor == pytest.approx(MIN_FACTOR)


def test_outcomes_count_the_error_and_calibrate_from_the_first_token_only():
    out = Outcomes()
    stream = StreamState("r1", predicted=Prediction(queue_s=1.0, compute_s=0.5, room_s=0.0))
    out.note(stream, GenerationChunk("r1", [7], "", ttft_s=2.5))
    assert (out.predictions, out.abs_error_s, out.error_s) == (1, 1.0, 1.0)
    assert out.calibration_for(0).observed == 1
    assert out.calibration_for(0).factor == pytest.approx(1.0 + 0.2 * (2.0 - 1.0))
    out.note(stream, GenerationChunk("r1", [8], "", ttft_s=2.5))  # a later token: no change
    assert (out.predictions, out.calibration_for(0).observed) == (1, 1)
    # the cluster's status carries the three sums only (router/cluster/ray_cluster.py)
    assert dataclasses.astuple(out) == (1, 1.0, 1.0)


def _waiting(priority: int, queue_s: float, compute_s: float, made_at: float) -> StreamState:
    return StreamState("r", priority=priority,
                       predicted=Prediction(queue_s, compute_s, 0.0, made_at=made_at))


def test_requests_running_late_now_raise_the_scale():
    """Three requests wait for their first token at t=10: one on time, one (queue 1 s, compute
    0.5 s) already 3 s old, i.e. its wait is at least 2.5x the predicted."""
    pending = [_waiting(0, 1.0, 0.5, made_at=9.5),   # 0.5 s old: within its 1.5 s
               _waiting(0, 1.0, 0.5, made_at=7.0),   # 3 s old: (3 - 0.5) / 1 = 2.5
               _waiting(0, 0.01, 0.5, made_at=0.0)]  # a wait too short to read
    assert live_scale(1.0, pending, priority=0, now=10.0) == pytest.approx(2.5)
    # the calibration's own factor when it is larger; never past MAX_FACTOR
    assert live_scale(3.0, pending, priority=0, now=10.0) == pytest.approx(3.0)
    assert live_scale(1.0, pending, priority=0, now=100.0) == pytest.approx(MAX_FACTOR)


def test_only_requests_at_its_priority_or_higher_count():
    """A low-priority request left waiting behind higher ones says nothing of a high one's
    wait (engine priorities: higher first)."""
    pending = [_waiting(-1, 1.0, 0.5, made_at=0.0), StreamState("done", priority=5)]
    assert live_scale(1.0, pending, priority=0, now=10.0) == 1.0
    assert live_scale(1.0, pending, priority=-1, now=3.0) == pytest.approx(2.5)


def test_each_priority_learns_its_own_factor():
    """Low requests overtaken by high ones wait three times their predicted queue while high
    ones wait as predicted: the low priority's factor grows to 3, the high one's stays at 1
    (engine priorities: higher first)."""
    out = Outcomes()
    for i in range(30):
        for priority, took in ((0, 3.0), (1, 1.0)):
            rid = f"{priority}-{i}"
            stream = StreamState(rid, priority=priority,
                                 predicted=Prediction(queue_s=1.0, compute_s=0.5, room_s=0.0))
            out.note(stream, GenerationChunk(rid, [7], "", ttft_s=0.5 + took))
    assert out.calibration_for(0).factor == pytest.approx(3.0, rel=0.01)
    assert out.calibration_for(1).factor == pytest.approx(1.0)
    assert out.calibration_for(-1).factor == 1.0  # never seen: as predicted
