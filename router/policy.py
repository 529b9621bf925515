"""Choosing workers: a decode worker by KV capacity and load, a prefill worker by queued work.

Pure functions over snapshots, so the choices are unit-testable. The router keeps its own
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
    inflight_requests: int = 0
    restarts: int = 0  # times Ray restarted the worker and it rejoined

    @property
    def kv_blocks_used(self) -> int:
        return self.load.kv_blocks_used if self.load else 0

    @property
    def requests_running(self) -> int:
        return self.load.requests_running if self.load else 0

    @property
    def free_blocks(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used - self.inflight_blocks

    def routable(self, now: float) -> bool:
        """May new work be sent here?"""
        return self.alive and self.reachable and now >= self.kv_unreachable_until


def pick_decode(workers: list[WorkerView], num_tokens: int, exclude: set[str] = frozenset(),
                prefix_hits: dict[str, int] | None = None) -> WorkerView | None:
    """The live decode worker with room for ``num_tokens`` and the most headroom.

    Order of preference: the most leading blocks of this prompt already cached there (prefix
    affinity; only colocated workers prefill, so only they report hits), then the largest
    free fraction of the KV pool, then the fewest running and in-flight requests.
    """
    hits = prefix_hits or {}
    now = time.monotonic()
    fits = [w for w in workers if w.routable(now) and w.worker_id not in exclude
            and w.free_blocks >= cdiv(num_tokens, w.block_size)]
    if not fits:
        return None
    return max(fits, key=lambda w: (hits.get(w.worker_id, 0),
                                    w.free_blocks / max(w.kv_blocks_total, 1),
                                    -(w.requests_running + w.inflight_requests)))


def pick_prefill(workers: list[WorkerView], exclude: set[str] = frozenset(),
                 prefix_hits: dict[str, int] | None = None) -> WorkerView | None:
    """The live prefill worker with the least queued prompt work, net of cached prefixes."""
    hits = prefix_hits or {}
    now = time.monotonic()
    live = [w for w in workers if w.routable(now) and w.worker_id not in exclude]
    if not live:
        return None
    # A cached block saves block_size tokens of compute on that worker.
    return min(live, key=lambda w: w.inflight_prefill_tokens - hits.get(w.worker_id, 0) * w.block_size)
