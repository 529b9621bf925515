"""What a worker does with its KV events, the same for both worker kinds: a ``KVEventLog`` that
routers pull from, and a Redis Streams sink beside it when the cluster has Redis.

Apart from ``worker_protocol.kv_events`` (the batches and the log, which the router reads too)
because it also needs the Redis sink (``worker_protocol.kv_stream``), which imports the batches.
"""

from __future__ import annotations

from collections.abc import Callable

from worker_protocol.kv_events import KVEventFeed, KVEventLog, KVSnapshot

__all__ = ["WorkerKVEvents"]


class WorkerKVEvents:
    """A worker's side of KV events, the same for both kinds: publishes its engine's events
    after every step (``after_work``, the engine loop's hook), answers routers' pulls
    (``since``) and snapshots (``snapshot``, on the engine thread), and publishes to Redis
    Streams as well when ``redis_url`` is set."""

    def __init__(self, engine, worker_id: str, incarnation: str,
                 redis_url: str | None = None, namespace: str = "pdcluster") -> None:
        """``engine``: the worker's LLMEngine, before its loop starts (its events are
        recorded from here on)."""
        engine.record_kv_events()
        block_size = engine.stats().block_size
        self._close: Callable[[], None] = lambda: None
        sink = None
        if redis_url is not None:
            # Imported only here: a worker without Redis never loads the client.
            from worker_protocol.kv_stream import RedisKVEventSink

            sink = RedisKVEventSink(redis_url, namespace, worker_id)
            self._close = sink.close
        self.log = KVEventLog(worker_id, incarnation, block_size, sink=sink)

    def after_work(self, engine) -> None:
        """Publish what the engine's prefix cache did since the last call (engine thread)."""
        self.log.publish(engine.take_kv_events())

    def snapshot(self, engine) -> KVSnapshot:
        """The engine's prefix cache now, every tier's blocks with their cheapest tier, with
        the seq it follows (engine thread)."""
        self.after_work(engine)
        tiers = engine.cached_block_tiers()  # hash -> tier, the same set as the events'
        return self.log.snapshot(list(tiers), list(tiers.values()))

    def since(self, seq: int, incarnation: str) -> KVEventFeed:
        return self.log.since(seq, incarnation)

    def close(self) -> None:
        self._close()
