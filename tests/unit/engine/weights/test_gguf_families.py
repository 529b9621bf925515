"""Every family from GGUF: a tiny checkpoint written as llama.cpp's converter writes it
(``tests/helpers/gguf_files.write_gguf_from_hf``: its names and metadata, Mixtral's permuted q/k,
stacked experts, Gemma's 1 + w norms, Phi-3's fused tensors and LongRoPE factor tensors)
converts back to the checkpoint's own model (greedy tokens equal transformers' on the
original; windows, soft-caps and routing read from the file's metadata), and its Q8_0
projections, experts included, serve as stored (``--quantization gguf``) with the tokens of
their fp32 conversion."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.quant.layouts import QuantizedWeight
from engine.weights.loader import load_quantized_state_dict
from engine.weights.resolve import resolve_model
from tests.helpers.gguf_files import write_gguf_from_hf
from tests.helpers.quantized import near_greedy_misses
from tests.helpers.tiny_models import (
    GEMMA_WINDOW,
    hf_greedy,
    load_hf,
    random_prompts,
    save_tiny_model,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# Small pools: the default 1 GiB an engine is memory these short prompts never use.
FAST = dict(kv_cache_memory_bytes=8 << 20)
# family -> (the transformers class's key in tests.helpers.tiny_models, the shortest prompt):
# Gemma's prompts outgrow the window; the LongRoPE Phi-3's outgrow its original context of 16,
# where transformers' own model uses the long factors from the first step as the engine does.
FAMILIES = {"qwen3": ("qwen3", 2), "gemma2": ("gemma2", GEMMA_WINDOW + 2),
            "gemma3": ("gemma3", GEMMA_WINDOW + 2), "mixtral": ("mixtral", 2),
            "qwen2_moe": ("qwen2_moe", 2), "qwen3_moe": ("qwen3_moe", 2), "phi3": ("phi3", 2),
            "phi3_longrope": ("phi3", 17)}


# What a GGUF can say: llama.cpp fixes Gemma's window pattern (every other layer for Gemma 2,
# five of six for Gemma 3) and its attention scale (1/sqrt(head_dim) below 27B), so these
# checkpoints keep to them; everything else is the shared fixtures'.
@pytest.fixture(scope="module")
def gguf_ready_dirs(request, tmp_path_factory):
    gemma = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=GEMMA_WINDOW,
                 tie_word_embeddings=True, pad_token_id=0)
    shared = {f: f"tiny_{f}_dir" for f in ("qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "phi3",
                                           "phi3_longrope")}

    def get(family: str):
        if family in shared:
            return request.getfixturevalue(shared[family])
        if family == "gemma2":
            return save_tiny_model("gemma2", tmp_path_factory.mktemp("g2"), **gemma)
        return save_tiny_model(
            "gemma3", tmp_path_factory.mktemp("g3"), **gemma, num_hidden_layers=6,
            hidden_size=32, intermediate_size=64,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10_000.0}})
    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_of_each_family_serves_the_checkpoints_tokens(family, gguf_ready_dirs, tmp_path):
    hf_dir = gguf_ready_dirs(family)
    arch, min_len = FAMILIES[family]
    gguf_path = write_gguf_from_hf(hf_dir, tmp_path / f"{family}.gguf")
    resolved = resolve_model(gguf_path, cache_dir=tmp_path / "cache")
    config = json.loads((resolved.model_dir / "config.json").read_text())
    original = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == original["architectures"]
    if arch.startswith("gemma"):
        assert config["sliding_window"] == GEMMA_WINDOW
        assert config["layer_types"] == original["layer_types"]
    if "moe" in arch:  # routing as the checkpoint's: renormalised top-k or not
        assert config["norm_topk_prob"] == original["norm_topk_prob"]
    prompts = random_prompts(seed=12, count=4, max_len=30, min_len=min_len)
    refs = hf_greedy(hf_dir, arch, prompts, GREEDY.max_tokens)  # the original checkpoint's
    with LLM(str(gguf_path), cache_dir=str(tmp_path / "cache"), **FAST) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == refs


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "mixtral", "qwen2_moe", "phi3"])
def test_q8_0_projections_of_a_family_gguf_serve_as_stored(family, gguf_ready_dirs, tmp_path):
    hf_dir = gguf_ready_dirs(family)
    arch, min_len = FAMILIES[family]
    gguf_path = write_gguf_from_hf(hf_dir, tmp_path / f"{family}.gguf", proj_type="Q8_0")
    resolved = resolve_model(gguf_path, cache_dir=tmp_path / "cache")
    quantized = load_quantized_state_dict(resolved.model_dir)
    assert {q.kind for q in quantized.values()} == {"int8"}
    prompts = random_prompts(seed=13, count=3, max_len=30, min_len=min_len)
    refs = hf_greedy(resolved.model_dir, arch, prompts, GREEDY.max_tokens)
    with LLM(str(gguf_path), cache_dir=str(tmp_path / "cache"), quantization="gguf",
             **FAST) as llm:
        model = llm.engine.runner.model
        assert model.quantization == "int8"
        layer = model.layers[0]
        assert isinstance(layer.qkv.weight, QuantizedWeight)
        if layer.moe is not None:  # every expert held as stored, not dequantized
            assert all(isinstance(w, QuantizedWeight) for w in layer.moe.gate_up)
            assert all(isinstance(w, QuantizedWeight) for w in layer.moe.down)
            if layer.moe.shared is not None:
                assert isinstance(layer.moe.shared["down"], QuantizedWeight)
        else:
            assert isinstance(layer.gate_up.weight, QuantizedWeight)
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    # The first token comes from a prompt step (fp32 activations: the stored weights' own
    # products); decode steps may round activations to int8 (the integer products, chosen per
    # host and batch), so from there the tokens are transformers' greedy up to near-ties.
    assert [o[0] for o in outs] == [r[0] for r in refs]
    assert not near_greedy_misses(load_hf(resolved.model_dir, arch), prompts, outs)


def _bare_gguf(path, arch: str, **fields):
    """A header-only GGUF of ``arch`` with ``fields`` (``add_<name>`` of gguf's writer)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, value in fields.items():
        getattr(w, f"add_{name}")(value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_expert_routing_the_engine_does_not_run_is_refused_by_name(tmp_path):
    """A MoE GGUF whose router is not a softmax (llama.cpp's gating function 2: sigmoid) is
    refused naming the field, not served with the wrong routing."""
    import gguf

    path = _bare_gguf(tmp_path / "moe.gguf", "qwen3moe", expert_count=8, expert_used_count=2,
                      expert_gating_func=gguf.ExpertGatingFuncType.SIGMOID)
    with pytest.raises(ValueError, match=r"qwen3moe.expert_gating_func=2"):
        resolve_model(path, cache_dir=tmp_path / "cache")


def test_an_unknown_gguf_architecture_is_refused_listing_the_supported(tmp_path):
    path = _bare_gguf(tmp_path / "x.gguf", "mamba")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'mamba'.*qwen3moe, "
                                         r"phi3, gemma2"):
        resolve_model(path, cache_dir=tmp_path / "cache")
