"""What a cluster is made of (``ClusterConfig``: everything ``pdcluster serve`` decides) and
the check, before any worker loads, that both roles' tensor-parallel sizes can split the model."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.args import EngineArgs
from engine.contract import POOLING_CHOICES
from engine.parallel.sharding import TPShard
from router.cluster.autoscale import AutoscaleConfig
from router.cluster.launcher import StartupError
from router.routing.policy import RoutingConfig
from worker_protocol.tracing import TracingConfig

__all__ = ["ClusterConfig", "check_tp_layouts"]


@dataclass(frozen=True)
class ClusterConfig:
    """Everything ``pdcluster serve`` decides. Engine args are per role (block sizes may differ)."""

    model: str | None = None
    mode: str = "disaggregated"  # or "colocated"
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    prefill_engine: EngineArgs = field(default_factory=lambda: EngineArgs(max_num_seqs=8))
    decode_engine: EngineArgs = field(default_factory=EngineArgs)
    ray_address: str | None = None  # None: start a local Ray; "auto" or host:port: join
    redis_url: str | None = None
    store_namespace: str = "pdcluster"  # Redis key prefix (several clusters can share a Redis)
    worker_num_cpus: float = 1.0
    # None: use GPUs when the cluster has them; True: require them (start-up fails without);
    # False: CPU workers. Fewer GPUs than workers: each worker gets a share of one.
    use_gpus: bool | None = None
    transfer_timeout_s: float = 30.0
    lease_s: float = 30.0
    max_inflight_requests: int = 1024
    capacity_wait_s: float = 30.0
    stream_layers: bool = True
    # Where workers bind and advertise KV endpoints (worker_protocol.runtime.resolve_kv_host).
    # Neither set: loopback when every Ray node is on one host, else each node's own address.
    kv_host: str | None = None
    kv_interface: str | None = None
    # Every start-up wait (each worker loading its model) fails after this, naming the worker.
    startup_timeout_s: float = 300.0
    call_timeout_s: float = 10.0  # deadline of a reserve / abort / load call to one worker
    # A stream in its decode worker's batch this long with no token is taken for lost
    # (time queued there does not count: router/control/token_wait.py).
    token_timeout_s: float = 120.0
    migration_limit: int = 3  # moves per request when its decode worker is lost
    migration_prefill: str = "auto"  # see OrchestratorConfig.migration_prefill
    orphan_after_s: float = 20.0  # see OrchestratorConfig.orphan_after_s
    suspect_after_s: float = 1.0  # see OrchestratorConfig.suspect_after_s (0: off)
    # How often Ray restarts a worker whose process died (each comes back, loads its model
    # and rejoins under the same id); past it the worker stays dead. 0: never restart.
    worker_restarts: int = 3
    # With redis_url: refuse to start while Redis is unreachable (default: start without it
    # and catch up once it answers).
    require_redis: bool = False
    # The deployment's name. Joining an existing Ray cluster (ray_address), workers are
    # detached Ray actors named "{name}-{worker id}": they outlive this router's death, and a
    # router started later with the same name re-attaches to them instead of starting new
    # ones (if they run the configuration it wants). A graceful shutdown stops them, unless
    # keep_workers (a router upgrade: the next router takes them over).
    name: str = "pdcluster"
    keep_workers: bool = False
    # How requests are spread over workers (router.routing.policy.RoutingConfig: kv_aware by default).
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # How workers' KV events reach routers (router.routing.kv_sync): "auto" = Redis Streams when
    # redis_url is set (workers then get its URL and publish there), else pulled through
    # Ray; "memory" = always pulled (workers never talk to Redis: the shipped Kubernetes
    # and `ray up` set-ups, whose workers cannot reach it).
    kv_event_bus: str = "auto"
    # worker_id -> WorkerConfig field overrides (fault injection in failure tests)
    worker_overrides: dict = field(default_factory=dict)
    # Environment prefill worker processes start with (router.cluster.threads: OMP_WAIT_POLICY when
    # their threads share the machine's cores with decode workers).
    prefill_env: dict = field(default_factory=dict)
    # Add and drain workers with the load (router.cluster.autoscale); None: fixed counts.
    # The worker counts above are the start; the policy's bounds must include them.
    autoscale: AutoscaleConfig | None = None
    # Per-request traces over OTLP from the router and every worker (worker_protocol.tracing);
    # None: off.
    tracing: TracingConfig | None = None
    # LoRA adapters served from the start, (name, PEFT folder) each (--lora-modules): every
    # worker loads them before the cluster serves; the engines need enable_lora.
    lora_modules: tuple = ()
    # How /v1/embeddings pools a prompt's final hidden states (engine.executor.pooling):
    # "last" (the default for decoder LMs), "mean" or "cls"; L2-normalized unless False.
    pooling: str = "last"
    normalize_embeddings: bool = True
    # Tenant -> weight of its share of decode room while requests wait for it
    # (router.control.fair_share; a tenant not named weighs 1).
    tenant_weights: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {self.mode!r}")
        if self.num_decode_workers < 1:
            raise ValueError("at least one decode worker is needed")
        if self.mode == "disaggregated" and self.num_prefill_workers < 1:
            raise ValueError("disaggregated mode needs at least one prefill worker")
        if self.worker_restarts < 0:
            raise ValueError(f"worker_restarts must be >= 0, got {self.worker_restarts}")
        if self.kv_event_bus not in ("auto", "memory"):
            raise ValueError(f"kv_event_bus must be 'auto' or 'memory', got {self.kv_event_bus!r}")
        if self.lora_modules and not (self.decode_engine.enable_lora
                                      and self.prefill_engine.enable_lora):
            raise ValueError("--lora-modules needs --enable-lora")
        if self.prefill_engine.enable_lora != self.decode_engine.enable_lora:
            raise ValueError("LoRA must be on for both prefill and decode workers or neither: "
                             "the prompt's KV and its tokens come from the same adapter")
        if self.pooling not in POOLING_CHOICES:
            raise ValueError(f"--pooling must be one of {', '.join(POOLING_CHOICES)}, "
                             f"got {self.pooling!r}")
        if self.autoscale is not None:
            pol = self.autoscale.policy
            starts = [("decode", self.num_decode_workers)]
            if self.mode == "disaggregated":
                starts.append(("prefill", self.num_prefill_workers))
            for role, n in starts:
                lo, hi = pol.bounds(role)
                if not lo <= n <= hi:
                    raise ValueError(f"--{role}-workers {n} is outside the autoscaler's bounds "
                                     f"{lo}..{hi} (--min/--max-{role}-workers)")

    def max_workers(self, role: str) -> int:
        """The most workers of ``role`` ("prefill" | "decode") this cluster may run at once."""
        start = self.num_prefill_workers if role == "prefill" else self.num_decode_workers
        if role == "prefill" and self.mode != "disaggregated":
            return 0
        return start if self.autoscale is None else self.autoscale.policy.bounds(role)[1]

    @property
    def kv_events_redis_url(self) -> str | None:
        """Where workers publish KV events besides their own log (None: nowhere else)."""
        return self.redis_url if self.kv_event_bus == "auto" else None


def check_kv_cache_dtypes(cfg: ClusterConfig) -> None:
    """StartupError when the prefill and the decode workers would store KV in different
    dtypes: KV moves as stored (pages and their scales), so a decode worker could read no
    transfer of a prefill worker of another KV dtype; named both, before any worker loads."""
    if cfg.mode != "disaggregated":
        return
    p, d = cfg.prefill_engine.kv_cache_dtype, cfg.decode_engine.kv_cache_dtype
    if p != d:
        raise StartupError(f"prefill workers' kv_cache_dtype={p!r} differs from the decode "
                           f"workers' kv_cache_dtype={d!r}: KV moves between them as stored, "
                           "so both must store the same (--kv-cache-dtype sets both)")


def check_tp_layouts(model_cfg, cfg: ClusterConfig) -> None:
    """StartupError when a role's tensor-parallel size cannot split the model, naming the
    prefill and the decode side together: their KV must map rank to rank
    (``kv_transfer.routes``), and any two sizes that each split the model do."""
    sides = [("decode" if cfg.mode == "disaggregated" else "colocated",
              cfg.decode_engine.tensor_parallel_size)]
    if cfg.mode == "disaggregated":
        sides.insert(0, ("prefill", cfg.prefill_engine.tensor_parallel_size))
    verdicts, bad = [], False
    for role, tp in sides:
        try:
            TPShard(0, tp).check(model_cfg)
            verdicts.append(f"{role} tp={tp}: ok")
        except ValueError as e:
            verdicts.append(f"{role} tp={tp}: {e}")
            bad = True
    if bad:
        raise StartupError(f"impossible KV layout for {model_cfg.model_id} "
                           f"({model_cfg.num_kv_heads} KV heads): " + "; ".join(verdicts))
