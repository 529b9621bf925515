"""The draft model of speculative decoding's ``draft_model`` and ``self_draft`` methods, built
beside an engine's target (``engine.runtime.build``) into a ``DraftProposer``.

The draft must share the target's vocabulary (its token ids are proposed to the target as they
are): a draft whose vocabulary size differs, or whose tokenizer maps any token to another id,
is refused here, before the engine serves, naming both. It runs on rank 0 only, unsharded,
whatever the target's tensor parallelism: its pages are addressed by rank 0's block tables,
which every rank shares. Its kernels are timed for this host like the target's, and the
process-wide linear plan holds both models' shapes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.config import CacheConfig, resolve_quantization
from engine.core.block_manager import BlockManager
from engine.executor.device import DevicePlan
from engine.executor.draft import DraftProposer
from engine.executor.model_runner import ModelRunner
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.ops.linear import linear_plan, set_linear_plan
from engine.quant.layouts import check_quantization, weight_bytes
from engine.spec.config import SpeculativeConfig
from engine.text.tokenizer import load_tokenizer
from engine.tuning.linear import model_linear_weights
from engine.tuning.runner_plans import tune_runner
from engine.weights.huge_pages import move_weights_to_huge_pages
from engine.weights.loader import has_quantized_blocks, load_weights
from engine.weights.resolve import load_model_config, resolve_model


def build_drafter(spec: SpeculativeConfig, args, plan: DevicePlan, target_dir: Path,
                  target_cfg: ModelConfig, cache_config: CacheConfig, num_blocks: int,
                  blocks: BlockManager, max_len: int, target_bytes: int) -> DraftProposer:
    """The draft ``spec`` names, loaded and tuned, its pool of ``num_blocks`` pages
    (``target_bytes``: the target's linear weights' bytes, which the draft's are compared
    with). Raises ValueError for a draft that cannot propose to this target."""
    if spec.method == "self_draft":
        draft_dir, quant = target_dir, spec.draft_quantization
    else:
        draft_dir = resolve_model(spec.model, cache_dir=args.cache_dir).model_dir
        quant = spec.draft_quantization
        if quant == "auto":
            quant = resolve_quantization("auto", has_quantized_blocks(draft_dir), plan.device.type)
    cfg = load_model_config(draft_dir, dtype=plan.dtype)
    if spec.method == "draft_model":
        _check_vocabulary(spec.model, draft_dir, cfg, target_dir, target_cfg)
    check_quantization(quant, plan.device, 1, plan.dtype)
    model = LlamaForCausalLM(cfg, max_len, None)
    load_weights(model, draft_dir, quant)
    model = model.to(plan.device)
    model.place_quantized(plan.device)
    move_weights_to_huge_pages(model)
    runner = ModelRunner(model, cache_config, num_blocks, attention_backend=plan.attention_backend,
                         cuda_graphs=False, max_num_seqs=args.max_num_seqs, max_model_len=max_len)
    target_plan = linear_plan()
    tune_runner(dataclasses.replace(args, quantization=quant), plan, model, runner)
    draft_plan = linear_plan()
    set_linear_plan(target_plan.merged(draft_plan))
    ratio = weight_bytes(model_linear_weights(model)) / max(1, target_bytes)
    drafter = DraftProposer(runner, blocks, ratio)
    # kept for the thread governor, which sets the served model's plan for each thread count
    # and must add the draft's entries back (engine.runtime.build)
    drafter.linear_plan = draft_plan
    return drafter


def _check_vocabulary(name: str, draft_dir: Path, cfg: ModelConfig, target_dir: Path,
                      target_cfg: ModelConfig) -> None:
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"speculative_config: the draft model {name!r} has a vocabulary of "
                         f"{cfg.vocab_size} tokens, the served model {target_cfg.vocab_size}: "
                         "a draft must share the served model's tokenizer")
    mine, theirs = load_tokenizer(draft_dir), load_tokenizer(target_dir)
    if (mine is None) != (theirs is None):
        raise ValueError(f"speculative_config: the draft model {name!r} "
                         f"{'has no' if mine is None else 'has a'} tokenizer, the served model "
                         f"{'has' if mine is None else 'has none'}: a draft must share the "
                         "served model's tokenizer")
    if mine is not None and mine.hf_tokenizer.get_vocab() != theirs.hf_tokenizer.get_vocab():
        raise ValueError(f"speculative_config: the draft model {name!r} has another tokenizer "
                         "than the served model (their token ids differ): a draft must share "
                         "the served model's tokenizer")
