"""The front-door modules (gRPC, HTTP, OpenAI fields, the OpenAPI document, structured
outputs and tools) share one backend per mode: starting a cluster per module cost ~15 s each."""

from __future__ import annotations

import pytest

from router.contract import GenerationBackend
from router.embedded import EngineBackend

# Queue limits the flood tests rely on: more than MAX_NUM_SEQS + MAX_WAITING concurrent
# requests must get RESOURCE_EXHAUSTED / 429.
MAX_NUM_SEQS = 4
MAX_WAITING = 4


@pytest.fixture(scope="package")
def otlp():
    """The OTLP trace receiver both backends export to (test_tracing.py reads it): tracing
    is on for every front-door test, so each also shows it costs no request anything."""
    from bench.harness.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="package", params=["embedded", "cluster"])
def backend(request, server_loop, otlp) -> GenerationBackend:
    """The same front-door tests run over one in-process engine and over the real Ray
    cluster (1 prefill + 1 decode worker, disaggregated) that `pdcluster serve` builds: one
    of each for every module of this package (pytest runs the package's tests grouped by
    backend), started once, shut down before the package's last test is done, so no other
    package's Ray meets this one. Tests leave it as they found it: no KV block held
    (``kv_probe``), no server of theirs running."""
    from engine.runtime.llm_engine import EngineArgs
    from worker_protocol.tracing import TracingConfig

    tracing = TracingConfig(otlp.endpoint, flush_interval_s=0.2, export_timeout_s=2.0)
    if request.param == "embedded":
        b = EngineBackend(EngineArgs(max_num_seqs=MAX_NUM_SEQS, max_waiting=MAX_WAITING),
                          tracing=tracing)
    else:
        from router.cluster.ray_cluster import Cluster, ClusterConfig

        engine = EngineArgs(max_num_seqs=MAX_NUM_SEQS, num_threads=1)
        b = server_loop.run(Cluster.start(ClusterConfig(
            prefill_engine=engine, decode_engine=engine,
            max_inflight_requests=MAX_NUM_SEQS + MAX_WAITING, capacity_wait_s=5.0,
            tracing=tracing)), 180)
    yield b
    server_loop.run(b.shutdown(), 60)
