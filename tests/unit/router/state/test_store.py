"""ClusterStore behaviour contract, run here against InMemoryStore (fake clock, no sleeping).

``StoreContract`` is the one shared suite: tests/integration/test_redis_store.py subclasses
it with a Redis-backed harness, so both backends pass exactly the same tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from router.state.factory import make_store
from router.state.memory import InMemoryStore
from router.state.store import (
    ClusterStore,
    JournalEvent,
    StreamLog,
    StreamRecord,
    UnknownWorkerError,
    WorkerLoad,
    WorkerRecord,
)


def worker(worker_id: str, role: str = "decode", port: int = 29500) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, node_id="node-0", kv_host="10.0.0.7",
                        kv_port=port, num_kv_blocks=1024, block_size=16,
                        model_id="tiny-llama", started_at=1_700_000_000.5)


def load(used: int = 10, running: int = 2) -> WorkerLoad:
    return WorkerLoad(worker_id="decode-0", role="decode", kv_blocks_used=used,
                      kv_blocks_total=1024, requests_running=running, requests_waiting=1,
                      kv_blocks_reserved=3, kv_transfer_bytes=4096, reported_at=1_700_000_001.25)


@dataclass
class Harness:
    """What a backend gives the contract: a store, a way to let time pass, and a factory
    for extra stores on the same backend (with custom options)."""

    store: ClusterStore
    ttl_s: float  # a short TTL this backend can wait out quickly
    elapse: Callable[[float], None]  # let (at least) this many seconds pass
    wait_until: Callable[[Callable[[], bool], float], None]  # fails the test on timeout
    make: Callable[..., ClusterStore]
    extra: list[ClusterStore] = field(default_factory=list)


class StoreContract:
    """Behaviour every ClusterStore backend must have. Subclasses provide fixture ``h``."""

    # -- registry -------------------------------------------------------------------------

    def test_register_list_round_trip(self, h: Harness):
        a, b = worker("d1", port=1), worker("p1", role="prefill", port=2)
        h.store.register_worker(b, ttl_s=60)
        h.store.register_worker(a, ttl_s=60)
        assert h.store.list_workers() == [a, b]  # every field survives, sorted by id

    def test_role_filter(self, h: Harness):
        for wid, role in [("d1", "decode"), ("d2", "decode"), ("p1", "prefill"),
                          ("c1", "colocated")]:
            h.store.register_worker(worker(wid, role), ttl_s=60)
        assert [w.worker_id for w in h.store.list_workers("decode")] == ["d1", "d2"]
        assert [w.worker_id for w in h.store.list_workers("prefill")] == ["p1"]
        assert [w.worker_id for w in h.store.list_workers("colocated")] == ["c1"]
        with pytest.raises(ValueError, match="role"):
            h.store.list_workers("decoder")

    def test_worker_expires_without_heartbeat(self, h: Harness):
        h.store.register_worker(worker("d1"), ttl_s=h.ttl_s)
        h.store.register_worker(worker("d2"), ttl_s=3600)
        h.store.heartbeat("d1", ttl_s=h.ttl_s, load=load())
        assert len(h.store.list_workers()) == 2
        h.wait_until(lambda: [w.worker_id for w in h.store.list_workers()] == ["d2"], h.ttl_s)
        assert h.store.get_load("d1") is None
        with pytest.raises(UnknownWorkerError, match="d1"):
            h.store.heartbeat("d1", ttl_s=60)

    def test_heartbeat_extends_liveness(self, h: Harness):
        h.store.register_worker(worker("d1"), ttl_s=h.ttl_s)
        h.store.heartbeat("d1", ttl_s=3600)
        h.elapse(h.ttl_s * 1.5)
        assert [w.worker_id for w in h.store.list_workers()] == ["d1"]

    def test_heartbeat_unknown_worker_raises(self, h: Harness):
        with pytest.raises(UnknownWorkerError, match="ghost"):
            h.store.heartbeat("ghost", ttl_s=60, load=load())
        assert h.store.get_load("ghost") is None  # the refused load was not stored

    def test_deregister_removes_worker_and_load(self, h: Harness):
        h.store.register_worker(worker("d1"), ttl_s=60)
        h.store.register_worker(worker("d2"), ttl_s=60)
        h.store.heartbeat("d1", ttl_s=60, load=load())
        h.store.deregister_worker("d1")
        h.store.deregister_worker("never-registered")  # ignored
        assert [w.worker_id for w in h.store.list_workers()] == ["d2"]
        assert h.store.get_load("d1") is None
        with pytest.raises(UnknownWorkerError):
            h.store.heartbeat("d1", ttl_s=60)

    def test_load_round_trip(self, h: Harness):
        h.store.register_worker(worker("d1"), ttl_s=60)
        assert h.store.get_load("d1") is None  # registered, no report yet
        h.store.heartbeat("d1", ttl_s=60, load=load(used=10))
        assert h.store.get_load("d1") == load(used=10)
        h.store.heartbeat("d1", ttl_s=60)  # no load: keeps the last report
        assert h.store.get_load("d1") == load(used=10)
        h.store.heartbeat("d1", ttl_s=60, load=load(used=99, running=7))
        assert h.store.get_load("d1") == load(used=99, running=7)
        h.store.register_worker(worker("d1"), ttl_s=60)  # a restarted worker starts clean
        assert h.store.get_load("d1") is None

    def test_bad_input_is_refused(self, h: Harness):
        with pytest.raises(ValueError, match="ttl_s"):
            h.store.register_worker(worker("d1"), ttl_s=0)
        with pytest.raises(ValueError, match="role"):
            worker("x", role="router")
        with pytest.raises(ValueError, match="kind"):
            JournalEvent(ts=1.0, kind="started", worker_id=None)

    # -- journal --------------------------------------------------------------------------

    def test_journal_keeps_order_and_fields(self, h: Harness):
        events = [JournalEvent(1.0, "received", None),
                  JournalEvent(2.0, "reserved", "d1", "12 blocks"),
                  JournalEvent(3.0, "prefilled", "p1"),
                  JournalEvent(2.5, "finished", "d1", "stop")]  # ts out of order: append order wins
        for e in events:
            h.store.journal_append("req-1", e)
        h.store.journal_append("req-2", JournalEvent(4.0, "aborted", None, "client cancel"))
        assert h.store.journal_get("req-1") == events
        assert h.store.journal_get("req-2") == [JournalEvent(4.0, "aborted", None, "client cancel")]
        assert h.store.journal_get("unknown") == []
        assert h.store.journal_recent(10) == ["req-2", "req-1"]
        h.store.journal_append("req-1", JournalEvent(5.0, "retried", "d2"))
        assert h.store.journal_recent(1) == ["req-1"]

    def test_journal_expires(self, h: Harness):
        store = h.make(journal_ttl_s=h.ttl_s)
        store.journal_append("req-1", JournalEvent(1.0, "received", None))
        assert store.journal_get("req-1") == [JournalEvent(1.0, "received", None)]
        h.wait_until(lambda: store.journal_get("req-1") == [] and store.journal_recent() == [],
                     h.ttl_s)

    # -- stream logs ----------------------------------------------------------------------

    def test_stream_log_reads_from_any_index_and_ends_with_its_reason(self, h: Harness):
        rec = StreamRecord("req-s", 3, 6, ["\n\n"], False, "tiny-llama", "chat")
        h.store.stream_open(rec)
        assert h.store.stream_read("req-s") == StreamLog(rec, [], 0, None, "")
        h.store.stream_append("req-s", [11, 12])
        h.store.stream_append("req-s", [])  # an update without tokens is fine
        h.store.stream_append("req-s", [13])
        assert h.store.stream_read("req-s", 1) == StreamLog(rec, [12, 13], 3, None)
        h.store.stream_append("req-s", [14], "length")
        assert h.store.stream_read("req-s") == StreamLog(rec, [11, 12, 13, 14], 4, "length")
        assert h.store.stream_read("req-s", 9) == StreamLog(rec, [], 4, "length")
        h.store.stream_append("req-s", [99], "stop")  # after the end: ignored
        assert h.store.stream_read("req-s", 3) == StreamLog(rec, [14], 4, "length")
        assert h.store.stream_read("unknown") is None
        h.store.stream_append("never-opened", [1], "stop")  # ignored, not created
        assert h.store.stream_read("never-opened") is None
        with pytest.raises(ValueError, match="from_index"):
            h.store.stream_read("req-s", -1)
        h.store.stream_open(rec)  # reopened (a retried id): starts empty again
        assert h.store.stream_read("req-s") == StreamLog(rec, [], 0, None)

    def test_stream_log_keeps_what_continuing_it_needs_and_one_claim_wins(self, h: Harness):
        """The record carries prompt and sampling (big seeds intact) for a router that
        continues the request; the owner moves by compare-and-set, so of routers racing
        to continue an orphan exactly one wins, and an ended log cannot be claimed."""
        sampling = {"max_tokens": 6, "temperature": 0.7, "seed": 2**63 - 1, "stop": ["x"]}
        rec = StreamRecord("req-c", 3, 6, ["x"], False, "m", "completion", [5, 6, 7], sampling,
                           "router-a")
        h.store.stream_open(rec)
        h.store.stream_append("req-c", [11])
        got = h.store.stream_read("req-c")
        assert got == StreamLog(rec, [11], 1, None, "router-a")
        assert got.record.prompt_token_ids == [5, 6, 7] and got.record.sampling == sampling
        h.store.stream_append("req-c", [12], owner="router-a")  # its owner writes
        wins = [h.store.stream_claim("req-c", r, "router-a") for r in ("router-b", "router-c")]
        assert wins == [True, False]
        assert h.store.stream_read("req-c").owner == "router-b"
        h.store.stream_append("req-c", [99], owner="router-a")  # taken over: fenced off
        h.store.stream_append("req-c", [], "abort", owner="router-a")  # cannot end it either
        assert h.store.stream_read("req-c") == StreamLog(rec, [11, 12], 2, None, "router-b")
        assert not h.store.stream_claim("req-c", "router-c", "router-a")  # stale expectation
        assert h.store.stream_claim("req-c", "router-c", "router-b")
        h.store.stream_append("req-c", [13], "stop", owner="router-c")
        assert not h.store.stream_claim("req-c", "router-d", "router-c")  # ended
        assert not h.store.stream_claim("unknown", "router-d", "")
        assert h.store.stream_read("req-c") == StreamLog(rec, [11, 12, 13], 3, "stop",
                                                         "router-c")

    def test_stream_log_expires_after_its_last_append(self, h: Harness):
        store = h.make(stream_ttl_s=h.ttl_s)
        store.stream_open(StreamRecord("req-e", 1, 4, [], False, "m"))
        store.stream_append("req-e", [2], "stop")
        h.wait_until(lambda: store.stream_read("req-e") is None, h.ttl_s)

    def test_a_stored_response_reads_back_a_copy_until_its_ttl(self, h: Harness):
        doc = {"response": {"id": "resp_1", "output": [{"type": "message"}]},
               "conversation": [{"role": "user", "content": "hi"}]}
        h.store.response_put("team-a/resp_1", doc, h.ttl_s)
        got = h.store.response_get("team-a/resp_1")
        assert got == doc
        got["response"]["id"] = "changed"  # the caller's copy, not the store's
        assert h.store.response_get("team-a/resp_1") == doc
        assert h.store.response_get("team-b/resp_1") is None  # keys are the tenant's
        assert h.store.response_get("resp_unknown") is None
        h.wait_until(lambda: h.store.response_get("team-a/resp_1") is None, h.ttl_s)

    def test_concurrent_appends_lose_nothing(self, h: Harness):
        def append(t: int) -> None:
            for i in range(25):
                h.store.journal_append("req-x", JournalEvent(float(i), "retried", f"w{t}", str(i)))

        threads = [threading.Thread(target=append, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        events = h.store.journal_get("req-x")
        assert len(events) == 100
        for t in range(4):  # each writer's events appear in its own order
            assert [e.detail for e in events if e.worker_id == f"w{t}"] == [str(i) for i in range(25)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TestInMemoryStore(StoreContract):
    @pytest.fixture
    def h(self) -> Harness:
        clock = FakeClock()

        def wait_until(pred: Callable[[], bool], ttl_s: float) -> None:
            assert not pred(), "condition already true before the TTL passed"
            clock.advance(ttl_s + 0.001)
            assert pred(), f"condition still false {ttl_s}s later"

        return Harness(store=InMemoryStore(clock=clock), ttl_s=10.0, elapse=clock.advance,
                       wait_until=wait_until, make=lambda **kw: InMemoryStore(clock=clock, **kw))


def test_make_store_without_url_is_in_memory():
    store = make_store(None)
    assert isinstance(store, InMemoryStore)
    store.register_worker(worker("d1"), ttl_s=60)
    assert [w.worker_id for w in store.list_workers()] == ["d1"]
    store.close()


def test_in_memory_expiry_is_exact_at_the_ttl_boundary():
    clock = FakeClock()
    store = InMemoryStore(clock=clock)
    store.register_worker(worker("d1"), ttl_s=5)
    clock.advance(4.5)
    assert store.list_workers() == [worker("d1")]
    clock.advance(0.5)  # exactly at the expiry instant: gone
    assert store.list_workers() == []


def test_the_resilient_store_reads_a_stored_response_before_and_after_it_is_written():
    """Read-your-writes: the response is there at once (this router's copy), and from the
    backend once written (the copy is dropped: the backend owns its expiry)."""
    from router.state.resilient import ResilientStore

    backend = InMemoryStore()
    store = ResilientStore(lambda: backend, "memory")
    try:
        store.response_put("t/resp_1", {"response": {"id": "resp_1"}}, 60.0)
        assert store.response_get("t/resp_1") == {"response": {"id": "resp_1"}}
        assert store.flush(timeout_s=5.0)
        assert backend.response_get("t/resp_1") == {"response": {"id": "resp_1"}}
        assert store.response_get("t/resp_1") == {"response": {"id": "resp_1"}}
        assert store._responses == {}  # noqa: SLF001 (the local copy went once written)
    finally:
        store.close()
