"""Building an engine's parts (``EngineParts``) from its ``EngineArgs``.

``build_engine`` resolves every ``"auto"`` once (``engine.executor.device``), loads the model
(starting the other tensor-parallel ranks first, so they load their slices meanwhile), sizes
the KV pool after the weights are placed, tunes this host's kernels for the model, and wires the
runner, block manager, scheduler and KV connector together. ``LLMEngine`` steps what it returns.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.args import EngineArgs
from engine.config import (
    CacheConfig,
    SchedulerConfig,
    check_kv_cache_dtype,
    kv_attention_backend,
    kv_hash_seed,
    num_blocks_for_budget,
    offload_config,
    resolve_quantization,
)
from engine.core.block_manager import BlockManager
from engine.core.grammar import Grammars
from engine.core.scheduler import Scheduler
from engine.executor.device import DevicePlan, kv_pool_bytes, plan_device
from engine.executor.kv_tier import KVTier
from engine.executor.model_runner import ModelRunner
from engine.lora.registry import LoRARegistry
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.ops.linear import LinearPlan, linear_plan, set_linear_plan
from engine.parallel.ranks import TPRanks, rank_device, rank_threads
from engine.parallel.sharding import TPShard
from engine.quant.layouts import check_quantization, weight_bytes
from engine.runtime.cpu_threads import EngineThreads
from engine.runtime.draft_build import build_drafter
from engine.runtime.kv_connector import KVConnector
from engine.spec.config import parse_speculative_config
from engine.spec.decoder import SpecDecoder
from engine.text.input_processor import InputProcessor
from engine.text.tokenizer import Tokenizer, load_tokenizer
from engine.tuning.linear import model_linear_weights
from engine.tuning.runner_plans import RunnerPlans, plans_by_threads, tune_runner
from engine.weights.huge_pages import move_weights_to_huge_pages
from engine.weights.loader import has_quantized_blocks, load_weights
from engine.weights.resolve import load_model_config, resolve_model

log = logging.getLogger(__name__)

__all__ = ["EngineParts", "build_engine"]

TP_FOLLOWER_MODULE = "engine.runtime.tp_follower"  # what each other rank runs (python -m)


@dataclass
class EngineParts:
    """What ``build_engine`` makes of one ``EngineArgs``: everything an ``LLMEngine`` steps with."""

    plan: DevicePlan  # every "auto" resolved
    threads: EngineThreads | None  # the CPU thread governor (CPU at TP 1), else None
    model_config: ModelConfig
    tokenizer: Tokenizer | None  # None: a model without one; lazy where text is rarely needed
    eos_token_ids: tuple[int, ...]  # the model's and the tokenizer's
    max_model_len: int
    scheduler_config: SchedulerConfig
    ranks: TPRanks | None  # the other tensor-parallel ranks (TP > 1)
    model: LlamaForCausalLM
    cache_config: CacheConfig
    runner: ModelRunner
    inputs: InputProcessor
    kv_tier: KVTier | None  # the second KV tier, None when off
    block_manager: BlockManager
    scheduler: Scheduler
    kv_connector: KVConnector
    spec: SpecDecoder | None = None  # speculative decoding (engine.spec), None when off
    lora: LoRARegistry | None = None  # the LoRA adapters (engine.lora), None when off


def build_engine(args: EngineArgs, clock: Callable[[], float] = time.monotonic) -> EngineParts:
    """Build an engine's parts from ``args``. Raises ValueError for what this machine or model
    cannot do; on any failure the tensor-parallel ranks it started are ended."""
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp > 1 and args.cuda_graphs:
        # Asked for explicitly, not just the GPU default: refused rather than dropped.
        raise ValueError("cuda_graphs=True: not with tensor_parallel_size > 1 (the "
                         "collectives are not captured); leave it unset or false")
    if tp > 1 or (args.num_threads and args.device != "cpu"):
        torch.set_num_threads(rank_threads(args.num_threads, tp))
    plan = plan_device(rank_device(args.device, 0) if tp > 1 else args.device,
                       args.dtype, kv_attention_backend(args), args.cuda_graphs)
    # On the CPU at TP 1, the thread count follows the CPU this process gets.
    threads = (EngineThreads(args.num_threads, args.adaptive_threads)
               if plan.device.type == "cpu" and tp == 1 else None)
    offload = offload_config(args)
    spec_config = parse_speculative_config(args.speculative_config)  # before any load
    resolved = resolve_model(args.model, cache_dir=args.cache_dir)
    if args.quantization == "auto":
        quant = resolve_quantization("auto", has_quantized_blocks(resolved.model_dir),
                                     plan.device.type)
        if quant == "gguf":
            log.info("serving %s in its own quantized blocks (--quantization gguf; "
                     "--quantization none serves their fp32 dequantization)", resolved.model_id)
        # the ranks, the status and every later reader see what is served
        args = dataclasses.replace(args, quantization=quant)
    check_quantization(args.quantization, plan.device, tp, plan.dtype)
    check_kv_cache_dtype(args.kv_cache_dtype, plan.device.type, plan.attention_backend)
    cfg = load_model_config(resolved.model_dir, dtype=plan.dtype, model_id=resolved.model_id)
    # A worker's engine (token ids in and out) loads it on first need: ~2 s less to start.
    tokenizer = load_tokenizer(resolved.model_dir, lazy=not args.detokenize)
    eos = tuple(sorted(set(cfg.eos_token_ids) | set(tokenizer.eos_token_ids
                                                     if tokenizer else ())))
    max_len = min(args.max_model_len or cfg.max_model_len, cfg.max_model_len)
    rs = cfg.rope_scaling
    if rs is not None and rs.kind == "longrope":
        log.info("LongRoPE: serving up to %d tokens with its %s factors for every sequence "
                 "(--max-model-len <= %d serves the short ones)", max_len,
                 "long" if max_len > rs.original_max_position_embeddings else "short",
                 rs.original_max_position_embeddings)
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        policy=args.batching, dynamic_window_s=args.dynamic_window_s,
        enable_chunked_prefill=args.enable_chunked_prefill, max_model_len=max_len,
        max_waiting=args.max_waiting, max_prefill_chunk=args.max_prefill_chunk,
        max_step_prefill_tokens=args.max_step_prefill_tokens,
        yield_step_prefill_tokens=args.yield_step_prefill_tokens,
        first_token_first=args.first_token_first,
        max_loras=args.max_loras if args.enable_lora else 0)
    if args.enable_lora:
        check_lora(args, cfg, plan.device.type, spec_config is not None)
    shard = TPShard(0, tp)
    shard.check(cfg)  # before any rank starts: a clear error naming the dimension
    # The other ranks start now and load their slices while this one loads its own.
    ranks = TPRanks(args, plan.device, TP_FOLLOWER_MODULE) if tp > 1 else None
    try:
        model = LlamaForCausalLM(cfg, max_len, ranks.comm if ranks else None)
        load_weights(model, resolved.model_dir, args.quantization,
                     lambda n: shard.slice_of(n, cfg))
        model = model.to(plan.device)
        model.place_quantized(plan.device)  # model.to leaves quantized weights behind
        move_weights_to_huge_pages(model)  # the CPU's weights in 2 MB pages: fewer TLB misses
        # Sized after the weights are on the device: on CUDA the pool takes what they
        # left. Per rank: each holds its KV heads only (model.cfg: this rank's shapes).
        pool_bytes = kv_pool_bytes(args.kv_cache_memory_bytes, plan.device,
                                   args.gpu_memory_utilization)
        cache_config = CacheConfig(
            block_size=args.block_size, kv_cache_memory_bytes=pool_bytes,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_hash_seed=args.prefix_hash_seed, kv_cache_dtype=args.kv_cache_dtype)
        num_blocks = num_blocks_for_budget(model.cfg, args.block_size, pool_bytes,
                                           args.kv_cache_dtype)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={pool_bytes} holds no block of "
                f"{args.block_size} tokens "
                f"({model.cfg.kv_cache_bytes_per_token(args.kv_cache_dtype)} bytes per token)")
        if ranks is not None:
            ranks.start(max_len, num_blocks)
        runner = ModelRunner(model, cache_config, num_blocks,
                             attention_backend=plan.attention_backend,
                             cuda_graphs=plan.cuda_graphs,
                             max_num_seqs=args.max_num_seqs, max_model_len=max_len)
        tune_runner(args, plan, model, runner)
        if threads is not None and threads.adaptive:
            plans = plans_by_threads(args, plan, model, runner,
                                     range(1, threads.governor.max_threads + 1))
            threads.on_change = lambda n: plans.get(n, RunnerPlans.current(runner)).apply(runner)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    inputs = InputProcessor(tokenizer, cfg.vocab_size, max_len,
                            max_kv_tokens=num_blocks * args.block_size)
    kv_tier = KVTier(runner.kv_caches, offload) if offload.enabled else None
    block_manager = BlockManager(num_blocks, args.block_size,
                                 enable_prefix_caching=args.enable_prefix_caching,
                                 hash_seed=kv_hash_seed(args.prefix_hash_seed,
                                                        args.kv_cache_dtype),
                                 tier=kv_tier)
    grammars = Grammars(tokenizer, cfg.vocab_size, eos) if tokenizer else None
    scheduler = Scheduler(scheduler_config, block_manager, clock, grammars)
    kv_connector = KVConnector(scheduler, block_manager, runner, eos, clock)
    spec = None
    if spec_config is not None:
        drafter = None
        if spec_config.method != "ngram":  # a draft model beside the target (rank 0 only)
            try:
                drafter = build_drafter(spec_config, args, plan, resolved.model_dir, cfg,
                                        cache_config, num_blocks, block_manager, max_len,
                                        weight_bytes(model_linear_weights(model)))
            except BaseException:
                if ranks is not None:
                    ranks.close()
                raise
        spec = SpecDecoder(spec_config, max_len, drafter)
        if drafter is not None and threads is not None and threads.on_change is not None:
            threads.on_change = keep_draft_plan(threads.on_change, drafter.linear_plan)
    lora = None
    if args.enable_lora:
        lora = runner.lora = LoRARegistry(
            cfg, args.max_loras, args.max_lora_rank, args.max_cpu_loras,
            lora_torch_dtype(args, plan.dtype),
            lambda name: sum(r.lora_name == name for r in scheduler.requests.values()),
            # under tensor parallelism: rank 0's shard held, every change told to the others
            shard, runner.rank_kv.tell if ranks is not None else None)
    return EngineParts(plan, threads, cfg, tokenizer, eos, max_len, scheduler_config, ranks,
                       model, cache_config, runner, inputs, kv_tier, block_manager, scheduler,
                       kv_connector, spec, lora)


def keep_draft_plan(on_change: Callable[[int], None], draft: LinearPlan | None
                    ) -> Callable[[int], None]:
    """The thread governor's ``on_change`` for an engine with a draft model: the served
    model's plans for the new thread count, then the draft's entries added back (``apply``
    replaces the process's one linear plan, and the draft's weights would fall to the
    untuned paths)."""
    def change(n: int) -> None:
        on_change(n)
        if draft is not None:
            set_linear_plan(linear_plan().merged(draft))
    return change


# "auto": the model's dtype; the CPU kernels read fp32, fp16 and int8 adapters (int8: one
# scale per rank row, docs/lora.md; bfloat16: not yet)
LORA_DTYPES = ("auto", "float32", "float16", "int8")


def lora_torch_dtype(args: EngineArgs, model_dtype: str) -> torch.dtype:
    """The dtype adapters are held in (every tensor-parallel rank alike)."""
    return getattr(torch, model_dtype if args.lora_dtype == "auto" else args.lora_dtype)


def check_lora(args: EngineArgs, cfg: ModelConfig, device_type: str, speculative: bool) -> None:
    """Refuse ``enable_lora`` where this engine would not apply adapters exactly, by name."""
    if args.max_loras < 1 or args.max_lora_rank < 1:
        raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {args.max_loras} and "
                         f"{args.max_lora_rank}")
    if args.lora_dtype not in LORA_DTYPES:
        raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got "
                         f"{args.lora_dtype!r}")
    # Tensor parallelism is served: each rank holds its shard of A and B (docs/lora.md).
    why = ("a mixture-of-experts model" if cfg.num_experts
           else "speculative decoding" if speculative
           else f"device {device_type!r} (the CPU only for now)" if device_type != "cpu"
           else None)
    if why:
        raise ValueError(f"enable_lora: LoRA adapters are not supported with {why}")
