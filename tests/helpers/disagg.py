"""What the disaggregated-serving modules share: their cluster shape, one request collected to
its end, journal reads, and an async poll with a deadline."""

from __future__ import annotations

import asyncio
import time

from engine import EngineArgs, SamplingParams
from router.cluster.ray_cluster import ClusterConfig
from router.contract import GenerateInput
from tests.helpers.tiny_models import hf_greedy, random_prompts

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def disagg_workload(model_dir):
    """32 random prompts and transformers' greedy continuation of each (MAX_TOKENS)."""
    prompts = random_prompts(seed=7, count=32, max_len=90, min_len=3)
    return prompts, hf_greedy(model_dir, "llama", prompts, MAX_TOKENS)


def disagg_config(model_dir, **kw) -> ClusterConfig:
    """2 prefill + 2 decode workers, one thread each; ``kw`` overrides any field."""
    base = dict(model=str(model_dir), num_prefill_workers=2, num_decode_workers=2,
                prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=8),
                decode_engine=EngineArgs(block_size=8, num_threads=1),
                transfer_timeout_s=10.0, lease_s=10.0, worker_num_cpus=1.0)
    base.update(kw)
    return ClusterConfig(**base)


async def collect(cluster, prompt, params=GREEDY, request_id=None):
    toks, last = [], None
    async for ch in cluster.generate(GenerateInput(params, token_ids=prompt, request_id=request_id)):
        toks += ch.token_ids
        last = ch
    return toks, last


def journal_kinds(cluster, rid):
    return [e.kind for e in cluster.store.journal_get(rid)]


async def wait_for(probe, ok, timeout_s=20.0):
    """Poll ``probe`` (sync or awaitable) until ``ok`` holds; AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if asyncio.iscoroutine(value) or hasattr(value, "__await__"):
            value = await value
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"condition not met; last value {value!r}"
        await asyncio.sleep(0.02)
