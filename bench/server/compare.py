"""`pdcluster bench compare A.json B.json [C.json ...]`: `bench serve` results side by side.

The files are ``serve.json`` results of `pdcluster bench serve` (ours, or ``--target`` any
OpenAI-compatible server: ``vllm serve``, llama.cpp's server), ideally the same seeded load.
Only the request rates present in every file are compared; a later file with other lengths,
prompt counts or SLOs is compared anyway, with a warning. Per rate, one table: a column per
file, named by its ``server.label``, then every later file's ratio to the first (value / first
value: below 1 is better for latencies, above 1 for throughputs and goodput). ``--out`` gets
``compare.json`` (the tables, in the units printed) and ``compare.png`` (TTFT p50, TPOT p50
and output throughput vs rate, a line per file).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.report import ratio, write_json

NAME = "compare"
HELP = "side-by-side table and plot of `bench serve` results (e.g. ours vs vllm serve)"
# Load settings that must agree for a comparison to be like for like.
CONFIG_KEYS = ("num_prompts", "input_len", "output_len", "max_concurrency", "seed")


@dataclass(frozen=True)
class Metric:
    """One row of the table: a field of a `bench serve` rate record, shown in ``unit``."""

    key: str
    name: str
    unit: str
    scale: float  # JSON value x scale = value in unit


METRICS = (
    Metric("ttft_p50_s", "TTFT p50", "ms", 1e3),
    Metric("ttft_p99_s", "TTFT p99", "ms", 1e3),
    Metric("tpot_p50_s", "TPOT p50", "ms", 1e3),
    Metric("tpot_p99_s", "TPOT p99", "ms", 1e3),
    Metric("itl_p99_s", "ITL p99", "ms", 1e3),
    Metric("output_throughput_tok_s", "output throughput", "tok/s", 1.0),
    Metric("request_throughput_req_s", "request throughput", "req/s", 1.0),
    Metric("goodput_req_s", "goodput", "req/s", 1.0),
    Metric("goodput_fraction", "goodput", "%", 100.0),
)


@dataclass(frozen=True)
class ServeRun:
    """One `bench serve` result file, as compare needs it."""

    path: str
    label: str
    model_id: str | None
    config: dict[str, Any]
    slo_s: dict[str, float]
    warnings: list[str]
    rows: dict[float, dict[str, Any]]  # request rate (inf = all at once) -> its record


@dataclass(frozen=True)
class MetricRow:
    """A metric at one rate: a value per file (None where not measured) and each later file's
    ratio to the first (None where either value is missing or the first is 0)."""

    metric: str
    name: str
    unit: str
    values: list[float | None]
    ratios_to_first: list[float | None]


@dataclass(frozen=True)
class RateTable:
    request_rate: float
    rows: list[MetricRow]


def rate_key(value: Any) -> float:
    """A rate as `bench serve` writes it (a number, or "inf") -> float; 2 and 2.0 match."""
    if value == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"request_rate {value!r} is neither a number nor 'inf'")
    return float(value)


def rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def parse_run(path: str, data: Any) -> ServeRun:
    """Validate one parsed file; raises ValueError naming ``path`` if it is not a `bench serve`
    result."""
    if not isinstance(data, dict) or data.get("benchmark") != "serve" \
            or not isinstance(data.get("rates"), list):
        got = data.get("benchmark") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} is not a `pdcluster bench serve` result "
                         f"(benchmark: {got!r}; expected 'serve' with a list of rates)")
    try:
        rows = {rate_key(r["request_rate"]): r for r in data["rates"]}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: a rate record is malformed ({e})") from None
    server = data.get("server") or {}
    config = data.get("config") or {}
    label = server.get("label") or config.get("address") or Path(path).stem
    return ServeRun(path, str(label), server.get("model_id"), config, data.get("slo_s") or {},
                    list(data.get("warnings") or []), rows)


def load_run(path: str) -> ServeRun:
    """Read and validate a `bench serve` result file (ValueError if unreadable or not one)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a `pdcluster bench serve` result (not JSON: {e})") from None
    return parse_run(path, data)


def unique_labels(labels: list[str]) -> list[str]:
    """Labels as given, a repeated one suffixed " (2)", " (3)", ... so columns stay apart."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out


def common_rates(runs: list[ServeRun]) -> list[float]:
    """Rates present in every run, in the first run's order; ValueError if there are none."""
    rates = [r for r in runs[0].rows if all(r in run.rows for run in runs[1:])]
    if not rates:
        have = "; ".join(f"{run.path}: {', '.join(map(rate_text, run.rows)) or 'none'}"
                         for run in runs)
        raise ValueError(f"no request rate is in every file ({have})")
    return rates


def _value(row: dict[str, Any], m: Metric) -> float | None:
    v = row.get(m.key)
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        return None
    return v * m.scale


def build_tables(runs: list[ServeRun]) -> list[RateTable]:
    """One table per common rate: every metric of ``METRICS`` for every run, with ratios."""
    tables = []
    for rate in common_rates(runs):
        rows = []
        for m in METRICS:
            values = [_value(run.rows[rate], m) for run in runs]
            rows.append(MetricRow(m.key, m.name, m.unit, values,
                                  [ratio(v, values[0]) for v in values[1:]]))
        tables.append(RateTable(rate, rows))
    return tables


def mismatches(runs: list[ServeRun]) -> list[str]:
    """Load settings (CONFIG_KEYS, SLOs) in which a later run differs from the first."""
    first = runs[0]
    out = []
    for run in runs[1:]:
        for key in CONFIG_KEYS:
            if run.config.get(key) != first.config.get(key):
                out.append(f"{run.path}: {key} {run.config.get(key)} vs "
                           f"{first.config.get(key)} in {first.path}")
        if run.slo_s != first.slo_s:
            out.append(f"{run.path}: SLOs {run.slo_s} vs {first.slo_s} in {first.path} "
                       "(goodput is not comparable)")
    return out


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def format_table(labels: list[str], table: RateTable) -> str:
    """The printed table of one rate: metric, a column per label, then the ratio columns."""
    head = [f"rate {rate_text(table.request_rate)} req/s", *labels,
            *(f"{lb} / {labels[0]}" for lb in labels[1:])]
    lines = [[f"{r.name} ({r.unit})", *map(_fmt, r.values),
              *("n/a" if x is None else f"{x:.2f}x" for x in r.ratios_to_first)]
             for r in table.rows]
    widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head))]

    def line(cells: list[str]) -> str:  # metric names left-aligned, numbers right-aligned
        return "  ".join([cells[0].ljust(widths[0]),
                          *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    return "\n".join(line(row) for row in [head, *lines])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="SERVE_JSON",
                   help="two or more `bench serve` results (serve.json); the first is the "
                        "reference for the ratios")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compare ``args.files``; print the tables, write ``compare.json`` + ``compare.png`` to
    ``args.out``. Raises ValueError for fewer than two files, a file that is not a `bench
    serve` result, or no rate in common."""
    if len(args.files) < 2:
        raise ValueError("bench compare needs at least two `bench serve` result files")
    runs = [load_run(p) for p in args.files]
    labels = unique_labels([r.label for r in runs])
    tables = build_tables(runs)
    warnings = mismatches(runs) + [f"{r.path}: {w}" for r in runs for w in r.warnings]
    result = {
        "benchmark": NAME,
        "files": [{"path": r.path, "label": lb, "model_id": r.model_id}
                  for r, lb in zip(runs, labels, strict=True)],
        "tables": [{"request_rate": "inf" if math.isinf(t.request_rate) else t.request_rate,
                    "rows": t.rows} for t in tables],
        "warnings": warnings,
    }
    out = Path(args.out)
    path = write_json(out, NAME, result)
    _plot(runs, labels, [t.request_rate for t in tables], out / f"{NAME}.png")
    for t in tables:
        print(format_table(labels, t), end="\n\n")
    print("ratios: value / first file's; below 1 is better for latencies, above 1 for the rest")
    for w in warnings:
        print(f"warning: {w}")
    print(f"wrote {path} and {out / f'{NAME}.png'}")
    return result


def _plot(runs: list[ServeRun], labels: list[str], rates: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(rates)))
    panels = [m for m in METRICS if m.key in ("ttft_p50_s", "tpot_p50_s", "output_throughput_tok_s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 4))
    for ax, m in zip(axes, panels, strict=True):
        for run, label in zip(runs, labels, strict=True):
            ys = [_value(run.rows[r], m) for r in rates]
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=label)
        ax.set_title(f"{m.name} ({m.unit})")
        ax.set_xticks(xs, [rate_text(r) for r in rates])
        ax.set_xlabel("offered request rate (req/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
