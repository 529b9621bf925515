"""Worker failure detection in well under a second for a dead process, about a second for a
stopped one, without false alarms.

Load reports cannot tell quickly that a worker stopped: each has a 2 s deadline, and a worker
is declared lost only after ``worker_silent_s`` (5 s) of unanswered reports, so a SIGSTOP'd
(or hung, or cut-off) decode worker froze its streams ~7 s before they moved. Here every live
worker is pinged every ``interval_s`` on its liveness concurrency group (its own threads: the
answer waits neither for an engine step nor behind control calls that do), at most one ping
in flight per worker. Two rules act:

- **Gone** (any worker): no pong for ``confirm_after_s`` (1.5 intervals) makes the
  router ask Ray's actor table (``worker_protocol.actor_state``, off the loop, one question in
  flight per worker). "RESTARTING" or "DEAD" is Ray's own word that the process died (the
  table flips ~0.1 s after a SIGKILL, while calls to a restarting actor just wait for the new
  process): ``on_gone`` acts at once (``WorkerHealth.gone``: streams move, waiting calls end,
  no new work until it rejoins). An actor Ray calls alive is left to the next rule.
- **Silent** (decode workers): no ping answered for ``suspect_after_s`` and no token batch for
  as long either, while streams are committed there (``on_silent``: reason
  ``worker_silent``). A busy worker still streams tokens (a step is milliseconds to a few
  hundred), and an idle one holds no stream, so neither is ever moved; a stopped one fails
  both and its streams migrate (the migration counter counts them; with no fault it stays 0).

- **Exited** (any worker): the router holds a connection to every worker's lifeline
  (``worker_protocol.lifeline``), which only the process's end closes; end-of-file on it is
  the kernel's word that the process died (SIGKILL, a crash, the OOM killer), read within
  milliseconds: ``on_gone`` acts at once with state "EXITED", before any ping is late. A
  stopped or hung process keeps it open (the silence rule finds those), and a lifeline that
  cannot be reached leaves that worker to the two rules above.

A worker that answers again is simply reachable again (its late tokens for moved streams are
dropped: ``StreamState.abandoned``); a restarted one rejoins (``forget``). Prefill workers
hold no streams, so only the first rule applies to them: their in-flight calls end and no
prefix is pulled from them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from router.control.request_state import WorkerSlot
from worker_protocol import actor_state, liveness

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 5.0
_CLASSIFY_FOR_S = 5.0  # how long to ask Ray's table whether an exited worker comes back


class Heartbeats:
    """Owned by the orchestrator; ``start`` on its loop once workers are added, ``close``."""

    def __init__(self, slots: Callable[[], Iterable[WorkerSlot]],
                 holds_streams: Callable[[str], bool], last_tokens: Callable[[str], float],
                 on_silent: Callable[[WorkerSlot, str], None],
                 on_gone: Callable[[WorkerSlot, str, str], None], interval_s: float,
                 suspect_after_s: float,
                 ray_state: Callable[[object], str | None] = actor_state) -> None:
        """``slots``: the workers to watch (both kinds); ``holds_streams(worker_id)``: streams
        are committed there; ``last_tokens(worker_id)``: monotonic time of its last token
        batch; ``on_silent(slot, why)``: a decode worker failed both signals;
        ``on_gone(slot, state, why)``: Ray says its process is gone; ``ray_state(handle)``:
        Ray's actor-table state (blocking; run in a thread)."""
        self._slots = slots
        self._holds_streams = holds_streams
        self._last_tokens = last_tokens
        self._on_silent = on_silent
        self._on_gone = on_gone
        self._ray_state = ray_state
        self.interval_s = interval_s
        self.suspect_after_s = suspect_after_s
        # A pong normally lands within milliseconds of its ping: half an interval late is
        # already unusual, and the question costs Ray a millisecond.
        self.confirm_after_s = 1.5 * interval_s
        self._answered: dict[str, float] = {}  # worker id -> monotonic time of its last pong
        self._in_flight: dict[str, asyncio.Future] = {}
        self._asking: dict[str, asyncio.Future] = {}  # worker id -> its actor-table question
        self._reported: set[str] = set()  # declared silent or gone, not answered since
        self._task: asyncio.Task | None = None
        self._lifelines: dict[str, asyncio.Task] = {}  # worker id -> its lifeline's reader
        self.num_silent = 0  # decode workers declared silent (streams moved)
        self.num_gone = 0  # workers Ray's table showed gone before any call failed
        self.num_exited = 0  # workers whose lifeline closed (their process ended)
        self._last_check: float | None = None  # when check last ran (a stalled loop's tell)

    def start(self) -> None:
        if self._task is None and self.suspect_after_s > 0:
            self._task = asyncio.ensure_future(self._run())

    def forget(self, worker_id: str) -> None:
        """``worker_id`` is a new process (Ray restarted it): its clock starts again."""
        self._answered.pop(worker_id, None)
        self._reported.discard(worker_id)

    def watch(self, slot: WorkerSlot) -> None:
        """A worker was added, or Ray restarted one (a rejoin): its clock starts again, and
        the router holds its lifeline if it has one and heartbeats are on (a new process's
        replaces the old one's). Call on the router's loop."""
        self.start()
        wid = slot.info.worker_id
        self.forget(wid)
        old = self._lifelines.pop(wid, None)
        if old is not None:
            old.cancel()
        if slot.info.lifeline_port and self.suspect_after_s > 0:
            self._lifelines[wid] = asyncio.ensure_future(
                self._hold(slot, slot.info.incarnation))

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._lifelines.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._lifelines.clear()
        for fut in [*self._in_flight.values(), *self._asking.values()]:
            fut.cancel()

    async def _run(self) -> None:
        while True:
            self.check(time.monotonic())
            await asyncio.sleep(self.interval_s)

    def check(self, now: float) -> None:
        """Ping every watched worker that has no ping in flight; act on the silent ones. A
        check that runs late (the router's loop was stalled: a long GC, a starved core) judges
        no silence: the pongs and lifeline closes that arrived meanwhile are still waiting
        for the loop, so every decode worker holding streams would look silent, and a
        SIGKILLed one would be moved as silent ahead of its lifeline's word. The next check,
        an interval later, judges as usual."""
        # late by more than the silence rule's margin over one interval: an answer read
        # before the stall may be an interval old, so past this a pong may be waiting unread
        stalled = (self._last_check is not None and now - self._last_check
                   > max(2 * self.interval_s, self.suspect_after_s - self.interval_s))
        self._last_check = now
        for slot in self._slots():
            wid = slot.info.worker_id
            if not slot.view.alive or slot.view.drained:
                self._answered.pop(wid, None)
                continue
            self._answered.setdefault(wid, now)  # a new worker starts its clock now
            if wid not in self._in_flight:
                self._ping(slot)
            if wid in self._reported:
                continue
            decode = slot.info.role != "prefill"
            last = max(self._answered[wid], self._last_tokens(wid) if decode else 0.0)
            if now - last > self.confirm_after_s and wid not in self._asking:
                self._ask_ray(slot)
            if (decode and not stalled and now - last > self.suspect_after_s
                    and self._holds_streams(wid)):
                self._reported.add(wid)
                self.num_silent += 1
                self._on_silent(slot, f"decode worker {wid} silent for {now - last:.1f} s: no "
                                      f"heartbeat answered and no tokens")

    def _ping(self, slot: WorkerSlot) -> None:
        wid = slot.info.worker_id
        fut = asyncio.ensure_future(liveness(slot.handle.ping).remote())
        self._in_flight[wid] = fut

        def done(f: asyncio.Future) -> None:
            self._in_flight.pop(wid, None)
            if not f.cancelled() and f.exception() is None:
                self._answered[wid] = time.monotonic()
                if wid in self._reported:
                    log.warning("worker %s answers again", wid)
                    self._reported.discard(wid)

        fut.add_done_callback(done)

    def _ask_ray(self, slot: WorkerSlot) -> None:
        """Ask Ray's actor table about a worker that is late to answer (off the loop)."""
        wid, incarnation = slot.info.worker_id, slot.info.incarnation
        fut = asyncio.get_running_loop().run_in_executor(None, self._ray_state, slot.handle)
        self._asking[wid] = fut

        def done(f: asyncio.Future) -> None:
            self._asking.pop(wid, None)
            state = None if f.cancelled() or f.exception() is not None else f.result()
            # An answer about a process that has been replaced meanwhile says nothing.
            if (state not in ("RESTARTING", "DEAD") or wid in self._reported
                    or slot.info.incarnation != incarnation or not slot.view.alive):
                return
            self._reported.add(wid)
            self.num_gone += 1
            self._on_gone(slot, state, f"worker {wid}'s process is gone (Ray: {state}); "
                                       f"no heartbeat answered")

        fut.add_done_callback(done)

    async def _hold(self, slot: WorkerSlot, incarnation: str) -> None:
        """Read ``slot``'s lifeline until it closes, then report the process gone (unless it
        was replaced, retired or reported meanwhile)."""
        info = slot.info
        wid, address = info.worker_id, f"{info.node_ip}:{info.lifeline_port}"
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(info.node_ip, info.lifeline_port), _CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            log.warning("no lifeline to worker %s at %s (%r): its death is found by the "
                        "heartbeat instead", wid, address, e)
            return
        try:
            while await reader.read(4096):  # nothing is ever sent: only EOF ends this
                pass
        except OSError:  # reset: the same news
            pass
        finally:
            writer.close()
        if (slot.info.incarnation != incarnation or not slot.view.alive or slot.view.drained
                or wid in self._reported):
            return
        self._reported.add(wid)
        self.num_exited += 1
        why = f"worker {wid}'s process exited (its lifeline at {address} closed)"
        self._on_gone(slot, "EXITED", why)
        # Whether a new process comes (RESTARTING) or none will (DEAD: never routed to again,
        # as when a call fails with Ray's ActorDiedError) is Ray's to say: its table flips
        # ~0.1 s after the death.
        loop, deadline = asyncio.get_running_loop(), time.monotonic() + _CLASSIFY_FOR_S
        while (time.monotonic() < deadline and slot.info.incarnation == incarnation
               and slot.view.alive):
            state = await loop.run_in_executor(None, self._ray_state, slot.handle)
            if state in ("DEAD", "RESTARTING"):
                if state == "DEAD":
                    self._on_gone(slot, state, why)
                return
            await asyncio.sleep(0.1)
