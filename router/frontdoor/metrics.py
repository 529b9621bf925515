"""Prometheus metrics for the front door, shared by the gRPC and HTTP servers.

Request-path metrics (TTFT, inter-token latency, end-to-end latency, token counters) are fed by
``Metrics.track``, which wraps every backend stream either server opens. Cluster-state metrics
(KV blocks, running/waiting requests per worker, KV transfer bytes) come from
``backend.stats()`` at scrape time (``await Metrics.render()``), so they are never stale.
Each ``Metrics`` owns its own ``CollectorRegistry`` (never the global one): two front doors in
one process, as in the tests, do not collide.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.core.step_times import step_histogram
from router.contract import BackendStats, GenerationBackend, GenerationChunk, QueueFullError
from router.frontdoor.errors import map_error
from router.frontdoor.recent import RecentRequest, RecentRequests

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. TTFT spans a prefill on CPU (tens of ms to seconds); ITL a decode step.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _StatsCollector(Collector):
    """Emits the last ``BackendStats`` snapshot taken by ``Metrics.render``."""

    def __init__(self) -> None:
        self.snapshot = BackendStats()

    def collect(self) -> Iterable[Metric]:
        s = self.snapshot
        labels = ["worker", "role"]
        fams = {
            "kv_blocks_used": GaugeMetricFamily(
                "pdcluster_kv_blocks_used", "KV cache blocks in use", labels=labels),
            "kv_blocks_total": GaugeMetricFamily(
                "pdcluster_kv_blocks_total", "KV cache blocks in the pool", labels=labels),
            "requests_running": GaugeMetricFamily(
                "pdcluster_requests_running", "Requests in the running batch", labels=labels),
            "requests_waiting": GaugeMetricFamily(
                "pdcluster_requests_waiting", "Requests queued, not yet running", labels=labels),
            "kv_usage_ratio": GaugeMetricFamily(
                "pdcluster_kv_usage_ratio", "Fraction of the KV pool's blocks in use (0..1)",
                labels=labels),
            "kv_block_bytes": GaugeMetricFamily(
                "pdcluster_kv_block_bytes", "Bytes of one KV block as the pool stores it, "
                "every layer (--kv-cache-dtype): blocks x this = bytes", labels=labels),
        }
        for w in s.workers:
            lv = [w.worker_id, w.role]
            fams["kv_blocks_used"].add_metric(lv, w.kv_blocks_used)
            fams["kv_blocks_total"].add_metric(lv, w.kv_blocks_total)
            fams["requests_running"].add_metric(lv, w.requests_running)
            fams["requests_waiting"].add_metric(lv, w.requests_waiting)
            fams["kv_usage_ratio"].add_metric(lv, w.kv_blocks_used / w.kv_blocks_total
                                              if w.kv_blocks_total else 0.0)
            fams["kv_block_bytes"].add_metric(lv, w.kv_block_bytes)
        yield from fams.values()
        # The second KV cache tier (engine.executor.kv_tier): what each worker keeps there, and the
        # prompt tokens it restored instead of recomputing (a counter per worker process).
        tier = GaugeMetricFamily("pdcluster_kv_offload_blocks",
                                 "KV blocks a worker keeps in its second cache tier",
                                 labels=["worker", "role", "tier"])
        restored = CounterMetricFamily("pdcluster_kv_offload_restored_tokens",
                                       "Prompt tokens restored from a worker's second KV "
                                       "cache tier instead of recomputed", labels=labels)
        for w in s.workers:
            tier.add_metric([w.worker_id, w.role, "host"], w.kv_offload_host_blocks)
            tier.add_metric([w.worker_id, w.role, "disk"], w.kv_offload_disk_blocks)
            restored.add_metric([w.worker_id, w.role], w.kv_offload_restored_tokens)
        yield tier
        yield restored
        # The one per-rank family (the rest label by worker): each tensor-parallel rank moves
        # its own KV heads on its own pairs.
        per_rank = CounterMetricFamily(
            "pdcluster_kv_rank_transfer_bytes",
            "Bytes of KV cache each tensor-parallel rank sent (prefill) or received (decode) "
            "on its own pairs", labels=["worker", "role", "rank"])
        for w in s.workers:
            for rank, n in enumerate(w.rank_kv_transfer_bytes):
                per_rank.add_metric([w.worker_id, w.role, str(rank)], n)
        yield per_rank
        moved = CounterMetricFamily("pdcluster_migrations",
                                    "Streams moved to another decode worker after theirs was lost",
                                    labels=["reason"])
        for reason in ("worker_died", "worker_silent", "worker_restarted", "stream_lost",
                       "token_timeout", "router_lost", "drained"):
            moved.add_metric([reason], s.migrations.get(reason, 0))
        yield moved
        if s.autoscaler_desired:  # serve --autoscale (router.cluster.autoscale)
            desired = GaugeMetricFamily("pdcluster_autoscaler_desired_workers",
                                        "Workers of a role the autoscaler wants now",
                                        labels=["role"])
            for role, n in sorted(s.autoscaler_desired.items()):
                desired.add_metric([role], n)
            yield desired
            decided = CounterMetricFamily(
                "pdcluster_autoscaler_decisions",
                "Autoscaler decisions: direction up|down, reason load|below_min|above_max, "
                "or up/unplaceable: an added worker that did not come up",
                labels=["role", "direction", "reason"])
            for (role, direction, reason), n in sorted(s.autoscaler_decisions.items()):
                decided.add_metric([role, direction, reason], n)
            yield decided
        if s.store_up is not None:
            yield GaugeMetricFamily("pdcluster_store_up",
                                    "1 while the cluster store (Redis) answers, 0 while the "
                                    "router serves without it", value=int(s.store_up))
        yield CounterMetricFamily("pdcluster_kv_transfer_bytes",
                                  "Bytes of KV cache moved from prefill to decode workers",
                                  value=s.kv_transfer_bytes_total)
        hits = CounterMetricFamily(
            "pdcluster_prefix_cache_hit_tokens",
            "Prompt tokens whose KV a worker's prefix cache already held (decode: not "
            "transferred; prefill, colocated: not computed)", labels=["role"])
        for role, n in sorted(s.prefix_hit_tokens.items()):
            hits.add_metric([role], n)
        yield hits
        yield CounterMetricFamily("pdcluster_prefix_pulled_tokens",
                                  "Prompt-prefix tokens a prefill worker pulled from another "
                                  "worker's cache instead of computing them",
                                  value=s.prefix_pulled_tokens)
        yield CounterMetricFamily("pdcluster_prefix_recomputed_tokens",
                                  "Prompt-prefix tokens another worker held that a prefill "
                                  "worker computed anyway (not worth moving, or the pull "
                                  "failed)", value=s.prefix_recomputed_tokens)
        yield CounterMetricFamily("pdcluster_prefill_computed_tokens",
                                  "Prompt (and recomputed) tokens run through a model",
                                  value=s.prefill_computed_tokens)
        if s.phase_seconds:  # disaggregated clusters (router.control.phase_times)
            phases = HistogramMetricFamily(
                "pdcluster_request_phase_seconds",
                "Where a request's time to first token went, by phase: prefill_queue and "
                "prefill_compute on its prefill worker, kv_transfer_tail (the KV transfer "
                "compute did not hide), decode_commit (until the decode worker admitted it)",
                labels=["phase"])
            for phase, h in s.phase_seconds.items():
                phases.add_metric([phase], h.cumulative(), h.sum)
            yield phases
        if s.phase_seconds:  # KV moves between workers: disaggregated clusters only
            transfers = HistogramMetricFamily(
                "pdcluster_kv_transfer_seconds",
                "Whole KV transfers by the roles they ran between: prefill->decode (a "
                "prompt's KV, first layer posted to last send done, the part compute hid "
                "included), <source>->prefill (a prefix pull)", labels=["pair"])
            for pair, h in s.kv_transfer_seconds.items():
                transfers.add_metric([pair], h.cumulative(), h.sum)
            yield transfers
        yield from _engine_counter_families(s)
        # The engine's own steps (engine.core.step_times), what `pdcluster bench serve` sets the
        # served time per output token beside: pure-decode steps by batch size, and mixed
        # steps (decode rows beside prefill chunks: colocated workers) by their decode rows.
        yield from _step_families("decode", "Pure-decode engine steps", s.decode_steps)
        yield from _step_families("mixed", "Engine steps running decode rows beside prefill "
                                  "chunks", s.mixed_steps)


def _engine_counter_families(s: BackendStats):
    """Per worker: preemptions, prefix-cache evictions, every engine step's time, and the
    threads its engine steps on with the share of their time other processes took."""
    labels = ["worker", "role"]
    threads = GaugeMetricFamily("pdcluster_engine_threads",
                                "Torch threads a worker's engine steps on now: the CPUs it may "
                                "use (affinity, cgroup quota), fewer while other processes take "
                                "its threads' time (engine.runtime.cpu_threads)", labels=labels)
    stolen = GaugeMetricFamily("pdcluster_engine_cpu_stolen_ratio",
                               "Fraction of a worker's busy engine threads' time, in its last "
                               "window, spent waiting for a CPU or throttled by its cgroup",
                               labels=labels)
    preempt = CounterMetricFamily("pdcluster_preemptions",
                                  "Requests a worker preempted (KV dropped, recomputed later)",
                                  labels=labels)
    evicted = CounterMetricFamily("pdcluster_prefix_cache_evictions",
                                  "Cached prefix blocks a worker's pool evicted for other "
                                  "requests (to the second tier when it is on)", labels=labels)
    steps = HistogramMetricFamily("pdcluster_engine_step_seconds",
                                  "Every engine step of a worker, schedule to outputs, whatever "
                                  "it ran (prefill chunks, decode rows or both)", labels=labels)
    for w in s.workers:
        preempt.add_metric([w.worker_id, w.role], w.preemptions)
        evicted.add_metric([w.worker_id, w.role], w.prefix_cache_evictions)
        threads.add_metric([w.worker_id, w.role], w.engine_threads)
        stolen.add_metric([w.worker_id, w.role], w.cpu_stolen)
        hist = step_histogram(w.step_seconds)
        if hist is not None:
            steps.add_metric([w.worker_id, w.role], *hist)
    yield preempt
    yield evicted
    yield threads
    yield stolen
    yield steps
    yield from _spec_families(s)
    yield from _lora_families(s)


def _lora_families(s: BackendStats):
    """Per LoRA adapter: requests and tokens (the router's count), and per worker the
    adapters it holds now and its loads and evictions of each (its own count)."""
    reqs = CounterMetricFamily("pdcluster_lora_requests", "Requests that named a LoRA adapter",
                               labels=["adapter"])
    toks = CounterMetricFamily("pdcluster_lora_generated_tokens",
                               "Tokens generated under a LoRA adapter", labels=["adapter"])
    for name, (n, t) in sorted(s.lora_adapters.items()):
        reqs.add_metric([name], n)
        toks.add_metric([name], t)
    labels = ["worker", "role", "adapter"]
    held = GaugeMetricFamily("pdcluster_lora_adapter_loaded",
                             "1 for each LoRA adapter a worker holds now", labels=labels)
    loads = CounterMetricFamily("pdcluster_lora_adapter_loads",
                                "Times a worker read a LoRA adapter from disk", labels=labels)
    evictions = CounterMetricFamily("pdcluster_lora_adapter_evictions",
                                    "Times a worker dropped a LoRA adapter for another (LRU)",
                                    labels=labels)
    for w in s.workers:
        for name in w.lora_adapters:
            held.add_metric([w.worker_id, w.role, name], 1)
        for name, n_loads, n_evictions in w.lora_counts:
            loads.add_metric([w.worker_id, w.role, name], n_loads)
            evictions.add_metric([w.worker_id, w.role, name], n_evictions)
    yield from (reqs, toks, held, loads, evictions)
    n, abs_err, err = s.ttft_predictions
    if n:  # a backend that predicts (a cluster): mean error = *_seconds_total / count
        for name, help_, v in (
                ("pdcluster_ttft_predictions", "First tokens whose time was predicted at "
                 "admission", n),
                ("pdcluster_ttft_prediction_abs_error_seconds", "Sum of |first token time - "
                 "its prediction at admission|", abs_err),
                ("pdcluster_ttft_prediction_error_seconds", "Sum of first token time - its "
                 "prediction at admission (> 0: predictions ran short)", err)):
            fam = CounterMetricFamily(name, help_)
            fam.add_metric([], v)
            yield fam


def _spec_families(s: BackendStats):
    """Per speculating worker (engine.spec): drafts proposed and accepted, in all and by
    position, and the sequence-steps that verified drafts with the tokens they produced.
    Acceptance by position is accepted / proposed of one position; the mean accepted length
    (tokens per verifying sequence-step, its own included) is emitted / verify_sequences."""
    labels = ["worker", "role"]
    names = {
        "proposed": ("pdcluster_spec_draft_tokens", "Draft tokens a worker proposed and verified"),
        "accepted": ("pdcluster_spec_accepted_tokens", "Draft tokens the target model accepted"),
        "verified": ("pdcluster_spec_verify_sequences",
                     "Sequence-steps that verified at least one draft"),
        "emitted": ("pdcluster_spec_emitted_tokens",
                    "Tokens those sequence-steps produced: accepted drafts plus one each"),
    }
    fams = {k: CounterMetricFamily(n, h, labels=labels) for k, (n, h) in names.items()}
    by_pos = {k: CounterMetricFamily(f"{names[k][0]}_by_position",
                                     f"{names[k][1]}, by the draft's position in its step "
                                     "(0: the first draft)", labels=[*labels, "position"])
              for k in ("proposed", "accepted")}
    for w in s.workers:
        if not w.spec_verified_seqs and not w.spec_proposed:
            continue
        key = [w.worker_id, w.role]
        for k, v in (("proposed", w.spec_proposed), ("accepted", w.spec_accepted),
                     ("verified", w.spec_verified_seqs), ("emitted", w.spec_emitted)):
            fams[k].add_metric(key, v)
        for k, rows in (("proposed", w.spec_proposed_by_position),
                        ("accepted", w.spec_accepted_by_position)):
            for i, v in enumerate(rows):
                by_pos[k].add_metric([*key, str(i)], v)
    yield from fams.values()
    yield from by_pos.values()


def _step_families(kind: str, what: str, rows: dict[int, tuple[int, float]]):
    """``pdcluster_engine_{kind}_steps`` and ``..._{kind}_step_seconds``, labelled by batch."""
    steps = CounterMetricFamily(f"pdcluster_engine_{kind}_steps",
                                f"{what}, by the step's decode rows", labels=["batch"])
    seconds = CounterMetricFamily(f"pdcluster_engine_{kind}_step_seconds",
                                  f"Seconds in {what[0].lower()}{what[1:]} (schedule to "
                                  "outputs), by the step's decode rows", labels=["batch"])
    for b, (n, sec) in sorted(rows.items()):
        steps.add_metric([str(b)], n)
        seconds.add_metric([str(b)], sec)
    yield steps
    yield seconds


class Metrics:
    """One registry of front-door metrics over one backend."""

    def __init__(self, backend: GenerationBackend) -> None:
        self.backend = backend
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft_s = Histogram("pdcluster_time_to_first_token_seconds",
                                "Time from request arrival to its first token",
                                ["api"], buckets=_TTFT_BUCKETS, registry=r)
        # Per finished request: (end to end - TTFT) / (output tokens - 1), vLLM's TPOT.
        self.tpot_s = Histogram("pdcluster_time_per_output_token_seconds",
                                "Per finished request of 2+ tokens: its time after the first "
                                "token divided by its later tokens", ["api"],
                                buckets=_ITL_BUCKETS, registry=r)
        self.itl_s = Histogram("pdcluster_inter_token_latency_seconds",
                               "Time between consecutive output tokens of one request",
                               ["api"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e_s = Histogram("pdcluster_e2e_request_latency_seconds",
                               "Time from request arrival to its last token",
                               ["api", "finish_reason"], buckets=_E2E_BUCKETS, registry=r)
        self.generation_tokens = Counter("pdcluster_generation_tokens",
                                         "Output tokens streamed to clients", ["api"], registry=r)
        self.prompt_tokens = Counter("pdcluster_prompt_tokens",
                                     "Prompt tokens of accepted requests", ["api"], registry=r)
        self.refused = Counter("pdcluster_requests_refused",
                               "Requests refused for load before their first token, by why: "
                               "deadline_unmet (router.control.admission), queue_full, "
                               "rate_limit_exceeded", ["api", "reason"], registry=r)
        self._stats = _StatsCollector()
        r.register(self._stats)
        self.recent = RecentRequests()  # the last requests' latencies (/v1/cluster, top)

    async def track(self, chunks: AsyncIterator[GenerationChunk], api: str,
                    user: str | None = None) -> AsyncIterator[GenerationChunk]:
        """Re-yield ``chunks`` unchanged while recording latency and token metrics.

        ``api`` ("grpc" | "http") labels the series. ``user`` (OpenAI's) goes into the
        recent-requests log only: a label per end user would grow the series without bound.
        Closing this iterator closes ``chunks`` (which aborts the request in the backend).
        """
        t0 = time.monotonic()
        last_token_t: float | None = None
        counted_prompt = False
        rid, ttft, tokens, reason, first_at = "", None, 0, "cancelled", None
        try:
            async for c in chunks:
                rid = c.request_id
                now = time.monotonic()
                if not counted_prompt and c.prompt_tokens:
                    self.prompt_tokens.labels(api).inc(c.prompt_tokens)
                    counted_prompt = True
                if c.token_ids:
                    n = len(c.token_ids)
                    tokens += n
                    if last_token_t is None:
                        ttft = c.ttft_s if c.ttft_s is not None else now - t0
                        first_at = now
                        self.ttft_s.labels(api).observe(ttft)
                    else:
                        # A chunk may carry several tokens (one decode step can emit more
                        # than one after a stall): spread the gap over them.
                        gap = (now - last_token_t) / n
                        for _ in range(n):
                            self.itl_s.labels(api).observe(gap)
                    last_token_t = now
                    self.generation_tokens.labels(api).inc(n)
                if c.finished:
                    reason = c.finish_reason or "unknown"
                    self.e2e_s.labels(api, reason).observe(now - t0)
                    if first_at is not None and tokens > 1:
                        self.tpot_s.labels(api).observe((now - first_at) / (tokens - 1))
                yield c
        except Exception as e:
            reason = "error"
            if isinstance(e, QueueFullError) and not tokens:
                self.refused.labels(api, map_error(e).openai_code or "queue_full").inc()
            raise
        finally:
            if rid:
                self.recent.note(RecentRequest(rid, api, time.time(), time.monotonic() - t0,
                                               ttft, tokens, reason, user))
            await chunks.aclose()

    async def render(self) -> bytes:
        """Snapshot ``backend.stats()`` and return the Prometheus text exposition."""
        self._stats.snapshot = await self.backend.stats()
        return generate_latest(self.registry)
