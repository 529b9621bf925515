"""`pdcluster plan`: the split of prefill and decode workers (and the decode batch cap) that
gives the most goodput per worker within an SLO, searched on the simulator.

Every candidate (prefill workers 1..max, decode workers 1..max, each ``max_num_seqs``
option; colocated: workers 1..max) runs the whole workload in ``router.planning.simulator``;
goodput is the requests within the SLO (TTFT and TPOT) per second of the workload, and the
candidates are ranked by goodput per worker, then by goodput, then by fewer workers. The
table of every candidate is printed, best first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.tuning.profile import EngineProfile
from router.planning.simulator import ClusterShape, SimResult, simulate
from router.planning.workload import TraceRequest

__all__ = ["PlanRow", "parse_slo", "search", "table"]


@dataclass(frozen=True)
class PlanRow:
    shape: ClusterShape
    result: SimResult
    slo_attainment: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None

    def as_dict(self) -> dict:
        s, r = self.shape, self.result
        return {"mode": s.mode, "prefill": s.num_prefill if s.mode == "disaggregated" else 0,
                "decode": s.num_decode, "max_num_seqs": s.max_num_seqs, "workers": s.workers,
                "goodput_rps": r.goodput_rps(), "goodput_per_worker": r.goodput_per_worker(),
                "slo_attainment": self.slo_attainment, "ttft_p50_s": self.ttft_p50_s,
                "ttft_p99_s": self.ttft_p99_s, "tpot_p50_s": self.tpot_p50_s,
                "rejected": r.rejected}


def parse_slo(text: str) -> tuple[float, float]:
    """``ttft=2,tpot=0.1`` (seconds) -> (ttft, tpot); ValueError naming what is wrong."""
    got = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in ("ttft", "tpot"):
            raise ValueError(f"--slo: {part!r}: give ttft=SECONDS,tpot=SECONDS")
        try:
            got[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {part!r} is not a number of seconds") from None
        if not got[key] > 0:
            raise ValueError(f"--slo: {key} must be > 0")
    if set(got) != {"ttft", "tpot"}:
        raise ValueError("--slo needs both ttft=SECONDS and tpot=SECONDS")
    return got["ttft"], got["tpot"]


def evaluate(profile: EngineProfile, shape: ClusterShape, requests: list[TraceRequest],
             slo: tuple[float, float]) -> PlanRow:
    res = simulate(profile, shape, requests, *slo)
    return PlanRow(shape, res, res.within_slo / max(len(requests), 1),
                   percentile(res.ttft_s, 50), percentile(res.ttft_s, 99),
                   percentile(res.tpot_s, 50))


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def search(profile: EngineProfile, requests: list[TraceRequest], slo: tuple[float, float],
           max_prefill: int, max_decode: int, seqs_options: list[int], modes: list[str],
           kv_tokens: int, cores: float = math.inf, threads: int = 1,
           max_num_batched_tokens: int | None = None) -> list[PlanRow]:
    """Every candidate, best first (see the module docstring)."""
    budget = max_num_batched_tokens or profile.max_num_batched_tokens
    rows = []
    for mode in modes:
        prefills = range(1, max_prefill + 1) if mode == "disaggregated" else [0]
        for p in prefills:
            for d in range(1, max_decode + 1):
                for seqs in seqs_options:
                    shape = ClusterShape(p, d, seqs, kv_tokens, mode, budget, cores, threads)
                    rows.append(evaluate(profile, shape, requests, slo))
    rows.sort(key=lambda r: (-r.result.goodput_per_worker(), -r.result.goodput_rps(),
                             r.shape.workers))
    return rows


def table(rows: list[PlanRow]) -> str:
    head = (f"{'mode':13s} {'P':>2s} {'D':>2s} {'seqs':>4s} {'goodput/s':>9s} {'per worker':>10s} "
            f"{'in SLO':>6s} {'TTFT p50':>8s} {'TTFT p99':>8s} {'TPOT p50':>8s}")

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}ms" if v < 10 else f"{v:.0f}s"
    lines = [head]
    for i, r in enumerate(rows):
        d = r.as_dict()
        lines.append(f"{d['mode']:13s} {d['prefill']:2d} {d['decode']:2d} {d['max_num_seqs']:4d} "
                     f"{d['goodput_rps']:9.2f} {d['goodput_per_worker']:10.3f} "
                     f"{d['slo_attainment']:6.0%} {ms(d['ttft_p50_s']):>8s} "
                     f"{ms(d['ttft_p99_s']):>8s} {ms(d['tpot_p50_s']):>8s}"
                     + ("  <- best" if i == 0 else ""))
    return "\n".join(lines)
