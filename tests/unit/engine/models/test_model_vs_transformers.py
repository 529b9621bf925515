"""Our forward pass over the paged KV cache equals transformers' own forward pass."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_paged import (
    CONTEXT_BUCKETS,
    DECODE_PATHS,
    PREFILL_PATHS,
    DecodePaths,
    PrefillPaths,
)
from engine.config import CacheConfig, cdiv
from engine.executor.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.ops.linear import M_BUCKETS
from engine.weights.loader import load_state_dict
from engine.weights.resolve import load_model_config
from tests.helpers.tiny_models import VOCAB, load_hf


def _ours(model_dir, block_size=8, num_blocks=64):
    cfg = load_model_config(model_dir)
    model = LlamaForCausalLM(cfg)
    model.load_hf_state_dict(load_state_dict(model_dir, torch.float32))
    return ModelRunner(model, CacheConfig(block_size=block_size), num_blocks)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral",
                                  "qwen2_moe", "qwen3_moe", "gemma2", "gemma3"])
@pytest.mark.parametrize("prefill_path", PREFILL_PATHS)
def test_prompt_logits_match_transformers(arch, prefill_path, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    runner = _ours(model_dir)
    runner.attn_backend.prefill_paths = PrefillPaths.everywhere(prefill_path)
    hf = load_hf(model_dir, arch)
    gen = torch.Generator().manual_seed(1)
    for length in (1, 7, 8, 37, 100):
        ids = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        # Non-contiguous, shuffled block ids: the page table, not memory order, defines the sequence.
        blocks = torch.randperm(64, generator=gen)[: cdiv(length, 8)].tolist()
        ours = runner.compute_logits_for_prompt(ids, blocks)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"{arch} len={length}: relative error {rel:.2e}"


def test_qwen2_has_qkv_bias_and_it_is_used(tiny_qwen2_dir):
    runner = _ours(tiny_qwen2_dir)
    assert runner.model.layers[0].qkv.bias is not None
    ids = list(range(3, 20))
    before = runner.compute_logits_for_prompt(ids, [0, 1, 2])
    runner.model.layers[0].qkv.bias.zero_()
    after = runner.compute_logits_for_prompt(ids, [0, 1, 2])
    assert not torch.allclose(before, after)


def test_qwen3_norms_every_query_and_key_head(tiny_qwen3_dir):
    """Qwen3's per-head q/k RMSNorm weights are loaded and used (changing one changes the
    logits), and its wider heads (head_dim 32 x 4 > hidden 64) load. The fused decode step
    applies them too (``test_fused_decode``)."""
    runner = _ours(tiny_qwen3_dir)
    layer = runner.model.layers[0]
    assert layer.q_norm is not None and layer.q_norm.shape == (32,)
    assert layer.qkv.weight.shape == ((4 + 2 * 2) * 32, 64)
    ids = list(range(3, 20))
    before = runner.compute_logits_for_prompt(ids, [0, 1, 2])
    layer.k_norm.fill_(0.5)
    assert not torch.allclose(before, runner.compute_logits_for_prompt(ids, [0, 1, 2]))


def test_moe_routing_ties_break_as_transformers_does(tmp_path):
    """Every expert with the same router row: all four tie on every token, so which two the
    top-k keeps is decided by tie-breaking alone. Ours keeps the ones transformers keeps (the
    logits agree), and the pick matters (the experts' weights differ)."""
    from safetensors.torch import load_file, save_file

    from tests.helpers.tiny_models import save_tiny_model

    model_dir = save_tiny_model("mixtral", tmp_path / "ties", num_local_experts=4,
                                num_experts_per_tok=2)
    path = model_dir / "model.safetensors"
    sd = load_file(path)
    for i in range(2):
        router = sd[f"model.layers.{i}.block_sparse_moe.gate.weight"]
        router[:] = router[1].clone()  # equal logits for every expert, every token
    save_file(sd, path, metadata={"format": "pt"})
    runner = _ours(model_dir)
    hf = load_hf(model_dir, "mixtral")
    ids = list(range(3, 40))
    ours = runner.compute_logits_for_prompt(ids, [0, 1, 2, 3, 4])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-4
    for layer in runner.model.layers:  # the other pick would differ
        assert not torch.equal(layer.moe.gate_up[1], layer.moe.gate_up[2])


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
@pytest.mark.parametrize("decode_path", DECODE_PATHS)
@pytest.mark.parametrize("prefill_path", PREFILL_PATHS)
def test_decode_with_cached_prefix_matches_full_forward(arch, decode_path, prefill_path, request):
    """Chunked prefill (prefix in pages) + single-token decode == one full forward, by every
    decode path and prefill path (the fused C kernels included: they are built on every host
    that runs the tests). Gemma's 23 tokens outgrow its sliding layer's window of 8: the
    chunk and the decode step attend through the windowed masks (soft-capped for Gemma 2)."""
    from engine.attention.backend import AttentionShape, SeqSlice, build_metadata
    from engine.attention.factory import create_backend

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    runner = _ours(model_dir, block_size=4, num_blocks=32)
    hf = load_hf(model_dir, arch)
    ids = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    blocks = [9, 2, 17, 5, 30, 11]
    model = runner.model
    cfg = model.cfg
    backend = create_backend("torch", "cpu", AttentionShape(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, torch.float32, cfg.layer_windows,
        cfg.attn_softcap))
    backend.decode_paths = DecodePaths({(b, c): decode_path for b in M_BUCKETS
                                        for c in CONTEXT_BUCKETS})
    backend.prefill_paths = PrefillPaths.everywhere(prefill_path)

    def run(tok_slice, start):
        meta = build_metadata([SeqSlice(blocks, start, len(tok_slice))], block_size=4)
        assert meta.num_decode == (len(tok_slice) == 1)  # the decode step takes the batched path
        backend.plan(meta)
        if meta.num_decode:
            assert backend._plan.decode_gather.path == decode_path
        with torch.inference_mode():
            hidden = model(torch.tensor(tok_slice), meta.positions, runner.kv_caches, backend)
            return model.compute_logits(hidden)

    run(ids[:10], 0)
    mid = run(ids[10:22], 10)  # prefill chunk over a cached prefix of 10 tokens
    last = run(ids[22:], 22)  # decode step
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (mid - ref[10:22]).abs().max() / ref.abs().max() < 1e-4
    assert (last[0] - ref[22]).abs().max() / ref.abs().max() < 1e-4
