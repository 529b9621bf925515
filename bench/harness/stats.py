"""Latency statistics: ``percentile`` (linear interpolation, numpy's default) and
``summarize`` (mean, p50, p90, p99 of a sample). Pure arithmetic on plain numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    """Summary of a latency sample (seconds)."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int


def summarize(values: Sequence[float]) -> Stats:
    """Mean and percentiles; an empty sample gives NaNs (e.g. no ITL when every output is 1 token)."""
    if not values:
        nan = float("nan")
        return Stats(nan, nan, nan, nan, 0)
    return Stats(mean=sum(values) / len(values), p50=percentile(values, 50),
                 p90=percentile(values, 90), p99=percentile(values, 99), count=len(values))
