"""`pdcluster bench autoscale`: a day's load in minutes, against ``--autoscale`` and a fixed split.

A seeded open-loop load (Poisson arrivals, thinned to a rate that ramps up from ``--low-rate``
to ``--peak-rate`` over ``--ramp-s``, holds the peak for ``--hold-s``, then drops back to the
low rate for ``--drop-s``) runs twice on a fresh cluster of the default model each time:

1. ``--autoscale``: starting at 1 prefill + 1 decode worker, bounds 1..``--max-workers`` per
   role, with windows scaled to the run (interval 1 s, up window 3 s, down window 10 s,
   cooldown 5 s; the product's defaults are minutes, for real days);
2. the fixed split the autoscaled run needed at its peak (the most workers of each role it
   ran at once), all the time: what one provisions for the peak without an autoscaler.

Per run: requests sent, completed, and lost (an error, or no end: must be 0); SLO attainment
(TTFT <= ``--slo-ttft`` and TPOT <= ``--slo-tpot``); goodput (requests within SLO per second)
and goodput per worker-second (worker-seconds: the integral of the workers running, started
or draining ones included, sampled every 0.25 s); the scale events and the streams a
scale-down migrated. Targets: 0 lost in both runs; the autoscaled run's goodput per
worker-second at least the fixed split's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cluster.ttft_breakdown import ray_session
from bench.harness.engine_under_test import model_config
from bench.harness.report import machine_info, print_targets, ratio, write_json
from bench.harness.report import target as make_target
from bench.harness.stats import summarize
from bench.harness.workload import make_prompts

NAME = "autoscale"
HELP = "a load that ramps up, holds and drops: --autoscale vs the fixed split for its peak"
SAMPLE_S = 0.25


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--low-rate", type=float, default=0.3, help="requests/s off-peak")
    p.add_argument("--peak-rate", type=float, default=None,
                   help="requests/s at the peak (default 2.5)")
    p.add_argument("--ramp-s", type=float, default=None, help="ramp-up seconds (default 30)")
    p.add_argument("--hold-s", type=float, default=None, help="peak seconds (default 60)")
    p.add_argument("--drop-s", type=float, default=None,
                   help="off-peak seconds after the peak (default 40)")
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-workers", type=int, default=2,
                   help="the autoscaler's upper bound per role (default 2)")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="decode workers' batch cap: the autoscaler's decode utilization is "
                        "sequences over it (default 8)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.25, help="seconds (default 0.25)")


@dataclass(frozen=True)
class Load:
    low_rate: float
    peak_rate: float
    ramp_s: float
    hold_s: float
    drop_s: float

    @property
    def duration_s(self) -> float:
        return self.ramp_s + self.hold_s + self.drop_s

    def rate(self, t: float) -> float:
        if t < self.ramp_s:
            return self.low_rate + (self.peak_rate - self.low_rate) * t / self.ramp_s
        return self.peak_rate if t < self.ramp_s + self.hold_s else self.low_rate

    def arrivals(self, seed: int) -> list[float]:
        """Seeded inhomogeneous Poisson arrivals (thinning at the peak rate)."""
        rng, t, out = random.Random(seed), 0.0, []
        top = max(self.peak_rate, self.low_rate)
        while True:
            t += rng.expovariate(top)
            if t >= self.duration_s:
                return out
            if rng.random() * top < self.rate(t):
                out.append(t)


@dataclass
class Outcome:
    sent_at: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    error: str | None = None


@dataclass
class Run:
    name: str
    split: tuple[int, int] = (1, 1)  # its starting (prefill, decode)
    outcomes: list[Outcome] = field(default_factory=list)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, P, D)
    wall_s: float = 0.0
    decisions: dict = field(default_factory=dict)
    migrated_by_drain: int = 0


def _config(args, model: str | None, split: tuple[int, int], autoscale: bool):
    from engine import EngineArgs
    from router.cluster.autoscale import AutoscaleConfig
    from router.cluster.ray_cluster import ClusterConfig
    from router.control.autoscaler import ScalePolicy

    auto = None
    if autoscale:
        policy = ScalePolicy(min_prefill=1, max_prefill=args.max_workers, min_decode=1,
                             max_decode=args.max_workers, interval_s=1.0, up_window_s=3.0,
                             down_window_s=10.0, cooldown_s=5.0)
        auto = AutoscaleConfig(policy, ready_timeout_s=180.0, drain_migrate_after_s=5.0)
    max_len = args.prompt_len + args.max_tokens + 16
    return ClusterConfig(
        model=model, num_prefill_workers=split[0], num_decode_workers=split[1],
        prefill_engine=EngineArgs(num_threads=1, max_num_seqs=8, max_model_len=max_len),
        decode_engine=EngineArgs(num_threads=1, max_num_seqs=args.max_num_seqs,
                                 max_model_len=max_len),
        worker_num_cpus=0.5, autoscale=auto)


async def run_request(cluster, prompt: list[int], max_tokens: int, rid: str, out: Outcome) -> None:
    """Run one greedy request to its end (``ignore_eos``); fill ``out`` with its TTFT and
    TPOT, or its error (a lost request). Shared with ``bench.cluster.plan_check``."""
    from engine import SamplingParams
    from router.contract import GenerateInput

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    times: list[float] = []
    n = 0
    try:
        async for ch in cluster.generate(GenerateInput(params, token_ids=prompt, request_id=rid)):
            if ch.token_ids:
                times.append(time.perf_counter())
                n += len(ch.token_ids)
    except Exception as e:  # lost: the benchmark's target is that this never happens
        out.error = f"{type(e).__name__}: {e}"[:200]
        return
    if n < max_tokens:
        out.error = f"ended after {n} of {max_tokens} tokens"
        return
    out.ttft_s = times[0] - start
    out.tpot_s = (times[-1] - times[0]) / max(n - 1, 1)


async def _run(args, model: str | None, run: Run, load: Load, arrivals: list[float],
               prompts: list[list[int]], autoscale: bool) -> None:
    from router.cluster.ray_cluster import Cluster

    cluster = await Cluster.start(_config(args, model, run.split, autoscale))
    stop = asyncio.Event()

    async def sample(t0: float) -> None:
        busy = ("starting", "ready", "draining", "unreachable")
        while not stop.is_set():
            ws = await cluster.cluster_status()
            run.timeline.append((time.perf_counter() - t0,
                                 sum(w.role == "prefill" and w.state in busy for w in ws),
                                 sum(w.role != "prefill" and w.state in busy for w in ws)))
            await asyncio.sleep(SAMPLE_S)
    try:
        t0 = time.perf_counter()
        sampler = asyncio.ensure_future(sample(t0))
        tasks = []
        for i, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            out = Outcome(at)
            run.outcomes.append(out)
            tasks.append(asyncio.ensure_future(
                run_request(cluster, prompts[i], args.max_tokens, f"{run.name}-{i}", out)))
        await asyncio.gather(*tasks)
        # The load's own length, not the last request's end: both runs pay for the same span.
        await asyncio.sleep(max(0.0, t0 + load.duration_s - time.perf_counter()))
        run.wall_s = time.perf_counter() - t0
        stop.set()
        await sampler
        stats = await cluster.stats()
        run.decisions = {"/".join(k): v for k, v in sorted(stats.autoscaler_decisions.items())}
        run.migrated_by_drain = stats.migrations.get("drained", 0)
    finally:
        stop.set()
        await cluster.shutdown()


def _worker_seconds(run: Run) -> float:
    tl = run.timeline
    return sum((b[0] - a[0]) * (a[1] + a[2]) for a, b in zip(tl, tl[1:], strict=False))


def _summary(run: Run, args) -> dict[str, Any]:
    ok = [o for o in run.outcomes if o.error is None]
    within = [o for o in ok if o.ttft_s <= args.slo_ttft and o.tpot_s <= args.slo_tpot]
    ws = _worker_seconds(run)
    ttft, tpot = summarize([o.ttft_s for o in ok]), summarize([o.tpot_s for o in ok])
    peak = (max((p for _, p, _ in run.timeline), default=0),
            max((d for _, _, d in run.timeline), default=0))
    return {"sent": len(run.outcomes), "completed": len(ok),
            "lost": len(run.outcomes) - len(ok),
            "errors": sorted({o.error for o in run.outcomes if o.error})[:5],
            "slo_attainment": len(within) / max(len(run.outcomes), 1),
            "goodput_rps": len(within) / max(run.wall_s, 1e-9),
            "worker_seconds": ws, "goodput_per_worker_s": len(within) / max(ws, 1e-9),
            "ttft_p50_s": ttft.p50, "ttft_p99_s": ttft.p99, "tpot_p50_s": tpot.p50,
            "tpot_p99_s": tpot.p99, "peak_workers": {"prefill": peak[0], "decode": peak[1]},
            "start_split": {"prefill": run.split[0], "decode": run.split[1]},
            "scale_decisions": run.decisions, "streams_migrated_by_drain": run.migrated_by_drain,
            "wall_s": run.wall_s, "timeline": run.timeline}


def run(args: argparse.Namespace) -> dict[str, Any]:
    load = Load(args.low_rate, args.peak_rate or (2.0 if args.quick else 2.5),
                args.ramp_s or (10.0 if args.quick else 30.0),
                args.hold_s or (20.0 if args.quick else 60.0),
                args.drop_s or (20.0 if args.quick else 40.0))
    if min(load.low_rate, load.peak_rate, args.prompt_len, args.max_tokens) <= 0:
        raise ValueError("rates, --prompt-len and --max-tokens must be > 0")
    if args.max_workers < 1:
        raise ValueError("--max-workers must be >= 1")
    t0 = time.perf_counter()
    arrivals = load.arrivals(args.seed)
    prompts = make_prompts(len(arrivals), args.prompt_len, model_config(args.model).vocab_size,
                           seed=args.seed)
    runs = {}
    with ray_session(num_workers=2 * args.max_workers):
        auto = Run("autoscale")
        asyncio.run(_run(args, args.model, auto, load, arrivals, prompts, autoscale=True))
        runs["autoscale"] = _summary(auto, args)
        peak = runs["autoscale"]["peak_workers"]
        fixed = Run("fixed", (max(1, peak["prefill"]), max(1, peak["decode"])))
        asyncio.run(_run(args, args.model, fixed, load, arrivals, prompts, autoscale=False))
        runs["fixed"] = _summary(fixed, args)
    a, f = runs["autoscale"], runs["fixed"]
    targets = [
        make_target("requests lost, autoscale", float(a["lost"]), 0.0, higher_is_better=False),
        make_target("requests lost, fixed", float(f["lost"]), 0.0, higher_is_better=False),
        make_target("goodput per worker-second, autoscale / fixed",
                    ratio(a["goodput_per_worker_s"], f["goodput_per_worker_s"]), 1.0),
    ]
    result = {"benchmark": NAME, "complete": True,
              "config": {"load": load.__dict__, "requests": len(arrivals),
                         "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                         "max_workers": args.max_workers, "max_num_seqs": args.max_num_seqs,
                         "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
                         "model": args.model or "default",
                         "autoscaler": "interval 1 s, up window 3 s, down window 10 s, "
                                       "cooldown 5 s, target 0.7, drain migrate after 5 s"},
              "runs": runs, "targets": targets, "wall_s": time.perf_counter() - t0,
              "machine": machine_info()}
    out = Path(args.out)
    path = write_json(out, NAME, result)
    _plot(load, runs, out / f"{NAME}.png")
    for name, r in runs.items():
        print(f"{name:9s}: {r['completed']}/{r['sent']} completed, {r['lost']} lost, SLO "
              f"{r['slo_attainment']:.0%}, goodput {r['goodput_rps']:.2f} req/s, "
              f"{r['worker_seconds']:.0f} worker-s -> {r['goodput_per_worker_s']:.3f} "
              f"per worker-s; TTFT p50 {r['ttft_p50_s'] or 0:.2f} s, TPOT p50 "
              f"{(r['tpot_p50_s'] or 0) * 1e3:.0f} ms; peak {r['peak_workers']}; decisions "
              f"{r['scale_decisions'] or 'none'}; migrated by drains "
              f"{r['streams_migrated_by_drain']}")
    print_targets(targets)
    print(f"wrote {path}")
    return result


def _plot(load: Load, runs: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    ts = [i * 0.5 for i in range(int(load.duration_s * 2) + 1)]
    ax2 = ax.twinx()
    ax2.plot(ts, [load.rate(t) for t in ts], color="grey", ls=":", label="offered req/s")
    ax2.set_ylabel("offered load (req/s)")
    for name, r in runs.items():
        tl = r["timeline"]
        ax.step([t for t, _, _ in tl], [p + d for _, p, d in tl], where="post",
                label=f"{name}: workers")
    ax.set_xlabel("seconds")
    ax.set_ylabel("workers running")
    ax.legend(loc="upper left")
    ax.set_title("bench autoscale: workers over a ramp / hold / drop load")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
