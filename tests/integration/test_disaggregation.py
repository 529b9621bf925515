"""Disaggregated serving over a real local Ray: prefill workers stream KV to decode workers.

One Ray for the module; each test starts the cluster shape it needs. Tokens are compared with
transformers' own greedy generate, and every test ends by checking that no worker holds a
reserved or used KV block.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from engine import EngineArgs, SamplingParams
from router.cluster.ray_cluster import ClusterConfig
from router.contract import GenerateInput
from tests.helpers.async_util import assert_no_blocks_held, ray_loop, run_cluster, until
from tests.helpers.tiny_models import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loop():
    with ray_loop(num_cpus=16, resources={"prefill_slot": 8, "decode_slot": 8}) as lt:
        yield lt


@pytest.fixture(scope="module")
def otlp():
    from bench.harness.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def workload(tiny_llama_dir):
    prompts = random_prompts(seed=7, count=32, max_len=90, min_len=3)
    return prompts, hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)


def _config(model_dir, **kw) -> ClusterConfig:
    base = dict(model=str(model_dir), num_prefill_workers=2, num_decode_workers=2,
                prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=8),
                decode_engine=EngineArgs(block_size=8, num_threads=1),
                transfer_timeout_s=10.0, lease_s=10.0, worker_num_cpus=1.0)
    base.update(kw)
    return ClusterConfig(**base)


async def _collect(cluster, prompt, params=GREEDY, request_id=None):
    toks, last = [], None
    async for ch in cluster.generate(GenerateInput(params, token_ids=prompt, request_id=request_id)):
        toks += ch.token_ids
        last = ch
    return toks, last


def test_32_concurrent_requests_match_transformers_and_colocated(loop, tiny_llama_dir, workload):
    prompts, refs = workload

    async def body(cluster):
        outs = await asyncio.gather(*[_collect(cluster, p) for p in prompts])
        await assert_no_blocks_held(cluster)
        stats = await cluster.stats()
        return outs, stats

    outs, stats = run_cluster(loop, _config(tiny_llama_dir), body)
    assert [t for t, _ in outs] == refs
    assert all(last.finish_reason == "length" and last.usage.completion_tokens == MAX_TOKENS
               for _, last in outs)
    assert stats.kv_transfer_bytes_total > 0
    # both decode workers took part (KV-capacity routing spreads the load)
    colocated, _ = run_cluster(loop, _config(tiny_llama_dir, mode="colocated", num_prefill_workers=0),
                                lambda c: _gather_then_check(c, prompts))
    assert [t for t, _ in colocated] == refs


async def _gather_then_check(cluster, prompts):
    outs = await asyncio.gather(*[_collect(cluster, p) for p in prompts])
    await assert_no_blocks_held(cluster)
    return outs, None


def test_dynamic_batching_launches_a_lone_request_after_its_window(loop, tiny_llama_dir):
    """Arrival times are stamped on the worker's clock. The router once sent wall-clock
    arrivals that the scheduler compared with its monotonic clock, so a lone request on a
    dynamic-batching worker waited for a full batch forever."""
    config = _config(tiny_llama_dir, mode="colocated", num_prefill_workers=0, num_decode_workers=1,
                     decode_engine=EngineArgs(block_size=8, num_threads=1, batching="dynamic",
                                              dynamic_window_s=0.05, max_num_seqs=32))

    async def body(cluster):
        return await asyncio.wait_for(_collect(cluster, [5, 6, 7, 8]), timeout=30)

    toks, last = run_cluster(loop, config, body)
    assert len(toks) == MAX_TOKENS and last.finish_reason == "length"


def test_abort_in_every_phase_frees_all_blocks(loop, tiny_llama_dir, workload):
    prompts, refs = workload
    # One decode worker with room for ~2 requests, a slow transfer link, a 1-slot prefill worker.
    decode_kv = 2 * 2 * 2 * 16 * 4 * 8 * 24  # 24 blocks of 8 tokens
    config = _config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=1,
                     prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=1),
                     decode_engine=EngineArgs(block_size=8, num_threads=1, kv_cache_memory_bytes=decode_kv),
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
        await _wait_for(lambda: prefill.layers_sent.remote("mid-transfer"), lambda n: n >= 1)
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
        await _wait_for(lambda: _journal_kinds(cluster, "reserved"), lambda k: "reserved" in k)
        await cancel(gen_b, first_b)
        # queued: C waits at the router for decode KV room while A holds most of it
        gen_c, first_c = await start("queued", prompts[4][:40],
                                     SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
        await asyncio.sleep(0.5)
        assert _journal_kinds(cluster, "queued") == ["received"]
        await cancel(gen_c, first_c)
        await cancel(gen_a, first_a)
        await assert_no_blocks_held(cluster)
        kinds = {rid: _journal_kinds(cluster, rid)
                 for rid in ("mid-transfer", "decoding", "reserved", "queued", "holder")}
        # the cluster still serves correctly afterwards
        after = await _collect(cluster, prompts[5])
        return kinds, after

    kinds, after = run_cluster(loop, config, body)
    assert kinds["queued"][-2:] == ["received", "aborted"]
    assert "reserved" in kinds["reserved"] and "prefilled" not in kinds["reserved"]
    assert "reserved" in kinds["mid-transfer"] and "committed" not in kinds["mid-transfer"]
    assert "committed" in kinds["decoding"] and kinds["decoding"][-1] == "aborted"
    assert after[0] == refs[5]


def test_abort_by_id_during_prefill_is_not_retried(loop, tiny_llama_dir, workload):
    prompts, _ = workload
    config = _config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=1,
                     worker_overrides={"prefill-0": {"fault_delay_per_layer_s": 0.4}})

    async def body(cluster):
        prefill = cluster.orchestrator.prefill["prefill-0"].handle
        task = asyncio.ensure_future(_collect(cluster, prompts[7], request_id="by-id"))
        await _wait_for(lambda: prefill.layers_sent.remote("by-id"), lambda n: n >= 1)
        assert await cluster.abort("by-id")
        toks, last = await asyncio.wait_for(task, 30)
        await assert_no_blocks_held(cluster)
        return toks, last, _journal_kinds(cluster, "by-id")

    toks, last, kinds = run_cluster(loop, config, body)
    assert toks == [] and last.finished and last.finish_reason == "abort"
    assert "retried" not in kinds and kinds.count("reserved") == 1


def test_dead_transfer_peer_releases_reservation_and_request_completes_elsewhere(
        loop, tiny_llama_dir, workload):
    prompts, refs = workload
    # No restarts: this is the worker gone for good (restarts: test_restarted_workers_...).
    config = _config(tiny_llama_dir, worker_overrides={"prefill-0": {"fault_exit_after_layers": 1}},
                     transfer_timeout_s=5.0, lease_s=5.0, worker_restarts=0)

    async def body(cluster):
        toks, last = await _collect(cluster, prompts[6], request_id="survivor")
        await assert_no_blocks_held(cluster, timeout_s=10.0)
        journal = cluster.store.journal_get("survivor")
        alive = {wid: s.view.alive for wid, s in cluster.orchestrator.prefill.items()}
        return toks, last, journal, alive

    toks, last, journal, alive = run_cluster(loop, config, body)
    assert toks == refs[6]
    assert last.finish_reason == "length"
    assert alive == {"prefill-0": False, "prefill-1": True}
    kinds = [e.kind for e in journal]
    assert "retried" in kinds
    reserved = [e for e in journal if e.kind == "reserved"]
    committed_on = [e.worker_id for e in journal if e.kind == "committed"]
    assert len(reserved) == 2 and committed_on == [reserved[1].worker_id]
    # The retry's KV came from the other prefill worker. Its decode worker may be the same
    # one: the prefill worker's death is not the decode worker's fault (the first
    # reservation was released: no block is held).
    assert [e.detail.split(" from ")[1].split(";")[0] for e in reserved] == ["prefill-0",
                                                                          "prefill-1"]


def _journal_kinds(cluster, rid):
    return [e.kind for e in cluster.store.journal_get(rid)]


async def _wait_for(probe, ok, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if asyncio.iscoroutine(value) or hasattr(value, "__await__"):
            value = await value
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"condition not met; last value {value!r}"
        await asyncio.sleep(0.02)


@pytest.mark.redis
def test_redis_store_holds_the_registry_and_journal(loop, tiny_llama_dir, workload):
    """With --redis-url, a second router (here: a plain RedisStore client) sees the workers,
    their load reports and every request's journal."""
    import uuid

    from router.state.redis_store import RedisStore

    prompts, refs = workload
    ns = f"pdtest-{uuid.uuid4().hex[:8]}"
    config = _config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=1,
                     redis_url="redis://127.0.0.1:6379/0", store_namespace=ns)

    other = RedisStore("redis://127.0.0.1:6379/0", namespace=ns)

    async def body(cluster):
        toks, _ = await _collect(cluster, prompts[8], request_id="journaled")
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
    config = _config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=1,
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
        tasks = [asyncio.ensure_future(_collect(cluster, prompts[i % len(prompts)],
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


@pytest.mark.parametrize("mode,sig,restarts,where", [("disaggregated", "SIGKILL", 0, "prefill"),
                                                     ("colocated", "SIGKILL", 2, "auto"),
                                                     ("disaggregated", "SIGSTOP", 2, "decode")])
def test_lost_decode_worker_streams_migrate_with_identical_tokens(loop, tiny_llama_dir, mode, sig,
                                                                  restarts, where, otlp):
    """SIGKILL (or SIGSTOP: alive for Ray, silent for us) a decode worker while its streams
    are mid-way: each continues on the other decode worker (prompt + tokens so far
    re-prefilled on a prefill worker and sent over, or computed on the new decode worker
    itself after pulling what a prefill worker holds of it: ``where``) and the client's
    stream equals an undisturbed run, token for token; the journal records the move; no
    block is left held (a stopped worker, once continued, frees what it held). Without
    restarts Ray reports the killed worker dead; with them its token stream breaks and it
    comes back later (test_restarted_workers_rejoin_and_serve). The streams ask for
    logprobs: the first token's after the seam comes from the new pair's prefill, and every
    one equals transformers' log-softmax. Traced, a migrated request's first decode phase
    ended failed ("migrated: ..."), a second follows, and the root counts one migration."""
    import os
    import signal

    import torch

    from tests.helpers.tiny_models import load_hf

    prompts = random_prompts(seed=21, count=4, max_len=40, min_len=8)
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, logprobs=1)
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, 400)
    hf = load_hf(tiny_llama_dir, "llama")
    with torch.no_grad():
        ref_lps = [torch.log_softmax(hf(torch.tensor([p + r])).logits[0, len(p) - 1:-1], -1)
                   .gather(1, torch.tensor(r)[:, None])[:, 0].tolist()
                   for p, r in zip(prompts, refs, strict=True)]
    del hf
    from worker_protocol.tracing import TracingConfig

    config = _config(tiny_llama_dir, mode=mode, num_prefill_workers=2 if mode == "disaggregated"
                     else 0, worker_restarts=restarts, migration_prefill=where,
                     tracing=TracingConfig(otlp.endpoint, flush_interval_s=0.2))

    async def body(cluster):
        status = {w.id: w for w in await cluster.cluster_status()}  # the pids, before any stream
        streams = [cluster.generate(GenerateInput(long, token_ids=p, request_id=f"m{i}"))
                   for i, p in enumerate(prompts)]
        got = [[] for _ in prompts]
        lps = [[] for _ in prompts]
        # Every stream has its first token, so it is committed somewhere; kill at once: the
        # tiny model decodes a step in about a millisecond (one fused call), and a stream whose
        # worker had already produced all its tokens would have nothing left to migrate.
        for i, s in enumerate(streams):
            while not got[i]:
                ch = await anext(s)
                got[i] += ch.token_ids
                lps[i] += ch.logprobs or []
        victim = "decode-0"
        on_victim = [i for i in range(len(prompts))
                     if cluster.orchestrator._streams[f"m{i}"].decode_id == victim]
        os.kill(status[victim].pid, getattr(signal, sig))

        async def drain(i, s):
            async for ch in s:
                got[i] += ch.token_ids
                lps[i] += ch.logprobs or []
        try:
            await asyncio.wait_for(asyncio.gather(*[drain(i, s) for i, s in enumerate(streams)]),
                                   120)
        finally:
            if sig == "SIGSTOP":
                os.kill(status[victim].pid, signal.SIGCONT)
        journals = {i: [e.kind for e in cluster.store.journal_get(f"m{i}")] for i in on_victim}
        await assert_no_blocks_held(cluster, timeout_s=30)
        return (got, lps, on_victim, journals, (await cluster.stats()).migrations,
                cluster.orchestrator.heartbeats.num_exited)

    got, lps, on_victim, journals, migrations, exited = run_cluster(loop, config, body)
    assert on_victim, "no stream was on the lost worker"
    assert got == refs
    assert [[lp.token_id for lp in x] for x in lps] == refs
    for x, want in zip(lps, ref_lps, strict=True):
        assert max(abs(lp.logprob - w) for lp, w in zip(x, want, strict=True)) < 1e-3
    assert all(j.count("migrated") == 1 and j[-1] == "finished" for j in journals.values())
    # A re-prefill on a prefill worker reserves KV on the new decode worker; a rebuild there not.
    moved = {i: j[j.index("migrated"):] for i, j in journals.items()}
    assert all(("reserved" in j) == (where == "prefill") for j in moved.values()), moved
    # A rebuild on the decode worker first pulls the prompt's whole 16-token blocks a prefill
    # worker holds (the tokens and logprobs above prove the pulled KV right).
    if where == "decode":
        pulled = {i: "pulled" in j for i, j in moved.items()}
        assert pulled == {i: len(prompts[i]) >= 16 for i in on_victim}, (pulled, journals)
    # A stopped worker is found by the heartbeat's second of silence (its lifeline stays open);
    # a killed one by its lifeline closing, before Ray says anything (worker_protocol.lifeline).
    if sig == "SIGSTOP":
        assert migrations == {"worker_silent": len(on_victim)} and exited == 0
    else:
        assert set(migrations) <= {"worker_died", "stream_lost"} and exited == 1
        assert sum(migrations.values()) == len(on_victim)
    roots = {s.attributes["gen_ai.response.id"]: s for s in otlp.spans()
             if s.parent_id == "" and s.attributes.get("gen_ai.response.id", "").startswith("m")}
    for i in range(len(prompts)):
        root = roots[f"m{i}"]
        spans = otlp.wait_for(root.trace_id, {"route", "decode", "decode.generate"})
        decodes = sorted((s for s in spans if s.name == "decode"), key=lambda s: s.start_ns)
        assert root.attributes["pdcluster.migrations"] == (i in on_victim)
        if i in on_victim:
            assert [s.status for s in decodes] == [2, 0], decodes
            assert decodes[0].end_ns <= decodes[1].start_ns
        else:
            assert [s.status for s in decodes] == [0]


def test_restarted_workers_rejoin_and_serve(loop, tiny_llama_dir, workload):
    """SIGKILL a decode and a prefill worker mid-stream with restarts on: the streams migrate
    (tokens equal transformers), Ray restarts both processes, and each rejoins under its id:
    a new pid, the decode worker's new KV port, ``restarts`` 1, state ready. Then both serve
    again: KV flows to the restarted decode worker's new port from the restarted prefill
    worker and from prefill-1, which had a group with decode-0's old process (it drops its
    cached store client and group when the address changes)."""
    import os
    import signal

    prompts, refs = workload
    long_prompts = random_prompts(seed=22, count=4, max_len=40, min_len=8)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    long_refs = hf_greedy(tiny_llama_dir, "llama", long_prompts, 200)
    config = _config(tiny_llama_dir, worker_restarts=2)

    def only(cluster, prefill: str | None, decode: str | None) -> None:
        """Route new requests to these workers alone (the others look KV-quarantined)."""
        orch, until = cluster.orchestrator, time.monotonic() + 600
        for slots, keep in ((orch.prefill, prefill), (orch.decode, decode)):
            for wid, slot in slots.items():
                slot.view.kv_unreachable_until = 0.0 if keep in (None, wid) else until

    async def body(cluster):
        only(cluster, "prefill-1", "decode-0")  # prefill-1 gets a group with decode-0
        warm, _ = await _collect(cluster, prompts[9], request_id="warm")
        sent_before = {lo.worker_id: lo.kv_transfer_bytes for lo in await cluster.worker_loads()}
        only(cluster, None, None)
        streams = [cluster.generate(GenerateInput(long, token_ids=p, request_id=f"r{i}"))
                   for i, p in enumerate(long_prompts)]
        got = [[] for _ in long_prompts]
        for i, s in enumerate(streams):
            while len(got[i]) < 5:
                got[i] += (await anext(s)).token_ids
        before = {w.id: w for w in await cluster.cluster_status()}
        orch = cluster.orchestrator
        old_incarnation = orch.kv_index.cursor("decode-0").incarnation
        for victim in ("decode-0", "prefill-0"):
            os.kill(before[victim].pid, signal.SIGKILL)

        async def drain(i, s):
            async for ch in s:
                got[i] += ch.token_ids
        await asyncio.wait_for(asyncio.gather(*[drain(i, s) for i, s in enumerate(streams)]), 120)

        def rejoined(status):
            w = {x.id: x for x in status}
            return all(w[v].state == "ready" and w[v].restarts == 1 for v in ("decode-0", "prefill-0"))
        after = {w.id: w for w in await _wait_for(cluster.cluster_status, rejoined, 60)}
        only(cluster, None, "decode-0")  # every transfer goes to decode-0's new port
        sent_mid = {lo.worker_id: lo.kv_transfer_bytes for lo in await cluster.worker_loads()}
        results = await asyncio.gather(*[_collect(cluster, p, request_id=f"again-{i}")
                                         for i, p in enumerate(prompts[:8])])
        loads = {lo.worker_id: lo for lo in await cluster.worker_loads()}
        await assert_no_blocks_held(cluster)

        async def index_vs_process():  # KV-aware routing's entry for decode-0, and the truth
            snap = await orch.decode["decode-0"].handle.kv_snapshot.remote()
            cur = orch.kv_index.cursor("decode-0")
            return snap, cur, orch.kv_index.num_cached_blocks("decode-0")
        snap, cur, cached = await _wait_for(
            index_vs_process, lambda r: (r[1].incarnation, r[1].seq, r[2])
            == (r[0].incarnation, r[0].seq, len(r[0].block_hashes)), 10)
        indexed = (old_incarnation, cur.incarnation, cached)
        return (got, before, after, [warm] + [t for t, _ in results], loads, sent_before,
                sent_mid, indexed)

    got, before, after, toks, loads, sent_before, sent_mid, indexed = run_cluster(
        loop, config, body)
    # The router's KV index dropped the dead process's entry and follows the new one.
    assert indexed[0] != indexed[1] and indexed[2] > 0
    assert sent_before["prefill-1"] > 0 and sent_before["decode-0"] == sent_before["prefill-1"]
    assert got == long_refs
    assert toks == [refs[9]] + refs[:8]
    for victim in ("decode-0", "prefill-0"):
        assert after[victim].pid != before[victim].pid
        assert after[victim].restarts == 1
    assert after["decode-0"].kv_address != before["decode-0"].kv_address
    assert after["decode-1"].restarts == 0 and after["prefill-1"].restarts == 0
    # The restarted processes' counters start at zero; decode-0's new one received exactly
    # what both prefill workers sent after the restart, and each sent some.
    from_p1 = loads["prefill-1"].kv_transfer_bytes - sent_mid["prefill-1"]
    assert loads["prefill-0"].kv_transfer_bytes > 0 and from_p1 > 0
    assert loads["decode-0"].kv_transfer_bytes == loads["prefill-0"].kv_transfer_bytes + from_p1
