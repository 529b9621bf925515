"""The FlashInfer backend gives the torch backend's attention (bf16 tolerance) and the same
KV writes, eagerly on a mixed batch and replayed from a CUDA graph with fresh metadata."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import AttentionShape, SeqSlice, build_metadata
from engine.attention.factory import create_backend
from engine.executor.cuda_graphs import DecodePadding, decode_buckets
from tests.gpu.marks import needs_flashinfer

pytestmark = [pytest.mark.gpu, needs_flashinfer]

BLOCK = 16
ATOL = RTOL = 2e-2  # bf16 inputs; both backends accumulate in fp32
# Decode-first: decodes over 40 and 17 cached tokens and a 1-token prompt, a prefill chunk over
# 20 cached tokens, a fresh 20-token prompt, and a 1-token chunk after the prefills (it goes
# to the prefill wrapper, not the decode one).
MIXED = [SeqSlice([3, 7, 1], 40, 1), SeqSlice([5], 0, 1), SeqSlice([9, 2], 17, 1),
         SeqSlice([4, 8, 6, 10], 20, 37), SeqSlice([11, 12], 0, 20), SeqSlice([13, 14], 21, 1)]


def _inputs(meta, shape, num_pages, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*dims):
        return torch.randn(*dims, generator=gen, device="cuda").to(shape.dtype)

    t = meta.num_tokens
    cache = randn(num_pages, 2, BLOCK, shape.num_kv_heads, shape.head_dim)  # random "history"
    return (randn(t, shape.num_heads, shape.head_dim), randn(t, shape.num_kv_heads, shape.head_dim),
            randn(t, shape.num_kv_heads, shape.head_dim), cache)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 8, 128), (32, 8, 128)])
def test_flashinfer_matches_torch_backend_on_mixed_batch(heads, kv_heads, head_dim):
    shape = AttentionShape(heads, kv_heads, head_dim, torch.bfloat16)
    meta = build_metadata(MIXED, BLOCK)
    q, k, v, cache = _inputs(meta, shape, num_pages=16)
    results = {}
    for name in ("torch", "flashinfer"):
        backend = create_backend(name, "cuda", shape)
        kv = cache.clone()
        backend.plan(meta)
        results[name] = (backend.forward(0, q, k, v, kv), kv)
    (want, want_kv), (got, got_kv) = results["torch"], results["flashinfer"]
    assert got.shape == (meta.num_tokens, heads * head_dim)
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)
    assert torch.equal(got_kv, want_kv)


@pytest.mark.parametrize("softcap", [None, 50.0])
def test_flashinfer_honours_per_layer_windows_and_softcap(softcap):
    """Layer 0 slides over 16 keys (the mixed batch's sequences reach 57), layer 1 sees all:
    each equals the torch backend's masked attention for its layer; Gemma 2's soft-cap too."""
    shape = AttentionShape(8, 2, 128, torch.bfloat16, windows=(16, None), softcap=softcap)
    meta = build_metadata(MIXED, BLOCK)
    q, k, v, cache = _inputs(meta, shape, num_pages=16)
    for layer in (0, 1):
        results = {}
        for name in ("torch", "flashinfer"):
            backend = create_backend(name, "cuda", shape)
            backend.plan(meta)
            results[name] = backend.forward(layer, q, k, v, cache.clone())
        torch.testing.assert_close(results["flashinfer"].float(), results["torch"].float(),
                                   atol=ATOL, rtol=RTOL)


def test_flashinfer_refuses_float32():
    with pytest.raises(ValueError, match="float16/bfloat16 only"):
        create_backend("flashinfer", "cuda", AttentionShape(4, 2, 64, torch.float32))


def test_decode_graph_replays_with_each_steps_metadata():
    # One captured graph of a 4-sequence decode, replayed for two different batches (other
    # pages, lengths and batch sizes padded with the scratch page): each replay must give
    # what the torch backend gives for that batch, because plan_decode_graph rewrote the
    # fixed buffers the graph reads.
    shape = AttentionShape(9, 3, 64, torch.bfloat16)
    num_pages, scratch = 32, 32
    padding = DecodePadding(decode_buckets(4), scratch_page=scratch)
    fi = create_backend("flashinfer", "cuda", shape)
    ref = create_backend("torch", "cuda", shape)
    slot = fi.new_decode_graph_slot(4, 4 * 8)
    first = build_metadata(padding.pad([], 4), BLOCK)
    q, k, v, cache = _inputs(first, shape, num_pages + 1)
    fi.plan_decode_graph(slot, first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fi.forward(0, q, k, v, cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fi.forward(0, q, k, v, cache)

    batches = [[SeqSlice([1, 2, 3], 35, 1), SeqSlice([4], 2, 1), SeqSlice([5, 6], 16, 1)],
               [SeqSlice([7, 8, 9, 10, 11], 70, 1), SeqSlice([12], 0, 1)]]
    for seed, seqs in enumerate(batches, start=1):
        meta = build_metadata(padding.pad(seqs, 4), BLOCK)
        new_q, new_k, new_v, _ = _inputs(meta, shape, 1, seed=seed)
        want_kv = cache.clone()
        ref.plan(meta)
        want = ref.forward(0, new_q, new_k, new_v, want_kv)
        fi.plan_decode_graph(slot, meta)
        q.copy_(new_q)
        k.copy_(new_k)
        v.copy_(new_v)
        graph.replay()
        n = len(seqs)
        torch.testing.assert_close(out[:n].float(), want[:n].float(), atol=ATOL, rtol=RTOL)
        assert torch.equal(cache[:num_pages], want_kv[:num_pages])
