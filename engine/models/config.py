"""A model's shape (``ModelConfig``), read from a Hugging Face ``config.json``.

Frozen and validated: ``__post_init__`` and ``ModelConfig.from_hf_config`` raise ``ValueError``
naming the bad field, or the architecture, RoPE scaling or layout this engine does not serve,
so a misconfiguration fails at start-up, not in the middle of a step. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.config import DTYPE_BYTES, kv_row_bytes

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe",
                           "qwen3_moe", "gemma2", "gemma3")
GEMMA = ("gemma2", "gemma3")  # the families with Gemma's layer (see ModelConfig's Gemma fields)

# HF `architectures[0]` / `model_type` -> our family name.
_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # Gemma 3 4B-27B ship as image+text models: their language model is served (text only;
    # the OpenAI API refuses image content parts), the vision tower is never read.
    "Gemma3ForConditionalGeneration": "gemma3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mistral": "mistral",
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; ``None`` means plain RoPE. ``kind``: ``"llama3"`` (Llama 3.x:
    low frequencies divided by ``factor``, a smooth ramp between), ``"linear"`` (every
    frequency divided by ``factor``: Gemma 3's global layers) or ``"longrope"`` (Phi-3
    128k / Phi-3.5: each frequency divided by its ``short_factor``, or by its ``long_factor``
    for a sequence longer than ``original_max_position_embeddings``; cos and sin times
    ``attention_factor``)."""

    factor: float
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0
    kind: str = "llama3"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. ``model_id`` names the weights (used by the KV handshake)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE
    # Mixture of experts (Mixtral, Qwen3-MoE): every layer's feed-forward is num_experts
    # SwiGLU experts of intermediate_size, top num_experts_per_tok per token; 0: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True  # renormalize the chosen experts' weights to sum to 1
    # Qwen2-MoE: one more SwiGLU expert every token goes through, scaled by a sigmoid gate.
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: a layer with a window of W attends to its last W keys (the
    # query's own included). ``layer_types`` names each layer "sliding_attention" or
    # "full_attention"; empty: every layer is windowed when ``sliding_window`` is set.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Gemma 2/3 (``GEMMA``): GeGLU (tanh GELU on the gate), norms after attention and after
    # the MLP as well as before them, embeddings scaled by sqrt(hidden), the attention
    # scale ``query_pre_attn_scalar ** -0.5``, tanh soft-capping of attention scores and of
    # the final logits (Gemma 2), and a separate RoPE base for the sliding layers (Gemma 3).
    # Their RMSNorm weights are stored as w and applied as (1 + w): the loader adds the 1.
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    sandwich_norms: bool = False
    embed_scale: bool = False
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope_theta: float | None = None  # the sliding layers' RoPE base; None: rope_theta
    dtype: str = "float32"
    model_id: str = "unnamed"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has "
                             f"{self.num_layers}")
        bad = set(self.layer_types) - {"sliding_attention", "full_attention"}
        if bad:
            raise ValueError(f"unsupported layer_types {sorted(bad)}; supported: "
                             "sliding_attention, full_attention")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {self.sliding_window}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: silu, "
                             "gelu_pytorch_tanh")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"1..num_experts ({self.num_experts})")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for one token over all layers: 2 * layers * kv_heads * head_dim * dtype_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def kv_cache_bytes_per_token(self, kv_cache_dtype: str) -> int:
        """K and V for one token over all layers as a pool of ``kv_cache_dtype`` stores them
        (an int8 row holds its scale: ``engine.config.kv_row_bytes``)."""
        return (2 * self.num_layers * self.num_kv_heads
                * kv_row_bytes(self.head_dim, self.dtype, kv_cache_dtype))

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) we serve: the model's context. Sliding layers
        attend to their window beyond it (every attention path honours ``layer_window``)."""
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """How many keys layer ``layer`` attends to (its query's own included); None: all."""
        if not self.sliding_window:
            return None
        if self.layer_types and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """``layer_window`` of every layer."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, dtype: str = "float32",
                       model_id: str = "unnamed") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict; unknown architectures and missing
        fields raise ValueError."""
        try:
            return cls._from_hf_config(_language_model(cfg), dtype, model_id)
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None

    @classmethod
    def _from_hf_config(cls, cfg: dict[str, Any], dtype: str, model_id: str) -> ModelConfig:
        archs = cfg.get("architectures") or []
        key = archs[0] if archs else cfg.get("model_type", "")
        arch = _HF_ARCH.get(key) or _HF_ARCH.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {key!r} (model_type={cfg.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        quant = cfg.get("quantization_config")
        if quant:
            # Its tensors are packed (AWQ / GPTQ) or in another dtype (FP8) under the same
            # names: refused by name rather than loaded wrong.
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise ValueError(f"quantized checkpoints are not supported yet (quantization_config "
                             f"quant_method={method!r}); use the unquantized weights")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        experts = _experts(arch, cfg)
        rope_theta, rope_scaling, local_rope_theta = _rope(arch, cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=experts.get("intermediate_size", cfg["intermediate_size"]),
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            local_rope_theta=local_rope_theta,
            # Qwen2-MoE names it qkv_bias (and writes attention_bias: null)
            attention_bias=bool(cfg["attention_bias"] if cfg.get("attention_bias") is not None
                                else cfg.get("qkv_bias", arch in ("qwen2", "qwen2_moe"))),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
            num_experts=experts.get("num_experts", 0),
            num_experts_per_tok=experts.get("num_experts_per_tok", 0),
            norm_topk_prob=experts.get("norm_topk_prob", True),
            shared_expert_intermediate_size=experts.get("shared_expert_intermediate_size", 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_windows(arch, cfg),
            **_gemma(arch, cfg, head_dim),
            dtype=dtype,
            model_id=model_id,
        )


# Gemma's config classes' defaults: older config.json files leave these out (a 4B Gemma 3's
# text_config names neither head_dim nor rms_norm_eps), and transformers fills them in.
_GEMMA_DEFAULTS = {
    "gemma2": {"head_dim": 256, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "max_position_embeddings": 8192,
               "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    "gemma3": {"head_dim": 256, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "max_position_embeddings": 131_072,
               "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
               "vocab_size": 262_208},
}


def _language_model(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``cfg`` itself, or for an image+text Gemma 3
    (``Gemma3ForConditionalGeneration``) its ``text_config`` with the top level's token ids;
    Gemma's defaults filled in where the file leaves a field out."""
    archs = cfg.get("architectures") or []
    if archs[:1] == ["Gemma3ForConditionalGeneration"]:
        top = cfg
        cfg = {**cfg.get("text_config", {}), "architectures": ["Gemma3ForCausalLM"],
               "model_type": "gemma3_text"}
        for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings", "torch_dtype"):
            if key in top and key not in cfg:
                cfg[key] = top[key]
    family = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}.get(
        (cfg.get("architectures") or [""])[0]) or {"gemma2": "gemma2", "gemma3_text": "gemma3"}.get(
        cfg.get("model_type", ""))
    return {**_GEMMA_DEFAULTS[family], **cfg} if family else cfg


def _rope(arch: str, cfg: dict[str, Any]) -> tuple[float, RopeScaling | None, float | None]:
    """RoPE base, scaling and (Gemma 3) the sliding layers' own base, from either spelling:
    ``rope_theta`` + ``rope_scaling`` (older configs) or ``rope_parameters`` (one dict, or
    one per layer type). A scaling type not implemented is refused by name."""
    params = cfg.get("rope_parameters") or {}
    local_theta = None
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention") or {}
        local_theta = local.get("rope_theta")
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope type {local['rope_type']!r} on sliding layers")
        params = params.get("full_attention") or {}
    rs = cfg.get("rope_scaling") or params or None
    theta = cfg.get("rope_theta") or params.get("rope_theta")
    if arch == "gemma3":
        theta = theta or 1_000_000.0
        local_theta = local_theta or cfg.get("rope_local_base_freq") or 10_000.0
    scaling = None
    if isinstance(rs, dict):
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype == "llama3":
            scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            )
        elif rtype == "linear":
            scaling = RopeScaling(factor=float(rs["factor"]), kind="linear")
        elif rtype in ("longrope", "su"):  # "su": the first Phi-3 128k configs' name for it
            scaling = _longrope(cfg, rs)
        elif rtype not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {rtype!r}")
        partial = rs.get("partial_rotary_factor", 1.0)
    else:
        partial = 1.0
    partial = cfg.get("partial_rotary_factor") or partial
    if float(partial) != 1.0:  # Phi-4-mini rotates 3/4 of each head
        raise ValueError(f"partial_rotary_factor={partial} (RoPE on part of each head) is "
                         "not supported")
    return float(theta or 10000.0), scaling, None if local_theta is None else float(local_theta)


def _longrope(cfg: dict[str, Any], rs: dict[str, Any]) -> RopeScaling:
    """Phi-3's LongRoPE parameters, with transformers' defaults: ``factor`` = context /
    original context, ``attention_factor`` = sqrt(1 + ln(factor) / ln(original context))."""
    original = int(rs.get("original_max_position_embeddings")
                   or cfg["original_max_position_embeddings"])
    factor = float(rs.get("factor") or cfg.get("max_position_embeddings", original) / original)
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    short, long = tuple(map(float, rs["short_factor"])), tuple(map(float, rs["long_factor"]))
    if len(short) != head_dim // 2 or len(long) != head_dim // 2:
        raise ValueError(f"longrope short_factor / long_factor need head_dim / 2 = "
                         f"{head_dim // 2} values, got {len(short)} / {len(long)}")
    return RopeScaling(factor=factor, original_max_position_embeddings=original, kind="longrope",
                       short_factor=short, long_factor=long, attention_factor=float(attention))


def _windows(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types``: from ``layer_types`` where the config lists
    them, else each family's rule (Gemma 2: every other layer from the first; Gemma 3: five
    of every ``sliding_window_pattern`` (6); Qwen2: layers from ``max_window_layers`` when
    ``use_sliding_window``; Mistral and the rest: every layer)."""
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", True):
        return {"sliding_window": None, "layer_types": ()}
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types:
        if arch == "gemma2":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        elif arch == "gemma3":
            pattern = cfg.get("sliding_window_pattern") or 6
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(n)]
        elif arch in ("qwen2", "qwen2_moe") and cfg.get("max_window_layers") is not None:
            types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
                     for i in range(n)]
    return {"sliding_window": int(window), "layer_types": tuple(types or ())}


def _gemma(arch: str, cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The Gemma 2/3 fields of ``ModelConfig`` ({} for the other families)."""
    if arch not in GEMMA:
        return {}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{arch} with hidden_activation {act!r} is not supported "
                         "(gelu_pytorch_tanh is)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention (an embedding model) is "
                         "not supported: this engine serves causal decoders")
    scalar = cfg.get("query_pre_attn_scalar") or head_dim
    return {"hidden_act": "gelu_tanh", "sandwich_norms": True, "embed_scale": True,
            "attn_scale": float(scalar) ** -0.5,
            "attn_softcap": cfg.get("attn_logit_softcapping"),
            "final_softcap": cfg.get("final_logit_softcapping")}


def _experts(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a Mixtral / Qwen3-MoE ``config.json`` ({} for a dense family).
    Layouts this engine does not serve (dense layers among the sparse ones) are refused by
    the field's name rather than loaded wrong."""
    if arch == "mixtral":
        return {"num_experts": cfg["num_local_experts"],
                "num_experts_per_tok": cfg["num_experts_per_tok"], "norm_topk_prob": True}
    if arch not in ("qwen2_moe", "qwen3_moe"):
        return {}
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{arch} with dense layers among the sparse ones (mlp_only_layers="
                         f"{cfg.get('mlp_only_layers')}, decoder_sparse_step="
                         f"{cfg.get('decoder_sparse_step')}) is not supported")
    return {"num_experts": cfg.get("num_experts") or cfg["num_local_experts"],
            "num_experts_per_tok": cfg["num_experts_per_tok"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "intermediate_size": cfg["moe_intermediate_size"],
            "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0}
