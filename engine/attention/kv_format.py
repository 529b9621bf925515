"""How a KV pool stores K and V: the model's dtype (``auto``) or int8 rows with their scales.

An int8 pool is one ``torch.int8`` tensor per layer, ``[pages, 2, block_size, kv_heads,
head_dim + 4]``: each token's K (and V) of each KV head is ``head_dim`` int8 values ``q`` and,
in the row's last 4 bytes, their fp32 scale ``s`` (symmetric: ``s = max|x| / 127``,
``q = round(x * 127 / max|x|)``, ``x ~ q * s``; an all-zero row stores ``s = 0``). The scale
lives in the row, not in a tensor beside the pool, so whatever copies pages or rows as bytes
(the KV transfer, the host/disk tier, prefix pulls, migration) moves values and scales
together and cannot pair a page with another page's scales.

The pool's dtype is its format: ``kv_cache.dtype == torch.int8`` means int8 rows. Every
reader goes through this module or reads the layout as documented here (the CPU kernels in
``engine.ops.csrc.cpu_ops.c``, ``kvq``), so nothing else needs to know which format a pool has.
"""

from __future__ import annotations

import torch

from engine.config import KV_SCALE_BYTES
from engine.ops import kv_int8

KV_INT8 = torch.int8  # the storage dtype of an int8 pool


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a pool of ``kv_cache_dtype`` for a model computing in ``model_dtype``."""
    return model_dtype if kv_cache_dtype == "auto" else KV_INT8


def row_width(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements of the pool's last dimension: ``head_dim``, or ``head_dim + 4`` int8 rows."""
    return head_dim if kv_cache_dtype == "auto" else head_dim + KV_SCALE_BYTES


def is_quantized(kv: torch.Tensor) -> bool:
    """Whether ``kv`` (a pool, its pages or rows read from it) holds int8 rows."""
    return kv.dtype == KV_INT8


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., head_dim]`` (float) as int8 rows ``[..., head_dim + 4]``: each row's values
    rounded to ``round(x * 127 / max|x|)`` and its scale ``max|x| / 127`` in the last 4 bytes.
    fp32 on the CPU: the C kernels' own rounding (``engine.ops.kv_int8.kv_quantize_rows``),
    so these rows are the bits the attention kernels write; elsewhere torch's float32 ops (a
    rounding may differ in its last bit)."""
    if x.dtype == torch.float32 and x.is_cpu and x.shape[-1]:
        rows = kv_int8.kv_quantize_rows(x)
        if rows is not None:
            return rows
    return _quantize_rows_torch(x)


def _quantize_rows_torch(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + KV_SCALE_BYTES, dtype=KV_INT8,
                       device=x.device)
    rows[..., :x.shape[-1]] = torch.round(xf * inv).clamp_(-127, 127).to(KV_INT8)
    rows[..., x.shape[-1]:] = (amax / 127.0).view(KV_INT8)
    return rows


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows ``[..., head_dim + 4]`` as ``[..., head_dim]`` values of ``dtype``."""
    d = rows.shape[-1] - KV_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].to(torch.float32) * scale).to(dtype)


def as_stored(kv_cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x [..., head_dim]`` (float) in ``kv_cache``'s format, ready to be written into it."""
    return quantize_rows(x) if is_quantized(kv_cache) else x


def for_pool(kv_cache: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``kv`` (values, or int8 rows) in ``kv_cache``'s format, on its device: quantized for an
    int8 pool, dequantized for a float pool (never a raw cast between the two)."""
    if is_quantized(kv_cache):
        kv = kv if is_quantized(kv) else quantize_rows(kv)
    elif is_quantized(kv):
        kv = dequantize_rows(kv, kv_cache.dtype)
    return kv.to(kv_cache.device, kv_cache.dtype)


def as_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a pool as ``[..., head_dim]`` values of ``dtype`` (a copy only when
    they are int8 rows or of another dtype)."""
    return dequantize_rows(rows, dtype) if is_quantized(rows) else rows.to(dtype)
