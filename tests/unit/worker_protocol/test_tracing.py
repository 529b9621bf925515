"""worker_protocol.tracing against a real OTLP/gRPC receiver on 127.0.0.1: what a worker's
``record`` sends (its own times, under the router's span), sampling decided at the root only,
the flags' checks, and an exporter whose collector is gone shutting down in bounded time."""

from __future__ import annotations

import time

import pytest

from bench.harness.otlp_receiver import OtlpReceiver, free_port
from engine.contract import SamplingParams
from worker_protocol.tracing import (
    TRACES_ENDPOINT_ENV,
    TracingConfig,
    close_request_span,
    end,
    open_request_span,
    start_tracing,
)


@pytest.fixture
def otlp():
    r = OtlpReceiver().start()
    yield r
    r.stop()


def _config(endpoint: str, ratio: float = 1.0) -> TracingConfig:
    return TracingConfig(endpoint, ratio, export_timeout_s=1.0, flush_interval_s=0.05)


def test_a_worker_span_hangs_under_the_routers_with_the_workers_own_times(otlp):
    router = start_tracing(_config(otlp.endpoint), "pdcluster-router", is_router=True)
    worker = start_tracing(_config(otlp.endpoint), "pdcluster-prefill")
    try:
        root = open_request_span(router, "req-1", "m", False, 7,
                                 SamplingParams(max_tokens=3, seed=5), None)
        phase = router.start("prefill", root)
        header = router.header(phase)
        assert header.startswith("00-") and int(header[-2:], 16) & 1  # W3C: sampled
        t0 = time.time_ns()
        worker.record("prefill.compute", header, t0, t0 + 2_000_000, {"k": 1})
        end(phase)
        close_request_span(root, 3, "length", None)
        trace_id = format(root.get_span_context().trace_id, "032x")
        spans = {s.name: s for s in otlp.wait_for(trace_id, {"prefill.compute", "text_completion m"})}
    finally:
        router.shutdown()
        worker.shutdown()
    compute = spans["prefill.compute"]
    assert compute.parent_id == spans["prefill"].span_id
    assert (compute.start_ns, compute.end_ns) == (t0, t0 + 2_000_000)
    assert compute.service == "pdcluster-prefill" and compute.attributes == {"k": 1}
    r = spans["text_completion m"]
    assert r.parent_id == "" and r.attributes["gen_ai.request.seed"] == 5
    assert r.attributes["gen_ai.usage.output_tokens"] == 3


def test_sampling_is_decided_at_the_root_and_workers_follow_it(otlp):
    """Ratio 0 at the router: no header for the workers, nothing exported anywhere; a worker
    never starts a trace itself (``record`` without a parent sends nothing)."""
    router = start_tracing(_config(otlp.endpoint, ratio=0.0), "pdcluster-router", is_router=True)
    worker = start_tracing(_config(otlp.endpoint), "pdcluster-decode")
    root = router.start("root", None)
    assert router.header(root) == ""
    worker.record("decode.generate", router.header(root), 1, 2)
    worker.record("decode.generate", "", 1, 2)
    end(root)
    router.shutdown()
    worker.shutdown()
    assert otlp.spans() == []


def test_a_failed_span_says_so(otlp):
    tracing = start_tracing(_config(otlp.endpoint), "pdcluster-router", is_router=True)
    root = tracing.start("root", None)
    end(root, RuntimeError("worker lost"))
    tracing.shutdown()
    (span,) = otlp.wait_for(format(root.get_span_context().trace_id, "032x"), {"root"})
    assert span.status == 2


def test_off_unless_an_endpoint_is_given_by_flag_or_environment(monkeypatch):
    monkeypatch.delenv(TRACES_ENDPOINT_ENV, raising=False)
    assert TracingConfig.resolve(None) is None
    assert start_tracing(None, "x") is None
    monkeypatch.setenv(TRACES_ENDPOINT_ENV, "http://127.0.0.1:4317")
    assert TracingConfig.resolve(None).endpoint == "http://127.0.0.1:4317"
    assert TracingConfig.resolve("127.0.0.1:9").grpc_target == ("127.0.0.1:9", True)
    assert TracingConfig("https://collector:4317").grpc_target == ("collector:4317", False)


@pytest.mark.parametrize("endpoint,ratio,match", [
    ("ftp://x:1", 1.0, "http"), ("http://", 1.0, "host:port"), ("x:1", 1.5, r"\[0, 1\]"),
    ("x:1", -0.1, r"\[0, 1\]")])
def test_bad_settings_are_refused_with_the_flag_named(endpoint, ratio, match):
    with pytest.raises(ValueError, match=match):
        TracingConfig(endpoint, ratio)


def test_a_collector_that_is_gone_costs_a_bounded_shutdown():
    """Spans queued for a port nobody listens on: recording stays instant, shutdown gives up
    within about the export timeout, and nothing raises."""
    tracing = start_tracing(_config(f"http://127.0.0.1:{free_port()}"), "r", is_router=True)
    t0 = time.perf_counter()
    for _ in range(200):
        end(tracing.start("s", None))
    assert time.perf_counter() - t0 < 1.0
    t1 = time.perf_counter()
    tracing.shutdown()
    assert time.perf_counter() - t1 < 10.0
