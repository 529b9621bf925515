"""Qwen3, Gemma 2 and Gemma 3 from GGUF: a tiny checkpoint written as llama.cpp's converter
writes it (``tests/gguf_files.write_gguf_from_hf``: its names, metadata, Gemma's 1 + w norms)
converts back to the checkpoint's own model (greedy tokens equal transformers' on the
original, windows and soft-caps read from the file's metadata), and its Q8_0 projections
serve as stored (``--quantization gguf``) with the tokens of their fp32 conversion."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.weights import load_quantized_state_dict, resolve_model
from tests.gguf_files import write_gguf_from_hf
from tests.tiny_models import GEMMA_WINDOW, hf_greedy, random_prompts, save_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
FAST = dict(tune_kernels=False, kv_cache_memory_bytes=8 << 20)


# What a GGUF can say: llama.cpp fixes Gemma's window pattern (every other layer for Gemma 2,
# five of six for Gemma 3) and its attention scale (1/sqrt(head_dim) below 27B), so these
# checkpoints keep to them; everything else is the shared fixtures'.
@pytest.fixture(scope="module")
def gguf_ready_dirs(tiny_qwen3_dir, tmp_path_factory):
    gemma = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=GEMMA_WINDOW,
                 tie_word_embeddings=True, pad_token_id=0)
    return {
        "qwen3": tiny_qwen3_dir,
        "gemma2": save_tiny_model("gemma2", tmp_path_factory.mktemp("g2"), **gemma),
        "gemma3": save_tiny_model(
            "gemma3", tmp_path_factory.mktemp("g3"), **gemma, num_hidden_layers=6,
            hidden_size=32, intermediate_size=64,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10_000.0}}),
    }


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3"])
def test_gguf_of_each_family_serves_the_checkpoints_tokens(arch, gguf_ready_dirs, tmp_path):
    hf_dir = gguf_ready_dirs[arch]
    gguf_path = write_gguf_from_hf(hf_dir, tmp_path / f"{arch}.gguf")
    resolved = resolve_model(gguf_path, cache_dir=tmp_path / "cache")
    config = json.loads((resolved.model_dir / "config.json").read_text())
    if arch != "qwen3":
        assert config["sliding_window"] == GEMMA_WINDOW
        assert config["layer_types"] == json.loads(
            (hf_dir / "config.json").read_text())["layer_types"]
    prompts = random_prompts(seed=12, count=4, max_len=30, min_len=GEMMA_WINDOW + 2)
    refs = hf_greedy(hf_dir, arch, prompts, GREEDY.max_tokens)  # the original checkpoint's
    with LLM(str(gguf_path), cache_dir=str(tmp_path / "cache"), **FAST) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == refs


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_q8_0_projections_of_a_family_gguf_serve_as_stored(arch, gguf_ready_dirs, tmp_path):
    hf_dir = gguf_ready_dirs[arch]
    gguf_path = write_gguf_from_hf(hf_dir, tmp_path / f"{arch}.gguf", proj_type="Q8_0")
    resolved = resolve_model(gguf_path, cache_dir=tmp_path / "cache")
    quantized = load_quantized_state_dict(resolved.model_dir)
    assert quantized["model.layers.0.self_attn.q_proj.weight"].kind == "int8"
    prompts = random_prompts(seed=13, count=3, max_len=30, min_len=GEMMA_WINDOW + 2)
    refs = hf_greedy(resolved.model_dir, arch, prompts, GREEDY.max_tokens)
    with LLM(str(gguf_path), cache_dir=str(tmp_path / "cache"), quantization="gguf",
             **FAST) as llm:
        assert llm.engine.runner.model.quantization == "int8"
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == refs


def test_a_mixture_of_experts_gguf_is_refused_by_name(tmp_path):
    """Mixtral's GGUFs say ``llama`` with an expert count (stacked expert tensors this
    conversion does not split): refused naming the field, not a missing-tensor error."""
    import gguf
    import numpy as np

    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"Mixture-of-Experts GGUF \(llama.expert_count=8\)"):
        resolve_model(path, cache_dir=tmp_path / "cache")
