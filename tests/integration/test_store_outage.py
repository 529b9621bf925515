"""Redis is optional at every moment: a redis-server of the test's own (free port) is killed
and started again under the ResilientStore and under a serving cluster.

What a user would notice is asserted: writes never block or raise while Redis is down, the
router keeps serving (no 429 storm, no leaked stream entries), ``pdcluster_store_up`` says
so, and when Redis returns (empty: it kept nothing) the registry and every journal event
written meanwhile are there again.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time

import pytest
import redis

from router.state.factory import make_store
from router.state.redis_store import RedisStore
from router.state.store import JournalEvent, StoreUnavailableError, StreamRecord
from tests.helpers.async_util import wait_until
from tests.helpers.redis_server import OwnRedis
from tests.unit.router.state.test_store import load, worker

pytestmark = pytest.mark.redis


# make_store keeps RedisStore's default: how long one call to a hung Redis waits.
REDIS_SOCKET_TIMEOUT_S = inspect.signature(RedisStore).parameters["socket_timeout_s"].default


def _until(pred, timeout_s: float = 10.0, what: str = "condition") -> None:
    wait_until(pred, timeout_s, what)


def test_writes_never_block_and_everything_is_written_once_redis_returns(own_redis):
    """Redis hangs, then dies, then comes back empty."""
    store = make_store(own_redis.url, namespace="outage")
    try:
        store.register_worker(worker("decode-0"), ttl_s=30)
        store.register_worker(worker("prefill-0", role="prefill"), ttl_s=30)
        assert store.flush(5.0)
        own_redis.pause()  # hung: any call to it waits out the store's socket timeout

        t0 = time.monotonic()
        store.stream_open(StreamRecord("s0", 3, 300, [], False, "tiny-llama"))
        for i in range(300):  # what a busy router writes while Redis is gone
            store.journal_append(f"r{i % 30}", JournalEvent(float(i), "received", None, str(i)))
            store.heartbeat("decode-0", ttl_s=30, load=load(used=i))
            store.stream_append("s0", [i])
        writes_s = time.monotonic() - t0
        # A write that waited on Redis even once would have taken a whole socket timeout.
        assert writes_s < REDIS_SOCKET_TIMEOUT_S, (
            f"900 writes took {writes_s:.2f} s while Redis hung")
        own_redis.kill()
        _until(lambda: not store.up, what="store marked down")
        # Reads answer from the router's own view instead of raising or hanging.
        assert [w.worker_id for w in store.list_workers()] == ["decode-0", "prefill-0"]
        assert store.get_load("decode-0").kv_blocks_used == 299
        assert store.stream_read("s0") is None
        assert store.journal_recent() == []
        assert [e.detail for e in store.journal_get("r7")] == [str(i) for i in range(7, 300, 30)]

        own_redis.start()  # empty: a crashed Redis without persistence kept nothing
        _until(lambda: store.up, what="store back up")
        assert store.flush(10.0)
        fresh = RedisStore(own_redis.url, namespace="outage")
        try:  # what another router sharing this Redis now sees
            assert [w.worker_id for w in fresh.list_workers()] == ["decode-0", "prefill-0"]
            assert fresh.get_load("decode-0").kv_blocks_used == 299
            assert [e.detail for e in fresh.journal_get("r7")] == [str(i) for i in range(7, 300, 30)]
            s0 = fresh.stream_read("s0")
            assert s0 is not None and s0.token_ids == list(range(300)) and s0.num_tokens == 300
        finally:
            fresh.close()
        assert store.dropped == 0 and store.backlog == 0
    finally:
        store.close()


def test_a_fast_restart_that_no_call_noticed_is_repaired_too(own_redis):
    """Redis restarted between two writes (its client reconnects without an error): the
    store's epoch changed, so the registry and the open request's journal are written again
    before the next event."""
    store = make_store(own_redis.url, namespace="blink")
    try:
        store.register_worker(worker("decode-0"), ttl_s=30)
        store.journal_append("open", JournalEvent(1.0, "received", None, ""))
        store.journal_append("open", JournalEvent(2.0, "committed", "decode-0", ""))
        store.journal_append("done", JournalEvent(1.0, "received", None, ""))
        store.journal_append("done", JournalEvent(2.0, "finished", "decode-0", ""))
        assert store.flush(5.0)
        own_redis.kill()
        own_redis.start()
        store.journal_append("open", JournalEvent(3.0, "finished", "decode-0", ""))
        assert store.flush(10.0)
        fresh = RedisStore(own_redis.url, namespace="blink")
        try:
            assert [e.kind for e in fresh.journal_get("open")] == ["received", "committed",
                                                                   "finished"]
            assert fresh.journal_get("done") == []  # closed before the loss: not kept here
            assert [w.worker_id for w in fresh.list_workers()] == ["decode-0"]
        finally:
            fresh.close()
    finally:
        store.close()


def test_starts_degraded_without_redis_and_catches_up_when_it_appears():
    late = OwnRedis()  # not started yet
    store = make_store(late.url, namespace="late")
    try:
        assert not store.up
        store.register_worker(worker("decode-0"), ttl_s=30)
        store.journal_append("r1", JournalEvent(1.0, "received", None, "before redis"))
        late.start()
        _until(lambda: store.up, what="store up once Redis starts")
        assert store.flush(10.0)
        assert [w.worker_id for w in store.list_workers()] == ["decode-0"]
        assert [e.detail for e in store.journal_get("r1")] == ["before redis"]
    finally:
        store.close()
        late.kill()
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{late.port}"):
        make_store(late.url, require=True)  # --require-redis


def test_password_urls_work_and_never_reach_a_message():
    secret = "s3cr3t-pw"
    r = OwnRedis(password=secret)
    r.start()
    try:
        store = make_store(r.url, namespace="auth")
        store.register_worker(worker("decode-0"), ttl_s=30)
        assert store.flush(5.0) and store.up
        assert [w.worker_id for w in store.list_workers()] == ["decode-0"]
        store.close()
        wrong = r.url.replace(secret, "wrong")
        with pytest.raises(StoreUnavailableError, match="invalid username-password") as exc:
            RedisStore(wrong)
        assert isinstance(exc.value.__cause__, redis.exceptions.AuthenticationError)
        assert "wrong" not in str(exc.value)
        r.kill()
        with pytest.raises(StoreUnavailableError,
                           match=re.escape(f"redis://:***@127.0.0.1:{r.port}")) as exc:
            make_store(r.url, require=True)
        assert secret not in str(exc.value)
    finally:
        r.kill()


@pytest.mark.slow
def test_cluster_serves_through_a_redis_outage(own_redis, tiny_llama_dir):
    """32 streams on a 1P+2D cluster whose Redis is SIGKILLed mid-way and started again
    (empty) a few seconds later: every stream completes with transformers' tokens, the
    stream table ends empty, requests after the outage are served (no 429 storm), the store
    gauge goes 0 then 1, and the registry and the journals of requests that ran during the
    outage are in the restarted Redis."""

    from engine import EngineArgs, SamplingParams
    from router.cluster.ray_cluster import ClusterConfig
    from router.contract import GenerateInput
    from tests.helpers.async_util import ray_loop, run_cluster
    from tests.helpers.tiny_models import hf_greedy, random_prompts

    prompts = random_prompts(seed=31, count=40, max_len=40, min_len=4)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, 40)
    config = ClusterConfig(
        model=str(tiny_llama_dir), num_prefill_workers=1, num_decode_workers=2,
        prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=8),
        decode_engine=EngineArgs(block_size=8, num_threads=1), worker_num_cpus=1.0,
        redis_url=own_redis.url, store_namespace="outage-cluster", max_inflight_requests=40)

    async def collect(cluster, i):
        toks = []
        async for ch in cluster.generate(GenerateInput(params, token_ids=prompts[i],
                                                       request_id=f"q{i}")):
            toks += ch.token_ids
            await asyncio.sleep(0.01)  # a client reading at its own pace: streams overlap
        return toks

    async def body(cluster):
        tasks = [asyncio.ensure_future(collect(cluster, i)) for i in range(32)]
        await asyncio.sleep(0.5)
        own_redis.kill()
        deadline = time.monotonic() + 20
        while (await cluster.stats()).store_up:
            assert time.monotonic() < deadline, "the outage was never noticed"
            await asyncio.sleep(0.05)
        up_during = False
        await asyncio.sleep(2.0)  # the streams run on with no Redis at all
        own_redis.start()
        got = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        deadline = time.monotonic() + 20
        while not (up_during := (await cluster.stats()).store_up):
            assert time.monotonic() < deadline, "the store never came back"
            await asyncio.sleep(0.05)
        after = await asyncio.gather(*[collect(cluster, i) for i in range(32, 40)])
        assert cluster.store.flush(10.0)
        return got, after, up_during, len(cluster.orchestrator._streams)

    with ray_loop(num_cpus=8, resources={"prefill_slot": 2, "decode_slot": 4}) as lt:
        # Read the restarted Redis before shutdown deregisters the workers: from inside.
        got, after, up_again, left = run_cluster(lt, config, body, timeout_s=400)
    assert got == refs[:32]
    assert after == refs[32:40]
    assert up_again and left == 0
    other = RedisStore(own_redis.url, namespace="outage-cluster")
    try:
        for i in (0, 17, 31, 39):  # journals written during (or after) the outage
            kinds = [e.kind for e in other.journal_get(f"q{i}")]
            assert kinds[0] == "received" and kinds[-1] == "finished", (i, kinds)
    finally:
        other.close()
