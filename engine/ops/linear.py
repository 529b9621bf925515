"""The linear layer's kernel paths and the dispatch that follows this host's plan (``LinearPlan``).

A decode step is a handful of small-M GEMMs (M = batch size) that stream every weight once.
Which torch call runs them fastest depends on the host, and by a lot:

- ``F.linear``: MKL's GEMM (a single-threaded GEMV at M=1);
- ``mm_t``: ``mm(W, x.T)``, MKL's threaded transposed GEMM; on one 2-core AMD EPYC it took
  16 ms per pass over the default model's 538 MB at M=1 and ``F.linear`` 32 ms, while on an
  Intel Xeon with AVX-512 and AMX the same pass took 61 ms and 26 ms, the reverse;
- ``onednn``: oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``) on the same dense
  weight, no copy. oneDNN picks its kernels by the CPU's instructions, MKL does not on AMD: on
  a 2-core AMD EPYC with AVX-512 it ran the M=32 LM-head GEMM 2.7x faster than ``F.linear``;
- ``cgemv``: ``engine.ops.cpu_ops.gemv``, a plain loop streaming each weight row once (M <= 8);
  on that EPYC it streamed the model's weights at M=1 1.5-2x faster than either library;
- ``cwide``: ``engine.ops.cpu_ops.wide_linear``, the whole-step decode kernel's wide tiles (the
  rows of x in vector lanes, each weight scalar broadcast against all of them; decode buckets
  only); on that EPYC the LM head streamed from memory took 5.0 ms at M=32 against oneDNN's 8.1.

Quantized weights (``engine.quant.layouts.QuantizedWeight``, ``--quantization``) have their own paths,
``QPATHS``: ``cquant`` (``engine.ops.quant_ops.quantized_linear``: the weight read in its int8 / int4
layout, never expanded, against fp32 activations), ``cqint`` (``quant_ops.quantized_linear_int``:
the activations quantized to int8 per 32 values too, each block an integer dot product: AVX-512 VNNI
or AVX2 where the host runs them; from a few rows up the multiplies, not the bytes, bound a
step), ``camx`` (the same products on AMX tiles, ``cpu_ops.amx_tiles``: 16 rows x 16 weight
rows x 32 values an instruction, after packing each 16 weight rows per call; from ~16 rows),
``cqpanel`` (the same products with 16 weight rows in the vector lanes, on the weight
repacked in panels at first use, ``quant_ops.quantized_linear_panels``; AVX-512 VNNI hosts),
``cqwide`` (``quant_ops.quantized_linear_wide``: ``cwide``'s tiles, each tile of weight rows
expanded to fp32 as it is reached: fp32's multiply rate at large M with the quantized bytes
read; the LM head at 32 rows),
``dequant`` and ``dequant_onednn`` (expand into a scratch fp weight
in one pass, then ``F.linear`` or oneDNN's GEMM: where the GEMM's compute dwarfs the
expansion, i.e. prefill rows; which GEMM is the host's to say, as for fp weights). A plan's
entries are keyed by the weight's kind as well as its shape.

So nothing is hard-coded: ``engine.tuning.linear.tune_linear`` times the paths per weight shape
and batch bucket (the decode buckets, and ``PREFILL_ROWS`` rows for prefill) and the engine
makes the result this process's plan (``set_linear_plan``); ``linear`` then dispatches on it.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.ops import cpu_ops, quant_ops
from engine.quant.gpu import TinyGemmWeight
from engine.quant.layouts import QuantizedWeight

log = logging.getLogger(__name__)

# F.linear(x, W) | mm(W, x.T).T | oneDNN inner product | engine.ops.cpu_ops.gemv (small M only) |
# engine.ops.cpu_ops.wide_linear (decode buckets only)
PATHS = ("linear", "mm_t", "onednn", "cgemv", "cwide")
# For quantized weights: engine.ops.quant_ops.quantized_linear | its integer products (on AMX
# tiles | on the weight's panels) | the wide tiles on expanded tiles | expand, then F.linear | expand, then oneDNN's GEMM
# (where this torch has it).
QPATHS = ("cquant", "cqint", "camx", "cqpanel", "cqwide", "dequant", "dequant_onednn")
# The paths that round the activations to int8 (exact_activations rules them out)
INT_PATHS = ("cqint", "camx", "cqpanel")
FP = "fp"  # the kind of an unquantized weight in plans and timings
CGEMV_MAX_M = 8  # a loop with no blocking: offered (and timed) for the small buckets only
# Decode batch sizes tuned (the attention paths use the same buckets); a batch uses the
# largest bucket <= its M. From PREFILL_ROWS rows on it is a prefill GEMM: one more bucket.
M_BUCKETS = (1, 2, 4, 8, 16, 32)
PREFILL_ROWS = 128
LINEAR_BUCKETS = (*M_BUCKETS, PREFILL_ROWS)


@dataclass
class LinearPlan:
    """The chosen path per ``(n, k)`` weight shape, M bucket (``LINEAR_BUCKETS``) and weight
    kind (``FP`` or a quantized layout); anything not in the table (tiny weights, shapes or
    buckets not tuned) takes ``F.linear`` (a quantized weight ``cquant`` up to 32 rows,
    ``dequant`` past them)."""

    choices: dict[tuple[int, int, int, str], str] = field(default_factory=dict)
    timings: list = field(default_factory=list)  # engine.tuning.cache.Timing, one per key and bucket
    key: str = ""
    from_cache: bool = False
    # per key and bucket, the fastest timed path that multiplies fp32 activations as they are
    # (what exact_activations takes where the choice is one of INT_PATHS)
    exact_choices: dict[tuple[int, int, int, str], str] = field(default_factory=dict)

    def path(self, n: int, k: int, m: int, kind: str = FP) -> str:
        bucket = max((b for b in LINEAR_BUCKETS if b <= m), default=1)
        # untimed: a quantized weight's rows read in place up to 32 rows, expanded past them
        # (exact_path's measurements)
        return self.choices.get((n, k, bucket, kind), "linear" if kind == FP
                                else "cquant" if m <= 32 else "dequant")

    def exact_path(self, n: int, k: int, m: int, kind: str) -> str:
        """``path`` for a quantized weight with ``INT_PATHS`` ruled out: the fastest other path
        timed for the bucket (from ``PREFILL_ROWS`` rows an expanding one); untimed, ``cquant``
        up to 32 rows and ``dequant`` past them (measured on the default model's int4 shapes:
        at 16 rows cquant 47 ms a pass against dequant's 91, at 64 rows 181 against 138, at
        256 693 against 302)."""
        bucket = max((b for b in LINEAR_BUCKETS if b <= m), default=1)
        chosen = self.path(n, k, m, kind)
        if chosen not in INT_PATHS:
            return chosen
        return self.exact_choices.get((n, k, bucket, kind),
                                      "cquant" if m <= 32 else "dequant")

    def merged(self, other: LinearPlan) -> LinearPlan:
        """This plan with ``other``'s entries for the keys it lacks (a draft model's weights
        beside the served model's: one process, one plan); this plan's key and cache state."""
        return LinearPlan({**other.choices, **self.choices}, self.timings + other.timings,
                          self.key, self.from_cache, {**other.exact_choices,
                                                      **self.exact_choices})

    def summary(self) -> list[str]:
        """One line per weight shape: the path per bucket and the speed-up over the other."""
        lines = []
        shapes = sorted({(t.n, t.k, t.kind) for t in self.timings})
        for n, k, kind in shapes:
            parts = []
            for t in sorted((t for t in self.timings if (t.n, t.k, t.kind) == (n, k, kind)),
                            key=lambda t: t.m):
                chosen = _bucket_choice(t)
                others = [v for p, v in t.seconds.items() if p != chosen]
                if others:
                    parts.append(f"M={t.m}: {chosen} ({min(others) / t.seconds[chosen]:.2f}x)")
                else:
                    parts.append(f"M={t.m}: {chosen}")
            parts = parts or ["F.linear (not tuned)"]
            lines.append(f"W[{n}x{k}]{'' if kind == FP else ' ' + kind} " + ", ".join(parts))
        return lines

    @classmethod
    def from_timings(cls, timings: list, key: str = "", from_cache: bool = False) -> LinearPlan:
        """Each timed key and bucket on its fastest path (``timings``: ``Timing``s)."""
        exact = {}
        for t in timings:
            # past PREFILL_ROWS only the expanding paths: the bucket is timed at its first
            # row count, and cquant's cost grows with the rows where an expansion's does not
            floats = {p: s for p, s in t.seconds.items() if p not in INT_PATHS
                      and (t.m < PREFILL_ROWS or p.startswith("dequant"))}
            if t.kind != FP and floats:
                exact[(t.n, t.k, t.m, t.kind)] = min(floats, key=floats.get)
        return cls({(t.n, t.k, t.m, t.kind): _bucket_choice(t) for t in timings}, timings, key,
                   from_cache, exact)


def _bucket_choice(t) -> str:
    """The path a plan takes for one timed key and bucket: the fastest, except that a
    quantized weight's prompt bucket (``PREFILL_ROWS``) takes an expanding path or an integer
    product. The bucket is timed at its first row count, and a path that reads the quantized
    weight again for each tile of rows (``cquant``, ``cqwide``) grows with the rows where an
    expansion is paid once per call: on a 2-core AMD EPYC Zen 4 the default model's o_proj and
    down_proj timed ``cquant`` fastest at 128 rows and then took 1.9x fp32's time in a
    2,048-row prompt step (a batch of 32 64-token prompts: 3.35 s against fp32's 2.79)."""
    if t.kind == FP or t.m < PREFILL_ROWS:
        return t.best
    kept = {p: s for p, s in t.seconds.items() if p in INT_PATHS or p.startswith("dequant")}
    return min(kept, key=kept.get) if kept else t.best


_plan = LinearPlan()
# Set while a step holds prompt rows (engine.executor.model_runner): the integer products
# (INT_PATHS) then give way to the float ones, so a prompt's KV and first token are the
# dequantized weights' exactly. Measured on the default model: its answer to "What is the
# capital of France?" starts at a 0.3% near-tie in fp32 ("The" 25.33 vs "L" 25.24), which
# int8 activations flipped; decode steps after the prompt keep the faster products.
_exact = threading.local()


@contextmanager
def exact_activations(on: bool = True):
    """Within it (in this thread), quantized weights multiply fp32 activations as they are:
    a plan's ``cqint`` or ``camx`` runs as ``LinearPlan.exact_path`` says."""
    held = getattr(_exact, "on", False)
    _exact.on = on or held
    try:
        yield
    finally:
        _exact.on = held


@contextmanager
def plan_rows(rows: int | None):
    """Within it (in this thread), every ``linear`` takes the path its plan chose for
    ``rows`` rows, whatever its input's rows (None: its own). Speculative decoding's
    verifying steps run B sequences' drafts as more rows: each row then gets the arithmetic
    a decode step of B rows gives it."""
    held = getattr(_exact, "rows", None)
    _exact.rows = rows
    try:
        yield
    finally:
        _exact.rows = held


def set_linear_plan(plan: LinearPlan) -> None:
    """Make ``plan`` the one ``linear`` follows in this process (one host, one plan)."""
    global _plan
    _plan = plan


def linear_plan() -> LinearPlan:
    return _plan


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [M, K]`` by the path the host's plan chose for this
    weight shape (and kind) and M (``F.linear`` when untuned and on GPU; a quantized weight
    untuned: ``cquant`` up to 32 rows, ``dequant`` past them). Returns a contiguous ``[M, N]``."""
    n, k = weight.shape
    if isinstance(weight, TinyGemmWeight):  # int4 on CUDA (engine.quant.gpu)
        return weight.linear(x, bias)
    m = getattr(_exact, "rows", None) or x.shape[0]  # plan_rows
    if isinstance(weight, QuantizedWeight):
        path = _plan.path(n, k, m, weight.kind) if x.is_cpu else "dequant"
        if path in INT_PATHS and getattr(_exact, "on", False):
            path = _plan.exact_path(n, k, m, weight.kind)
        return quantized_linear_by_path(path, x, weight, bias)
    if not x.is_cpu:
        return F.linear(x, weight, bias)
    return linear_by_path(_plan.path(n, k, m), x, weight, bias)


def quantized_linear_by_path(path: str, x: torch.Tensor, weight: QuantizedWeight,
                             bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` of a quantized weight by the named path (one of ``QPATHS``); where the C
    kernel does not apply (not built, bf16 activations) ``dequant`` runs instead."""
    if path == "cquant":
        out = quant_ops.quantized_linear(x, weight, bias)
    elif path == "cqwide":
        out = quant_ops.quantized_linear_wide(x, weight, bias)
    elif path == "cqpanel":
        out = quant_ops.quantized_linear_panels(x, weight, bias)
    elif path in INT_PATHS:
        out = quant_ops.quantized_linear_int(x, weight, bias, amx=path == "camx")
    else:
        out = None
    if out is not None:
        return out
    w = quant_ops.dequantize(weight) if x.is_cpu and x.dtype == torch.float32 else None
    if w is None:
        return F.linear(x, weight.dequantize(x.dtype), bias)
    gemm = "onednn" if path == "dequant_onednn" and "onednn" in available_paths() else "linear"
    return linear_by_path(gemm, x, w, bias)


def weight_kind(weight: torch.Tensor | QuantizedWeight) -> str:
    return weight.kind if isinstance(weight, QuantizedWeight) else FP


def weight_key(weight: torch.Tensor | QuantizedWeight) -> tuple[int, int, str]:
    """What a plan keys a weight by: its shape and kind."""
    n, k = weight.shape
    return (n, k, weight_kind(weight))


def linear_by_path(path: str, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` by the named path (one of ``available_paths()``), whatever the plan says:
    what the tuning and the benchmarks time."""
    if path == "linear":
        return F.linear(x, weight, bias)
    if path == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if path in ("cgemv", "cwide"):
        out = (cpu_ops.gemv if path == "cgemv" else cpu_ops.wide_linear)(x, weight, bias)
        return out if out is not None else F.linear(x, weight, bias)
    return _mm_t(x, weight, bias)


_available: tuple[str, ...] | None = None


def available_paths() -> tuple[str, ...]:
    """The paths this torch build can run here: ``onednn`` only where torch has oneDNN and its
    inner product gives ``F.linear``'s answer on a probe (checked once per process)."""
    global _available
    if _available is None:
        paths = ["linear", "mm_t"]
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = torch.randn(3, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
            got = linear_by_path("onednn", x, w, b)
            if torch.backends.mkldnn.is_available() and torch.allclose(got, F.linear(x, w, b), atol=1e-4):
                paths.append("onednn")
        except (RuntimeError, AttributeError) as e:  # no such op in this build
            log.info("oneDNN linear unavailable: %s", e)
        for path, kernel in (("cgemv", cpu_ops.gemv), ("cwide", cpu_ops.wide_linear)):
            got = kernel(x, w, b)  # None where the fused kernels are not built
            if got is not None and torch.allclose(got, F.linear(x, w, b), atol=1e-4):
                paths.append(path)
        _available = tuple(paths)
    return _available


def _mm_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    # MKL sends a one-column product back to its GEMV: give it two columns (the row twice;
    # cat, not repeat: 1 us instead of 7 at this size, 91 times a step).
    rows = torch.cat((x, x)) if m == 1 else x
    out = torch.mm(weight, rows.t())[:, :m].t().contiguous()  # [M, N]
    return out if bias is None else out + bias
