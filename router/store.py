"""ClusterStore: the control plane's shared metadata (DESIGN §6).

Owns three things, behind one interface with two backends:

1. the **worker registry** (records kept alive by heartbeats with a TTL, plus each worker's
   latest load report),
2. the **request journal** (the ordered lifecycle events of each global request id),
3. the **stream logs** (each request's generated token ids as they stream, so a client whose
   connection or router died resumes on any router of the deployment).

KV-aware routing's per-worker cache index is not in the store: each router builds it from
the workers' KV events (router/kv_index.py).

``InMemoryStore`` is the embedded default (one process, thread-safe, injectable clock so
tests never sleep); ``RedisStore`` (router/redis_store.py) is the production backend shared
by several routers.
``make_store(redis_url)`` picks one. Every value is a JSON-serializable dataclass.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Self, TypeVar

from worker_protocol import WorkerLoad

__all__ = [
    "JOURNAL_KINDS", "TERMINAL_JOURNAL_KINDS", "WORKER_ROLES", "ClusterStore", "InMemoryStore", "JournalEvent",
    "StoreError", "StreamLog", "StreamRecord", "StoreUnavailableError", "UnknownWorkerError", "WorkerLoad",
    "WorkerRecord", "make_store", "redact_url",
]

WORKER_ROLES = ("prefill", "decode", "colocated")
JOURNAL_KINDS = ("received", "reserved", "prefilled", "committed", "finished", "aborted",
                 "retried", "failed", "migrated")
TERMINAL_JOURNAL_KINDS = ("finished", "aborted", "failed")  # a request's last event
DEFAULT_JOURNAL_TTL_S = 3600.0
DEFAULT_STREAM_TTL_S = 600.0  # a stream log lives this long after its last append


_T = TypeVar("_T")


class StoreError(Exception):
    """Base class of every error this module raises (besides ValueError for bad input)."""


class StoreUnavailableError(StoreError):
    """The backend cannot be reached (e.g. Redis down or the URL points nowhere)."""


class UnknownWorkerError(StoreError, LookupError):
    """A heartbeat named a worker that is not registered (never was, deregistered, or its
    TTL lapsed). The worker must call ``register_worker`` again."""


def from_dict(cls: type[_T], d: dict[str, Any]) -> _T:
    """Rebuild a dataclass from its ``asdict`` form. Unknown keys are ignored so a newer
    writer does not break an older reader."""
    return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})  # type: ignore[arg-type]


class _Serde:
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        return from_dict(cls, d)


@dataclass(frozen=True)
class WorkerRecord(_Serde):
    """A worker's identity and how to reach its KV endpoint (its TCPStore, DESIGN §5)."""

    worker_id: str
    role: str  # one of WORKER_ROLES
    node_id: str
    kv_host: str
    kv_port: int
    num_kv_blocks: int
    block_size: int
    model_id: str
    started_at: float  # wall-clock seconds

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("WorkerRecord.worker_id must be non-empty")
        _check_role(self.role)


@dataclass(frozen=True)
class JournalEvent(_Serde):
    """One step in a request's life; ``worker_id`` is None for router-only events."""

    ts: float
    kind: str  # one of JOURNAL_KINDS
    worker_id: str | None
    detail: str = ""

    def __post_init__(self) -> None:
        if self.kind not in JOURNAL_KINDS:
            raise ValueError(f"unknown journal event kind {self.kind!r}; expected one of {JOURNAL_KINDS}")


@dataclass(frozen=True)
class StreamRecord(_Serde):
    """What any router needs to resume a request's stream: its tokens come from the log,
    its text from detokenizing them (output text depends on output tokens alone), cut at
    the same stop strings."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    stop: list[str]
    include_stop_str_in_output: bool
    model_id: str
    kind: str = "completion"  # or "chat": how the HTTP API renders a resumed stream
    # What another router needs to continue the request itself when both its router and its
    # decode worker died: the prompt's token ids, the SamplingParams (asdict), and the
    # router that opened the log (its first owner; StreamLog.owner is the current one).
    prompt_token_ids: list[int] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    owner: str = ""


@dataclass(frozen=True)
class StreamLog:
    """A stream log read from ``from_index``: its record, the tokens from there on, how many
    were logged in all, and the finish reason once the request ended (None while live)."""

    record: StreamRecord
    token_ids: list[int]
    num_tokens: int
    finish_reason: str | None
    owner: str = ""  # the router producing it now (``stream_claim`` moves it)


def _check_role(role: str | None) -> None:
    if role is not None and role not in WORKER_ROLES:
        raise ValueError(f"unknown worker role {role!r}; expected one of {WORKER_ROLES}")


def _check_ttl(ttl_s: float, name: str = "ttl_s") -> None:
    if not ttl_s > 0:
        raise ValueError(f"{name} must be > 0, got {ttl_s!r}")


class ClusterStore(ABC):
    """The control plane's metadata store. All methods are safe to call from many threads.

    Liveness: a worker is live from ``register_worker`` until ``ttl_s`` passes without a
    ``heartbeat`` (or until ``deregister_worker``). Only live workers are listed or report
    loads.
    """

    @abstractmethod
    def register_worker(self, rec: WorkerRecord, ttl_s: float) -> None:
        """Add or replace a worker; it stays live for ``ttl_s`` unless heartbeated. A
        re-registration forgets the previous load report."""

    @abstractmethod
    def heartbeat(self, worker_id: str, ttl_s: float, load: WorkerLoad | None = None) -> None:
        """Extend liveness by ``ttl_s`` and, if given, replace the load report.

        Raises UnknownWorkerError if the worker is not live (it must re-register)."""

    @abstractmethod
    def deregister_worker(self, worker_id: str) -> None:
        """Remove a worker and its load. Unknown ids are ignored."""

    @abstractmethod
    def list_workers(self, role: str | None = None) -> list[WorkerRecord]:
        """Live workers (optionally of one role), sorted by worker_id."""

    @abstractmethod
    def get_load(self, worker_id: str) -> WorkerLoad | None:
        """The latest load of a live worker; None if it is not live or never reported."""

    @abstractmethod
    def journal_append(self, request_id: str, event: JournalEvent) -> None:
        """Append an event; the journal expires ``journal_ttl_s`` after its last append."""

    @abstractmethod
    def journal_get(self, request_id: str) -> list[JournalEvent]:
        """The request's events in append order; [] if unknown or expired."""

    @abstractmethod
    def journal_recent(self, limit: int = 100) -> list[str]:
        """Request ids with unexpired journals, most recently appended first."""

    @abstractmethod
    def stream_open(self, record: StreamRecord) -> None:
        """Start (or restart, emptied) the stream log of ``record.request_id``."""

    @abstractmethod
    def stream_append(self, request_id: str, token_ids: list[int],
                      finish_reason: str | None = None, owner: str | None = None) -> None:
        """Append generated tokens (possibly none) and, on the last append, the finish
        reason. Ignored for a log that was never opened (or expired), that has ended, or,
        with ``owner``, whose owner is another (a router whose request was taken over
        cannot write, or end, the log of the router that continues it)."""

    @abstractmethod
    def stream_read(self, request_id: str, from_index: int = 0) -> StreamLog | None:
        """The log from token ``from_index`` on; None if unknown or expired."""

    @abstractmethod
    def stream_claim(self, request_id: str, owner: str, expect_owner: str) -> bool:
        """Make ``owner`` the producer of a live log whose producer is still ``expect_owner``
        (compare-and-set: of several routers racing to continue an orphaned request, exactly
        one wins). False for an unknown, expired or ended log, or one owned by another."""

    @abstractmethod
    def close(self) -> None:
        """Release connections. The store must not be used afterwards."""

    @property
    def up(self) -> bool:
        """Whether the store answers (a remote one may be down; see ResilientStore)."""
        return True

    def ping(self) -> None:  # noqa: B027 (optional hook: a local store is always there)
        """Raise StoreUnavailableError when the store cannot be reached."""

    def epoch(self) -> str:
        """A token that changes when the store lost its data (a Redis restarted without
        persistence): whoever keeps state in it must write that state again."""
        return "local"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InMemoryStore(ClusterStore):
    """Single-process store. ``clock`` (seconds, monotonic) decides every expiry, so tests
    inject a fake one instead of sleeping."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 journal_ttl_s: float = DEFAULT_JOURNAL_TTL_S,
                 stream_ttl_s: float = DEFAULT_STREAM_TTL_S) -> None:
        _check_ttl(journal_ttl_s, "journal_ttl_s")
        _check_ttl(stream_ttl_s, "stream_ttl_s")
        self._stream_ttl_s = stream_ttl_s
        # request id -> [record, tokens, finish_reason, expires_at]
        self._streams: dict[str, list] = {}
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
        _check_ttl(ttl_s)
        with self._lock:
            self._workers[rec.worker_id] = (rec, self._clock() + ttl_s)
            self._loads.pop(rec.worker_id, None)

    def heartbeat(self, worker_id: str, ttl_s: float, load: WorkerLoad | None = None) -> None:
        _check_ttl(ttl_s)
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
        _check_role(role)
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


def make_store(redis_url: str | None, namespace: str = "pdcluster",
               journal_ttl_s: float = DEFAULT_JOURNAL_TTL_S,
               require: bool = False) -> ClusterStore:
    """For a ``redis_url`` (``redis://`` or ``rediss://``, password in the URL): a
    ``RedisStore`` behind a ``ResilientStore``, which serves on while Redis is down, at
    start-up too (``require``: raise StoreUnavailableError instead). Without one: the
    embedded ``InMemoryStore``. A malformed URL raises ValueError."""
    if redis_url:
        from router.redis_store import RedisStore
        from router.resilient_store import ResilientStore

        return ResilientStore(
            lambda: RedisStore(redis_url, namespace=namespace, journal_ttl_s=journal_ttl_s),
            f"Redis at {redact_url(redis_url)}", require=require)
    return InMemoryStore(journal_ttl_s=journal_ttl_s)


def redact_url(url: str) -> str:
    """The URL without its password (it goes to logs)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
