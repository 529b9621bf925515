"""Skip conditions shared by the GPU tests."""

from __future__ import annotations

import pytest
import torch

from engine.executor.device import flashinfer_available

HAVE_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA")
# FlashInfer's kernels are CUDA-only; without the package `attention_backend="auto"` is torch.
needs_flashinfer = pytest.mark.skipif(
    not (HAVE_CUDA and flashinfer_available()),
    reason="needs CUDA and flashinfer (pip install 'pdcluster[gpu]')")
