"""Draining a worker: take it out of service without losing a token (scale-down, maintenance).

A drain marks the worker ``draining`` (``WorkerView.routable`` is then False: no new prompt,
reservation, submission, migration or prefix pull goes there) and waits for what it holds:

- a prefill worker: its prefills in flight finish (their KV reaches their decode workers and
  their streams go on there); a prefill is short, so nothing is moved;
- a decode (or colocated) worker: its streams run on; those still running ``migrate_after_s``
  after the start are moved off it the way a lost worker's are (``Orchestrator`` re-prefills
  prompt + the tokens streamed so far on another pair), so each client sees one stream with
  no token missing or repeated, equal to an undisturbed one under greedy or seeded sampling.

Then the worker's own report must say its scheduler is empty (a request of another router
still running there is waited for, at most ``settle_s`` more), and the owner retires it
(``retire``: deregistered, its process shut down). ``WorkerDrains`` is the one owner of every
drain of one router; it runs on the orchestrator's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from router.contract import DrainStatus, InvalidRequestError, WorkerNotFoundError
from router.control.request_state import StreamState, WorkerSlot
from worker_protocol import liveness

log = logging.getLogger(__name__)

DEFAULT_MIGRATE_AFTER_S = 30.0  # a stream still running then moves (re-prefill elsewhere)
DEFAULT_SETTLE_S = 30.0  # then at most this long for the worker's own scheduler to empty
POLL_S = 0.05


class Streams(Protocol):
    """The router's streams by worker (``router.control.fanout.TokenFanout``)."""

    def streams_on(self, worker_id: str) -> list[StreamState]: ...

    def migrate_off(self, worker_id: str, why: str) -> list[str]:
        """Move every stream committed on ``worker_id`` elsewhere; the ids moved."""
        ...


Slots = Callable[[], list[WorkerSlot]]  # every worker the router knows, dead ones included
Retire = Callable[[WorkerSlot], Awaitable[None]]


@dataclass
class _Drain:
    slot: WorkerSlot
    migrate_after_s: float
    started: float
    seen: set[str] = field(default_factory=set)  # streams that ran there during the drain
    migrated: set[str] = field(default_factory=set)
    remaining: int = 0
    ended: float | None = None
    task: asyncio.Task | None = None

    def status(self, now: float) -> DrainStatus:
        finished = len(self.seen - self.migrated) - self.remaining
        return DrainStatus(self.slot.info.worker_id, self.slot.info.role,
                           "drained" if self.ended is not None else "draining",
                           (now if self.ended is None else self.ended) - self.started,
                           self.migrate_after_s,
                           max(finished, 0), len(self.migrated), self.remaining)


class WorkerDrains:
    """Every drain this router started, by worker id (a drained worker's stays, for status)."""

    def __init__(self, slots: Slots, streams: Streams, retire: Retire | None = None,
                 settle_s: float = DEFAULT_SETTLE_S, call_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.streams = streams
        self.retire = retire  # set by the cluster (it owns the processes)
        self.settle_s = settle_s
        self.call_timeout_s = call_timeout_s
        self.clock = clock
        self._drains: dict[str, _Drain] = {}

    def start(self, worker_id: str, migrate_after_s: float | None = None) -> DrainStatus:
        """Begin draining ``worker_id`` (a drain already running or done: its status, the
        first ``migrate_after_s`` kept). Raises WorkerNotFoundError / InvalidRequestError
        (see ``GenerationBackend.drain_worker``)."""
        drain = self._drains.get(worker_id)
        if drain is not None:
            return drain.status(self.clock())
        slot = next((s for s in self.slots() if s.info.worker_id == worker_id), None)
        if slot is None:
            raise WorkerNotFoundError(f"no worker {worker_id!r} in this cluster")
        after = DEFAULT_MIGRATE_AFTER_S if migrate_after_s is None else float(migrate_after_s)
        if not 0 <= after <= 86_400:
            raise InvalidRequestError(f"migrate_after_s must be in [0, 86400], got {after:g}")
        if not slot.view.alive:
            raise InvalidRequestError(f"worker {worker_id} is dead: there is nothing to drain")
        now = self.clock()
        others = [s for s in self._peers(slot) if s.view.routable(now)]
        if not others:
            raise InvalidRequestError(
                f"worker {worker_id} is the last ready {slot.info.role} worker: draining it "
                f"would leave nothing to take its work (start another one first)")
        slot.view.draining = True
        drain = _Drain(slot, after, now)
        on = self.streams.streams_on(worker_id)
        drain.seen, drain.remaining = {st.request_id for st in on}, len(on)
        self._drains[worker_id] = drain
        log.warning("draining %s (%s): streams still running after %.0f s migrate",
                    worker_id, slot.info.role, after)
        drain.task = asyncio.ensure_future(self._run(drain))
        return drain.status(now)

    def status(self, worker_id: str) -> DrainStatus | None:
        drain = self._drains.get(worker_id)
        return None if drain is None else drain.status(self.clock())

    async def wait(self, worker_id: str) -> DrainStatus:
        """The drain's status once it ended."""
        drain = self._drains[worker_id]
        assert drain.task is not None
        await asyncio.shield(drain.task)
        return drain.status(self.clock())

    async def close(self) -> None:
        tasks = [d.task for d in self._drains.values() if d.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _peers(self, slot: WorkerSlot) -> list[WorkerSlot]:
        """The other workers of ``slot``'s role (prefill; decode and colocated alike)."""
        return [s for s in self.slots() if s is not slot
                and (s.info.role == "prefill") == (slot.info.role == "prefill")]

    # ---- one drain ---------------------------------------------------------------------------
    async def _run(self, drain: _Drain) -> None:
        wid = drain.slot.info.worker_id
        decode_side = drain.slot.info.role != "prefill"
        while True:
            on = self.streams.streams_on(wid)
            drain.seen |= {s.request_id for s in on}
            drain.remaining = len(on)
            if decode_side and self.clock() - drain.started >= drain.migrate_after_s:
                # Streams committed meanwhile (an attempt in flight at the start) move too.
                moved = self.streams.migrate_off(wid, f"worker {wid} is drained")
                drain.migrated |= set(moved)
            if not on and not self._router_inflight(drain.slot):
                break
            await asyncio.sleep(POLL_S)
        drain.remaining = 0
        await self._settle(drain)
        if self.retire is not None:
            try:
                await self.retire(drain.slot)
            except Exception:  # it holds nothing of ours any more: the drain is done
                log.exception("drain of %s: retiring the worker failed", wid)
        drain.ended = self.clock()
        st = drain.status(drain.ended)
        log.warning("drained %s in %.1f s: %d streams finished there, %d migrated", wid,
                    st.elapsed_s, st.streams_finished, st.streams_migrated)

    @staticmethod
    def _router_inflight(slot: WorkerSlot) -> bool:
        """Work this router has routed there and not yet attached to a stream's ids."""
        v = slot.view
        return v.inflight_blocks > 0 or v.inflight_prefill_tokens > 0 or v.inflight_requests > 0

    async def _settle(self, drain: _Drain) -> None:
        """Wait (at most ``settle_s``) until the worker itself reports nothing running or
        waiting: another router's requests, aborts still being applied. After that the
        worker is retired anyway; whatever still ran there is another router's, which
        migrates it as from a lost worker."""
        deadline = self.clock() + self.settle_s
        while self.clock() < deadline:
            try:
                load = await asyncio.wait_for(liveness(drain.slot.handle.load).remote(),
                                              self.call_timeout_s)
            except Exception as e:  # gone already: nothing left to wait for
                log.info("drain of %s: load report failed (%r)", drain.slot.info.worker_id, e)
                return
            if (load.requests_running + load.requests_waiting == 0
                    and load.kv_blocks_reserved == 0):
                return
            await asyncio.sleep(POLL_S * 4)
        log.warning("drain of %s: its scheduler still reports work after %.0f s; retiring it "
                    "anyway (its streams migrate)", drain.slot.info.worker_id, self.settle_s)
