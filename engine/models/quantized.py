"""Layers that hold ``engine.quant.layouts`` weights where a model's fp ones were, and moving such
weights to a device (``Module.to`` moves parameters and buffers; these are neither)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.ops import quant_ops
from engine.quant.gpu import to_cuda
from engine.quant.layouts import QuantizedWeight


class QLinear(nn.Module):
    """A linear layer whose weight is quantized (``engine.quant.layouts``): stands where the
    fp ``Linear`` was (``.weight``, ``.bias``), read by ``engine.ops.linear.linear``."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


class QEmbedding(nn.Module):
    """The token embedding in a quantized layout (a tied model's LM head is the same table):
    a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.take_rows(ids)
        if rows.data.is_cpu:
            # One C pass (on one thread for a decode step's few rows: a parallel region
            # costs more than they do). torch's unpack-and-scale ops took ~0.18 ms a decode
            # step of the default model's int4 table, 4% of its batch-1 step.
            out = quant_ops.dequantize(rows, threads=1 if len(ids) < 64 else None)
            if out is not None:
                return out
        return rows.dequantize()


def placer(device: torch.device) -> Callable[[Any, str], Any]:
    """``place(weight, name)``: a quantized weight ready to multiply on ``device`` (on CUDA,
    int4 packed for tinygemm: ``engine.quant.gpu.to_cuda``; ``name`` for its log line), any
    other weight unchanged."""
    def place(w, name: str):
        if not isinstance(w, QuantizedWeight):
            return w
        return to_cuda(w, device, name) if w.kind == "int4" else w.to(device)
    return place
