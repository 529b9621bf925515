"""The pure part of ``pdcluster bench neighbour``: the systems, loads and targets shared by
every part, the cells and their verdicts, the printed table, and the parsing of SSE timings
and ``/metrics`` pages. No processes, no I/O."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.harness.report import target as make_target

SYSTEMS = ("offline", "colocated", "colocated-t2", "disaggregated", "transformers")
SERVED = {"colocated": ["--mode", "colocated"],
          "colocated-t2": ["--mode", "colocated", "--threads-per-worker", "2"],
          "disaggregated": []}
CHILD_SYSTEMS = ("offline", "transformers")
LOADS = ("quiet", "nice19", "nice0", "quota1")
NICE = {"nice19": 19, "nice0": 0}
BUSY_LOOP = "while True: pass"
QUOTA_PERIOD_US = 100_000
CELL_TIMEOUT_S = 900.0  # one cell of a child system (all its rounds)


def goal_for(system: str, load: str) -> float | None:
    """The most a load may slow ``system`` (ratio to quiet), or None: no target."""
    if system == "transformers":
        return None
    if load == "nice0":
        return 2.0 if system == "offline" else 2.5
    if load == "nice19":
        return 1.3
    return None


# ---- cells, verdicts, the table --------------------------------------------------------------

@dataclass
class Cell:
    """One (system, load, batch) measurement; ``ms_per_token`` None when it has none."""

    system: str
    load: str
    batch: int
    ms_per_token: float | None = None
    samples: int = 0  # requests (served) or rounds (offline, transformers) behind the median
    engine_step_ms: float | None = None  # the engine's own pure-decode step at this batch
    engine_threads: Any = None  # int (offline) or {worker: threads} (served)
    unavailable: str | None = None  # the load could not be applied, and why
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def verdict(load: str, ratio: float | None, goal: float | None, ms: float | None,
            unavailable: str | None = None, error: str | None = None) -> str:
    """``met`` / ``MISSED`` against ``goal``, or why there is no verdict."""
    if unavailable:
        return f"unavailable: {unavailable}"
    if error:
        return f"error: {error}"
    if ms is None:
        return "not measured"
    if load == "quiet":
        return "baseline"
    if goal is None:
        return "no target"
    if ratio is None:
        return "no quiet baseline"
    return "met" if ratio <= goal else "MISSED"


def rows(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """Every cell with its quiet figure (same system and batch), ratio, goal and verdict."""
    quiet = {(c.system, c.batch): c.ms_per_token for c in cells if c.load == "quiet"}
    out = []
    for c in cells:
        q = quiet.get((c.system, c.batch))
        ratio = c.ms_per_token / q if c.ms_per_token is not None and q else None
        goal = goal_for(c.system, c.load)
        v = verdict(c.load, ratio, goal, c.ms_per_token, c.unavailable, c.error)
        out.append({"system": c.system, "load": c.load, "batch": c.batch,
                    "ms_per_token": c.ms_per_token, "quiet_ms_per_token": q,
                    "ratio_to_quiet": ratio, "goal": goal,
                    "met": {"met": True, "MISSED": False}.get(v), "verdict": v,
                    "samples": c.samples, "engine_step_ms": c.engine_step_ms,
                    "engine_threads": c.engine_threads, "unavailable": c.unavailable,
                    "error": c.error, **c.extra})
    return out


def targets(table: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """bench.harness.report's targets lines for every cell that has a goal."""
    return [make_target(f"{r['system']} batch {r['batch']} {r['load']} / quiet ms per token",
                        r["ratio_to_quiet"], r["goal"], higher_is_better=False,
                        reason="" if r["verdict"] in ("met", "MISSED") else r["verdict"])
            for r in table if r["goal"] is not None]


def _fmt_threads(t: Any) -> str:
    if t is None:
        return "-"
    if isinstance(t, dict):
        return ",".join(f"{v:g}" for _, v in sorted(t.items())) or "-"
    return f"{t:g}" if isinstance(t, int | float) else str(t)


def render_table(table: Sequence[dict[str, Any]]) -> str:
    """The table the benchmark prints: one line per cell, every cell shown."""
    head = ("system", "batch", "load", "ms/token", "quiet ms", "x quiet", "goal", "engine ms",
            "threads", "verdict")
    lines = [head]
    for r in table:
        ms, q, ratio = r["ms_per_token"], r["quiet_ms_per_token"], r["ratio_to_quiet"]
        lines.append((r["system"], str(r["batch"]), r["load"],
                      "-" if ms is None else f"{ms:.1f}", "-" if q is None else f"{q:.1f}",
                      "-" if ratio is None else f"{ratio:.2f}x",
                      "-" if r["goal"] is None else f"<={r['goal']:.1f}x",
                      "-" if r["engine_step_ms"] is None else f"{r['engine_step_ms']:.1f}",
                      _fmt_threads(r["engine_threads"]), r["verdict"]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    right = {1, 3, 4, 5, 7}
    out = []
    for line in lines:
        cols = [(s.rjust(w) if i in right else s.ljust(w))
                for i, (s, w) in enumerate(zip(line[:-1], widths, strict=True))]
        out.append("  ".join([*cols, line[-1]]).rstrip())
    return "\n".join(out)


# ---- SSE timing, metrics ---------------------------------------------------------------------

def per_token_s(chunk_times: Sequence[float]) -> float | None:
    """A stream's time per output token: (last data chunk - first) / (chunks - 1); None
    with fewer than two chunks."""
    if len(chunk_times) < 2:
        return None
    return (chunk_times[-1] - chunk_times[0]) / (len(chunk_times) - 1)


_THREADS = re.compile(r"^pdcluster_engine_threads(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_threads(text: str) -> dict[str, float] | None:
    """``pdcluster_engine_threads`` per worker (its ``worker`` label, else all its labels)
    from a Prometheus text page; None when the page has no such gauge."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _THREADS.match(line.strip())
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(1) or ""))
        key = labels.get("worker") or ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        try:
            out[key] = float(m.group(2))
        except ValueError:
            continue
    return out or None
