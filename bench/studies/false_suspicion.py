"""No fault, full load: does the router's failure detection ever move a stream?

    python -m bench.studies.false_suspicion [--minutes 5] [--prefill-workers 1 --decode-workers 1]

Starts `pdcluster serve` (the heartbeat on: `--suspect-after-s 1`, the default) and keeps it
saturated for ``--minutes`` with `pdcluster bench serve --request-rates inf` rounds (every
prompt at once, 128 tokens in, 64 out), then reads ``pdcluster_migrations_total`` from its
``/metrics``: with no fault every reason must stay 0 (a migration here is a false suspicion).
Writes ``false_suspicion.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness.otlp_receiver import free_port
from bench.harness.serve_ab import stop, wait_ready

NAME = "false_suspicion"


def migrations(http_port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "pdcluster_migrations":
            for s in fam.samples:
                out[s.labels["reason"]] = s.value
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    from bench.harness.report import machine_info, write_json

    grpc_port, http_port = free_port(), free_port()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "router.cli", "serve", "--grpc-port", str(grpc_port),
           "--http-port", str(http_port), "--prefill-workers", str(args.prefill_workers),
           "--decode-workers", str(args.decode_workers), "--suspect-after-s", "1"]
    rounds, requests = 0, 0
    t0 = time.perf_counter()
    with open(out / f"{NAME}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ))
        try:
            wait_ready(http_port, proc)
            t_load = time.perf_counter()
            while time.perf_counter() - t_load < args.minutes * 60:
                subprocess.run([sys.executable, "-m", "router.cli", "bench", "serve",
                                "--address", f"127.0.0.1:{grpc_port}",
                                "--metrics-url", f"http://127.0.0.1:{http_port}/metrics",
                                "--request-rates", "inf", "--num-prompts", str(args.num_prompts),
                                "--seed", str(rounds), "--no-progress", "--out", str(out)],
                               check=True, stdout=log, stderr=subprocess.STDOUT)
                rounds += 1
                requests += args.num_prompts
            loaded_s = time.perf_counter() - t_load
            moved = migrations(http_port)
        finally:
            stop(proc)
    result = {"benchmark": NAME, "config": vars(args), "rounds": rounds, "requests": requests,
              "loaded_s": loaded_s, "migrations": moved,
              "false_suspicions": sum(moved.values()), "wall_s": time.perf_counter() - t0,
              "machine": machine_info()}
    path = write_json(out, NAME, result)
    print(f"  {requests} requests in {rounds} saturating rounds over {loaded_s:.0f} s: "
          f"streams moved {result['false_suspicions']:g} ({moved})")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
