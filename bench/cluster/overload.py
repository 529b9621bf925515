"""`pdcluster bench overload`: what a cluster does with more work than it can take.

One disaggregated cluster (1 prefill + 1 decode worker, the product's defaults), its HTTP
front door with API keys for two tenants (equal weights unless ``--tenant-weights``). First
the capacity: ``--capacity-clients`` clients send requests back to back for a while; completed
requests per second is the cluster's capacity (``--capacity`` gives it instead, to compare
runs at the same offered rates on a host whose speed moves). Then, per offered load
(``--loads``, multiples of that capacity), Poisson arrivals for ``--duration`` seconds, alternating tenants; a
``--high-share`` of them are the high class (``priority`` -1, first-token SLO ``--slo-high``),
the rest low (``priority`` 0, ``--slo-low``). Every request is a streamed ``/v1/completions``
of ``--prompt-len`` token-id prompt tokens and ``--output-len`` tokens.

What the deadline means: each request's ``x-request-timeout`` is its class's SLO plus
``--deadline-extra`` (default 0). The admission judges a request's *first token* against it
(refused at once with 429 ``deadline_unmet`` when predicted later), while the server ends a
request still running when it passes (docs/api.md, Deadlines and admission): with no extra, an
admitted request whose first token came in time but whose last would not is ended in-band
(``deadline_exceeded`` error event, then ``[DONE]``), and one whose first token had not come
by then gets a 504 ``deadline_exceeded``. Both are counted as their own outcome, never as
served. The SLO is the first token's: one ended in-band met it (its first token counts in
the TTFT columns and the share within the SLO), one answered 504 missed it.

Per load and class, every request's outcome (``OUTCOMES``): served whole (200, ``[DONE]``, no
error event), refused (429; ``refused_deadline``: of them ``deadline_unmet``), ended by its
deadline in-band or with a 504, server error (5xx other than a deadline, or an in-band error
event other than a deadline), other 4xx, cut (a 200 stream that ended without ``[DONE]``), no
status (a broken call); the TTFT (p50 / p99) of the admitted requests (those with a first
token, and those answered 504 ``deadline_exceeded`` counted at their answer's time: a lower
bound on a first token that never came, ``ttft_p99_lower_bound``) and their share within the
class's SLO; how fast a refusal came (p99); per tenant,
the share of the served requests; the router's first-token predictions' mean absolute error
over the level (``pdcluster_ttft_prediction_*``) and where the first tokens' time went (the
router's ``pdcluster_request_phase_seconds``, mean per phase); the router's and the workers'
RSS after it; per class, the prediction's mean absolute error and bias, where its admitted
requests' first tokens went (``first_token_parts``) and their first-to-last-token time.
Targets at the highest load: the high class's TTFT p99 within its SLO, 0 server errors, 0
calls without a status (or cut short), refusals answered within a second (p99).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.cluster.ttft_breakdown import ray_session
from bench.harness.engine_under_test import model_config
from bench.harness.report import machine_info, print_targets, write_json
from bench.harness.report import target as make_target
from bench.harness.stats import percentile
from bench.harness.workload import make_prompts

NAME = "overload"
HELP = ("offered load 0.5x..4x of measured capacity, two priority classes and two tenants: "
        "who is served, who is refused, how fast")
KEYS = {"tenant-a": "sk-bench-tenant-a-0123456789", "tenant-b": "sk-bench-tenant-b-0123456789"}
# What became of a request, one of these each (``outcome``).
OUTCOMES = ("served", "refused", "deadline_inband", "deadline_504", "server_error",
            "other_4xx", "cut", "no_status")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loads", default="0.5,1,2,4",
                   help="offered loads, multiples of the measured capacity (default 0.5,1,2,4)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals per load (default 20; --quick 8)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slo-high", type=float, default=2.0,
                   help="the high class's first-token SLO, s (default 2)")
    p.add_argument("--slo-low", type=float, default=10.0,
                   help="the low class's first-token SLO, s (default 10)")
    p.add_argument("--deadline-extra", type=float, default=0.0,
                   help="seconds added to a class's SLO in its x-request-timeout (default 0: "
                        "the SLO; the server ends a request still running at it)")
    p.add_argument("--high-share", type=float, default=0.25,
                   help="share of the requests in the high class (default 0.25)")
    p.add_argument("--capacity-clients", type=int, default=16,
                   help="closed-loop clients measuring the capacity (default 16)")
    p.add_argument("--tenant-weights", default="tenant-a=1,tenant-b=1")
    p.add_argument("--capacity", type=float, default=None,
                   help="requests/s the loads are multiples of, instead of measuring it "
                        "(runs compared at the same offered rates)")
    p.add_argument("--yield-step-prefill-tokens", type=int, default=None,
                   help="the prefill worker's prompt tokens per step below the top priority "
                        "queued lately (default: the engine's, 256; 0: no such limit, as "
                        "before it existed)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    if not loads or min(loads) <= 0:
        raise ValueError("--loads: positive multiples of the capacity, e.g. 0.5,1,2,4")
    duration = args.duration or (8.0 if args.quick else 20.0)
    t0 = time.perf_counter()
    with ray_session(num_workers=2):
        levels, capacity = asyncio.run(_run(args, loads, duration))
    top = levels[-1]
    high = top["classes"]["high"]
    targets = [
        make_target(f"high-class TTFT p99 at {top['load']}x, s (SLO {args.slo_high})",
                    high["ttft_p99_s"], args.slo_high, higher_is_better=False),
        make_target(f"server errors at {top['load']}x", float(top["server_errors"]), 0.0,
                    higher_is_better=False),
        make_target(f"calls without a status or cut short at {top['load']}x",
                    float(top["no_status"]), 0.0, higher_is_better=False),
        make_target(f"refusal latency p99 at {top['load']}x, s", top["refusal_p99_s"], 1.0,
                    higher_is_better=False)]
    result = {"benchmark": NAME, "config": {
        "loads": loads, "duration_s": duration, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "slo_high_s": args.slo_high, "slo_low_s": args.slo_low,
        "deadline_extra_s": args.deadline_extra, "yield_step_prefill_tokens": _yield(args).get(
            "yield_step_prefill_tokens", "default"), "high_share": args.high_share, "tenant_weights": args.tenant_weights,
        "model": args.model or "default"}, "capacity_rps": capacity,
        "capacity_given": args.capacity is not None, "levels": levels,
        "targets": targets, "wall_s": time.perf_counter() - t0, "machine": machine_info()}
    path = write_json(Path(args.out), NAME, result)
    print(f"capacity: {capacity:.2f} requests/s")
    print(table(levels))
    for lv in levels:
        print(f"{lv['load']:>4}x ({lv['offered_rps']:.2f}/s): refusal p99 "
              f"{_f(lv['refusal_p99_s'])} s; served by tenant {lv['served_share']}; prediction "
              f"|error| {_f(lv['prediction_mae_s'])} s; RSS MiB {lv['rss_mib']}; first-token "
              f"phases (mean s) {lv['first_token_phases_s']}")
    for lv in levels:
        for name, c in lv["classes"].items():
            print(f"{lv['load']:>4}x {name}: prediction |error| {_f(c['prediction_mae_s'])} s, "
                  f"bias {_f(c['prediction_bias_s'])} s; first to last token p50 "
                  f"{_f(c['after_first_p50_s'])} s; first token parts "
                  f"{c['first_token_parts_s']}")
    print_targets(targets)
    print(f"wrote {path}")
    return result


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def table(levels: list[dict[str, Any]]) -> str:
    """Every outcome per load and class, as a markdown table (TTFT p99 with ">=" when a 504
    deadline answer sets it: a lower bound)."""
    head = ["load", "class", "sent", *OUTCOMES, "TTFT p50 s", "TTFT p99 s", "within SLO"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lv in levels:
        for name, c in lv["classes"].items():
            p99 = ((">=" if c["ttft_p99_lower_bound"] else "") + _f(c["ttft_p99_s"]))
            rows.append("| " + " | ".join([
                f"{lv['load']:g}x", name, str(c["sent"]),
                *(str(c["outcomes"][o]) for o in OUTCOMES), _f(c["ttft_p50_s"]), p99,
                _f(c["within_slo"])]) + " |")
    return "\n".join(rows)


def outcome(status: int | None, code: str | None, done: bool,
            stream_code: str | None) -> str:
    """What became of one request (one of ``OUTCOMES``): its HTTP ``status`` (None: the call
    broke without one), the error ``code`` of a refused / failed answer, whether a 200
    stream reached ``[DONE]``, and the code of an in-band error event (None: none came)."""
    if status is None:
        return "no_status"
    if status == 200:
        if stream_code == "deadline_exceeded":
            return "deadline_inband"
        if stream_code is not None:
            return "server_error"  # a fault reported after the 200
        return "served" if done else "cut"
    if status == 429:
        return "refused"
    if status == 504 and code == "deadline_exceeded":
        return "deadline_504"  # the caller's deadline, not a fault
    return "server_error" if status >= 500 else "other_4xx"


def read_event(out: dict[str, Any], line: str, elapsed_s: float) -> None:
    """One SSE line of a 200 stream into ``out``: the first choice's time (``ttft_s``), an
    error event's code (``stream_code``), ``[DONE]`` (``done``)."""
    if not line.startswith("data:"):
        return
    data = line.removeprefix("data:").strip()
    if data == "[DONE]":
        out["done"] = True
        return
    event = json.loads(data)
    if "error" in event:
        out["stream_code"] = (event["error"] or {}).get("code") or "unknown"
    elif event.get("choices") and out["ttft_s"] is None:
        out["ttft_s"] = elapsed_s


def summarize_class(rs: list[dict[str, Any]], slo: float) -> dict[str, Any]:
    """One class's results at one load: every outcome's count, and the admitted requests'
    TTFT (a 504 deadline answer counted at its time, a lower bound) against ``slo``."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for r in rs:
        counts[r["outcome"]] += 1
    first = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
    late = [r["e2e_s"] for r in rs if r["outcome"] == "deadline_504"]
    ttfts = first + late
    after = [r["e2e_s"] - r["ttft_s"] for r in rs if r["outcome"] == "served" and r["ttft_s"]]
    p99 = percentile(ttfts, 99) if ttfts else None
    return {"sent": len(rs), "outcomes": counts, "served": counts["served"],
            "refused": counts["refused"],
            "refused_deadline": sum(r["code"] == "deadline_unmet" for r in rs),
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None, "ttft_p99_s": p99,
            "ttft_p99_lower_bound": bool(late) and p99 is not None and max(late) >= p99,
            # what broke the calls without a status or cut short (the exception's name)
            "broken_calls": dict(Counter(r["code"] for r in rs
                                         if r["outcome"] in ("cut", "no_status"))),
            "within_slo": (sum(x <= slo for x in ttfts) / len(ttfts)) if ttfts else None,
            # the served requests' time from the first token to the last (p50)
            "after_first_p50_s": percentile(after, 50) if after else None}


def first_token_parts(rs: list[dict[str, Any]], timings: dict) -> dict[str, Any]:
    """Where the first tokens of one class went: per request with a first token and the
    router's timing of it (``timings``: backend id ``<tenant>/<x-request-id>`` ->
    RequestTiming), its prefill queue, compute, and the rest of its client-seen TTFT (the
    wait for decode room, the reserve, the KV tail, the commit, HTTP); the mean over all of
    them and over the slowest tenth (the p99's neighbours)."""
    parts = []
    for r in rs:
        t = timings.get(f"{r['tenant']}/{r['rid']}")
        if r["ttft_s"] is None or t is None:
            continue
        parts.append((r["ttft_s"], t.queue_s, t.prefill_compute_s,
                      r["ttft_s"] - t.queue_s - t.prefill_compute_s))
    if not parts:
        return {}
    parts.sort()
    slow = parts[-max(1, len(parts) // 10):]

    def mean(xs, i):
        return round(sum(x[i] for x in xs) / len(xs), 4)
    return {"n": len(parts), "slowest_n": len(slow),
            **{f"{k}_mean": mean(parts, i) for i, k in enumerate(
                ("ttft", "prefill_queue", "prefill_compute", "rest"))},
            **{f"{k}_slowest": mean(slow, i) for i, k in enumerate(
                ("ttft", "prefill_queue", "prefill_compute", "rest"))}}


async def _run(args, loads: list[float], duration: float):
    import httpx

    from engine import EngineArgs
    from router.cluster.ray_cluster import Cluster, ClusterConfig
    from router.control.fair_share import parse_tenant_weights
    from router.frontdoor.lifecycle import serve_frontdoor
    from router.frontdoor.security import Gate, SecurityConfig

    vocab = model_config(args.model).vocab_size
    cluster = await Cluster.start(ClusterConfig(
        model=args.model, num_prefill_workers=1, num_decode_workers=1,
        prefill_engine=EngineArgs(num_threads=1, max_num_seqs=8, **_yield(args)),
        decode_engine=EngineArgs(num_threads=1), worker_num_cpus=1.0,
        tenant_weights=parse_tenant_weights(args.tenant_weights)))
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text("".join(f"{t}:{k}\n" for t, k in KEYS.items()))
        fd = await serve_frontdoor(cluster, grpc_port=0, http_port=0, drain_grace_s=1,
                                   gate=Gate.from_config(SecurityConfig(str(keys))))
    url = f"http://127.0.0.1:{fd.http_port}"
    seed = iter(range(args.seed, args.seed + 10_000))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120,
                                     limits=httpx.Limits(max_connections=1000)) as http:
            cap_seed = next(seed)  # taken either way: the levels' workloads stay the same
            capacity = args.capacity or await _capacity(http, args, vocab, cap_seed)
            levels = []
            for load in loads:
                levels.append(await _level(http, cluster, args, vocab, load, capacity,
                                           duration, next(seed)))
    finally:
        await fd.stop(1)
        await cluster.shutdown()
    return levels, capacity


def _yield(args) -> dict[str, Any]:
    """The prefill engine's ``yield_step_prefill_tokens`` from ``--yield-step-prefill-tokens``
    (nothing: the engine's default; 0: None, no limit)."""
    n = args.yield_step_prefill_tokens
    return {} if n is None else {"yield_step_prefill_tokens": n or None}


async def _request(http, prompt: list[int], args, tenant: str, priority: int,
                   deadline_s: float, rid: str | None = None) -> dict[str, Any]:
    """One streamed completion (``rid``: its ``x-request-id``, to find its phases): its
    status (None: the call broke or timed out without one), TTFT (its first choice),
    end-to-end time (for a refusal: how fast it came), and its ``outcome``."""
    body = {"prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "priority": priority}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", "x-request-timeout": str(deadline_s)}
    if rid is not None:
        headers["x-request-id"] = rid
    t0 = time.perf_counter()
    out: dict[str, Any] = {"tenant": tenant, "priority": priority, "status": None, "rid": rid,
                           "ttft_s": None, "e2e_s": None, "code": None, "done": False,
                           "stream_code": None}
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode()
                m = re.search(r'"code":\s*"([a-z_]+)"', text)
                out["code"] = m.group(1) if m else None
                out["e2e_s"] = time.perf_counter() - t0
            else:
                async for line in r.aiter_lines():
                    read_event(out, line, time.perf_counter() - t0)
                out["e2e_s"] = time.perf_counter() - t0
    except Exception as e:  # a broken call is a data point: without a status, or cut
        out["code"] = type(e).__name__
    out["outcome"] = outcome(out["status"], out["code"], out["done"], out["stream_code"])
    return out


async def _capacity(http, args, vocab: int, seed: int) -> float:
    """Completed requests per second of ``--capacity-clients`` closed-loop clients."""
    n = args.capacity_clients
    prompts = make_prompts(n * 64, args.prompt_len, vocab, seed=seed)
    span = 6.0 if args.quick else 15.0
    done, stop, it = [], time.perf_counter() + span, iter(prompts)

    async def client(i: int) -> None:
        while time.perf_counter() < stop:
            r = await _request(http, next(it), args, "tenant-a" if i % 2 else "tenant-b",
                               0, 600.0)
            if r["status"] == 200:
                done.append(r)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(n)))
    return len(done) / (time.perf_counter() - t0)


async def _level(http, cluster, args, vocab: int, load: float, capacity: float,
                 duration: float, seed: int) -> dict[str, Any]:
    rate = load * capacity
    rng = random.Random(seed)
    n = max(1, int(rate * duration))
    prompts = make_prompts(n, args.prompt_len, vocab, seed=seed)
    before = await _prediction_sums(http)
    outcomes = cluster.orchestrator.outcomes  # per class: its sums before this level
    by_prio = {k: list(v) for k, v in outcomes.by_priority.items()}
    tasks, t = [], 0.0
    start = time.perf_counter()
    for i in range(n):
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        high = rng.random() < args.high_share
        tasks.append(asyncio.ensure_future(_request(
            http, prompts[i], args, "tenant-a" if i % 2 == 0 else "tenant-b",
            -1 if high else 0, (args.slo_high if high else args.slo_low) + args.deadline_extra,
            f"ovl-{seed}-{i}")))
    results = await asyncio.gather(*tasks)
    after = await _prediction_sums(http)
    timings = cluster.orchestrator.phases.timings
    classes = {}
    for name, prio, slo in (("high", -1, args.slo_high), ("low", 0, args.slo_low)):
        rs = [r for r in results if r["priority"] == prio]
        classes[name] = summarize_class(rs, slo)
        classes[name]["first_token_parts_s"] = first_token_parts(rs, timings)
        # the engines' priorities run the other way (router/control/config.py)
        n0, a0, e0 = by_prio.get(-prio, (0, 0.0, 0.0))
        n1, a1, e1 = outcomes.by_priority.get(-prio, (0, 0.0, 0.0))
        classes[name]["prediction_mae_s"] = (a1 - a0) / (n1 - n0) if n1 > n0 else None
        classes[name]["prediction_bias_s"] = (e1 - e0) / (n1 - n0) if n1 > n0 else None
    counts = {o: sum(r["outcome"] == o for r in results) for o in OUTCOMES}
    refusals = [r["e2e_s"] for r in results if r["status"] == 429]
    served = [r for r in results if r["outcome"] == "served"]
    n_pred, abs_err = after[0] - before[0], after[1] - before[1]
    phases = {k: round((v[0] - before[2].get(k, (0, 0))[0])
                       / max(1.0, v[1] - before[2].get(k, (0, 0))[1]), 4)
              for k, v in after[2].items()}
    return {"load": load, "offered_rps": rate, "sent": n, "classes": classes,
            "outcomes": counts, "server_errors": counts["server_error"],
            "no_status": counts["no_status"] + counts["cut"], "other_4xx": counts["other_4xx"],
            "refusal_p99_s": percentile(refusals, 99) if refusals else None,
            "served_share": {t: round(sum(r["tenant"] == t for r in served) / len(served), 3)
                             for t in KEYS} if served else {},
            "prediction_mae_s": abs_err / n_pred if n_pred else None,
            # where the admitted requests' first-token time went, mean s per phase
            "first_token_phases_s": phases,
            "rss_mib": await _rss(cluster)}


async def _prediction_sums(http) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """The router's counters: predictions met, their summed |error|, and per first-token
    phase (pdcluster_request_phase_seconds) its (sum, count)."""
    # /metrics needs a key when keys are on (docs/security.md)
    text = (await http.get("/metrics", headers={
        "Authorization": f"Bearer {KEYS['tenant-a']}"})).text

    def value(name: str) -> float:
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0
    phases: dict[str, list[float]] = {}
    for kind, phase, v in re.findall(
            r'^pdcluster_request_phase_seconds_(sum|count)\{phase="([a-z_]+)"\} ([0-9.e+-]+)$',
            text, re.MULTILINE):
        phases.setdefault(phase, [0.0, 0.0])[kind == "count"] = float(v)
    return (value("pdcluster_ttft_predictions_total"),
            value("pdcluster_ttft_prediction_abs_error_seconds_total"),
            {k: (v[0], v[1]) for k, v in phases.items()})


async def _rss(cluster) -> dict[str, int]:
    """The router's (this process) and each worker's resident memory, MiB."""
    import psutil

    out = {"router": psutil.Process(os.getpid()).memory_info().rss >> 20}
    for w in await cluster.cluster_status():
        try:
            out[w.id] = psutil.Process(w.pid).memory_info().rss >> 20
        except psutil.Error:
            out[w.id] = -1
    return out
