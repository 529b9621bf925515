"""Tensor-parallel workers served over a real local Ray: KV crosses between prefill and decode
workers of different TP sizes over per-(prefill rank, decode rank) pairs (each decode rank
takes its KV heads from the prefill ranks that hold them: ``kv_transfer.routes``), a decode
worker's cached prefix is reused whatever the prefill's TP size, colocated TP workers serve
alone, and a decode worker whose rank dies is a dead worker whose streams migrate and finish
identical. Tokens are compared with transformers' greedy generate; every test ends with no KV
block held on rank 0, nothing held for a transfer on any other rank, and no rank process left."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine import EngineArgs, SamplingParams
from kv_transfer.routes import kv_routes, rank_peer_id
from router.cluster.ray_cluster import ClusterConfig
from router.contract import GenerateInput
from tests.helpers.async_util import assert_no_blocks_held, run_cluster
from tests.helpers.tiny_models import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


@pytest.fixture(scope="module")
def workload(tiny_llama_dir):
    prompts = random_prompts(seed=11, count=8, max_len=60, min_len=3)
    return prompts, hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)


def _engine(tp: int, **kw) -> EngineArgs:
    # One thread a rank: each rank's kernel timing at start-up takes ~0.5 s there, where on
    # all of a busy 2-core host's threads it took 10-15 s. Small pools: the KV of 8 prompts.
    return EngineArgs(num_threads=1, tensor_parallel_size=tp,
                      kv_cache_memory_bytes=8 << 20, **kw)


def _config(model_dir, prefill_tp: int, decode_tp: int, **kw) -> ClusterConfig:
    base = dict(model=str(model_dir), num_prefill_workers=1, num_decode_workers=1,
                prefill_engine=_engine(prefill_tp, block_size=16),
                decode_engine=_engine(decode_tp, block_size=8),
                transfer_timeout_s=10.0, lease_s=10.0, worker_num_cpus=1.0)
    base.update(kw)
    return ClusterConfig(**base)


async def _rank_state(cluster, status) -> dict[str, list[dict]]:
    return {wid: await cluster.worker_handle(wid).kv_rank_state.remote() for wid in status}


def _idle(tp: int) -> list[dict]:
    return [{"held_pages": 0, "expected": 0, "sending": 0}] * (tp - 1)


async def _collect(cluster, prompt, params=GREEDY, request_id=None):
    toks = []
    async for ch in cluster.generate(GenerateInput(params, token_ids=prompt, request_id=request_id)):
        toks += ch.token_ids
    return toks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("prefill_tp,decode_tp,mode", [
    (2, 1, "disaggregated"), (1, 2, "disaggregated"), (2, 4, "disaggregated"),
    (1, 2, "colocated"),
], ids=["P2-D1", "P1-D2", "P2-D4", "colocated-TP2"])
def test_tp_workers_serve_transformers_tokens(loop, tiny_llama_dir, workload, prefill_tp,
                                              decode_tp, mode):
    prompts, refs = workload
    config = _config(tiny_llama_dir, prefill_tp, decode_tp, mode=mode,
                     num_prefill_workers=1 if mode == "disaggregated" else 0)

    async def body(cluster):
        status = {w.id: w for w in await cluster.cluster_status()}
        outs = await asyncio.gather(*[_collect(cluster, p) for p in prompts])
        await assert_no_blocks_held(cluster)
        pairs = {wid: await cluster.worker_handle(wid).kv_pairs.remote() for wid in status}
        loads = {wid: await cluster.worker_handle(wid).load.remote() for wid in status}
        return (outs, status, (await cluster.stats()).kv_transfer_bytes_total, pairs,
                await _rank_state(cluster, status), loads)

    outs, status, kv_bytes, pairs, ranks_state, loads = run_cluster(loop, config, body)
    assert outs == refs
    assert ranks_state == {wid: _idle(w.tp) if mode == "disaggregated" else []
                           for wid, w in status.items()}
    if mode == "disaggregated":
        # Rank 0 of each side paired with exactly the other side's ranks its routes name.
        routes = kv_routes(2, prefill_tp, decode_tp)  # the tiny model's 2 KV heads
        assert set(pairs["prefill-0"]) == {rank_peer_id("decode-0", r.decode_rank)
                                           for r in routes if r.prefill_rank == 0}
        assert set(pairs["decode-0"]) == {rank_peer_id("prefill-0", r.prefill_rank)
                                          for r in routes if r.decode_rank == 0}
        # Each rank moved exactly its routes' heads (of the model's 2) of every transfer.
        whole = loads["decode-0"].kv_transfer_bytes
        assert loads["prefill-0"].kv_transfer_bytes == whole
        for wid, side, tp in (("prefill-0", "prefill_rank", prefill_tp),
                              ("decode-0", "decode_rank", decode_tp)):
            assert loads[wid].rank_kv_transfer_bytes == tuple(
                whole * sum(r.num_heads for r in routes if getattr(r, side) == rank) // 2
                for rank in range(tp))
    want = {"decode-0": decode_tp} | ({"prefill-0": prefill_tp} if mode == "disaggregated" else {})
    assert {wid: w.tp for wid, w in status.items()} == want
    ranks = [pid for w in status.values() for pid in w.rank_pids]
    assert sorted(len(w.rank_pids) for w in status.values()) == sorted(t - 1 for t in want.values())
    assert (kv_bytes > 0) == (mode == "disaggregated")
    assert _wait_gone(ranks) == [], "a rank outlived its worker"


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_a_decode_workers_cached_prefix_is_reused_across_tp_sizes(loop, tiny_llama_dir,
                                                                 prefill_tp, decode_tp):
    """A prompt whose prefix the decode worker already caches: only the rest crosses (fewer
    KV bytes than the whole prompt's), every rank fills in its heads of the rest, and the
    tokens still equal transformers'."""
    prompts = random_prompts(seed=5, count=1, max_len=48, min_len=48)
    base = prompts[0]
    longer = base + random_prompts(seed=6, count=1, max_len=12, min_len=12)[0]
    refs = hf_greedy(tiny_llama_dir, "llama", [base, longer], MAX_TOKENS)
    config = _config(tiny_llama_dir, prefill_tp, decode_tp)

    async def body(cluster):
        status = {w.id: w for w in await cluster.cluster_status()}
        first = await _collect(cluster, base)
        bytes_first = (await cluster.stats()).kv_transfer_bytes_total
        second = await _collect(cluster, longer)
        await assert_no_blocks_held(cluster)
        load = await cluster.worker_handle("decode-0").load.remote()
        return ([first, second], bytes_first, load.kv_transfer_bytes, load.prefix_hit_tokens,
                await _rank_state(cluster, status), status)

    outs, bytes_first, bytes_all, hits, ranks_state, status = run_cluster(loop, config, body)
    assert outs == refs
    assert hits >= 40  # the 48-token prefix, in whole 8-token blocks (the last may recompute)
    per_token = bytes_first / len(base)
    assert bytes_all - bytes_first == pytest.approx(per_token * (len(longer) - hits))
    assert ranks_state == {wid: _idle(w.tp) for wid, w in status.items()}


def test_a_dead_decode_rank_kills_its_worker_and_the_streams_migrate(loop, tiny_llama_dir):
    """SIGKILL rank 1 of a TP 2 decode worker mid-stream: the worker's next step fails, so the
    worker dies as a whole (its other ranks end too); its streams continue on the other decode
    worker and equal an undisturbed run, token for token."""
    prompts = random_prompts(seed=23, count=4, max_len=30, min_len=8)
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, 300)
    config = _config(tiny_llama_dir, 1, 2, num_decode_workers=2, worker_restarts=0)

    async def body(cluster):
        status = {w.id: w for w in await cluster.cluster_status()}
        streams = [cluster.generate(GenerateInput(long, token_ids=p, request_id=f"t{i}"))
                   for i, p in enumerate(prompts)]
        got = [[] for _ in prompts]
        for i, s in enumerate(streams):
            while not got[i]:
                got[i] += (await anext(s)).token_ids
        victim = "decode-0"
        on_victim = [i for i in range(len(prompts))
                     if cluster.orchestrator._streams[f"t{i}"].decode_id == victim]
        os.kill(status[victim].rank_pids[0], signal.SIGKILL)

        async def drain(i, s):
            async for ch in s:
                got[i] += ch.token_ids
        await asyncio.wait_for(asyncio.gather(*[drain(i, s) for i, s in enumerate(streams)]),
                               120)
        await assert_no_blocks_held(cluster, timeout_s=30)
        return got, on_victim, status, (await cluster.stats()).migrations

    got, on_victim, status, migrations = run_cluster(loop, config, body)
    assert on_victim, "no stream was on the worker whose rank died"
    assert got == refs
    assert sum(migrations.values()) == len(on_victim)
    victim = status["decode-0"]
    assert _wait_gone([victim.pid, *victim.rank_pids]) == []


def test_a_tp_size_the_model_cannot_take_fails_start_up_naming_it(loop, tiny_llama_dir):
    """3 ranks over the tiny model's 2 KV heads: start-up refuses before any worker starts,
    naming both sides of the KV layout, at once (not a wait for the deadline)."""
    from router.cluster.ray_cluster import StartupError

    config = _config(tiny_llama_dir, 1, 3, startup_timeout_s=120.0)
    t0 = time.monotonic()
    with pytest.raises(StartupError, match=r"impossible KV layout .*\(2 KV heads\): prefill "
                                           r"tp=1: ok; decode tp=3: tensor_parallel_size=3 "
                                           r"does not divide .*2 KV heads"):
        run_cluster(loop, config, lambda cluster: asyncio.sleep(0))
    assert time.monotonic() - t0 < 60
