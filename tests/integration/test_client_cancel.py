"""Clients that go away mid-request, over a real local Ray 1P+1D cluster of the tiny model:
whatever call their request waits on, their tasks end at once and no KV block stays held."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from engine import EngineArgs, SamplingParams
from router.cluster.ray_cluster import ClusterConfig
from router.contract import GenerateInput
from tests.helpers.async_util import assert_no_blocks_held, run_cluster
from tests.helpers.tiny_models import random_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


async def _collect(cluster, prompt, params):
    async for _ in cluster.generate(GenerateInput(params, token_ids=prompt)):
        pass


def test_clients_cancelled_at_any_moment_end_at_once_and_free_everything(loop, tiny_llama_dir):
    """Four clients keep short greedy requests going (each one ends, the next starts) and
    are cancelled together at random moments, twelve times: whatever call each request was
    in (reserve, prefill, commit, a token's wait), every client's task ends within seconds,
    and no worker holds a KV block after. (Python 3.11's ``asyncio.wait_for`` lost a
    cancellation that arrived as its call returned: such a client's request ran on, its
    task never ended.)"""
    prompts = random_prompts(seed=7, count=32, max_len=90, min_len=3)
    rng = random.Random(3)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    async def body(cluster):
        started = [0]

        async def client():
            while True:
                started[0] += 1
                await _collect(cluster, prompts[started[0] % len(prompts)], params)

        slowest = 0.0
        for _ in range(12):
            tasks = [asyncio.ensure_future(client()) for _ in range(4)]
            await asyncio.sleep(rng.uniform(0.2, 1.2))
            t0 = time.monotonic()
            for t in tasks:
                t.cancel()
            done, pending = await asyncio.wait(tasks, timeout=15)
            assert not pending, f"{len(pending)} cancelled clients still running after 15 s"
            slowest = max(slowest, time.monotonic() - t0)
        await assert_no_blocks_held(cluster)
        return started[0], slowest

    config = ClusterConfig(model=str(tiny_llama_dir), num_prefill_workers=1,
                           num_decode_workers=1,
                           prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=8),
                           decode_engine=EngineArgs(block_size=8, num_threads=1),
                           transfer_timeout_s=10.0, lease_s=10.0, worker_num_cpus=1.0)
    started, slowest = run_cluster(loop, config, body)
    assert started > 48 and slowest < 15
