"""Scheduler lifecycles driven by a fake runner (token = f(request, position)) and a fake clock.

Every step is checked against the scheduler's contract (token budget, sequence cap, chunks that
continue exactly where the request's KV ends, block tables that cover the chunk) and every test
ends with the whole block pool free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.config import SchedulerConfig
from engine.contract import QueueFullError, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput, StepUpdate

EOS = 2


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def fake_token(chunk) -> int:
    """Deterministic next token: depends only on the request and the position it samples for,
    so recompute after preemption must reproduce the same continuation."""
    return 10 + (_rid_hash(chunk.request_id) + chunk.end_pos) % 50


def _rid_hash(rid: str) -> int:
    return sum(map(ord, rid))  # not hash(): that changes with PYTHONHASHSEED


@dataclass
class Harness:
    sched: Scheduler
    clock: FakeClock
    steps: list[SchedulerOutput] = field(default_factory=list)
    finished: dict[str, Request] = field(default_factory=dict)
    next_token: int = 1000  # int prompts get fresh token ids: no accidental prefix hits

    @property
    def bm(self) -> BlockManager:
        return self.sched.blocks

    def add(self, rid: str, prompt: list[int] | int = 4, *, max_tokens: int = 4,
            eos: tuple[int, ...] = (EOS,), **sp) -> Request:
        if isinstance(prompt, int):
            tokens = list(range(self.next_token, self.next_token + prompt))
            self.next_token += prompt
        else:
            tokens = prompt
        req = Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **sp),
                      arrival_time=self.clock(), eos_token_ids=eos)
        self.sched.add_request(req)
        return req

    def step(self, token_fn=fake_token) -> tuple[SchedulerOutput, list[StepUpdate]]:
        s = self.sched
        # Where each request's KV ended before this step (chunks must continue from there).
        computed = {rid: r.num_computed_tokens for rid, r in s.requests.items()}
        out = s.schedule()
        cfg = s.config
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.chunks) <= cfg.max_num_seqs
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        for c in out.chunks:
            req = s.requests[c.request_id]
            assert c.num_tokens > 0
            assert c.start_pos == req.num_computed_tokens
            if computed.get(c.request_id, 0) != c.start_pos:  # admitted: KV from prefix cache
                assert c.start_pos == req.num_cached_tokens
            assert c.token_ids == req.all_token_ids[c.start_pos:c.end_pos]
            assert c.sample == (c.end_pos == req.num_tokens)
            assert len(c.block_ids) * self.bm.block_size >= c.end_pos
        result = ModelRunnerOutput({c.request_id: token_fn(c) for c in out.chunks if c.sample})
        updates = s.update_from_output(out, result)
        self.bm.check_invariants()
        for u in updates:
            if u.request.is_finished:
                self.finished[u.request_id] = u.request
                assert not self.bm.has_request(u.request_id)  # blocks freed at once
        if not out.is_empty:
            self.steps.append(out)
        return out, updates

    def run(self, max_steps: int = 5000, token_fn=fake_token) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished:
                break
            self.step(token_fn)
        assert not self.sched.has_unfinished, "scheduler made no progress"
        self.assert_all_free()

    def assert_all_free(self) -> None:
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks


def make(num_blocks: int = 256, block_size: int = 4, prefix_caching: bool = True,
         **cfg) -> Harness:
    clock = FakeClock()
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Harness(Scheduler(SchedulerConfig(**cfg), bm, clock), clock)


def chunk_ids(out: SchedulerOutput) -> list[str]:
    return [c.request_id for c in out.chunks]


# ---- lifecycles --------------------------------------------------------------------------
def test_single_request_prefill_then_decode_to_max_tokens():
    h = make()
    req = h.add("a", 10, max_tokens=5)
    out, ups = h.step()
    assert [(c.start_pos, c.num_tokens, c.sample) for c in out.chunks] == [(0, 10, True)]
    assert [u.new_token_ids for u in ups] == [[fake_token(out.chunks[0])]]
    for _ in range(4):
        out, ups = h.step()
        assert [(c.num_tokens, c.sample) for c in out.chunks] == [(1, True)]
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.status.finish_reason == "length"
    assert len(req.output_token_ids) == 5
    assert "a" not in h.sched.requests
    assert not h.sched.has_unfinished
    h.assert_all_free()


def test_token_times_come_from_the_injected_clock():
    h = make()
    req = h.add("a", 3, max_tokens=3)
    for _ in range(3):
        h.clock.advance(1.5)
        h.step()
    assert req.first_token_time == 1.5
    assert req.token_times == [1.5, 3.0, 4.5]


def test_chunked_prefill_respects_token_budget_and_seq_cap():
    h = make(max_num_batched_tokens=8, max_num_seqs=2)
    reqs = [h.add(f"r{i}", 20, max_tokens=3) for i in range(4)]
    first, _ = h.step()
    assert [(c.request_id, c.num_tokens, c.sample) for c in first.chunks] == [("r0", 8, False)]
    h.run()
    for out in h.steps:
        assert out.num_batched_tokens <= 8 and len(out.chunks) <= 2
    # No step ever ran more than two distinct requests, and every prompt was fully prefilled.
    assert all(len(r.output_token_ids) == 3 for r in reqs)
    prefill = sum(c.num_tokens for out in h.steps for c in out.chunks if not c.sample)
    assert prefill > 0


def test_decode_gives_each_running_request_one_token_per_step():
    h = make(max_num_seqs=4)
    for i in range(4):
        h.add(f"r{i}", 5 + i, max_tokens=6)
    h.step()  # all four prompts fit the budget: prefilled together
    for _ in range(5):
        out, ups = h.step()
        assert sorted(chunk_ids(out)) == ["r0", "r1", "r2", "r3"]
        assert all(c.num_tokens == 1 and c.sample for c in out.chunks)
        assert len(ups) == 4
    h.assert_all_free()


def test_seq_cap_limits_the_running_batch():
    h = make(max_num_seqs=2)
    for i in range(5):
        h.add(f"r{i}", 4, max_tokens=3)
    while h.sched.has_unfinished:
        h.step()
        assert h.sched.num_running <= 2
    assert len(h.finished) == 5
    h.assert_all_free()


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget():
    h = make(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    h.add("a", 10, max_tokens=3)
    h.add("b", 10, max_tokens=3)
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 10)]
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 10)]
    h.run()


def test_prefix_cache_hit_skips_the_shared_prompt():
    h = make(block_size=4)
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks + 1
    h.add("a", prompt, max_tokens=2)
    h.run()
    b = h.add("b", prompt, max_tokens=2)
    out, _ = h.step()
    assert [(c.start_pos, c.num_tokens) for c in out.chunks] == [(12, 1)]
    assert b.num_cached_tokens == 12
    h.run()


# ---- batching policies ----------------------------------------------------------------------
def test_continuous_refills_a_freed_slot_the_next_step():
    h = make(max_num_seqs=2)
    h.add("short", 4, max_tokens=2)
    h.add("long", 4, max_tokens=10)
    h.add("next", 4, max_tokens=2)
    h.step()
    _, ups = h.step()
    assert [u.request_id for u in ups if u.request.is_finished] == ["short"]
    # Freed within the same update: only "long" holds blocks now.
    assert h.bm.num_used_blocks == len(h.bm.block_ids("long")) > 0
    out, _ = h.step()
    assert "next" in chunk_ids(out)
    h.run()


def test_static_nobody_joins_until_the_whole_batch_finished():
    h = make(max_num_seqs=2, policy="static")
    h.add("a", 4, max_tokens=2)
    h.add("b", 4, max_tokens=6)
    h.add("c", 4, max_tokens=2)
    h.step()
    h.add("late", 4, max_tokens=2)
    joined_at = None
    for n in range(2, 20):
        out, _ = h.step()
        if "c" in chunk_ids(out):
            joined_at = n
            break
        assert set(chunk_ids(out)) <= {"a", "b"}
    assert joined_at == 7  # b's 6th token was step 6
    assert "b" in h.finished
    h.run()


def test_static_batch_fills_all_slots_even_when_prompts_exceed_one_steps_budget():
    # The token budget only chunks the batch's prefill; the batch is still max_num_seqs wide.
    h = make(max_num_seqs=3, max_num_batched_tokens=8, policy="static")
    for rid in "abc":
        h.add(rid, 6, max_tokens=8)
    h.add("d", 6, max_tokens=1)
    seen: set[str] = set()
    for _ in range(4):
        out, _ = h.step()
        seen |= set(chunk_ids(out))
    assert seen == {"a", "b", "c"}
    h.run()


def test_dynamic_launches_on_window_or_full_batch():
    h = make(max_num_seqs=3, policy="dynamic", dynamic_window_s=1.0)
    h.add("a", 4, max_tokens=2)
    h.clock.advance(0.4)
    h.add("b", 4, max_tokens=2)
    out, _ = h.step()
    assert out.is_empty
    h.clock.advance(0.5)  # oldest waited 0.9 s
    out, _ = h.step()
    assert out.is_empty
    h.clock.advance(0.1)  # oldest waited 1.0 s: launch with whatever is there
    out, _ = h.step()
    assert chunk_ids(out) == ["a", "b"]
    h.add("c", 4, max_tokens=2)  # arrives while a batch runs: must not join it
    out, _ = h.step()
    assert chunk_ids(out) == ["a", "b"]
    assert h.sched.num_running == 0
    h.add("d", 4, max_tokens=2)
    h.add("e", 4, max_tokens=2)
    out, _ = h.step()  # c, d, e fill the batch: no need to wait for the window
    assert chunk_ids(out) == ["c", "d", "e"]
    h.run()


# ---- preemption ---------------------------------------------------------------------------
def test_preemption_recomputes_the_newest_request_and_keeps_its_tokens():
    # 6 blocks of 4 tokens; three requests each growing to 12 tokens (3 blocks) cannot coexist.
    h = make(num_blocks=6, block_size=4, prefix_caching=False)
    reqs = [h.add(rid, [rid_i * 10 + 1] * 4, max_tokens=8)
            for rid_i, rid in enumerate(["a", "b", "c"])]
    outputs_at_preemption: dict[str, list[int]] = {}
    while h.sched.has_unfinished:
        out, _ = h.step()
        for rid in out.preempted_ids:
            req = next(r for r in reqs if r.request_id == rid)
            outputs_at_preemption.setdefault(rid, list(req.output_token_ids))
            assert req.status is RequestStatus.PREEMPTED
            assert not h.bm.has_request(rid)
    assert h.sched.num_preemptions >= 1
    first = next(out for out in h.steps if out.preempted_ids)
    assert first.preempted_ids[0] == "c"  # most recently admitted goes first
    c = reqs[2]
    assert c.num_preemptions >= 1
    assert outputs_at_preemption["c"]  # it had generated tokens before ...
    assert c.output_token_ids[:len(outputs_at_preemption["c"])] == outputs_at_preemption["c"]
    # ... and its recompute chunk fed them back in rather than regenerating them.
    recompute = next(ch for out in h.steps for ch in out.chunks
                     if ch.request_id == "c" and ch.start_pos == 0 and ch.num_tokens > 4)
    assert recompute.token_ids[4:] == outputs_at_preemption["c"]
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 8
        # Deterministic runner: preemption must not change what was generated.
        assert r.output_token_ids == [10 + (_rid_hash(r.request_id) + p) % 50 for p in range(4, 12)]
    h.assert_all_free()


# ---- abort / remote KV ------------------------------------------------------------------------
def test_abort_waiting_running_and_remote_frees_blocks():
    h = make(max_num_seqs=1)
    running = h.add("run", 6, max_tokens=10)
    waiting = h.add("wait", 6, max_tokens=10)
    remote = Request("rem", [5] * 6, SamplingParams(max_tokens=4), arrival_time=0.0)
    assert h.sched.add_remote_request(remote)
    assert h.bm.has_request("rem")
    h.step()
    assert running.status is RequestStatus.RUNNING and waiting.status is RequestStatus.WAITING
    for req in (running, waiting, remote):
        assert h.sched.abort_request(req.request_id)
        assert req.status is RequestStatus.FINISHED_ABORTED
        assert req.status.finish_reason == "abort"
        assert not h.bm.has_request(req.request_id)
        assert not h.sched.abort_request(req.request_id)  # already done
    assert not h.sched.abort_request("nobody")
    assert not h.sched.has_unfinished
    h.assert_all_free()


def test_abort_while_a_step_runs_drops_its_result():
    h = make()
    h.add("a", 4, max_tokens=5)
    out = h.sched.schedule()
    h.sched.abort_request("a")
    assert h.sched.update_from_output(out, ModelRunnerOutput({"a": 7})) == []
    h.assert_all_free()


def test_remote_kv_request_joins_ahead_of_new_arrivals_and_decodes():
    h = make(block_size=4)
    h.add("local", 4, max_tokens=2)
    remote = Request("rem", list(range(30, 38)), SamplingParams(max_tokens=3),
                     arrival_time=0.0, eos_token_ids=(EOS,))
    assert h.sched.add_remote_request(remote)
    assert len(h.bm.block_ids("rem")) == 3  # 8 prompt tokens + the first generated one
    assert h.sched.num_waiting == 2
    upd = h.sched.finish_remote_kv("rem", 44)
    assert upd.new_token_ids == [44] and not upd.request.is_finished
    assert remote.num_computed_tokens == 8 and remote.output_token_ids == [44]
    out, _ = h.step()
    # The remote request only computes its first token's KV; it is queued before "local".
    assert [(c.request_id, c.start_pos, c.num_tokens) for c in out.chunks] == [
        ("rem", 8, 1), ("local", 0, 4)]
    h.run()
    assert len(remote.output_token_ids) == 3 and remote.output_token_ids[0] == 44


def test_remote_kv_first_token_can_finish_the_request():
    h = make()
    remote = Request("rem", [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=0.0)
    assert h.sched.add_remote_request(remote)
    upd = h.sched.finish_remote_kv("rem", 9)
    assert upd.request.status is RequestStatus.FINISHED_LENGTH
    assert not h.sched.has_unfinished
    h.assert_all_free()


def test_remote_request_rejected_when_pool_too_small():
    h = make(num_blocks=2, block_size=4)
    req = Request("big", list(range(12)), SamplingParams(max_tokens=2), arrival_time=0.0)
    assert not h.sched.add_remote_request(req)
    assert "big" not in h.sched.requests and not h.bm.has_request("big")
    h.assert_all_free()


# ---- stop conditions ----------------------------------------------------------------------
def _always(tok: int):
    return lambda chunk: tok


def test_eos_stops_unless_ignore_eos():
    h = make()
    a = h.add("a", 4, max_tokens=5)
    b = h.add("b", 4, max_tokens=5, ignore_eos=True)
    h.run(token_fn=_always(EOS))
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids == [EOS]
    assert a.stop_reason == EOS and a.status.finish_reason == "stop"
    assert b.status is RequestStatus.FINISHED_LENGTH and len(b.output_token_ids) == 5


def test_min_tokens_suppresses_stop_until_reached():
    h = make()
    a = h.add("a", 4, max_tokens=10, min_tokens=3)
    b = h.add("b", 4, max_tokens=10, min_tokens=3, stop_token_ids=[77])
    h.run(token_fn=lambda c: EOS if c.request_id == "a" else 77)
    assert a.output_token_ids == [EOS] * 3 and a.status is RequestStatus.FINISHED_STOPPED
    assert b.output_token_ids == [77] * 3 and b.status is RequestStatus.FINISHED_STOPPED


def test_stop_token_ids_stop_even_with_ignore_eos():
    h = make()
    a = h.add("a", 4, max_tokens=10, ignore_eos=True, stop_token_ids=[77])
    h.run(token_fn=lambda c: 77 if c.num_output_tokens == 2 else 50)
    assert a.output_token_ids == [50, 50, 77]
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason == 77


def test_max_model_len_ends_the_request():
    h = make(max_model_len=12)
    a = h.add("a", 10, max_tokens=50)
    h.run()
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_tokens == 12


# ---- intake errors --------------------------------------------------------------------------
def test_queue_full_past_max_waiting():
    h = make(max_waiting=2)
    h.add("a")
    h.add("b")
    with pytest.raises(QueueFullError):
        h.add("c")
    assert "c" not in h.sched.requests
    h.run()


def test_duplicate_request_id_rejected():
    h = make()
    h.add("a")
    with pytest.raises(ValueError, match="duplicate"):
        h.add("a")
    with pytest.raises(ValueError, match="duplicate"):
        h.sched.add_remote_request(Request("a", [1], SamplingParams(), arrival_time=0.0))
    h.run()


# ---- slot utilization -----------------------------------------------------------------------
def _utilization(h: Harness) -> float:
    """Useful token-steps / (slots x steps), where each sampled chunk is one produced token."""
    useful = sum(1 for out in h.steps for c in out.chunks if c.sample)
    return useful / (h.sched.config.max_num_seqs * len(h.steps))


def test_static_batching_wastes_slots_on_mixed_lengths():
    h = make(max_num_seqs=3, block_size=16, policy="static")
    for rid, n in (("a", 10), ("b", 50), ("c", 1000)):
        h.add(rid, 1, max_tokens=n, ignore_eos=True)
    h.run()
    assert len(h.steps) == 1000
    assert _utilization(h) == pytest.approx(1060 / 3000)


def test_continuous_batching_keeps_slots_busy():
    h = make(max_num_seqs=3, block_size=16, num_blocks=512)
    for rid, n in (("a", 10), ("b", 50), ("c", 1000)):
        h.add(rid, 1, max_tokens=n, ignore_eos=True)
    for i in range(40):  # enough queued work to keep the other two slots full
        h.add(f"x{i}", 1, max_tokens=50, ignore_eos=True)
    h.run()
    assert _utilization(h) >= 0.9
