"""RedisStore: the production ClusterStore backend (router/state/store.py holds the contract).

All keys live under ``{namespace}:``; expiry uses Redis TTLs; heartbeats and journal appends
are Lua scripts so each is atomic. Connection failures surface as StoreUnavailableError.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import asdict

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from router.state.store import (
    DEFAULT_JOURNAL_TTL_S,
    DEFAULT_STREAM_TTL_S,
    ClusterStore,
    JournalEvent,
    StoreUnavailableError,
    StreamLog,
    StreamRecord,
    UnknownWorkerError,
    WorkerLoad,
    WorkerRecord,
    check_role,
    check_ttl,
    from_dict,
    redact_url,
)

__all__ = ["RedisStore"]


def _unavailable(fn):
    """Turn redis connection/timeout errors into StoreUnavailableError."""
    @functools.wraps(fn)
    def wrapper(self: RedisStore, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise StoreUnavailableError(f"Redis at {redact_url(self.url)} is unavailable: {e}"
                                        ) from e
    return wrapper


# Extend the worker's TTL only if it is still registered, atomically with the load update,
# so a heartbeat can never resurrect a lapsed worker's load without its record.
_HEARTBEAT_LUA = """
if redis.call('pexpire', KEYS[1], ARGV[1]) == 0 then return 0 end
if ARGV[2] ~= '' then redis.call('set', KEYS[2], ARGV[2], 'PX', ARGV[1])
else redis.call('pexpire', KEYS[2], ARGV[1]) end
return 1
"""


# Append + index the journal with the *server's* clock, strictly increasing, so
# journal_recent orders appends from many routers correctly even within one microsecond.
_JOURNAL_APPEND_LUA = """
redis.call('rpush', KEYS[1], ARGV[1])
redis.call('pexpire', KEYS[1], ARGV[2])
local t = redis.call('time')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('get', KEYS[3]) or '0')
if now_us <= last then now_us = last + 1 end
redis.call('set', KEYS[3], now_us)
redis.call('zadd', KEYS[2], now_us, ARGV[3])
redis.call('zremrangebyscore', KEYS[2], '-inf', now_us - tonumber(ARGV[2]) * 1000)
return 1
"""


# Append to a stream log only if it was opened, has not expired, has not ended and (when an
# owner is given) is still that owner's; keep its keys' TTLs together. KEYS: rec, tok, end,
# own. ARGV: ttl ms, finish reason ('' = still live), fence ('' = none, else '=' .. owner),
# token ids...
_STREAM_APPEND_LUA = """
if redis.call('exists', KEYS[1]) == 0 or redis.call('exists', KEYS[3]) == 1 then return 0 end
if ARGV[3] ~= '' and '=' .. (redis.call('get', KEYS[4]) or '') ~= ARGV[3] then return 0 end
if #ARGV > 3 then redis.call('rpush', KEYS[2], unpack(ARGV, 4)) end
if ARGV[2] ~= '' then redis.call('set', KEYS[3], ARGV[2]) end
for i = 1, 4 do redis.call('pexpire', KEYS[i], ARGV[1]) end
return 1
"""

# Compare-and-set of a live log's owner. KEYS: rec, tok, end, own. ARGV: expected owner, new
# owner, ttl ms.
_STREAM_CLAIM_LUA = """
if redis.call('exists', KEYS[1]) == 0 or redis.call('exists', KEYS[3]) == 1 then return 0 end
if (redis.call('get', KEYS[4]) or '') ~= ARGV[1] then return 0 end
redis.call('set', KEYS[4], ARGV[2], 'PX', ARGV[3])
return 1
"""


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisStore(ClusterStore):
    """Redis backend; every key lives under ``{namespace}:``.

    Keys: ``worker:{id}`` (JSON record, PX ttl), ``load:{id}`` (JSON, same ttl), ``workers``
    (set of ids, cleaned lazily), ``journal:{rid}`` (list of JSON events, PX journal ttl),
    ``journals`` (zset rid -> last append, server clock in us, for journal_recent),
    ``stream:{rid}:rec|tok|end|own`` (a stream log: JSON record, token list, finish reason,
    current owner; one PX stream ttl, renewed by every append), ``response:{key}`` (a stored
    Responses-API response, JSON, PX its ttl).

    Raises StoreUnavailableError at construction if Redis cannot be pinged, and from any call
    that loses the connection.
    """

    def __init__(self, url: str, namespace: str = "pdcluster",
                 journal_ttl_s: float = DEFAULT_JOURNAL_TTL_S,
                 connect_timeout_s: float = 2.0, socket_timeout_s: float = 5.0,
                 stream_ttl_s: float = DEFAULT_STREAM_TTL_S) -> None:
        check_ttl(journal_ttl_s, "journal_ttl_s")
        check_ttl(stream_ttl_s, "stream_ttl_s")
        self._stream_ttl_ms = _ms(stream_ttl_s)
        if not namespace:
            raise ValueError("namespace must be non-empty")
        self.url = url
        self.namespace = namespace
        self._journal_ttl_ms = _ms(journal_ttl_s)
        try:
            self._r = redis.Redis.from_url(
                url, decode_responses=True, socket_connect_timeout=connect_timeout_s,
                socket_timeout=socket_timeout_s,
                # A couple of quick retries ride out a blip without hiding a dead server.
                retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2))
        except ValueError as e:
            raise ValueError(f"bad Redis URL {redact_url(url)!r}: {e}") from e
        self._heartbeat = self._r.register_script(_HEARTBEAT_LUA)
        self._journal_append = self._r.register_script(_JOURNAL_APPEND_LUA)
        self._stream_append = self._r.register_script(_STREAM_APPEND_LUA)
        self._stream_claim = self._r.register_script(_STREAM_CLAIM_LUA)
        self.ping()

    @_unavailable
    def ping(self) -> None:
        self._r.ping()

    @_unavailable
    def epoch(self) -> str:
        # The first caller after the data was lost sets a fresh token; everyone reads it.
        self._r.set(self._k("epoch"), uuid.uuid4().hex, nx=True)
        return self._r.get(self._k("epoch")) or ""

    def _k(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    @_unavailable
    def register_worker(self, rec: WorkerRecord, ttl_s: float) -> None:
        check_ttl(ttl_s)
        wid = rec.worker_id
        with self._r.pipeline(transaction=True) as p:
            p.set(self._k("worker", wid), json.dumps(rec.to_dict()), px=_ms(ttl_s))
            p.delete(self._k("load", wid))
            p.sadd(self._k("workers"), wid)
            p.execute()

    @_unavailable
    def heartbeat(self, worker_id: str, ttl_s: float, load: WorkerLoad | None = None) -> None:
        check_ttl(ttl_s)
        payload = json.dumps(asdict(load)) if load is not None else ""
        ok = self._heartbeat(keys=[self._k("worker", worker_id), self._k("load", worker_id)],
                             args=[_ms(ttl_s), payload])
        if not ok:
            raise UnknownWorkerError(f"heartbeat from unregistered or expired worker {worker_id!r}")

    @_unavailable
    def deregister_worker(self, worker_id: str) -> None:
        with self._r.pipeline(transaction=True) as p:
            p.delete(self._k("worker", worker_id), self._k("load", worker_id))
            p.srem(self._k("workers"), worker_id)
            p.execute()

    def _live_records(self) -> list[WorkerRecord]:
        ids = sorted(self._r.smembers(self._k("workers")))
        if not ids:
            return []
        raw = self._r.mget([self._k("worker", wid) for wid in ids])
        dead = [wid for wid, v in zip(ids, raw, strict=True) if v is None]
        if dead:  # their keys expired: drop the ids
            self._r.srem(self._k("workers"), *dead)
        return [WorkerRecord.from_dict(json.loads(v)) for v in raw if v is not None]

    @_unavailable
    def list_workers(self, role: str | None = None) -> list[WorkerRecord]:
        check_role(role)
        return [r for r in self._live_records() if role is None or r.role == role]

    @_unavailable
    def get_load(self, worker_id: str) -> WorkerLoad | None:
        alive, raw = self._r.mget([self._k("worker", worker_id), self._k("load", worker_id)])
        if alive is None or raw is None:
            return None
        return from_dict(WorkerLoad, json.loads(raw))

    @_unavailable
    def journal_append(self, request_id: str, event: JournalEvent) -> None:
        self._journal_append(
            keys=[self._k("journal", request_id), self._k("journals"), self._k("journals_last")],
            args=[json.dumps(event.to_dict()), self._journal_ttl_ms, request_id])

    @_unavailable
    def journal_get(self, request_id: str) -> list[JournalEvent]:
        raw = self._r.lrange(self._k("journal", request_id), 0, -1)
        return [JournalEvent.from_dict(json.loads(v)) for v in raw]

    @_unavailable
    def journal_recent(self, limit: int = 100) -> list[str]:
        if limit <= 0:
            return []
        secs, micros = self._r.time()
        min_us = secs * 1_000_000 + micros - self._journal_ttl_ms * 1000
        return self._r.zrevrangebyscore(self._k("journals"), "+inf", f"({min_us}",
                                        start=0, num=limit)

    def _stream_keys(self, request_id: str) -> list[str]:
        return [self._k("stream", request_id, part) for part in ("rec", "tok", "end", "own")]

    @_unavailable
    def stream_open(self, record: StreamRecord) -> None:
        rec, tok, end, own = self._stream_keys(record.request_id)
        with self._r.pipeline(transaction=True) as p:
            p.delete(tok, end)
            p.set(rec, json.dumps(record.to_dict()), px=self._stream_ttl_ms)
            p.set(own, record.owner, px=self._stream_ttl_ms)
            p.execute()

    @_unavailable
    def response_put(self, key: str, doc: dict, ttl_s: float) -> None:
        check_ttl(ttl_s, "ttl_s")
        self._r.set(self._k("response", key), json.dumps(doc), px=_ms(ttl_s))

    @_unavailable
    def response_get(self, key: str) -> dict | None:
        raw = self._r.get(self._k("response", key))
        return json.loads(raw) if raw is not None else None

    @_unavailable
    def stream_claim(self, request_id: str, owner: str, expect_owner: str) -> bool:
        return bool(self._stream_claim(keys=self._stream_keys(request_id),
                                       args=[expect_owner, owner, self._stream_ttl_ms]))

    @_unavailable
    def stream_append(self, request_id: str, token_ids: list[int],
                      finish_reason: str | None = None, owner: str | None = None) -> None:
        fence = "" if owner is None else "=" + owner
        self._stream_append(keys=self._stream_keys(request_id),
                            args=[self._stream_ttl_ms, finish_reason or "", fence, *token_ids])

    @_unavailable
    def stream_read(self, request_id: str, from_index: int = 0) -> StreamLog | None:
        if from_index < 0:
            raise ValueError(f"from_index must be >= 0, got {from_index}")
        rec, tok, end, own = self._stream_keys(request_id)
        with self._r.pipeline(transaction=True) as p:
            p.get(rec)
            p.lrange(tok, from_index, -1)
            p.llen(tok)
            p.get(end)
            p.get(own)
            raw, tokens, total, reason, owner = p.execute()
        if raw is None:
            return None
        return StreamLog(StreamRecord.from_dict(json.loads(raw)), [int(t) for t in tokens],
                         total, reason, owner or "")

    def close(self) -> None:
        self._r.close()
