"""Rotary position embeddings, shared by every family: the inverse frequencies (plain, Llama
3.x's scaling, linear scaling, Phi-3's LongRoPE; Gemma 3's sliding layers' own base) and the
cos/sin tables the model indexes by position."""

from __future__ import annotations

import torch

from engine.models.config import ModelConfig
from engine.ops import cpu_ops


def rope_inv_freq(cfg: ModelConfig, local: bool = False, long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]``, with the configured scaling (Llama 3's, linear
    or LongRoPE: ``long`` picks its long factors). ``local``: the sliding layers' own base,
    unscaled (Gemma 3)."""
    d = cfg.head_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    rs = None if local else cfg.rope_scaling
    if rs is not None and rs.kind == "longrope":
        factors = torch.tensor(rs.long_factor if long else rs.short_factor, dtype=torch.float32)
        return 1.0 / (factors * theta ** exponents)
    inv = 1.0 / (theta ** exponents)
    if rs is None:
        return inv
    if rs.kind == "linear":
        return inv / rs.factor
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * torch.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables ``[max_len, head_dim]`` (rotate-half convention, as in HF).

    LongRoPE (Phi-3 128k, Phi-3.5) picks one factor set for the whole engine from the
    context it serves, ``max_len``: the short factors when it fits the original context, else
    the long ones, for every token (``long``). transformers picks per sequence, recomputing a
    sequence's whole KV with the long factors once it outgrows the original context; so a
    sequence rotates as there whenever it fits the served context's regime, and a short one
    served with a long context differs (docs/models.md). Cos and sin carry the attention
    factor."""

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype,
                 local: bool = False) -> None:
        rs = None if local else cfg.rope_scaling
        longrope = rs is not None and rs.kind == "longrope"
        self.long = longrope and max_len > rs.original_max_position_embeddings
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(cfg, local, self.long))  # [max_len, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = rs.attention_factor if longrope else 1.0
        self.cos = (emb.cos() * scale).to(dtype)
        self.sin = (emb.sin() * scale).to(dtype)

    def apply_qk(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate Q and K of a fused ``qkv [T, (H + 2 KVH) * D]``; cos/sin: ``[T, D]``.
        Returns ``q [T, H, D]`` and ``k [T, KVH, D]``: views of ``qkv`` rotated in place when
        the fused kernel applies (Q and K heads are adjacent: one call), else new tensors."""
        t = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim)
        if cpu_ops.rope_(qkv, num_heads + num_kv_heads, head_dim, cos, sin):
            return q, k
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cpu_ops.rope_torch(q, cos, sin), cpu_ops.rope_torch(k, cos, sin)
