"""Messages between the router and the workers (plain dataclasses; Ray pickles them).

One module so the router, both worker kinds and the tests agree on every field. Times that
cross a process boundary are durations measured on one side, never timestamps compared
across clocks (a wall-clock arrival time once reached a scheduler that compared it with its
monotonic clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.args import EngineArgs
from engine.contract import SamplingParams, TokenLogprob
from engine.lora.request import LoRARequest
from kv_transfer import KVLayout, KVTransferSpec, PeerAddress
from worker_protocol.tracing import TracingConfig

# The Ray concurrency group of every worker's control calls (load, abort, ping): its own
# threads, so they answer at once while the default group's threads sit in blocking
# prefill / commit calls. The router picks the group per call (``control(handle.load)``).
CONTROL_GROUP = "control"
CONTROL_GROUP_THREADS = 8
# ... and the calls that say a worker is alive (ping, load, progress): never blocking on the
# engine, in a group of their own, so a burst of control calls that wait for a slow engine
# step (aborts of many streams at once) cannot starve them into a worker taken for dead.
LIVENESS_GROUP = "liveness"
LIVENESS_GROUP_THREADS = 4

KV_TRANSPORTS = ("auto", "nccl", "gloo")


def control(method):
    """``method`` of a worker actor handle, to run in the control concurrency group."""
    return method.options(concurrency_group=CONTROL_GROUP)


def liveness(method):
    """``method`` (ping, load, progress) of a worker actor handle, in the liveness group."""
    return method.options(concurrency_group=LIVENESS_GROUP)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the router once it is up."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    node_id: str
    pid: int
    layout: KVLayout
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_address: PeerAddress | None = None  # decode workers: where their TCPStore listens
    node_ip: str = "127.0.0.1"  # the host it runs on (its Ray node's address)
    kv_host: str = "127.0.0.1"  # the address its KV endpoints bind and advertise
    # New for every start of the process: a worker Ray restarted (same id, same handle) has
    # a new incarnation, a new KV port and none of the old sequences.
    incarnation: str = ""
    kv_transport: str = ""  # "nccl" | "gloo": what its KV transfers run over
    tp_size: int = 1  # tensor-parallel ranks (this process is rank 0)
    rank_pids: tuple[int, ...] = ()  # the other ranks' processes, on the same host
    # Its lifeline's port on node_ip (worker_protocol.lifeline); 0: none.
    lifeline_port: int = 0


@dataclass(frozen=True)
class WorkerLoad:
    """The one load shape: a worker's report, the router's routing input, the registry's
    heartbeat payload and the /metrics gauges all read these fields."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated" | "embedded"
    kv_blocks_used: int  # blocks reserved for KV still in flight included
    kv_blocks_total: int
    requests_running: int
    requests_waiting: int
    kv_blocks_reserved: int = 0
    kv_transfer_bytes: int = 0  # sent (prefill) or received (decode) so far
    reported_at: float = 0.0  # wall-clock seconds, set where the report is stored
    incarnation: str = ""  # the reporting process's (WorkerInfo.incarnation)
    # Cumulative over this incarnation: prompt tokens whose KV came from the prefix cache
    # (a decode worker's count includes pinned prefixes it did not receive), and prompt
    # (or recomputed) tokens run through the model.
    prefix_hit_tokens: int = 0
    prefill_tokens_computed: int = 0
    # The newest KV event batch this incarnation published (worker_protocol.kv_events): a
    # router whose index lags it for long pulls the batches itself (see router.routing.kv_sync).
    kv_event_seq: int = 0
    # Cumulative over this incarnation: pure-decode engine steps per batch size, as
    # (batch, steps, seconds) rows (engine.core.step_times); empty for a prefill worker. And the
    # same for mixed steps (decode rows beside prefill chunks: colocated), by decode rows.
    decode_steps: tuple = ()
    mixed_steps: tuple = ()
    # KV bytes each tensor-parallel rank sent (prefill) or received (decode) on its own
    # pairs, rank order (one entry at TP 1; empty for a colocated worker).
    rank_kv_transfer_bytes: tuple = ()
    # One block of its KV pool as stored, every layer (int8 pools: values and scales).
    kv_block_bytes: int = 0
    # The second KV cache tier (engine.executor.kv_tier): blocks held in host memory and on disk now,
    # and prompt tokens restored from it instead of recomputed (cumulative).
    kv_offload_host_blocks: int = 0
    kv_offload_disk_blocks: int = 0
    kv_offload_restored_tokens: int = 0
    # Cumulative over this incarnation: preempted requests, cached prefix blocks evicted from
    # the pool, and every engine step's time (engine.core.step_times.StepHistogram.snapshot).
    preemptions: int = 0
    prefix_cache_evictions: int = 0
    step_seconds: tuple = ()
    # The torch threads its engine steps on now, and the fraction of those threads' time
    # other processes took in its last window (engine.runtime.cpu_threads; 0 off the CPU).
    engine_threads: int = 0
    cpu_stolen: float = 0.0
    # Speculative decoding (engine.spec), cumulative over this incarnation: drafts proposed
    # and accepted, by position too (index i: a step's (i+1)-th draft), and the sequence-steps
    # that verified drafts with the tokens they produced (accepted drafts + one each).
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_verified_seqs: int = 0
    spec_emitted: int = 0
    spec_proposed_by_position: tuple = ()
    spec_accepted_by_position: tuple = ()
    # LoRA adapters (worker_protocol.adapters): the names held now, and cumulative per
    # adapter name (name, loads, evictions) over this incarnation.
    lora_adapters: tuple = ()
    lora_counts: tuple = ()

    def __post_init__(self) -> None:
        # Through JSON (the Redis registry) the rows come back as lists: made tuples again,
        # so a report read back equals the one written.
        for name in ("decode_steps", "mixed_steps"):
            rows = getattr(self, name)
            if not isinstance(rows, tuple) or any(not isinstance(r, tuple) for r in rows):
                object.__setattr__(self, name, tuple(
                    (int(b), int(n), float(s)) for b, n, s in rows))
        if not isinstance(self.step_seconds, tuple):  # a list, through JSON
            object.__setattr__(self, "step_seconds", tuple(self.step_seconds))
        for name in ("rank_kv_transfer_bytes", "spec_proposed_by_position",
                     "spec_accepted_by_position"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(int(n) for n in getattr(self, name)))
        if not isinstance(self.lora_adapters, tuple):
            object.__setattr__(self, "lora_adapters", tuple(self.lora_adapters))
        if any(not isinstance(r, tuple) for r in self.lora_counts) \
                or not isinstance(self.lora_counts, tuple):
            object.__setattr__(self, "lora_counts", tuple(
                (str(n), int(ld), int(ev)) for n, ld, ev in self.lora_counts))


@dataclass(frozen=True)
class ReserveRequest:
    """Decode side: hold pages for ``prompt_token_ids`` and post receives for its KV."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    layout: KVLayout  # what the prefill worker sends in (checked against the decode model's)
    source_worker_id: str  # the prefill worker that will send the KV
    router_id: str = ""  # the router that owns the request (gets its tokens)
    source_tp: int = 1  # its tensor-parallel ranks (each sends the KV heads it holds)
    # The LoRA adapter the prompt's KV is computed under (None: the base model): this worker
    # holds it too, and reuses only that adapter's cached prefix.
    lora_request: LoRARequest | None = None
    priority: int = 0  # its engine priority (higher first): the last preempted when short
    # How long to wait for a held adapter to free when every one this worker may hold
    # (max_cpu_loras) has requests under it (worker_protocol.adapters); then AdaptersBusyError.
    adapter_wait_s: float = 0.0


@dataclass(frozen=True)
class ReserveResult:
    ok: bool
    reason: str = ""  # why not, when refused (no KV capacity, cannot receive, ...)
    num_blocks: int = 0
    # Where the reserving process receives the KV, and which process that is. The prefill
    # worker sends here, not to the router's record: a worker Ray has just restarted
    # listens on a new port before the router has re-read its WorkerInfo.
    kv_address: PeerAddress | None = None
    incarnation: str = ""
    # The transfer the prefill worker must send, its id assigned by this decode worker: the
    # receiver is the one party that sees every transfer into it, so ids stay unique per
    # (prefill, decode) pair however many routers reserve at once.
    transfer: KVTransferSpec | None = None
    # Where the decode worker's other tensor-parallel ranks receive (ranks 1..; empty at TP
    # 1): the prefill ranks send each of them its KV heads directly.
    kv_rank_addresses: tuple[PeerAddress, ...] = ()


@dataclass(frozen=True)
class CommitRequest:
    """Decode side: wait for the reserved KV to arrive, then admit with the first token."""

    request_id: str
    first_token_id: int
    timeout_s: float | None = None  # None: the worker's transfer timeout
    first_logprob: TokenLogprob | None = None  # the prefill's, when the request asked
    # W3C traceparent of the router's decode span ("": untraced): worker_protocol.tracing.
    traceparent: str = ""


@dataclass(frozen=True)
class CommitResult:
    """After the KV arrived and the first token was placed: finished already, or decoding."""

    finished: bool
    finish_reason: str | None = None


@dataclass(frozen=True)
class AbortRequest:
    """Either worker: free everything ``request_id`` holds there. Idempotent."""

    request_id: str


@dataclass(frozen=True)
class SubmitRequest:
    """Colocated mode: the decode worker prefills the prompt itself (chunked)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # queued ahead of lower priorities (a migrated stream's re-prefill)
    router_id: str = ""  # the router that owns the request (gets its tokens)
    traceparent: str = ""  # the router's decode span ("": untraced)
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: base model)


@dataclass(frozen=True)
class TokenUpdate:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # set on the request's last update
    error: str | None = None  # finish_reason "error": why this request alone failed
    # Position of new_token_ids[0] in the client's whole stream (a migrated request's
    # earlier tokens counted): lets a router that adopts the request write its log exactly.
    index: int = -1
    # One per new token when the request asked for logprobs (SamplingParams.logprobs).
    logprobs: list[TokenLogprob] | None = None
    # The request's first update, when it asked for prompt logprobs: one per prompt token.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class RequestTokens:
    """Every token a decode worker generated for one request, for a router repairing a gap
    in its stream log: ``token_ids`` start at stream position ``index``."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None


@dataclass(frozen=True)
class TokenBatch:
    """One decode step's new tokens for every sequence that produced one (one message per step)."""

    worker_id: str
    updates: list[TokenUpdate] = field(default_factory=list)
    step_time: float = 0.0


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    transfer: KVTransferSpec
    destination: PeerAddress
    # The worker gives up (aborts the prompt, frees its pages) after this long; None: its
    # own default. The router waits a little longer, so the worker's answer arrives first.
    timeout_s: float | None = None
    priority: int = 0  # queued ahead of lower priorities (a migrated stream's re-prefill)
    # The decode worker's other ranks' addresses (ReserveResult.kv_rank_addresses): its TP
    # size is one more than their number.
    destination_ranks: tuple[PeerAddress, ...] = ()
    traceparent: str = ""  # the router's prefill span ("": untraced)
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: base model)


class PrefillTimeoutError(RuntimeError):
    """A prefill worker did not finish a prompt (queue + compute + send) within its deadline;
    the prompt was aborted there."""


@dataclass(frozen=True)
class PrefillResult:
    """The first token, and where the time went (seconds, measured on the prefill worker)."""

    request_id: str
    first_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_s: float  # arrival at the worker -> first scheduled step
    compute_s: float  # first scheduled step -> end of the step that finished the prompt
    transfer_tail_s: float  # end of that step -> all KV sends completed
    kv_bytes: int
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # ... for prompt logprobs
    # Its first layer's send posted -> every send completed: the whole KV transfer, the part
    # compute hid included (``transfer_tail_s`` is the rest).
    transfer_s: float = 0.0


@dataclass(frozen=True)
class WorkerConfig:
    """How to build one worker. ``engine_args`` is the engine's; the rest is the worker's own."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    engine_args: EngineArgs
    # Where KV endpoints bind and advertise (worker_protocol.runtime.resolve_kv_host): an
    # explicit address, else this interface's IPv4, else $PDCLUSTER_KV_HOST, else the Ray
    # node IP. The router passes 127.0.0.1 when every worker shares one host.
    kv_host: str | None = None
    kv_interface: str | None = None
    transfer_timeout_s: float = 30.0
    # A reservation whose KV has not fully arrived by then is released (blocks freed).
    lease_s: float = 30.0
    # Prefill: send each layer as soon as it is computed (False: all layers after the step).
    stream_layers: bool = True
    # Pin the worker process to these CPU cores (benchmarks compare setups with equal cores).
    cpu_affinity: tuple[int, ...] | None = None
    # Fault injection for failure tests (never set in production): the prefill worker's
    # process exits after sending this many layers in total (a peer dying mid-transfer), or
    # sleeps after each layer it sends (a slow link, to hold a transfer open); the decode
    # worker sleeps after each engine step (long-lived streams); any worker serving a
    # prefix pull sleeps before each layer it sends (a pull held open, to kill its source).
    # KV events (prefix-cache changes, for KV-aware routing) also go to Redis Streams here
    # (None: routers pull them from the worker's in-memory log through Ray).
    kv_events_redis_url: str | None = None
    kv_events_namespace: str = "pdcluster"
    fault_exit_after_layers: int | None = None
    fault_delay_per_layer_s: float = 0.0
    fault_delay_per_step_s: float = 0.0
    fault_pull_delay_per_layer_s: float = 0.0
    # What KV transfers run over: "nccl" (GPU to GPU; the launcher chooses it only when every
    # worker has a GPU of its own: NCCL cannot put two ranks of a group on one device),
    # "gloo" (TCP through host memory: CPU workers, or workers sharing a GPU), or "auto"
    # (follow the engine's device: workers built outside a cluster).
    kv_transport: str = "auto"
    # Where this worker exports the spans of the requests it serves (None: tracing off).
    tracing: TracingConfig | None = None

    def __post_init__(self) -> None:
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, "
                             f"got {self.kv_transport!r}")

    def transport_for(self, engine_device_type: str) -> str:
        """The transport, "nccl" or "gloo", for an engine on ``engine_device_type``;
        ValueError for NCCL without CUDA (it moves CUDA tensors only)."""
        if self.kv_transport == "auto":
            return "nccl" if engine_device_type == "cuda" else "gloo"
        if self.kv_transport == "nccl" and engine_device_type != "cuda":
            raise ValueError(f"{self.worker_id}: kv_transport 'nccl' needs a CUDA engine "
                             f"(this one runs on {engine_device_type})")
        return self.kv_transport


def offload_load(stats) -> dict:
    """``WorkerLoad``'s second-tier and engine-counter fields from an ``engine.EngineStats``
    (keyword args)."""
    tier = stats.kv_offload
    return {"kv_offload_host_blocks": tier.memory_blocks if tier else 0,
            "kv_offload_disk_blocks": tier.disk_blocks if tier else 0,
            "kv_offload_restored_tokens": stats.num_restored_tokens,
            "preemptions": stats.num_preemptions,
            "prefix_cache_evictions": stats.num_evicted_blocks,
            "step_seconds": stats.step_seconds,
            "engine_threads": stats.num_threads,
            "cpu_stolen": stats.cpu_stolen,
            **spec_load(stats.spec)}


def spec_load(spec: dict | None) -> dict:
    """``WorkerLoad``'s speculative-decoding fields from ``EngineStats.spec``
    (``engine.spec.controller.SpecStats.snapshot``; None: speculation off)."""
    if not spec:
        return {}
    return {"spec_proposed": spec["proposed"], "spec_accepted": spec["accepted"],
            "spec_verified_seqs": spec["verified_seqs"], "spec_emitted": spec["emitted"],
            "spec_proposed_by_position": tuple(spec["proposed_by_position"]),
            "spec_accepted_by_position": tuple(spec["accepted_by_position"])}
