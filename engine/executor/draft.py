"""Greedy drafts from a draft model (speculative decoding's ``draft_model`` and ``self_draft``).

The draft model runs in its own ``ModelRunner`` with its own KV pool of as many pages as the
target's, addressed by the *target's* block tables: page i of the draft pool holds the draft's
K/V for the tokens the target holds in its page i. So the draft needs no block manager of its
own, prefix-cache hits and preemption follow the target's, and a verifying step's rejected
drafts leave the draft pool exactly as they leave the target's (slots later steps rewrite).

Per sequence the proposer knows how many leading tokens have the draft's K/V (``_Seq.done``).
Before a step it runs, in one batch, each sequence's missing tokens up to its last one (the
prompt at first: on a decode worker the draft's prompt K/V is recomputed there, not moved, see
docs/speculative-decoding.md; afterwards the token the target added and any draft it accepted
past the draft's own K/V), whose last row gives the first draft, then k - 1 single-row steps
for the others. At most ``CATCH_UP_TOKENS`` missing tokens are computed a step, all sequences
together: a sequence still catching up gets no drafts that step, so a long prompt's draft
prefill is spread over steps instead of stalling the batch's streams.

Every missing token runs as a decode row, in passes of at most ``ROWS_UP_TO`` rows (the
fused decode step's largest bucket): the first pass as full of the oldest missing tokens as
it can be, the last one each sequence's newest tokens, whose last row drafts. A draft's
catch-up as a prompt chunk multiplies fp32 activations against its expanded weights (a
quantized self-draft: 37 tokens ~63-93 ms on the default model), as rows it reads its packed
weights once a pass (~8-24 ms for 24-37 rows, measured); the draft's own arithmetic only
changes which tokens it proposes, never what the target emits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from engine.contract import SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.core.scheduler import ScheduledChunk, SchedulerOutput
from engine.executor.model_runner import ModelRunner

CATCH_UP_TOKENS = 256
_STEADY = 2  # missing tokens after a verified step: the target's own, and one accepted draft
ROWS_UP_TO = 32  # decode rows a catch-up pass runs at most (the fused step's largest bucket)
# Greedy, with the drafted token's log-probability under the draft (its confidence)
_GREEDY = SamplingParams(temperature=0, max_tokens=1 << 30, logprobs=0)
# A draft the draft model gives less probability than this ends its sequence's drafts for the
# step (it is still verified: its pass is paid for). Where the draft hesitates it is seldom
# right, and every draft after it would cost a pass and a verification row for less.
MIN_CONFIDENCE = 0.3


@dataclass
class DraftTimes:
    """A step's drafting: all of it, its drafting passes' (sequences, seconds; the first one
    only where it carried no catch-up), and the catch-up (tokens beyond two a sequence, in
    every pass before the one that samples and in that one's extra rows; seconds: the passes
    before it, and the sampling pass's time pro rata)."""

    seconds: float
    passes: list[tuple[int, float]]
    catch_up_tokens: int
    catch_up_seconds: float


@dataclass
class _Seq:
    done: int  # leading tokens whose draft K/V is written
    preemptions: int  # the request's count when ``done`` was set (a preemption drops its KV)
    proposed_at: int = -1  # num_tokens when drafts were last proposed (-1: none pending)
    proposed: int = 0


class DraftProposer:
    """Drafts for an engine's sequences from ``runner`` (the draft model's runner, its pool
    as many pages as the target's ``blocks``)."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, cost_ratio: float) -> None:
        """``cost_ratio``: the draft's weight bytes over the target's (what a draft pass is
        guessed to cost against a target decode step, until passes are timed)."""
        self.runner = runner
        self.blocks = blocks
        self.cost_ratio = cost_ratio
        self.catch_up_per_step = CATCH_UP_TOKENS
        # the draft model's own linear plan (engine.runtime.draft_build), None where untuned
        self.linear_plan = None
        self._seqs: dict[str, _Seq] = {}
        self._seconds = 0.0  # this step's drafting, every pass
        self._passes: list[tuple[int, float]] = []  # this step's passes: (B, seconds)
        self._catch_up = (0, 0.0)  # this step's catch-up: tokens, seconds (pro rata)
        self._cold = True  # no decode rows have run yet (the first pay one-off costs)
        self.min_confidence = MIN_CONFIDENCE  # 0: always k drafts

    def take_times(self) -> DraftTimes:
        """The last step's drafting times; cleared."""
        out = DraftTimes(self._seconds, self._passes, *self._catch_up)
        self._seconds, self._passes, self._catch_up = 0.0, [], (0, 0.0)
        return out

    def backlog(self, reqs: list[Request]) -> dict[str, int]:
        """Tokens each of ``reqs`` would make the draft compute before its first draft,
        beyond the (at most) two of a step after drafts were verified: its prompt at first,
        one more for each step it decoded without drafts since (the controller's catch-up)."""
        return {r.request_id: max(0, r.num_tokens - self._settle(r).done - _STEADY)
                for r in reqs}

    def propose(self, reqs: list[Request], k: dict[str, int]) -> dict[str, list[int]]:
        """Up to ``k[request_id]`` greedy drafts for each of ``reqs`` (every sequence whose
        next step decodes, each step: what the last step's verification kept is read off
        them). Allocates the target's slots the drafts and their verification need (a
        sequence the pool has no room for gets none)."""
        budget = CATCH_UP_TOKENS
        heads: list[tuple[Request, int, int]] = []  # catch-up before the drafting pass
        tails: list[tuple[Request, int]] = []  # each drafting sequence's first missing token
        want: dict[str, int] = {}
        for req in reqs:
            rid, n, kr = req.request_id, req.num_tokens, k.get(req.request_id, 0)
            seq = self._settle(req)
            if kr <= 0:
                continue
            missing = n - seq.done  # the last token's K/V comes with its row: >= 1
            if missing > budget:  # part of its catch-up this step, its drafts later
                if budget > 0:
                    heads.append((req, seq.done, seq.done + budget))
                    seq.done += budget
                    budget = 0
                continue
            # the target's slots: the drafts' K/V here, then their verification there
            if not self.blocks.allocate_slots(rid, n + kr):
                continue
            tails.append((req, seq.done))
            budget -= missing
            seq.done = n
            want[rid] = kr
        passes = self._passes_of(heads, tails)
        if not passes:
            return {}
        drafts: dict[str, list[int]] = {rid: [] for rid in want}
        t0 = time.perf_counter()
        for chunks in passes[:-1]:
            self.runner.execute(SchedulerOutput(chunks))
        t_last = time.perf_counter()
        out = self.runner.execute(SchedulerOutput(passes[-1]))
        # the catch-up (tokens beyond the steady ones): every pass before the drafting one,
        # and that one's share pro rata; a drafting pass without it is a draft pass over the
        # sequences that draft (at k = 1 the only one)
        now = time.perf_counter()
        last_tokens = sum(c.num_tokens for c in passes[-1])
        last_extra = max(0, last_tokens - _STEADY * len(tails))
        extra = sum(c.num_tokens for p in passes[:-1] for c in p) + last_extra
        self._catch_up = ((extra, t_last - t0 + (now - t_last) * last_extra / last_tokens)
                          if extra else (0, 0.0))
        if want and not extra:
            self._passes.append((len(want), now - t_last))
        live = [r for r in reqs if r.request_id in want]
        floor = math.log(self.min_confidence) if self.min_confidence > 0 else -math.inf
        for _ in range(max(want.values(), default=0)):
            for rid in list(drafts):
                if rid in out.sampled_token_ids:
                    drafts[rid].append(out.sampled_token_ids[rid])
                    lp = out.logprobs.get(rid)
                    if lp is not None and lp.logprob < floor:  # hesitant: its last draft
                        want[rid] = len(drafts[rid])
            live = [r for r in live if len(drafts[r.request_id]) < want[r.request_id]]
            if not live:
                break
            # the next draft of each: the last one's K/V written at its position
            step_chunks = []
            for r in live:
                d = drafts[r.request_id]
                pos = r.num_tokens + len(d) - 1
                step_chunks.append(ScheduledChunk(r.request_id, [d[-1]], pos,
                                                  self.blocks.block_ids(r.request_id), True,
                                                  _GREEDY, 0, [], []))
            t1 = time.perf_counter()
            out = self.runner.execute(SchedulerOutput(step_chunks))
            self._passes.append((len(step_chunks), time.perf_counter() - t1))
        self._seconds = time.perf_counter() - t0
        if self._cold:
            # the draft's first decode rows paid one-off costs (0.13 s against ~5 ms on the
            # default model in fp32): their time a catch-up's (an investment), not a pass's
            self._cold = False
            self._passes, self._catch_up = [], (0, self._seconds)
        for r in reqs:
            if r.request_id in want:
                seq = self._seqs[r.request_id]
                seq.proposed_at, seq.proposed = r.num_tokens, len(drafts[r.request_id])
        return drafts

    def _settle(self, req: Request) -> _Seq:
        """The sequence's state after the last step: a preemption dropped every K/V; drafts
        verified since the last proposal left the accepted ones' K/V in place."""
        seq = self._seqs.get(req.request_id)
        if seq is None or seq.preemptions != req.num_preemptions:
            seq = self._seqs[req.request_id] = _Seq(0, req.num_preemptions)
        elif seq.proposed_at >= 0:
            accepted = max(0, req.num_tokens - seq.proposed_at - 1)
            # draft i's K/V (i < proposed) is written; the last draft's never was
            seq.done = min(seq.done + accepted, seq.proposed_at + max(seq.proposed - 1, 0),
                           req.num_tokens - 1)
            seq.proposed_at = -1
        return seq

    def _passes_of(self, heads: list[tuple[Request, int, int]],
                   tails: list[tuple[Request, int]]) -> list[list[ScheduledChunk]]:
        """The step's draft passes, each of at most ``ROWS_UP_TO`` rows (more only where the
        drafting sequences' steady rows alone are more): ``heads`` (a sequence, its first and
        end position) are catch-up only; each of ``tails`` (a sequence, its first missing
        position) ends in the last pass, which samples its first draft. A sequence's tokens
        run in order: a pass holds at most one piece of each, after its earlier pieces."""
        last: list[ScheduledChunk] = []
        room = ROWS_UP_TO - sum(min(_STEADY, r.num_tokens - s) for r, s in tails)
        for req, start in tails:
            end = req.num_tokens
            steady = min(_STEADY, end - start)
            # the newest missing tokens in the drafting pass while it has room
            more = min(end - start - steady, max(room, 0))
            room -= more
            first = end - steady - more
            if first > start:
                heads.append((req, start, first))
            last.append(self._chunk(req, first, end, sample=True))
        passes: list[list[ScheduledChunk]] = []
        fill = ROWS_UP_TO
        for req, start, end in heads:  # packed in order: a long one across passes
            while start < end:
                if fill == ROWS_UP_TO:
                    passes.append([])
                    fill = 0
                piece = min(end - start, ROWS_UP_TO - fill)
                passes[-1].append(self._chunk(req, start, start + piece, sample=False))
                start += piece
                fill += piece
        if last:
            passes.append(last)
        return passes

    def _chunk(self, req: Request, start: int, end: int, sample: bool) -> ScheduledChunk:
        # decode rows, through the fused decode step (the module docstring)
        return ScheduledChunk(req.request_id, req.token_slice(start, end), start,
                              self.blocks.block_ids(req.request_id), sample, _GREEDY, 0, [], [],
                              as_rows=True)

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
