"""FlashInfer paged attention on CUDA: the ``"flashinfer"`` ``AttentionBackend``.

Owns ``FlashInferBackend`` and ``DecodeGraphSlot`` (a fixed-size decode batch a CUDA graph
captures). ``flashinfer`` is imported in the constructor, never at module import: importing
it initialises CUDA, and CPU-only engines must not pay for (or need) the package.

Per step, ``plan`` splits the decode-first metadata in two: the first ``num_decode``
single-token sequences go to ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores when
query heads share KV heads), the rest to ``BatchPrefillWithPagedKVCacheWrapper`` (causal; its
mask is aligned bottom-right, so a chunk over a cached prefix sees that prefix). Both plan from
the host tables (FlashInfer copies each to the device once and needs the host ``indptr`` for
its scheduling anyway). Every layer's ``forward`` then writes the step's K/V and runs.

The KV cache is one ``[num_pages, 2, page_size, kv_heads, head_dim]`` tensor per layer: the
single-tensor NHD form both wrappers accept (K at index 0 of dim 1). FlashInfer has no float32
kernels, so this backend takes float16/bfloat16 only; float32 runs on the torch backend.
The softmax scale is FlashInfer's default, ``1/sqrt(head_dim)``, as in the torch backend.

Per-layer sliding windows (``AttentionShape.windows``) and soft-capped scores: FlashInfer takes
both per plan (``window_left`` = window - 1: the keys left of the query it still sees;
``logits_soft_cap``), so the backend keeps one decode and one prefill wrapper per distinct
window of the model (two for Gemma: its sliding layers and its global ones), plans each once
a step, and every layer runs the pair of its window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.backend import AttentionMetadata, AttentionShape, DecodeTables, write_kv

# FlashInfer's recommended size; one buffer serves every wrapper (see __init__).
WORKSPACE_BYTES = 128 << 20
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DecodeGraphSlot:
    """A decode batch of exactly ``batch_size`` sequences, replayable from a CUDA graph.

    Its wrapper runs in FlashInfer's CUDA-graph mode over fixed device buffers, and the K/V
    write indices live in fixed tensors too: a graph reads them by address, so each replay's
    ``plan_decode_graph`` overwrites them in place instead of allocating new ones.
    """

    batch_size: int
    # flashinfer.BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True), one per window_left
    wrappers: dict[int, Any]
    write_page_ids: torch.Tensor  # [batch_size] int64, on the device
    write_offsets: torch.Tensor  # [batch_size] int64, on the device


@dataclass(frozen=True)
class _StepPlan:
    write_page_ids: torch.Tensor  # [num_tokens] int64, on the device
    write_offsets: torch.Tensor  # [num_tokens] int64
    num_decode: int
    # The planned wrappers by window_left (-1: none); empty without decode rows / prefill chunks.
    decode: dict[int, Any]
    prefill: dict[int, Any]


class FlashInferBackend:
    """``AttentionBackend`` on FlashInfer's batch decode / batch prefill paged kernels.

    Raises ValueError for a non-CUDA device or a dtype FlashInfer has no kernels for, and
    ImportError when the package is missing (``pip install 'pdcluster[gpu]'``).
    """

    name = "flashinfer"
    whole_step_decode = False  # the whole-step decode kernel is CPU-only (engine.ops.cpu_ops)

    def __init__(self, device: torch.device | str, shape: AttentionShape,
                 workspace_bytes: int = WORKSPACE_BYTES) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, got {device}")
        if shape.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"attention backend 'flashinfer' has no {shape.dtype} kernels "
                             "(float16/bfloat16 only); use attention_backend='torch' for it")
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(f"{shape.num_heads} query heads do not share "
                             f"{shape.num_kv_heads} KV heads evenly")
        import flashinfer  # here, not at module top: it initialises CUDA

        self._fi = flashinfer
        self.device = device
        self.shape = shape
        # One float workspace for all wrappers (decode, prefill, every graph slot): their runs
        # are sequential on one stream, so none reads another's scratch. FlashInfer wants it
        # zeroed before first use.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        # Tensor-core decode (the prefill kernel on 1-row queries) wins once several query
        # heads read one KV head.
        self._tensor_cores = shape.num_heads > shape.num_kv_heads
        # window_left of every layer (-1: attends to all keys), and one wrapper pair per value.
        self._lefts = [-1 if w is None else w - 1
                       for w in (shape.windows or (None,))]
        self._decode = {left: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=self._tensor_cores)
            for left in set(self._lefts)}
        self._prefill = {left: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD") for left in set(self._lefts)}
        self._plan: _StepPlan | None = None

    def _plan_args(self, block_size: int, left: int
                   ) -> tuple[tuple[int, int, int, int], dict[str, Any]]:
        s = self.shape
        # Positional: num_qo_heads, num_kv_heads, head_dim (head_dim_qk in the prefill
        # wrapper), page_size. sm_scale is left at FlashInfer's 1/sqrt(head_dim).
        return ((s.num_heads, s.num_kv_heads, s.head_dim, block_size),
                dict(q_data_type=s.dtype, kv_data_type=s.dtype, window_left=left,
                     logits_soft_cap=s.softcap))

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan the decode rows and the prefill chunks for every layer of this step.

        ``meta`` must be the host copy: FlashInfer reads its indptr arrays on the host.
        """
        nd, ns = meta.num_decode, meta.num_seqs
        kv_indptr = meta.kv_indptr
        decode, prefill = {}, {}
        for left in self._decode:
            dims, kw = self._plan_args(meta.block_size, left)
            if nd:
                last_page = int(kv_indptr[nd])
                self._decode[left].plan(kv_indptr[:nd + 1], meta.kv_indices[:last_page],
                                        meta.kv_last_page_len[:nd], *dims, **kw)
                decode[left] = self._decode[left]
            if ns > nd:
                # The prefill wrapper sees only the chunks: rebase both indptrs to start at 0.
                first_page = int(kv_indptr[nd])
                self._prefill[left].plan(meta.qo_indptr[nd:] - meta.qo_indptr[nd],
                                         kv_indptr[nd:] - first_page, meta.kv_indices[first_page:],
                                         meta.kv_last_page_len[nd:], *dims, causal=True, **kw)
                prefill[left] = self._prefill[left]
        dev = self.device
        self._plan = _StepPlan(meta.write_page_ids.to(dev, non_blocking=True),
                               meta.write_offsets.to(dev, non_blocking=True), nd, decode, prefill)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Write new K/V into the cache, then attend with the wrappers of ``layer``'s window.

        q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        Returns ``[num_tokens, num_heads * head_dim]``.
        """
        p = self._plan
        if p is None:
            raise RuntimeError("FlashInferBackend.forward called before plan()")
        # The torch backend's scatter, not flashinfer.page.append_paged_kv_cache: the write
        # indices are already in the metadata (append would need per-token batch indices and
        # positions computed on top), it is the same code the CPU tests prove, and with the
        # indices in fixed tensors it is capturable in a CUDA graph as is.
        write_kv(kv_cache, p.write_page_ids, p.write_offsets, k, v)
        num_tokens, num_heads, head_dim = q.shape
        left = self._lefts[layer] if len(self._lefts) > 1 else self._lefts[0]
        if not p.prefill:  # decode-only: every CUDA-graph step
            return p.decode[left].run(q, kv_cache).view(num_tokens, num_heads * head_dim)
        out = torch.empty_like(q)
        nd = p.num_decode
        if p.decode:
            p.decode[left].run(q[:nd], kv_cache, out=out[:nd])
        p.prefill[left].run(q[nd:], kv_cache, out=out[nd:])
        return out.view(num_tokens, num_heads * head_dim)

    def decode_tables(self, meta: AttentionMetadata) -> DecodeTables:
        raise NotImplementedError("the whole-step decode kernel runs on the CPU backend only")

    # ---- CUDA graphs (engine/executor/cuda_graphs.py) -------------------------------------------
    def new_decode_graph_slot(self, batch_size: int, max_pages: int) -> DecodeGraphSlot:
        """A decode wrapper in CUDA-graph mode for ``batch_size`` sequences holding at most
        ``max_pages`` pages in all (size it for every sequence at the longest context)."""
        dev = self.device
        wrappers = {left: self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_cuda_graph=True,
            use_tensor_cores=self._tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=dev))
            for left in self._decode}
        return DecodeGraphSlot(batch_size, wrappers,
                               torch.zeros(batch_size, dtype=torch.int64, device=dev),
                               torch.zeros(batch_size, dtype=torch.int64, device=dev))

    def plan_decode_graph(self, slot: DecodeGraphSlot, meta: AttentionMetadata) -> None:
        """Plan a decode-only step of exactly ``slot.batch_size`` sequences into the slot's
        fixed buffers, and make it this backend's plan. Call outside graph capture/replay,
        before each capture and replay (FlashInfer's plan cannot run inside a graph)."""
        if meta.num_decode != slot.batch_size or meta.num_seqs != slot.batch_size:
            raise ValueError(f"graph slot holds {slot.batch_size} decode sequences, the step has "
                             f"{meta.num_decode} decode of {meta.num_seqs}")
        for left, wrapper in slot.wrappers.items():
            dims, kw = self._plan_args(meta.block_size, left)
            wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, *dims, **kw)
        slot.write_page_ids.copy_(meta.write_page_ids, non_blocking=True)
        slot.write_offsets.copy_(meta.write_offsets, non_blocking=True)
        self._plan = _StepPlan(slot.write_page_ids, slot.write_offsets, slot.batch_size,
                               slot.wrappers, {})
