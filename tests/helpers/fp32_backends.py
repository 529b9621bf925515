"""The fp32 backends of the front-door checks that need the float products
(tests/integration/frontdoor_fp32/, whose conftest.py holds one of each for the package): the
front-door package's queue limits and tracing, as in tests/integration/frontdoor/conftest.py,
on fp32 weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

MAX_NUM_SEQS = 4
MAX_WAITING = 4
# fp32 weights, not the default: every check over these backends needs the float products.
QUANTIZATION = "none"


@contextmanager
def fp32_backend(kind: str, server_loop, otlp) -> Iterator:
    """``kind`` "embedded" (one in-process engine) or "cluster" (1 prefill + 1 decode worker,
    disaggregated, on a Ray it starts and stops, as `pdcluster serve` does); shut down after."""
    from engine.args import EngineArgs
    from router.embedded import EngineBackend
    from worker_protocol.tracing import TracingConfig

    tracing = TracingConfig(otlp.endpoint, flush_interval_s=0.2, export_timeout_s=2.0)
    if kind == "embedded":
        b = EngineBackend(EngineArgs(max_num_seqs=MAX_NUM_SEQS, max_waiting=MAX_WAITING,
                                     quantization=QUANTIZATION), tracing=tracing)
    else:
        from router.cluster.ray_cluster import Cluster, ClusterConfig
        from tests.helpers.shared_ray import stop_shared_ray

        stop_shared_ray()
        engine = EngineArgs(max_num_seqs=MAX_NUM_SEQS, num_threads=1, quantization=QUANTIZATION)
        b = server_loop.run(Cluster.start(ClusterConfig(
            prefill_engine=engine, decode_engine=engine,
            max_inflight_requests=MAX_NUM_SEQS + MAX_WAITING, capacity_wait_s=5.0,
            tracing=tracing)), 180)
    try:
        yield b
    finally:
        server_loop.run(b.shutdown(), 60)
