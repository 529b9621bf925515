"""Cluster-wide prefix reuse, the router's side: before a prefill worker computes a prompt (or a
decode worker rebuilds a migrated stream: ``Orchestrator._migrate``), pull the prefix it lacks
from another worker (prefill or decode) that holds more of it, when moving it is estimated to
cost less than computing it.

The decision (``PrefixPulls.plan``), per request, from the KV index and two measured rates:

- what the chosen prefill worker holds (``KVIndex.held_tokens``: any tier) and which other
  live worker holds the longest run (ties: an idle prefill worker, then a decode worker, whose
  read stalls its batch for one short engine call, then a busy prefill worker); the pull
  takes positions ``[held by the puller, end)``, ``end`` the source's run cut to the puller's
  whole blocks (only those can be cached there), at least one block;
- estimated recompute = those tokens / the puller's prefill rate (from its own
  ``PrefillResult.compute_s``, an EWMA; 1,000 tokens/s until measured);
- estimated transfer = their KV bytes / the effective pull bandwidth (every completed pull's
  bytes / its wall time, reserve to commit, Ray calls included; an EWMA starting at 200 MB/s),
  plus, from a prefill worker with prompts in flight, the time to compute those (the source
  reads between its engine steps, so a busy one first ends the step it runs; all of its
  queue is counted, an upper bound).

``auto`` pulls when the transfer is estimated to cost less; ``always`` whenever another
worker holds more; ``off`` never. Under ``auto`` a pull is given 4x the estimated recompute
(at least ``MIN_PULL_TIMEOUT_S``, at most the transfer timeout): a stuck source costs
little. Every decision with its inputs is logged (INFO) and
counted: ``pulled_tokens`` (moved instead of computed) and ``recomputed_tokens`` (held
elsewhere, computed anyway: not worth moving, or the pull failed). A failed pull (the
source died, lost the prefix, a timeout) holds nothing on the puller
(``worker_protocol.prefix_pull``): the request goes on and computes the prefix.
Tensor-parallel workers take no part.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kv_transfer import KVLayout
from router.control.request_state import WorkerSlot, cause_of
from router.control.request_trace import phase
from router.control.worker_health import WorkerHealth
from router.routing.kv_index import KVIndex
from worker_protocol.prefix_pull import PullRequest, PullResult

log = logging.getLogger(__name__)

_EWMA = 0.3  # weight of the newest measurement
PRIOR_PREFILL_TOKENS_S = 1_000.0
PRIOR_PULL_BYTES_S = 200e6
MIN_PULL_TIMEOUT_S = 2.0  # the least a pull is given (a first pull opens its pair)


@dataclass(frozen=True)
class PullPlan:
    """Pull ``[have, end)`` of the prompt from ``source`` (``pull``: False when estimated not
    worth it: the tokens are computed)."""

    source: WorkerSlot
    have: int
    end: int
    est_transfer_s: float
    est_recompute_s: float
    pull: bool

    @property
    def tokens(self) -> int:
        return self.end - self.have


@dataclass(frozen=True)
class PullOutcome:
    """What happened, for the request's journal."""

    kind: str  # "pulled" | "recomputed"
    source_id: str
    detail: str


@dataclass
class PrefixPulls:
    """Owned by the orchestrator (its event loop); see the module docstring."""

    index: KVIndex
    layout: KVLayout
    mode: str = "auto"
    timeout_s: float = 10.0
    pulled_tokens: int = 0
    recomputed_tokens: int = 0
    failed_pulls: int = 0
    pull_bytes_s: float = PRIOR_PULL_BYTES_S
    _prefill_tokens_s: dict[str, float] = field(default_factory=dict)
    _num_pulls: int = 0
    # Told of every pull that moved KV: (role pair "decode->prefill", seconds).
    on_transfer: Callable[[str, float], None] | None = None
    # Ends a pull's wait at once when its source or puller is declared lost meanwhile.
    health: WorkerHealth | None = None

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    def note_prefill(self, worker_id: str, computed_tokens: int, compute_s: float) -> None:
        """A prefill worker's measured rate (its ``PrefillResult``)."""
        if computed_tokens < 16 or compute_s <= 0:
            return  # too short to say anything about the rate
        rate = computed_tokens / compute_s
        old = self._prefill_tokens_s.get(worker_id)
        self._prefill_tokens_s[worker_id] = rate if old is None else old + _EWMA * (rate - old)

    def measured_prefill_rate(self, worker_id: str) -> float | None:
        """``worker_id``'s measured prompt tokens per second, or None before one."""
        return self._prefill_tokens_s.get(worker_id)

    def prefill_rate(self, worker_id: str) -> float:
        """Prompt tokens per second ``worker_id`` computes, as measured (a prior until it
        ran a prompt of 16 tokens or more)."""
        return self._prefill_tokens_s.get(worker_id, PRIOR_PREFILL_TOKENS_S)

    def plan(self, prompt_ids: list[int], puller: WorkerSlot,
             candidates: list[WorkerSlot]) -> PullPlan | None:
        """The pull worth considering for this prompt on ``puller``, or None (nobody holds
        more of it than the puller, by at least one of the puller's blocks)."""
        if self.mode == "off" or puller.info.tp_size != 1:
            return None
        others = [s for s in candidates if s.info.worker_id != puller.info.worker_id
                  and s.view.alive and s.view.reachable and not s.view.draining
                  and s.info.tp_size == 1]
        held = self.index.held_tokens(prompt_ids,
                                      [puller.info.worker_id] + [s.info.worker_id for s in others])
        have = held.get(puller.info.worker_id, 0)
        # Ties: an idle prefill worker, then a decode worker (its read stalls one step for
        # milliseconds), then a busy prefill worker (the read waits for its step to end).
        best = max(others, default=None, key=lambda s: (
            held.get(s.info.worker_id, 0),
            s.info.role == "prefill" and not s.view.inflight_prefill_tokens,
            s.info.role != "prefill"))
        bs = puller.view.block_size
        if best is None:
            return None
        end = min(held.get(best.info.worker_id, 0), len(prompt_ids) - 1) // bs * bs
        if end - have < bs:
            return None
        tokens = end - have
        # A source reads the prefix between its engine steps: a prefill worker with prompts
        # in flight ends its running step first, counted as all of them (an upper bound).
        wait = (best.view.inflight_prefill_tokens / self.prefill_rate(best.info.worker_id)
                if best.info.role == "prefill" else 0.0)
        est_transfer = tokens * self.bytes_per_token / self.pull_bytes_s + wait
        est_recompute = tokens / self._prefill_tokens_s.get(puller.info.worker_id,
                                                            PRIOR_PREFILL_TOKENS_S)
        pull = self.mode == "always" or est_transfer < est_recompute
        return PullPlan(best, have, end, est_transfer, est_recompute, pull)

    async def before_prefill(self, request_id: str, prompt_ids: list[int], puller: WorkerSlot,
                             candidates: list[WorkerSlot], journal=None, trace=None
                             ) -> PullOutcome | None:
        """Plan, and pull when worth it; the outcome goes to ``journal(request_id, kind,
        source_id, detail)`` too. Never raises for a failed pull (the prefill computes what is
        missing); None when there was nothing to decide. ``trace`` (a RequestTrace, given only
        where no other phase of the request is open): a pull gets a ``pull`` phase of its own."""
        plan = self.plan(prompt_ids, puller, candidates)
        if plan is None:
            return None
        if trace is not None and plan.pull:
            with phase(trace, "pull", {"pdcluster.worker_id": puller.info.worker_id}):
                out = await self._decide(request_id, prompt_ids, puller, plan)
        else:
            out = await self._decide(request_id, prompt_ids, puller, plan)
        if journal is not None:
            journal(request_id, out.kind, out.source_id, out.detail)
        return out

    async def _decide(self, request_id: str, prompt_ids: list[int], puller: WorkerSlot,
                      plan: PullPlan) -> PullOutcome:
        src = plan.source.info.worker_id
        inputs = (f"{plan.tokens} tokens [{plan.have}, {plan.end}) from {src}: transfer est "
                  f"{plan.est_transfer_s * 1e3:.1f} ms vs recompute est "
                  f"{plan.est_recompute_s * 1e3:.1f} ms")
        if not plan.pull:
            self.recomputed_tokens += plan.tokens
            log.info("request %s: prefix recomputed on %s (%s)", request_id,
                     puller.info.worker_id, inputs)
            return PullOutcome("recomputed", src, inputs)
        # A pull that takes longer than a few recomputes has lost its point (a stuck source):
        # it gives up and the prefill computes, well within the decode worker's lease.
        timeout_s = (self.timeout_s if self.mode == "always"  # estimates ignored
                     else min(self.timeout_s, max(MIN_PULL_TIMEOUT_S, 4 * plan.est_recompute_s)))
        # Its own id per pull: a retried attempt's pull never meets an earlier one still
        # running on the same worker.
        self._num_pulls += 1
        req = PullRequest(f"{request_id}/pull-{self._num_pulls}", list(prompt_ids), plan.end,
                          src, plan.source.handle, timeout_s)
        try:
            # Not wait_for (see WorkerCalls.call).
            async with asyncio.timeout(timeout_s + 5.0) as deadline:
                health = self.health
                watched = [] if health is None else [src, puller.info.worker_id]
                for wid in watched:
                    health.watch(wid, deadline)
                try:
                    res: PullResult = await puller.handle.pull_prefix.remote(req)
                finally:
                    for wid in watched:
                        health.unwatch(wid, deadline)
        except Exception as e:  # the puller failed or timed out: the prefill call will tell
            e = cause_of(e)
            res = PullResult(0, plan.have, 0, timeout_s, f"{type(e).__name__}: {e}"[:300])
        if res.error:
            self.failed_pulls += 1
            self.recomputed_tokens += plan.tokens
            log.warning("request %s: prefix pull to %s failed, recomputing (%s): %s",
                        request_id, puller.info.worker_id, inputs, res.error)
            return PullOutcome("recomputed", src, f"{inputs}; pull failed: {res.error}")
        self.pulled_tokens += res.pulled_tokens
        recomputed = max(0, plan.tokens - res.pulled_tokens - (res.cached_tokens - plan.have))
        self.recomputed_tokens += recomputed
        if res.kv_bytes and res.seconds > 0:
            measured = res.kv_bytes / res.seconds
            self.pull_bytes_s += _EWMA * (measured - self.pull_bytes_s)
            if self.on_transfer is not None:
                self.on_transfer(f"{plan.source.info.role}->{puller.info.role}", res.seconds)
        log.info("request %s: prefix pulled to %s (%s): %d tokens, %.1f MB in %.1f ms",
                 request_id, puller.info.worker_id, inputs, res.pulled_tokens,
                 res.kv_bytes / 1e6, res.seconds * 1e3)
        return PullOutcome("pulled", src, f"{inputs}; moved {res.pulled_tokens} tokens in "
                                          f"{res.seconds * 1e3:.1f} ms")
