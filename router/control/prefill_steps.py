"""What the router sees of each prefill worker's steps, for the admission's first-token
prediction (router/control/admission.py; docs/api.md, Deadlines and admission).

A prefill worker computes its queue in steps: each step takes the waiting prompts of the
highest priority first (up to its ``max_num_seqs``), and a step that has started runs to
its end; a prompt of a higher priority arriving meanwhile waits for that step, then goes
ahead of every lower-priority prompt still queued (engine/core/scheduler.py). So a new
prompt of priority ``p`` waits for

- the rest of the step running now (``residual``): it started when the last step ended
  (the last call came back with a result) or, on an idle worker, when the first prompt was sent; it
  lasts about as long as the last steps of its priority did (the results' ``compute_s``);
- the prompt tokens of priority ``p`` or higher sent there before it and not in that step,
  at the worker's batched rate (``drain_rate``: prompt tokens its results returned per
  second while it was busy, not one prompt's rate: a step computes several);
- its own step: as long as the last steps of prompts of its priority took (a step of
  high-priority prompts holds none of a lower one, so it is shorter than a full step).

Only the router's own prefills are seen (embeddings' prompts, which also run there, are
not). All times are the router's ``time.monotonic()`` (``now``, given in tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Each result moves a step time (and its spread) by a fifth of the way; the rate's sums decay
# by this much a result (about the last 20 results count). A step is predicted to last its
# mean plus SPREAD times its mean absolute deviation (about its 95th percentile): a deadline
# is missed by the steps that run long, and a host's other load makes them vary by half.
STEP_ALPHA, RATE_DECAY, SPREAD = 0.2, 0.95, 2.0


@dataclass
class _Prompt:
    priority: int
    tokens: int
    sent_at: float
    ended_at: float | None = None  # its call ended (then no longer in flight)
    step_from: float | None = None  # when the step it ended in started, as far as seen


@dataclass
class WorkerSteps:
    """One prefill worker: its prompts in flight and what its results said."""

    prompts: dict[str, _Prompt] = field(default_factory=dict)
    busy_since: float | None = None  # when it last went from idle to a prompt in flight
    last_end: float | None = None  # when the last call with a result ended
    step_s: float | None = None  # any step (EWMA of results' compute_s)
    step_by_priority: dict[int, float] = field(default_factory=dict)
    # EWMA of |compute_s - the mean before it|: any step's, and by priority
    spread_s: float = 0.0
    spread_by_priority: dict[int, float] = field(default_factory=dict)
    tokens: float = 0.0  # decayed sums: prompt tokens returned, and busy seconds
    busy_s: float = 0.0

    @property
    def inflight(self) -> dict[str, _Prompt]:
        return {rid: p for rid, p in self.prompts.items() if p.ended_at is None}

    @property
    def drain_rate(self) -> float | None:
        """Prompt tokens per second the worker returned while busy (None: no result yet)."""
        return self.tokens / self.busy_s if self.busy_s > 0 and self.tokens > 0 else None

    def step(self, priority: int | None) -> float:
        """How long a step of ``priority`` prompts is predicted to last (None, or none of
        them measured yet: any step): its mean plus ``SPREAD`` times its spread."""
        if priority in self.step_by_priority:
            return self.step_by_priority[priority] + SPREAD * self.spread_by_priority.get(
                priority, 0.0)
        return self.step_s + SPREAD * self.spread_s

    def running_since(self) -> float | None:
        """When the step running now started (None: idle)."""
        if self.busy_since is None:
            return None
        return max(self.busy_since, self.last_end or self.busy_since)


# A prompt whose call ended without a result (a failed attempt) is forgotten this long after.
FORGET_S = 60.0


class PrefillSteps:
    """Per prefill worker id, ``WorkerSteps``. The orchestrator calls ``sent`` when it sends
    a prompt, ``ended`` when that call ends however, and ``prefilled`` with its result."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerSteps] = {}

    def sent(self, worker_id: str, request_id: str, priority: int, tokens: int,
             now: float | None = None) -> None:
        """A prompt of ``tokens`` to compute (engine ``priority``: higher first) was sent to
        ``worker_id`` (``now``: time.monotonic() unless given)."""
        now = time.monotonic() if now is None else now
        w = self.workers.setdefault(worker_id, WorkerSteps())
        for rid in [r for r, p in w.prompts.items()
                    if p.ended_at is not None and p.ended_at < now - FORGET_S]:
            del w.prompts[rid]
        if w.busy_since is None:
            w.busy_since = now
        w.prompts[request_id] = _Prompt(priority, tokens, now)

    def ended(self, worker_id: str, request_id: str, now: float | None = None) -> None:
        """The prompt's prefill call ended (a result, an error, a cancellation)."""
        now = time.monotonic() if now is None else now
        w = self.workers.get(worker_id)
        p = w.prompts.get(request_id) if w is not None else None
        if p is None or p.ended_at is not None:
            return
        p.ended_at, p.step_from = now, w.running_since()
        if not w.inflight:
            w.busy_since = None

    def prefilled(self, worker_id: str, request_id: str, tokens: int,
                  compute_s: float) -> None:
        """The ended call's result: ``tokens`` computed, in a step of ``compute_s`` (worker
        clock) that ended when the call did. Call it right after ``ended`` (no await
        between: until then the next step is not known to have begun)."""
        w = self.workers.get(worker_id)
        p = w.prompts.pop(request_id, None) if w is not None else None
        if p is None or p.ended_at is None:
            return
        if p.step_from is not None and p.ended_at > p.step_from:  # busy all that time
            w.tokens = RATE_DECAY * w.tokens + tokens
            w.busy_s = RATE_DECAY * w.busy_s + (p.ended_at - p.step_from)
        else:  # a result of the same step as the last one: its tokens, no more time
            w.tokens += tokens
        # A result's call end is its step's end; a failed or aborted call's is not (a
        # request ended by its deadline aborts its prefill at any time).
        w.last_end = max(w.last_end or p.ended_at, p.ended_at)
        if compute_s > 0:
            if w.step_s is not None:
                w.spread_s = _ewma(w.spread_s, abs(compute_s - w.step_s))
            w.step_s = _ewma(w.step_s, compute_s)
            old = w.step_by_priority.get(p.priority)
            if old is not None:
                w.spread_by_priority[p.priority] = _ewma(
                    w.spread_by_priority.get(p.priority, 0.0), abs(compute_s - old))
            w.step_by_priority[p.priority] = _ewma(old, compute_s)

    def predict(self, worker_id: str, priority: int, now: float
                ) -> tuple[float, float] | None:
        """``(wait_s, own_step_s)`` for a new prompt of ``priority`` on ``worker_id`` (module
        docstring), or None before the worker returned a result (nothing measured yet)."""
        w = self.workers.get(worker_id)
        rate = w.drain_rate if w is not None else None
        if w is None or w.step_s is None or rate is None:
            return None
        own = w.step(priority)
        start = w.running_since()
        if start is None:
            return 0.0, own
        # What the running step holds: the prompts sent before it started, highest priority
        # first (the oldest among equals), up to a step's worth of tokens; it lasts as long
        # as the last steps of its (highest) priority did.
        room = rate * w.step_s
        in_step: dict[str, int] = {}
        inflight = w.inflight
        for rid, p in sorted(inflight.items(), key=lambda kv: (-kv[1].priority, kv[1].sent_at)):
            if p.sent_at <= start and room > 0:
                in_step[rid] = p.priority
                room -= p.tokens
        step = w.step(max(in_step.values()) if in_step else None)
        residual = max(0.0, start + step - now)
        ahead = sum(p.tokens for rid, p in inflight.items()
                    if p.priority >= priority and rid not in in_step)
        return residual + ahead / rate, own


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + STEP_ALPHA * (new - old)
