"""The second KV cache tier in a real cluster (local Ray, 1 prefill + 1 decode worker, pools of
12 blocks): a conversation's prefix pushed out of both pools by other prompts comes back from
the tier on its next turn, on the prefill worker (not recomputed) and on the decode worker (not
transferred); tokens equal transformers' greedy ones, the router's index follows every tier,
no block is held at the end and the tier's disk directories are gone after shutdown."""

from __future__ import annotations

import pytest

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

MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
BLOCK = 8
BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 16 * 4  # tiny model: 2 layers, 2 KV heads of 16, fp32


@pytest.fixture(scope="module")
def loop(shared_ray_loop):
    return shared_ray_loop  # this pytest process's local Ray (tests/helpers/shared_ray.py)


def test_an_evicted_prefix_comes_back_from_the_tier_on_both_workers(loop, tiny_llama_dir,
                                                                    tmp_path):
    # One block of host memory: the tier's blocks live on disk, the path with files.
    engine = dict(block_size=BLOCK, num_threads=1, kv_cache_memory_bytes=12 * BLOCK_BYTES,
                  max_model_len=96, kv_offload_memory_bytes=BLOCK_BYTES,
                  kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=256 * (BLOCK_BYTES + 256))
    config = ClusterConfig(model=str(tiny_llama_dir), num_prefill_workers=1,
                           num_decode_workers=1, prefill_engine=EngineArgs(**engine),
                           decode_engine=EngineArgs(**engine), transfer_timeout_s=10.0,
                           lease_s=10.0, worker_num_cpus=1.0, routing=RoutingConfig("kv_aware"))
    base = random_prompts(seed=31, count=1, max_len=41, min_len=41)[0]
    others = random_prompts(seed=32, count=3, max_len=60, min_len=60)
    follow = base[:40] + random_prompts(seed=33, count=1, max_len=7, min_len=7)[0]
    prompts = [base, *others, follow]

    async def index_follows_workers() -> bool:
        orch = cluster_ref[0].orchestrator
        for slot in (*orch.prefill.values(), *orch.decode.values()):
            snap = await slot.handle.kv_snapshot.remote()
            cur = orch.kv_index.cursor(slot.info.worker_id)
            if cur is None or cur.stale or cur.seq != snap.seq:
                return False
            if orch.kv_index.cached_block_tiers(slot.info.worker_id) != snap.block_tiers():
                return False
        return True

    cluster_ref = []

    async def body(cluster):
        cluster_ref.append(cluster)
        outs = [await generate_tokens(cluster, GREEDY, p, f"t{i}") for i, p in enumerate(prompts[:-1])]
        await until(index_follows_workers, "the index to follow the workers' tiers")
        tiers = {t for slot in (*cluster.orchestrator.prefill.values(),
                                *cluster.orchestrator.decode.values())
                 for t in cluster.orchestrator.kv_index.cached_block_tiers(
                     slot.info.worker_id).values()}
        before = await cluster.stats()
        loads_before = {lo.role: lo for lo in await cluster.worker_loads()}
        outs.append(await generate_tokens(cluster, GREEDY, follow, "follow"))
        after = await cluster.stats()
        loads = {lo.role: lo for lo in await cluster.worker_loads()}
        await assert_no_blocks_held(cluster)
        await until(index_follows_workers, "the index to follow the workers' tiers")
        dirs = sorted(p.name for p in tmp_path.iterdir())
        return outs, tiers, before, after, loads_before, loads, dirs

    outs, tiers, before, after, loads_before, loads, dirs = run_cluster(loop, config, body)
    assert outs == hf_greedy(tiny_llama_dir, "llama", prompts, MAX_TOKENS)
    assert "disk" in tiers  # the router was told where the evicted blocks went
    assert len(dirs) == 2  # one directory per worker while they run
    for role in ("prefill", "decode"):
        restored = (loads[role].kv_offload_restored_tokens
                    - loads_before[role].kv_offload_restored_tokens)
        assert restored >= 40, f"{role} restored {restored} tokens of the 40-token prefix"
    # The prefill worker computed the follow-up's new tokens only (40 came from its tier).
    assert after.prefill_computed_tokens - before.prefill_computed_tokens == len(follow) - 40
    assert list(tmp_path.iterdir()) == []  # both workers removed their files on shutdown
