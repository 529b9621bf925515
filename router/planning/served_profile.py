"""`pdcluster profile --served`: the step times a cluster's workers really take, measured while
they serve.

A bare engine's steps (``engine.profile``) leave out what serving adds on the same cores: the
router, Ray, each prefill worker's KV export and sender, each decode worker's receiver. On a
small host that is a third or more of a prefill's time (``docs/figures/history.md``, the
planner's check). This profile starts a local 1 prefill + 1 decode cluster of the model and
measures, through the cluster's own counters:

- prefill: each prompt length sent alone (nothing queued), the prefill worker's own compute
  time for it (``PrefillResult.compute_s``: its first step to the end of the step that
  finished it), the median of ``repeats``;
- the fixed part of a first token beyond that compute (router calls, Ray hops, the exposed
  KV tail): the median of TTFT - queue - compute, ``overhead_s``;
- decode: ``b`` requests at once with ``c``-token prompts, for each ``b`` of the grid; the
  decode worker's pure-decode step time at every batch size it stepped at (its
  ``decode_steps`` counters over the runs, sizes seen at least 3 times);
- the router's CPU per streamed token (this process is the router: its CPU time over the
  decode runs / their tokens), ``router_cpu_s_per_token``.

The result is an ``EngineProfile`` like the bare one (``served`` True, ``overhead_s`` set),
for ``pdcluster plan``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

from engine.profile import EngineProfile, ProfileGrid, measure_loopback_bytes_s

__all__ = ["profile_served"]


async def _one(cluster: Any, prompt: list[int], max_tokens: int, rid: str) -> float:
    """Run one greedy request to its end; its client-side TTFT."""
    from engine import SamplingParams
    from router.contract import GenerateInput

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start, first = time.perf_counter(), None
    async for ch in cluster.generate(GenerateInput(params, token_ids=prompt, request_id=rid)):
        if first is None and ch.token_ids:
            first = time.perf_counter() - start
    assert first is not None, f"{rid} produced no token"
    return first


async def _measure(cluster: Any, grid: ProfileGrid, vocab: int, seed: int,
                   progress) -> tuple[list, list, list[float]]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    ids = iter(range(10**9))
    orch = cluster.orchestrator
    # Both workers' first steps (allocations, kernel plans) are not measured.
    for _ in range(2):
        await _one(cluster, prompt(32), 4, f"warm-{next(ids)}")
    prefill, overheads = [], []
    for n in grid.prompt_lens:
        times = []
        for _ in range(grid.repeats):
            rid = f"p-{next(ids)}"
            ttft = await _one(cluster, prompt(n), 1, rid)
            t = orch.timings[rid]
            times.append(t.prefill_compute_s)
            overheads.append(max(0.0, ttft - t.queue_s - t.prefill_compute_s))
        prefill.append((1, n, statistics.median(times)))
        progress(f"served prefill {n} tokens: {statistics.median(times) * 1e3:.1f} ms")
    decode = []
    cpu0, tokens = time.process_time(), 0
    # Long enough that the batch's requests, admitted a few steps apart, mostly decode
    # together: the counters are per exact batch size.
    steps = max(4 * grid.decode_steps, 48)
    for c in grid.contexts:
        seen: dict[int, list[tuple[int, float]]] = {}
        for b in grid.decode_batches:
            before = (await cluster.stats()).decode_steps
            await asyncio.gather(*(_one(cluster, prompt(c), steps, f"d-{next(ids)}")
                                   for _ in range(b)))
            after = (await cluster.stats()).decode_steps
            tokens += b * steps
            # Every batch size the run stepped at counts (its requests arrive a prefill step
            # or more apart, so the batch grows to b and shrinks as they end).
            for size, (n, secs) in after.items():
                n0, s0 = before.get(size, (0, 0.0))
                if n - n0 >= 3:
                    seen.setdefault(size, []).append((n - n0, secs - s0))
        for size in sorted(seen):
            n = sum(k for k, _ in seen[size])
            secs = sum(x for _, x in seen[size])
            decode.append((size, c, secs / n))
        progress(f"served decode steps at {c} tokens: " + ", ".join(
            f"batch {b} {x * 1e3:.1f} ms" for b, cc, x in decode if cc == c))
    # This process is the router: its CPU over the decode runs, per token it streamed.
    return prefill, decode, overheads, (time.process_time() - cpu0) / max(tokens, 1)


def profile_served(model: str | None, num_threads: int, grid: ProfileGrid | None = None,
                   seed: int = 0, progress=lambda msg: None) -> EngineProfile:
    """Measure ``grid`` (its prompt lengths, decode batches and contexts; prefill batches are
    not: a served step's cost follows its tokens) on a fresh local 1P+1D cluster."""
    from engine import EngineArgs
    from engine.weights import load_model_config, resolve_model
    from router.cluster.ray_cluster import Cluster, ClusterConfig

    grid = grid or ProfileGrid.quick()
    t0 = time.perf_counter()
    resolved = resolve_model(model)
    cfg = load_model_config(resolved.model_dir, model_id=resolved.model_id)
    max_len = max(*grid.prompt_lens, *grid.contexts) + max(4 * grid.decode_steps, 48) + 16
    seqs = max(grid.decode_batches)
    common = dict(num_threads=num_threads, max_model_len=max_len, enable_prefix_caching=False)
    config = ClusterConfig(
        model=model, num_prefill_workers=1, num_decode_workers=1,
        prefill_engine=EngineArgs(max_num_seqs=8, **common),
        decode_engine=EngineArgs(max_num_seqs=seqs, **common), worker_num_cpus=0.5)

    async def run():
        cluster = await Cluster.start(config)
        try:
            return await _measure(cluster, grid, cfg.vocab_size, seed, progress)
        finally:
            await cluster.shutdown()

    prefill, decode, overheads, cpu_per_token = asyncio.run(run())
    prof = EngineProfile(cfg.model_id, num_threads, "cpu",
                         config.prefill_engine.max_num_batched_tokens, cfg.kv_bytes_per_token,
                         prefill, decode, measure_loopback_bytes_s(),
                         served=True, overhead_s=statistics.median(overheads),
                         router_cpu_s_per_token=cpu_per_token)
    prof.wall_s = time.perf_counter() - t0
    return prof
