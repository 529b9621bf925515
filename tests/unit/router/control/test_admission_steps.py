"""The admission's wait on a prefill worker counts its steps (router/control/prefill_steps.py):
the rest of the step running now, then what runs ahead of the request by priority at the
worker's batched rate. Synthetic calls and results at given times, no clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from router.contract import DeadlineRefusedError
from router.control.admission import Outcomes, admit
from router.control.prefill_steps import FORGET_S, PrefillSteps

LOW, HIGH = 0, 1  # engine priorities: higher first


def _measured(steps: PrefillSteps) -> None:
    """Worker "p" ran one step of 8 prompts of 64 tokens from t=0 to t=1: 512 tokens/s
    batched, a step of 1 s."""
    for i in range(8):
        steps.sent("p", f"m{i}", LOW, 64, now=0.0)
    for i in range(8):
        steps.ended("p", f"m{i}", now=1.0)
        steps.prefilled("p", f"m{i}", 64, 1.0)


def _backlog(steps: PrefillSteps, n: int, at: float) -> None:
    for i in range(n):
        steps.sent("p", f"low{i}", LOW, 64, now=at)


def test_a_worker_that_returned_nothing_yet_has_no_prediction():
    steps = PrefillSteps()
    assert steps.predict("p", LOW, now=0.0) is None
    steps.sent("p", "a", LOW, 64, now=0.0)
    assert steps.predict("p", LOW, now=0.5) is None


def test_the_batched_rate_and_the_step_come_from_the_results():
    steps = PrefillSteps()
    _measured(steps)
    w = steps.workers["p"]
    assert w.drain_rate == pytest.approx(512.0)
    assert w.step_s == pytest.approx(1.0)
    assert steps.predict("p", LOW, now=2.0) == (0.0, 1.0)  # idle: its own step only


def test_a_high_request_waits_for_the_running_step_not_the_low_backlog():
    """20 low prompts sent at t=1: the first 8 (a step's worth) run from t=1 to t=2, 12 wait.
    At t=1.4 a high prompt waits for the running step's last 0.6 s only; a low one also for
    the 12 queued (768 tokens at 512/s)."""
    steps = PrefillSteps()
    _measured(steps)
    _backlog(steps, 20, at=1.0)
    wait, own = steps.predict("p", HIGH, now=1.4)
    assert wait == pytest.approx(0.6)
    assert own == pytest.approx(1.0)  # no high step measured yet: any step's time
    wait, _ = steps.predict("p", LOW, now=1.4)
    assert wait == pytest.approx(0.6 + 768 / 512)


def test_high_prompts_queued_ahead_count_for_the_next_high_one():
    steps = PrefillSteps()
    _measured(steps)
    _backlog(steps, 20, at=1.0)
    steps.sent("p", "h0", HIGH, 64, now=1.5)  # not in the running step: it queues first
    wait, _ = steps.predict("p", HIGH, now=1.6)
    assert wait == pytest.approx(0.4 + 64 / 512)


def test_own_step_is_the_last_steps_of_its_priority():
    """A step of high prompts holds no low ones (engine/core/scheduler.py): shorter."""
    steps = PrefillSteps()
    _measured(steps)
    steps.sent("p", "h0", HIGH, 64, now=2.0)
    steps.ended("p", "h0", now=2.25)
    steps.prefilled("p", "h0", 64, 0.25)
    assert steps.predict("p", HIGH, now=3.0) == (0.0, pytest.approx(0.25))
    assert steps.predict("p", LOW, now=3.0)[1] > 0.25  # any step's time, moved a fifth


def test_a_failed_call_is_out_of_flight_and_forgotten():
    steps = PrefillSteps()
    _measured(steps)
    _backlog(steps, 9, at=1.0)
    assert steps.predict("p", LOW, now=1.5)[0] == pytest.approx(0.5 + 64 / 512)
    steps.ended("p", "low8", now=1.5)  # no result: aborted (its deadline passed), say
    assert "low8" not in steps.workers["p"].inflight
    # no step ended with it: the running one still ends at 2.0; nothing queues behind it
    assert steps.predict("p", LOW, now=1.5)[0] == pytest.approx(0.5)
    assert steps.workers["p"].drain_rate == pytest.approx(512.0)  # and no rate moved
    steps.sent("p", "later", LOW, 64, now=1.5 + FORGET_S + 1)
    assert "low8" not in steps.workers["p"].prompts


def _orch(outcomes: Outcomes, inflight_tokens: int) -> SimpleNamespace:
    view = SimpleNamespace(alive=True, block_size=16, free_blocks=10_000,
                           inflight_prefill_tokens=inflight_tokens)
    slot = SimpleNamespace(view=view, info=SimpleNamespace(worker_id="p"))
    return SimpleNamespace(
        config=SimpleNamespace(mode="disaggregated"), prefill={"p": slot},
        decode={"d": slot}, outcomes=outcomes,
        kv_index=SimpleNamespace(match_detail=lambda ids, wids, root: {}),
        pulls=SimpleNamespace(prefill_rate=lambda wid: 64.0),  # one prompt's rate: 64 / 1 s
        fanout=SimpleNamespace(pending=lambda: []),
        choose=SimpleNamespace(room_wait_s=0.0),
        adapters=SimpleNamespace(admitted=lambda lora: None))


def test_a_high_request_is_not_refused_for_the_low_backlog():
    """A 2 s deadline with 20 low prompts (1,280 tokens) routed there: the high request
    waits 0.6 s for the running step and its own 1 s, so it is admitted; a low one would
    wait 1.5 s more for the 12 queued, so it is refused with that wait."""
    out = Outcomes()
    _measured(out.steps)
    _backlog(out.steps, 20, at=1.0)
    orch = _orch(out, inflight_tokens=20 * 64)
    p = admit(orch, list(range(64)), 32, None, 2.0, HIGH, now=1.4)
    assert p.first_token_s == pytest.approx(1.6)
    with pytest.raises(DeadlineRefusedError) as e:
        admit(orch, list(range(64)), 32, None, 2.0, LOW, now=1.4)
    assert e.value.retry_after_s == pytest.approx(0.6 + 768 / 512)


def test_before_any_result_the_queued_tokens_are_the_prediction():
    """No step measured yet: the tokens routed there, at one prompt's rate."""
    orch = _orch(Outcomes(), inflight_tokens=128)
    p = admit(orch, list(range(64)), 32, None, None, LOW, now=0.0)
    assert (p.queue_s, p.compute_s) == (pytest.approx(2.0), pytest.approx(1.0))


def test_the_running_step_lasts_as_the_last_steps_of_its_priority():
    """A step of one high prompt (0.25 s, measured) runs from t=3: a request at t=3.1 waits
    0.15 s for it, not what is left of a full low step (1 s)."""
    steps = PrefillSteps()
    _measured(steps)
    steps.sent("p", "h0", HIGH, 64, now=2.0)
    steps.ended("p", "h0", now=2.25)
    steps.prefilled("p", "h0", 64, 0.25)
    steps.sent("p", "h1", HIGH, 64, now=3.0)
    assert steps.predict("p", LOW, now=3.1)[0] == pytest.approx(0.15)


def test_steps_that_vary_are_predicted_long():
    """Steps of 1 s then 2 s: the mean moves to 1.2 s, the spread to 0.2 s, and a step is
    predicted at the mean plus twice the spread: a deadline is missed by the long ones."""
    steps = PrefillSteps()
    _measured(steps)
    steps.sent("p", "slow", LOW, 64, now=2.0)
    steps.ended("p", "slow", now=4.0)
    steps.prefilled("p", "slow", 64, 2.0)
    assert steps.predict("p", LOW, now=5.0) == (0.0, pytest.approx(1.2 + 2 * 0.2))
