"""Paged attention in plain torch: the CPU backend and the reference the GPU backend is tested against.

Owns ``TorchPagedBackend`` (the ``"torch"`` ``AttentionBackend``) and the decode and prefill
paths it chooses between (``DecodePaths``, ``PrefillPaths``; timed by ``torch_tuning``).

KV cache layout (one tensor per layer, FlashInfer's NHD): ``[num_blocks, 2, block_size,
num_kv_heads, head_dim]`` with K at index 0 and V at index 1 of dim 1. The math is FlashInfer's:
gather a sequence's pages in page-table order, keep the first ``L`` rows, query head ``h`` reads
KV head ``h // (num_heads // num_kv_heads)``, scale ``1/sqrt(head_dim)``, softmax in fp32.

A step's sequences are laid out decode-first: the first ``num_decode`` are single-token queries
(batched in one call), the rest are prefill chunks (one call each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.backend import (
    AttentionMetadata,
    AttentionShape,
    DecodeTables,
    gather_kv,
    write_kv,
)
from engine.attention.kv_format import as_values
from engine.ops import cpu_ops
from engine.ops.linear import M_BUCKETS


@dataclass(frozen=True)
class _PrefillPlan:
    """One prefill chunk: query rows ``[q_start, q_start + q_len)`` at positions from ``start_pos``."""

    q_start: int
    q_len: int
    start_pos: int
    block_ids: torch.Tensor  # [num_pages] int64, covering start_pos + q_len tokens
    # Causal with an offset (query i at position start_pos+i sees keys at positions <= that);
    # None when nothing is cached before the chunk, which attends to its fresh K/V with is_causal.
    mask: torch.Tensor | None  # [q_len, start_pos + q_len] bool

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.q_len


DECODE_PATHS = ("gather", "rows", "fused")  # "fused": engine.ops.cpu_ops, where it was built
CONTEXT_BUCKETS = (128, 512, 2048)  # decode paths are timed at these padded lengths


@dataclass
class DecodePaths:
    """Which batched-decode implementation to run, per batch bucket and padded context.

    ``"gather"``: one broadcast gather of ``kv_cache[page, kv, offset, head]`` straight into
    ``[2, B, KVH, L, D]``, then two batched matmuls. ``"rows"``: an ``index_select`` of whole
    ``KVH * D`` rows, then two strided ``bmm`` per KV head (no per-element index arithmetic,
    but a Python loop over heads). ``"fused"``: the C kernel of ``engine.ops.cpu_ops``, reading
    K/V in place through the page table (fp32 CPU, offered only where the library was built).
    Which wins depends on the host, the batch and the context (on one 2-core EPYC: rows 1.8x
    faster than gather at batch 32 with 100-token contexts, 1.7x slower at batch 1), so the
    engine times them at start-up (``tune_decode_paths``); untimed: gather.
    """

    choices: dict[tuple[int, int], str] = field(default_factory=dict)
    timings: list = field(default_factory=list)  # engine.tuning.cache.Timing (n=context, m=batch)
    from_cache: bool = False

    def path(self, batch: int, context: int) -> str:
        b = max((x for x in M_BUCKETS if x <= batch), default=1)
        c = next((x for x in CONTEXT_BUCKETS if x >= context), CONTEXT_BUCKETS[-1])
        return self.choices.get((b, c), "gather")

    def summary(self) -> list[str]:
        """One line per batch bucket: the path per context, and how much faster than the
        runner-up it timed (``pdcluster bench ceilings`` prints these)."""
        lines = []
        for b in sorted({t.m for t in self.timings}):
            parts = []
            for t in sorted((t for t in self.timings if t.m == b), key=lambda t: t.n):
                other = min(v for p, v in t.seconds.items() if p != t.best)
                parts.append(f"L<={t.n}: {t.best} ({other / t.seconds[t.best]:.2f}x)")
            lines.append(f"batch {b}: " + ", ".join(parts))
        return lines


PREFILL_PATHS = ("sdpa", "fused")  # "fused": engine.ops.cpu_ops.prefill_attention, where built
PREFILL_BUCKETS = (128, 512, 2048)  # prefill attention is timed at these KV lengths


@dataclass
class PrefillPaths:
    """Which causal prefill attention to run, per KV-length bucket (the chunk's tokens plus
    the ones cached before it). ``"sdpa"``: torch's ``scaled_dot_product_attention`` (its CPU
    flash kernel; 100-130 GFLOP/s on a 2-core AVX-512 EPYC). ``"fused"``:
    ``engine.ops.cpu_ops.prefill_attention``, 32 query rows in vector lanes, keys and values read
    as broadcast scalars, lane-wise online softmax (fp32 CPU, offered where the library was
    built). Timed per host at start-up (``tune_prefill_paths``); untimed: sdpa."""

    choices: dict[int, str] = field(default_factory=dict)
    timings: list = field(default_factory=list)  # engine.tuning.cache.Timing (n=KV length, m=1)
    from_cache: bool = False

    @classmethod
    def everywhere(cls, path: str) -> PrefillPaths:
        return cls(dict.fromkeys(PREFILL_BUCKETS, path))

    def path(self, kv_len: int) -> str:
        bucket = next((x for x in PREFILL_BUCKETS if x >= kv_len), PREFILL_BUCKETS[-1])
        return self.choices.get(bucket, "sdpa")

    def summary(self) -> list[str]:
        """One line: the path per KV length and how much faster than the other it timed."""
        parts = []
        for t in sorted(self.timings, key=lambda t: t.n):
            other = min(v for p, v in t.seconds.items() if p != t.best)
            parts.append(f"L<={t.n}: {t.best} ({other / t.seconds[t.best]:.2f}x, "
                         f"{t.seconds[t.best] * 1e3:.1f} ms)")
        return [", ".join(parts)] if parts else []


@dataclass(frozen=True)
class _DecodeGather:
    """What the step's decode rows read, for the path chosen: for ``"gather"``, index
    tensors that gather ``kv_cache[page, kv, offset, head]`` straight into the
    ``[2, B, KVH, L, D]`` layout the matmuls read (the head index, ``[1, 1, KVH, 1]``, comes
    from the cache's shape: ``TorchPagedBackend._heads``); for ``"rows"``, the flat row of
    each slot in ``kv_cache.view(-1, KVH * D)``; for ``"fused"``, the page table and lengths."""

    path: str
    pages: torch.Tensor | None  # [1, B, 1, L] int64: the page of each slot (page 0 as padding)
    kv: torch.Tensor | None  # [2, 1, 1, 1]: K, V
    offsets: torch.Tensor | None  # [1, 1, 1, L]: the slot within its page
    rows: torch.Tensor | None  # [2 * B * L] int64: (page * 2 + kv) * block_size + offset
    shape: tuple[int, int]  # (B, L)
    tables: torch.Tensor | None = None  # [B, max_pages] int64, padded with page 0
    kv_lens: torch.Tensor | None = None  # [B] int64


@dataclass(frozen=True)
class _MaskedPlan:
    """The step's plan for layers whose math the fast paths lack: a sliding window some
    sequence of the step has outgrown, or soft-capped scores. Decode rows take the
    ``"gather"`` read; every mask is keyed by the layer's window (None: causal only) and is
    True where a key is *hidden* for decode (``[B, 1, 1, L]``), *visible* for prefill
    (``[q_len, kv_len]``, as SDPA takes it)."""

    decode_gather: _DecodeGather | None
    decode_masks: dict[int | None, torch.Tensor]
    prefill_masks: list[dict[int | None, torch.Tensor]]  # one per prefill chunk
    windows: frozenset[int]  # the windows that bind this step (shorter than some KV length)


@dataclass(frozen=True)
class _StepPlan:
    """What every layer of one step reuses, on the backend's device."""

    write_page_ids: torch.Tensor  # [num_tokens] int64
    write_offsets: torch.Tensor  # [num_tokens] int64
    num_decode: int
    # One gather index per dimension of the cache, broadcasting to [2, num_decode, KVH, L]
    # (L = max_pages * block_size): K and V of every decode sequence, head-major, in one copy.
    decode_gather: _DecodeGather | None
    # True past each sequence's KV length (padding rows of the gathered pages).
    decode_pad_mask: torch.Tensor | None  # [num_decode, 1, 1, max_pages * block_size] bool
    prefills: list[_PrefillPlan]
    masked: _MaskedPlan | None = None  # None: every layer takes the fast paths this step


class TorchPagedBackend:
    """``AttentionBackend`` on torch ops (SDPA for prefill, two matmuls for batched decode).

    ``shape``'s per-layer windows and soft-cap are honoured: a layer whose window some
    sequence of the step has outgrown, or any layer of a soft-capped model, attends through
    explicit masks (``_MaskedPlan``); while every sequence fits in the windows, windowed
    layers take the same fast paths as global ones (the math is the same)."""

    name = "torch"
    whole_step_decode = True  # the whole-step kernel reads these caches: decode_tables

    def __init__(self, device: torch.device | str = "cpu", shape: AttentionShape | None = None
                 ) -> None:
        self.device = torch.device(device)
        self.windows: tuple[int | None, ...] = shape.windows if shape is not None else ()
        self.softcap: float | None = shape.softcap if shape is not None else None
        # An int8 pool's decode rows take the C kernel, which reads the rows as stored, where
        # it is built (the timed paths were timed on fp32 pools); else "gather", dequantizing
        # what it gathers.
        self.kv_quantized = shape is not None and shape.kv_cache_dtype != "auto"
        self._kv_quantized_path = ("fused" if self.kv_quantized and self.device.type == "cpu"
                                   and cpu_ops.decode_applies(shape.num_heads, shape.num_kv_heads,
                                                              shape.head_dim, shape.dtype)
                                   else "gather")
        self._plan: _StepPlan | None = None
        self._head_index: torch.Tensor | None = None
        self.decode_paths = DecodePaths()  # the engine sets the host's (tune_decode_paths)
        self.prefill_paths = PrefillPaths()  # likewise (tune_prefill_paths)

    def decode_tables(self, meta: AttentionMetadata) -> DecodeTables:
        return decode_tables(meta)

    def _heads(self, num_kv_heads: int) -> torch.Tensor:
        """``[1, 1, KVH, 1]`` head index of the decode gather (made once: same every layer)."""
        h = self._head_index
        if h is None or h.shape[2] != num_kv_heads:
            h = self._head_index = torch.arange(num_kv_heads, device=self.device)[None, None, :, None]
        return h

    def plan(self, meta: AttentionMetadata) -> None:
        """Build this step's padded decode page tables, padding mask, per-prefill pages and masks.

        Reads the page table as Python ints, so ``meta`` should be the host copy.
        """
        bs = meta.block_size
        dev = self.device
        qo_indptr = meta.qo_indptr.tolist()
        kv_indptr = meta.kv_indptr.tolist()
        last_page_len = meta.kv_last_page_len.tolist()
        nd = meta.num_decode
        gather = pad_mask = tables = None
        if nd:
            tables = decode_tables(meta)  # (page tables, KV lengths) of the decode rows
            gather, pad_mask = self._decode_gather(*tables, bs)
        prefills = []
        if meta.num_seqs > nd:
            kv_indices = meta.kv_indices.to(dev, torch.int64, non_blocking=True)  # [total_pages]
        for i in range(nd, meta.num_seqs):
            q_start, q_end = qo_indptr[i], qo_indptr[i + 1]
            q_len = q_end - q_start
            kv_len = (kv_indptr[i + 1] - kv_indptr[i] - 1) * bs + last_page_len[i]
            start_pos = kv_len - q_len
            mask = None
            if start_pos:
                q_pos = torch.arange(start_pos, kv_len, device=dev)
                mask = torch.arange(kv_len, device=dev)[None, :] <= q_pos[:, None]  # [q_len, kv_len]
            prefills.append(_PrefillPlan(q_start, q_len, start_pos,
                                         kv_indices[kv_indptr[i]:kv_indptr[i + 1]], mask))
        self._plan = _StepPlan(meta.write_page_ids.to(dev, non_blocking=True),
                               meta.write_offsets.to(dev, non_blocking=True),
                               nd, gather, pad_mask, prefills,
                               self._masked_plan(meta, tables, prefills))

    def _masked_plan(self, meta: AttentionMetadata,
                     decode: DecodeTables | None,
                     prefills: list[_PrefillPlan]) -> _MaskedPlan | None:
        """The masks of this step's windowed and soft-capped layers (``decode``: the decode
        rows' page tables and KV lengths); None when no layer needs them (no soft-cap, and
        every sequence within every window)."""
        if not self.windows and self.softcap is None:
            return None
        bs, nd, dev = meta.block_size, meta.num_decode, self.device
        tables, kv_lens = decode if decode is not None else (None, None)
        longest = max((s.end_pos for s in prefills), default=0)
        if nd:
            longest = max(longest, int(kv_lens.max()))
        binding = frozenset(w for w in self.windows if w is not None and longest > w)
        if not binding and self.softcap is None:
            return None
        keys: list[int | None] = [None, *sorted(binding)]
        decode_gather, decode_masks = None, {}
        if nd:
            length = tables.shape[1] * bs
            pos = torch.arange(length)[None, :]
            pad = pos >= kv_lens[:, None]  # [B, L]: past each sequence's end
            decode_gather = _DecodeGather(
                "gather", tables.repeat_interleave(bs, dim=1)[None, :, None, :].to(dev),
                torch.arange(2, device=dev)[:, None, None, None],
                (torch.arange(length) % bs)[None, None, None, :].to(dev), None, (nd, length))
            for w in keys:  # hidden: padding, and keys more than w - 1 behind the query
                hidden = pad if w is None else pad | (pos < kv_lens[:, None] - w)
                decode_masks[w] = hidden[:, None, None, :].to(dev)
        prefill_masks = []
        for s in prefills:
            q_pos = torch.arange(s.start_pos, s.end_pos, device=dev)[:, None]
            k_pos = torch.arange(s.end_pos, device=dev)[None, :]
            causal = k_pos <= q_pos  # [q_len, kv_len]
            prefill_masks.append({w: causal if w is None else causal & (k_pos > q_pos - w)
                                  for w in keys})
        return _MaskedPlan(decode_gather, decode_masks, prefill_masks, binding)

    def _decode_gather(self, tables: torch.Tensor, kv_lens: torch.Tensor, bs: int
                       ) -> tuple[_DecodeGather, torch.Tensor | None]:
        """The decode rows' read plan for the path this batch and context take, and the
        padding mask (``[B, 1, 1, L]``, None for the fused kernel, which stops at each length)."""
        dev = self.device
        nd, max_pages = tables.shape
        length = max_pages * bs
        path = self.decode_paths.path(nd, length)
        if self.kv_quantized:
            path = self._kv_quantized_path
        if path == "fused" and not cpu_ops.enabled():  # turned off since the tuning
            path = "gather"
        if path == "fused":  # reads the cache in place: no gather index, no mask
            return _DecodeGather("fused", None, None, None, None, (nd, length), tables, kv_lens), None
        pad_mask = torch.arange(length)[None, :] >= kv_lens[:, None]
        slot_pages = tables.repeat_interleave(bs, dim=1)  # [nd, L]
        offsets = torch.arange(length) % bs  # [L]
        if path == "rows":
            k_rows = slot_pages * (2 * bs) + offsets  # [nd, L]
            rows = torch.stack([k_rows, k_rows + bs]).reshape(-1)
            gather = _DecodeGather("rows", None, None, None, rows.to(dev, non_blocking=True),
                                   (nd, length))
        else:
            gather = _DecodeGather(
                "gather", slot_pages[None, :, None, :].to(dev, non_blocking=True),
                torch.arange(2, device=dev)[:, None, None, None],
                offsets[None, None, None, :].to(dev, non_blocking=True), None, (nd, length))
        return gather, pad_mask[:, None, None, :].to(dev, non_blocking=True)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Write new KV into the cache, then attend (``layer`` is unused: all layers share a plan).

        q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        Returns ``[num_tokens, num_heads * head_dim]``.
        """
        p = self._plan
        if p is None:
            raise RuntimeError("TorchPagedBackend.forward called before plan()")
        write_kv(kv_cache, p.write_page_ids, p.write_offsets, k, v)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        m = p.masked
        if m is not None:
            w = self.windows[layer] if self.windows else None
            w = w if w in m.windows else None  # a window no sequence outgrew: causal only
            if w is not None or self.softcap is not None:
                self._forward_masked(p, m, w, q, k, v, kv_cache, out)
                return out.view(num_tokens, num_heads * head_dim)
        if p.num_decode:
            nd = p.num_decode
            _decode(q[:nd], kv_cache, p.decode_gather, self._heads(kv_cache.shape[3]),
                    p.decode_pad_mask, out[:nd])
        for s in p.prefills:
            rows = slice(s.q_start, s.q_start + s.q_len)
            if s.mask is None:
                # Nothing cached before this chunk: attend to the fresh K/V directly.
                ks, vs = k[rows], v[rows]
            else:
                ks, vs = _cached_kv(kv_cache, s, q.dtype)
            if not (self.prefill_paths.path(s.end_pos) == "fused"
                    and cpu_ops.prefill_attention(q[rows], ks, vs, s.start_pos, out[rows])):
                out[rows] = sdpa_prefill(q[rows], ks, vs, s.mask)
        return out.view(num_tokens, num_heads * head_dim)

    def attend_decode_rows(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor
                           ) -> None:
        """Attend the planned step's decode rows ``q [B, H, D]`` into ``out`` by the planned
        decode path, writing no K/V (what ``engine.attention.torch_tuning`` times)."""
        p = self._plan
        if p is None or not p.num_decode:
            raise RuntimeError("attend_decode_rows needs a plan with decode rows")
        _decode(q, kv_cache, p.decode_gather, self._heads(kv_cache.shape[3]), p.decode_pad_mask,
                out)

    def _forward_masked(self, p: _StepPlan, m: _MaskedPlan, window: int | None, q: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        out: torch.Tensor) -> None:
        """One layer's attention through ``m``'s masks for ``window``, scores soft-capped."""
        nd = p.num_decode
        if nd:
            out[:nd] = _decode_gather(q[:nd], kv_cache, m.decode_gather,
                                      self._heads(kv_cache.shape[3]), m.decode_masks[window],
                                      self.softcap)
        for s, masks in zip(p.prefills, m.prefill_masks, strict=True):
            rows = slice(s.q_start, s.q_start + s.q_len)
            if s.mask is None:  # nothing cached before the chunk: its fresh K/V are all
                ks, vs = k[rows], v[rows]
            else:
                ks, vs = _cached_kv(kv_cache, s, q.dtype)
            out[rows] = _prefill_masked(q[rows], ks, vs, masks[window], self.softcap)


def _cached_kv(kv_cache: torch.Tensor, s: _PrefillPlan, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's K and V read from its pages (the cached prefix and the chunk's own,
    just written) as values of ``dtype``: ``[end_pos, KVH, D]`` each."""
    k, v = gather_kv(kv_cache, s.block_ids, s.end_pos)
    return as_values(k, dtype), as_values(v, dtype)


def decode_tables(meta: AttentionMetadata) -> DecodeTables:
    """The decode rows' page tables ``[num_decode, max_pages]`` (padded with page 0) and KV
    lengths ``[num_decode]`` (the new token included), int64 on the host; ``meta`` on the host."""
    bs, nd = meta.block_size, meta.num_decode
    kv_indptr = meta.kv_indptr[:nd + 1].tolist()
    last_page_len = meta.kv_last_page_len[:nd].tolist()
    # Python lists, one tensor each: cheaper than a chain of small tensor ops at batch 1.
    pages = meta.kv_indices[:kv_indptr[nd]].tolist()
    num_pages = [kv_indptr[i + 1] - kv_indptr[i] for i in range(nd)]
    max_pages = max(num_pages)
    rows = [pages[kv_indptr[i]:kv_indptr[i + 1]] + [0] * (max_pages - num_pages[i])
            for i in range(nd)]
    kv_lens = [(n - 1) * bs + last for n, last in zip(num_pages, last_page_len, strict=True)]
    return DecodeTables(torch.tensor(rows, dtype=torch.int64),
                        torch.tensor(kv_lens, dtype=torch.int64))


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                 ) -> torch.Tensor:
    """Causal (``mask`` None) or masked prefill attention by torch's SDPA: ``[q_len, H, D]``."""
    # [1, H, q_len, D] x [1, KVH, L, D]; enable_gqa maps head h to kv head h // group.
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None, enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1)  # [q_len, H, D]


def _prefill_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    softcap: float | None) -> torch.Tensor:
    """Prefill attention under an explicit ``visible [q_len, kv_len]`` mask: SDPA, or with a
    soft-cap (which SDPA cannot apply between the scores and the softmax) the scores
    written out: ``[q_len, H, D]``."""
    if softcap is None:
        return sdpa_prefill(q, k, v, visible)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k).float() * (1.0 / math.sqrt(q.shape[-1]))
    scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, gather: _DecodeGather, heads: torch.Tensor,
            pad_mask: torch.Tensor | None, out: torch.Tensor) -> None:
    """One query token per sequence, all sequences in one batched call, into ``out [B, H, D]``."""
    if gather.path == "fused":
        if not cpu_ops.paged_decode(q, kv_cache, gather.tables, gather.kv_lens, out):
            raise RuntimeError("the fused decode path was planned for a cache or query it does "
                               "not take (tune_decode_paths offers it only where it applies)")
    elif gather.path == "rows":
        out.copy_(_decode_rows(q, kv_cache, gather, pad_mask))
    else:
        out.copy_(_decode_gather(q, kv_cache, gather, heads, pad_mask))


def _decode_gather(q: torch.Tensor, kv_cache: torch.Tensor, gather: _DecodeGather,
                   heads: torch.Tensor, pad_mask: torch.Tensor, softcap: float | None = None
                   ) -> torch.Tensor:
    """The ``"gather"`` path (``pad_mask``: True where a key is hidden; scores
    soft-capped when ``softcap`` is set)."""
    b, num_heads, head_dim = q.shape
    kvh = heads.shape[2]
    group = num_heads // kvh
    # One gather writes K and V head-major ([2, B, KVH, L, D]); the matmuls then read K
    # transposed in place. (Gathering whole pages, then permuting, copied everything twice:
    # 1.4 -> 1.2 ms per layer at batch 32, measured in one process.)
    kv = as_values(kv_cache[gather.pages, gather.kv, gather.offsets, heads], q.dtype)
    k, v = kv[0], kv[1]
    qg = q.view(b, kvh, group, head_dim)  # [B, KVH, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(head_dim))  # [B, KVH, G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(pad_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, num_heads, head_dim)


def _decode_rows(q: torch.Tensor, kv_cache: torch.Tensor, gather: _DecodeGather,
                 pad_mask: torch.Tensor) -> torch.Tensor:
    """The ``"rows"`` path: whole ``KVH * D`` rows gathered, then per KV head two ``bmm`` over
    strided K/V views (BLAS reads them with a leading dimension, no copy)."""
    b, num_heads, head_dim = q.shape
    kvh = kv_cache.shape[3]
    group = num_heads // kvh
    batch, length = gather.shape
    row = kv_cache.shape[-1]  # head_dim, or an int8 row's head_dim + 4
    kv = kv_cache.view(-1, kvh * row).index_select(0, gather.rows)
    kv = as_values(kv.view(2, batch, length, kvh, row), q.dtype)
    qg = q.view(b, kvh, group, head_dim)
    out = torch.empty(b, kvh, group, head_dim, dtype=q.dtype, device=q.device)
    scale = 1.0 / math.sqrt(head_dim)
    mask = pad_mask[:, 0]  # [B, 1, L]
    for h in range(kvh):
        scores = torch.bmm(qg[:, h], kv[0, :, :, h].transpose(1, 2)).float() * scale  # [B, G, L]
        scores.masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(kv.dtype)
        out[:, h] = torch.bmm(probs, kv[1, :, :, h])
    return out.view(b, num_heads, head_dim)
