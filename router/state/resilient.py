"""ResilientStore: the router's view of a remote ClusterStore (Redis) that may be down at
any moment, at start-up included. Serving never waits on it.

- **Writes never block and never fail.** Registry changes (register, heartbeat, deregister)
  are kept as the state this router wants the store to hold, one entry per worker (only the
  newest heartbeat matters); journal events and stream-log writes queue in a bounded backlog
  (oldest dropped past ``max_backlog``, counted). One writer thread applies them in order.
- **Reads degrade.** While the store is down, reads answer from this router's own view (its
  registrations and their last loads; the journal events not yet written) instead of
  raising. Routing reads nothing here (its KV cache index is the router's own, built from
  the workers' KV events: router/routing/kv_index.py); callers on the event loop run reads on a
  thread.
- **Reconciled on return.** The writer probes a down store every ``probe_interval_s``; when
  it answers, and whenever the store's ``epoch`` changed (a Redis restarted so fast that no
  call failed still lost its data), every worker this router registered is written again,
  the journals of requests still open here are repaired (events the store lost are written
  again, ahead of the backlog), and the backlog is flushed, in order. Each transition logs
  one line; ``up`` feeds the ``pdcluster_store_up`` gauge.

Why a writer thread and not ``redis.asyncio``: the ClusterStore contract is synchronous and
shared with callers outside any event loop (tests, tools, the embedded store); keeping one
synchronous backend behind a queue gives the same guarantee (nothing on the router's loop
waits on Redis) with one implementation of every Redis command.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from router.state.store import (
    TERMINAL_JOURNAL_KINDS,
    ClusterStore,
    JournalEvent,
    StoreError,
    StoreUnavailableError,
    StreamLog,
    StreamRecord,
    UnknownWorkerError,
    WorkerLoad,
    WorkerRecord,
)

__all__ = ["ResilientStore"]

log = logging.getLogger(__name__)


@dataclass
class _Registration:
    """A worker as this router wants the store to hold it."""

    record: WorkerRecord
    ttl_s: float
    load: WorkerLoad | None = None
    written: bool = False  # register_worker reached the store (since the last reconnect)


class ResilientStore(ClusterStore):
    """Wraps the backend ``connect()`` returns (called again until it succeeds).

    ``require``: raise StoreUnavailableError from the constructor when the store cannot be
    reached (``--require-redis``) instead of starting degraded.
    """

    def __init__(self, connect: Callable[[], ClusterStore], describe: str,
                 require: bool = False, probe_interval_s: float = 0.5,
                 max_backlog: int = 100_000) -> None:
        self.describe = describe
        self.probe_interval_s = probe_interval_s
        self.dropped = 0  # backlog entries lost to the bound during a long outage
        self._connect = connect
        self._backend: ClusterStore | None = None
        self._up = False
        self._closed = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._registry: dict[str, _Registration] = {}
        self._dirty: set[str] = set()  # registrations whose newest state is not written yet
        self._deregistered: set[str] = set()
        self._backlog: deque[tuple[str, tuple]] = deque()
        self._max_backlog = max_backlog
        self._busy = False  # the writer holds work taken off the queues
        # Every journal event of the requests still open here (until their last event is
        # written), to repair what a store that lost its data no longer holds. Bounded.
        self._open_journals: dict[str, list[JournalEvent]] = {}
        self._max_open_journals = max_backlog // 8
        # Responses-API documents written here, readable before (and while) the store is not.
        self._responses: dict[str, dict] = {}
        self._epoch: str | None = None  # the store's epoch when we last wrote to it
        try:
            self._backend = connect()
            self._up = True
        except StoreUnavailableError as e:
            if require:
                raise
            log.error("cluster store unavailable at start-up, serving without it until it "
                      "answers (degraded mode): %s", e)
        self._writer = threading.Thread(target=self._run, daemon=True, name="store-writer")
        self._writer.start()

    @property
    def up(self) -> bool:
        """Whether the store answered the last call made to it."""
        return self._up

    @property
    def backlog(self) -> int:
        with self._lock:
            return len(self._backlog) + len(self._dirty) + len(self._deregistered)

    # ---- writes: recorded here, applied by the writer thread ------------------------------
    def register_worker(self, rec: WorkerRecord, ttl_s: float) -> None:
        with self._changed:
            self._registry[rec.worker_id] = _Registration(rec, ttl_s)
            self._deregistered.discard(rec.worker_id)
            self._dirty.add(rec.worker_id)
            self._changed.notify()

    def heartbeat(self, worker_id: str, ttl_s: float, load: WorkerLoad | None = None) -> None:
        """Raises UnknownWorkerError only for a worker this router never registered (the
        store's own expiry is repaired by the writer, which registers it again)."""
        with self._changed:
            reg = self._registry.get(worker_id)
            if reg is None:
                raise UnknownWorkerError(f"heartbeat from unregistered worker {worker_id!r}")
            reg.ttl_s = ttl_s
            if load is not None:
                reg.load = load
            self._dirty.add(worker_id)
            self._changed.notify()

    def deregister_worker(self, worker_id: str) -> None:
        with self._changed:
            self._registry.pop(worker_id, None)
            self._dirty.discard(worker_id)
            self._deregistered.add(worker_id)
            self._changed.notify()

    def journal_append(self, request_id: str, event: JournalEvent) -> None:
        with self._lock:
            events = self._open_journals.setdefault(request_id, [])
            events.append(event)
            if len(self._open_journals) > self._max_open_journals:
                self._open_journals.pop(next(iter(self._open_journals)))
        self._enqueue("journal_append", (request_id, event))

    def stream_open(self, record: StreamRecord) -> None:
        self._enqueue("stream_open", (record,))

    def stream_append(self, request_id: str, token_ids: list[int],
                      finish_reason: str | None = None, owner: str | None = None) -> None:
        # The owner check happens when the writer applies it, against Redis' owner then.
        self._enqueue("stream_append", (request_id, list(token_ids), finish_reason, owner))

    def response_put(self, key: str, doc: dict, ttl_s: float) -> None:
        with self._lock:  # read back from here until written (and while the store is down)
            self._responses[key] = doc
            while len(self._responses) > self._max_open_journals:
                self._responses.pop(next(iter(self._responses)))
        self._enqueue("response_put", (key, doc, ttl_s))

    def response_get(self, key: str) -> dict | None:
        def local() -> dict | None:
            with self._lock:
                return self._responses.get(key)
        found = self._read(lambda b: b.response_get(key), local)
        return found if found is not None else local()

    def _enqueue(self, method: str, args: tuple) -> None:
        with self._changed:
            if len(self._backlog) >= self._max_backlog:
                self._backlog.popleft()
                self.dropped += 1
            self._backlog.append((method, args))
            self._changed.notify()

    # ---- reads: the store's answer while it is up, this router's view while it is down ---
    def list_workers(self, role: str | None = None) -> list[WorkerRecord]:
        def local() -> list[WorkerRecord]:
            with self._lock:
                recs = [r.record for r in self._registry.values()]
            return sorted((r for r in recs if role is None or r.role == role),
                          key=lambda r: r.worker_id)
        return self._read(lambda b: b.list_workers(role), local)

    def get_load(self, worker_id: str) -> WorkerLoad | None:
        def local() -> WorkerLoad | None:
            with self._lock:
                reg = self._registry.get(worker_id)
            return reg.load if reg else None
        return self._read(lambda b: b.get_load(worker_id), local)

    def journal_get(self, request_id: str) -> list[JournalEvent]:
        """Read-your-writes: waits (bounded) for this router's queued events to be written."""
        self.flush(timeout_s=2.0)

        def local() -> list[JournalEvent]:
            with self._lock:
                return [a[1] for m, a in self._backlog
                        if m == "journal_append" and a[0] == request_id]
        return self._read(lambda b: b.journal_get(request_id), local)

    def journal_recent(self, limit: int = 100) -> list[str]:
        return self._read(lambda b: b.journal_recent(limit), list)

    def stream_read(self, request_id: str, from_index: int = 0) -> StreamLog | None:
        """What the store holds (this router's latest appends may still be queued: readers
        poll); None while the store is down."""
        return self._read(lambda b: b.stream_read(request_id, from_index), lambda: None)

    def stream_claim(self, request_id: str, owner: str, expect_owner: str) -> bool:
        """Only while the store is up (a claim nobody else can see fences nothing): False
        while it is down. This router's queued writes go first, so its own open is there."""
        self.flush(timeout_s=2.0)
        return self._read(lambda b: b.stream_claim(request_id, owner, expect_owner),
                          lambda: False)

    def _read(self, call, fallback):
        backend = self._backend
        if not self._up or backend is None:
            return fallback()
        try:
            return call(backend)
        except StoreUnavailableError as e:
            self._went_down(e)
            return fallback()

    # ---- lifecycle ------------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait until everything recorded so far is written; False if the store is down or
        the deadline passed first."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._up and (self._busy or self._backlog or self._dirty or self._deregistered):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.05))
            return self._up

    def close(self) -> None:
        """Write what is queued (best effort, 2 s), then stop the writer and disconnect."""
        self.flush(timeout_s=2.0)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._writer.join(timeout=5)
        if self._backend is not None:
            self._backend.close()

    # ---- the writer thread ----------------------------------------------------------------
    def _went_down(self, e: BaseException) -> None:
        with self._changed:
            if self._up:
                log.error("cluster store unavailable, serving without it (degraded mode) "
                          "until it answers again: %s", e)
            self._up = False
            self._changed.notify_all()

    def _came_back(self) -> None:
        self._repair(self._backend)
        with self._changed:
            self._up = True
            log.warning("cluster store %s is back; writing %d registrations and %d queued "
                        "events", self.describe, len(self._registry), len(self._backlog))
            self._changed.notify_all()

    def _repair(self, backend: ClusterStore) -> None:
        """Write again what the store may have lost: every registration, and each open
        request's journal events that were written before but are missing now (put ahead
        of the backlog, which holds the ones never written)."""
        with self._lock:
            for wid, reg in self._registry.items():
                reg.written = False
                self._dirty.add(wid)
            journals = {rid: list(ev) for rid, ev in self._open_journals.items()}
            pending: dict[str, int] = {}
            for method, args in self._backlog:
                if method == "journal_append":
                    pending[args[0]] = pending.get(args[0], 0) + 1
        repairs = []
        for rid, events in journals.items():
            written = len(events) - pending.get(rid, 0)
            stored = len(backend.journal_get(rid)) if written > 0 else 0
            repairs += [("journal_append", (rid, e)) for e in events[stored:written]]
        with self._lock:
            self._backlog.extendleft(reversed(repairs))
        self._epoch = backend.epoch()

    def _probe(self) -> bool:
        try:
            if self._backend is None:
                self._backend = self._connect()
            else:
                self._backend.ping()
            self._came_back()
        except (StoreError, OSError):
            return False
        return True

    def _run(self) -> None:
        while True:
            with self._changed:
                if self._closed:
                    return
                if self._up and not (self._backlog or self._dirty or self._deregistered):
                    self._changed.wait(self.probe_interval_s)
                    continue
            if not self._up:
                if not self._probe():
                    with self._changed:
                        self._changed.wait(self.probe_interval_s)
                continue
            try:
                self._write_some()
            except StoreUnavailableError as e:
                self._went_down(e)
            except Exception:  # a bug or bad data: log it, never kill the writer
                log.exception("cluster store write failed")
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def _write_some(self) -> None:
        """Deregistrations, then registrations, then up to 256 backlog entries, each removed
        from its queue only once written (an outage mid-way loses nothing)."""
        backend = self._backend
        with self._lock:
            self._busy = True
        if backend.epoch() != self._epoch:  # lost its data since we last wrote: repair first
            if self._epoch is not None:
                log.warning("cluster store %s lost its data (restarted); writing this "
                            "router's state again", self.describe)
            self._repair(backend)
        with self._lock:
            gone = list(self._deregistered)
        for wid in gone:
            backend.deregister_worker(wid)
            with self._lock:
                self._deregistered.discard(wid)
        with self._lock:
            dirty = list(self._dirty)
        for wid in dirty:
            with self._lock:
                reg = self._registry.get(wid)
                self._dirty.discard(wid)
            if reg is None:
                continue
            try:
                self._write_registration(backend, reg)
            except StoreUnavailableError:
                with self._lock:
                    if wid in self._registry:
                        self._dirty.add(wid)
                raise
        for _ in range(256):
            with self._lock:
                if not self._backlog:
                    return
                method, args = self._backlog[0]
            getattr(backend, method)(*args)
            with self._lock:
                if self._backlog and self._backlog[0][1] is args:
                    self._backlog.popleft()
                if method == "journal_append" and args[1].kind in TERMINAL_JOURNAL_KINDS:
                    self._open_journals.pop(args[0], None)  # its last event is written
                if method == "response_put":  # the store holds it now (and its expiry)
                    self._responses.pop(args[0], None)

    @staticmethod
    def _write_registration(backend: ClusterStore, reg: _Registration) -> None:
        if not reg.written:
            backend.register_worker(reg.record, reg.ttl_s)
            reg.written = True
        try:
            backend.heartbeat(reg.record.worker_id, reg.ttl_s, reg.load)
        except UnknownWorkerError:  # its key expired in the store (e.g. a long pause)
            backend.register_worker(reg.record, reg.ttl_s)
            backend.heartbeat(reg.record.worker_id, reg.ttl_s, reg.load)
