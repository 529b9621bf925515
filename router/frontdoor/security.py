"""Who may call the front doors, and how much: API keys -> tenants, per-tenant request ids,
rate limits and concurrency caps, request size, TLS material. ``Gate`` is the one owner;
both front doors (router/frontdoor/http_app.py, router/frontdoor/grpc_server.py) ask it and nothing else decides.

- **Keys.** ``--api-keys FILE``: one key per line, optionally ``name:key`` (the tenant's
  name; else ``key-<first 12 hex of sha256(key)>``); blank lines and ``#`` comments are
  skipped. Keys are compared by their SHA-256 digest (a dict lookup on the digest, so the
  time taken says nothing about how much of a key matched). Without a file, auth is off and
  every caller is the tenant ``anonymous``.
- **Tenants own their requests.** The backend knows a request as ``<tenant>/<id>``; the
  client only ever sees ``<id>`` (its own ``x-request-id`` / ``request_id``, or a generated
  one). So two tenants may choose the same id, and Abort / Resume / a reused id of another
  tenant's request find nothing (NOT_FOUND / 404), never that request. Tenant names are
  restricted to ``[A-Za-z0-9_.-]`` so the scope is unambiguous.
- **Limits, per tenant.** A token bucket of ``rate_limit`` generations per second (burst:
  the same number, at least 1): over it, 429 with ``Retry-After`` / RESOURCE_EXHAUSTED. At
  most ``max_concurrent_per_key`` generations at once, counted until the generation ends
  (a resumable request that outlives its call still counts). Bodies above
  ``max_request_bytes`` get 413 (HTTP) / RESOURCE_EXHAUSTED (gRPC's message limit).
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from router.contract import QueueFullError

__all__ = ["ANONYMOUS", "ForbiddenError", "Gate", "Permit", "RateLimitedError", "RequestTooLargeError",
           "SecurityConfig", "TLSConfig", "Tenant", "UnauthenticatedError", "load_api_keys"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MIN_KEY_LENGTH = 16


class UnauthenticatedError(PermissionError):
    """No API key, or one that is not in the key file (401 / UNAUTHENTICATED)."""


class ForbiddenError(PermissionError):
    """A valid key whose tenant may not make this call (an operator's call such as a drain,
    when auth is on and the tenant is not in ``admin_tenants``): 403 / PERMISSION_DENIED."""


class RateLimitedError(QueueFullError):
    """The tenant is over its rate or concurrency limit (429 / RESOURCE_EXHAUSTED);
    ``retry_after_s`` is when a retry can succeed (None: when a running request ends)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLargeError(ValueError):
    """A request body over ``max_request_bytes`` (413 / RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class TLSConfig:
    """PEM files: the server's certificate chain and key; ``client_ca_file`` set requires
    every client to present a certificate signed by it (mTLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(cert, key, client CA) bytes; ValueError naming a file that cannot be read."""
        out = []
        for flag, path in (("--tls-cert", self.cert_file), ("--tls-key", self.key_file),
                           ("--tls-client-ca", self.client_ca_file)):
            if path is None:
                out.append(None)
                continue
            try:
                out.append(Path(path).read_bytes())
            except OSError as e:
                raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
        return out[0], out[1], out[2]


@dataclass(frozen=True)
class SecurityConfig:
    api_keys_file: str | None = None
    # /metrics without a key. None: public exactly when auth is off.
    metrics_public: bool | None = None
    max_request_bytes: int = 1 << 20
    rate_limit: float = 0.0  # generations per second per tenant; 0: no limit
    max_concurrent_per_key: int = 0  # 0: no cap
    tls: TLSConfig | None = None
    # Tenants that may make operators' calls (drain a worker). With auth off, every caller may.
    admin_tenants: tuple[str, ...] = ()
    # Tenant -> seconds its requests wait at most when they name no deadline themselves
    # ("*": every tenant not named); the router's admission refuses a request predicted to
    # miss it (router.control.admission). Empty: no default deadline.
    tenant_deadlines: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [t for t in self.admin_tenants if not _NAME.match(t)]
        if bad:
            raise ValueError(f"--admin-tenants: {bad[0]!r} is not a tenant name "
                             "([A-Za-z0-9_.-], 1-64 characters)")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if not math.isfinite(self.rate_limit) or self.rate_limit < 0:
            raise ValueError(f"--rate-limit must be >= 0, got {self.rate_limit}")
        for name, v in self.tenant_deadlines.items():
            if name != "*" and not _NAME.match(name):
                raise ValueError(f"--tenant-deadlines: {name!r} is not a tenant name")
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
                raise ValueError(f"--tenant-deadlines: {name}: seconds > 0, got {v!r}")
        if self.max_concurrent_per_key < 0:
            raise ValueError(f"--max-concurrent-per-key must be >= 0, "
                             f"got {self.max_concurrent_per_key}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_api_keys(path: str) -> dict[bytes, str]:
    """Key digest -> tenant name, from ``path``. ValueError naming the file and line for a
    key shorter than 16 characters, a bad name, a key listed twice, or a file without keys."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--api-keys {path}: {e.strerror or e}") from None
    keys: dict[bytes, str] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        if not sep:
            name, key = "", line
        name, key = name.strip(), key.strip()
        where = f"--api-keys {path} line {n}"
        if len(key) < MIN_KEY_LENGTH:
            raise ValueError(f"{where}: a key must be at least {MIN_KEY_LENGTH} characters")
        if sep and not _NAME.match(name):
            raise ValueError(f"{where}: tenant name {name!r} must match [A-Za-z0-9_.-]{{1,64}}")
        digest = _digest(key)
        if digest in keys:
            raise ValueError(f"{where}: this key is listed twice")
        keys[digest] = name or f"key-{digest.hex()[:12]}"
    if not keys:
        raise ValueError(f"--api-keys {path}: no keys in the file")
    return keys


@dataclass(frozen=True)
class Tenant:
    name: str
    scope: str  # prefix of its requests' backend ids ("" when auth is off)


ANONYMOUS = Tenant("anonymous", "")


class Permit:
    """One admitted generation's place under its tenant's concurrency cap. ``release`` is
    idempotent; whoever ends the generation calls it (``StreamLogger.keep`` takes it over
    with ``adopt``, so a resumable request that outlives its call still holds it)."""

    def __init__(self, on_release: Callable[[], None] | None) -> None:
        self._on_release = on_release
        self.adopted = False
        self._lock = threading.Lock()

    def adopt(self) -> Permit:
        self.adopted = True
        return self

    def release(self) -> None:
        with self._lock:
            fn, self._on_release = self._on_release, None
        if fn is not None:
            fn()


@dataclass
class _Usage:
    tokens: float
    refilled_at: float
    running: int = 0


@dataclass
class Gate:
    config: SecurityConfig = field(default_factory=SecurityConfig)
    keys: dict[bytes, str] = field(default_factory=dict)  # digest -> tenant name
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: SecurityConfig) -> Gate:
        keys = load_api_keys(config.api_keys_file) if config.api_keys_file else {}
        return cls(config, keys)

    @property
    def auth_required(self) -> bool:
        return bool(self.keys)

    @property
    def metrics_public(self) -> bool:
        public = self.config.metrics_public
        return not self.auth_required if public is None else public

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization: Bearer KEY`` value. Raises UnauthenticatedError
        when auth is on and the key is missing or unknown (the message never echoes it)."""
        if not self.auth_required:
            return ANONYMOUS
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise UnauthenticatedError("missing API key: send 'Authorization: Bearer <key>'")
        name = self.keys.get(_digest(key.strip()))
        if name is None:
            raise UnauthenticatedError("invalid API key")
        return Tenant(name, f"{name}/")

    def authorize_admin(self, tenant: Tenant) -> None:
        """Raise ForbiddenError unless ``tenant`` may make operators' calls: anyone when
        auth is off, else the tenants named in ``admin_tenants``."""
        if self.auth_required and tenant.name not in self.config.admin_tenants:
            raise ForbiddenError(f"tenant {tenant.name!r} may not do this: operators' calls "
                                 "need a key of a tenant listed in --admin-tenants")

    def deadline_for(self, tenant: Tenant, asked: float | None) -> float | None:
        """The seconds ``tenant``'s request waits at most: its own (``asked``: the gRPC
        deadline, ``x-request-timeout``), else its tenant's default (``tenant_deadlines``,
        then ``*``), else None."""
        if asked is not None:
            return asked
        d = self.config.tenant_deadlines
        return d.get(tenant.name, d.get("*"))

    def admit(self, tenant: Tenant) -> Permit:
        """A permit for one generation, or RateLimitedError (nothing held then)."""
        cfg = self.config
        if not cfg.rate_limit and not cfg.max_concurrent_per_key:
            return Permit(None)
        with self._lock:
            now = self.clock()
            burst = max(1.0, cfg.rate_limit)
            u = self._usage.setdefault(tenant.name, _Usage(burst, now))
            if cfg.max_concurrent_per_key and u.running >= cfg.max_concurrent_per_key:
                raise RateLimitedError(f"tenant {tenant.name!r} has {u.running} requests "
                                       f"running (limit {cfg.max_concurrent_per_key})")
            if cfg.rate_limit:
                u.tokens = min(burst, u.tokens + (now - u.refilled_at) * cfg.rate_limit)
                u.refilled_at = now
                if u.tokens < 1.0:
                    wait = (1.0 - u.tokens) / cfg.rate_limit
                    raise RateLimitedError(f"tenant {tenant.name!r} is over its rate limit "
                                           f"({cfg.rate_limit:g} requests/s)", wait)
                u.tokens -= 1.0
            u.running += 1
        return Permit(lambda: self._finished(tenant.name))

    def _finished(self, name: str) -> None:
        with self._lock:
            self._usage[name].running -= 1

    def running(self, tenant: Tenant) -> int:
        with self._lock:
            u = self._usage.get(tenant.name)
            return u.running if u else 0

    @staticmethod
    def scoped(tenant: Tenant, request_id: str) -> str:
        """The backend's id for ``tenant``'s request ``request_id``."""
        return tenant.scope + request_id
