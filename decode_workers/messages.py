"""Messages between the router and the workers (plain dataclasses; Ray pickles them).

Prefill workers import these too: they are the workers' shared vocabulary, and keeping them in
one module means the router, both worker kinds and the tests agree on every field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import SamplingParams
from kv_transfer import KVLayout, KVTransferSpec, PeerAddress


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


@dataclass(frozen=True)
class WorkerLoad:
    """A snapshot for routing and /metrics."""

    worker_id: str
    role: str
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_reserved: int
    requests_running: int
    requests_waiting: int
    kv_transfer_bytes: int = 0


@dataclass(frozen=True)
class ReserveRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    transfer: KVTransferSpec
    source_worker_id: str  # the prefill worker that will send the KV
    arrival_time: float = 0.0


@dataclass(frozen=True)
class ReserveResult:
    ok: bool
    reason: str = ""  # why not, when refused (no KV capacity, duplicate id, ...)
    num_blocks: int = 0


@dataclass(frozen=True)
class CommitResult:
    """After the KV arrived and the first token was placed: finished already, or decoding."""

    finished: bool
    finish_reason: str | None = None


@dataclass(frozen=True)
class SubmitRequest:
    """Colocated mode: the decode worker prefills the prompt itself (chunked)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0


@dataclass(frozen=True)
class TokenUpdate:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # set on the request's last update


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
    arrival_time: float = 0.0


@dataclass(frozen=True)
class PrefillResult:
    """The first token, and where the time went (seconds, measured on the prefill worker)."""

    request_id: str
    first_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_s: float  # arrival -> first scheduled step
    compute_s: float  # first scheduled step -> end of the step that finished the prompt
    transfer_tail_s: float  # end of that step -> all KV sends completed
    kv_bytes: int


def apply_cpu_affinity(cores: tuple[int, ...] | None) -> None:
    """Pin this process to ``cores`` (Linux); torch then uses one thread per pinned core."""
    if not cores:
        return
    import os

    import torch

    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))


@dataclass(frozen=True)
class WorkerConfig:
    """How to build one worker. ``engine_args`` is the engine's; the rest is the worker's own."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    engine_args: object  # engine.llm_engine.EngineArgs (kept untyped: no torch import here)
    kv_host: str = "127.0.0.1"
    transfer_timeout_s: float = 30.0
    # A reservation whose KV has not fully arrived by then is released (blocks freed).
    lease_s: float = 30.0
    # Prefill: send each layer as soon as it is computed (False: all layers after the step).
    stream_layers: bool = True
    # Pin the worker process to these CPU cores (benchmarks compare setups with equal cores).
    cpu_affinity: tuple[int, ...] | None = None
    # Fault injection for failure tests (never set in production): the prefill worker's
    # process exits after sending this many layers in total (a peer dying mid-transfer), or
    # sleeps after each layer it sends (a slow link, to hold a transfer open).
    fault_exit_after_layers: int | None = None
    fault_delay_per_layer_s: float = 0.0
