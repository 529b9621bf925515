"""Decode-worker failure detection in about a second, without false alarms.

Load reports cannot tell quickly that a worker stopped: each has a 2 s deadline, and a worker
is declared lost only after ``worker_silent_s`` (5 s) of unanswered reports, so a SIGSTOP'd
(or hung, or cut-off) decode worker froze its streams ~7 s before they moved. Here each live
decode worker is pinged every ``interval_s`` on its control concurrency group (its own
threads: the answer does not wait for an engine step), at most one ping in flight per worker.
Two signals must agree before anything moves:

- no ping answered for ``suspect_after_s``, and
- no token batch from it for as long either, while streams are committed there.

A busy worker still streams tokens (a step is milliseconds to a few hundred), and an idle one
holds no stream, so neither is ever moved; a stopped one fails both and its streams migrate
(``WorkerHealth.silent``: reason ``worker_silent``, the migration counter counts them; with no
fault it stays 0). A worker that answers again is simply reachable again (its late tokens for
moved streams are dropped: ``StreamState.abandoned``). Ray's own word that an actor died
arrives through the token stream (router.control.fanout) and usually first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from router.control.request_state import WorkerSlot
from worker_protocol import control

log = logging.getLogger(__name__)


class Heartbeats:
    """Owned by the orchestrator; ``start`` on its loop once workers are added, ``close``."""

    def __init__(self, slots: Callable[[], Iterable[WorkerSlot]],
                 holds_streams: Callable[[str], bool], last_tokens: Callable[[str], float],
                 on_silent: Callable[[WorkerSlot, str], None], interval_s: float,
                 suspect_after_s: float) -> None:
        """``slots``: the decode slots to watch; ``holds_streams(worker_id)``: streams are
        committed there; ``last_tokens(worker_id)``: monotonic time of its last token batch;
        ``on_silent(slot, why)``: both signals agree it is gone."""
        self._slots = slots
        self._holds_streams = holds_streams
        self._last_tokens = last_tokens
        self._on_silent = on_silent
        self.interval_s = interval_s
        self.suspect_after_s = suspect_after_s
        self._answered: dict[str, float] = {}  # worker id -> monotonic time of its last pong
        self._in_flight: dict[str, asyncio.Future] = {}
        self._reported: set[str] = set()  # declared silent, not answered since
        self._task: asyncio.Task | None = None
        self.num_silent = 0  # workers declared silent (streams moved)

    def start(self) -> None:
        if self._task is None and self.suspect_after_s > 0:
            self._task = asyncio.ensure_future(self._run())

    def forget(self, worker_id: str) -> None:
        """``worker_id`` is a new process (Ray restarted it): its clock starts again."""
        self._answered.pop(worker_id, None)
        self._reported.discard(worker_id)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for fut in self._in_flight.values():
            fut.cancel()

    async def _run(self) -> None:
        while True:
            self.check(time.monotonic())
            await asyncio.sleep(self.interval_s)

    def check(self, now: float) -> None:
        """Ping every watched worker that has no ping in flight; act on the silent ones."""
        for slot in self._slots():
            wid = slot.info.worker_id
            if not slot.view.alive or slot.view.drained:
                self._answered.pop(wid, None)
                continue
            self._answered.setdefault(wid, now)  # a new worker starts its clock now
            if wid not in self._in_flight:
                self._ping(slot)
            last = max(self._answered[wid], self._last_tokens(wid))
            if (now - last > self.suspect_after_s and wid not in self._reported
                    and self._holds_streams(wid)):
                self._reported.add(wid)
                self.num_silent += 1
                self._on_silent(slot, f"decode worker {wid} silent for {now - last:.1f} s: no "
                                      f"heartbeat answered and no tokens")

    def _ping(self, slot: WorkerSlot) -> None:
        wid = slot.info.worker_id
        fut = asyncio.ensure_future(control(slot.handle.ping).remote())
        self._in_flight[wid] = fut

        def done(f: asyncio.Future) -> None:
            self._in_flight.pop(wid, None)
            if not f.cancelled() and f.exception() is None:
                self._answered[wid] = time.monotonic()
                if wid in self._reported:
                    log.warning("decode worker %s answers again", wid)
                    self._reported.discard(wid)

        fut.add_done_callback(done)
