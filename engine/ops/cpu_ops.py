"""Fused CPU kernels (``engine/ops/csrc/cpu_ops.c``), built for this host, with torch twins.

A decode step of a small model on CPU is a few GEMMs wrapped in dozens of small torch ops per
layer, and the torch paged attention copies every sequence's K/V out of the cache before it
reads them. ``engine/ops/csrc/cpu_ops.c`` holds four fp32 kernels that read the paged cache in
place and fuse the elementwise chains: ``paged_decode``, ``rms_norm`` (optionally adding the
residual first), ``silu_mul`` and ``rope_``; ``gemv``, a small-M product that streams each
weight row once (a linear path ``engine.tuning.linear`` times against MKL's and oneDNN's); and
``decode_layers``, a whole pure-decode step through every layer in one call (the same math;
``engine.executor.fused_decode`` decides per host and batch whether it runs; its projections fp32, or
int8 / int4 in ``engine.quant.layouts``'s layouts, whose stand-alone products ``engine.ops.quant_ops``
wraps). Each wrapper here takes
tensors, checks what the kernel assumes, and falls back to the torch twin (same math, op for op
what the model did before) when the library is missing, the tensor is not fp32 on CPU, or its
layout does not fit (``decode_layers`` declines, and the caller runs the layers one by one).

Building (``engine.ops.cpu_build``): the library is compiled by the machine's C compiler (``cc -O3 -march=native
-ffast-math -fopenmp``, linked without fast-math; under a second) into ``~/.cache/pdcluster/ext/cpu_ops-<key>.so``,
the key naming the source, the compiler and the CPU's flags, so an image built on one host
and run on another compiles afresh rather than running another CPU's instructions. ``make
setup`` builds it at install time; a process that finds no library builds it on first use
(one process at a time: a file lock). No compiler, or a failed build, logs once and leaves
the torch twins in charge. ``PDCLUSTER_CPU_OPS=0`` turns the kernels off (A/B and debugging).

Threads: the library links the libgomp that torch loaded (same soname, so the process has one
OpenMP runtime), and each call passes torch's intra-op thread count.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import KV_SCALE_BYTES

# the build's names, for callers that reach them through this module (tests, bench)
from engine.ops.cpu_build import CFLAGS, ISA_LADDER, LDFLAGS, SOURCE, build  # noqa: F401

log = logging.getLogger(__name__)

MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the C kernel's stack buffers (MAX_GROUP, MAX_D)
NEVER_WIDE = 1 << 30  # decode_layers' wide_from that keeps every batch on the dot-product tiles

_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "paged_decode": [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32,
                     _INT, _I64],
    "rms_norm": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT],
    "kv_write_int8": [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _INT],
    "kv_quantize_rows": [_PTR, _I64, _I64, _PTR, _INT],
    "silu_mul": [_PTR, _PTR, _I64, _I64, _INT],
    "rope": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT],
    "gemv": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT],
    "decode_layers": [_PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR,
                      _I64, _PTR, _I64, _F32, _F32, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT],
    "decode_layers_work_floats": [_I64, _I64, _I64, _I64, _I64, _I64, _INT],
    "wide_linear": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _INT],
    "wide_linear_work_floats": [_I64, _I64, _INT],
    "qwide_linear": [_I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR,
                     _INT],
    "qwide_linear_work_floats": [_I64, _I64, _INT],
    "prefill_attention": [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64,
                          _I64, _F32, _INT],
    "apply_bitmask": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64],
    "q8_linear": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT],
    "q4_linear": [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _INT],
    "q_dequantize": [_I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT],
    "qi_linear": [_I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _INT],
    "qa_linear": [_I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _INT],
    "qi_linear_work_floats": [_I64, _I64, _INT],
    "qr_bytes": [_I64, _I64, _I64],
    "qr_pack": [_I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _INT],
    "qr_linear": [_I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _INT],
    "qr_linear_work_floats": [_I64, _I64],
    "lora_apply": [_PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _INT],
    "qi_isa": [],
    "qa_enable": [],
    "isa_probe": [],
}
_RESTYPES = {"decode_layers_work_floats": _I64, "wide_linear_work_floats": _I64,
             "qwide_linear_work_floats": _I64,
             "qi_linear_work_floats": _I64, "qr_bytes": _I64, "qr_linear": _INT,
             "qr_linear_work_floats": _I64, "qi_isa": _INT, "isa_probe": _INT,
             "qa_enable": _INT}

_lib: ctypes.CDLL | None = None
_tried = False
_first_use = threading.Lock()


def enabled() -> bool:
    """Whether the fused kernels are in use in this process (built, or buildable, and not
    turned off with ``PDCLUSTER_CPU_OPS=0``)."""
    return library() is not None


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None when unavailable."""
    global _lib, _tried
    if not _tried:
        with _first_use:  # threads arriving together wait for the one build, then share it
            if not _tried:
                if os.environ.get("PDCLUSTER_CPU_OPS", "1") == "0":
                    log.info("fused CPU kernels off (PDCLUSTER_CPU_OPS=0)")
                else:
                    _lib = _load(build())
                _tried = True
    return _lib


def build_id() -> str:
    """Names the loaded library build ("" when none): timings of these kernels are keyed by it."""
    lib = library()
    return Path(lib._name).stem if lib is not None else ""


ISA_NAMES = {2: "avx512-vnni", 1: "avx2", 0: "portable"}


def int_dot_isa() -> str | None:
    """Which code the integer products (int8 activations x int8 / int4 weights) run on this
    host: ``"avx512-vnni"``, ``"avx2"`` or ``"portable"``; None without the library."""
    lib = library()
    return ISA_NAMES[lib.qi_isa()] if lib is not None else None


def amx_tiles(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the integer products may run on AMX tiles here (the ``camx`` linear path and
    the fused step's ``qamx``): the build holds them (``-march=native`` on a host listing
    amx_tile and amx_int8, its probe survived) and Linux granted this process the tile state
    (asked when the library loads: ``arch_prctl(ARCH_REQ_XCOMP_PERM)``). ``lib``: another
    build."""
    lib = lib or library()
    return lib is not None and lib.qa_enable() == 1


def panels_built(lib: ctypes.CDLL | None = None) -> bool:
    """Whether this host's build has the weight panels (``qr_pack`` / ``qr_linear``, and
    ``decode_layers``' qfmt 7 / 8): integer products with 16 weight rows in the vector lanes,
    AVX-512 VNNI builds only."""
    lib = lib or library()
    return lib is not None and lib.qr_bytes(1, 16, 32) > 0


def set_enabled(on: bool) -> None:
    """Turn the kernels on or off in this process (benchmarks' A/B; tests of the twins)."""
    global _lib, _tried
    _tried = True
    _lib = _load(build()) if on else None


def load(path: Path | None) -> ctypes.CDLL | None:
    """The library at ``path`` (a ``build``) loaded, its functions typed; None when it cannot
    be (logged). ``library()`` is this process's; tests load other builds with it."""
    return _load(path)


def _load(path: Path | None) -> ctypes.CDLL | None:
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, _RESTYPES.get(name)
    except (OSError, AttributeError) as e:
        log.warning("cannot load fused CPU kernels %s (using the torch paths): %s", path, e)
        return None
    # AMX tiles, where built in: asked for now, before any plan (a cached one may name them)
    # sends a step to them; a kernel asked for them without the grant runs the vector tiles.
    lib.qa_enable()
    return lib


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)


# ---- the kernels, each with its torch twin -----------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim of ``x [T, n]``."""
    lib = library()
    if lib is None or not _fits(x, weight) or not x.is_contiguous() or x.dim() != 2:
        return rms_norm_torch(x, weight, eps)
    out = torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                 eps, torch.get_num_threads())
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The skip connection then the next norm: ``h + delta`` and its ``rms_norm``. The sum
    may be written into ``h`` in place: the caller must own ``h`` (no other reader)."""
    lib = library()
    if (lib is None or not _fits(h, delta, weight) or not (h.is_contiguous() and delta.is_contiguous())
            or h.dim() != 2 or h.shape != delta.shape):
        h = h + delta
        return h, rms_norm_torch(h, weight, eps)
    out = torch.empty_like(h)
    lib.rms_norm(h.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(), h.shape[0],
                 h.shape[1], eps, torch.get_num_threads())
    return h, out


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers' LlamaRMSNorm: normalize in fp32, cast, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2I]`` = ``[gate | up]``; returns ``[T, I]``."""
    lib = library()
    if lib is None or not _fits(gate_up) or not gate_up.is_contiguous() or gate_up.dim() != 2:
        return silu_mul_torch(gate_up)
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, torch.get_num_threads())
    return out


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate the first ``heads`` heads of every row of ``x [T, >= heads * head_dim]`` in
    place (rotate-half convention; ``cos``/``sin``: ``[T, head_dim]``, halves equal). Returns
    False, touching nothing, when the kernel does not apply: the caller then uses
    ``rope_torch``."""
    lib = library()
    if (lib is None or not _fits(x, cos, sin) or x.dim() != 2 or x.stride(1) != 1
            or not (cos.is_contiguous() and sin.is_contiguous())):
        return False
    lib.rope(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos.data_ptr(),
             sin.data_ptr(), torch.get_num_threads())
    return True


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, heads, D]``; cos/sin: ``[T, 1, D]`` (as transformers' ``apply_rotary_pos_emb``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _linear_library(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> ctypes.CDLL | None:
    """The library, where a linear kernel takes these tensors (contiguous fp32 CPU, x 2-D)."""
    lib = library()
    if (lib is None or not _fits(x, weight) or x.dim() != 2 or not x.is_contiguous()
            or not weight.is_contiguous() or (bias is not None and not _fits(bias))):
        return None
    return lib


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for a few rows (``x [M, K]``, M small), each weight row streamed
    once; None, computing nothing, when the kernel does not apply (the caller runs another
    path). ``engine.ops.linear`` offers it as the ``"cgemv"`` linear path, timed like the others."""
    lib = _linear_library(x, weight, bias)
    if lib is None:
        return None
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    lib.gemv(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
             out.data_ptr(), m, n, k, torch.get_num_threads())
    return out


def wide_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor | None:
    """``x @ weight.T + bias`` (``x [M, K]``) by the wide tiles of ``decode_layers``: the rows
    of x in vector lanes, each weight scalar broadcast against all of them, each weight row
    streamed once (from a few rows up, no horizontal sums: ~2x the FMA rate of a dot-product
    loop at 32 rows). None, computing nothing, when the kernel does not apply.
    ``engine.ops.linear`` offers it as the ``"cwide"`` linear path, timed like the others."""
    lib = _linear_library(x, weight, bias)
    if lib is None:
        return None
    m, k = x.shape
    n = weight.shape[0]
    threads = torch.get_num_threads()
    out = torch.empty(m, n, dtype=x.dtype)
    work = torch.empty(lib.wide_linear_work_floats(m, k, threads))
    lib.wide_linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                    out.data_ptr(), m, n, k, work.data_ptr(), threads)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int,
                      out: torch.Tensor) -> bool:
    """Causal attention of a prefill chunk into ``out``: ``q [Lq, H, D]``, ``k``/``v``
    ``[start_pos + Lq, KVH, D]`` (the tokens before the chunk, then the chunk's), query row
    ``i`` at position ``start_pos + i`` attending keys ``0 .. start_pos + i``; ``out [Lq, H,
    D]``. Each row of the three may sit any number of floats apart (views into the fused QKV
    projection), the heads and dims contiguous. Returns False, writing nothing, when the
    kernel does not apply (the caller runs ``scaled_dot_product_attention``)."""
    lib = library()
    if lib is None or not _fits(q, k, v, out) or q.dim() != 3 or k.dim() != 3:
        return False
    lq, h, d = q.shape
    kvh = k.shape[1]
    if (d > MAX_HEAD_DIM or h % kvh or k.shape != v.shape or k.shape[0] != start_pos + lq
            or k.shape[2] != d or out.shape != q.shape or k.stride() != v.stride()
            or any(t.stride(2) != 1 or t.stride(1) != d for t in (q, k, v, out))):
        return False
    lib.prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0),
                          out.data_ptr(), out.stride(0), lq, start_pos, h, kvh, d, d ** -0.5,
                          torch.get_num_threads())
    return True


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In each row ``rows[r]`` of ``logits [N, vocab]`` (fp32), the tokens whose bit in
    ``bitmask[r]`` (int32 words, token i in bit i % 32 of word i // 32) is 0 become -inf, in
    place."""
    lib = library()
    if lib is None or not _fits(logits) or logits.dim() != 2 or logits.stride(1) != 1 \
            or bitmask.dtype != torch.int32 or not bitmask.is_contiguous():
        apply_bitmask_torch(logits, rows, bitmask)
        return
    index = torch.tensor(rows, dtype=torch.int64)
    lib.apply_bitmask(logits.data_ptr(), logits.stride(0), index.data_ptr(), len(rows),
                      bitmask.data_ptr(), bitmask.shape[1], logits.shape[1])


def apply_bitmask_torch(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    bitmask = bitmask.to(logits.device)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:len(rows), :, None] >> bits) & 1).reshape(len(rows), -1)
    allowed = allowed[:, :logits.shape[1]].bool()
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def decode_applies(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``paged_decode`` runs (rather than declines) for a model of these shapes."""
    return (library() is not None and dtype == torch.float32
            and num_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                 kv_lens: torch.Tensor, out: torch.Tensor) -> bool:
    """Decode attention for ``q [B, H, D]`` (rows may be strided: views of a fused QKV) over
    ``kv_cache [pages, 2, block_size, KVH, D]`` (fp32, or an int8 pool's rows of D + 4 bytes,
    ``engine.attention.kv_format``: read as stored) read in place through ``tables [B,
    max_pages]`` (int64) and ``kv_lens [B]`` (int64, each >= 1), into ``out [B, H, D]``
    (contiguous). Returns False, touching nothing, when the kernel does not apply (the
    caller's torch path runs instead)."""
    lib = library()
    b, h, d = q.shape
    kvh = kv_cache.shape[3]
    if (lib is None or not _fits(q, out) or not kv_cache.is_cpu
            or kv_cache.dtype not in KV_POOL_DTYPES or kv_cache.shape[4] != _row_width(d, kv_cache)
            or not kv_cache.is_contiguous()
            or not out.is_contiguous() or q.stride(2) != 1 or q.stride(1) != d
            or h // kvh > MAX_GROUP or d > MAX_HEAD_DIM):
        return False
    lib.paged_decode(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), tables.data_ptr(),
                     tables.shape[1], kv_lens.data_ptr(), out.data_ptr(), b, h, kvh, d,
                     kv_cache.shape[2], d ** -0.5, torch.get_num_threads(), _kvq(kv_cache))
    return True


# The pools the kernels read: fp32 values, or int8 rows with their scales (kvq 1).
KV_POOL_DTYPES = (torch.float32, torch.int8)


def _kvq(kv_cache: torch.Tensor) -> int:
    """The kernels' name for a pool's format: 0 fp32 rows, 1 int8 rows with their scales."""
    return int(kv_cache.dtype == torch.int8)


def _row_width(head_dim: int, kv_cache: torch.Tensor) -> int:
    return head_dim + KV_SCALE_BYTES if kv_cache.dtype == torch.int8 else head_dim


@dataclass(frozen=True)
class DecodeLayerShapes:
    """What ``decode_layers`` needs to know of the model besides its tensors."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


def decode_layers_applies(shapes: DecodeLayerShapes, dtype: torch.dtype) -> bool:
    """Whether ``decode_layers`` runs for a model of these shapes and dtype on this host."""
    return (decode_applies(shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, dtype)
            and shapes.head_dim % 2 == 0 and shapes.hidden % 2 == 0)


# Addresses per layer in decode_layers' table (DL_PTRS in the C source).
LAYER_POINTERS = 18
_TABLE_DTYPES = (torch.float32, torch.int8, torch.uint8, torch.float16)


def layer_pointers(layers: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The address table ``decode_layers`` walks: per layer (input norm, post norm, QKV weight,
    QKV bias or None, O weight, gate/up weight, down weight, query-head norm or None, key-head
    norm or None, KV cache, then for quantized weights the scales and offsets (int4; else
    None) of QKV, O, gate/up and down, all None for fp weights): ``LAYER_POINTERS`` each.
    Raises ValueError when a tensor is not contiguous on CPU in a dtype the kernel reads (fp32;
    int8 / uint8 weight data and fp16 scales of quantized weights). The caller must keep the
    tensors alive, unmoved, while the table is in use."""
    addrs = []
    for tensors in layers:
        if len(tensors) != LAYER_POINTERS:
            raise ValueError(f"decode_layers takes {LAYER_POINTERS} tensors a layer, "
                             f"got {len(tensors)}")
        for t in tensors:
            if t is None:
                addrs.append(0)
                continue
            if not (t.is_cpu and t.dtype in _TABLE_DTYPES and t.is_contiguous()):
                raise ValueError("decode_layers reads contiguous fp32 CPU tensors (and a "
                                 "quantized weight's int8 / uint8 data and fp16 scales) only")
            addrs.append(t.data_ptr())
    return torch.tensor(addrs, dtype=torch.int64)


def decode_layers(h: torch.Tensor, pointers: torch.Tensor, shapes: DecodeLayerShapes,
                  cos: torch.Tensor, sin: torch.Tensor, tables: torch.Tensor,
                  kv_lens: torch.Tensor, block_size: int, wide_from: int = NEVER_WIDE,
                  weights: tuple[int, int] = (0, 0), kv_int8: bool = False,
                  lora: torch.Tensor | None = None) -> bool:
    """Run a pure-decode step through every layer in one call: ``h [M, hidden]`` (one row per
    sequence, the embeddings; contiguous fp32, updated in place to the last layer's residual
    sum), each new token's K/V written into its cache slot (position ``kv_lens - 1`` of its
    page table). ``pointers``: ``layer_pointers``; ``cos``/``sin``: ``[M, head_dim]``;
    ``tables [M, max_pages]`` and ``kv_lens [M]`` int64 as for ``paged_decode``; from
    ``wide_from`` rows the projections run the kernel's wide tiles (rows in vector lanes, no
    horizontal sums), below it the dot-product tiles (same math, different summation order).
    ``weights``: the projections' layout, ``(0, 0)`` fp32, ``(1, group)`` int8, ``(2, 32)``
    int4 (``engine.quant.layouts``; the table then holds their data, scales and offsets), and
    ``(3, 32)`` / ``(4, 32)`` the same int8 / int4 weights multiplied by int8 activations
    (each projection's input quantized per 32 values: the integer products). ``kv_int8``: the
    table's caches are int8 pools (``engine.attention.kv_format``), written and read as
    stored (the same format for every layer). ``lora``: the step's LoRA adapters
    (``engine.lora.rows.LoRARows.kernel_table``), added to each projection's output; the
    projections then take the dot-product tiles whatever ``wide_from`` says. Returns False,
    touching nothing, when the kernel does not apply (the caller runs the layers itself)."""
    lib = library()
    if (lib is None or not _fits(h, cos, sin) or h.dim() != 2 or not h.is_contiguous()
            or not (cos.is_contiguous() and sin.is_contiguous())
            or not decode_layers_applies(shapes, h.dtype)
            or tables.dtype != torch.int64 or kv_lens.dtype != torch.int64
            or not (tables.is_contiguous() and kv_lens.is_contiguous())):
        return False
    m = h.shape[0]
    s = shapes
    threads = torch.get_num_threads()
    work = torch.empty(lib.decode_layers_work_floats(m, s.hidden, s.num_heads, s.num_kv_heads,
                                                     s.head_dim, s.intermediate, threads))
    lib.decode_layers(h.data_ptr(), pointers.data_ptr(), pointers.numel() // LAYER_POINTERS, m,
                      s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate,
                      cos.data_ptr(), sin.data_ptr(), tables.data_ptr(), tables.shape[1],
                      kv_lens.data_ptr(), block_size, s.eps, s.head_dim ** -0.5, wide_from,
                      weights[0], weights[1], int(kv_int8),
                      None if lora is None else lora.data_ptr(), work.data_ptr(), threads)
    return True


def main() -> None:
    """``python -m engine.ops.cpu_ops``: build this host's library now (``make setup`` runs it, so
    the first engine start does not compile). Never fails: without a compiler the torch twins
    serve, and the message says so."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = build()
    print(f"fused CPU kernels: {path}" if path else
          "fused CPU kernels: not built (see above); the torch paths will serve")


if __name__ == "__main__":
    main()
