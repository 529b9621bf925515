"""Frozen, validated configuration for the engine's KV cache (its pool, its dtype, its second
tier) and scheduler, and the choices the engine's settings accept. No torch: the router reads
and checks all of it before any engine exists.

Config is read once (CLI / YAML / LLM(...) kwargs) into these dataclasses and passed down;
nothing below reads the environment. Every ``__post_init__`` raises ``ValueError`` naming
the bad field, so a misconfiguration fails at start-up, not in the middle of a step. The
model's shape is ``engine.models.config.ModelConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

BATCHING_POLICIES = ("continuous", "static", "dynamic")
# The one dtype table: names every config, layout and checkpoint loader accepts, and their
# sizes. Torch dtypes are ``getattr(torch, name)`` (this module stays torch-free).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_CHOICES = ("auto", *DTYPE_BYTES)
ATTENTION_BACKEND_CHOICES = ("auto", "torch", "flashinfer")
# What ``--kv-cache-dtype`` accepts (vLLM's name and meaning). ``auto``: the KV cache holds the
# model's dtype. ``int8``: each token's K and V of each KV head are stored as head_dim int8
# values and their fp32 scale (symmetric, max |x| / 127) in one row of head_dim + 4 bytes,
# quantized as they are written (engine.attention.kv_format): a page holds its scales, so
# every page copy (transfer, tier, pull) moves them together. ``fp8`` is refused where it is
# not served (engine.attention.kv_format.check_kv_cache_dtype says where).
KV_CACHE_DTYPE_CHOICES = ("auto", "int8", "fp8")
KV_SCALE_BYTES = 4  # int8 rows: one fp32 scale after each head's head_dim values


def kv_row_bytes(head_dim: int, dtype: str, kv_cache_dtype: str) -> int:
    """Bytes of one token's K (or V) of one KV head as the pool stores it."""
    if kv_cache_dtype == "auto":
        return head_dim * DTYPE_BYTES[dtype]
    if kv_cache_dtype == "int8":
        return head_dim + KV_SCALE_BYTES
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} has no row layout here; choose from "
                     f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")


def check_kv_cache_dtype(kv_cache_dtype: str, device_type: str, attention_backend: str) -> None:
    """ValueError naming what to use instead, where ``kv_cache_dtype`` is not served:

    - ``fp8`` is not served yet on any device: these CPUs have no fp8 arithmetic, so every
      element would be converted in the kernel, where int8's row scales give the same 1 byte
      per value and integer-exact round trips; on CUDA it awaits FlashInfer's fp8 pages.
    - ``int8`` with the FlashInfer backend: FlashInfer reads no int8 pages; the torch backend
      (``attention_backend="torch"``) serves it on CUDA and the CPU alike.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose from "
                         f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
    if kv_cache_dtype == "fp8":
        raise ValueError("kv_cache_dtype='fp8' is not served yet: use kv_cache_dtype='int8' "
                         "(1 byte per value with a scale per token and KV head, on the CPU "
                         "and, with attention_backend='torch', on CUDA)")
    if kv_cache_dtype == "int8" and attention_backend == "flashinfer":
        raise ValueError("kv_cache_dtype='int8' is read by the torch attention backend only "
                         "(FlashInfer reads no int8 pages): use attention_backend='torch'")


def kv_attention_backend(args) -> str:
    """An ``engine.EngineArgs``'s attention backend with its KV dtype: ``"auto"`` with an int8
    KV cache is the torch backend (the one that reads int8 pages); anything else as asked."""
    if args.kv_cache_dtype != "auto" and args.attention_backend == "auto":
        return "torch"
    return args.attention_backend


def kv_hash_seed(prefix_hash_seed: int, kv_cache_dtype: str) -> int:
    """The seed of the chained prefix-block hashes for a pool of ``kv_cache_dtype``: the
    configured seed for ``auto``, a different one per quantized KV dtype, so a block's key
    names the bytes it holds and neither a block manager nor a router's KV index matches a
    prompt to blocks of another KV dtype."""
    if kv_cache_dtype == "auto":
        return prefix_hash_seed
    tag = int.from_bytes(f"kv:{kv_cache_dtype}".encode()[:8].ljust(8, b"\0"), "little")
    return (prefix_hash_seed ^ tag) & 0xFFFFFFFFFFFFFFFF
# What ``--quantization`` accepts: ``auto`` (the default) serves a checkpoint in its own
# quantization where it has one this engine serves (a GGUF's blocks: ``gguf``), else as
# ``none``; ``none`` keeps the checkpoint's fp weights (a GGUF's dequantized copy), a kind of
# ``engine.quant.layouts.KINDS`` quantizes them at load, ``gguf`` serves a GGUF's own Q8_0 /
# Q4_0 / Q4_1 / Q4_K blocks in those layouts (engine.quant.gguf).
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4", "gguf")


def resolve_quantization(name: str, has_gguf_blocks: bool, device_type: str) -> str:
    """``--quantization`` as served: ``"auto"`` -> ``"gguf"`` for a model converted from a GGUF
    that holds blocks in our layouts (``has_gguf_blocks``), on the CPU (the GPU serves no GGUF
    blocks yet), at any TP size, else ``"none"``; any other name as it is
    (``check_quantization`` refuses what cannot be honoured)."""
    if name != "auto":
        return name
    return "gguf" if has_gguf_blocks and device_type == "cpu" else "none"


def resolve_dtype(name: str, device_type: str) -> str:
    """``"auto"`` -> bfloat16 on CUDA (half the bytes every decode step reads), float32 on CPU
    (these CPUs have no fast bf16 GEMM, and fp32 is what the token-equality tests pin).
    ``device_type``: a torch device's ``.type`` ("cpu", "cuda"); ValueError for an unknown
    dtype. Here, not beside the device plan, so the router resolves a KV layout's dtype
    without importing torch."""
    if name == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {name!r}; choose from {', '.join(DTYPE_CHOICES)}")
    return name


class KVFootprint(Protocol):
    """What sizing the KV pool reads of a model (``engine.models.config.ModelConfig``)."""

    @property
    def kv_bytes_per_token(self) -> int: ...

    def kv_cache_bytes_per_token(self, kv_cache_dtype: str) -> int: ...


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many ``b``-sized blocks hold ``a`` items."""
    return -(-a // b)


def num_blocks_for_budget(model: KVFootprint, block_size: int, kv_cache_memory_bytes: int,
                          kv_cache_dtype: str = "auto") -> int:
    """How many KV blocks fit in ``kv_cache_memory_bytes`` (the only way we size the pool):
    a quantized KV dtype's smaller rows give more blocks for the same budget."""
    return kv_cache_memory_bytes // (block_size * model.kv_cache_bytes_per_token(kv_cache_dtype))


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, memory budget, prefix caching."""

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    # Seeds the chained block hashes; every worker of a cluster must agree on it.
    prefix_hash_seed: int = 0
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPE_CHOICES

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose from "
                             f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two > 0, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling limits and the batching policy.

    - ``continuous``: every step refills free slots from the waiting queue.
    - ``static``: a batch is formed only when no request is running; nobody joins until the
      whole batch has finished (the head-of-line blocking baseline).
    - ``dynamic``: like static, but a batch is launched once it is full or the oldest waiting
      request has waited ``dynamic_window_s``.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    policy: str = "continuous"
    dynamic_window_s: float = 0.05
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048
    max_waiting: int = 4096  # queue limit; beyond it add_request raises QueueFullError
    # At most this many prompt tokens of one request per step (None: the whole budget). A
    # long prompt then takes several steps and leaves room in each for others: a short
    # prompt, or a prefix-cache hit, arriving behind it starts at the next step instead of
    # after the long one (its TTFT stops depending on what arrived just before it). Needs
    # chunked prefill.
    max_prefill_chunk: int | None = None
    # At most this many prompt tokens per step, all requests together (None: the whole
    # budget); decode tokens do not count. A step's length is mostly its prompt tokens, so
    # this bounds how long prompt work stalls the running streams (their inter-token gap)
    # on a worker that decodes for many while it prefills for a few (a disaggregated decode
    # worker computing a migrated stream again). Needs chunked prefill.
    max_step_prefill_tokens: int | None = None
    # At most this many prompt tokens per step of the requests below the highest priority
    # queued in the last minute (None or 0: no such limit). A step cannot be interrupted, so a
    # higher-priority prompt arriving while one runs waits for it: this keeps that step
    # short while priorities are mixed (engine/core/prompt_budget.py). Applies under
    # continuous batching with chunked prefill only.
    yield_step_prefill_tokens: int | None = 256
    # Continuous batching: a step that can finish the next waiting prompt runs without the
    # decodes (their next step follows at once), so its first token does not wait for them
    # (engine/core/scheduler.py's module docstring).
    first_token_first: bool = False
    # LoRA (engine.lora): at most this many distinct adapters in the running batch (a
    # request of another adapter waits for one of them to finish).
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_prefill_chunk is not None:
            if self.max_prefill_chunk <= 0:
                raise ValueError(f"max_prefill_chunk must be > 0, got {self.max_prefill_chunk}")
            if not self.enable_chunked_prefill:
                raise ValueError("max_prefill_chunk needs chunked prefill (a prompt in "
                                 "several steps); it is off")
        if self.max_step_prefill_tokens is not None:
            if self.max_step_prefill_tokens <= 0:
                raise ValueError(f"max_step_prefill_tokens must be > 0, got "
                                 f"{self.max_step_prefill_tokens}")
            if not self.enable_chunked_prefill:
                raise ValueError("max_step_prefill_tokens needs chunked prefill (a prompt in "
                                 "several steps); it is off")
        if self.yield_step_prefill_tokens is not None and self.yield_step_prefill_tokens < 0:
            raise ValueError(f"yield_step_prefill_tokens must be >= 0 (0: off), got "
                             f"{self.yield_step_prefill_tokens}")
        if self.policy not in BATCHING_POLICIES:
            raise ValueError(
                f"unknown batching policy {self.policy!r}; choose one of {', '.join(BATCHING_POLICIES)}"
            )
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.dynamic_window_s < 0:
            raise ValueError(f"dynamic_window_s must be >= 0, got {self.dynamic_window_s}")


# ---- the second KV cache tier (engine.executor.kv_tier): its sizes, read by the router too ----
@dataclass(frozen=True)
class KVTierConfig:
    """Sizes of the tiers (bytes); ``memory_bytes`` 0 turns the tier off."""

    memory_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("kv_offload sizes must be >= 0, got "
                             f"memory={self.memory_bytes} disk={self.disk_bytes}")
        if (self.disk_dir is None) != (self.disk_bytes == 0):
            raise ValueError("--kv-offload-dir and --kv-offload-disk go together (a disk tier "
                             f"needs both), got dir={self.disk_dir!r} disk={self.disk_bytes}")
        if self.disk_bytes and not self.memory_bytes:
            raise ValueError("--kv-offload-disk needs --kv-offload-memory: blocks reach the "
                             "disk tier through host memory")

    @property
    def enabled(self) -> bool:
        return self.memory_bytes > 0


def offload_config(args) -> KVTierConfig:
    """The second tier's sizes from an ``engine.EngineArgs``, refused by name where it cannot
    work."""
    cfg = KVTierConfig(args.kv_offload_memory_bytes, args.kv_offload_dir,
                       args.kv_offload_disk_bytes)
    if cfg.enabled and not args.enable_prefix_caching:
        raise ValueError("--kv-offload-memory keeps prefix-cache blocks: it needs prefix "
                         "caching on (enable_prefix_caching=True)")
    if cfg.enabled and args.tensor_parallel_size > 1:
        raise ValueError("--kv-offload-memory: not with tensor_parallel_size > 1 yet (each "
                         "rank holds its own KV heads; the tier copies one rank's pool)")
    return cfg
