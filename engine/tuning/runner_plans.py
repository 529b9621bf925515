"""A model runner's kernel choices per torch thread count: timed (or read from the host's
cache) at start-up, switched when the engine's thread count changes (engine.runtime.cpu_threads).

Why per count: a plan timed at 2 threads and run at 1 chose paths that are slower there (the
default model's batch-1 decode step at 1 thread: 29.0 ms on the 2-thread plan, 24.9 ms on its own;
docs/history/2026-12-06-wave-4.md, "Speed beside a neighbour"). The engine's own count is timed as
before; the lower counts it may drop to come from the cache only (``make setup`` times 1 thread and
every core for the default model, ``engine.tuning.pretune``; timing them at a neighbour's mercy
would cache wrong answers), and a count without cached plans keeps the current ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.torch_tuning import tune_decode_paths, tune_prefill_paths
from engine.ops.linear import LinearPlan, linear_plan, set_linear_plan
from engine.tuning.cache import NotCached, cache_only
from engine.tuning.fused_decode import tune_fused_decode
from engine.tuning.linear import model_linear_weights, tune_linear

log = logging.getLogger(__name__)

__all__ = ["RunnerPlans", "plans_by_threads", "tune_runner"]


@dataclass(frozen=True)
class RunnerPlans:
    """The kernel choices a runner steps with: the linear plan (process-wide), decode and
    prefill attention paths, the fused decode step's batches (None: that part untuned)."""

    linear: Any
    decode_paths: Any = None
    prefill_paths: Any = None
    fused_decode: Any = None

    @classmethod
    def current(cls, runner) -> RunnerPlans:
        backend = runner.attn_backend
        return cls(linear_plan(), getattr(backend, "decode_paths", None),
                   getattr(backend, "prefill_paths", None), runner.fused_decode)

    def apply(self, runner) -> None:
        set_linear_plan(self.linear)
        if self.decode_paths is not None:
            runner.attn_backend.decode_paths = self.decode_paths
        if self.prefill_paths is not None:
            runner.attn_backend.prefill_paths = self.prefill_paths
        if self.fused_decode is not None:
            runner.fused_decode = self.fused_decode


def tune_runner(args, plan, model, runner) -> None:
    """Time this host's kernel paths for ``model``'s shapes (CPU, ``tune_kernels``) at torch's
    current thread count: linear layers, decode and prefill attention, the fused decode step.
    Every rank of a tensor-parallel engine tunes its own shard's shapes."""
    if plan.device.type != "cpu":
        return
    if not args.tune_kernels:  # untuned: F.linear (a quantized weight cquant), whatever an
        set_linear_plan(LinearPlan())  # engine before this one in the process had chosen
        return
    set_linear_plan(tune_linear(model_linear_weights(model)))
    if plan.attention_backend != "torch":
        return
    cfg, dtype = model.cfg, getattr(torch, model.cfg.dtype)
    runner.attn_backend.decode_paths = tune_decode_paths(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, args.block_size, dtype)
    runner.attn_backend.prefill_paths = tune_prefill_paths(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype)
    if model.comm is None:  # the fused step has no collectives: one rank only
        runner.fused_decode = tune_fused_decode(model, args.block_size,
                                                runner.attn_backend.decode_paths)


def plans_by_threads(args, plan, model, runner, counts: range) -> dict[int, RunnerPlans]:
    """The runner's plans at torch's current count (already tuned) and at each of ``counts``
    whose plans this host has cached; torch's count and the runner's plans are left as found."""
    here = torch.get_num_threads()
    plans = {here: RunnerPlans.current(runner)}
    if plan.device.type != "cpu" or not args.tune_kernels:
        return plans
    try:
        for n in counts:
            if n == here:
                continue
            torch.set_num_threads(n)
            try:
                with cache_only():
                    tune_runner(args, plan, model, runner)
                plans[n] = RunnerPlans.current(runner)
            except NotCached:
                log.info("no cached kernel plans at %d thread(s) on this host: the engine keeps "
                         "its %d-thread plans there (python -m engine.tuning.pretune --threads %d)",
                         n, here, n)
    finally:
        torch.set_num_threads(here)
        plans[here].apply(runner)
    return plans
