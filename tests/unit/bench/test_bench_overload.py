"""`pdcluster bench overload` counts every request's outcome (bench/cluster/overload.py): the
classification, the SSE reading (error events as the server writes them) and one class's
summary, on synthetic results."""

from __future__ import annotations

import json

import pytest

from bench.cluster.overload import OUTCOMES, outcome, read_event, summarize_class, table
from router.contract import DeadlineExceededError, QueueFullError
from router.frontdoor.errors import map_error, openai_error_body


def _error_line(exc: BaseException) -> str:
    """The in-band error event the server sends after a stream's 200."""
    return "data: " + json.dumps(openai_error_body(map_error(exc)))


@pytest.mark.parametrize(("status", "code", "done", "stream_code", "want"), [
    (200, None, True, None, "served"),
    (200, None, True, "deadline_exceeded", "deadline_inband"),
    (200, None, True, "internal_error", "server_error"),
    (200, None, False, None, "cut"),
    (429, "deadline_unmet", False, None, "refused"),
    (429, "queue_full", False, None, "refused"),
    (504, "deadline_exceeded", False, None, "deadline_504"),
    (504, None, False, None, "server_error"),
    (500, "internal_error", False, None, "server_error"),
    (503, None, False, None, "server_error"),
    (400, "invalid_request", False, None, "other_4xx"),
    (None, "ReadTimeout", False, None, "no_status"),
])
def test_every_outcome(status, code, done, stream_code, want):
    assert want in OUTCOMES
    assert outcome(status, code, done, stream_code) == want


def test_a_stream_ended_by_its_deadline_is_not_served():
    """A first token, then the server's deadline event and [DONE]: the TTFT counts, the
    request is ended by its deadline."""
    out = {"ttft_s": None, "done": False, "stream_code": None}
    for i, line in enumerate([
            ": keep-alive", "",
            'data: {"id": "c", "choices": [{"index": 0, "text": "a"}]}',
            'data: {"id": "c", "choices": [{"index": 0, "text": "b"}]}',
            _error_line(DeadlineExceededError("x-request-timeout: 2 s passed")),
            "data: [DONE]"]):
        read_event(out, line, float(i))
    assert out == {"ttft_s": 2.0, "done": True, "stream_code": "deadline_exceeded"}
    assert outcome(200, None, out["done"], out["stream_code"]) == "deadline_inband"
    # the whole (non-streamed) answer's code is the one the bench reads from a 504 body
    assert map_error(DeadlineExceededError("x")).http_status == 504
    assert map_error(QueueFullError("x")).http_status == 429


def test_class_summary_counts_everything_and_bounds_the_late():
    rs = [{"outcome": "served", "ttft_s": 0.5, "e2e_s": 1.0, "code": None},
          {"outcome": "served", "ttft_s": 1.0, "e2e_s": 1.9, "code": None},
          {"outcome": "deadline_inband", "ttft_s": 1.5, "e2e_s": 2.0, "code": None},
          {"outcome": "deadline_504", "ttft_s": None, "e2e_s": 2.0, "code": "deadline_exceeded"},
          {"outcome": "refused", "ttft_s": None, "e2e_s": 0.05, "code": "deadline_unmet"},
          {"outcome": "refused", "ttft_s": None, "e2e_s": 0.05, "code": "queue_full"},
          {"outcome": "no_status", "ttft_s": None, "e2e_s": None, "code": "ReadTimeout"}]
    c = summarize_class(rs, slo=1.2)
    assert c["sent"] == 7 and sum(c["outcomes"].values()) == 7
    assert c["outcomes"] == {"served": 2, "refused": 2, "deadline_inband": 1,
                             "deadline_504": 1, "server_error": 0, "other_4xx": 0, "cut": 0,
                             "no_status": 1}
    assert (c["served"], c["refused"], c["refused_deadline"]) == (2, 2, 1)
    assert c["broken_calls"] == {"ReadTimeout": 1}
    # admitted: three first tokens and the 504 at its answer's 2.0 s, which sets the p99
    assert c["ttft_p99_s"] == pytest.approx(1.5 + 0.97 * 0.5)
    assert c["ttft_p99_lower_bound"] is True
    assert c["within_slo"] == pytest.approx(2 / 4)
    levels = [{"load": 4.0, "classes": {"high": c}}]
    row = table(levels).splitlines()[2]
    assert row.startswith("| 4x | high | 7 | 2 | 2 | 1 | 1 | 0 | 0 | 0 | 1 |")
    assert row.endswith("| 1.25 | >=1.99 | 0.5 |")  # p50, p99 a lower bound, within SLO


def test_a_class_with_nothing_admitted():
    c = summarize_class([{"outcome": "refused", "ttft_s": None, "e2e_s": 0.1,
                          "code": "deadline_unmet"}], slo=2.0)
    assert (c["ttft_p99_s"], c["within_slo"], c["ttft_p99_lower_bound"]) == (None, None, False)


def test_first_token_parts_split_each_class_by_the_routers_timings():
    """Each admitted request's TTFT: its prefill queue and compute as the router timed them,
    the rest (decode room, reserve, KV tail, commit, HTTP); the slowest tenth apart."""
    from bench.cluster.overload import first_token_parts
    from router.control.request_state import RequestTiming

    rs = [{"tenant": "tenant-a", "rid": f"r{i}", "ttft_s": 1.0 + i / 10} for i in range(10)]
    rs.append({"tenant": "tenant-b", "rid": "refused", "ttft_s": None})
    timings = {f"tenant-a/r{i}": RequestTiming(queue_s=0.5 + i / 10, prefill_compute_s=0.4)
               for i in range(10)}
    parts = first_token_parts(rs, timings)
    assert (parts["n"], parts["slowest_n"]) == (10, 1)
    assert parts["ttft_slowest"] == pytest.approx(1.9)
    assert parts["prefill_queue_slowest"] == pytest.approx(1.4)
    assert parts["rest_mean"] == pytest.approx(0.1)
    assert first_token_parts(rs[-1:], timings) == {}
