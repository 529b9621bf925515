"""A CPU model's weights moved into one private mapping advised for transparent huge pages.

A decode step on the CPU streams every weight once, and at small batches it is bound by how
fast those bytes arrive. Loaded tensor by tensor, the weights sit in separate allocations of
0.3-2 MB, each in 4 KB pages: the default model's 540 MB of fp32 is ~132,000 pages, so the
step walks far more pages than the TLB holds and every few KB of the stream waits on a
page-table walk. Hosts that enable transparent huge pages only on request (``madvise``, the
common server default) never give a weight a 2 MB page on their own. Gathered into one mapping
that starts on a 2 MB boundary and is advised ``MADV_HUGEPAGE``, the same bytes take ~270
pages. Measured on a 2-vCPU AMD EPYC (AVX2) in one process, the same model loaded twice and
their batch-1 decode steps alternating (median of 10-12 paired rounds, two runs): fp32
1.03-1.10x faster, int8 1.01-1.04x, int4 1.01-1.06x, the GGUF 1.08x
(docs/history/2026-12-06-wave-4.md, "AVX2 wide tiles that stay in registers, and weights on
huge pages").

The mapping is ``MAP_PRIVATE | MAP_ANONYMOUS`` on purpose: Python's ``mmap.mmap(-1, n)`` is a
*shared* anonymous mapping, which is shared memory to the kernel and takes huge pages only
where ``shmem_enabled`` allows (rarely).

Nothing here changes a value: each tensor is copied into the mapping and the model's
reference to it replaced by the copy (a parameter's ``.data``, a buffer, a quantized weight's
``data`` / ``scale`` / ``offset``). Callers run it after loading and quantization and before
anything records a weight's address (the fused step's address table is reset here all the
same). ``PDCLUSTER_HUGE_PAGE_WEIGHTS=0`` leaves the weights where they were (for A/B runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.quant.layouts import QuantizedWeight

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # the x86-64 (and arm64 4K-granule) PMD page
ALIGN = 64  # each tensor on a cache line: the kernels' vector loads assume no less
ENV = "PDCLUSTER_HUGE_PAGE_WEIGHTS"


@dataclass(frozen=True)
class WeightArena:
    """Where ``move_weights_to_huge_pages`` put the weights: ``nbytes`` of tensors in one
    mapping starting at ``address``; ``tensors`` how many were moved."""

    address: int
    nbytes: int
    tensors: int

    def huge_bytes(self) -> int:
        """Bytes of the mapping the kernel backs with huge pages now (``AnonHugePages`` of its
        ``/proc/self/smaps`` entry; 0 where it has none or the file cannot be read)."""
        return _smaps_field(self.address, "AnonHugePages") * 1024


def huge_page_eligible(address: int) -> bool:
    """Whether the kernel may back the mapping holding ``address`` with huge pages
    (``THPeligible`` in ``/proc/self/smaps``: a mapping advised ``MADV_HUGEPAGE`` on a host
    whose THP mode is ``madvise`` or ``always``; False where THP is off or the file cannot be
    read)."""
    return _smaps_field(address, "THPeligible") == 1


def enabled() -> bool:
    """Whether weights go to huge pages: on Linux with ``MADV_HUGEPAGE``, unless the
    environment sets ``PDCLUSTER_HUGE_PAGE_WEIGHTS=0``."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV, "1") != "0"


def move_weights_to_huge_pages(model: nn.Module) -> WeightArena | None:
    """Copy every contiguous CPU parameter, floating-point buffer and quantized weight's
    tensors of ``model`` into one mapping advised for huge pages and point the model at the copies
    (module docstring). A tensor held twice (a tied head) is copied once and both holders get
    the copy. Returns None, moving nothing, where ``enabled()`` is False or the model has a
    tensor off the CPU. The old tensors are freed as far as nothing else holds them."""
    if not enabled():
        return None
    holders: dict[tuple[int, int, tuple, torch.dtype], list[Callable]] = {}
    tensors: dict[tuple[int, int, tuple, torch.dtype], torch.Tensor] = {}

    def hold(t: torch.Tensor, put: Callable[[torch.Tensor], None]) -> None:
        if not t.is_contiguous():
            return  # left where it is: a copy would change the layout a kernel reads
        key = (t.data_ptr(), t.numel(), tuple(t.stride()), t.dtype)
        tensors.setdefault(key, t)
        holders.setdefault(key, []).append(put)

    def hold_quantized(w: QuantizedWeight) -> None:
        for f in ("data", "scale", "offset"):
            t = getattr(w, f)
            if t is not None:
                hold(t, lambda v, w=w, f=f: setattr(w, f, v))

    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None:
                hold(p.data, lambda v, p=p: setattr(p, "data", v))
        for name, b in mod._buffers.items():
            if b is not None and b.is_floating_point():
                hold(b, lambda v, mod=mod, name=name: mod._buffers.__setitem__(name, v))
        for value in vars(mod).values():  # quantized weights: a layer's, or an MoE's lists
            items = value.values() if isinstance(value, dict) else (
                value if isinstance(value, (list, tuple)) else (value,))
            for w in items:
                if isinstance(w, QuantizedWeight):
                    hold_quantized(w)
    if not tensors or any(not t.is_cpu for t in tensors.values()):
        return None
    sizes = {key: t.numel() * t.element_size() for key, t in tensors.items()}
    total = sum(-(-n // ALIGN) * ALIGN for n in sizes.values())
    # Whole huge pages from a 2 MB boundary on: the kernel backs only aligned 2 MB runs that
    # lie inside the mapping (a smaller one would not be eligible at all).
    size = -(-total // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        pages.madvise(mmap.MADV_HUGEPAGE)
    except OSError as e:  # a kernel without THP: the mapping still serves, in small pages
        log.info("weights: MADV_HUGEPAGE refused (%s); kept in small pages", e)
    arena = torch.frombuffer(pages, dtype=torch.uint8)  # holds the mapping while any view lives
    offset = (-arena.data_ptr()) % HUGE_PAGE
    start = arena.data_ptr() + offset
    moved = len(tensors)
    for key in list(tensors):  # in the model's order: a step streams them so
        old, n = tensors.pop(key), sizes[key]
        copy = arena[offset:offset + n].view(old.dtype).view(old.shape)
        copy.copy_(old)
        for put in holders.pop(key):
            put(copy)
        offset += -(-n // ALIGN) * ALIGN
        del old  # freed now where nothing else holds it: the peak stays ~ one model
    _return_freed_memory()
    if hasattr(model, "_pointers"):
        model._pointers = None  # the fused step's address table named the old tensors
        model._panel_table = None
    result = WeightArena(start, total, moved)
    log.info("weights: %.0f MB in one mapping advised for huge pages (%.0f MB on them now)",
             total / 1e6, result.huge_bytes() / 1e6)
    return result


def _return_freed_memory() -> None:
    """Hand the old tensors' freed heap back to the kernel (glibc's ``malloc_trim``): the
    allocator keeps freed chunks below its adaptive mmap threshold in its arenas, where they
    would stay in the resident set beside the copies (+218 MB for the default model in fp32,
    measured). Nothing to do without glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _smaps_field(address: int, field: str) -> int:
    """``field``'s number in the ``/proc/self/smaps`` entry of the mapping holding
    ``address`` (0 where there is none)."""
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return 0
    inside = False
    for line in text.splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    return 0
