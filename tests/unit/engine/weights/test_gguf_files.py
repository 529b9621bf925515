"""GGUF files of every block type ``--quantization gguf`` serves (Q4_K, Q4_0, Q8_0, and F16
beside them), written with gguf-py's own writer in llama.cpp's layout
(``tests/helpers/gguf_files.py``): converted, loaded as stored (rotary rows un-permuted, q/k/v
and gate/up fused), and computing what transformers computes with the same weights."""

from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.executor.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM, QLinear
from engine.quant.layouts import QuantizedWeight
from engine.weights.loader import load_quantized_state_dict, load_weights
from engine.weights.resolve import load_model_config, resolve_model
from tests.helpers.gguf_files import HIDDEN, INTERMEDIATE, write_tiny_gguf


def _convert(tmp_path, **kw):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", **kw)
    return resolve_model(path, cache_dir=tmp_path / "cache")


def _reference(model_dir, ours: LlamaForCausalLM):
    """transformers' model of the converted directory with every weight ours holds copied in
    (dequantized): the same weights, so the same logits (Q4_K's fp16-rounded scales differ
    from the fp32 conversion's exact products by up to 2^-11 of a weight)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).eval()
    cfg = ours.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def fp(w):
        return w.dequantize() if isinstance(w, QuantizedWeight) else w

    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(fp(ours.embed.weight))
        hf.model.norm.weight.copy_(ours.norm)
        for layer, mine in zip(hf.model.layers, ours.layers, strict=True):
            qkv, gate_up = fp(mine.qkv.weight), fp(mine.gate_up.weight)
            layer.self_attn.q_proj.weight.copy_(qkv[:q])
            layer.self_attn.k_proj.weight.copy_(qkv[q:q + kv])
            layer.self_attn.v_proj.weight.copy_(qkv[q + kv:])
            layer.self_attn.o_proj.weight.copy_(fp(mine.o_proj.weight))
            layer.mlp.gate_proj.weight.copy_(gate_up[:INTERMEDIATE])
            layer.mlp.up_proj.weight.copy_(gate_up[INTERMEDIATE:])
            layer.mlp.down_proj.weight.copy_(fp(mine.down.weight))
            layer.input_layernorm.weight.copy_(mine.input_norm)
            layer.post_attention_layernorm.weight.copy_(mine.post_norm)
    hf.tie_weights()
    return hf


def _load(resolved):
    cfg = load_model_config(resolved.model_dir, model_id=resolved.model_id)
    model = LlamaForCausalLM(cfg)
    load_weights(model, resolved.model_dir, "gguf")
    return model


def test_q4_k_q4_0_and_q8_0_blocks_load_as_stored_and_compute_transformers_logits(tmp_path):
    resolved = _convert(tmp_path)
    quantized = load_quantized_state_dict(resolved.model_dir)
    p = "model.layers.1."
    assert quantized["model.embed_tokens.weight"].kind == "int8"  # Q8_0
    assert {quantized[p + n].kind for n in ("self_attn.q_proj.weight", "mlp.down_proj.weight",
                                            "self_attn.o_proj.weight")} == {"int4"}
    model = _load(resolved)
    assert model.quantization == "int4+int8" and model._projection_layout() == (2, 32)
    assert all(isinstance(getattr(lay, n), QLinear) for lay in model.layers
               for n in ("qkv", "o_proj", "gate_up", "down"))
    # Q4_0 is exact, so its weights equal the fp32 conversion's; Q4_K within its fp16 scales.
    from engine.weights.loader import load_state_dict

    fp = load_state_dict(resolved.model_dir, torch.float32)
    assert torch.equal(model.layers[1].o_proj.weight.dequantize(), fp[p + "self_attn.o_proj.weight"])
    q_rows = model.layers[1].qkv.weight.dequantize()[:HIDDEN]  # un-permuted like the fp32 copy
    ref_q = fp[p + "self_attn.q_proj.weight"]
    assert (q_rows - ref_q).abs().max() <= 2 ** -10 * ref_q.abs().max()
    hf = _reference(resolved.model_dir, model)
    runner = ModelRunner(model, CacheConfig(block_size=8), 32)
    gen = torch.Generator().manual_seed(0)
    for length in (3, 29):
        ids = torch.randint(3, 1000, (length,), generator=gen).tolist()
        ours = runner.compute_logits_for_prompt(ids, list(range((length + 7) // 8)))
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max() / ref.abs().max() < 1e-4


def test_a_fused_weight_whose_parts_differ_in_type_is_served_in_fp(tmp_path):
    """attn_v in F16 beside Q4_K q/k (as Q4_K_M files mix types): QKV is dequantized (exact),
    the other projections stay quantized, and the decode step runs layer by layer. The
    embedding in Q4_0 (tied: the LM head reads it in that layout too)."""
    resolved = _convert(tmp_path, types={"attn_v": "F16"}, embed_type="Q4_0")
    model = _load(resolved)
    assert isinstance(model.embed.weight, QuantizedWeight) and model.embed.weight.kind == "int4"
    assert all(not isinstance(lay.qkv.weight, QuantizedWeight) for lay in model.layers)
    assert all(isinstance(lay.down.weight, QuantizedWeight) for lay in model.layers)
    assert model._projection_layout() is None
    hf = _reference(resolved.model_dir, model)
    runner = ModelRunner(model, CacheConfig(block_size=8), 32)
    ids = list(range(5, 30))
    ours = runner.compute_logits_for_prompt(ids, [0, 1, 2, 3])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-4
