"""Timing the whole-step decode kernel against the layer-by-layer step into this host's ``FusedDecodePlan``.

Both are timed on whole decode steps of the model at start-up, per batch bucket up to
``FUSED_BUCKETS[-1]``, interleaved in rounds, and the faster kept; cached per host like the
linear kernels (``engine.tuning.cache``, kind ``fused-decode``). The layer-by-layer side runs the
linear plan in force (``engine.tuning.linear`` times those paths per shape) and the torch
backend's decode attention by the given ``DecodePaths``.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from pathlib import Path

import torch

from engine.attention.backend import SeqSlice, build_metadata
from engine.attention.torch_paged import DecodePaths, TorchPagedBackend, decode_tables
from engine.executor.fused_decode import FUSED_BUCKETS, STEPS, FusedDecodePlan
from engine.ops import cpu_ops
from engine.ops.linear import linear_plan
from engine.tuning.cache import Timing, cached_timings, host_key
from engine.tuning.linear import AMX_MIN_ROWS, QWIDE_MIN_ROWS

log = logging.getLogger(__name__)

TUNE_CONTEXT = 128  # tokens each timed sequence attends to (fewer if the model's context is shorter)
# Interleaved rounds; the median of each. The best of 7 chose the layer-by-layer step at
# batch 1 once (13.4 vs 13.9 ms) where steps measured 14.5 fused vs 18 ms layer by layer:
# a single quiet sample says little about a step's usual time (on 2 vCPUs one preempted
# thread stalls a whole fused step at its barriers), so the median of more rounds decides.
_ROUNDS = 15


def tune_fused_decode(model: torch.nn.Module, block_size: int, decode_paths: DecodePaths,
                      cache_dir: str | Path | None = None) -> FusedDecodePlan:
    """Time a pure-decode step of ``model`` layer by layer (attention by ``decode_paths``, the
    linear layers by the plan in force) against ``decode_layers``, at each bucket, interleaved
    in rounds (the linear layers by ``engine.ops.linear.linear_plan()``: set the host's plan
    first); cached per host, thread count, model shapes and kernel build. Runs on scratch
    KV caches of its own (a few MB). Returns an empty plan where the kernel does not apply."""
    cfg = model.cfg
    dtype = model.embed.weight.dtype
    if (cfg.num_experts or cfg.sandwich_norms
            or not cpu_ops.decode_layers_applies(model.layer_shapes, dtype)):
        # routed experts or Gemma's layer: the layer path (the kernel has neither)
        return FusedDecodePlan()
    shapes = [(cfg.num_layers, cfg.hidden_size), (cfg.intermediate_size, cfg.head_dim),
              (cfg.num_heads, cfg.num_kv_heads), (block_size, _context(model))]
    # The layer-by-layer side runs the linear and attention plans in force: part of the key.
    # Qwen3's q/k norms are part of the timed step: named where present; so are quantized
    # weights (their kernels' speed against the layer path differs from fp weights' by batch:
    # an fp model's plan once sent a quantized model's batch-32 steps to the fused kernel at
    # half the speed of the layer path).
    key = host_key(shapes, dtype, f"fused-decode|{cpu_ops.build_id()}|{linear_plan().key}|"
                                  f"{sorted(decode_paths.choices.items())}"
                                  + ("|qk_norm" if cfg.qk_norm else "")
                                  + (f"|{model.quantization}" if model.quantization else ""))
    timings, from_cache = cached_timings(
        "fused-decode", key, lambda: _measure(model, block_size, decode_paths), cache_dir)
    plan = FusedDecodePlan({t.m: t.best for t in timings}, timings, from_cache)
    if not from_cache:
        log.info("whole-step decode kernel timed for this host: %s", "; ".join(plan.summary()))
    return plan


def _context(model: torch.nn.Module) -> int:
    """Tokens each timed sequence attends to: ``TUNE_CONTEXT``, or the model's whole context
    (its rotary table's length) where that is shorter."""
    return min(TUNE_CONTEXT, model.rope_cos.shape[0])


@torch.inference_mode()
def _measure(model: torch.nn.Module, block_size: int, decode_paths: DecodePaths) -> list[Timing]:
    cfg = model.cfg
    dtype = model.embed.weight.dtype
    context = _context(model)
    quantized = bool(model.quantization)
    pages_per_seq = -(-context // block_size)
    num_pages = FUSED_BUCKETS[-1] * pages_per_seq
    caches = [torch.randn(num_pages, 2, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
              for _ in range(cfg.num_layers)]
    backend = TorchPagedBackend()
    backend.decode_paths = decode_paths
    out = []
    for m in FUSED_BUCKETS:
        seqs = [SeqSlice(range(i * pages_per_seq, (i + 1) * pages_per_seq), context - 1, 1)
                for i in range(m)]
        meta = build_metadata(seqs, block_size)
        ids = torch.randint(cfg.vocab_size, (m,))

        def layers(meta=meta, ids=ids) -> None:
            backend.plan(meta)
            model(ids, meta.positions, caches, backend)

        def fused(meta=meta, ids=ids, wide_from=cpu_ops.NEVER_WIDE, ints=False,
                  amx=False, panels=False) -> None:
            tables, kv_lens = decode_tables(meta)
            model.decode_fused(ids, meta.positions, caches, tables, kv_lens, block_size,
                               wide_from, ints, amx, panels=panels)

        wide = functools.partial(fused, wide_from=1)
        steps = {"layers": layers, "fused": fused, "wide": wide, "qwide": wide,
                 "qint": functools.partial(fused, ints=True),
                 "qamx": functools.partial(fused, ints=True, amx=True),
                 "qpanel": functools.partial(fused, ints=True, panels=True)}
        # "wide" for fp weights, "qwide" (the same tiles on expanded weights, from the rows
        # where the expansion can pay) and the integer products for quantized weights (on AMX
        # tiles where the host runs them, from the rows where they can win)
        skip = ("qint", "qamx", "qwide", "qpanel") if not quantized else ("wide",)
        names = [n for n in STEPS if n not in skip
                 and (n != "qamx" or (m >= AMX_MIN_ROWS and cpu_ops.amx_tiles()))
                 and (n != "qwide" or m >= QWIDE_MIN_ROWS)
                 and (n != "qpanel" or model.panels_apply())]
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(_ROUNDS + 1):  # round 0 warms every step up, untimed
            for name in names:
                step = steps[name]
                t0 = time.perf_counter()
                step()
                if r:
                    times[name].append(time.perf_counter() - t0)
        out.append(Timing(context, 0, m, {k: statistics.median(v) for k, v in times.items()}))
    return out
