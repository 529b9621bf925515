"""Keeps the router's ``KVIndex`` current from the workers' KV events.

Two buses, one recovery rule:
- in-memory (the embedded default): every refresh (``Cluster``'s load loop, 4 per second)
  pulls each worker's batches after the index's cursor through Ray (``kv_events``);
- Redis Streams (``--redis-url``): workers also XADD every batch to a bounded stream; one
  reader task here follows all streams and applies batches as they land. While Redis is
  unreachable the refresh falls back to pulling through Ray, so routing keeps its picture;
  so it does for one worker whose batches stop arriving through the stream while its load
  reports say it published more (a worker that cannot reach Redis, a sink that dropped
  batches): after ``STREAM_LAG_S`` of lag, that worker's batches are pulled.
Either way a worker whose entry is stale (new, restarted, or a hole in its batches) gets a
snapshot (``kv_snapshot``) on the next refresh; with Redis the stream is then replayed from
its start, and batches the snapshot already covers are skipped by their ``seq``.

Owned by the router's event loop; every worker call has a deadline, and a worker that does
not answer keeps a stale entry (it matches nothing) until it does.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.routing.kv_index import KVIndex
from worker_protocol import control

log = logging.getLogger(__name__)

_STREAM_START = "0-0"
_STREAM_BLOCK_MS = 200
_STREAM_RETRY_S = 1.0
STREAM_LAG_S = 1.0  # a worker's stream this far behind its load reports is pulled instead


class KVEventSync:
    def __init__(self, index: KVIndex, call_timeout_s: float, source=None) -> None:
        """``source``: a ``worker_protocol.kv_stream.RedisKVEventSource``, or None (pull)."""
        self.index = index
        self.call_timeout_s = call_timeout_s
        self.source = source
        self.stream_up = source is not None
        self._cursors: dict[str, str] = {}  # worker id -> last stream entry read
        self._resets: dict[str, int] = {}  # worker id -> snapshots taken (drops stale reads)
        self._reader: asyncio.Task | None = None
        self._behind_since: dict[str, float] = {}  # worker id -> when its stream fell behind
        # worker id -> its refresh in flight: each worker's own, so one that does not answer
        # (stopped, hung: a call waits out its deadline) never holds back the others' events
        self._refreshing: dict[str, asyncio.Future] = {}
        self.snapshots = 0
        self.pulls = 0  # pulls through Ray (every refresh without a stream; else fallbacks)

    def track(self, worker_id: str, block_size: int) -> None:
        """A worker joined (or rejoined after a restart): stale until its snapshot."""
        self.index.add_worker(worker_id, block_size)
        self._cursors[worker_id] = _STREAM_START
        if self.source is not None and self._reader is None:
            self._reader = asyncio.ensure_future(self._follow_streams())

    def kick(self, slots) -> None:
        """Refresh each worker in the background unless its last refresh still runs: the
        load loop calls this every round and never waits on it (a snapshot waits for the
        worker's current engine step, seconds for a long prefill; load reports must not)."""
        for slot in slots:
            wid = slot.info.worker_id
            task = self._refreshing.get(wid)
            if task is None or task.done():
                self._refreshing[wid] = asyncio.ensure_future(self._refresh_one(slot))

    async def refresh(self, slots) -> None:
        """Bring every given worker's entry up to date (one deadline-bound call each)."""
        await asyncio.gather(*(self._refresh_one(s) for s in slots))

    async def _refresh_one(self, slot) -> None:
        wid = slot.info.worker_id
        cur = self.index.cursor(wid)
        if cur is None:
            return
        try:
            if cur.stale:
                snap = await asyncio.wait_for(control(slot.handle.kv_snapshot).remote(),
                                              self.call_timeout_s)
                self.index.reset(snap)
                self.snapshots += 1
                self._resets[wid] = self._resets.get(wid, 0) + 1
                self._cursors[wid] = _STREAM_START  # replay what the stream still holds
                return
            if self.stream_up and not self._stream_lags(slot, cur.seq):
                return  # the stream reader applies this worker's batches
            self.pulls += 1
            feed = await asyncio.wait_for(
                control(slot.handle.kv_events).remote(cur.seq, cur.incarnation),
                self.call_timeout_s)
        except Exception as e:  # unreachable or dead: its entry waits (stale or as it was)
            log.debug("KV events of %s: %r", wid, e)
            return
        if not feed.complete:
            self.index.invalidate(wid)
            return
        for batch in feed.batches:
            if not self.index.apply(batch):
                break

    def _stream_lags(self, slot, seq: int) -> bool:
        """Has the stream been behind this worker's own load reports for STREAM_LAG_S?"""
        wid = slot.info.worker_id
        load = slot.view.load
        if load is None or load.incarnation != slot.info.incarnation or load.kv_event_seq <= seq:
            self._behind_since.pop(wid, None)
            return False
        now = time.monotonic()
        since = self._behind_since.setdefault(wid, now)
        if now - since < STREAM_LAG_S:
            return False
        log.warning("KV events of %s lag %d batches behind on the stream: pulling them",
                    wid, load.kv_event_seq - seq)
        self._behind_since[wid] = now  # warn again only if it keeps lagging
        return True

    async def _follow_streams(self) -> None:
        from worker_protocol.kv_stream import KVStreamUnavailable

        while True:
            cursors = dict(self._cursors)
            resets = dict(self._resets)
            try:
                entries = await asyncio.to_thread(self.source.read, cursors, _STREAM_BLOCK_MS)
            except KVStreamUnavailable as e:
                if self.stream_up:
                    log.warning("KV event streams unreachable (%s): pulling from workers", e)
                self.stream_up = False
                await asyncio.sleep(_STREAM_RETRY_S)
                continue
            if not self.stream_up:
                log.warning("KV event streams reachable again")
                self.stream_up = True
            for wid, entry_id, batch in entries:
                # A snapshot taken while this read ran moved the cursor back to replay:
                # what this read returned for that worker is superseded.
                if wid not in self._cursors or self._resets.get(wid, 0) != resets.get(wid, 0):
                    continue
                self._cursors[wid] = entry_id
                self.index.apply(batch)

    async def close(self) -> None:
        tasks, self._refreshing = list(self._refreshing.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self.source is not None:
            self.source.close()
