"""One step's rows grouped by adapter (``LoRARows``), and the thread's active grouping, which
each projection of the decoder adds its adapters' products to (``add``).

Batched LoRA without merging weights: the rows of each adapter are gathered, shrunk by its
stacked A (``[n, R]``), expanded by each part's B into that part's output columns, and added
back, so rows of different adapters and of the base model share every base GEMM of the step.
An adapter's cost is ``R * (K + N)`` multiply-adds per row and projection on top of the base's
``K * N``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.lora.peft_format import LoRAAdapter

_active = threading.local()


@dataclass(frozen=True)
class LoRARows:
    """``groups``: per adapter present in the step, the rows (int64 indices into the step's
    flattened tokens) that run under it."""

    groups: tuple[tuple[torch.Tensor, LoRAAdapter], ...]

    @classmethod
    def of(cls, chunks: Iterable, adapter: Callable[[str], LoRAAdapter]) -> LoRARows | None:
        """The grouping of a step's chunks in batch order (each with ``lora_name`` and
        ``num_tokens``), ``adapter(name)`` giving each held adapter; None when no chunk runs
        under one."""
        rows: dict[str, list[int]] = {}
        at = 0
        for c in chunks:
            if c.lora_name is not None:
                rows.setdefault(c.lora_name, []).extend(range(at, at + c.num_tokens))
            at += c.num_tokens
        if not rows:
            return None
        return cls(tuple((torch.tensor(r, dtype=torch.int64), adapter(name))
                         for name, r in rows.items()))

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += s B (A x[rows])`` for each adapter's rows, in place (``x [T, K]`` the
        projection's input, ``y [T, N]`` its output)."""
        for rows, adapter in self.groups:
            p = adapter.layers[layer].get(proj)
            if p is None:
                continue
            t = x.index_select(0, rows) @ p.a.T  # [n, R]
            if len(p.parts) == 1 and p.parts[0][0] == 0 and p.parts[0][1] == y.shape[1]:
                y.index_add_(0, rows, t @ p.parts[0][4].T)
                continue
            delta = torch.zeros(rows.numel(), y.shape[1], dtype=y.dtype, device=y.device)
            for o0, o1, r0, r1, b in p.parts:
                delta[:, o0:o1] = t[:, r0:r1] @ b.T
            y.index_add_(0, rows, delta)


def active() -> LoRARows | None:
    """The grouping of the step this thread is running, or None (base model only)."""
    return getattr(_active, "rows", None)


@contextmanager
def using(rows: LoRARows | None) -> Iterator[None]:
    """Within it (in this thread), the decoder's projections add ``rows``' adapters."""
    held = active()
    _active.rows = rows
    try:
        yield
    finally:
        _active.rows = held
