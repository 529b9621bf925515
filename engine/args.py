"""``EngineArgs``: everything needed to build an engine, as plain data (no torch). The offline
API, the workers and the router (which only passes them on) share it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build an engine; the offline API and the workers share it."""

    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF
    # "auto": bfloat16 on CUDA, float32 on CPU (engine.executor.device has every default).
    dtype: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # None: 1 GiB on CPU; on CUDA what the weights leave of gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    batching: str = "continuous"
    dynamic_window_s: float = 0.05
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # At most this many prompt tokens of one request per step (None: the whole
    # max_num_batched_tokens): SchedulerConfig.max_prefill_chunk.
    max_prefill_chunk: int | None = None
    max_step_prefill_tokens: int | None = None  # SchedulerConfig.max_step_prefill_tokens
    # Prompt tokens per step of the priorities below one queued lately (None or 0: no limit):
    # SchedulerConfig.yield_step_prefill_tokens.
    yield_step_prefill_tokens: int | None = 256
    first_token_first: bool = False  # SchedulerConfig.first_token_first
    max_model_len: int | None = None  # default: the model's context
    prefix_hash_seed: int = 0
    max_waiting: int = 4096
    cache_dir: str | None = None  # where converted GGUF models are cached
    # Torch intra-op threads at most (None: the CPUs this process may use: affinity mask and
    # cgroup quota). adaptive_threads: fewer while other processes take CPU time from the
    # engine's threads, back when they stop (engine.runtime.cpu_threads; CPU, tensor_parallel 1).
    num_threads: int | None = None
    adaptive_threads: bool = True
    # Workers leave detokenization (and stop strings) to the router, which owns the stream.
    detokenize: bool = True
    device: str = "cpu"  # "cpu", "cuda", "cuda:N", or "auto" (CUDA when available)
    # Paged-attention implementation (engine.attention): "torch" runs everywhere,
    # "flashinfer" on CUDA; "auto" picks flashinfer on CUDA when installed.
    attention_backend: str = "auto"
    # Replay decode steps from captured CUDA graphs (None: on for CUDA, off for CPU).
    cuda_graphs: bool | None = None
    # CPU: time each linear kernel path and each decode-attention path on this host at
    # start-up (cached per host in ~/.cache/pdcluster/kernels; engine.tuning.linear). False:
    # F.linear everywhere and the "gather" decode path.
    tune_kernels: bool = True
    # Ranks the model is sharded over (engine.parallel): one process each (this one is rank
    # 0), one GPU each on CUDA; on the CPU each takes num_threads (default: the cores shared
    # out). kv_cache_memory_bytes is per rank, so the pool grows with the ranks.
    tensor_parallel_size: int = 1
    # Quantization of the linear weights (engine.quant.layouts): "auto" serves a GGUF in its own
    # blocks ("gguf", on the CPU at TP 1) and anything else as "none"; "int8" | "int4"
    # quantize the fp weights at load, "gguf" serves a GGUF's own Q8_0/Q4_0/Q4_1/Q4_K blocks
    # (no fp copy of them is read), "none" keeps fp weights. The KV cache is unchanged; the
    # activations too, except where the host's plan multiplies quantized weights by int8
    # activations (engine.ops.linear's cqint). On CUDA only "int4", in bfloat16 (PyTorch's
    # tinygemm kernel, engine.quant.gpu).
    quantization: str = "auto"
    # A second KV cache tier (engine.executor.kv_tier) for prefix blocks the pool evicts: host memory
    # (bytes; 0: off), and optionally a disk tier under a directory (both or neither).
    # The KV cache's dtype (engine.config.KV_CACHE_DTYPE_CHOICES): "auto" stores the model's
    # dtype; "int8" stores each token's K/V per KV head as int8 with its fp32 scale (3.76x the
    # tokens of fp32 per byte at head_dim 64), read by the attention kernels as stored and
    # moved between workers as stored (docs/kv-cache.md).
    kv_cache_dtype: str = "auto"
    # Speculative decoding (engine.spec, docs/speculative-decoding.md): vLLM's
    # --speculative-config as a dict or its JSON text, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4}; None: off. Checked when the engine is built.
    speculative_config: dict | str | None = None
    # LoRA adapters (engine.lora, vLLM's names): requests name one (LoRARequest) and run under
    # it, mixed with others and the base model in one batch; at most max_loras adapters in a
    # running batch, of rank at most max_lora_rank, max_cpu_loras held (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # The adapters' dtype as held and read (vLLM's name): "auto" the model's (fp32 on the
    # CPU), "float16" half the bytes a step reads (each weight rounded once; docs/lora.md).
    lora_dtype: str = "auto"
    kv_offload_memory_bytes: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int = 0
