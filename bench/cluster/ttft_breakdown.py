"""`pdcluster bench ttft_breakdown`: where a disaggregated request's time-to-first-token goes.

One prefill and one decode worker, each pinned to its own core, serve 512-token prompts
twice in the same run: with layer-wise KV streaming (each layer sent while the next one
computes) and with every layer sent after the prompt's last step. TTFT, as the client sees
it, is split into the prefill worker's own measurements (``orchestrator.phases.timings``):

- ``queue_s``: arrival on the prefill worker -> its first scheduled step;
- ``prefill_compute_s``: that step -> the end of the step that finished the prompt;
- ``transfer_tail_s``: the end of that step -> every KV send completed (what streaming hides);
- ``other_s``: the rest (router work, reserve and commit calls, Ray hops, first-token stream).

Phase 1 sends requests one at a time (queueing ~0); phase 2 sends a few at once, so later
ones queue behind earlier ones on the prefill worker (its token budget fits one prompt per step).

With ``--prefill-tp`` / ``--decode-tp`` the same run measures that pair of tensor-parallel
sizes after the TP 1 pair, on the same prompts: KV then moves over per-(prefill rank, decode
rank) pairs (``kv_transfer.routes``), and the transfer tail says what that costs. The TP
workers are not pinned (a pinned worker's ranks would share its one core); one thread a rank.

Also holds what the other cluster benchmarks share: ``ray_session`` (start Ray once for
several clusters and stop it after) and ``timed_generate`` (client-side chunk timestamps).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.engine_under_test import model_config
from bench.harness.report import machine_info, print_targets, ratio, write_json
from bench.harness.report import target as make_target
from bench.harness.stats import summarize
from bench.harness.workload import make_prompts

NAME = "ttft_breakdown"
HELP = "TTFT split into queueing, prefill compute and KV transfer tail (streamed vs at end)"
TAIL_TARGET = 0.20  # streaming: transfer tail < 20% of prefill compute
SEGMENTS = ("queue_s", "prefill_compute_s", "transfer_tail_s", "other_s")


# ---- shared with bench.cluster.disagg --------------------------------------------------------
@contextlib.contextmanager
def ray_session(num_workers: int = 4) -> Iterator[None]:
    """Start a local Ray for several clusters in a row (one ~10 s start, not one per setup)
    and shut it down afterwards; a Ray that is already running is used and left running."""
    import ray

    from router.cluster.local_ray import start_local_ray
    from router.cluster.placement import DECODE_RESOURCE, PREFILL_RESOURCE

    started = False
    if not ray.is_initialized():
        # Logical CPUs only: the workers pin themselves to real cores (cpu_affinity).
        start_local_ray(num_cpus=max(4, num_workers + 1), include_dashboard=False,
                        log_to_driver=False,
                        resources={PREFILL_RESOURCE: num_workers, DECODE_RESOURCE: num_workers})
        started = True
    try:
        yield
    finally:
        if started:
            ray.shutdown()


@dataclass
class ClientTrace:
    """One request as the client saw it: when it was sent and when each chunk arrived."""

    request_id: str
    start: float  # time.perf_counter() when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_tokens)

    def itls(self) -> list[float]:
        """Gaps between consecutive token-carrying chunks (one per decode step)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


async def timed_generate(cluster: Any, prompt: list[int], max_tokens: int,
                         request_id: str, trace: ClientTrace | None = None) -> ClientTrace:
    """Run one greedy request to its end (``ignore_eos``) and timestamp every chunk. Pass
    ``trace`` to watch the chunks arrive from another task; its ``start`` is reset here."""
    from engine import SamplingParams
    from router.contract import GenerateInput

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    trace = trace or ClientTrace(request_id, 0.0)
    trace.start = time.perf_counter()
    async for chunk in cluster.generate(GenerateInput(params, token_ids=prompt,
                                                      request_id=request_id)):
        if chunk.token_ids:
            trace.chunk_times.append(time.perf_counter())
            trace.chunk_tokens.append(len(chunk.token_ids))
    if not trace.chunk_times:
        raise RuntimeError(f"request {request_id} finished without producing a token")
    return trace


def pinned_overrides(assignments: dict[str, tuple[int, ...]]) -> dict[str, dict]:
    """worker id -> cores, as ``ClusterConfig.worker_overrides``; cores this machine does not
    have are dropped (a 1-core box runs every worker on core 0) rather than failing."""
    import os

    have = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    out = {}
    for wid, cores in assignments.items():
        usable = tuple(c for c in cores if c in have) or (have[0],)
        out[wid] = {"cpu_affinity": usable}
    return out


# ---- this benchmark --------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestBreakdown:
    """One request's TTFT and its parts (seconds)."""

    request_id: str
    ttft_s: float
    queue_s: float
    prefill_compute_s: float
    transfer_tail_s: float
    other_s: float  # ttft_s minus the three measured parts


@dataclass
class PhaseResult:
    """One (transfer mode, phase) cell: per-request rows and their means."""

    stream_layers: bool
    phase: str  # "sequential" | "concurrent"
    requests: list[RequestBreakdown]
    kv_bytes_per_request: float
    means: dict[str, float] = field(default_factory=dict)
    tp: tuple[int, int] = (1, 1)  # (prefill, decode) tensor-parallel sizes

    def __post_init__(self) -> None:
        for key in ("ttft_s", *SEGMENTS):
            self.means[key] = sum(getattr(r, key) for r in self.requests) / len(self.requests)
        self.means["ttft_p99_s"] = summarize([r.ttft_s for r in self.requests]).p99
        compute = self.means["prefill_compute_s"]
        self.means["tail_over_compute"] = self.means["transfer_tail_s"] / compute if compute else None
        tail = self.means["transfer_tail_s"]
        # Bytes per second of exposed wait: the link rate when nothing overlaps (send at the end).
        self.means["effective_transfer_gb_s"] = (self.kv_bytes_per_request / tail / 1e9
                                                 if tail > 0 else None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="sequential requests per mode (default 8; --quick 3)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests sent at once in the concurrent phase (default 4; --quick 2)")
    p.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                   help="2: run again with prefill and decode on two simulated hosts (network "
                        "namespaces on a bridge; needs root) and compare with one host")
    p.add_argument("--prefill-tp", type=int, default=1,
                   help="also measure a prefill worker of this many tensor-parallel ranks")
    p.add_argument("--decode-tp", type=int, default=1,
                   help="also measure a decode worker of this many tensor-parallel ranks")
    # The two-host run re-enters this benchmark on the simulated prefill host, joined there.
    p.add_argument("--ray-address", default=None, help=argparse.SUPPRESS)


async def _phase(cluster: Any, prompts: list[list[int]], max_tokens: int, concurrent: bool,
                 tag: str) -> tuple[list[RequestBreakdown], int]:
    orch = cluster.orchestrator
    bytes_before = orch.kv_transfer_bytes_total
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    if concurrent:
        traces = await asyncio.gather(*[timed_generate(cluster, p, max_tokens, r)
                                        for p, r in zip(prompts, rids, strict=True)])
    else:
        traces = [await timed_generate(cluster, p, max_tokens, r)
                  for p, r in zip(prompts, rids, strict=True)]
    rows = []
    for tr in traces:
        t = orch.phases.timings[tr.request_id]
        other = tr.ttft_s - t.queue_s - t.prefill_compute_s - t.transfer_tail_s
        rows.append(RequestBreakdown(tr.request_id, tr.ttft_s, t.queue_s, t.prefill_compute_s,
                                     t.transfer_tail_s, max(other, 0.0)))
    return rows, orch.kv_transfer_bytes_total - bytes_before


async def _run_mode(args: argparse.Namespace, stream_layers: bool, seq_prompts, conc_prompts,
                    warm_prompts, tp: tuple[int, int] = (1, 1)) -> list[PhaseResult]:
    from engine import EngineArgs
    from router.cluster.ray_cluster import Cluster, ClusterConfig

    max_len = args.prompt_len + args.max_tokens + 16
    pinned = tp == (1, 1)
    cfg = ClusterConfig(
        model=args.model, mode="disaggregated", num_prefill_workers=1, num_decode_workers=1,
        ray_address=args.ray_address,
        # A token budget of one prompt: concurrent prompts queue instead of sharing a step.
        prefill_engine=EngineArgs(block_size=16, num_threads=1, max_num_seqs=8,
                                  max_num_batched_tokens=max(args.prompt_len, 16),
                                  max_model_len=max_len, tensor_parallel_size=tp[0]),
        decode_engine=EngineArgs(block_size=16, num_threads=1, max_model_len=max_len,
                                 tensor_parallel_size=tp[1]),
        stream_layers=stream_layers,
        worker_overrides=(pinned_overrides({"prefill-0": (0,), "decode-0": (1,)})
                          if pinned else {}))
    cluster = await Cluster.start(cfg)
    tag = ("stream" if stream_layers else "end") + ("" if pinned else f"-tp{tp[0]}x{tp[1]}")
    try:
        # Warm-up: the first forward and the lazy gloo group/handshake are one-off costs.
        await _phase(cluster, warm_prompts, args.max_tokens, False, f"{tag}-warm")
        seq, seq_bytes = await _phase(cluster, seq_prompts, args.max_tokens, False, f"{tag}-seq")
        conc, conc_bytes = await _phase(cluster, conc_prompts, args.max_tokens, True, f"{tag}-conc")
    finally:
        await cluster.shutdown()
    return [PhaseResult(stream_layers, "sequential", seq, seq_bytes / len(seq), tp=tp),
            PhaseResult(stream_layers, "concurrent", conc, conc_bytes / len(conc), tp=tp)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run both transfer modes (same prompts), write ``ttft_breakdown.json`` + ``.png``."""
    num_seq = args.num_requests or (3 if args.quick else 8)
    conc = args.concurrency or (2 if args.quick else 4)
    if args.prompt_len <= 0 or num_seq <= 0 or conc <= 0 or args.max_tokens <= 0:
        raise ValueError("--prompt-len, --num-requests, --concurrency and --max-tokens must be > 0")
    tp = (args.prefill_tp, args.decode_tp)
    if min(tp) < 1:
        raise ValueError("--prefill-tp and --decode-tp must be >= 1")
    sizes = [(1, 1)] + ([tp] if tp != (1, 1) else [])
    vocab = model_config(args.model).vocab_size
    t0 = time.perf_counter()
    session = contextlib.nullcontext() if args.ray_address else ray_session(num_workers=2)
    with session:
        phases = []
        for size in sizes:
            for i, stream_layers in enumerate((True, False)):
                # Same lengths, fresh ids per mode (each mode gets a new cluster anyway); the
                # same prompts for every TP size.
                ps = make_prompts(2 + num_seq + conc, args.prompt_len, vocab,
                                  seed=args.seed + 7919 * i)
                phases += asyncio.run(_run_mode(args, stream_layers, ps[2:2 + num_seq],
                                                ps[2 + num_seq:], ps[:2], size))
    two_hosts = _two_hosts(args) if args.hosts == 2 and not args.ray_address else None
    by = {(p.stream_layers, p.phase): p for p in phases if p.tp == (1, 1)}
    stream_seq, end_seq = by[(True, "sequential")], by[(False, "sequential")]
    ratio_stream = stream_seq.means["tail_over_compute"]
    targets = [make_target(
        "streaming transfer tail / prefill compute (sequential)", ratio_stream, TAIL_TARGET,
        higher_is_better=False,
        reason="the last layer's send plus the finish handshake outlast the target share")]
    result = {
        "benchmark": NAME,
        "config": {"model": args.model or "default", "prompt_len": args.prompt_len,
                   "num_sequential": num_seq, "concurrency": conc, "max_tokens": args.max_tokens,
                   "workers": "1 prefill (core 0) + 1 decode (core 1), 1 torch thread each"},
        "phases": [{"mode": "stream_layers" if p.stream_layers else "send_at_end",
                    "phase": p.phase, "prefill_tp": p.tp[0], "decode_tp": p.tp[1],
                    "kv_bytes_per_request": p.kv_bytes_per_request,
                    **p.means, "requests": p.requests} for p in phases],
        "tp": _tp_ratios(phases, tp) if tp != (1, 1) else None,
        "tail_over_compute_streaming": ratio_stream,
        "tail_over_compute_send_at_end": end_seq.means["tail_over_compute"],
        "kv_bytes_per_request": stream_seq.kv_bytes_per_request,
        "link_gb_s": end_seq.means["effective_transfer_gb_s"],
        "ttft_saved_by_streaming_s": end_seq.means["ttft_s"] - stream_seq.means["ttft_s"],
        "targets": targets,
        "two_hosts": two_hosts,
        "wall_s": time.perf_counter() - t0,
        "machine": machine_info(),
    }
    out = Path(args.out)
    path = write_json(out, NAME, result)
    _plot(phases, out / f"{NAME}.png")
    for p in phases:
        m = p.means
        print(f"tp {p.tp[0]}x{p.tp[1]} {'stream' if p.stream_layers else 'at-end':6s} {p.phase:10s} "
              f"ttft {m['ttft_s'] * 1e3:7.1f} ms = queue {m['queue_s'] * 1e3:6.1f} + compute "
              f"{m['prefill_compute_s'] * 1e3:7.1f} + tail {m['transfer_tail_s'] * 1e3:6.1f} + "
              f"other {m['other_s'] * 1e3:6.1f}  ({p.kv_bytes_per_request / 1e6:.1f} MB KV)")
    if two_hosts:
        for mode in ("stream_layers", "send_at_end"):
            one = next(p.means for p in phases if p.phase == "sequential"
                       and p.stream_layers == (mode == "stream_layers"))
            two = two_hosts["sequential"][mode]
            print(f"{mode:13s} sequential: ttft {one['ttft_s'] * 1e3:7.1f} ms one host, "
                  f"{two['ttft_s'] * 1e3:7.1f} ms two hosts; tail {one['transfer_tail_s'] * 1e3:6.1f}"
                  f" / {two['transfer_tail_s'] * 1e3:6.1f} ms")
        print(f"bridge between the simulated hosts: {two_hosts['bridge_gb_s']:.2f} GB/s (one TCP "
              f"stream); KV at the end, exposed: {two_hosts['link_gb_s'] or 0:.2f} GB/s")
    print_targets(targets)
    print(f"wrote {path}")
    return result


def _tp_ratios(phases: list[PhaseResult], tp: tuple[int, int]) -> dict[str, Any]:
    """TP pair / TP 1 pair, per mode and phase: TTFT and the exposed transfer tail."""
    by = {(p.tp, p.stream_layers, p.phase): p.means for p in phases}
    out: dict[str, Any] = {"prefill_tp": tp[0], "decode_tp": tp[1]}
    for stream_layers in (True, False):
        for phase in ("sequential", "concurrent"):
            one, many = by[((1, 1), stream_layers, phase)], by[(tp, stream_layers, phase)]
            out[f"{'stream_layers' if stream_layers else 'send_at_end'}/{phase}"] = {
                "ttft_ratio": ratio(many["ttft_s"], one["ttft_s"]),
                "tail_ratio": ratio(many["transfer_tail_s"], one["transfer_tail_s"]),
                "compute_ratio": ratio(many["prefill_compute_s"], one["prefill_compute_s"]),
                "tail_s": (many["transfer_tail_s"], one["transfer_tail_s"])}
    return out


def _two_hosts(args: argparse.Namespace) -> dict[str, Any]:
    """The same measurement with the prefill worker (and router) on one simulated host and
    the decode worker on another; the bridge's raw TCP rate is measured beside it."""
    import json
    import sys
    import tempfile

    from bench.cluster.simhosts import HostSpec, SimCluster, unavailable_reason
    from router.cluster.placement import DECODE_RESOURCE, PREFILL_RESOURCE

    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"--hosts 2 needs simulated hosts: {reason}")
    specs = [HostSpec("prefill", {"router": 1, PREFILL_RESOURCE: 1}, num_cpus=2),
             HostSpec("decode", {DECODE_RESOURCE: 1}, num_cpus=2)]
    with SimCluster(specs) as sim, tempfile.TemporaryDirectory() as tmp:
        sim.start_ray()
        bridge = sim.measure_bandwidth_gb_s("prefill", "decode")
        argv = [sys.executable, "-m", "router.cli", "bench", NAME, "--out", tmp,
                "--ray-address", sim.ray_address, "--prompt-len", str(args.prompt_len),
                "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
        for flag, value in (("--model", args.model), ("--num-requests", args.num_requests),
                            ("--concurrency", args.concurrency)):
            if value is not None:
                argv += [flag, str(value)]
        if args.quick:
            argv.append("--quick")
        res = sim.run("prefill", argv, timeout_s=900, cwd=str(Path(__file__).parents[2]))
        if res.returncode != 0:
            raise RuntimeError(f"two-host run failed: {res.stderr[-3000:]}")
        inner = json.loads((Path(tmp) / f"{NAME}.json").read_text())
    table: dict[str, dict[str, Any]] = {"sequential": {}, "concurrent": {}}
    for ph in inner["phases"]:
        table[ph["phase"]][ph["mode"]] = {k: ph[k] for k in ("ttft_s", *SEGMENTS)}
    return {**table, "bridge_gb_s": bridge, "link_gb_s": inner["link_gb_s"],
            "tail_over_compute_streaming": inner["tail_over_compute_streaming"],
            "hosts": [{"name": h.name, "ip": h.ip} for h in sim.hosts]}


def _plot(phases: list[PhaseResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{'streamed' if p.stream_layers else 'at end'}\n{p.phase}"
              + (f"\nTP {p.tp[0]}x{p.tp[1]}" if p.tp != (1, 1) else "") for p in phases]
    colors = {"queue_s": "#bbbbbb", "prefill_compute_s": "#4c72b0",
              "transfer_tail_s": "#dd8452", "other_s": "#55a868"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bottom = [0.0] * len(phases)
    for seg in SEGMENTS:
        vals = [p.means[seg] * 1e3 for p in phases]
        ax.bar(labels, vals, bottom=bottom, label=seg.removesuffix("_s"), color=colors[seg])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("mean time to first token (ms)")
    ax.set_title("TTFT breakdown, 1 prefill + 1 decode worker (1 core each)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

