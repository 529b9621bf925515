"""Tiny GGUF files written with gguf-py's own writer, in the layout llama.cpp's converter
produces (q/k rows rotary-permuted for ``llama``, ``blk.N.*`` names), with chosen tensor types:
what ``--quantization gguf`` must load as stored. The tokenizer fields are the default model's
(a GGUF's tokenizer is what transformers builds the HF tokenizer from)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 256, 4, 2, 512, 2
HEAD_DIM = HIDDEN // HEADS
# Per projection: the type each layer's tensor is written in. Q4_K needs rows of 256 weights.
DEFAULT_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q4_0",
                 "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q4_K"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's rotary permutation of q/k rows (the inverse of
    ``engine.weights._unpermute_rows``)."""
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

    from engine.weights import default_gguf_path

    types = {**DEFAULT_TYPES, **(types or {})}
    rng = np.random.default_rng(seed)
    src = gguf.GGUFReader(str(default_gguf_path()))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
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
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)

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
# checkpoint below: GGUF name by HF layer name (no rotary permutation: only Llama has one).
_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm"}
_HF_TO_GGUF_GEMMA = {**_HF_TO_GGUF, "post_attention_layernorm": "attn_post_norm",
                     "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf_from_hf(hf_dir: Path, path: Path, proj_type: str = "F32") -> Path:
    """``hf_dir``'s Qwen3 / Gemma 2 / Gemma 3 checkpoint as llama.cpp's converter writes it:
    its GGUF names and metadata, Gemma's norm weights stored as 1 + w, the projections in
    ``proj_type`` (F32: the same numbers), everything else F32; the default model's tokenizer
    fields (the tiny vocabulary's ids are a prefix of its)."""
    import json

    import gguf
    from safetensors.torch import load_file

    from engine.weights import default_gguf_path

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3"}[cfg["model_type"]]
    gemma = arch.startswith("gemma")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    if arch == "qwen3":
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
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
    src = gguf.GGUFReader(str(default_gguf_path()))
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)

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
    names = _HF_TO_GGUF_GEMMA if gemma else {**_HF_TO_GGUF,
                                              "post_attention_layernorm": "ffn_norm"}
    add("token_embd.weight", state["model.embed_tokens.weight"], True)
    add("output_norm.weight", state["model.norm.weight"], False)
    if "lm_head.weight" in state and not cfg.get("tie_word_embeddings"):
        add("output.weight", state["lm_head.weight"], True)
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, g_name in names.items():
            t = state.get(f"model.layers.{i}.{hf_name}.weight")
            if t is not None:
                add(f"blk.{i}.{g_name}.weight", t, not hf_name.endswith("norm"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
