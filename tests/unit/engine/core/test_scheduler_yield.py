"""``SchedulerConfig.yield_step_prefill_tokens``: while requests of a higher priority have been
queued lately, the prompts of lower priorities are computed at most that many tokens a step
(chunked when longer), so a higher-priority prompt arriving mid-step waits for a short step,
then gets the next one; without mixed priorities, prompts batch as before
(engine/core/prompt_budget.py; helpers: tests/unit/engine/core/test_scheduler.py)."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.contract import MAX_PRIORITY, SamplingParams
from engine.core.prompt_budget import PRIORITY_MEMORY_S
from engine.core.request import Request
from tests.unit.engine.core.test_scheduler import EOS, Harness, make

HIGH = 1  # the engine's priorities: higher first (a request's API priority -1 arrives as 1)
YIELD = SchedulerConfig().yield_step_prefill_tokens  # the default, 256
P = YIELD // 2  # a prompt length: two of them fill a yielding step


def add(h: Harness, rid: str, n: int, priority: int = 0, max_tokens: int = 2) -> None:
    prompt = list(range(h.next_token, h.next_token + n))
    h.next_token += n
    h.sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens),
                                arrival_time=h.clock(), eos_token_ids=(EOS,),
                                priority=priority))


def prompt_chunks(out) -> list[tuple[str, int]]:
    """(request, prompt tokens) of a step's prompt chunks, decodes left out."""
    return [(c.request_id, c.num_tokens) for c in out.chunks if c.num_tokens > 1]


def test_without_mixed_priorities_prompts_batch_whole():
    """Only one priority queued: eight prompts share one step, as before."""
    h = make(num_blocks=1024, max_num_seqs=8)
    for i in range(8):
        add(h, f"low{i}", P)
    out, _ = h.step()
    assert prompt_chunks(out) == [(f"low{i}", P) for i in range(8)]
    h.run()


def test_a_high_priority_request_waits_behind_a_short_low_step_then_goes_next():
    """Once a high-priority request has been queued, low prompts are computed ``YIELD``
    tokens a step (two prompts); one arriving while such a step runs is the whole next step, ahead of
    the low prompts still waiting, which then go on two a step."""
    h = make(num_blocks=1024, max_num_seqs=8)
    add(h, "early-high", P, HIGH)
    out, _ = h.step()
    assert prompt_chunks(out) == [("early-high", P)]
    for i in range(6):
        add(h, f"low{i}", P)
    out, _ = h.step()
    assert prompt_chunks(out) == [("low0", P), ("low1", P)]
    add(h, "high", P, HIGH)  # arrives while that step runs
    out, _ = h.step()
    assert prompt_chunks(out) == [("high", P)]
    out, _ = h.step()
    assert prompt_chunks(out) == [("low2", P), ("low3", P)]
    out, _ = h.step()
    assert prompt_chunks(out) == [("low4", P), ("low5", P)]
    h.run()
    assert len(h.finished) == 8


def test_a_long_low_prompt_is_cut_into_chunks_and_a_high_prompt_goes_between_them():
    """A low prompt of 2 * YIELD + 44 tokens while priorities are mixed: YIELD, YIELD, 44
    tokens. A high prompt
    arriving after the first chunk is admitted in the next step; the low prompt's chunk
    beside it stays within the yield budget, and its first token comes after the high one."""
    h = make(num_blocks=1024, max_num_seqs=8)
    add(h, "early-high", 8, HIGH)
    h.run()
    add(h, "long", 2 * YIELD + 44)
    out, _ = h.step()
    assert prompt_chunks(out) == [("long", YIELD)]
    add(h, "high", P, HIGH)
    out, ups = h.step()
    assert prompt_chunks(out) == [("long", YIELD), ("high", P)]
    assert [u.request_id for u in ups if u.new_token_ids] == ["high"]
    out, _ = h.step()
    assert ("long", 44) in prompt_chunks(out)
    h.run()
    assert set(h.finished) == {"early-high", "long", "high"}


def test_the_yield_ends_once_no_higher_priority_was_queued_for_a_while():
    """A minute after the last high-priority request was queued, low prompts batch whole."""
    h = make(num_blocks=1024, max_num_seqs=8)
    add(h, "high", 8, HIGH)
    h.run()
    for i in range(4):
        add(h, f"low{i}", P)
    out, _ = h.step()
    assert prompt_chunks(out) == [("low0", P), ("low1", P)]
    h.clock.advance(PRIORITY_MEMORY_S + 1)
    out, _ = h.step()
    assert prompt_chunks(out) == [("low2", P), ("low3", P)]
    add(h, "later", 2 * YIELD + 44)
    out, _ = h.step()
    assert prompt_chunks(out) == [("later", 2 * YIELD + 44)]
    h.run()


def test_the_highest_priority_itself_is_never_held_to_the_yield_budget():
    """High prompts batch up to the step's whole budget: the yield is for the lower ones."""
    h = make(num_blocks=1024, max_num_seqs=8)
    add(h, "low", 8)
    h.run()
    for i in range(4):
        add(h, f"high{i}", P, HIGH)
    out, _ = h.step()
    assert prompt_chunks(out) == [(f"high{i}", P) for i in range(4)]
    h.run()


def assert_lows_batch_whole(h: Harness) -> None:
    """Four low prompts queued now share the next step whole (no yield), and finish."""
    for i in range(4):
        add(h, f"low{i}", P)
    out, _ = h.step()
    assert prompt_chunks(out) == [(f"low{i}", P) for i in range(4)]
    h.run()


def test_no_yield_when_turned_off_or_the_batching_cannot_cut_prompts():
    """``yield_step_prefill_tokens`` None or 0 (the command line's ``0``) turns it off; static
    batching and prefill without chunks never apply it (a prompt there cannot be cut, nor
    join a running batch). A negative budget is refused."""
    for cfg in (dict(yield_step_prefill_tokens=None), dict(yield_step_prefill_tokens=0),
                dict(policy="static"), dict(enable_chunked_prefill=False)):
        h = make(num_blocks=1024, max_num_seqs=8, **cfg)
        add(h, "high", 8, HIGH)
        h.run()
        assert_lows_batch_whole(h)
    with pytest.raises(ValueError, match=r"yield_step_prefill_tokens must be >= 0 \(0: off\)"):
        SchedulerConfig(yield_step_prefill_tokens=-1)


def test_a_migrated_streams_re_prefill_does_not_turn_the_yield_on():
    """A stream moved off a lost decode worker is queued above every client priority
    (MAX_PRIORITY + 1, router.control.config.MIGRATED_PRIORITY): not a class of requests
    arriving, so the prompts queued after it still batch whole."""
    h = make(num_blocks=1024, max_num_seqs=8)
    add(h, "migrated", 8, MAX_PRIORITY + 1)
    h.run()
    assert_lows_batch_whole(h)


def test_the_first_token_step_reads_this_steps_yield_budget():
    """Under ``first_token_first``, the decodes are left out only for a prompt that finishes in
    the step; a high request queued (and gone) since the last step makes the low prompt's
    budget this step YIELD, so a prompt of YIELD + 44 tokens does not finish and the decodes
    run beside its first chunk."""
    h = make(num_blocks=1024, max_num_seqs=8, first_token_first=True)
    add(h, "dec", 8, max_tokens=20)
    h.step()  # its prompt; it decodes from here on
    add(h, "high", 8, HIGH)
    assert h.sched.abort_request("high")
    add(h, "low", YIELD + 44)
    out, _ = h.step()
    assert prompt_chunks(out) == [("low", YIELD)]
    assert [c.request_id for c in out.chunks if c.num_tokens == 1] == ["dec"]
    h.run()
