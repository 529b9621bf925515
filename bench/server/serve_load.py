"""`pdcluster bench serve`: load a RUNNING server the way `vllm bench serve` does.

For each request rate of ``--request-rates`` (Poisson arrivals; ``inf`` sends everything at
once), ``--num-prompts`` seeded token-id prompts of ``--input-len`` tokens each ask for exactly
``--output-len`` tokens (``ignore_eos``, greedy), over gRPC (the SDK's ``AsyncClient``) or over
HTTP (``/v1/completions`` with SSE streaming, via ``httpx``; OpenAI's completions API accepts
token-id prompts, so both APIs carry identical work). Every rate gets fresh prompts, so the
server's prefix cache cannot turn a later rate into cache hits.

Per rate: TTFT, TPOT ((e2e - ttft) / (output tokens - 1)), ITL (gaps between streamed chunks)
and E2E as mean/p50/p90/p99, request and output-token throughput, and goodput under ``--slo``
(DistServe's definition: requests per second that meet EVERY SLO; also as a fraction). Against
our own server, also the engines' own decode steps during the rate (per batch size, read from
``/metrics``) and the serving overhead per output token: TPOT minus the engine's step
(``bench.server.serve_engine``).
Over HTTP, chunks whose text is empty are not sent by the server, so a model without a
tokenizer shows TTFT = E2E there; gRPC always carries token ids.

``--structured json_schema`` runs every rate twice, unconstrained then with the output held
to a JSON schema (vLLM's ``structured_outputs``, which both our APIs and vLLM's server take),
each on fresh prompts, in one run: the rows' TPOT ratio is the cost of the grammar mask. The
schema (an object holding an array of at least ``--output-len`` strings) cannot complete
before ``--output-len`` tokens, so both variants generate the same number of tokens.

``--target URL`` loads any OpenAI-compatible server (``vllm serve``, llama.cpp's server, ours)
with the same seeded work: the model is the first id of its ``/v1/models`` (or
``--served-model``), ``--api-key``/``$OPENAI_API_KEY`` goes as a Bearer token, and what the
server does not report or honour (``max_model_len``, usage, ``ignore_eos``) is listed under
``warnings`` in the JSON. ``server.label`` names the run for `pdcluster bench compare`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import time
from pathlib import Path
from typing import Any

from bench.harness.report import machine_info, write_json
from bench.harness.stats import summarize
from bench.harness.workload import make_prompts, poisson_arrivals
from bench.server.serve_clients import RequestResult, grpc_request, http_request
from bench.server.serve_engine import EngineSteps, engine_steps, scrape, serving_overhead
from bench.server.serve_target import Target, headers, http_client, server_facts, target_from_args

NAME = "serve"
HELP = "load a running server (gRPC or HTTP): Poisson rate sweep, TTFT/TPOT/ITL/E2E, goodput"
SLO_METRICS = ("ttft", "tpot", "e2e")
# Without a way to ask the server (HTTP has no vocab size), stay below every real vocab.
SAFE_VOCAB = 256


def parse_rates(text: str) -> list[float]:
    """"1,2,inf" -> [1.0, 2.0, inf]; raises ValueError on a non-positive or bad value."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"--request-rates: {part!r} is not a number or 'inf'") from None
        if not r > 0:
            raise ValueError(f"--request-rates: rates must be > 0, got {part}")
        rates.append(r)
    if not rates:
        raise ValueError("--request-rates: give at least one rate")
    return rates


def parse_slo(text: str) -> dict[str, float]:
    """"ttft=0.5,tpot=0.1" -> {"ttft": 0.5, "tpot": 0.1} (seconds); empty -> no SLO."""
    slo = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"--slo: expected METRIC=SECONDS with METRIC in "
                             f"{', '.join(SLO_METRICS)}, got {part!r}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {value!r} is not a number of seconds") from None
        if slo[key] <= 0:
            raise ValueError(f"--slo: {key} must be > 0 seconds, got {value}")
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    """DistServe's goodput test: the request finished and met every SLO (a 1-token output
    has no TPOT and passes that one)."""
    if not r.ok:
        return False
    got = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
    return all(math.isnan(got[k]) or got[k] <= v for k, v in slo.items())


STRUCTURED_VARIANTS = ("json_schema",)


def long_schema(output_len: int) -> dict[str, Any]:
    """A JSON schema no document of which fits in fewer than ``output_len`` tokens."""
    return {"type": "object", "required": ["items"], "additionalProperties": False,
            "properties": {"items": {"type": "array", "minItems": output_len,
                                     "items": {"type": "string", "maxLength": 12}}}}


# ---- the sweep -------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="our server's address: host:port of gRPC (default 127.0.0.1:50051) or "
                        "of HTTP (default 127.0.0.1:8000; an http:// URL also works)")
    p.add_argument("--api", choices=("grpc", "http"), default=None,
                   help="grpc (default) or http; --target implies http")
    p.add_argument("--target", default=None, metavar="URL",
                   help="any OpenAI-compatible server's base URL (vllm serve, llama.cpp, ours): "
                        "http://host:port, with or without /v1")
    p.add_argument("--served-model", default=None, metavar="NAME",
                   help="model name to send (default: the first id of the server's /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="sent as a Bearer token (default: $OPENAI_API_KEY over HTTP)")
    p.add_argument("--label", default=None,
                   help="names this server in `bench compare` (default: its host:port)")
    p.add_argument("--request-rates", default=None,
                   help="comma-separated requests/s, 'inf' = all at once (default 1,2,4)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per rate (default 48; --quick 8)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128; --quick 32)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (default 64; --quick 16)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight (default: none, like vllm bench serve)")
    p.add_argument("--slo", default="ttft=0.5,tpot=0.1",
                   help="goodput SLOs, seconds: e.g. ttft=0.5,tpot=0.1[,e2e=10]")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt ids are drawn below this (default: the server's vocab over "
                        f"gRPC; {SAFE_VOCAB} over HTTP)")
    p.add_argument("--structured", choices=STRUCTURED_VARIANTS, default=None,
                   help="also run every rate with the output held to a JSON schema, beside "
                        "the unconstrained run: the TPOT cost of the grammar mask")
    p.add_argument("--offline-threads", type=int, default=None, metavar="N",
                   help="with --max-concurrency 1: also run the same prompts through the "
                        "in-process engine at N torch threads (the served worker's), one at a "
                        "time, after the load, and report served / offline TPOT: what the "
                        "serving path costs a stream (bench/server/serve_offline.py)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--metrics-url", default=None, metavar="URL",
                   help="our server's /metrics, for the engine's own decode steps beside the "
                        "served TPOT (default: the HTTP target's /metrics; over gRPC, port 8000 "
                        "of the gRPC host)")


def output_warnings(results: list[RequestResult], output_len: int) -> list[str]:
    """What the completed requests' token counts say the server did not honour: fewer tokens
    than asked (``ignore_eos`` dropped, or a stop) or no usage in the stream (then tokens are
    counted as streamed chunks, which undercounts servers that batch tokens per chunk)."""
    ok = [r for r in results if r.ok]
    out = []
    short = [r.output_tokens for r in ok if r.output_tokens < output_len]
    if short:
        out.append(f"{len(short)} of {len(ok)} completed requests produced fewer than "
                   f"--output-len {output_len} tokens (min {min(short)}): the server did not "
                   "honour ignore_eos; TPOT and tok/s are over the tokens it did produce")
    no_usage = sum(not r.usage_reported for r in ok)
    if no_usage:
        out.append(f"{no_usage} of {len(ok)} completed requests carried no usage "
                   "(stream_options.include_usage): output tokens counted as streamed chunks")
    return out


async def _sweep(t: Target, model: str, rates: list[float],
                 prompts_per_rate: list[list[list[int]]], output_len: int, seed: int,
                 max_concurrency: int | None, progress: bool, metrics_url: str | None = None,
                 structured: list[dict[str, Any] | None] | None = None
                 ) -> list[tuple[float, float, list[RequestResult], RateSteps]]:
    """[(rate, duration_s, results, engine steps during the rate)] per rate, sharing one
    connection; the engine steps come from ``metrics_url`` (``bench.server.serve_engine``).
    ``structured``: per rate, the ``structured_outputs`` its requests carry (None: free)."""
    structured = structured or [None] * len(rates)
    import httpx
    from tqdm import tqdm

    if t.api == "grpc":
        from client.sdk import AsyncClient

        # One channel for every request: as a real multiplexing client would.
        client = AsyncClient(t.address, timeout=600, api_key=t.api_key)
        one = grpc_request
    else:
        client = http_client(t)
        one = functools.partial(http_request, model=model)
    out = []
    scraper = httpx.AsyncClient(timeout=httpx.Timeout(30.0))
    try:
        # Warm-up (not counted): connection set-up and the server's first forward.
        await one(client, prompts_per_rate[0][0][: max(1, len(prompts_per_rate[0][0]) // 4)], 2)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        for rate, prompts, so in zip(rates, prompts_per_rate, structured, strict=True):
            arrivals = poisson_arrivals(len(prompts), None if math.isinf(rate) else rate, seed)
            bar = tqdm(total=len(prompts), desc=f"rate {rate:g}/s", disable=not progress,
                       leave=False)

            async def fire(prompt, offset, t0, bar=bar, so=so):
                await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
                if sem is None:
                    res = await one(client, prompt, output_len, so)
                else:
                    async with sem:
                        res = await one(client, prompt, output_len, so)
                bar.update(1)
                return res

            before = await scrape(scraper, metrics_url, headers(t))
            t0 = time.perf_counter()
            results = await asyncio.gather(*[fire(p, a, t0) for p, a in zip(prompts, arrivals, strict=True)])
            duration = time.perf_counter() - t0
            bar.close()
            # The router asks every worker for its counters when /metrics is read, and a
            # step counts itself before it hands out its tokens: nothing to wait for.
            after = await scrape(scraper, metrics_url, headers(t))
            steps = (engine_steps(before, after, "decode"), engine_steps(before, after, "mixed"))
            out.append((rate, duration, list(results), steps))
    finally:
        await scraper.aclose()
        if t.api == "grpc":
            await client.close()
        else:
            await client.aclose()
    return out


# The engine's pure-decode and mixed steps during one rate (either None: none ran / no figures).
RateSteps = tuple[EngineSteps | None, EngineSteps | None]


def summarize_rate(rate: float, duration_s: float, results: list[RequestResult],
                   slo: dict[str, float], steps: RateSteps = (None, None)) -> dict[str, Any]:
    """The per-rate record (vLLM's names, in seconds): stats, throughputs and goodput; with
    ``steps``, the engine's own decode (and mixed) steps and the split of the served TPOT
    (``bench.server.serve_engine.serving_overhead``)."""
    decode, mixed = steps
    ok = [r for r in results if r.ok]
    row: dict[str, Any] = {"request_rate": "inf" if math.isinf(rate) else rate,
                           "num_prompts": len(results), "completed": len(ok),
                           "failed": len(results) - len(ok), "duration_s": duration_s}
    samples = {"ttft": [r.ttft_s for r in ok], "tpot": [r.tpot_s for r in ok if r.output_tokens > 1],
               "itl": [x for r in ok for x in r.itls_s], "e2e": [r.e2e_s for r in ok]}
    for name, values in samples.items():
        s = summarize(values)
        row.update({f"{name}_mean_s": s.mean, f"{name}_p50_s": s.p50, f"{name}_p90_s": s.p90,
                    f"{name}_p99_s": s.p99})
    out_tokens = sum(r.output_tokens for r in ok)
    good = sum(meets_slo(r, slo) for r in results)
    row.update({
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": out_tokens,
        "request_throughput_req_s": len(ok) / duration_s,
        "output_throughput_tok_s": out_tokens / duration_s,
        "goodput_req_s": good / duration_s, "goodput_fraction": good / len(results),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "engine_decode_steps": _steps_record(decode),
        "engine_mixed_steps": _steps_record(mixed),
    })
    row.update(serving_overhead(row["tpot_mean_s"], decode, mixed))
    return row


def _steps_record(steps: EngineSteps | None) -> dict[str, Any] | None:
    return None if steps is None else {
        "by_batch": {str(b): v for b, v in steps.by_batch.items()}, "steps": steps.steps,
        "mean_step_s": steps.mean_step_s, "mean_batch": steps.mean_batch}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Sweep the request rates against ``--address`` or ``--target``; write ``serve.json`` +
    ``serve.png``. Raises ValueError for bad arguments or a server that cannot be asked."""
    q = args.quick
    rates = parse_rates(args.request_rates or ("1,2,4"))
    slo = parse_slo(args.slo)
    num = args.num_prompts or (8 if q else 48)
    input_len = args.input_len or (32 if q else 128)
    output_len = args.output_len or (16 if q else 64)
    if num <= 0 or input_len <= 0 or output_len <= 0:
        raise ValueError("--num-prompts, --input-len and --output-len must be > 0")
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError(f"--max-concurrency must be > 0, got {args.max_concurrency}")
    offline_threads = getattr(args, "offline_threads", None)
    if offline_threads is not None and (offline_threads <= 0 or args.max_concurrency != 1):
        raise ValueError("--offline-threads N (N > 0) compares one stream at a time: it needs "
                         "--max-concurrency 1")
    t = target_from_args(args)
    facts = asyncio.run(server_facts(t))
    max_len = facts.max_model_len
    if max_len and input_len + output_len > max_len:
        raise ValueError(f"--input-len + --output-len = {input_len + output_len} exceeds the "
                         f"server's max_model_len {max_len}")
    vocab = args.vocab_size or facts.vocab_size or SAFE_VOCAB
    # Each rate once per variant, the variants back to back (one spell of the machine each).
    variants = [None] + ([args.structured] if getattr(args, "structured", None) else [])
    cells = [(rate, v) for rate in rates for v in variants]
    rates = [rate for rate, _ in cells]
    constraint = {"json": long_schema(output_len)}
    prompts = [make_prompts(num, input_len, vocab, seed=args.seed + 1000 * i)
               for i in range(len(cells))]
    t_start = time.perf_counter()
    metrics_url = args.metrics_url or (f"{t.address}/metrics" if t.api == "http" else
                                       f"http://{t.address.rsplit(':', 1)[0]}:8000/metrics")
    raw = asyncio.run(_sweep(t, facts.model_id, rates, prompts, output_len, args.seed,
                             args.max_concurrency, progress=not args.no_progress,
                             metrics_url=metrics_url,
                             structured=[constraint if v else None for _, v in cells]))
    rows = [summarize_rate(rate, dur, res, slo, steps) for rate, dur, res, steps in raw]
    for row, (_, v) in zip(rows, cells, strict=True):
        row["structured"] = v or "none"
    if len(variants) > 1:
        for free, bound in zip(rows[::2], rows[1::2], strict=True):
            bound["tpot_p50_over_free"] = _ratio(bound["tpot_p50_s"], free["tpot_p50_s"])
            bound["tpot_mean_over_free"] = _ratio(bound["tpot_mean_s"], free["tpot_mean_s"])
    if offline_threads is not None:  # the server is idle now: the engine alone, same prompts
        from bench.server.serve_offline import offline_one_stream

        alone = offline_one_stream(args.model, prompts[0], output_len, offline_threads)
        for row, (_, v) in zip(rows, cells, strict=True):
            if v is None:
                row["offline"] = alone.to_dict()
                row["tpot_p50_over_offline"] = _ratio(row["tpot_p50_s"], alone.tpot_p50_s)
    warnings = list(facts.warnings)
    if metrics_url and all(r["engine_decode_steps"] is None for r in rows):
        warnings.append(f"no engine step counters at {metrics_url}: serving overhead not reported")
    for row, (_, _, res, _) in zip(rows, raw, strict=True):
        row["warnings"] = output_warnings(res, output_len)
        warnings += [f"rate {row['request_rate']}: {w}" for w in row["warnings"]]
    result = {
        "benchmark": NAME,
        "config": {"api": t.api, "address": t.address, "num_prompts": num, "input_len": input_len,
                   "output_len": output_len, "request_rates": [r["request_rate"] for r in rows],
                   "structured": getattr(args, "structured", None),
                   "max_concurrency": args.max_concurrency, "vocab_size": vocab, "seed": args.seed},
        "server": {"label": t.label, "url": t.address, "model_id": facts.model_id,
                   "max_model_len": facts.max_model_len, "vocab_size": facts.vocab_size},
        "warnings": warnings,
        "slo_s": slo,
        "rates": rows,
        "wall_s": time.perf_counter() - t_start,
        "machine": machine_info(),
    }
    out = Path(args.out)
    path = write_json(out, NAME, result)
    _plot(rows, slo, out / f"{NAME}.png")
    for r in rows:
        if len(variants) > 1:
            cost = (f" (TPOT p50 {r['tpot_p50_over_free']:.3f}x, mean "
                    f"{r['tpot_mean_over_free']:.3f}x the unconstrained)"
                    if "tpot_p50_over_free" in r else "")
            print(f"  [{r['structured']}]{cost}")
        print(f"  rate {r['request_rate']}/s: {r['completed']}/{r['num_prompts']} ok, "
              f"{r['request_throughput_req_s']:.2f} req/s, {r['output_throughput_tok_s']:.1f} tok/s, "
              f"TTFT p50 {_ms(r['ttft_p50_s'])} p99 {_ms(r['ttft_p99_s'])}, "
              f"TPOT p50 {_ms(r['tpot_p50_s'])}, goodput {r['goodput_req_s']:.2f} req/s "
              f"({r['goodput_fraction']:.0%})")
        if "offline" in r:
            off = r["offline"]
            print(f"    the engine alone ({off['num_threads']} threads, one stream at a time): "
                  f"TPOT p50 {_ms(off['tpot_p50_s'])}, TTFT p50 {_ms(off['ttft_p50_s'])}; "
                  f"served / offline TPOT p50 {r['tpot_p50_over_offline']:.3f}x")
        steps = r["engine_decode_steps"]
        if steps is not None:
            per = ", ".join(f"b{b} {v['mean_s'] * 1e3:.0f} ms x{v['steps']}"
                            for b, v in steps["by_batch"].items())
            mixed = r["engine_mixed_steps"]
            if mixed is not None:
                per += (f"; mixed with prefill: {mixed['steps']} steps of "
                        f"{mixed['mean_step_s'] * 1e3:.0f} ms (mean {mixed['mean_batch']:.1f} rows)")
            print(f"    engine decode steps: {per}")
            print(f"    TPOT mean {_ms(r['tpot_mean_s'])} = engine step {_ms(r['engine_step_s'])}"
                  f" + prefill in its steps {_ms(r['prefill_share_per_token_s'])}"
                  f" + serving {_ms(r['serving_overhead_per_token_s'])} per token"
                  f" ({r['tpot_over_engine_step']:.2f}x the step,"
                  f" {r['tpot_over_engine_token']:.2f}x the engine's time per token)")
        for e in r["errors"]:
            print(f"    error: {e}")
    for w in warnings:
        print(f"  warning: {w}")
    print(f"wrote {path}")
    return result


def _ratio(a: float | None, b: float | None) -> float:
    return math.nan if not a or not b or math.isnan(a) or math.isnan(b) else a / b


def _ms(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x * 1e3:.0f} ms"


def _plot(rows: list[dict[str, Any]], slo: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(rows)))
    labels = [str(r["request_rate"]) for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("ttft", "tpot", "e2e"):
        a1.plot(xs, [r[f"{name}_p99_s"] or math.nan for r in rows], marker="o", label=f"{name} p99")
        a1.plot(xs, [r[f"{name}_p50_s"] or math.nan for r in rows], marker=".", ls="--",
                label=f"{name} p50")
    a1.set_yscale("log")
    a1.set_ylabel("seconds")
    a2.plot(xs, [r["request_throughput_req_s"] for r in rows], marker="o", label="throughput")
    a2.plot(xs, [r["goodput_req_s"] for r in rows], marker="s",
            label="goodput (" + ", ".join(f"{k}<={v:g}s" for k, v in slo.items()) + ")")
    a2.set_ylabel("requests/s")
    for ax in (a1, a2):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("offered request rate (req/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
