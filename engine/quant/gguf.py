"""GGUF quantized tensors loaded into ``engine.quant.layouts``'s layouts as stored: integer repacking
of the raw blocks plus fp16 scales, never an fp32 copy of the weight.

``from_gguf(data, qtype, shape)`` takes a ``gguf.GGUFReader`` tensor's raw bytes (``.data``,
flat or ``[N, bytes_per_row]``), its type, and its torch shape ``(N, K)`` (GGUF lists dims
fastest first: ``(N, K) = reversed(tensor.shape)``), and returns a ``QuantizedWeight``, or
None when the caller must dequantize instead: a type not in ``SUPPORTED``, or (never seen in
real files) a block scale whose fp16 scale or offset would overflow. The mappings, with ``q``
the stored 4-bit value (0..15) and ``d``, ``m``, ``dmin`` the block's fp16 fields:

- ``Q8_0`` (blocks of 32: ``d``, 32 int8): ``int8``, group 32, ``scale = d``. Exact.
- ``Q4_0`` (blocks of 32: ``d``, 16 bytes; ``w = d * (q - 8)``): ``int4``, the nibbles
  regrouped from ggml's order (byte ``j``: weights ``j``, ``j + 16``) into ours
  (``engine.quant.layouts``), ``scale = d``, ``offset = -8 * d``. Exact: ``-8 * d`` is an fp16
  exponent shift.
- ``Q4_1`` (blocks of 32: ``d``, ``m``, 16 bytes; ``w = d * q + m``): ``int4``, regrouped
  likewise, ``scale = d``, ``offset = m``. Exact.
- ``Q4_K`` (super-blocks of 256: ``d``, ``dmin``, 12 bytes of 6-bit scales ``sc`` and mins
  ``mn`` for its eight 32-weight sub-blocks, 128 bytes; ``w = d * sc * q - dmin * mn``):
  ``int4``, nibbles regrouped into our per-32 order, ``scale = fp16(d * sc)``,
  ``offset = fp16(-dmin * mn)`` (each product exact in fp32, rounded to fp16 once). Not bit-
  exact: each weight is off by at most ``2^-11 * (15 * |d * sc| + |dmin * mn|)`` (plus
  ``2^-25`` per term where a product falls in fp16's subnormal range).

"Exact" means ``QuantizedWeight.dequantize()`` (fp32) equals ``gguf.quants.dequantize``
value for value. ``permute_rows`` reorders a loaded weight's output rows (undoing llama.cpp's
q/k rotary permutation) without dequantizing it.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from engine.quant.layouts import INT4_GROUP, QuantizedWeight

SUPPORTED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")  # GGMLQuantizationType names from_gguf loads


def from_gguf(data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int],
              dtype: torch.dtype = torch.float32) -> QuantizedWeight | None:
    """The GGUF tensor with raw bytes ``data``, type ``qtype`` and torch shape ``(N, K)`` as a
    ``QuantizedWeight`` (module docstring), or None where the caller must dequantize it.
    Raises ValueError when ``data`` is not ``N * K`` weights of ``qtype``."""
    qtype = gguf.GGMLQuantizationType(qtype)
    if qtype.name not in SUPPORTED:
        return None
    n, k = (int(s) for s in shape)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.asarray(data).view(np.uint8).reshape(-1)  # raw bytes, whatever the reader's shape
    if n <= 0 or k <= 0 or k % block or raw.size != n * (k // block) * block_bytes:
        raise ValueError(f"{qtype.name} tensor [{n}, {k}]: {raw.size} bytes is not whole "
                         f"blocks of {block} weights ({block_bytes} bytes) per row")
    blocks = raw.reshape(n, k // block, block_bytes)
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        scale = _f16(blocks[:, :, 0:2])
        q = np.array(blocks[:, :, 2:]).view(np.int8).reshape(n, k)  # np.array copies the mmap
        return QuantizedWeight("int8", torch.from_numpy(q), torch.from_numpy(scale), None,
                               block, dtype)
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return _from_q4_k(blocks, n, k, dtype)
    d = _f16(blocks[:, :, 0:2])
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        with np.errstate(over="ignore"):
            offset = d * np.float16(-8)  # exact in fp16 unless it overflows (checked below)
        qs = blocks[:, :, 2:]
    else:  # Q4_1
        offset = _f16(blocks[:, :, 2:4])
        qs = blocks[:, :, 4:]
    return _int4(np.array(qs).reshape(n, k // 2), d, offset, dtype)


def permute_rows(w: QuantizedWeight, perm: torch.Tensor) -> QuantizedWeight:
    """``w`` with output row ``i`` taken from row ``perm[i]`` (data, scale and offset alike)."""
    n = w.shape[0]
    perm = torch.as_tensor(perm, dtype=torch.long)
    if perm.shape != (n,):
        raise ValueError(f"row permutation of shape {tuple(perm.shape)} for a weight with "
                         f"{n} rows")
    return QuantizedWeight(w.kind, w.data[perm], w.scale[perm],
                           None if w.offset is None else w.offset[perm], w.group, w.dtype)


def _f16(field: np.ndarray) -> np.ndarray:
    """A ``[..., 2]`` byte slice of fp16 block fields -> fp16 ``[...]`` (a contiguous copy)."""
    return np.array(field).view(np.float16)[..., 0]


def _int4(qs: np.ndarray, scale: np.ndarray, offset: np.ndarray,
          dtype: torch.dtype) -> QuantizedWeight | None:
    """``qs``: ``[N, K // 2]`` bytes in ggml's per-32 nibble order (byte j: weights j and
    j + 16), regrouped into ours (byte 8 h + j: weights 16 h + j and 16 h + 8 + j)."""
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        return None  # a scale fp16 cannot hold: the caller's dequantization keeps it
    g = qs.reshape(qs.shape[0], -1, 16)
    low, high = g & 0x0F, g >> 4  # weights 0..15 and 16..31 of each block
    ours = np.concatenate((low[..., :8] | (low[..., 8:] << 4),
                           high[..., :8] | (high[..., 8:] << 4)), axis=-1)
    return QuantizedWeight("int4", torch.from_numpy(ours.reshape(qs.shape)),
                           torch.from_numpy(scale), torch.from_numpy(offset), INT4_GROUP, dtype)


def _from_q4_k(blocks: np.ndarray, n: int, k: int, dtype: torch.dtype) -> QuantizedWeight | None:
    sb = blocks.reshape(-1, blocks.shape[-1])  # one row per 256-weight super-block
    d = np.array(sb[:, 0:2]).view(np.float16).astype(np.float32)  # [S, 1]
    dmin = np.array(sb[:, 2:4]).view(np.float16).astype(np.float32)
    sc, mn = _q4_k_scale_min(sb[:, 4:16])
    # d (11 significant bits) times a 6-bit integer is exact in fp32, so each fp16 field is
    # rounded once, as the docstring's error bound assumes.
    with np.errstate(over="ignore"):
        scale = (d * sc).astype(np.float16).reshape(n, k // INT4_GROUP)
        offset = (-(dmin * mn)).astype(np.float16).reshape(n, k // INT4_GROUP)
    # 128 bytes = 4 chunks of 32; chunk i's low nibbles are sub-block 2i, its high nibbles
    # sub-block 2i + 1, byte b holding weight b. ggml's per-32 order (what _int4 regroups)
    # holds weights j (low) and j + 16 (high) in byte j: pair chunk byte j with byte j + 16.
    c = sb[:, 16:].reshape(-1, 4, 2, 16)
    first, second = c[:, :, 0], c[:, :, 1]  # chunk bytes 0..15 and 16..31
    even = (first & 0x0F) | (second << 4)  # uint8 shift drops the high nibble
    odd = (first >> 4) | (second & 0xF0)
    qs = np.stack((even, odd), axis=2).reshape(n, k // 2)
    return _int4(qs, scale, offset, dtype)


def _q4_k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 packed bytes ``[S, 12]`` -> 6-bit scales and mins, fp32 ``[S, 8]`` each
    (ggml's get_scale_min_k4): sub-blocks 0..3 keep 6 bits in bytes 0..3 (scales) and 4..7
    (mins); sub-blocks 4..7 take their low 4 bits from bytes 8..11 (scale low nibble, min
    high nibble) and their top 2 from the top bits of bytes 0..3 (scales) and 4..7 (mins)."""
    lo_sc, lo_mn, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate((lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 6) << 4)), axis=1)
    mn = np.concatenate((lo_mn & 0x3F, (hi >> 4) | ((lo_mn >> 6) << 4)), axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)
