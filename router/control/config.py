"""The orchestrator's tunables (deadlines, retry and migration limits), set by the Cluster
from ClusterConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.contract import MAX_PRIORITY
from router.routing.policy import RoutingConfig
from worker_protocol.tracing import TracingConfig

__all__ = ["MIGRATED_PRIORITY", "MIGRATION_PREFILL", "OrchestratorConfig"]

# Engine priorities (higher first) are the client's negated (vLLM's: lower first). A migrated
# stream's re-prefill is queued ahead of every new prompt, whatever their priority.
MIGRATED_PRIORITY = MAX_PRIORITY + 1
# Where a migrated stream's re-prefill runs in disaggregated mode (WorkerChooser.reprefill_on_decode).
MIGRATION_PREFILL = ("auto", "prefill", "decode")


@dataclass(frozen=True)
class OrchestratorConfig:
    model_id: str
    mode: str = "disaggregated"  # or "colocated"
    max_attempts: int = 3  # reserve/prefill/transfer tries before giving up on a request
    transfer_timeout_s: float = 30.0
    capacity_wait_s: float = 30.0  # how long a request may wait for KV capacity
    max_inflight_requests: int = 1024  # beyond it: QueueFullError (RESOURCE_EXHAUSTED)
    prefix_hash_seed: int = 0  # the workers' (KV-aware routing hashes prompts the same way)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # Deadlines on worker calls, so a host that went silent (link down) costs a retry, not a
    # hung request: reserve / abort get call_timeout_s; commit waits for the transfer too;
    # a prefill may queue behind other prompts first (the prefill worker gives up on it at
    # prefill_timeout_s; the router waits call_timeout_s longer for that answer).
    call_timeout_s: float = 10.0
    prefill_timeout_s: float = 300.0
    # A committed stream in its decode worker's batch this long with no token update was
    # lost there (a step takes milliseconds to a second): it migrates, or past the limit ends
    # with UNAVAILABLE instead of hanging. Time queued on a live worker does not count
    # (router/control/token_wait.py).
    token_timeout_s: float = 120.0
    # How many times one request may move to another decode worker when its own dies.
    migration_limit: int = 3
    # Where a moved stream's prompt + tokens are computed again (disaggregated mode): "auto"
    # (on a prefill worker when one is idle, else on the new decode worker), "prefill",
    # "decode". See WorkerChooser.reprefill_on_decode.
    migration_prefill: str = "auto"
    # A decode worker that misses its load reports this long (hung, SIGSTOP'd, host cut off)
    # has its streams migrated; it gets no new work until it reports again.
    worker_silent_s: float = 5.0
    # ... and sooner: a decode worker that answers no heartbeat (pinged every
    # heartbeat_interval_s) and sends no token for suspect_after_s while streams are
    # committed there has them migrated (router/control/heartbeat.py); 0: off.
    heartbeat_interval_s: float = 0.25
    suspect_after_s: float = 1.0
    # A decode worker whose KV address a prefill worker could not reach gets no new requests
    # for this long (then it is tried again: the address may have come back).
    kv_unreachable_quarantine_s: float = 30.0
    # A resumed stream's log that grows no more for this long, with no live decode worker
    # holding its request, is continued by this router: its router and its decode worker
    # both died (router/control/orphans.py).
    orphan_after_s: float = 20.0
    # Per-request traces (worker_protocol.tracing); None: off.
    tracing: TracingConfig | None = None
    # The workers run with LoRA on (router.control.adapters): adapters may be loaded.
    enable_lora: bool = False
    # Tenant -> weight of its fair share of decode room (router.control.fair_share; 1 if
    # not named).
    tenant_weights: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.migration_prefill not in MIGRATION_PREFILL:
            raise ValueError(f"migration_prefill must be one of {', '.join(MIGRATION_PREFILL)}, "
                             f"got {self.migration_prefill!r}")
