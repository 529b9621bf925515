"""The attention-backend seam: FlashInfer-format metadata, the torch backend's math against a
dense reference, one ``plan`` per engine step, and a clear error for an unknown backend."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.backend import (
    ATTENTION_BACKENDS,
    AttentionShape,
    SeqSlice,
    build_metadata,
    gather_kv,
)
from engine.attention.factory import create_backend
from engine.attention.torch_paged import (
    CONTEXT_BUCKETS,
    DECODE_PATHS,
    DecodePaths,
    TorchPagedBackend,
)
from engine.attention.torch_tuning import tune_decode_paths
from engine.config import cdiv
from engine.executor.fused_decode import FusedDecodePlan
from engine.ops.linear import M_BUCKETS
from engine.runtime.llm_engine import EngineArgs, LLMEngine

# One step, decode-first: two decodes (one with 9 cached tokens, one a 1-token prompt), a prefill
# chunk over 6 cached tokens whose block table has a spare trailing block, and a fresh prompt.
STEP = [
    SeqSlice(block_ids=[7, 3, 9], start_pos=9, num_new_tokens=1),
    SeqSlice(block_ids=[5], start_pos=0, num_new_tokens=1),
    SeqSlice(block_ids=[2, 8, 4, 6], start_pos=6, num_new_tokens=5),
    SeqSlice(block_ids=[1, 0], start_pos=0, num_new_tokens=3),
]

# Worked by hand: KV lengths are 10, 1, 11, 3.
EXPECTED = {
    4: dict(
        kv_indptr=[0, 3, 4, 7, 8],
        kv_indices=[7, 3, 9, 5, 2, 8, 4, 1],  # 6 is past token 11: not a page of the step
        kv_last_page_len=[2, 1, 3, 3],
        write_page_ids=[9, 5, 8, 8, 4, 4, 4, 1, 1, 1],
        write_offsets=[1, 0, 2, 3, 0, 1, 2, 0, 1, 2],
    ),
    16: dict(
        kv_indptr=[0, 1, 2, 3, 4],
        kv_indices=[7, 5, 2, 1],
        kv_last_page_len=[10, 1, 11, 3],
        write_page_ids=[7, 5, 2, 2, 2, 2, 2, 1, 1, 1],
        write_offsets=[9, 0, 6, 7, 8, 9, 10, 0, 1, 2],
    ),
}


@pytest.mark.parametrize("block_size", [4, 16])
def test_metadata_is_flashinfer_page_table(block_size):
    meta = build_metadata(STEP, block_size)
    want = EXPECTED[block_size]
    assert meta.qo_indptr.tolist() == [0, 1, 2, 7, 10]
    assert meta.kv_indptr.tolist() == want["kv_indptr"]
    assert meta.kv_indices.tolist() == want["kv_indices"]
    assert meta.kv_last_page_len.tolist() == want["kv_last_page_len"]
    assert meta.positions.tolist() == [9, 0, 6, 7, 8, 9, 10, 0, 1, 2]
    assert meta.write_page_ids.tolist() == want["write_page_ids"]
    assert meta.write_offsets.tolist() == want["write_offsets"]
    assert (meta.num_decode, meta.num_seqs, meta.num_tokens, meta.block_size) == (2, 4, 10, block_size)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
        assert getattr(meta, name).dtype == torch.int32, name
    assert meta.to("cpu") is meta


def test_num_decode_counts_only_leading_single_token_seqs():
    meta = build_metadata([SeqSlice([0], 0, 3), SeqSlice([1], 2, 1)], 4)
    assert meta.num_decode == 0
    assert build_metadata([], 4).num_tokens == 0


def test_short_block_table_is_refused():
    with pytest.raises(ValueError, match="sequence 1 has 1 blocks, needs 2"):
        build_metadata([SeqSlice([0], 0, 1), SeqSlice([1], 3, 2)], 4)


def _dense_reference(q, k, v, cache_before, seqs, block_size):
    """Per sequence: the cached prefix read token by token from its pages, plus the new K/V;
    causal with the chunk's offset; query head h reads KV head h // group; float64."""
    num_heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for s in seqs:
        cached = [(s.block_ids[p // block_size], p % block_size) for p in range(s.start_pos)]
        ks = torch.stack([cache_before[b, 0, o] for b, o in cached] + list(k[row:row + s.num_new_tokens]))
        vs = torch.stack([cache_before[b, 1, o] for b, o in cached] + list(v[row:row + s.num_new_tokens]))
        for i in range(s.num_new_tokens):
            visible = s.start_pos + i + 1
            for h in range(num_heads):
                kh = ks[:visible, h // group].double()  # [visible, D]
                vh = vs[:visible, h // group].double()
                scores = kh @ q[row + i, h].double() / math.sqrt(d)
                out[row + i, h] = torch.softmax(scores, dim=0) @ vh
        row += s.num_new_tokens
    return out.reshape(q.shape[0], num_heads * d)


@pytest.mark.parametrize("decode_path", DECODE_PATHS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_backend_matches_dense_attention(block_size, decode_path):
    # Mixed batch: the STEP above plus a trailing 1-token chunk after the prefills, which takes
    # the general (masked prefill) path rather than the batched decode one.
    seqs = [*STEP, SeqSlice(block_ids=[10, 11, 12], start_pos=5, num_new_tokens=1)]
    num_heads, kv_heads, d = 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(16, 2, block_size, kv_heads, d, generator=gen)  # random "history"
    cache_before = cache.clone()
    meta = build_metadata(seqs, block_size)
    t = meta.num_tokens
    q = torch.randn(t, num_heads, d, generator=gen)
    k = torch.randn(t, kv_heads, d, generator=gen)
    v = torch.randn(t, kv_heads, d, generator=gen)

    backend = create_backend("torch")
    nd = meta.num_decode
    length = max(cdiv(s.end_pos, block_size) for s in seqs[:nd]) * block_size
    backend.decode_paths = DecodePaths({(b, c): decode_path for b in M_BUCKETS
                                        for c in CONTEXT_BUCKETS})
    assert backend.decode_paths.path(nd, length) == decode_path
    backend.plan(meta)
    assert backend._plan.decode_gather.path == decode_path
    out = backend.forward(0, q, k, v, cache)

    assert out.shape == (t, num_heads * d)
    ref = _dense_reference(q, k, v, cache_before, seqs, block_size)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The new K/V landed in their slots and nothing else changed.
    written = cache_before.clone()
    written[meta.write_page_ids, 0, meta.write_offsets] = k
    written[meta.write_page_ids, 1, meta.write_offsets] = v
    assert torch.equal(cache, written)
    ks, vs = gather_kv(cache, torch.tensor([2, 8, 4, 6][: math.ceil(11 / block_size)]), 11)
    assert torch.equal(ks[6:], k[2:7]) and torch.equal(vs[6:], v[2:7])


def test_forward_before_plan_is_an_error():
    q = torch.zeros(1, 4, 8)
    kv = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="plan"):
        TorchPagedBackend().forward(0, q, kv, kv, torch.zeros(2, 2, 4, 2, 8))


def test_engine_plans_once_per_step(tiny_llama_dir):
    # adaptive_threads off: under CPU contention the thread governor re-applies the host's
    # plans (fused steps that skip the backend) over the layer path this test pins.
    llm = LLM(str(tiny_llama_dir), max_num_seqs=3, max_num_batched_tokens=16, block_size=4,
              adaptive_threads=False)
    runner = llm.engine.runner
    # Layer by layer at every step (pure-decode steps the host timed faster fused skip the
    # backend altogether: tests/unit/engine/executor/test_fused_decode.py).
    runner.fused_decode = FusedDecodePlan()
    backend = runner.attn_backend
    calls = {"plan": 0, "forward": 0, "model": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    backend.plan = counted("plan", backend.plan)
    backend.forward = counted("forward", backend.forward)
    runner.model.register_forward_pre_hook(lambda *_: calls.__setitem__("model", calls["model"] + 1))
    prompts = [[5, 6, 7, 8, 9] * 5, [11, 12, 13], [20] * 9, [30, 31]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))

    assert [len(o.token_ids) for o in outs] == [4, 4, 4, 4]
    assert calls["model"] > len(prompts)  # chunked and queued: many steps
    assert calls["plan"] == calls["model"]
    assert calls["forward"] == calls["model"] * runner.cfg.num_layers


def test_unknown_backend_is_refused():
    assert ATTENTION_BACKENDS == ("torch", "flashinfer")
    assert create_backend("torch").name == "torch"
    with pytest.raises(ValueError, match=r"unknown attention backend 'tourch'.*'flashinfer'\]"):
        create_backend("tourch")


def test_flashinfer_refuses_what_it_cannot_run_before_importing_it():
    bf16 = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs the model's AttentionShape"):
        create_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_backend("flashinfer", "cpu", bf16)
    if torch.cuda.is_available():
        fp32 = AttentionShape(4, 2, 8, torch.float32)
        with pytest.raises(ValueError, match="float16/bfloat16 only.*'torch'"):
            create_backend("flashinfer", "cuda", fp32)


def test_cpu_engine_never_imports_flashinfer(tiny_llama_dir, tmp_path):
    # A stand-in `flashinfer` package on the path, so an import would succeed (and show up in
    # sys.modules) even on machines without the real one. A fresh interpreter: other tests
    # may have imported anything.
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("")
    script = textwrap.dedent(f"""
        import sys
        import engine.attention.flashinfer_backend
        from engine import LLM, SamplingParams
        llm = LLM({str(tiny_llama_dir)!r}, attention_backend="auto")
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
        assert len(out[0].token_ids) == 2
        assert llm.engine.runner.attn_backend.name == "torch"
        print("imported" if "flashinfer" in sys.modules else "clean")
    """)
    repo = Path(__file__).resolve().parents[4]
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=repo, env={"PYTHONPATH": f"{tmp_path}:{repo}", "PATH": "/usr/bin"},
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "clean"


def test_unknown_backend_is_refused_by_the_engine(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'"):
        LLMEngine(EngineArgs(model=str(tiny_llama_dir), attention_backend="bogus"))


def test_decode_paths_are_timed_and_cached_per_host(tmp_path):
    paths = tune_decode_paths(4, 2, 8, 4, torch.float32, cache_dir=tmp_path)
    assert not paths.from_cache
    assert {(t.m, t.n) for t in paths.timings} == {(b, c) for b in M_BUCKETS for c in CONTEXT_BUCKETS}
    for t in paths.timings:
        assert set(t.seconds) == set(DECODE_PATHS)
        assert paths.path(t.m, t.n) == min(t.seconds, key=t.seconds.get)
    again = tune_decode_paths(4, 2, 8, 4, torch.float32, cache_dir=tmp_path)
    assert again.from_cache and again.choices == paths.choices
    assert DecodePaths().path(32, 100) == "gather"  # untimed
