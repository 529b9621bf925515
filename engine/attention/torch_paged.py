"""Paged attention in plain torch: the CPU backend and the reference the GPU backend is tested against.

KV cache layout (one tensor per layer, FlashInfer's NHD): ``[num_blocks, 2, block_size,
num_kv_heads, head_dim]`` with K at index 0 and V at index 1 of dim 1. The math is FlashInfer's:
gather a sequence's pages in block-table order, keep the first ``L`` rows, query head ``h`` reads
KV head ``h // (num_heads // num_kv_heads)``, scale ``1/sqrt(head_dim)``, softmax in fp32.

A step's tokens are laid out decode-first: the first ``num_decode`` tokens are single-token
queries (decode steps, batched in one call), the rest are prefill chunks (one call each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """One prefill chunk: query rows ``[q_start, q_start + q_len)`` at positions from ``start_pos``."""

    q_start: int
    q_len: int
    start_pos: int
    block_ids: torch.Tensor  # [num_blocks_covering_end] int64

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.q_len

    def to(self, device: torch.device) -> PrefillSeq:
        return PrefillSeq(self.q_start, self.q_len, self.start_pos, self.block_ids.to(device))


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once per step by the model runner."""

    slot_blocks: torch.Tensor  # [num_tokens] int64: block of each new token
    slot_offsets: torch.Tensor  # [num_tokens] int64: row inside that block
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] int64
    decode_key_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSeq] = field(default_factory=list)

    def to(self, device: torch.device) -> AttentionMetadata:
        """A copy on ``device`` (built on the host, moved once per step)."""
        if device.type == "cpu":
            return self

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return AttentionMetadata(mv(self.slot_blocks), mv(self.slot_offsets), self.num_decode,
                                 mv(self.decode_block_tables), mv(self.decode_key_mask),
                                 [p.to(device) for p in self.prefills])


def build_decode_tables(block_tables: list[list[int]], seq_lens: list[int], block_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad block tables to a rectangle and build the key-validity mask (keep the first L rows)."""
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int64)
    for i, (bt, n) in enumerate(zip(block_tables, seq_lens, strict=True)):
        nb = -(-n // block_size)
        table[i, :nb] = torch.tensor(bt[:nb], dtype=torch.int64)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    mask = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
    return table, mask[:, None, None, :]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Scatter this step's new K/V ``[num_tokens, kv_heads, head_dim]`` into their pages."""
    kv_cache[meta.slot_blocks, 0, meta.slot_offsets] = k
    kv_cache[meta.slot_blocks, 1, meta.slot_offsets] = v


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``num_tokens`` tokens of a block table, each ``[num_tokens, H, D]``."""
    pages = kv_cache[block_ids]  # [nb, 2, bs, H, D]
    nb, _, bs, h, d = pages.shape
    k = pages[:, 0].reshape(nb * bs, h, d)[:num_tokens]
    v = pages[:, 1].reshape(nb * bs, h, d)[:num_tokens]
    return k, v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """Write new KV into the cache, then attend.

    q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]``.
    Returns ``[num_tokens, num_heads * head_dim]``.
    """
    write_kv(kv_cache, k, v, meta)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if meta.num_decode:
        nd = meta.num_decode
        out[:nd] = _decode(q[:nd], kv_cache, meta.decode_block_tables, meta.decode_key_mask)
    for p in meta.prefills:
        qs = q[p.q_start:p.q_start + p.q_len]
        if p.start_pos == 0:
            # Nothing cached before this chunk: attend to the fresh K/V directly.
            ks = k[p.q_start:p.q_start + p.q_len]
            vs = v[p.q_start:p.q_start + p.q_len]
            out[p.q_start:p.q_start + p.q_len] = _prefill(qs, ks, vs, None)
        else:
            ks, vs = gather_kv(kv_cache, p.block_ids, p.end_pos)
            # Causal with an offset: query i (position start+i) sees keys at positions <= start+i.
            q_pos = torch.arange(p.start_pos, p.end_pos, device=q.device)
            mask = torch.arange(p.end_pos, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, end]
            out[p.q_start:p.q_start + p.q_len] = _prefill(qs, ks, vs, mask)
    return out.view(num_tokens, num_heads * head_dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # [1, H, q_len, D] x [1, KVH, L, D]; enable_gqa maps head h to kv head h // group.
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None, enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1)  # [q_len, H, D]


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
            key_mask: torch.Tensor) -> torch.Tensor:
    """One query token per sequence, all sequences in one batched call."""
    b, num_heads, head_dim = q.shape
    pages = kv_cache[block_tables]  # [B, MB, 2, bs, KVH, D]
    _, mb, _, bs, kvh, _ = pages.shape
    group = num_heads // kvh
    # One copy puts K and V head-major ([2, B, KVH, L, D]); the matmuls then read K transposed
    # in place. (Reshaping K and V separately, then permuting K, cost 2.4x as much at batch 32.)
    kv = pages.permute(2, 0, 4, 1, 3, 5).reshape(2, b, kvh, mb * bs, head_dim)
    k, v = kv[0], kv[1]
    qg = q.view(b, kvh, group, head_dim)  # [B, KVH, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(head_dim))  # [B, KVH, G, L]
    scores.masked_fill_(~key_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, num_heads, head_dim)
