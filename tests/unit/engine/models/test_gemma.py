"""Gemma 2 / Gemma 3 and sliding windows through the whole engine: greedy tokens equal
transformers' ``generate`` for prompts that outgrow the window (batched, chunked, over a
cached prefix), a model windowed in every layer (Mistral) too, and the config fields each
family's ``config.json`` spells its own way are read as transformers reads them."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from tests.helpers.tiny_models import (
    GEMMA_WINDOW,
    hf_greedy,
    random_prompts,
    save_tiny_gemma3_image_text_model,
    save_tiny_model,
)

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("setup", [
    dict(),
    dict(max_num_seqs=3, max_num_batched_tokens=16, block_size=4),  # chunked, window-crossing
], ids=["default", "chunked"])
def test_gemma_greedy_matches_transformers(arch, setup, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    # 3..40 tokens: some inside the window of 8, most beyond it; 10 more generated.
    prompts = random_prompts(seed=5, count=8, max_len=40, min_len=3)
    assert any(len(p) > GEMMA_WINDOW for p in prompts) and any(len(p) < GEMMA_WINDOW for p in prompts)
    refs = hf_greedy(model_dir, arch, prompts, MAX_TOKENS)
    llm = LLM(str(model_dir), **setup)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_gemma_prefix_cache_hit_past_the_window_gives_the_same_tokens(tiny_gemma3_dir):
    llm = LLM(str(tiny_gemma3_dir), block_size=4)
    shared = random_prompts(seed=9, count=1, max_len=30, min_len=30)[0]
    first = llm.generate([shared + [7, 8]], GREEDY)[0]
    second = llm.generate([shared + [7, 8]], GREEDY)[0]
    assert second.metrics.num_cached_tokens >= 28
    assert first.token_ids == second.token_ids == hf_greedy(
        tiny_gemma3_dir, "gemma3", [shared + [7, 8]], MAX_TOKENS)[0]
    assert llm.engine.block_manager.num_used_blocks == 0


def test_image_text_gemma3_serves_its_language_model(tmp_path):
    """Gemma 3 4B-27B ship as ``Gemma3ForConditionalGeneration``: the config's
    ``text_config`` and the ``language_model.`` tensors are served, the vision tower is never
    read, and text prompts get transformers' tokens from the whole image+text model."""
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, sliding_window=GEMMA_WINDOW, bos_token_id=1,
                eos_token_id=2, pad_token_id=0,
                layer_types=["sliding_attention", "full_attention"])
    model_dir = save_tiny_gemma3_image_text_model(tmp_path / "g3", text)
    prompts = random_prompts(seed=8, count=3, max_len=30, min_len=12)
    llm = LLM(str(model_dir))
    assert llm.engine.model_config.architecture == "gemma3"
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, "gemma3_image_text", prompts,
                                                   MAX_TOKENS)


def test_every_layer_windowed_mistral_matches_transformers_past_the_window(tmp_path):
    """Mistral slides every layer: the context is no longer cut at the window (it was the
    served maximum before), and decode steps past the window leave the fused whole-step
    kernel (it has no window) for the windowed attention, with transformers' tokens."""
    model_dir = save_tiny_model("mistral", tmp_path / "m", sliding_window=GEMMA_WINDOW)
    prompts = random_prompts(seed=6, count=4, max_len=30, min_len=2)
    llm = LLM(str(model_dir))
    assert llm.engine.max_model_len == 512  # max_position_embeddings, not the window
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, "mistral", prompts, MAX_TOKENS)


# ---- config.json as the Hub ships it (older files name fewer fields) --------------------------
_GEMMA_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=8192, rms_norm_eps=1e-6)


def test_gemma2_hub_config_alternates_windows_from_the_first_layer():
    cfg = ModelConfig.from_hf_config({
        **_GEMMA_BASE, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "sliding_window": 4096, "query_pre_attn_scalar": 144, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"})
    assert cfg.layer_windows == (4096, None, 4096, None, 4096, None, 4096)
    assert (cfg.attn_scale, cfg.attn_softcap, cfg.final_softcap) == (144 ** -0.5, 50.0, 30.0)
    assert cfg.tie_word_embeddings and cfg.sandwich_norms and cfg.embed_scale
    assert cfg.max_model_len == 8192


def test_gemma3_hub_config_reads_its_pattern_and_both_rope_bases():
    cfg = ModelConfig.from_hf_config({
        **_GEMMA_BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 256})
    assert cfg.layer_windows == (512, 512, 512, 512, 512, None, 512)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor == 8.0
    assert cfg.qk_norm and cfg.attn_softcap is None and cfg.final_softcap is None


def test_qwen2_windows_only_the_layers_from_max_window_layers():
    cfg = ModelConfig.from_hf_config({
        **_GEMMA_BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
        "sliding_window": 64, "max_window_layers": 5})
    assert cfg.layer_windows == (None,) * 5 + (64, 64)


@pytest.mark.parametrize("fields, message", [
    ({"architectures": ["PaliGemmaForConditionalGeneration"], "model_type": "paligemma"},
     "supported: .*gemma2, gemma3"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
      "text_config": {"hidden_size": 64}}, "lacks the field 'num_attention_heads'"),
    ({"architectures": ["Gemma2ForCausalLM"], "use_bidirectional_attention": True},
     "bidirectional"),
    ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "relu"}, "hidden_activation"),
    ({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "factor": 4.0},
        "sliding_attention": {"rope_type": "default"}}}, "rope_scaling type 'yarn'"),
    ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 8,
      "layer_types": ["sliding_attention", "chunked_attention"] * 3 + ["full_attention"]},
     "layer_types"),
])
def test_gemma_configs_this_engine_cannot_serve_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**_GEMMA_BASE, **fields})
