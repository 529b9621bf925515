"""Quantized weights on CUDA: ``--quantization int4`` through PyTorch's tinygemm kernel
(``torch._weight_int4pack_mm``: int4 weights in groups of 32, bf16 activations, one fused
GEMM/GEMV that reads the 4-bit weights from memory, the only grouped weight-only kernel
PyTorch ships for CUDA).

Our int4 layout (``engine.quant.layouts``: ``w = q * scale + offset``, q 0..15, per 32 weights) maps
onto tinygemm's (``w = (q - 8) * scale + zero``, scales and zeros bf16 ``[K / group, N, 2]``)
with ``zero = offset + 8 * scale``: the same q, no re-quantization. tinygemm keeps scales and
zeros in bf16, so each is rounded once from our fp16 (a relative error under 2^-8 on a
group's scale and zero): stated where outputs are compared (``tests/gpu``).

What runs where (docs/models.md, "Quantized weights"): on CUDA ``int4`` needs
``--dtype bfloat16`` (the kernel's only activation dtype) and weights whose rows are a multiple
of 8 and inputs a multiple of 32 (every released checkpoint's); a weight that does not fit is
held dequantized in bf16 and logged. ``int8`` and ``gguf`` are refused on CUDA by
``engine.runtime.llm_engine.check_quantization``: PyTorch's CUDA int8 weight-only kernel takes one scale
per row, not our 32-weight groups (per-row int8 changed the default model's greedy tokens
within a few tokens of most prompts), and a GGUF's Q8_0 tensors are int8.

``tinygemm_operands`` is device-independent (checked on CPU against PyTorch's CPU twin of
the kernel, ``_weight_int4pack_mm_for_cpu``, which takes the same scales and zeros).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.quant.layouts import INT4_GROUP, QuantizedWeight, unpack_int4

log = logging.getLogger(__name__)

_INNER_K_TILES = (8, 4, 2)  # tinygemm's K packing: the widest tile count that divides K / 16


@dataclass(eq=False)
class TinyGemmWeight:
    """An int4 weight ``[N, K]`` packed for ``torch._weight_int4pack_mm`` on a CUDA device:
    stands where a weight tensor would for ``engine.ops.linear.linear`` (``shape``, ``dtype``,
    ``kind``, ``nbytes``, ``device``)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor  # bf16 [K / group, N, 2]
    shape: tuple[int, int]
    group: int = INT4_GROUP
    kind: str = "int4"
    dtype: torch.dtype = torch.bfloat16

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K] @ w.T + bias`` (``x`` bf16 on this weight's device)."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"int4 on CUDA multiplies bf16 activations, got {x.dtype}")
        out = torch._weight_int4pack_mm(x.contiguous(), self.packed, self.group,
                                        self.scales_and_zeros)
        return out if bias is None else out + bias


def tinygemm_operands(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``w``'s int4 values (int32 ``[N, K]``, 0..15) and tinygemm's scales and zeros (bf16
    ``[K / 32, N, 2]``) for the same weights (module docstring), on ``w``'s device."""
    if w.kind != "int4" or w.group != INT4_GROUP:
        raise ValueError(f"tinygemm takes int4 weights in groups of {INT4_GROUP}, got "
                         f"{w.kind} in groups of {w.group}")
    q = unpack_int4(w.data).to(torch.int32)
    scale, offset = w.scale.float(), w.offset.float()
    pairs = torch.stack([scale, offset + 8 * scale], dim=-1)  # [N, K / 32, 2]
    return q, pairs.transpose(0, 1).contiguous().to(torch.bfloat16)


def inner_k_tiles(k: int) -> int | None:
    """tinygemm's K packing for an input size ``k``; None when none divides it."""
    return next((t for t in _INNER_K_TILES if k % (16 * t) == 0), None)


def to_cuda(w: QuantizedWeight, device: torch.device,
            name: str = "weight") -> TinyGemmWeight | torch.Tensor:
    """``w`` (int4, on the CPU) ready to multiply on ``device``: packed for tinygemm, or,
    where the kernel cannot take its shape (rows not a multiple of 8, no K packing), the bf16
    weight it stands for (logged, naming ``name``)."""
    n, k = w.shape
    tiles = inner_k_tiles(k)
    if n % 8 or tiles is None:
        log.warning("int4 on CUDA: %s [%d, %d] does not fit tinygemm's packing (rows a "
                    "multiple of 8, inputs of 32); held in bf16", name, n, k)
        return w.dequantize(torch.bfloat16).to(device)
    q, pairs = tinygemm_operands(w)
    q = q.to(device=device, dtype=torch.uint8)
    # the CUDA packing takes two values a byte, even columns in the high nibble
    packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4) | q[:, 1::2], tiles)
    return TinyGemmWeight(packed, pairs.to(device), (n, k), w.group)
