"""Which router gets each request's token updates, and the per-router queues ``subscribe``
drains. Several routers may front one decode worker at once (active-active); each request is
owned by the router that reserved or submitted it, and only that router receives its tokens.

A router that stops reporting for ``router_silent_s`` (it died) loses its requests to the
live router seen most recently: each one's whole record (every token generated so far, from
its stream position) is queued for the adopter, then its later updates go there too. The
adopter keeps the request's stream log going, so the dead router's clients resume on it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from worker_protocol import RequestTokens, TokenBatch, TokenUpdate

__all__ = ["TokenDelivery"]


@dataclass
class _Subscriber:
    batches: deque[TokenBatch] = field(default_factory=deque)
    generation: int = 0  # the live subscribe() call's number (a new call takes over)
    seen_at: float = 0.0  # monotonic: its last load report or subscription


class TokenDelivery:
    def __init__(self, worker_id: str, router_silent_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_id = worker_id
        self.router_silent_s = router_silent_s
        self._clock = clock
        self._cond = threading.Condition()
        self._subs: dict[str, _Subscriber] = {}
        self._owner: dict[str, str] = {}  # request id -> router id
        self._stopped = False

    def own(self, request_id: str, router_id: str) -> None:
        """``router_id`` receives ``request_id``'s updates from now on."""
        with self._cond:
            self._owner[request_id] = router_id

    def seen(self, router_id: str) -> None:
        """The router is alive (its load report arrived)."""
        with self._cond:
            self._sub(router_id).seen_at = self._clock()

    def forget(self, request_id: str) -> None:
        with self._cond:
            self._owner.pop(request_id, None)

    def publish(self, updates: list[TokenUpdate], step_time: float) -> None:
        """One engine step's updates: one batch per owning router."""
        by_router: dict[str, list[TokenUpdate]] = {}
        with self._cond:
            for u in updates:
                by_router.setdefault(self._owner.get(u.request_id, ""), []).append(u)
            for router_id, ups in by_router.items():
                self._sub(router_id).batches.append(TokenBatch(self.worker_id, ups, step_time))
            self._cond.notify_all()

    def subscribe(self, router_id: str) -> Iterator[TokenBatch]:
        """``router_id``'s batches as they come; a newer call for the same router takes
        over (the older generator ends), and ``stop`` ends them all."""
        with self._cond:
            sub = self._sub(router_id)
            sub.generation += 1
            mine = sub.generation
            sub.seen_at = self._clock()
            self._cond.notify_all()  # wake the old generator so it ends now
        while True:
            with self._cond:
                self._cond.wait_for(lambda: sub.batches or self._stopped
                                    or sub.generation != mine, timeout=0.5)
                if self._stopped or sub.generation != mine or self._subs.get(router_id) is not sub:
                    return
                if not sub.batches:
                    continue
                batch = sub.batches.popleft()
            yield batch

    def reassign_orphans(self, record_of: Callable[[str], RequestTokens | None]) -> list[str]:
        """Hand the requests of routers silent for ``router_silent_s`` to the live router
        seen last (none live: they wait). Returns the request ids moved."""
        moved: list[str] = []
        with self._cond:
            now = self._clock()
            live = [(s.seen_at, rid) for rid, s in self._subs.items()
                    if rid and now - s.seen_at <= self.router_silent_s]
            dead = {rid for rid, s in self._subs.items()
                    if rid and now - s.seen_at > self.router_silent_s}
            if not live or not dead:
                return moved
            adopter = max(live)[1]
            records = []
            for request_id, owner in self._owner.items():
                if owner in dead:
                    self._owner[request_id] = adopter
                    moved.append(request_id)
                    rec = record_of(request_id)
                    if rec is not None:  # everything so far; later updates follow as usual
                        records.append(TokenUpdate(rec.request_id, rec.token_ids,
                                                   rec.finish_reason, None, rec.index))
            for rid in dead:
                del self._subs[rid]  # its queue: covered by the records above
            if records:
                self._sub(adopter).batches.append(TokenBatch(self.worker_id, records, time.time()))
            self._cond.notify_all()
        return moved

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _sub(self, router_id: str) -> _Subscriber:
        sub = self._subs.get(router_id)
        if sub is None:
            sub = self._subs[router_id] = _Subscriber(seen_at=self._clock())
        return sub
