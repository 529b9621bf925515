"""What a benchmark writes and prints: where results go (``DEFAULT_OUT_DIR``), the machine they
were measured on (``machine_info``), strict JSON (``to_jsonable``, ``write_json``), and the
targets table (``ratio``, ``target``, ``print_targets``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT_DIR = Path("bench/results")


def machine_info() -> dict[str, Any]:
    """What the figures were measured on (CPU model, cores, torch threads, load average)."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def to_jsonable(obj: Any) -> Any:
    """Dataclasses -> dicts, NaN/inf -> None (strict JSON), recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(out_dir: str | Path, name: str, payload: Any) -> Path:
    """Write ``payload`` as ``<out_dir>/<name>.json`` (creating the folder); returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(to_jsonable(payload), indent=2) + "\n")
    return path


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero (a baseline that did not run)."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def target(name: str, measured: float | None, goal: float, higher_is_better: bool = True,
           reason: str = "") -> dict[str, Any]:
    """One line of the targets table: the measured ratio, the goal, and whether it was met."""
    met: bool | None = None
    if measured is not None:
        met = measured >= goal if higher_is_better else measured <= goal
    return {"target": name, "measured": measured, "goal": goal,
            "comparison": ">=" if higher_is_better else "<=", "met": met, "reason": reason}


def print_targets(targets: Sequence[dict[str, Any]]) -> None:
    for t in targets:
        m = "n/a" if t["measured"] is None else f"{t['measured']:.3g}"
        verdict = {True: "MET", False: "MISSED", None: "NOT MEASURED"}[t["met"]]
        extra = f"  ({t['reason']})" if t["reason"] and t["met"] is not True else ""
        print(f"  target {t['target']}: {m} {t['comparison']} {t['goal']:g} -> {verdict}{extra}")
