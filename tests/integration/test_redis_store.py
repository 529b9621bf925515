"""RedisStore against a real Redis at 127.0.0.1:6379 (CI starts one; locally: `redis-server`).

Runs the shared ``StoreContract`` from tests/unit/router/state/test_store.py plus Redis-only checks
(namespacing, real key TTLs, two stores sharing state, unreachable servers). Each test uses
a fresh random namespace and deletes its keys afterwards. If Redis is not reachable these
tests FAIL (never skip): CI is expected to provide it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from router.state.factory import make_store
from router.state.redis_store import RedisStore
from router.state.store import JournalEvent, StoreUnavailableError
from tests.unit.router.state.test_store import Harness, StoreContract, load, worker

REDIS_URL = "redis://127.0.0.1:6379/0"
pytestmark = pytest.mark.redis


def _open(namespace: str, **kwargs) -> RedisStore:
    try:
        return RedisStore(REDIS_URL, namespace=namespace, **kwargs)
    except StoreUnavailableError as e:
        pytest.fail(f"Redis is required for these tests and is not reachable at {REDIS_URL} "
                    f"(start redis-server; CI provides one): {e}")


def _poll(pred: Callable[[], bool], ttl_s: float) -> None:
    # As the in-memory harness does: an expiry test whose state never reached Redis would
    # otherwise pass without exercising it.
    assert not pred(), "condition already true before the TTL passed"
    deadline = time.monotonic() + ttl_s + 5.0  # generous: Redis expiry is lazy + sampled
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"condition still false {ttl_s + 5.0:.1f}s after a {ttl_s}s TTL")
        time.sleep(0.05)


@pytest.fixture
def namespace() -> Iterator[str]:
    ns = f"pdtest-{uuid.uuid4().hex[:12]}"
    yield ns
    raw = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        keys = list(raw.scan_iter(match=f"{ns}:*"))
        if keys:
            raw.delete(*keys)
    except redis.ConnectionError:
        pass  # the test itself already failed with the clear "not reachable" message
    finally:
        raw.close()


@pytest.fixture
def raw_redis() -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True, socket_connect_timeout=2)
    yield r
    r.close()


class TestRedisStore(StoreContract):
    @pytest.fixture
    def h(self, namespace: str) -> Iterator[Harness]:
        made: list[RedisStore] = []

        def make(**kw) -> RedisStore:
            made.append(_open(namespace, **kw))
            return made[-1]

        yield Harness(store=make(), ttl_s=1.0, elapse=time.sleep, wait_until=_poll, make=make)
        for s in made:
            s.close()


def test_all_keys_live_under_the_namespace(namespace, raw_redis):
    store = _open(namespace)
    store.register_worker(worker("d1"), ttl_s=60)
    store.heartbeat("d1", ttl_s=60, load=load())
    store.journal_append("req-1", JournalEvent(1.0, "received", None))
    keys = set(raw_redis.scan_iter(match=f"{namespace}:*"))
    assert {f"{namespace}:worker:d1", f"{namespace}:load:d1",
            f"{namespace}:journal:req-1"} <= keys
    store.deregister_worker("d1")
    assert not set(raw_redis.scan_iter(match=f"{namespace}:*")) & {
        f"{namespace}:worker:d1", f"{namespace}:load:d1"}
    store.close()


def test_keys_carry_real_redis_ttls(namespace, raw_redis):
    store = _open(namespace, journal_ttl_s=120)
    store.register_worker(worker("d1"), ttl_s=30)
    store.heartbeat("d1", ttl_s=30, load=load())
    store.journal_append("req-1", JournalEvent(1.0, "received", None))
    for key in ("worker:d1", "load:d1", "journal:req-1"):
        assert raw_redis.ttl(f"{namespace}:{key}") > 0, f"{key} has no expiry"
    assert raw_redis.ttl(f"{namespace}:journal:req-1") > 30  # the journal TTL, not a worker's
    store.close()


def test_two_routers_share_one_cluster_view(namespace):
    a, b = _open(namespace), _open(namespace)
    a.register_worker(worker("d1"), ttl_s=60)
    b.heartbeat("d1", ttl_s=60, load=load(used=42))  # b knows a's worker: no UnknownWorkerError
    assert [w.worker_id for w in b.list_workers()] == ["d1"]
    assert a.get_load("d1") == load(used=42)
    other = _open(namespace + "-other")  # another namespace sees none of it
    assert other.list_workers() == [] and other.get_load("d1") is None
    for s in (a, b, other):
        s.close()


@pytest.mark.timeout(20)  # a hang guard, not a speed check: connect timeouts bound the failure
def test_unreachable_redis_fails_fast_with_a_clear_error():
    with pytest.raises(StoreUnavailableError, match="127.0.0.1:1"):
        RedisStore("redis://127.0.0.1:1/0")
    with pytest.raises(StoreUnavailableError, match="127.0.0.1:1"):  # --require-redis
        make_store("redis://127.0.0.1:1/0", require=True)


def test_make_store_with_url_is_redis_behind_the_outage_guard(namespace, raw_redis):
    from router.state.resilient import ResilientStore

    store = make_store(REDIS_URL, namespace=namespace)
    assert isinstance(store, ResilientStore) and store.up
    assert isinstance(store._backend, RedisStore)
    # What it writes lands in Redis: a plain client reads it there.
    store.register_worker(worker("d1"), ttl_s=60)
    store.journal_append("req-1", JournalEvent(1.0, "received", None))
    assert store.flush(5.0)
    assert raw_redis.exists(f"{namespace}:worker:d1", f"{namespace}:journal:req-1") == 2
    store.close()
