"""The int8 KV pool's writes, in C (``engine.ops.csrc.cpu_ops.c``: ``kv_store_`` and its two
callers): a step's K/V quantized and scattered into their slots in one pass, and rows
quantized the same way for whoever needs them outside a pool (``engine.attention.kv_format``).
Every int8 row a CPU engine holds comes from that one rounding; the decode kernels that read
the rows are ``cpu_ops.paged_decode`` and ``cpu_ops.decode_layers``."""

from __future__ import annotations

import torch

from engine.config import KV_SCALE_BYTES
from engine.ops.cpu_ops import library


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)


def kv_write_int8(kv_cache: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> bool:
    """Quantize a step's new ``k``, ``v`` (``[T, KVH, D]`` fp32; rows may be strided views of
    a fused QKV) into an int8 pool's slots ``(page_ids[t], offsets[t])`` (int64), in one pass
    (``engine.attention.kv_format.quantize_rows``'s rounding). Returns False, touching
    nothing, when the kernel does not apply (the caller's torch path runs instead)."""
    lib = library()
    t, kvh, d = k.shape
    if (lib is None or not _fp32_cpu(k, v) or kv_cache.dtype != torch.int8 or not kv_cache.is_cpu
            or not kv_cache.is_contiguous() or kv_cache.shape[3:] != (kvh, d + KV_SCALE_BYTES)
            or k.stride(2) != 1 or k.stride(1) != d or v.stride(2) != 1 or v.stride(1) != d
            or page_ids.dtype != torch.int64 or offsets.dtype != torch.int64
            or not (page_ids.is_contiguous() and offsets.is_contiguous())):
        return False
    lib.kv_write_int8(kv_cache.data_ptr(), page_ids.data_ptr(), offsets.data_ptr(),
                      k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), t, kvh, d,
                      kv_cache.shape[2], torch.get_num_threads())
    return True


def kv_quantize_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x [..., D]`` (fp32, CPU) as int8 rows ``[..., D + 4]``, as the kernels write them
    (``engine.attention.kv_format``'s layout); None where the kernel does not apply."""
    lib = library()
    if lib is None or not _fp32_cpu(x) or x.dim() == 0:
        return None
    x = x.contiguous()
    d = x.shape[-1]
    out = torch.empty(*x.shape[:-1], d + KV_SCALE_BYTES, dtype=torch.int8)
    lib.kv_quantize_rows(x.data_ptr(), x.numel() // d if d else 0, d, out.data_ptr(),
                         torch.get_num_threads())
    return out
