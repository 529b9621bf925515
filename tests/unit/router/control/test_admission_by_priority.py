"""The admission's prediction error per engine priority (router/control/admission.py), which
`pdcluster bench overload` reports per class."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from router.contract import GenerationChunk
from router.control.admission import MIN_RATE_SHARE, RECENT_S, Outcomes, Prediction, predict
from router.control.request_state import StreamState


def test_errors_are_summed_per_priority_from_first_tokens_only():
    out = Outcomes()
    high = StreamState("h", priority=1, predicted=Prediction(queue_s=0.5, compute_s=0.5, room_s=0.0))
    low = StreamState("l", priority=0, predicted=Prediction(queue_s=3.0, compute_s=0.5, room_s=0.0))
    out.note(high, GenerationChunk("h", [1], "", ttft_s=1.5))  # 0.5 s late
    out.note(low, GenerationChunk("l", [1], "", ttft_s=2.5))  # 1 s early
    out.note(low, GenerationChunk("l", [2], "", ttft_s=2.5))  # a later token: not counted
    assert out.by_priority[1] == [1, pytest.approx(0.5), pytest.approx(0.5)]
    assert out.by_priority[0] == [1, pytest.approx(1.0), pytest.approx(-1.0)]
    assert (out.predictions, out.abs_error_s) == (2, pytest.approx(1.5))


def _orch(queued_tokens: int, rate: float) -> SimpleNamespace:
    """One live prefill worker with ``queued_tokens`` queued, computing ``rate`` tokens/s;
    a decode worker with room; nothing cached, nobody pending."""
    view = SimpleNamespace(alive=True, block_size=16, inflight_prefill_tokens=queued_tokens,
                           free_blocks=1000)
    slot = SimpleNamespace(view=view, info=SimpleNamespace(worker_id="p0"))
    return SimpleNamespace(
        config=SimpleNamespace(mode="disaggregated"), prefill={"p0": slot},
        decode={"d0": SimpleNamespace(view=view)},
        kv_index=SimpleNamespace(match_detail=lambda *a: {}),
        pulls=SimpleNamespace(prefill_rate=lambda wid: rate),
        fanout=SimpleNamespace(pending=lambda: []), choose=SimpleNamespace(room_wait_s=0.0),
        outcomes=Outcomes())


def test_a_lower_priority_queue_drains_at_the_share_of_first_tokens_higher_ones_leave_it():
    """1,000 tokens queued at 1,000 tokens/s: 1 s for either class. When half the first
    tokens of late went to a higher priority, the low request's queue takes 2 s (half the
    worker is theirs), the high one's still 1 s; when all did, the low one's queue takes
    1 / MIN_RATE_SHARE times its plain wait; first tokens older than RECENT_S no longer
    count. Engine priorities: higher first."""
    orch = _orch(1000, 1000.0)
    prompt = list(range(64))
    assert predict(orch, prompt, 8, priority=0).queue_s == pytest.approx(1.0)
    now = time.monotonic()
    orch.outcomes.first_token(0, now)
    orch.outcomes.first_token(1, now)
    assert predict(orch, prompt, 8, priority=0).queue_s == pytest.approx(2.0)
    assert predict(orch, prompt, 8, priority=1).queue_s == pytest.approx(1.0)
    only_high = _orch(1000, 1000.0)
    only_high.outcomes.first_token(1, now)
    assert predict(only_high, prompt, 8, priority=0).queue_s == pytest.approx(1 / MIN_RATE_SHARE)
    old = _orch(1000, 1000.0)
    old.outcomes.first_token(1, now - 2 * RECENT_S)
    assert predict(old, prompt, 8, priority=0).queue_s == pytest.approx(1.0)


def test_a_first_token_counts_toward_its_priority_share():
    """What the router's streams deliver feeds the share (engine priorities: higher first)."""
    out = Outcomes()
    for rid, priority in (("h", 1), ("l1", 0), ("l2", 0), ("l3", 0)):
        stream = StreamState(rid, priority=priority,
                             predicted=Prediction(queue_s=0.5, compute_s=0.5, room_s=0.0))
        out.note(stream, GenerationChunk(rid, [1], "", ttft_s=1.0))
    assert out.higher_share(0, time.monotonic()) == pytest.approx(0.25)
    assert out.higher_share(1, time.monotonic()) == 0.0


def test_a_migrated_streams_first_token_is_no_priority_class_share():
    """A stream moved before its first token is queued above every client priority
    (MIGRATED_PRIORITY): its first token teaches its own calibration but takes no class's
    share of the workers from the others."""
    from router.control.config import MIGRATED_PRIORITY

    out = Outcomes()
    for rid, priority in (("moved", MIGRATED_PRIORITY), ("l1", 0)):
        stream = StreamState(rid, priority=priority,
                             predicted=Prediction(queue_s=0.5, compute_s=0.5, room_s=0.0))
        out.note(stream, GenerationChunk(rid, [1], "", ttft_s=1.0))
    assert out.higher_share(0, time.monotonic()) == 0.0
    assert out.by_priority[MIGRATED_PRIORITY][0] == 1
