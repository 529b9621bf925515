"""`pdcluster bench neighbour`: time per output token beside a busy neighbour, in one run.

    pdcluster bench neighbour [--systems offline,colocated,colocated-t2,disaggregated,
                               transformers] [--loads quiet,nice19,nice0,quota1]
                              [--batches 1,8] [--rounds 2] [--input-len 64] [--output-len 64]

Systems: ``offline`` (``engine.LLM()`` with its default arguments, in a child process);
``colocated`` (``pdcluster serve --mode colocated``), ``colocated-t2`` (the same with
``--threads-per-worker 2``) and ``disaggregated`` (``pdcluster serve``), each started once on
free 127.0.0.1 ports; ``transformers`` (``generate`` on the same weights,
``bench.engine.baseline_hf.load_hf_model``, ``torch.set_num_threads(2)``, in a child process).

Loads, one after another on the same running system: ``quiet``; ``nice19`` and ``nice0`` (one
``python -c "while True: pass"`` started by this benchmark at that niceness, ended by its pid);
``quota1`` (the system's processes moved into a new cgroup with a CPU quota of one core:
cgroup v2 ``cpu.max`` = ``100000 100000``, or v1 ``cpu.cfs_quota_us`` = ``cpu.cfs_period_us``
= 100000; moved back and the cgroup removed afterwards; where the host does not let us create
it, the cell says ``unavailable`` and why). After a load is applied the benchmark waits
``--settle-s`` (so the engine's thread governor, ``engine.runtime.cpu_threads``, sees it), then measures
every batch size.

Per cell (system, load, batch B), on ``--input-len``-token prompts that are new for every
request and round (the prefix cache cannot help), ``--output-len`` tokens each, greedy,
``ignore_eos``:

- served: B concurrent streamed ``/v1/completions`` requests per round; a request's time per
  output token is (last SSE data chunk - first) / (chunks - 1), and the cell is the median over
  the requests of ``--rounds`` rounds. Beside it, the engines' own pure-decode step at batch B
  (the delta of ``pdcluster_engine_decode_step_seconds_total`` over
  ``pdcluster_engine_decode_steps_total`` with ``batch="B"`` on ``/metrics`` across the cell)
  and ``pdcluster_engine_threads`` after the cell, when the server exports it;
- offline: the engine's mean decode step at batch B from its own counters
  (``LLMEngine.stats().decode_steps``) per round, median over rounds;
- transformers: (time of a ``generate`` of ``--output-len`` tokens - time of a 1-token
  ``generate`` of the same prompts) / (output-len - 1) per round, median over rounds.

Reported per system and batch: the quiet ms/token and, per load, ms/token and its ratio to
quiet, against the targets: nice0 <= 2.0x quiet offline and <= 2.5x quiet served (colocated,
colocated-t2, disaggregated); nice19 <= 1.3x (offline and served). transformers and quota1 are
reported without a target. Every cell is printed, the missed ones included, and written to
``<out>/neighbour.json``.

Process groups, not sessions: a server is started with ``process_group=0`` (its own process
group, in this benchmark's session), not ``start_new_session``. With Linux's autogroup
(``/proc/sys/kernel/sched_autogroup_enabled``) each session is its own scheduling group that
gets a fair share of the CPU as a whole, so a server in a new session would get its share
whatever the neighbour's niceness, and nice 19 vs nice 0 would not be measured. Ray's daemons
inherit the server's group; Ray's workers put themselves in process groups of their own but
stay in the session. So the system's processes (``system_pids``: the group's members from
``/proc/*/stat`` field ``pgrp``, and all their descendants) are what the cgroup move takes,
and the server is ended with ``os.killpg`` (SIGTERM, then SIGKILL after a timeout), with any
of its processes still there afterwards killed by pid (checked against its start time).
Nothing is killed by name.

Niceness: Ray starts its worker processes at nice 15 by default (``worker_niceness``), where a
nice-0 neighbour takes almost all of a shared core from them; pdcluster starts Ray with
``worker_niceness`` 0 (``router.cluster.local_ray``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.cluster.neighbour_systems import (
    Prompts,
    Settings,
    child_main,
    run_child,
    run_served,
)
from bench.cluster.neighbour_table import (
    CHILD_SYSTEMS,
    LOADS,
    SYSTEMS,
    Cell,
    render_table,
    rows,
    targets,
)
from bench.harness.report import machine_info, write_json

NAME = "neighbour"
HELP = ("time per output token beside a busy neighbour (nice 19, nice 0, a 1-core quota): "
        "offline engine, served, transformers")


# ---- arguments -------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list of {', '.join(SYSTEMS)} (default: all)")
    p.add_argument("--loads", default=",".join(LOADS),
                   help=f"comma list of {', '.join(LOADS)} (default: all; ratios are to quiet)")
    p.add_argument("--batches", default=None,
                   help="comma list of batch sizes (default 1,8; --quick 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per cell (default 2; --quick 1)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--output-len", type=int, default=None,
                   help="tokens per request (default 64; --quick 16)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0,
                   help="wait at most this long for a server's /health (or a child's model) "
                        "(default 300)")
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="seconds between applying a load and measuring (default 1)")


def _names(text: str, allowed: Sequence[str], flag: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise ValueError(f"{flag}: a comma list of {', '.join(allowed)}; got {text!r}")
    return names


def settings(args: argparse.Namespace) -> Settings:
    """The run's sizes from the flags (``--quick``: rounds 1, output-len 16, batches 1, unless
    given explicitly). Raises ValueError on a bad flag."""
    quick = getattr(args, "quick", False)
    batches_text = args.batches or ("1" if quick else "1,8")
    try:
        batches = tuple(dict.fromkeys(int(b) for b in batches_text.split(",") if b.strip()))
    except ValueError:
        raise ValueError(f"--batches: a comma list of integers, got {batches_text!r}") from None
    s = Settings(systems=_names(args.systems, SYSTEMS, "--systems"),
                 loads=_names(args.loads, LOADS, "--loads"), batches=batches,
                 rounds=args.rounds or (1 if quick else 2), input_len=args.input_len,
                 output_len=args.output_len or (16 if quick else 64),
                 startup_timeout_s=args.startup_timeout_s, settle_s=args.settle_s)
    if not s.batches or min(s.batches) <= 0:
        raise ValueError("--batches: sizes must be > 0")
    if s.rounds <= 0 or s.input_len <= 0:
        raise ValueError("--rounds and --input-len must be > 0")
    if s.output_len < 2:
        raise ValueError("--output-len must be >= 2 (time per token needs two tokens)")
    if s.startup_timeout_s <= 0 or s.settle_s < 0:
        raise ValueError("--startup-timeout-s must be > 0 and --settle-s >= 0")
    return s


# ---- the benchmark ---------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.harness.engine_under_test import model_config

    s = settings(args)
    # A SIGTERM (a timeout, an operator) unwinds like Ctrl-C, so every finally below ends the
    # neighbours, quotas and servers this run started.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    t0 = time.perf_counter()
    out = Path(args.out)
    log_dir = out / "neighbour_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    prompts = Prompts(model_config(args.model).vocab_size, s.input_len, args.seed)
    print(f"neighbour: systems {','.join(s.systems)}; loads {','.join(s.loads)}; batches "
          f"{','.join(map(str, s.batches))}; {s.rounds} round(s) of {s.input_len}-token "
          f"prompts, {s.output_len} tokens each", flush=True)
    cells: list[Cell] = []
    systems: dict[str, dict[str, Any]] = {}
    for system in s.systems:
        info: dict[str, Any] = {}
        systems[system] = info
        runner = run_child if system in CHILD_SYSTEMS else run_served
        cells += runner(system, s, args, prompts, log_dir, info)
    table = rows(cells)
    tgts = targets(table)
    result = {"benchmark": NAME,
              "config": {"systems": list(s.systems), "loads": list(s.loads),
                         "batches": list(s.batches), "rounds": s.rounds,
                         "input_len": s.input_len, "output_len": s.output_len,
                         "settle_s": s.settle_s, "model": args.model or "default",
                         "autogroup": _autogroup()},
              "cells": table, "targets": tgts, "systems": systems,
              "wall_s": time.perf_counter() - t0, "machine": machine_info()}
    path = write_json(out, NAME, result)
    print()
    print(render_table(table))
    counts = {k: sum(r["verdict"] == k for r in table) for k in ("met", "MISSED")}
    print(f"targets: {counts['met']} met, {counts['MISSED']} MISSED, "
          f"{len(tgts) - counts['met'] - counts['MISSED']} without a figure")
    print(f"wrote {path}")
    return result


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _autogroup() -> str | None:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return None


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
