"""Timing the linear layer's kernel paths on a model's own weights into this host's ``LinearPlan``.

For every weight shape of the model and every batch bucket (the decode buckets, and
``PREFILL_ROWS`` rows for prefill), ``tune_linear`` times the paths of ``engine.ops.linear`` on the
model's own weights in step order (every weight streamed from memory, as in a real step) and
keeps the fastest. The table is cached per host (``engine.tuning.cache``, kind ``linear``), the key
naming the CPU model, torch version, thread count, dtype, shapes, the paths this torch offers
and the C kernels' build. ``pdcluster bench ceilings`` prints the table and the timings behind it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from engine.ops import cpu_ops
from engine.ops.linear import (
    CGEMV_MAX_M,
    FP,
    LINEAR_BUCKETS,
    PREFILL_ROWS,
    LinearPlan,
    available_paths,
    linear_by_path,
    quantized_linear_by_path,
    weight_key,
)
from engine.quant.layouts import QuantizedWeight
from engine.tuning.cache import Timing, cached_timings, host_key

log = logging.getLogger(__name__)

# Weights smaller than this are not worth a timing (and fit in cache, so timing them lies).
MIN_TUNED_BYTES = 256 << 10
# camx packs each 16 weight rows per call, a cost the batch's rows share: on the Intel Xeon
# it lost to cqint below 16 rows (8 rows: 14.4 ms a pass over the default model's int8
# weights against 10.6; 16: 14.5 against 18.5), so smaller buckets do not time it.
AMX_MIN_ROWS = 16
# cqwide expands each tile of 12 weight rows per call, a cost the batch's rows share (as the
# fp cwide path, decode buckets only).
QWIDE_MIN_ROWS = 8
_REPEATS = 2
# Small-M passes are short (~20 ms for the default model) and the paths differ there by a few
# percent: more repeats, so the choice is not one noisy sample's.
_SMALL_M, _SMALL_M_REPEATS = 8, 5


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
        # cqint takes groups of 32 (every layout made here or from a GGUF); another group
        # falls back to dequant inside the path, and the timing shows it.
        paths = ["cquant", "cqint"] if cpu_ops.enabled() and dtype == torch.float32 else []
        if paths and m >= AMX_MIN_ROWS and cpu_ops.amx_tiles():
            paths.append("camx")
        if paths and m < PREFILL_ROWS and cpu_ops.panels_built():
            paths.append("cqpanel")
        if paths and QWIDE_MIN_ROWS <= m < PREFILL_ROWS:
            paths.append("cqwide")
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
