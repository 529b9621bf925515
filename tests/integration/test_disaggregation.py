"""Disaggregated serving over a real local Ray: prefill workers stream KV to decode workers.

One local Ray for the pytest process (tests/helpers/shared_ray.py); each test starts the
cluster shape it needs. Tokens are compared with transformers' own greedy generate, and every
test ends by checking that no worker holds a reserved or used KV block.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from engine import EngineArgs, SamplingParams
from router.contract import GenerateInput
from tests.helpers.async_util import assert_no_blocks_held, run_cluster, until
from tests.helpers.disagg import (
    MAX_TOKENS,
    collect,
    disagg_config,
    disagg_workload,
    journal_kinds,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


@pytest.fixture(scope="module")
def workload(tiny_llama_dir):
    return disagg_workload(tiny_llama_dir)


def test_32_concurrent_requests_match_transformers_and_colocated(loop, tiny_llama_dir, workload):
    prompts, refs = workload

    async def body(cluster):
        outs = await asyncio.gather(*[collect(cluster, p) for p in prompts])
        await assert_no_blocks_held(cluster)
        stats = await cluster.stats()
        return outs, stats

    outs, stats = run_cluster(loop, disagg_config(tiny_llama_dir), body)
    assert [t for t, _ in outs] == refs
    assert all(last.finish_reason == "length" and last.usage.completion_tokens == MAX_TOKENS
               for _, last in outs)
    assert stats.kv_transfer_bytes_total > 0
    # both decode workers took part (KV-capacity routing spreads the load)
    colocated, _ = run_cluster(
        loop, disagg_config(tiny_llama_dir, mode="colocated", num_prefill_workers=0),
        lambda c: _gather_then_check(c, prompts))
    assert [t for t, _ in colocated] == refs


async def _gather_then_check(cluster, prompts):
    outs = await asyncio.gather(*[collect(cluster, p) for p in prompts])
    await assert_no_blocks_held(cluster)
    return outs, None


def test_dynamic_batching_launches_a_lone_request_after_its_window(loop, tiny_llama_dir):
    """Arrival times are stamped on the worker's clock. The router once sent wall-clock
    arrivals that the scheduler compared with its monotonic clock, so a lone request on a
    dynamic-batching worker waited for a full batch forever."""
    config = disagg_config(
        tiny_llama_dir, mode="colocated", num_prefill_workers=0, num_decode_workers=1,
        decode_engine=EngineArgs(block_size=8, num_threads=1, batching="dynamic",
                                 dynamic_window_s=0.05, max_num_seqs=32))

    async def body(cluster):
        return await asyncio.wait_for(collect(cluster, [5, 6, 7, 8]), timeout=30)

    toks, last = run_cluster(loop, config, body)
    assert len(toks) == MAX_TOKENS and last.finish_reason == "length"


def test_abort_in_every_phase_frees_all_blocks(loop, tiny_llama_dir, workload):
    prompts, refs = workload
    # One decode worker with room for ~2 requests, a slow transfer link, a 1-slot prefill worker.
    decode_kv = 2 * 2 * 2 * 16 * 4 * 8 * 24  # 24 blocks of 8 tokens
    config = disagg_config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=1,
                           prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=1),
                           decode_engine=EngineArgs(block_size=8, num_threads=1,
                                                    kv_cache_memory_bytes=decode_kv),
                           worker_overrides={"prefill-0": {"fault_delay_per_layer_s": 0.4}},
                           capacity_wait_s=60.0)
    long_gen = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)

    async def body(cluster):
        orch = cluster.orchestrator
        prefill = orch.prefill["prefill-0"].handle

        async def start(rid, prompt, params):
            gen = cluster.generate(GenerateInput(params, token_ids=prompt, request_id=rid))
            task = asyncio.ensure_future(gen.__anext__())
            return gen, task

        async def cancel(gen, task):
            """What a disconnecting client does: cancel the pending read, close the stream."""
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await task
            await gen.aclose()

        # mid-transfer: cancel once the prefill worker has posted its first layer
        gen, first = await start("mid-transfer", prompts[0][:60], long_gen)
        await wait_for(lambda: prefill.layers_sent.remote("mid-transfer"), lambda n: n >= 1)
        await cancel(gen, first)
        await assert_no_blocks_held(cluster)

        # decoding: cancel after a few streamed tokens
        gen, first = await start("decoding", prompts[1][:40], long_gen)
        await first
        for _ in range(3):
            await gen.__anext__()
        await gen.aclose()
        await assert_no_blocks_held(cluster)

        # reserved: A holds the only prefill slot; B is reserved on decode, queued at prefill
        gen_a, first_a = await start("holder", prompts[2][:40], long_gen)
        gen_b, first_b = await start("reserved", prompts[3][:40], long_gen)
        await wait_for(lambda: journal_kinds(cluster, "reserved"), lambda k: "reserved" in k)
        await cancel(gen_b, first_b)
        # queued: C waits at the router for decode KV room while A holds most of it
        gen_c, first_c = await start("queued", prompts[4][:40],
                                     SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
        await asyncio.sleep(0.5)
        assert journal_kinds(cluster, "queued") == ["received"]
        await cancel(gen_c, first_c)
        await cancel(gen_a, first_a)
        await assert_no_blocks_held(cluster)
        kinds = {rid: journal_kinds(cluster, rid)
                 for rid in ("mid-transfer", "decoding", "reserved", "queued", "holder")}
        # the cluster still serves correctly afterwards
        after = await collect(cluster, prompts[5])
        return kinds, after

    kinds, after = run_cluster(loop, config, body)
    assert kinds["queued"][-2:] == ["received", "aborted"]
    assert "reserved" in kinds["reserved"] and "prefilled" not in kinds["reserved"]
    assert "reserved" in kinds["mid-transfer"] and "committed" not in kinds["mid-transfer"]
    assert "committed" in kinds["decoding"] and kinds["decoding"][-1] == "aborted"
    assert after[0] == refs[5]


def test_abort_by_id_during_prefill_is_not_retried(loop, tiny_llama_dir, workload):
    prompts, _ = workload
    config = disagg_config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=1,
                           worker_overrides={"prefill-0": {"fault_delay_per_layer_s": 0.4}})

    async def body(cluster):
        prefill = cluster.orchestrator.prefill["prefill-0"].handle
        task = asyncio.ensure_future(collect(cluster, prompts[7], request_id="by-id"))
        await wait_for(lambda: prefill.layers_sent.remote("by-id"), lambda n: n >= 1)
        assert await cluster.abort("by-id")
        toks, last = await asyncio.wait_for(task, 30)
        await assert_no_blocks_held(cluster)
        return toks, last, journal_kinds(cluster, "by-id")

    toks, last, kinds = run_cluster(loop, config, body)
    assert toks == [] and last.finished and last.finish_reason == "abort"
    assert "retried" not in kinds and kinds.count("reserved") == 1


@pytest.mark.redis
def test_redis_store_holds_the_registry_and_journal(loop, tiny_llama_dir, workload):
    """With --redis-url, a second router (here: a plain RedisStore client) sees the workers,
    their load reports and every request's journal."""
    import uuid

    from router.state.redis_store import RedisStore

    prompts, refs = workload
    ns = f"pdtest-{uuid.uuid4().hex[:8]}"
    config = disagg_config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=1,
                           redis_url="redis://127.0.0.1:6379/0", store_namespace=ns)

    other = RedisStore("redis://127.0.0.1:6379/0", namespace=ns)

    async def body(cluster):
        toks, _ = await collect(cluster, prompts[8], request_id="journaled")
        await asyncio.sleep(0.6)  # at least one load-refresh round
        workers = {w.worker_id: w.role for w in other.list_workers()}
        return toks, workers, other.get_load("decode-0")

    try:
        toks, workers, load = run_cluster(loop, config, body)
        kinds = [e.kind for e in other.journal_get("journaled")]
        assert kinds == ["received", "reserved", "prefilled", "committed", "finished"]
        assert workers == {"prefill-0": "prefill", "decode-0": "decode"}
        assert load is not None and load.kv_blocks_total > 0
        assert other.list_workers() == []  # shutdown deregistered them
    finally:
        keys = other._r.keys(f"{ns}:*")
        if keys:
            other._r.delete(*keys)
        other.close()
    assert toks == refs[8]


def test_control_calls_answer_while_every_request_thread_waits(loop, tiny_llama_dir, workload):
    """70 prompts on a slow prefill worker: 64 occupy all its request threads, 6 wait in Ray's
    queue. Load reports and aborts run in their own concurrency groups and still answer, each
    before its own deadline and before any of those prompts' prefills returned; the queued
    calls, aborted before they arrived, are refused when they do, so nothing stays held."""
    prompts, _ = workload
    # 8 s a layer: no prefill returns, and so no request thread frees, for 16 s (the first
    # step sends 2 layers of at least one prompt). A control call queued behind them would
    # wait that long: past its deadline (call_timeout_s), where the abort's call gives up.
    config = disagg_config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=1,
                           max_inflight_requests=200, capacity_wait_s=60.0, transfer_timeout_s=60.0,
                           lease_s=60.0,
                           worker_overrides={"prefill-0": {"fault_delay_per_layer_s": 8.0}})
    # Six more than the worker has request threads (its max_concurrency): they wait in Ray's
    # queue and arrive after the aborts below found nothing of them there; run, they would
    # hold their prompts' blocks through their whole slow prefill (past the check below).
    rids = [f"busy-{i}" for i in range(70)]

    def journaled(cluster, kind: str) -> list[str]:
        return [r for r in rids if kind in {e.kind for e in cluster.store.journal_get(r)}]

    async def body(cluster):
        tasks = [asyncio.ensure_future(collect(cluster, prompts[i % len(prompts)],
                                                request_id=rid)) for i, rid in enumerate(rids)]
        try:
            async def all_sent() -> bool:  # "reserved": next, the call to the prefill worker
                return len(journaled(cluster, "reserved")) == len(rids)
            await until(all_sent, "every prompt sent to the prefill worker", timeout_s=60)
            t0 = time.monotonic()
            aborted = await cluster.abort("busy-69")
            abort_s = time.monotonic() - t0
            t0 = time.monotonic()
            stats = await cluster.stats()
            stats_s = time.monotonic() - t0
            prefilled = journaled(cluster, "prefilled")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await assert_no_blocks_held(cluster, timeout_s=60)
        return stats, stats_s, aborted, abort_s, prefilled

    stats, stats_s, aborted, abort_s, prefilled = run_cluster(loop, config, body)
    # Both answered while every request thread still waited: no prefill had returned.
    assert prefilled == []
    assert len(stats.workers) == 2 and stats_s < config.call_timeout_s
    assert aborted and abort_s < config.call_timeout_s


def test_int8_kv_moves_as_stored_and_decodes_like_the_offline_engine(loop, tiny_llama_dir,
                                                                   workload):
    """``--kv-cache-dtype int8`` on both sides: every prompt's KV crosses as the pools' int8
    rows with their scales (the transfer counter equals the prompts' tokens times the int8
    layout's bytes per token, 3.2x fewer than fp32 at the tiny model's head_dim 16), and the
    streams equal the offline engine's with the same int8 cache."""
    from engine import LLM
    from engine.weights.resolve import load_model_config
    from kv_transfer import KVLayout

    prompts = workload[0][:12]
    llm = LLM(str(tiny_llama_dir), kv_cache_dtype="int8")
    refs = [o.token_ids for o in llm.generate(prompts, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))]
    llm.close()
    config = disagg_config(
        tiny_llama_dir, num_prefill_workers=1, num_decode_workers=1,
        prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=8,
                                  kv_cache_dtype="int8"),
        decode_engine=EngineArgs(block_size=8, num_threads=1, kv_cache_dtype="int8"))

    async def body(cluster):
        outs = [await collect(cluster, p) for p in prompts]  # one by one: no shared prefix
        await assert_no_blocks_held(cluster)
        return outs, await cluster.stats()

    outs, stats = run_cluster(loop, config, body)
    assert [t for t, _ in outs] == refs
    cfg = load_model_config(tiny_llama_dir)
    int8 = KVLayout.from_model_config(cfg, "int8")
    assert int8.bytes_per_token * 16 == KVLayout.from_model_config(cfg).bytes_per_token * 5
    assert stats.kv_transfer_bytes_total == sum(len(p) for p in prompts) * int8.bytes_per_token


def test_prefill_and_decode_kv_dtypes_must_agree(tiny_llama_dir):
    from router.cluster.cluster_config import check_kv_cache_dtypes
    from router.cluster.launcher import StartupError

    config = disagg_config(
        tiny_llama_dir,
        prefill_engine=EngineArgs(block_size=16, num_threads=1, kv_cache_dtype="int8"),
        decode_engine=EngineArgs(block_size=8, num_threads=1))
    with pytest.raises(StartupError, match="prefill workers' kv_cache_dtype='int8' differs "
                                           "from the decode workers' kv_cache_dtype='auto'"):
        check_kv_cache_dtypes(config)
    check_kv_cache_dtypes(disagg_config(tiny_llama_dir))
