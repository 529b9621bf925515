"""The fused CPU kernels (engine/ops/csrc/cpu_ops.c) against their torch twins and a float64
reference, the build (cached per host, a broken compiler leaves the twins in charge), and the
process state the library must not touch."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from engine.ops import cpu_ops


@pytest.fixture(autouse=True)
def kernels_on():
    # Every host that runs the tests has a C compiler: the kernels must build here.
    assert cpu_ops.enabled(), "the fused CPU kernels did not build on this host (see the log)"
    yield
    cpu_ops.set_enabled(True)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_build_is_cached_per_host_and_a_broken_compiler_falls_back(tmp_path, monkeypatch, caplog):
    lib = cpu_ops.build(tmp_path)
    assert lib is not None and lib.exists()
    mtime = lib.stat().st_mtime_ns
    assert cpu_ops.build(tmp_path) == lib and lib.stat().st_mtime_ns == mtime  # not rebuilt
    assert not list(tmp_path.glob("*.tmp*"))  # no half-built leftovers

    monkeypatch.setenv("CC", "/bin/false")  # a "compiler" that fails: another key, no library
    assert cpu_ops.build(tmp_path / "broken") is None
    assert "building fused CPU kernels with" in caplog.text and "failed" in caplog.text
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert cpu_ops.build(tmp_path / "missing") is None


def test_loading_the_library_keeps_subnormal_floats():
    # Linking with -ffast-math would add crtfastmath.o, which turns on flush-to-zero for the
    # whole process at load time; the library is linked without it.
    code = textwrap.dedent("""
        import numpy as np
        from engine.ops import cpu_ops
        assert cpu_ops.enabled()
        tiny = np.float32(1e-38) * np.float32(1e-3)
        print(tiny > 0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert np.float32(1e-38) * np.float32(1e-3) > 0  # and in this process too


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_rms_norm_matches_its_twin(rows):
    g = _gen(rows)
    x = torch.randn(rows, 576, generator=g) * 3
    w = torch.randn(576, generator=g)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.rms_norm_torch(x, w, 1e-5),
                               atol=1e-5, rtol=1e-5)
    delta = torch.randn(rows, 576, generator=g)
    want_h = x + delta
    want = cpu_ops.rms_norm_torch(want_h, w, 1e-5)
    h, normed = cpu_ops.add_rms_norm(x, delta, w, 1e-5)
    torch.testing.assert_close(h, want_h, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(normed, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_silu_mul_matches_its_twin(rows):
    gu = torch.randn(rows, 2 * 1536, generator=_gen(rows)) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating and zero gates
    torch.testing.assert_close(cpu_ops.silu_mul(gu), cpu_ops.silu_mul_torch(gu), atol=1e-5, rtol=1e-5)


def test_rope_rotates_q_and_k_in_place_and_leaves_v():
    t, h, kvh, d = 7, 9, 3, 64
    g = _gen(1)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    angles = torch.rand(t, d // 2, generator=g) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q = qkv[:, :h * d].reshape(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].reshape(t, kvh, d)
    v_before = qkv[:, (h + kvh) * d:].clone()
    want_q = cpu_ops.rope_torch(q, cos[:, None], sin[:, None])
    want_k = cpu_ops.rope_torch(k, cos[:, None], sin[:, None])
    assert cpu_ops.rope_(qkv, h + kvh, d, cos, sin)
    torch.testing.assert_close(qkv[:, :h * d].view(t, h, d), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, h * d:(h + kvh) * d].view(t, kvh, d), want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (h + kvh) * d:], v_before)


def _dense_decode(q, cache, tables, lens):
    """float64 reference: sequence b's first lens[b] tokens read page by page."""
    b, h, d = q.shape
    bs, kvh = cache.shape[2], cache.shape[3]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        slots = [(int(tables[i, t // bs]), t % bs) for t in range(n)]
        ks = torch.stack([cache[p, 0, o] for p, o in slots]).double()  # [n, KVH, D]
        vs = torch.stack([cache[p, 1, o] for p, o in slots]).double()
        for j in range(h):
            kv = j // (h // kvh)
            p = torch.softmax(ks[:, kv] @ q[i, j].double() / math.sqrt(d), 0)
            out[i, j] = p @ vs[:, kv]
    return out


@pytest.mark.parametrize("lens,block_size,d", [([1], 16, 64), ([5, 17, 300], 16, 64),
                                                ([129, 128, 256, 3], 4, 64), ([7, 140], 16, 128),
                                                ([33, 2], 8, 32)])
def test_paged_decode_matches_dense_attention(lens, block_size, d):
    # Lengths straddle the kernel's 128-token tiles (running max across tiles) and page
    # boundaries, pages are shuffled and padded with page 0, query rows are strided views of a
    # fused QKV; head sizes 64 and 128 take the kernel's specialized copies, 32 the generic one.
    h, kvh = 9, 3
    g = _gen(len(lens))
    max_pages = max(math.ceil(n / block_size) for n in lens)
    num_pages = len(lens) * max_pages + 1
    cache = torch.randn(num_pages, 2, block_size, kvh, d, generator=g) * 2
    perm = torch.randperm(num_pages - 1, generator=g) + 1
    tables = torch.zeros(len(lens), max_pages, dtype=torch.int64)
    for i, n in enumerate(lens):
        used = math.ceil(n / block_size)
        tables[i, :used] = perm[i * max_pages:i * max_pages + used]
    kv_lens = torch.tensor(lens, dtype=torch.int64)
    qkv = torch.randn(len(lens), (h + 2 * kvh) * d, generator=g)
    q = qkv[:, :h * d].view(len(lens), h, d)
    out = torch.full((len(lens), h, d), float("nan"))
    assert cpu_ops.paged_decode(q, cache, tables, kv_lens, out)
    torch.testing.assert_close(out.double(), _dense_decode(q, cache, tables, kv_lens),
                               atol=1e-5, rtol=1e-5)


def test_kernels_decline_what_they_do_not_take():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), cpu_ops.rms_norm_torch(x, w, 1e-6))
    assert not cpu_ops.rope_(x, 1, 64, torch.ones(4, 64), torch.zeros(4, 64))
    cache = torch.zeros(2, 2, 4, 1, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    one = torch.ones(1, 1, dtype=torch.int64)
    assert not cpu_ops.paged_decode(q, cache, one, one[0], torch.empty_like(q))
    assert not cpu_ops.decode_applies(9, 3, 64, torch.bfloat16)
    assert not cpu_ops.decode_applies(64, 2, 64, torch.float32)  # group of 32: too wide
    assert cpu_ops.decode_applies(9, 3, 64, torch.float32)


def test_turned_off_the_twins_run(tiny_llama_dir):
    from engine import LLM, SamplingParams

    prompts = [[5, 9, 2, 7, 1, 3] * k for k in (1, 3, 7)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), max_num_seqs=4)
    fused = [o.token_ids for o in llm.generate(prompts, sp)]
    cpu_ops.set_enabled(False)
    assert not cpu_ops.enabled()
    x = torch.randn(3, 16)
    assert torch.equal(cpu_ops.silu_mul(x), cpu_ops.silu_mul_torch(x))
    twins = [o.token_ids for o in llm.generate(prompts, sp)]  # decode plan falls back to gather
    assert twins == fused


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_f_linear(m, bias):
    g = _gen(m)
    x, w = torch.randn(m, 576, generator=g), torch.randn(960, 576, generator=g)
    b = torch.randn(960, generator=g) if bias else None
    torch.testing.assert_close(cpu_ops.gemv(x, w, b), torch.nn.functional.linear(x, w, b),
                               atol=1e-4, rtol=1e-5)
    assert cpu_ops.gemv(x.bfloat16(), w.bfloat16(), None) is None  # declined: fp32 only
    assert cpu_ops.gemv(x.t().contiguous().t(), w, b) is None or m == 1  # strided rows declined


@pytest.mark.parametrize("q_len,start,heads,kv_heads,d", [
    (1, 0, 9, 3, 64),      # one row: 31 padding lanes
    (33, 0, 9, 3, 64),     # a full block of 32 rows, then one
    (70, 13, 9, 3, 64),    # a chunk after 13 cached tokens: the diagonal moves
    (100, 200, 8, 8, 128), # MHA, head size 128, keys beyond one block of 64 before the chunk
    (31, 1, 2, 1, 40),     # head size not a multiple of the 12-dim tile (3 x 12 + 4 x 1)
    (200, 0, 4, 2, 16),    # keys in many blocks, tiles of 12 keys then single keys
])
def test_prefill_attention_matches_float64_causal_attention(q_len, start, heads, kv_heads, d):
    """Query rows read from a strided view (as they sit in the fused QKV output), query row i at
    position start + i attending keys 0..start + i, grouped heads: equal to a float64
    reference of the same masked softmax."""
    g = _gen(q_len + start)
    qkv = torch.randn(q_len, (heads + 2 * kv_heads) * d, generator=g)
    q = qkv[:, :heads * d].view(q_len, heads, d)
    k = torch.randn(start + q_len, kv_heads, d, generator=g)
    v = torch.randn(start + q_len, kv_heads, d, generator=g)
    out = torch.full((q_len, heads, d), float("nan"))
    assert cpu_ops.prefill_attention(q, k, v, start, out)
    group = heads // kv_heads
    kk = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
    vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) / math.sqrt(d)  # [H, Lq, L]
    visible = torch.arange(start + q_len)[None, :] <= torch.arange(start, start + q_len)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    want = (torch.softmax(scores, -1) @ vv).transpose(0, 1)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_prefill_attention_declines_what_it_does_not_take():
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    out = torch.empty(4, 2, 8)
    assert not cpu_ops.prefill_attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), 0,
                                         out.bfloat16())
    assert not cpu_ops.prefill_attention(q, k, k, 1, out)  # K/V length != start + rows
    assert not cpu_ops.prefill_attention(q[:, :, ::2], k[:, :, ::2], k[:, :, ::2], 0,
                                         out[:, :, ::2])  # head dims not contiguous
    k2 = torch.randn(4, 2, 8)  # 3 query heads over 2 KV heads: no whole group
    assert not cpu_ops.prefill_attention(torch.randn(4, 3, 8), k2, k2, 0, torch.empty(4, 3, 8))
