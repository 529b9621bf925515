"""`pdcluster bench plan`: the planner's simulator against the real cluster, on this host.

For each split (``--splits``, default 1P+1D, 1P+2D, 2P+1D) and each named workload
(``--workloads``, default chat and rag at ``--rate``), the same seeded requests run on a
fresh disaggregated cluster of the default model (unpinned workers, ``--num-threads`` each
(default 1), as the profiles were measured) and through ``router.planning.simulator`` with this host's profiles
(measured first: ``pdcluster profile`` and ``pdcluster profile --served``, quick grid; or
the one ``--profile``). The targets judge the served profile's predictions (what ``plan`` is
meant to get); the bare engine's are reported beside them (``by_profile``). Reported per
cell: goodput (requests within ``--slo``), TTFT p50 / p99 and TPOT p50, predicted and
measured, and their ratio. Target: every ratio within 25% (0.75..1.25).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

from bench.cluster.autoscale import Outcome, run_request
from bench.cluster.ttft_breakdown import ray_session
from bench.harness.engine_under_test import model_config
from bench.harness.report import machine_info, print_targets, ratio, write_json
from bench.harness.report import target as make_target
from bench.harness.stats import percentile

NAME = "plan"
HELP = "the planner's simulator vs the real cluster: goodput, TTFT, TPOT for 3 splits x 2 loads"
TOLERANCE = 0.25


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None,
                   help="a `pdcluster profile` JSON of this host (default: measure one now)")
    p.add_argument("--splits", default="1x1,1x2,2x1", help="PxD,... (default 1x1,1x2,2x1)")
    p.add_argument("--workloads", default="chat,rag", help="named workloads (default chat,rag)")
    p.add_argument("--rate", type=float, default=None,
                   help="requests/s (default: chat 0.3, rag 0.25)")
    p.add_argument("--duration", type=float, default=None, help="seconds per run (default 90)")
    p.add_argument("--slo", default="ttft=4,tpot=0.2", help="the goodput SLO")
    p.add_argument("--max-num-seqs", type=int, default=16)


RATES = {"chat": 0.3, "rag": 0.25, "mixed": 0.3}


def _splits(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        p, _, d = part.strip().partition("x")
        if not (p.isdigit() and d.isdigit()) or int(p) < 1 or int(d) < 1:
            raise ValueError(f"--splits: {part!r} is not PxD (e.g. 1x2)")
        out.append((int(p), int(d)))
    return out


def _cluster_config(model, split, args, threads: int, max_len: int):
    from engine import EngineArgs
    from router.cluster.ray_cluster import ClusterConfig
    from router.routing.policy import RoutingConfig

    common = dict(num_threads=threads, max_model_len=max_len, enable_prefix_caching=False)
    return ClusterConfig(
        model=model, num_prefill_workers=split[0], num_decode_workers=split[1],
        prefill_engine=EngineArgs(max_num_seqs=8, **common),
        decode_engine=EngineArgs(max_num_seqs=args.max_num_seqs, **common),
        worker_num_cpus=0.5, routing=RoutingConfig("load"))


async def _measure(model, split, args, threads: int, requests, prompts, max_len: int
                   ) -> list[Outcome]:
    from router.cluster.ray_cluster import Cluster

    cluster = await Cluster.start(_cluster_config(model, split, args, threads, max_len))
    try:
        # Every worker's first steps (allocations, kernel plans) before the clock starts.
        warm = [Outcome(0.0) for _ in range(2 * (split[0] + split[1]))]
        await asyncio.gather(*(run_request(cluster, prompts[i % len(prompts)][:32], 2, f"warm-{i}", o)
                               for i, o in enumerate(warm)))
        t0 = time.perf_counter()
        outs, tasks = [], []
        for i, r in enumerate(requests):
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            o = Outcome(r.arrival_s)
            outs.append(o)
            tasks.append(asyncio.ensure_future(
                run_request(cluster, prompts[i], r.output_tokens, f"plan-{i}", o)))
        await asyncio.gather(*tasks)
        return outs
    finally:
        await cluster.shutdown()


def _stats(ttfts: list[float], tpots: list[float], within: int, span: float) -> dict:
    return {"goodput_rps": within / max(span, 1e-9),
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
            "tpot_p50_s": percentile(tpots, 50) if tpots else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine import EngineArgs
    from engine.tuning.profile import EngineProfile, ProfileGrid, profile_engine
    from router.planning.loopback import add_loopback
    from router.planning.plan import parse_slo
    from router.planning.served_profile import profile_served
    from router.planning.simulator import ClusterShape, simulate
    from router.planning.workload import named_workload

    t0 = time.perf_counter()
    threads = args.num_threads or 1  # each worker's, and the profile's
    splits, slo = _splits(args.splits), parse_slo(args.slo)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    duration = args.duration or (40.0 if args.quick else 90.0)
    if args.profile:
        profiles = {"given": EngineProfile.load(args.profile)}
    else:
        # Both: the bare engine's steps, and the served ones `plan` is meant to get.
        print("measuring this host's profiles (pdcluster profile [--served], quick grid) ...",
              flush=True)
        profiles = {"bare": add_loopback(profile_engine(
                        EngineArgs(model=args.model, num_threads=threads), ProfileGrid.quick())),
                    "served": profile_served(args.model, threads, ProfileGrid.quick())}
    judged = "given" if "given" in profiles else "served"
    cores = float(os.cpu_count() or 1)
    cells, targets = [], []
    with ray_session(num_workers=4):
        for wl in workloads:
            requests = named_workload(wl, args.rate or RATES.get(wl, 0.3), duration,
                                      args.seed, max_len=2048)
            rng = random.Random(args.seed)
            vocab = model_config(args.model).vocab_size
            prompts = [[rng.randrange(10, vocab) for _ in range(r.prompt_tokens)]
                       for r in requests]
            max_len = max(r.prompt_tokens + r.output_tokens for r in requests) + 16
            span = requests[-1].arrival_s - requests[0].arrival_s
            for split in splits:
                predictions = {}
                for kind, profile in profiles.items():
                    shape = ClusterShape(split[0], split[1], args.max_num_seqs, 1 << 30,
                                         cores=cores, threads=threads,
                                         max_num_batched_tokens=profile.max_num_batched_tokens)
                    sim = simulate(profile, shape, requests, *slo)
                    predictions[kind] = _stats(sim.ttft_s, sim.tpot_s, sim.within_slo, span)
                predicted = predictions[judged]
                outs = asyncio.run(_measure(args.model, split, args, threads, requests, prompts,
                                            max_len))
                ok = [o for o in outs if o.error is None]
                within = sum(o.ttft_s <= slo[0] and o.tpot_s <= slo[1] for o in ok)
                measured = _stats([o.ttft_s for o in ok], [o.tpot_s for o in ok], within, span)
                measured["lost"] = len(outs) - len(ok)
                name = f"{wl} {split[0]}P+{split[1]}D"
                cell = {"cell": name, "requests": len(requests), "profile": judged,
                        "predicted": predicted, "measured": measured,
                        "ratio": {k: ratio(predicted[k], measured[k]) for k in predicted},
                        "by_profile": {kind: {k: ratio(pr[k], measured[k]) for k in pr}
                                       for kind, pr in predictions.items()}}
                cells.append(cell)
                for k, r in cell["ratio"].items():
                    targets.append(make_target(f"{name}: {k} predicted / measured, off by",
                                               None if r is None else abs(r - 1), TOLERANCE,
                                               higher_is_better=False))
                print(f"{name}: " + ", ".join(
                    f"{k} {predicted[k] or 0:.3g} vs {measured[k] or 0:.3g}" for k in predicted),
                    flush=True)
    result = {"benchmark": NAME, "complete": True,
              "config": {"splits": splits, "workloads": workloads, "duration_s": duration,
                         "slo": {"ttft_s": slo[0], "tpot_s": slo[1]}, "threads": threads,
                         "max_num_seqs": args.max_num_seqs, "cores": cores,
                         "model": args.model or "default"},
              "profiles": {kind: {"prefill": p.prefill, "decode": p.decode,
                                  "loopback_bytes_s": p.loopback_bytes_s,
                                  "overhead_s": p.overhead_s,
                                  "router_cpu_s_per_token": p.router_cpu_s_per_token,
                                  "prefill_beside_decode": p.prefill_beside_decode,
                                  "decode_beside_prefill": p.decode_beside_prefill,
                                  "busy_overhead_steps": p.busy_overhead_steps}
                           for kind, p in profiles.items()},
              "cells": cells, "targets": targets, "wall_s": time.perf_counter() - t0,
              "machine": machine_info()}
    path = write_json(Path(args.out), NAME, result)
    print_targets(targets)
    print(f"wrote {path}")
    return result
