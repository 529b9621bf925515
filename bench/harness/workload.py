"""Benchmark workloads: seeded token-id prompts of exact length, heavy-tailed output lengths,
Poisson arrival times. Pure arithmetic on plain numbers
(``tests/unit/bench/test_bench_math.py``)."""

from __future__ import annotations

import math
import random


def make_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int = 0,
                 low_id: int = 10) -> list[list[int]]:
    """``num_prompts`` distinct token-id prompts of exactly ``prompt_len`` tokens.

    Ids are drawn from ``[low_id, vocab_size)`` so special tokens (bos/eos, usually < 10) are
    avoided; distinct random prompts keep the prefix cache from short-cutting prefill.
    """
    if num_prompts <= 0 or prompt_len <= 0:
        raise ValueError(f"num_prompts and prompt_len must be > 0, got {num_prompts}, {prompt_len}")
    low = min(low_id, vocab_size - 1)
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]


def heavy_tailed_lengths(num: int, seed: int = 0, low: int = 8, high: int = 512,
                         median: float = 48.0, sigma: float = 1.0) -> list[int]:
    """Seeded lognormal output lengths clipped to ``[low, high]`` (most short, a few long)."""
    if num <= 0 or not 0 < low <= high:
        raise ValueError(f"need num > 0 and 0 < low <= high, got {num}, {low}, {high}")
    rng = random.Random(seed)
    mu = math.log(median)
    return [max(low, min(high, round(rng.lognormvariate(mu, sigma)))) for _ in range(num)]


def poisson_arrivals(num: int, rate_per_s: float | None, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds from start). ``rate_per_s`` None or <= 0: everyone at t=0."""
    if not rate_per_s or rate_per_s <= 0:
        return [0.0] * num
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out
