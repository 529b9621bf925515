"""What Gemma 2 / Gemma 3 change in the shared decoder layer (``engine.models.llama``):
GeGLU, and RMSNorm weights applied as (1 + w) — four of them a layer, on both sides of
attention and of the MLP. The rest of Gemma is configuration the shared pieces read
(``ModelConfig``'s Gemma fields: embedding scale, attention scale folded into the queries,
soft-caps in the attention backends and the logits, per-layer windows, two RoPE bases)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU: ``gelu_tanh(gate) * up`` of a fused ``[T, 2 I]`` -> ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def norm_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A Gemma RMSNorm weight as the shared norm kernels apply it: ``1 + w``, added in fp32
    (as transformers computes it) and then rounded to the model dtype."""
    return (1.0 + w.float()).to(dtype)


# Gemma's per-layer norms besides input_layernorm: the shared layer's attribute for each.
_NORMS = (("attn_out_norm", "post_attention_layernorm"),
          ("post_norm", "pre_feedforward_layernorm"),
          ("mlp_out_norm", "post_feedforward_layernorm"))


def load_norms(layer: nn.Module, prefix: str, take_norm: Callable[[str], torch.Tensor],
               put: Callable[[torch.Tensor, torch.Tensor, str], None]) -> None:
    """Fill a decoder layer's three Gemma norms from ``{prefix}<HF name>.weight``.
    (Gemma's post_attention_layernorm norms the attention's output; Llama's of the same name
    is the norm before the MLP, which Gemma calls pre_feedforward_layernorm.)"""
    for attr, name in _NORMS:
        put(getattr(layer, attr), take_norm(f"{prefix}{name}.weight"), f"{prefix}{name}.weight")
