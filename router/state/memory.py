"""InMemoryStore: the embedded ClusterStore (router/state/store.py holds the contract)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from router.state.store import (
    DEFAULT_JOURNAL_TTL_S,
    DEFAULT_STREAM_TTL_S,
    ClusterStore,
    JournalEvent,
    StreamLog,
    StreamRecord,
    UnknownWorkerError,
    WorkerLoad,
    WorkerRecord,
    check_role,
    check_ttl,
)

__all__ = ["InMemoryStore"]


class InMemoryStore(ClusterStore):
    """Single-process store. ``clock`` (seconds, monotonic) decides every expiry, so tests
    inject a fake one instead of sleeping."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 journal_ttl_s: float = DEFAULT_JOURNAL_TTL_S,
                 stream_ttl_s: float = DEFAULT_STREAM_TTL_S) -> None:
        check_ttl(journal_ttl_s, "journal_ttl_s")
        check_ttl(stream_ttl_s, "stream_ttl_s")
        self._stream_ttl_s = stream_ttl_s
        # request id -> [record, tokens, finish_reason, expires_at]
        self._streams: dict[str, list] = {}
        self._responses: dict[str, tuple[dict, float]] = {}  # key -> (doc, expires_at)
        self._clock = clock
        self._journal_ttl_s = journal_ttl_s
        self._lock = threading.Lock()
        self._workers: dict[str, tuple[WorkerRecord, float]] = {}  # id -> (record, expires_at)
        self._loads: dict[str, WorkerLoad] = {}
        # request id -> (events, expires_at); dict order = last-append order.
        self._journals: dict[str, tuple[list[JournalEvent], float]] = {}

    def _live(self, worker_id: str, now: float) -> WorkerRecord | None:
        entry = self._workers.get(worker_id)
        if entry is None:
            return None
        if entry[1] <= now:  # lapsed: drop everything it owned, as Redis expiry would
            self._forget_worker(worker_id)
            return None
        return entry[0]

    def _forget_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._loads.pop(worker_id, None)

    def register_worker(self, rec: WorkerRecord, ttl_s: float) -> None:
        check_ttl(ttl_s)
        with self._lock:
            self._workers[rec.worker_id] = (rec, self._clock() + ttl_s)
            self._loads.pop(rec.worker_id, None)

    def heartbeat(self, worker_id: str, ttl_s: float, load: WorkerLoad | None = None) -> None:
        check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            rec = self._live(worker_id, now)
            if rec is None:
                raise UnknownWorkerError(f"heartbeat from unregistered or expired worker {worker_id!r}")
            self._workers[worker_id] = (rec, now + ttl_s)
            if load is not None:
                self._loads[worker_id] = load

    def deregister_worker(self, worker_id: str) -> None:
        with self._lock:
            self._forget_worker(worker_id)

    def list_workers(self, role: str | None = None) -> list[WorkerRecord]:
        check_role(role)
        with self._lock:
            now = self._clock()
            live = [r for wid in list(self._workers) if (r := self._live(wid, now)) is not None]
        return sorted((r for r in live if role is None or r.role == role), key=lambda r: r.worker_id)

    def get_load(self, worker_id: str) -> WorkerLoad | None:
        with self._lock:
            if self._live(worker_id, self._clock()) is None:
                return None
            return self._loads.get(worker_id)

    def _expire_journals(self, now: float) -> None:
        # Dict order is last-append order and the TTL is one constant, so the expired ones
        # are a prefix: stop at the first live one (O(expired), not O(all), per append).
        while self._journals:
            rid, (_, exp) = next(iter(self._journals.items()))
            if exp > now:
                break
            del self._journals[rid]

    def journal_append(self, request_id: str, event: JournalEvent) -> None:
        with self._lock:
            now = self._clock()
            self._expire_journals(now)
            events = self._journals.pop(request_id, ([], 0.0))[0]  # pop+insert = move to end
            events.append(event)
            self._journals[request_id] = (events, now + self._journal_ttl_s)

    def journal_get(self, request_id: str) -> list[JournalEvent]:
        with self._lock:
            self._expire_journals(self._clock())
            entry = self._journals.get(request_id)
            return list(entry[0]) if entry else []

    def journal_recent(self, limit: int = 100) -> list[str]:
        with self._lock:
            self._expire_journals(self._clock())
            return list(reversed(self._journals))[:limit]

    def response_put(self, key: str, doc: dict, ttl_s: float) -> None:
        check_ttl(ttl_s, "ttl_s")
        with self._lock:
            now = self._clock()
            self._responses = {k: v for k, v in self._responses.items() if v[1] > now}
            self._responses[key] = (json.loads(json.dumps(doc)), now + ttl_s)

    def response_get(self, key: str) -> dict | None:
        with self._lock:
            entry = self._responses.get(key)
            if entry is None or entry[1] <= self._clock():
                return None
            return json.loads(json.dumps(entry[0]))  # a copy: callers may change theirs

    def stream_open(self, record: StreamRecord) -> None:
        with self._lock:
            now = self._clock()
            self._expire_streams(now)
            self._streams.pop(record.request_id, None)
            self._streams[record.request_id] = [record, [], None, now + self._stream_ttl_s,
                                                record.owner]

    def stream_append(self, request_id: str, token_ids: list[int],
                      finish_reason: str | None = None, owner: str | None = None) -> None:
        with self._lock:
            now = self._clock()
            self._expire_streams(now)
            entry = self._streams.get(request_id)
            if entry is None or entry[2] is not None:  # unknown, or ended: nothing to log
                return
            if owner is not None and entry[4] != owner:  # taken over by another router
                return
            self._streams[request_id] = self._streams.pop(request_id)  # last-append order
            entry[1].extend(token_ids)
            if finish_reason is not None:
                entry[2] = finish_reason
            entry[3] = now + self._stream_ttl_s

    def stream_read(self, request_id: str, from_index: int = 0) -> StreamLog | None:
        if from_index < 0:
            raise ValueError(f"from_index must be >= 0, got {from_index}")
        with self._lock:
            self._expire_streams(self._clock())
            entry = self._streams.get(request_id)
            if entry is None:
                return None
            record, tokens, reason, _, owner = entry
            return StreamLog(record, list(tokens[from_index:]), len(tokens), reason, owner)

    def stream_claim(self, request_id: str, owner: str, expect_owner: str) -> bool:
        with self._lock:
            self._expire_streams(self._clock())
            entry = self._streams.get(request_id)
            if entry is None or entry[2] is not None or entry[4] != expect_owner:
                return False
            entry[4] = owner
            return True

    def _expire_streams(self, now: float) -> None:
        # As _expire_journals: dict order is last-append order, expired ones a prefix.
        while self._streams:
            rid, entry = next(iter(self._streams.items()))
            if entry[3] > now:
                break
            del self._streams[rid]

    def close(self) -> None:
        pass
