"""GGUF -> Hugging Face directory: undo llama.cpp's converter, family by family.

``convert_gguf(path, out_dir)`` writes ``config.json``, the tokenizer, ``model.safetensors``
(every tensor dequantized to fp32, under HF names) and ``quantized.safetensors`` (the
projections whose GGUF type maps onto an ``engine.quant.layouts`` layout, as stored:
``engine.quant.gguf``), so everything downstream sees one format. ``engine.weights.resolve`` owns
when it runs (once per file, into a cache), ``engine.weights.loader`` reading the result back.

What llama.cpp's converter changes, and so what is undone here:

- Llama-family q/k rows are rotary-permuted per head (Llama, Mixtral: GGUF architecture
  ``llama``); no other family's are.
- Gemma's norm weights are stored as 1 + w (llama.cpp multiplies); its window pattern and
  attention scale are fixed by family, not stored.
- Mixture-of-Experts experts are stacked into one ``[experts, rows, cols]`` tensor per
  projection (``ffn_{gate,up,down}_exps``); HF checkpoints keep one tensor per expert. The
  router is ``ffn_gate_inp``; Qwen2-MoE's shared expert is ``ffn_*_shexp`` and its gate
  ``ffn_gate_inp_shexp`` (stored as a vector: HF's is ``[1, hidden]``). Whether the top-k
  weights are renormalised is fixed per family by llama.cpp (Mixtral, Qwen3-MoE: yes;
  Qwen2-MoE: no) unless the file says ``expert_weights_norm``.
- Phi-3 keeps HF's fused ``qkv_proj`` (``attn_qkv``) and ``[gate | up]`` (``ffn_up``);
  LongRoPE's factors are the tensors ``rope_factors_{long,short}``.

Nothing here reads the environment or downloads anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.quant.layouts import QuantizedWeight

# engine.weights.converted.CONVERTER_VERSION: bump it with any change to what this writes.
from engine.weights.converted import QUANTIZED_FILE

# GGUF tensor names (``blk.N.<name>``) -> the HF layer's.
_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma: the norm before the MLP is ffn_norm, and two more norm the attention's and the MLP's
# outputs.
_GEMMA = {**_ATTENTION, **_MLP, "ffn_norm": "pre_feedforward_layernorm",
          "attn_post_norm": "post_attention_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm"}
_QWEN_MOE_ROUTER = {"ffn_gate_inp": "mlp.gate"}
_QWEN2_SHARED_EXPERT = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                        "ffn_up_shexp": "mlp.shared_expert.up_proj",
                        "ffn_down_shexp": "mlp.shared_expert.down_proj",
                        "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_PHI3 = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
         "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
# The stacked expert tensors, in the order of a family's (gate, up, down) HF names.
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# Routers stay in the model dtype (tiny, and they choose the experts): never kept quantized.
_ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")


@dataclass(frozen=True)
class _Family:
    """How one family's GGUF maps back onto its HF checkpoint."""

    hf_arch: str
    model_type: str
    layer: dict[str, str]
    permute_qk: bool = False  # llama.cpp permutes q/k rows (Llama-family only)
    gemma: bool = False  # norms stored as 1 + w
    # Mixture-of-Experts: the HF prefix of a layer's experts, their (gate, up, down) names, and
    # whether llama.cpp renormalises the top-k weights for this family.
    experts: str | None = None
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    renormalize: bool = False
    config: dict[str, Any] = field(default_factory=dict)  # fixed config.json fields


_FAMILIES = {
    "llama": _Family("LlamaForCausalLM", "llama", {**_ATTENTION, **_MLP}, permute_qk=True),
    # Mixtral's GGUFs say ``llama`` and carry an expert count (``_family``).
    "mixtral": _Family("MixtralForCausalLM", "mixtral",
                       {**_ATTENTION, "ffn_gate_inp": "block_sparse_moe.gate"}, permute_qk=True,
                       experts="block_sparse_moe.experts", expert_names=("w1", "w3", "w2"),
                       renormalize=True),
    "qwen2": _Family("Qwen2ForCausalLM", "qwen2", {**_ATTENTION, **_MLP},
                     config={"use_sliding_window": False}),
    "qwen3": _Family("Qwen3ForCausalLM", "qwen3", {**_ATTENTION, **_MLP, **_QK_NORMS},
                     config={"use_sliding_window": False}),
    "qwen2moe": _Family("Qwen2MoeForCausalLM", "qwen2_moe",
                        {**_ATTENTION, **_QWEN_MOE_ROUTER, **_QWEN2_SHARED_EXPERT},
                        experts="mlp.experts", renormalize=False,
                        config={"use_sliding_window": False, "decoder_sparse_step": 1,
                                "mlp_only_layers": []}),
    "qwen3moe": _Family("Qwen3MoeForCausalLM", "qwen3_moe",
                        {**_ATTENTION, **_QK_NORMS, **_QWEN_MOE_ROUTER},
                        experts="mlp.experts", renormalize=True,
                        config={"use_sliding_window": False, "decoder_sparse_step": 1,
                                "mlp_only_layers": []}),
    "phi3": _Family("Phi3ForCausalLM", "phi3", _PHI3),
    "gemma2": _Family("Gemma2ForCausalLM", "gemma2", _GEMMA, gemma=True),
    "gemma3": _Family("Gemma3ForCausalLM", "gemma3_text", {**_GEMMA, **_QK_NORMS}, gemma=True),
}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3",
                                "gemma2", "gemma3")
# llama.cpp's Gemma models are 27B at these depths: it then scales attention by
# 1/sqrt(hidden / heads) (the checkpoints' query_pre_attn_scalar), else by 1/sqrt(head_dim),
# and a GGUF stores neither; the conversion follows llama.cpp.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata field's value, or ``default`` when the file does not have it."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _required(reader: Any, key: str, name: str) -> Any:
    value = field_value(reader, key)
    if value is None:
        raise ValueError(f"{name} has no {key!r} field")
    return value


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's rotary permutation of q_proj/k_proj rows.

    llama.cpp stores each head's rows interleaved (reshape(n_head, 2, d/2).swapaxes(1, 2));
    HF keeps the two rotary halves contiguous. ``w``: [n_head * head_dim, in] or [n_head * head_dim].
    """
    head_dim = w.shape[0] // n_head
    return (w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _family(reader: Any, arch: str, name: str) -> _Family:
    """The file's family; raises ValueError naming the supported ones."""
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {name}; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (llama with experts: "
                         "Mixtral)")
    experts = int(field_value(reader, f"{arch}.expert_count", 0) or 0)
    family = _FAMILIES["mixtral" if arch == "llama" and experts else arch]
    if bool(experts) != (family.experts is not None):
        raise ValueError(f"{name}: GGUF architecture {arch!r} with {arch}.expert_count="
                         f"{experts} is not a layout this conversion knows")
    if experts:
        gating = field_value(reader, f"{arch}.expert_gating_func", _SOFTMAX_GATING)
        scale = float(field_value(reader, f"{arch}.expert_weights_scale", 1.0) or 1.0)
        if int(gating) != _SOFTMAX_GATING or scale != 1.0:
            raise ValueError(f"{name}: expert routing other than softmax over the router with "
                             f"unscaled weights ({arch}.expert_gating_func={gating}, "
                             f"{arch}.expert_weights_scale={scale}) is not supported")
    return family


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face-style model directory for ``gguf_path`` into ``out_dir`` (module
    docstring). Raises ValueError for architectures other than
    ``SUPPORTED_GGUF_ARCHITECTURES`` (and Mixtral), scaled RoPE tables other than Phi-3's, and
    a file missing a tensor its family needs."""
    import gguf
    from safetensors.torch import save_file

    from engine.quant.gguf import from_gguf, permute_rows

    reader = gguf.GGUFReader(str(gguf_path))
    arch = field_value(reader, "general.architecture")
    family = _family(reader, arch, gguf_path.name)
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{gguf_path.name} uses scaled RoPE (rope_freqs.weight); not supported")

    n_head = int(_required(reader, f"{arch}.attention.head_count", gguf_path.name))
    n_kv_head = int(field_value(reader, f"{arch}.attention.head_count_kv", n_head))
    n_layer = int(_required(reader, f"{arch}.block_count", gguf_path.name))
    hidden = int(_required(reader, f"{arch}.embedding_length", gguf_path.name))
    tokens = field_value(reader, "tokenizer.ggml.tokens") or []
    # The embedding's rows are the model's vocabulary (Gemma 3's GGUFs drop the checkpoint's
    # unused rows; the tokenizer may name more tokens than a model has rows).
    vocab_size = int(tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in tensors \
        else int(field_value(reader, f"{arch}.vocab_size", len(tokens)))
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", hidden // n_head))

    quantized: dict[str, QuantizedWeight] = {}

    def shape_of(name: str) -> tuple[int, ...]:
        # GGUF lists dims fastest-first; numpy/torch want them reversed ([out, in]).
        return tuple(reversed(tensors[name].shape.tolist()))

    def keep_quantized(data: np.ndarray, qtype: Any, shape: tuple[int, ...], hf_name: str,
                       rows_perm_heads: int | None = None) -> None:
        """The blocks in an ``engine.quant.layouts`` layout, when their type maps onto one."""
        if len(shape) != 2:
            return
        q = from_gguf(data, qtype, shape)
        if q is None:
            return
        if rows_perm_heads is not None:
            perm = unpermute_rows(np.arange(q.shape[0]), rows_perm_heads)
            q = permute_rows(q, torch.from_numpy(np.ascontiguousarray(perm)))
        quantized[hf_name] = q

    def tensor(name: str) -> torch.Tensor:
        t = tensors[name]
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape_of(name))
        # F32 tensors are read-only views of the memory-mapped file; torch needs owned memory.
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    def norm(name: str) -> torch.Tensor:
        """A norm weight in HF's convention (Gemma's GGUFs store 1 + w: llama.cpp multiplies)."""
        w = tensor(name)
        return w - 1.0 if family.gemma else w

    def need(name: str) -> None:
        if name not in tensors:
            raise ValueError(f"{gguf_path.name} is missing tensor {name!r}")

    state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": tensor("token_embd.weight"),
                                      "model.norm.weight": norm("output_norm.weight")}
    embd = tensors["token_embd.weight"]
    keep_quantized(embd.data, embd.tensor_type, shape_of(embd.name), "model.embed_tokens.weight")
    tied = "output.weight" not in tensors
    if not tied:
        state["lm_head.weight"] = tensor("output.weight")
        out = tensors["output.weight"]
        keep_quantized(out.data, out.tensor_type, shape_of(out.name), "lm_head.weight")
    names = dict(family.layer)
    if family is _FAMILIES["phi3"] and "blk.0.attn_qkv.weight" not in tensors:
        # llama.cpp also reads Phi-3 GGUFs whose q, k and v are separate tensors
        del names["attn_qkv"]
        names.update({k: v for k, v in _ATTENTION.items() if k.startswith("attn_")})
    for i in range(n_layer):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                name = f"blk.{i}.{src}.{kind}"
                if name not in tensors:
                    if kind == "weight":
                        need(name)
                    continue
                w = norm(name) if src.endswith("norm") else tensor(name)
                heads = None
                if family.permute_qk and src in ("attn_q", "attn_k"):
                    heads = n_head if src == "attn_q" else n_kv_head
                    w = torch.from_numpy(unpermute_rows(w.numpy(), heads).copy())
                if src == "ffn_gate_inp_shexp":
                    w = w.reshape(1, -1)  # a vector in the GGUF, [1, hidden] in HF's
                hf_name = f"model.layers.{i}.{dst}.{kind}"
                state[hf_name] = w
                if kind == "weight" and not src.endswith("norm") and src not in _ROUTERS:
                    t = tensors[name]
                    keep_quantized(t.data, t.tensor_type, shape_of(name), hf_name, heads)
        if family.experts is not None:
            for src, dst in zip(_EXPERT_TENSORS, family.expert_names, strict=True):
                name = f"blk.{i}.{src}.weight"
                need(name)
                stacked, t = tensor(name), tensors[name]  # [experts, rows, cols]
                for j in range(stacked.shape[0]):
                    hf_name = f"model.layers.{i}.{family.experts}.{j}.{dst}.weight"
                    state[hf_name] = stacked[j].clone()  # its own storage: saved alone
                    keep_quantized(t.data[j], t.tensor_type, tuple(stacked.shape[1:]), hf_name)
                del stacked
    out_dir.mkdir(parents=True, exist_ok=True)

    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    pad = field_value(reader, "tokenizer.ggml.padding_token_id")
    config = {
        "architectures": [family.hf_arch],
        "model_type": family.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(field_value(reader, f"{arch}.feed_forward_length", 0)),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": head_dim,
        "max_position_embeddings": int(field_value(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon",
                                          1e-5)),
        "rope_theta": float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        # stated even when absent: some families' config classes default to an id past the
        # embedding's rows (Phi-3: 32000), which transformers then refuses to load
        "pad_token_id": None if pad is None or int(pad) >= vocab_size else int(pad),
        "torch_dtype": "float32",
        "gguf_source": gguf_path.name,
        **family.config,
    }
    if family.experts is not None:
        config.update(_experts_config(reader, arch, family, config))
    if family is _FAMILIES["phi3"]:
        config.update(_phi3_config(reader, arch, tensors, tensor, head_dim))
    if family.gemma:
        config.update(_gemma_config(reader, arch, config))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    _write_tokenizer(gguf_path, out_dir, field_value(reader, "tokenizer.chat_template"))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    _save_quantized(quantized, out_dir / QUANTIZED_FILE)


def _experts_config(reader: Any, arch: str, family: _Family,
                    config: dict[str, Any]) -> dict[str, Any]:
    """A MoE GGUF's ``config.json`` fields, under its family's HF names."""
    name = config["gguf_source"]
    count = int(_required(reader, f"{arch}.expert_count", name))
    used = int(_required(reader, f"{arch}.expert_used_count", name))
    per_expert = int(field_value(reader, f"{arch}.expert_feed_forward_length", 0)
                     or config["intermediate_size"])
    if family.model_type == "mixtral":  # always renormalised (engine.models.config)
        return {"num_local_experts": count, "num_experts_per_tok": used,
                "intermediate_size": per_expert}
    out = {"num_experts": count, "num_experts_per_tok": used,
           "moe_intermediate_size": per_expert,
           "intermediate_size": config["intermediate_size"] or per_expert,
           "norm_topk_prob": bool(field_value(reader, f"{arch}.expert_weights_norm",
                                              family.renormalize))}
    shared = int(field_value(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0)
    if family.model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = shared or config["intermediate_size"]
    return out


def _phi3_config(reader: Any, arch: str, tensors: dict[str, Any], tensor: Any,
                 head_dim: int) -> dict[str, Any]:
    """A Phi-3 GGUF's window, partial rotation and LongRoPE (its factor tensors and original
    context) as ``config.json`` fields. llama.cpp itself ignores Phi-3's window today; HF's
    model (the checkpoint's own) applies it, and so does this engine."""
    window = int(field_value(reader, f"{arch}.attention.sliding_window", 0) or 0)
    out: dict[str, Any] = {"sliding_window": window or None}
    rotary = int(field_value(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:  # engine.models.config refuses it by name
        out["partial_rotary_factor"] = rotary / head_dim
    if "rope_factors_long.weight" in tensors:
        original = int(_required(reader, f"{arch}.rope.scaling.original_context_length",
                                 "a Phi-3 GGUF with LongRoPE factors"))
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": tensor("rope_factors_long.weight").tolist(),
            "short_factor": tensor("rope_factors_short.weight").tolist()}
        attention = field_value(reader, f"{arch}.rope.scaling.attn_factor")
        if attention is not None:
            scaling["attention_factor"] = float(attention)
        out.update(rope_scaling=scaling, original_max_position_embeddings=original)
    return out


def _gemma_config(reader: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """A Gemma GGUF's ``config.json`` fields: what the file stores (window, soft-caps, Gemma 3's
    RoPE base and linear scaling) and what llama.cpp fixes by family (the window pattern,
    Gemma 3's sliding layers' RoPE base of 10000, the attention scale)."""
    n, hidden, heads = (config["num_hidden_layers"], config["hidden_size"],
                        config["num_attention_heads"])
    scalar = hidden // heads if n == _GEMMA_27B_LAYERS[arch] else config["head_dim"]
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon",
                                          1e-6)),
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(field_value(reader, f"{arch}.attention.sliding_window", 4096)),
        "attn_logit_softcapping": field_value(reader, f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": field_value(reader, f"{arch}.final_logit_softcapping"),
    }
    pattern = 2 if arch == "gemma2" else 6
    out["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                          for i in range(n)]
    if arch == "gemma3":
        out["rope_theta"] = float(field_value(reader, f"{arch}.rope.freq_base", 1_000_000.0))
        out["rope_local_base_freq"] = 10_000.0
        kind = field_value(reader, f"{arch}.rope.scaling.type")
        if kind not in (None, "none", "linear"):
            raise ValueError(f"unsupported rope scaling {kind!r} in a gemma3 GGUF")
        if kind == "linear":
            out["rope_scaling"] = {
                "rope_type": "linear",
                "factor": float(field_value(reader, f"{arch}.rope.scaling.factor"))}
    return out


def _save_quantized(quantized: dict[str, QuantizedWeight], path: Path) -> None:
    """``{name}.qdata`` / ``.qscale`` / ``.qoffset`` per weight; each one's layout (kind,
    group) in the file's metadata under its name (``engine.weights.loader.load_quantized_state_dict``
    reads it)."""
    from safetensors.torch import save_file

    tensors, layouts = {}, {}
    for name, q in quantized.items():
        tensors[name + ".qdata"] = q.data.contiguous()
        tensors[name + ".qscale"] = q.scale.contiguous()
        if q.offset is not None:
            tensors[name + ".qoffset"] = q.offset.contiguous()
        layouts[name] = {"kind": q.kind, "group": q.group}
    save_file(tensors, str(path), metadata={"format": "pdcluster-quant",
                                            "layouts": json.dumps(layouts)})


def _write_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    """Build the fast tokenizer from the GGUF's vocab/merges via transformers and save it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
    # transformers 5 writes the template to chat_template.jinja only; keep it in
    # tokenizer_config.json too, where other tools (and older transformers) look for it.
    if chat_template:
        cfg_path = out_dir / "tokenizer_config.json"
        with cfg_path.open() as f:
            tok_cfg = json.load(f)
        tok_cfg["chat_template"] = chat_template
        _write_json(cfg_path, tok_cfg)


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
