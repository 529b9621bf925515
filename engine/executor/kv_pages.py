"""The memory of the KV page pool: zeroed, and on the host committed page by page as it is
first written.

``torch.zeros`` writes every byte of a pool at start-up. On the host that is ~0.3 s of page
faults and memset per GiB in every engine (the CPU default is a 1 GiB pool), and the whole
pool is resident before the first request. An anonymous mapping is zero-filled by the kernel
one page at a time on first write instead: start-up costs nothing, and the resident set grows
with the blocks requests actually fill (a freed block's pages stay resident for its next
owner). A page read before it is written reads zeros, as a ``torch.zeros`` pool would.

The trade: the pool's size is promised, not taken, at start-up, so a host whose memory is
overcommitted finds out when the pool fills rather than at start (docs/deployment.md, "KV
cache memory"). Device pools are allocated as before: device memory is not overcommitted.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_kv_pages(shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A zeroed tensor of ``shape`` for KV pages: an anonymous mapping on the CPU (its pages
    committed on first write), ``torch.zeros`` on any other device. The tensor owns its
    mapping: it is unmapped when the last view of the tensor is freed."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # MAP_PRIVATE | MAP_ANONYMOUS (mmap.mmap(-1, n) alone would be a shared mapping: shared
    # memory to the kernel): zero-filled by the kernel on first touch, page aligned.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)
