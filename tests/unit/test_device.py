"""Device selection is explicit and refuses what the machine cannot do."""

from __future__ import annotations

import pytest
import torch

from engine.device import resolve_device


def test_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on CPU-only machines")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


def test_unknown_device():
    with pytest.raises(ValueError, match="unsupported device"):
        resolve_device("mps")
