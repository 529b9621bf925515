"""SLO-aware admission: a request that says how long it will wait (``GenerateInput.deadline_s``:
the gRPC deadline, HTTP's ``x-request-timeout``) and whose first token is predicted to come
later is refused at once (``DeadlineRefusedError``: 429 + ``Retry-After`` /
RESOURCE_EXHAUSTED carrying the predicted wait), instead of timing out after holding a place.

The prediction, from live state only: the prompt's wait and compute on the prefill worker
(colocated: the worker) that would take it soonest, i.e. the prompt tokens queued there (the
share of them of requests at its priority or higher: the rest wait behind it) plus its own not
already cached, at that worker's measured prefill rate (``PrefixPulls.prefill_rate``); plus,
when no decode worker has room for it now, the wait for room the router last measured
(``WorkerChooser.room_wait_s``), scaled the same way. It leaves out the KV transfer and the
decode worker's commit (milliseconds: docs/benchmarks.md, Overload). The waiting part (queue
and room) is what it misjudges under load: a queue of prompts drains at the batched rate of a
worker that shares its core, not one prompt's, and a lower priority's queue drains slower
still, as higher-priority requests arriving meanwhile go first: its queue drains at the share
of the workers' output the higher priorities leave it (``Outcomes.higher_share``: the share
of the first tokens of the last ``RECENT_S`` that went to higher priorities), at least
``MIN_RATE_SHARE`` (a higher class that takes every first token leaves a lower one's queue
ten times its plain wait: refused, not admitted to miss its deadline). A share of what came
out, not of what was admitted nor a rate: admitted low requests may sit starved in the queue,
and the measured rate is one prompt's, not a worker's batched throughput. And the waiting part
is scaled
by ``Calibration``, one per priority: how long recent admitted requests of that priority
really waited against what was predicted for them (their first token less their compute),
learnt from the router's own first tokens; and at least by
how late the requests still waiting for theirs (at its priority or higher) already are
(``live_scale``): first tokens that never come (a request ended by its deadline first) teach
the calibration nothing, so the requests running late now are read as they wait."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.config import cdiv
from engine.contract import MAX_PRIORITY
from router.contract import DeadlineRefusedError


@dataclass(frozen=True)
class Prediction:
    queue_s: float  # prompt tokens queued ahead on the soonest worker, at its rate
    compute_s: float  # its own uncached prompt tokens there
    room_s: float  # waiting for decode room (0: a decode worker has room now)
    scale: float = 1.0  # Calibration.factor when made: applies to queue_s + room_s
    made_at: float = 0.0  # time.monotonic() when made (live_scale reads how late it runs)

    @property
    def wait_s(self) -> float:
        """The predicted wait before its prompt is computed, calibrated."""
        return self.scale * (self.queue_s + self.room_s)

    @property
    def first_token_s(self) -> float:
        return self.wait_s + self.compute_s


# Calibration's knobs. Waits predicted under 50 ms say nothing about a queue's error (the
# transfer and network dominate them); one observation moves the factor by a fifth of the
# way (about the last ten count); the factor stays within [0.5, 4] so that one freak first
# token can neither open the door to everything nor shut it (both seen: docs/benchmarks.md,
# Overload).
MIN_WAIT_S, ALPHA, MIN_FACTOR, MAX_FACTOR = 0.05, 0.2, 0.5, 4.0
# The first tokens of the last RECENT_S seconds say how much of the workers higher priorities
# take; a lower priority's queue keeps at least MIN_RATE_SHARE of them.
RECENT_S, MIN_RATE_SHARE = 10.0, 0.1


def live_scale(factor: float, pending, priority: int, now: float) -> float:
    """``factor``, or more when requests still waiting for their first token (``pending``:
    StreamStates with their ``predicted``) of engine ``priority`` or higher are already later
    than predicted: the largest ``(age - compute) / predicted wait`` among those past their
    prediction whose predicted wait was at least ``MIN_WAIT_S``, within ``MAX_FACTOR``."""
    scale = factor
    for s in pending:
        p = s.predicted
        if p is None or s.priority < priority or p.queue_s + p.room_s < MIN_WAIT_S:
            continue
        age = now - p.made_at
        if age > p.first_token_s:
            scale = max(scale, min(MAX_FACTOR, (age - p.compute_s) / (p.queue_s + p.room_s)))
    return scale


@dataclass
class Calibration:
    """The factor by which predicted waits (queue + room) came out: an exponentially weighted
    mean of ``(first token - compute) / predicted wait`` over admitted requests whose
    predicted wait was at least ``MIN_WAIT_S``. Only admitted requests are seen (a refused
    one has no first token, and one ended by its deadline before it has none either), so the
    factor learns from the requests the door let in."""

    factor: float = 1.0
    observed: int = 0

    def observe(self, p: Prediction, first_token_s: float) -> None:
        """One admitted request's first token ``first_token_s`` after admission against its
        prediction ``p`` (its raw wait: the factor it was made with is divided out)."""
        wait = p.queue_s + p.room_s
        if wait < MIN_WAIT_S:
            return
        ratio = min(MAX_FACTOR, max(MIN_FACTOR, (first_token_s - p.compute_s) / wait))
        self.factor += ALPHA * (ratio - self.factor)
        self.observed += 1


def predict(orch, prompt_ids: list[int], max_tokens: int, lora=None,
            priority: int = 0) -> Prediction | None:
    """The first-token prediction for a new request of engine ``priority`` (higher first) on
    ``orch``'s workers (None: no live worker to predict on; the request's own routing answers
    that). Queues and the wait for room are scaled by the share of the requests not yet
    decoding whose priority is as high or higher: the others wait behind it."""
    colocated = orch.config.mode == "colocated"
    slots = [s for s in (orch.decode if colocated else orch.prefill).values() if s.view.alive]
    if not slots:
        return None
    root = lora.key if lora is not None else 0
    held = orch.kv_index.match_detail(prompt_ids, [s.info.worker_id for s in slots], root)
    now = time.monotonic()
    # the share of the workers higher priorities' recent admissions leave its queue
    left = max(MIN_RATE_SHARE, 1.0 - orch.outcomes.higher_share(priority, now))
    best = None
    for s in slots:
        rate = orch.pulls.prefill_rate(s.info.worker_id)
        cached = held[s.info.worker_id].blocks * s.view.block_size \
            if s.info.worker_id in held else 0
        queued = s.view.inflight_prefill_tokens
        if colocated:  # prompts waiting there, each counted as long as this one
            queued += (s.view.requests_waiting + s.view.inflight_requests) * len(prompt_ids)
        p = (queued / (rate * left), max(1, len(prompt_ids) - cached) / rate)
        if best is None or sum(p) < sum(best):
            best = p
    streams = orch.fanout.pending()
    pending = [s.priority for s in streams]
    ahead = (sum(p >= priority for p in pending) / len(pending)) if pending else 1.0
    best = (best[0] * ahead, best[1])
    decode = [s for s in orch.decode.values() if s.view.alive]
    room = any(s.view.free_blocks >= cdiv(len(prompt_ids) + max_tokens, s.view.block_size)
               for s in decode)
    return Prediction(best[0], best[1], 0.0 if room else orch.choose.room_wait_s * ahead,
                      live_scale(orch.outcomes.calibration_for(priority).factor, streams,
                                 priority, now), now)


def admit(orch, prompt_ids: list[int], max_tokens: int, lora, deadline_s: float | None,
          priority: int = 0) -> Prediction | None:
    """The request's prediction (None: no live worker); raises DeadlineRefusedError when its
    first token is predicted after ``deadline_s`` (None: no deadline). Call it last, once the
    request is valid: an admitted request counts toward its adapter's requests."""
    p = predict(orch, prompt_ids, max_tokens, lora, priority)
    if p is not None and deadline_s is not None and p.first_token_s > deadline_s:
        raise DeadlineRefusedError(
            f"the first token is predicted in {p.first_token_s:.2f} s (queue {p.queue_s:.2f} s "
            f"and decode room {p.room_s:.2f} s, scaled by {p.scale:.2f} as recent waits came "
            f"out; prompt {p.compute_s:.2f} s), after the request's deadline of "
            f"{deadline_s:.2f} s", retry_after_s=p.wait_s)
    orch.adapters.admitted(lora)  # pdcluster_lora_requests_total: admitted requests only
    return p


@dataclass
class Outcomes:
    """What became of admitted requests, for the metrics: each adapter's tokens, and how far
    the first-token predictions were from the first tokens (cumulative sums, seconds; the
    three fields are what the cluster's status carries), and the ``Calibration`` of each
    priority they teach the next predictions of that priority."""

    predictions: int = 0
    abs_error_s: float = 0.0  # sum of |actual - predicted|
    error_s: float = 0.0  # sum of actual - predicted (> 0: the prediction ran short)

    def __post_init__(self) -> None:
        # not fields: the status carries the three sums only. One calibration per engine
        # priority: while higher ones are served first, a lower one waits longer than its
        # queue says, by as much as they arrive meanwhile (docs/benchmarks.md, Overload: one
        # shared factor, learnt mostly from the fast high class, let low requests in that
        # then missed their deadline)
        self.calibrations: dict[int, Calibration] = {}
        # engine priority -> [predictions, sum |error|, sum error] (bench overload, per class)
        self.by_priority: dict[int, list[float]] = {}
        # (when, engine priority) of the first tokens of the last RECENT_S
        self.firsts: deque[tuple[float, int]] = deque()

    def first_token(self, priority: int, now: float) -> None:
        """An admitted request of engine ``priority`` got its first token at ``now``."""
        self.firsts.append((now, priority))
        while self.firsts and now - self.firsts[0][0] > RECENT_S:
            self.firsts.popleft()

    def higher_share(self, priority: int, now: float) -> float:
        """The share of the first tokens of the last ``RECENT_S`` that went to priorities
        above engine ``priority`` (0: none came): what of the workers they take ahead of
        its queue."""
        recent = [p for t, p in self.firsts if now - t <= RECENT_S]
        return sum(p > priority for p in recent) / len(recent) if recent else 0.0

    def calibration_for(self, priority: int) -> Calibration:
        """The calibration of engine ``priority``'s predictions (a new one: factor 1)."""
        return self.calibrations.setdefault(priority, Calibration())

    def note(self, stream, chunk) -> None:
        """One chunk of ``stream`` (a StateStream with ``lora`` and ``predicted``)."""
        if stream.lora is not None:
            stream.lora.tokens += len(chunk.token_ids)
        if stream.predicted is not None and chunk.token_ids and chunk.ttft_s is not None:
            err = chunk.ttft_s - stream.predicted.first_token_s
            self.predictions += 1
            self.abs_error_s += abs(err)
            self.error_s += err
            sums = self.by_priority.setdefault(stream.priority, [0, 0.0, 0.0])
            sums[0] += 1
            sums[1] += abs(err)
            sums[2] += err
            self.calibration_for(stream.priority).observe(stream.predicted, chunk.ttft_s)
            if stream.priority <= MAX_PRIORITY:  # a migrated stream's (above every client's)
                self.first_token(stream.priority, time.monotonic())  # is no class's share
            stream.predicted = None  # its first token only
