"""Scheduler priorities: a migrated stream's re-prefill (priority 1) is queued ahead of new
prompts and gets a step of its own; blocks running short preempt the lowest priority; a
waiting request of a higher priority with no room preempts lower running ones, and only when
that makes room (helpers and per-step checks: tests/unit/engine/core/test_scheduler.py)."""

from __future__ import annotations

from engine.contract import SamplingParams
from engine.core.request import Request
from tests.unit.engine.core.test_scheduler import EOS, chunk_ids, make


def test_a_higher_priority_request_is_admitted_ahead_of_waiting_ones():
    """A migrated stream's re-prefill (priority 1) goes ahead of prompts already waiting,
    behind the running batch and behind earlier requests of its own priority."""
    h = make(max_num_seqs=1)
    for i in range(3):
        h.add(f"new{i}", 4, max_tokens=2)
    h.step()  # new0 runs; new1, new2 wait
    for rid in ("moved-a", "moved-b"):
        req = Request(rid, list(range(900, 904)), SamplingParams(max_tokens=2),
                      arrival_time=h.clock(), eos_token_ids=(EOS,), priority=1)
        h.sched.add_request(req)
    assert [r.request_id for r in h.sched.waiting] == ["moved-a", "moved-b", "new1", "new2"]
    order = []
    while h.sched.has_unfinished:
        out, _ = h.step()
        order += [rid for rid in chunk_ids(out) if rid not in order]
    assert order == ["new0", "moved-a", "moved-b", "new1", "new2"]
    h.assert_all_free()


def test_a_step_that_admits_higher_priority_requests_admits_no_lower_ones():
    """Re-prefills of migrated streams (priority 1) get a step of their own: new prompts
    waiting beside them would lengthen it, and every moved stream's first token waits for the
    whole step. Running chunks still share it; the new prompts follow in the next step."""
    h = make(max_num_batched_tokens=64, max_prefill_chunk=8)
    h.add("running", 16, max_tokens=2)
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("running", 8)]
    for i in range(2):
        h.add(f"new{i}", 4, max_tokens=2)
    for k, rid in enumerate(("moved-a", "moved-b")):
        prompt = list(range(900 + 10 * k, 906 + 10 * k))
        h.sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=2),
                                    arrival_time=h.clock(), eos_token_ids=(EOS,), priority=1))
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [
        ("running", 8), ("moved-a", 6), ("moved-b", 6)]
    out, _ = h.step()
    assert {c.request_id for c in out.chunks} >= {"new0", "new1"}
    h.run()
    assert set(h.finished) == {"running", "new0", "new1", "moved-a", "moved-b"}
    h.assert_all_free()


def test_blocks_running_short_preempt_the_lowest_priority_request_not_the_latest():
    """Three requests grow past a pool that holds two: the one preempted is the lowest
    priority (admitted first), not the one admitted last; it resumes once room frees."""
    h = make(num_blocks=12, block_size=4, prefix_caching=False)
    for rid, prio in (("low", -5), ("mid", 0), ("high", 5)):
        h.sched.add_request(Request(rid, list(range(100, 108)), SamplingParams(max_tokens=12),
                                    arrival_time=h.clock(), eos_token_ids=(EOS,),
                                    priority=prio))
        h.step()
    assert [r.request_id for r in h.sched.running] == ["high", "mid", "low"]
    preempted = []
    while h.sched.has_unfinished:
        out, _ = h.step()
        preempted += out.preempted_ids
    assert preempted and set(preempted) == {"low"}, preempted
    assert set(h.finished) == {"low", "mid", "high"}
    h.assert_all_free()


def _running_pair(h):
    """``low`` (-5) and ``mid`` (0) decoding, holding 7 of the pool's 8 blocks of 4 tokens
    (at most 4 each to their end: growth alone never preempts)."""
    for rid, prio in (("low", -5), ("mid", 0)):
        h.sched.add_request(Request(rid, list(range(100 + 20 * prio, 112 + 20 * prio)),
                                    SamplingParams(max_tokens=4), arrival_time=h.clock(),
                                    eos_token_ids=(EOS,), priority=prio))
        h.step()
    assert [r.request_id for r in h.sched.running] == ["mid", "low"]
    assert h.bm.num_free_blocks == 1


def _add(h, rid: str, prio: int, prompt_len: int = 12) -> Request:
    req = Request(rid, list(range(500 + 40 * len(h.sched.requests),
                                  500 + 40 * len(h.sched.requests) + prompt_len)),
                  SamplingParams(max_tokens=4), arrival_time=h.clock(), eos_token_ids=(EOS,),
                  priority=prio)
    h.sched.add_request(req)
    return req


def test_a_waiting_higher_priority_request_preempts_the_lowest_running_one_for_room():
    """No room for ``high``'s prompt: ``low`` (the lowest running priority) is preempted in
    the step that admits ``high``, not ``mid``; ``low`` requeues by its priority (behind
    ``mid2``, which waits: nobody below it runs once ``low`` is gone), is preempted once only,
    and everyone finishes with the pool whole."""
    h = make(num_blocks=8, block_size=4, prefix_caching=False)
    _running_pair(h)
    _add(h, "high", 5)
    _add(h, "mid2", 0)
    out, _ = h.step()
    assert out.preempted_ids == ["low"]
    assert "high" in chunk_ids(out) and "low" not in chunk_ids(out)
    assert [r.request_id for r in h.sched.waiting] == ["mid2", "low"]
    preempted = list(out.preempted_ids)
    while h.sched.has_unfinished:
        out, _ = h.step()
        preempted += out.preempted_ids
    assert preempted == ["low"]
    assert h.finished["low"].num_preemptions == 1
    assert set(h.finished) == {"low", "mid", "high", "mid2"}
    h.assert_all_free()


def test_equal_priorities_never_preempt_each_other_and_lower_ones_wait():
    h = make(num_blocks=8, block_size=4, prefix_caching=False)
    _running_pair(h)
    _add(h, "same-as-low", -5)
    out, _ = h.step()
    assert out.preempted_ids == [] and "same-as-low" not in chunk_ids(out)
    h.run()
    assert all(r.num_preemptions == 0 for r in h.finished.values())


def test_nobody_is_preempted_when_all_lower_ones_would_not_make_room():
    """``mid2`` (0) needs 6 blocks; ``low``, the one running below it, holds 4 and at most
    one is free: preempting it would not be enough, so nothing is preempted and ``mid2`` waits for
    room to come back."""
    h = make(num_blocks=8, block_size=4, prefix_caching=False)
    _running_pair(h)
    _add(h, "mid2", 0, prompt_len=24)
    out, _ = h.step()
    assert out.preempted_ids == [] and "mid2" not in chunk_ids(out)
    h.run()
    assert all(r.num_preemptions == 0 for r in h.finished.values())
    assert set(h.finished) == {"low", "mid", "mid2"}
