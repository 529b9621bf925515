"""Each decode worker's token fan-out: one task per worker subscribes to its per-step token
batches and hands every update to the stream of its request; the same owner tells streams
when their worker was lost (they migrate) and adopts the requests a worker hands over from
a router that stopped reporting (their stream logs are kept going).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

from router.control.request_state import StreamState, WorkerLost, WorkerSlot
from router.control.worker_health import WorkerHealth, is_restarting
from router.state.stream_log import StreamLogger
from worker_protocol import TokenBatch, control

__all__ = ["TokenFanout"]

log = logging.getLogger(__name__)


class TokenFanout:
    """Over the orchestrator's stream table (``streams``: request id -> StreamState)."""

    def __init__(self, streams: dict[str, StreamState], stream_log: StreamLogger,
                 call_timeout_s: float, router_id: str) -> None:
        self._streams = streams
        self.router_id = router_id
        self.streams = stream_log
        self.call_timeout_s = call_timeout_s
        self.health: WorkerHealth | None = None  # set by the owner (health reports losses here)
        # Set by the owner: on_lost(worker_id, why) for each lost decode worker, so requests
        # adopted from it (their router died) are continued elsewhere (router/control/orphans.py).
        self.on_lost: Callable[[str, str], None] | None = None
        self._consumers: dict[str, asyncio.Task] = {}  # decode worker id -> its fan-out task
        self._last_batch: dict[str, float] = {}  # decode worker id -> monotonic s (heartbeat)

    def start(self, slot: WorkerSlot) -> None:
        """Fan ``slot``'s tokens out (again, if its task ended: a restarted worker)."""
        task = self._consumers.get(slot.info.worker_id)
        if task is None or task.done():
            self._consumers[slot.info.worker_id] = asyncio.ensure_future(self._consume(slot))

    async def close(self) -> None:
        tasks = list(self._consumers.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def last_tokens(self, worker_id: str) -> float:
        """When ``worker_id``'s last token batch arrived (monotonic s; 0: never)."""
        return self._last_batch.get(worker_id, 0.0)

    def streams_on(self, worker_id: str) -> list[StreamState]:
        """The streams that run (or are being set up) on ``worker_id``, decode or prefill."""
        return [s for s in self._streams.values() if worker_id in (s.decode_id, s.prefill_id)]

    def pending(self) -> list[StreamState]:
        """The streams not yet decoding anywhere (queued for room, in prefill, moving)."""
        return [s for s in self._streams.values() if not s.committed]

    def migrate_off(self, worker_id: str, why: str) -> list[str]:
        """Move every stream committed on decode worker ``worker_id`` to another one while
        it still runs (a drain: reason ``drained``, outside migration_limit); the ids."""
        moved = [s.request_id for s in self._streams.values()
                 if s.decode_id == worker_id and s.committed]
        self.fail_committed_streams(worker_id, why, "drained")
        return moved

    def fail_committed_streams(self, worker_id: str, why: str, reason: str,
                                keep_incarnation: str | None = None) -> None:
        """Tell every stream whose sequence lives on ``worker_id`` that it was lost (it then
        migrates), except those committed in process ``keep_incarnation`` (a restarted
        worker's new one). Streams still in an attempt there are left alone: that attempt
        fails and is retried by itself."""
        for s in self._streams.values():
            if (s.decode_id == worker_id and s.committed
                    and (keep_incarnation is None or s.decode_incarnation != keep_incarnation)):
                s.committed = False  # one loss marker per stream and worker
                s.abandoned = worker_id  # its later tokens, if it still runs, are dropped
                s.queue.put_nowait(WorkerLost(why, reason))
        if self.on_lost is not None:
            self.on_lost(worker_id, why)

    async def _consume(self, slot: WorkerSlot) -> None:
        """Fan one decode worker's per-step token batches out to the request streams, for as
        long as the worker lives. A broken subscription (the connection dropped while a link
        was down) loses the batches in flight: the streams on that worker fail, the worker is
        unreachable until it reports again, and the subscription is taken up anew."""
        import ray.exceptions

        wid = slot.info.worker_id
        while slot.view.alive:
            # The process this subscription reaches. A call made before Ray restarted the
            # worker can fail only after the new process rejoined: that error speaks for the
            # old process alone, not for streams already committed on the new one.
            incarnation = slot.info.incarnation
            try:
                async for ref in slot.handle.subscribe.remote(self.router_id):
                    batch: TokenBatch = await ref
                    self._last_batch[wid] = time.monotonic()
                    for upd in batch.updates:
                        s = self._streams.get(upd.request_id)
                        # Only the worker the stream is committed to speaks for it: an attempt
                        # the router gave up on (its commit timed out while the host was cut
                        # off) may still be admitted there later, and must not inject tokens.
                        if s is not None and s.decode_id == wid and s.abandoned != wid:
                            s.queue.put_nowait(upd)
                        elif s is None:  # a request of a router that died: keep its log going
                            self.streams.adopt(upd, functools.partial(self._tokens_of, slot),
                                               wid)
                return  # the worker closed the stream: it is shutting down
            except asyncio.CancelledError:
                raise
            except ray.exceptions.ActorUnavailableError as e:
                rejoined = slot.info.incarnation != incarnation
                keep = slot.info.incarnation if rejoined else None
                if not rejoined:
                    self.health.unreachable(slot, f"token stream broke: {e!r}")
                if is_restarting(e):
                    self.fail_committed_streams(wid, f"decode worker {wid} died; Ray is "
                                                      f"restarting it", "worker_restarted", keep)
                else:
                    self.fail_committed_streams(wid, f"lost the token stream of decode worker "
                                                      f"{wid} (its host was unreachable)",
                                                 "stream_lost", keep)
                await asyncio.sleep(0.5)
            except Exception as e:  # actor died
                self.health.dead(slot, repr(e))
                return

    async def _tokens_of(self, slot: WorkerSlot, request_id: str):
        async with asyncio.timeout(self.call_timeout_s):  # not wait_for: WorkerCalls.call
            return await control(slot.handle.tokens_of).remote(request_id)
