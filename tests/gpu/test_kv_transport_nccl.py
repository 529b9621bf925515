"""The KV transport's lifecycle (tests/integration/test_kv_transport.py, over gloo there) over
NCCL: the receiver on cuda:0, the sender's process on cuda:1 (skipped with fewer than two
GPUs; ``bash bench/gpu_check.sh`` runs tests/gpu on a lent machine)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_kv_transport import run_lifecycle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pair needs 2 GPUs")]


def test_nccl_lifecycle():
    run_lifecycle("cuda:0", "cuda:1")
