"""The autoscaler's decisions (router.control.autoscaler) on a fake clock and fake loads:
a constant load moves each role once, in one direction, to ceil(load / target) and then
never again; the bounds always hold; a load inside the tolerance band, or one that asks for
more only briefly, changes nothing; removal is one worker at a time after the down window."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.control.autoscaler import ScaleController, ScalePolicy

INTERVAL = 5.0


def _run(policy: ScalePolicy, role: str, start: int, load_at, steps: int,
         tick: float = INTERVAL):
    """Sample every ``tick`` (INTERVAL, or later: a loop whose ticks drift); a decision is
    applied at once (the actuator's new count). The load is a total shared by the workers:
    each one's utilization is load / n."""
    ctl = ScaleController(policy)
    n, decisions, counts = start, [], []
    for i in range(steps):
        now = i * tick
        load = load_at(now)
        d = ctl.observe(now, role, n, [load / n] * n)
        if d is not None:
            assert d.current == n and d.role == role
            decisions.append(d)
            n = d.desired
        counts.append(n)
    return decisions, counts


@settings(max_examples=300, deadline=None)
@given(load=st.floats(0.0, 12.0), lo=st.integers(1, 3), span=st.integers(0, 5),
       start=st.integers(1, 9), role=st.sampled_from(["prefill", "decode"]))
def test_a_constant_load_moves_once_and_stays_within_bounds(load, lo, span, start, role):
    hi = lo + span
    policy = ScalePolicy(min_prefill=lo, max_prefill=hi, min_decode=lo, max_decode=hi,
                         interval_s=INTERVAL, up_window_s=15, down_window_s=60, cooldown_s=30)
    decisions, counts = _run(policy, role, start, lambda _: load, steps=400)
    # The bounds: the first decision brings an out-of-bounds start back; after it they hold.
    first_in = next((i for i, n in enumerate(counts) if lo <= n <= hi), None)
    assert first_in is not None and first_in <= 1
    assert all(lo <= n <= hi for n in counts[first_in:])
    # One direction only, and settled well before the end.
    assert len({d.direction for d in decisions}) <= 1
    assert counts[-100:] == [counts[-1]] * 100
    final = counts[-1]
    mean = load / final
    want = min(max(math.ceil(load / policy.target_utilization - 1e-9), lo), hi)
    # Where it settled is what the load asks for, or a count whose mean utilization is
    # within the tolerance band of the target (nothing to change there).
    assert final == want or abs(mean / policy.target_utilization - 1) <= policy.tolerance


def test_inside_the_tolerance_band_nothing_changes():
    policy = ScalePolicy(min_decode=1, max_decode=8, interval_s=INTERVAL, up_window_s=0,
                         down_window_s=0, cooldown_s=0)
    # 3 workers at 0.75 each: 0.75 / 0.7 - 1 = 7% < 10%.
    decisions, _ = _run(policy, "decode", 3, lambda _: 2.25, steps=50)
    assert decisions == []


def test_a_short_burst_adds_nothing_and_a_held_one_adds_at_once_to_what_it_needs():
    policy = ScalePolicy(min_decode=1, max_decode=6, interval_s=INTERVAL, up_window_s=15,
                         down_window_s=60, cooldown_s=30)
    # 10 s of 4x load (2 samples) on 2 workers: under the 15 s window -> nothing.
    decisions, counts = _run(policy, "decode", 2,
                             lambda t: 2.8 if 50 <= t < 60 else 1.4, steps=40)
    assert decisions == [] and set(counts) == {2}
    # Held from t=50 on: after 15 s, straight to ceil(2.8 / 0.7) = 4.
    decisions, counts = _run(policy, "decode", 2, lambda t: 2.8 if t >= 50 else 1.4,
                             steps=40)
    assert [(d.direction, d.current, d.desired, d.reason) for d in decisions] == [
        ("up", 2, 4, "load")]
    assert counts.index(4) * INTERVAL == 65


@pytest.mark.parametrize("drift", [1.01, 1.04, 1.2])
def test_ticks_that_drift_still_see_a_held_load(drift):
    """A real loop ticks every interval plus the tick's own time: the windows still fill."""
    policy = ScalePolicy(min_decode=1, max_decode=4, interval_s=INTERVAL, up_window_s=15,
                         down_window_s=60, cooldown_s=30)
    decisions, _ = _run(policy, "decode", 1, lambda _: 2.0, steps=20, tick=INTERVAL * drift)
    assert [(d.direction, d.desired) for d in decisions] == [("up", 3)]


def test_the_load_going_away_removes_one_worker_per_down_window_and_cooldown():
    policy = ScalePolicy(min_prefill=1, max_prefill=4, interval_s=INTERVAL, up_window_s=15,
                         down_window_s=60, cooldown_s=30)
    decisions, counts = _run(policy, "prefill", 4, lambda _: 0.0, steps=100)
    assert [(d.direction, d.current, d.desired) for d in decisions] == [
        ("down", 4, 3), ("down", 3, 2), ("down", 2, 1)]
    # The first after a full 60 s window; the next ones a window after each change (the
    # samples of the old size are dropped), which also covers the 30 s cooldown.
    assert [counts.index(n) * INTERVAL for n in (3, 2, 1)] == [60, 125, 190]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"min_decode": 0}, "min-decode-workers"),
    ({"min_prefill": 3, "max_prefill": 2}, "min-prefill-workers"),
    ({"target_utilization": 0}, "autoscale-target"),
    ({"interval_s": 0}, "interval_s"),
])
def test_bad_settings_are_refused_naming_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScalePolicy(**kwargs)
