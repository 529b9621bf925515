"""First token first (SchedulerConfig.first_token_first): a step that can finish an arriving
prompt leaves the running decodes out, and they run the very next step, alone (helpers and
per-step checks: tests/unit/engine/core/test_scheduler.py)."""

from __future__ import annotations

from engine.config import SchedulerConfig
from tests.unit.engine.core.test_scheduler import chunk_ids, make


def _decoding(h, *rids, max_tokens=50):
    for rid in rids:
        h.add(rid, 4, max_tokens=max_tokens)
    h.step()  # their prompts
    out, _ = h.step()
    assert sorted(chunk_ids(out)) == sorted(rids) and all(c.num_tokens == 1 for c in out.chunks)


def test_an_arriving_prompt_gets_a_step_without_the_decodes_and_they_run_next():
    h = make(first_token_first=True)
    _decoding(h, "d0", "d1")
    h.add("new", 12, max_tokens=3)
    out, updates = h.step()
    assert chunk_ids(out) == ["new"] and out.chunks[0].num_tokens == 12
    assert [u.request.request_id for u in updates if u.new_token_ids] == ["new"]  # 1st token
    h.add("late", 4, max_tokens=3)
    out, _ = h.step()  # the decodes' turn (the new request's second token too), alone
    assert sorted(chunk_ids(out)) == ["d0", "d1", "new"]
    out, _ = h.step()  # then the prompt that arrived meanwhile, in a step of its own
    assert chunk_ids(out) == ["late"]
    h.run()
    assert set(h.finished) == {"d0", "d1", "new", "late"}
    h.assert_all_free()


def test_a_decode_never_waits_two_steps_in_a_row_however_prompts_arrive():
    h = make(first_token_first=True)
    _decoding(h, "d0")
    skipped_in_a_row = 0
    for k in range(6):  # a prompt arrives before every step
        h.add(f"p{k}", 8, max_tokens=2)
        out, _ = h.step()
        skipped_in_a_row = 0 if "d0" in chunk_ids(out) else skipped_in_a_row + 1
        assert skipped_in_a_row <= 1
    h.run()
    h.assert_all_free()


def test_a_prompt_longer_than_a_step_is_mixed_with_the_decodes_as_before():
    """Its first token is several steps away: holding the decodes back would buy nothing."""
    h = make(first_token_first=True, max_num_batched_tokens=16, max_prefill_chunk=8)
    _decoding(h, "d0")
    h.add("long", 20, max_tokens=2)
    out, _ = h.step()
    assert chunk_ids(out) == ["d0", "long"]
    h.run()
    h.assert_all_free()


def test_off_by_default_a_prompt_shares_its_step_with_the_decodes():
    assert SchedulerConfig().first_token_first is False
    h = make()
    _decoding(h, "d0", "d1")
    h.add("new", 12, max_tokens=3)
    out, _ = h.step()
    assert chunk_ids(out) == ["d0", "d1", "new"]
    h.run()
    h.assert_all_free()


def test_a_prompt_that_cannot_be_admitted_leaves_the_decodes_their_step():
    """No blocks for the arriving prompt: the step is the decodes', not an empty one."""
    h = make(first_token_first=True, num_blocks=5)  # 4 tokens a block
    _decoding(h, "d0", max_tokens=8)  # 2 blocks now, 3 at the end
    h.add("big", 16, max_tokens=2)  # 4-5 blocks: does not fit beside d0
    out, _ = h.step()
    assert chunk_ids(out) == ["d0"]
    h.run()
    h.assert_all_free()
