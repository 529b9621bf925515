"""Draining a worker (scale-down, maintenance) over a real local Ray: nothing is lost.

A drained decode worker's streams either finish there or move to another decode worker and
stay equal to transformers' greedy tokens; a prefill worker drained mid-transfer finishes
that prefill first; new work goes elsewhere from the moment the drain starts; the drained
process exits and holds nothing. One drain goes through the HTTP front door and the
``pdcluster drain`` command line, as an operator would run it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from engine import EngineArgs, SamplingParams
from router.cluster.ray_cluster import ClusterConfig
from router.contract import InvalidRequestError, WorkerNotFoundError
from tests.helpers.async_util import (
    assert_no_blocks_held,
    generate_tokens,
    run_cluster,
    until,
)
from tests.helpers.tiny_models import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


def _config(model_dir, prefill: int, decode: int, overrides: dict,
            mode: str = "disaggregated") -> ClusterConfig:
    return ClusterConfig(model=str(model_dir), mode=mode, num_prefill_workers=prefill,
                         num_decode_workers=decode,
                         prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=8),
                         decode_engine=EngineArgs(block_size=8, num_threads=1),
                         transfer_timeout_s=10.0, lease_s=10.0, worker_num_cpus=1.0,
                         worker_restarts=0, worker_overrides=overrides)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _workers_of(cluster, rid: str, kind: str) -> list[str]:
    return [e.worker_id for e in cluster.store.journal_get(rid) if e.kind == kind]


@pytest.mark.parametrize(("mode", "migrate_after_s"), [
    ("disaggregated", 0.3), ("disaggregated", 60.0), ("colocated", 0.3)],
    ids=["migrate", "finish-there", "colocated-migrate"])
def test_a_drained_decode_worker_loses_no_stream(loop, tiny_llama_dir, mode, migrate_after_s):
    """Four greedy streams on two decode workers (10 ms a step: each runs ~1.2 s); the
    worker of the first is drained once every stream has its first token. With a short
    ``migrate_after_s`` its streams move and continue on the other worker; with a long one
    they finish where they are. Either way every client gets transformers' tokens, the drain
    counts what it did, a request sent meanwhile never goes to the drained worker, its
    process exits and no block stays held."""
    prompts = random_prompts(seed=5, count=4, max_len=40, min_len=8)
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    slow = {"fault_delay_per_step_s": 0.01}
    config = _config(tiny_llama_dir, 1 if mode == "disaggregated" else 0, 2,
                     {"decode-0": slow, "decode-1": slow}, mode)

    async def body(cluster):
        from router.contract import GenerateInput

        streams = [cluster.generate(GenerateInput(params, token_ids=p, request_id=f"d{i}"))
                   for i, p in enumerate(prompts)]
        got = [[] for _ in prompts]
        for i, s in enumerate(streams):
            while not got[i]:
                got[i] += (await anext(s)).token_ids
        victim = next(w for w in ("decode-0", "decode-1")
                      if "d0" in {s.request_id for s in cluster.orchestrator.streams_on(w)})
        on_victim = {s.request_id for s in cluster.orchestrator.streams_on(victim)}
        pid = {w.id: w.pid for w in await cluster.cluster_status()}[victim]
        started = await cluster.drain_worker(victim, migrate_after_s)
        assert started.state == "draining" and started.worker_id == victim
        states = {w.id: w.state for w in await cluster.cluster_status()}
        assert states[victim] == "draining"
        # New work goes elsewhere while it drains.
        late = await generate_tokens(cluster, params, prompts[1], "late")

        async def rest(i, s):
            async for ch in s:
                got[i] += ch.token_ids
        await asyncio.gather(*(rest(i, s) for i, s in enumerate(streams)))
        done = await cluster.drain_worker(victim, wait=True)
        status = {w.id: w for w in await cluster.cluster_status()}

        async def exited():
            return not _pid_alive(pid)
        await until(exited, "the drained process to exit")
        await assert_no_blocks_held(cluster, timeout_s=30)
        journals = {rid: [e.kind for e in cluster.store.journal_get(rid)]
                    for rid in [f"d{i}" for i in range(4)]}
        return (got, late, victim, on_victim, done, status, journals,
                _workers_of(cluster, "late", "finished"))

    got, late, victim, on_victim, done, status, journals, late_on = run_cluster(
        loop, config, body)
    assert got == refs and late == refs[1]
    assert late_on and victim not in late_on
    assert on_victim and "d0" in on_victim
    assert done.state == "drained" and done.remaining == 0
    assert status[victim].state == "drained"
    others = [w.state for w in status.values() if w.id != victim]
    assert others == ["ready"] * (2 if mode == "disaggregated" else 1)  # 1P+1D, or 1D
    if migrate_after_s < 1:
        assert (done.streams_migrated, done.streams_finished) == (len(on_victim), 0)
        assert all(journals[rid].count("migrated") == 1 for rid in on_victim)
    else:
        assert (done.streams_migrated, done.streams_finished) == (0, len(on_victim))
        assert all("migrated" not in kinds for kinds in journals.values())


def test_a_prefill_worker_drained_mid_transfer_finishes_it_first(loop, tiny_llama_dir):
    """A prefill worker whose layers take 0.5 s each is drained while it computes and
    streams a prompt's KV: the drain waits for that request, which completes with
    transformers' tokens; the next request is prefilled by the other worker. The operator's
    ``pdcluster drain`` (through the HTTP front door) of the same worker waits for the drain
    and reports it; draining the last ready decode worker or an unknown one is refused."""
    prompts = random_prompts(seed=9, count=2, max_len=60, min_len=30)
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, 16)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    config = _config(tiny_llama_dir, 2, 1, {"prefill-0": {"fault_delay_per_layer_s": 0.5},
                                             "prefill-1": {"fault_delay_per_layer_s": 0.5}})

    async def body(cluster):
        from router.frontdoor.lifecycle import serve_frontdoor

        fd = await serve_frontdoor(cluster, grpc_port=0, http_port=0, drain_grace_s=1)
        try:
            first = asyncio.ensure_future(generate_tokens(cluster, params, prompts[0], "p0"))
            orch = cluster.orchestrator

            async def prefilling():
                return any(s.prefill_id for w in ("prefill-0", "prefill-1")
                           for s in orch.streams_on(w))
            await until(prefilling, "the prefill to start")
            victim = next(w for w in ("prefill-0", "prefill-1") if orch.streams_on(w))
            started = await cluster.drain_worker(victim)
            cli = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "router.cli", "drain", victim,
                                 "--http-address", f"127.0.0.1:{fd.http_port}"],
                capture_output=True, text=True, timeout=120)
            toks = await first
            second = await generate_tokens(cluster, params, prompts[1], "p1")
            errors = []
            for wid in ("decode-0", "nobody"):
                try:
                    await cluster.drain_worker(wid)
                except (InvalidRequestError, WorkerNotFoundError) as e:
                    errors.append(type(e))
            await assert_no_blocks_held(cluster, timeout_s=30)
            states = {w.id: w.state for w in await cluster.cluster_status()}
            return (victim, started, cli, toks, second, errors, orch.drains.status(victim),
                    states, _workers_of(cluster, "p1", "prefilled"))
        finally:
            await fd.stop(1)

    victim, started, cli, toks, second, errors, done, states, p1_prefilled = run_cluster(
        loop, config, body)
    assert started.state == "draining" and started.remaining == 1  # the prefill in flight
    assert cli.returncode == 0, cli.stderr
    assert f"{victim} (prefill): drained" in cli.stdout, cli.stdout
    assert "1 streams finished there, 0 migrated" in cli.stdout
    assert toks == refs[0] and second == refs[1]
    assert done.state == "drained" and done.streams_finished == 1
    assert states[victim] == "drained"
    assert p1_prefilled and victim not in p1_prefilled
    assert errors == [InvalidRequestError, WorkerNotFoundError]
