"""`pdcluster bench disagg`: decode inter-token latency while long prompts keep arriving.

Three setups on the same two cores, same workload:

- ``colocated_unchunked``: two colocated workers (core 0, core 1), each prefilling whole prompts
  in one step, so a long prompt stalls every decode stream on its worker for the whole prefill;
- ``colocated_chunked``: the same two workers with chunked prefill (``--chunk-size`` tokens per
  step shared with the decodes), which bounds the stall to one chunk;
- ``disaggregated``: one prefill worker (core 0) streaming KV to one decode worker (core 1);
- ``disaggregated_tp`` (added when ``--prefill-tp`` / ``--decode-tp`` ask for more than one
  rank): the same pair with tensor-parallel workers, one thread per rank, not pinned (their
  ranks share the two cores): TP's cost and gain beside TP 1 in one run.

Why two one-core colocated workers rather than one two-thread worker: every setup is then two
single-threaded engines, one per core, and only the division of labour differs; the router
splits the traffic between the two colocated workers (it picks the worker with more free KV),
the way a colocated deployment of N replicas would. (One two-thread worker would also change
the per-step GEMM speed, which is a different question.)

Workload: ``--num-streams`` steady requests (short prompt, ``--output-len`` tokens) start
together; once all are decoding, ``--num-long`` long prompts (``--long-prompt-len`` tokens,
``--long-max-tokens`` outputs) arrive every ``--long-interval-s``. ITL = gap between token
chunks of the steady streams at the client, counted while long prompts are in the system
(first long arrival -> last long request done; ``itl_all_*`` count the whole streams); TTFT
is that of the long-prompt requests.

``--target LABEL=URL`` (repeatable) sends the same workload to running OpenAI-compatible
servers instead (``pdcluster serve`` in either mode, ``vllm serve``, ...), one after another,
over streamed ``/v1/completions`` with token-id prompts: the same ITL and TTFT figures, keyed by
label, so a user can compare decode ITL under long prompts across servers on one machine. The
servers must serve ``--model``'s weights (the prompts' token ids are drawn below its vocab).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cluster.ttft_breakdown import (
    ClientTrace,
    pinned_overrides,
    ray_session,
    timed_generate,
)
from bench.harness.engine_under_test import model_config
from bench.harness.report import machine_info, print_targets, ratio, write_json
from bench.harness.report import target as make_target
from bench.harness.stats import summarize
from bench.harness.workload import make_prompts

NAME = "disagg"
HELP = "decode ITL under long-prompt arrivals: colocated (chunked or not) vs disaggregated"
SETUPS = ("colocated_unchunked", "colocated_chunked", "disaggregated", "disaggregated_tp")
DEFAULT_SETUPS = SETUPS[:3]
ITL_P99_TARGET = 3.0  # colocated-unchunked p99 / disaggregated p99


@dataclass(frozen=True)
class Workload:
    num_streams: int
    stream_prompt_len: int
    output_len: int
    num_long: int
    long_prompt_len: int
    long_max_tokens: int
    long_interval_s: float
    chunk_size: int
    prefill_tp: int = 1  # disaggregated_tp's ranks per worker
    decode_tp: int = 1


@dataclass
class SetupRun:
    """What the client saw in one setup (times are seconds since the setup's start)."""

    name: str
    streams: list[ClientTrace]
    longs: list[ClientTrace]
    long_arrivals_s: list[float]
    t0: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setups", default=None,
                   help=f"comma-separated subset of {', '.join(SETUPS)} (default: the first "
                        "three, plus disaggregated_tp when a TP flag is above 1)")
    p.add_argument("--prefill-tp", type=int, default=1,
                   help="disaggregated_tp: tensor-parallel ranks of the prefill worker")
    p.add_argument("--decode-tp", type=int, default=1,
                   help="disaggregated_tp: tensor-parallel ranks of the decode worker")
    p.add_argument("--num-streams", type=int, default=4, help="steady decode requests")
    p.add_argument("--stream-prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=None,
                   help="tokens per steady stream (default 160; --quick 64)")
    p.add_argument("--num-long", type=int, default=None,
                   help="long prompts sent during decoding (default 6; --quick 2)")
    p.add_argument("--long-prompt-len", type=int, default=None,
                   help="tokens per long prompt (default 1024; --quick 512)")
    p.add_argument("--long-max-tokens", type=int, default=4)
    p.add_argument("--long-interval-s", type=float, default=None,
                   help="seconds between long prompts (default 3.0; --quick 1.5)")
    p.add_argument("--chunk-size", type=int, default=128,
                   help="colocated_chunked: max_num_batched_tokens per step")
    p.add_argument("--target", action="append", default=None, metavar="LABEL=URL",
                   help="a running OpenAI-compatible server to load instead of the setups "
                        "(repeatable; each is run in turn): e.g. vllm=http://127.0.0.1:8001")
    p.add_argument("--api-key", default=None,
                   help="--target: sent as a Bearer token (default: $OPENAI_API_KEY)")


def parse_targets(values: list[str]) -> list[tuple[str, str]]:
    """``["vllm=http://h:1", "h:2"]`` -> ``[("vllm", "http://h:1"), ("h:2", "http://h:2")]``
    (a bare URL is labelled by its host:port). Raises ValueError on a repeated label or a
    URL that is not http(s)."""
    from urllib.parse import urlsplit

    from bench.server.serve_target import base_url

    out: list[tuple[str, str]] = []
    for value in values:
        label, sep, url = value.partition("=")
        if not sep:
            label, url = "", value
        url = base_url(url)
        label = label.strip() or urlsplit(url).netloc
        if label in (lbl for lbl, _ in out):
            raise ValueError(f"--target: label {label!r} given twice")
        out.append((label, url))
    if not out:
        raise ValueError("--target: give at least one LABEL=URL")
    return out


def _workload(args: argparse.Namespace) -> Workload:
    q = args.quick
    w = Workload(args.num_streams, args.stream_prompt_len,
                 args.output_len or (64 if q else 160), args.num_long or (2 if q else 6),
                 args.long_prompt_len or (512 if q else 1024), args.long_max_tokens,
                 (args.long_interval_s if args.long_interval_s is not None else 1.5 if q else 3.0), args.chunk_size,
                 getattr(args, "prefill_tp", 1), getattr(args, "decode_tp", 1))
    for name in ("num_streams", "stream_prompt_len", "output_len", "num_long", "long_prompt_len",
                 "long_max_tokens", "chunk_size", "prefill_tp", "decode_tp"):
        if getattr(w, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(w, name)}")
    if w.output_len < 2:
        raise ValueError("--output-len must be >= 2 (an ITL needs two tokens)")
    if w.long_interval_s < 0:
        raise ValueError(f"--long-interval-s must be >= 0, got {w.long_interval_s}")
    return w


def _cluster_config(name: str, model: str | None, w: Workload) -> Any:
    from engine import EngineArgs
    from router.cluster.ray_cluster import ClusterConfig

    max_len = max(w.long_prompt_len + w.long_max_tokens, w.stream_prompt_len + w.output_len) + 16
    common = dict(block_size=16, num_threads=1, max_model_len=max_len)
    if name == "disaggregated_tp":
        # Not pinned: a worker's ranks inherit its affinity, and TP 2 needs both cores.
        return ClusterConfig(
            model=model, mode="disaggregated", num_prefill_workers=1, num_decode_workers=1,
            prefill_engine=EngineArgs(**common, max_num_seqs=8,
                                      max_num_batched_tokens=max(max_len, 2048),
                                      tensor_parallel_size=w.prefill_tp),
            decode_engine=EngineArgs(**common, tensor_parallel_size=w.decode_tp))
    if name == "disaggregated":
        return ClusterConfig(
            model=model, mode="disaggregated", num_prefill_workers=1, num_decode_workers=1,
            prefill_engine=EngineArgs(**common, max_num_seqs=8,
                                      max_num_batched_tokens=max(max_len, 2048)),
            decode_engine=EngineArgs(**common),
            worker_overrides=pinned_overrides({"prefill-0": (0,), "decode-0": (1,)}))
    if name == "colocated_unchunked":
        # A budget of a whole prompt and no chunking: each prompt is prefilled in one step.
        engine = EngineArgs(**common, enable_chunked_prefill=False,
                            max_num_batched_tokens=max(max_len, 2048))
    elif name == "colocated_chunked":
        engine = EngineArgs(**common, enable_chunked_prefill=True,
                            max_num_batched_tokens=w.chunk_size)
    else:
        raise ValueError(f"unknown setup {name!r}; choose from {', '.join(SETUPS)}")
    return ClusterConfig(model=model, mode="colocated", num_prefill_workers=0,
                         num_decode_workers=2, decode_engine=engine,
                         worker_overrides=pinned_overrides({"decode-0": (0,), "decode-1": (1,)}))


# gen(prompt, max_tokens, trace): run one greedy request to its end, appending to ``trace``.
Generate = Callable[[list[int], int, ClientTrace], Awaitable[Any]]


async def _drive(name: str, gen: Generate, w: Workload, stream_prompts, long_prompts,
                 warm_prompt) -> SetupRun:
    """The workload against one server: warm it, start the steady streams, and once all are
    decoding send the long prompts at their interval; wait for everything."""
    # Warm both workers (first forward, lazy KV groups) with one long and one short prompt.
    await asyncio.gather(gen(warm_prompt, 2, ClientTrace(f"{name}-warm-0", 0.0)),
                         gen(stream_prompts[0], 2, ClientTrace(f"{name}-warm-1", 0.0)))
    t0 = time.perf_counter()
    streams = [ClientTrace(f"{name}-stream-{i}", 0.0) for i in range(w.num_streams)]
    stream_tasks = [asyncio.ensure_future(gen(p, w.output_len, tr))
                    for p, tr in zip(stream_prompts, streams, strict=True)]
    while not all(tr.chunk_times for tr in streams):  # every stream is decoding
        if any(t.done() and t.exception() for t in stream_tasks):
            break
        await asyncio.sleep(0.005)
    longs = [ClientTrace(f"{name}-long-{i}", 0.0) for i in range(w.num_long)]
    long_tasks, arrivals = [], []
    start = time.perf_counter()
    for i, (p, tr) in enumerate(zip(long_prompts, longs, strict=True)):
        await asyncio.sleep(max(0.0, start + i * w.long_interval_s - time.perf_counter()))
        arrivals.append(time.perf_counter() - t0)
        long_tasks.append(asyncio.ensure_future(gen(p, w.long_max_tokens, tr)))
    await asyncio.gather(*stream_tasks, *long_tasks)
    return SetupRun(name, streams, longs, arrivals, t0)


async def _run_setup(name: str, model: str | None, w: Workload, stream_prompts, long_prompts,
                     warm_prompt) -> SetupRun:
    from router.cluster.ray_cluster import Cluster

    cluster = await Cluster.start(_cluster_config(name, model, w))

    async def gen(prompt: list[int], max_tokens: int, trace: ClientTrace) -> None:
        await timed_generate(cluster, prompt, max_tokens, trace.request_id, trace)

    try:
        return await _drive(name, gen, w, stream_prompts, long_prompts, warm_prompt)
    finally:
        await cluster.shutdown()


async def http_generate(client: Any, model: str, prompt: list[int], max_tokens: int,
                        trace: ClientTrace) -> ClientTrace:
    """One greedy streamed ``/v1/completions`` request (``ignore_eos``), every event that
    carries text timestamped into ``trace`` (one token per event: how our server and vLLM's
    stream; a server that packs several would show its packing as longer gaps). Events
    without text (a bare finish reason, the usage record) are not tokens."""
    from bench.server.serve_clients import completion_body, completion_events

    trace.start = time.perf_counter()
    async for msg in completion_events(client, completion_body(prompt, max_tokens, model)):
        if any(c.get("text") for c in msg.get("choices") or ()):
            trace.chunk_times.append(time.perf_counter())
            trace.chunk_tokens.append(1)
    if not trace.chunk_times:
        raise RuntimeError(f"request {trace.request_id} finished without producing a token")
    return trace


async def _run_target(label: str, url: str, api_key: str | None, w: Workload, stream_prompts,
                      long_prompts, warm_prompt) -> SetupRun:
    from bench.server.serve_target import Target, http_client, server_facts

    t = Target("http", url, label, api_key or os.environ.get("OPENAI_API_KEY") or None)
    facts = await server_facts(t)
    need = max(w.long_prompt_len + w.long_max_tokens, w.stream_prompt_len + w.output_len)
    if facts.max_model_len is not None and facts.max_model_len < need:
        raise ValueError(f"{label}: max_model_len {facts.max_model_len} < the {need} tokens "
                         "a request needs; lower --long-prompt-len or --output-len")
    async with http_client(t) as client:
        gen = functools.partial(http_generate, client, facts.model_id)
        return await _drive(label, gen, w, stream_prompts, long_prompts, warm_prompt)


def _window_itls(run_: SetupRun) -> list[float]:
    """Steady-stream ITLs that ended while long prompts were arriving or being served: from
    the first long arrival to the last long request's final token. Falls back to every ITL
    when the streams finished before the first arrival (nothing overlapped)."""
    if not run_.longs:
        return [x for tr in run_.streams for x in tr.itls()]
    lo = run_.t0 + run_.long_arrivals_s[0]
    hi = max(tr.chunk_times[-1] for tr in run_.longs)
    out = [b - a for tr in run_.streams
           for a, b in zip(tr.chunk_times, tr.chunk_times[1:], strict=False) if lo <= b <= hi]
    return out or [x for tr in run_.streams for x in tr.itls()]


def _summarize(run_: SetupRun) -> dict[str, Any]:
    all_itls = [x for tr in run_.streams for x in tr.itls()]
    itl = summarize(_window_itls(run_))
    every = summarize(all_itls)
    ttft = summarize([tr.ttft_s for tr in run_.longs])
    tokens = sum(tr.num_tokens for tr in run_.streams)
    span = max(tr.chunk_times[-1] for tr in run_.streams) - run_.t0
    return {"itl_p50_s": itl.p50, "itl_p90_s": itl.p90, "itl_p99_s": itl.p99,
            "itl_mean_s": itl.mean, "num_itl_samples": itl.count,
            "itl_all_p50_s": every.p50, "itl_all_p99_s": every.p99,
            "itl_max_s": max(all_itls) if all_itls else None, "num_itl_all": every.count,
            "ttft_mean_s": ttft.mean, "ttft_p50_s": ttft.p50, "ttft_p99_s": ttft.p99,
            "stream_tokens": tokens, "stream_decode_tok_s": tokens / span if span > 0 else None,
            "long_arrivals_s": run_.long_arrivals_s}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen setups on one Ray; write ``disagg.json`` and ``disagg.png``. With
    ``--target``, load those servers instead (``run_targets``)."""
    if args.target:
        return run_targets(args)
    w = _workload(args)
    if args.setups is None:
        names = list(DEFAULT_SETUPS) + (["disaggregated_tp"]
                                        if max(w.prefill_tp, w.decode_tp) > 1 else [])
    else:
        names = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETUPS]
    if unknown or not names:
        raise ValueError(f"--setups: unknown {unknown or 'empty list'}; choose from {', '.join(SETUPS)}")
    vocab = model_config(args.model).vocab_size
    t_start = time.perf_counter()
    runs: list[SetupRun] = []
    with ray_session(num_workers=2):
        for k, name in enumerate(names):
            # Fresh ids per setup; equal lengths, so every setup does the same work.
            seed = args.seed + 1000 * k
            streams = make_prompts(w.num_streams, w.stream_prompt_len, vocab, seed=seed)
            longs = make_prompts(w.num_long + 1, w.long_prompt_len, vocab, seed=seed + 1)
            runs.append(asyncio.run(_run_setup(name, args.model, w, streams, longs[1:], longs[0])))
            print(f"  {name}: done ({time.perf_counter() - t_start:.0f} s)")
    setups = {r.name: _summarize(r) for r in runs}
    p99 = {n: s["itl_p99_s"] for n, s in setups.items()}
    ratios = {
        "itl_p99_colocated_unchunked_over_disaggregated": ratio(p99.get("colocated_unchunked"),
                                                                p99.get("disaggregated")),
        "itl_p99_colocated_chunked_over_disaggregated": ratio(p99.get("colocated_chunked"),
                                                              p99.get("disaggregated")),
        "itl_p99_colocated_unchunked_over_chunked": ratio(p99.get("colocated_unchunked"),
                                                          p99.get("colocated_chunked")),
        "itl_p50_disaggregated_tp_over_disaggregated": ratio(
            setups.get("disaggregated_tp", {}).get("itl_p50_s"),
            setups.get("disaggregated", {}).get("itl_p50_s")),
        "ttft_mean_disaggregated_tp_over_disaggregated": ratio(
            setups.get("disaggregated_tp", {}).get("ttft_mean_s"),
            setups.get("disaggregated", {}).get("ttft_mean_s")),
    }
    targets = [make_target("ITL p99 colocated-unchunked / disaggregated",
                           ratios["itl_p99_colocated_unchunked_over_disaggregated"], ITL_P99_TARGET,
                           reason="see the per-step timings in docs/benchmarks.md")]
    result = {
        "benchmark": NAME,
        "config": {"model": args.model or "default", **w.__dict__,
                   "cores": "2 (each worker pinned to one core, 1 torch thread; "
                            "disaggregated_tp: 1 thread per rank, not pinned)"},
        "setups": setups,
        "ratios": ratios,
        "targets": targets,
        "wall_s": time.perf_counter() - t_start,
        "machine": machine_info(),
    }
    out = Path(args.out)
    path = write_json(out, NAME, result)
    _plot(runs, out / f"{NAME}.png")
    _print_setups(setups)
    print_targets(targets)
    print(f"wrote {path}")
    return result


def run_targets(args: argparse.Namespace) -> dict[str, Any]:
    """The workload against each ``--target`` server in turn, the same prompts for each (a
    server sees them once; run again with another ``--seed``, or restart the server, so its
    prefix cache does not serve the second run); writes ``disagg_servers.json`` / ``.png``."""
    w = _workload(args)
    servers = parse_targets(args.target)
    vocab = model_config(args.model).vocab_size
    streams = make_prompts(w.num_streams, w.stream_prompt_len, vocab, seed=args.seed)
    longs = make_prompts(w.num_long + 1, w.long_prompt_len, vocab, seed=args.seed + 1)
    t_start = time.perf_counter()
    runs: list[SetupRun] = []
    for label, url in servers:
        runs.append(asyncio.run(_run_target(label, url, args.api_key, w, streams, longs[1:],
                                            longs[0])))
        print(f"  {label}: done ({time.perf_counter() - t_start:.0f} s)")
    setups = {r.name: _summarize(r) for r in runs}
    lowest = min(s["itl_p99_s"] for s in setups.values())
    result = {
        "benchmark": f"{NAME}_servers",
        "config": {"model": args.model or "default", **w.__dict__,
                   "servers": dict(servers)},
        "setups": setups,
        "ratios": {f"itl_p99_{n}_over_lowest": ratio(s["itl_p99_s"], lowest)
                   for n, s in setups.items()},
        "wall_s": time.perf_counter() - t_start,
        "machine": machine_info(),
    }
    out = Path(args.out)
    path = write_json(out, f"{NAME}_servers", result)
    _plot(runs, out / f"{NAME}_servers.png")
    _print_setups(setups)
    print(f"wrote {path}")
    return result


def _print_setups(setups: dict[str, dict[str, Any]]) -> None:
    for n, s in setups.items():
        print(f"  {n:20s} ITL p50 {s['itl_p50_s'] * 1e3:7.1f} ms  p99 {s['itl_p99_s'] * 1e3:7.1f} ms"
              f"  long-prompt TTFT mean {s['ttft_mean_s']:.2f} s p99 {s['ttft_p99_s']:.2f} s"
              f"  streams {s['stream_decode_tok_s']:.1f} tok/s")


def _plot(runs: list[SetupRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.4 * len(runs) + 0.6), sharex=True,
                             squeeze=False)
    for ax, r in zip(axes[:, 0], runs, strict=True):
        tr = r.streams[0]
        xs = [t - r.t0 for t in tr.chunk_times[1:]]
        ax.plot(xs, [x * 1e3 for x in tr.itls()], lw=1, marker=".", ms=3)
        for i, a in enumerate(r.long_arrivals_s):
            ax.axvline(a, color="#dd8452", lw=0.8, ls="--", label="long prompt arrives" if i == 0 else None)
        ax.set_yscale("log")
        ax.set_ylabel("ITL (ms)")
        ax.set_title(f"{r.name}: stream 0", fontsize=9)
        if r.long_arrivals_s:
            ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since the steady streams started (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
