"""The autoscaler over a real local Ray: decode pressure adds a decode worker through Ray,
the load going away drains one again, and no request is lost on the way (every stream
equals transformers' greedy tokens); a worker that does not come up is reported, leaves
nothing behind, and the cluster serves on."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineArgs, SamplingParams
from router.cluster.autoscale import AutoscaleConfig
from router.cluster.launcher import StartupError
from router.cluster.ray_cluster import ClusterConfig
from router.control.autoscaler import ScalePolicy
from tests.helpers.async_util import (
    assert_no_blocks_held,
    generate_tokens,
    run_cluster,
    until,
)
from tests.helpers.tiny_models import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 300


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


def test_decode_pressure_adds_a_worker_and_its_end_drains_one_losing_nothing(
        loop, tiny_llama_dir):
    """1 prefill + 1 decode worker (4 sequences each, 10 ms a step), decode bounds 1..2:
    eight 300-token streams fill the decode worker past the target (running + waiting over
    max_num_seqs), so a second decode worker is added while they run; once they end the
    autoscaler drains one. Every stream completes with transformers' tokens, the decisions
    are counted and exported, and no block stays held."""
    prompts = random_prompts(seed=13, count=8, max_len=30, min_len=6)
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    slow = {"fault_delay_per_step_s": 0.01}
    policy = ScalePolicy(min_prefill=1, max_prefill=1, min_decode=1, max_decode=2,
                         target_utilization=0.5, interval_s=0.25, up_window_s=0.5,
                         down_window_s=2.0, cooldown_s=1.0)
    config = ClusterConfig(
        model=str(tiny_llama_dir), num_prefill_workers=1, num_decode_workers=1,
        prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=8),
        decode_engine=EngineArgs(block_size=8, num_threads=1, max_num_seqs=4),
        transfer_timeout_s=10.0, lease_s=10.0, worker_num_cpus=1.0, worker_restarts=0,
        worker_overrides={"decode-0": slow, "decode-1": slow},
        autoscale=AutoscaleConfig(policy, ready_timeout_s=120, drain_migrate_after_s=1.0))

    async def body(cluster):
        from router.frontdoor.metrics import Metrics

        runs = [asyncio.ensure_future(generate_tokens(cluster, params, p, f"a{i}"))
                for i, p in enumerate(prompts)]

        async def two_decode_workers():
            return sum(w.role == "decode" and w.state == "ready"
                       for w in await cluster.cluster_status()) == 2
        await until(two_decode_workers, "a second decode worker", timeout_s=120)
        got = await asyncio.gather(*runs)

        async def drained():
            return any(w.state == "drained" for w in await cluster.cluster_status())
        await until(drained, "a decode worker drained after the load", timeout_s=60)
        after = await generate_tokens(cluster, params, prompts[0], "after")
        await assert_no_blocks_held(cluster, timeout_s=30)
        stats = await cluster.stats()
        text = (await Metrics(cluster).render()).decode()
        states = sorted((w.id, w.state) for w in await cluster.cluster_status())
        return got, after, stats, text, states

    got, after, stats, text, states = run_cluster(loop, config, body)
    assert got == refs and after == refs[0]
    assert stats.autoscaler_decisions.get(("decode", "up", "load"), 0) == 1
    assert stats.autoscaler_decisions.get(("decode", "down", "load"), 0) == 1
    assert stats.autoscaler_desired == {"prefill": 1, "decode": 1}
    assert ('pdcluster_autoscaler_decisions_total{direction="up",reason="load",role="decode"} '
            '1.0') in text
    assert 'pdcluster_autoscaler_desired_workers{role="decode"} 1.0' in text
    assert [s for _, s in states].count("drained") == 1
    assert [s for _, s in states].count("ready") == 2  # prefill-0 + one decode worker


def test_a_worker_that_does_not_come_up_is_reported_and_leaves_nothing(loop, tiny_llama_dir):
    """An added worker not up in time (as when no node has room for it) raises StartupError
    naming it; no actor, no starting entry and no worker record stays; the cluster serves
    on, and a later add succeeds and takes requests."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = random_prompts(seed=3, count=1, max_len=20, min_len=10)[0]
    ref = hf_greedy(tiny_llama_dir, "llama", [prompt], 8)[0]
    config = ClusterConfig(
        model=str(tiny_llama_dir), mode="colocated", num_prefill_workers=0,
        num_decode_workers=1, decode_engine=EngineArgs(block_size=8, num_threads=1),
        worker_num_cpus=1.0, worker_restarts=0,
        autoscale=AutoscaleConfig(ScalePolicy(min_decode=1, max_decode=3, interval_s=60)))

    async def body(cluster):
        actors = len(cluster.launcher.actors)
        with pytest.raises(StartupError, match="decode-1 was not up within"):
            await cluster.add_worker("decode", ready_timeout_s=0.01)
        left = (len(cluster.launcher.actors) - actors, dict(cluster.launcher.starting),
                sorted(w.id for w in await cluster.cluster_status()))
        served = await generate_tokens(cluster, params, prompt, "still")
        info = await cluster.add_worker("decode")
        await cluster.drain_worker("decode-0", migrate_after_s=0, wait=True)
        moved = await generate_tokens(cluster, params, prompt, "moved")
        return left, served, info.worker_id, moved, (await cluster.stats()).workers

    left, served, added, moved, workers = run_cluster(loop, config, body)
    assert left == (0, {}, ["decode-0"])
    assert served == ref and moved == ref
    assert added == "decode-1"
    assert [w.worker_id for w in workers] == ["decode-1"]


def test_an_add_that_never_comes_up_is_retried_and_serving_goes_on(loop, tiny_llama_dir):
    """Decode pressure on one colocated worker whose added peers can never be up in time
    (a 10 ms start-up allowance, as with no node to place them on): each add is reported
    (``unplaceable``), nothing of it stays, the rule asks again after its cooldown, and
    every stream completes with transformers' tokens on the one worker."""
    prompts = random_prompts(seed=17, count=8, max_len=24, min_len=6)
    refs = hf_greedy(tiny_llama_dir, "llama", prompts, 200)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    policy = ScalePolicy(min_decode=1, max_decode=2, target_utilization=0.5, interval_s=0.2,
                         up_window_s=0.2, down_window_s=30, cooldown_s=0.5)
    config = ClusterConfig(
        model=str(tiny_llama_dir), mode="colocated", num_prefill_workers=0,
        num_decode_workers=1,
        decode_engine=EngineArgs(block_size=8, num_threads=1, max_num_seqs=4),
        worker_num_cpus=1.0, worker_restarts=0,
        worker_overrides={"decode-0": {"fault_delay_per_step_s": 0.01}},
        autoscale=AutoscaleConfig(policy, ready_timeout_s=0.01))

    async def body(cluster):
        runs = [asyncio.ensure_future(generate_tokens(cluster, params, p, f"r{i}"))
                for i, p in enumerate(prompts)]

        async def retried():
            return cluster.autoscaler.decisions[("decode", "up", "unplaceable")] >= 2
        await until(retried, "two failed adds", timeout_s=60)
        got = await asyncio.gather(*runs)
        # The rule may be mid-add when the last stream ends (load was still there): stopping
        # the autoscaler cancels that add, which must leave nothing of it either.
        await cluster.autoscaler.close()
        return (got, dict(cluster.autoscaler.decisions), dict(cluster.launcher.starting),
                [w.id for w in await cluster.cluster_status()])

    got, decisions, starting, workers = run_cluster(loop, config, body)
    assert got == refs
    assert decisions[("decode", "up", "load")] >= 2  # asked again after each failure
    assert starting == {} and workers == ["decode-0"]
