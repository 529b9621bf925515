"""Cluster-wide prefix reuse on a real local Ray (2 prefill + 1 decode worker, round-robin
prefill picks, ``--prefix-pull always``): the second request of a shared prefix lands on the
prefill worker that lacks it, which pulls the prefix over the KV transport from the worker that
holds the most of it (the other prefill worker, or the decode worker) instead of computing it.
Tokens equal transformers' greedy ones, the puller computes only the rest, nothing is held at
the end; a source killed mid-pull leaves the puller holding nothing and the request computes
its prefix."""

from __future__ import annotations

import asyncio

import pytest
import ray

from engine import EngineArgs, SamplingParams
from router.cluster.ray_cluster import ClusterConfig
from router.routing.policy import RoutingConfig
from tests.helpers.async_util import (
    assert_no_blocks_held,
    generate_tokens,
    run_cluster,
    until,
)
from tests.helpers.tiny_models import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


def _config(model_dir, prefill_bs: int, decode_bs: int, **kw) -> ClusterConfig:
    return ClusterConfig(model=str(model_dir), num_prefill_workers=2, num_decode_workers=1,
                         prefill_engine=EngineArgs(block_size=prefill_bs, num_threads=1),
                         decode_engine=EngineArgs(block_size=decode_bs, num_threads=1),
                         transfer_timeout_s=10.0, lease_s=10.0, worker_num_cpus=1.0,
                         routing=RoutingConfig("round_robin", prefix_pull="always"), **kw)


def _journal(orch, rid: str) -> dict[str, tuple[str, str]]:
    return {e.kind: (e.worker_id, e.detail) for e in orch.store.journal_get(rid)}


async def _indexed(orch, prompt: list[int], worker_ids: list[str], tokens: int) -> bool:
    held = orch.kv_index.held_tokens(prompt, worker_ids)
    return all(held.get(w, 0) >= tokens for w in worker_ids)


@pytest.mark.parametrize(("prefill_bs", "decode_bs", "source_role", "pulled"), [
    (8, 16, "prefill", 40),  # the other prefill worker holds 40 tokens, the decode one 32
    (16, 8, "decode", 32),   # the decode worker holds 40, the prefill one 32: 32 fit 16s
])
def test_the_second_request_pulls_the_prefix_instead_of_computing_it(
        loop, tiny_llama_dir, prefill_bs, decode_bs, source_role, pulled):
    first = random_prompts(seed=61, count=1, max_len=41, min_len=41)[0]
    second = first[:40] + random_prompts(seed=62, count=1, max_len=7, min_len=7)[0]

    async def body(cluster):
        orch = cluster.orchestrator
        out1 = await generate_tokens(cluster, GREEDY, first, "first")
        first_on = _journal(orch, "first")["prefilled"][0]
        holders = [first_on, *orch.decode]
        await until(lambda: _indexed(orch, first, holders, 32), "the index to see the prefix")
        before = await cluster.stats()
        out2 = await generate_tokens(cluster, GREEDY, second, "second")
        after = await cluster.stats()
        await assert_no_blocks_held(cluster)
        return out1, out2, first_on, _journal(orch, "second"), before, after

    out1, out2, first_on, journal, before, after = run_cluster(
        loop, _config(tiny_llama_dir, prefill_bs, decode_bs), body)
    assert [out1, out2] == hf_greedy(tiny_llama_dir, "llama", [first, second], GREEDY.max_tokens)
    puller = journal["prefilled"][0]
    assert puller != first_on  # round robin sent it to the worker lacking the prefix
    source, detail = journal["pulled"]
    assert source == (first_on if source_role == "prefill" else "decode-0"), detail
    assert after.prefix_pulled_tokens - before.prefix_pulled_tokens == pulled
    computed = after.prefill_computed_tokens - before.prefill_computed_tokens
    assert computed == len(second) - pulled  # the puller computed only what it lacked


def test_a_source_killed_mid_pull_leaves_nothing_and_the_prefix_is_computed(loop,
                                                                           tiny_llama_dir):
    first = random_prompts(seed=63, count=1, max_len=41, min_len=41)[0]
    second = first[:40] + random_prompts(seed=64, count=1, max_len=7, min_len=7)[0]
    # A source sleeps 3 s before each layer it sends: the pull is open long enough to kill it.
    slow = {"fault_pull_delay_per_layer_s": 3.0}
    config = _config(tiny_llama_dir, 8, 16,
                     worker_overrides={"prefill-0": slow, "prefill-1": slow})

    async def body(cluster):
        orch = cluster.orchestrator
        out1 = await generate_tokens(cluster, GREEDY, first, "first")
        first_on = _journal(orch, "first")["prefilled"][0]
        await until(lambda: _indexed(orch, first, [first_on], 40), "the index to see it")
        source = orch.prefill[first_on].handle
        before = await cluster.stats()
        task = asyncio.ensure_future(generate_tokens(cluster, GREEDY, second, "second"))
        await asyncio.sleep(1.5)  # reserved, pulling: the source sleeps before layer 0
        assert not task.done()
        ray.kill(source, no_restart=False)  # Ray restarts it; the pull is lost
        out2 = await task
        after = await cluster.stats()
        loads = {lo.worker_id: lo for lo in await cluster.worker_loads()}
        await assert_no_blocks_held(cluster)
        return out1, out2, first_on, _journal(orch, "second"), before, after, loads

    out1, out2, first_on, journal, before, after, loads = run_cluster(loop, config, body)
    assert [out1, out2] == hf_greedy(tiny_llama_dir, "llama", [first, second], GREEDY.max_tokens)
    source, detail = journal["recomputed"]
    assert source == first_on and "pull failed" in detail, detail
    assert "pulled" not in journal
    assert after.prefix_pulled_tokens == before.prefix_pulled_tokens
    assert after.prefix_recomputed_tokens - before.prefix_recomputed_tokens == 40
    puller = journal["prefilled"][0]
    assert puller != first_on
    assert loads[puller].kv_blocks_reserved == 0  # the pull's pages were released
