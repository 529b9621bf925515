"""Picks an attention backend by name: ``"torch"`` (everywhere) or ``"flashinfer"`` (CUDA,
bf16/fp16, ``pip install 'pdcluster[gpu]'``; its package is imported only when chosen).

Lives beside the contract (``engine/attention/backend.py``), not inside it: the implementations
import the contract, so a factory in the contract would make an import cycle.
"""

from __future__ import annotations

import torch

from engine.attention.backend import ATTENTION_BACKENDS, AttentionBackend, AttentionShape


def create_backend(name: str, device: torch.device | str = "cpu",
                   shape: AttentionShape | None = None) -> AttentionBackend:
    """The backend called ``name`` (one of ``ATTENTION_BACKENDS``), running on ``device``.

    ``"flashinfer"`` needs ``shape`` and a CUDA device; ValueError otherwise (and for an
    unknown name). ``shape``'s per-layer windows and soft-cap are honoured by both.
    """
    # Imported here: a GPU backend's heavy imports should only happen when it is chosen.
    if name == "torch":
        from engine.attention.torch_paged import TorchPagedBackend

        return TorchPagedBackend(device, shape)
    if name == "flashinfer":
        if shape is None:
            raise ValueError("attention backend 'flashinfer' needs the model's AttentionShape")
        from engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device, shape)
    raise ValueError(f"unknown attention backend {name!r}; choose from {list(ATTENTION_BACKENDS)}")
