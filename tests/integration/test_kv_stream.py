"""KV event batches over Redis Streams, against a redis-server of the test's own (free port).

What a router relies on is asserted: batches arrive in order and intact, the stream stays
bounded and a reader can tell it missed the trimmed head (seq > 1), a dead Redis never
blocks the worker's engine thread (batches are dropped and counted, one warning), publishing
resumes once Redis is back, and cursors return only what is new.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from engine.core.kv_events import AllCleared, BlockRemoved, BlockStored
from tests.helpers.async_util import wait_until
from tests.helpers.redis_server import OwnRedis
from worker_protocol.kv_events import KVEventBatch, KVEventLog
from worker_protocol.kv_stream import (
    KVStreamUnavailable,
    RedisKVEventSink,
    RedisKVEventSource,
    stream_key,
)

pytestmark = pytest.mark.redis


def _until(pred, timeout_s: float = 5.0, what: str = "condition") -> None:
    wait_until(pred, timeout_s, what, poll_s=0.01)


def _events(i: int) -> list:
    """One step's events: new blocks (64-bit hashes, as hash_block makes), some evictions."""
    stored = BlockStored(tuple((i * 7919 + k) * 0x9E3779B97F4A7C15 % 2**64 for k in range(4)))
    return [stored, BlockRemoved((i,))] if i % 3 == 0 else [stored]


def _read_all(source: RedisKVEventSource, worker: str, cursor: str = "0-0"):
    """Everything after ``cursor``, in as many reads as it takes."""
    out = []
    while chunk := source.read({worker: cursor}, count=500):
        out += chunk
        cursor = chunk[-1][1]
    return out


def test_batches_round_trip_in_order(own_redis):
    sink = RedisKVEventSink(own_redis.url, "rt", "w0")
    source = RedisKVEventSource(own_redis.url, "rt")
    try:
        kv_log = KVEventLog("w0", "inc-1", 16, sink=sink)
        for i in range(300):
            kv_log.publish(_events(i))
        assert sink.flush(5.0)
        got = _read_all(source, "w0")
        assert [w for w, _, _ in got] == ["w0"] * 301
        batches = [b for _, _, b in got]
        assert [b.seq for b in batches] == list(range(1, 302))
        assert batches[0].events == (AllCleared(),)
        assert batches == list(kv_log.since(0, "inc-1").batches)  # identical content
        assert (sink.published, sink.dropped) == (301, 0)
        assert source.length("w0") == 301
    finally:
        sink.close()
        source.close()


def test_the_stream_stays_bounded_and_a_reader_sees_the_trimmed_head(own_redis):
    sink = RedisKVEventSink(own_redis.url, "trim", "w0", maxlen=100, queue_max=4096)
    source = RedisKVEventSource(own_redis.url, "trim")
    try:
        kv_log = KVEventLog("w0", "inc-1", 16, sink=sink)
        for i in range(2000):
            kv_log.publish(_events(i))
        assert sink.flush(10.0)
        assert (sink.published, sink.dropped) == (2001, 0)
        assert 100 <= source.length("w0") <= 300  # MAXLEN ~: trimmed by whole nodes
        seqs = [b.seq for _, _, b in _read_all(source, "w0")]
        assert seqs[0] > 1, "the reader must be able to tell it missed the head"
        assert seqs == list(range(seqs[0], 2002))  # what is kept is a contiguous tail
    finally:
        sink.close()
        source.close()


def test_a_dead_redis_never_blocks_the_publisher_and_publishing_resumes(own_redis, caplog):
    """Redis hangs, then dies: publishing goes on at once throughout."""
    caplog.set_level(logging.INFO, logger="worker_protocol.kv_stream")
    socket_timeout_s = 2.0
    sink = RedisKVEventSink(own_redis.url, "out", "w0", queue_max=8, max_backoff_s=0.2,
                            socket_timeout_s=socket_timeout_s)
    source = RedisKVEventSource(own_redis.url, "out")
    try:
        kv_log = KVEventLog("w0", "inc-1", 16, sink=sink)
        kv_log.publish(_events(0))
        assert sink.flush(5.0) and sink.published == 2
        own_redis.pause()  # hung: any call to it waits out the sink's socket timeout

        t0 = time.monotonic()
        for i in range(1, 51):
            kv_log.publish(_events(i))
        publish_s = time.monotonic() - t0
        # A publish that waited on Redis even once would have taken a whole socket timeout.
        assert publish_s < socket_timeout_s, (
            f"50 publishes took {publish_s:.2f} s while Redis hung")
        # Dropped by the caller, not waited for: the queue holds 8, the sink's thread (stuck in
        # an XADD) maybe one more.
        assert sink.dropped >= 50 - 8 - 1
        own_redis.kill()
        cpu0 = time.process_time()
        time.sleep(0.3)  # the thread retries the queued batches meanwhile, backing off
        assert time.process_time() - cpu0 < 0.15, "the publisher spins while Redis is down"
        _until(lambda: sink.dropped > 50 - 8 - 1, what="the thread dropping batches")
        with pytest.raises(KVStreamUnavailable, match=f"127.0.0.1:{own_redis.port}"):
            source.read({"w0": "0-0"})
        with pytest.raises(KVStreamUnavailable, match=f"127.0.0.1:{own_redis.port}"):
            source.length("w0")
        assert sink.flush(5.0)  # the queue drains (all dropped), the thread did not hang
        assert sink.published == 2 and sink.dropped == 50
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage(), (
            "one warning per outage, not one per batch")

        own_redis.start()  # empty: it kept nothing
        last = kv_log.publish(_events(51))

        def arrived() -> bool:
            return any(b.seq == last.seq for _, _, b in source.read({"w0": "0-0"}))
        _until(arrived, what="a batch published after the restart arriving")
        seqs = [b.seq for _, _, b in source.read({"w0": "0-0"})]
        assert seqs == [53], "the restarted stream starts after a hole the reader can see"
        assert (sink.published, sink.dropped) == (3, 50)
        back = "is back; 50 batches dropped meanwhile"
        assert any(back in r.getMessage() for r in caplog.records)
    finally:
        sink.close()
        source.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_cursors_return_only_newer_batches(own_redis, protocol):
    url = f"{own_redis.url}?protocol={protocol}"
    sinks = {w: RedisKVEventSink(url, "cur", w) for w in ("w0", "w1")}
    source = RedisKVEventSource(url, "cur")
    try:
        logs = {w: KVEventLog(w, "inc-1", 16, sink=s) for w, s in sinks.items()}
        for i in range(5):
            logs["w0"].publish(_events(i))
        logs["w1"].publish(_events(9))
        assert all(s.flush(5.0) for s in sinks.values())
        got = source.read({"w0": "0-0", "w1": "0-0"})
        assert [(w, b.seq) for w, _, b in got] == [("w0", s) for s in range(1, 7)] + [
            ("w1", 1), ("w1", 2)]
        cursors = {w: [e for x, e, _ in got if x == w][-1] for w in ("w0", "w1")}

        for i in range(3):
            logs["w0"].publish(_events(10 + i))
        # A corrupt entry (not ours) between them is skipped, the reader goes on.
        raw = redis.Redis(port=own_redis.port)
        raw.xadd(stream_key("cur", "w0"), {"b": "not json"})
        raw.close()
        logs["w0"].publish(_events(13))
        assert sinks["w0"].flush(5.0)
        newer = source.read(cursors)
        assert [(w, b.seq) for w, _, b in newer] == [("w0", 7), ("w0", 8), ("w0", 9),
                                                     ("w0", 10)]
        cursors["w0"] = newer[-1][1]
        assert source.read(cursors) == []

        # A blocking read returns as soon as a batch arrives, and [] when none does.
        t0 = time.monotonic()
        assert source.read(cursors, block_ms=100) == []
        assert time.monotonic() - t0 >= 0.09
        timer = threading.Timer(0.1, logs["w1"].publish, [_events(20)])
        timer.start()
        t0 = time.monotonic()
        woke = source.read(cursors, block_ms=3000)
        timer.join()
        assert [(w, b.seq) for w, _, b in woke] == [("w1", 3)]
        assert isinstance(woke[0][2], KVEventBatch) and time.monotonic() - t0 < 2.0
    finally:
        for s in sinks.values():
            s.close()
        source.close()


def test_nothing_connects_until_used_and_bad_arguments_are_refused():
    never = OwnRedis()  # not started: construction must not need Redis
    sink = RedisKVEventSink(never.url, "x", "w0", queue_max=2)
    source = RedisKVEventSource(never.url, "x")
    try:
        kv_log = KVEventLog("w0", "inc-1", 16, sink=sink)
        kv_log.publish(_events(1))
        assert sink.flush(5.0) and sink.published == 0 and sink.dropped == 2
        with pytest.raises(KVStreamUnavailable, match=f"127.0.0.1:{never.port}"):
            source.read({"w0": "0-0"}, block_ms=50)
        assert source.read({}) == []
    finally:
        sink.close()
        source.close()
    sink(KVEventBatch("w0", "inc-1", 3, 16, ()))  # after close: dropped, never raised
    assert sink.dropped == 3
    for field, value in (("maxlen", 0), ("queue_max", 0), ("worker_id", ""), ("namespace", "")):
        args = {"url": never.url, "namespace": "x", "worker_id": "w0", field: value}
        with pytest.raises(ValueError, match=field):
            RedisKVEventSink(**args)
    with pytest.raises(ValueError, match=r"\*\*\*"):
        RedisKVEventSource("redis://:pw@127.0.0.1:notaport/0", "x").length("w0")
