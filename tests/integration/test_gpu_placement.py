"""GPU start-up on a machine without enough GPUs fails fast with a message, never hangs.

Runs on CPU-only machines (skipped where CUDA works, since there the workers would start):
`pdcluster serve --device cuda` finds no GPU in its Ray cluster and exits at once naming it;
and a Ray that declares one logical GPU (``ray.init(num_gpus=1)``) gets a 1P+1D cluster
planned as half a GPU each over gloo, whose workers then cannot initialise CUDA: their
constructors fail, and start-up reports which worker and why instead of waiting out
``startup_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from router.cluster.placement import DECODE_RESOURCE, PREFILL_RESOURCE
from tests.helpers.async_util import ray_loop, run_cluster

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="CUDA works here: the workers would start")]

FAIL_WITHIN_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_requiring_gpus_without_any_exits_with_a_message():
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--device", "cuda",
         "--grpc-port", str(_free_port()), "--http-port", str(_free_port())],
        capture_output=True, text=True, timeout=FAIL_WITHIN_S + 30, env=dict(os.environ))
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.0f} s to fail"
    error = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert error, proc.stderr[-3000:]
    assert "GPUs are required" in error[-1] and "--device cpu" in error[-1]
    assert "Traceback" not in proc.stderr  # a message, not a stack


async def _must_not_start(cluster) -> None:
    raise AssertionError("a cluster of CUDA workers started on a machine without CUDA")


def test_workers_that_cannot_initialise_cuda_fail_start_up_with_the_cause(tiny_llama_dir, caplog):
    from router.cluster.launcher import StartupError
    from router.cluster.ray_cluster import ClusterConfig

    caplog.set_level(logging.INFO, logger="router.cluster.launcher")  # the placement plan
    config = ClusterConfig(model=str(tiny_llama_dir), startup_timeout_s=300.0)
    started = time.monotonic()
    with (ray_loop(num_cpus=4, num_gpus=1,
                   resources={PREFILL_RESOURCE: 1, DECODE_RESOURCE: 1}) as loop,
          pytest.raises(StartupError) as e):
        run_cluster(loop, config, _must_not_start, timeout_s=FAIL_WITHIN_S + 30)
    elapsed = time.monotonic() - started
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.0f} s to fail"
    msg = str(e.value)
    assert msg.startswith(("worker prefill-0 failed to start: ",
                           "worker decode-0 failed to start: ")), msg
    assert "CUDA is not available" in msg and "Traceback" not in msg
    # The plan for one GPU and two workers: half each, KV through host memory.
    assert "GPUs: 2 workers per GPU, 0.5 GPU each; KV over gloo through host memory" in caplog.text
