"""Weight-only quantized linear weights: the layouts, quantizing fp weights into them, and the
reference dequantization every kernel is checked against.

Two layouts, both group-wise along K (the input dimension), chosen so that the GGUF formats a
user downloads map onto them with integer repacking only (``engine.quant.gguf``), never through
an fp32 copy:

- ``int8``: ``data`` int8 ``[N, K]``; ``scale`` fp16 ``[N, K // group]``;
  ``w[n, k] = data[n, k] * scale[n, k // group]``, ``group`` a multiple of 16 dividing K.
  ``--quantization int8`` quantizes symmetrically per 32 weights (GGUF Q8_0's blocks, which
  load into it as they are); one scale per row (PyTorch's ``_weight_int8pack_mm`` layout)
  changed the default model's greedy tokens within a few tokens of most prompts.
- ``int4``: ``data`` uint8 ``[N, K // 2]``, two weights a byte; within each block of 32 weights
  of a row (16 bytes), byte ``j`` (0..7) holds weights ``j`` (low nibble) and ``j + 8`` (high),
  byte ``8 + j`` weights ``16 + j`` and ``24 + j``: an 8-byte load widened to 32-bit lanes is
  two runs of 8 consecutive weights after one mask and one shift (ggml's order, byte ``j`` =
  weights ``j`` and ``j + 16``, took three more shuffles per 32 weights: 1.46x slower on
  AVX2); ``scale`` and ``offset`` fp16 ``[N, K // group]``, ``group == 32``;
  ``w[n, k] = q[n, k] * scale[n, k // 32] + offset[n, k // 32]`` with ``q`` in 0..15.
  ``--quantization int4`` quantizes each group by its min and max (asymmetric); GGUF Q4_0,
  Q4_1 and Q4_K load into it exactly (Q4_K's 6-bit sub-block scales are multiplied out, then
  rounded to fp16: a relative error under 2^-11 on a scale).

Scales are fp16 because they are streamed with the weights every step: fp32 scales would add a
quarter byte per int4 weight (half again its bytes) to a step that is bound by bytes read.

Activations between layers stay in the model's dtype (fp32 or bf16). The kernels that multiply
by these layouts are in ``engine.ops.linear`` (``cquant``: our C kernels on fp32 activations,
``cqint``: the activations quantized to int8 per 32 values too and each block an integer dot
product, ``dequant``: dequantize, then the fp GEMM) and are chosen per host and batch bucket
like every other linear path; a step holding prompt rows takes the float ones. PyTorch's own packed kernels (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``) were measured and are not used: with fp32 activations they ran
1.5-10x slower than our fp32 GEMV on the default model's shapes, and with bf16 activations they
round every activation to bf16 (docs/models.md, "Quantized weights"). On CUDA, int4 runs
PyTorch's tinygemm kernel (``engine.quant.gpu``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import QUANTIZATION_CHOICES as CHOICES  # what --quantization accepts

KINDS = ("int8", "int4")
INT4_GROUP = 32  # the int4 layout's block (and GGUF's): one scale and offset per 32 weights
INT8_GROUP = 32  # --quantization int8's block (GGUF Q8_0's): one scale per 32 weights


def check_quantization(quantization: str, device: torch.device, tp: int = 1,
                       dtype: str = "bfloat16") -> None:
    """Raises ValueError for a ``quantization`` this engine cannot honour on ``device`` (in
    model ``dtype``) with ``tp`` ranks (every layout splits between ranks: a GGUF's blocks by
    rows and at block boundaries, ``engine.weights.loader``). On CUDA only ``int4`` in bf16
    runs (PyTorch's tinygemm kernel, ``engine.quant.gpu``)."""
    if quantization not in CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(CHOICES)}, "
                         f"got {quantization!r}")
    if quantization in ("int8", "gguf") and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} on {device.type}: PyTorch's GPU int8 "
                         "weight-only kernel takes one scale per row, not the 32-weight groups "
                         "these weights are in (and a GGUF's Q8_0 tensors are int8); on GPU "
                         "use int4 (with dtype bfloat16) or none")
    if quantization == "int4" and device.type != "cpu" and dtype != "bfloat16":
        raise ValueError(f"quantization='int4' on {device.type} multiplies bf16 activations "
                         f"(PyTorch's tinygemm kernel); got dtype {dtype!r}: use bfloat16")


@dataclass(eq=False)
class QuantizedWeight:
    """One linear layer's weight ``[N, K]`` in a quantized layout (module docstring).

    Stands where a weight tensor would: ``shape``, ``dtype`` (of the dequantized weight and of
    the activations it multiplies), ``nbytes``."""

    kind: str
    data: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int
    dtype: torch.dtype = torch.float32
    # The same weight repacked in panels of 16 rows for the integer products with weight rows
    # in the vector lanes (engine.ops.quant_ops.panels: made on first use, on AVX-512 VNNI
    # hosts; 1.18x the int8 data's bytes, int4's the same): a second copy, not counted in
    # nbytes.
    panels: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.data.shape[0]
        k = self.data.shape[1] * (2 if self.kind == "int4" else 1)
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantized layout {self.kind!r}; known: {', '.join(KINDS)}")
        if (self.group <= 0 or self.group % 16 or k % self.group
                or self.scale.shape != (n, k // self.group)):
            raise ValueError(f"{self.kind} weight [{n}, {k}]: scale {tuple(self.scale.shape)} "
                             f"does not give one scale per {self.group} weights of a row "
                             "(groups: a multiple of 16 dividing the row)")
        if self.kind == "int4" and (self.group % INT4_GROUP or self.offset is None
                                    or self.offset.shape != self.scale.shape):
            raise ValueError(f"int4 weight [{n}, {k}]: needs groups of a multiple of "
                             f"{INT4_GROUP} with one offset per scale")

    @property
    def shape(self) -> tuple[int, int]:
        n = self.data.shape[0]
        return (n, self.data.shape[1] * (2 if self.kind == "int4" else 1))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes a pass over this weight reads."""
        extra = 0 if self.offset is None else self.offset.nbytes
        return self.data.nbytes + self.scale.nbytes + extra

    def numel(self) -> int:
        n, k = self.shape
        return n * k

    def element_size(self) -> int:  # bytes per weight, rounded up (what tuning sizes by)
        return 1

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The fp weight ``[N, K]`` this layout stands for (the reference every kernel is
        checked against), in ``dtype`` (default: the weight's activation dtype)."""
        n, k = self.shape
        scale = self.scale.float().repeat_interleave(self.group, dim=1)
        if self.kind == "int8":
            w = self.data.float() * scale
        else:
            w = unpack_int4(self.data).float() * scale
            w += self.offset.float().repeat_interleave(self.group, dim=1)
        return w.to(dtype or self.dtype)

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows ``index`` as a weight of their own (copies, as tensor indexing makes): an
        embedding lookup's rows, expanded by ``engine.models.quantized.QEmbedding``."""
        return self._sub(index)

    def row_slice(self, start: int, stop: int) -> QuantizedWeight:
        """Rows ``start:stop`` as a weight of their own (views: nothing copied)."""
        return self._sub(slice(start, stop))

    def _sub(self, index) -> QuantizedWeight:
        return QuantizedWeight(self.kind, self.data[index], self.scale[index],
                               None if self.offset is None else self.offset[index], self.group,
                               self.dtype)

    def to(self, device: torch.device) -> QuantizedWeight:
        """The same weight with its tensors on ``device``."""
        return QuantizedWeight(self.kind, self.data.to(device), self.scale.to(device),
                               None if self.offset is None else self.offset.to(device),
                               self.group, self.dtype)

    def detach(self) -> QuantizedWeight:  # what model_linear_weights calls on a tensor
        return self


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one layout stacked by rows (q/k/v into the fused QKV, gate/up)."""
    first = parts[0]
    if any((p.kind, p.group, p.shape[1]) != (first.kind, first.group, first.shape[1])
           for p in parts):
        raise ValueError("only weights of one layout, group and width stack into one")
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])
    return QuantizedWeight(first.kind, torch.cat([p.data for p in parts]),
                           torch.cat([p.scale for p in parts]), offset, first.group, first.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q`` uint8 ``[N, K]`` of values 0..15 (K a multiple of 32) -> the int4 layout's bytes
    ``[N, K // 2]``: per 32-weight block, byte ``8 h + j`` = ``q[16 h + j] | q[16 h + 8 + j] <<
    4`` (h 0..1, j 0..7)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // INT4_GROUP, 2, 2, 8)  # [.., h, low/high, j]
    return (blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 ``[N, K // 2]`` -> uint8 ``[N, K]`` of values 0..15."""
    n, half = data.shape
    blocks = data.reshape(n, half // (INT4_GROUP // 2), 2, 1, 8)
    return torch.cat((blocks & 15, blocks >> 4), dim=3).reshape(n, half * 2)


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """``weight [N, K]`` (fp) in layout ``kind``: int8 per 32 weights, symmetric (scale =
    max |w| / 127 of the group, as GGUF's Q8_0); int4 per 32 weights, asymmetric (scale =
    (max - min) / 15, offset = min, q = round((w - min) / scale), as Q4_1). Raises
    ValueError when K does not split into 32-weight groups."""
    w = weight.detach().float()
    n, k = w.shape
    if kind not in KINDS:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {', '.join(CHOICES)}")
    if k % INT4_GROUP:
        raise ValueError(f"{kind} needs the input size to be a multiple of {INT4_GROUP}; "
                         f"a weight [{n}, {k}] is not")
    g = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
    if kind == "int8":
        scale = (g.abs().amax(dim=2) / 127).clamp(min=1e-12).half()
        q = torch.round(g / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", q.reshape(n, k).contiguous(), scale.contiguous(), None,
                               INT8_GROUP, weight.dtype)
    if kind == "int4":
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = ((hi - lo) / 15).clamp(min=1e-8).half()
        offset = lo.half()
        q = torch.round((g - offset.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
        return QuantizedWeight("int4", pack_int4(q.reshape(n, k).to(torch.uint8)),
                               scale.contiguous(), offset.contiguous(), INT4_GROUP, weight.dtype)


def weight_bytes(weights) -> int:
    """Bytes one pass over ``weights`` (tensors or quantized weights) reads."""
    return sum(w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
               for w in weights)
