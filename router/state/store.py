"""ClusterStore: the control plane's shared metadata (docs/architecture.md, "The state the
control plane keeps").

Owns three things, behind one interface with two backends:

1. the **worker registry** (records kept alive by heartbeats with a TTL, plus each worker's
   latest load report),
2. the **request journal** (the ordered lifecycle events of each global request id),
3. the **stream logs** (each request's generated token ids as they stream, so a client whose
   connection or router died resumes on any router of the deployment).

KV-aware routing's per-worker cache index is not in the store: each router builds it from
the workers' KV events (router/routing/kv_index.py).

This module is the contract: the records, the errors and ``ClusterStore``. The implementations
live beside it: ``InMemoryStore`` (router/state/memory.py) is the embedded default (one
process, thread-safe, injectable clock so tests never sleep); ``RedisStore``
(router/state/redis_store.py) is the production backend shared by several routers, behind
``ResilientStore`` (router/state/resilient.py). ``make_store(redis_url)``
(router/state/factory.py) picks one. Every value is a JSON-serializable dataclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Self, TypeVar

from worker_protocol import WorkerLoad

__all__ = [
    "JOURNAL_KINDS", "TERMINAL_JOURNAL_KINDS", "WORKER_ROLES", "ClusterStore", "JournalEvent",
    "StoreError", "StreamLog", "StreamRecord", "StoreUnavailableError", "UnknownWorkerError", "WorkerLoad",
    "WorkerRecord", "check_role", "check_ttl", "redact_url",
]

WORKER_ROLES = ("prefill", "decode", "colocated")
JOURNAL_KINDS = ("received", "reserved", "prefilled", "committed", "finished", "aborted",
                 "retried", "failed", "migrated", "pulled", "recomputed")
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
    """A worker's identity and how to reach its KV endpoint (its TCPStore: kv_transfer/)."""

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
        check_role(self.role)


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


def check_role(role: str | None) -> None:
    """Every store refuses a role outside WORKER_ROLES (ValueError)."""
    if role is not None and role not in WORKER_ROLES:
        raise ValueError(f"unknown worker role {role!r}; expected one of {WORKER_ROLES}")


def check_ttl(ttl_s: float, name: str = "ttl_s") -> None:
    """Every store refuses a TTL that is not > 0 (ValueError)."""
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
    def response_put(self, key: str, doc: dict[str, Any], ttl_s: float) -> None:
        """Keep a stored Responses-API response (JSON-able ``doc``) under ``key`` (its
        tenant-scoped id) for ``ttl_s`` seconds."""

    @abstractmethod
    def response_get(self, key: str) -> dict[str, Any] | None:
        """A stored response; None if unknown or expired."""

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


def redact_url(url: str) -> str:
    """The URL without its password (it goes to logs)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
