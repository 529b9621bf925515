"""The engine's own decode steps beside what `pdcluster bench serve` measured, per rate.

Our servers export ``pdcluster_engine_decode_steps_total{batch}`` and
``pdcluster_engine_decode_step_seconds_total{batch}`` (every worker's pure-decode engine steps,
cumulative; ``engine.step_times``). ``scrape`` reads them from ``/metrics`` before and after a
rate; ``engine_steps`` turns the difference into the steps the engines ran during the rate:
per batch size, the count and mean step, and the token-weighted mean step (a step of batch b
produced b tokens, so it counts b times, as in a per-token average). ``serving_overhead`` sets
the served TPOT beside it: TPOT minus the engine's step is what the serving path (workers'
delivery, Ray, the router, the API) adds per output token, or takes away from the engine by
sharing its cores. Another server (vLLM, llama.cpp) exports none of these: no figures then.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

STEPS = "pdcluster_engine_decode_steps_total"
SECONDS = "pdcluster_engine_decode_step_seconds_total"
_LINE = re.compile(r'^(\w+)\{batch="(\d+)"\}\s+([0-9.eE+-]+)$')

Snapshot = dict[int, tuple[float, float]]  # batch -> (steps, seconds), cumulative


def parse_metrics(text: str) -> Snapshot | None:
    """The two families from a Prometheus text page; None when the server has neither."""
    out: dict[int, list[float]] = {}
    seen = False
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m or m.group(1) not in (STEPS, SECONDS):
            continue
        seen = True
        row = out.setdefault(int(m.group(2)), [0.0, 0.0])
        row[0 if m.group(1) == STEPS else 1] = float(m.group(3))
    if not seen and STEPS not in text:
        return None
    return {b: (n, s) for b, (n, s) in out.items()}


async def scrape(client: Any, url: str | None, headers: dict[str, str]) -> Snapshot | None:
    """GET ``url`` (a ``/metrics`` page) with an ``httpx.AsyncClient``; None when there is no
    URL, the server does not answer 200, or it exports no engine step counters."""
    if url is None:
        return None
    try:
        r = await client.get(url, headers=headers)
    except Exception:  # noqa: BLE001 - the figures are optional: any failure means "none"
        return None
    return parse_metrics(r.text) if r.status_code == 200 else None


@dataclass(frozen=True)
class EngineSteps:
    """Pure-decode engine steps run during one rate, every worker together."""

    by_batch: dict[int, dict[str, float]]  # batch -> {"steps": n, "mean_s": seconds}
    steps: int
    mean_step_s: float  # over steps
    token_mean_step_s: float  # each step weighted by its batch size (tokens it produced)
    mean_batch: float  # tokens per step


def engine_steps(before: Snapshot | None, after: Snapshot | None) -> EngineSteps | None:
    """What ran between two snapshots; None when either is missing or no decode step ran."""
    if before is None or after is None:
        return None
    by_batch, steps, seconds, tokens, token_seconds = {}, 0, 0.0, 0.0, 0.0
    for b, (n1, s1) in sorted(after.items()):
        n0, s0 = before.get(b, (0.0, 0.0))
        n, s = int(round(n1 - n0)), s1 - s0
        if n <= 0:
            continue
        by_batch[b] = {"steps": n, "mean_s": s / n}
        steps += n
        seconds += s
        tokens += b * n
        token_seconds += b * s
    if not steps:
        return None
    return EngineSteps(by_batch, steps, seconds / steps, token_seconds / tokens, tokens / steps)


def serving_overhead(tpot_mean_s: float, steps: EngineSteps | None) -> dict[str, float | None]:
    """Served TPOT against the engine's token-weighted step: the difference (seconds per
    output token the serving path adds) and the ratio (the issue's target: <= 1.1)."""
    if steps is None or math.isnan(tpot_mean_s):
        return {"engine_step_s": None, "serving_overhead_per_token_s": None,
                "tpot_over_engine_step": None}
    return {"engine_step_s": steps.token_mean_step_s,
            "serving_overhead_per_token_s": tpot_mean_s - steps.token_mean_step_s,
            "tpot_over_engine_step": tpot_mean_s / steps.token_mean_step_s}
