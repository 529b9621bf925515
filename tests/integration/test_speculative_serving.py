"""Speculative decoding on the decode workers of a real local cluster (Ray, KV over gloo):
the streams equal transformers' greedy tokens with drafts accepted and rejected on the
decode side (prompt-lookup drafts need no draft KV: the decode worker holds the prompt and the
output, ``docs/speculative-decoding.md``), and a stream moved off a killed decode worker
keeps speculating on the next one, token for token as an undisturbed run."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine import EngineArgs, SamplingParams
from router.contract import GenerateInput
from tests.helpers.async_util import assert_no_blocks_held, run_cluster
from tests.helpers.disagg import collect, disagg_config
from tests.helpers.spec import EVERY_STEP, repetitive_prompts
from tests.helpers.tiny_models import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


def _spec_decode(**kw) -> EngineArgs:
    return EngineArgs(block_size=8, num_threads=1, speculative_config=EVERY_STEP, **kw)


def _decode_loads(stats):
    return {w.worker_id: w for w in stats.workers if w.role == "decode"}


def test_disaggregated_decode_workers_speculate_and_stream_transformers_tokens(
        loop, tiny_llama_dir, otlp):
    """... and each request's decode span counts its drafts verified and accepted."""
    from worker_protocol.tracing import TracingConfig

    prompts = repetitive_prompts()
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, 24)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    config = disagg_config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=2,
                           decode_engine=_spec_decode(),
                           tracing=TracingConfig(otlp.endpoint, flush_interval_s=0.2))

    async def body(cluster):
        outs = await asyncio.gather(*[collect(cluster, p, params, request_id=f"d{i}")
                                      for i, p in enumerate(prompts)])
        await assert_no_blocks_held(cluster)
        return outs, await cluster.stats()

    outs, stats = run_cluster(loop, config, body)
    assert [t for t, _ in outs] == refs
    assert all(last.usage.completion_tokens == 24 for _, last in outs)
    loads = _decode_loads(stats)
    proposed = sum(w.spec_proposed for w in loads.values())
    accepted = sum(w.spec_accepted for w in loads.values())
    assert 0 < accepted < proposed  # drafts held and drafts were rejected
    assert all(sum(w.spec_accepted_by_position) == w.spec_accepted for w in loads.values())
    # prefill workers produce one token a request: they never speculate
    assert all(w.spec_proposed == 0 for w in stats.workers if w.role == "prefill")
    deadline = time.monotonic() + 30  # spans leave every 0.2 s (flush_interval_s)
    while True:
        roots = {s.attributes["gen_ai.response.id"]: s for s in otlp.spans() if s.parent_id == ""
                 and s.attributes.get("gen_ai.response.id", "").startswith("d")}
        if len(roots) == len(prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    spans = [next(x for x in otlp.wait_for(roots[f"d{i}"].trace_id, {"decode.generate"})
                  if x.name == "decode.generate") for i in range(len(prompts))]
    drafts = [(s.attributes.get("pdcluster.spec.draft_tokens", 0),
               s.attributes.get("pdcluster.spec.accepted_tokens", 0)) for s in spans]
    assert (sum(d for d, _ in drafts), sum(a for _, a in drafts)) == (proposed, accepted)


def test_a_stream_moved_off_a_killed_decode_worker_keeps_speculating(loop, tiny_llama_dir):
    prompts = repetitive_prompts()[3:7]
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, 300)
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    # Each decode worker pauses 10 ms after a step: with drafts accepted the tiny model makes
    # 300 tokens in ~100 steps of ~1 ms, and a stream that ended before the kill would have
    # nothing left to move.
    slow = {"fault_delay_per_step_s": 0.01}
    config = disagg_config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=2,
                           decode_engine=_spec_decode(), migration_prefill="prefill",
                           worker_overrides={"decode-0": slow, "decode-1": slow})

    async def body(cluster):
        status = {w.id: w for w in await cluster.cluster_status()}
        streams = [cluster.generate(GenerateInput(long, token_ids=p, request_id=f"s{i}"))
                   for i, p in enumerate(prompts)]
        got = [[] for _ in prompts]
        for i, s in enumerate(streams):  # every stream committed to a decode worker
            while not got[i]:
                got[i] += (await anext(s)).token_ids
        before = _decode_loads(await cluster.stats())["decode-1"]
        on_victim = [i for i in range(len(prompts))
                     if cluster.orchestrator._streams[f"s{i}"].decode_id == "decode-0"]
        os.kill(status["decode-0"].pid, signal.SIGKILL)

        async def drain(i, s):
            async for ch in s:
                got[i] += ch.token_ids
        await asyncio.wait_for(asyncio.gather(*[drain(i, s) for i, s in enumerate(streams)]), 120)
        after = _decode_loads(await cluster.stats())["decode-1"]
        journals = {i: [e.kind for e in cluster.store.journal_get(f"s{i}")] for i in on_victim}
        await assert_no_blocks_held(cluster, timeout_s=30)
        return got, on_victim, journals, before, after

    got, on_victim, journals, before, after = run_cluster(loop, config, body)
    assert on_victim, "no stream was on the killed worker"
    assert all(j.count("migrated") == 1 and j[-1] == "finished" for j in journals.values()), \
        journals
    assert got == refs
    # decode-1 verified drafts after the move, the moved streams' among them
    assert after.spec_accepted > before.spec_accepted


def test_a_draft_model_on_the_decode_worker_recomputes_the_prompt_and_drafts_right(
        loop, tiny_llama_dir):
    """The prompt's KV crosses for the target only; the decode worker computes its draft's
    prompt KV itself. With the target as its own draft every draft must be accepted: a draft
    KV wrong anywhere (the recomputed prompt, the drafts rolled back) would cost acceptance."""
    prompts = repetitive_prompts()
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, 20)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    draft = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3,
             "adaptive": False}
    config = disagg_config(tiny_llama_dir, num_prefill_workers=1, num_decode_workers=1,
                           decode_engine=EngineArgs(block_size=8, num_threads=1,
                                                    speculative_config=draft))

    async def body(cluster):
        outs = await asyncio.gather(*[collect(cluster, p, params) for p in prompts])
        await assert_no_blocks_held(cluster)
        return outs, await cluster.stats()

    outs, stats = run_cluster(loop, config, body)
    assert [t for t, _ in outs] == refs
    d = _decode_loads(stats)["decode-0"]
    assert d.spec_proposed > 0 and d.spec_accepted == d.spec_proposed
