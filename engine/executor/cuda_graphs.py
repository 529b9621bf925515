"""CUDA graphs for decode steps: batch-size buckets, padding to them, capture and replay.

Owns ``decode_buckets``, ``DecodePadding`` (pure, CPU-tested) and ``CudaGraphRunner`` (CUDA
and the FlashInfer backend only).

A decode-only step of ``n`` sequences replays the graph of the smallest bucket ``>= n``
(buckets 1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``). The batch is padded with
dummy sequences: one token (id ``PAD_TOKEN_ID``) at position 0 whose only page is the
**scratch page**. The scratch page is page ``num_blocks`` of KV caches allocated with
``num_blocks + 1`` pages while the block manager only knows ``num_blocks``, so no request is
ever given it: a dummy's K/V write lands there, it attends only to itself, and its output row
is never sampled. Steps with any prefill chunk (or a layer hook), and decode steps larger than
the largest bucket, run eagerly. On CPU the same padded batch runs eagerly (tests).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.backend import AttentionMetadata, SeqSlice, build_metadata
from engine.models.llama import LlamaForCausalLM

PAD_TOKEN_ID = 0  # any valid id: a dummy row's output is never read


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 8, ending at the first bucket that holds ``max_num_seqs``
    (so every batch the scheduler can form has a bucket)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    buckets: list[int] = []
    for b in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        buckets.append(b)
        if b >= max_num_seqs:
            return tuple(buckets)
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass(frozen=True)
class DecodePadding:
    """Which decode steps are padded, to which bucket, and with which dummy sequence."""

    buckets: tuple[int, ...]  # ascending
    scratch_page: int  # == the block manager's num_blocks: a page no request ever gets

    def bucket_for(self, seqs: Sequence[SeqSlice]) -> int | None:
        """The smallest bucket ``>= len(seqs)`` for a decode-only step; None (run eagerly) for
        an empty step, any sequence with more than one new token, or more sequences than the
        largest bucket."""
        n = len(seqs)
        if not n or n > self.buckets[-1] or any(s.num_new_tokens != 1 for s in seqs):
            return None
        return next(b for b in self.buckets if b >= n)

    def pad(self, seqs: Sequence[SeqSlice], bucket: int) -> list[SeqSlice]:
        """``seqs`` followed by ``bucket - len(seqs)`` dummies in the scratch page."""
        dummy = SeqSlice(block_ids=(self.scratch_page,), start_pos=0, num_new_tokens=1)
        return [*seqs, *[dummy] * (bucket - len(seqs))]


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    slot: Any  # engine.attention.flashinfer_backend.DecodeGraphSlot
    input_ids: torch.Tensor  # [bucket] int64, read by the graph
    positions: torch.Tensor  # [bucket] int64, read by the graph
    hidden: torch.Tensor  # [bucket, hidden], written by the graph


class CudaGraphRunner:
    """The model's decode forward captured once per bucket, replayed per step.

    ``backend`` must offer ``new_decode_graph_slot`` and ``plan_decode_graph`` (the FlashInfer
    backend). Graphs read the weights, the KV caches and their own input buffers by address:
    none of them may be reallocated after ``capture``. ``run``'s result is overwritten by the
    next replay of any bucket.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], backend: Any,
                 padding: DecodePadding, block_size: int, max_pages_per_seq: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.padding = padding
        self.block_size = block_size
        self.max_pages_per_seq = max_pages_per_seq
        self.device = model.embed.weight.device
        self._graphs: dict[int, _Graph] = {}

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket (dummy batches: writes touch only the scratch page)."""
        pool = None
        # Largest first: the smaller graphs then fit in the memory pool it leaves.
        for b in sorted(self.padding.buckets, reverse=True):
            meta = build_metadata(self.padding.pad([], b), self.block_size)
            slot = self.backend.new_decode_graph_slot(b, b * self.max_pages_per_seq)
            ids = torch.full((b,), PAD_TOKEN_ID, dtype=torch.int64, device=self.device)
            pos = meta.positions.to(self.device)
            self.backend.plan_decode_graph(slot, meta)
            # Warm-up on a side stream, outside the capture: first calls load kernels, pick
            # cuBLAS algorithms and allocate workspaces, none of which may happen mid-capture.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model(ids, pos, self.kv_caches, self.backend)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, pos, self.kv_caches, self.backend)
            pool = graph.pool()
            self._graphs[b] = _Graph(graph, slot, ids, pos, hidden)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()  # the static buffers were made in inference mode
    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph of a padded decode step (``meta.num_seqs`` is a bucket; host
        ``meta``): ``[bucket, hidden]``, valid until the next replay."""
        g = self._graphs[meta.num_seqs]
        self.backend.plan_decode_graph(g.slot, meta)
        g.input_ids.copy_(input_ids, non_blocking=True)
        g.positions.copy_(meta.positions, non_blocking=True)
        g.graph.replay()
        return g.hidden
