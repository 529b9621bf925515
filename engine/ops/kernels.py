"""Per-host choice of the linear-layer kernel: timed at start-up, cached per host.

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
layout, never expanded), ``dequant`` and ``dequant_onednn`` (expand into a scratch fp weight
in one pass, then ``F.linear`` or oneDNN's GEMM: where the GEMM's compute dwarfs the
expansion, i.e. prefill rows; which GEMM is the host's to say, as for fp weights). They are timed the same way; a
plan's entries are keyed by the weight's kind as well as its shape.

So nothing is hard-coded: for every weight shape of the model and every batch bucket (the
decode buckets, and ``PREFILL_ROWS`` rows for prefill), ``tune_linear`` times the paths on the
model's own weights in step order (every weight streamed from memory, as in a real step) and
keeps the fastest; ``linear`` then dispatches on the table.

The table is cached in ``{cache_dir}/kernels/linear-<key>.json``, the key naming the CPU model,
torch version, thread count, dtype, shapes and the paths this torch offers, so a second start
on the same host pays nothing and a different host (or thread count) tunes afresh. ``pdcluster
bench ceilings`` prints the table and the timings behind it.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.ops import cpu_ops, quant_ops
from engine.quant.gpu import TinyGemmWeight
from engine.quant.layouts import QuantizedWeight

log = logging.getLogger(__name__)

# F.linear(x, W) | mm(W, x.T).T | oneDNN inner product | engine.ops.cpu_ops.gemv (small M only) |
# engine.ops.cpu_ops.wide_linear (decode buckets only)
PATHS = ("linear", "mm_t", "onednn", "cgemv", "cwide")
# For quantized weights: engine.ops.quant_ops.quantized_linear | expand, then F.linear | expand,
# then oneDNN's GEMM (where this torch has it).
QPATHS = ("cquant", "dequant", "dequant_onednn")
FP = "fp"  # the kind of an unquantized weight in plans and timings
CGEMV_MAX_M = 8  # a loop with no blocking: offered (and timed) for the small buckets only
# Decode batch sizes tuned (the attention paths use the same buckets); a batch uses the
# largest bucket <= its M. From PREFILL_ROWS rows on it is a prefill GEMM: one more bucket.
M_BUCKETS = (1, 2, 4, 8, 16, 32)
PREFILL_ROWS = 128
LINEAR_BUCKETS = (*M_BUCKETS, PREFILL_ROWS)
# Weights smaller than this are not worth a timing (and fit in cache, so timing them lies).
MIN_TUNED_BYTES = 256 << 10
DEFAULT_CACHE_DIR = Path("~/.cache/pdcluster")
_REPEATS = 2
# Small-M passes are short (~20 ms for the default model) and the paths differ there by a few
# percent: more repeats, so the choice is not one noisy sample's.
_SMALL_M, _SMALL_M_REPEATS = 8, 5


@dataclass(frozen=True)
class Timing:
    """Median seconds per call of each path for one weight shape and one M bucket."""

    n: int
    k: int
    m: int
    seconds: dict[str, float]
    kind: str = FP  # "fp", or the quantized layout ("int8", "int4")

    @property
    def best(self) -> str:
        return min(self.seconds, key=self.seconds.get)


@dataclass
class LinearPlan:
    """The chosen path per ``(n, k)`` weight shape, M bucket (``LINEAR_BUCKETS``) and weight
    kind (``FP`` or a quantized layout); anything not in the table (tiny weights, shapes or
    buckets not tuned) takes ``F.linear`` (a quantized weight ``cquant``)."""

    choices: dict[tuple[int, int, int, str], str] = field(default_factory=dict)
    timings: list[Timing] = field(default_factory=list)
    key: str = ""
    from_cache: bool = False

    def path(self, n: int, k: int, m: int, kind: str = FP) -> str:
        bucket = max((b for b in LINEAR_BUCKETS if b <= m), default=1)
        return self.choices.get((n, k, bucket, kind), "linear" if kind == FP else "cquant")

    def summary(self) -> list[str]:
        """One line per weight shape: the path per bucket and the speed-up over the other."""
        lines = []
        shapes = sorted({(t.n, t.k, t.kind) for t in self.timings})
        for n, k, kind in shapes:
            parts = []
            for t in sorted((t for t in self.timings if (t.n, t.k, t.kind) == (n, k, kind)),
                            key=lambda t: t.m):
                other = min(v for p, v in t.seconds.items() if p != t.best)
                parts.append(f"M={t.m}: {t.best} ({other / t.seconds[t.best]:.2f}x)")
            parts = parts or ["F.linear (not tuned)"]
            lines.append(f"W[{n}x{k}]{'' if kind == FP else ' ' + kind} " + ", ".join(parts))
        return lines

    @classmethod
    def from_timings(cls, timings: list[Timing], key: str = "", from_cache: bool = False
                     ) -> LinearPlan:
        return cls({(t.n, t.k, t.m, t.kind): t.best for t in timings}, timings, key, from_cache)


_plan = LinearPlan()


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
    untuned: ``cquant``). Returns a contiguous ``[M, N]``."""
    n, k = weight.shape
    if isinstance(weight, TinyGemmWeight):  # int4 on CUDA (engine.quant.gpu)
        return weight.linear(x, bias)
    if isinstance(weight, QuantizedWeight):
        path = _plan.path(n, k, x.shape[0], weight.kind) if x.is_cpu else "dequant"
        return quantized_linear_by_path(path, x, weight, bias)
    if not x.is_cpu:
        return F.linear(x, weight, bias)
    return linear_by_path(_plan.path(n, k, x.shape[0]), x, weight, bias)


def quantized_linear_by_path(path: str, x: torch.Tensor, weight: QuantizedWeight,
                             bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` of a quantized weight by the named path (one of ``QPATHS``); where the C
    kernel does not apply (not built, bf16 activations) ``dequant`` runs instead."""
    if path == "cquant":
        out = quant_ops.quantized_linear(x, weight, bias)
        if out is not None:
            return out
    w = quant_ops.dequantize(weight) if x.is_cpu and x.dtype == torch.float32 else None
    if w is None:
        return F.linear(x, weight.dequantize(x.dtype), bias)
    gemm = "onednn" if path == "dequant_onednn" and "onednn" in available_paths() else "linear"
    return linear_by_path(gemm, x, w, bias)


def weight_kind(weight: torch.Tensor | QuantizedWeight) -> str:
    return weight.kind if isinstance(weight, QuantizedWeight) else FP


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


# ---- tuning ---------------------------------------------------------------------------------
def host_key(shapes: Iterable[tuple], dtype: torch.dtype, extra: str = "") -> str:
    """Names what the timings depend on: CPU model, torch, threads, dtype, shapes, the paths
    on offer, and ``extra`` (e.g. which build of a kernel library was timed)."""
    parts = [_cpu_model(), torch.__version__, str(torch.get_num_threads()), str(dtype),
             ",".join("x".join(map(str, s)) for s in sorted(set(shapes))),
             ",".join(map(str, LINEAR_BUCKETS)),
             ",".join(available_paths()), extra]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def weight_key(weight: torch.Tensor | QuantizedWeight) -> tuple[int, int, str]:
    """What a plan keys a weight by: its shape and kind."""
    n, k = weight.shape
    return (n, k, weight_kind(weight))


def time_passes(weights: list, m: int, choice: dict[tuple[int, int, str], str],
                repeats: int = _REPEATS, warm_up: bool = False) -> float:
    """Seconds for one pass of ``m`` rows through every weight in ``weights``, in that order,
    each by ``choice[weight_key(w)]``: the weight traffic of a decode step of batch ``m`` (the
    best of ``repeats`` passes, after one untimed pass with ``warm_up``: interference only
    ever adds time)."""
    dtype = weights[0].dtype
    xs = {k: torch.randn(m, k, dtype=dtype) for k in {w.shape[1] for w in weights}}
    calls = []
    for w in weights:
        key = weight_key(w)
        if key[2] == FP:
            calls.append((linear_by_path, xs[w.shape[1]], w, choice.get(key, "linear")))
        else:
            calls.append((quantized_linear_by_path, xs[w.shape[1]], w, choice.get(key, "cquant")))

    def one_pass() -> None:
        for fn, x, w, path in calls:
            fn(path, x, w, None)

    if warm_up:
        one_pass()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - t0)
    return best


def _paths_for(kind: str, m: int, dtype: torch.dtype) -> list[str]:
    """The paths timed for a weight of ``kind`` at bucket ``m``."""
    if kind != FP:
        paths = ["cquant"] if cpu_ops.enabled() and dtype == torch.float32 else []
        return paths + ["dequant"] + (["dequant_onednn"] if "onednn" in available_paths() else [])
    # mm_t exists for small M (MKL's GEMV at M=1); on prefill rows it only costs tuning time.
    return [p for p in available_paths() if (m < PREFILL_ROWS or p not in ("mm_t", "cwide"))
            and (m <= CGEMV_MAX_M or p != "cgemv")]


def time_choices(weights: list, buckets: Iterable[int] | None = None,
                 repeats: int = _REPEATS) -> list[Timing]:
    """Per M bucket, choose each weight's path (per shape and kind) by timing whole passes
    over the model's own weights (so each call streams its weight from memory as in a real
    step, and the libraries' threading behaves as it does there): start from the path whose
    uniform pass is fastest (quantized weights: ``cquant`` for decode buckets, ``dequant``
    for prefill rows), then try each weight key on each other path, keeping a change when the
    pass gets faster than the current choice timed in the same rounds. One ``Timing`` per key
    and bucket: the pass time with that key on each path. Small-M passes are short and close:
    the best of more repeats. The prefill bucket's passes are long (and steady): timed once
    each."""
    dtype = weights[0].dtype
    keys = sorted({weight_key(w) for w in weights
                   if (w.nbytes if isinstance(w, QuantizedWeight)
                       else w.numel() * w.element_size()) >= MIN_TUNED_BYTES})
    fp_keys = [key for key in keys if key[2] == FP]
    out = []
    for m in LINEAR_BUCKETS if buckets is None else buckets:
        reps = 1 if m >= PREFILL_ROWS else max(repeats, _SMALL_M_REPEATS) if m <= _SMALL_M else repeats
        start = "cquant" if m < PREFILL_ROWS and cpu_ops.enabled() else "dequant"
        choice = {key: start for key in keys if key[2] != FP}
        if fp_keys:
            paths = _paths_for(FP, m, dtype)
            uniform = _interleaved(weights, m, {p: {**choice, **dict.fromkeys(fp_keys, p)}
                                                for p in paths}, reps, warm_up=True)
            choice.update(dict.fromkeys(fp_keys, min(uniform, key=uniform.get)))
        for key in keys:
            # The incumbent is timed again beside each trial, interleaved with it: compared
            # with a figure from earlier (a quieter moment), every trial looked faster and
            # noise chose the plan.
            trials = {p: {**choice, key: p} for p in _paths_for(key[2], m, dtype)}
            seconds = _interleaved(weights, m, trials, reps, warm_up=not fp_keys)
            out.append(Timing(key[0], key[1], m, seconds, key[2]))
            choice[key] = min(seconds, key=seconds.get)
    return out


def _interleaved(weights: list[torch.Tensor], m: int, choices: dict[str, dict], repeats: int,
                 warm_up: bool = False) -> dict[str, float]:
    """Best pass time of each named choice, timed in rounds (A B C A B C ...) so a noisy
    spell hits every candidate alike."""
    best = {}
    for r in range(repeats):
        for name, choice in choices.items():
            t = time_passes(weights, m, choice, 1, warm_up=warm_up and r == 0)
            best[name] = min(best.get(name, t), t)
    return best


def tune_linear(weights: list, cache_dir: str | Path | None = None) -> LinearPlan:
    """The plan for a model whose linear weights are ``weights`` (in the order a step calls
    them: ``model_linear_weights``) on this host: from the cache when this host (CPU, torch,
    threads, dtype) tuned these shapes before, else timed now and cached (for the default
    model 30 s at 2 threads and 55 s at 1 on a 2-vCPU host: ``make setup`` times the default
    thread counts ahead, ``engine.tuning.pretune``). Weights under ``MIN_TUNED_BYTES`` are not timed (``F.linear``)."""
    shapes = sorted({weight_key(w) for w in weights})
    # The kernel library's build is part of the key: its paths' speed is that build's.
    key = host_key(shapes, weights[0].dtype, f"cpu_ops {cpu_ops.build_id()}")
    timings, from_cache = cached_timings("linear", key, lambda: time_choices(weights), cache_dir)
    plan = LinearPlan.from_timings(timings, key, from_cache)
    if not from_cache:
        log.info("linear kernels tuned for this host: %s",
                 "; ".join(plan.summary()) or "nothing worth tuning")
    return plan


class NotCached(LookupError):
    """Raised by ``cached_timings`` under ``cache_only`` when this host has no entry."""


_CACHE_ONLY = contextvars.ContextVar("pdcluster_kernels_cache_only", default=False)


@contextlib.contextmanager
def cache_only():
    """Inside: ``cached_timings`` reads the cache and raises NotCached instead of timing."""
    token = _CACHE_ONLY.set(True)
    try:
        yield
    finally:
        _CACHE_ONLY.reset(token)


def cached_timings(kind: str, key: str, measure: Callable[[], list[Timing]],
                   cache_dir: str | Path | None = None) -> tuple[list[Timing], bool]:
    """``measure()``'s timings, cached in ``{cache_dir}/kernels/{kind}-{key}.json``, and
    whether they came from the cache. One process measures at a time (a file lock): workers
    starting together on one host would time each other's memory traffic; the others wait,
    then read its result."""
    path = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "kernels" / f"{kind}-{key}.json"
    cached = _read_timings(path, key)
    if cached is not None:
        return cached, True
    if _CACHE_ONLY.get():
        raise NotCached(f"{kind}-{key}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")  # noqa: SIM115 (held across the measuring)
    except OSError as e:
        log.warning("cannot cache kernel timings in %s: %s", path.parent, e)
        return measure(), False
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read_timings(path, key)
        if cached is not None:
            return cached, True
        timings = measure()
        try:
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, "timings": [asdict(t) for t in timings]}))
            tmp.replace(path)  # atomic: a reader never sees half a file
        except OSError as e:
            log.warning("cannot cache kernel timings at %s: %s", path, e)
        return timings, False


def _read_timings(path: Path, key: str) -> list[Timing] | None:
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
            return [Timing(**t) for t in data["timings"]]
    except (OSError, ValueError, TypeError, KeyError):
        pass  # missing or unreadable: measure again
    return None


def model_linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's linear weights in the order a step calls them: every layer's fused QKV and
    output projections, then its feed-forward's (a dense layer's fused gate/up and down; a
    routed-experts layer's router, each expert's gate/up and down, and a shared expert's
    gate/up, down and gate), then the LM head (the embedding when tied). Each expert's weights
    are listed once (a step at a large batch streams them all), so a plan covers every shape
    ``engine.models.moe`` multiplies by. Quantized weights are listed as they are held."""
    out = []
    for layer in getattr(model, "layers", []):
        out += [layer.qkv.weight, layer.o_proj.weight]
        moe = getattr(layer, "moe", None)
        if moe is None:
            out += [layer.gate_up.weight, layer.down.weight]
            continue
        # Stacked [E, ...] tensors (or, quantized, lists): expert e's weights are item e.
        out.append(moe.router)
        for gate_up, down in zip(moe.gate_up, moe.down, strict=True):
            out += [gate_up, down]
        if moe.shared is not None:
            out += [moe.shared["gate_up"], moe.shared["down"], moe.shared["gate"]]
    head = getattr(model, "lm_head", None)
    out.append(head.weight if head is not None else model.embed.weight)
    return [w.detach() for w in out]
