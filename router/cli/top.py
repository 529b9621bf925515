"""`pdcluster top`: a live terminal view of a running server, refreshed from its own
``GET /v1/cluster`` and ``/metrics`` (nothing else is asked of the server).

Every ``--interval`` seconds it scrapes both and shows, for the interval just past: requests
and output tokens per second, TTFT and inter-token latency p50 / p99 (from the histograms'
bucket deltas, as Prometheus' ``histogram_quantile`` would), where first tokens' time went
(disaggregated: the mean of each phase), every worker with its state, load and KV usage, and
the slowest requests of the last minutes (operators' keys only: they are every tenant's).
``--once`` prints one view (two scrapes ``--interval`` apart) and exits: for scripts and logs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

# name -> [(labels, value)] for every sample of a scrape
Samples = dict[str, list[tuple[dict[str, str], float]]]


def add_top_subcommand(sub, add_connection_args) -> None:
    p = sub.add_parser("top", help="live view of a running server: rates, latency, workers, "
                                   "KV usage, the slowest recent requests")
    p.add_argument("--http-address", default="127.0.0.1:8000",
                   help="HOST:PORT of the server's HTTP front door")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true",
                   help="print one view (two scrapes --interval apart) and exit")
    add_connection_args(p)
    p.set_defaults(func=cmd_top)


# ---- reading the server -------------------------------------------------------------------------
def parse_samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


@dataclass(frozen=True)
class Scrape:
    at: float  # time.monotonic()
    cluster: dict[str, Any]
    samples: Samples


def scrape(base: str, key: str | None, context: ssl.SSLContext | None) -> Scrape:
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def get(path: str) -> bytes:
        req = urllib.request.Request(base + path, headers=headers)
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return resp.read()

    cluster = json.loads(get("/v1/cluster"))
    return Scrape(time.monotonic(), cluster, parse_samples(get("/metrics").decode()))


# ---- what the view shows ------------------------------------------------------------------------
def _total(s: Samples, name: str, **match: str) -> float:
    return sum(v for labels, v in s.get(name, []) if all(labels.get(k) == x
                                                           for k, x in match.items()))


def _buckets(s: Samples, name: str) -> dict[float, float]:
    """``le`` -> cumulative count, summed over the other labels."""
    out: dict[float, float] = {}
    for labels, v in s.get(f"{name}_bucket", []):
        le = float(labels["le"])
        out[le] = out.get(le, 0.0) + v
    return out


def quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """``histogram_quantile``: linear within the bucket holding the q-th observation; the
    highest finite bound when it falls in +Inf; None without observations."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below
                                            else 0.0)
        lower, below = le, count
    return lower


@dataclass
class View:
    seconds: float
    req_s: float
    tok_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    phases_ms: dict[str, float] = field(default_factory=dict)  # mean over the interval
    workers: list[dict[str, Any]] = field(default_factory=list)
    slowest: list[dict[str, Any]] | None = None  # None: not an operator's key
    # Speculative decoding over the interval (None: no draft verified): accepted / proposed
    # drafts, the same per position, and tokens per verifying sequence-step.
    spec_acceptance: float | None = None
    spec_by_position: list[float] = field(default_factory=list)
    spec_mean_length: float | None = None


def build_view(before: Scrape, after: Scrape) -> View:
    """The interval between two scrapes."""
    a, b = after.samples, before.samples
    dt = max(after.at - before.at, 1e-9)

    def delta(name: str) -> float:
        return max(0.0, _total(a, name) - _total(b, name))

    def interval_buckets(name: str) -> dict[float, float]:
        old = _buckets(b, name)
        return {le: n - old.get(le, 0.0) for le, n in _buckets(a, name).items()}

    ttft = interval_buckets("pdcluster_time_to_first_token_seconds")
    itl = interval_buckets("pdcluster_inter_token_latency_seconds")
    phases = {}
    for labels, _ in a.get("pdcluster_request_phase_seconds_count", []):
        p = labels["phase"]
        n = (_total(a, "pdcluster_request_phase_seconds_count", phase=p)
             - _total(b, "pdcluster_request_phase_seconds_count", phase=p))
        if n > 0:
            s = (_total(a, "pdcluster_request_phase_seconds_sum", phase=p)
                 - _total(b, "pdcluster_request_phase_seconds_sum", phase=p))
            phases[p] = s / n * 1e3
    view = View(dt, delta("pdcluster_e2e_request_latency_seconds_count") / dt,
                delta("pdcluster_generation_tokens_total") / dt,
                quantile(0.5, ttft), quantile(0.99, ttft), quantile(0.5, itl),
                quantile(0.99, itl), phases, list(after.cluster.get("workers", [])),
                after.cluster.get("slowest_recent"))
    proposed = delta("pdcluster_spec_draft_tokens_total")
    if proposed > 0:
        view.spec_acceptance = delta("pdcluster_spec_accepted_tokens_total") / proposed
        verified = delta("pdcluster_spec_verify_sequences_total")
        view.spec_mean_length = (delta("pdcluster_spec_emitted_tokens_total") / verified
                                 if verified else None)
        positions = sorted({int(lab["position"]) for lab, _ in
                            a.get("pdcluster_spec_draft_tokens_by_position_total", [])})
        for i in positions:
            n = (_total(a, "pdcluster_spec_draft_tokens_by_position_total", position=str(i))
                 - _total(b, "pdcluster_spec_draft_tokens_by_position_total", position=str(i)))
            k = (_total(a, "pdcluster_spec_accepted_tokens_by_position_total", position=str(i))
                 - _total(b, "pdcluster_spec_accepted_tokens_by_position_total",
                          position=str(i)))
            view.spec_by_position.append(k / n if n > 0 else 0.0)
    return view


# ---- drawing it ---------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def render(view: View, address: str):
    """The view as one rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(
        (f"pdcluster @ {address}", "bold"),
        f"   last {view.seconds:.1f} s: {view.req_s:.2f} req/s, {view.tok_s:.1f} tok/s   "
        f"TTFT p50 {_ms(view.ttft_p50)} p99 {_ms(view.ttft_p99)}   "
        f"ITL p50 {_ms(view.itl_p50)} p99 {_ms(view.itl_p99)}")
    parts: list[Any] = [head]
    if view.phases_ms:
        parts.append(Text("first token: " + " + ".join(
            f"{p} {ms:.0f} ms" for p, ms in view.phases_ms.items())))
    if view.spec_acceptance is not None:
        parts.append(Text(
            f"speculation: {100 * view.spec_acceptance:.0f}% of drafts accepted (by position "
            + " ".join(f"{100 * x:.0f}%" for x in view.spec_by_position) + "), "
            + ("-" if view.spec_mean_length is None else f"{view.spec_mean_length:.2f}")
            + " tokens per verifying step"))
    workers = Table(title="workers", title_justify="left", expand=False)
    numeric = ("running", "waiting", "KV used", "KV %", "threads", "stolen", "restarts")
    for col in ("id", "role", "host", "state", *numeric):
        workers.add_column(col, justify="right" if col in numeric else "left")
    for w in view.workers:
        used, total = w.get("kv_blocks_used", 0), w.get("kv_blocks_total", 0)
        pct = f"{100 * used / total:.0f}%" if total else "-"
        style = "" if w.get("state") == "ready" else "yellow"
        workers.add_row(str(w.get("id")), str(w.get("role")), str(w.get("host", "")),
                        str(w.get("state")), str(w.get("running", "")),
                        str(w.get("waiting", "")), f"{used}/{total}", pct,
                        str(w.get("threads") or "-"), f"{100 * w.get('cpu_stolen', 0.0):.0f}%",
                        str(w.get("restarts", "")), style=style)
    parts.append(workers)
    if view.slowest is not None:
        slow = Table(title="slowest requests (last 5 min)", title_justify="left")
        for col in ("request", "api", "e2e", "TTFT", "tokens", "end"):
            slow.add_column(col)
        for r in view.slowest:
            slow.add_row(str(r["request_id"]), r["api"], _ms(r["e2e_s"]), _ms(r["ttft_s"]),
                         str(r["output_tokens"]), r["finish_reason"])
        parts.append(slow)
    return Group(*parts)


def cmd_top(args: argparse.Namespace) -> int:
    """Exit 1 when the server cannot be reached."""
    from rich.console import Console
    from rich.live import Live

    if args.interval <= 0:
        print("error: --interval must be > 0", file=sys.stderr)
        return 2
    tls = args.tls or args.ca_file
    base = f"{'https' if tls else 'http'}://{args.http_address}"
    key = args.api_key or os.environ.get("PDCLUSTER_API_KEY")
    context = ssl.create_default_context(cafile=args.ca_file) if tls else None
    # Not a terminal (a log, a pipe): wide enough that no column is cut.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        before = scrape(base, key, context)
        time.sleep(args.interval)
        after = scrape(base, key, context)
        if args.once:
            console.print(render(build_view(before, after), args.http_address))
            return 0
        with Live(render(build_view(before, after), args.http_address), console=console,
                  screen=False, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                before, after = after, scrape(base, key, context)
                live.update(render(build_view(before, after), args.http_address), refresh=True)
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"error: cannot read {base}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
