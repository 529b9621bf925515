"""Where one engine decode step's time goes, by layer of the stack (``bench kernels`` prints it).

Wraps, for the duration of a measurement only, the calls that bound each layer: the
scheduler's ``schedule`` and ``update_from_output``, the model runner's ``execute``, the
model's ``forward`` and ``compute_logits``, every linear-kernel call (``engine.ops.linear.linear_by_path``)
and every fused CPU kernel (``engine.ops.cpu_ops``). A step that runs as one whole-step call
(``engine.executor.fused_decode``) has its GEMMs inside that call: they count as C kernels then. What is left of the step outside the model
(forward + logits) is the scheduler and the Python around the model: input preparation,
sampling, output bookkeeping. The wrappers add ~1 us per wrapped call (~250 calls a step).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

CPU_KERNELS = ("rms_norm", "add_rms_norm", "silu_mul", "rope_", "paged_decode", "decode_layers")


@dataclass(frozen=True)
class StepSplit:
    """Mean milliseconds per decode step, and the shares that matter."""

    step_ms: float
    gemm_ms: float  # every linear layer, the LM head included
    cpu_kernels_ms: float  # the fused C kernels
    other_model_ms: float  # the rest of forward + logits: torch ops and Python in the model
    outside_model_ms: float  # scheduler, input preparation, sampling, bookkeeping
    scheduler_ms: float  # schedule + update_from_output (part of outside_model_ms)

    @property
    def outside_model_share(self) -> float:
        return self.outside_model_ms / self.step_ms

    def line(self) -> str:
        s = self.step_ms
        return (f"step {s:.1f} ms = GEMMs {self.gemm_ms:.1f} ({self.gemm_ms / s:.0%}) + C kernels "
                f"{self.cpu_kernels_ms:.1f} ({self.cpu_kernels_ms / s:.0%}) + other model ops "
                f"{self.other_model_ms:.1f} ({self.other_model_ms / s:.0%}) + scheduler and "
                f"Python outside the model {self.outside_model_ms:.1f} "
                f"({self.outside_model_share:.1%}; scheduler alone {self.scheduler_ms:.2f})")


def measure_step_split(engine, steps: int = 10) -> StepSplit:
    """Run ``steps`` engine steps (the caller has a full decode batch running) and split them."""
    import engine.ops.linear as linear_ops
    from engine.ops import cpu_ops

    acc: dict[str, float] = defaultdict(float)
    patched: list[tuple[object, str, object, bool]] = []

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)
        own = name in getattr(obj, "__dict__", {})

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t0

        patched.append((obj, name, fn, own))
        setattr(obj, name, timed)

    runner = engine.runner
    wrap(engine.scheduler, "schedule", "scheduler")
    wrap(engine.scheduler, "update_from_output", "scheduler")
    wrap(runner.model, "forward", "model")
    wrap(runner.model, "decode_fused", "model")
    wrap(runner.model, "compute_logits", "model")
    wrap(linear_ops, "linear_by_path", "gemm")
    for name in CPU_KERNELS:
        wrap(cpu_ops, name, "cpu")
    try:
        engine.step()  # warm: the wrappers' first calls
        acc.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    finally:
        for obj, name, fn, own in reversed(patched):
            if own:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)  # an instance patch over a class method
    per = {k: v / steps * 1e3 for k, v in acc.items()}
    step = wall / steps * 1e3
    model = per.get("model", 0.0)
    return StepSplit(step, per.get("gemm", 0.0), per.get("cpu", 0.0),
                     model - per.get("gemm", 0.0) - per.get("cpu", 0.0), step - model,
                     per.get("scheduler", 0.0))
