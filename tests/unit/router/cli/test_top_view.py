"""`pdcluster top`'s numbers (router/cli/top.py) from two scrapes of a known exposition: rates
over the interval, quantiles as Prometheus' histogram_quantile computes them, phase means,
workers and the slowest requests as drawn."""

from __future__ import annotations

import io
from dataclasses import asdict

import pytest

from router.cli.top import Scrape, build_view, parse_samples, quantile, render
from router.contract import WorkerStatus


def _exposition(requests: int, tokens: int, ttft_le: dict[str, int], phase_sum: float,
                phase_n: int) -> str:
    lines = [
        "# TYPE pdcluster_e2e_request_latency_seconds histogram",
        f'pdcluster_e2e_request_latency_seconds_count{{api="http",finish_reason="length"}} {requests}',
        'pdcluster_e2e_request_latency_seconds_sum{api="http",finish_reason="length"} 1.0',
        "# TYPE pdcluster_generation_tokens counter",
        f'pdcluster_generation_tokens_total{{api="http"}} {tokens}',
        "# TYPE pdcluster_time_to_first_token_seconds histogram"]
    lines += [f'pdcluster_time_to_first_token_seconds_bucket{{api="http",le="{le}"}} {n}'
              for le, n in ttft_le.items()]
    lines += [f'pdcluster_time_to_first_token_seconds_count{{api="http"}} {ttft_le["+Inf"]}',
              'pdcluster_time_to_first_token_seconds_sum{api="http"} 1.0',
              "# TYPE pdcluster_request_phase_seconds histogram",
              f'pdcluster_request_phase_seconds_bucket{{phase="prefill_compute",le="+Inf"}} {phase_n}',
              f'pdcluster_request_phase_seconds_count{{phase="prefill_compute"}} {phase_n}',
              f'pdcluster_request_phase_seconds_sum{{phase="prefill_compute"}} {phase_sum}']
    return "\n".join(lines) + "\n"


# Built from the server's own record, so the view reads the keys /v1/cluster really sends.
CLUSTER = {"workers": [asdict(WorkerStatus("prefill-0", "prefill", "127.0.0.1", 11, "ready",
                                           16, 64, running=1, waiting=0, threads=2,
                                           cpu_stolen=0.0)),
                       asdict(WorkerStatus("decode-0", "decode", "127.0.0.1", 12, "unreachable",
                                           0, 64, running=3, waiting=7, restarts=1, threads=1,
                                           cpu_stolen=0.4))],
           "slowest_recent": [{"request_id": "req-slow", "api": "grpc", "ended_at": 0.0,
                               "e2e_s": 2.5, "ttft_s": 0.4, "output_tokens": 64,
                               "finish_reason": "length"}]}


def test_the_view_covers_the_interval_between_two_scrapes():
    before = Scrape(10.0, CLUSTER, parse_samples(_exposition(
        4, 100, {"0.1": 2, "0.5": 4, "+Inf": 4}, 0.2, 4)))
    after = Scrape(12.0, CLUSTER, parse_samples(_exposition(
        14, 600, {"0.1": 2, "0.5": 12, "+Inf": 14}, 1.2, 14)))
    v = build_view(before, after)
    assert (v.req_s, v.tok_s) == (5.0, 250.0)
    # 10 first tokens in the interval: 0 <= 0.1 s, 8 in (0.1, 0.5], 2 above 0.5 s
    assert v.ttft_p50 == pytest.approx(0.1 + 0.4 * 5 / 8)
    assert v.ttft_p99 == 0.5  # in +Inf: the highest finite bound, as histogram_quantile
    assert v.phases_ms == {"prefill_compute": pytest.approx(100.0)}
    assert v.itl_p50 is None  # no inter-token observations at all
    from rich.console import Console

    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(render(v, "127.0.0.1:8000"))
    text = console.export_text()
    for want in ("5.00 req/s", "250.0 tok/s", "TTFT p50 350 ms p99 500 ms",
                 "prefill_compute 100 ms",
                 "prefill-0", "25%", "unreachable", "req-slow", "2500 ms"):
        assert want in text, (want, text)
    decode_row = next(line for line in text.splitlines() if "decode-0" in line)
    # running, waiting, threads and the share of their time other processes took
    for want in (" 3 ", " 7 ", " 1 ", "40%"):
        assert want in decode_row, (want, decode_row)


def test_quantile_is_prometheus_histogram_quantile():
    assert quantile(0.5, {}) is None
    assert quantile(0.5, {0.1: 0, float("inf"): 0}) is None
    assert quantile(0.5, {1.0: 10, 2.0: 20, float("inf"): 20}) == pytest.approx(1.0)
    assert quantile(0.75, {1.0: 10, 2.0: 20, float("inf"): 20}) == pytest.approx(1.5)
    assert quantile(0.25, {1.0: 10, 2.0: 20, float("inf"): 20}) == pytest.approx(0.5)


def _spec_exposition(proposed: list[int], accepted: list[int], verified: int) -> str:
    w = 'worker="decode-0",role="decode"'
    lines = ["# TYPE pdcluster_spec_draft_tokens counter",
             f"pdcluster_spec_draft_tokens_total{{{w}}} {sum(proposed)}",
             "# TYPE pdcluster_spec_accepted_tokens counter",
             f"pdcluster_spec_accepted_tokens_total{{{w}}} {sum(accepted)}",
             "# TYPE pdcluster_spec_verify_sequences counter",
             f"pdcluster_spec_verify_sequences_total{{{w}}} {verified}",
             "# TYPE pdcluster_spec_emitted_tokens counter",
             f"pdcluster_spec_emitted_tokens_total{{{w}}} {sum(accepted) + verified}",
             "# TYPE pdcluster_spec_draft_tokens_by_position counter",
             "# TYPE pdcluster_spec_accepted_tokens_by_position counter"]
    for i, (p, a) in enumerate(zip(proposed, accepted, strict=True)):
        lines += [f'pdcluster_spec_draft_tokens_by_position_total{{{w},position="{i}"}} {p}',
                  f'pdcluster_spec_accepted_tokens_by_position_total{{{w},position="{i}"}} {a}']
    return "\n".join(lines) + "\n"


def test_the_view_shows_speculation_over_the_interval():
    before = Scrape(10.0, CLUSTER, parse_samples(
        _exposition(4, 100, {"+Inf": 4}, 0.2, 4) + _spec_exposition([10, 8], [8, 4], 10)))
    after = Scrape(12.0, CLUSTER, parse_samples(
        _exposition(14, 600, {"+Inf": 14}, 1.2, 14) + _spec_exposition([30, 28], [26, 14], 30)))
    v = build_view(before, after)
    # interval: 40 drafts, 28 accepted; 20 verifying steps made 28 + 20 tokens
    assert v.spec_acceptance == pytest.approx(28 / 40)
    assert v.spec_by_position == [pytest.approx(18 / 20), pytest.approx(10 / 20)]
    assert v.spec_mean_length == pytest.approx(48 / 20)
    from rich.console import Console

    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(render(v, "127.0.0.1:8000"))
    assert ("speculation: 70% of drafts accepted (by position 90% 50%), 2.40 tokens per "
            "verifying step") in console.export_text()
    quiet = build_view(before, before)
    assert quiet.spec_acceptance is None


def test_top_reads_the_speculation_counters_the_exporter_writes():
    """The front door's /metrics (router/frontdoor/metrics.py) from two load reports of a
    speculating decode worker, read the way `pdcluster top` reads a scrape."""
    import asyncio

    from router.contract import BackendStats
    from router.frontdoor.metrics import Metrics
    from worker_protocol.messages import WorkerLoad

    class Backend:
        load = None

        async def stats(self):
            return BackendStats(workers=[self.load, WorkerLoad("prefill-0", "prefill", 0, 64,
                                                               0, 0)])

    def load(proposed, accepted, verified):
        return WorkerLoad("decode-0", "decode", 0, 64, 1, 0, spec_proposed=sum(proposed),
                          spec_accepted=sum(accepted), spec_verified_seqs=verified,
                          spec_emitted=sum(accepted) + verified,
                          spec_proposed_by_position=tuple(proposed),
                          spec_accepted_by_position=tuple(accepted))

    backend = Backend()
    metrics = Metrics(backend)
    scrapes = []
    for t, args in ((10.0, ([10, 8], [8, 4], 10)), (12.0, ([30, 28], [26, 14], 30))):
        backend.load = load(*args)
        text = asyncio.run(metrics.render()).decode()
        scrapes.append(Scrape(t, CLUSTER, parse_samples(text)))
    assert 'pdcluster_spec_accepted_tokens_by_position_total{position="1",role="decode",' \
           'worker="decode-0"} 14.0' in text
    assert 'worker="prefill-0"' not in "".join(
        line for line in text.splitlines() if line.startswith("pdcluster_spec"))
    v = build_view(*scrapes)
    assert v.spec_acceptance == pytest.approx(28 / 40)
    assert v.spec_by_position == [pytest.approx(0.9), pytest.approx(0.5)]
    assert v.spec_mean_length == pytest.approx(48 / 20)
