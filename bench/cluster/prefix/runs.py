"""The runs `pdcluster bench prefix` and its ``--sweep`` share: the request shapes, one request
as the client saw it, a fresh 2P + 2D cluster per (workload, policy) run with its counters
before and after, and a run's summary. ``bench.cluster.prefix.workloads`` (the two chat
workloads) and ``bench.cluster.prefix.sweep`` (the grid) both build on it."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bench.cluster.ttft_breakdown import pinned_overrides
from bench.harness.report import ratio
from bench.harness.stats import summarize

POLICIES = ("kv_aware", "load", "round_robin")


@dataclass(frozen=True)
class Shape:
    conversations: int
    turns: int
    doc_len: int
    user_len: int
    output_len: int
    system_prompts: int
    system_len: int
    users: int
    question_len: int
    concurrency: int
    cache_fraction: float
    think_s: float


@dataclass
class Request:
    """One request as the client saw it."""

    ttft_s: float
    itls: list[float]
    prompt_len: int
    turn: int  # 0 for the first turn / a shared-prefix request


@dataclass
class PolicyRun:
    workload: str
    policy: str
    requests: list[Request] = field(default_factory=list)
    wall_s: float = 0.0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    kv_bytes: int = 0
    decode_hit_tokens: int = 0
    prefill_hit_tokens: int = 0
    pulled_tokens: int = 0  # prefix tokens pulled from another worker instead of computed
    restored_tokens: int = 0  # prompt tokens restored from a worker's second KV tier
    # Where the requests' first-token time went: each phase's mean seconds over the run
    # (router.control.phase_times: prefill_queue, prefill_compute, kv_transfer_tail,
    # decode_commit).
    phase_mean_s: dict[str, float] = field(default_factory=dict)


def names(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{flag}: unknown {unknown or 'empty list'}; choose from {', '.join(known)}")
    return names


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def pool_tokens(fraction: float, working: int, longest: int) -> int:
    """Each worker's KV pool: ``fraction`` of the working set, but never below 2 longest
    requests (each worker must still serve its share)."""
    return max(int(fraction * working), 2 * longest)


def working_set(workload: str, s: Shape) -> tuple[int, int]:
    """(distinct prompt tokens the workload touches, its longest request in tokens)."""
    if workload == "multi_turn":
        final = s.doc_len + (s.turns - 1) * (s.output_len + s.user_len)
        return s.conversations * (final + s.output_len), final + s.output_len
    return (s.system_prompts * s.system_len + s.users * s.question_len,
            s.system_len + s.question_len + s.output_len)


async def generate(cluster, prompt: list[int], max_tokens: int, rid: str, turn: int
                    ) -> tuple[Request, list[int]]:
    from engine import SamplingParams
    from router.contract import GenerateInput

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    times, tokens = [], []
    async for ch in cluster.generate(GenerateInput(params, token_ids=prompt, request_id=rid)):
        if ch.token_ids:
            times.append(time.perf_counter())
            tokens += ch.token_ids
    itls = [b - a for a, b in zip(times, times[1:], strict=False)]
    return Request(times[0] - start, itls, len(prompt), turn), tokens


async def send_all(cluster, prompts: list[list[int]], concurrency: int, output_len: int,
                    tag: str) -> list[Request]:
    """Send ``prompts`` in list order, at most ``concurrency`` in flight (closed loop)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Request:
        async with gate:
            req, _ = await generate(cluster, prompts[i], output_len, f"{tag}-u{i}", 0)
            return req

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


# ---- one run ------------------------------------------------------------------------------------
def check_prefill_chunk(chunk: int | None) -> None:
    """``--prefill-chunk``: None or > 0 (refused before Ray starts)."""
    if chunk is not None and chunk <= 0:
        raise ValueError(f"--prefill-chunk must be > 0, got {chunk}")


def cluster_config(model: str | None, policy: str, pool_bytes: int, max_len: int,
                    engine_kwargs: dict[str, Any] | None = None,
                    prefill_chunk: int | None = None) -> Any:
    """2P + 2D, pinned; ``engine_kwargs`` go to every worker's ``EngineArgs`` (prefill and
    decode alike), e.g. the sweep's ``kv_offload_memory_bytes``; ``prefill_chunk`` is the
    prefill workers' ``max_prefill_chunk`` (``--prefill-chunk``; None: a whole prompt a
    step)."""
    from engine import EngineArgs
    from router.cluster.ray_cluster import ClusterConfig
    from router.routing.policy import RoutingConfig

    common = dict(block_size=16, num_threads=1, max_model_len=max_len,
                  kv_cache_memory_bytes=pool_bytes, **(engine_kwargs or {}))
    return ClusterConfig(
        model=model, mode="disaggregated", num_prefill_workers=2, num_decode_workers=2,
        prefill_engine=EngineArgs(**common, max_num_seqs=8,
                                  max_num_batched_tokens=max(max_len, 2048),
                                  max_prefill_chunk=prefill_chunk),
        decode_engine=EngineArgs(**common), routing=RoutingConfig(policy),
        worker_overrides=pinned_overrides({"prefill-0": (0,), "decode-0": (0,),
                                           "prefill-1": (1,), "decode-1": (1,)}))


Body = Callable[[Any, str], Awaitable[list[Request]]]  # (cluster, request-id tag) -> requests


async def run_on_cluster(config: Any, workload: str, policy: str, vocab: int, seed: int,
                          body: Body) -> PolicyRun:
    """Start a fresh cluster from ``config``, warm every worker, run ``body`` and measure it
    (the cluster's counters before and after ``body``, not the warm-up); shut it down."""
    from router.cluster.ray_cluster import Cluster

    cluster = await Cluster.start(config)
    run_ = PolicyRun(workload, policy)
    try:
        # Every worker's first forward, on prompts unrelated to the workload (4 > 2 workers
        # of each kind under every policy, so each one runs at least one).
        warm = random.Random(seed ^ 0x5EED)
        await asyncio.gather(*(generate(cluster, tokens(warm, 48, vocab), 2, f"warm-{i}", 0)
                               for i in range(4)))
        before = await cluster.stats()
        t0 = time.perf_counter()
        run_.requests = await body(cluster, f"{policy}-{workload}")
        run_.wall_s = time.perf_counter() - t0
        after = await cluster.stats()
    finally:
        await cluster.shutdown()
    run_.prompt_tokens = sum(r.prompt_len for r in run_.requests)
    run_.computed_tokens = after.prefill_computed_tokens - before.prefill_computed_tokens
    run_.kv_bytes = after.kv_transfer_bytes_total - before.kv_transfer_bytes_total
    hits = {role: after.prefix_hit_tokens.get(role, 0) - before.prefix_hit_tokens.get(role, 0)
            for role in ("decode", "prefill")}
    run_.decode_hit_tokens, run_.prefill_hit_tokens = hits["decode"], hits["prefill"]
    run_.pulled_tokens = after.prefix_pulled_tokens - before.prefix_pulled_tokens
    restored_before = {w.worker_id: w.kv_offload_restored_tokens for w in before.workers}
    run_.restored_tokens = sum(w.kv_offload_restored_tokens - restored_before.get(w.worker_id, 0)
                               for w in after.workers)
    run_.phase_mean_s = phase_means(before.phase_seconds, after.phase_seconds)
    return run_


def phase_means(before: dict, after: dict) -> dict[str, float]:
    """Each phase's mean seconds over the observations between two ``BackendStats``
    snapshots' ``phase_seconds`` (phases with none left out)."""
    out = {}
    for phase, h in after.items():
        b = before.get(phase)
        n = h.count - (b.count if b else 0)
        if n > 0:
            out[phase] = (h.sum - (b.sum if b else 0.0)) / n
    return out


def summary(r: PolicyRun) -> dict[str, Any]:
    ttft = summarize([q.ttft_s for q in r.requests])
    later = summarize([q.ttft_s for q in r.requests if q.turn > 0])
    itl = summarize([x for q in r.requests for x in q.itls])
    return {"ttft_p50_s": ttft.p50, "ttft_p99_s": ttft.p99, "ttft_mean_s": ttft.mean,
            "ttft_later_turns_p50_s": later.p50 if later.count else None,
            "itl_p50_s": itl.p50, "itl_p99_s": itl.p99, "requests": len(r.requests),
            "wall_s": r.wall_s, "prompt_tokens": r.prompt_tokens,
            "computed_prompt_tokens": r.computed_tokens, "kv_bytes_moved": r.kv_bytes,
            "decode_hit_rate": r.decode_hit_tokens / max(r.prompt_tokens, 1),
            "prefill_hit_rate": r.prefill_hit_tokens / max(r.prompt_tokens, 1),
            "pulled_tokens": r.pulled_tokens, "restored_tokens": r.restored_tokens,
            "phase_mean_s": r.phase_mean_s}


# ---- repeats of one run (bench prefix --sweep --sweep-repeats) ----------------------------------
def paired_ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    """``a[key] / b[key]``; over repeats (``combine``), the median of the per-repeat ratios:
    each repeat's two runs served the same requests, so its ratio is the paired comparison."""
    ra, rb = a.get("repeats"), b.get("repeats")
    if not (ra and rb):
        return ratio(a.get(key), b.get(key))
    pairs = [ratio(x.get(key), y.get(key)) for x, y in zip(ra, rb, strict=True)]
    pairs = [p for p in pairs if p is not None]
    return statistics.median(pairs) if pairs else None


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (cell, tier, policy)'s repeats as one result: each number the median over the
    repeats that ran, ``repeats`` every run as measured (a failed one as its error), and
    ``ttft_p50_s_range`` the lowest and highest TTFT p50. A single run is returned as is."""
    if len(runs) == 1:
        return runs[0]
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"], "repeats": runs}
    out: dict[str, Any] = {}
    for key, value in ok[0].items():
        vals = [r.get(key) for r in ok]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals)
        if isinstance(value, dict):  # e.g. phase_mean_s: each entry's median
            out[key] = {k: statistics.median(v[k] for v in vals if k in v) for k in value}
        elif not numeric:
            out[key] = value
        elif all(isinstance(v, int) for v in vals):  # token counts stay whole
            out[key] = round(statistics.median(vals))
        else:
            out[key] = statistics.median(vals)
    ttfts = [r["ttft_p50_s"] for r in ok]
    return {**out, "repeats": runs, "ttft_p50_s_range": [min(ttfts), max(ttfts)]}
