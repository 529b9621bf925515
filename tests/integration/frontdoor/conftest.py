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
# Both backends serve the default quantization ("auto": the GGUF's own blocks), what
# `pdcluster serve` runs. The promises that need the float products (n choices and batches
# against each request alone, a resumed stream against an unbroken run, logprobs against
# transformers' fp32 forward) run over fp32 backends of their own:
# tests/integration/frontdoor_fp32/test_frontdoor_float_products.py, test_frontdoor_float_resume.py.


@pytest.fixture(scope="package")
def otlp():
    """The OTLP trace receiver both backends export to (test_tracing.py reads it): tracing
    is on for every front-door test, so each also shows it costs no request anything."""
    from bench.harness.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="package")
def tracing(otlp):
    from worker_protocol.tracing import TracingConfig

    return TracingConfig(otlp.endpoint, flush_interval_s=0.2, export_timeout_s=2.0)


@pytest.fixture(scope="package")
def embedded_backend(server_loop, tracing) -> GenerationBackend:
    """One in-process engine (the default model) for every module of this package that a
    pytest process runs."""
    from engine.args import EngineArgs

    b = EngineBackend(EngineArgs(max_num_seqs=MAX_NUM_SEQS, max_waiting=MAX_WAITING),
                      tracing=tracing)
    yield b
    server_loop.run(b.shutdown(), 60)


@pytest.fixture(scope="package")
def cluster_backend(server_loop, tracing) -> GenerationBackend:
    """The real Ray cluster (1 prefill + 1 decode worker, disaggregated) that `pdcluster
    serve` builds, for every module of this package that a pytest process runs."""
    from engine.args import EngineArgs
    from router.cluster.ray_cluster import Cluster, ClusterConfig
    from tests.helpers.shared_ray import stop_shared_ray

    stop_shared_ray()  # this cluster starts the Ray it owns, as `pdcluster serve` does
    engine = EngineArgs(max_num_seqs=MAX_NUM_SEQS, num_threads=1)
    b = server_loop.run(Cluster.start(ClusterConfig(
        prefill_engine=engine, decode_engine=engine,
        max_inflight_requests=MAX_NUM_SEQS + MAX_WAITING, capacity_wait_s=5.0,
        tracing=tracing)), 180)
    yield b
    server_loop.run(b.shutdown(), 60)


@pytest.fixture(scope="package", params=["embedded", "cluster"])
def backend(request) -> GenerationBackend:
    """The same front-door tests run over one in-process engine and over the real Ray
    cluster. Both are package-scoped fixtures of their own, so both stay up while a pytest
    process runs this package's modules: xdist hands out whole modules (`--dist loadfile`),
    and one parametrized fixture would have started each again for every module, since a
    module runs its tests of both backends before the next module's. Both are shut down
    before the package's last test is done, so no other package's Ray meets this one. Tests
    leave them as they found them: no KV block held (``kv_probe``), no server of theirs
    running."""
    return request.getfixturevalue(f"{request.param}_backend")
