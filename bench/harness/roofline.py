"""The roofline model (``roofline_step_time``, ``roofline_workload_throughput``) and knee
detection (``find_knee``): what a sweep's figures are held against. Pure arithmetic."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Below this throughput gain per doubling of the batch, batching stops paying for its latency.
KNEE_GAIN_PER_DOUBLING = 1.3


@dataclass(frozen=True)
class RooflinePoint:
    """Predicted decode step time at one batch size and which roof binds it."""

    batch_size: int
    memory_s: float  # weight bytes / bandwidth
    compute_s: float  # 2 * params * batch / matmul rate
    step_s: float  # the larger of the two
    bound: str  # "memory" | "compute"
    throughput_tok_s: float  # batch / step_s


def roofline_step_time(weight_bytes: int, num_params: int, batch_size: int,
                       bandwidth_bytes_s: float, flops_per_s: float) -> RooflinePoint:
    """Predicted step time = max(weights read once per step, 2 x params x batch FLOPs).

    Ignores attention over the KV cache (small for short contexts) and per-step overheads; it
    is the floor a decode step cannot beat, not an estimate of what it will take.
    """
    if batch_size <= 0 or bandwidth_bytes_s <= 0 or flops_per_s <= 0:
        raise ValueError("batch_size, bandwidth and flop rate must be > 0")
    mem = weight_bytes / bandwidth_bytes_s
    comp = 2.0 * num_params * batch_size / flops_per_s
    step = max(mem, comp)
    return RooflinePoint(batch_size, mem, comp, step, "memory" if mem >= comp else "compute",
                         batch_size / step)


def roofline_workload_throughput(weight_bytes: int, num_params: int, embed_params: int,
                                 batch_size: int, prompt_len: int, output_len: int,
                                 bandwidth_bytes_s: float, flops_per_s: float) -> float:
    """Tokens/s a wave of ``batch_size`` requests cannot beat: the prompts' prefill at the
    matmul rate (every non-embedding weight per prompt token, the LM head once per request:
    only the last position is sampled), then ``output_len - 1`` decode steps at
    ``roofline_step_time``. Prefill is compute-bound at every batch size, so it caps how much
    a bigger batch can gain over batch 1 on a workload that includes it."""
    if min(batch_size, prompt_len, output_len) <= 0:
        raise ValueError("batch_size, prompt_len and output_len must be > 0")
    prefill_flops = batch_size * (2.0 * (num_params - embed_params) * prompt_len
                                  + 2.0 * embed_params)
    step = roofline_step_time(weight_bytes, num_params, batch_size, bandwidth_bytes_s,
                              flops_per_s).step_s
    return batch_size * output_len / (prefill_flops / flops_per_s + (output_len - 1) * step)


@dataclass(frozen=True)
class Knee:
    """Where batching stops paying: the last batch size whose next step up still gained enough."""

    batch_size: int
    gains_per_doubling: list[float]  # between consecutive batch sizes


def find_knee(batch_sizes: Sequence[int], throughputs: Sequence[float],
              itls: Sequence[float], min_gain: float = KNEE_GAIN_PER_DOUBLING) -> Knee:
    """The knee: the first batch size after which throughput gains < ``min_gain`` per doubling
    while per-token latency grows. Batch sizes need not be powers of two (the gain between
    ``b1`` and ``b2`` is normalized to ``(t2/t1) ** (1 / log2(b2/b1))``). If every step gains
    enough, the knee is the largest batch size measured.
    """
    if not (len(batch_sizes) == len(throughputs) == len(itls)) or not batch_sizes:
        raise ValueError("batch_sizes, throughputs and itls must be non-empty and equally long")
    if list(batch_sizes) != sorted(set(batch_sizes)):
        raise ValueError("batch_sizes must be strictly increasing")
    gains = []
    for i in range(len(batch_sizes) - 1):
        doublings = math.log2(batch_sizes[i + 1] / batch_sizes[i])
        ratio = throughputs[i + 1] / throughputs[i] if throughputs[i] > 0 else float("inf")
        gains.append(ratio ** (1.0 / doublings) if ratio > 0 else 0.0)
    for i, g in enumerate(gains):
        if g < min_gain and itls[i + 1] > itls[i]:
            return Knee(batch_sizes[i], gains)
    return Knee(batch_sizes[-1], gains)
