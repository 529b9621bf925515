"""One step's rows grouped by adapter (``LoRARows``), and the thread's active grouping, which
each projection of the decoder adds its adapters' products to (``add``).

Batched LoRA without merging weights: the rows of each adapter are shrunk by its stacked A
(``[n, R]``), expanded by each part's B into that part's output columns, and added in, so rows
of different adapters and of the base model share every base GEMM of the step. An adapter
costs ``R * (K + N)`` multiply-adds per row and projection on top of the base's ``K * N``. On
fp32 CPU tensors one C call per projection does every group (``cpu_ops.c``'s ``lora_apply``:
each A and B row read once per step); elsewhere torch ops per group do the same."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.lora.peft_format import PROJECTIONS, LoRAAdapter, b_matrix
from engine.ops.cpu_ops import library

_active = threading.local()
# Each thread's previous (spans, LoRARows) (LoRARows.of_layout), by its Thread object: an
# entry goes with its thread, and forget_groupings() drops them all, so an adapter unloaded or
# evicted never stays alive through a remembered grouping (an idle engine, or a follower rank
# whose next steps run no adapter, would otherwise hold it past max_cpu_loras).
_last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INDEX = {name: i for i, name in enumerate(PROJECTIONS)}


def forget_groupings() -> None:
    """Drop every thread's remembered grouping (``LoRARows.of_layout``): the registry calls it
    when an adapter is unloaded or evicted, so nothing but a running step holds it after."""
    _last.clear()


@dataclass(frozen=True)
class LoRARows:
    """``groups``: per adapter present in the step, the rows (int64 indices into the step's
    flattened tokens) that run under it; ``rows`` / ``row_off``: the same concatenated, group
    g's at ``rows[row_off[g]:row_off[g + 1]]``; ``descs [L, 4, G]``: each group's adapter's
    ``desc_ptrs`` (the C kernel's tables)."""

    groups: tuple[tuple[torch.Tensor, LoRAAdapter], ...]
    rows: torch.Tensor
    row_off: torch.Tensor
    descs: torch.Tensor
    rmax: int
    t: torch.Tensor  # the kernel's scratch: [rows, rmax]
    # addresses made once per step (each call then costs a ctypes call and the kernel)
    desc_addrs: list[list[int]]
    # the adapters' tensors are in a dtype the C kernel reads (fp32, fp16, int8)
    c_kernel: bool = True

    @staticmethod
    def layout(chunks: Iterable) -> tuple[tuple[str | None, int], ...] | None:
        """Each of a step's chunks in batch order (each with ``lora_name`` and
        ``num_tokens``) as ``(adapter name or None, tokens)``; None when no chunk runs under
        an adapter. What rank 0 sends the other tensor-parallel ranks with the step."""
        spans = tuple((c.lora_name, c.num_tokens) for c in chunks)
        return spans if any(name is not None for name, _ in spans) else None

    @classmethod
    def of(cls, chunks: Iterable, adapter: Callable[[str], LoRAAdapter]) -> LoRARows | None:
        """The grouping of a step's chunks in batch order (each with ``lora_name`` and
        ``num_tokens``), ``adapter(name)`` giving each held adapter; None when no chunk runs
        under one."""
        spans = cls.layout(chunks)
        if spans is None:
            _last.pop(threading.current_thread(), None)  # no adapter held past such a step
            return None
        return cls.of_layout(spans, adapter)

    @classmethod
    def of_layout(cls, spans: Iterable[tuple[str | None, int]],
                  adapter: Callable[[str], LoRAAdapter]) -> LoRARows | None:
        """``of`` from ``layout``'s answer (a follower rank's view of rank 0's step). A
        decode step with the same spans under the same adapter objects as this thread's
        previous one gets that step's grouping back (decode steps repeat their layout; the
        tables cost ~1 ms of Python for 16 adapters)."""
        spans, me = tuple(spans), threading.current_thread()
        last = _last.get(me)
        if last is not None and last[0] == spans and all(
                adapter(a.name) is a for _, a in last[1].groups):
            return last[1]
        made = cls._make(spans, adapter)
        if made is None:
            _last.pop(me, None)
        else:
            _last[me] = (spans, made)
        return made

    @classmethod
    def _make(cls, spans: tuple[tuple[str | None, int], ...],
              adapter: Callable[[str], LoRAAdapter]) -> LoRARows | None:
        rows: dict[str, list[int]] = {}
        at = 0
        for name, num_tokens in spans:
            if name is not None:
                rows.setdefault(name, []).extend(range(at, at + num_tokens))
            at += num_tokens
        if not rows:
            return None
        groups = tuple((torch.tensor(r, dtype=torch.int64), adapter(name))
                       for name, r in rows.items())
        offs = [0]
        for r, _ in groups:
            offs.append(offs[-1] + r.numel())
        descs = torch.stack([a.desc_ptrs for _, a in groups], dim=-1).contiguous()
        rmax = max(a.rmax for _, a in groups)
        flat = torch.cat([r for r, _ in groups])
        base, step = descs.data_ptr(), descs.element_size() * descs.shape[2]
        addrs = [[base + (i * descs.shape[1] + j) * step for j in range(descs.shape[1])]
                 for i in range(descs.shape[0])]
        kernel = all(a.c_kernel for _, a in groups)
        return cls(groups, flat, torch.tensor(offs), descs, rmax,
                   torch.empty(flat.numel(), rmax), addrs, kernel)

    def kernel_table(self) -> torch.Tensor:
        """``cpu_ops.decode_layers``' ``lora``: int64 ``[G, rmax, &rows, &row_off, &t,
        &descs]`` (valid while this object lives)."""
        return torch.tensor([len(self.groups), self.rmax, self.rows.data_ptr(),
                             self.row_off.data_ptr(), self.t.data_ptr(),
                             self.descs.data_ptr()], dtype=torch.int64)

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += s B (A x[rows])`` for each adapter's rows, in place (``x [T, K]`` the
        projection's input, ``y [T, N]`` its output)."""
        lib = library()
        if (lib is not None and x.is_cpu and x.dtype == y.dtype == torch.float32
                and y.is_contiguous() and self.c_kernel):
            x = x.contiguous()
            lib.lora_apply(x.data_ptr(), x.shape[1], y.data_ptr(), y.shape[1],
                           len(self.groups), self.desc_addrs[layer][_INDEX[proj]],
                           self.rows.data_ptr(), self.row_off.data_ptr(), self.t.data_ptr(),
                           self.rmax, torch.get_num_threads())
            return
        for rows, adapter in self.groups:
            p = adapter.layers[layer].get(proj)
            if p is None:
                continue
            if rows.device != y.device:
                rows = rows.to(y.device)
            t = x.index_select(0, rows) @ p.a.to(x.dtype).T  # [n, R]
            if p.scale is not None:  # int8: each rank row's scale (A's times B's)
                t = t * p.scale.to(t.device, t.dtype)
            delta = torch.zeros(rows.numel(), y.shape[1], dtype=y.dtype, device=y.device)
            for part in p.parts:
                o0, o1, r0, r1, _ = part
                delta[:, o0:o1] = t[:, r0:r1] @ b_matrix(part).to(t.dtype).T
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
