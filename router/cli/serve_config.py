"""`pdcluster serve`'s configuration: a ServeConfig built from flags over YAML over defaults,
validated once, and the configurations of the cluster, routing, security and threads derived
from it. Running it is router/cli/serve.py's job."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.args import EngineArgs
from engine.config import (
    ATTENTION_BACKEND_CHOICES,
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    check_kv_cache_dtype,
)
from engine.config import QUANTIZATION_CHOICES as QUANT_CHOICES
from engine.spec.config import parse_speculative_config
from router.cli.lora_flags import check_lora_flags, lora_cpu_slots, parse_lora_modules
from router.control.config import MIGRATION_PREFILL
from router.control.fair_share import parse_tenant_weights
from router.frontdoor.openai.reasoning import REASONING_PARSERS

log = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
          "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def parse_bytes(value: str | int) -> int:
    """'1GiB', '512MB', '1073741824' -> bytes. ValueError on anything else."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"not a size: {value!r} (use e.g. 512MiB, 2GiB)")
    unit = (m.group(2) or "").upper().rstrip("B")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    prefill_workers: int = 1
    decode_workers: int = 1
    # Add and drain workers with the load (router.cluster.autoscale); bounds default to the
    # start counts (--prefill-workers / --decode-workers).
    autoscale: bool = False
    min_prefill_workers: int | None = None
    max_prefill_workers: int | None = None
    min_decode_workers: int | None = None
    max_decode_workers: int | None = None
    autoscale_target: float = 0.7
    autoscale_interval_s: float = 5.0
    autoscale_up_window_s: float = 15.0
    autoscale_down_window_s: float = 60.0
    autoscale_cooldown_s: float = 60.0
    autoscale_migrate_after_s: float = 30.0
    autoscale_profile: str | None = None  # a `pdcluster profile` JSON
    mode: str = "disaggregated"
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    ray_address: str | None = None
    redis_url: str | None = None
    # The engines' device settings (engine.executor.device resolves every "auto"; docs/deployment.md,
    # GPUs). device: auto = GPUs when the Ray cluster has them, cuda = require them.
    device: str = "auto"
    dtype: str = "auto"
    # Quantized linear layers on CPU workers (engine.quant.layouts): "auto" serves a GGUF (the
    # default model) in its own blocks, anything else in fp; "none" keeps fp.
    quantization: str = "auto"
    attention_backend: str = "auto"
    # How every worker's KV pool stores K and V (engine.attention.kv_format): "auto" the
    # model's dtype, "int8" int8 rows with a scale per token and KV head (docs/kv-cache.md).
    kv_cache_dtype: str = "auto"
    cuda_graphs: bool | None = None  # None: on for GPU workers
    # Speculative decoding on the decode (and colocated) workers, vLLM's JSON
    # (engine.spec.config; docs/speculative-decoding.md): None off.
    speculative_config: dict | str | None = None
    # LoRA adapters on every worker (router.cli.lora_flags; docs/lora.md).
    enable_lora: bool = False
    lora_modules: list | dict | None = None  # "name=DIR" entries (YAML: also a mapping)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # How /v1/embeddings pools a prompt's final hidden states (engine.executor.pooling).
    pooling: str = "last"
    normalize_embeddings: bool = True
    gpu_memory_utilization: float = 0.9  # of each GPU, split among the workers sharing it
    kv_cache_memory: str | int | None = None  # per worker; None: 1 GiB on CPU, GPU: from memory
    # The second KV cache tier per worker (engine.executor.kv_tier): host memory, then disk.
    kv_offload_memory: str | int | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk: str | int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    # Prompt tokens of one request a step (None: all); a step that can finish an arriving
    # prompt leaves the decodes out; prompt tokens a step below a recent priority (0: all):
    # docs/deployment.md, "Short prompts behind long ones", "First token first", "Priorities".
    max_prefill_chunk: int | None = None
    first_token_first: bool = False
    yield_step_prefill_tokens: int = 256
    # Engines run fewer torch threads while other processes take their threads' time, and
    # their planned count again once they stop (engine.runtime.cpu_threads). False: always planned.
    adaptive_threads: bool = True
    # Decode and colocated workers: at most this many prompt tokens of all requests a step
    # (None: a disaggregated decode worker's own 64, decode_workers.worker; colocated: none),
    # so a stream rebuilt there after a migration leaves its running streams a token a step.
    decode_step_prefill_tokens: int | None = None
    prefill_block_size: int = 16
    decode_block_size: int = 16
    prefill_tp: int = 1  # tensor-parallel ranks per prefill worker
    decode_tp: int = 1  # ... per decode or colocated worker
    max_model_len: int | None = None
    max_waiting: int = 1024
    drain_grace_s: float = 30.0
    # tool_choice "auto": how the model writes tool calls (None: read off its chat template).
    tool_call_parser: str | None = None
    # How a reasoning model's thinking leaves chat output (router.frontdoor.openai.reasoning):
    # qwen3 | deepseek_r1; None: it stays in the content.
    reasoning_parser: str | None = None
    threads_per_worker: int | None = None  # None: the machine's cores split among workers
    # Per role, over threads_per_worker: the split of a box's cores between prefill
    # (compute-bound) and decode (memory-bound) workers is the operator's to measure.
    prefill_threads: int | None = None
    decode_threads: int | None = None
    kv_host: str | None = None  # address workers advertise for KV (default: their node's)
    kv_interface: str | None = None  # or: the NIC whose IPv4 they advertise (every node)
    startup_timeout_s: float = 300.0
    migration_limit: int = 3
    migration_prefill: str = "auto"  # where a moved stream is computed again: auto|prefill|decode
    orphan_after_s: float = 20.0
    # A decode worker silent this long (no heartbeat, no token) has its streams moved.
    suspect_after_s: float = 1.0
    worker_restarts: int = 3
    require_redis: bool = False
    name: str = "pdcluster"
    keep_workers: bool = False
    # How requests are spread (router.routing.policy.RoutingConfig: the cost and its defaults).
    routing: str = "kv_aware"
    prefix_weight: float = 1.0
    queue_weight: float = 1.0
    kv_usage_weight: float = 1.0
    prefix_pull: str = "auto"  # auto | always | off (router.control.prefix_pull)
    kv_event_bus: str = "auto"
    # Fault injection for failure tests only: worker id -> {fault_* WorkerConfig field: value}.
    worker_overrides: dict = field(default_factory=dict)
    # The front doors' security (router/frontdoor/security.py).
    api_keys: str | None = None  # key file (or $PDCLUSTER_API_KEYS_FILE)
    metrics_public: bool | None = None  # None: public exactly when there are no keys
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    max_request_bytes: str | int = "1MiB"
    rate_limit: float = 0.0
    max_concurrent_per_key: int = 0
    # Tenants (key names) that may make operators' calls, e.g. drain a worker: "ops,admin".
    admin_tenants: str | None = None
    # Tenants' weights of decode room ("a=2,b=1"; router.control.fair_share) and default
    # deadlines ("a=5,*=30": router.control.admission), for requests naming none.
    tenant_weights: str | dict | None = None
    tenant_deadlines: str | dict | None = None
    # Per-request traces over OTLP/gRPC (worker_protocol.tracing): the collector, else
    # $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; neither: off. The share of requests traced.
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        self.kv_cache_memory_bytes()  # its own check: a size > 0
        self.offload_config()  # its own checks: sizes, dir and disk together
        self._check_device_flags()
        check_lora_flags(self)
        for flag, least in (("max_prefill_chunk", 1), ("decode_step_prefill_tokens", 1),
                            ("yield_step_prefill_tokens", 0)):
            if (v := getattr(self, flag)) is not None and v < least:
                raise ValueError(f"--{flag.replace('_', '-')} must be {('>= 0', '> 0')[least]}, got {v}")
        for flag in ("first_token_first", "adaptive_threads"):
            if getattr(self, flag) not in (True, False):
                raise ValueError(f"--{flag.replace('_', '-')} must be true or false, "
                                 f"got {getattr(self, flag)!r}")
        self.tracing_config()  # its own checks: the endpoint's form, the ratio in [0, 1]
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("give --tls-cert and --tls-key together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        self.security_config()  # its own checks: limits in range
        parse_tenant_weights(self.tenant_weights)  # its own checks: name=weight, weight > 0
        self.routing_config()  # its own checks: a known policy, weights >= 0
        for wid, over in self.worker_overrides.items():
            bad = [k for k in (over if isinstance(over, dict) else {"?": 0})
                   if not str(k).startswith("fault_")]
            if bad:
                raise ValueError(f"--worker-overrides[{wid!r}]: only fault_* fields, got {bad}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}"
                             f", got {self.reasoning_parser!r}")
        if self.tool_call_parser not in (None, "hermes", "llama3_json"):
            raise ValueError(f"--tool-call-parser must be hermes or llama3_json, "
                             f"got {self.tool_call_parser!r}")
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"--mode must be disaggregated or colocated, got {self.mode!r}")
        for name in ("prefill_workers", "decode_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        self.autoscale_config()  # its own checks; refuses autoscale settings without it
        for name in ("prefill_tp", "decode_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.mode == "colocated" and self.prefill_tp != 1:
            raise ValueError("--prefill-tp: colocated workers have no prefill worker; their "
                             "ranks are --decode-tp")
        if self.kv_host and self.kv_interface:
            raise ValueError("give --kv-host or --kv-interface, not both")
        for name in ("threads_per_worker", "prefill_threads", "decode_threads"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if not self.orphan_after_s > 0:
            raise ValueError(f"--orphan-after-s must be > 0, got {self.orphan_after_s}")
        if not self.suspect_after_s >= 0:
            raise ValueError(f"--suspect-after-s must be >= 0, got {self.suspect_after_s}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.migration_prefill not in MIGRATION_PREFILL:
            raise ValueError(f"--migration-prefill must be one of {', '.join(MIGRATION_PREFILL)}"
                             f", got {self.migration_prefill!r}")
        if self.worker_restarts < 0:
            raise ValueError(f"--worker-restarts must be >= 0, got {self.worker_restarts}")
        if self.kv_event_bus not in ("auto", "memory"):
            raise ValueError(f"--kv-event-bus must be auto or memory, got {self.kv_event_bus!r}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"--startup-timeout-s must be > 0, got {self.startup_timeout_s}")

    def kv_cache_memory_bytes(self) -> int | None:
        """``--kv-cache-memory`` in bytes; None: engine.executor.device sizes the pool."""
        if self.kv_cache_memory is None:
            return None
        try:
            size = parse_bytes(self.kv_cache_memory)
        except ValueError as e:
            raise ValueError(f"--kv-cache-memory: {e}") from None
        if size <= 0:
            raise ValueError(f"--kv-cache-memory must be > 0, got {self.kv_cache_memory!r}")
        return size

    def offload_config(self):
        """The ``--kv-offload-*`` flags as ``engine.config.KVTierConfig`` (checked)."""
        from engine.config import KVTierConfig

        sizes = {}
        for name in ("kv_offload_memory", "kv_offload_disk"):
            v = getattr(self, name)
            try:
                sizes[name] = 0 if v is None else parse_bytes(v)
            except ValueError as e:
                raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
        return KVTierConfig(sizes["kv_offload_memory"], self.kv_offload_dir,
                            sizes["kv_offload_disk"])

    def _check_device_flags(self) -> None:
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, "
                             f"got {self.device!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, "
                             f"got {self.dtype!r}")
        if self.quantization not in QUANT_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANT_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.quantization not in ("none", "auto") and self.device == "cuda":
            raise ValueError(f"--quantization {self.quantization}: the quantized kernels are "
                             "CPU kernels; not with --device cuda")
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(f"--attention-backend must be one of "
                             f"{', '.join(ATTENTION_BACKEND_CHOICES)}, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"--kv-cache-dtype must be one of "
                             f"{', '.join(KV_CACHE_DTYPE_CHOICES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto":  # refused here, not in every worker's constructor
            check_kv_cache_dtype(self.kv_cache_dtype, "cpu" if self.device == "cpu" else "cuda",
                                 self.attention_backend)
        if self.cuda_graphs not in (None, True, False):
            raise ValueError(f"--cuda-graphs must be true or false, got {self.cuda_graphs!r}")
        try:  # here, not in every decode worker's constructor
            parse_speculative_config(self.speculative_config)
        except ValueError as e:
            raise ValueError(f"--{e}".replace("--speculative_config", "--speculative-config",
                                                1)) from None
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {u!r}")
        if self.device == "cpu":  # would fail in every worker's constructor instead
            if self.attention_backend == "flashinfer":
                raise ValueError("--attention-backend flashinfer needs GPUs: not with --device cpu")
            if self.cuda_graphs:
                raise ValueError("--cuda-graphs needs GPUs: not with --device cpu")

    def security_config(self):
        from router.frontdoor.security import SecurityConfig, TLSConfig

        tls = (TLSConfig(self.tls_cert, self.tls_key, self.tls_client_ca)
               if self.tls_cert and self.tls_key else None)
        return SecurityConfig(self.api_keys, self.metrics_public,
                              parse_bytes(self.max_request_bytes), float(self.rate_limit),
                              int(self.max_concurrent_per_key), tls,
                              tuple(t.strip() for t in (self.admin_tenants or "").split(",")
                                    if t.strip()),
                              parse_tenant_weights(self.tenant_deadlines, "--tenant-deadlines"))

    def routing_config(self):
        from router.routing.policy import RoutingConfig

        return RoutingConfig(self.routing, float(self.prefix_weight), float(self.queue_weight),
                             float(self.kv_usage_weight), self.prefix_pull)

    def autoscale_config(self):
        """The autoscaler's settings, or None without --autoscale (whose own settings are
        then refused, not ignored). ValueError for bad bounds or windows."""
        from router.cluster.autoscale import AutoscaleConfig
        from router.control.autoscaler import ScalePolicy

        names = ("min_prefill_workers", "max_prefill_workers", "min_decode_workers",
                 "max_decode_workers", "autoscale_target", "autoscale_interval_s",
                 "autoscale_up_window_s", "autoscale_down_window_s", "autoscale_cooldown_s",
                 "autoscale_migrate_after_s", "autoscale_profile")
        if not self.autoscale:
            default = ServeConfig.__dataclass_fields__
            given = [n for n in names if getattr(self, n) != default[n].default]
            if given:
                raise ValueError(f"--{given[0].replace('_', '-')} needs --autoscale")
            return None
        if self.mode != "disaggregated" and (self.min_prefill_workers is not None
                                             or self.max_prefill_workers is not None):
            raise ValueError("--min/--max-prefill-workers: a colocated cluster has no prefill "
                             "workers (its workers are --min/--max-decode-workers)")
        prefill = self.prefill_workers if self.mode == "disaggregated" else 1

        def bound(value, start):
            return start if value is None else int(value)
        policy = ScalePolicy(
            min_prefill=bound(self.min_prefill_workers, prefill),
            max_prefill=bound(self.max_prefill_workers, prefill),
            min_decode=bound(self.min_decode_workers, self.decode_workers),
            max_decode=bound(self.max_decode_workers, self.decode_workers),
            target_utilization=float(self.autoscale_target),
            interval_s=float(self.autoscale_interval_s),
            up_window_s=float(self.autoscale_up_window_s),
            down_window_s=float(self.autoscale_down_window_s),
            cooldown_s=float(self.autoscale_cooldown_s))
        for role, start in (("prefill", prefill), ("decode", self.decode_workers)):
            lo, hi = policy.bounds(role)
            if not lo <= start <= hi:
                raise ValueError(f"--{role}-workers {start} is outside --min-{role}-workers "
                                 f"{lo} .. --max-{role}-workers {hi}")
        if self.autoscale_migrate_after_s < 0:
            raise ValueError("--autoscale-migrate-after-s must be >= 0")
        return AutoscaleConfig(policy, ready_timeout_s=self.startup_timeout_s,
                               drain_migrate_after_s=float(self.autoscale_migrate_after_s),
                               prefill_tokens_s=self._profile_prefill_rate())

    def _profile_prefill_rate(self) -> float | None:
        """--autoscale-profile's prefill rate (tokens/s of a 512-token prompt, the profile's
        own interpolation), or None without one. ValueError for a file that is not one."""
        if self.autoscale_profile is None:
            return None
        from engine.tuning.profile import EngineProfile

        try:
            prof = EngineProfile.load(self.autoscale_profile)
            rate = 512 / prof.prefill_s(512)
        except (OSError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:
            raise ValueError(f"--autoscale-profile {self.autoscale_profile}: not a "
                             f"`pdcluster profile` JSON ({e})") from e
        if not rate > 0 or rate == float("inf"):
            raise ValueError(f"--autoscale-profile {self.autoscale_profile}: its prefill "
                             f"times give no rate")
        return rate

    def cluster_config(self):
        from router.cluster.ray_cluster import ClusterConfig

        num_prefill = self.prefill_workers if self.mode == "disaggregated" else 0
        threads = self.thread_plan()
        offload = self.offload_config()
        # The launcher sets each worker's device (cuda or cpu, from the placement) and
        # divides gpu_memory_utilization among workers sharing a GPU.
        common = dict(dtype=self.dtype, quantization=self.quantization,
                      attention_backend=self.attention_backend,
                      kv_cache_dtype=self.kv_cache_dtype,
                      cuda_graphs=self.cuda_graphs,
                      gpu_memory_utilization=float(self.gpu_memory_utilization),
                      kv_cache_memory_bytes=self.kv_cache_memory_bytes(),
                      kv_offload_memory_bytes=offload.memory_bytes,
                      kv_offload_dir=offload.disk_dir, kv_offload_disk_bytes=offload.disk_bytes,
                      max_model_len=self.max_model_len, max_waiting=self.max_waiting,
                      max_prefill_chunk=self.max_prefill_chunk,
                      yield_step_prefill_tokens=self.yield_step_prefill_tokens or None,
                      first_token_first=self.first_token_first,
                      adaptive_threads=self.adaptive_threads, enable_lora=self.enable_lora,
                      max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                      max_cpu_loras=lora_cpu_slots(self), lora_dtype=self.lora_dtype)
        return ClusterConfig(
            model=self.model, mode=self.mode, num_prefill_workers=num_prefill,
            num_decode_workers=self.decode_workers,
            prefill_engine=EngineArgs(block_size=self.prefill_block_size, max_num_seqs=8,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      num_threads=threads.prefill_threads,
                                      tensor_parallel_size=self.prefill_tp, **common),
            decode_engine=EngineArgs(block_size=self.decode_block_size, max_num_seqs=self.max_num_seqs,
                                     max_num_batched_tokens=self.max_num_batched_tokens,
                                     num_threads=threads.decode_threads,
                                     max_step_prefill_tokens=self.decode_step_prefill_tokens,
                                     tensor_parallel_size=self.decode_tp,
                                     speculative_config=self.speculative_config_json(),
                                     **common),
            ray_address=self.ray_address, redis_url=self.redis_url,
            use_gpus={"auto": None, "cpu": False, "cuda": True}[self.device],
            max_inflight_requests=self.max_waiting, kv_host=self.kv_host,
            kv_interface=self.kv_interface, startup_timeout_s=self.startup_timeout_s,
            migration_limit=self.migration_limit, worker_restarts=self.worker_restarts,
            migration_prefill=self.migration_prefill,
            orphan_after_s=self.orphan_after_s, suspect_after_s=self.suspect_after_s,
            require_redis=self.require_redis, name=self.name, keep_workers=self.keep_workers,
            routing=self.routing_config(), kv_event_bus=self.kv_event_bus,
            worker_overrides=dict(self.worker_overrides), prefill_env=threads.prefill_env,
            autoscale=self.autoscale_config(), tracing=self.tracing_config(),
            lora_modules=tuple((m.name, m.path) for m in parse_lora_modules(self.lora_modules)),
            pooling=self.pooling, normalize_embeddings=self.normalize_embeddings,
            tenant_weights=parse_tenant_weights(self.tenant_weights))

    def speculative_config_json(self) -> str | None:
        """The decode workers' speculative config as JSON text (None: off); prefill workers
        produce one token a request and never speculate."""
        cfg = parse_speculative_config(self.speculative_config)
        return json.dumps(cfg.to_dict()) if cfg is not None else None

    def tracing_config(self):
        """Where traces go (None: tracing off)."""
        from worker_protocol.tracing import TracingConfig

        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"--trace-sample-ratio must be in [0, 1], got "
                             f"{self.trace_sample_ratio:g}")
        return TracingConfig.resolve(self.otlp_traces_endpoint, float(self.trace_sample_ratio))

    def thread_plan(self):
        """Torch threads per worker and the workers' environment (router.cluster.threads)."""
        from router.cluster.threads import plan_threads

        num_prefill = self.prefill_workers if self.mode == "disaggregated" else 0
        num_decode = self.decode_workers
        auto = self.autoscale_config()
        if auto is not None:  # cores for as many workers as may run, not the first ones
            num_prefill = auto.policy.max_prefill if num_prefill else 0
            num_decode = auto.policy.max_decode
        from engine.runtime.cpu_threads import cpu_budget

        # The CPUs this process may use (affinity mask, cgroup quota), not the machine's.
        return plan_threads(cpu_budget().threads, num_prefill, max(1, num_decode),
                            threads_per_worker=self.threads_per_worker,
                            prefill_threads=self.prefill_threads,
                            decode_threads=self.decode_threads)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Defaults < YAML file (--config; keys are flag names) < flags given on the command line."""
    values: dict = {}
    if args.config:
        import yaml

        data = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: expected a mapping of flag names to values")
        values.update({k.replace("-", "_"): v for k, v in data.items()})
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{args.config}: unknown keys {sorted(unknown)}")
    for name in known:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    # Secrets may come from the environment (a Kubernetes Secret), never needed on a command
    # line where `ps` shows them; a flag or YAML key wins.
    for name, env in (("api_keys", "PDCLUSTER_API_KEYS_FILE"), ("redis_url", "PDCLUSTER_REDIS_URL")):
        if values.get(name) is None and os.environ.get(env):
            values[name] = os.environ[env]
    return ServeConfig(**values)
