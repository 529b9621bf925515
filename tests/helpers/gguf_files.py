"""Tiny GGUF files written with gguf-py's own writer, in the layout llama.cpp's converter
produces (q/k rows rotary-permuted for ``llama``, ``blk.N.*`` names), with chosen tensor types:
what ``--quantization gguf`` must load as stored. The tokenizer fields are the default model's
(a GGUF's tokenizer is what transformers builds the HF tokenizer from)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 256, 4, 2, 512, 2
HEAD_DIM = HIDDEN // HEADS
FULL_VOCAB = 49152  # the default model's tokenizer, whole (write_tiny_gguf)
# Per projection: the type each layer's tensor is written in. Q4_K needs rows of 256 weights.
DEFAULT_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q4_0",
                 "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q4_K"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's rotary permutation of q/k rows (the inverse of
    ``engine.weights.gguf_convert.unpermute_rows``)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _random_blocks(qtype, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks of random weights of a moderate size: quantized from random floats where
    gguf-py can quantize the type, else random bytes with small finite fp16 scales."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    if t.name in ("F32", "F16"):
        return (rng.standard_normal((n, k)) * 0.05).astype(np.float32 if t.name == "F32"
                                                            else np.float16)
    try:
        return gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), t)
    except (NotImplementedError, gguf.quants.QuantError, KeyError, TypeError):
        pass
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    assert t.name == "Q4_K", t  # the one type here gguf-py does not quantize
    raw[..., 0:2] = np.full((n, k // block, 1), 0.0008, np.float16).view(np.uint8)  # d
    raw[..., 2:4] = np.full((n, k // block, 1), 0.0006, np.float16).view(np.uint8)  # dmin
    return raw.reshape(n, -1)


def write_tiny_gguf(path: Path, types: dict[str, str] | None = None, embed_type: str = "Q8_0",
                    seed: int = 0) -> Path:
    """A 2-layer ``llama`` GGUF (hidden 256, 4 heads over 2 KV heads, the default model's
    49152-token vocabulary and tokenizer) with each projection in ``types`` (``DEFAULT_TYPES``
    by default: Q4_K, Q4_0), the token embedding in ``embed_type``, tied to the output."""
    import gguf

    types = {**DEFAULT_TYPES, **(types or {})}
    rng = np.random.default_rng(seed)
    vocab = FULL_VOCAB
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    _add_tokenizer(w, vocab)

    def add(name: str, qtype: str, n: int, k: int, permute_heads: int | None = None) -> None:
        if permute_heads is not None:  # permuting whole rows keeps each row's blocks whole
            data = _random_blocks(qtype, n, k, rng)
            data = _permute(data.reshape(n, -1), permute_heads)
        else:
            data = _random_blocks(qtype, n, k, rng)
        t = gguf.GGMLQuantizationType[qtype]
        if t.name in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=(n, data.shape[-1]), raw_dtype=t)

    add("token_embd.weight", embed_type, vocab, HIDDEN)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
              "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
              "ffn_down": (HIDDEN, INTERMEDIATE)}
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight",
                         (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for proj, (n, k) in shapes.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(proj)
            add(f"blk.{i}.{proj}.weight", types[proj], n, k, heads)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# What llama.cpp's converter writes per HF tensor, for the families converted from a tiny HF
# checkpoint below: GGUF name by HF layer name.
_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               # Mixture-of-Experts routers, Qwen2-MoE's shared expert, Phi-3's fused tensors
               "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp",
               "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_HF_TO_GGUF_GEMMA = {**_HF_TO_GGUF, "post_attention_layernorm": "attn_post_norm",
                     "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm"}
# HF model_type -> GGUF architecture (Mixtral's GGUFs say llama, with an expert count).
_ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "mixtral": "llama",
         "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "phi3": "phi3"}
# Each expert's HF names -> the stacked tensor llama.cpp writes ([experts, rows, cols]).
_EXPERTS = {"mixtral": ("block_sparse_moe.experts", {"w1": "ffn_gate_exps", "w3": "ffn_up_exps",
                                                     "w2": "ffn_down_exps"}),
            "qwen2_moe": ("mlp.experts", {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                                          "down_proj": "ffn_down_exps"})}
_EXPERTS["qwen3_moe"] = _EXPERTS["qwen2_moe"]


def _add_tokenizer(w, vocab: int) -> None:
    """The default model's tokenizer fields cut to its first ``vocab`` tokens (its special
    tokens and byte alphabet come first) and the merges among them: a consistent byte-level
    BPE tokenizer the size of a tiny model's vocabulary. The full one's 49k tokens and merges
    took ~20 s to parse per conversion (ours and transformers')."""
    for key, value, kind, sub in _tokenizer_fields(vocab):
        w.add_key_value(key, value, kind, sub)


@functools.cache
def _tokenizer_fields(vocab: int) -> tuple:
    import gguf

    from engine.weights.resolve import default_gguf_path

    src = gguf.GGUFReader(str(default_gguf_path()))  # ~7 s: read once per process
    tokens = src.fields["tokenizer.ggml.tokens"].contents()[:vocab]
    kept = set(tokens)
    out = []
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:vocab]
        elif key == "tokenizer.ggml.merges":
            value = [m for m in value
                     if m.replace(" ", "") in kept and all(p in kept for p in m.split(" "))]
        elif key.endswith("_token_id") and int(value) >= vocab:
            continue
        out.append((key, value, field.types[0], field.types[1] if len(field.types) > 1 else None))
    return tuple(out)


def write_gguf_from_hf(hf_dir: Path, path: Path, proj_type: str = "F32") -> Path:
    """``hf_dir``'s Qwen3 / Gemma 2 / Gemma 3 / Mixtral / Qwen2-MoE / Qwen3-MoE / Phi-3
    checkpoint as llama.cpp's converter writes it: its GGUF names and metadata, Mixtral's q/k
    rows rotary-permuted, experts stacked per projection, Gemma's norm weights stored as
    1 + w, Phi-3's LongRoPE factors as tensors, the projections (experts too) in
    ``proj_type`` (F32: the same numbers), everything else F32; the default model's
    tokenizer cut to the checkpoint's vocabulary (``_add_tokenizer``)."""
    import json

    import gguf
    import torch
    from safetensors.torch import load_file


    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = _ARCH[model_type]
    gemma = arch.startswith("gemma")
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if not gemma:
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if model_type in _EXPERTS:
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if model_type != "mixtral":
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
        if cfg.get("sliding_window"):
            w.add_sliding_window(cfg["sliding_window"])
        if rope.get("rope_type") == "longrope":  # llama.cpp's converter computes the factor
            import math

            original = cfg["original_max_position_embeddings"]
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_orig_ctx_len(original)
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    if gemma:
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3":
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    _add_tokenizer(w, cfg["vocab_size"])

    def add(name: str, t, quantize: bool) -> None:
        a = t.float().numpy()
        if gemma and name.endswith("norm.weight"):
            a = a + 1.0
        qtype = gguf.GGMLQuantizationType[proj_type if quantize else "F32"]
        if qtype.name == "F32":
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    state = load_file(str(hf_dir / "model.safetensors"))
    names = _HF_TO_GGUF_GEMMA if gemma else _HF_TO_GGUF
    add("token_embd.weight", state["model.embed_tokens.weight"], True)
    add("output_norm.weight", state["model.norm.weight"], False)
    if "lm_head.weight" in state and not cfg.get("tie_word_embeddings"):
        add("output.weight", state["lm_head.weight"], True)
    if rope.get("rope_type") == "longrope":
        add("rope_factors_long.weight", torch.tensor(rope["long_factor"]), False)
        add("rope_factors_short.weight", torch.tensor(rope["short_factor"]), False)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, g_name in names.items():
            for kind in ("weight", "bias"):
                t = state.get(f"model.layers.{i}.{hf_name}.{kind}")
                if t is None:
                    continue
                if arch == "llama" and g_name in heads:  # only Llama's rows are permuted
                    t = torch.from_numpy(_permute(t.numpy(), heads[g_name]).copy())
                if g_name == "ffn_gate_inp_shexp":
                    t = t.reshape(-1)  # llama.cpp keeps this gate as a vector
                router = g_name.startswith("ffn_gate_inp")
                add(f"blk.{i}.{g_name}.{kind}", t,
                    kind == "weight" and not hf_name.endswith("norm") and not router)
        if model_type in _EXPERTS:
            prefix, stacked = _EXPERTS[model_type]
            n = cfg.get("num_experts") or cfg["num_local_experts"]
            for hf_name, g_name in stacked.items():
                add(f"blk.{i}.{g_name}.weight", torch.stack([
                    state[f"model.layers.{i}.{prefix}.{j}.{hf_name}.weight"] for j in range(n)]),
                    True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
