"""A prompt waits for the prefix block a running request is computing instead of computing
it a second time (``BlockManager.note_computing`` / ``in_progress``, ``Scheduler._admit``),
under continuous batching only and never for prompt logprobs; driven by the scheduler tests'
fake runner and clock (``tests/unit/engine/core/test_scheduler.py``), every block free at the
end."""

from __future__ import annotations

from engine.core.request import RequestStatus
from tests.unit.engine.core.test_scheduler import chunk_ids, make


def test_a_prompt_waits_for_the_prefix_a_running_request_is_computing():
    """Two requests with one new 3-block prefix arrive together: the second waits while the
    first computes it (chunked over two steps), then computes its own tail only; a request
    behind it with another prompt is not held up. Without the wait both computed the prefix."""
    h = make(block_size=4, max_num_batched_tokens=8)
    prefix = list(range(50, 62))  # 3 full blocks
    a = h.add("a", prefix + [70], max_tokens=2)
    b = h.add("b", prefix + [71, 72], max_tokens=2)
    c = h.add("c", 3, max_tokens=2)
    out, _ = h.step()  # a's first 8 tokens fill the budget (b would wait for block 0)
    assert [(x.request_id, x.start_pos, x.num_tokens) for x in out.chunks] == [
        ("a", 0, 8)]
    out, _ = h.step()  # blocks 0-1 cached; a computes block 2: b waits, c (behind it) joins
    assert chunk_ids(out) == ["a", "c"] and b.status is RequestStatus.WAITING
    out, _ = h.step()  # every prefix block cached: b computes only its 2 tail tokens
    assert ("b", 12, 2) in [(x.request_id, x.start_pos, x.num_tokens) for x in out.chunks]
    assert b.num_cached_tokens == 12 and h.sched.num_prefix_waits == 1
    h.run()
    assert all(r.status.finish_reason == "length" for r in (a, b, c))


def test_a_prompt_waiting_for_a_prefix_goes_ahead_when_its_computer_is_aborted():
    h = make(block_size=4, max_num_batched_tokens=4)
    prefix = list(range(50, 62))
    h.add("a", prefix + [70], max_tokens=2)
    b = h.add("b", prefix + [71], max_tokens=2)
    h.step()  # a computes block 0; b waits for block 1
    assert b.status is RequestStatus.WAITING
    assert h.sched.abort_request("a")  # nobody computes the rest now: b must not wait
    out, _ = h.step()
    assert [(x.request_id, x.start_pos) for x in out.chunks] == [("b", 4)]  # block 0 cached
    h.run()


def test_static_batching_never_waits_for_a_prefix():
    """A static batch runs to completion before the next forms: a prompt held back to wait
    for a batch-mate's prefix would miss the batch, so it computes the prefix alongside."""
    h = make(block_size=4, max_num_batched_tokens=64, policy="static", max_num_seqs=2)
    prefix = list(range(50, 62))
    h.add("a", prefix + [70], max_tokens=1)
    b = h.add("b", prefix + [71], max_tokens=1)
    out, _ = h.step()
    assert chunk_ids(out) == ["a", "b"] and b.num_cached_tokens == 0
    assert h.sched.num_prefix_waits == 0
    h.run()


def test_prompt_logprobs_never_wait_for_a_prefix():
    h = make(block_size=4, max_num_batched_tokens=32)
    prefix = list(range(50, 62))
    h.add("a", prefix + [70], max_tokens=1)
    b = h.add("b", prefix + [71], max_tokens=1, prompt_logprobs=0)
    out, _ = h.step()  # b computes every prompt position anyway: it joins at once
    assert chunk_ids(out) == ["a", "b"] and b.num_cached_tokens == 0
    h.run()
