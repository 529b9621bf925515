"""The metric families the router's ``/metrics`` exports that the dashboards and alert rules
read, and the SLOs they are held to.

One place for the names: a query is built from ``Family`` helpers (``TTFT.bucket``,
``MIGRATIONS.total``), so a typo fails at generation time, and the integration test
(``tests/integration/frontdoor/test_dashboard_metrics.py``) holds this catalogue to a live
scrape: every family here, with these labels, is really exported. The exporter is
``router/frontdoor/metrics.py`` (README, Metrics); this module does not import it, because
the router's packages import one way and nothing in the server needs this one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One exported metric family, named as ``prometheus_client``'s parser names it (a
    counter without ``_total``, a histogram without ``_bucket`` / ``_sum`` / ``_count``)."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    labels: tuple[str, ...]
    # Exported only by some servers (e.g. "disaggregated clusters"); None: by every one.
    only: str | None = None

    def _need(self, kind: str) -> None:
        if self.kind != kind:
            raise TypeError(f"{self.name} is a {self.kind}, not a {kind}")

    @property
    def total(self) -> str:
        self._need("counter")
        return f"{self.name}_total"

    @property
    def bucket(self) -> str:
        self._need("histogram")
        return f"{self.name}_bucket"

    @property
    def sum(self) -> str:
        self._need("histogram")
        return f"{self.name}_sum"

    @property
    def count(self) -> str:
        self._need("histogram")
        return f"{self.name}_count"

    @property
    def gauge(self) -> str:
        self._need("gauge")
        return self.name

    def series(self) -> tuple[str, ...]:
        """The series names a query may select from this family."""
        if self.kind == "histogram":
            return (self.bucket, self.sum, self.count)
        return (self.total,) if self.kind == "counter" else (self.name,)


_WORKER = ("worker", "role")
DISAGGREGATED = "disaggregated clusters"

# Request path (router/frontdoor/metrics.py, Metrics.track): both front doors, label api.
TTFT = Family("pdcluster_time_to_first_token_seconds", "histogram", ("api",))
ITL = Family("pdcluster_inter_token_latency_seconds", "histogram", ("api",))
TPOT = Family("pdcluster_time_per_output_token_seconds", "histogram", ("api",))
E2E = Family("pdcluster_e2e_request_latency_seconds", "histogram", ("api", "finish_reason"))
GENERATION_TOKENS = Family("pdcluster_generation_tokens", "counter", ("api",))
PROMPT_TOKENS = Family("pdcluster_prompt_tokens", "counter", ("api",))
# Where a request's first-token time went (router/control/phase_times.py).
PHASES = Family("pdcluster_request_phase_seconds", "histogram", ("phase",), only=DISAGGREGATED)
PHASE_NAMES = ("prefill_queue", "prefill_compute", "kv_transfer_tail", "decode_commit")
# Whole KV transfers by role pair (router/control/phase_times.py, PhaseTimes.transfer).
KV_TRANSFER_SECONDS = Family("pdcluster_kv_transfer_seconds", "histogram", ("pair",),
                             only=DISAGGREGATED)

# Cluster state at scrape time (backend.stats()): one series per live worker.
REQUESTS_RUNNING = Family("pdcluster_requests_running", "gauge", _WORKER)
REQUESTS_WAITING = Family("pdcluster_requests_waiting", "gauge", _WORKER)
KV_BLOCKS_USED = Family("pdcluster_kv_blocks_used", "gauge", _WORKER)
KV_BLOCKS_TOTAL = Family("pdcluster_kv_blocks_total", "gauge", _WORKER)
KV_USAGE = Family("pdcluster_kv_usage_ratio", "gauge", _WORKER)
KV_BLOCK_BYTES = Family("pdcluster_kv_block_bytes", "gauge", _WORKER)
KV_OFFLOAD_BLOCKS = Family("pdcluster_kv_offload_blocks", "gauge", (*_WORKER, "tier"))
KV_OFFLOAD_RESTORED = Family("pdcluster_kv_offload_restored_tokens", "counter", _WORKER)
KV_TRANSFER_BYTES = Family("pdcluster_kv_transfer_bytes", "counter", ())
KV_RANK_TRANSFER_BYTES = Family("pdcluster_kv_rank_transfer_bytes", "counter",
                                (*_WORKER, "rank"))
MIGRATIONS = Family("pdcluster_migrations", "counter", ("reason",))
PREFIX_HIT_TOKENS = Family("pdcluster_prefix_cache_hit_tokens", "counter", ("role",))
PREFIX_PULLED_TOKENS = Family("pdcluster_prefix_pulled_tokens", "counter", ())
PREFIX_RECOMPUTED_TOKENS = Family("pdcluster_prefix_recomputed_tokens", "counter", ())
PREFILL_COMPUTED_TOKENS = Family("pdcluster_prefill_computed_tokens", "counter", ())
DECODE_STEPS = Family("pdcluster_engine_decode_steps", "counter", ("batch",))
DECODE_STEP_SECONDS = Family("pdcluster_engine_decode_step_seconds", "counter", ("batch",))
# Per worker, from its load reports (engine counters and every step's time).
STEP_SECONDS = Family("pdcluster_engine_step_seconds", "histogram", _WORKER)
PREEMPTIONS = Family("pdcluster_preemptions", "counter", _WORKER)
EVICTIONS = Family("pdcluster_prefix_cache_evictions", "counter", _WORKER)
ENGINE_THREADS = Family("pdcluster_engine_threads", "gauge", _WORKER)
CPU_STOLEN = Family("pdcluster_engine_cpu_stolen_ratio", "gauge", _WORKER)
STORE_UP = Family("pdcluster_store_up", "gauge", (), only="clusters (a cluster store)")
AUTOSCALER_DESIRED = Family("pdcluster_autoscaler_desired_workers", "gauge", ("role",),
                            only="serve --autoscale")
AUTOSCALER_DECISIONS = Family("pdcluster_autoscaler_decisions", "counter",
                              ("role", "direction", "reason"), only="serve --autoscale")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    TTFT, ITL, TPOT, E2E, GENERATION_TOKENS, PROMPT_TOKENS, PHASES, REQUESTS_RUNNING,
    REQUESTS_WAITING, KV_BLOCKS_USED, KV_BLOCKS_TOTAL, KV_USAGE, KV_BLOCK_BYTES,
    KV_OFFLOAD_BLOCKS,
    KV_OFFLOAD_RESTORED, KV_TRANSFER_BYTES, KV_RANK_TRANSFER_BYTES, MIGRATIONS,
    PREFIX_HIT_TOKENS, PREFIX_PULLED_TOKENS, PREFIX_RECOMPUTED_TOKENS, PREFILL_COMPUTED_TOKENS,
    DECODE_STEPS, DECODE_STEP_SECONDS, STORE_UP, AUTOSCALER_DESIRED,
    AUTOSCALER_DECISIONS, KV_TRANSFER_SECONDS, STEP_SECONDS, PREEMPTIONS, EVICTIONS,
    ENGINE_THREADS, CPU_STOLEN)}


def family_of(series: str) -> Family:
    """The family a series name belongs to (``pdcluster_migrations_total`` -> MIGRATIONS)."""
    for fam in FAMILIES.values():
        if series in fam.series():
            return fam
    raise KeyError(f"{series} is no series of a catalogued family")


# The SLOs, as the project's benchmarks set them (docs/benchmarks.md: `--slo ttft=2,tpot=0.25`).
TTFT_SLO_S = 2.0
TPOT_SLO_S = 0.25
# A histogram counts observations at its bucket bounds only: SLO attainment is read at the
# smallest bound >= the SLO, written as prometheus_client writes `le` (TTFT's bounds have no
# 2; ITL's have 0.25). The integration test checks these bounds are exported.
TTFT_SLO_LE = "2.5"
ITL_SLO_LE = "0.25"
# A worker's KV pool this full for minutes queues new requests for capacity.
KV_USAGE_ALERT = 0.95
