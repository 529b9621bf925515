"""One pure-decode step of five sequences over random paged caches: what the tests of the
whole-step decode kernel against the layer path share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata, SeqSlice, build_metadata

BLOCK = 4


@dataclass
class FiveRows:
    """Caches (and a copy for the kernel under test), the five sequences, their metadata
    and new tokens, and where each new token's K/V lands (``slots``: pages, offsets)."""

    caches: list[torch.Tensor]
    fused_caches: list[torch.Tensor]
    seqs: list[SeqSlice]
    meta: AttentionMetadata
    ids: torch.Tensor
    slots: tuple[torch.Tensor, torch.Tensor]


def five_rows(cfg) -> FiveRows:
    """Seeded caches of 64 pages of ``BLOCK`` tokens for ``cfg``'s layers; five sequences of
    1-3 pages at positions 0-10."""
    gen = torch.Generator().manual_seed(5)
    caches = [torch.randn(64, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim, generator=gen)
              for _ in range(cfg.num_layers)]
    seqs = [SeqSlice([5, 9, 2], 9, 1), SeqSlice([40], 0, 1), SeqSlice([7, 33], 4, 1),
            SeqSlice([1, 2, 3], 10, 1), SeqSlice([11], 2, 1)]
    slots = (torch.tensor([s.block_ids[s.start_pos // BLOCK] for s in seqs]),
             torch.tensor([s.start_pos % BLOCK for s in seqs]))
    return FiveRows(caches, [c.clone() for c in caches], seqs, build_metadata(seqs, BLOCK),
                    torch.tensor([11, 12, 13, 14, 15]), slots)
