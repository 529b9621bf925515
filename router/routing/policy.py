"""Choosing workers: by cached prefix, queued work and KV use (``kv_aware``), by load alone,
or in turns (``RoutingConfig``).

Pure choices over snapshots, so they are unit-testable. The router keeps its own
in-flight counters on top of the workers' periodic load reports, because a report is up to
one refresh interval stale and a burst of requests would otherwise all pick the same worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.config import cdiv
from worker_protocol import WorkerLoad


@dataclass
class WorkerView:
    """The router's picture of one worker: its last load report plus exact router-side
    counters of what was routed to it since."""

    worker_id: str
    role: str
    kv_blocks_total: int
    block_size: int
    load: WorkerLoad | None = None  # the last report (None until the first one)
    alive: bool = True  # False once Ray reports the actor dead: never routed to again
    # Alive for Ray, but its last call or load report ran past its deadline (a host whose
    # link is down): skipped until a report arrives again.
    reachable: bool = True
    unreachable_since: float | None = None  # monotonic s, while not reachable
    # A peer could not reach its advertised KV address: skipped until then (monotonic s).
    kv_unreachable_until: float = 0.0
    inflight_blocks: int = 0
    inflight_prefill_tokens: int = 0
    # Blocks its prefix cache holds in its KV pool (on device, not in a second tier: those
    # take no pool room), per the router's KV index (running requests' included).
    cached_blocks: int = 0
    inflight_requests: int = 0
    restarts: int = 0  # times Ray restarted the worker and it rejoined
    # An operator drains it (router/control/drain.py): no new work; what it holds finishes
    # or migrates, then it is retired (``alive`` False, ``drained`` True).
    draining: bool = False
    drained: bool = False

    @property
    def kv_blocks_used(self) -> int:
        return self.load.kv_blocks_used if self.load else 0

    @property
    def requests_running(self) -> int:
        return self.load.requests_running if self.load else 0

    @property
    def requests_waiting(self) -> int:
        return self.load.requests_waiting if self.load else 0

    @property
    def occupied_blocks(self) -> int:
        """Blocks in use or promised: the last report's, with its reservations replaced by
        the router's own in-flight count when that is larger (a reservation is in both from
        the worker's reserve until its commit; counting it twice would turn away work)."""
        reserved = self.load.kv_blocks_reserved if self.load else 0
        return self.kv_blocks_used - reserved + max(reserved, self.inflight_blocks)

    @property
    def free_blocks(self) -> int:
        return self.kv_blocks_total - self.occupied_blocks

    def routable(self, now: float) -> bool:
        """May new work be sent here?"""
        return (self.alive and self.reachable and not self.draining
                and now >= self.kv_unreachable_until)


PREFIX_PULL_MODES = ("auto", "always", "off")
ROUTING_POLICIES = ("kv_aware", "load", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    """How the router chooses workers (``pdcluster serve --routing ...``).

    ``kv_aware`` (default) picks the worker with the lowest cost, in prompt tokens of work:
    ``prefix_weight`` x the prompt tokens it does NOT cache (what it must compute, or for a
    decode worker receive; a cached block it must first restore from host memory or disk
    counts for the part of a block's compute that restore costs, ``hits`` being weighted by
    tier, ``router.routing.kv_index.TIER_BLOCK_WEIGHTS``) + ``queue_weight`` x the uncached
    prompt tokens queued there ahead of this one (prefill and colocated workers: a
    disaggregated decode worker admits arrivals at once, nothing queues; a prefill worker's
    queued tokens that compute blocks this prompt will reuse do not count, ``pick_prefill``)
    + ``kv_usage_weight`` x its KV pool's used fraction (blocks in use with reservations in
    flight, or the blocks its prefix cache holds in the pool, if more) x the prompt length (a
    nearly full pool costs preemptions or evicts cached prefixes). With the default weights
    (1, 1, 1) a worker holding the prefix wins unless the work queued on it exceeds the work
    the prefix saves: a hot prefix spills to a cold worker, which then caches it too. Ties go
    to the least loaded, then take turns.
    ``load`` ignores caches (most free KV, fewest requests; least queued prefill tokens);
    ``round_robin`` takes turns among the workers with room.
    """

    policy: str = "kv_aware"
    prefix_weight: float = 1.0
    queue_weight: float = 1.0
    kv_usage_weight: float = 1.0
    # Cluster-wide reuse (router.control.prefix_pull): a prefill worker lacking a prefix
    # another worker holds pulls it when the estimated transfer beats the estimated
    # recompute ("auto"), whenever another worker holds more of it ("always"), or never.
    prefix_pull: str = "auto"

    def __post_init__(self) -> None:
        if self.prefix_pull not in PREFIX_PULL_MODES:
            raise ValueError(f"prefix pull must be one of {', '.join(PREFIX_PULL_MODES)}, "
                             f"got {self.prefix_pull!r}")
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, "
                             f"got {self.policy!r}")
        for name in ("prefix_weight", "queue_weight", "kv_usage_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


class Routing:
    """Picks workers for one router under one ``RoutingConfig``. ``hits`` maps a worker id
    to how many leading blocks of the prompt its cache holds, each weighted by what it saves
    there (``PrefixMatch.weighted`` of ``router.routing.kv_index``: a plain count when all are
    on device; a block on disk counts less, so of two workers holding one prefix the one
    holding it on device wins)."""

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self._turn = {"prefill": 0, "decode": 0}  # round_robin's next position per kind

    def pick_decode(self, workers: list[WorkerView], prompt_len: int, num_tokens: int,
                    exclude: set[str] = frozenset(), hits: dict[str, float] | None = None
                    ) -> WorkerView | None:
        """A live decode (or colocated) worker with room for ``num_tokens`` (prompt +
        output), or None."""
        now = time.monotonic()
        fits = [w for w in workers if w.routable(now) and w.worker_id not in exclude
                and w.free_blocks >= cdiv(num_tokens, w.block_size)]
        if not fits:
            return None
        if self.config.policy == "round_robin":
            return self._take_turn("decode", fits)
        if self.config.policy == "load":
            return max(fits, key=_decode_headroom)
        hits = hits or {}
        return self._cheapest("decode", fits, lambda w: (
            self.cost(w, prompt_len, hits, _decode_queue(w, prompt_len)),
            _neg(_decode_headroom(w))))

    def pick_prefill(self, workers: list[WorkerView], prompt_len: int,
                     exclude: set[str] = frozenset(), hits: dict[str, float] | None = None,
                     in_flight: dict[str, int] | None = None) -> WorkerView | None:
        """The live prefill worker to compute this prompt, or None. ``in_flight``: of each
        worker's ``hits``, the blocks still being computed there for requests routed before
        (``KVIndex.expect``). Their tokens are not counted as queued ahead of this prompt:
        waiting for them costs it no more than computing them itself would, and it then
        computes only the rest (the second request of a new prefix joins the first)."""
        now = time.monotonic()
        live = [w for w in workers if w.routable(now) and w.worker_id not in exclude]
        if not live:
            return None
        if self.config.policy == "round_robin":
            return self._take_turn("prefill", live)
        if self.config.policy == "load":
            return min(live, key=lambda w: w.inflight_prefill_tokens)
        hits, in_flight = hits or {}, in_flight or {}

        def queued(w: WorkerView) -> int:
            return max(0, w.inflight_prefill_tokens
                       - in_flight.get(w.worker_id, 0) * w.block_size)

        return self._cheapest("prefill", live, lambda w: (
            self.cost(w, prompt_len, hits, queued(w)), w.inflight_prefill_tokens))

    def cost(self, w: WorkerView, prompt_len: int, hits: dict[str, float],
             queued_tokens: int) -> float:
        """``kv_aware``'s cost of sending this prompt to ``w`` (tokens of work; lower wins)."""
        c = self.config
        missing = max(0, prompt_len - hits.get(w.worker_id, 0) * w.block_size)
        # A pool full of cached prefixes is as full for a newcomer as one full of running
        # requests (it would evict them): cold prompts spread the working set evenly, so
        # no worker has to cycle more conversations through its cache than it holds.
        used = max(w.occupied_blocks, w.cached_blocks)
        usage = min(1.0, used / w.kv_blocks_total) if w.kv_blocks_total else 0.0
        return (c.prefix_weight * missing + c.queue_weight * queued_tokens
                + c.kv_usage_weight * usage * prompt_len)

    def _cheapest(self, kind: str, candidates: list[WorkerView], key) -> WorkerView:
        """The lowest ``key``; exact ties (idle workers, cold prompts) take turns, so every
        worker's cache fills, not only the first one's."""
        keys = {w.worker_id: key(w) for w in candidates}
        best = min(keys.values())
        return self._take_turn(kind, [w for w in candidates if keys[w.worker_id] == best])

    def _take_turn(self, kind: str, candidates: list[WorkerView]) -> WorkerView:
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        pick = ordered[self._turn[kind] % len(ordered)]
        self._turn[kind] += 1
        return pick


def _decode_headroom(w: WorkerView) -> tuple[float, int]:
    """Larger is better: the free fraction of the KV pool, then fewer requests."""
    return (w.free_blocks / max(w.kv_blocks_total, 1),
            -(w.requests_running + w.inflight_requests))


def _neg(t: tuple[float, int]) -> tuple[float, int]:
    return (-t[0], -t[1])


def _decode_queue(w: WorkerView, prompt_len: int) -> int:
    """Prompt tokens queued on a decode worker ahead of this one: prompts waiting to be
    prefilled there (colocated; each counted as long as this one, the report carries no
    lengths). A disaggregated decode worker has no such queue: KV in flight to it is
    memory (the usage term), not a wait."""
    if w.role == "colocated":
        return (w.requests_waiting + w.inflight_requests) * prompt_len
    return 0
