"""The attention-backend seam: one per-step metadata format and the protocol every backend speaks.

Owns ``AttentionMetadata`` (FlashInfer's page-table format, built once per step by
``build_metadata``), the ``AttentionBackend`` protocol (``plan`` once per step, ``forward`` once
per layer), ``AttentionShape`` (what a backend must know of the model), the paged KV cache's
layout every backend shares (``write_kv``, ``gather_kv``) and the names of the implementations
(``ATTENTION_BACKENDS``); ``engine/attention/factory.py`` picks one by name. The model only sees
the protocol; the runner only builds metadata; each backend turns the metadata into whatever its
kernels want in ``plan``, so per-layer calls reuse it.

Layout: sequences are decode-first. The first ``num_decode`` sequences have exactly one query
token each (batched in one call); the rest are prefill chunks, possibly over a cached prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import NamedTuple, Protocol

import torch

# The pool's format is part of the layout every backend shares: the executor sizes, reads
# and writes pools through these names (engine.attention.kv_format has the details).
from engine.attention.kv_format import (  # noqa: F401  (re-exported for the executor)
    as_stored,
    for_pool,
    is_quantized,
    row_width,
    storage_dtype,
)
from engine.config import cdiv
from engine.ops import kv_int8

ATTENTION_BACKENDS = ("torch", "flashinfer")


@dataclass(frozen=True)
class AttentionShape:
    """The model's attention dimensions and KV dtype: what a kernel library plans with, and
    what changes the math per layer.

    The torch backend reads the dimensions off the tensors; FlashInfer's ``plan`` needs them up
    front. ``windows``: per layer, how many keys it attends to (its query's own included;
    None: all of them), empty when no layer has a window (``ModelConfig.layer_windows``).
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the softmax
    (Gemma 2). The softmax scale is always ``1/sqrt(head_dim)``: a model with another folds
    it into its queries. ``kv_cache_dtype``: the pool's format (``engine.attention.kv_format``;
    ``"auto"``: ``dtype``).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    windows: tuple[int | None, ...] = ()
    softcap: float | None = None
    kv_cache_dtype: str = "auto"

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step: new tokens at positions ``[start_pos, end_pos)``.

    ``block_ids`` is the sequence's block table; it must cover ``end_pos`` tokens (extra
    trailing blocks are ignored).
    """

    block_ids: Sequence[int]
    start_pos: int
    num_new_tokens: int

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_new_tokens


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, in FlashInfer's paged-KV format.

    Sequence ``i`` owns query rows ``qo_indptr[i]:qo_indptr[i+1]`` and pages
    ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``; its last page holds ``kv_last_page_len[i]``
    valid tokens (so its KV length is ``(num_pages - 1) * block_size + kv_last_page_len``).
    The KV length includes this step's new tokens, which backends write before attending.
    """

    qo_indptr: torch.Tensor  # [num_seqs + 1] int32
    kv_indptr: torch.Tensor  # [num_seqs + 1] int32
    kv_indices: torch.Tensor  # [total_pages] int32
    kv_last_page_len: torch.Tensor  # [num_seqs] int32
    positions: torch.Tensor  # [num_tokens] int64: position of each new token in its sequence
    # Where each new token's K/V goes: kv_cache[write_page_ids[t], :, write_offsets[t]].
    # int64 because torch indexes with them directly.
    write_page_ids: torch.Tensor  # [num_tokens] int64
    write_offsets: torch.Tensor  # [num_tokens] int64
    num_decode: int  # leading sequences with exactly one query token
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.kv_last_page_len.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """A copy on ``device`` (built on the host, moved once per step); CPU returns ``self``."""
        device = torch.device(device)
        if device.type == "cpu" and self.positions.device.type == "cpu":
            return self
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True)
                 for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


def build_metadata(seqs: Sequence[SeqSlice], block_size: int) -> AttentionMetadata:
    """The step's metadata from its sequences, in batch order (decode-first for speed).

    Runs on the host every step. The loop is per sequence and per page, never per token: at
    batch 1 a handful of list appends costs less than the fixed overhead of tensor ops.
    """
    qo_indptr, kv_indptr = [0], [0]
    kv_indices: list[int] = []
    last_page_len: list[int] = []
    positions: list[int] = []
    write_page_ids: list[int] = []
    for i, s in enumerate(seqs):
        start, end = s.start_pos, s.end_pos
        num_pages = cdiv(end, block_size)
        pages = s.block_ids[:num_pages]
        if len(pages) < num_pages:
            raise ValueError(f"sequence {i} has {len(s.block_ids)} blocks, "
                             f"needs {num_pages} for {end} tokens")
        qo_indptr.append(qo_indptr[-1] + s.num_new_tokens)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        kv_indices.extend(pages)
        last_page_len.append(end - (num_pages - 1) * block_size)
        positions.extend(range(start, end))
        # Each page the new tokens land in, repeated once per token it receives.
        for j in range(start // block_size, num_pages):
            first, last = max(start, j * block_size), min(end, (j + 1) * block_size)
            write_page_ids.extend([pages[j]] * (last - first))
    num_decode = next((i for i, s in enumerate(seqs) if s.num_new_tokens != 1), len(seqs))
    positions_t = torch.tensor(positions, dtype=torch.int64)  # [num_tokens]
    return AttentionMetadata(
        qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32),
        kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32),
        kv_indices=torch.tensor(kv_indices, dtype=torch.int32),
        kv_last_page_len=torch.tensor(last_page_len, dtype=torch.int32),
        positions=positions_t,
        write_page_ids=torch.tensor(write_page_ids, dtype=torch.int64),
        write_offsets=positions_t % block_size,
        num_decode=num_decode,
        block_size=block_size,
    )


def write_kv(kv_cache: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter a step's new K/V (``[num_tokens, kv_heads, head_dim]`` each) into the paged
    cache at ``kv_cache[page_ids[t], :, offsets[t]]``: every backend's first act per layer.
    An int8 pool gets them quantized as they are written (``engine.attention.kv_format``).
    No host sync, so a CUDA graph can capture it with the index tensors fixed."""
    if is_quantized(kv_cache) and kv_int8.kv_write_int8(kv_cache, page_ids, offsets, k, v):
        return  # quantized and written in one pass (the torch lines below, fused)
    kv_cache[page_ids, 0, offsets] = as_stored(kv_cache, k)
    kv_cache[page_ids, 1, offsets] = as_stored(kv_cache, v)


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``num_tokens`` tokens of a block table, each ``[num_tokens, H, D]``
    as the pool stores them (an int8 pool's rows: ``[num_tokens, H, D + 4]``;
    ``engine.attention.kv_format.as_values`` reads them as numbers) (``write_kv``'s reverse,
    over whole pages)."""
    pages = kv_cache[block_ids]  # [nb, 2, bs, H, D]
    nb, _, bs, h, d = pages.shape
    k = pages[:, 0].reshape(nb * bs, h, d)[:num_tokens]
    v = pages[:, 1].reshape(nb * bs, h, d)[:num_tokens]
    return k, v


class DecodeTables(NamedTuple):
    """A step's decode rows as the whole-step CPU decode kernel reads them (the model's
    ``decode_fused``), int64 on the host."""

    tables: torch.Tensor  # [num_decode, max_pages]: each row's pages, padded with page 0
    kv_lens: torch.Tensor  # [num_decode]: each row's KV length, the new token included


class AttentionBackend(Protocol):
    """Paged attention over per-layer KV caches ``[num_blocks, 2, block_size, kv_heads, head_dim]``.

    ``plan`` runs once per step with the host-built metadata and precomputes what every layer
    reuses (moving it to the backend's device); ``forward`` runs once per layer.

    ``whole_step_decode``: whether the model's whole-step CPU decode kernel may stand in for
    this backend on a pure-decode step (reading the same caches through ``decode_tables``);
    True for the torch backend, False for FlashInfer (the kernel is CPU-only).
    """

    name: str
    whole_step_decode: bool

    def plan(self, meta: AttentionMetadata) -> None: ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache``, then attend.

        q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        Returns ``[num_tokens, num_heads * head_dim]``.
        """
        ...

    def decode_tables(self, meta: AttentionMetadata) -> DecodeTables:
        """The decode rows of ``meta`` (on the host) for the whole-step decode kernel.
        NotImplementedError where ``whole_step_decode`` is False."""
        ...
