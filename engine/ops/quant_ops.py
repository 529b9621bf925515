"""The C kernels for ``engine.quant.layouts``'s layouts: thin wrappers over ``engine/ops/csrc/cpu_ops.c``'s
``q8_linear``, ``q4_linear``, ``qi_linear``, ``qr_linear`` (over ``qr_pack``'s panels),
``qwide_linear`` and ``q_dequantize`` (the library is ``engine.ops.cpu_ops``', built and
loaded there; the whole-step decode kernel reads the same layouts, ``cpu_ops.decode_layers``).
Each returns None, computing nothing, where it does not apply (no library, activations not
fp32 on CPU, a layout the kernels do not take): the caller runs another path
(``engine.ops.linear``).
"""

from __future__ import annotations

import torch

from engine.ops.cpu_ops import amx_tiles, library, panels_built
from engine.quant.layouts import QuantizedWeight


def _fp32_cpu(t: torch.Tensor) -> bool:
    return t.is_cpu and t.dtype == torch.float32


def _float_tiles_shape(lib, x: torch.Tensor, weight: QuantizedWeight,
                       bias: torch.Tensor | None) -> tuple[int, int, int] | None:
    """``(M, N, K)`` where the kernels that multiply fp32 activations as they are apply (the
    library built, x ``[M, K]`` contiguous fp32 on the CPU, fp16 scales, K a multiple of 32,
    groups a multiple of 16), else None."""
    if (lib is None or not _fp32_cpu(x) or x.dim() != 2 or not x.is_contiguous()
            or (bias is not None and not _fp32_cpu(bias)) or weight.scale.dtype != torch.float16):
        return None
    m, k = x.shape
    if k != weight.shape[1] or k % 32 or weight.group % 16:
        return None
    return m, weight.shape[0], k


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for a ``engine.quant.layouts.QuantizedWeight`` read in its layout
    (``x [M, K]`` fp32): the ``"cquant"`` linear path. Any M (rows 4 at a time against each
    tile of weight rows). None, computing nothing, when the kernel does not apply."""
    lib = library()
    shape = _float_tiles_shape(lib, x, weight, bias)
    if shape is None:
        return None
    m, n, k = shape
    out = torch.empty(m, n, dtype=x.dtype)
    b = None if bias is None else bias.data_ptr()
    threads = torch.get_num_threads()
    if weight.kind == "int8":
        lib.q8_linear(x.data_ptr(), weight.data.data_ptr(), weight.scale.data_ptr(), b,
                      out.data_ptr(), m, n, k, weight.group, threads)
    else:
        xsum = torch.empty(m * (k // 32))
        lib.q4_linear(x.data_ptr(), weight.data.data_ptr(), weight.scale.data_ptr(),
                      weight.offset.data_ptr(), b, out.data_ptr(), m, n, k, xsum.data_ptr(),
                      threads)
    return out


def quantized_linear_int(x: torch.Tensor, weight: QuantizedWeight,
                         bias: torch.Tensor | None, lib=None,
                         amx: bool = False) -> torch.Tensor | None:
    """``x @ weight.T + bias`` with ``x [M, K]`` (fp32) quantized to int8 first, per 32 values
    as the weights are (symmetric, ``max |x| / 127`` of the block), and every 32-weight block an
    integer dot product (``qi_linear``: AVX-512 VNNI, AVX2 or portable,
    ``cpu_ops.int_dot_isa``): the ``"cqint"`` linear path. It differs from ``cquant`` by the
    activations' rounding (at most 1/254 of a block's largest value per value). Weights in
    groups of 32 only;
    None, computing nothing, when the kernel does not apply. ``lib``: another build of the
    kernels (``cpu_ops.load``; tests of each instruction path), else this process's.
    ``amx``: on the AMX tiles (``qa_linear``, the ``"camx"`` path: the same products, summed
    in another order), where ``cpu_ops.amx_tiles`` says they run; else None."""
    lib = lib or library()
    if amx and not amx_tiles(lib):
        return None
    if (lib is None or not _fp32_cpu(x) or x.dim() != 2 or not x.is_contiguous()
            or (bias is not None and not _fp32_cpu(bias)) or weight.scale.dtype != torch.float16
            or weight.group != 32):
        return None
    m, k = x.shape
    n = weight.shape[0]
    if k != weight.shape[1] or k % 32:
        return None
    out = torch.empty(m, n, dtype=x.dtype)
    threads = torch.get_num_threads()
    work = torch.empty(lib.qi_linear_work_floats(m, k, threads))
    (lib.qa_linear if amx else lib.qi_linear)(1 if weight.kind == "int8" else 2, x.data_ptr(), weight.data.data_ptr(),
                  weight.scale.data_ptr(),
                  None if weight.offset is None else weight.offset.data_ptr(),
                  None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k,
                  work.data_ptr(), threads)
    return out


def panels(weight: QuantizedWeight) -> torch.Tensor | None:
    """``weight`` repacked in panels of 16 rows (``qr_pack``: per 32-value block, 16 rows x 4
    values a vector, then the rows' scales), made on first use and kept on the weight
    (``QuantizedWeight.panels``); None where the host's build has no panels
    (``cpu_ops.panels_built``: AVX-512 VNNI only) or the layout is not one they take (groups
    of 32, fp16 scales, fp32 activations)."""
    if weight.panels is not None:
        return weight.panels
    lib = library()
    if (lib is None or not panels_built(lib) or weight.group != 32
            or weight.scale.dtype != torch.float16 or weight.dtype != torch.float32):
        return None
    n, k = weight.shape
    fmt = 1 if weight.kind == "int8" else 2
    out = torch.empty(lib.qr_bytes(fmt, n, k), dtype=torch.uint8)
    lib.qr_pack(fmt, weight.data.data_ptr(), weight.scale.data_ptr(),
                None if weight.offset is None else weight.offset.data_ptr(), n, k,
                out.data_ptr(), torch.get_num_threads())
    weight.panels = out
    return out


def quantized_linear_panels(x: torch.Tensor, weight: QuantizedWeight,
                            bias: torch.Tensor | None) -> torch.Tensor | None:
    """``quantized_linear_int``'s math (``x`` quantized to int8 per 32 values, each block an
    integer dot product) on the weight's panels (``panels``): 16 weight rows in the vector
    lanes, so a block of 16 outputs against a row costs 8 vpdpbusd and one scaling, no
    horizontal sums (~3x the products an instruction of the row-layout tiles; at 32 rows the
    default model's LM head 4.3 ms against 13.2 on those and 9.4 in fp32, AMD EPYC Zen 4): the
    ``"cqpanel"`` linear path. None, computing nothing, where it does not apply."""
    lib = library()
    if (lib is None or not _fp32_cpu(x) or x.dim() != 2 or not x.is_contiguous()
            or (bias is not None and not _fp32_cpu(bias))):
        return None
    m, k = x.shape
    n = weight.shape[0]
    if k != weight.shape[1] or k % 32:
        return None
    p = panels(weight)
    if p is None:
        return None
    out = torch.empty(m, n, dtype=x.dtype)
    work = torch.empty(lib.qr_linear_work_floats(m, k))
    lib.qr_linear(1 if weight.kind == "int8" else 2, x.data_ptr(), p.data_ptr(),
                  None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k,
                  work.data_ptr(), torch.get_num_threads())
    return out


def quantized_linear_wide(x: torch.Tensor, weight: QuantizedWeight,
                          bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` (``x [M, K]`` fp32) on the wide tiles (``cpu_ops.wide_linear``'s:
    the rows of x in vector lanes), each tile of 12 weight rows expanded to fp32 as it is
    reached (``qwide_linear``): from ~16 rows the multiplies bound the product and these
    tiles multiply fastest, while only the quantized bytes are read and no ``[N, K]`` fp32
    copy is written. The same math as ``cquant`` (fp32 activations as they are, another
    summation order): the ``"cqwide"`` linear path. None, computing nothing, when the kernel
    does not apply."""
    lib = library()
    shape = _float_tiles_shape(lib, x, weight, bias)
    if shape is None:
        return None
    m, n, k = shape
    out = torch.empty(m, n, dtype=x.dtype)
    threads = torch.get_num_threads()
    work = torch.empty(lib.qwide_linear_work_floats(m, k, threads))
    lib.qwide_linear(1 if weight.kind == "int8" else 2, x.data_ptr(), weight.data.data_ptr(),
                     weight.scale.data_ptr(),
                     None if weight.offset is None else weight.offset.data_ptr(), weight.group,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k,
                     work.data_ptr(), threads)
    return out


def dequantize(weight: QuantizedWeight, threads: int | None = None) -> torch.Tensor | None:
    """The fp32 ``[N, K]`` a quantized weight stands for, in one pass (the
    ``"dequant"`` linear path's scratch weight; an embedding lookup's rows) on ``threads``
    (default: torch's); None where the kernel does not apply. CPU tensors only."""
    lib = library()
    if lib is None or weight.scale.dtype != torch.float16 or weight.dtype != torch.float32:
        return None
    n, k = weight.shape
    out = torch.empty(n, k)
    lib.q_dequantize(1 if weight.kind == "int8" else 2, weight.data.data_ptr(),
                     weight.scale.data_ptr(),
                     None if weight.offset is None else weight.offset.data_ptr(),
                     out.data_ptr(), n, k, weight.group, threads or torch.get_num_threads())
    return out
