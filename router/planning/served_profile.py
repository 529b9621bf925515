"""`pdcluster profile --served`: the step times a cluster's workers really take, measured while
they serve.

A bare engine's steps (``engine.tuning.profile``) leave out what serving adds on the same cores: the
router, Ray, each prefill worker's KV export and sender, each decode worker's receiver. On a
small host that is a third or more of a prefill's time
(``docs/history/2026-12-03-wave-3-prefix-and-planner.md``, the planner's check). This profile starts a local 1 prefill + 1 decode cluster of the model and
measures, through the cluster's own counters:

- prefill: each prompt length sent alone (nothing queued), the prefill worker's own compute
  time for it (``PrefillResult.compute_s``: its first step to the end of the step that
  finished it), the median of ``repeats``;
- the fixed part of a first token beyond that compute (router calls, Ray hops, the exposed
  KV tail): the median of TTFT - queue - compute, ``overhead_s``;
- decode: ``b`` streams of ``c``-token prompts kept decoding, for each ``b`` and ``c`` of
  the grid; the decode worker's step time at exactly ``b`` sequences once all are admitted
  (its ``decode_steps`` counters; no prefill runs beside those steps);
- the router's CPU per streamed token (this process is the router: its CPU time over the
  decode runs / their tokens), ``router_cpu_s_per_token``;
- how the two workers' steps slow each other (``_interference``): a prefill's compute while
  the decode worker steps a batch, that batch's steps while prompts are prefilled, and how
  much longer a first token takes when its decode worker is busy (its reserve and commit
  are answered between steps), in decode steps.

The result is an ``EngineProfile`` like the bare one (``served`` True, ``overhead_s`` set),
for ``pdcluster plan``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

from engine.tuning.profile import EngineProfile, ProfileGrid
from router.planning.loopback import measure_loopback_bytes_s

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


async def _measure(cluster: Any, grid: ProfileGrid, vocab: int, max_len: int, seed: int,
                   progress) -> tuple[list, list, list[float], float, tuple]:
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
            t = orch.phases.timings[rid]
            times.append(t.prefill_compute_s)
            overheads.append(max(0.0, ttft - t.queue_s - t.prefill_compute_s))
        prefill.append((1, n, statistics.median(times)))
        progress(f"served prefill {n} tokens: {statistics.median(times) * 1e3:.1f} ms")
    decode = []
    cpu0, tokens = time.process_time(), 0
    want = max(3 * grid.decode_steps, 12)  # steps timed at each (batch, context)
    for c in grid.contexts:
        for b in grid.decode_batches:
            # Short streams, renewed as they end, so the KV pool holds the largest batch;
            # only steps of exactly b sequences count (none of them beside a prefill).
            async with _Decoding(cluster, b, prompt, c, min(max_len - c - 1, 256), ids) as run:
                before = (await cluster.stats()).decode_steps
                n, secs = await _steps_at(cluster, b, before, want)
            tokens += run.tokens
            if n >= 3:
                decode.append((b, c, secs / n))
        progress(f"served decode steps at {c} tokens: " + ", ".join(
            f"batch {b} {x * 1e3:.1f} ms" for b, cc, x in decode if cc == c))
    # This process is the router: its CPU over the decode runs, per token it streamed.
    cpu_per_token = (time.process_time() - cpu0) / max(tokens, 1)
    if not decode:
        raise RuntimeError("the served profile timed no decode step (the decode worker "
                           "never stepped a whole batch)")
    beside = await _interference(cluster, grid, prompt, ids, prefill, decode, max_len,
                                 statistics.median(overheads), progress)
    progress("served steps side by side: prefill x{:.2f} beside decoding, decode x{:.2f} "
             "beside a prefill, a busy decode worker adds {:.2f} steps to a first token"
             .format(*beside))
    return prefill, decode, overheads, cpu_per_token, beside


class _Decoding:
    """``batch`` greedy streams of ``context``-token prompts kept decoding on the cluster's
    decode worker while the block runs (one that reaches ``max_tokens`` is followed by a
    new one); entered once every one has its first token, left by aborting them all.
    ``tokens``: how many tokens they streamed."""

    def __init__(self, cluster: Any, batch: int, prompt, context: int, max_tokens: int,
                 ids) -> None:
        self.cluster, self.batch, self.prompt, self.context = cluster, batch, prompt, context
        self.max_tokens, self.ids = max_tokens, ids
        self.tokens = 0
        self._started: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def _stream(self) -> None:
        from engine import SamplingParams
        from router.contract import GenerateInput

        params = SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        first = True
        try:
            while True:
                async for ch in self.cluster.generate(GenerateInput(
                        params, token_ids=self.prompt(self.context),
                        request_id=f"s-{next(self.ids)}")):
                    self.tokens += len(ch.token_ids)
                    if first and ch.token_ids:
                        first = False
                        self._started.put_nowait(None)
        except Exception as e:  # noqa: BLE001 - handed to __aenter__, which raises it
            self._started.put_nowait(e)

    async def __aenter__(self) -> _Decoding:
        self._tasks = [asyncio.create_task(self._stream()) for _ in range(self.batch)]
        try:
            for _ in range(self.batch):
                error = await asyncio.wait_for(self._started.get(), 300)
                if error is not None:
                    raise RuntimeError(f"a profiling stream failed: {error!r}") from error
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _steps_at(cluster: Any, size: int, before: dict, want: int,
                    timeout_s: float = 60.0) -> tuple[int, float]:
    """Wait until the decode worker has stepped ``want`` more steps of exactly ``size``
    sequences since ``before`` (its ``decode_steps`` counters), or ``timeout_s``; how many
    it did and their seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = (await cluster.stats()).decode_steps
        n1, s1 = now.get(size, (0, 0.0))
        n0, s0 = before.get(size, (0, 0.0))
        if n1 - n0 >= want or time.monotonic() > deadline:
            return n1 - n0, s1 - s0
        await asyncio.sleep(0.1)


def _step_mean(before: dict, after: dict) -> tuple[float, int]:
    """The mean decode step (s) between two ``decode_steps`` counters, and how many."""
    n = sum(k - before.get(size, (0, 0.0))[0] for size, (k, _) in after.items())
    secs = sum(x - before.get(size, (0, 0.0))[1] for size, (_, x) in after.items())
    return secs / max(n, 1), n


async def _interference(cluster: Any, grid: ProfileGrid, prompt, ids, prefill: list,
                        decode: list, max_len: int, quiet_overhead_s: float, progress
                        ) -> tuple[float, float, float]:
    """How the two workers' steps slow each other while both work (on a CPU host
    they share cores with the router, Ray and each other's KV threads): ``b`` streams decode
    on the decode worker (b: 4, or the grid's nearest), their steps are timed for a quiet
    window, then prompts are prefilled one after another beside them. Returns (prefill
    compute beside decoding / alone, decode step beside prefills / alone, the first token's
    extra wait over the decode steps it took). Neutral (1, 1, 0), said through ``progress``,
    if the decode worker did not step in a window."""
    n = max([x for x in grid.prompt_lens if x <= 256], default=min(grid.prompt_lens))
    alone_s = next(s for b, x, s in prefill if b == 1 and x == n)
    batch = min(grid.decode_batches, key=lambda b: abs(b - 4))
    context = min(grid.contexts)
    # Streams as long as the model allows, to outlast the probe (a small model's may not:
    # then the next one starts).
    async with _Decoding(cluster, batch, prompt, context, max_len - context - 1, ids):
        # A few steps past the last one's admission, then some 30 steps with nothing beside
        # them (a step as the decode grid timed it; the windows within 0.05..2 s).
        step = next((s for b, c, s in decode if b == batch and c == context), 0.05)
        await asyncio.sleep(min(0.5, max(0.05, 5 * step)))
        quiet0 = (await cluster.stats()).decode_steps
        await asyncio.sleep(min(2.0, max(0.05, 30 * step)))
        quiet1 = (await cluster.stats()).decode_steps
        computes, overheads = [], []
        for _ in range(max(grid.repeats, 3)):
            rid = f"ip-{next(ids)}"
            ttft = await _one(cluster, prompt(n), 1, rid)
            t = cluster.orchestrator.phases.timings[rid]
            computes.append(t.prefill_compute_s)
            overheads.append(max(0.0, ttft - t.queue_s - t.prefill_compute_s))
        busy1 = (await cluster.stats()).decode_steps
    step_quiet, n_quiet = _step_mean(quiet0, quiet1)
    step_busy, n_busy = _step_mean(quiet1, busy1)
    if not n_quiet or not n_busy:
        progress("served interference not measured: the decode worker did not step in a "
                 "window; taken as none")
        return 1.0, 1.0, 0.0
    extra = max(0.0, statistics.median(overheads) - quiet_overhead_s)
    return (statistics.median(computes) / max(alone_s, 1e-9),
            step_busy / max(step_quiet, 1e-9), extra / max(step_busy, 1e-9))


def profile_served(model: str | None, num_threads: int, grid: ProfileGrid | None = None,
                   seed: int = 0, progress=lambda msg: None) -> EngineProfile:
    """Measure ``grid`` (its prompt lengths, decode batches and contexts; prefill batches are
    not: a served step's cost follows its tokens) on a fresh local 1P+1D cluster."""
    from engine import EngineArgs
    from engine.weights.resolve import load_model_config, resolve_model
    from router.cluster.ray_cluster import Cluster, ClusterConfig

    t0 = time.perf_counter()
    resolved = resolve_model(model)
    cfg = load_model_config(resolved.model_dir, model_id=resolved.model_id)
    grid = (grid or ProfileGrid.quick()).within(cfg.max_position_embeddings)
    # Room for the interference probe's streams to outlast it (they are aborted after).
    max_len = max(max(*grid.prompt_lens, *grid.contexts) + max(4 * grid.decode_steps, 48) + 16,
                  min(cfg.max_position_embeddings, 2048))
    seqs = max(grid.decode_batches)
    common = dict(num_threads=num_threads, max_model_len=max_len, enable_prefix_caching=False)
    config = ClusterConfig(
        model=model, num_prefill_workers=1, num_decode_workers=1,
        prefill_engine=EngineArgs(max_num_seqs=8, **common),
        decode_engine=EngineArgs(max_num_seqs=seqs, **common), worker_num_cpus=0.5)

    async def run():
        cluster = await Cluster.start(config)
        try:
            return await _measure(cluster, grid, cfg.vocab_size, max_len, seed, progress)
        finally:
            await cluster.shutdown()

    prefill, decode, overheads, cpu_per_token, beside = asyncio.run(run())
    prof = EngineProfile(cfg.model_id, num_threads, "cpu",
                         config.prefill_engine.max_num_batched_tokens,
                         cfg.kv_cache_bytes_per_token(config.decode_engine.kv_cache_dtype),
                         prefill, decode, measure_loopback_bytes_s(),
                         served=True, overhead_s=statistics.median(overheads),
                         router_cpu_s_per_token=cpu_per_token,
                         prefill_beside_decode=beside[0], decode_beside_prefill=beside[1],
                         busy_overhead_steps=beside[2])
    prof.wall_s = time.perf_counter() - t0
    return prof
