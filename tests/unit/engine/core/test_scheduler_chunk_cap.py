"""``SchedulerConfig.max_prefill_chunk``: at most that many prompt tokens of one request a step,
so a short prompt behind a long one starts the next step (the harness of test_scheduler.py
checks every step's contract and that the pool ends free)."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from tests.unit.engine.core.test_scheduler import Harness, make


def _first_token_step(h: Harness, rid: str) -> int:
    """Index (in ``h.steps``) of the step that sampled ``rid``'s first token."""
    return next(i for i, out in enumerate(h.steps)
                for c in out.chunks if c.request_id == rid and c.sample)


@pytest.mark.parametrize("cap", [None, 16])
def test_prefill_chunk_cap_lets_a_short_prompt_start_behind_a_long_one(cap):
    """With ``max_prefill_chunk`` a long prompt takes at most ``cap`` tokens a step and the
    rest of the budget admits a short prompt that arrives behind it: its first token comes
    the next step. Without it the long prompt takes the whole budget until it is done."""
    h = make(max_num_batched_tokens=32, max_prefill_chunk=cap)
    long_req = h.add("long", 100, max_tokens=2)
    h.step()
    h.add("short", 5, max_tokens=2)
    h.run()
    if cap is None:
        # the long prompt's 100 tokens take steps 0-3; the short one finishes in step 3 or later
        assert _first_token_step(h, "short") >= 3
    else:
        assert _first_token_step(h, "short") == 1
        assert max(c.num_tokens for out in h.steps for c in out.chunks) <= cap
    assert len(long_req.output_token_ids) == 2  # the long one still completes, in order
    assert _first_token_step(h, "long") == (3 if cap is None else 6)


def test_prefill_chunk_cap_is_refused_without_chunked_prefill_or_below_one():
    with pytest.raises(ValueError, match="max_prefill_chunk must be > 0"):
        SchedulerConfig(max_prefill_chunk=0)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        SchedulerConfig(max_prefill_chunk=64, enable_chunked_prefill=False,
                        max_num_batched_tokens=4096)


def test_step_prefill_cap_bounds_every_steps_prompt_tokens_and_never_holds_a_decode():
    """``max_step_prefill_tokens``: the prompt tokens of a step, all requests together, stay
    within the cap (three prompts arriving at once are spread over steps), while every
    running decode still gets its token in every step: the streams' gap is one capped step."""
    h = make(max_num_batched_tokens=256, max_step_prefill_tokens=24)
    decoders = [h.add(f"d{i}", 4, max_tokens=40) for i in range(3)]
    h.step()  # the three short prompts: 12 tokens
    arrivals = [h.add(f"m{i}", 30, max_tokens=2) for i in range(3)]  # 90 prompt tokens
    for _ in range(6):
        out, _ = h.step()
        prompt_tokens = sum(c.num_tokens for c in out.chunks if c.num_tokens > 1)
        assert prompt_tokens <= 24
        # every decoder decodes in every step (none was held for the prompts)
        assert {c.request_id for c in out.chunks if c.num_tokens == 1} >= {"d0", "d1", "d2"}
    h.run()
    assert all(len(r.output_token_ids) == 2 for r in arrivals)
    assert all(len(r.output_token_ids) == 40 for r in decoders)
    # 90 prompt tokens at 24 a step: the last first token comes out of the fourth step
    assert _first_token_step(h, "m2") == 4


def test_step_prefill_cap_is_refused_without_chunked_prefill_or_below_one():
    with pytest.raises(ValueError, match="max_step_prefill_tokens must be > 0"):
        SchedulerConfig(max_step_prefill_tokens=0)
    with pytest.raises(ValueError, match="max_step_prefill_tokens needs chunked prefill"):
        SchedulerConfig(max_step_prefill_tokens=64, enable_chunked_prefill=False,
                        max_num_batched_tokens=4096)
