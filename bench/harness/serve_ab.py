"""Two (or more) server set-ups under the same `pdcluster bench serve` load, in one run.

Each round starts every variant once, in an order that alternates round by round (drift on
a shared host falls on all alike): a real `pdcluster serve` process with the variant's extra
flags, loaded by a real `pdcluster bench serve` process over gRPC, then stopped (SIGTERM: it
drains and stops its workers; its process group if it lingers). The studies built on it:
``bench.studies.tracing_cost``, ``bench.studies.false_suspicion``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.otlp_receiver import free_port

# What each variant's run reports per rate (bench serve's row keys).
METRICS = ("output_throughput_tok_s", "ttft_p50_s", "tpot_p50_s", "itl_p50_s", "itl_p99_s")


@dataclass(frozen=True)
class Load:
    rates: str = "1,2,4"
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 64


def wait_ready(http_port: int, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdcluster serve exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"pdcluster serve was not ready within {timeout_s:g} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def serve_once(serve_flags: list[str], load: Load, out: Path) -> dict[str, dict[str, float]]:
    """Start `pdcluster serve` with ``serve_flags``, load it, stop it: ``METRICS`` per rate."""
    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "router.cli", "serve", "--grpc-port", str(grpc_port),
           "--http-port", str(http_port), *serve_flags]
    env = {k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}
    with open(out / "serve.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            wait_ready(http_port, proc)
            subprocess.run([sys.executable, "-m", "router.cli", "bench", "serve",
                            "--address", f"127.0.0.1:{grpc_port}",
                            "--metrics-url", f"http://127.0.0.1:{http_port}/metrics",
                            "--request-rates", load.rates, "--num-prompts", str(load.num_prompts),
                            "--input-len", str(load.input_len),
                            "--output-len", str(load.output_len), "--no-progress",
                            "--out", str(out)], check=True, stdout=log, stderr=subprocess.STDOUT)
        finally:
            stop(proc)
    rows = json.loads((out / "serve.json").read_text())["rates"]
    return {str(r["request_rate"]): {k: r[k] for k in METRICS} for r in rows}


def run_ab(variants: dict[str, list[str]], load: Load, rounds: int,
           progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every variant once per round; per rate and variant the median of each metric over
    rounds (``cells``), and every run (``runs``)."""
    names = list(variants)
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):
            for name in (names if k % 2 == 0 else names[::-1]):
                runs.append({"variant": name, "round": k + 1,
                             "rates": serve_once(variants[name], load, Path(tmp))})
                progress(f"  round {k + 1} {name}: done ({time.perf_counter() - t0:.0f} s)")
    cells: dict[str, dict[str, dict[str, float]]] = {}
    for rate in runs[0]["rates"]:
        cells[rate] = {name: {m: statistics.median(r["rates"][rate][m] for r in runs
                                                   if r["variant"] == name)
                              for m in METRICS} for name in names}
    return {"variants": variants,
            "rounds": rounds, "cells": cells, "runs": runs,
            "wall_s": time.perf_counter() - t0}
