"""`pdcluster bench prefix`: KV-aware vs load vs round-robin routing on prefix-heavy traffic,
each run on a fresh 2 prefill + 2 decode cluster. This package's one entry point (``NAME``,
``HELP``, ``add_arguments``, ``run``, mounted by ``bench.cli``) runs one of two modes:

- by default, the two chat workloads, ``multi_turn`` and ``shared_prefix``
  (``bench.cluster.prefix.workloads``; writes ``prefix.json``);
- with ``--sweep``, a grid of shared-prefix cells over prefix count x reuse count x
  concurrency x pool fraction, with and without the host KV tier
  (``bench.cluster.prefix.sweep``; writes ``prefix_sweep.json``).

Both build on ``bench.cluster.prefix.runs``: the request shapes, one request as the client saw
it, one (workload, policy) run on a fresh cluster with its counters before and after, and a
run's summary.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.cluster.prefix.runs import POLICIES
from bench.cluster.prefix.sweep import add_sweep_arguments, refuse_sweep_flags, run_sweep
from bench.cluster.prefix.workloads import NAME, WORKLOADS, run_workloads

__all__ = ["HELP", "NAME", "add_arguments", "run"]

HELP = "KV-aware vs load vs round-robin routing on multi-turn and shared-prefix chat (2P+2D)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated, from {', '.join(POLICIES)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--conversations", type=int, default=None, help="multi_turn (default 8)")
    p.add_argument("--turns", type=int, default=None, help="multi_turn (default 12)")
    p.add_argument("--doc-len", type=int, default=None, help="multi_turn opening context (512)")
    p.add_argument("--user-len", type=int, default=24, help="multi_turn new message per turn")
    p.add_argument("--think-s", type=float, default=0.3,
                   help="multi_turn: most seconds between an answer and the next turn")
    p.add_argument("--output-len", type=int, default=None,
                   help="answer tokens per request (default 16; --sweep: 4)")
    p.add_argument("--system-prompts", type=int, default=None, help="shared_prefix (default 8)")
    p.add_argument("--system-len", type=int, default=None,
                   help="shared_prefix (default 1024, --quick 192; --sweep: 256, --quick 128)")
    p.add_argument("--users", type=int, default=None, help="shared_prefix requests (default 40)")
    p.add_argument("--question-len", type=int, default=None,
                   help="shared_prefix question (default 48; --sweep: 16)")
    p.add_argument("--concurrency", type=int, default=4, help="shared_prefix in flight")
    p.add_argument("--cache-fraction", type=float, default=0.6,
                   help="each worker's KV pool / the workload's working set (default 0.6)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill workers' --max-prefill-chunk: at most this many prompt tokens "
                        "of one request per step (default: none, a whole prompt a step)")
    add_sweep_arguments(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The two workloads (``prefix.json``), or with ``--sweep`` the grid (``prefix_sweep.json``);
    a sweep flag without ``--sweep`` is refused rather than ignored."""
    if args.sweep:
        return run_sweep(args)
    refuse_sweep_flags(args)
    return run_workloads(args)
