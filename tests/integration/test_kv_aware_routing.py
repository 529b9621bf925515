"""KV-aware routing on a real local Ray: the router's index is fed by the workers' KV events
(pulled through Ray, or read from Redis Streams), a conversation's next turn goes to the
decode worker that holds its start, and only the missing blocks travel. Tokens equal
transformers' greedy ones; no worker holds a block at the end."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from engine import EngineArgs, SamplingParams
from router.cluster.ray_cluster import ClusterConfig
from router.routing.kv_index import KVIndex
from router.routing.kv_sync import KVEventSync
from router.routing.policy import RoutingConfig
from tests.helpers.async_util import (
    assert_no_blocks_held,
    generate_tokens,
    run_cluster,
    until,
)
from tests.helpers.redis_server import OwnRedis
from tests.helpers.tiny_models import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


def _config(model_dir, prefill_bs: int, decode_bs: int, **kw) -> ClusterConfig:
    base = dict(model=str(model_dir), num_prefill_workers=2, num_decode_workers=2,
                prefill_engine=EngineArgs(block_size=prefill_bs, num_threads=1, max_num_seqs=8),
                decode_engine=EngineArgs(block_size=decode_bs, num_threads=1),
                transfer_timeout_s=10.0, lease_s=10.0, worker_num_cpus=1.0,
                routing=RoutingConfig("kv_aware"))
    base.update(kw)
    return ClusterConfig(**base)


async def _index_equals_workers(index: KVIndex, cluster) -> bool:
    """Every worker's entry in ``index`` holds exactly what its prefix cache holds now."""
    orch = cluster.orchestrator
    for slot in (*orch.prefill.values(), *orch.decode.values()):
        snap = await slot.handle.kv_snapshot.remote()
        cur = index.cursor(slot.info.worker_id)
        if cur is None or cur.stale or cur.seq != snap.seq:
            return False
        if index.cached_hashes(slot.info.worker_id) != set(snap.block_hashes):
            return False
    return True


def test_next_turns_reuse_the_decode_workers_prefix(loop, tiny_llama_dir):
    """Prefill block size 16, decode 8 (the other way round, and equal sizes, are in
    tests/unit/engine/runtime/test_prefix_reuse.py, engine to engine)."""
    convs = random_prompts(seed=21, count=3, max_len=60, min_len=50)
    extra = random_prompts(seed=22, count=6, max_len=10, min_len=6)

    async def body(cluster):
        orch = cluster.orchestrator
        turns: list[list[list[int]]] = [[c] for c in convs]
        outs: list[list[list[int]]] = [[] for _ in convs]
        decode_of: dict[str, str] = {}
        for t in range(3):
            for i in range(len(convs)):
                if t:  # the conversation so far + a new user message
                    turns[i].append(turns[i][-1] + outs[i][-1] + extra[(i + t) % len(extra)])
                    prompt = turns[i][-1]
                    # The index learned the last turn from the workers' events.
                    await until(lambda p=prompt: _has_hit(orch, p), "the index to see turn")
                rid = f"c{i}-t{t}"
                outs[i].append(await generate_tokens(cluster, GREEDY, turns[i][-1], rid))
                decode_of[rid] = [e.worker_id for e in orch.store.journal_get(rid)
                                  if e.kind == "committed"][-1]
        await assert_no_blocks_held(cluster)
        stats = await cluster.stats()
        hits = {rid: [e.detail for e in orch.store.journal_get(rid)
                      if e.kind == "reserved" and "cached here" in e.detail]
                for rid in decode_of}
        return turns, outs, decode_of, hits, stats

    turns, outs, decode_of, hits, stats = run_cluster(loop, _config(tiny_llama_dir, 16, 8), body)
    for i in range(len(convs)):
        refs = hf_greedy(tiny_llama_dir, "llama", turns[i], MAX_TOKENS)
        assert outs[i] == refs, f"conversation {i}"
        for t in (1, 2):  # the same decode worker, and only the missing tokens moved
            assert decode_of[f"c{i}-t{t}"] == decode_of[f"c{i}-t0"]
            assert hits[f"c{i}-t{t}"], f"c{i}-t{t} had no decode-side prefix hit"
    prompt_tokens = sum(len(p) for turn in turns for p in turn)
    assert stats.prefix_hit_tokens.get("decode", 0) > prompt_tokens // 3
    assert stats.prefix_hit_tokens.get("prefill", 0) > 0
    assert 0 < stats.prefill_computed_tokens < prompt_tokens


def test_a_new_prefix_sent_twice_at_once_is_computed_once(loop, tiny_llama_dir):
    """In-flight affinity, router to engine: two requests sharing a new 3-block prefix, sent
    together, go to the same prefill and decode workers (the router counts the first one's
    blocks before any event says so; without that they split over both pairs), and the
    prefix is computed once (from the worker's cache, or, when both reach its scheduler
    together, by waiting for the blocks the first is computing:
    tests/unit/engine/core/test_scheduler.py).
    Tokens equal transformers'; every in-flight entry and every block is gone at the end."""
    prefix = random_prompts(seed=41, count=1, max_len=48, min_len=48)[0]
    tails = random_prompts(seed=42, count=2, max_len=7, min_len=5)
    prompts = [prefix + tails[0], prefix + tails[1]]

    async def body(cluster):
        orch = cluster.orchestrator
        before = (await cluster.stats()).prefill_computed_tokens
        outs = await asyncio.gather(*(generate_tokens(cluster, GREEDY, p, f"twin{i}")
                                      for i, p in enumerate(prompts)))
        placed = {rid: {e.kind: e.worker_id for e in orch.store.journal_get(rid)
                        if e.kind in ("prefilled", "committed")} for rid in ("twin0", "twin1")}
        computed = (await cluster.stats()).prefill_computed_tokens - before
        await assert_no_blocks_held(cluster)
        return outs, placed, computed, orch.kv_index.requests_expected

    outs, placed, computed, expected = run_cluster(loop, _config(tiny_llama_dir, 16, 16), body)
    assert outs == hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)
    assert placed["twin0"] == placed["twin1"], placed
    # the prefix's 3 blocks once, then each prompt's own tokens
    assert computed == len(prefix) + len(tails[0]) + len(tails[1])
    assert expected == 0


def _has_hit(orch, prompt) -> bool:
    async def check():
        return bool(orch.kv_index.match(prompt, list(orch.decode)))
    return check()


def test_redis_streams_feed_the_index_and_a_new_reader_rebuilds_it(loop, tiny_llama_dir,
                                                                    own_redis):
    """With Redis: the router's index follows the workers' streams; a worker that cannot
    reach Redis is pulled instead once its stream lags its load reports; a second router's
    index, started later from snapshots + stream replay, converges to the same content; a
    Redis outage falls back to pulling from the workers."""
    from worker_protocol.kv_stream import RedisKVEventSource

    redis = own_redis
    ns = f"pdtest-{uuid.uuid4().hex[:8]}"
    prompts = random_prompts(seed=31, count=8, max_len=70, min_len=20)
    unreachable = OwnRedis()  # never started: decode-1 publishes into the void
    config = _config(tiny_llama_dir, 16, 8, num_prefill_workers=1, redis_url=redis.url,
                     store_namespace=ns,
                     worker_overrides={"decode-1": {"kv_events_redis_url": unreachable.url}})

    async def body(cluster):
        orch = cluster.orchestrator
        assert orch.kv_sync.source is not None
        for i, p in enumerate(prompts[:4]):
            await generate_tokens(cluster, GREEDY, p, f"a{i}")
        await until(lambda: _index_equals_workers(orch.kv_index, cluster), "router index")
        assert orch.kv_sync.stream_up and orch.kv_sync.pulls > 0  # decode-1's, pulled
        source = RedisKVEventSource(redis.url, ns)
        assert source.length("decode-0") > 0 and source.length("prefill-0") > 0
        assert source.length("decode-1") == 0
        # A second reader, as a router started now would be: snapshots, then the streams.
        index = KVIndex(orch.kv_index.hash_seed)
        sync = KVEventSync(index, 10.0, source)
        slots = [*orch.prefill.values(), *orch.decode.values()]
        for s in slots:
            sync.track(s.info.worker_id, s.info.block_size)
        await sync.refresh(slots)
        for i, p in enumerate(prompts[4:]):
            await generate_tokens(cluster, GREEDY, p, f"b{i}")
        async def caught_up():  # driven as a router's load loop drives its own (4/s)
            await sync.refresh(slots)
            return await _index_equals_workers(index, cluster)

        await until(caught_up, "the second index")
        pulled = sync.snapshots
        await sync.close()
        # Redis goes away: the router's own index keeps up by pulling through Ray.
        redis.kill()
        await until(lambda: _false_stream(orch), "the router to notice the outage")
        for i, p in enumerate(prompts[:3]):
            await generate_tokens(cluster, GREEDY, p + [5, 6, 7] * (i + 1), f"c{i}")
        await until(lambda: _index_equals_workers(orch.kv_index, cluster), "pulled index")
        return pulled

    pulled = run_cluster(loop, config, body)
    assert pulled == 3  # one snapshot per worker, then the streams (and decode-1's pulls)


def _false_stream(orch):
    async def check():
        return not orch.kv_sync.stream_up
    return check()
