"""References for quantized engines: transformers on the dequantized weights, and the check
that generated tokens are that reference's greedy choices up to the activations' rounding."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import CacheConfig
from engine.executor.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.weights.loader import load_state_dict
from engine.weights.resolve import load_model_config
from tests.helpers.tiny_models import load_hf

# How far (a fraction of the reference row's largest |logit|) below the reference's best
# logit a generated token's may sit. Quantized weights multiplied by int8 activations (the
# ``cqint`` path and the fused step's integer products, chosen per host and batch) round each
# projection's input to 255 levels per row: near-ties may flip, nothing else may.
NEAR_GREEDY_TOL = 0.02


def quantized_runner(model_dir: Path, kind: str) -> ModelRunner:
    cfg = load_model_config(model_dir)
    model = LlamaForCausalLM(cfg)
    model.load_hf_state_dict(load_state_dict(model_dir, torch.float32))
    model.quantize(kind)
    return ModelRunner(model, CacheConfig(block_size=8), 64)


def dequantized_hf(model_dir: Path, arch: str, kind: str, out: Path):
    """transformers' model of ``model_dir`` with every linear weight replaced by what ours
    holds after quantizing (dequantized), saved to ``out``: the reference a quantized engine
    must follow."""
    ours = quantized_runner(model_dir, kind).model
    hf = load_hf(model_dir, arch)
    cfg = ours.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    with torch.no_grad():
        for layer, mine in zip(hf.model.layers, ours.layers, strict=True):
            qkv = mine.qkv.weight.dequantize()
            at, mlp = layer.self_attn, layer.mlp
            at.q_proj.weight.copy_(qkv[:q])
            at.k_proj.weight.copy_(qkv[q:q + kv])
            at.v_proj.weight.copy_(qkv[q + kv:])
            at.o_proj.weight.copy_(mine.o_proj.weight.dequantize())
            if mine.moe is not None:  # transformers stacks the experts: [E, 2I, H], [E, H, I]
                moe = mine.moe
                for e in range(len(moe.gate_up)):
                    mlp.experts.gate_up_proj[e].copy_(moe.gate_up[e].dequantize())
                    mlp.experts.down_proj[e].copy_(moe.down[e].dequantize())
                if moe.shared is not None:
                    gu, n = moe.shared["gate_up"].dequantize(), moe.shared["down"].shape[1]
                    mlp.shared_expert.gate_proj.weight.copy_(gu[:n])
                    mlp.shared_expert.up_proj.weight.copy_(gu[n:])
                    mlp.shared_expert.down_proj.weight.copy_(moe.shared["down"].dequantize())
                continue
            gate_up = mine.gate_up.weight.dequantize()
            mlp.gate_proj.weight.copy_(gate_up[:cfg.intermediate_size])
            mlp.up_proj.weight.copy_(gate_up[cfg.intermediate_size:])
            mlp.down_proj.weight.copy_(mine.down.weight.dequantize())
        if ours.lm_head is not None:
            hf.lm_head.weight.copy_(ours.lm_head.weight.dequantize())
        else:  # tied (Gemma): the quantized embedding is both the lookup and the head
            hf.model.embed_tokens.weight.copy_(ours.embed.weight.dequantize())
    hf.save_pretrained(out, safe_serialization=True)
    return hf


def near_greedy_misses(hf, prompts: list[list[int]], outputs: list[list[int]],
                       tol: float = NEAR_GREEDY_TOL) -> list[tuple[int, int, float]]:
    """Each generated token the reference ``hf`` (fed the prompt and the tokens generated
    before it) scores more than ``tol`` x its row's largest |logit| below its best token:
    ``(prompt index, position, gap as that fraction)``; empty when every token is greedy up
    to near-ties."""
    misses = []
    for i, (p, out) in enumerate(zip(prompts, outputs, strict=True)):
        with torch.no_grad():
            logits = hf(torch.tensor([p + out[:-1]])).logits[0, len(p) - 1:]
        for j, (row, tok) in enumerate(zip(logits, out, strict=True)):
            gap = float((row.max() - row[tok]) / row.abs().max())
            if gap > tol:
                misses.append((i, j, gap))
    return misses
