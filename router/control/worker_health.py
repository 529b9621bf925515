"""Each worker's health as the router sees it, kept on its ``WorkerView``: dead (Ray reported
the actor gone: never routed to again), unreachable (a call or load report missed its
deadline: no new work until it answers again), KV-quarantined (a peer could not reach its
advertised KV address: skipped for a while).

One owner for these transitions, so the orchestrator and the cluster's load refresh flip
them the same way. Losing a decode worker's running sequences (it died, or stayed silent
past ``silent_s``) is reported through ``on_decode_lost``; the orchestrator migrates them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from engine.contract import QueueFullError
from kv_transfer import KVTransferError
from router.control.request_state import WorkerSlot

log = logging.getLogger(__name__)

# on_decode_lost(worker_id, why, reason): reason labels the migration metric.
DecodeLost = Callable[[str, str, str], None]


def is_restarting(e: BaseException) -> bool:
    """Ray's word that the actor's process died and is being started again (a transient
    ActorUnavailableError whose message says so; a cut link reads differently)."""
    import ray.exceptions

    return isinstance(e, ray.exceptions.ActorUnavailableError) and "restarting" in str(e)


class WorkerHealth:
    def __init__(self, store, quarantine_s: float, silent_s: float,
                 on_decode_lost: DecodeLost) -> None:
        self.store = store
        self.quarantine_s = quarantine_s
        self.silent_s = silent_s
        self._on_decode_lost = on_decode_lost
        # worker id -> deadlines of calls waiting on it now (WorkerCalls.call): a worker
        # declared silent ends them at once instead of at their own deadlines.
        self._waiting: dict[str, set] = {}

    def watch(self, worker_id: str, deadline) -> None:
        """``deadline`` (an ``asyncio.timeout`` context) expires at once if ``worker_id`` is
        declared silent meanwhile; ``unwatch`` when the call is over."""
        self._waiting.setdefault(worker_id, set()).add(deadline)

    def unwatch(self, worker_id: str, deadline) -> None:
        waiting = self._waiting.get(worker_id)
        if waiting is not None:
            waiting.discard(deadline)
            if not waiting:
                del self._waiting[worker_id]

    def dead(self, slot: WorkerSlot, why: str) -> None:
        """Ray says the actor is gone: deregister it; its decode sequences are lost."""
        if not slot.view.alive:
            return
        wid = slot.info.worker_id
        log.error("worker %s is gone: %s", wid, why)
        slot.view.alive = False
        if self.store is not None:
            self.store.deregister_worker(wid)
        if slot.info.role != "prefill":
            self._on_decode_lost(wid, f"decode worker {wid} died: {why}", "worker_died")

    def unreachable(self, slot: WorkerSlot, why: str) -> None:
        """No new work until its next load report arrives (``reachable``)."""
        if slot.view.reachable:
            log.warning("worker %s is unreachable: %s", slot.info.worker_id, why)
            slot.view.unreachable_since = time.monotonic()
        slot.view.reachable = False

    def reachable(self, slot: WorkerSlot) -> None:
        if not slot.view.reachable:
            log.warning("worker %s is reachable again", slot.info.worker_id)
        slot.view.reachable = True
        slot.view.unreachable_since = None

    def quarantine(self, slot: WorkerSlot, why: str) -> None:
        log.warning("routing around %s for %.0f s: %s", slot.info.worker_id,
                    self.quarantine_s, why)
        slot.view.kv_unreachable_until = time.monotonic() + self.quarantine_s

    def on_error(self, slot: WorkerSlot, e: BaseException) -> None:
        """Classify a failed call: transient (unreachable), the actor's death, or the
        call's own error (logged; the caller decides what it costs the request)."""
        import ray.exceptions

        if isinstance(e, ray.exceptions.ActorUnavailableError):  # transient, by Ray's word
            self.unreachable(slot, repr(e))
        elif isinstance(e, ray.exceptions.RayActorError | ray.exceptions.ActorDiedError):
            self.dead(slot, repr(e))
        elif not isinstance(e, KVTransferError | QueueFullError):
            log.warning("worker %s failed a call: %r", slot.info.worker_id, e)

    def silent(self, slot: WorkerSlot, why: str) -> None:
        """A decode worker neither answers heartbeats nor streams tokens
        (router/control/heartbeat.py): no new work, and its sequences are lost."""
        self.unreachable(slot, why)
        self._on_decode_lost(slot.info.worker_id, why, "worker_silent")
        self._end_waits(slot.info.worker_id)

    def gone(self, slot: WorkerSlot, state: str, why: str) -> None:
        """The worker's process is gone (router/control/heartbeat.py): Ray's actor table says
        ``RESTARTING`` (a new process will rejoin: unreachable until then) or ``DEAD``, or its
        lifeline closed (``EXITED``: unreachable until it rejoins; a worker past its restarts
        is declared dead by the next call Ray fails). Its decode sequences are lost and calls
        waiting on it end now, whichever worker kind."""
        wid = slot.info.worker_id
        if state == "DEAD":
            self.dead(slot, why)
        else:
            self.unreachable(slot, why)
            if slot.info.role != "prefill":
                reason = "worker_restarted" if state == "RESTARTING" else "worker_died"
                self._on_decode_lost(wid, why, reason)
        self._end_waits(wid)

    def _end_waits(self, worker_id: str) -> None:
        now = asyncio.get_running_loop().time()
        for deadline in self._waiting.pop(worker_id, ()):
            deadline.reschedule(now)  # its call fails now (a timeout): retried elsewhere

    def check_silent(self, decode_slots: Iterable[WorkerSlot]) -> None:
        """After each load refresh: sequences on a decode worker silent for longer than
        ``silent_s`` are lost (a SIGSTOP'd or hung worker still looks alive to Ray)."""
        now = time.monotonic()
        for slot in decode_slots:
            since = slot.view.unreachable_since
            if slot.view.alive and since is not None and now - since > self.silent_s:
                wid = slot.info.worker_id
                self._on_decode_lost(wid, f"decode worker {wid} silent for {now - since:.1f} s",
                                     "worker_silent")
