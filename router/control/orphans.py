"""Requests whose router died, continued by another router when their decode worker is gone
too. Nobody else would: their stream (the coroutine that migrates a stream) died with their
router, and a decode worker hands a dead router's requests over only while it lives.

Two ways such a request reaches this router:
- **adopted, then lost**: a decode worker handed this router a dead router's requests
  (``StreamLogger.adopt``) and then died, restarted or became unreachable
  (``TokenFanout`` reports it: ``lost``);
- **orphaned outright**: the router and the decode worker died together, so nothing was
  handed over; a client resuming here follows a log that stops growing, and after
  ``StreamLogger.orphan_after_s`` the logger asks ``stalled``. It is continued only if no live
  decode worker holds the request (held: it is running, and will be handed over) and the
  log's owner is still the one that opened it. A worker that finished it while its router
  was dying has the rest: the log is completed from it.

Continuing = what a migration does (``RescueHost.follow``, the orchestrator's) with no client
attached: claim the log (a compare-and-set in the store, so one router wins), prefill prompt
+ every logged token on a live pair, and append the rest at its stream position. Clients
following the log (``Resume``) see one stream. Greedy requests equal an undisturbed run;
seeded ones too (the sampler's position is carried).

Every write to a log is fenced by its owner (``ClusterStore.stream_append(owner=)``): the
router that claimed a request is the only one that can extend or end its log. So a router
that is alive but held a request ``orphan_after_s`` with no decode worker holding it (a long
wait for KV capacity mid-migration) and lost it to a takeover cannot corrupt the log; its
own still-connected client keeps what that router produces (for greedy and seeded requests
the same tokens; for unseeded sampling they may differ from the log after the takeover).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

from engine.contract import SamplingParams
from router.contract import GenerationChunk
from router.control.adapters import AdapterCatalog
from router.control.request_state import StreamState, WorkerLost, WorkerSlot
from router.state.store import StreamLog, from_dict
from router.state.stream_log import StreamLogger
from worker_protocol import control

__all__ = ["OrphanRescue", "RescueHost"]

log = logging.getLogger(__name__)


class RescueHost(Protocol):
    """What the rescue needs of the router it runs in (the orchestrator is one): its name in the
    store, its stream logs, its live streams and decode workers, and the migration itself."""

    router_id: str
    streams: StreamLogger
    call_timeout_s: float
    adapters: AdapterCatalog  # a continued stream runs under its LoRA adapter again

    def has_stream(self, request_id: str) -> bool:
        """This router is producing ``request_id``'s stream now."""
        ...

    def live_decode_slots(self) -> list[WorkerSlot]: ...

    def add_stream(self, stream: StreamState) -> None:
        """Produce ``stream`` here from now on (``end_stream`` ends it)."""
        ...

    def follow(self, stream: StreamState, prompt_ids: list[int], params: SamplingParams,
               generated: list[int], pending: list, t0: float) -> AsyncIterator[GenerationChunk]:
        """The stream's chunks after the ``generated`` tokens, migrating it first when
        ``pending`` starts with a ``WorkerLost``."""
        ...

    async def end_stream(self, stream: StreamState, finished: bool) -> None: ...


class OrphanRescue:
    def __init__(self, host: RescueHost) -> None:
        self._host = host
        self._tasks: dict[str, asyncio.Task] = {}  # request id -> its continuation

    # ---- triggers -------------------------------------------------------------------------
    def lost(self, worker_id: str, why: str) -> None:
        """Decode worker ``worker_id`` was lost: continue the requests adopted from it."""
        for rid in self._host.streams.take_adopted(worker_id):
            self._start(rid, f"adopted, then {why}", worker_id)

    async def stalled(self, request_id: str) -> None:
        """A resumed log stopped growing: continue the request if nobody holds it."""
        host = self._host
        if host.has_stream(request_id) or request_id in self._tasks:
            return
        for slot in host.live_decode_slots():
            try:
                if await asyncio.wait_for(control(slot.handle.holds).remote(request_id),
                                          host.call_timeout_s):
                    return  # running there: the worker hands it to a live router
                rec = await asyncio.wait_for(control(slot.handle.tokens_of).remote(request_id),
                                             host.call_timeout_s)
            except Exception as e:  # unreachable: it may hold it; do not double-produce
                log.info("cannot ask %s about %s: %r", slot.info.worker_id, request_id, e)
                return
            if rec is not None and rec.finish_reason is not None:
                await self._complete_from(request_id, rec)
                return
        self._start(request_id, "its router and its decode worker are gone", None)

    # ---- continuing -----------------------------------------------------------------------
    def _start(self, request_id: str, why: str, lost_on: str | None) -> None:
        if request_id in self._tasks or self._host.has_stream(request_id):
            return
        task = asyncio.ensure_future(self._continue(request_id, why, lost_on))
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))

    async def _claim(self, request_id: str) -> StreamLog | None:
        """The log, once it is this router's to write; None if it ended, is unknown, cannot
        be continued, or another router claimed it first."""
        store, me = self._host.streams.store, self._host.router_id
        first = await asyncio.to_thread(store.stream_read, request_id, 0)
        if first is None or first.finish_reason is not None or not first.record.sampling:
            return None
        if first.owner != me and not await asyncio.to_thread(
                store.stream_claim, request_id, me, first.owner):
            return None
        # Read again now that it is ours: appends racing the claim are in.
        return await asyncio.to_thread(store.stream_read, request_id, 0)

    async def _continue(self, request_id: str, why: str, lost_on: str | None) -> None:
        host = self._host
        try:
            current = await self._claim(request_id)
            if current is None or host.has_stream(request_id):
                return
            rec = current.record
            params = from_dict(SamplingParams, rec.sampling)
            # Its LoRA adapter, if this router serves it; else it is not continued: computed
            # again under other weights, its tokens would silently change.
            lora = host.adapters.resolve(rec.model_id)
        except Exception as e:  # the store is away (the client's resume ends; it may retry),
            log.warning("cannot continue %s: %r", request_id, e)  # a record we cannot read,
            return  # or an adapter this router does not serve
        stream = StreamState(request_id, lora=lora)
        stream.decode_id = lost_on  # a lost worker that comes back frees its copy
        host.add_stream(stream)
        host.adapters.admitted(lora)  # counted by the router that continues it
        log.warning("continuing %s after %d tokens: %s", request_id, current.num_tokens, why)
        finished = False
        try:
            lost = WorkerLost(why, "router_lost")
            async for chunk in host.follow(stream, rec.prompt_token_ids, params,
                                           current.token_ids, [lost], time.monotonic()):
                finished = chunk.finished
        except Exception as e:  # it ends like any stream that failed: its log says abort
            log.warning("continuing %s failed: %r", request_id, e)
        finally:
            await host.end_stream(stream, finished)

    async def _complete_from(self, request_id: str, rec) -> None:
        """A worker finished the request but its router died before logging the end."""
        current = await self._claim(request_id)
        if current is None:
            return
        start = current.num_tokens - rec.index
        if start < 0:  # the worker no longer has every missing token
            return
        self._host.streams.append(request_id, list(rec.token_ids[start:]), rec.finish_reason)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
