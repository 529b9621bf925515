"""`pdcluster bench chaos`: what worker faults cost the users of a 2 prefill + 2 decode cluster.

Two rounds, each on a fresh cluster with the product's defaults (Ray restarts a killed
worker, which rejoins): N concurrent greedy streams run while the benchmark kills a decode
worker mid-stream (round 1: SIGKILL, round 2: SIGSTOP, continued after the streams finish),
then a prefill worker while new prompts are in prefill (``--prefill-fault off``: the decode
worker alone); then it aborts requests at random
phases (queued, reserving, prefilling, decoding). It reports, per round: requests completed,
streams token-for-token equal to an undisturbed engine run of the same prompts, KV blocks
still held by any worker afterwards (restarted ones included, once they rejoined), which
workers restarted and rejoined, and the latency a migration adds (end-to-end time of
migrated streams minus the median of streams the faults did not touch, same round).
Targets: 100% completed, 100% identical, 0 leaked, every worker ready again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cluster.ttft_breakdown import ray_session
from bench.harness.engine_under_test import model_config
from bench.harness.report import machine_info, print_targets, write_json
from bench.harness.report import target as make_target
from bench.harness.stats import percentile
from bench.harness.workload import make_prompts

NAME = "chaos"
HELP = "kill / stop decode and prefill workers mid-stream, abort at random: is anything lost?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=None,
                   help="concurrent greedy streams per round (default 16; --quick 6)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per stream (default 96; --quick 48)")
    p.add_argument("--aborts", type=int, default=None,
                   help="requests aborted at random phases per round (default 200; --quick 40)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--suspect-after", type=float, default=1.0,
                   help="the router's heartbeat: a silent decode worker's streams move after "
                        "this many seconds (default 1, the product's; 0: off, only the 5 s "
                        "load-report silence)")
    p.add_argument("--worker-restarts", type=int, default=3,
                   help="how often Ray restarts a dead worker (default 3, the product's; 0: "
                        "killed workers stay dead, so no restart competes with the migration "
                        "for the cores, and 'ready again' cannot be met)")
    p.add_argument("--migration-prefill", default="auto", choices=("auto", "prefill", "decode"),
                   help="where a moved stream's prompt + tokens are computed again (default "
                        "auto, the product's: a prefill worker if one is idle, else the new "
                        "decode worker)")
    p.add_argument("--prefill-fault", default="on", choices=("on", "off"),
                   help="on (default): prefill-0 is also SIGKILLed 0.3 s after the decode "
                        "worker, while the second wave is in prefill; off: the decode worker "
                        "alone is taken down")
    p.add_argument("--prefix-pull", default="auto", choices=("auto", "always", "off"),
                   help="the router's prefix pulls (default auto, the product's): a moved "
                        "stream rebuilt on a decode worker first pulls what a prefill worker "
                        "still holds of its prompt when that is estimated cheaper")
    p.add_argument("--signals", default="SIGKILL,SIGSTOP",
                   help="how the decode worker is taken down, one round each, in order "
                        "(default SIGKILL,SIGSTOP)")


def _signals(text: str) -> list[str]:
    sigs = [s.strip().upper() for s in text.split(",") if s.strip()]
    bad = [s for s in sigs if s not in ("SIGKILL", "SIGSTOP")]
    if not sigs or bad:
        raise SystemExit(f"--signals: SIGKILL and/or SIGSTOP, got {text!r}")
    return sigs


@dataclass
class StreamRun:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    e2e_s: float = 0.0
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # wall clock of each token chunk


async def _stream(cluster: Any, rid: str, prompt: list[int], max_tokens: int,
                  first_token: asyncio.Semaphore | None = None) -> StreamRun:
    from engine import SamplingParams
    from router.contract import GenerateInput

    run = StreamRun(rid)
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        async for ch in cluster.generate(GenerateInput(params, token_ids=prompt, request_id=rid)):
            if first_token is not None and not run.tokens and ch.token_ids:
                first_token.release()
            run.tokens += ch.token_ids
            if ch.token_ids:
                run.chunk_times.append(time.time())
    except Exception as e:  # counted as not completed
        run.error = f"{type(e).__name__}: {e}"
    run.e2e_s = time.perf_counter() - t0
    return run


async def _abort_storm(cluster: Any, prompts: list[list[int]], n: int, seed: int) -> None:
    """``n`` requests, each cancelled after a random delay: some while queued or reserving,
    some mid-prefill, some while decoding."""
    rng = random.Random(seed)

    async def one(i: int) -> None:
        task = asyncio.ensure_future(_stream(cluster, f"abort-{i}", prompts[i % len(prompts)], 64))
        await asyncio.sleep(rng.uniform(0.0, 1.5))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    await asyncio.gather(*[one(i) for i in range(n)])


async def _held(cluster: Any, timeout_s: float = 60.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        loads = await cluster.worker_loads()
        held = {lo.worker_id: lo.kv_blocks_used + lo.kv_blocks_reserved for lo in loads
                if lo.kv_blocks_used or lo.kv_blocks_reserved}
        if not held or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.2)


async def _all_ready(cluster: Any, timeout_s: float = 120.0) -> list:
    """Every worker's status once all are ready again (killed ones restarted and rejoined),
    or as they are at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await cluster.cluster_status()
        if all(w.state == "ready" for w in status) or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.5)


async def _round(args: argparse.Namespace, sig: str, prompts, refs, n_streams: int,
                 max_tokens: int, n_aborts: int) -> dict[str, Any]:
    from engine import EngineArgs
    from router.cluster.ray_cluster import Cluster, ClusterConfig
    from router.routing.policy import RoutingConfig

    cfg = ClusterConfig(model=args.model, num_prefill_workers=2, num_decode_workers=2,
                        prefill_engine=EngineArgs(num_threads=1, max_num_seqs=8),
                        decode_engine=EngineArgs(num_threads=1), transfer_timeout_s=10.0,
                        lease_s=20.0, capacity_wait_s=60.0, suspect_after_s=args.suspect_after,
                        worker_restarts=args.worker_restarts,
                        migration_prefill=args.migration_prefill,
                        routing=RoutingConfig(prefix_pull=args.prefix_pull))
    cluster = await Cluster.start(cfg)
    try:
        pids = {w.id: w.pid for w in await cluster.cluster_status()}
        started = asyncio.Semaphore(0)
        first = [asyncio.ensure_future(_stream(cluster, f"s{i}", prompts[i], max_tokens, started))
                 for i in range(n_streams)]
        for _ in range(n_streams):  # every stream is decoding somewhere
            await started.acquire()
        # The decode worker holding the most live streams is the one to lose.
        live = [s.decode_id for s in cluster.orchestrator._streams.values() if s.committed]
        victim = max(("decode-0", "decode-1"), key=live.count)
        on_victim = {rid for rid, s in cluster.orchestrator._streams.items()
                     if s.decode_id == victim and s.committed}
        fault_ts = time.time()
        os.kill(pids[victim], getattr(signal, sig))
        # A second wave of prompts, and the prefill worker dies while they are in prefill.
        second = [asyncio.ensure_future(_stream(cluster, f"t{i}", prompts[n_streams + i],
                                                max_tokens)) for i in range(n_streams)]
        if args.prefill_fault == "on":
            await asyncio.sleep(0.3)
            os.kill(pids["prefill-0"], signal.SIGKILL)
        runs = list(await asyncio.gather(*first, *second))
        if sig == "SIGSTOP":
            os.kill(pids[victim], signal.SIGCONT)
        await _abort_storm(cluster, prompts, n_aborts, args.seed)
        status = await _all_ready(cluster, 120.0 if args.worker_restarts else 0.0)
        held = await _held(cluster)
        stats = await cluster.stats()
        store = cluster.orchestrator.store
        journals = {rid: store.journal_get(rid) for rid in on_victim} if store else {}
        timings = {rid: cluster.orchestrator.phases.timings.get(rid) for rid in on_victim}
    finally:
        await cluster.shutdown()
    ref_of = {f"s{i}": refs[i] for i in range(n_streams)}
    ref_of.update({f"t{i}": refs[n_streams + i] for i in range(n_streams)})
    completed = [r for r in runs if r.error is None]
    identical = [r for r in completed if r.tokens == ref_of[r.request_id]]
    moved = [r.e2e_s for r in runs if r.request_id in on_victim and r.error is None]
    calm = [r.e2e_s for r in runs if r.request_id not in on_victim and r.request_id[0] == "s"
            and r.error is None]
    base = percentile(calm, 50) if calm else 0.0
    added = [m - base for m in moved]
    return {"signal": sig, "requests": len(runs), "completed": len(completed),
            "identical": len(identical), "migrated_streams": len(on_victim),
            "migrations": stats.migrations, "aborted": n_aborts, "blocks_leaked": held,
            "workers_ready": sum(w.state == "ready" for w in status), "workers": len(status),
            "restarts": {w.id: w.restarts for w in status if w.restarts},
            "added_latency_p50_s": percentile(added, 50) if added else None,
            "added_latency_p99_s": percentile(added, 99) if added else None,
            # Moved streams whose rebuild pulled part of its prompt from another worker.
            "rebuilds_pulled": sum(any(e.kind == "pulled" and e.ts >= fault_ts for e in j)
                                   for j in journals.values()),
            "after_fault": _after_fault(fault_ts, [r for r in runs if r.request_id in on_victim],
                                        journals, timings),
            # What the move cost the streams it did not touch: their longest gap between
            # tokens after the fault (a re-prefill on their decode worker stalls them once).
            "bystanders_gap_s": _gaps_after(fault_ts, [r for r in runs if r.request_id
                                                       not in on_victim and r.error is None
                                                       and r.request_id[0] == "s"]),
            "streams": [{"id": r.request_id, "moved": r.request_id in on_victim,
                         "e2e_s": r.e2e_s, "chunks": len(r.chunk_times),
                         "longest_gap_after_fault_s": _longest_gap(fault_ts, r),
                         "chunk_times_after_fault_s": [round(t - fault_ts, 4)
                                                       for t in r.chunk_times]}
                        for r in runs],
            "errors": sorted({r.error for r in runs if r.error})[:5]}


_STEPS = (("detect", "migrated"), ("route_reserve", "reserved"), ("prefill", "prefilled"),
          ("commit", "committed"))


def _after_fault(fault_ts: float, moved: list[StreamRun], journals: dict[str, list],
                 timings: dict[str, Any]) -> dict[str, Any]:
    """Where a migrated stream's freeze went, p50 and max over the moved streams (s): from the
    fault to the router's ``migrated`` journal event (detection), then route + reserve,
    the re-prefill (split into its wait in the prefill worker's queue and its compute), the
    commit (KV received), and the first token to the client after it; ``freeze`` is the
    client's gap from its last token before the fault to its first after. A re-prefill on
    the new decode worker itself (``migration_prefill``) has no reserve, prefill or commit
    step: detect and freeze only."""
    parts: dict[str, list[float]] = {name: [] for name, _ in _STEPS}
    parts.update(prefill_queue=[], prefill_compute=[], first_token=[], freeze=[])
    for run in moved:
        events = [e for e in journals.get(run.request_id, []) if e.ts >= fault_ts]
        timing = timings.get(run.request_id)  # its last attempt's: the re-prefill's ...
        if timing is not None and any(e.kind == "prefilled" for e in events):
            parts["prefill_queue"].append(timing.queue_s)  # ... if on a prefill worker
            parts["prefill_compute"].append(timing.prefill_compute_s)
        at, t = {}, fault_ts
        for name, kind in _STEPS:  # each step's first event after the previous one
            ev = next((e for e in events if e.kind == kind and e.ts >= t), None)
            if ev is None:
                break
            parts[name].append(ev.ts - t)
            at[name], t = ev.ts, ev.ts
        before = [c for c in run.chunk_times if c < fault_ts]
        after = [c for c in run.chunk_times if c >= at.get("detect", fault_ts)]
        if "commit" in at and after:
            parts["first_token"].append(after[0] - at["commit"])
        if before and after:
            parts["freeze"].append(after[0] - before[-1])
    return {name: {"p50": percentile(v, 50), "max": max(v), "n": len(v)}
            for name, v in parts.items() if v}


def _longest_gap(fault_ts: float, run: StreamRun) -> float | None:
    """``run``'s longest gap between tokens from its last one before the fault on."""
    before = [t for t in run.chunk_times if t < fault_ts]
    times = before[-1:] + [t for t in run.chunk_times if t >= fault_ts]
    if len(times) < 2:
        return None
    return max(b - a for a, b in zip(times[:-1], times[1:], strict=True))


def _gaps_after(fault_ts: float, runs: list[StreamRun]) -> dict[str, float] | None:
    """p50 and max over ``runs`` of each one's longest gap between tokens after the fault."""
    gaps = [g for g in (_longest_gap(fault_ts, r) for r in runs) if g is not None]
    return {"p50": percentile(gaps, 50), "max": max(gaps), "n": len(gaps)} if gaps else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    n_streams = args.streams or (6 if args.quick else 16)
    max_tokens = args.max_tokens or (48 if args.quick else 96)
    n_aborts = args.aborts or (40 if args.quick else 200)
    if min(n_streams, max_tokens, n_aborts, args.prompt_len) <= 0:
        raise ValueError("--streams, --max-tokens, --aborts and --prompt-len must be > 0")
    t0 = time.perf_counter()
    vocab = model_config(args.model).vocab_size
    prompts = make_prompts(2 * n_streams, args.prompt_len, vocab, seed=args.seed)
    refs = _reference(args, prompts, max_tokens)
    with ray_session(num_workers=4):
        rounds = [asyncio.run(_round(args, sig, prompts, refs, n_streams, max_tokens, n_aborts))
                  for sig in _signals(args.signals)]
    total = sum(r["requests"] for r in rounds)
    completed = sum(r["completed"] for r in rounds) / total
    identical = sum(r["identical"] for r in rounds) / total
    leaked = sum(sum(r["blocks_leaked"].values()) for r in rounds)
    ready = sum(r["workers_ready"] for r in rounds) / sum(r["workers"] for r in rounds)
    targets = [make_target("requests completed", completed, 1.0),
               make_target("streams identical to an undisturbed run", identical, 1.0),
               make_target("KV blocks leaked", float(leaked), 0.0, higher_is_better=False),
               make_target("workers ready again after the faults", ready, 1.0)]
    result = {"benchmark": NAME, "config": {"streams": n_streams, "max_tokens": max_tokens,
                                            "aborts": n_aborts, "prompt_len": args.prompt_len,
                                            "suspect_after_s": args.suspect_after,
                                            "worker_restarts": args.worker_restarts,
                                            "migration_prefill": args.migration_prefill,
                                            "prefill_fault": args.prefill_fault,
                                            "prefix_pull": args.prefix_pull,
                                            "model": args.model or "default"},
              "rounds": rounds, "targets": targets, "wall_s": time.perf_counter() - t0,
              "machine": machine_info()}
    out = Path(args.out)
    path = write_json(out, NAME, result)
    _plot(rounds, out / f"{NAME}.png")
    for r in rounds:
        p50, p99 = r["added_latency_p50_s"], r["added_latency_p99_s"]
        print(f"{r['signal']:7s}: {r['completed']}/{r['requests']} completed, {r['identical']} "
              f"identical, {r['migrated_streams']} migrated, {r['aborted']} aborted, leaked "
              f"{r['blocks_leaked'] or 0}, restarted {r['restarts'] or 'none'}, "
              f"{r['workers_ready']}/{r['workers']} ready; migration adds p50 "
              f"{(p50 or 0) * 1e3:.0f} ms, p99 {(p99 or 0) * 1e3:.0f} ms")
        print(f"         rebuilds that pulled their prompt: {r['rebuilds_pulled']} of "
              f"{r['migrated_streams']}")
        print("         after the fault (p50 / max ms): " + ", ".join(
            f"{k} {v['p50'] * 1e3:.0f} / {v['max'] * 1e3:.0f}"
            for k, v in r["after_fault"].items()))
        if r["bystanders_gap_s"]:
            gap = r["bystanders_gap_s"]
            print(f"         untouched streams' longest gap after it (p50 / max): "
                  f"{gap['p50'] * 1e3:.0f} / {gap['max'] * 1e3:.0f} ms")
    print_targets(targets)
    print(f"wrote {path}")
    return result


def _reference(args: argparse.Namespace, prompts: list[list[int]], max_tokens: int) -> list:
    """The same prompts through one undisturbed in-process engine (greedy)."""
    from engine import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=len(prompts))
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True))
    return [o.token_ids for o in outs]


def _plot(rounds: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [r["signal"] for r in rounds]
    width = 0.25
    for k, (key, color) in enumerate((("requests", "#bbbbbb"), ("completed", "#4c72b0"),
                                      ("identical", "#55a868"))):
        ax.bar([i + (k - 1) * width for i in range(len(rounds))], [r[key] for r in rounds],
               width, label=key, color=color)
    ax.set_xticks(range(len(rounds)), labels)
    ax.set_ylabel("requests")
    ax.set_title("decode worker lost mid-stream, then a prefill worker")
    ax.legend(loc="lower center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
