"""Argument parsing for `pdcluster bench <name>`; the router's CLI mounts it.

``add_bench_subcommands(subparsers)`` adds ``bench`` with one subcommand per benchmark listed
in ``_builtin``; each subcommand stores its runner as ``args.func``. A new benchmark module
provides ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args)`` and is listed there;
one that runs nothing (``compare`` reads result files) gets ``--out`` only (``common=False``).
``python -m bench.cli <name> ...`` runs a benchmark without the router's CLI.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.harness.report import DEFAULT_OUT_DIR


@dataclass(frozen=True)
class Benchmark:
    """One `bench` subcommand: its help line, its own arguments, and its runner."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Any]
    baseline: bool = False  # accepts --baseline transformers
    common: bool = True  # --model, --quick, --seed, --num-threads (else only --out)


def _builtin() -> list[Benchmark]:
    from bench.cluster import (
        autoscale,
        chaos,
        disagg,
        kv_cache,
        neighbour,
        overload,
        plan_check,
        prefix,
        ttft_breakdown,
    )
    from bench.engine import ceilings, kernels, lora, policies, spec, sweep
    from bench.server import compare, serve_load

    cluster = [Benchmark(m.NAME, m.HELP, m.add_arguments, m.run)
               for m in (ttft_breakdown, disagg, serve_load, chaos, prefix, autoscale,
                         plan_check, neighbour, kv_cache, overload)]
    return [
        Benchmark("ceilings", "this machine's copy/GEMV bandwidth and fp32 matmul rate",
                  ceilings.add_arguments, ceilings.run),
        Benchmark(kernels.NAME, kernels.HELP, kernels.add_arguments, kernels.run),
        Benchmark("sweep", "throughput and latency over batch size, against the roofline",
                  sweep.add_arguments, sweep.run, baseline=True),
        Benchmark("policies", "static vs dynamic vs continuous batching, slot utilization",
                  policies.add_arguments, policies.run, baseline=True),
        Benchmark(spec.NAME, spec.HELP, spec.add_arguments, spec.run),
        Benchmark(lora.NAME, lora.HELP, lora.add_arguments, lora.run),
        *cluster,
        Benchmark(compare.NAME, compare.HELP, compare.add_arguments, compare.run, common=False),
    ]


def _add_common(p: argparse.ArgumentParser, baseline: bool, common: bool) -> None:
    p.add_argument("--out", default=str(DEFAULT_OUT_DIR),
                   help=f"folder for the JSON and PNG results (default {DEFAULT_OUT_DIR}/)")
    if not common:
        return
    p.add_argument("--model", default=None,
                   help="model directory or .gguf (default: the default SmolLM2-135M model)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes: finishes in under 2 minutes (for smoke runs)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's)")
    if baseline:
        p.add_argument("--baseline", choices=("none", "transformers"), default="none",
                       help="also run transformers on the same weights and workload")


def add_bench_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` (and its subcommands) to a CLI's subparsers; returns the ``bench`` parser.

    Each subcommand sets ``args.func(args)``; the caller dispatches with ``args.func(args)``.
    """
    bench = subparsers.add_parser("bench", help="engine and cluster benchmarks",
                                  description="Benchmarks; results go to --out as JSON + PNG.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for b in _builtin():
        p = sub.add_parser(b.name, help=b.help, description=b.help)
        _add_common(p, b.baseline, b.common)
        b.add_arguments(p)
        p.set_defaults(func=b.run)
    return bench


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.cli <benchmark> [options]`` (the same as ``pdcluster bench ...``)."""
    parser = argparse.ArgumentParser(prog="python -m bench.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_subcommands(sub)
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    try:
        args.func(args)
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
