"""KV event batches over Redis Streams: a worker's non-blocking sink and a router's reader.

Keys: one stream per worker, ``{namespace}:kvev:{worker_id}``; each entry has one field
``b``, the batch's ``KVEventBatch.to_json()``. Entries are appended in ``seq`` order by one
publisher thread per worker process. A restarted worker (new incarnation) appends to the same
key; its batch 1 is ``AllCleared``, so a reader that sees a new incarnation drops what it knew.

Trimming: every XADD passes ``MAXLEN ~ maxlen``, so a stream holds roughly the last
``maxlen`` batches (Redis trims whole internal nodes: the length may exceed ``maxlen`` by up
to a node, ~100 entries by default). Nothing else expires the key.

Loss is expected and cheap: batches trimmed before a reader got to them, batches the sink
dropped (its queue was full, or Redis was down: a Redis outage costs only the batches
published meanwhile, the worker never waits), or a Redis restart that lost the stream. The
reader detects all of them the same way, by a gap in ``KVEventBatch.seq`` (or a first ``seq``
other than the one after its last) within an incarnation, and then recovers from a worker
snapshot (``KVEventLog.snapshot`` / ``since``) - that recovery is the caller's job, not this
module's. Readers should also ignore a ``seq`` they have already applied.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from worker_protocol.kv_events import KVEventBatch

__all__ = ["KVStreamUnavailable", "RedisKVEventSink", "RedisKVEventSource", "stream_key"]

log = logging.getLogger(__name__)

DEFAULT_MAXLEN = 10_000
DEFAULT_QUEUE_MAX = 1024
_FIELD = "b"


class KVStreamUnavailable(RuntimeError):
    """Redis could not be reached (refused, timed out, lost): fall back to another feed."""


def stream_key(namespace: str, worker_id: str) -> str:
    """The Redis stream that holds ``worker_id``'s batches."""
    return f"{namespace}:kvev:{worker_id}"


def _redact(url: str) -> str:
    """The URL without its password (it goes to logs and exception messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _client(url: str, timeout_s: float, connect_timeout_s: float) -> redis.Redis:
    # No client-side retries: the default Retry of redis-py sleeps up to seconds, and a
    # retried XADD whose reply was lost would append the batch twice. The pool already
    # replaces connections the server closed (e.g. after a Redis restart).
    try:
        return redis.Redis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                    socket_connect_timeout=connect_timeout_s,
                                    retry=Retry(NoBackoff(), 0))
    except ValueError as e:
        raise ValueError(f"bad Redis URL {_redact(url)!r}: {e}") from e


def _check_names(namespace: str, worker_id: str | None = None) -> None:
    if not namespace:
        raise ValueError("namespace must be non-empty")
    if worker_id is not None and not worker_id:
        raise ValueError("worker_id must be non-empty")


class RedisKVEventSink:
    """A ``KVEventLog`` sink that publishes each batch to the worker's stream, off-thread.

    Calling it (``sink(batch)``) never blocks on I/O and never raises: the batch goes on a
    bounded queue (``queue_max``) that one daemon thread XADDs from. A batch is dropped, and
    ``dropped`` counted, when the queue is full or its XADD fails; ``published`` counts
    batches Redis accepted. While Redis is down the thread keeps trying each later batch,
    waiting a backoff (``retry_backoff_s`` doubling up to ``max_backoff_s``) after every
    failure, and logs one warning per outage. Construction does not connect (a worker starts
    even when Redis is down); a malformed URL raises ``ValueError``.
    """

    def __init__(self, url: str, namespace: str, worker_id: str,
                 maxlen: int = DEFAULT_MAXLEN, queue_max: int = DEFAULT_QUEUE_MAX, *,
                 socket_timeout_s: float = 2.0, retry_backoff_s: float = 0.05,
                 max_backoff_s: float = 1.0) -> None:
        _check_names(namespace, worker_id)
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        if queue_max < 1:
            raise ValueError(f"queue_max must be >= 1, got {queue_max}")
        self.key = stream_key(namespace, worker_id)
        self.maxlen = maxlen
        self.published = 0
        self.dropped = 0
        self._url = _redact(url)
        self._r = _client(url, socket_timeout_s, socket_timeout_s)
        self._join_s = 2 * socket_timeout_s + 1.0  # one XADD in flight, with its connect
        self._backoff_s = (retry_backoff_s, max_backoff_s)
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize=queue_max)
        self._lock = threading.Lock()  # counters: written by the caller and the thread
        self._pending = 0  # queued or being written
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-stream-{worker_id}",
                                        daemon=True)
        self._thread.start()

    def __call__(self, batch: KVEventBatch) -> None:
        if self._stop.is_set():
            self._count_drop()
            return
        with self._lock:
            self._pending += 1  # before the put: the thread may finish it at once
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._count_drop(pending=True)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued batch was published or dropped; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._pending == 0:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def close(self) -> None:
        """Stop the thread (waits at most for one XADD in flight) and close the connection.
        Batches still queued are dropped: call ``flush`` first to publish them."""
        self._stop.set()
        self._thread.join(self._join_s)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            self._count_drop(pending=True)
        self._r.close()

    def _count_drop(self, pending: bool = False) -> None:
        with self._lock:
            self.dropped += 1
            if pending:
                self._pending -= 1

    def _run(self) -> None:
        backoff = self._backoff_s[0]
        down = False
        dropped_before = 0  # self.dropped at the last success, for the recovery log line
        while not self._stop.is_set():
            try:
                batch = self._queue.get(timeout=0.1)  # wakes up to notice close()
            except queue.Empty:
                continue
            try:
                self._r.xadd(self.key, {_FIELD: batch.to_json()}, maxlen=self.maxlen,
                             approximate=True)
            except Exception as e:  # the thread must outlive any failure
                self._count_drop(pending=True)
                if not isinstance(e, redis.RedisError):
                    log.exception("KV event stream %s: batch %d dropped", self.key, batch.seq)
                    continue
                if not down:
                    down = True
                    log.warning("KV event stream %s: Redis at %s unavailable (%s); dropping "
                                "batches until it is back", self.key, self._url, e)
                self._stop.wait(backoff)  # don't spin on a dead server
                backoff = min(backoff * 2, self._backoff_s[1])
                continue
            with self._lock:
                self.published += 1
                self._pending -= 1
                dropped_now = self.dropped
            if down:
                down, backoff = False, self._backoff_s[0]
                log.info("KV event stream %s: Redis at %s is back; %d batches dropped "
                         "meanwhile", self.key, self._url, dropped_now - dropped_before)
            dropped_before = dropped_now


class RedisKVEventSource:
    """Reads workers' batch streams for a router. Construction does not connect.

    Every call raises ``KVStreamUnavailable`` when Redis cannot be reached (the caller falls
    back, e.g. to pulling ``KVEventLog.since`` from the workers). A reply takes at most
    ``socket_timeout_s`` (plus ``block_ms`` for a blocking read) on a dead server.
    """

    def __init__(self, url: str, namespace: str, *, socket_timeout_s: float = 2.0) -> None:
        _check_names(namespace)
        self.namespace = namespace
        self._url = url
        self._timeout_s = socket_timeout_s
        self._r = _client(url, socket_timeout_s, socket_timeout_s)
        # Blocking reads need a longer socket timeout than the block; one client per block_ms.
        self._blocking: dict[int, redis.Redis] = {}
        self._bad: set[tuple[str, str]] = set()  # unparsable entries already logged

    def read(self, cursors: dict[str, str], block_ms: int = 0,
             count: int = 1000) -> list[tuple[str, str, KVEventBatch]]:
        """The batches after each worker's cursor, as ``(worker_id, entry_id, batch)``.

        ``cursors`` maps worker id -> the last entry id read (``"0-0"``: from the oldest
        entry the stream still holds). Results come grouped by worker, in stream order, at
        most ``count`` per worker; pass each worker's last returned entry id back as its next
        cursor. ``block_ms`` > 0 waits up to that long when no worker has anything new
        (0 = answer at once). Unparsable entries are logged and skipped (a seq gap for the
        reader). An id Redis rejects raises ``redis.ResponseError``.
        """
        if not cursors:
            return []
        if block_ms < 0 or count < 1:
            raise ValueError(f"need block_ms >= 0 and count >= 1, got {block_ms}, {count}")
        workers = {stream_key(self.namespace, w): w for w in cursors}
        streams = {stream_key(self.namespace, w): c for w, c in cursors.items()}
        client = self._client_for(block_ms)
        reply = self._call(client.xread, streams, count=count, block=block_ms or None)
        if not reply:
            return []
        # RESP2 answers [[key, entries], ...]; RESP3 (?protocol=3) {key: [entries]}.
        if isinstance(reply, dict):
            reply = [(key, wrapped[0]) for key, wrapped in reply.items()]
        out: list[tuple[str, str, KVEventBatch]] = []
        for key, entries in reply:
            worker = workers[key]
            for entry_id, fields in entries:
                batch = self._parse(worker, entry_id, fields)
                if batch is not None:
                    out.append((worker, entry_id, batch))
        return out

    def length(self, worker_id: str) -> int:
        """How many entries the worker's stream holds now (XLEN)."""
        return int(self._call(self._r.xlen, stream_key(self.namespace, worker_id)))

    def close(self) -> None:
        for client in (self._r, *self._blocking.values()):
            client.close()
        self._blocking.clear()

    def _client_for(self, block_ms: int) -> redis.Redis:
        if block_ms == 0:
            return self._r
        client = self._blocking.get(block_ms)
        if client is None:
            client = _client(self._url, self._timeout_s + block_ms / 1000, self._timeout_s)
            self._blocking[block_ms] = client
        return client

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise KVStreamUnavailable(f"Redis at {_redact(self._url)} is unavailable: {e}"
                                      ) from e

    def _parse(self, worker: str, entry_id: str, fields: dict | None) -> KVEventBatch | None:
        try:
            return KVEventBatch.from_json(fields[_FIELD])
        except Exception as e:  # a bad entry must not stop the reader
            if (worker, entry_id) not in self._bad:  # a cursor behind it re-reads it
                if len(self._bad) >= 10_000:
                    self._bad.clear()
                self._bad.add((worker, entry_id))
                log.warning("KV event stream %s: skipping unparsable entry %s: %r",
                            stream_key(self.namespace, worker), entry_id, e)
            return None
