"""The engine's own decode steps beside what `pdcluster bench serve` measured, per rate.

Our servers export ``pdcluster_engine_decode_steps_total{batch}`` and
``pdcluster_engine_decode_step_seconds_total{batch}`` (every worker's pure-decode engine steps,
cumulative; ``engine.core.step_times``). ``scrape`` reads them from ``/metrics`` before and after a
rate; ``engine_steps`` turns the difference into the steps the engines ran during the rate:
per batch size, the count and mean step, and the token-weighted mean step (a step of batch b
produced b tokens, so it counts b times, as in a per-token average). ``serving_overhead`` sets
the served TPOT beside it, split into the engine's pure-decode step, what prefill chunks
sharing steps with decode rows add (``pdcluster_engine_mixed_steps_total``: colocated
workers), and the rest: what the serving path (workers' delivery, Ray, the router, the API)
adds per output token, or takes away from the engine by sharing its cores. Another server
(vLLM, llama.cpp) exports none of these: no figures then.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# Per kind (engine.core.step_times): pure-decode steps, and mixed steps (decode rows beside
# prefill chunks), each by batch size = the step's decode rows.
FAMILIES = {"pdcluster_engine_decode_steps_total": ("decode", 0),
            "pdcluster_engine_decode_step_seconds_total": ("decode", 1),
            "pdcluster_engine_mixed_steps_total": ("mixed", 0),
            "pdcluster_engine_mixed_step_seconds_total": ("mixed", 1)}
KINDS = ("decode", "mixed")
_LINE = re.compile(r'^(\w+)\{batch="(\d+)"\}\s+([0-9.eE+-]+)$')

# kind -> batch -> (steps, seconds), cumulative
Snapshot = dict[str, dict[int, tuple[float, float]]]


def parse_metrics(text: str) -> Snapshot | None:
    """The step families from a Prometheus text page, by kind; None when the server has none
    (a kind a server does not export is empty)."""
    out: dict[str, dict[int, list[float]]] = {k: {} for k in KINDS}
    seen = False
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m or m.group(1) not in FAMILIES:
            continue
        seen = True
        kind, col = FAMILIES[m.group(1)]
        out[kind].setdefault(int(m.group(2)), [0.0, 0.0])[col] = float(m.group(3))
    if not seen and "pdcluster_engine_decode_steps_total" not in text:
        return None
    return {k: {b: (n, s) for b, (n, s) in rows.items()} for k, rows in out.items()}


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
    """Engine steps of one kind run during one rate, every worker together."""

    by_batch: dict[int, dict[str, float]]  # batch -> {"steps": n, "mean_s": seconds}
    steps: int
    mean_step_s: float  # over steps
    token_mean_step_s: float  # each step weighted by its batch size (tokens it produced)
    mean_batch: float  # tokens per step
    tokens: int  # decode tokens the steps produced


def engine_steps(before: Snapshot | None, after: Snapshot | None,
                 kind: str = "decode") -> EngineSteps | None:
    """What ran of ``kind`` between two snapshots; None when either is missing or no such
    step ran."""
    if before is None or after is None:
        return None
    by_batch, steps, seconds, tokens, token_seconds = {}, 0, 0.0, 0, 0.0
    for b, (n1, s1) in sorted(after.get(kind, {}).items()):
        n0, s0 = before.get(kind, {}).get(b, (0.0, 0.0))
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
    return EngineSteps(by_batch, steps, seconds / steps, token_seconds / tokens,
                       tokens / steps, tokens)


def serving_overhead(tpot_mean_s: float, steps: EngineSteps | None,
                     mixed: EngineSteps | None = None) -> dict[str, float | None]:
    """Served TPOT split three ways, seconds per output token:

    - ``engine_step_s``: the engine's pure-decode step, token-weighted (the issue's target
      is ``tpot_over_engine_step`` = TPOT / this <= 1.1);
    - ``prefill_share_per_token_s``: what decode rows lost to prefill chunks sharing their
      steps (``mixed``; colocated workers), so ``engine_token_s`` = the engine's time per
      decode token over every step that produced one;
    - ``serving_overhead_per_token_s``: TPOT - ``engine_token_s``, what the serving path
      (delivery, Ray, the router, the API, and their share of the cores) adds.
    """
    none = {"engine_step_s": None, "engine_token_s": None, "prefill_share_per_token_s": None,
            "serving_overhead_per_token_s": None, "tpot_over_engine_step": None,
            "tpot_over_engine_token": None}
    if steps is None or math.isnan(tpot_mean_s):
        return none
    tokens = steps.tokens + (mixed.tokens if mixed else 0)
    engine_token_s = (steps.token_mean_step_s * steps.tokens
                      + (mixed.token_mean_step_s * mixed.tokens if mixed else 0.0)) / tokens
    return {"engine_step_s": steps.token_mean_step_s, "engine_token_s": engine_token_s,
            "prefill_share_per_token_s": engine_token_s - steps.token_mean_step_s,
            "serving_overhead_per_token_s": tpot_mean_s - engine_token_s,
            "tpot_over_engine_step": tpot_mean_s / steps.token_mean_step_s,
            "tpot_over_engine_token": tpot_mean_s / engine_token_s}
