"""Disaggregated serving when a worker fails, over a real local Ray: a transfer peer that dies
mid-stream, a decode worker lost (killed or stopped) with streams on it, and restarted workers
that rejoin. The shape and checks are test_disaggregation.py's: tokens equal transformers'
greedy run, and no worker holds a KV block at the end.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import SamplingParams
from router.contract import GenerateInput
from tests.helpers.async_util import assert_no_blocks_held, run_cluster
from tests.helpers.disagg import (
    collect,
    disagg_config,
    disagg_workload,
    wait_for,
)
from tests.helpers.tiny_models import hf_greedy, random_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


@pytest.fixture(scope="module")
def workload(tiny_llama_dir):
    return disagg_workload(tiny_llama_dir)


def test_dead_transfer_peer_releases_reservation_and_request_completes_elsewhere(
        loop, tiny_llama_dir, workload):
    prompts, refs = workload
    # No restarts: this is the worker gone for good (restarts: test_restarted_workers_...).
    config = disagg_config(
        tiny_llama_dir, worker_overrides={"prefill-0": {"fault_exit_after_layers": 1}},
        transfer_timeout_s=5.0, lease_s=5.0, worker_restarts=0)

    async def body(cluster):
        toks, last = await collect(cluster, prompts[6], request_id="survivor")
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

    config = disagg_config(
        tiny_llama_dir, mode=mode, num_prefill_workers=2 if mode == "disaggregated" else 0,
        worker_restarts=restarts, migration_prefill=where,
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
    config = disagg_config(tiny_llama_dir, worker_restarts=2)

    def only(cluster, prefill: str | None, decode: str | None) -> None:
        """Route new requests to these workers alone (the others look KV-quarantined)."""
        orch, until = cluster.orchestrator, time.monotonic() + 600
        for slots, keep in ((orch.prefill, prefill), (orch.decode, decode)):
            for wid, slot in slots.items():
                slot.view.kv_unreachable_until = 0.0 if keep in (None, wid) else until

    async def body(cluster):
        only(cluster, "prefill-1", "decode-0")  # prefill-1 gets a group with decode-0
        warm, _ = await collect(cluster, prompts[9], request_id="warm")
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
            return all(w[v].state == "ready" and w[v].restarts == 1
                       for v in ("decode-0", "prefill-0"))
        after = {w.id: w for w in await wait_for(cluster.cluster_status, rejoined, 60)}
        only(cluster, None, "decode-0")  # every transfer goes to decode-0's new port
        sent_mid = {lo.worker_id: lo.kv_transfer_bytes for lo in await cluster.worker_loads()}
        results = await asyncio.gather(*[collect(cluster, p, request_id=f"again-{i}")
                                         for i, p in enumerate(prompts[:8])])
        loads = {lo.worker_id: lo for lo in await cluster.worker_loads()}
        await assert_no_blocks_held(cluster)

        async def index_vs_process():  # KV-aware routing's entry for decode-0, and the truth
            snap = await orch.decode["decode-0"].handle.kv_snapshot.remote()
            cur = orch.kv_index.cursor("decode-0")
            return snap, cur, orch.kv_index.num_cached_blocks("decode-0")
        snap, cur, cached = await wait_for(
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
