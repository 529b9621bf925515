"""The int8 KV cache (``engine.attention.kv_format``): rows with their scales, written as
K/V arrive, read as stored by every attention path, against dense attention over the same
dequantized values (exact math: 1e-5) and over the unquantized values (the quantization's
own error: stated bounds)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.backend import AttentionShape, SeqSlice, build_metadata
from engine.attention.kv_format import (
    _quantize_rows_torch,
    dequantize_rows,
    for_pool,
    quantize_rows,
)
from engine.attention.torch_paged import (
    CONTEXT_BUCKETS,
    DECODE_PATHS,
    DecodePaths,
    TorchPagedBackend,
)
from engine.config import (
    KV_SCALE_BYTES,
    check_kv_cache_dtype,
    kv_hash_seed,
    kv_row_bytes,
)
from engine.ops import cpu_ops
from engine.ops.linear import M_BUCKETS

# Decode-first: two decodes (9 cached tokens; a 1-token prompt), a chunk over 6 cached
# tokens, a fresh prompt, and a 1-token chunk after the prefills (the masked prefill path).
STEP = [
    SeqSlice(block_ids=[7, 3, 9], start_pos=9, num_new_tokens=1),
    SeqSlice(block_ids=[5], start_pos=0, num_new_tokens=1),
    SeqSlice(block_ids=[2, 8, 4, 6], start_pos=6, num_new_tokens=5),
    SeqSlice(block_ids=[1, 0], start_pos=0, num_new_tokens=3),
    SeqSlice(block_ids=[10, 11, 12], start_pos=5, num_new_tokens=1),
]


def test_rows_hold_values_and_scale():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (2, 4 + KV_SCALE_BYTES)
    assert rows[0, :4].tolist() == [64, -127, 32, 0]  # round(x * 127 / 1.0), half to even
    assert rows[0, 4:].view(torch.float32).item() == pytest.approx(1.0 / 127)
    assert rows[1].tolist() == [0] * 8  # an all-zero row: zero values, scale 0
    back = dequantize_rows(rows, torch.float32)
    assert back.shape == x.shape
    # Within half a step of each row's scale, and exact at its largest magnitude.
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(64, 3, 128, generator=gen) * torch.rand(64, 3, 1, generator=gen) * 10
    yq = dequantize_rows(quantize_rows(y), torch.float32)
    step = y.abs().amax(-1, keepdim=True) / 127
    assert bool(((yq - y).abs() <= step / 2 + 1e-6).all())
    # The torch twin (other devices) rounds alike but for the last bit of a product: a value
    # one step off where x * 127 / max|x| sits on a half, the scale within an ulp.
    twin, mine = _quantize_rows_torch(y), quantize_rows(y)
    assert (twin[..., :128] != mine[..., :128]).float().mean() < 1e-3
    assert (twin[..., :128].int() - mine[..., :128].int()).abs().max() <= 1
    torch.testing.assert_close(twin[..., 128:].view(torch.float32),
                               mine[..., 128:].view(torch.float32), rtol=1e-6, atol=0)


def test_for_pool_converts_never_casts():
    pool8 = torch.zeros(1, 2, 4, 2, 8 + KV_SCALE_BYTES, dtype=torch.int8)
    pool32 = torch.zeros(1, 2, 4, 2, 8)
    x = torch.randn(2, 3, 2, 8)
    rows = for_pool(pool8, x)
    assert torch.equal(rows, quantize_rows(x))
    assert for_pool(pool8, rows) is rows  # already stored
    assert torch.equal(for_pool(pool32, rows), dequantize_rows(rows, torch.float32))


def test_sizes_and_refusals():
    assert kv_row_bytes(64, "float32", "auto") == 256
    assert kv_row_bytes(64, "float32", "int8") == 68  # 3.76x the tokens of fp32 per byte
    assert kv_row_bytes(64, "bfloat16", "int8") == 68
    assert kv_hash_seed(7, "auto") == 7
    assert kv_hash_seed(7, "int8") != 7
    assert kv_hash_seed(7, "int8") != kv_hash_seed(8, "int8")
    check_kv_cache_dtype("int8", "cpu", "torch")
    with pytest.raises(ValueError, match="fp8' is not served yet: use kv_cache_dtype='int8'"):
        check_kv_cache_dtype("fp8", "cpu", "torch")
    with pytest.raises(ValueError, match="FlashInfer reads no int8 pages.*attention_backend='torch'"):
        check_kv_cache_dtype("int8", "cuda", "flashinfer")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'"):
        check_kv_cache_dtype("int4", "cpu", "torch")


def _reference(q, k, v, values, seqs, block_size, from_cache, window=None, softcap=None):
    """Dense float64 attention per sequence: ``values`` is the pool read as numbers after the
    step's writes; a sequence reads its own new K/V from the pool where the backend does
    (``from_cache``: decode rows and chunks after a cached prefix), else the fresh ``k``/``v``."""
    num_heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i, s in enumerate(seqs):
        n = s.num_new_tokens
        if from_cache[i]:
            slots = [(s.block_ids[p // block_size], p % block_size) for p in range(s.end_pos)]
            ks = torch.stack([values[b, 0, o] for b, o in slots])
            vs = torch.stack([values[b, 1, o] for b, o in slots])
        else:
            ks, vs = k[row:row + n], v[row:row + n]
        for t in range(n):
            pos = s.start_pos + t
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(num_heads):
                kh = ks[lo:pos + 1, h // group].double()
                vh = vs[lo:pos + 1, h // group].double()
                scores = kh @ q[row + t, h].double() / math.sqrt(d)
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                out[row + t, h] = torch.softmax(scores, dim=0) @ vh
        row += n
    return out.reshape(q.shape[0], num_heads * d)


def _step(block_size, num_heads=6, kv_heads=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(16, 2, block_size, kv_heads, d, generator=gen)
    meta = build_metadata(STEP, block_size)
    t = meta.num_tokens
    q = torch.randn(t, num_heads, d, generator=gen)
    k = torch.randn(t, kv_heads, d, generator=gen)
    v = torch.randn(t, kv_heads, d, generator=gen)
    return values, meta, q, k, v


FROM_CACHE = [True, True, True, False, True]


@pytest.mark.parametrize("decode_path", DECODE_PATHS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_int8_pool_every_path_matches_dense_attention(block_size, decode_path):
    """Decode rows (each decode path), a chunk after a cached prefix, a fresh prompt and the
    masked 1-token chunk, GQA (3 query heads a KV head), across block boundaries."""
    values, meta, q, k, v = _step(block_size)
    pool = quantize_rows(values)
    backend = TorchPagedBackend(shape=AttentionShape(6, 2, 16, torch.float32,
                                                     kv_cache_dtype="int8"))
    backend.decode_paths = DecodePaths({(b, c): decode_path for b in M_BUCKETS
                                        for c in CONTEXT_BUCKETS})
    backend._kv_quantized_path = decode_path  # each path, not only the one an int8 pool takes
    backend.plan(meta)
    out = backend.forward(0, q, k, v, pool)

    # The step's K/V were written quantized, nothing else changed.
    want = pool.clone()
    want[meta.write_page_ids, 0, meta.write_offsets] = quantize_rows(k)
    want[meta.write_page_ids, 1, meta.write_offsets] = quantize_rows(v)
    assert torch.equal(pool, want)
    read = dequantize_rows(pool, torch.float32)
    exact = _reference(q, k, v, read, STEP, block_size, FROM_CACHE)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    # Against the unquantized values (the fp32 pool's answer): the quantization's error.
    full = values.clone()
    full[meta.write_page_ids, 0, meta.write_offsets] = k
    full[meta.write_page_ids, 1, meta.write_offsets] = v
    fp32 = _reference(q, k, v, full, STEP, block_size, FROM_CACHE)
    assert (out.double() - fp32).abs().max().item() < 0.03


@pytest.mark.parametrize("window,softcap", [(4, None), (None, 30.0), (3, 20.0)])
def test_int8_pool_windows_and_softcap(window, softcap):
    """Gemma's layers: a sliding window some sequence outgrew, soft-capped scores (the masked
    paths), over an int8 pool."""
    block_size = 4
    values, meta, q, k, v = _step(block_size, seed=3)
    pool = quantize_rows(values)
    shape = AttentionShape(6, 2, 16, torch.float32, (window,) if window else (), softcap, "int8")
    backend = TorchPagedBackend(shape=shape)
    backend.plan(meta)
    out = backend.forward(0, q, k, v, pool)
    read = dequantize_rows(pool, torch.float32)
    exact = _reference(q, k, v, read, STEP, block_size, FROM_CACHE, window, softcap)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_ops.enabled(), reason="the CPU kernels are not built on this host")
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("group", [1, 3])
def test_c_kernel_reads_int8_rows(head_dim, group):
    """``cpu_ops.paged_decode`` over int8 rows (the compile-time head sizes and the generic
    one) against the gather path's dequantized math, contexts past one tile of 128 tokens."""
    gen = torch.Generator().manual_seed(head_dim + group)
    kvh, bs, b = 2, 16, 5
    pages_per = 20
    values = torch.randn(b * pages_per + 1, 2, bs, kvh, head_dim, generator=gen)
    pool = quantize_rows(values)
    read = dequantize_rows(pool, torch.float32)
    perm = torch.randperm(b * pages_per, generator=gen) + 1
    tables = perm.view(b, pages_per).contiguous()
    kv_lens = torch.tensor([1, 17, 130, 200, 320])
    q = torch.randn(b, kvh * group, head_dim, generator=gen)
    out = torch.empty_like(q)
    assert cpu_ops.paged_decode(q, pool, tables, kv_lens, out)
    for i in range(b):
        n = int(kv_lens[i])
        slots = [(int(tables[i, p // bs]), p % bs) for p in range(n)]
        ks = torch.stack([read[pg, 0, o] for pg, o in slots]).double()
        vs = torch.stack([read[pg, 1, o] for pg, o in slots]).double()
        for h in range(kvh * group):
            sc = ks[:, h // group] @ q[i, h].double() / math.sqrt(head_dim)
            want = torch.softmax(sc, 0) @ vs[:, h // group]
            torch.testing.assert_close(out[i, h].double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not cpu_ops.enabled(), reason="the CPU kernels are not built on this host")
@pytest.mark.parametrize("wide_from", [cpu_ops.NEVER_WIDE, 1], ids=["dot", "wide"])
def test_fused_step_over_int8_pools(tiny_llama_dir, wide_from):
    """The whole-step decode kernel over int8 pools against the layer-by-layer path from the
    same pools: the same hidden states, the new tokens' rows quantized alike (their
    dequantized values within one step of each other: the two paths' K differ in the last
    bits), every other row untouched."""
    from engine.attention.torch_paged import decode_tables
    from engine.models.llama import LlamaForCausalLM
    from engine.weights.loader import load_state_dict
    from engine.weights.resolve import load_model_config

    model = LlamaForCausalLM(load_model_config(tiny_llama_dir))
    model.load_hf_state_dict(load_state_dict(tiny_llama_dir, torch.float32))
    cfg, bs = model.cfg, 4
    gen = torch.Generator().manual_seed(7)
    caches = [quantize_rows(torch.randn(64, 2, bs, cfg.num_kv_heads, cfg.head_dim,
                                        generator=gen)) for _ in range(cfg.num_layers)]
    fused = [c.clone() for c in caches]
    before = [c.clone() for c in caches]
    seqs = [SeqSlice([5, 9, 2], 9, 1), SeqSlice([40], 0, 1), SeqSlice([7, 33], 4, 1)]
    meta = build_metadata(seqs, bs)
    ids = torch.tensor([11, 12, 13])
    backend = TorchPagedBackend(shape=AttentionShape(cfg.num_heads, cfg.num_kv_heads,
                                                     cfg.head_dim, torch.float32,
                                                     kv_cache_dtype="int8"))
    with torch.inference_mode():
        backend.plan(meta)
        ref = model(ids, meta.positions, caches, backend)
        got = model.decode_fused(ids, meta.positions, fused, *decode_tables(meta), bs, wide_from)
    assert got is not None, "the kernel declined int8 pools"
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    written = torch.zeros(64, bs, dtype=torch.bool)
    for s in seqs:
        written[s.block_ids[s.start_pos // bs], s.start_pos % bs] = True
    for layer in range(cfg.num_layers):
        r = dequantize_rows(caches[layer], torch.float32).transpose(1, 2)[written]
        g = dequantize_rows(fused[layer], torch.float32).transpose(1, 2)[written]
        step = r.abs().amax(-1, keepdim=True) / 127
        assert bool(((g - r).abs() <= step * 1.01 + 1e-6).all())
        assert torch.equal(fused[layer].transpose(1, 2)[~written],
                           before[layer].transpose(1, 2)[~written])
        assert not torch.equal(fused[layer], before[layer]), "the step wrote no K/V"


def test_serve_passes_one_kv_dtype_to_every_worker_and_refuses_what_it_cannot_serve():
    from router.cli.serve_config import ServeConfig

    cluster = ServeConfig(kv_cache_dtype="int8").cluster_config()
    assert cluster.prefill_engine.kv_cache_dtype == cluster.decode_engine.kv_cache_dtype == "int8"
    assert ServeConfig().cluster_config().decode_engine.kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, int8, fp8"):
        ServeConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="fp8' is not served yet"):
        ServeConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="FlashInfer reads no int8 pages"):
        ServeConfig(kv_cache_dtype="int8", device="cuda", attention_backend="flashinfer")


def test_an_engine_refuses_fp8_before_loading_anything(tiny_llama_dir):
    from engine import LLM

    with pytest.raises(ValueError, match="fp8' is not served yet: use kv_cache_dtype='int8'"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="fp8")
